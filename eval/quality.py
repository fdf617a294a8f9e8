"""Quantization quality table: held-out perplexity at each loop depth for 16/8/4/3/2 bits, RTN vs GPTQ.

    python -m tinyloop_hf.eval.quality --model embedded --depths 1 2 4 8 --out quality-embedded
    python -m tinyloop_hf.eval.quality --model smollm2 --depths 1 --out quality-smollm2

Calibration text and held-out text default to the samples that ship with the embedded model (training split and
held-out split of its public-domain corpus). Writes a Markdown table and a JSON file next to each other.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tinyloop_hf import TinyLoopForCausalLM, TinyLoopQuantConfig, embedded_model_path
from tinyloop_hf.convert.quantize import quantize_model
from tinyloop_hf.convert.report import calibration_windows, perplexity, text_windows

from .flags import at_least

# Group size used for each width (INT8 per output channel; smaller groups as bits drop).
GROUPS = {8: None, 4: 128, 3: 64, 2: 32}


def load(name: str) -> tuple[TinyLoopForCausalLM, object, str]:
    if name == "smollm2":
        from .smollm2 import load_smollm2

        model, tokenizer = load_smollm2()
        return model.float().eval(), tokenizer, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized), L = 1"
    directory = embedded_model_path() if name == "embedded" else Path(name)
    model = TinyLoopForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory), "embedded TinyLoop model" if name == "embedded" else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="'embedded', 'smollm2' or a TinyLoop checkpoint dir")
    parser.add_argument("--calib", type=Path, default=embedded_model_path() / "calibration_sample.txt")
    parser.add_argument("--eval-text", type=Path, default=embedded_model_path() / "heldout_sample.txt")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4, 3, 2], choices=sorted(GROUPS),
                        help="quantized widths (16 bits, the unquantized row, is always reported)")
    parser.add_argument("--methods", nargs="+", default=["rtn", "gptq"], choices=["rtn", "gptq"])
    parser.add_argument("--depths", type=at_least(1), nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--window", type=at_least(2), default=512)
    parser.add_argument("--calib-samples", type=at_least(1), default=64)
    parser.add_argument("--calib-length", type=at_least(2), default=256)
    parser.add_argument("--out", type=Path, required=True, help="output stem: writes OUT.md and OUT.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch.cuda.is_available() is False on this machine")
    for path in (args.calib, args.eval_text):
        if not path.is_file():
            parser.error(f"{path} is not a file")

    model, tokenizer, title = load(args.model)
    too_deep = [depth for depth in args.depths if depth > model.config.max_loops]
    if too_deep:
        parser.error(f"--depths {too_deep}: this model runs at most max_loops={model.config.max_loops} loops")
    model.to(args.device)
    windows = text_windows(tokenizer, args.eval_text.read_text(), args.window)
    calibration = calibration_windows(tokenizer, args.calib.read_text(), args.calib_samples, args.calib_length)
    rows = [{"bits": 16, "method": "-", "group": None, "ppl": {d: perplexity(model, windows, d) for d in args.depths}}]
    print(rows[-1], flush=True)
    for bits in args.bits:
        for method in args.methods:
            start = time.time()
            config = TinyLoopQuantConfig(bits=bits, group_size=GROUPS[bits], method=method)
            quantized = quantize_model(copy.deepcopy(model), config, calibration, progress=False)
            rows.append(
                {
                    "bits": bits,
                    "method": method,
                    "group": GROUPS[bits],
                    "seconds": round(time.time() - start),
                    "ppl": {d: perplexity(quantized, windows, d) for d in args.depths},
                }
            )
            print(rows[-1], flush=True)
    tokens = windows.numel()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(
        json.dumps({"model": title, "heldout_tokens": tokens, "rows": rows}, indent=1)
    )
    Path(f"{args.out}.md").write_text(markdown(title, tokens, args.depths, rows))
    print(markdown(title, tokens, args.depths, rows))


def markdown(title: str, tokens: int, depths: list[int], rows: list[dict]) -> str:
    base = rows[0]["ppl"]
    header = "| bits | group | method | " + " | ".join(f"ppl @ {d} loops" for d in depths) + " |"
    lines = [
        f"**{title}** — held-out perplexity ({tokens:,} tokens; change vs 16-bit in brackets)",
        "",
        header,
        "|" + "---|" * (3 + len(depths)),
    ]
    for row in rows:
        group = "-" if row["bits"] == 16 else ("channel" if row["group"] is None else str(row["group"]))
        cells = [
            f"{row['ppl'][d]:.2f}" + ("" if row["bits"] == 16 else f" ({100 * (row['ppl'][d] / base[d] - 1):+.1f}%)")
            for d in depths
        ]
        lines.append(f"| {row['bits']} | {group} | {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
