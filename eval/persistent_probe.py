"""Probe (ninth session): what a persistent decode kernel could save over today's chain of kernels. Streams the bytes
each kernel of an Ouro-1.4B INT4 decode step reads (per layer: QKV, attention's K/V, O, the junction, gate/up, down,
the junction; 24 layers x 4 loops, a distinct buffer per layer so nothing stays in L2) either as one launch per phase
(graph-captured, programmatic like the GEMVs) or as one persistent launch with a grid barrier between phases
(kernels/persistent_probe.cu). No model, no correctness: only where the time goes.

    python -m tinyloop_hf.eval.persistent_probe --batch 1 16 --ctas-per-sm 2 4 [--activations]

--activations: every CTA of a projection phase also reads all of its input activation after
the wait, as the tensor-core GEMM's CTAs do at batch 16 (64 KiB of x at K 2048, 176 KiB for down_proj).
--activation-fraction F (with --activations): each CTA reads only that fraction of it, the activation traffic of a
partition that splits K F^-1 ways across CTAs (or multicasts x to clusters of F^-1 CTAs); the partial sums such a K
split adds are left out (a few MB per step, in L2).

    python -m tinyloop_hf.eval.persistent_probe --batch 16 --ctas-per-sm 1 2 --activations --activation-fraction 1 0.25
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch

from tinyloop_hf.kernels.loader import i32, kernel, launch, multiprocessors, ptr

from .gpu import require_gpu
from .profile_decode import gpu_ms

THREADS = 256  # persistent_probe.cu PROBE_THREADS
PHASES_PER_LAYER = 7  # ouro_phases: qkv, attention, o, junction, gate_up, down, junction
MB = 1 << 20


def ouro_phases(batch: int, cached: int = 192) -> list[tuple[str, int, int, int]]:
    """(name, bytes, CTAs of today's kernel, bytes of input activation each of its CTAs reads) for each phase of one
    decode step, INT4 g128 weights (+ 3 bytes of scale and zero per group), bf16 K/V and activations. The projections'
    CTAs read all of x (M rows x K); paged decode's and the junction's inputs are in their streamed bytes."""
    hidden, ffn, heads, dim, layers = 2048, 5632, 16, 128, 24 * 4

    def int4(rows: int, cols: int) -> int:
        return rows * cols // 2 + rows * (cols // 128) * 3

    kv = batch * heads * cached * dim * 2 * 2
    junction = (2 * batch + 2) * hidden * 2
    x, h = batch * hidden * 2, batch * ffn * 2
    layer = [
        ("qkv", int4(3 * hidden, hidden), 768 if batch == 1 else 384, x),
        ("attention", kv, heads * 8 if batch == 1 else heads * batch, 0),
        ("o", int4(hidden, hidden), 256 if batch == 1 else 128, x),
        ("junction", junction, batch, 0),
        ("gate_up", int4(2 * ffn, hidden), 704 if batch == 1 else 352, x),
        ("down", int4(hidden, ffn), 256 if batch == 1 else 128, h),
        ("junction", junction, batch, 0),
    ]
    return layer * layers


@dataclass
class Step:
    """One decode step's phases laid out in one device buffer."""

    ctas: list[int]  # today's CTA count per phase
    addresses: list[int]
    vectors: list[int]  # 16-byte vectors per phase
    gigabytes: float
    act_addresses: list[int]  # each phase's input activation (one buffer per phase of a layer: L2-resident, as x is)
    act_vectors: list[int]  # 16-byte vectors every CTA of the phase reads (0 without --activations)


def _packed(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, list[int], list[int]]:
    """One random buffer holding regions of ``sizes`` bytes (rounded up to 16): (buffer, addresses, 16-byte vectors)."""
    rounded = [-(-size // 16) * 16 for size in sizes]
    buffer = torch.randint(0, 255, (max(16, sum(rounded)),), dtype=torch.uint8, device=device)
    offsets = np.cumsum([0, *rounded[:-1]])
    return buffer, [buffer.data_ptr() + int(o) for o in offsets], [n // 16 for n in rounded]


def lay_out(
    phases: list[tuple[str, int, int, int]], device: torch.device, activations: bool, fraction: float = 1.0
) -> tuple[Step, tuple]:
    """The step's buffers; each CTA of a projection reads ``fraction`` of its input activation (with ``activations``)."""
    buffer, addresses, vectors = _packed([size for _, size, _, _ in phases], device)
    # Activations: the inputs of one layer's phases, reused by every layer application (the caching allocator hands
    # today's step the same few buffers), ~0.4 MB at batch 16.
    acts, act_addresses, act_vectors = _packed([a for *_, a in phases[:PHASES_PER_LAYER]], device)
    step = Step([c for _, _, c, _ in phases], addresses, vectors, sum(vectors) * 16 / 1e9,
                [act_addresses[i % PHASES_PER_LAYER] for i in range(len(phases))],
                [round(act_vectors[i % PHASES_PER_LAYER] * fraction) if activations else 0
                 for i in range(len(phases))])  # fmt: skip
    return step, (buffer, acts)


def separate_ms(step: Step, empty: bool, dependent: bool) -> float:
    """GPU time of one graph replay of the step as one probe_phase launch per phase."""
    phase_kernel = kernel("persistent_probe.cu", "probe_phase")
    stride = max(step.ctas)  # one value per CTA of a phase, two phases alternating
    out = torch.zeros(2 * stride + 1, dtype=torch.int32, device="cuda")

    def run() -> None:
        previous = out[-1:]
        for index, (ctas, address, count) in enumerate(zip(step.ctas, step.addresses, step.vectors, strict=True)):
            target = out[(index % 2) * stride :]
            act = (np.uint64(step.act_addresses[index]), np.uint64(0 if empty else step.act_vectors[index]))
            launch(phase_kernel, (ctas,), (THREADS,),
                   (np.uint64(address), np.uint64(0 if empty else count), ptr(previous), ptr(target), *act),
                   dependent=dependent)  # fmt: skip
            previous = target

    run()  # warm-up (and compile)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        run()
    return gpu_ms(graph.replay, repeats=10)


def persistent_ms(step: Step, grid: int, empty: bool) -> float:
    """GPU time of the step as one probe_chain launch of ``grid`` resident CTAs."""
    chain_kernel = kernel("persistent_probe.cu", "probe_chain")
    table = torch.tensor(step.addresses, dtype=torch.int64, device="cuda")
    counts = torch.tensor([0 if empty else v for v in step.vectors], dtype=torch.int64, device="cuda")
    out = torch.zeros(len(step.vectors) * grid, dtype=torch.int32, device="cuda")
    arrived = torch.zeros(1, dtype=torch.int32, device="cuda")
    acts = torch.tensor(step.act_addresses, dtype=torch.int64, device="cuda")
    act_counts = torch.tensor([0 if empty else v for v in step.act_vectors], dtype=torch.int64, device="cuda")
    args = (ptr(table), ptr(counts), i32(len(step.vectors)), ptr(out), ptr(arrived), ptr(acts), ptr(act_counts))

    def run() -> None:
        arrived.zero_()
        launch(chain_kernel, (grid,), (THREADS,), args)

    run()
    torch.cuda.synchronize()
    return gpu_ms(run, repeats=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--ctas-per-sm", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--activations", action="store_true",
                        help="every CTA of a projection phase also reads all of its input activation (M x K)")
    parser.add_argument("--activation-fraction", type=float, nargs="+", default=[1.0],
                        help="with --activations: the fraction of it each CTA reads (a K split's or multicast's share)")
    args = parser.parse_args()
    require_gpu("python -m tinyloop_hf.eval.persistent_probe")
    for fraction in args.activation_fraction:
        if not 0.0 < fraction <= 1.0:
            raise SystemExit(f"--activation-fraction takes values in (0, 1], got {fraction}")
    device = torch.device("cuda")
    sms = multiprocessors(device)
    for batch, fraction in ((b, f) for b in args.batch for f in args.activation_fraction):
        step, buffer = lay_out(ouro_phases(batch), device, args.activations, fraction)
        rows = [
            ("kernels, programmatic", separate_ms(step, False, True), False),
            ("kernels, plain", separate_ms(step, False, False), False),
            ("empty kernels, programmatic", separate_ms(step, True, True), True),
        ]
        for per_sm in args.ctas_per_sm:
            label = f"persistent, {sms * per_sm} CTAs ({per_sm} per SM)"
            rows.append((label, persistent_ms(step, sms * per_sm, False), False))
            rows.append((label + ", barriers only", persistent_ms(step, sms * per_sm, True), True))
        share = f", each projection CTA reading {fraction:g} of its input activation" if args.activations else ""
        print(f"\nbatch {batch}: {len(step.vectors)} phases per step, {step.gigabytes:.2f} GB streamed{share}")
        print("| schedule | ms per step | TB/s |\n|---|---|---|")
        for label, ms, empty in rows:
            print(f"| {label} | {ms:.3f} | {'-' if empty else f'{step.gigabytes / ms:.2f}'} |")
        del buffer


if __name__ == "__main__":
    main()
