"""Where a decode step's time goes on the CUDA path (Ouro-1.4B shape): GPU time of one graph replay, of one eager
step, generate()'s wall time per token against the graph's (the rest is host time the GPU waits for), and the kernels
of the eager step ranked by total time (torch.profiler / CUPTI sees the CuPy kernels too).

    python -m tinyloop_hf.eval.profile_decode --bits 4 --batch 1 --loops 4
"""

from __future__ import annotations

import argparse
import time

import torch

from tinyloop_hf import TinyLoopForCausalLM

from .bench import base_model, build_ours, timed
from .flags import at_least
from .gpu import require_gpu


def gpu_ms(fn, repeats: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def generate_ms_per_token(model: TinyLoopForCausalLM, ids: torch.Tensor) -> float:
    """Wall time per decoded token of plain greedy generate(), prefill excluded (difference of two lengths)."""

    def best_of_two(tokens: int) -> float:
        return min(timed(lambda: model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False))
                   for _ in range(2))  # fmt: skip

    best_of_two(8)  # warm-up
    return (best_of_two(72) - best_of_two(8)) / 64 * 1000


def prefill_forward(model: TinyLoopForCausalLM, ids: torch.Tensor) -> None:
    """One prompt forward on a fresh cache, as generate() runs it (last position's logits only)."""
    model(ids, past_key_values=model.new_cache(2 * ids.shape[1]), use_cache=True, logits_to_keep=1)


def ttft_breakdown(model: TinyLoopForCausalLM, ids: torch.Tensor) -> str:
    """generate(max_new_tokens=1) wall time against the prefill forward alone (wall and GPU time)."""
    kwargs = dict(max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None)

    def prefill() -> None:
        prefill_forward(model, ids)

    generate = min(timed(lambda: model.generate(ids, **kwargs)) for _ in range(5)) * 1000
    forward = min(timed(prefill) for _ in range(5)) * 1000
    gpu = gpu_ms(prefill, repeats=5)
    return (
        f"TTFT: generate(max_new_tokens=1) {generate:.2f} ms wall; the prefill forward alone "
        f"{forward:.2f} ms wall, {gpu:.2f} ms between CUDA events"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--loops", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--prefill", action="store_true", help="rank the kernels of the prefill forward instead")
    parser.add_argument(
        "--no-programmatic-launch",
        action="store_true",
        help="capture plain launches, with the junctions fused into the GEMV prologues (A/B of kernels/loader.py)",
    )
    parser.add_argument(
        "--no-tile-gemm",
        action="store_true",
        help="prompts and rows past GEMV_MAX_ROWS through dequantize + cuBLAS (ops_cuda.TILE_GEMM off)",
    )
    parser.add_argument("--tile-max-rows", type=at_least(1), help="rows past which dequantize + cuBLAS serves")
    args = parser.parse_args()
    require_gpu("python -m tinyloop_hf.eval.profile_decode")
    from tinyloop_hf.kernels import loader, ops_cuda

    ops_cuda.TILE_GEMM = not args.no_tile_gemm
    if args.tile_max_rows is not None:
        ops_cuda.TILE_MAX_ROWS = args.tile_max_rows
    loader.PROGRAMMATIC_LAUNCH = not args.no_programmatic_launch
    base = base_model(args.loops, 4096)
    model = build_ours(base, args.bits).use_cuda_path()
    del base
    ids = torch.randint(1, 49152, (args.batch, args.context), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False)
        cache = model.new_cache(args.context + 64)
        model(ids, past_key_values=cache, use_cache=True)
        step = ids[:, -1:]
        path = model._cuda_path
        for _ in range(3):  # eager warm-up, capture, replay
            model(step, past_key_values=cache, use_cache=True)
        print(f"graphs captured: {len(path.graphs)}")
        replay = gpu_ms(lambda: model(step, past_key_values=cache, use_cache=True))
        wall = time.perf_counter()
        for _ in range(10):
            model(step, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - wall) / 10 * 1000
        host = time.perf_counter()  # the GPU runs behind: this is the host time of one forward call
        for _ in range(10):
            model(step, past_key_values=cache, use_cache=True)
        host = (time.perf_counter() - host) / 10 * 1000
        torch.cuda.synchronize()
        per_token = generate_ms_per_token(model, ids)
        path.run_ahead_enabled = False
        per_token_plain = generate_ms_per_token(model, ids)
        path.run_ahead_enabled = True
        print(
            f"generate(): {per_token:.2f} ms per token with run-ahead, {per_token_plain:.2f} without = graph "
            f"{replay:.2f} + {per_token_plain - replay:.2f} ms the GPU waits for the host (of which our forward's host "
            f"time: {host:.2f} ms)"
        )
        print(ttft_breakdown(model, ids))
        path.use_graphs = False
        eager = gpu_ms(lambda: model(step, past_key_values=cache, use_cache=True))
        print(f"decode step: graph replay {replay:.2f} ms GPU ({wall:.2f} ms wall), eager {eager:.2f} ms")
        if args.prefill:  # rank the kernels of one eager prompt forward instead of a decode step
            print(f"prefill forward, eager: {gpu_ms(lambda: prefill_forward(model, ids), 3):.2f} ms GPU")
            cache, step = model.new_cache(2 * args.context), ids
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            model(step, past_key_values=cache, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
