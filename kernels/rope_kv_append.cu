// RoPE on the fused QKV projection output and KV append into the paged cache, one warp per (token, head).
//
// qkv: [tokens, (Hq + 2 Hkv) * D] (T), tokens = B * S in row-major (b, s) order. cos/sin: [tokens, D/2] fp32,
// computed once per forward by the reference rope_angles. Rotation as ops_tinyloop.rope: fp32 math (no fused
// multiply-add, so results match the reference bit for bit), result rounded to T.
//   rotate_half (layout 0): dim p pairs with p + D/2;  interleaved (layout 1): 2p with 2p + 1.
// Outputs: q_out [tokens, Hq, D]; K and V into pages [blocks, Hkv, 16, D] at the cache position of each
// token (slot = block_table[b][pos / 16] * 16 + pos % 16). INT8 pages (kv_int8 = 1) store round(x / s) with
// s = max|x| / 127 per (token, KV head) in k_scale/v_scale [blocks, Hkv, 16]. k_out/v_out (optional,
// [tokens, Hkv, D]) receive the rotated K and V for a prefill's contiguous attention.
#include "common.cuh"

constexpr int PAGE = 16;

template <typename T>
__global__ void rope_kv_append(const T* __restrict__ qkv, const float* __restrict__ cos_table,
                               const float* __restrict__ sin_table, T* __restrict__ q_out, void* k_pages,
                               void* v_pages, float* k_scale, float* v_scale, const int* __restrict__ block_table,
                               const int* __restrict__ positions, T* k_out, T* v_out, int tokens, int S, int Hq,
                               int Hkv, int D, int max_blocks, int layout, int kv_int8) {
    pdl_trigger();
    const int warp_id = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int heads = Hq + 2 * Hkv;
    if (warp_id >= tokens * heads) return;
    const int token = warp_id / heads, head = warp_id % heads;
    const int b = token / S;
    const T* src = qkv + static_cast<long long>(token) * heads * D + head * D;
    const int half = D / 2;
    constexpr int MAX_PER_LANE = 8;  // D <= 256
    float out[MAX_PER_LANE];
    int dims[MAX_PER_LANE];
    int n = 0;
    const bool rotate = head < Hq + Hkv;
    for (int p = lane; p < half; p += 32) {
        const int d0 = layout == 0 ? p : 2 * p, d1 = layout == 0 ? p + half : 2 * p + 1;
        const float a = to_float(src[d0]), c = to_float(src[d1]);
        if (rotate) {
            const float cs = cos_table[token * half + p], sn = sin_table[token * half + p];
            out[n] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(c, sn));
            out[n + 1] = __fadd_rn(__fmul_rn(c, cs), __fmul_rn(a, sn));
        } else {
            out[n] = a;
            out[n + 1] = c;
        }
        dims[n] = d0;
        dims[n + 1] = d1;
        n += 2;
    }
    if (head < Hq) {
        T* dst = q_out + (static_cast<long long>(token) * Hq + head) * D;
        for (int i = 0; i < n; ++i) dst[dims[i]] = from_float<T>(out[i]);
        return;
    }
    const bool is_key = head < Hq + Hkv;
    const int kv_head = is_key ? head - Hq : head - Hq - Hkv;
    T* contiguous = is_key ? k_out : v_out;
    if (contiguous) {
        T* dst = contiguous + (static_cast<long long>(token) * Hkv + kv_head) * D;
        for (int i = 0; i < n; ++i) dst[dims[i]] = from_float<T>(out[i]);
    }
    if (block_table == nullptr) return;  // no cache: contiguous outputs only
    const int pos = positions[token];
    const int block = block_table[b * max_blocks + pos / PAGE];
    const long long slot = (static_cast<long long>(block) * Hkv + kv_head) * PAGE + pos % PAGE;
    if (kv_int8) {
        float amax = 0.0f;
        for (int i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(to_float(from_float<T>(out[i]))));
        amax = warp_max(amax);
        const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
        signed char* dst = static_cast<signed char*>(is_key ? k_pages : v_pages) + slot * D;
        for (int i = 0; i < n; ++i) {
            const float v = to_float(from_float<T>(out[i]));
            dst[dims[i]] = static_cast<signed char>(__float2int_rn(fminf(fmaxf(v / scale, -127.0f), 127.0f)));
        }
        if (lane == 0) (is_key ? k_scale : v_scale)[slot] = scale;
    } else {
        T* dst = static_cast<T*>(is_key ? k_pages : v_pages) + slot * D;
        for (int i = 0; i < n; ++i) dst[dims[i]] = from_float<T>(out[i]);
    }
}
