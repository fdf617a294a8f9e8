// SwiGLU of prompt rows: out[m, n] = silu(gate[m, n]) * up[m, n], rounded as the unfused reference rounds (silu to
// T, then the product to T). gate and up are [M, N] with row stride ld (the two halves of one fused gate/up GEMM
// output, or two separate outputs); out is [M, N] contiguous. 8 elements per thread step (16-byte accesses:
// N % 8 == 0 and 16-byte aligned rows, checked by the caller). One kernel instead of PyTorch's silu and mul over
// strided halves (two passes at non-vectorized speed).
#include "common.cuh"

template <typename T>
__global__ void swiglu(const T* __restrict__ gate, const T* __restrict__ up, int ld, T* __restrict__ out, int M,
                       int N) {
    const int per_row = N / 8;
    const long long total = static_cast<long long>(M) * per_row;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long m = i / per_row;
        const int col = static_cast<int>(i % per_row) * 8;
        float g[8], u[8];
        load8_as_float(gate + m * ld + col, g);
        load8_as_float(up + m * ld + col, u);
#pragma unroll
        for (int e = 0; e < 8; ++e) g[e] = to_float(from_float<T>(silu(g[e]))) * u[e];
        store_row8(out + m * N + col, g);
    }
}
