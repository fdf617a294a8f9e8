// The CUDA-core GEMV's row loop (used by gemv_quant.cu): R weight rows of one warp dotted with up to MAXM activation
// rows, weights streamed in 16-byte chunks, two chunks per lane in flight.
#pragma once
#include "gemv_dot.cuh"

// The loads of one 16-byte chunk (or one tail word) of R rows: weights, INT3's high plane, scales and zeros of
// the (at most two) groups it spans.
template <int BITS, int R>
struct Chunk {
    unsigned w[R][4];
    unsigned high[R][2];
    unsigned short scale_bits[R][2];
    int zero[R][2];
};

// A chunk spans one group, except INT2/INT3 chunks (64 columns) with 32-column groups: two.
template <int BITS> struct ChunkGroups { static constexpr int count = BITS == 4 || BITS == 8 ? 1 : 2; };

template <int BITS, int R>
__device__ __forceinline__ void load_chunk(const QuantMatrix& mat, int row0, int row_step, int N, int words,
                                           int groups, int midpoint, int first_word, bool full, int group0,
                                           int group1, Chunk<BITS, R>& ch) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        // 32-bit offsets (the host checks every packed tensor has < 2^31 elements): one IMAD.WIDE per address.
        const unsigned row = min(row0 + r * row_step, N - 1);
        const unsigned* base = mat.qweight + (row * static_cast<unsigned>(words) + first_word);
        if (full) {
            const uint4 v = load_stream(reinterpret_cast<const uint4*>(base));
            ch.w[r][0] = v.x; ch.w[r][1] = v.y; ch.w[r][2] = v.z; ch.w[r][3] = v.w;
        } else {
            ch.w[r][0] = __ldg(base);
        }
        if constexpr (BITS == 3) {
            const unsigned* high = mat.qhigh + static_cast<long long>(row) * (words / 2) + first_word / 2;
            ch.high[r][0] = __ldg(high);
            ch.high[r][1] = full ? __ldg(high + 1) : 0u;
        }
        const unsigned gi = row * static_cast<unsigned>(groups);
        load_group(mat, gi + group0, midpoint, ch.scale_bits[r][0], ch.zero[r][0]);
        if constexpr (ChunkGroups<BITS>::count == 2)
            load_group(mat, gi + group1, midpoint, ch.scale_bits[r][1], ch.zero[r][1]);
    }
}

// Groups are 32, 64 or 128 columns (or the whole row): the group of column c is c >> group_shift (31 per channel).
// Every load of a chunk is issued before any math and the next chunk's loads before this chunk's math, so two
// chunks per lane are in flight; scales and the magic constants are converted once per chunk and row.
// The warp's rows are row0 + r * row_step (row_step 1, or D/2 to pair the dims RoPE rotates together).
template <int BITS, typename T, int MAXM, int R, int KSPLIT, bool ALL_FULL, int SCALE_BF16>
__device__ __forceinline__ void row_dots(const QuantMatrix& mat, int row0, int row_step, int N, int K,
                                         int group_shift, int groups, int scale_is_bf16, int midpoint,
                                         const T* __restrict__ x, int ldx, int M, int part, float (&acc)[R][MAXM]) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    constexpr int NG = ChunkGroups<BITS>::count;
    constexpr int STRIDE = 32 * KSPLIT;  // the KSPLIT warps of a row group interleave their chunks
    const int lane = part * 32 + (threadIdx.x & 31);
    const int words = K / cpw;
    const int chunks = words % 4 == 0 ? words / 4 : 0;  // 16-byte loads need 16-byte aligned rows
    const int total = chunks + (words - 4 * chunks);     // c < chunks: a 16-byte chunk of 4 words; beyond: 1 word
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.0f;
    auto first_word_of = [&](int c) { return ALL_FULL || c < chunks ? 4 * c : 4 * chunks + (c - chunks); };
    auto load = [&](int c, Chunk<BITS, R>& ch) {
        const bool full = ALL_FULL || c < chunks;
        const int first_word = first_word_of(c);
        const int group0 = (first_word * cpw) >> group_shift;
        const int group1 = ((first_word + (full ? 3 : 0)) * cpw) >> group_shift;
        load_chunk<BITS, R>(mat, row0, row_step, N, words, groups, midpoint, first_word, full, group0, group1, ch);
    };
    // Rows past N were loaded clamped (load_chunk): every row is accumulated without a test, the caller drops them.
    auto accumulate = [&](int c, const Chunk<BITS, R>& cur) {
        const bool full = ALL_FULL || c < chunks;
        const int first_word = first_word_of(c);
        const int group0 = (first_word * cpw) >> group_shift;
        float scale[R][NG];
        unsigned magic_minus[R][NG];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int k = 0; k < NG; ++k) {
                scale[r][k] = scale_to_float(cur.scale_bits[r][k], SCALE_BF16 < 0 ? scale_is_bf16 : SCALE_BF16);
                magic_minus[r][k] = magic_minus_zero<T>(cur.zero[r][k]);
            }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (i == 0 || full) {
                const int word_index = first_word + i;
                const int col0 = word_index * cpw;
                // A select, not a run-time array index (which would put the arrays in local memory).
                const bool second = NG == 2 && (col0 >> group_shift) != group0;
                uint4 xv[MAXM][XWords<BITS>::count];
                load_x<BITS, T, MAXM>(x, ldx, col0, M, xv);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    unsigned high = 0u;
                    if constexpr (BITS == 3) high = cur.high[r][i / 2] >> (8 * (word_index & 1));
                    const int k = NG - 1;  // the second group's index where there is one
                    accumulate_word<BITS, T, MAXM>(cur.w[r][i], high, second ? scale[r][k] : scale[r][0],
                                                   second ? cur.zero[r][k] : cur.zero[r][0],
                                                   second ? magic_minus[r][k] : magic_minus[r][0], xv, M, acc[r]);
                }
            }
        }
    };
    // Unrolled by two with the buffers swapping roles, so no chunk is copied between registers; each chunk's math
    // runs with the other buffer's loads in flight. A load past the end reloads the lane's last chunk (an L2 hit)
    // instead of branching around the loads.
    Chunk<BITS, R> even, odd;
    if (lane < total) {
        load(lane, even);
        load(lane + STRIDE < total ? lane + STRIDE : lane, odd);
    }
    // Both first chunks are in flight (with programmatic launch, while the previous kernel still runs: at K 2048 a
    // lane's whole share); x (and everything written below) comes from earlier kernels.
    pdl_wait();
    for (int c = lane; c < total; c += 2 * STRIDE) {
        const int c1 = c + STRIDE, c2 = c1 + STRIDE;
        accumulate(c, even);
        if (c1 >= total) break;
        load(c2 < total ? c2 : c1, even);
        accumulate(c1, odd);
        if (c2 >= total) break;
        const int c3 = c2 + STRIDE;
        load(c3 < total ? c3 : c2, odd);
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = warp_sum(acc[r][m]);
}

// ALL_FULL (every row a whole number of 16-byte chunks, the usual case) compiles the loop without the per-word
// tail test, and with the scale dtype (SCALE_BF16 1 or 0) fixed instead of tested per chunk; other rows take the
// general loop (SCALE_BF16 -1: the dtype read from scale_is_bf16).
template <int BITS, typename T, int MAXM, int R, int KSPLIT>
__device__ __forceinline__ void row_dots_any(const QuantMatrix& mat, int row0, int row_step, int N, int K,
                                             int group_shift, int groups, int scale_is_bf16, int midpoint,
                                             const T* __restrict__ x, int ldx, int M, int part,
                                             float (&acc)[R][MAXM]) {
    if ((K / Layout<BITS>::cols_per_word) % 4 != 0)
        row_dots<BITS, T, MAXM, R, KSPLIT, false, -1>(mat, row0, row_step, N, K, group_shift, groups, scale_is_bf16,
                                                      midpoint, x, ldx, M, part, acc);
    else if (scale_is_bf16)
        row_dots<BITS, T, MAXM, R, KSPLIT, true, 1>(mat, row0, row_step, N, K, group_shift, groups, scale_is_bf16,
                                                    midpoint, x, ldx, M, part, acc);
    else
        row_dots<BITS, T, MAXM, R, KSPLIT, true, 0>(mat, row0, row_step, N, K, group_shift, groups, scale_is_bf16,
                                                    midpoint, x, ldx, M, part, acc);
}
