"""Where the attention block kernel's time goes (kernels/attention_block.cu; Ouro-1.4B shape, INT4, L = 4, batch 1).

%globaltimer stamps at the kernel's phase boundaries over one eager decode step's launches (one clock for all SMs,
so the spans are comparable across CTAs): median and maximum over CTAs and launches, in microseconds, and the span
from the first CTA's start to the last CTA's end of a launch.

    python -m tinyloop_hf.eval.attention_block_profile [--context 192]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tinyloop_hf.kernels import attention_block

from .bench import base_model, build_ours
from .gpu import require_gpu

PHASES = ["QKV projection", "cluster barrier 1", "gather + attention", "barrier 2 + merge + barrier 3", "o_proj slice",
          "count + last CTA's sum"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=192)
    args = parser.parse_args()
    require_gpu("python -m tinyloop_hf.eval.attention_block_profile")
    attention_block.ATTENTION_BLOCK = True
    base = base_model(4, 4096)
    model = build_ours(base, 4).use_cuda_path(cuda_graphs=False)
    del base
    ids = torch.randint(1, 49152, (1, args.context), device="cuda")
    config = model.config
    launches = config.num_loops * config.num_loop_layers
    ctas = config.num_key_value_heads * attention_block.CLUSTER
    with torch.no_grad():
        cache = model.new_cache(args.context + 64)
        model(ids, past_key_values=cache, use_cache=True)
        model(ids[:, -1:], past_key_values=cache, use_cache=True)  # warm-up: every kernel compiled
        attention_block.trace = torch.zeros(launches * ctas * 8, dtype=torch.int64, device="cuda")
        attention_block.trace_launches = 0
        model(ids[:, -1:], past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
    stamps = attention_block.trace.view(launches, ctas, 8).cpu().double() / 1e3  # us
    attention_block.trace = None
    lines = ["| phase | median us | max us |", "|---|---|---|"]
    for k, name in enumerate(PHASES, start=1):
        spans = (stamps[:, :, k] - stamps[:, :, k - 1]).flatten()
        if name.startswith("count"):  # only the last CTA of each rank sums: the others have no stamp 6
            spans = spans[spans > 0]
        values = spans.tolist()
        lines.append(f"| {name} | {statistics.median(values):.2f} | {max(values):.2f} |")
    start = stamps[:, :, 0].min(dim=1).values
    whole = (stamps[:, :, 5:7].amax(dim=(1, 2)) - start).tolist()
    skew = (stamps[:, :, 0].max(dim=1).values - start).tolist()
    lines.append(f"| first CTA start to last CTA end | {statistics.median(whole):.2f} | {max(whole):.2f} |")
    lines.append(f"| CTA start skew | {statistics.median(skew):.2f} | {max(skew):.2f} |")
    print(f"attention_block, {args.context} cached tokens, {launches} launches of one eager step:")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
