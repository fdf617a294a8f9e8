// Probe v2: a decode megakernel's structure with a throttled producer warp. Warp 0 (producer) streams each CTA's
// weight share of every layer application (4 slots: QKV, O, gate/up, down) into shared memory in chunks of `chunk`
// bytes, at most `inflight` chunks in flight, a slot of app a+1 only once the consumers released it for app a. Warps
// 1.. (consumers) run 5 phases per app with a grid barrier after each (consumers only), reading each slot once its
// chunks landed, plus a 4 KiB L2 activation read per phase and K/V in phase 1.
#include <cuda_bf16.h>

#include "tma.cuh"

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"r"(blockDim.x - 32) : "memory"); }

__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
    consumers_sync();
    if (threadIdx.x == 32) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        } while (seen < target);
    }
    consumers_sync();
}

constexpr int THREADS = 512;
constexpr int RING = 128;  // chunk mbarriers, reused cyclically

extern "C" __global__ void __launch_bounds__(THREADS, 1) pipe_probe(
    const unsigned char* weights, const unsigned char* kv, int unique_layers, int apps, unsigned s0, unsigned s1,
    unsigned s2, unsigned s3, unsigned kv_bytes, float* act, unsigned* counter, float* out, int mode,
    unsigned chunk, int inflight) {
    // mode bit 0: stream weights; bit 1: barriers; bit 2: kv; bit 3: activations
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long ring[RING];
    __shared__ __align__(8) unsigned long long empty[4];
    __shared__ float red[THREADS / 32];
    const unsigned sizes[4] = {s0, s1, s2, s3};
    unsigned offsets[4], chunks[4];
    offsets[0] = 0;
    for (int s = 1; s < 4; ++s) offsets[s] = offsets[s - 1] + sizes[s - 1];
    unsigned per_app = 0, first_chunk[4];
    for (int s = 0; s < 4; ++s) {
        chunks[s] = (sizes[s] + chunk - 1) / chunk;
        first_chunk[s] = per_app;
        per_app += chunks[s];
    }
    const unsigned layer_bytes = offsets[3] + sizes[3];
    const int G = gridDim.x, cta = blockIdx.x;
    const bool stream = mode & 1, barriers = mode & 2, read_kv = mode & 4, read_act = mode & 8;
    auto src = [&](int app, int s) {
        const int layer = app % unique_layers;
        return weights + static_cast<size_t>(layer) * G * layer_bytes + static_cast<size_t>(offsets[s]) * G +
               static_cast<size_t>(cta) * sizes[s];
    };
    if (threadIdx.x == 0) {
        for (int i = 0; i < RING; ++i) mbar_init(&ring[i], 1);
        for (int s = 0; s < 4; ++s) mbar_init(&empty[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the producer warp
        if (threadIdx.x != 0 || !stream) return;
        unsigned long long issued = 0;
        for (int app = 0; app < apps; ++app) {
            for (int s = 0; s < 4; ++s) {
                if (app > 0) mbar_wait(&empty[s], (app - 1) & 1);  // consumers released slot s of app - 1
                for (unsigned c = 0; c < chunks[s]; ++c, ++issued) {
                    if (issued >= static_cast<unsigned long long>(inflight)) {
                        const unsigned long long old = issued - inflight;
                        mbar_wait(&ring[old % RING], (old / RING) & 1);
                    }
                    const unsigned o = c * chunk, n = min(chunk, sizes[s] - o);
                    unsigned long long* bar = &ring[issued % RING];
                    mbar_expect(bar, n);
                    bulk_copy(smem + offsets[s] + o, src(app, s) + o, n, bar);
                }
            }
        }
        return;
    }
    // consumers
    const int ct = threadIdx.x - 32, CT = THREADS - 32;
    float acc = 0.0f;
    unsigned phase_count = 0;
    auto consume = [&](int app, int s) {
        if (!stream) return;
        const unsigned long long base = static_cast<unsigned long long>(app) * per_app + first_chunk[s];
        for (unsigned c = 0; c < chunks[s]; ++c) {
            const unsigned long long i = base + c;
            mbar_wait(&ring[i % RING], (i / RING) & 1);
        }
        const uint4* p = reinterpret_cast<const uint4*>(smem + offsets[s]);
        unsigned x = 0;
        for (unsigned i = ct; i < sizes[s] / 16; i += CT) {
            const uint4 v = p[i];
            x ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        acc += static_cast<float>(x & 1);
        consumers_sync();
        if (ct == 0) mbar_arrive(&empty[s]);
    };
    auto activation = [&]() {
        if (!read_act) return;
        const float* a = act + (phase_count & 1) * G * 64;
        float v[3];
#pragma unroll
        for (int j = 0; j < 3; ++j) {
            const int i = ct + j * CT;
            v[j] = i < G * 8 ? __ldcg(a + i * 8) : 0.0f;
        }
        acc += v[0] + v[1] + v[2];
    };
    const bool ll = mode & 4096;
    // LL sync: `ll_vec` holds the phase's output vector as 16-byte words {d0, seq, d1, seq}; each CTA writes its
    // slice of `words` words with seq = phase + 1, then every consumer thread polls its share of the next input.
    auto ll_phase = [&](int words) {
        const unsigned seq = phase_count + 1;
        uint4* ll_vec = reinterpret_cast<uint4*>(act) + (phase_count % 5) * 1408;  // a buffer per phase
        const int per = (words + G - 1) / G;
        for (int i = ct; i < per; i += CT) {
            const int w = cta * per + i;
            if (w < words) {
                const unsigned d = __float_as_uint(acc) + w;
                asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %2};" ::"l"(ll_vec + w), "r"(d),
                             "r"(seq), "r"(d ^ 1u) : "memory");
            }
        }
        float v = 0.0f;
        for (int w = ct; w < words; w += CT) {
            uint4 x;
            do {
                asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "l"(ll_vec + w) : "memory");
            } while (x.y != seq || x.w != seq);
            v += __uint_as_float(x.x & 0x3fffffffu);
        }
        acc += v * 1e-30f;
        consumers_sync();
    };
    int phase_words = 512;
    auto finish_phase = [&]() {
        if (ll) {
            ll_phase(phase_words);
            ++phase_count;
            return;
        }
        if (ct < 64) act[((phase_count + 1) & 1) * G * 64 + cta * 64 + ct] = acc;
        ++phase_count;
        if (barriers) grid_barrier(counter, phase_count * G);
    };
    for (int app = 0; app < apps; ++app) {
        activation();
        consume(app, 0);
        finish_phase();
        activation();
        if (read_kv) {
            const uint4* p = reinterpret_cast<const uint4*>(kv + (static_cast<size_t>(app) * G + cta) * kv_bytes);
            unsigned x = 0;
            for (unsigned i = ct; i < kv_bytes / 16; i += CT) {
                const uint4 v = __ldcg(p + i);
                x ^= v.x ^ v.y;
            }
            acc += static_cast<float>(x & 1);
        }
        finish_phase();
        activation();
        consume(app, 1);
        finish_phase();
        activation();
        consume(app, 2);
        finish_phase();
        activation();
        consume(app, 3);
        phase_words = 1408;
        finish_phase();
        phase_words = 512;
    }
    if (ct == 0) out[cta] = acc;
}
