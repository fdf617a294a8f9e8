// Probe (twenty-third session; not used by the model): what one hand-off costs between CTAs, as a thread-block cluster
// does it (barrier.cluster, distributed shared memory) and as the fused decode kernel does it (LL words in global
// memory, polled). eval/cluster_probe.py launches it and prints cycles per round. Modes:
//   0  a cluster barrier alone
//   1  a DSMEM exchange: 130 floats written to shared memory, a cluster barrier, 8 peers' 16 values read back
//   2  an LL hop among the cluster's 8 CTAs through global memory (each publishes a word, polls its 7 peers')
//   3  an LL hop over the whole grid (each CTA publishes 4 words and polls all G * 4; needs every CTA resident)
// Sequence numbers grow by one per round and a poll accepts any later one: a fast CTA may already have published
// round i + 1 when a slow one polls for round i.
#include "cluster.cuh"

__device__ __forceinline__ void probe_store(uint2* p, unsigned value, unsigned seq) {
    asm volatile("st.relaxed.gpu.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(value), "r"(seq) : "memory");
}
// The payload of *p once its sequence number reaches seq.
__device__ __forceinline__ unsigned probe_poll(const uint2* p, unsigned seq) {
    uint2 v;
    while (true) {
        asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
        if (v.y >= seq) return v.x;
        __nanosleep(32);
    }
}

// One CTA per SM (the host asks for most of its shared memory); CTA index along z, as loader.launch forms clusters.
extern "C" __global__ void cluster_probe(int mode, int rounds, int base, uint2* words, float* sink,
                                         unsigned long long* cycles) {
    extern __shared__ float exchange[];  // [2][256]: one buffer per round parity
    const int cta = blockIdx.z, grid = gridDim.z;
    const unsigned rank = mode == 3 ? 0u : cluster_rank();
    float acc = 0.0f;
    if (mode != 3) cluster_barrier();
    __syncthreads();
    const unsigned long long start = clock64();
    for (int i = 0; i < rounds; ++i) {
        const unsigned seq = static_cast<unsigned>(base + i + 1);
        if (mode == 0) {
            cluster_barrier();
        } else if (mode == 1) {
            float* buffer = exchange + (i & 1) * 256;  // round i + 2 writes it after every peer passed round i + 1
            if (threadIdx.x < 130) buffer[threadIdx.x] = acc + i;
            cluster_barrier();
            if (threadIdx.x < 16)
                for (unsigned c = 0; c < 8; ++c) acc += load_peer_shared(buffer + rank * 16 + threadIdx.x, c);
        } else if (mode == 2) {
            if (threadIdx.x == 0) probe_store(words + cta, __float_as_uint(acc), seq);
            if (threadIdx.x < 8) acc += __uint_as_float(probe_poll(words + cta - rank + threadIdx.x, seq));
            __syncthreads();
        } else {
            if (threadIdx.x < 4) probe_store(words + cta * 4 + threadIdx.x, __float_as_uint(acc), seq);
            for (int k = threadIdx.x; k < grid * 4; k += blockDim.x) acc += __uint_as_float(probe_poll(words + k, seq));
            __syncthreads();
        }
    }
    const unsigned long long end = clock64();
    if (threadIdx.x == 0) cycles[cta] = end - start;
    if (acc == 12345.0f) sink[0] = acc;  // keeps the loads
}
