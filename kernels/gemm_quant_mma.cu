// Tensor-core low-bit GEMM for a few token rows (2-16 per launch: verify passes, small batches):
// y[m, n] = sum_k x[m, k] * ((q[n, k] - z[n, g]) * s[n, g])  for INT2/3/4/8 weights (layout: quant_layout.cuh).
//
// mma.sync m16n8k16 with the weights as the 16-row A operand and the tokens as N (8 per n-tile, NT tiles), so
// the CUDA cores only dequantize (about 2 instructions per weight whatever the number of tokens) and the tensor
// cores do the products. Each weight is dequantized straight into A fragments: (q - z) exactly by the magic-number
// trick (INT8: in fp32), times the group's scale rounded to the activation dtype, which is how the reference path
// rounds; or, when a step (16 words of a row) lies in one group (POST_SCALE), the scale multiplies the step's fp32
// sums instead.
//
// The k order inside an mma is free as long as A and B agree. Lane (g = lane / 4, t = lane % 4) reads one 16-byte
// chunk (4 words) of rows g and g + 8; pairs 2h and 2h + 1 of word j form the fragment's two column pairs of k-tile
// (j, h), and the B fragment is then x at 4 consecutive columns: one 8-byte piece of the lane's activations.
//
// Work split: a CTA of WARPS warps (8, or 16 where the grid has too few CTAs to fill the GPU) owns 16 output rows (of
// each of up to 3 matrices, CTAs in matrix order as in gemv_quant; SWIGLU: gate rows and up rows together, half of
// the warps each); the warps split K in 16-word steps per row and reduce through shared memory.
#include "mma_fragments.cuh"
#include "rope_epilogue.cuh"

// acc[nt] += W[rows g, g + 8; the lane's 4 words] . x[tokens of n-tile nt; the same columns].
template <int BITS, typename T, int NT, bool POST_SCALE>
__device__ __forceinline__ void mma_step(const RowFragments<BITS, T, POST_SCALE>& lo,
                                         const RowFragments<BITS, T, POST_SCALE>& hi,
                                         const uint4 (&xv)[NT][Layout<BITS>::cols_per_word / 2], float (&acc)[NT][4]) {
    constexpr int P = Layout<BITS>::pairs_per_word;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < P / 2; ++h) {
            const unsigned a[4] = {lo.pair(j, 2 * h), hi.pair(j, 2 * h), lo.pair(j, 2 * h + 1), hi.pair(j, 2 * h + 1)};
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

// RoPE epilogue (ROPE, the QKV launch of a decode step: token m is batch row m, one new token each): a CTA's 16 rows
// are 8 dim pairs of one head, rows g and g + 8 of the tile the two dims RoPE rotates together (p, p + D/2 for
// rotate_half; 2p, 2p + 1 interleaved), so each lane holds both dims of its pairs; rotated q goes to q_out
// [M, Hq, D] and rotated K / V into each row's page slot (16-token pages, T), replacing y and the rope_kv_append
// kernel (rope_epilogue.cuh: the same arithmetic). Needs D % 16 == 0.
template <int BITS, typename T, int NT, bool SWIGLU, bool POST_SCALE, int WARPS, bool ROPE>
__global__ void __launch_bounds__(32 * WARPS) gemm_quant_mma(
    const T* __restrict__ x, int M, int ldx,
    const unsigned* qw0, const unsigned* qh0, const unsigned short* sc0, const unsigned char* zr0, const T* bias0,
    int N0,
    const unsigned* qw1, const unsigned* qh1, const unsigned short* sc1, const unsigned char* zr1, const T* bias1,
    int N1,
    const unsigned* qw2, const unsigned* qh2, const unsigned short* sc2, const unsigned char* zr2, const T* bias2,
    int N2,
    const T* __restrict__ residual, int ldr, T* __restrict__ y, int ldy, int K, int group_shift, int groups,
    int scale_is_bf16, int midpoint, const float* rope_cos, const float* rope_sin, T* q_out, T* k_pages,
    T* v_pages, const int* block_table, const int* positions, int max_blocks, int Hq, int Hkv, int D, int layout) {
    static_assert(!(ROPE && SWIGLU), "the RoPE epilogue serves the QKV projection");
    constexpr int cpw = Layout<BITS>::cols_per_word;
    constexpr int MATS = SWIGLU ? 2 : 1;
    constexpr int XV = cpw / 2;  // uint4 activation pieces per lane and token: 4 words x cpw columns x 2 bytes / 16
    pdl_trigger();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const ProjectionSlot<T> slot =
        select_projection<T>(blockIdx.x, 16, SWIGLU, QuantMatrix{qw0, qh0, sc0, zr0}, bias0, N0,
                             QuantMatrix{qw1, qh1, sc1, zr1}, bias1, N1, QuantMatrix{qw2, qh2, sc2, zr2}, bias2, N2);
    // SWIGLU: the first half of the warps serves gate, the second up, each half splitting K (a warp holds one
    // matrix's loads and sums: the registers, and with them the CTAs per SM, of a plain launch).
    constexpr int K_WARPS = WARPS / MATS;
    const int mi = warp / K_WARPS, k_warp = warp % K_WARPS;
    const QuantMatrix mat = SWIGLU && mi == 1 ? QuantMatrix{qw1, qh1, sc1, zr1} : slot.mat;
    const T* bias = slot.bias;
    const int N = slot.N, column = slot.column, block = slot.block;
    const int row0 = block * 16;
    int row_lo = min(row0 + g, N - 1), row_hi = min(row0 + g + 8, N - 1);
    const int head = ROPE ? block / (D / 16) : 0;  // ROPE: tile `block` holds pairs pair0 .. pair0 + 7 of `head`
    if constexpr (ROPE) {
        const int pair = (block % (D / 16)) * 8 + g;
        row_lo = head * D + (layout == 0 ? pair : 2 * pair);
        row_hi = layout == 0 ? row_lo + D / 2 : row_lo + 1;
    }
    const int words = K / cpw;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[nt][c] = 0.0f;
    // Each step's weights are loaded one step ahead (two steps of loads in flight per lane).
    RowChunk next_lo, next_hi;
    auto load_step = [&](int first) {
        const int first_word = first + 4 * t;
        load_row_chunk<BITS>(mat, row_lo, words, first_word, first, group_shift, groups, midpoint, next_lo);
        load_row_chunk<BITS>(mat, row_hi, words, first_word, first, group_shift, groups, midpoint, next_hi);
    };
    if (k_warp * 16 < words) load_step(k_warp * 16);
    pdl_wait();  // the first step's weights are in flight; x and the outputs belong to earlier kernels
    for (int first = k_warp * 16; first < words; first += 16 * K_WARPS) {
        const int first_word = first + 4 * t;
        const bool valid = first_word < words;  // words % 4 == 0: a lane's 4 words are all in or all out
        const RowChunk lo = next_lo, hi = next_hi;
        if (first + 16 * K_WARPS < words) load_step(first + 16 * K_WARPS);
        uint4 xv[NT][XV];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int token = 8 * nt + g;
            const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<long long>(token) * ldx +
                                                              first_word * cpw);
#pragma unroll
            for (int v = 0; v < XV; ++v) xv[nt][v] = valid && token < M ? src[v] : make_uint4(0u, 0u, 0u, 0u);
        }
        const RowFragments<BITS, T, POST_SCALE> flo(lo, first_word, group_shift, scale_is_bf16),
            fhi(hi, first_word, group_shift, scale_is_bf16);
        if constexpr (POST_SCALE) {
            float step[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) step[nt][c] = 0.0f;
            mma_step<BITS, T, NT, POST_SCALE>(flo, fhi, xv, step);
            // Accumulators 0, 1 belong to row g, 2, 3 to row g + 8: their rows' scales. (The lanes of a quad read
            // the same group here, so any lane's scale is the row's.)
            const float s_lo = scale_to_float(lo.scale_bits[0], scale_is_bf16);
            const float s_hi = scale_to_float(hi.scale_bits[0], scale_is_bf16);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                acc[nt][0] = fmaf(s_lo, step[nt][0], acc[nt][0]);
                acc[nt][1] = fmaf(s_lo, step[nt][1], acc[nt][1]);
                acc[nt][2] = fmaf(s_hi, step[nt][2], acc[nt][2]);
                acc[nt][3] = fmaf(s_hi, step[nt][3], acc[nt][3]);
            }
        } else {
            mma_step<BITS, T, NT, POST_SCALE>(flo, fhi, xv, acc);
        }
    }
    // Sum the warps' partial products per matrix: [warp][n-tile][c][lane], conflict-free by lane.
    __shared__ float partial[WARPS][NT][4][32];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) partial[warp][nt][c][lane] = acc[nt][c];
    __syncthreads();
    if (warp != 0) return;
    float sums[MATS][NT][4];
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                float sum = 0.0f;
#pragma unroll
                for (int w = 0; w < K_WARPS; ++w) sum += partial[m * K_WARPS + w][nt][c][lane];
                sums[m][nt][c] = sum;
            }
    // Accumulator c of n-tile nt: weight row g (+ 8 for c >= 2), token 8 nt + 2t + (c & 1).
    if constexpr (ROPE) {
        const int d0 = row_lo - head * D, d1 = row_hi - head * D, p = layout == 0 ? d0 : d0 / 2;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int token = 8 * nt + 2 * t + j;
                if (token >= M) continue;
                float a = sums[0][nt][j], c = sums[0][nt][2 + j];
                if (bias) {
                    a += to_float(bias[row_lo]);
                    c += to_float(bias[row_hi]);
                }
                const long long angles = static_cast<long long>(token) * (D / 2);
                store_rope_pair<T>(a, c, column, head, d0, d1, p, rope_cos + angles, rope_sin + angles,
                                   q_out + static_cast<long long>(token) * Hq * D, k_pages, v_pages,
                                   block_table + static_cast<long long>(token) * max_blocks, positions + token, Hq,
                                   Hkv, D);
            }
        return;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int row = row0 + g + (c >= 2 ? 8 : 0), token = 8 * nt + 2 * t + (c & 1);
            if (row >= N || token >= M) continue;
            float v = sums[0][nt][c];
            if constexpr (SWIGLU) {
                // Round each projection to the activation dtype first, as the unfused path does.
                const float gate = to_float(from_float<T>(v)), up = to_float(from_float<T>(sums[MATS - 1][nt][c]));
                v = to_float(from_float<T>(silu(gate))) * up;
            }
            if (bias) v += to_float(bias[row]);
            if (residual) v = to_float(from_float<T>(v)) + to_float(residual[token * ldr + column + row]);
            y[token * ldy + column + row] = from_float<T>(v);
        }
}
