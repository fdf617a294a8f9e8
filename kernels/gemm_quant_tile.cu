// Tensor-core low-bit GEMM for many token rows (prompt forwards, decode batches past GEMV_MAX_ROWS):
// y[m, column + n] = sum_k x[m, k] * T((q[n, k] - z[n, g]) * T(s[n, g])) (+ bias) for 1-3 matrices of one format,
// concatenated along y's columns: the values dequantize_weights + cuBLAS multiply, without writing and re-reading a
// 16-bit copy of every weight.
//
// A CTA owns 16 * WARPS weight rows (16 per warp, as A fragments of mma.sync m16n8k16: mma_fragments.cuh) and
// 8 * NT tokens (the N side, NT n-tiles of 8). The tokens' activations are staged in shared memory by cp.async, a step
// (16 words of a row: 16 * cols_per_word columns) per stage, STAGES - 1 steps ahead, and every warp reads them there:
// each weight is loaded and dequantized once per 8 * NT tokens, and each activation crosses from L2 once per CTA (the
// 16-row kernel, gemm_quant_mma.cu, re-reads all of x in every CTA, which dominates past 32 rows). A warp's own
// weights go from global memory to registers, two steps ahead. K may be split over gridDim.z CTAs where the row and
// token tiles alone would leave SMs idle: the splits' fp32 sums go to `partial` and gemm_tile_reduce adds them (and,
// for gate/up, applies SwiGLU: then `partial` is used even with one split).
#include "mma_fragments.cuh"

constexpr int TILE_STAGES = 3;  // activation steps in shared memory (the host sizes dynamic shared memory with it)

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    // src-size 0 copies nothing and zero-fills the 16 bytes (tokens past M, columns past K).
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                     static_cast<unsigned>(__cvta_generic_to_shared(dst))),
                 "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Where 16-byte chunk c of token row r lies in its staged row. Lane (g, t) reads word 4t + j of the step for token
// 8 nt + g; the XOR spreads the 8 lanes of each 16-byte access phase (g = 2i, 2i + 1, t = 0..3) over distinct banks
// (INT4: chunk 4t + j; INT2/3: chunks 2 (4t + j) and + 1; INT8, 8-byte reads: at most 2 lanes per bank).
__device__ __forceinline__ int tile_swizzle(int c, int r) { return c ^ (((c >> 3) & 3) << 1) ^ (r & 1); }

// The x pairs (2 columns each, as 32-bit words) of word w of a step for staged token row r: cols_per_word columns.
template <int BITS>
__device__ __forceinline__ void staged_word(const uint4* row, int r, int w, unsigned (&xp)[Layout<BITS>::pairs_per_word]) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    if constexpr (cpw == 4) {  // INT8: 8 bytes, half a chunk
        const uint2 v = reinterpret_cast<const uint2*>(row + tile_swizzle(w >> 1, r))[w & 1];
        xp[0] = v.x;
        xp[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < cpw / 8; ++i) {  // INT4: one chunk; INT2/3: two
            const uint4 v = row[tile_swizzle(w * (cpw / 8) + i, r)];
            xp[4 * i] = v.x;
            xp[4 * i + 1] = v.y;
            xp[4 * i + 2] = v.z;
            xp[4 * i + 3] = v.w;
        }
    }
}

// acc[nt] += W[rows g, g + 8; the lane's 4 words of the step] . x[tokens 8 nt .. 8 nt + 7; the same columns], with
// x from the staged step `stage` ([8 NT][2 cols_per_word] chunks). Word by word: its A fragments are made once and
// serve every n-tile.
template <int BITS, typename T, int NT>
__device__ __forceinline__ void tile_step(const RowFragments<BITS, T, false>& lo, const RowFragments<BITS, T, false>& hi,
                                          const uint4* stage, int g, int t, float (&acc)[NT][4]) {
    constexpr int P = Layout<BITS>::pairs_per_word, CHUNKS = 2 * Layout<BITS>::cols_per_word;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        unsigned a[P / 2][4];
#pragma unroll
        for (int h = 0; h < P / 2; ++h) {
            a[h][0] = lo.pair(j, 2 * h);
            a[h][1] = hi.pair(j, 2 * h);
            a[h][2] = lo.pair(j, 2 * h + 1);
            a[h][3] = hi.pair(j, 2 * h + 1);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int r = 8 * nt + g;
            unsigned xp[P];
            staged_word<BITS>(stage + r * CHUNKS, r, 4 * t + j, xp);
#pragma unroll
            for (int h = 0; h < P / 2; ++h) mma_16816<T>(acc[nt], a[h], xp[2 * h], xp[2 * h + 1]);
        }
    }
}

// x [M, K] (row stride ldx, 16-byte aligned rows) times the matrices -> y [M, ldy] at each matrix's column (partial
// null), or fp32 partial sums without the bias -> partial [gridDim.z][M][ldy] (gemm_tile_reduce finishes them).
// Grid: (row tiles of all matrices, token tiles, K splits of steps_per_split steps). Needs K % 8 == 0 and
// (K / cols_per_word) % 4 == 0 (a lane's 4 words all in K or all past it).
template <int BITS, typename T, int NT, int WARPS>
__global__ void __launch_bounds__(32 * WARPS) gemm_quant_tile(
    const T* __restrict__ x, int M, int ldx,
    const unsigned* qw0, const unsigned* qh0, const unsigned short* sc0, const unsigned char* zr0, int N0,
    const unsigned* qw1, const unsigned* qh1, const unsigned short* sc1, const unsigned char* zr1, int N1,
    const unsigned* qw2, const unsigned* qh2, const unsigned short* sc2, const unsigned char* zr2, int N2,
    const T* __restrict__ bias, T* __restrict__ y, float* __restrict__ partial, int ldy, int K, int group_shift,
    int groups, int scale_is_bf16, int midpoint, int steps_per_split) {
    constexpr int cpw = Layout<BITS>::cols_per_word, CHUNKS = 2 * cpw, TOKENS = 8 * NT;
    constexpr int STAGE = TOKENS * CHUNKS;  // uint4 per staged step
    extern __shared__ __align__(16) uint4 staged[];  // [TILE_STAGES][TOKENS][CHUNKS]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const ProjectionSlot<T> slot =
        select_projection<T>(blockIdx.x, 16 * WARPS, false, QuantMatrix{qw0, qh0, sc0, zr0}, nullptr, N0,
                             QuantMatrix{qw1, qh1, sc1, zr1}, nullptr, N1, QuantMatrix{qw2, qh2, sc2, zr2}, nullptr, N2);
    const QuantMatrix mat = slot.mat;
    const int N = slot.N, row0 = slot.block * 16 * WARPS + warp * 16;
    const int row_lo = min(row0 + g, N - 1), row_hi = min(row0 + g + 8, N - 1);  // rows past N: loaded, not stored
    const int m0 = blockIdx.y * TOKENS;
    const int words = K / cpw, steps = (words + 15) / 16;
    const int s_begin = blockIdx.z * steps_per_split, s_end = min(steps, s_begin + steps_per_split);

    // Step s's activations (16 * cpw columns of the CTA's tokens) into stage buffer `buffer`.
    auto stage_x = [&](int s, int buffer) {
        uint4* dst = staged + buffer * STAGE;
        const int col0 = s * 16 * cpw;
        for (int i = threadIdx.x; i < STAGE; i += 32 * WARPS) {
            const int r = i / CHUNKS, c = i % CHUNKS, col = col0 + 8 * c;
            const bool valid = m0 + r < M && col < K;
            cp_async16(dst + r * CHUNKS + tile_swizzle(c, r),
                       valid ? x + static_cast<long long>(m0 + r) * ldx + col : x, valid);
        }
    };
    auto load_weights = [&](int s, RowChunk& lo, RowChunk& hi) {
        if (s >= s_end) return;
        const int first = 16 * s, first_word = first + 4 * t;
        load_row_chunk<BITS>(mat, row_lo, words, first_word, first, group_shift, groups, midpoint, lo);
        load_row_chunk<BITS>(mat, row_hi, words, first_word, first, group_shift, groups, midpoint, hi);
    };

#pragma unroll
    for (int k = 0; k < TILE_STAGES - 1; ++k) {  // every thread commits one group per step, staged or not
        if (s_begin + k < s_end) stage_x(s_begin + k, k);
        cp_async_commit();
    }
    RowChunk even_lo, even_hi, odd_lo, odd_hi;  // the weights of the next two steps (registers: fixed names)
    load_weights(s_begin, even_lo, even_hi);
    load_weights(s_begin + 1, odd_lo, odd_hi);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[nt][c] = 0.0f;

    auto step = [&](int s, RowChunk& lo, RowChunk& hi) {
        cp_async_wait<TILE_STAGES - 2>();  // this thread's copies of step s have landed
        __syncthreads();                   // everyone's have, and everyone is done with step s - 1's buffer
        const int ahead = s + TILE_STAGES - 1;
        if (ahead < s_end) stage_x(ahead, (ahead - s_begin) % TILE_STAGES);
        cp_async_commit();
        const int first_word = 16 * s + 4 * t;
        const RowFragments<BITS, T, false> flo(lo, first_word, group_shift, scale_is_bf16),
            fhi(hi, first_word, group_shift, scale_is_bf16);
        load_weights(s + 2, lo, hi);  // the fragments hold step s's words: the registers take step s + 2's
        tile_step<BITS, T, NT>(flo, fhi, staged + ((s - s_begin) % TILE_STAGES) * STAGE, g, t, acc);
    };
    for (int s = s_begin; s < s_end; s += 2) {
        step(s, even_lo, even_hi);
        if (s + 1 < s_end) step(s + 1, odd_lo, odd_hi);
    }
    cp_async_wait<0>();  // no copy outlives the CTA's shared memory

    // Accumulator c of n-tile nt: weight row g (+ 8 for c >= 2), token 8 nt + 2t + (c & 1).
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int row = row0 + g + (c >= 2 ? 8 : 0), token = m0 + 8 * nt + 2 * t + (c & 1);
            if (row >= N || token >= M) continue;
            const long long at = static_cast<long long>(token) * ldy + slot.column + row;
            if (partial != nullptr) {
                partial[blockIdx.z * static_cast<long long>(M) * ldy + at] = acc[nt][c];
            } else {
                const float b = bias ? to_float(bias[slot.column + row]) : 0.0f;
                y[at] = from_float<T>(acc[nt][c] + b);
            }
        }
}

// y [M, ldy] = T(sum over `splits` of partial[split][M][ldy], + bias[column]), one element per thread; with SWIGLU,
// partial's rows are [gate | up] (2 ldy columns) and y = T(T(silu(T(gate))) * T(up)), as gemv_quant.cu rounds it.
template <typename T, bool SWIGLU>
__global__ void gemm_tile_reduce(const float* __restrict__ partial, int splits, int count, int ldy,
                                 const T* __restrict__ bias, T* __restrict__ y) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const int column = static_cast<int>(i % ldy);
    if constexpr (SWIGLU) {
        const long long at = i + (i / ldy) * ldy;  // row m's gate column: m * 2 ldy + column
        float gate = 0.0f, up = 0.0f;
        for (int s = 0; s < splits; ++s) {
            gate += partial[s * 2LL * count + at];
            up += partial[s * 2LL * count + at + ldy];
        }
        if (bias) {
            gate += to_float(bias[column]);
            up += to_float(bias[ldy + column]);
        }
        const float g = to_float(from_float<T>(gate)), u = to_float(from_float<T>(up));
        y[i] = from_float<T>(to_float(from_float<T>(silu(g))) * u);
    } else {
        float sum = 0.0f;
        for (int s = 0; s < splits; ++s) sum += partial[s * static_cast<long long>(count) + i];
        y[i] = from_float<T>(bias ? sum + to_float(bias[column]) : sum);
    }
}
