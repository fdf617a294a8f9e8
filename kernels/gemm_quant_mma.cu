// Tensor-core low-bit GEMM for a few token rows (2-16 per launch: verify passes, small batches):
// y[m, n] = sum_k x[m, k] * ((q[n, k] - z[n, g]) * s[n, g])  for INT2/INT3/INT4 weights (layout: quant_layout.cuh).
//
// mma.sync m16n8k16 with the weights as the 16-row A operand and the tokens as N (8 per n-tile, NT tiles), so
// the CUDA cores only dequantize (about 2 instructions per weight whatever the number of tokens) and the tensor
// cores do the products. Each weight is dequantized straight into A fragments: (q - z) exactly by the magic-number
// trick, times the group's scale rounded to the activation dtype, which is how the reference path rounds.
//
// The k order inside an mma is free as long as A and B agree. Lane (g = lane / 4, t = lane % 4) reads one 16-byte
// chunk (4 words) of rows g and g + 8; pairs 2h and 2h + 1 of word j form the fragment's two column pairs of k-tile
// (j, h), and the B fragment is then x at 4 consecutive columns: one 8-byte piece of the lane's activations.
//
// Work split: a CTA of 8 warps owns 16 output rows (of each of up to 3 matrices, CTAs in matrix order as in
// gemv_quant; SWIGLU: gate rows and up rows together); the warps split K in 16-word steps per row and reduce
// through shared memory.
#include "quant_layout.cuh"

constexpr int MMA_WARPS = 8;

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (Magic<T>::bits == 0x4300u) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

template <typename T> __device__ __forceinline__ unsigned vec2_bits(typename Vec2<T>::type v) {
    return *reinterpret_cast<unsigned*>(&v);
}

// One row's part of a step: its 4 words, INT3 high bits, and per word the scale pair and magic constant.
template <int BITS, typename T>
struct RowChunk {
    unsigned w[4];
    unsigned high[2];
    typename Vec2<T>::type scale[4];
    unsigned magic_minus[4];
};

template <int BITS, typename T>
__device__ __forceinline__ void load_row_chunk(const QuantMatrix& mat, int row, int words, int first_word, bool valid,
                                               int group_shift, int groups, int scale_is_bf16, int midpoint,
                                               RowChunk<BITS, T>& rc) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    if (!valid) {  // past the end of K: zero weights (the activations there are zero too)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            rc.w[j] = 0u;
            rc.scale[j] = bits_as_vec2<T>(0u);
            rc.magic_minus[j] = magic_minus_zero<T>(0);
        }
        rc.high[0] = rc.high[1] = 0u;
        return;
    }
    const uint4 v = load_stream(reinterpret_cast<const uint4*>(mat.qweight + static_cast<long long>(row) * words +
                                                               first_word));
    rc.w[0] = v.x; rc.w[1] = v.y; rc.w[2] = v.z; rc.w[3] = v.w;
    if constexpr (BITS == 3) {
        const unsigned* high = mat.qhigh + static_cast<long long>(row) * (words / 2) + first_word / 2;
        rc.high[0] = __ldg(high);
        rc.high[1] = __ldg(high + 1);
    }
    // The 4 words span one group, or two (INT2/INT3: 64 columns, groups of 32).
    const long long gi = static_cast<long long>(row) * groups;
    const int group0 = (first_word * cpw) >> group_shift, group1 = ((first_word + 3) * cpw) >> group_shift;
    const float s0 = scale_to_float(__ldg(mat.scales + gi + group0), scale_is_bf16);
    const int z0 = mat.zeros ? static_cast<int>(__ldg(mat.zeros + gi + group0)) : midpoint;
    float s1 = s0;
    int z1 = z0;
    if (group1 != group0) {
        s1 = scale_to_float(__ldg(mat.scales + gi + group1), scale_is_bf16);
        z1 = mat.zeros ? static_cast<int>(__ldg(mat.zeros + gi + group1)) : midpoint;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const bool second = (((first_word + j) * cpw) >> group_shift) != group0;
        const T s = from_float<T>(second ? s1 : s0);
        rc.scale[j] = typename Vec2<T>::type{s, s};
        rc.magic_minus[j] = magic_minus_zero<T>(second ? z1 : z0);
    }
}

// The A fragment pair (pair i of word j) of one row: (q - z) * s in the activation dtype.
template <int BITS, typename T>
__device__ __forceinline__ unsigned a_pair(const RowChunk<BITS, T>& rc, int j, int i) {
    unsigned high = 0u;
    if constexpr (BITS == 3) high = rc.high[j / 2] >> (8 * (j & 1));
    return vec2_bits<T>(__hmul2(weight_pair<BITS, T>(rc.w[j], high, i, rc.magic_minus[j]), rc.scale[j]));
}

// acc[nt] += W[rows g, g + 8; the lane's 4 words] . x[tokens of n-tile nt; the same columns].
template <int BITS, typename T, int NT>
__device__ __forceinline__ void mma_step(const RowChunk<BITS, T>& lo, const RowChunk<BITS, T>& hi,
                                         const uint4 (&xv)[NT][Layout<BITS>::cols_per_word / 2], float (&acc)[NT][4]) {
    constexpr int P = Layout<BITS>::pairs_per_word;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < P / 2; ++h) {
            const unsigned a[4] = {a_pair<BITS, T>(lo, j, 2 * h), a_pair<BITS, T>(hi, j, 2 * h),
                                   a_pair<BITS, T>(lo, j, 2 * h + 1), a_pair<BITS, T>(hi, j, 2 * h + 1)};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                // Columns j * cpw + 4h .. + 3 of this lane's chunk: x pairs j * P + 2h and + 1.
                const int pair = j * P + 2 * h;
                const uint4& v = xv[nt][pair / 4];
                const unsigned b0 = (pair & 3) == 0 ? v.x : v.z, b1 = (pair & 3) == 0 ? v.y : v.w;
                mma_16816<T>(acc[nt], a, b0, b1);
            }
        }
    }
}

template <int BITS, typename T, int NT, bool SWIGLU>
__global__ void __launch_bounds__(32 * MMA_WARPS) gemm_quant_mma(
    const T* __restrict__ x, int M, int ldx,
    const unsigned* qw0, const unsigned* qh0, const unsigned short* sc0, const unsigned char* zr0, const T* bias0,
    int N0,
    const unsigned* qw1, const unsigned* qh1, const unsigned short* sc1, const unsigned char* zr1, const T* bias1,
    int N1,
    const unsigned* qw2, const unsigned* qh2, const unsigned short* sc2, const unsigned char* zr2, const T* bias2,
    int N2,
    const T* __restrict__ residual, int ldr, T* __restrict__ y, int ldy, int K, int group_shift, int groups,
    int scale_is_bf16, int midpoint) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    constexpr int MATS = SWIGLU ? 2 : 1;
    constexpr int XV = cpw / 2;  // uint4 activation pieces per lane and token: 4 words x cpw columns x 2 bytes / 16
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int blocks0 = (N0 + 15) / 16, blocks1 = (N1 + 15) / 16;
    int block = blockIdx.x, N = N0, column = 0;
    QuantMatrix mats[MATS];
    mats[0] = QuantMatrix{qw0, qh0, sc0, zr0};
    if constexpr (SWIGLU) mats[1] = QuantMatrix{qw1, qh1, sc1, zr1};
    const T* bias = bias0;
    if (!SWIGLU && block >= blocks0) {
        block -= blocks0;
        column = N0;
        if (block < blocks1) {
            mats[0] = QuantMatrix{qw1, qh1, sc1, zr1};
            bias = bias1;
            N = N1;
        } else {
            block -= blocks1;
            column = N0 + N1;
            mats[0] = QuantMatrix{qw2, qh2, sc2, zr2};
            bias = bias2;
            N = N2;
        }
    }
    const int row0 = block * 16;
    const int row_lo = min(row0 + g, N - 1), row_hi = min(row0 + g + 8, N - 1);
    const int words = K / cpw;
    float acc[MATS][NT][4];
#pragma unroll
    for (int mi = 0; mi < MATS; ++mi)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mi][nt][c] = 0.0f;
    for (int first = warp * 16; first < words; first += 16 * MMA_WARPS) {
        const int first_word = first + 4 * t;
        const bool valid = first_word < words;  // words % 4 == 0: a lane's 4 words are all in or all out
        RowChunk<BITS, T> lo[MATS], hi[MATS];
#pragma unroll
        for (int mi = 0; mi < MATS; ++mi) {
            load_row_chunk<BITS, T>(mats[mi], row_lo, words, first_word, valid, group_shift, groups, scale_is_bf16,
                                    midpoint, lo[mi]);
            load_row_chunk<BITS, T>(mats[mi], row_hi, words, first_word, valid, group_shift, groups, scale_is_bf16,
                                    midpoint, hi[mi]);
        }
        uint4 xv[NT][XV];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int token = 8 * nt + g;
            const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<long long>(token) * ldx +
                                                              first_word * cpw);
#pragma unroll
            for (int v = 0; v < XV; ++v) xv[nt][v] = valid && token < M ? src[v] : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int mi = 0; mi < MATS; ++mi) mma_step<BITS, T, NT>(lo[mi], hi[mi], xv, acc[mi]);
    }
    // Sum the warps' partial products: [warp][matrix][n-tile][c][lane], conflict-free by lane.
    __shared__ float partial[MMA_WARPS][MATS][NT][4][32];
#pragma unroll
    for (int mi = 0; mi < MATS; ++mi)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) partial[warp][mi][nt][c][lane] = acc[mi][nt][c];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int mi = 0; mi < MATS; ++mi)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                float sum = 0.0f;
#pragma unroll
                for (int w = 0; w < MMA_WARPS; ++w) sum += partial[w][mi][nt][c][lane];
                acc[mi][nt][c] = sum;
            }
    // Accumulator c of n-tile nt: weight row g (+ 8 for c >= 2), token 8 nt + 2t + (c & 1).
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int row = row0 + g + (c >= 2 ? 8 : 0), token = 8 * nt + 2 * t + (c & 1);
            if (row >= N || token >= M) continue;
            float v = acc[0][nt][c];
            if constexpr (SWIGLU) {
                // Round each projection to the activation dtype first, as the unfused path does.
                const float gate = to_float(from_float<T>(v)), up = to_float(from_float<T>(acc[1][nt][c]));
                v = to_float(from_float<T>(silu(gate))) * up;
            }
            if (bias) v += to_float(bias[row]);
            if (residual) v = to_float(from_float<T>(v)) + to_float(residual[token * ldr + column + row]);
            y[token * ldy + column + row] = from_float<T>(v);
        }
}
