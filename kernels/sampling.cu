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

// The CTA's argmax: every thread passes its own best (value, index) over the indices it visited in increasing order;
// thread 0 returns with the row's, ties to the lowest index (as torch.argmax).
__device__ __forceinline__ void cta_argmax(float& best, int& best_index) {
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
    }
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
    cta_argmax(best, best_index);
    if (threadIdx.x == 0) tokens[row] = best_index;
}

// The inputs of the decode step greedy generate() runs next, written in one launch where small kernels would each
// add their launch to the GPU's idle time between two steps (CUDA-path run-ahead, cuda_path.CudaPath._replay_ahead).
// One CTA per row: the argmax of the row's logits, or `pad` where the row's current token is one of `ends` (a
// finished row, which transformers pads from then on), goes to input_ids; position_ids advances by one; and the paged
// cache's device metadata of one new token after `length` cached ones is set (lengths, step positions).
template <typename T>
__global__ void advance_greedy(const T* __restrict__ logits, long long row_stride, int V,
                               long long* __restrict__ input_ids, long long* __restrict__ position_ids,
                               const long long* __restrict__ ends, int n_ends, const long long* __restrict__ pad,
                               int* __restrict__ lengths, int* __restrict__ step_positions, int length) {
    const int row = blockIdx.x;
    const T* values = logits + row * row_stride;
    float best = -TL_INF;
    int best_index = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = to_float(values[i]);
        if (v > best) {
            best = v;
            best_index = i;
        }
    }
    cta_argmax(best, best_index);
    if (threadIdx.x != 0) return;
    long long token = best_index;
    const long long current = input_ids[row];
    for (int i = 0; i < n_ends; ++i) {
        if (current == ends[i]) {
            token = *pad;
            break;
        }
    }
    input_ids[row] = token;
    position_ids[row] += 1;
    lengths[row] = length + 1;
    step_positions[row] = length;
}
