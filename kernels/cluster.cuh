// Thread-block cluster helpers (sm_90+) and the partial softmax states (empty, merged), shared by paged_attention.cu
// and fused_decode.cu.
#pragma once
#include "common.cuh"

// Thread-block clusters (sm_90+; CLUSTER = 1 launches never call these): rank, barrier, peer shared memory.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned rank = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
    return rank;
}

// Every thread of every CTA of the cluster arrives; release / acquire make shared-memory writes before it visible
// to the peers' reads after it.
__device__ __forceinline__ void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The float at ``p`` (an address in this CTA's shared memory) in the shared memory of the cluster's CTA ``rank``.
__device__ __forceinline__ float load_peer_shared(const float* p, unsigned rank) {
    float value = 0.0f;
#if __CUDA_ARCH__ >= 900
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(value) : "r"(remote) : "memory");
#endif
    return value;
}

// An empty online-softmax state (no token yet): m = -inf, l = 0, o = 0.
template <int MAXG>
__device__ __forceinline__ void empty_states(float (&m)[MAXG], float (&l)[MAXG], float (&o)[MAXG][8]) {
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        m[g] = -TL_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[g][e] = 0.0f;
    }
}

// The weight 2^(m - top) of a partial softmax state with running max m in a merge whose overall max is top (an empty
// state, m = -inf, weighs 0). Used by the three merges: subs within a CTA, peers of a cluster, splits in global memory.
__device__ __forceinline__ float merge_weight(float m, float top) { return m == -TL_INF ? 0.0f : exp2f(m - top); }

// The online-softmax states (running max m, sum l, 8 output dims o per query vector) of the lanes of a warp that hold
// the same 8 dims (groups of PER_TOKEN lanes, each group serving other tokens), merged with shuffles: afterwards every
// lane holds its dims' state over the whole warp. Every lane of the warp calls it (full-mask shuffles).
template <int MAXG, int PER_TOKEN>
__device__ __forceinline__ void merge_warp_states(float (&m)[MAXG], float (&l)[MAXG], float (&o)[MAXG][8]) {
#pragma unroll
    for (int width = PER_TOKEN; width < 32; width <<= 1) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            const float m_other = __shfl_xor_sync(0xffffffffu, m[g], width);
            const float l_other = __shfl_xor_sync(0xffffffffu, l[g], width);
            const float top = fmaxf(m[g], m_other);
            const float w_self = merge_weight(m[g], top), w_other = merge_weight(m_other, top);
            l[g] = l[g] * w_self + l_other * w_other;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float o_other = __shfl_xor_sync(0xffffffffu, o[g][e], width);
                o[g][e] = o[g][e] * w_self + o_other * w_other;
            }
            m[g] = top;
        }
    }
}

// Element d of query vector g merged over N partial states in shared memory, o [N][V][D] and ml [N][V][2] (running max
// and sum): returns sum_i o_i 2^(m_i - top), with top = max_i m_i and sum = sum_i l_i 2^(m_i - top).
template <int N, int D>
__device__ __forceinline__ float merged_states(const float* o, const float* ml, int V, int g, int d, float& top,
                                               float& sum) {
    top = -TL_INF;
#pragma unroll
    for (int i = 0; i < N; ++i) top = fmaxf(top, ml[(i * V + g) * 2]);
    float acc = 0.0f;
    sum = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const float w = merge_weight(ml[(i * V + g) * 2], top);
        acc += o[(i * V + g) * D + d] * w;
        sum += ml[(i * V + g) * 2 + 1] * w;
    }
    return acc;
}

// Output element idx (of query vector g) of a cluster's attention: the CLUSTER CTAs' states (cta_ml [V][2] and cta_o
// [V * D], at the same shared-memory addresses in every CTA) merged and normalized, every peer load in flight at once.
template <int CLUSTER>
__device__ __forceinline__ float cluster_merged(const float* cta_ml, const float* cta_o, int g, int idx) {
    float mc[CLUSTER], lc[CLUSTER], oc[CLUSTER];
#pragma unroll
    for (int c = 0; c < CLUSTER; ++c) {
        mc[c] = load_peer_shared(cta_ml + 2 * g, c);
        lc[c] = load_peer_shared(cta_ml + 2 * g + 1, c);
        oc[c] = load_peer_shared(cta_o + idx, c);
    }
    float top = -TL_INF;
#pragma unroll
    for (int c = 0; c < CLUSTER; ++c) top = fmaxf(top, mc[c]);
    float o = 0.0f, sum = 0.0f;
#pragma unroll
    for (int c = 0; c < CLUSTER; ++c) {
        const float w = merge_weight(mc[c], top);
        o += oc[c] * w;
        sum += lc[c] * w;
    }
    return o / sum;
}
