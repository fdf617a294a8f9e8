// The tensor-core low-bit kernels' weight fragments (gemm_quant_mma.cu, gemm_quant_tile.cu): mma.sync m16n8k16 with
// the weights as the 16-row A operand, a lane (g = lane / 4, t = lane % 4) holding one 16-byte chunk (4 words) of
// rows g and g + 8 per step of 16 words, dequantized straight into A fragments.
#pragma once
#include "quant_layout.cuh"

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (Magic<T>::bits == 0x4300u) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

template <typename T> __device__ __forceinline__ unsigned vec2_bits(typename Vec2<T>::type v) {
    return *reinterpret_cast<unsigned*>(&v);
}

// One row's part of a step as loaded: its 4 words, INT3 high bits, and the scale / zero of the (at most two)
// groups the words span (INT2/INT3: 64 columns, groups of 32).
struct RowChunk {
    unsigned w[4];
    unsigned high[2];
    unsigned short scale_bits[2];
    int zero[2];
};

// Lanes past the end of K (words % 4 == 0: a lane's 4 words are all in or all out) get zero codes (finite; their
// activations are zero) but the scale / zero of the step's first word: with POST_SCALE each lane scales sums over
// the whole quad's columns, so it needs the row's scale even when its own words are missing.
template <int BITS>
__device__ __forceinline__ void load_row_chunk(const QuantMatrix& mat, int row, int words, int first_word,
                                               int step_word, int group_shift, int groups, int midpoint,
                                               RowChunk& rc) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    const bool valid = first_word < words;
    if (valid) {
        const uint4 v = load_stream(
            reinterpret_cast<const uint4*>(mat.qweight + static_cast<long long>(row) * words + first_word));
        rc.w[0] = v.x; rc.w[1] = v.y; rc.w[2] = v.z; rc.w[3] = v.w;
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) rc.w[j] = 0u;
    }
    rc.high[0] = rc.high[1] = 0u;
    if constexpr (BITS == 3) {
        if (valid) {
            const unsigned* high = mat.qhigh + static_cast<long long>(row) * (words / 2) + first_word / 2;
            rc.high[0] = __ldg(high);
            rc.high[1] = __ldg(high + 1);
        }
    }
    const int word = valid ? first_word : step_word;
    const long long gi = static_cast<long long>(row) * groups;
    const int group0 = (word * cpw) >> group_shift, group1 = ((word + 3) * cpw) >> group_shift;
    load_group(mat, static_cast<unsigned>(gi + group0), midpoint, rc.scale_bits[0], rc.zero[0]);
    load_group(mat, static_cast<unsigned>(gi + group1), midpoint, rc.scale_bits[1], rc.zero[1]);
}

// A row's fragment pairs of one step, ready for the mma: (q - z), times the scale unless POST_SCALE (one group per
// step: the scale multiplies the step's fp32 products instead, 1 instruction per 8 weights instead of 1 per 2).
template <int BITS, typename T, bool POST_SCALE>
struct RowFragments {
    unsigned w[4];
    unsigned high[2];
    unsigned magic_minus[4];
    typename Vec2<T>::type scale[4];

    __device__ __forceinline__ RowFragments(const RowChunk& rc, int first_word, int group_shift, int scale_is_bf16) {
        constexpr int cpw = Layout<BITS>::cols_per_word;
        const int group0 = (first_word * cpw) >> group_shift;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            w[j] = rc.w[j];
            // Selects, not rc.zero[k]: a run-time index would put the arrays in local memory.
            const bool second = !POST_SCALE && (((first_word + j) * cpw) >> group_shift) != group0;
            const int zero = second ? rc.zero[1] : rc.zero[0];
            // INT8 codes do not fit bf16's 7 mantissa bits: fp32 magic 2^23 (+ z), then an exact conversion.
            magic_minus[j] = BITS == 8 ? __float_as_uint(8388608.0f + static_cast<float>(zero))
                                       : magic_minus_zero<T>(zero);
            if constexpr (!POST_SCALE) {
                const T s = from_float<T>(scale_to_float(second ? rc.scale_bits[1] : rc.scale_bits[0], scale_is_bf16));
                scale[j] = typename Vec2<T>::type{s, s};
            }
        }
        high[0] = rc.high[0];
        high[1] = rc.high[1];
    }

    // Pair i of word j.
    __device__ __forceinline__ unsigned pair(int j, int i) const {
        typename Vec2<T>::type v;
        if constexpr (BITS == 8) {  // bytes (k0, k2, k1, k3): pair i = bytes i and i + 2
            const float offset = __uint_as_float(magic_minus[j]);
            const float even = __uint_as_float(0x4B000000u | ((w[j] >> (8 * i)) & 0xFFu)) - offset;
            const float odd = __uint_as_float(0x4B000000u | ((w[j] >> (16 + 8 * i)) & 0xFFu)) - offset;
            v = typename Vec2<T>::type{from_float<T>(even), from_float<T>(odd)};  // |q - z| <= 255: exact
        } else {
            unsigned h = 0u;
            if constexpr (BITS == 3) h = high[j / 2] >> (8 * (j & 1));
            v = weight_pair<BITS, T>(w[j], h, i, magic_minus[j]);
        }
        if constexpr (POST_SCALE) return vec2_bits<T>(v);
        else return vec2_bits<T>(__hmul2(v, scale[j]));
    }
};
