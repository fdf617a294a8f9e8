"""tinyloop-bench: speed of the CUDA path on the Ouro-1.4B shape, with HF transformers measured in the same run.

Model: 24 unique layers x L loops, hidden 2048, MLP 5632, 16 heads (MHA), vocab 49152, bf16, random weights (speed
does not depend on the values). Quantized variants use RTN with the LM head and the token embedding in INT8 (the
embedding per vocabulary row; see ``quant_config``). Peers: the same shared-weight
looped stack built from transformers' own LlamaForCausalLM (96 decoder layers whose parameters are the 24 unique
layers'; Llama's pre-norm block has two RMSNorms fewer per layer than Ouro's sandwich block), run with eager SDPA and
with a static cache + torch.compile. Everything is timed through ``model.generate()``:

  TTFT      = generate(max_new_tokens=1) wall time (prefill + first token)
  prefill   = batch x context / TTFT
  decode    = batch x (new_tokens - 1) / (generate(max_new_tokens=new_tokens) - TTFT)

    tinyloop-bench                                   # default sweep (one 10-minute device command)
    tinyloop-bench --batch 1 16 64 --context 128 2048 8192 --loops 1 4 8 --bits 16 8 4 2
    tinyloop-bench --baseline eval/results/bench-h200.json   # exit 1 if decode fell below 0.8x the baseline

Writes OUT.json, OUT.md (the table printed on stdout) and OUT.png (with matplotlib: the "eval" extra). Each row
records the setup it ran with (K/V dtype, new tokens, run-ahead), and the regression check compares only rows of the
same setup: it fails when none were comparable.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tinyloop_hf import TinyLoopConfig, TinyLoopForCausalLM, TinyLoopQuantConfig
from tinyloop_hf.convert.quantize import quantize_model
from tinyloop_hf.cuda_path import capacity_bucket

from .flags import at_least, fraction

GROUP_FOR_BITS = {8: None, 4: 128, 2: 64}


def ouro_config(loops: int, max_context: int) -> TinyLoopConfig:
    return TinyLoopConfig(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=5632,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_loop_layers=24,
        num_loops=loops,
        max_loops=max(8, loops),
        block_norm="sandwich",
        final_norm="every_loop",
        exit_gate=True,
        max_position_embeddings=max(max_context, 4096),
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=None,
        pad_token_id=0,
    )


def quant_config(bits: int) -> TinyLoopQuantConfig:
    """The benchmark's quantized variants. The embedding is INT8 per vocabulary row, the more accurate of the two
    choices under the whole-model floor of 0.3x bf16 at INT4: 0.296x (INT4 g128 would give 0.279x; a bf16
    table 0.331x). tests/test_bench_logic.py checks the ratio."""
    components = {"lm_head": {"bits": 8}, "embed_tokens": {"bits": 8, "group_size": None}}
    return TinyLoopQuantConfig(bits=bits, group_size=GROUP_FOR_BITS[bits], components=components)


def base_model(loops: int, max_context: int) -> TinyLoopForCausalLM:
    """The benchmark's bf16 model of the Ouro-1.4B shape on the GPU, its random weights drawn from seed 0 (the same
    model in every script that measures it)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        return TinyLoopForCausalLM(ouro_config(loops, max_context)).to(torch.bfloat16).eval()


def build_ours(base: TinyLoopForCausalLM, bits: int, device: str = "cuda") -> TinyLoopForCausalLM:
    """A copy of ``base`` on ``device``, quantized to ``bits`` there (``base`` may stay on the CPU)."""
    model = copy.deepcopy(base).to(device)
    if bits != 16:
        quantize_model(model, quant_config(bits), progress=False)
    return model.eval()


def build_hf_peer(config: TinyLoopConfig, loops: int) -> Any:
    """transformers' Llama with 24 x loops decoder layers sharing the parameters of 24 unique ones."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    unique = config.num_loop_layers
    llama_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        num_hidden_layers=unique,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(llama_config).to(torch.bfloat16)
    layers = []
    for index in range(unique * loops):
        with torch.device("meta"):
            layer = LlamaDecoderLayer(llama_config, layer_idx=index)
        source = model.model.layers[index % unique]
        for name, _ in list(layer.named_parameters()):
            owner_name, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            owner._parameters[leaf] = source.get_parameter(name)
        layers.append(layer)
    model.model.layers = torch.nn.ModuleList(layers)
    model.config.num_hidden_layers = unique * loops
    model.generation_config.pad_token_id = 0
    return model.eval()


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(model: Any, batch: int, context: int, new_tokens: int, extra: dict[str, Any]) -> dict[str, float]:
    ids = torch.randint(1, 49152, (batch, context), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, **extra)

    def run(tokens: int) -> Any:
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)

    with torch.no_grad():
        run(new_tokens)  # warm-up: kernel compilation, graph capture, cuBLAS / torch.compile
        run(1)
        torch.cuda.reset_peak_memory_stats()
        ttft = min(timed(lambda: run(1)) for _ in range(3))
        total = timed(lambda: run(new_tokens))
    peak = torch.cuda.max_memory_allocated() / 2**30
    return {
        "ttft_ms": 1000 * ttft,
        "prefill_tok_s": batch * context / ttft,
        "decode_tok_s": batch * (new_tokens - 1) / max(total - ttft, 1e-9),
        "peak_vram_gib": peak,
    }


def gemv_bandwidth(size: int = 16384, repeats: int = 50) -> dict[str, float]:
    """INT4 g128 GEMV y = W x on a size x size matrix (128 MiB of INT4, larger than L2)."""
    timing = gemv_timing(size, size, rows=1, repeats=repeats)
    renamed = {"us": "int4_us", "tb_s": "int4_tb_s"}
    return {renamed.get(key, key): value for key, value in timing.items() if key not in ("rows", "bits")}


def gemv_timing(
    out_features: int, in_features: int, rows: int, bits: int = 4, repeats: int = 50, from_l2: bool = False
) -> dict[str, Any]:
    """Low-bit (g128) projection of ``rows`` token rows, timed by CUDA events over CUDA-graph replays that cycle
    through enough weight copies to exceed twice the L2 cache (so every call reads HBM); bandwidth counts packed
    weights + scales + zeros. cuBLAS bf16 on the same shape, timed the same way, is the peer. ``from_l2``: one
    copy of each, read again by every call (from L2 where it fits): how fast the kernel is once its weights are
    on chip."""
    from tinyloop_hf import QuantFormat, QuantLinear
    from tinyloop_hf.kernels import ops_cuda
    from tinyloop_hf.quant_tinyloop import quantize_rtn

    fmt = QuantFormat(bits=bits, group_size=128)
    layer = QuantLinear(in_features, out_features, False, fmt)
    layer.load_packed(quantize_rtn(torch.randn(out_features, in_features, device="cuda") * 0.02, fmt))
    layer = layer.cuda()
    weight_bytes = sum(t.numel() * t.element_size() for t in layer.packed().tensors().values())
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size

    def copies(operand_bytes: int) -> int:
        """Operand copies the timed calls cycle through: past twice the L2 cache, or one (``from_l2``)."""
        return 1 if from_l2 else math.ceil(2 * l2_bytes / operand_bytes) + 1

    layers = [layer] + [copy.deepcopy(layer) for _ in range(copies(weight_bytes) - 1)]
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    bf16 = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(copies(2 * out_features * in_features))]  # fmt: skip

    def graph_seconds(call: Any, operands: list) -> float:
        for operand in operands:
            call(operand)  # warm-up: compilation, cuBLAS heuristics
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for index in range(repeats):
                call(operands[index % len(operands)])
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / repeats

    seconds = graph_seconds(lambda q: ops_cuda.project(x, [q]), layers)
    cublas = graph_seconds(lambda w: torch.nn.functional.linear(x, w), bf16)
    return {
        "shape": f"{out_features}x{in_features}",
        "rows": rows,
        "bits": bits,
        "us": seconds * 1e6,
        "tb_s": weight_bytes / seconds / 1e12,
        "cublas_bf16_us": cublas * 1e6,
        "speedup_vs_cublas_bf16": cublas / seconds,
    }


def kv_bytes_per_token(config: TinyLoopConfig, loops: int, int8: bool) -> int:
    """K/V bytes one token costs in the paged cache at this depth (what ``PagedTinyLoopCache.bytes_per_token()``
    reports once every slot is written): one slot per prelude/coda layer and per (loop, loop-block layer)."""
    from tinyloop_hf.paged_cache import kv_bytes_per_token_per_slot

    return config.kv_slots(loops) * kv_bytes_per_token_per_slot(
        config.num_key_value_heads, config.head_dim, torch.bfloat16, int8
    )


def weight_bytes(model: torch.nn.Module, linear_only: bool) -> int:
    """Bytes of parameters and buffers (packed tensors included): of the linear layers only, or of the whole model
    (embedding, norms and exit gate too)."""
    from tinyloop_hf import QuantLinear

    total = 0
    for module in model.modules():
        if linear_only and not isinstance(module, (QuantLinear, torch.nn.Linear)):
            continue
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            total += tensor.numel() * tensor.element_size()
    return total


# What a row's numbers depend on besides its key (impl, bits, loops, context, batch), with the value a row written
# before they were recorded ran with: rows of another setup are not compared.
SETUP_DEFAULTS = {"kv_cache_dtype": "auto", "new_tokens": 128, "run_ahead": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=at_least(1), nargs="+", default=[1, 16])
    parser.add_argument("--context", type=at_least(1), nargs="+", default=[128])
    parser.add_argument("--loops", type=at_least(1), nargs="+", default=[4])
    parser.add_argument("--bits", type=int, nargs="+", default=[16, 4], choices=[16, 8, 4, 2])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--new-tokens", type=at_least(2), default=128, help="decode rates need 2 or more")
    # A bare --peers used to parse as "no peers" and dropped the HF rows without a word: a peer list is required.
    peers = parser.add_mutually_exclusive_group()
    peers.add_argument(
        "--peers",
        nargs="+",
        default=["eager", "compile"],
        choices=["eager", "compile"],
        help="HF peers measured in the same run (default: eager compile)",
    )
    peers.add_argument(
        "--no-peers",
        dest="peers",
        action="store_const",
        const=[],
        help="no HF peer rows (the table then has no ratios)",
    )
    parser.add_argument("--peer-batches", type=at_least(1), nargs="+", default=None,
                        help="batches for peers (default all)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench"), help="output stem: OUT.json, OUT.md, OUT.png")
    parser.add_argument("--baseline", type=Path, help="regression check against this JSON (exit 1 below tolerance)")
    parser.add_argument("--tolerance", type=fraction, default=0.8, help="fraction of the baseline's decode rate")
    parser.add_argument("--no-gemv", action="store_true", help="skip the INT4 GEMV bandwidth measurement")
    parser.add_argument("--no-run-ahead", action="store_true", help="greedy decode steps wait for generate()'s host")
    args = parser.parse_args(argv)
    if args.peer_batches is not None and not args.peers:
        parser.error("--peer-batches selects the HF peers' batches; with --no-peers there are none")
    # The baseline is read once, before minutes of measuring: a bad file fails now, and a baseline that the run's own
    # JSON overwrites (--out at the same path) is still the old rows when the check runs.
    args.baseline_rows = None
    if args.baseline is not None:
        try:
            args.baseline_rows = load_baseline(args.baseline)
        except ValueError as error:
            parser.error(f"--baseline {args.baseline}: {error}")
    return args


def load_baseline(path: Path) -> list[dict]:
    """The rows of a tinyloop-bench JSON, or ValueError saying why ``path`` cannot serve as a regression baseline."""
    try:
        rows = json.loads(path.read_text())["rows"]
    except OSError as error:
        raise ValueError(f"cannot be read ({error.strerror})") from error
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError("is not a tinyloop-bench JSON file (a JSON object with a 'rows' list)") from error
    key = ("impl", "bits", "loops", "context", "batch", "decode_tok_s")
    if not isinstance(rows, list) or not all(isinstance(row, dict) and all(k in row for k in key) for row in rows):
        raise ValueError(f"its 'rows' are not tinyloop-bench rows (each needs {', '.join(key)})")
    for row in rows:
        integers = [k for k in ("bits", "loops", "context", "batch") if type(row[k]) is not int]
        rate = row["decode_tok_s"]
        if not isinstance(row["impl"], str) or integers or isinstance(rate, bool) or not isinstance(rate, int | float):
            wrong = integers + ([] if isinstance(row["impl"], str) else ["impl"])
            wrong += [] if isinstance(rate, int | float) and not isinstance(rate, bool) else ["decode_tok_s"]
            raise ValueError(f"a row has fields of the wrong type ({', '.join(wrong)}): {row}")
    if not rows:
        raise ValueError("has no rows")
    return rows


def baseline_problem(path: Path) -> str | None:
    """Why ``path`` cannot serve as a regression baseline, or None."""
    try:
        load_baseline(path)
    except ValueError as error:
        return str(error)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tinyloop-bench needs a CUDA GPU", file=sys.stderr)
        return 2

    rows: list[dict[str, Any]] = []
    extras: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    setup = {"kv_cache_dtype": args.kv_cache_dtype, "new_tokens": args.new_tokens, "run_ahead": not args.no_run_ahead}
    json_path, table_path, plot_path = (Path(f"{args.out}{suffix}") for suffix in (".json", ".md", ".png"))
    if not args.no_gemv:
        extras["gemv"] = gemv_bandwidth()
        print("INT4 GEMV:", extras["gemv"], flush=True)
    max_context = max(args.context) + args.new_tokens
    args.out.parent.mkdir(parents=True, exist_ok=True)
    extras["kv_kib_per_token"] = {
        f"L={loops}": {kind: kv_bytes_per_token(ouro_config(loops, 4096), loops, kind == "int8") / 1024
                       for kind in ("bf16", "int8")}
        for loops in args.loops
    }  # fmt: skip

    def record(row: dict[str, Any]) -> None:  # saved as it comes, so a crash later keeps what was measured
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        json_path.write_text(json.dumps({"extras": extras, "rows": rows}, indent=1))

    def measured(row: dict[str, Any], kv_bytes: int, model: Any, extra: dict[str, Any]) -> bool:
        """Measure ``row``'s configuration into it unless its K/V cannot fit on the device. One that does not fit
        (known before or found during the run) is listed in extras["skipped"] with the reason; the sweep goes on."""
        total = torch.cuda.get_device_properties(0).total_memory
        reason = None
        if kv_bytes > total:
            reason = f"its K/V cache needs {kv_bytes / 2**30:,.0f} GiB, the device has {total / 2**30:,.0f} GiB"
        else:
            if isinstance(model, TinyLoopForCausalLM):
                model.release_cuda_caches()  # the peak memory is this configuration's alone
            try:
                row.update(measure(model, row["batch"], row["context"], args.new_tokens, extra))
            except (torch.OutOfMemoryError, RuntimeError) as error:  # cuBLAS / graph capture report it as text
                if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error):
                    raise
                reason = f"out of device memory (K/V cache {kv_bytes / 2**30:,.0f} GiB)"
            if reason is not None:  # outside the handler, whose traceback holds the failed run's tensors
                gc.collect()
                torch.cuda.empty_cache()
        if reason is not None:
            extras.setdefault("skipped", []).append({**row, "reason": reason})
            print(f"skipped {row}: {reason}", flush=True)
        return reason is None

    for loops in args.loops:
        # Kept off the GPU: a row's peak memory is its own model's and cache's.
        base = base_model(loops, max_context).cpu()
        bf16_linear, bf16_total = weight_bytes(base, True), weight_bytes(base, False)
        for bits in args.bits:
            model = build_ours(base, bits).use_cuda_path(args.kv_cache_dtype, run_ahead=not args.no_run_ahead)
            memory = {
                "linear_weights_vs_bf16": weight_bytes(model, True) / bf16_linear,
                "all_weights_vs_bf16": weight_bytes(model, False) / bf16_total,
            }
            for context in args.context:
                for batch in args.batch:
                    row = {"impl": "tinyloop-cuda", "bits": bits, "loops": loops, "context": context, "batch": batch,
                           **setup}  # fmt: skip
                    kv = (
                        batch
                        * capacity_bucket(context + args.new_tokens)
                        * kv_bytes_per_token(model.config, loops, args.kv_cache_dtype == "int8")
                    )
                    if not measured(row, kv, model, {}):
                        continue
                    row.update(memory)
                    record(row)
            del model
            gc.collect()
            torch.cuda.empty_cache()
        del base
        gc.collect()
        torch.cuda.empty_cache()
        for peer in args.peers:
            hf_config = ouro_config(loops, max_context)
            hf = build_hf_peer(hf_config, loops)
            # A static cache makes generate() compile the forward itself (transformers' CompileConfig).
            extra: dict[str, Any] = {"cache_implementation": "static"} if peer == "compile" else {}
            for context in args.context:
                for batch in args.peer_batches if args.peer_batches is not None else args.batch:
                    row = {"impl": f"hf-{peer}", "bits": 16, "loops": loops, "context": context, "batch": batch,
                           "new_tokens": args.new_tokens}  # fmt: skip
                    kv = batch * (context + args.new_tokens) * kv_bytes_per_token(hf_config, loops, False)
                    try:
                        if not measured(row, kv, hf, extra):
                            continue
                    except Exception as error:  # a failing peer is reported, the sweep goes on
                        print(f"{row['impl']} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
                        continue
                    record(row)
            del hf
            gc.collect()
            torch.cuda.empty_cache()

    table = markdown(rows, extras)
    print(table)
    json_path.write_text(json.dumps({"extras": extras, "rows": rows}, indent=1))
    table_path.write_text(table)
    plot(rows, plot_path)
    if args.baseline is None:
        return 0
    return regression_check(rows, args.baseline, args.tolerance, extras.get("skipped", []), args.baseline_rows)


def _peer_rate(rows: list[dict], row: dict, impl: str) -> float | None:
    for other in rows:
        if other["impl"] == impl and all(other[k] == row[k] for k in ("loops", "context", "batch")):
            return other["decode_tok_s"]
    return None


def markdown(rows: list[dict], extras: dict) -> str:
    lines = [
        f"Ouro-1.4B shape on {extras['device']}, generate(), greedy; ratios: decode tok/s over the HF peer "
        f"at the same batch / context / loops.",
        "",
        "| impl | bits | loops | context | batch | TTFT ms | prefill tok/s | decode tok/s | x HF eager | "
        "x HF compile | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratios = []
        for peer in ("hf-eager", "hf-compile"):
            rate = _peer_rate(rows, row, peer)
            ratios.append(f"{row['decode_tok_s'] / rate:.1f}" if rate else "-")
        lines.append(
            f"| {row['impl']} | {row['bits']} | {row['loops']} | {row['context']} | {row['batch']} | "
            f"{row['ttft_ms']:.1f} | {row['prefill_tok_s']:,.0f} | {row['decode_tok_s']:,.1f} | {ratios[0]} | "
            f"{ratios[1]} | {row['peak_vram_gib']:.1f} |"
        )
    if "gemv" in extras:
        gemv = extras["gemv"]
        lines += [
            "",
            f"INT4 g128 GEMV {gemv['shape']}: {gemv['int4_us']:.1f} us = {gemv['int4_tb_s']:.2f} TB/s "
            f"({gemv['speedup_vs_cublas_bf16']:.2f}x cuBLAS bf16 at {gemv['cublas_bf16_us']:.1f} us)",
        ]
    for row in extras.get("skipped", []):
        weights = "bf16" if row["bits"] == 16 else f"INT{row['bits']}"
        lines.append(f"Not measured: {row['impl']} {weights} L={row['loops']} context {row['context']} "
                     f"batch {row['batch']}: {row['reason']}")  # fmt: skip
    for depth, sizes in extras.get("kv_kib_per_token", {}).items():
        lines.append(f"KV cache per token at {depth}: {sizes['bf16']:.0f} KiB bf16, {sizes['int8']:.0f} KiB INT8")
    memory = [row for row in rows if row["impl"] == "tinyloop-cuda" and row["bits"] != 16]
    for row in {r["bits"]: r for r in memory}.values():
        lines.append(
            f"INT{row['bits']} weight memory: linear layers {row['linear_weights_vs_bf16']:.3f}x bf16, whole model "
            f"(INT8 embedding and head) {row['all_weights_vs_bf16']:.3f}x"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    labels = [f"{r['impl']}\nint{r['bits']} L{r['loops']} ctx{r['context']} b{r['batch']}" for r in rows]
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    colors = ["tab:blue" if r["impl"] == "tinyloop-cuda" else "tab:gray" for r in rows]
    axis.bar(range(len(rows)), [r["decode_tok_s"] for r in rows], color=colors)
    axis.set_yscale("log")
    axis.set_ylabel("decode tokens / s (log)")
    axis.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    axis.set_title("Ouro-1.4B shape, generate() decode throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def regression_check(
    rows: list[dict],
    baseline_path: Path,
    tolerance: float,
    skipped: list[dict] = (),
    baseline: list[dict] | None = None,
) -> int:
    """1 when a tinyloop row decodes below ``tolerance`` x its baseline, or could not run at all (``skipped``: out of
    memory). The HF peers' rows are compared too but only reported: they measure the machine (HF eager decode is bound
    by the host's Python speed), not this package. ``baseline``: its rows as read before the run (else read now)."""
    baseline = load_baseline(baseline_path) if baseline is None else baseline
    key = ("impl", "bits", "loops", "context", "batch")

    def same(a: dict, b: dict) -> bool:
        """The same configuration, run with the same setup (a field a row lacks has its default)."""
        if not all(a[k] == b[k] for k in key):
            return False
        setup = SETUP_DEFAULTS if a["impl"].startswith("tinyloop") else {"new_tokens": SETUP_DEFAULTS["new_tokens"]}
        return all(a.get(k, default) == b.get(k, default) for k, default in setup.items())

    failures, peer_drift, compared = [], [], 0
    for old in baseline:
        lost = next((r for r in skipped if same(r, old)), None)
        if lost is not None:
            baseline_rate = old["decode_tok_s"]
            line = f"{[old[k] for k in key]}: not measured ({lost['reason']}); {baseline_rate:.1f} in the baseline"
            (failures if old["impl"].startswith("tinyloop") else peer_drift).append(line)
            continue
        new = next((r for r in rows if same(r, old)), None)
        compared += new is not None and old["impl"].startswith("tinyloop")
        if new is not None and new["decode_tok_s"] < tolerance * old["decode_tok_s"]:
            line = f"{[old[k] for k in key]}: {new['decode_tok_s']:.1f} < {tolerance} x {old['decode_tok_s']:.1f}"
            (failures if old["impl"].startswith("tinyloop") else peer_drift).append(line)
    for line in failures:
        print("REGRESSION", line)
    for line in peer_drift:
        print("peer slower than in the baseline (machine state, not a regression):", line)
    if not compared and not failures:
        print(f"regression check against {baseline_path}: FAILED, no tinyloop row of this run has a baseline row of "
              "the same configuration and setup (impl, bits, loops, context, batch; K/V dtype, new tokens, run-ahead)")
        return 1
    verdict = "FAILED" if failures else "ok"
    print(f"regression check against {baseline_path}: {verdict} ({compared} tinyloop rows compared)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
