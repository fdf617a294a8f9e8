// The RoPE epilogue of a decode step's QKV projection (gemv_quant.cu for one token row, gemm_quant_mma.cu for the
// tensor-core kernel's rows), which replaces rope_kv_append.cu there with the same arithmetic.
#pragma once
#include "common.cuh"

// One token's pair of projection values (a, c) at dims d0 and d1 of `head` (p: the pair's angle index): rounded to T,
// rotated as rope_kv_append.cu does (fp32, no fused multiply-add) when the projection is q or k (column < (Hq + Hkv)
// * D), and stored: q into q_out [Hq, D], K / V into the token's page slot (16-token pages, T). The per-token
// pointers (rope_cos / rope_sin [D/2], q_out, the block-table row, the position) point at this token.
template <typename T>
__device__ __forceinline__ void store_rope_pair(float a, float c, int column, int head, int d0, int d1, int p,
                                                const float* rope_cos, const float* rope_sin, T* q_out, T* k_pages,
                                                T* v_pages, const int* block_table, const int* positions, int Hq,
                                                int Hkv, int D) {
    a = to_float(from_float<T>(a));
    c = to_float(from_float<T>(c));
    float out0 = a, out1 = c;
    if (column < Hq * D + Hkv * D) {  // q or k: rotate
        const float cs = rope_cos[p], sn = rope_sin[p];
        out0 = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(c, sn));
        out1 = __fadd_rn(__fmul_rn(c, cs), __fmul_rn(a, sn));
    }
    T* dst;
    if (column == 0) {
        dst = q_out + head * D;
    } else {
        const int pos = positions[0];
        const int page = block_table[pos / 16];
        const long long page_slot = (static_cast<long long>(page) * Hkv + head) * 16 + pos % 16;
        dst = (column == Hq * D ? k_pages : v_pages) + page_slot * D;
    }
    dst[d0] = from_float<T>(out0);
    dst[d1] = from_float<T>(out1);
}
