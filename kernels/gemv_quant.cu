// Low-bit weight GEMV for decode: y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, g]) * s[n, g]  (m < M <= MAXM).
// The weight layout is described in quant_layout.cuh.
//
// Work split: a CTA of 4 warps; each warp owns R output rows (each activation chunk is loaded once, used R
// times); lanes stride over the row in 16-byte weight loads. Epilogues: + bias, + residual, or SwiGLU
// (SWIGLU: a second matrix "up" with the same shape; y = silu(gate . x) * (up . x)).
#include "norm.cuh"
#include "gemv_dot.cuh"
#include "rope_epilogue.cuh"

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

// One-row INT4/INT8 launches with R = 2 are held to 64 registers (8 CTAs of 128 threads per SM, no spills, checked
// with ptxas_report): large matrices then run in close to whole waves (16384 rows: 2048 CTAs over 1056 slots)
// instead of 1.55 waves of R = 4 CTAs at 96 registers. INT2/INT3 would spill at 64.
template <int BITS, int MAXM, int R> struct GemvOccupancy {
    static constexpr int min_ctas = MAXM == 1 && R == 2 && (BITS == 4 || BITS == 8) ? 8 : 1;
};

// One launch serves up to three matrices sharing K and the format (QKV: outputs concatenated along columns of
// y), or (SWIGLU) a gate matrix 0 and an up matrix 1 of the same shape. CTAs are assigned to matrices in order.
// KSPLIT warps share each R rows and split K between them (summed through shared memory): short rows and
// long-K / few-row layers (down_proj) then have more loads in flight and shorter dependent chains per warp.
// Junction prologue (jx not null): x is not given but computed by every CTA from the residual stream jx and the
// previous sublayer's output jbranch as the block's residual junction (norm.cuh) into shared memory (dynamic, M * K
// elements); CTA 0 also writes the new residual stream to jsum. This replaces a separate junction kernel.
// RoPE epilogue (ROPE, one token, the QKV launch): each warp owns the two dims RoPE rotates together (rows
// p, p + D/2 of a head for rotate_half, 2p, 2p + 1 interleaved) and writes rotated q to q_out and rotated K / V
// into the token's page slot (16-token pages, T), replacing y and the rope_kv_append kernel.
template <int BITS, typename T, int MAXM, int R, bool SWIGLU, int KSPLIT, bool ROPE>
__global__ void __launch_bounds__(128, GemvOccupancy<BITS, MAXM, R>::min_ctas) gemv_quant(
    const T* __restrict__ x, int M, int ldx,
    const unsigned* qw0, const unsigned* qh0, const unsigned short* sc0, const unsigned char* zr0, const T* bias0,
    int N0,
    const unsigned* qw1, const unsigned* qh1, const unsigned short* sc1, const unsigned char* zr1, const T* bias1,
    int N1,
    const unsigned* qw2, const unsigned* qh2, const unsigned short* sc2, const unsigned char* zr2, const T* bias2,
    int N2,
    const T* __restrict__ residual, int ldr, T* __restrict__ y, int ldy, int K, int group_shift, int groups,
    int scale_is_bf16, int midpoint, const T* jx, const T* jbranch, const T* jw_branch, const T* jw_next, T* jsum,
    float eps, int mode, const float* rope_cos, const float* rope_sin, T* q_out, T* k_pages, T* v_pages,
    const int* block_table, const int* positions, int max_blocks, int Hq, int Hkv, int D, int layout) {
    static_assert(!ROPE || (MAXM == 1 && R == 2 && !SWIGLU), "the RoPE epilogue: one token, one dim pair per warp");
    pdl_trigger();
    constexpr int GROUPS_PER_CTA = 4 / KSPLIT;
    constexpr int ROWS_PER_CTA = GROUPS_PER_CTA * R;
    constexpr int MATS = SWIGLU ? 2 : 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row_group = warp / KSPLIT, part = warp % KSPLIT;
    const ProjectionSlot<T> slot =
        select_projection<T>(blockIdx.x, ROWS_PER_CTA, SWIGLU, QuantMatrix{qw0, qh0, sc0, zr0}, bias0, N0,
                             QuantMatrix{qw1, qh1, sc1, zr1}, bias1, N1, QuantMatrix{qw2, qh2, sc2, zr2}, bias2, N2);
    const QuantMatrix mat = slot.mat;
    const T* bias = slot.bias;
    const int N = slot.N, column = slot.column, block = slot.block;
    extern __shared__ __align__(16) unsigned char staged_bytes[];
    T* staged = reinterpret_cast<T*>(staged_bytes);
    if (jx != nullptr) {
        pdl_wait();  // the junction reads the previous kernels' outputs
        for (int m = 0; m < M; ++m)
            junction_row(jx + static_cast<long long>(m) * K, jbranch + static_cast<long long>(m) * K, jw_branch,
                         jw_next, blockIdx.x == 0 ? jsum + static_cast<long long>(m) * K : nullptr, staged + m * K,
                         K, eps, mode);
        __syncthreads();
    }
    int row0 = (block * GROUPS_PER_CTA + row_group) * R, row_step = 1;
    if (ROPE && layout == 0 && row0 < N) {  // rotate_half: pair p of a head is dims (p, p + D/2)
        const int pair = row0 / 2, half = D / 2;
        row0 = (pair / half) * D + pair % half;
        row_step = half;
    }
    if (KSPLIT == 1 && row0 >= N) return;  // with KSPLIT > 1 every warp reaches the barrier below
    float acc[MATS][R][MAXM];
    auto dots = [&](const T* __restrict__ in, int ld) {
        row_dots_any<BITS, T, MAXM, R, KSPLIT>(mat, row0, row_step, N, K, group_shift, groups, scale_is_bf16,
                                               midpoint, in, ld, M, part, acc[0]);
        if constexpr (SWIGLU) {
            const QuantMatrix up{qw1, qh1, sc1, zr1};
            row_dots_any<BITS, T, MAXM, R, KSPLIT>(up, row0, row_step, N, K, group_shift, groups, scale_is_bf16,
                                                   midpoint, in, ld, M, part, acc[1]);
        }
    };
    // Two copies of the loop: activations from shared memory (the junction's output) or global memory, each read
    // with its own load instruction instead of a generic one.
    if (jx != nullptr)
        dots(staged, K);
    else
        dots(x, ldx);
    if constexpr (KSPLIT > 1) {
        __shared__ float partial[4][MATS][R][MAXM];
        if (lane == 0)
#pragma unroll
            for (int mi = 0; mi < MATS; ++mi)
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int m = 0; m < MAXM; ++m) partial[warp][mi][r][m] = acc[mi][r][m];
        __syncthreads();
        if (part != 0 || row0 >= N) return;
#pragma unroll
        for (int mi = 0; mi < MATS; ++mi)
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int m = 0; m < MAXM; ++m)
#pragma unroll
                    for (int p = 1; p < KSPLIT; ++p) acc[mi][r][m] += partial[warp + p][mi][r][m];
    }
    if constexpr (SWIGLU) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                // Round each projection to the activation dtype first, as the unfused path does.
                const float g = to_float(from_float<T>(acc[0][r][m])), u = to_float(from_float<T>(acc[1][r][m]));
                acc[0][r][m] = to_float(from_float<T>(silu(g))) * u;
            }
    }
    if (lane != 0) return;
    if constexpr (ROPE) {  // one token: its q / k dims (d0, d1), q into q_out, K / V straight into its page slot
        const int d0 = row0 % D, d1 = d0 + row_step * (R - 1), head = row0 / D;
        float a = acc[0][0][0], c = acc[0][1][0];
        if (bias) {
            a += to_float(bias[row0]);
            c += to_float(bias[row0 + row_step]);
        }
        store_rope_pair<T>(a, c, column, head, d0, d1, layout == 0 ? d0 : d0 / 2, rope_cos, rope_sin, q_out, k_pages,
                           v_pages, block_table, positions, Hq, Hkv, D);
        return;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = row0 + r;
        if (row >= N) break;
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m < M) {
                float v = acc[0][r][m];
                if (bias) v += to_float(bias[row]);
                if (residual) v = to_float(from_float<T>(v)) + to_float(residual[m * ldr + column + row]);
                y[m * ldy + column + row] = from_float<T>(v);
            }
        }
    }
}
