// Thread-block cluster helpers (sm_90+) and the softmax-state merge weight, shared by paged_attention.cu and
// attention_block.cu.
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

// The weight 2^(m - top) of a partial softmax state with running max m in a merge whose overall max is top (an empty
// state, m = -inf, weighs 0). Used by the three merges: subs within a CTA, peers of a cluster, splits in global memory.
__device__ __forceinline__ float merge_weight(float m, float top) { return m == -TL_INF ? 0.0f : exp2f(m - top); }
