// Shared device helpers for the tinyloop_hf kernels (compiled by NVRTC through CuPy; no host headers).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define TL_INF __int_as_float(0x7f800000)

// Activation types: fp16 or bf16, chosen per kernel instantiation.
template <typename T> struct Vec2;
template <> struct Vec2<__half> { using type = __half2; };
template <> struct Vec2<__nv_bfloat16> { using type = __nv_bfloat162; };

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Magic-number dequantization (see kernels.md §4): OR-ing a small unsigned code q into the mantissa of
// MAGIC gives the exact value MAGIC + q; subtracting MAGIC + z then gives the exact integer q - z.
// fp16: 0x6400 = 1024 (10 mantissa bits, codes < 1024); bf16: 0x4300 = 128 (7 mantissa bits, codes < 128).
template <typename T> struct Magic;
template <> struct Magic<__half> { static constexpr unsigned bits = 0x6400u; };
template <> struct Magic<__nv_bfloat16> { static constexpr unsigned bits = 0x4300u; };

template <typename T>
__device__ __forceinline__ typename Vec2<T>::type bits_as_vec2(unsigned v) {
    return *reinterpret_cast<typename Vec2<T>::type*>(&v);
}

// A pair of adjacent columns (field & mask | MAGIC), minus (MAGIC + z) in both halves: exact (q - z) values.
template <typename T>
__device__ __forceinline__ typename Vec2<T>::type centered_pair(unsigned fields, unsigned magic_minus) {
    const unsigned magic = Magic<T>::bits | (Magic<T>::bits << 16);
    return __hsub2(bits_as_vec2<T>(fields | magic), bits_as_vec2<T>(magic_minus));
}

// (bits & mask) | magic in one LOP3: with two immediates the compiler emits an AND and an OR.
__device__ __forceinline__ unsigned and_or(unsigned bits, unsigned mask, unsigned magic) {
    unsigned out;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(out) : "r"(bits), "r"(mask), "r"(magic));
    return out;
}

// A bf16x2's halves as floats: two integer ops (the intrinsic's conversion takes three).
__device__ __forceinline__ float2 bf16x2_bits_to_float2(unsigned bits) {
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xFFFF0000u));
}

// Scales are stored as fp16 or bf16 bit patterns regardless of the activation dtype.
__device__ __forceinline__ float scale_to_float(unsigned short bits, int scale_is_bf16) {
    return scale_is_bf16 ? __uint_as_float(static_cast<unsigned>(bits) << 16) : __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Streamed weights: read-only, no L1 allocation (they are used once; activations stay cached).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// 8 fp16/bf16 values as loaded in one 16-byte vector, as fp32.
template <typename T>
__device__ __forceinline__ void unpack8_as_float(const uint4 raw, float (&out)[8]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = to_float2(bits_as_vec2<T>(words[i]));
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// 8 consecutive fp16/bf16 values (one 16-byte load, 16-byte aligned) as fp32.
template <typename T>
__device__ __forceinline__ void load8_as_float(const T* p, float (&out)[8]) {
    unpack8_as_float<T>(*reinterpret_cast<const uint4*>(p), out);
}

// 8 fp32 values rounded to T, stored with one 16-byte store (16-byte aligned).
template <typename T>
__device__ __forceinline__ void store_row8(T* p, const float (&values)[8]) {
    T packed[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) packed[i] = from_float<T>(values[i]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(packed);
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

// Programmatic dependent launch (sm_90+; no-ops before): a kernel launched with the PDL attribute may start while
// the previous kernel on the stream finishes. pdl_wait() blocks until that kernel has completed and its writes are
// visible: call it before reading anything earlier kernels wrote (weights can be loaded before) and before any
// global write. pdl_trigger() lets the next PDL-launched kernel start launching (it still waits for completion).
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
