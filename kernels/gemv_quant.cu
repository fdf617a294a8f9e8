// Low-bit weight GEMV for decode: y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, g]) * s[n, g]  (m < M <= MAXM).
// The weight layout is described in quant_layout.cuh.
//
// Work split: a CTA of 4 warps; each warp owns R output rows (each activation chunk is loaded once, used R
// times); lanes stride over the row in 16-byte weight loads. Epilogues: + bias, + residual, or SwiGLU
// (SWIGLU: a second matrix "up" with the same shape; y = silu(gate . x) * (up . x)).
#include "norm.cuh"
#include "gemv_rows.cuh"
#include "rope_epilogue.cuh"

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
