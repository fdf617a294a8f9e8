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

// torch.argmax's order: NaN above every number, then the value, ties to the lowest index.
__device__ __forceinline__ bool better(float value, int index, float best, int best_index) {
    const bool nan = value != value, best_nan = best != best;
    if (nan != best_nan) return nan;
    return value > best || ((nan || value == best) && index < best_index);
}

// The CTA's argmax: every thread passes its own best (value, index); thread 0 returns with the row's.
__device__ __forceinline__ void cta_argmax(float& best, int& best_index) {
    __shared__ float shared_value[32];
    __shared__ int shared_index[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
        if (better(other, other_index, best, best_index)) {
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
            if (better(shared_value[w], shared_index[w], best, best_index)) {
                best = shared_value[w];
                best_index = shared_index[w];
            }
        }
    }
}

// The row's argmax of score(index, logit) over `values` [V] into thread 0's (best, best_index). Where the row is
// 16-byte aligned, each thread reads 8 logits per load and has CHUNKS loads in flight (a row of logits read one
// element per thread and loop step, as before, took ~22 us at V = 49152: a chain of dependent round trips).
template <typename T, typename Score>
__device__ __forceinline__ void row_argmax(const T* __restrict__ values, int V, Score score, float& best,
                                           int& best_index) {
    constexpr int PER_LOAD = 16 / sizeof(T), CHUNKS = 4;
    best = -TL_INF;
    best_index = 0x7fffffff;
    auto visit = [&](int i, T raw) {  // any visiting order: better() breaks ties by index
        const float v = score(i, to_float(raw));
        if (better(v, i, best, best_index)) {
            best = v;
            best_index = i;
        }
    };
    int vectors = 0;
    if (reinterpret_cast<unsigned long long>(values) % 16 == 0) {
        vectors = V / PER_LOAD;
        const uint4* rows = reinterpret_cast<const uint4*>(values);
        for (int base = threadIdx.x; base < vectors; base += CHUNKS * blockDim.x) {
            uint4 chunk[CHUNKS];
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int vi = base + c * blockDim.x;
                if (vi < vectors) chunk[c] = __ldcg(rows + vi);
            }
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int vi = base + c * blockDim.x;
                if (vi >= vectors) break;
                const T* items = reinterpret_cast<const T*>(&chunk[c]);
#pragma unroll
                for (int e = 0; e < PER_LOAD; ++e) visit(vi * PER_LOAD + e, items[e]);
            }
        }
    }
    for (int i = vectors * PER_LOAD + threadIdx.x; i < V; i += blockDim.x) visit(i, values[i]);  // the rest
    cta_argmax(best, best_index);
}

template <typename T>
__global__ void sample_tokens(const T* __restrict__ logits, long long* __restrict__ tokens, int V,
                              const unsigned long long* __restrict__ seed, float temperature) {
    const int row = blockIdx.x;
    float best;
    int best_index;
    if (temperature > 0.0f) {
        const unsigned long long s = *seed;
        row_argmax(logits + static_cast<long long>(row) * V, V, [&](int i, float v) {
            const unsigned long long h = mix64(s ^ mix64((static_cast<unsigned long long>(row) << 32) | i));
            const float u = (static_cast<float>(h >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
            return v / temperature - logf(-logf(u));
        }, best, best_index);  // fmt: skip
    } else {
        row_argmax(logits + static_cast<long long>(row) * V, V, [](int, float v) { return v; }, best, best_index);
    }
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
    float best;
    int best_index;
    row_argmax(logits + row * row_stride, V, [](int, float v) { return v; }, best, best_index);
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
