// Paged attention for decode (one query token per row) with split-KV and a log-sum-exp merge.
//
// Pages: K/V [blocks, Hkv, 16, D] in T, or int8 with fp32 scales [blocks, Hkv, 16] (one per token and KV head).
// block_table [B, max_blocks] int32; lengths[b] = cached tokens including the new one; starts[b] = first valid
// position (left padding before it is never attended). All of these live in device memory, so a captured CUDA
// graph replays with new lengths. Grid (Hkv, B, splits): a CTA serves every query head of its KV head (GQA
// groups of up to 8 read each K/V byte once). Scores use exp2 with q pre-scaled by softmax_scale * log2(e).
// One split writes the output directly; several write fp32 partials (o, m, l) that `merge_splits` combines.
#include "common.cuh"

constexpr int PAGE = 16;
constexpr int MAX_GROUP = 8;
constexpr int MAX_DIM = 256;

template <typename T, int KV_INT8>
__device__ __forceinline__ float kv_value(const void* pages, const float* scales, long long slot, int D, int d) {
    if constexpr (KV_INT8) {
        return static_cast<float>(static_cast<const signed char*>(pages)[slot * D + d]) * scales[slot];
    } else {
        return to_float(static_cast<const T*>(pages)[slot * D + d]);
    }
}

template <typename T, int KV_INT8>
__global__ void __launch_bounds__(128) paged_decode(
    const T* __restrict__ q, const void* k_pages, const void* v_pages, const float* k_scale, const float* v_scale,
    const int* __restrict__ block_table, const int* __restrict__ lengths, const int* __restrict__ starts,
    T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, int Hq, int Hkv, int D,
    int max_blocks, int chunk, float scale_log2) {
    extern __shared__ float smem[];
    const int G = Hq / Hkv;
    float* q_s = smem;                    // [G][D]
    float* scores = smem + G * D;         // [G][chunk]
    float* stats = scores + G * chunk;    // [G][2]: max, sum
    const int kv_head = blockIdx.x, b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int length = lengths[b], start = starts[b];
    const int t0 = split * chunk, t1 = min(length, t0 + chunk);
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        q_s[i] = to_float(q[(static_cast<long long>(b) * Hq + kv_head * G + g) * D + d]) * scale_log2;
    }
    __syncthreads();
    // Phase 1: one warp per token, lanes split the head dimension.
    for (int t = t0 + warp; t < t1; t += warps) {
        const long long slot =
            (static_cast<long long>(block_table[b * max_blocks + t / PAGE]) * Hkv + kv_head) * PAGE + t % PAGE;
        float partial[MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) partial[g] = 0.0f;
        for (int d = lane; d < D; d += 32) {
            const float k = kv_value<T, KV_INT8>(k_pages, k_scale, slot, D, d);
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g)
                if (g < G) partial[g] += q_s[g * D + d] * k;
        }
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g < G) {
                const float s = warp_sum(partial[g]);
                if (lane == 0) scores[g * chunk + (t - t0)] = t < start ? -TL_INF : s;
            }
        }
    }
    __syncthreads();
    // Phase 2: per head, max and sum of exp2 over this split's tokens; scores become probabilities (unnormalized).
    for (int g = warp; g < G; g += warps) {
        float m = -TL_INF;
        for (int i = lane; i < t1 - t0; i += 32) m = fmaxf(m, scores[g * chunk + i]);
        m = warp_max(m);
        float l = 0.0f;
        for (int i = lane; i < t1 - t0; i += 32) {
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
    // Phase 3: threads over the head dimension accumulate p * V for every head of the group.
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc[MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) acc[g] = 0.0f;
        for (int t = t0; t < t1; ++t) {
            const long long slot =
                (static_cast<long long>(block_table[b * max_blocks + t / PAGE]) * Hkv + kv_head) * PAGE + t % PAGE;
            const float v = kv_value<T, KV_INT8>(v_pages, v_scale, slot, D, d);
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g)
                if (g < G) acc[g] += scores[g * chunk + (t - t0)] * v;
        }
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g < G) {
                const int head = kv_head * G + g;
                const long long row = static_cast<long long>(b) * Hq + head;
                if (splits == 1) {
                    out[row * D + d] = from_float<T>(acc[g] / stats[2 * g + 1]);
                } else {
                    part_o[(row * splits + split) * D + d] = acc[g];
                    if (d == 0) {
                        part_ml[(row * splits + split) * 2] = stats[2 * g];
                        part_ml[(row * splits + split) * 2 + 1] = stats[2 * g + 1];
                    }
                }
            }
        }
    }
}

// out[row, d] = sum_i o_i[d] 2^(m_i - M) / sum_i l_i 2^(m_i - M), rows = B * Hq, one CTA per row.
template <typename T>
__global__ void merge_splits(const float* __restrict__ part_o, const float* __restrict__ part_ml, T* __restrict__ out,
                             int splits, int D) {
    const long long row = blockIdx.x;
    float m = -TL_INF;
    for (int i = 0; i < splits; ++i) m = fmaxf(m, part_ml[(row * splits + i) * 2]);
    float l = 0.0f;
    for (int i = 0; i < splits; ++i) {
        const float mi = part_ml[(row * splits + i) * 2];
        l += mi == -TL_INF ? 0.0f : part_ml[(row * splits + i) * 2 + 1] * exp2f(mi - m);
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.0f;
        for (int i = 0; i < splits; ++i) {
            const float mi = part_ml[(row * splits + i) * 2];
            if (mi != -TL_INF) o += part_o[(row * splits + i) * D + d] * exp2f(mi - m);
        }
        out[row * D + d] = from_float<T>(o / l);
    }
}
