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
#include "norm.cuh"
#include "rope_epilogue.cuh"

// acc[s][nt] += W[rows g, g + 8; the lane's 4 words] . x_s[tokens of n-tile nt; the same columns] for each of SETS
// activation sets (a deferred junction's two, see JUNCTION), the weight fragments dequantized once for all sets.
template <int BITS, typename T, int NT, bool POST_SCALE, int SETS>
__device__ __forceinline__ void mma_step(const RowFragments<BITS, T, POST_SCALE>& lo,
                                         const RowFragments<BITS, T, POST_SCALE>& hi,
                                         const uint4 (&xv)[SETS][NT][Layout<BITS>::cols_per_word / 2],
                                         float (&acc)[SETS][NT][4]) {
    constexpr int P = Layout<BITS>::pairs_per_word;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < P / 2; ++h) {
            const unsigned a[4] = {lo.pair(j, 2 * h), hi.pair(j, 2 * h), lo.pair(j, 2 * h + 1), hi.pair(j, 2 * h + 1)};
#pragma unroll
            for (int set = 0; set < SETS; ++set)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    // Columns j * cpw + 4h .. + 3 of this lane's chunk: x pairs j * P + 2h and + 1.
                    const int pair = j * P + 2 * h;
                    const uint4& v = xv[set][nt][pair / 4];
                    const unsigned b0 = (pair & 3) == 0 ? v.x : v.z, b1 = (pair & 3) == 0 ? v.y : v.w;
                    mma_16816<T>(acc[set][nt], a, b0, b1);
                }
        }
    }
}

// The elementwise product of two 16-byte vectors of 8 T values, rounded to T.
template <typename T>
__device__ __forceinline__ uint4 mul8(const uint4& a, const uint4& b) {
    uint4 out;
    out.x = vec2_bits<T>(__hmul2(bits_as_vec2<T>(a.x), bits_as_vec2<T>(b.x)));
    out.y = vec2_bits<T>(__hmul2(bits_as_vec2<T>(a.y), bits_as_vec2<T>(b.y)));
    out.z = vec2_bits<T>(__hmul2(bits_as_vec2<T>(a.z), bits_as_vec2<T>(b.z)));
    out.w = vec2_bits<T>(__hmul2(bits_as_vec2<T>(a.w), bits_as_vec2<T>(b.w)));
    return out;
}

// c + a * r for each T pair of 16-byte vectors a and c (one fused multiply-add, rounded to T, per pair).
template <typename T>
__device__ __forceinline__ uint4 fma8(const uint4& a, typename Vec2<T>::type r, const uint4& c) {
    uint4 out;
    out.x = vec2_bits<T>(__hfma2(bits_as_vec2<T>(a.x), r, bits_as_vec2<T>(c.x)));
    out.y = vec2_bits<T>(__hfma2(bits_as_vec2<T>(a.y), r, bits_as_vec2<T>(c.y)));
    out.z = vec2_bits<T>(__hfma2(bits_as_vec2<T>(a.z), r, bits_as_vec2<T>(c.z)));
    out.w = vec2_bits<T>(__hfma2(bits_as_vec2<T>(a.w), r, bits_as_vec2<T>(c.w)));
    return out;
}

// A deferred sandwich junction's per-row factors from its branch producer's sums (see JUNCTION): sums[m] = (sum b^2,
// sum x u, sum u^2, sum x^2) over the row, u = w_branch * b; the branch norm's 1 / rms(b) and, since the new residual
// h = x + u / rms(b), the next norm's 1 / rms(h) = rsqrt((sum x^2 + 2 r sum x u + r^2 sum u^2) / K + eps).
__device__ __forceinline__ float2 junction_factors(const double* sums, int m, int K, float eps) {
    const double2 s01 = reinterpret_cast<const double2*>(sums)[2 * m];
    const double2 s23 = reinterpret_cast<const double2*>(sums)[2 * m + 1];
    const float r_branch = rsqrtf(static_cast<float>(s01.x) / K + eps);
    const float h_squares = static_cast<float>(s23.y + 2.0 * r_branch * s01.y + double(r_branch) * r_branch * s23.x);
    return make_float2(r_branch, rsqrtf(fmaxf(h_squares, 0.0f) / K + eps));
}

// RoPE epilogue (ROPE, the QKV launch of a decode step: token m is batch row m, one new token each): a CTA's 16 rows
// are 8 dim pairs of one head, rows g and g + 8 of the tile the two dims RoPE rotates together (p, p + D/2 for
// rotate_half; 2p, 2p + 1 interleaved), so each lane holds both dims of its pairs; rotated q goes to q_out
// [M, Hq, D] and rotated K / V into each row's page slot (16-token pages, T), replacing y and the rope_kv_append
// kernel (rope_epilogue.cuh: the same arithmetic). Needs D % 16 == 0.
//
// Deferred sandwich junctions (an experiment, ops_cuda.DEFERRED_JUNCTION), DEFERRED = 1 or 3 (JUNCTION): x is the
// residual stream and the launch's input is norm(x + norm(b; w_branch); w_next) without the junction kernel. Its row
// statistics come from the branch's producer (branch_sums, see SUMS below); since norm(h) W = r_h (h * w_next) W and
// h = x + r_b (w_branch * b), the kernel (1) projects two activation sets, x * w_next and (b * w_branch) * w_next, into
// two accumulators and combines them per token as r_h (acc_x + r_b acc_b); or (3, COMBINED) forms h * w_next as the
// activations arrive, in T with r_b split in two T values (hi + lo: no rounding of r_b itself), and projects that
// one set (half the mma, one accumulator, registers freed once the branch is folded in), scaled by r_h at the end.
// It also writes the new residual stream h (each CTA a slice, rounded as the junction kernel rounds) and zeroes
// `zero_sums`, the sums buffer the next producer accumulates into.
// DEFERRED = 2 (SUMS, the branch producer; plain launches): after rounding its output b, each CTA adds its columns'
// shares of (b^2, x u, u^2, x^2) per token (u = sums_weight * b, x = sums_x) into sums_out [M][4] with fp64 atomics:
// the CTAs' fp32 shares add up exactly in fp64 (or nearly: within 53 bits), so the sums do not depend on the order
// the CTAs arrive in, and graph replays give the eager step's numbers.
// An 8-warp consumer (DEFERRED odd: 1 or 3) is held to 128 registers (2 CTAs per SM; unbounded, DEFERRED = 1 takes
// 136-142 at INT4).
template <int BITS, typename T, int NT, bool SWIGLU, bool POST_SCALE, int WARPS, int DEFERRED, bool ROPE>
__global__ void __launch_bounds__(32 * WARPS, DEFERRED % 2 == 1 && WARPS == 8 ? 2 : 0) gemm_quant_mma(
    const T* __restrict__ x, int M, int ldx,
    const unsigned* qw0, const unsigned* qh0, const unsigned short* sc0, const unsigned char* zr0, const T* bias0,
    int N0,
    const unsigned* qw1, const unsigned* qh1, const unsigned short* sc1, const unsigned char* zr1, const T* bias1,
    int N1,
    const unsigned* qw2, const unsigned* qh2, const unsigned short* sc2, const unsigned char* zr2, const T* bias2,
    int N2,
    const T* __restrict__ residual, int ldr, T* __restrict__ y, int ldy, int K, int group_shift, int groups,
    int scale_is_bf16, int midpoint, const float* rope_cos, const float* rope_sin, T* q_out, T* k_pages,
    T* v_pages, const int* block_table, const int* positions, int max_blocks, int Hq, int Hkv, int D, int layout,
    const T* __restrict__ branch, const T* __restrict__ w_branch, const T* __restrict__ w_next,
    const double* __restrict__ branch_sums, T* __restrict__ total, double* __restrict__ zero_sums, float eps,
    const T* __restrict__ sums_x, const T* __restrict__ sums_weight, double* __restrict__ sums_out) {
    static_assert(!(ROPE && SWIGLU), "the RoPE epilogue serves the QKV projection");
    constexpr bool JUNCTION = DEFERRED == 1 || DEFERRED == 3, COMBINED = DEFERRED == 3, SUMS = DEFERRED == 2;
    static_assert(!SUMS || !(ROPE || SWIGLU), "row sums are made by plain launches");
    constexpr int cpw = Layout<BITS>::cols_per_word;
    constexpr int MATS = SWIGLU ? 2 : 1;
    constexpr int SETS = JUNCTION && !COMBINED ? 2 : 1;
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
    float acc[SETS][NT][4];
#pragma unroll
    for (int set = 0; set < SETS; ++set)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[set][nt][c] = 0.0f;
    // Each step's weights are loaded one step ahead (two steps of loads in flight per lane).
    RowChunk next_lo, next_hi;
    auto load_step = [&](int first) {
        const int first_word = first + 4 * t;
        load_row_chunk<BITS>(mat, row_lo, words, first_word, first, group_shift, groups, midpoint, next_lo);
        load_row_chunk<BITS>(mat, row_hi, words, first_word, first, group_shift, groups, midpoint, next_hi);
    };
    if (k_warp * 16 < words) load_step(k_warp * 16);
    pdl_wait();  // the first step's weights are in flight; x and the outputs belong to earlier kernels
    using T2 = typename Vec2<T>::type;
    T2 r_hi[NT], r_lo[NT];  // COMBINED: r_b of the lane's activation tokens (8 nt + g) as hi + lo, both in T
    if constexpr (COMBINED) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int token = 8 * nt + g;
            const float r = token < M ? junction_factors(branch_sums, token, K, eps).x : 0.0f;
            const T hi = from_float<T>(r), lo = from_float<T>(r - to_float(hi));
            r_hi[nt] = T2{hi, hi};
            r_lo[nt] = T2{lo, lo};
        }
    }
    for (int first = k_warp * 16; first < words; first += 16 * K_WARPS) {
        const int first_word = first + 4 * t;
        const bool valid = first_word < words;  // words % 4 == 0: a lane's 4 words are all in or all out
        const RowChunk lo = next_lo, hi = next_hi;
        if (first + 16 * K_WARPS < words) load_step(first + 16 * K_WARPS);
        // The lane's columns of its tokens' rows of `rows` (x, or a deferred junction's branch).
        auto load_tokens = [&](const T* rows, uint4 (&dst)[NT][XV]) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int token = 8 * nt + g;
                const uint4* src = reinterpret_cast<const uint4*>(rows + static_cast<long long>(token) * ldx +
                                                                  first_word * cpw);
#pragma unroll
                for (int v = 0; v < XV; ++v) dst[nt][v] = valid && token < M ? src[v] : make_uint4(0u, 0u, 0u, 0u);
            }
        };
        uint4 xv[SETS][NT][XV];
        uint4 bv[NT][XV];  // COMBINED: the branch, folded into xv below
        load_tokens(x, xv[0]);
        if constexpr (COMBINED) load_tokens(branch, bv);
        else if constexpr (JUNCTION) load_tokens(branch, xv[SETS - 1]);
        if constexpr (JUNCTION) {
            // The norm weights of the lane's columns (the same for every token). COMBINED: h * w_next =
            // (x + r_lo u + r_hi u) * w_next with u = b * w_branch, each pair in T; otherwise the two sets x * w_next
            // and (b * w_branch) * w_next.
            if (valid) {
                const uint4* wb = reinterpret_cast<const uint4*>(w_branch + first_word * cpw);
                const uint4* wn = reinterpret_cast<const uint4*>(w_next + first_word * cpw);
#pragma unroll
                for (int v = 0; v < XV; ++v) {
                    const uint4 b_weight = __ldg(wb + v), n_weight = __ldg(wn + v);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        if constexpr (COMBINED) {
                            const uint4 u = mul8<T>(bv[nt][v], b_weight);
                            const uint4 h = fma8<T>(u, r_hi[nt], fma8<T>(u, r_lo[nt], xv[0][nt][v]));
                            xv[0][nt][v] = mul8<T>(h, n_weight);
                        } else {
                            xv[0][nt][v] = mul8<T>(xv[0][nt][v], n_weight);
                            xv[SETS - 1][nt][v] = mul8<T>(mul8<T>(xv[SETS - 1][nt][v], b_weight), n_weight);
                        }
                    }
                }
            }
        }
        const RowFragments<BITS, T, POST_SCALE> flo(lo, first_word, group_shift, scale_is_bf16),
            fhi(hi, first_word, group_shift, scale_is_bf16);
        if constexpr (POST_SCALE) {
            float step[SETS][NT][4];
#pragma unroll
            for (int set = 0; set < SETS; ++set)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) step[set][nt][c] = 0.0f;
            mma_step<BITS, T, NT, POST_SCALE, SETS>(flo, fhi, xv, step);
            // Accumulators 0, 1 belong to row g, 2, 3 to row g + 8: their rows' scales. (The lanes of a quad read
            // the same group here, so any lane's scale is the row's.)
            const float s_lo = scale_to_float(lo.scale_bits[0], scale_is_bf16);
            const float s_hi = scale_to_float(hi.scale_bits[0], scale_is_bf16);
#pragma unroll
            for (int set = 0; set < SETS; ++set)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    acc[set][nt][0] = fmaf(s_lo, step[set][nt][0], acc[set][nt][0]);
                    acc[set][nt][1] = fmaf(s_lo, step[set][nt][1], acc[set][nt][1]);
                    acc[set][nt][2] = fmaf(s_hi, step[set][nt][2], acc[set][nt][2]);
                    acc[set][nt][3] = fmaf(s_hi, step[set][nt][3], acc[set][nt][3]);
                }
        } else {
            mma_step<BITS, T, NT, POST_SCALE, SETS>(flo, fhi, xv, acc);
        }
    }
    if constexpr (JUNCTION) {
        // The new residual stream h = x + norm(b; w_branch) as the junction kernel rounds it, 8 columns a thread,
        // the rows' vectors spread over the grid's CTAs.
        const int vectors_per_row = K / 8, vectors = M * vectors_per_row;
        const int per_cta = (vectors + gridDim.x - 1) / gridDim.x;
        for (int i = threadIdx.x; i < per_cta; i += blockDim.x) {
            const int index = blockIdx.x * per_cta + i;
            if (index >= vectors) break;
            const int m = index / vectors_per_row, col = (index % vectors_per_row) * 8;
            const float r_branch = junction_factors(branch_sums, m, K, eps).x;
            float xs[8], bs[8], ws[8];
            load8_as_float(x + static_cast<long long>(m) * ldx + col, xs);
            load8_as_float(branch + static_cast<long long>(m) * ldx + col, bs);
            load8_as_float(w_branch + col, ws);
            const T* tag = nullptr;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float normed = round_to(round_to(bs[e] * r_branch, tag) * ws[e], tag);
                xs[e] = round_to(xs[e] + normed, tag);
            }
            store_row8(total + static_cast<long long>(m) * K + col, xs);
        }
        if (zero_sums != nullptr && blockIdx.x == 0 && threadIdx.x < 4 * M) zero_sums[threadIdx.x] = 0.0;
    }
    // Sum the warps' partial products per matrix: [warp][n-tile][c][lane], conflict-free by lane. A deferred junction
    // first combines its two sets per token: r_h (acc_x + r_b acc_b).
    __shared__ float partial[WARPS][NT][4][32];
    if constexpr (JUNCTION) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int token = 8 * nt + 2 * t + j;
                const float2 factors =
                    token < M ? junction_factors(branch_sums, token, K, eps) : make_float2(0.0f, 0.0f);
#pragma unroll
                for (int c = j; c < 4; c += 2)
                    partial[warp][nt][c][lane] = COMBINED ? factors.y * acc[0][nt][c]
                                                          : factors.y * fmaf(factors.x, acc[SETS - 1][nt][c],
                                                                             acc[0][nt][c]);
            }
    } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) partial[warp][nt][c][lane] = acc[0][nt][c];
    }
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
    float shares[NT][2][4];  // producer sums: this lane's columns' (b^2, x u, u^2, x^2) per token
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) shares[nt][j][q] = 0.0f;
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
            const T out = from_float<T>(v);
            y[token * ldy + column + row] = out;
            if constexpr (SUMS) {
                const float b = to_float(out), u = to_float(sums_weight[column + row]) * b;
                const float r = to_float(sums_x[static_cast<long long>(token) * ldy + column + row]);
                float* share = shares[nt][c & 1];
                share[0] = fmaf(b, b, share[0]);
                share[1] = fmaf(r, u, share[1]);
                share[2] = fmaf(u, u, share[2]);
                share[3] = fmaf(r, r, share[3]);
            }
        }
    if constexpr (!SUMS) return;
    // Sum over the lanes' rows (g: lane bits 2-4), then lanes 0-3 add their tokens' sums.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float v = shares[nt][j][q];
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                const int token = 8 * nt + 2 * t + j;
                if (g == 0 && token < M) atomicAdd(sums_out + 4 * token + q, static_cast<double>(v));
            }
}
