// RMSNorm and the residual junction of a block, one CTA per token row (the math lives in norm.cuh).
#include "norm.cuh"

template <typename T>
__global__ void rms_norm(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out, int H,
                         float eps) {
    pdl_trigger();
    const long long base = static_cast<long long>(blockIdx.x) * H;
    float v[MAX_VECS][8];
    FOR_VECS(j, col) load8_as_float(x + base + col, v[j]);
    normalize(v, weight, H, eps);
    FOR_VECS(j, col) store_row8(out + base + col, v[j]);
}

// Bounded for 1024-thread launches (hidden 8192+): the preloaded vectors would otherwise take it past 64 registers.
// WAIT: launched programmatically (it starts while the GEMV before it runs): the norm weights are loaded before
// pdl_wait, and the next launch may start once this one is past it. Otherwise a plain launch that lets the next
// launch start at once.
template <typename T, bool WAIT>
__global__ void __launch_bounds__(1024)
    residual_norm(const T* __restrict__ x, const T* __restrict__ branch, const T* __restrict__ w_branch,
                  const T* __restrict__ w_next, T* __restrict__ sum_out, T* __restrict__ next_out, int H, float eps,
                  int mode) {
    if constexpr (!WAIT) pdl_trigger();
    const long long base = static_cast<long long>(blockIdx.x) * H;
    junction_row<T, true, WAIT>(x + base, branch + base, w_branch, w_next, sum_out + base, next_out + base, H, eps,
                                mode);
}
