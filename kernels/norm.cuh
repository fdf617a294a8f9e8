// RMSNorm and the residual junction of a block as device functions over one token row, values kept in
// registers (8 per 16-byte vector, up to MAX_VECS vectors per thread: hidden <= 8 * MAX_VECS * blockDim), statistics
// in fp32; every thread of the CTA takes part (block reductions). Used by norm.cu and by the GEMV prologue.
//
// Rounding mirrors the reference path (ops_tinyloop.rms_norm): normed = x * rsqrt(mean(x^2) + eps) in fp32,
// cast to T, then times the weight in T. The junction computes, per `mode`,
//   0 pre:      sum = x + branch
//   1 sandwich: sum = x + norm(branch; w_branch)          (Ouro)
//   2 post:     sum = norm(branch + x; w_branch)          (Huginn)
// and then, if w_next is given, next = norm(sum; w_next) — the input of the following sublayer.
#pragma once
#include "common.cuh"

constexpr int MAX_VECS = 4;

__device__ __forceinline__ float round_to(float v, const __half*) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ float round_to(float v, const __nv_bfloat16*) {
    return __bfloat162float(__float2bfloat16_rn(v));
}

__device__ float block_sum(float v) {
    __shared__ float shared[32];
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    __syncthreads();  // shared[] may still be read by a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < warps; ++i) total += shared[i];
    return total;
}

// Every thread owns vectors j at columns (threadIdx.x + j * blockDim.x) * 8.
#define FOR_VECS(j, col)                                                    \
    _Pragma("unroll") for (int j = 0; j < MAX_VECS; ++j)                   \
        if (const int col = (threadIdx.x + j * blockDim.x) * 8; col < H)

template <typename T>
__device__ float inverse_rms(const float (&v)[MAX_VECS][8], int H, float eps) {
    float sq = 0.0f;
    FOR_VECS(j, col) {
#pragma unroll
        for (int e = 0; e < 8; ++e) sq += v[j][e] * v[j][e];
    }
    return rsqrtf(block_sum(sq) / H + eps);
}

// v <- T(T(v * inv) * weight), the weight's vector j (at column col) given by weight_at(j, col, out).
template <typename T, typename WeightAt>
__device__ void normalize_by(float (&v)[MAX_VECS][8], WeightAt weight_at, int H, float eps) {
    const float inv = inverse_rms<T>(v, H, eps);
    const T* tag = nullptr;  // selects round_to's rounding
    FOR_VECS(j, col) {
        float w[8];
        weight_at(j, col, w);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[j][e] = round_to(round_to(v[j][e] * inv, tag) * w[e], tag);
    }
}

template <typename T>
__device__ void normalize(float (&v)[MAX_VECS][8], const T* __restrict__ weight, int H, float eps) {
    normalize_by<T>(v, [&](int, int col, float (&w)[8]) { load8_as_float(weight + col, w); }, H, eps);
}

// The junction of one row (x, branch, sum_out, next_out point at the row): sum_out (if not null) gets the new
// residual stream, next_out (if w_next is not null) the next sublayer's normed input.
// PRELOAD (the junction kernel): a thread's first vector of x and of both norm weights (its whole share up to hidden
// 8192, where the kernel runs a thread per vector) is loaded with the branch, before the first reduction, so the
// loads are in flight at once instead of one round trip after each reduction. The GEMV prologue (64 registers)
// loads each where it is used. Same arithmetic either way.
// WAIT (the junction kernel launched programmatically): the norm weights, which no kernel writes, are loaded before
// pdl_wait; the next launch is let start after it.
template <typename T, bool PRELOAD = false, bool WAIT = false>
__device__ void junction_row(const T* __restrict__ x, const T* __restrict__ branch, const T* __restrict__ w_branch,
                             const T* __restrict__ w_next, T* sum_out, T* next_out, int H, float eps, int mode) {
    static_assert(PRELOAD || !WAIT, "the programmatic junction preloads its weights");
    uint4 x_first, branch_weight_first, next_weight_first;
    if constexpr (PRELOAD) {
        if (const int col = threadIdx.x * 8; col < H) {
            if (w_branch != nullptr) branch_weight_first = *reinterpret_cast<const uint4*>(w_branch + col);
            if (w_next != nullptr) next_weight_first = *reinterpret_cast<const uint4*>(w_next + col);
        }
        if constexpr (WAIT) {
            pdl_wait();
            pdl_trigger();
        }
        if (const int col = threadIdx.x * 8; col < H) x_first = *reinterpret_cast<const uint4*>(x + col);
    }
    // Vector j (at column col) of p as fp32: preloaded (vector 0 with PRELOAD; j is a compile-time index) or loaded.
    auto vector_at = [&](const T* p, const uint4& first, int j, int col, float (&out)[8]) {
        if (PRELOAD && j == 0) unpack8_as_float<T>(first, out);
        else load8_as_float(p + col, out);
    };
    auto add_x = [&](float (&v)[MAX_VECS][8]) {  // v <- T(x + v)
        FOR_VECS(j, col) {
            float a[8];
            vector_at(x, x_first, j, col, a);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[j][e] = round_to(a[e] + v[j][e], x);
        }
    };
    auto normalize_with = [&](float (&v)[MAX_VECS][8], const T* weight, const uint4& first) {
        normalize_by<T>(v, [&](int j, int col, float (&w)[8]) { vector_at(weight, first, j, col, w); }, H, eps);
    };
    float v[MAX_VECS][8];
    FOR_VECS(j, col) load8_as_float(branch + col, v[j]);
    if (mode != 1) add_x(v);
    if (mode != 0) {
        normalize_with(v, w_branch, branch_weight_first);
        if (mode == 1) add_x(v);
    }
    if (sum_out != nullptr) {
        FOR_VECS(j, col) store_row8(sum_out + col, v[j]);
    }
    if (w_next == nullptr) return;
    normalize_with(v, w_next, next_weight_first);
    FOR_VECS(j, col) store_row8(next_out + col, v[j]);
}
