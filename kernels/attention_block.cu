// The attention block of one decode token (batch 1) in one launch: the QKV projection with RoPE and the K/V append,
// paged attention over the cached tokens, and the output projection. The per-op path runs these as three kernels
// (QKV GEMV, paged decode, O GEMV), and at batch 1 a decode step is bound by such kernel boundaries, not by bytes.
// One thread-block cluster of CLUSTER CTAs serves each KV head h (its G = Hq / Hkv query heads):
//   1. Rank c projects its share of the group's (G + 2) * D / 2 QKV dim pairs (q of the G heads, k, v; the two dims
//      RoPE rotates together in one warp, row_dots of gemv_rows.cuh), rotates q and k, writes the new token's K/V
//      into its page slot and keeps the values, rounded to T, in shared memory.
//   2. After a cluster barrier every CTA gathers the group's q, k and v from its peers (distributed shared memory),
//      attends its split of the tokens (the new one from shared memory), and after a second barrier merges every
//      peer's softmax state itself, so each CTA holds the group's whole attention output (in T).
//   3. Rank c computes rows [c H / C, (c + 1) H / C) of o_proj over the group's columns only (a K slice of G * D)
//      into fp32 partials [Hkv][H]; the last of the Hkv CTAs of rank c to finish (counted in counters[c], which it
//      resets for the next launch) sums the partials of those rows in head order and writes them to out in T.
// Rounding mirrors the per-op kernels (gemv_quant.cu's RoPE epilogue, paged_attention.cu's output in T); the order
// of the fp32 sums differs (attention splits, and o_proj per KV group, then across groups).
// Cached tokens' K/V and the CTA's o_proj weights are prefetched into L2 before the projection: they do not depend
// on the kernels before this one (pages of earlier steps; lengths, positions and block tables are filled before a
// graph's replay), so with programmatic launch they load while the junction kernel before it runs.
#include "gemv_rows.cuh"
#include "cluster.cuh"
#include "attend_step.cuh"

namespace ablock {

constexpr int CLUSTER = 8;
constexpr int PAGE = 16;
constexpr int UNROLL = 2;  // tokens per sub per step of the token loop

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

template <typename T, int D, int MAXG, int WARPS, int SCALE_BF16>
__global__ void __launch_bounds__(WARPS * 32, 2) attention_block(
    const T* __restrict__ x,  // the normed input row [H]
    const unsigned* qw_q, const unsigned short* sc_q, const unsigned char* zr_q,
    const unsigned* qw_k, const unsigned short* sc_k, const unsigned char* zr_k,
    const unsigned* qw_v, const unsigned short* sc_v, const unsigned char* zr_v,
    const unsigned* qw_o, const unsigned short* sc_o, const unsigned char* zr_o,
    int H, int group_shift, int groups_in, int groups_o, int midpoint,
    const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, int layout,
    T* k_pages, T* v_pages, const int* __restrict__ block_table, const int* __restrict__ positions,
    const int* __restrict__ lengths, const int* __restrict__ starts, float* partials, int* counters, T* out, int Hq,
    int Hkv, float scale_log2, unsigned long long* trace) {
    pdl_trigger();
    // Profiling (eval/attention_block_profile.py; null otherwise): %globaltimer (ns, one clock for all SMs) at
    // point k of this CTA, [CTA][8]. (Stamp 0 is written before pdl_wait: no kernel before this one touches it.)
    auto mark = [&](int k) {
        if (trace != nullptr && threadIdx.x == 0) {
            unsigned long long now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            trace[(blockIdx.x * CLUSTER + blockIdx.z) * 8 + k] = now;
        }
    };
    mark(0);
    static_assert(WARPS % 2 == 0, "the shared-memory offset of `attn` is 16-byte aligned for an even warp count");
    constexpr int THREADS = WARPS * 32;
    constexpr int per_token = D / 8, subs = THREADS / per_token;
    extern __shared__ __align__(16) float smem[];
    const int G = Hq / Hkv;
    const int h = blockIdx.x, rank = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int quarter = D / 4, tasks_per_cta = (G + 2) * quarter / CLUSTER;
    const int values = (G + 2) * D;
    float* mine = smem;                        // [(G + 2) D]: this CTA's projected values, at their group index
    float* full = mine + values;               // [(G + 2) D]: the group's q (pre-scaled), k_new, v_new
    float* warp_o = full + values;             // [WARPS][G][D]
    float* warp_ml = warp_o + WARPS * G * D;   // [WARPS][G][2]
    float* cta_o = warp_ml + WARPS * G * 2;    // [G][D]
    float* cta_ml = cta_o + G * D;             // [G][2]
    T* attn = reinterpret_cast<T*>(cta_ml + (2 * G + 3) / 4 * 4);  // [G][D] (16-byte aligned)

    // Lengths, starts, positions and block tables are filled before the step (before a graph's replay): read before
    // the wait. (Read again after the projection instead of kept: live across it they cost row_dots registers.)
    const int rows_per_rank = H / CLUSTER, slice = G * D, chunks_per_row = slice / 32, words_o = Hq * D / 8;
    // The page slot of token t of this KV head (16-token pages [blocks][Hkv][16][D]).
    auto slot_of = [&](int t) {
        return (static_cast<long long>(block_table[t / PAGE]) * Hkv + h) * PAGE + (t & (PAGE - 1));
    };
    auto split_of = [&](int length, int& t0, int& n) {  // this rank's tokens [t0, t0 + n)
        const int span = (length + CLUSTER - 1) / CLUSTER;
        t0 = rank * span;
        n = max(0, min(length, t0 + span) - t0);
    };
    // L2 prefetch: the split's cached K/V (the new token's slot is written below) and this CTA's o_proj slice.
    {
        const int length = __ldg(lengths), start = __ldg(starts);
        int t0, n;
        split_of(length, t0, n);
        constexpr int LINES = D * static_cast<int>(sizeof(T)) / 128 > 0 ? D * static_cast<int>(sizeof(T)) / 128 : 1;
        for (int i = threadIdx.x; i < n * LINES; i += THREADS) {
            const int t = t0 + i / LINES;
            if (t >= length - 1 || t < start) continue;
            const long long slot = slot_of(t);
            const int line = (i % LINES) * (128 / static_cast<int>(sizeof(T)));
            prefetch_l2(k_pages + slot * D + line);
            prefetch_l2(v_pages + slot * D + line);
        }
        for (int r = threadIdx.x; r < rows_per_rank; r += THREADS)
            prefetch_l2(qw_o + static_cast<long long>(rank * rows_per_rank + r) * words_o + h * slice / 8);
    }

    // The q / k / v tensors by index, from shared memory: selected from the kernel's parameters they would hold
    // nine pointers in registers across the projection.
    __shared__ const void* matrices[3][3];
    if (threadIdx.x == 0) {
        matrices[0][0] = qw_q, matrices[0][1] = sc_q, matrices[0][2] = zr_q;
        matrices[1][0] = qw_k, matrices[1][1] = sc_k, matrices[1][2] = zr_k;
        matrices[2][0] = qw_v, matrices[2][1] = sc_v, matrices[2][2] = zr_v;
    }
    __syncthreads();

    // ---- 1. the group's QKV rows of this rank: two dim pairs per warp task (4 rows in one row_dots pass) ----
    // Task j of a head's matrix (q of a query head, k, v) holds pairs p and p + D/4 (rotate_half: rows p, p + D/4,
    // p + D/2, p + 3D/4; interleaved: pairs 2j, 2j + 1 = rows 4j .. 4j + 3).
    for (int j = warp; j < tasks_per_cta; j += WARPS) {
        const int task = rank * tasks_per_cta + j, m = task / quarter, jj = task % quarter;
        const int which = m < G ? 0 : m - G + 1;  // 0 q, 1 k, 2 v
        const int base = which == 0 ? (h * G + m) * D : h * D;
        const int first = layout == 0 ? jj : 4 * jj, step = layout == 0 ? quarter : 1;
        const QuantMatrix mat{static_cast<const unsigned*>(matrices[which][0]), nullptr,
                              static_cast<const unsigned short*>(matrices[which][1]),
                              static_cast<const unsigned char*>(matrices[which][2])};
        const int N = which == 0 ? Hq * D : Hkv * D;
        float acc[4][1];
        // Rows of whole 16-byte chunks (the host checks H % 32 == 0), the scale dtype fixed: one copy of the loop.
        row_dots<4, T, 1, 4, 1, true, SCALE_BF16>(mat, base + first, step, N, H, group_shift, groups_in, SCALE_BF16,
                                                  midpoint, x, H, 1, 0, acc);
        if (lane < 2) {  // lane k finishes pair k of the task: gemv_quant.cu's RoPE epilogue (store_rope_pair)
            // rotate_half: pair k = rows (k, k + 2) of the four, dims (jj + k * D/4, + D/2), angle jj + k * D/4;
            // interleaved: rows (2k, 2k + 1), dims (4jj + 2k, + 1), angle 2jj + k.
            const int r0 = layout == 0 ? lane : 2 * lane, r1 = layout == 0 ? lane + 2 : 2 * lane + 1;
            const int d0 = first + r0 * step, d1 = first + r1 * step;
            const int p = layout == 0 ? d0 : d0 / 2;
            const float a = to_float(from_float<T>(acc[r0][0])), c = to_float(from_float<T>(acc[r1][0]));
            float out0 = a, out1 = c;
            if (which < 2) {
                const float cs = rope_cos[p], sn = rope_sin[p];
                out0 = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(c, sn));
                out1 = __fadd_rn(__fmul_rn(c, cs), __fmul_rn(a, sn));
            }
            const T v0 = from_float<T>(out0), v1 = from_float<T>(out1);
            const int index = m * D;  // the head's place in `mine`: q heads, then k, then v
            mine[index + d0] = to_float(v0);
            mine[index + d1] = to_float(v1);
            if (which > 0) {
                const long long slot = slot_of(__ldg(positions));
                T* pages = which == 1 ? k_pages : v_pages;
                pages[slot * D + d0] = v0;
                pages[slot * D + d1] = v1;
            }
        }
    }
    mark(1);
    pdl_wait();  // (row_dots waited already; warps without a task wait here, before they read x's kernel's outputs)
    cluster_barrier();
    mark(2);

    // ---- 2. gather q / k / v, attend this rank's tokens, merge the cluster's states ----
    const int length = __ldg(lengths), start = __ldg(starts);
    int t0, n;
    split_of(length, t0, n);
    const int r0 = rank * rows_per_rank, col0 = h * slice;
    for (int i = threadIdx.x; i < values; i += THREADS) {
        const int d = i % D, jj = layout == 0 ? d % quarter : d / 4;
        const int owner = ((i / D) * quarter + jj) / tasks_per_cta;
        const float value = load_peer_shared(mine + i, owner);
        full[i] = i < G * D ? value * scale_log2 : value;
    }
    __syncthreads();
    const float* q_s = full;
    const float* k_new = full + G * D;
    const float* v_new = k_new + D;
    const int sub = threadIdx.x / per_token, offset = (threadIdx.x % per_token) * 8;
    const int new_token = length - 1;
    float m[MAXG], l[MAXG], o[MAXG][8];
    empty_states<MAXG>(m, l, o);
    for (int base = 0; base < n; base += UNROLL * subs) {
        uint4 k_raw[UNROLL], v_raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * subs + sub, t = t0 + i;
            k_raw[u] = v_raw[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i < n && t != new_token && t >= start) {
                const long long slot = slot_of(t);
                k_raw[u] = *reinterpret_cast<const uint4*>(k_pages + slot * D + offset);
                v_raw[u] = *reinterpret_cast<const uint4*>(v_pages + slot * D + offset);
            }
        }
        bool from_new[UNROLL], attended[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * subs + sub, t = t0 + i;
            from_new[u] = t == new_token;
            attended[u] = i < n && t >= start;
        }
        attend_step<T, D, MAXG, UNROLL>(k_raw, v_raw, from_new, attended, q_s, k_new, v_new, G, offset, m, l, o);
    }
    // The subs of a warp (lanes with the same offset) merged with shuffles, then the warps in shared memory.
    merge_warp_states<MAXG, per_token>(m, l, o);
    store_warp_state<D, MAXG>(m, l, o, G, lane, warp_o + warp * G * D, warp_ml + warp * G * 2);
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += THREADS) {
        const int g = idx / D;
        float top, sum;
        cta_o[idx] = merged_states<WARPS, D>(warp_o, warp_ml, G, g, idx % D, top, sum);
        if (idx % D == 0) {
            cta_ml[2 * g] = top;
            cta_ml[2 * g + 1] = sum;
        }
    }
    mark(3);
    cluster_barrier();
    for (int idx = threadIdx.x; idx < G * D; idx += THREADS) {
        const int g = idx / D;
        attn[idx] = from_float<T>(cluster_merged<CLUSTER>(cta_ml, cta_o, g, idx));
    }
    cluster_barrier();  // every peer has read this CTA's state (and `attn` is complete)
    mark(4);

    // ---- 3. o_proj rows of this rank over the group's columns; the last CTA of the rank sums the groups ----
    // Up to O_ITEMS (row, 32-column chunk) items per lane, every load issued before any math.
    constexpr int O_ITEMS = 2;
    const int items = rows_per_rank * chunks_per_row;
    for (int first = warp * 32; first < items; first += O_ITEMS * THREADS) {
        uint4 w[O_ITEMS];
        unsigned short scale_bits[O_ITEMS];
        int zero[O_ITEMS];
#pragma unroll
        for (int k = 0; k < O_ITEMS; ++k) {
            const int item = first + k * THREADS + lane, row = r0 + item / chunks_per_row;
            const int column = col0 + (item % chunks_per_row) * 32;
            w[k] = make_uint4(0u, 0u, 0u, 0u);
            scale_bits[k] = 0;
            zero[k] = midpoint;
            if (item < items) {
                w[k] = load_stream(reinterpret_cast<const uint4*>(qw_o + static_cast<long long>(row) * words_o +
                                                                  column / 8));
                load_group(QuantMatrix{qw_o, nullptr, sc_o, zr_o},
                           static_cast<unsigned>(row * groups_o + (column >> group_shift)), midpoint, scale_bits[k],
                           zero[k]);
            }
        }
#pragma unroll
        for (int k = 0; k < O_ITEMS; ++k) {
            const int item = first + k * THREADS + lane, chunk = item % chunks_per_row;
            float acc = 0.0f;
            const unsigned words[4] = {w[k].x, w[k].y, w[k].z, w[k].w};
            const uint4* xs = reinterpret_cast<const uint4*>(attn + chunk * 32);
            const float scale = scale_to_float(scale_bits[k], SCALE_BF16);
            const unsigned mm = magic_minus_zero<T>(zero[k]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint4 xv[1][1] = {{xs[i]}};
                accumulate_word<4, T, 1>(words[i], 0u, scale, zero[k], mm, xv, 1, &acc);
            }
            for (int width = chunks_per_row / 2; width > 0; width >>= 1)
                acc += __shfl_xor_sync(0xffffffffu, acc, width);  // the row's chunks: aligned groups of lanes
            if (item < items && chunk == 0) partials[static_cast<long long>(h) * H + r0 + item / chunks_per_row] = acc;
        }
    }
    mark(5);
    __shared__ int is_last;
    __threadfence();  // this CTA's partials are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        is_last = atomicAdd(counters + rank, 1) == Hkv - 1;
        if (is_last) counters[rank] = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Eight groups' partials in flight at a time (a plain loop would wait out one L2 round trip per group), summed
    // in group order.
    for (int r = threadIdx.x; r < rows_per_rank; r += THREADS) {
        float sum = 0.0f;
        for (int g0 = 0; g0 < Hkv; g0 += 8) {
            float part[8];
#pragma unroll
            for (int i = 0; i < 8; ++i)
                part[i] = g0 + i < Hkv ? __ldcg(partials + static_cast<long long>(g0 + i) * H + r0 + r) : 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += part[i];
        }
        out[r0 + r] = from_float<T>(sum);
    }
    mark(6);
}

}  // namespace ablock
