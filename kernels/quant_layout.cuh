// The QuantLinear weight layout of tinyloop_hf/quant_tinyloop.py as the kernels read it (shared by the CUDA-core
// GEMV and the tensor-core small-M GEMM).
//
// Row-major int32 words, each word holding 32/b consecutive columns with the even columns in bits 0-15 and the odd
// ones in bits 16-31, so masking one field per 16-bit half gives two adjacent columns ("pair" i = columns 2i, 2i+1)
// as an (fp16|bf16)x2 through the magic-number trick. INT3 = INT2 low plane + 1-bit high plane (bit j of a high
// word's low half is column 2j of its 32 columns).
#pragma once
#include "common.cuh"

template <int BITS> struct Layout {
    static constexpr int low_bits = BITS == 3 ? 2 : BITS;
    static constexpr int cols_per_word = 32 / low_bits;
    static constexpr int pairs_per_word = cols_per_word / 2;
};

struct QuantMatrix {
    const unsigned* qweight;       // [N, K * low_bits / 32]
    const unsigned* qhigh;         // INT3: [N, K / 32], else null
    const unsigned short* scales;  // [N, groups] fp16 or bf16 bits
    const unsigned char* zeros;    // [N, groups] or null (symmetric: midpoint)
};

// (MAGIC + z) in both halves: subtracting it from (field | MAGIC) leaves the exact q - z (INT2/3/4).
template <typename T>
__device__ __forceinline__ unsigned magic_minus_zero(int zero) {
    // z * 0x10001 + MAGIC * 0x10001 (no carry between the halves: MAGIC + z < 2^16): one IMAD, not add-shift-or.
    return static_cast<unsigned>(zero) * 0x10001u + Magic<T>::bits * 0x10001u;
}

// Pair i of a weight word (INT2/3/4) as exact (q - z) values; `high` is INT3's high-plane bits for this word.
template <int BITS, typename T>
__device__ __forceinline__ typename Vec2<T>::type weight_pair(unsigned word, unsigned high, int i,
                                                              unsigned magic_minus) {
    constexpr int lb = Layout<BITS>::low_bits;
    constexpr unsigned mask = ((1u << lb) - 1) | (((1u << lb) - 1) << 16);
    if constexpr (BITS == 3) {
        const unsigned fields = ((word >> (lb * i)) & mask) | (((high >> i) & 0x00010001u) << 2);
        return centered_pair<T>(fields, magic_minus);
    } else {
        const unsigned magic = Magic<T>::bits | (Magic<T>::bits << 16);
        const unsigned biased = and_or(word >> (lb * i), mask, magic);  // MAGIC + q in both halves
        return __hsub2(bits_as_vec2<T>(biased), bits_as_vec2<T>(magic_minus));
    }
}

// The scale bits and zero at index `index` (row * groups + group); symmetric: the midpoint.
__device__ __forceinline__ void load_group(const QuantMatrix& mat, unsigned index, int midpoint,
                                           unsigned short& scale_bits, int& zero) {
    scale_bits = __ldg(mat.scales + index);
    zero = mat.zeros ? static_cast<int>(__ldg(mat.zeros + index)) : midpoint;
}

// INT3: the high-plane bits of word `word_index` of `row` (a high word covers two low words).
template <int BITS>
__device__ __forceinline__ unsigned high_bits_for(const QuantMatrix& mat, int row, int words_per_row, int word_index) {
    if constexpr (BITS == 3) {
        const unsigned h = __ldg(mat.qhigh + static_cast<long long>(row) * (words_per_row / 2) + word_index / 2);
        return h >> (8 * (word_index & 1));
    } else {
        return 0u;
    }
}

// The matrix a CTA of a fused projection works on: CTAs are assigned to up to three matrices in order, whose
// outputs are concatenated along the columns of y (QKV); `first_only` (SwiGLU: gate and up share the CTAs' rows)
// keeps every CTA on matrix 0. `block` is then the CTA's index within its matrix.
template <typename T>
struct ProjectionSlot {
    QuantMatrix mat;
    const T* bias;
    int N;
    int column;
    int block;
};

template <typename T>
__device__ __forceinline__ ProjectionSlot<T> select_projection(int block, int rows_per_cta, bool first_only,
                                                               QuantMatrix m0, const T* b0, int N0, QuantMatrix m1,
                                                               const T* b1, int N1, QuantMatrix m2, const T* b2,
                                                               int N2) {
    const int blocks0 = (N0 + rows_per_cta - 1) / rows_per_cta, blocks1 = (N1 + rows_per_cta - 1) / rows_per_cta;
    if (first_only || block < blocks0) return {m0, b0, N0, 0, block};
    block -= blocks0;
    if (block < blocks1) return {m1, b1, N1, N0, block};
    return {m2, b2, N2, N0 + N1, block - blocks1};
}
