"""What a kernel costs inside the graph-replayed decode step (Ouro-1.4B shape, INT4, L = 4): GPU time of one replay
with the kernels whose name contains a --skip pattern not launched. The outputs are garbage; only the time counts.
The difference to the full step is the most that fusing those kernels away could save, with programmatic launch's
overlap included (which summing eager kernel times misses). ``--without`` instead keeps every launch and removes
one kind of work from the low-bit projections' loops (their activation loads, or their dequantize-and-multiply
math), by patching the kernel sources before they are compiled. One process per configuration: a graph pool cannot
be reused across captures.

    python -m tinyloop_hf.eval.ablate_decode --batch 16 --skip residual_norm
    python -m tinyloop_hf.eval.ablate_decode --batch 16 --without mma-x mma-math
    python -m tinyloop_hf.eval.ablate_decode --batch 1 --kv-cache-dtype int8 --no-rope-epilogue
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from tinyloop_hf import TinyLoopForCausalLM
from tinyloop_hf.kernels import fused_decode, loader, ops_cuda

from .bench import base_model, build_ours
from .gpu import require_gpu
from .profile_decode import gpu_ms


def skip_kernels(patterns: list[str]) -> None:
    """Make ops_cuda launch nothing for kernels whose name contains one of ``patterns``."""
    skipped = object()
    kernel, launch = ops_cuda.kernel, ops_cuda.launch
    ops_cuda.kernel = lambda file, name: skipped if any(p in name for p in patterns) else kernel(file, name)
    ops_cuda.launch = lambda fn, *args, **kwargs: None if fn is skipped else launch(fn, *args, **kwargs)


# The loaded weight words (and x) folded by XOR into one accumulator, so that every load stays live without the math.
_FOLD_MMA = """{  // ablate_decode --without mma-math
        unsigned folded = 0u;
        _Pragma("unroll") for (int j = 0; j < 4; ++j) folded ^= lo.w[j] ^ hi.w[j] ^ lo.scale_bits[0] ^ hi.scale_bits[0];
        _Pragma("unroll") for (int a = 0; a < NT; ++a) _Pragma("unroll") for (int b = 0; b < XV; ++b)
            folded ^= xv[a][b].x ^ xv[a][b].y ^ xv[a][b].z ^ xv[a][b].w;
        SUMS[0][0] += __uint_as_float(folded & 0x007fffffu);
    }"""
_FOLD_GEMV = """    if constexpr (BITS != 8) {  // ablate_decode --without gemv-math
        unsigned folded = word ^ magic_minus ^ __float_as_uint(scale);
        _Pragma("unroll") for (int m = 0; m < MAXM; ++m)
            _Pragma("unroll") for (int v = 0; v < XWords<BITS>::count; ++v)
                folded ^= xv[m][v].x ^ xv[m][v].y ^ xv[m][v].z ^ xv[m][v].w;
        acc[0] += __uint_as_float(folded & 0x007fffffu);
        return;
    }
"""
_T2 = "    using T2 = typename Vec2<T>::type;\n"
_ONES = "0x3f803f80u"  # two bf16 1.0s (timing only: an fp16 model gets other weights)
_FUSED_MATH_LOOP = "    for (int c = c0 + lane; c < c1; c += 32) {\n        uint4 xv[4][1][1];"
# --without NAME: (source file, text, replacement) patches. Each text must occur once in the current source
# (tests/test_kernels_compile.py checks it and that the patched kernels compile). The CUDA-core GEMV's INT8 path (the LM
# head) is left as it is.
WITHOUT: dict[str, list[tuple[str, str, str]]] = {
    "gemv-x": [("gemv_dot.cuh", "xv[m][v] = reinterpret_cast<const uint4*>(x + m * ldx + col0)[v];",
                "xv[m][v] = make_uint4(col0, m, v, 0x3c003c00u);")],
    "gemv-math": [("gemv_dot.cuh", _T2, _T2 + _FOLD_GEMV)],
    "mma-x": [("gemm_quant_mma.cu", "xv[nt][v] = valid && token < M ? src[v] : make_uint4(0u, 0u, 0u, 0u);",
               "xv[nt][v] = make_uint4(lane, token, v, first);")],
    "mma-math": [("gemm_quant_mma.cu", f"mma_step<BITS, T, NT, POST_SCALE>(flo, fhi, xv, {sums});",
                  _FOLD_MMA.replace("SUMS", sums)) for sums in ("step", "acc")],
    # The fused decode kernel (batch 1): its projection loops emptied (fused_profile --no-math); or its weight stream
    # off (the producer warp issues nothing, the consumers never wait for a slot and multiply whatever the slots hold):
    # what the stream adds to the step, math kept. H200, Ouro-1.4B shape: 2.195 ms against 2.481 (twenty-third session).
    "fused-math": [("fused_decode.cu", _FUSED_MATH_LOOP, _FUSED_MATH_LOOP.replace("c < c1", "c < c0"))],
    "fused-weights": [
        ("fused_decode.cu", "        if (threadIdx.x != 0) return;\n", "        return;  // --without fused-weights\n"),
        ("fused_decode.cu", "for (int k = 0; k < W.slot_batches[s]; ++k) {", "for (int k = 0; k < 0; ++k) {"),
    ],
    # Its junctions' norm weights not loaded (every weight 1.0; the pointer chase through the application table
    # goes too): whether a late CTA's dependent loads before each junction are on the step's critical path.
    "fused-norm-loads": [("fused_decode.cu", "return owned ? load_vec(w, vec) : zero4; };",
                          f"(void)w; return owned ? make_uint4({_ONES}, {_ONES}, {_ONES}, {_ONES}) : zero4; }};")],
    # Its norms' sums of squares without the CTA-wide reduction (each warp takes its own sum times the 8 warps that own
    # columns; no barrier): the prize of a junction whose norms need no reduction across warps (sums published by the
    # producers, or the norm applied after the next projection). H200, Ouro-1.4B shape: 2.270 ms against 2.303 / 2.300
    # (thirty-second session).
    "fused-norm-sums": [("fused_decode.cu", "    v = warp_sum(v);\n    float* buffer = red + 32 * (turn & 1);",
                         "    v = warp_sum(v);\n    if (red != nullptr) return v * 8.0f;  // --without fused-norm-sums\n"
                         "    float* buffer = red + 32 * (turn & 1);")],
    # Its attention split merge reading only the merging CTA's own split (no wait for the head's other 7 splits): the
    # prize of the merge's cross-CTA wait (the attention -> O hand-off's 2.2 us producers' skew): 2.283 ms against
    # 2.303 / 2.300; both probes together 2.252 (thirty-second session).
    "fused-merge-wait": [("fused_decode.cu",
                          "const uint2* pi = P.part_ll + (static_cast<long long>(h * S + i) * Gq + g) * (D + 2);",
                          "const uint2* pi = P.part_ll + (static_cast<long long>(h * S) * Gq + g) * (D + 2);")],
    # Paged decode (the batch-16 path: one CTA per row and KV head): its later token-loop steps without their K/V loads
    # (every step computes on the first step's registers, loaded before pdl_wait), or its attention math replaced by a
    # fold of the loaded words: what the loads after pdl_wait and the math add to its ~10 us per layer application.
    "paged-later-loads": [("paged_attention.cu",
                           "        if (base > 0) {  // the first step's loads were issued before the wait",
                           "        if (false) {  // --without paged-later-loads")],
    # Its later steps' loads re-reading the first step's tokens (the same instructions; addresses the CTA has just
    # read, so L1 / L2 hits): what of paged-later-loads' prize is the memory system's. H200: 4.110 ms against 4.306 /
    # 4.312, paged-later-loads 3.985 (thirty-fourth session).
    "paged-later-hits": [("paged_attention.cu",
                          "            if (FULL || i < n) load_token(u, i, page[u]);",
                          "            if (FULL || i < n) load_token(u, i - base, table[(t0 + i - base) / PAGE]);")],
    "paged-math": [("paged_attention.cu",
                    "        if (full) token_step(base, true);\n        else token_step(base, false);",
                    "        {  // --without paged-math\n            unsigned f = 0u;\n"
                    "            _Pragma(\"unroll\") for (int u = 0; u < UNROLL; ++u)\n"
                    "                f ^= k_raw[u].bits.x ^ k_raw[u].bits.y ^ k_raw[u].bits.z ^ k_raw[u].bits.w ^\n"
                    "                     v_raw[u].bits.x ^ v_raw[u].bits.y ^ v_raw[u].bits.z ^ v_raw[u].bits.w;\n"
                    "            acc[0][0] += __uint_as_float(f & 0x007fffffu);\n        }")],
}  # fmt: skip


_ACC_WORDS = ("#pragma unroll\n            for (int i = 0; i < 4; ++i) "
              "accumulate_word<4, T, 1>(words[i], 0u, scale, zero, mm, xv[i], 1, &acc[r]);\n")
_ACC4 = """            {  // --variant fused-acc4
                (void)zero;
                typename Vec2<T>::type part =
                    __hmul2(weight_pair<4, T>(words[0], 0u, 0, mm), bits_as_vec2<T>(xv[0][0][0].x));
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const unsigned xw[4] = {xv[i][0][0].x, xv[i][0][0].y, xv[i][0][0].z, xv[i][0][0].w};
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (i + j > 0)
                            part = __hfma2(weight_pair<4, T>(words[i], 0u, j, mm), bits_as_vec2<T>(xw[j]), part);
                }
                const float2 f = to_float2(part);
                acc[r] += scale * (f.x + f.y);
            }
"""
# --variant NAME: candidate kernel changes and probes, as patches of the same form (the work kept, unlike WITHOUT's).
VARIANTS: dict[str, list[tuple[str, str, str]]] = {
    # The fused kernel's bf16 dots with the 4 words of a 32-column chunk (one quantization group) in one bf16x2 chain
    # of 16 products, then one conversion, add and scale, instead of a chain per word: 12% fewer instructions in the
    # dot loops. A probe of what the projections' instruction count is worth: H200, Ouro-1.4B shape, 2.410 ms
    # against 2.472 / 2.477 (twenty-fourth session). Not adopted: its rounding took the fused GPU tests' logits 1.5-2.2%
    # of their scale from the per-op path's (bound 1%) and 14% further from the reference on average.
    "fused-acc4": [("fused_decode.cu", _ACC_WORDS, _ACC4)],
    # Its trace in the global timer's nanoseconds (%globaltimer, one clock for all SMs) instead of each SM's clock64:
    # fused_profile --global-clock compares CTAs with each other (when the last producer of a hand-off finished,
    # when its consumers saw the data).
    "fused-global-clock": [("fused_decode.cu", "* gridDim.x + cta] = clock64();",
                            "* gridDim.x + cta] = [] { unsigned long long t; "
                            'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }();')],
    # Its O projection in row pairs instead of quads: a CTA's 4 O quads kept 4 of its 11 consumer warps busy, each over
    # all 64 chunks; as 8 pairs, 8 warps with half the rows each. Each row's sum is computed exactly as before (split by
    # rows, not K), so the outputs are identical; each pair stores one 8-byte half of its quad's LL word.
    "fused-o-pairs": [
        ("fused_decode.cu", "for (int q = cwarp; q < W.o_quads; q += CWARPS) {\n"
         "                const int lrow[4] = {4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3};\n"
         "                float acc[4];\n                smem_dots<T, 4>(",
         "for (int p = cwarp; p < 2 * W.o_quads; p += CWARPS) {  // --variant fused-o-pairs\n"
         "                const int lrow[2] = {2 * p, 2 * p + 1};\n"
         "                float acc[2];\n                smem_dots<T, 2>("),
        ("fused_decode.cu",
         "ll_store16(P.o_ll + W.o_quad0 + q, pack2<T>(acc[0], acc[1]), pack2<T>(acc[2], acc[3]), seq);",
         "ll_store8(reinterpret_cast<uint2*>(P.o_ll + W.o_quad0) + p, pack2<T>(acc[0], acc[1]), seq);"),
    ],
}  # fmt: skip
PATCHES = {**WITHOUT, **VARIANTS}


def patch_sources(names: list[str]) -> None:
    """Compile the kernels with the PATCHES ``names`` (WITHOUT or VARIANTS) applied (before any kernel is compiled)."""
    patches = [patch for name in dict.fromkeys(names) for patch in PATCHES[name]]  # a name twice: once
    original = loader.source

    def patched(file: str, _seen: set[str] | None = None) -> str:
        text = original(file, _seen)
        for target, old, new in patches:
            if file == target:
                if text.count(old) != 1:
                    raise ValueError(f"ablate_decode: a source patch for {target} no longer matches its source")
                text = text.replace(old, new)
        return text

    loader.source = patched


def add_switches(parser: argparse.ArgumentParser) -> None:
    """The decode step's A/B switches (kernel choices and source patches), shared with replay_timeline."""
    # fmt: off
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=192, help="cached tokens before the measured step")
    parser.add_argument("--without", nargs="*", default=[], choices=sorted(WITHOUT),
                        help="work removed from the projections' loops (activation loads, math)")
    parser.add_argument("--variant", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="candidate kernel changes, compiled in by source patches")
    parser.add_argument("--no-mma-wide", action="store_true", help="8-warp tensor-core CTAs everywhere")
    parser.add_argument("--no-rope-epilogue", action="store_true", help="rope_kv_append instead of the QKV epilogue")
    parser.add_argument("--decode-ctas", type=int, help="paged-decode CTA target (ops_cuda._DECODE_CTAS)")
    parser.add_argument("--plain-paged", action="store_true", help="paged decode launched without programmatic launch")
    parser.add_argument("--paged-wide", type=int, nargs=2, metavar=("THREADS", "UNROLL"),
                        help="one paged-decode CTA of THREADS per (row, KV head) (ops_cuda.PAGED_WIDE; 0 0: off)")
    parser.add_argument("--paged-wide-max-tokens", type=int, help="ops_cuda.PAGED_WIDE_MAX_TOKENS")
    parser.add_argument("--junction-programmatic", action="store_true",
                        help="residual junctions launched programmatically at every batch")
    parser.add_argument("--paged-cluster-programmatic", action="store_true",
                        help="batch-1 paged decode (clusters) launched programmatically, triggering after its wait")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"), help="the paged cache's K/V")
    parser.add_argument("--fused-decode", action=argparse.BooleanOptionalAction, default=True,
                        help="the step as one kernel where it serves it (kernels/fused_decode.cu; the default)")
    parser.add_argument("--fused-threads", type=int, choices=(384, 512),
                        help="the fused kernel's CTA size, not its choice (384: 168 registers, no spills; 512: 128)")
    parser.add_argument("--fused-splits", type=int, help="attention splits per KV head (fused_decode.SPLITS)")
    parser.add_argument("--no-kv-prefetch", action="store_true",
                        help="the fused kernel without its K / V prefetch into L2 (fused_decode.KV_PREFETCH)")
    parser.add_argument("--fused-chunk", type=int, help="the fused kernel's TMA batch bytes (fused_decode.CHUNK_BYTES)")
    parser.add_argument("--fused-inflight", type=int, help="its batches in flight per CTA (fused_decode.INFLIGHT)")
    parser.add_argument("--plain-fused-launch", action="store_true",
                        help="the fused kernel launched without the cooperative attribute (its default)")
    parser.add_argument("--no-fused-programmatic", action="store_true",
                        help="the fused kernel launched after the kernel before it ends (fused_decode.PROGRAMMATIC)")
    parser.add_argument("--no-tile-gemm", action="store_true",
                        help="rows past GEMV_MAX_ROWS through dequantize + cuBLAS, not kernels/gemm_quant_tile.cu")
    parser.add_argument("--tile-warps", type=int, choices=(4, 8), help="its warps per CTA (ops_cuda.TILE_WARPS)")
    parser.add_argument("--tile-min-rows", type=int, help="rows from which it serves (ops_cuda.TILE_MIN_ROWS)")
    parser.add_argument("--tile-waves", type=int, help="CTAs per SM its K split aims for (ops_cuda.TILE_WAVES)")
    # fmt: on


def apply_switches(args: argparse.Namespace) -> None:
    """Set the switches ``add_switches`` parsed, before any kernel is compiled or launched."""
    fused_decode.FUSED_DECODE = args.fused_decode
    ops_cuda.MMA_WIDE = not args.no_mma_wide
    ops_cuda.TILE_GEMM = not args.no_tile_gemm
    if args.tile_warps:
        ops_cuda.TILE_WARPS = args.tile_warps
    if args.tile_min_rows:
        ops_cuda.TILE_MIN_ROWS = args.tile_min_rows
    if args.tile_waves:
        ops_cuda.TILE_WAVES = args.tile_waves
    ops_cuda.ROPE_EPILOGUE = not args.no_rope_epilogue
    ops_cuda.PAGED_PROGRAMMATIC = not args.plain_paged
    if args.junction_programmatic:
        ops_cuda.JUNCTION_PROGRAMMATIC_ROWS = 1
    ops_cuda.PAGED_CLUSTER_PROGRAMMATIC = args.paged_cluster_programmatic
    if args.decode_ctas:
        ops_cuda._DECODE_CTAS = args.decode_ctas
    if args.paged_wide:
        ops_cuda.PAGED_WIDE = tuple(args.paged_wide) if args.paged_wide[0] else None
    if args.paged_wide_max_tokens:
        ops_cuda.PAGED_WIDE_MAX_TOKENS = args.paged_wide_max_tokens
    if args.fused_threads:
        fused_decode.THREADS = args.fused_threads
    if args.fused_splits:
        fused_decode.SPLITS = args.fused_splits
    if args.no_kv_prefetch:
        fused_decode.KV_PREFETCH = False
    if args.fused_chunk:
        fused_decode.CHUNK_BYTES = args.fused_chunk
    if args.fused_inflight:
        fused_decode.INFLIGHT = args.fused_inflight
    fused_decode.COOPERATIVE = not args.plain_fused_launch
    fused_decode.PROGRAMMATIC = not args.no_fused_programmatic
    patch_sources(args.without + args.variant)


def switches_label(args: argparse.Namespace, model: Any) -> str:
    """What the switches turned on, as a suffix for the result line."""
    label = ", INT8 KV" if args.kv_cache_dtype == "int8" else ""
    threads = sorted({plan.threads for plan in model._cuda_path.fused.plans.values() if not isinstance(plan, str)})
    label += f", fused decode kernel ({'/'.join(map(str, threads))} threads)" if model._cuda_path.fused.steps else ""
    label += ", plain launch" if model._cuda_path.fused.steps and args.plain_fused_launch else ""
    label += ", not programmatic" if model._cuda_path.fused.steps and args.no_fused_programmatic else ""
    label += f", {args.fused_splits} attention splits" if args.fused_splits else ""
    label += ", no K/V prefetch" if model._cuda_path.fused.steps and args.no_kv_prefetch else ""
    label += f", TMA batches of {args.fused_chunk} bytes" if args.fused_chunk else ""
    label += f", {args.fused_inflight} batches in flight" if args.fused_inflight else ""
    label += ", programmatic junctions" if args.junction_programmatic else ""
    label += ", programmatic paged clusters" if args.paged_cluster_programmatic else ""
    if args.paged_wide:
        threads, unroll = args.paged_wide
        label += f", paged decode {threads} threads x {unroll}" if threads else ", split paged decode"
    label += f", wide paged decode up to {args.paged_wide_max_tokens} tokens" if args.paged_wide_max_tokens else ""
    return label


def benchmark_model(args: argparse.Namespace) -> TinyLoopForCausalLM:
    """The benchmark's INT4 L = 4 model on the CUDA path, with the K/V dtype asked for."""
    base = base_model(4, 4096)
    model = build_ours(base, 4).use_cuda_path(kv_cache_dtype=args.kv_cache_dtype)
    del base
    return model


def warmed_decode_step(
    model: TinyLoopForCausalLM, args: argparse.Namespace, after_prompt: Callable[[], None] | None = None
) -> Callable[[], None]:
    """A decode step after a ``--context``-token prompt of ``--batch`` rows, its graph captured and replayed once;
    ``after_prompt`` runs between the prompt (which compiles every kernel) and the first step."""
    ids = torch.randint(1, 49152, (args.batch, args.context), device="cuda")
    cache = model.new_cache(args.context + 64)
    step = ids[:, -1:]

    def replay() -> None:
        with torch.no_grad():
            model(step, past_key_values=cache, use_cache=True)

    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    if after_prompt is not None:
        after_prompt()
    for _ in range(3):  # eager warm-up, capture, replay
        replay()
    return replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_switches(parser)
    parser.add_argument("--skip", nargs="*", default=[], help="substrings of kernel names not to launch")
    args = parser.parse_args()
    require_gpu("python -m tinyloop_hf.eval.ablate_decode")
    apply_switches(args)
    model = benchmark_model(args)
    replay = warmed_decode_step(model, args, after_prompt=lambda: skip_kernels(args.skip))
    time = gpu_ms(replay, repeats=20)
    removed = f", without {' '.join(args.without)}" if args.without else ""
    removed += f", variant {' '.join(args.variant)}" if args.variant else ""
    print(f"batch {args.batch}{switches_label(args, model)}, skipped {args.skip or 'nothing'}{removed}: "
          f"{time:.3f} ms per graph replay")  # fmt: skip


if __name__ == "__main__":
    main()
