// The RoPE angles of a forward: cos and sin of position * inv_freq[i] for every token and i < D/2, fp32 [tokens, D/2]
// each, exactly as ops_tinyloop.rope_angles computes them (the fp32 product, then cosf / sinf: the functions torch's
// CUDA cos and sin kernels call), in one launch instead of four small kernels per decode step. It lets the next kernel
// launch at once (a programmatic launch, such as the fused decode kernel's, still waits for it to complete before
// reading anything).
#include "common.cuh"

__global__ void rope_angles(const long long* __restrict__ positions, const float* __restrict__ inv_freq, int half,
                            int tokens, float* __restrict__ cos_out, float* __restrict__ sin_out) {
    pdl_trigger();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * half) return;
    const float angle = static_cast<float>(positions[i / half]) * inv_freq[i % half];
    cos_out[i] = cosf(angle);
    sin_out[i] = sinf(angle);
}
