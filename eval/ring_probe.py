"""Probe (fifteenth session; not used by the model): the structure of a decode megakernel with grid barriers.

One CTA per SM (512 threads), 5 grid barriers per layer application, each CTA's weight share of the Ouro-1.4B
shape streamed into shared memory by TMA one layer ahead (kernels/ring_probe.cu); ms per step of 96 layer
applications. H200: a barrier costs ~1.0-1.1 us alone and ~4.2 us while TMA keeps HBM busy; weights and barriers
did not overlap (eval/results/BENCH.md, fifteenth session).

    python -m tinyloop_hf.eval.ring_probe
"""


import numpy as np
import torch

from tinyloop_hf.kernels import loader

from .gpu import require_gpu


def main() -> None:
    require_gpu("python -m tinyloop_hf.eval.ring_probe")
    import cupy  # after the GPU check: CuPy is the GPU extra's, not a base dependency

    KB = 1024
    source = loader.source("ring_probe.cu")
    module = cupy.RawModule(code=source, options=("--std=c++17", "-arch=sm_90"))
    fn = module.get_function("ring_probe")
    G = torch.cuda.get_device_properties(0).multi_processor_count
    slots = [48 * KB + 2304, 16 * KB + 768, 86 * KB + 4096, 45 * KB + 2048]
    slots = [-(-s // 16) * 16 for s in slots]
    smem = sum(slots)
    fn.max_dynamic_shared_size_bytes = smem
    kv_bytes = 12 * KB
    unique, apps = 24, 96
    weights = torch.randint(0, 255, (unique * G * smem,), dtype=torch.uint8, device="cuda")
    kv = torch.randint(0, 255, (apps * G * kv_bytes,), dtype=torch.uint8, device="cuda")
    act = torch.zeros(2 * G * 64, device="cuda")
    counter = torch.zeros(64, dtype=torch.int32, device="cuda")
    out = torch.zeros(G, device="cuda")
    stream = torch.cuda.current_stream()


    class S:
        ptr = stream.cuda_stream


    def run(mode: int, n_apps: int = apps, scale: float = 1.0, grid: int = G) -> None:
        counter.zero_()
        sizes = [int(s * scale) // 16 * 16 for s in slots]
        args = (np.uint64(weights.data_ptr()), np.uint64(kv.data_ptr()), np.int32(unique), np.int32(n_apps),
                *(np.uint32(s) for s in sizes), np.uint32(kv_bytes), np.uint64(act.data_ptr()),
                np.uint64(counter.data_ptr()), np.uint64(out.data_ptr()), np.int32(mode))
        fn((grid,), (512,), args, shared_mem=smem, stream=S)


    def ms(mode: int, n_apps: int = apps, scale: float = 1.0, grid: int = G) -> float:
        run(mode, n_apps, scale, grid)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            run(mode, n_apps, scale, grid)
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 10


    print(f"grid {G} x 512, smem {smem} B; weights per step {apps * G * smem / 1e9:.2f} GB")
    for label, mode, scale, grid in [
            ("barriers only", 34, 1.0, G), ("barriers only + background stream", 34 + 2048, 1.0, G),
            ("barriers+act", 42, 1.0, G), ("barriers+act + background stream", 42 + 2048, 1.0, G),
            ("weights+barriers", 35, 1.0, G)]:
        t = ms(mode, apps, scale, grid)
        print(f"| {label} | {t:.3f} ms | {apps * grid * smem * scale / t / 1e9:.2f} TB/s weights |", flush=True)


if __name__ == "__main__":
    main()
