"""Probe (fifteenth session; not used by the model): the structure of kernels/fused_decode.cu without its math.

As ring_probe, with a throttled producer warp (TMA batches of a given size, so many in flight) and LL-protocol
phase outputs (payload and sequence number in one store, polled) instead of barriers (kernels/pipe_probe.cu).

    python -m tinyloop_hf.eval.pipe_probe
"""

import numpy as np
import torch

from tinyloop_hf.kernels import loader

from .gpu import require_gpu


def main() -> None:
    require_gpu("python -m tinyloop_hf.eval.pipe_probe")
    import cupy  # after the GPU check: CuPy is the GPU extra's, not a base dependency

    KB = 1024
    module = cupy.RawModule(code=loader.source("pipe_probe.cu"), options=("--std=c++17", "-arch=sm_90"))
    fn = module.get_function("pipe_probe")
    G = torch.cuda.get_device_properties(0).multi_processor_count
    slots = [-(-s // 16) * 16 for s in (48 * KB + 2304, 16 * KB + 768, 86 * KB + 4096, 45 * KB + 2048)]
    smem = sum(slots)
    fn.max_dynamic_shared_size_bytes = smem
    kv_bytes, unique, apps = 12 * KB, 24, 96
    weights = torch.randint(0, 255, (unique * G * smem,), dtype=torch.uint8, device="cuda")
    kv = torch.randint(0, 255, (apps * G * kv_bytes,), dtype=torch.uint8, device="cuda")
    act = torch.zeros(6 * 1408 * 4, device="cuda")
    counter = torch.zeros(64, dtype=torch.int32, device="cuda")
    out = torch.zeros(G, device="cuda")


    class S:
        ptr = torch.cuda.current_stream().cuda_stream


    def run(mode, chunk, inflight):
        counter.zero_()
        act.zero_()
        args = (np.uint64(weights.data_ptr()), np.uint64(kv.data_ptr()), np.int32(unique), np.int32(apps),
                *(np.uint32(s) for s in slots), np.uint32(kv_bytes), np.uint64(act.data_ptr()),
                np.uint64(counter.data_ptr()), np.uint64(out.data_ptr()), np.int32(mode), np.uint32(chunk),
                np.int32(inflight))
        fn((G,), (512,), args, shared_mem=smem, stream=S)


    def ms(*a):
        run(*a)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            run(*a)
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / 10


    print(f"grid {G} x 512, smem {smem} B; weights per step {apps * G * smem / 1e9:.2f} GB")
    def ll_ms(mode, chunk, inflight):
        act.zero_()
        return ms(mode, chunk, inflight)


    print(f"| barriers+act+kv, no weights | {ms(14, 16 * KB, 1):.3f} ms |")
    print(f"| LL only | {ll_ms(4096, 16 * KB, 1):.3f} ms |")
    print(f"| LL + kv | {ll_ms(4096 + 4, 16 * KB, 1):.3f} ms |")
    for chunk, inflight in [(16, 1), (16, 2), (16, 4), (8, 2), (32, 1), (32, 2), (64, 2)]:
        wb, al = ll_ms(4096 + 1, chunk * KB, inflight), ll_ms(4096 + 5, chunk * KB, inflight)
        print(f"| {chunk} KiB x {inflight} | weights+LL {wb:.3f} ms | weights+LL+kv {al:.3f} ms |", flush=True)


if __name__ == "__main__":
    main()
