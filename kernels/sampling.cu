// Token selection on the GPU, one CTA per row of logits [B, V]:
//   greedy (temperature <= 0): argmax, ties to the lowest index (as torch.argmax);
//   sampling: argmax(logits / temperature + Gumbel noise) — an exact draw from softmax(logits / temperature).
// The noise comes from a counter-based hash of (seed, row, token), so a captured graph replays with a new seed
// read from device memory and no host synchronisation.
#include "common.cuh"

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {  // splitmix64 finalizer
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <typename T>
__global__ void sample_tokens(const T* __restrict__ logits, long long* __restrict__ tokens, int V,
                              const unsigned long long* __restrict__ seed, float temperature) {
    const int row = blockIdx.x;
    const T* values = logits + static_cast<long long>(row) * V;
    float best = -TL_INF;
    int best_index = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float v = to_float(values[i]);
        if (temperature > 0.0f) {
            const unsigned long long h = mix64(*seed ^ mix64((static_cast<unsigned long long>(row) << 32) | i));
            const float u = (static_cast<float>(h >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
            v = v / temperature - logf(-logf(u));
        }
        if (v > best) {  // strided loop visits increasing indices: strict > keeps the lowest on ties
            best = v;
            best_index = i;
        }
    }
    __shared__ float shared_value[32];
    __shared__ int shared_index[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
        if (other > best || (other == best && other_index < best_index)) {
            best = other;
            best_index = other_index;
        }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        shared_value[warp] = best;
        shared_index[warp] = best_index;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (blockDim.x >> 5); ++w) {
            if (shared_value[w] > best || (shared_value[w] == best && shared_index[w] < best_index)) {
                best = shared_value[w];
                best_index = shared_index[w];
            }
        }
        tokens[row] = best_index;
    }
}
