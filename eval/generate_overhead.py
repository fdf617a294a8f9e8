"""Where a greedy generate() token's time goes beyond its decode graph's replay (Ouro-1.4B shape, INT4, L = 4).

CUDA events around every graph replay (CUDAGraph.replay patched; the model's forward is left alone: with a wrapped
forward, generate() ran the prompt eagerly, ~0.1 s on the H200) give each replay's GPU time and the GPU time between
one replay's end and the next one's start. Host clocks at each replay's launch tell whether the host launched it
late (after the previous replay had ended on the GPU: the host is then the bound). Back-to-back replays of the same
step are the reference.

    python -m tinyloop_hf.eval.generate_overhead --batch 1 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tinyloop_hf.kernels import fused_decode

from .ablate_decode import benchmark_model, warmed_decode_step
from .bench import timed
from .gpu import require_gpu
from .profile_decode import gpu_ms


@dataclass
class Replay:
    graph: torch.cuda.CUDAGraph
    launched: float  # host seconds since the reference event
    start: torch.cuda.Event
    end: torch.cuda.Event


@contextmanager
def recorded_replays(replays: list[Replay]) -> Iterator[torch.cuda.Event]:
    """Inside, every CUDAGraph.replay() is bracketed by timing events on the stream it is launched on; yields the
    reference event (host clock zero: recorded, then waited for)."""
    reference = torch.cuda.Event(enable_timing=True)
    reference.record()
    reference.synchronize()
    zero = time.perf_counter()
    original = torch.cuda.CUDAGraph.replay

    def replay(graph: torch.cuda.CUDAGraph) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        launched = time.perf_counter() - zero
        start.record()
        original(graph)
        end.record()
        replays.append(Replay(graph, launched, start, end))

    torch.cuda.CUDAGraph.replay = replay
    try:
        yield reference
    finally:
        torch.cuda.CUDAGraph.replay = original


def breakdown(model, batch: int, context: int, tokens: int) -> str:
    ids = torch.randint(1, 49152, (batch, context), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        # Warm-up: the first call runs the prompt and the first decode step eagerly and captures the decode step;
        # the second captures the prompt's graph (a capture inside a timed call would count ~0.1 s against it).
        for _ in range(2):
            model.generate(ids, **kwargs)

        def generate_s(new_tokens: int) -> float:
            return timed(lambda: model.generate(ids, **{**kwargs, "max_new_tokens": new_tokens,
                                                        "min_new_tokens": new_tokens}))  # fmt: skip

        full, half, one = generate_s(tokens), generate_s(tokens // 2), generate_s(1)
        replays: list[Replay] = []
        with recorded_replays(replays) as reference:
            model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    decode_graphs = {id(entry.graph) for key, entry in model._cuda_path.graphs.items() if key[0] == "decode"}
    decode = [r for r in replays if id(r.graph) in decode_graphs][1:-1]  # the last one run ahead is never asked for
    durations = [r.start.elapsed_time(r.end) for r in decode]
    gaps = [a.end.elapsed_time(b.start) * 1000 for a, b in zip(decode, decode[1:], strict=False)]
    # How long before the previous replay ended (GPU clock) the host launched the next one: negative means late.
    lead = [reference.elapsed_time(a.end) / 1000 - b.launched for a, b in zip(decode, decode[1:], strict=False)]
    late = sum(x < 0 for x in lead)
    step = warmed_decode_step(model, argparse.Namespace(batch=batch, context=context + tokens // 2))
    alone = gpu_ms(step, repeats=20)
    per_token = (full - one) / (tokens - 1) * 1000  # the bench's measure
    second_half = (full - half) / (tokens - tokens // 2) * 1000
    return (
        f"batch {batch}: generate() {per_token:.3f} ms per token ({batch / per_token * 1000:,.1f} tok/s; "
        f"{second_half:.3f} over the second half of the tokens); replay "
        f"{statistics.median(durations):.3f} ms in generate(), {alone:.3f} back to back; GPU gap between replays "
        f"median {statistics.median(gaps):.1f} us (max {max(gaps):.1f}); host launched {late} of {len(lead)} "
        f"replays after the previous one ended (median lead {statistics.median(lead) * 1000:.2f} ms); run-ahead "
        f"{model._cuda_path.run_ahead_counts}; fused steps {model._cuda_path.fused.steps}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generate()")
    parser.add_argument("--fused-decode", action=argparse.BooleanOptionalAction, default=True,
                        help="batch-1 steps as one kernel (kernels/fused_decode.cu; the default)")
    parser.add_argument("--spare-sms", type=int, help="SMs the fused kernel leaves free (fused_decode.SPARE_SMS)")
    args = parser.parse_args()
    require_gpu("python -m tinyloop_hf.eval.generate_overhead")
    fused_decode.FUSED_DECODE = args.fused_decode
    if args.spare_sms is not None:
        fused_decode.SPARE_SMS = args.spare_sms
    model = benchmark_model(argparse.Namespace(kv_cache_dtype="auto"))
    for batch in args.batch:
        print(breakdown(model, batch, args.context, args.tokens))


if __name__ == "__main__":
    main()
