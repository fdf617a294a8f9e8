// Fused decode: one launch runs every layer application of a batch-1 decode step (all loops, all layers) and the
// final norm, on one CTA per SM. It exists because batch-1 decode is bound by the chain of dependent steps, not by
// bytes: ~576 kernels per step each pay a boundary and a ramp, and a grid barrier costs as much. Here
//   * each CTA owns a fixed share of every projection's rows; warp 0 (the producer) streams the CTA's share of each
//     layer application's INT4 weights, scales and zeros into shared memory with TMA bulk copies (L2 evict-first),
//     one slot per projection (QKV, O, gate/up, down), one layer application ahead, at most `inflight` batches of
//     about `chunk` bytes in flight (a deep queue of weight traffic makes every synchronization slow: H200 probe);
//   * the other warps (the consumers: 11 in a 384-thread CTA, 15 at 512) run 5 phases per layer application — QKV +
//     RoPE + K/V append, attention, O, residual junction + gate/up + SwiGLU, down — with no grid barrier: every
//     phase's output is written in LL form (each 4-byte payload next to a 4-byte sequence number, stored and loaded
//     as one access, as NCCL's LL protocol does), and consumers poll the words they need until their sequence
//     numbers match;
//   * every CTA keeps its own copy of the residual stream and recomputes the residual junctions (a few KiB of
//     math): nothing but the phase outputs crosses CTAs.
// Rounding mirrors the multi-kernel CUDA path (norm.cuh, gemv_quant.cu, paged_attention.cu, rope_epilogue.cuh).
// The host (fused_decode.py) builds every table; it serves only what this kernel implements and says why not.
#include "gemv_dot.cuh"
#include "norm.cuh"
#include "tma.cuh"
#include "cluster.cuh"
#include "attend_step.cuh"

namespace fused {

constexpr int RING = 128;          // batch mbarriers, reused cyclically (the host keeps batches per app <= RING / 2)
constexpr int MAX_TASKS = 64;      // GEMV tasks of one phase of one CTA (partial sums in shared memory)
constexpr int MAX_UNITS = 128;     // QKV pair units of one CTA
constexpr int UNROLL = 2;          // attention: tokens per sub per step
constexpr unsigned long long SPIN_LIMIT = 1ull << 22;  // seconds of polling: a deadlock traps instead of hanging
// A polling round that found words missing sleeps this long before the next: 132 CTAs x 480 threads re-reading every
// missing word at once slow the L2 round trips everyone waits on (H200, graph replay of the Ouro-1.4B step: 3.53 ms
// without, 3.34 at 32 ns, 3.37 at 128, 3.54 at 512, 3.77 at 2000; twentieth session).
constexpr unsigned POLL_BACKOFF_NS = 32;

// Matrices of a layer and their tensors (App::mat).
enum { MQ, MK, MV, MO, MGATE, MUP, MDOWN };
enum { QWEIGHT, SCALES, ZEROS };
// App::flags
constexpr int LOOP_END = 1;  // the loop pass ends after this application (final norm every loop, exit gate)

struct App {
    const void* mat[7][3];  // qweight, scales, zeros (null: symmetric)
    const void* norm[4];    // N1 input norm, N2 attention-branch norm, N3 post-attention norm, N4 MLP-branch norm
    void* k_pages;
    void* v_pages;
    int flags;
    int loop;
    int pad[2];
};

// A TMA bulk copy of part of one tensor of the application's matrices into shared memory. Pieces are grouped in
// batches (the host keeps a batch near `chunk` bytes); a batch completes on one ring mbarrier.
struct Piece {
    unsigned char mat, kind, last, pad;
    unsigned offset;       // bytes into the tensor
    unsigned bytes;
    unsigned smem;         // bytes into dynamic shared memory
    unsigned batch_bytes;  // on a batch's first piece: the batch's bytes
    unsigned pad2[3];
};

// What one CTA does in every layer application (the same for all of them).
struct Work {
    int unit0, units;      // QKV pair units (a row pair RoPE rotates together, or a pair of V rows)
    int o_quad0, o_quads;  // O rows in quads of 4
    int g_quad0, g_quads;  // intermediate rows (gate and up) in quads
    int d_quad0, d_quads;  // down rows in quads
    int piece0;            // into Params::pieces
    int slot_piece0[4], slot_pieces[4];
    int slot_batch0[4], slot_batches[4];
    int batches_per_app;
    int pad[3];
};

struct Slot {  // a projection's region of dynamic shared memory (offsets in bytes; rows in the CTA's local order)
    unsigned weights, scales, zeros;
    int row_bytes, groups, group_shift, rows_cap;  // rows_cap: local up rows start here (gate/up)
    int pad;
};

struct Params {
    int H, F, Hq, Hkv, D, Gq, apps, S, G;
    int mode;             // junction: 0 pre, 1 sandwich, 2 post_residual
    int final_every_loop, final_end, rope_interleaved, scale_bf16, midpoint, chunk, inflight;
    float eps, scale_log2;
    const int* block_table;
    const int* lengths;
    const int* starts;
    const int* positions;
    const void* final_w;
    const void* gate_w;   // exit gate [H] or null
    const void* gate_b;   // its bias [1] or null
    void* hidden_out;     // [H]
    void* gates_out;      // [loops]
    unsigned* epoch;
    uint2* q_ll;          // [Hq * D] 8-byte LL words {value bits, seq}
    uint2* k_ll;          // [Hkv * D]
    uint2* v_ll;
    uint2* part_ll;       // [Hkv][S][Gq][D + 2]: a split's attention state (m, l, o)
    uint4* attn_ll;       // [Hq * D / 4] 16-byte LL words {2 values, seq, 2 values, seq}
    uint4* o_ll;          // [H / 4]
    uint4* h_ll;          // [F / 4]
    uint4* down_ll;       // [H / 4]
    const App* apps_table;
    const Work* work;     // [G]
    const Piece* pieces;
    const unsigned* unit_rows;  // [G][MAX_UNITS]: local row of the pair's first row | second row << 16
    unsigned long long* trace;  // [apps][16][G] clock64 at phase boundaries (null: no trace)
    Slot slot[4];
    unsigned xres, stage, partials;  // dynamic shared memory offsets
    unsigned smem_bytes;
    int kv_prefetch;  // a spare producer-warp lane prefetches each attention split's cached K / V into L2
};

// ---------------------------------------------------------------------------------------------------------------
// Synchronization primitives
// ---------------------------------------------------------------------------------------------------------------

// Every consumer thread (named barrier 1; the producer warp never takes part).
template <int CONSUMERS>
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }

// LL words: relaxed gpu-scope accesses (L2, never a stale L1 line), each payload beside its sequence number.
__device__ __forceinline__ void ll_store8(uint2* p, unsigned value, unsigned seq) {
    asm volatile("st.relaxed.gpu.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(value), "r"(seq) : "memory");
}
__device__ __forceinline__ void ll_store16(uint4* p, unsigned a, unsigned b, unsigned seq) {
    asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %2};" ::"l"(p), "r"(a), "r"(seq), "r"(b)
                 : "memory");
}
// One LL word: an 8-byte {payload, seq} or a 16-byte {payload, seq, payload, seq} (each 8-byte half written at once).
__device__ __forceinline__ void ll_load(const uint2* p, uint2& v) {
    asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
}
__device__ __forceinline__ void ll_load(const uint4* p, uint4& v) {
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
}
__device__ __forceinline__ bool ll_ready(const uint2& v, unsigned seq) { return v.y == seq; }
__device__ __forceinline__ bool ll_ready(const uint4& v, unsigned seq) { return v.y == seq && v.w == seq; }
__device__ __forceinline__ void ll_payload(const uint2& v, unsigned& out) { out = v.x; }
__device__ __forceinline__ void ll_payload(const uint4& v, uint2& out) { out = make_uint2(v.x, v.z); }

// Poll up to N words at once (one round trip per round, all loads in flight together) until every word i < count
// carries seq; their payloads into out.
template <int N, typename Word, typename Payload>
__device__ __forceinline__ void ll_wait_n(const Word* const (&p)[N], int count, unsigned seq, Payload (&out)[N]) {
    bool done[N];
    Word v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) done[i] = i >= count;
    unsigned long long spins = 0;
    while (true) {
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (!done[i]) ll_load(p[i], v[i]);
        bool all = true;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (!done[i]) {
                if (ll_ready(v[i], seq)) {
                    ll_payload(v[i], out[i]);
                    done[i] = true;
                } else {
                    all = false;
                }
            }
        }
        if (all) return;
        if (++spins > SPIN_LIMIT) __trap();
        __nanosleep(POLL_BACKOFF_NS);
    }
}

// A pointer from read-only global memory (the application table), through the read-only cache.
template <typename P>
__device__ __forceinline__ P* ldg_ptr(P* const* p) {
    return reinterpret_cast<P*>(__ldg(reinterpret_cast<const unsigned long long*>(p)));
}

// What an attention split attends to: CTA `cta` (< Hkv * S) serves KV head cta / S, split cta % S, whose tokens of a
// `length`-token row are [t0, t0 + n) (P2, and the K / V prefetch ahead of it).
struct SplitSpan {
    int head, t0, n;
};
__device__ __forceinline__ SplitSpan split_span(int cta, int S, int length) {
    const int span = (length + S - 1) / S, t0 = (cta % S) * span;
    return {cta / S, t0, max(0, min(length, t0 + span) - t0)};
}

// The sequence number of phase `phase` (0..5) of application `app` in the launch of epoch `epoch`: unique across
// launches (the epoch counts them), never 0 (the buffers start zeroed).
__device__ __forceinline__ unsigned seq_of(unsigned epoch, int apps, int app, int phase) {
    const unsigned s = epoch * static_cast<unsigned>(apps * 8) + static_cast<unsigned>(app * 8 + phase + 1);
    return s == 0 ? 1u : s;
}
enum { PH_QKV, PH_PART, PH_ATTN, PH_O, PH_H, PH_DOWN };

template <typename T>
__device__ __forceinline__ unsigned pack2(float a, float b) {
    const T pa = from_float<T>(a), pb = from_float<T>(b);
    return static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(&pa)) |
           (static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(&pb)) << 16);
}
// 8 fp32 values rounded to T, as the 16 bytes one vector store writes.
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
    return make_uint4(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]), pack2<T>(x[4], x[5]), pack2<T>(x[6], x[7]));
}
template <typename T>
__device__ __forceinline__ float2 unpack2(unsigned bits) {
    return to_float2(bits_as_vec2<T>(bits));
}

// Staged activations (the GEMV input x, in T) are swizzled by 16-byte vector so that the lanes of a warp, each
// reading the 4 vectors of its own 32-column chunk, hit distinct banks: vector v of chunk c = v / 4 goes to slot
// (v % 4 + c / 2) % 4 of that chunk.
__device__ __forceinline__ int swizzle(int v) { return (v & ~3) | (((v & 3) + (v >> 3)) & 3); }

// ---------------------------------------------------------------------------------------------------------------
// Consumer building blocks
// ---------------------------------------------------------------------------------------------------------------

// Sum over the consumer threads (two shared buffers used in turn: one barrier per call).
template <int CONSUMERS>
__device__ __forceinline__ float consumers_sum(float v, float* red, int& turn) {
    v = warp_sum(v);
    float* buffer = red + 32 * (turn & 1);
    ++turn;
    const int ct = threadIdx.x - 32;
    if ((ct & 31) == 0) buffer[ct >> 5] = v;
    consumers_sync<CONSUMERS>();
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < CONSUMERS / 32; ++i) total += buffer[i];
    return total;
}

// v <- T(T(v * rsqrt(mean(v^2) + eps)) * w) for the thread's vector (8 values at column 8 * ct, when owned);
// every consumer thread calls it (the reduction).
template <typename T, int CONSUMERS>
__device__ __forceinline__ void normalize(float (&v)[8], bool owned, const uint4& w_bits, int H, float eps,
                                          float* red, int& turn) {
    float sq = 0.0f;
    if (owned) {
#pragma unroll
        for (int e = 0; e < 8; ++e) sq += v[e] * v[e];
    }
    const float inv = rsqrtf(consumers_sum<CONSUMERS>(sq, red, turn) / H + eps);
    if (!owned) return;
    float w[8];
    unpack8_as_float<T>(w_bits, w);
    const T* tag = nullptr;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = round_to(round_to(v[e] * inv, tag) * w[e], tag);
}

// 8 values of T at p (16-byte aligned) as raw bits, or zeros when p is null.
__device__ __forceinline__ uint4 load_vec(const void* p, int vec) {
    return p == nullptr ? make_uint4(0u, 0u, 0u, 0u) : __ldg(reinterpret_cast<const uint4*>(p) + vec);
}

// Dot products of R rows held in shared memory (local rows lrow[r] of a slot) with the staged activation x over
// chunks [c0, c1) of 32 columns; returns the warp's sums in every lane.
template <typename T, int R>
__device__ __forceinline__ void smem_dots(const unsigned char* smem, const Slot& slot, const int (&lrow)[R],
                                          const T* x, int c0, int c1, int midpoint, int scale_bf16, bool zeros,
                                          float (&acc)[R]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    const unsigned char* wbase = smem + slot.weights;
    const unsigned short* sbase = reinterpret_cast<const unsigned short*>(smem + slot.scales);
    const unsigned char* zbase = smem + slot.zeros;
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    for (int c = c0 + lane; c < c1; c += 32) {
        uint4 xv[4][1][1];
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[i][0][0] = xs[swizzle(c * 4 + i)];
        const int group = (c * 32) >> slot.group_shift;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const uint4 w = *reinterpret_cast<const uint4*>(wbase + lrow[r] * slot.row_bytes + c * 16);
            const int gi = lrow[r] * slot.groups + group;
            const float scale = scale_to_float(sbase[gi], scale_bf16);
            const int zero = zeros ? static_cast<int>(zbase[gi]) : midpoint;
            const unsigned mm = magic_minus_zero<T>(zero);
            const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) accumulate_word<4, T, 1>(words[i], 0u, scale, zero, mm, xv[i], 1, &acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------------------------

template <typename T, int D, int MAXG, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) fused_decode(const Params* __restrict__ params, const float* rope_cos,
                                                           const float* rope_sin, const T* hidden_in) {
    constexpr int CONSUMERS = THREADS - 32;  // warps 1.. (warp 0 is the producer)
    constexpr int CWARPS = CONSUMERS / 32;
    // QKV pair units per warp task: 2 (4 rows) while a CTA's ~24 units fit in one task per warp, else 3 (6 rows).
    constexpr int QKV_UNITS = CWARPS >= 12 ? 2 : 3;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long ring[RING];
    __shared__ __align__(8) unsigned long long empty[4];
    __shared__ Params P;
    __shared__ Work W;
    __shared__ float red[64];
    __shared__ unsigned units_s[MAX_UNITS];
    __shared__ float angles[2][128];  // cos, sin of the step's position (D <= 256)
    // The step's row length, first attended token, position and its page: read when needed, not kept in registers.
    __shared__ int step_s[4];
    __shared__ unsigned epoch_s;  // this launch's epoch, as read at its start (the last CTA 0 thread increments it)
    __shared__ int app_s;         // the application the consumers are in (paces the K / V prefetch)

    const int cta = blockIdx.x;
    // Params and this CTA's Work into shared memory.
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(Params) / 4); i += THREADS)
        reinterpret_cast<unsigned*>(&P)[i] = reinterpret_cast<const unsigned*>(params)[i];
    __syncthreads();
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(Work) / 4); i += THREADS)
        reinterpret_cast<unsigned*>(&W)[i] = reinterpret_cast<const unsigned*>(P.work + cta)[i];
    if (threadIdx.x == 0) {
        for (int i = 0; i < RING; ++i) mbar_init(&ring[i], 1);
        for (int s = 0; s < 4; ++s) mbar_init(&empty[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    for (int i = threadIdx.x; i < W.units; i += THREADS) units_s[i] = P.unit_rows[cta * MAX_UNITS + i];
    if (threadIdx.x == 0) {
        const int position = __ldcg(P.positions);
        step_s[0] = __ldcg(P.lengths);
        step_s[1] = __ldcg(P.starts);
        step_s[2] = position;
        step_s[3] = __ldcg(P.block_table + position / 16);
        epoch_s = __ldcg(P.epoch);
        app_s = 0;
    }
    __syncthreads();  // the last block-wide barrier: from here on the producer warp and the consumers run apart
    const int& apps = P.apps;

    if (threadIdx.x < 32) {
        if (threadIdx.x == 1 && P.kv_prefetch && cta < P.Hkv * P.S) {
            // ---- K / V prefetch: this CTA's attention split's cached tokens, each application's pages into L2 once
            // the consumers have reached the application before, so that the split's loads (issued before its q / K /
            // V poll) hit L2 instead of queueing in front of that poll's loads. The new token is left out (this
            // step's QKV phase writes it).
            const SplitSpan mine = split_span(cta, P.S, step_s[0]);
            const int h = mine.head, first = max(mine.t0, step_s[1]), end = min(step_s[0] - 1, mine.t0 + mine.n);
            const unsigned page_bytes = 16 * P.D * sizeof(T);
            for (int a = 0; a < apps && first < end; ++a) {
                while (*reinterpret_cast<volatile int*>(&app_s) < a - 1) __nanosleep(256);
                const App* app = P.apps_table + a;
                const char* k_pages = static_cast<const char*>(ldg_ptr(&app->k_pages));
                const char* v_pages = static_cast<const char*>(ldg_ptr(&app->v_pages));
                for (int page = first / 16; page * 16 < end; ++page) {
                    const long long offset =
                        (static_cast<long long>(__ldg(P.block_table + page)) * P.Hkv + h) * page_bytes;
                    bulk_prefetch_l2(k_pages + offset, page_bytes);
                    bulk_prefetch_l2(v_pages + offset, page_bytes);
                }
            }
            return;
        }
        // ---- producer: stream every application's weight share, slot by slot, throttled ----
        if (threadIdx.x != 0) return;
        unsigned long long policy;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        const Piece* pieces = P.pieces + W.piece0;
        unsigned issued = 0;  // batches issued so far
        for (int a = 0; a < apps; ++a) {
            const App* app = P.apps_table + a;
            for (int s = 0; s < 4; ++s) {
                if (a > 0) mbar_wait(&empty[s], (a - 1) & 1);  // the consumers are done with slot s of app a - 1
                for (int k = 0; k < W.slot_pieces[s]; ++k) {
                    const Piece piece = pieces[W.slot_piece0[s] + k];
                    unsigned long long* bar = &ring[issued % RING];
                    if (piece.batch_bytes != 0) {  // a batch's first piece
                        if (issued >= static_cast<unsigned>(P.inflight)) {
                            const unsigned old = issued - P.inflight;
                            mbar_wait(&ring[old % RING], (old / RING) & 1);
                        }
                        mbar_expect(bar, piece.batch_bytes);
                    }
                    const unsigned char* src =
                        static_cast<const unsigned char*>(ldg_ptr(&app->mat[piece.mat][piece.kind])) + piece.offset;
                    bulk_copy_hint(smem + piece.smem, src, piece.bytes, bar, policy);
                    if (piece.last) ++issued;
                }
            }
        }
        return;
    }

    // ---- consumers ----
    const int ct = threadIdx.x - 32, cwarp = ct >> 5, lane = ct & 31;
    // In a graph this kernel is launched programmatically and the RoPE angles kernel before it lets it start at once:
    // the producer's weight stream (above) overlaps that kernel; what earlier kernels wrote (the angles, the embedded
    // input) is read after pdl_wait.
    pdl_wait();
    for (int i = ct; i < P.D / 2; i += CONSUMERS) {
        angles[0][i] = rope_cos[i];
        angles[1][i] = rope_sin[i];
    }
    consumers_sync<CONSUMERS>();
    // Shapes are read from the shared Params where used (references, not register copies live through the loop).
    const int &H = P.H, &F = P.F, &Hq = P.Hq, &Hkv = P.Hkv, &Gq = P.Gq, &S = P.S;
    const float& eps = P.eps;
    const unsigned& epoch = epoch_s;
    // Regions of dynamic shared memory, addressed from the Params' offsets where used: this CTA's copy of the residual
    // stream, the staged GEMV input (swizzled) and the down projection's K-split partial sums.
    auto xres = [&] { return reinterpret_cast<T*>(smem + P.xres); };
    auto stage = [&] { return reinterpret_cast<T*>(smem + P.stage); };
    auto partials = [&] { return reinterpret_cast<float*>(smem + P.partials); };
    int turn = 0;
    const int vec = ct;  // the junction's 8 columns of this thread
    const bool owned = vec * 8 < H;
    const int& bpa = W.batches_per_app;
    // A timestamp of this CTA at point k of application a (tests and eval scripts only).
    auto mark = [&](int a, int k) {
        if (ct == 0 && P.trace != nullptr) P.trace[(static_cast<long long>(a) * 16 + k) * gridDim.x + cta] = clock64();
    };

    auto wait_slot = [&](int a, int s) {
        const unsigned first = static_cast<unsigned>(a * bpa + W.slot_batch0[s]);
        for (int k = 0; k < W.slot_batches[s]; ++k) {
            const unsigned b = first + k;
            mbar_wait(&ring[b % RING], (b / RING) & 1);
        }
    };
    auto release_slot = [&](int s) {
        consumers_sync<CONSUMERS>();  // every consumer is done reading the slot
        if (ct == 0) mbar_arrive(&empty[s]);
    };
    // The staged input: 8 values of vector v (unswizzled index) from 8 floats.
    auto stage_vec = [&](int v, const float (&x)[8]) { reinterpret_cast<uint4*>(stage())[swizzle(v)] = pack8<T>(x); };
    // A 16-byte LL vector of n values polled into the stage (word k: values 4k .. 4k + 3), up to STAGE_WORDS words
    // per thread in flight together.
    auto poll_to_stage = [&](const uint4* ll, int n, unsigned seq) {
        constexpr int STAGE_WORDS = 4;  // the host keeps max(F, H, Hq * D) / 4 <= 4 * CONSUMERS
        const uint4* ptrs[STAGE_WORDS];
        uint2 payload[STAGE_WORDS];
        int count = 0;
#pragma unroll
        for (int i = 0; i < STAGE_WORDS; ++i) {
            const int k = ct + i * CONSUMERS;
            ptrs[i] = ll + (k < n / 4 ? k : 0);
            count += k < n / 4;
        }
        ll_wait_n<STAGE_WORDS>(ptrs, count, seq, payload);
#pragma unroll
        for (int i = 0; i < STAGE_WORDS; ++i) {
            const int k = ct + i * CONSUMERS;
            if (i < count)
                reinterpret_cast<uint2*>(reinterpret_cast<uint4*>(stage()) + swizzle(k / 2))[k & 1] = payload[i];
        }
    };
    // The thread's 8 values of a 16-byte LL vector (2 words).
    auto poll_vec = [&](const uint4* ll, unsigned seq, float (&v)[8]) {
        if (!owned) return;
        const uint4* ptrs[2] = {ll + 2 * vec, ll + 2 * vec + 1};
        uint2 payload[2];
        ll_wait_n<2>(ptrs, 2, seq, payload);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float2 a = unpack2<T>(payload[half].x), b = unpack2<T>(payload[half].y);
            v[4 * half] = a.x;
            v[4 * half + 1] = a.y;
            v[4 * half + 2] = b.x;
            v[4 * half + 3] = b.y;
        }
    };
    auto load_x = [&](float (&x)[8]) {
        if (owned) unpack8_as_float<T>(reinterpret_cast<const uint4*>(xres())[vec], x);
    };
    auto store_x = [&](const float (&x)[8]) {
        if (owned) reinterpret_cast<uint4*>(xres())[vec] = pack8<T>(x);
    };
    // The residual junction (norm.cuh's junction_row): v (the branch) becomes the new residual stream.
    auto junction = [&](float (&v)[8], const uint4& w_branch) {
        const T* tag = nullptr;
        float x[8];
        load_x(x);
        if (P.mode != 1 && owned) {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = round_to(x[e] + v[e], tag);
        }
        if (P.mode != 0) {
            normalize<T, CONSUMERS>(v, owned, w_branch, H, eps, red, turn);
            if (P.mode == 1 && owned) {
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = round_to(x[e] + v[e], tag);
            }
        }
    };
    // The exit gate's logit of the loop that just ended (CTA 0): T(sum x * w + b).
    auto exit_gate = [&](const float (&x)[8], const uint4& w_bits, int loop) {
        if (P.gate_w == nullptr || cta != 0) return;
        float dot = 0.0f;
        if (owned) {
            float w[8];
            unpack8_as_float<T>(w_bits, w);
#pragma unroll
            for (int e = 0; e < 8; ++e) dot += x[e] * w[e];
        }
        dot = consumers_sum<CONSUMERS>(dot, red, turn);
        if (ct == 0) {
            const float bias = P.gate_b == nullptr ? 0.0f : to_float(*static_cast<const T*>(P.gate_b));
            static_cast<T*>(P.gates_out)[loop] = from_float<T>(dot + bias);
        }
    };

    // A junction's norm weights (the thread's 8 columns) are loaded just before the poll that starts its phase, whose
    // wait hides their latency; not a phase ahead, which kept 24 registers live through the projections' loops.
    const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
    auto norm_weight = [&](const void* w) { return owned ? load_vec(w, vec) : zero4; };

    for (int a = 0; a < apps; ++a) {
        const App* app = P.apps_table + a;
        mark(a, 0);
        if (ct == 0) *reinterpret_cast<volatile int*>(&app_s) = a;
        // ================= P1: junction, QKV projection, RoPE, K/V append =================
        {
            float v[8];
            const uint4 w_input = norm_weight(ldg_ptr(&app->norm[0]));
            if (a == 0) {
                if (owned) unpack8_as_float<T>(reinterpret_cast<const uint4*>(hidden_in)[vec], v);
            } else {
                const App* prev = app - 1;
                const bool loop_end = __ldg(&prev->flags) & LOOP_END;  // the final norm and the exit gate follow
                const uint4 w_branch = norm_weight(ldg_ptr(&prev->norm[3]));
                const uint4 w_final = loop_end && P.final_every_loop ? norm_weight(P.final_w) : zero4;
                const uint4 w_gate = loop_end ? norm_weight(P.gate_w) : zero4;
                poll_vec(P.down_ll, seq_of(epoch, apps, a - 1, PH_DOWN), v);
                junction(v, w_branch);
                if (loop_end) {
                    if (P.final_every_loop) normalize<T, CONSUMERS>(v, owned, w_final, H, eps, red, turn);
                    exit_gate(v, w_gate, __ldg(&prev->loop));
                }
            }
            store_x(v);
            normalize<T, CONSUMERS>(v, owned, w_input, H, eps, red, turn);
            if (owned) stage_vec(vec, v);
            consumers_sync<CONSUMERS>();  // the stage
            mark(a, 1);
            wait_slot(a, 0);
            mark(a, 2);
            const Slot& slot = P.slot[0];
            const unsigned seq = seq_of(epoch, apps, a, PH_QKV);
            T* k_pages = static_cast<T*>(ldg_ptr(&app->k_pages));
            T* v_pages = static_cast<T*>(ldg_ptr(&app->v_pages));
            const int half = D / 2, chunks = H / 32;
            constexpr int U = QKV_UNITS;
            for (int task = cwarp; U * task < W.units; task += CWARPS) {
                const int j0 = U * task, n = min(U, W.units - j0);
                int lrow[2 * U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const unsigned rows = units_s[j0 + min(u, n - 1)];
                    lrow[2 * u] = rows & 0xFFFF;
                    lrow[2 * u + 1] = rows >> 16;
                }
                float acc[2 * U];
                smem_dots<T, 2 * U>(smem, slot, lrow, stage(), 0, chunks, P.midpoint, P.scale_bf16, slot.zeros != 0,
                                    acc);
                if (lane < n) {  // lane u finishes unit j0 + u
                    const int unit = W.unit0 + j0 + lane;
                    float first = acc[0], second = acc[1];
#pragma unroll
                    for (int u = 1; u < U; ++u) {  // selects, not a dynamically indexed (local memory) array
                        if (lane == u) {
                            first = acc[2 * u];
                            second = acc[2 * u + 1];
                        }
                    }
                    const int heads_pairs = half;  // pairs per head
                    const int which_head = unit / heads_pairs, p = unit % heads_pairs;
                    const int d0 = P.rope_interleaved ? 2 * p : p, d1 = P.rope_interleaved ? 2 * p + 1 : p + half;
                    first = to_float(from_float<T>(first));
                    second = to_float(from_float<T>(second));
                    float out0 = first, out1 = second;
                    if (which_head < Hq + Hkv) {  // q or k: rotate (rope_epilogue.cuh's arithmetic)
                        const float cs = angles[0][p], sn = angles[1][p];
                        out0 = __fsub_rn(__fmul_rn(first, cs), __fmul_rn(second, sn));
                        out1 = __fadd_rn(__fmul_rn(second, cs), __fmul_rn(first, sn));
                    }
                    const T t0 = from_float<T>(out0), t1 = from_float<T>(out1);
                    const unsigned b0 = *reinterpret_cast<const unsigned short*>(&t0);
                    const unsigned b1 = *reinterpret_cast<const unsigned short*>(&t1);
                    if (which_head < Hq) {
                        ll_store8(P.q_ll + which_head * D + d0, b0, seq);
                        ll_store8(P.q_ll + which_head * D + d1, b1, seq);
                    } else {
                        const bool is_k = which_head < Hq + Hkv;
                        const int kvh = which_head - (is_k ? Hq : Hq + Hkv);
                        T* pages = is_k ? k_pages : v_pages;
                        const long long slot_index =
                            (static_cast<long long>(step_s[3]) * Hkv + kvh) * 16 + step_s[2] % 16;
                        pages[slot_index * D + d0] = t0;
                        pages[slot_index * D + d1] = t1;
                        uint2* ll = (is_k ? P.k_ll : P.v_ll) + kvh * D;
                        ll_store8(ll + d0, b0, seq);
                        ll_store8(ll + d1, b1, seq);
                    }
                }
            }
            release_slot(0);
            mark(a, 3);
        }
        // ================= P2: attention (one KV head and split per CTA), the split merge =================
        if (cta < Hkv * S) {
            constexpr int per_token = D / 8, subs = CONSUMERS / per_token;
            const int length = step_s[0], start = step_s[1], split = cta % S;
            const SplitSpan mine = split_span(cta, S, length);
            const int h = mine.head, t0 = mine.t0, n = mine.n;
            const int sub = ct / per_token, offset = (ct % per_token) * 8;
            const bool in_sub = sub < subs;
            float* q_s = reinterpret_cast<float*>(stage());  // [Gq][D], pre-scaled
            float* k_new = q_s + Gq * D;                   // [D]
            float* v_new = k_new + D;                      // [D]
            float* warp_o = v_new + D;                     // [CWARPS][Gq][D]
            float* warp_ml = warp_o + CWARPS * MAXG * D;   // [CWARPS][Gq][2]
            const T* k_pages = static_cast<const T*>(ldg_ptr(&app->k_pages));
            const T* v_pages = static_cast<const T*>(ldg_ptr(&app->v_pages));
            const int* table = P.block_table;
            const int new_token = length - 1;
            // The first step's cached tokens, loaded before the new token's q / K / V are polled.
            uint4 k_raw[UNROLL], v_raw[UNROLL];
            auto load_step = [&](int base) {
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int i = base + u * subs + sub;
                    const int t = t0 + i;
                    if (in_sub && i < n && t != new_token && t >= start) {
                        const long long slot_index =
                            (static_cast<long long>(table[t / 16]) * Hkv + h) * 16 + (t & 15);
                        k_raw[u] = __ldcg(reinterpret_cast<const uint4*>(k_pages + slot_index * D + offset));
                        v_raw[u] = __ldcg(reinterpret_cast<const uint4*>(v_pages + slot_index * D + offset));
                    } else {
                        k_raw[u] = v_raw[u] = zero4;
                    }
                }
            };
            load_step(0);
            const unsigned seq = seq_of(epoch, apps, a, PH_QKV);
            {  // q of the group's heads, then the new token's K and V (contiguous in shared memory)
                constexpr int WORDS = (MAXG * D + 2 * D + CONSUMERS - 1) / CONSUMERS;
                const uint2* ptrs[WORDS];
                unsigned bits[WORDS];
                int count = 0;
#pragma unroll
                for (int w = 0; w < WORDS; ++w) {
                    const int i = ct + w * CONSUMERS;
                    const uint2* ll = P.q_ll;
                    if (i < Gq * D) ll = P.q_ll + (h * Gq) * D + i;
                    else if (i < Gq * D + D) ll = P.k_ll + h * D + (i - Gq * D);
                    else if (i < Gq * D + 2 * D) ll = P.v_ll + h * D + (i - Gq * D - D);
                    ptrs[w] = ll;
                    count += i < Gq * D + 2 * D;
                }
                ll_wait_n<WORDS>(ptrs, count, seq, bits);
                mark(a, 4);
#pragma unroll
                for (int w = 0; w < WORDS; ++w) {
                    const int i = ct + w * CONSUMERS;
                    if (w < count) {
                        const float value = to_float(*reinterpret_cast<const T*>(&bits[w]));
                        if (i < Gq * D) q_s[i] = value * P.scale_log2;
                        else k_new[i - Gq * D] = value;  // then v_new
                    }
                }
            }
            consumers_sync<CONSUMERS>();
            float m[MAXG], l[MAXG], o[MAXG][8];
            empty_states<MAXG>(m, l, o);
            for (int base = 0; base < n; base += UNROLL * subs) {
                if (base > 0) load_step(base);
                bool from_new[UNROLL], attended[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int i = base + u * subs + sub, t = t0 + i;
                    from_new[u] = t == new_token;
                    attended[u] = in_sub && i < n && t >= start;
                }
                attend_step<T, D, MAXG, UNROLL>(k_raw, v_raw, from_new, attended, q_s, k_new, v_new, Gq, offset, m, l,
                                                o);
            }
            // The subs of a warp (lanes with the same offset) merged with shuffles, then the warps in shared memory.
            merge_warp_states<MAXG, per_token>(m, l, o);
            store_warp_state<D, MAXG>(m, l, o, Gq, lane, warp_o + cwarp * MAXG * D,
                                      warp_ml + cwarp * MAXG * 2);
            consumers_sync<CONSUMERS>();
            const unsigned part_seq = seq_of(epoch, apps, a, PH_PART);
            uint2* part = P.part_ll + static_cast<long long>(h * S + split) * Gq * (D + 2);
            for (int idx = ct; idx < Gq * D; idx += CONSUMERS) {
                const int g = idx / D, d = idx % D;
                float top, sum;
                const float acc = merged_states<CWARPS, D>(warp_o, warp_ml, MAXG, g, d, top, sum);
                ll_store8(part + g * (D + 2) + 2 + d, __float_as_uint(acc), part_seq);
                if (d == 0) {
                    ll_store8(part + g * (D + 2), __float_as_uint(top), part_seq);
                    ll_store8(part + g * (D + 2) + 1, __float_as_uint(sum), part_seq);
                }
            }
            if (split == 0) {
                // The merge of the head's splits. First every split's state into shared memory (a thread per split,
                // query vector and 4 dims: its 6 words in flight together), then 4 output dims per thread.
                consumers_sync<CONSUMERS>();  // warp_o / warp_ml have been read: the stage's front is free
                float* o_s = reinterpret_cast<float*>(stage());  // [Gq][S][D]
                float* ml_s = o_s + Gq * S * D;                // [Gq][S][2]
                constexpr int QUADS = D / 4;
                for (int idx = ct; idx < Gq * S * QUADS; idx += CONSUMERS) {
                    const int g = idx / (S * QUADS), i = (idx / QUADS) % S, d0 = (idx % QUADS) * 4;
                    const uint2* pi = P.part_ll + (static_cast<long long>(h * S + i) * Gq + g) * (D + 2);
                    const uint2* ptrs[6] = {pi, pi + 1, pi + 2 + d0, pi + 3 + d0, pi + 4 + d0, pi + 5 + d0};
                    unsigned words[6];
                    ll_wait_n<6>(ptrs, 6, part_seq, words);
#pragma unroll
                    for (int e = 0; e < 4; ++e) o_s[(g * S + i) * D + d0 + e] = __uint_as_float(words[2 + e]);
                    if (d0 == 0) {
                        ml_s[(g * S + i) * 2] = __uint_as_float(words[0]);
                        ml_s[(g * S + i) * 2 + 1] = __uint_as_float(words[1]);
                    }
                }
                consumers_sync<CONSUMERS>();
                const unsigned attn_seq = seq_of(epoch, apps, a, PH_ATTN);
                for (int idx = ct; idx < Gq * QUADS; idx += CONSUMERS) {
                    const int g = idx / QUADS, d0 = (idx % QUADS) * 4;
                    float top = -TL_INF;
                    for (int i = 0; i < S; ++i) top = fmaxf(top, ml_s[(g * S + i) * 2]);
                    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sum = 0.0f;
                    for (int i = 0; i < S; ++i) {
                        const float mi = ml_s[(g * S + i) * 2];
                        const float weight = mi == -TL_INF ? 0.0f : exp2f(mi - top);
                        sum += ml_s[(g * S + i) * 2 + 1] * weight;
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[e] += o_s[(g * S + i) * D + d0 + e] * weight;
                    }
                    const float inv = 1.0f / sum;
                    const int column = (h * Gq + g) * D + d0;
                    ll_store16(P.attn_ll + column / 4, pack2<T>(acc[0] * inv, acc[1] * inv),
                               pack2<T>(acc[2] * inv, acc[3] * inv), attn_seq);
                }
            }
            consumers_sync<CONSUMERS>();  // the stage (q_s, warp states) is reused by P3
            mark(a, 5);
        }
        // ================= P3: O projection =================
        {
            poll_to_stage(P.attn_ll, Hq * D, seq_of(epoch, apps, a, PH_ATTN));
            consumers_sync<CONSUMERS>();
            mark(a, 6);
            wait_slot(a, 1);
            mark(a, 7);
            const Slot& slot = P.slot[1];
            const unsigned seq = seq_of(epoch, apps, a, PH_O);
            for (int q = cwarp; q < W.o_quads; q += CWARPS) {
                const int lrow[4] = {4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3};
                float acc[4];
                smem_dots<T, 4>(smem, slot, lrow, stage(), 0, Hq * D / 32, P.midpoint, P.scale_bf16, slot.zeros != 0,
                                acc);
                if (lane == 0)
                    ll_store16(P.o_ll + W.o_quad0 + q, pack2<T>(acc[0], acc[1]), pack2<T>(acc[2], acc[3]), seq);
            }
            release_slot(1);
            mark(a, 8);
        }
        // ================= P4: junction, gate/up projections, SwiGLU =================
        {
            float v[8];
            const uint4 w_branch = norm_weight(ldg_ptr(&app->norm[1])), w_post = norm_weight(ldg_ptr(&app->norm[2]));
            poll_vec(P.o_ll, seq_of(epoch, apps, a, PH_O), v);
            mark(a, 15);  // the poll's end (the trace's last slot): fused_profile tells the poll from the junction
            junction(v, w_branch);
            store_x(v);
            normalize<T, CONSUMERS>(v, owned, w_post, H, eps, red, turn);
            if (owned) stage_vec(vec, v);
            consumers_sync<CONSUMERS>();
            mark(a, 9);
            wait_slot(a, 2);
            mark(a, 10);
            const Slot& slot = P.slot[2];
            const unsigned seq = seq_of(epoch, apps, a, PH_H);
            for (int q = cwarp; q < W.g_quads; q += CWARPS) {
                const int lrow[8] = {4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3, slot.rows_cap + 4 * q,
                                     slot.rows_cap + 4 * q + 1, slot.rows_cap + 4 * q + 2, slot.rows_cap + 4 * q + 3};
                float acc[8];
                smem_dots<T, 8>(smem, slot, lrow, stage(), 0, H / 32, P.midpoint, P.scale_bf16, slot.zeros != 0, acc);
                if (lane == 0) {
                    float y[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {  // gemv_quant.cu's SwiGLU rounding
                        const float g = to_float(from_float<T>(acc[i])), u = to_float(from_float<T>(acc[4 + i]));
                        y[i] = to_float(from_float<T>(silu(g))) * u;
                    }
                    ll_store16(P.h_ll + W.g_quad0 + q, pack2<T>(y[0], y[1]), pack2<T>(y[2], y[3]), seq);
                }
            }
            release_slot(2);
            mark(a, 11);
        }
        // ================= P5: down projection (K split in parts of 64 chunks, or longer parts where the CTA's
        // rows would otherwise give a warp two tasks) =================
        {
            poll_to_stage(P.h_ll, F, seq_of(epoch, apps, a, PH_H));
            consumers_sync<CONSUMERS>();
            mark(a, 12);
            wait_slot(a, 3);
            mark(a, 13);
            const Slot& slot = P.slot[3];
            const int chunks = F / 32;
            int span = 64;
            if (W.d_quads * ((chunks + span - 1) / span) > CWARPS && W.d_quads <= CWARPS) {
                const int parts_that_fit = CWARPS / W.d_quads;
                span = (chunks + parts_that_fit - 1) / parts_that_fit;
            }
            const int parts = (chunks + span - 1) / span, tasks = W.d_quads * parts;
            for (int task = cwarp; task < tasks; task += CWARPS) {
                const int q = task / parts, part = task % parts;
                const int lrow[4] = {4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3};
                float acc[4];
                smem_dots<T, 4>(smem, slot, lrow, stage(), part * span, min(chunks, part * span + span), P.midpoint,
                                P.scale_bf16, slot.zeros != 0, acc);
                if (lane < 4) partials()[task * 4 + lane] = lane == 0 ? acc[0] : lane == 1 ? acc[1] : lane == 2 ? acc[2] : acc[3];
            }
            consumers_sync<CONSUMERS>();
            const unsigned seq = seq_of(epoch, apps, a, PH_DOWN);
            if (ct < W.d_quads) {
                float y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int part = 0; part < parts; ++part)
#pragma unroll
                    for (int i = 0; i < 4; ++i) y[i] += partials()[(ct * parts + part) * 4 + i];
                ll_store16(P.down_ll + W.d_quad0 + ct, pack2<T>(y[0], y[1]), pack2<T>(y[2], y[3]), seq);
            }
            release_slot(3);
            mark(a, 14);
        }
    }
    // ================= the last junction and final norm (CTA 0) =================
    // The other CTAs are done: the next kernel (the LM head, launched programmatically in a graph) may start its CTAs
    // and their first weight loads while CTA 0 finishes.
    pdl_trigger();
    if (cta != 0) return;
    const App* last = P.apps_table + apps - 1;
    float v[8];
    const uint4 w_branch = norm_weight(ldg_ptr(&last->norm[3])), w_final = norm_weight(P.final_w);
    const uint4 w_gate = norm_weight(P.gate_w);
    poll_vec(P.down_ll, seq_of(epoch, apps, apps - 1, PH_DOWN), v);
    junction(v, w_branch);
    if (P.final_every_loop) normalize<T, CONSUMERS>(v, owned, w_final, H, eps, red, turn);
    exit_gate(v, w_gate, __ldg(&last->loop));
    if (P.final_end) normalize<T, CONSUMERS>(v, owned, w_final, H, eps, red, turn);
    if (owned) reinterpret_cast<uint4*>(P.hidden_out)[vec] = pack8<T>(v);
    consumers_sync<CONSUMERS>();
    if (ct == 0) *P.epoch = epoch + 1;  // every CTA read the epoch before producing anything this CTA waited for
}

}  // namespace fused

