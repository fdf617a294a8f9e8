"""Low-bit projection timings on the Ouro-1.4B layer shapes (and 16384²) for a few token-row counts, against cuBLAS
bf16 on the same shape; every call reads HBM (weight copies rotate past the L2 cache), or with --from-l2 the same
copy again (how fast a projection is once its weights are on chip).

    python -m tinyloop_hf.eval.gemv_sweep --bits 4 --rows 1 4 16
    python -m tinyloop_hf.eval.gemv_sweep --rows 16 --from-l2
    python -m tinyloop_hf.eval.gemv_sweep --rows 16 64 --tile-gemm     # 2+ rows through the tile kernel
    python -m tinyloop_hf.eval.gemv_sweep --rows 16 64 --no-tile-gemm  # past 32 rows dequantize + cuBLAS
"""

from __future__ import annotations

import argparse

from .bench import gemv_timing
from .gpu import require_gpu

# (out_features, in_features): fused QKV, o_proj, one of gate/up, down_proj, the 16384² reference matrix.
SHAPES = ((6144, 2048), (2048, 2048), (5632, 2048), (2048, 5632), (16384, 16384))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 8))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--from-l2", action="store_true", help="one weight copy, read from L2 by every call")
    tile = parser.add_mutually_exclusive_group()
    tile.add_argument("--tile-gemm", action="store_true",
                      help="2+ rows through kernels/gemm_quant_tile.cu (ops_cuda.TILE_MIN_ROWS 2; default: 33+)")
    tile.add_argument("--no-tile-gemm", action="store_true", help="no rows through it (ops_cuda.TILE_GEMM off)")
    args = parser.parse_args(argv)
    require_gpu("python -m tinyloop_hf.eval.gemv_sweep")
    from tinyloop_hf.kernels import ops_cuda

    if args.tile_gemm:
        ops_cuda.TILE_MIN_ROWS = 2
    ops_cuda.TILE_GEMM = not args.no_tile_gemm
    print(f"| N x K | rows | INT{args.bits} us | TB/s | cuBLAS bf16 us | speed-up |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        for out_features, in_features in SHAPES:
            t = gemv_timing(out_features, in_features, rows=rows, bits=args.bits, from_l2=args.from_l2)
            print(f"| {t['shape']} | {rows} | {t['us']:.2f} | {t['tb_s']:.2f} | {t['cublas_bf16_us']:.2f} "
                  f"| {t['speedup_vs_cublas_bf16']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
