// Low-bit weight GEMV for decode: y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, g]) * s[n, g]  (m < M <= MAXM).
//
// Reads the QuantLinear layout of tinyloop_hf/quant_tinyloop.py as is: row-major int32 words, each word holding
// 32/b consecutive columns with the even columns in bits 0-15 and the odd ones in bits 16-31, so masking one
// field per 16-bit half gives two adjacent columns as a (fp16|bf16)x2 pair through the magic-number trick.
// INT3 = INT2 low plane + 1-bit high plane (bit j of a high word's low half is column 2j of its 32 columns).
//
// Work split: a CTA of 4 warps; each warp owns R output rows (each activation chunk is loaded once, used R
// times); lanes stride over the row in 16-byte weight loads. Epilogues: + bias, + residual, or SwiGLU
// (SWIGLU: a second matrix "up" with the same shape; y = silu(gate . x) * (up . x)).
#include "common.cuh"

template <int BITS> struct Layout {
    static constexpr int low_bits = BITS == 3 ? 2 : BITS;
    static constexpr int cols_per_word = 32 / low_bits;
};

struct QuantMatrix {
    const unsigned* qweight;       // [N, K * low_bits / 32]
    const unsigned* qhigh;         // INT3: [N, K / 32], else null
    const unsigned short* scales;  // [N, groups] fp16 or bf16 bits
    const unsigned char* zeros;    // [N, groups] or null (symmetric: midpoint)
};

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
        if (m < M) {
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
            if (m < M) {
                const float2 a = to_float2(bits_as_vec2<T>(xv[m][0].x)), b = to_float2(bits_as_vec2<T>(xv[m][0].y));
                acc[m] += scale * (w[0] * a.x + w[1] * a.y + w[2] * b.x + w[3] * b.y);
            }
        }
    } else {
        constexpr int pairs = Layout<BITS>::cols_per_word / 2;  // INT4: 4, INT2/INT3: 8
        constexpr int lb = Layout<BITS>::low_bits;
        constexpr unsigned mask = ((1u << lb) - 1) | (((1u << lb) - 1) << 16);
        const unsigned mz = Magic<T>::bits + zero;
        const unsigned magic_minus = mz | (mz << 16);
        T2 w[pairs];
#pragma unroll
        for (int i = 0; i < pairs; ++i) {
            unsigned fields = (word >> (lb * i)) & mask;
            if constexpr (BITS == 3) fields |= ((high >> i) & 0x00010001u) << 2;
            w[i] = centered_pair<T>(fields, magic_minus);
        }
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m < M) {
                float sum = 0.0f;
#pragma unroll
                for (int v = 0; v < pairs / 4; ++v) {
                    const unsigned xs[4] = {xv[m][v].x, xv[m][v].y, xv[m][v].z, xv[m][v].w};
                    if constexpr (sizeof(T) == 2 && Magic<T>::bits == 0x4300u) {
                        // bf16: accumulate 4 exact-weight products in bf16x2 (fp32 range, no overflow).
                        T2 part = __hmul2(w[4 * v], bits_as_vec2<T>(xs[0]));
#pragma unroll
                        for (int j = 1; j < 4; ++j) part = __hfma2(w[4 * v + j], bits_as_vec2<T>(xs[j]), part);
                        const float2 f = to_float2(part);
                        sum += f.x + f.y;
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

template <int BITS>
__device__ __forceinline__ unsigned high_bits_for(const QuantMatrix& mat, int row, int words_per_row, int word_index) {
    if constexpr (BITS == 3) {
        const unsigned h = __ldg(mat.qhigh + static_cast<long long>(row) * (words_per_row / 2) + word_index / 2);
        return h >> (8 * (word_index & 1));
    } else {
        return 0u;
    }
}

// Groups are 32, 64 or 128 columns (or the whole row): the group of column c is c >> group_shift (31 per channel).
// Every load of an iteration (the R rows' weights, their scales / zeros, INT3's high plane) is issued before any
// math, so one memory latency, not three in a chain, is paid per 16-byte chunk.
template <int BITS, typename T, int MAXM, int R>
__device__ __forceinline__ void row_dots(const QuantMatrix& mat, int row0, int N, int K, int group_shift, int groups,
                                         int scale_is_bf16, int midpoint, const T* __restrict__ x, int ldx, int M,
                                         float (&acc)[R][MAXM]) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    const int lane = threadIdx.x & 31;
    const int words = K / cpw;
    const int chunks = words % 4 == 0 ? words / 4 : 0;  // 16-byte loads need 16-byte aligned rows
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.0f;
    for (int c = lane; c < chunks + (words - 4 * chunks); c += 32) {
        // c < chunks: a 16-byte chunk of 4 words; beyond: one tail word each.
        const bool full = c < chunks;
        const int first_word = full ? 4 * c : 4 * chunks + (c - chunks);
        const int count = full ? 4 : 1;
        // A chunk spans one group, or two (INT2/INT3 chunks are 64 columns; groups can be 32).
        const int group0 = (first_word * cpw) >> group_shift;
        const int group1 = ((first_word + count - 1) * cpw) >> group_shift;
        unsigned ws[R][4];
        unsigned hs[R][2];
        unsigned short scale_bits[R][2];
        int zero[R][2];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = min(row0 + r, N - 1);
            const unsigned* base = mat.qweight + static_cast<long long>(row) * words;
            if (full) {
                const uint4 v = load_stream(reinterpret_cast<const uint4*>(base) + c);
                ws[r][0] = v.x; ws[r][1] = v.y; ws[r][2] = v.z; ws[r][3] = v.w;
            } else {
                ws[r][0] = __ldg(base + first_word);
            }
            if constexpr (BITS == 3) {
                const unsigned* high = mat.qhigh + static_cast<long long>(row) * (words / 2) + first_word / 2;
                hs[r][0] = __ldg(high);
                hs[r][1] = full ? __ldg(high + 1) : 0u;
            }
            const long long gi = static_cast<long long>(row) * groups;
            scale_bits[r][0] = __ldg(mat.scales + gi + group0);
            scale_bits[r][1] = __ldg(mat.scales + gi + group1);
            zero[r][0] = mat.zeros ? static_cast<int>(__ldg(mat.zeros + gi + group0)) : midpoint;
            zero[r][1] = mat.zeros ? static_cast<int>(__ldg(mat.zeros + gi + group1)) : midpoint;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (i < count) {
                const int word_index = first_word + i;
                const int col0 = word_index * cpw;
                const int k = (col0 >> group_shift) == group0 ? 0 : 1;
                uint4 xv[MAXM][XWords<BITS>::count];
                load_x<BITS, T, MAXM>(x, ldx, col0, M, xv);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (row0 + r < N) {
                        unsigned high = 0u;
                        if constexpr (BITS == 3) high = hs[r][i / 2] >> (8 * (word_index & 1));
                        accumulate_word<BITS, T, MAXM>(ws[r][i], high, scale_to_float(scale_bits[r][k], scale_is_bf16),
                                                       zero[r][k], xv, M, acc[r]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = warp_sum(acc[r][m]);
}

// One launch serves up to three matrices sharing K and the format (QKV: outputs concatenated along columns of
// y), or (SWIGLU) a gate matrix 0 and an up matrix 1 of the same shape. CTAs are assigned to matrices in order.
template <int BITS, typename T, int MAXM, int R, bool SWIGLU>
__global__ void __launch_bounds__(128) gemv_quant(
    const T* __restrict__ x, int M, int ldx,
    const unsigned* qw0, const unsigned* qh0, const unsigned short* sc0, const unsigned char* zr0, const T* bias0,
    int N0,
    const unsigned* qw1, const unsigned* qh1, const unsigned short* sc1, const unsigned char* zr1, const T* bias1,
    int N1,
    const unsigned* qw2, const unsigned* qh2, const unsigned short* sc2, const unsigned char* zr2, const T* bias2,
    int N2,
    const T* __restrict__ residual, int ldr, T* __restrict__ y, int ldy, int K, int group_shift, int groups,
    int scale_is_bf16, int midpoint) {
    constexpr int ROWS_PER_CTA = 4 * R;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int blocks0 = (N0 + ROWS_PER_CTA - 1) / ROWS_PER_CTA, blocks1 = (N1 + ROWS_PER_CTA - 1) / ROWS_PER_CTA;
    int block = blockIdx.x, N = N0, column = 0;
    QuantMatrix mat{qw0, qh0, sc0, zr0};
    const T* bias = bias0;
    if (!SWIGLU && block >= blocks0) {
        block -= blocks0;
        column = N0;
        if (block < blocks1) {
            mat = QuantMatrix{qw1, qh1, sc1, zr1};
            bias = bias1;
            N = N1;
        } else {
            block -= blocks1;
            column = N0 + N1;
            mat = QuantMatrix{qw2, qh2, sc2, zr2};
            bias = bias2;
            N = N2;
        }
    }
    const int row0 = (block * 4 + warp) * R;
    if (row0 >= N) return;
    float acc[R][MAXM];
    row_dots<BITS, T, MAXM, R>(mat, row0, N, K, group_shift, groups, scale_is_bf16, midpoint, x, ldx, M, acc);
    if constexpr (SWIGLU) {
        const QuantMatrix up{qw1, qh1, sc1, zr1};
        float acc_up[R][MAXM];
        row_dots<BITS, T, MAXM, R>(up, row0, N, K, group_shift, groups, scale_is_bf16, midpoint, x, ldx, M, acc_up);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                // Round each projection to the activation dtype first, as the unfused path does.
                const float g = to_float(from_float<T>(acc[r][m])), u = to_float(from_float<T>(acc_up[r][m]));
                acc[r][m] = to_float(from_float<T>(silu(g))) * u;
            }
    }
    if (lane != 0) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = row0 + r;
        if (row >= N) break;
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m < M) {
                float v = acc[r][m];
                if (bias) v += to_float(bias[row]);
                if (residual) v = to_float(from_float<T>(v)) + to_float(residual[m * ldr + column + row]);
                y[m * ldy + column + row] = from_float<T>(v);
            }
        }
    }
}

// Prefill path (many rows): dequantize to the activation dtype, then cuBLAS does the GEMM.
template <int BITS, typename T>
__global__ void dequantize_weight(const unsigned* qweight, const unsigned* qhigh, const unsigned short* scales,
                                  const unsigned char* zeros, T* __restrict__ out, int N, int K, int group_shift,
                                  int groups, int scale_is_bf16, int midpoint) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    const int words = K / cpw;
    const long long total = static_cast<long long>(N) * words;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int row = static_cast<int>(i / words), word_index = static_cast<int>(i % words);
        const unsigned word = qweight[i];
        const int col0 = word_index * cpw;
        const long long gi = static_cast<long long>(row) * groups + (col0 >> group_shift);
        const float s = scale_to_float(scales[gi], scale_is_bf16);
        const int z = zeros ? static_cast<int>(zeros[gi]) : midpoint;
        const QuantMatrix mat{qweight, qhigh, scales, zeros};
        const unsigned high = high_bits_for<BITS>(mat, row, words, word_index);
        T* dst = out + static_cast<long long>(row) * K + col0;
        if constexpr (BITS == 8) {
            const int q[4] = {static_cast<int>(word & 0xFF), static_cast<int>((word >> 16) & 0xFF),
                              static_cast<int>((word >> 8) & 0xFF), static_cast<int>(word >> 24)};
#pragma unroll
            for (int j = 0; j < 4; ++j) dst[j] = from_float<T>(static_cast<float>(q[j] - z) * s);
        } else {
            constexpr int lb = Layout<BITS>::low_bits;
#pragma unroll
            for (int j = 0; j < cpw / 2; ++j) {
                int even = (word >> (lb * j)) & ((1 << lb) - 1), odd = (word >> (16 + lb * j)) & ((1 << lb) - 1);
                if constexpr (BITS == 3) {
                    even |= ((high >> j) & 1) << 2;
                    odd |= ((high >> (16 + j)) & 1) << 2;
                }
                dst[2 * j] = from_float<T>(static_cast<float>(even - z) * s);
                dst[2 * j + 1] = from_float<T>(static_cast<float>(odd - z) * s);
            }
        }
    }
}
