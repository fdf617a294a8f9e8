// Prefill path (many token rows): dequantize low-bit weights to the activation dtype, then cuBLAS does the GEMM.
// One launch serves up to three matrices of one format and K (a fused projection: QKV, gate + up), written as
// consecutive row blocks of one [sum N, K] buffer; blockIdx.y picks the matrix. (q - z) * s in fp32, rounded once:
// the reference path's rounding.
//
// One word per thread step, consecutive threads on consecutive words: a warp's stores are one contiguous span
// (dequantizing writes 2-4x the bytes it reads, so the stores set the pace). Measured on the H200: 4 words per
// thread (one 16-byte load, stores 64 bytes apart across lanes) made the prefill dequantization 1.5x slower.
#include "quant_layout.cuh"

template <typename T>
__device__ __forceinline__ unsigned pack_pair(float a, float b) {
    typename Vec2<T>::type v{from_float<T>(a), from_float<T>(b)};
    return *reinterpret_cast<unsigned*>(&v);
}

// One weight word (cols_per_word columns starting at col0 of `row`) to dst.
template <int BITS, typename T>
__device__ __forceinline__ void dequantize_word(const QuantMatrix& mat, unsigned word, int row, int words,
                                                int word_index, int group_shift, int groups, int scale_is_bf16,
                                                int midpoint, T* __restrict__ dst) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    unsigned short scale_bits;
    int z;
    const unsigned group_index = static_cast<unsigned>(row) * groups + ((word_index * cpw) >> group_shift);
    load_group(mat, group_index, midpoint, scale_bits, z);
    const float s = scale_to_float(scale_bits, scale_is_bf16);
    unsigned packed[cpw / 2];  // column pairs (2j, 2j + 1)
    if constexpr (BITS == 8) {  // bytes (k0, k2, k1, k3)
        const int q[4] = {static_cast<int>(word & 0xFF), static_cast<int>((word >> 16) & 0xFF),
                          static_cast<int>((word >> 8) & 0xFF), static_cast<int>(word >> 24)};
        packed[0] = pack_pair<T>(static_cast<float>(q[0] - z) * s, static_cast<float>(q[1] - z) * s);
        packed[1] = pack_pair<T>(static_cast<float>(q[2] - z) * s, static_cast<float>(q[3] - z) * s);
        *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);  // 8-byte aligned: K % 32 == 0
    } else {
        constexpr int lb = Layout<BITS>::low_bits;
        const unsigned high = high_bits_for<BITS>(mat, row, words, word_index);
#pragma unroll
        for (int j = 0; j < cpw / 2; ++j) {
            int even = (word >> (lb * j)) & ((1 << lb) - 1), odd = (word >> (16 + lb * j)) & ((1 << lb) - 1);
            if constexpr (BITS == 3) {
                even |= ((high >> j) & 1) << 2;
                odd |= ((high >> (16 + j)) & 1) << 2;
            }
            packed[j] = pack_pair<T>(static_cast<float>(even - z) * s, static_cast<float>(odd - z) * s);
        }
#pragma unroll
        for (int v = 0; v < cpw / 8; ++v)  // 16-byte aligned: K % 32 == 0 (QuantFormat)
            reinterpret_cast<uint4*>(dst)[v] =
                make_uint4(packed[4 * v], packed[4 * v + 1], packed[4 * v + 2], packed[4 * v + 3]);
    }
}

template <int BITS, typename T>
__global__ void dequantize_weights(
    const unsigned* qw0, const unsigned* qh0, const unsigned short* sc0, const unsigned char* zr0, int N0,
    const unsigned* qw1, const unsigned* qh1, const unsigned short* sc1, const unsigned char* zr1, int N1,
    const unsigned* qw2, const unsigned* qh2, const unsigned short* sc2, const unsigned char* zr2, int N2,
    T* __restrict__ out, int K, int group_shift, int groups, int scale_is_bf16, int midpoint) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    const int matrix = blockIdx.y;
    const QuantMatrix mat = matrix == 0 ? QuantMatrix{qw0, qh0, sc0, zr0}
                            : matrix == 1 ? QuantMatrix{qw1, qh1, sc1, zr1} : QuantMatrix{qw2, qh2, sc2, zr2};
    const int N = matrix == 0 ? N0 : matrix == 1 ? N1 : N2;
    const long long first_row = matrix == 0 ? 0 : matrix == 1 ? N0 : N0 + N1;
    const int words = K / cpw;
    const long long total = static_cast<long long>(N) * words;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int row = static_cast<int>(i / words), word_index = static_cast<int>(i % words);
        dequantize_word<BITS, T>(mat, __ldg(mat.qweight + i), row, words, word_index, group_shift, groups,
                                 scale_is_bf16, midpoint, out + (first_row + row) * K + word_index * cpw);
    }
}

// The embedding lookup of QuantEmbedding on the CUDA path: output row r = row ids[r] of the packed table, word by
// word as dequantize_weights (so exactly the reference path's lookup), in one launch where the reference ops take
// ~20 small kernels (gathers of each packed tensor, unpacking, the group expansion). blockIdx.x = output row (a prompt
// can pass grid y's limit of 65,535 rows: batch 16 x 8,192 tokens), blockIdx.y = block of words.
// An id outside the table stops the kernel with a message, as torch's gather asserts on the device.
template <int BITS, typename T>
__global__ void dequantize_rows(const unsigned* qw, const unsigned* qh, const unsigned short* sc,
                                const unsigned char* zr, const long long* __restrict__ ids, int table_rows,
                                T* __restrict__ out, int K, int group_shift, int groups, int scale_is_bf16,
                                int midpoint) {
    constexpr int cpw = Layout<BITS>::cols_per_word;
    const int words = K / cpw, word_index = blockIdx.y * blockDim.x + threadIdx.x;
    if (word_index >= words) return;
    const long long id = ids[blockIdx.x];
    if (id < 0 || id >= table_rows) {
        if (word_index == 0) printf("dequantize_rows: token id %lld is outside the table [0, %d)\n", id, table_rows);
        __trap();
    }
    const int row = static_cast<int>(id);
    const QuantMatrix mat{qw, qh, sc, zr};
    dequantize_word<BITS, T>(mat, __ldg(qw + static_cast<long long>(row) * words + word_index), row, words,
                             word_index, group_shift, groups, scale_is_bf16, midpoint,
                             out + static_cast<long long>(blockIdx.x) * K + word_index * cpw);
}
