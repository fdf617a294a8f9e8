// Paged attention for decode (Q new query tokens per row, Q = 1 for plain decode; Q > 1 for a short continuation
// such as a speculative verify, causal among the new tokens) with split-KV and a log-sum-exp merge.
//
// Pages: K/V [blocks, Hkv, 16, D] in T, or int8 with fp32 scales [blocks, Hkv, 16] (one per token and KV head).
// block_table [B, max_blocks] int32; lengths[b] = cached tokens including the new ones; starts[b] = first valid
// position (left padding before it is never attended). All of these live in device memory, so a captured CUDA
// graph replays with new lengths. Grid (Hkv, B, splits): a CTA serves every query head of its KV head for every
// new token (G * Q <= 8 query vectors read each K/V byte once). q and out: [B * Q, Hq, D]. Scores use exp2 with q
// pre-scaled by softmax_scale * log2(e).
// One split writes the output directly; several write fp32 partials (o, m, l) and the last split of a (row, KV
// head) to finish — counted in split_counters, which it resets for the next launch — merges them.
#include "common.cuh"

constexpr int PAGE = 16;
// Tokens per thread whose loads are in flight together (raw: 5 registers each). Decode step on the H200 (INT4, L = 4,
// context ~200): 4 was ~3% faster than 8 at batch 1 and equal at batch 16; 16 was 10-70% slower.
constexpr int UNROLL = 4;

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

template <typename T, int KV_INT8>
__device__ __forceinline__ void raw8_to_float(const Raw8& raw, float (&out)[8]) {
    if constexpr (KV_INT8) {
        const unsigned words[2] = {raw.bits.x, raw.bits.y};
#pragma unroll
        for (int i = 0; i < 8; ++i)
            out[i] = static_cast<float>(static_cast<signed char>((words[i / 4] >> (8 * (i % 4))) & 0xFF)) * raw.scale;
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

// A token is served by D/8 consecutive threads (8 elements each), so a CTA of 128 threads works on 1024/D tokens
// at once and every load of a pass is independent (page slots are looked up once, into shared memory).
// MAX_GROUP (1, 2, 4 or 8) bounds the query vectors per CTA (G * Q): the V accumulators take 8 * MAX_GROUP
// registers, so MHA decode (1) keeps occupancy high.
template <typename T, int KV_INT8, int MAX_GROUP>
__global__ void __launch_bounds__(128) paged_decode(
    const T* __restrict__ q, const void* k_pages, const void* v_pages, const float* k_scale, const float* v_scale,
    const int* __restrict__ block_table, const int* __restrict__ lengths, const int* __restrict__ starts,
    T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, int* __restrict__ split_counters,
    int Hq, int Hkv, int D, int Q, int max_blocks, int chunk, float scale_log2) {
    pdl_trigger();
    extern __shared__ float smem[];
    // V query vectors per CTA: the G heads of the KV group for each of the row's Q new tokens (v = j * G + g).
    const int G = Hq / Hkv, V = G * Q;
    const int per_token = D / 8, tokens_per_pass = blockDim.x / per_token;
    float* q_s = smem;                                    // [V][D]
    float* scores = q_s + V * D;                          // [V][chunk]
    float* stats = scores + V * chunk;                    // [V][2]: max, sum
    float* partial = stats + 2 * V;                       // [tokens_per_pass][V][D]
    int* slots = reinterpret_cast<int*>(partial + tokens_per_pass * V * D);  // [chunk]
    const int kv_head = blockIdx.x, b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int length = lengths[b], start = starts[b];
    // Query vector v's output / query row: token j = v / G of the row (position length - Q + j), head g = v % G.
    auto row_of = [&](int v) { return (static_cast<long long>(b) * Q + v / G) * Hq + kv_head * G + v % G; };
    // The tokens are spread over all splits whatever the length (the grid is fixed per cache capacity, so that
    // a captured graph serves every step): span <= chunk, the shared-memory stride, since length <= capacity.
    const int span = (length + splits - 1) / splits;
    const int t0 = split * span, n = max(0, min(length, t0 + span) - t0);
    for (int i = threadIdx.x; i < V * D; i += blockDim.x) q_s[i] = to_float(q[row_of(i / D) * D + i % D]) * scale_log2;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int t = t0 + i;
        slots[i] = (block_table[b * max_blocks + t / PAGE] * Hkv + kv_head) * PAGE + t % PAGE;
    }
    __syncthreads();
    const int sub = threadIdx.x / per_token, offset = (threadIdx.x % per_token) * 8;
    // Phase 1: scores (log2 domain); the D/8 threads of a token reduce with shuffles inside their aligned group.
    // UNROLL tokens per thread are loaded before any math, so their latencies overlap.
    for (int base = 0; base < n; base += UNROLL * tokens_per_pass) {
        Raw8 k_raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * tokens_per_pass + sub;
            if (i < n) k_raw[u] = load_raw8<T, KV_INT8>(k_pages, k_scale, slots[i], D, offset);
            else k_raw[u] = Raw8{make_uint4(0u, 0u, 0u, 0u), 0.0f};
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * tokens_per_pass + sub;
            float k[8];
            raw8_to_float<T, KV_INT8>(k_raw[u], k);
            for (int g = 0; g < V; ++g) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) dot += q_s[g * D + offset + e] * k[e];
                for (int width = per_token / 2; width > 0; width >>= 1)
                    dot += __shfl_xor_sync(0xffffffffu, dot, width);
                // Outside [start, the query token's own position]: left padding, or (Q > 1) a later new token.
                const int t = t0 + i, last = length - Q + g / G;
                if (offset == 0 && i < n) scores[g * chunk + i] = t < start || t > last ? -TL_INF : dot;
            }
        }
    }
    __syncthreads();
    // Phase 2: per head, max and sum of exp2; scores become unnormalized probabilities.
    for (int g = warp; g < V; g += warps) {
        float m = -TL_INF;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, scores[g * chunk + i]);
        m = warp_max(m);
        float l = 0.0f;
        for (int i = lane; i < n; i += 32) {
            const float p = m == -TL_INF ? 0.0f : exp2f(scores[g * chunk + i] - m);
            scores[g * chunk + i] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            stats[2 * g] = m;
            stats[2 * g + 1] = l;
        }
    }
    __syncthreads();
    // Phase 3: each thread sums p * V over its tokens for its 8 dimensions, then the passes are added up.
    float acc[MAX_GROUP][8];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
    for (int base = sub; base < n; base += UNROLL * tokens_per_pass) {
        Raw8 v_raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (base + u * tokens_per_pass < n)
                v_raw[u] = load_raw8<T, KV_INT8>(v_pages, v_scale, slots[base + u * tokens_per_pass], D, offset);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * tokens_per_pass;
            if (i >= n) break;
            float v[8];
            raw8_to_float<T, KV_INT8>(v_raw[u], v);
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g) {
                if (g < V) {
                    const float p = scores[g * chunk + i];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[g][e] += p * v[e];
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g)
        if (g < V)
#pragma unroll
            for (int e = 0; e < 8; ++e) partial[(sub * V + g) * D + offset + e] = acc[g][e];
    __syncthreads();
    for (int idx = threadIdx.x; idx < V * D; idx += blockDim.x) {
        const int g = idx / D, d = idx % D;
        float o = 0.0f;
        for (int s = 0; s < tokens_per_pass; ++s) o += partial[(s * V + g) * D + d];
        const long long row = row_of(g);
        if (splits == 1) {
            out[row * D + d] = from_float<T>(o / stats[2 * g + 1]);
        } else {
            part_o[(row * splits + split) * D + d] = o;
            if (d == 0) {
                part_ml[(row * splits + split) * 2] = stats[2 * g];
                part_ml[(row * splits + split) * 2 + 1] = stats[2 * g + 1];
            }
        }
    }
    if (splits == 1) return;
    // The last split to finish merges: out = sum_i o_i 2^(m_i - M) / sum_i l_i 2^(m_i - M).
    __shared__ int is_last;
    __threadfence();  // this split's partials are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        int* counter = split_counters + b * Hkv + kv_head;
        is_last = atomicAdd(counter, 1) == splits - 1;
        if (is_last) *counter = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Per head, the splits' weights 2^(m_i - M) / L go to shared memory (warp per head, lanes over splits; the
    // scores buffer is free now), then every output element sums its splits with their loads in flight together.
    // Partials are read through L2 (__ldcg): other CTAs wrote them.
    float* weights = scores;  // [V][splits] (splits <= chunk)
    for (int g = warp; g < V; g += warps) {
        const float* ml = part_ml + row_of(g) * splits * 2;
        float m = -TL_INF;
        for (int i = lane; i < splits; i += 32) m = fmaxf(m, __ldcg(ml + 2 * i));
        m = warp_max(m);
        float l = 0.0f;
        for (int i = lane; i < splits; i += 32) {
            const float mi = __ldcg(ml + 2 * i);
            const float w = mi == -TL_INF ? 0.0f : exp2f(mi - m);
            weights[g * splits + i] = w;
            l += w * __ldcg(ml + 2 * i + 1);
        }
        l = warp_sum(l);
        for (int i = lane; i < splits; i += 32) weights[g * splits + i] /= l;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < V * D; idx += blockDim.x) {
        const int g = idx / D, d = idx % D;
        const long long row = row_of(g);
        float o = 0.0f;
#pragma unroll 8
        for (int i = 0; i < splits; ++i) {
            const float w = weights[g * splits + i];
            if (w != 0.0f) o += __ldcg(part_o + (row * splits + i) * D + d) * w;
        }
        out[row * D + d] = from_float<T>(o);
    }
}
