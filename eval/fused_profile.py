"""Where a fused decode step's time goes (kernels/fused_decode.cu; Ouro-1.4B shape, INT4, L = 4, batch 1).

Default: per-phase durations from the kernel's clock64 trace of one eager step (median and maximum over CTAs and
layer applications), in microseconds at the device's rated clock. ``--replay``: the GPU time of one graph-replayed
step, fused and per-op; with ``--no-math`` the fused kernel's projection loops are compiled out (wrong outputs,
timing only), which separates the GEMVs from the kernel's structure (polls, junctions, attention, barriers).

``--global-clock``: the trace in the global timer's nanoseconds, one clock for every SM, and a second table of the
hand-offs across CTAs: how far the last producer CTA finished behind the median one (skew), how long after the last
producer the median consumer had the data (the hand-off itself), and how far the last consumer was behind the median.

    python -m tinyloop_hf.eval.fused_profile [--global-clock]
    python -m tinyloop_hf.eval.fused_profile --replay [--no-math]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tinyloop_hf import TinyLoopForCausalLM
from tinyloop_hf.kernels import fused_decode

from .ablate_decode import VARIANTS, patch_sources
from .bench import base_model, build_ours
from .gpu import require_gpu
from .profile_decode import gpu_ms

PHASES = ["P1 poll + junction", "P1 slot wait", "P1 QKV", "P2 q/k/v poll", "P2 attention", "P3 poll", "P3 slot wait",
          "P3 O", "P4 poll + junction", "P4 slot wait", "P4 gate/up", "P5 poll", "P5 slot wait", "P5 down"]  # fmt: skip
# Hand-offs: (name, the producers' mark, the consumers' mark, the producers' mark is in the application before).
# Marks (fused_decode.cu): 3 QKV stored, 4 q/k/v polled, 5 attention (and split 0's merge) stored, 6 attention output
# polled, 8 O stored, 15 O polled, 11 gate/up stored, 12 gate/up polled, 14 down stored, 1 the next junction done.
HANDOFFS = [("QKV -> attention", 3, 4, False), ("attention -> O", 5, 6, False), ("O -> junction", 8, 15, False),
            ("gate/up -> down", 11, 12, False), ("down -> junction (incl. the junction)", 14, 1, True)]  # fmt: skip


def trace_table(model: TinyLoopForCausalLM, cache: object, step: torch.Tensor, global_clock: bool = False) -> str:
    import cupy

    fused = model._cuda_path.fused
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    apps = model.config.num_loops * model.config.num_loop_layers
    fused.drop()
    fused.trace = torch.zeros(apps * 16 * sms, dtype=torch.int64, device="cuda")  # the grid is at most one CTA an SM
    with torch.no_grad():
        for _ in range(2):
            model(step, past_key_values=cache, use_cache=True)
    torch.cuda.synchronize()
    grid = next(plan.grid for plan in fused.plans.values() if not isinstance(plan, str))  # SPARE_SMS fewer than sms
    ticks = as_float_ticks(fused.trace[: apps * 16 * grid].view(apps, 16, grid).cpu())
    fused.trace = None
    fused.drop()
    ghz = 1.0 if global_clock else cupy.cuda.runtime.getDeviceProperties(0)["clockRate"] / 1e6  # ticks per ns

    def row(name: str, spans: torch.Tensor) -> str:
        values = spans.flatten().tolist()
        return f"| {name} | {statistics.median(values) / 1e3 / ghz:.2f} | {max(values) / 1e3 / ghz:.2f} |"

    lines = ["| phase | median us | max us |", "|---|---|---|"]
    for k, name in enumerate(PHASES, start=1):
        spans = ticks[2:, k] - ticks[2:, k - 1]
        lines.append(row(name, spans[:, :128] if name.startswith("P2") else spans))  # CTAs with an attention split
    for name, begin, end in (("P4 poll alone", 8, 15), ("P4 junction alone", 15, 9)):  # mark 15: the poll's end
        lines.append(row(name, ticks[2:, end] - ticks[2:, begin]))
    lines.append(row("layer application", ticks[3:, 0] - ticks[2:-1, 0]))
    if global_clock:
        lines += ["", handoff_table(ticks[2:])]
    return "\n".join(lines)


def as_float_ticks(raw: torch.Tensor) -> torch.Tensor:
    """int64 trace -> float64, every mark relative to the earliest (1 = the earliest; 0 stays 0, a mark never
    reached): the global timer counts ~1.7e18 ns since the epoch, where a float64's 53 bits resolve only 256 ns."""
    reached = raw > 0
    if not reached.any():
        return raw.double()
    return torch.where(reached, raw - raw[reached].min() + 1, raw).double()


def handoff_table(ns: torch.Tensor) -> str:
    """The hand-offs across CTAs from a global-timer trace [apps, 16, grid] (ns): per hand-off, medians over layer
    applications of the producers' skew (last - median), the time from the last producer to the median consumer, and
    the consumers' spread (last - median); in us."""
    nonzero = (ns[:, 1:] - ns[:, :-1]).flatten()
    step = nonzero[nonzero > 0].min().item()
    lines = [f"global timer: smallest step seen {step:.0f} ns", "",
             "| hand-off | producers' skew us | last producer -> median consumer us | consumers' spread us |",
             "|---|---|---|---|"]  # fmt: skip
    for name, produced, consumed, before in HANDOFFS:
        producers = ns[:-1, produced] if before else ns[:, produced]
        consumers = ns[1:, consumed] if before else ns[:, consumed]
        # CTAs that never reach a mark (no attention split: marks 4 and 5) leave it 0.
        producers = producers[:, (producers > 0).all(dim=0)]
        consumers = consumers[:, (consumers > 0).all(dim=0)]
        last = producers.max(dim=1).values
        skew = last - producers.median(dim=1).values
        after = consumers.median(dim=1).values - last
        spread = consumers.max(dim=1).values - consumers.median(dim=1).values
        cells = " | ".join(f"{statistics.median(v.tolist()) / 1e3:.2f}" for v in (skew, after, spread))
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def replay_ms(model: TinyLoopForCausalLM, cache: object, step: torch.Tensor) -> float:
    """GPU time of one graph-replayed decode step (after the eager warm-up and the capture)."""
    with torch.no_grad():
        for _ in range(3):
            model(step, past_key_values=cache, use_cache=True)
        return gpu_ms(lambda: model(step, past_key_values=cache, use_cache=True), repeats=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replay", action="store_true", help="graph-replay times, fused and per-op")
    parser.add_argument("--no-math", action="store_true", help="the fused kernel without its projection loops")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--splits", type=int, help="attention splits per KV head (fused_decode.SPLITS)")
    parser.add_argument("--global-clock", action="store_true", help="trace in global-timer ns; the hand-off table")
    parser.add_argument("--variant", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="ablate_decode's candidate kernel changes, traced instead of the kernel as it is")
    args = parser.parse_args()
    require_gpu("python -m tinyloop_hf.eval.fused_profile")
    fused_decode.SPLITS = args.splits
    # Source patches before the kernel is first compiled.
    patch_sources(["fused-math"] * args.no_math + ["fused-global-clock"] * args.global_clock + args.variant)
    base = base_model(4, 4096)
    ids = torch.randint(1, 49152, (1, args.context), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    for fused in (True, False) if args.replay else (True,):
        fused_decode.FUSED_DECODE = fused
        model = build_ours(base, 4).use_cuda_path(cuda_graphs=args.replay)
        with torch.no_grad():
            cache = model.new_cache(args.context + 64)
            model(ids, past_key_values=cache, use_cache=True)
            step = ids[:, -1:]
        if not args.replay:
            print(trace_table(model, cache, step, args.global_clock))
            return
        ms = replay_ms(model, cache, step)
        label = "fused" + (" (no math)" if args.no_math else "") if fused else "per-op"
        print(f"{label}: {ms:.3f} ms per graph replay (fused steps {model._cuda_path.fused.steps})")
        del model, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
