// RMSNorm and the residual junction of a block, one CTA per token row, statistics in fp32.
//
// Rounding mirrors the reference path (ops_tinyloop.rms_norm): normed = x * rsqrt(mean(x^2) + eps) in fp32,
// cast to T, then times the weight in T. The junction computes, per `mode`,
//   0 pre:      sum = x + branch
//   1 sandwich: sum = x + norm(branch; w_branch)          (Ouro)
//   2 post:     sum = norm(branch + x; w_branch)          (Huginn)
// and then, if w_next is given, next = norm(sum; w_next) — the input of the following sublayer.
#include "common.cuh"

template <typename T>
__device__ float block_sum(float v, float* shared) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < warps; ++i) total += shared[i];
    return total;
}

template <typename T>
__device__ float inverse_rms(const float* values, int H, float eps, float* shared) {
    float sq = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) sq += values[i] * values[i];
    return rsqrtf(block_sum<T>(sq, shared) / H + eps);
}

// values (fp32, already rounded to T) -> T(T(values * inv) * weight)
template <typename T>
__device__ __forceinline__ T apply_norm(float value, float inv, T weight) {
    return from_float<T>(to_float(from_float<T>(value * inv)) * to_float(weight));
}

template <typename T>
__global__ void rms_norm(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out, int H,
                         float eps) {
    extern __shared__ float row[];  // [H] then 32 for reductions
    float* shared = row + H;
    const long long base = static_cast<long long>(blockIdx.x) * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) row[i] = to_float(x[base + i]);
    const float inv = inverse_rms<T>(row, H, eps, shared);
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[base + i] = apply_norm<T>(row[i], inv, weight[i]);
}

template <typename T>
__global__ void residual_norm(const T* __restrict__ x, const T* __restrict__ branch, const T* __restrict__ w_branch,
                              const T* __restrict__ w_next, T* __restrict__ sum_out, T* __restrict__ next_out, int H,
                              float eps, int mode) {
    extern __shared__ float row[];
    float* shared = row + H;
    const long long base = static_cast<long long>(blockIdx.x) * H;
    if (mode == 0) {
        for (int i = threadIdx.x; i < H; i += blockDim.x)
            row[i] = to_float(from_float<T>(to_float(x[base + i]) + to_float(branch[base + i])));
    } else {
        for (int i = threadIdx.x; i < H; i += blockDim.x) {
            const float b = to_float(branch[base + i]);
            row[i] = mode == 1 ? b : to_float(from_float<T>(b + to_float(x[base + i])));
        }
        const float inv = inverse_rms<T>(row, H, eps, shared);
        __syncthreads();
        for (int i = threadIdx.x; i < H; i += blockDim.x) {
            const float normed = to_float(apply_norm<T>(row[i], inv, w_branch[i]));
            row[i] = mode == 1 ? to_float(from_float<T>(to_float(x[base + i]) + normed)) : normed;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < H; i += blockDim.x) sum_out[base + i] = from_float<T>(row[i]);
    if (w_next == nullptr) return;
    const float inv = inverse_rms<T>(row, H, eps, shared);
    for (int i = threadIdx.x; i < H; i += blockDim.x) next_out[base + i] = apply_norm<T>(row[i], inv, w_next[i]);
}
