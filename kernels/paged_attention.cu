// Paged attention for decode (Q new query tokens per row, Q = 1 for plain decode; Q > 1 for a short continuation
// such as a speculative verify, causal among the new tokens) with split-KV and a log-sum-exp merge.
//
// Pages: K/V [blocks, Hkv, 16, D] in T, or int8 with fp32 scales [blocks, Hkv, 16] (one per token and KV head).
// An INT8 decode step (Q = 1) can take its new tokens' K/V in T from staging pages instead (staged_k / staged_v
// [B, Hkv, 16, D], row b's token at slot position % 16 of page b: where the QKV launch's RoPE epilogue wrote them);
// the CTA that attends a new token quantizes it into the pages itself, so no rope_kv_append launch is needed.
// block_table [B, max_blocks] int32; lengths[b] = cached tokens including the new ones; starts[b] = first valid
// position (left padding before it is never attended). All of these live in device memory, so a captured CUDA
// graph replays with new lengths. Grid (Hkv, B, splits): a CTA serves every query head of its KV head for every
// new token (G * Q <= 8 query vectors read each K/V byte once). q and out: [B * Q, Hq, D]. Scores use exp2 with q
// pre-scaled by softmax_scale * log2(e).
//
// Splits come in units of CLUSTER CTAs (a thread-block cluster on sm_90+, CLUSTER = 8; single CTAs before). A
// row's length is spread over as many units as keep each CTA at <= tokens_per_split tokens (the rest exit at
// once), so a short context is served by one unit, which merges its CTAs' partial softmax states through
// distributed shared memory: no global-memory round trip, fence or counter. With more units (long contexts),
// every CTA writes fp32 partials (o, m, l) and the last CTA of a (row, KV head) to finish — counted in
// split_counters, which it resets for the next launch — merges them.
#include "cluster.cuh"

constexpr int PAGE = 16;

// 8 consecutive K or V elements of one token and head as loaded (a 16-byte load in T; 8 bytes and the token's
// scale in int8): kept raw until used, so UNROLL tokens' loads fit in registers together.
struct Raw8 {
    uint4 bits;
    float scale;
};

template <typename T, int KV_INT8>
__device__ __forceinline__ Raw8 load_raw8(const void* pages, const float* scales, int slot, int D, int offset) {
    Raw8 raw;
    if constexpr (KV_INT8) {
        const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const signed char*>(pages) +
                                                        static_cast<long long>(slot) * D + offset);
        raw.bits = make_uint4(v.x, v.y, 0u, 0u);
        raw.scale = scales[slot];
    } else {
        raw.bits = *reinterpret_cast<const uint4*>(static_cast<const T*>(pages) + static_cast<long long>(slot) * D +
                                                   offset);
        raw.scale = 1.0f;
    }
    return raw;
}

// The 8 elements as floats, int8 ones without their scale (the caller multiplies a token's dot product by its K
// scale and its softmax weight by its V scale: 2 multiplies per token instead of 16). int8 -> float without I2F (a
// conversion runs at 1/8 of the FP32 rate on sm_90; dropping it took INT8 KV decode at 2,048 tokens x 16 rows from
// 1,368 to 1,543 tok/s on the H200): the byte, offset by 128, becomes the low mantissa byte of 2^23 (one PRMT), and
// one FADD removes 2^23 + 128, exactly.
template <typename T, int KV_INT8>
__device__ __forceinline__ void raw8_to_float(const Raw8& raw, float (&out)[8]) {
    if constexpr (KV_INT8) {
        const unsigned words[2] = {raw.bits.x ^ 0x80808080u, raw.bits.y ^ 0x80808080u};
#pragma unroll
        for (int i = 0; i < 8; ++i)
            out[i] = __uint_as_float(__byte_perm(words[i / 4], 0x4B000000u, 0x7540u + (i % 4))) - 8388736.0f;
    } else {
        const unsigned words[4] = {raw.bits.x, raw.bits.y, raw.bits.z, raw.bits.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = to_float2(bits_as_vec2<T>(words[i]));
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    }
}

// A new token's K or V (8 elements of one head) from the QKV projection's staging page, quantized as rope_kv_append
// does (s = max|x| / 127 over the head's D elements, round(x / s)) and written to the int8 pages and scales; returns
// what load_raw8 would then read. PER_TOKEN: the D/8 threads of the token (an aligned group of lanes, all of which
// call this together) reduce the maximum.
template <typename T, int PER_TOKEN>
__device__ __forceinline__ Raw8 quantize_staged(const T* staged, long long staged_slot, void* pages, float* scales,
                                                int slot, int D, int offset) {
    Raw8 raw;
    raw.bits = *reinterpret_cast<const uint4*>(staged + staged_slot * D + offset);
    float x[8];
    raw8_to_float<T, 0>(raw, x);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(x[e]));
    const unsigned lane = threadIdx.x & 31;
    const unsigned group = PER_TOKEN == 32 ? 0xffffffffu : ((1u << PER_TOKEN) - 1u) << (lane & ~(PER_TOKEN - 1u));
#pragma unroll
    for (int width = PER_TOKEN / 2; width > 0; width >>= 1) amax = fmaxf(amax, __shfl_xor_sync(group, amax, width));
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    unsigned words[2] = {0u, 0u};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int code = __float2int_rn(fminf(fmaxf(x[e] / scale, -127.0f), 127.0f));
        words[e / 4] |= (static_cast<unsigned>(code) & 0xFFu) << (8 * (e % 4));
    }
    *reinterpret_cast<uint2*>(static_cast<signed char*>(pages) + static_cast<long long>(slot) * D + offset) =
        make_uint2(words[0], words[1]);
    if (offset == 0) scales[slot] = scale;
    raw.bits = make_uint4(words[0], words[1], 0u, 0u);
    raw.scale = scale;
    return raw;
}

// A token is served by D/8 consecutive threads (a "sub", 8 elements each), so a CTA of THREADS threads works on 8 *
// THREADS / D tokens at once. Each sub keeps an online softmax state (running max m and sum l per query vector, its 8
// output dims) over its tokens: the token loop has no barrier, and K and V loads of UNROLL tokens per thread are in
// flight together (raw: 10 registers each), with the next tokens' page numbers loaded behind them. MAX_GROUP (1, 2, 4
// or 8) bounds the query vectors per CTA (G * Q). THREADS (128 or 256) x UNROLL set how many tokens a CTA has in flight
// per step of its token loop.
template <typename T, int KV_INT8, int MAX_GROUP, int CLUSTER, int D, int THREADS, int UNROLL>
__global__ void __launch_bounds__(THREADS) paged_decode(
    const T* __restrict__ q, void* k_pages, void* v_pages, float* k_scale, float* v_scale, const T* staged_k,
    const T* staged_v, const int* __restrict__ block_table, const int* __restrict__ lengths,
    const int* __restrict__ starts, T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
    int* __restrict__ split_counters, int Hq, int Hkv, int Q, int max_blocks, int tokens_per_split, float scale_log2,
    int trigger_late) {
    // trigger_late: the next launch (the O projection) may start only once this one is past pdl_wait, so that a
    // programmatic launch of this kernel does not let the O projection's CTAs compete with the QKV projection's.
    if (!trigger_late) pdl_trigger();
    extern __shared__ float smem[];
    // V query vectors per CTA: the G heads of the KV group for each of the row's Q new tokens (v = j * G + g).
    const int G = Hq / Hkv, V = G * Q;
    // D is a template argument: the index arithmetic (threads per token, subs, element of a vector) is shifts and
    // the subs' merge unrolls, which at batch 16 (64-256 tokens per CTA) is most of a CTA's instructions otherwise.
    constexpr int per_token = D / 8, subs = THREADS / per_token, warps = THREADS / 32;
    const int kv_head = blockIdx.x, b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* q_s = smem;                        // [V][D]; after the token loop, the CTA's merged (unnormalized) o
    float* sub_o = q_s + V * D;               // [subs][V][D]
    float* sub_ml = sub_o + subs * V * D;     // [subs][V][2]: max, sum
    float* cta_ml = sub_ml + subs * V * 2;    // [V][2]
    float* weights = cta_ml + 2 * V;          // [V][splits]: the global merge's weight per split
    // Query vector v's output / query row: token j = v / G of the row (position length - Q + j), head g = v % G.
    auto row_of = [&](int v) { return (static_cast<long long>(b) * Q + v / G) * Hq + kv_head * G + v % G; };
    // Lengths, starts and block tables are filled before the step (before a graph's replay), so they and the K/V of
    // cached tokens are read before pdl_wait; q and the new tokens' K/V come from the kernel before (see below).
    const int length = lengths[b], start = starts[b];  // loaded first: the page numbers wait on them
    const int units = splits / CLUSTER, per_unit = CLUSTER * tokens_per_split;
    const int active = min(units, max(1, (length + per_unit - 1) / per_unit)) * CLUSTER;
    if (split >= active) return;  // whole units: no peer of this CTA waits for it
    const int span = (length + active - 1) / active;
    const int t0 = split * span, n = max(0, min(length, t0 + span) - t0);
    const int sub = threadIdx.x / per_token, offset = (threadIdx.x % per_token) * 8;
    const int* table = block_table + static_cast<long long>(b) * max_blocks;
    int page[UNROLL];
    auto pages_of = [&](int base) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * subs + sub;
            page[u] = i < n ? table[(t0 + i) / PAGE] : 0;
        }
    };
    pages_of(0);
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][8];
    empty_states(m, l, acc);
    // The K and V loads of one step of the token loop (UNROLL tokens per sub; the page numbers of the next step are
    // loaded behind them). FULL: every token of the step is valid, no bounds tests.
    Raw8 k_raw[UNROLL], v_raw[UNROLL];
    bool waited = false;  // set after pdl_wait: from then on the QKV projection's outputs may be read
    auto load_token = [&](int u, int i, int page_number) {
        const int t = t0 + i, slot = (page_number * Hkv + kv_head) * PAGE + (t & (PAGE - 1));
        if (KV_INT8 && staged_k != nullptr && waited && t >= length - Q) {
            // A new token of an INT8 cache: the QKV launch's RoPE epilogue left it in T in a staging page per row.
            const long long staged_slot = (static_cast<long long>(b) * Hkv + kv_head) * PAGE + (t & (PAGE - 1));
            k_raw[u] = quantize_staged<T, per_token>(staged_k, staged_slot, k_pages, k_scale, slot, D, offset);
            v_raw[u] = quantize_staged<T, per_token>(staged_v, staged_slot, v_pages, v_scale, slot, D, offset);
            return;
        }
        k_raw[u] = load_raw8<T, KV_INT8>(k_pages, k_scale, slot, D, offset);
        v_raw[u] = load_raw8<T, KV_INT8>(v_pages, v_scale, slot, D, offset);
    };
    auto load_step = [&](int base, const bool FULL) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * subs + sub;
            if (FULL || i < n) load_token(u, i, page[u]);
            else k_raw[u] = v_raw[u] = Raw8{make_uint4(0u, 0u, 0u, 0u), 0.0f};  // zeros: p = 0 times v stays 0
        }
        if (base + UNROLL * subs < n) pages_of(base + UNROLL * subs);
    };
    // The first step's loads are issued before pdl_wait: with programmatic launch (graphs on sm_90+) they run while
    // the QKV projection before this kernel still does. Only the step's new tokens (positions from length - Q on,
    // which that kernel writes) are loaded again after the wait (page[] holds the next step's pages by then).
    load_step(0, false);
    pdl_wait();
    if (trigger_late) pdl_trigger();
    waited = true;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int i = u * subs + sub;
        if (i < n && t0 + i >= length - Q) load_token(u, i, table[(t0 + i) / PAGE]);
    }
    for (int i = threadIdx.x; i < V * D; i += THREADS)
        q_s[i] = to_float(q[row_of(i / D) * D + i % D]) * scale_log2;
    __syncthreads();  // q_s
    // The math of a step whose loads are in k_raw / v_raw. FULL: every token of the step is valid and attended (in
    // [start, the first new token's position]), so the step runs without bounds tests or masks.
    // (Called with a constant FULL at two sites: each inlined copy is specialized.)
    auto token_step = [&](int base, const bool FULL) {
        // Scores (log2 domain); the D/8 threads of a token reduce with shuffles inside their aligned group.
        float s[UNROLL][MAX_GROUP];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * subs + sub, t = t0 + i;
            float k[8];
            raw8_to_float<T, KV_INT8>(k_raw[u], k);
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g) {
                if (g < V) {
                    float dot = 0.0f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) dot += q_s[g * D + offset + e] * k[e];
                    for (int width = per_token / 2; width > 0; width >>= 1)
                        dot += __shfl_xor_sync(0xffffffffu, dot, width);
                    if constexpr (KV_INT8) dot *= k_raw[u].scale;
                    // Outside [start, the query token's own position]: left padding, or (Q > 1) a later new token.
                    const int last = length - Q + g / G;
                    s[u][g] = !FULL && (i >= n || t < start || t > last) ? -TL_INF : dot;
                }
            }
        }
        // Online softmax: rescale the state to the new running max, then add this step's tokens.
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g < V) {
                float top = m[g];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) top = fmaxf(top, s[u][g]);
                const float rescale = !FULL && top == -TL_INF ? 1.0f : exp2f(m[g] - top);
                l[g] *= rescale;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] *= rescale;
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    s[u][g] = !FULL && top == -TL_INF ? 0.0f : exp2f(s[u][g] - top);
                    l[g] += s[u][g];
                }
                m[g] = top;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float v[8];
            raw8_to_float<T, KV_INT8>(v_raw[u], v);
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g)
                if (g < V) {
                    const float p = KV_INT8 ? s[u][g] * v_raw[u].scale : s[u][g];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, v[e], acc[g][e]);
                }
        }
    };
    for (int base = 0; base < n; base += UNROLL * subs) {
        const int first = t0 + base, end = first + UNROLL * subs;  // the step's tokens: [first, end)
        const bool full = base + UNROLL * subs <= n && first >= start && end <= length - Q + 1;
        if (base > 0) {  // the first step's loads were issued before the wait
            if (full) load_step(base, true);
            else load_step(base, false);
        }
        if (full) token_step(base, true);
        else token_step(base, false);
    }
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        if (g < V) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sub_o[(sub * V + g) * D + offset + e] = acc[g][e];
            if (offset == 0) {
                sub_ml[(sub * V + g) * 2] = m[g];
                sub_ml[(sub * V + g) * 2 + 1] = l[g];
            }
        }
    }
    __syncthreads();
    // The CTA's state: its subs merged, o into q_s (free now), (m, l) into cta_ml. A CTA that is its row's only split
    // writes its output at once, divided by the sum this thread merged itself: cta_ml's is written by the thread of
    // d = 0, and reading it here, with no barrier between, was a race (seen with 256-thread CTAs at D = 64).
    for (int idx = threadIdx.x; idx < V * D; idx += THREADS) {
        const int g = idx / D, d = idx % D;
        float top, sum;
        const float o = merged_states<subs, D>(sub_o, sub_ml, V, g, d, top, sum);
        if (active == 1) {  // (never with CLUSTER > 1: active is then a multiple of CLUSTER)
            out[row_of(g) * D + d] = from_float<T>(o / sum);
            continue;
        }
        q_s[idx] = o;
        if (d == 0) {
            cta_ml[2 * g] = top;
            cta_ml[2 * g + 1] = sum;
        }
    }
    if (CLUSTER > 1 && active == CLUSTER) {
        // One unit: rank r of the cluster finishes elements [r * share, (r + 1) * share) from every peer's state.
        cluster_barrier();
        const unsigned rank = cluster_rank();
        const int share = (V * D + CLUSTER - 1) / CLUSTER;
        for (int j = threadIdx.x; j < share; j += THREADS) {
            const int idx = rank * share + j;
            if (idx >= V * D) break;
            const int g = idx / D, d = idx % D;
            out[row_of(g) * D + d] = from_float<T>(cluster_merged<CLUSTER>(cta_ml, q_s, g, idx));
        }
        cluster_barrier();  // a CTA's shared memory stays until every peer has read it
        return;
    }
    if (active == 1) return;
    for (int idx = threadIdx.x; idx < V * D; idx += THREADS) {
        const int g = idx / D, d = idx % D;
        const long long row = row_of(g);
        part_o[(row * splits + split) * D + d] = q_s[idx];
        if (d == 0) {
            part_ml[(row * splits + split) * 2] = cta_ml[2 * g];
            part_ml[(row * splits + split) * 2 + 1] = cta_ml[2 * g + 1];
        }
    }
    // The last active split to finish merges: out = sum_i o_i 2^(m_i - M) / sum_i l_i 2^(m_i - M).
    __shared__ int is_last;
    __threadfence();  // this split's partials are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        int* counter = split_counters + b * Hkv + kv_head;
        is_last = atomicAdd(counter, 1) == active - 1;
        if (is_last) *counter = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Per head, the splits' weights 2^(m_i - M) / L go to shared memory (warp per head, lanes over splits), then
    // every output element sums its splits with their loads in flight together. Partials are read through L2
    // (__ldcg): other CTAs wrote them.
    for (int g = warp; g < V; g += warps) {
        const float* ml = part_ml + row_of(g) * splits * 2;
        float top = -TL_INF;
        for (int i = lane; i < active; i += 32) top = fmaxf(top, __ldcg(ml + 2 * i));
        top = warp_max(top);
        float sum = 0.0f;
        for (int i = lane; i < active; i += 32) {
            const float mi = __ldcg(ml + 2 * i);
            const float w = merge_weight(mi, top);
            weights[g * splits + i] = w;
            sum += w * __ldcg(ml + 2 * i + 1);
        }
        sum = warp_sum(sum);
        for (int i = lane; i < active; i += 32) weights[g * splits + i] /= sum;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < V * D; idx += THREADS) {
        const int g = idx / D, d = idx % D;
        const long long row = row_of(g);
        float o = 0.0f;
#pragma unroll 8
        for (int i = 0; i < active; ++i) {
            const float w = weights[g * splits + i];
            if (w != 0.0f) o += __ldcg(part_o + (row * splits + i) * D + d) * w;
        }
        out[row * D + d] = from_float<T>(o);
    }
}
