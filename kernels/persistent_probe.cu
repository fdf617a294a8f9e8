// Probe, not used by the model (ninth session): what a persistent decode kernel could save over today's chain of
// ~576 kernels per step. A "phase" streams a buffer of 16-byte vectors (the bytes one kernel of the decode step
// reads: a projection's INT4 weights, a layer's K/V, a junction's few KiB), mixes in one value the previous phase
// wrote, and writes one value per CTA. probe_phase is one phase per launch (programmatic in graphs: its first loads
// before pdl_wait, like the GEMVs); probe_chain runs every phase in one launch of resident CTAs with a grid barrier
// between phases, each CTA issuing its next phase's first loads before it waits at the barrier.
#include "common.cuh"

constexpr int PROBE_THREADS = 256;
constexpr int FIRST = 4;  // 16-byte loads per thread issued before the wait (the GEMVs' whole share at K 2048)

__device__ __forceinline__ unsigned mix(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// The vectors [begin, end) of a phase that CTA `cta` of `ctas` streams.
__device__ __forceinline__ void share(unsigned long long vectors, int cta, int ctas, unsigned long long& begin,
                                      unsigned long long& end) {
    const unsigned long long per_cta = (vectors + ctas - 1) / ctas;
    begin = min(vectors, static_cast<unsigned long long>(cta) * per_cta);
    end = min(vectors, begin + per_cta);
}

__device__ __forceinline__ void first_loads(const uint4* data, unsigned long long begin, unsigned long long end,
                                            uint4 (&first)[FIRST]) {
#pragma unroll
    for (int i = 0; i < FIRST; ++i) {
        const unsigned long long index = begin + threadIdx.x + i * PROBE_THREADS;
        first[i] = index < end ? load_stream(data + index) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// The rest of the share after the first loads, 4 loads in flight per thread; the CTA's xor of everything.
__device__ __forceinline__ unsigned stream_rest(const uint4* data, unsigned long long begin, unsigned long long end,
                                                const uint4 (&first)[FIRST], unsigned acc) {
#pragma unroll
    for (int i = 0; i < FIRST; ++i) acc ^= mix(first[i]);
    unsigned long long index = begin + threadIdx.x + FIRST * PROBE_THREADS;
    for (; index + 3 * PROBE_THREADS < end; index += 4 * PROBE_THREADS) {
        uint4 v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = load_stream(data + index + i * PROBE_THREADS);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc ^= mix(v[i]);
    }
    for (; index < end; index += PROBE_THREADS) acc ^= mix(load_stream(data + index));
    __shared__ unsigned warps[PROBE_THREADS / 32];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
    if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = acc;
    __syncthreads();
    unsigned total = 0;
#pragma unroll
    for (int w = 0; w < PROBE_THREADS / 32; ++w) total ^= warps[w];
    __syncthreads();  // warps[] is reused by the next phase
    return total;
}

// After the wait every CTA also reads a phase's whole input activation (act, act_vectors; 0: none) through L1, as
// every tensor-core GEMM CTA reads all of x at batch 16.
__device__ __forceinline__ unsigned read_activation(const uint4* act, unsigned long long act_vectors) {
    unsigned acc = 0u;
    for (unsigned long long i = threadIdx.x; i < act_vectors; i += PROBE_THREADS) acc ^= mix(act[i]);
    return acc;
}

__global__ void __launch_bounds__(PROBE_THREADS) probe_phase(const uint4* data, unsigned long long vectors,
                                                             const unsigned* previous, unsigned* out,
                                                             const uint4* act, unsigned long long act_vectors) {
    pdl_trigger();
    unsigned long long begin, end;
    share(vectors, blockIdx.x, gridDim.x, begin, end);
    uint4 first[FIRST];
    first_loads(data, begin, end, first);
    pdl_wait();
    const unsigned total =
        stream_rest(data, begin, end, first, __ldcg(previous) ^ read_activation(act, act_vectors));
    if (threadIdx.x == 0) out[blockIdx.x] = total;
}

// Phase p reads vectors[p] vectors at data[p] (and every CTA act_vectors[p] at act[p]); out [phases][gridDim.x];
// arrived counts CTAs done with each phase (zeroed before the launch). Every CTA must be resident at once (the host sizes the grid from the occupancy).
__global__ void __launch_bounds__(PROBE_THREADS) probe_chain(const unsigned long long* data,
                                                             const unsigned long long* vectors, int phases,
                                                             unsigned* out, unsigned* arrived,
                                                             const unsigned long long* act,
                                                             const unsigned long long* act_vectors) {
    unsigned previous = 0;
    for (int p = 0; p < phases; ++p) {
        const uint4* phase_data = reinterpret_cast<const uint4*>(data[p]);
        unsigned long long begin, end;
        share(vectors[p], blockIdx.x, gridDim.x, begin, end);
        uint4 first[FIRST];
        first_loads(phase_data, begin, end, first);  // before the barrier: weights do not depend on it
        if (p > 0) {
            if (threadIdx.x == 0) {
                const unsigned target = p * gridDim.x;
                unsigned seen;
                do {
                    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrived) : "memory");
                } while (seen < target);
            }
            __syncthreads();
            previous = __ldcg(out + static_cast<long long>(p - 1) * gridDim.x);
        }
        previous ^= read_activation(reinterpret_cast<const uint4*>(act[p]), act_vectors[p]);
        const unsigned total = stream_rest(phase_data, begin, end, first, previous);
        if (threadIdx.x == 0) {
            out[static_cast<long long>(p) * gridDim.x + blockIdx.x] = total;
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrived) : "memory");
        }
    }
}
