// The dot-product core of the CUDA-core GEMV (gemv_quant.cu): activations of one weight word and the accumulation
// of one weight word into per-token-row sums.
#pragma once
#include "quant_layout.cuh"

// Activations of one weight word's columns, per token row: INT4 8 columns = one uint4, INT2/INT3 16 = two, INT8 4
// columns = half of one. Loaded once per word and reused by every weight row of the warp.
template <int BITS> struct XWords {
    static constexpr int count = BITS == 8 ? 1 : Layout<BITS>::cols_per_word / 8;
};

template <int BITS, typename T, int MAXM>
__device__ __forceinline__ void load_x(const T* __restrict__ x, int ldx, int col0, int M,
                                       uint4 (&xv)[MAXM][XWords<BITS>::count]) {
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
        if (MAXM == 1 || m < M) {  // a MAXM = 1 launch always has its one row
            if constexpr (BITS == 8) {
                const uint2 raw = *reinterpret_cast<const uint2*>(x + m * ldx + col0);
                xv[m][0] = make_uint4(raw.x, raw.y, 0u, 0u);
            } else {
#pragma unroll
                for (int v = 0; v < XWords<BITS>::count; ++v)
                    xv[m][v] = reinterpret_cast<const uint4*>(x + m * ldx + col0)[v];
            }
        }
    }
}

// Adds the contribution of one weight word of one row to acc[m] for every activation row.
template <int BITS, typename T, int MAXM>
__device__ __forceinline__ void accumulate_word(unsigned word, unsigned high, float scale, int zero,
                                                unsigned magic_minus,
                                                const uint4 (&xv)[MAXM][XWords<BITS>::count], int M, float* acc) {
    using T2 = typename Vec2<T>::type;
    if constexpr (BITS == 8) {
        // 4 columns: bytes (k0, k2, k1, k3). Exact through the fp32 magic 2^23 + byte.
        const float offset = 8388608.0f + static_cast<float>(zero);
        float w[4];
        w[0] = __int_as_float(0x4B000000 | (word & 0xFF)) - offset;
        w[2] = __int_as_float(0x4B000000 | ((word >> 8) & 0xFF)) - offset;
        w[1] = __int_as_float(0x4B000000 | ((word >> 16) & 0xFF)) - offset;
        w[3] = __int_as_float(0x4B000000 | (word >> 24)) - offset;
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (MAXM == 1 || m < M) {
                const float2 a = to_float2(bits_as_vec2<T>(xv[m][0].x)), b = to_float2(bits_as_vec2<T>(xv[m][0].y));
                acc[m] += scale * (w[0] * a.x + w[1] * a.y + w[2] * b.x + w[3] * b.y);
            }
        }
    } else {
        constexpr int pairs = Layout<BITS>::pairs_per_word;  // INT4: 4, INT2/INT3: 8
        T2 w[pairs];
#pragma unroll
        for (int i = 0; i < pairs; ++i) w[i] = weight_pair<BITS, T>(word, high, i, magic_minus);
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (MAXM == 1 || m < M) {
                float sum = 0.0f;
#pragma unroll
                for (int v = 0; v < pairs / 4; ++v) {
                    const unsigned xs[4] = {xv[m][v].x, xv[m][v].y, xv[m][v].z, xv[m][v].w};
                    if constexpr (sizeof(T) == 2 && Magic<T>::bits == 0x4300u) {
                        // bf16: accumulate 4 exact-weight products in bf16x2 (fp32 range, no overflow).
                        T2 part = __hmul2(w[4 * v], bits_as_vec2<T>(xs[0]));
#pragma unroll
                        for (int j = 1; j < 4; ++j) part = __hfma2(w[4 * v + j], bits_as_vec2<T>(xs[j]), part);
                        const float2 f = bf16x2_bits_to_float2(*reinterpret_cast<const unsigned*>(&part));
                        sum = v == 0 ? f.x + f.y : sum + (f.x + f.y);  // not 0 + ...: the compiler keeps that add
                    } else {
                        // fp16: products to fp32 at once (an fp16 running sum could overflow).
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const float2 wf = to_float2(w[4 * v + j]), xf = to_float2(bits_as_vec2<T>(xs[j]));
                            sum = fmaf(wf.x, xf.x, fmaf(wf.y, xf.y, sum));
                        }
                    }
                }
                acc[m] += scale * sum;
            }
        }
    }
}
