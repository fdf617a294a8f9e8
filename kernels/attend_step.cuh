// One step of a split-KV decode attention's token loop (fused_decode.cu): each "sub" of D/8 lanes serves one token,
// 8 of its D elements per lane, UNROLL tokens per sub per step.
#pragma once
#include "common.cuh"

// The scores of UNROLL tokens against the G (<= MAXG) query vectors q_s [G][D] (shared memory, pre-scaled by
// softmax_scale * log2(e)), the online-softmax update of (m, l) and the V accumulation into o. k_raw / v_raw: the
// tokens' 8 elements in T as loaded; from_new[u]: token u is the step's new one, its K / V taken from k_new / v_new
// (shared memory) instead; attended[u]: token u takes part (others score -inf). Every lane of the warp calls it
// (full-mask shuffles over each sub's lanes).
template <typename T, int D, int MAXG, int UNROLL>
__device__ __forceinline__ void attend_step(const uint4 (&k_raw)[UNROLL], const uint4 (&v_raw)[UNROLL],
                                            const bool (&from_new)[UNROLL], const bool (&attended)[UNROLL],
                                            const float* q_s, const float* k_new, const float* v_new, int G,
                                            int offset, float (&m)[MAXG], float (&l)[MAXG], float (&o)[MAXG][8]) {
    constexpr int per_token = D / 8;
    // Token u's 8 elements of K or V: the step's new token from shared memory, the others as loaded.
    auto elements = [&](int u, const uint4& raw, const float* fresh, float (&out)[8]) {
        if (from_new[u]) {
#pragma unroll
            for (int e = 0; e < 8; ++e) out[e] = fresh[offset + e];
        } else {
            unpack8_as_float<T>(raw, out);
        }
    };
    float s[UNROLL][MAXG];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float k[8];
        elements(u, k_raw[u], k_new, k);
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            float dot = 0.0f;
            if (g < G) {
#pragma unroll
                for (int e = 0; e < 8; ++e) dot += q_s[g * D + offset + e] * k[e];
            }
#pragma unroll
            for (int width = per_token / 2; width > 0; width >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, width);
            s[u][g] = attended[u] && g < G ? dot : -TL_INF;
        }
    }
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        float top = m[g];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) top = fmaxf(top, s[u][g]);
        const float rescale = top == -TL_INF ? 1.0f : exp2f(m[g] - top);
        l[g] *= rescale;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[g][e] *= rescale;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            s[u][g] = top == -TL_INF ? 0.0f : exp2f(s[u][g] - top);
            l[g] += s[u][g];
        }
        m[g] = top;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float v[8];
        elements(u, v_raw[u], v_new, v);
#pragma unroll
        for (int g = 0; g < MAXG; ++g)
#pragma unroll
            for (int e = 0; e < 8; ++e) o[g][e] = fmaf(s[u][g], v[e], o[g][e]);
    }
}

// After the subs' states are merged (cluster.cuh's merge_warp_states), the first sub's lanes (lane < D/8) store the
// warp's state: 8 dims of o per lane into warp_o [G][D], (m, l) per query vector into warp_ml [G][2] (both pointing
// at this warp's slot).
template <int D, int MAXG>
__device__ __forceinline__ void store_warp_state(const float (&m)[MAXG], const float (&l)[MAXG],
                                                 const float (&o)[MAXG][8], int G, int lane, float* warp_o,
                                                 float* warp_ml) {
    if (lane >= D / 8) return;
    const int offset = lane * 8;
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g < G) {
#pragma unroll
            for (int e = 0; e < 8; ++e) warp_o[g * D + offset + e] = o[g][e];
            if (lane == 0) {
                warp_ml[g * 2] = m[g];
                warp_ml[g * 2 + 1] = l[g];
            }
        }
    }
}
