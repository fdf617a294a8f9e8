// Probe: the structure of a decode megakernel. One CTA per SM (512 threads), 5 phases per layer application with a
// grid barrier after each; each CTA's weight share of phases 0, 2, 3, 4 (QKV, O, gate/up, down) streamed into a
// shared-memory slot per phase by TMA bulk copies one layer ahead (slot X of layer l+1 is requested as soon as phase
// X of layer l has read it). Phase 1 (attention) reads `kv_bytes` per CTA straight from global memory. Every phase
// also reads a 4 KiB vector written by all CTAs in the previous phase (the activation) from L2.
#include <cuda_bf16.h>

#include "tma.cuh"


// Arrivals on counter[0]; the last arrival of generation `gen` publishes it in counter[32] (another line), which
// the others poll.
__device__ __forceinline__ void flag_barrier(unsigned* counter, unsigned gen, unsigned G) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
        if (old == gen * G - 1) {
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(counter + 32), "r"(gen) : "memory");
        } else {
            unsigned seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter + 32) : "memory");
            } while (seen < gen);
        }
    }
    __syncthreads();
}


__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target, bool fence, bool relaxed_poll, bool no_release) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (fence) __threadfence();
        if (no_release) asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        else asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        unsigned seen;
        if (relaxed_poll) {
            do {
                asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
            } while (seen < target);
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
        } else {
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
            } while (seen < target);
        }
    }
    __syncthreads();
}

constexpr int THREADS = 512;

// weights: [layers][4 slots][grid][slot_bytes[s]] bytes; kv: [layers][grid][kv_bytes]; act: [2][grid][64 floats]
extern "C" __global__ void __launch_bounds__(THREADS, 1) ring_probe(
    const unsigned char* weights, const unsigned char* kv, int unique_layers, int apps, unsigned s0, unsigned s1,
    unsigned s2, unsigned s3, unsigned kv_bytes, float* act, unsigned* counter, float* out, int mode) {
    // mode bit 0: stream weights; bit 1: barriers; bit 2: read kv; bit 3: read activations
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[5];
    __shared__ float red[THREADS / 32];
    const unsigned sizes[4] = {s0, s1, s2, s3};
    unsigned offsets[4];
    offsets[0] = 0;
    for (int s = 1; s < 4; ++s) offsets[s] = offsets[s - 1] + sizes[s - 1];
    const unsigned layer_bytes = offsets[3] + sizes[3];
    const int G = gridDim.x, cta = blockIdx.x;
    const bool stream = mode & 1, barriers = mode & 2, read_kv = mode & 4, read_act = mode & 8;
    const int issuer = mode & 16 ? 32 : 0;
    const bool fence = !(mode & 32), no_wait = mode & 64, evict_first = mode & 128, flag = mode & 256;
    unsigned long long policy = 0;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    auto src = [&](int app, int s) {
        const int layer = app % unique_layers;
        return weights + static_cast<size_t>(layer) * G * layer_bytes + static_cast<size_t>(offsets[s]) * G +
               static_cast<size_t>(cta) * sizes[s];
    };
    auto request = [&](int app, int s) {
        if (!stream || app >= apps || threadIdx.x != issuer) return;
        mbar_expect(&bars[s], sizes[s]);
        // in chunks of <= 32 KiB, as a row-run copy would be
        for (unsigned o = 0; o < sizes[s]; o += 32768) {
            const unsigned n = min(32768u, sizes[s] - o);
            if (evict_first) bulk_copy_hint(smem + offsets[s] + o, src(app, s) + o, n, &bars[s], policy);
            else bulk_copy(smem + offsets[s] + o, src(app, s) + o, n, &bars[s]);
        }
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < 5; ++s) mbar_init(&bars[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    for (int s = 0; s < 4; ++s) request(0, s);
    float acc = 0.0f;
    unsigned phase_count = 0;
    auto consume = [&](int app, int s) {
        if (!stream) return;
        if (!no_wait) mbar_wait(&bars[s], app & 1);
        const uint4* p = reinterpret_cast<const uint4*>(smem + offsets[s]);
        unsigned x = 0;
        for (unsigned i = threadIdx.x; i < sizes[s] / 16; i += THREADS) {
            const uint4 v = p[i];
            x ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        acc += static_cast<float>(x & 1);
        __syncthreads();  // every thread has read the slot
        request(app + 1, s);
    };
    auto activation = [&]() {
        if (!read_act) return;
        const float* a = act + (phase_count & 1) * G * 64;
        float v[3];
#pragma unroll
        for (int j = 0; j < 3; ++j) {
            const int i = threadIdx.x + j * THREADS;
            v[j] = i < G * 8 ? __ldcg(a + i * 8) : 0.0f;  // 4 KiB-ish of others' output, loads in flight together
        }
        acc += v[0] + v[1] + v[2];
    };
    const bool background = mode & 2048;
    unsigned bg_parity = 0, bg_round = 0;
    auto background_stream = [&]() {  // keep one whole-layer copy in flight into the (unused) slots
        if (!background || threadIdx.x != issuer) return;
        if (bg_round > 0 && !mbar_test(&bars[4], bg_parity)) return;
        if (bg_round > 0) bg_parity ^= 1;
        const int layer_app = bg_round++;
        mbar_expect(&bars[4], layer_bytes);
        for (unsigned o = 0; o < layer_bytes; o += 32768) {
            const unsigned n = min(32768u, layer_bytes - o);
            bulk_copy(smem + o, src(layer_app, 0) + o, n, &bars[4]);
        }
    };
    auto finish_phase = [&]() {
        background_stream();
        if (threadIdx.x < 64) act[((phase_count + 1) & 1) * G * 64 + cta * 64 + threadIdx.x] = acc;
        ++phase_count;
        if (barriers && flag) flag_barrier(counter, phase_count, G);
        else if (barriers) grid_barrier(counter, phase_count * G, fence, mode & 512, mode & 1024);
    };
    for (int app = 0; app < apps; ++app) {
        activation();
        consume(app, 0);  // QKV
        finish_phase();
        activation();
        if (read_kv) {  // attention: K/V straight from global
            const uint4* p = reinterpret_cast<const uint4*>(kv + (static_cast<size_t>(app) * G + cta) * kv_bytes);
            unsigned x = 0;
            for (unsigned i = threadIdx.x; i < kv_bytes / 16; i += THREADS) {
                const uint4 v = __ldcg(p + i);
                x ^= v.x ^ v.y;
            }
            acc += static_cast<float>(x & 1);
        }
        finish_phase();
        activation();
        consume(app, 1);  // O
        finish_phase();
        activation();
        consume(app, 2);  // gate/up
        finish_phase();
        activation();
        consume(app, 3);  // down
        finish_phase();
    }
    if (background && threadIdx.x == issuer) mbar_wait(&bars[4], bg_parity);
    __syncthreads();
    if (threadIdx.x == 0) out[cta] = acc;
}
