"""Where a graph-replayed decode step's time goes, kernel by kernel, with programmatic launch's overlap kept: CUPTI
(torch.profiler) records every kernel of a few replays; for each kernel kind of the step this prints how long its
kernels ran, how early they started before the previous kernel ended (the overlap programmatic launch buys), and
what each adds to the step: its end minus the previous kernel's end. The added times sum to the step.

    python -m tinyloop_hf.eval.replay_timeline --batch 1
    python -m tinyloop_hf.eval.replay_timeline --generate 64 --context 128   # a generate() step: busy and idle
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .ablate_decode import add_switches, apply_switches, benchmark_model, warmed_decode_step
from .gpu import require_gpu
from .profile_decode import gpu_ms


def kind_of(name: str) -> str:
    """A kernel's name without argument lists, with the template arguments that tell the step's launches apart."""
    name = re.sub(r"\(.*\)$", "", name).replace("void ", "")
    return name[:90]


def kernel_events(trace: Path) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel in a chrome trace, in start order."""
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel"]
    return sorted(kernels)


def profiled_kernels(run: Callable[[], None]) -> list[tuple[float, float, str]]:
    """The kernel events (kernel_events) of ``run()`` under torch.profiler (CUPTI)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return kernel_events(trace)


def split_replays(kernels: list[tuple[float, float, str]], per_replay: int) -> list[list[tuple[float, float, str]]]:
    return [kernels[i : i + per_replay] for i in range(0, len(kernels) - per_replay + 1, per_replay)]


def summarize(replay: list[tuple[float, float, str]]) -> list[tuple[str, int, float, float, float, float]]:
    """Per kernel kind: (kind, calls, median duration, median start before the previous end, median and total added)."""
    stats: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    order: list[str] = []
    previous_end = replay[0][0]
    for start, end, name in replay:
        kind = kind_of(name)
        if kind not in stats:
            order.append(kind)
        stats[kind].append((end - start, previous_end - start, max(0.0, end - previous_end)))
        previous_end = max(previous_end, end)
    rows = []
    for kind in order:
        durations, early, added = zip(*stats[kind], strict=True)
        rows.append((kind, len(durations), statistics.median(durations), statistics.median(early),
                     statistics.median(added), sum(added)))  # fmt: skip
    return rows


def step_windows(kernels: list[tuple[float, float, str]], marker: str) -> list[tuple[float, float, Counter]]:
    """Per decode step of a profiled generate(): (period, GPU busy time, kernel kinds with their busy time) between
    the ends of consecutive ``marker`` kernels (the LM head: one per step). Busy is the union of the kernels'
    intervals in the window, so kernels overlapping on two streams count once; the period minus it is GPU idle."""
    ends = [end for _, end, name in kernels if marker in name]
    windows = []
    for lo, hi in zip(ends, ends[1:], strict=False):
        inside = sorted((max(s, lo), min(e, hi), n) for s, e, n in kernels if e > lo and s < hi)
        busy, reach, kinds = 0.0, lo, Counter()
        for start, end, name in inside:
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
            kinds[kind_of(name)] += end - start
        windows.append((hi - lo, busy, kinds))
    return windows


def profile_generate(model: Any, ids: torch.Tensor, new_tokens: int, marker: str) -> None:
    """Profile one greedy generate() and print a step's period, GPU busy and idle time, and its kernels' time."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(ids, **kwargs)  # warm-up: graphs captured
    kernels = profiled_kernels(lambda: model.generate(ids, **kwargs))
    windows = step_windows(kernels, marker)[2:]  # past the prompt and the first plain step
    if not windows:
        raise SystemExit(f"no two steps found: no kernel name contains {marker!r} (--marker)")
    period = statistics.median(w[0] for w in windows)
    busy = statistics.median(w[1] for w in windows)
    print(f"generate(): {len(windows)} steps; per step {period:.1f} us, GPU busy {busy:.1f} us, "
          f"idle {period - busy:.1f} us")  # fmt: skip
    total = sum((w[2] for w in windows), Counter())
    print(f"{'kernel':90s} {'us per step':>11s}")
    for kind, time in total.most_common(14):
        print(f"{kind:90s} {time / len(windows):11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_switches(parser)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--dump", type=Path, help="write every kernel of the last replay here (tsv)")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="profile a greedy generate() of N new tokens from a --context prompt instead")  # fmt: skip
    parser.add_argument("--marker", default="gemv_quant<8", help="a kernel run once per step (--generate)")
    args = parser.parse_args()
    require_gpu("python -m tinyloop_hf.eval.replay_timeline")
    apply_switches(args)
    model = benchmark_model(args)
    if args.generate:
        ids = torch.randint(1, 49152, (args.batch, args.context), device="cuda")
        profile_generate(model, ids, args.generate, args.marker)
        return
    replay = warmed_decode_step(model, args)
    plain = gpu_ms(replay, repeats=20)

    def replays() -> None:
        for _ in range(args.replays):
            replay()

    kernels = profiled_kernels(replays)
    per_replay = len(kernels) // args.replays
    steps = split_replays(kernels, per_replay)
    spans = [r[-1][1] - r[0][0] for r in steps]
    print(f"batch {args.batch}: {per_replay} kernels per replay; replay {plain:.3f} ms between CUDA events without the "
          f"profiler, {statistics.median(spans) / 1000:.3f} ms first start to last end under it")  # fmt: skip
    rows = summarize(steps[len(steps) // 2])
    print(f"{'kernel':90s} {'calls':>5s} {'dur us':>7s} {'early us':>8s} {'added us':>8s} {'total ms':>8s}")
    for kind, calls, duration, early, added, total in sorted(rows, key=lambda r: -r[5]):
        print(f"{kind:90s} {calls:5d} {duration:7.2f} {early:8.2f} {added:8.2f} {total / 1000:8.3f}")
    if args.dump:
        start0 = steps[-1][0][0]
        lines = [f"{s - start0:.3f}\t{e - start0:.3f}\t{kind_of(n)}" for s, e, n in steps[-1]]
        args.dump.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
