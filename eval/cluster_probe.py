"""Probe (twenty-third session; not used by the model): whether thread-block clusters could carry the fused decode
kernel's hand-offs (kernels/cluster_probe.cu), on CTAs of its size (384 threads, one per SM).

Prints how many clusters of 2 / 4 / 8 such CTAs can be resident at once (cuOccupancyMaxActiveClusters), whether a
cooperative launch accepts a cluster dimension, and the cycles of one round of each hand-off: a cluster barrier, a
DSMEM exchange, an LL hop among a cluster's 8 CTAs and an LL hop over a 128-CTA grid (cooperative).

    python -m tinyloop_hf.eval.cluster_probe
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from tinyloop_hf.kernels import loader

from .gpu import require_gpu

THREADS, SHARED = 384, 200 * 1024  # the fused kernel's CTA: 11 consumer warps and a producer, most shared memory
GRID, CLUSTER, ROUNDS = 128, 8, 2000
MODES = {
    0: "cluster barrier",
    1: "DSMEM exchange (write, cluster barrier, 8 peer loads)",
    2: "LL hop among a cluster's 8 CTAs (global memory)",
    3: "LL hop over the whole grid (cooperative)",
}


def max_active_clusters(fn: object, cluster: int) -> int:
    attribute = loader._LaunchAttribute(id=loader._CLUSTER_DIMENSION, value=1, value_y=1, value_z=cluster)
    attributes = (loader._LaunchAttribute * 1)(attribute)
    stream = torch.cuda.current_stream().cuda_stream
    config = loader._LaunchConfig(1, 1, GRID, THREADS, 1, 1, SHARED, stream, attributes, 1)
    count = ctypes.c_int(0)
    occupancy = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    status = occupancy(ctypes.byref(count), ctypes.c_void_p(fn.kernel.ptr), ctypes.byref(config))
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed with CUresult {status}")
    return count.value


def main() -> None:
    require_gpu("python -m tinyloop_hf.eval.cluster_probe")
    import cupy  # after the GPU check: CuPy is the GPU extra's, not a base dependency

    module = cupy.RawModule(code=loader.source("cluster_probe.cu"), options=("--std=c++17", "-arch=sm_90"))
    fn = module.get_function("cluster_probe")
    fn.max_dynamic_shared_size_bytes = SHARED
    print(f"{torch.cuda.get_device_name()}, {loader.multiprocessors(torch.device('cuda'))} SMs; CTAs of {THREADS} "
          f"threads and {SHARED // 1024} KiB shared memory")  # fmt: skip
    for cluster in (2, 4, 8):
        clusters = max_active_clusters(fn, cluster)
        print(f"clusters of {cluster}: at most {clusters} resident ({clusters * cluster} CTAs)")
    words = torch.zeros(GRID * 4, 2, dtype=torch.int32, device="cuda")
    sink = torch.zeros(1, device="cuda")
    cycles = torch.zeros(GRID, dtype=torch.int64, device="cuda")
    base = 0

    def run(mode: int, rounds: int, cluster: int, cooperative: bool) -> None:
        nonlocal base
        args = (np.int32(mode), np.int32(rounds), np.int32(base), loader.ptr(words), loader.ptr(sink),
                loader.ptr(cycles))  # fmt: skip
        base += rounds
        loader.launch(fn, (1, 1, GRID), (THREADS,), args, SHARED, cluster=cluster, cooperative=cooperative)

    try:
        run(0, 1, CLUSTER, True)
        torch.cuda.synchronize()
        print(f"a cooperative launch of {GRID // CLUSTER} clusters of {CLUSTER}: accepted")
    except RuntimeError as error:
        print(f"a cooperative launch of {GRID // CLUSTER} clusters of {CLUSTER}: refused ({error})")
    for mode, name in MODES.items():
        cluster, cooperative = (1, True) if mode == 3 else (CLUSTER, False)  # modes 0-2 wait within a cluster only
        run(mode, 10, cluster, cooperative)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(mode, ROUNDS, cluster, cooperative)
        end.record()
        torch.cuda.synchronize()
        median = cycles.double().median().item() / ROUNDS
        print(f"{name}: {median:.0f} cycles a round (median CTA), {start.elapsed_time(end) * 1e3 / ROUNDS:.3f} us")


if __name__ == "__main__":
    main()
