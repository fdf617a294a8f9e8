"""What a kernel costs inside the graph-replayed decode step (Ouro-1.4B shape, INT4, L = 4): GPU time of one replay
with the kernels whose name contains a --skip pattern not launched. The outputs are garbage; only the time counts.
The difference to the full step is the most that fusing those kernels away could save, with programmatic launch's
overlap included (which summing eager kernel times misses). One process per configuration: a graph pool cannot be
reused across captures.

    python -m tinyloop_hf.eval.ablate_decode --batch 16 --skip residual_norm
"""

from __future__ import annotations

import argparse

import torch

from tinyloop_hf import TinyLoopForCausalLM
from tinyloop_hf.kernels import ops_cuda

from .bench import build_ours, ouro_config
from .profile_decode import gpu_ms


def skip_kernels(patterns: list[str]) -> None:
    """Make ops_cuda launch nothing for kernels whose name contains one of ``patterns``."""
    skipped = object()
    kernel, launch = ops_cuda.kernel, ops_cuda.launch
    ops_cuda.kernel = lambda file, name: skipped if any(p in name for p in patterns) else kernel(file, name)
    ops_cuda.launch = lambda fn, *args, **kwargs: None if fn is skipped else launch(fn, *args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=192, help="cached tokens before the measured step")
    parser.add_argument("--skip", nargs="*", default=[], help="substrings of kernel names not to launch")
    parser.add_argument("--no-mma-wide", action="store_true", help="8-warp tensor-core CTAs everywhere")
    parser.add_argument("--no-mma-rope", action="store_true", help="rope_kv_append instead of the QKV epilogue")
    parser.add_argument("--decode-ctas", type=int, help="paged-decode CTA target (ops_cuda._DECODE_CTAS)")
    parser.add_argument("--plain-paged", action="store_true", help="paged decode launched without programmatic launch")
    args = parser.parse_args()
    ops_cuda.MMA_WIDE = not args.no_mma_wide
    ops_cuda.MMA_ROPE = not args.no_mma_rope
    ops_cuda.PAGED_PROGRAMMATIC = not args.plain_paged
    if args.decode_ctas:
        ops_cuda._DECODE_CTAS = args.decode_ctas
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = TinyLoopForCausalLM(ouro_config(4, 4096)).to(torch.bfloat16).eval()
    model = build_ours(base, 4).use_cuda_path()
    del base
    ids = torch.randint(1, 49152, (args.batch, args.context), device="cuda")
    with torch.no_grad():
        cache = model.new_cache(args.context + 64)
        model(ids, past_key_values=cache, use_cache=True)  # the prompt runs every kernel
        skip_kernels(args.skip)
        step = ids[:, -1:]
        for _ in range(3):  # eager warm-up, capture, replay
            model(step, past_key_values=cache, use_cache=True)
        replay = gpu_ms(lambda: model(step, past_key_values=cache, use_cache=True), repeats=20)
    print(f"batch {args.batch}, skipped {args.skip or 'nothing'}: {replay:.3f} ms per graph replay")


if __name__ == "__main__":
    main()
