"""The parts of the CUDA path and tinyloop-bench that are plain Python: report, ratios, regression check, the
paged-decode partition and the capacity buckets (the kernels themselves are tested on a GPU, tests/gpu)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from helpers import tiny_model
from tinyloop_hf import PagedTinyLoopCache, QuantEmbedding, QuantLinear, TinyLoopForCausalLM
from tinyloop_hf.cuda_path import capacity_bucket
from tinyloop_hf.eval import bench as bench_module
from tinyloop_hf.eval.bench import (
    build_ours,
    kv_bytes_per_token,
    load_baseline,
    markdown,
    ouro_config,
    parse_args,
    quant_config,
    regression_check,
    weight_bytes,
)
from tinyloop_hf.kernels import ops_cuda
from tinyloop_hf.kernels.ops_cuda import _SMEM_LIMIT, _decode_shared_floats, decode_partition
from tinyloop_hf.quantizer_tinyloop import replace_linears

ROWS = [
    {"impl": "tinyloop-cuda", "bits": 4, "loops": 4, "context": 128, "batch": 1, "ttft_ms": 10.0,
     "prefill_tok_s": 12800.0, "decode_tok_s": 300.0, "peak_vram_gib": 1.0, "linear_weights_vs_bf16": 0.28,
     "all_weights_vs_bf16": 0.33},
    {"impl": "hf-eager", "bits": 16, "loops": 4, "context": 128, "batch": 1, "ttft_ms": 20.0,
     "prefill_tok_s": 6400.0, "decode_tok_s": 10.0, "peak_vram_gib": 3.0},
    {"impl": "hf-compile", "bits": 16, "loops": 4, "context": 128, "batch": 1, "ttft_ms": 20.0,
     "prefill_tok_s": 6400.0, "decode_tok_s": 50.0, "peak_vram_gib": 3.0},
]  # fmt: skip


def test_peer_flags_never_drop_the_hf_rows_silently(capsys):
    """A bare --peers once parsed as an empty list, so a run meant to measure the HF peers measured none."""
    assert parse_args([]).peers == ["eager", "compile"]
    assert parse_args(["--peers", "eager"]).peers == ["eager"]
    assert parse_args(["--no-peers"]).peers == []
    for argv in (["--peers"], ["--peer-batches"], ["--peers", "eager", "--no-peers"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--peer" in capsys.readouterr().err


def test_a_bad_baseline_is_refused_before_anything_is_measured(tmp_path, capsys):
    """--baseline /dev/null once ran the whole bench and then died in json.loads with a traceback."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"rows": ROWS}))
    assert parse_args(["--baseline", str(good)]).baseline == good
    empty, no_rows, odd_rows = tmp_path / "empty.json", tmp_path / "no_rows.json", tmp_path / "odd.json"
    empty.write_text("")
    no_rows.write_text(json.dumps({"extras": {}}))
    odd_rows.write_text(json.dumps({"rows": [{"impl": "x"}]}))
    for path, reason in ((empty, "not a tinyloop-bench JSON"), (no_rows, "not a tinyloop-bench JSON"),
                         (odd_rows, "decode_tok_s"), (tmp_path / "missing.json", "cannot be read")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(["--baseline", str(path)])
        assert f"--baseline {path}" in capsys.readouterr().err
        assert reason in bench_module.baseline_problem(path)


def test_table_reports_ratios_against_both_peers_and_weight_memory():
    gemv = {"shape": "8x8", "int4_us": 1.0, "int4_tb_s": 3.1, "cublas_bf16_us": 2.0, "speedup_vs_cublas_bf16": 2.0}
    table = markdown(ROWS, {"device": "GPU", "gemv": gemv})
    ours = next(line for line in table.splitlines() if line.startswith("| tinyloop-cuda"))
    assert "| 300.0 | 30.0 | 6.0 |" in ours
    assert "3.10 TB/s" in table and "linear layers 0.280x bf16" in table


def test_table_lists_configurations_that_did_not_fit_with_the_reason():
    skipped = [
        {"impl": "hf-eager", "bits": 16, "loops": 8, "context": 8192, "batch": 64, "reason": "needs 800 GiB"},
        {"impl": "tinyloop-cuda", "bits": 2, "loops": 8, "context": 8192, "batch": 16, "reason": "out of"},
    ]
    table = markdown(ROWS, {"device": "GPU", "skipped": skipped})
    assert "Not measured: hf-eager bf16 L=8 context 8192 batch 64: needs 800 GiB" in table
    assert "Not measured: tinyloop-cuda INT2 L=8 context 8192 batch 16: out of" in table


def test_regression_check_fails_below_the_tolerance(tmp_path, capsys):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"rows": ROWS}))
    assert regression_check(ROWS, baseline, 0.8) == 0
    slower = [dict(row, decode_tok_s=row["decode_tok_s"] * 0.7) if row["impl"] == "tinyloop-cuda" else row
              for row in ROWS]  # fmt: skip
    assert regression_check(slower, baseline, 0.8) == 1
    assert "REGRESSION ['tinyloop-cuda', 4, 4, 128, 1]: 210.0 < 0.8 x 300.0" in capsys.readouterr().out


def test_regression_check_reports_slower_peers_without_failing(tmp_path, capsys):
    """HF eager decode is host-bound: a slower machine slows the peers, which is not a regression of this package."""
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"rows": ROWS}))
    slower_peers = [dict(row, decode_tok_s=row["decode_tok_s"] * 0.5) if row["impl"].startswith("hf-") else row
                    for row in ROWS]  # fmt: skip
    assert regression_check(slower_peers, baseline, 0.8) == 0
    out = capsys.readouterr().out
    assert "REGRESSION" not in out and "['hf-eager', 16, 4, 128, 1]: 5.0 < 0.8 x 10.0" in out
    assert out.rstrip().endswith(": ok (1 tinyloop rows compared)")


def test_regression_check_fails_on_a_tinyloop_row_that_no_longer_fits(tmp_path, capsys):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"rows": ROWS}))
    ours = {key: ROWS[0][key] for key in ("impl", "bits", "loops", "context", "batch")}
    assert regression_check(ROWS[1:], baseline, 0.8, [dict(ours, reason="out of device memory")]) == 1
    assert "REGRESSION ['tinyloop-cuda', 4, 4, 128, 1]: not measured (out of device memory)" in capsys.readouterr().out
    extra = dict(ROWS[0], batch=16)
    baseline.write_text(json.dumps({"rows": ROWS + [extra]}))
    assert regression_check(ROWS, baseline, 0.8) == 0  # a row not asked for this time is no regression ...
    assert regression_check(ROWS[1:], baseline, 0.8) == 1  # ... but a run that compared no tinyloop row fails
    assert "no tinyloop row of this run has a baseline row" in capsys.readouterr().out


def test_regression_check_compares_only_rows_of_the_same_setup(tmp_path, capsys):
    """An INT8-K/V run, another token count or no run-ahead is another setup: not compared with 16-bit K/V rows
    (rows written before the setup was recorded count as the defaults)."""
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"rows": ROWS}))
    for setup in ({"kv_cache_dtype": "int8"}, {"new_tokens": 64}, {"run_ahead": False}):
        slower = [dict(ROWS[0], decode_tok_s=100.0, **setup)]
        assert regression_check(slower, baseline, 0.8) == 1
        assert "no tinyloop row of this run" in capsys.readouterr().out
    same = [dict(ROWS[0], decode_tok_s=100.0, kv_cache_dtype="auto", new_tokens=128, run_ahead=True)]
    assert regression_check(same, baseline, 0.8) == 1 and "REGRESSION" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, problem",
    [(["--batch", "0"], "--batch: .*>= 1"), (["--context", "0"], "--context"), (["--loops", "0"], "--loops"),
     (["--new-tokens", "1"], "--new-tokens: .*>= 2"), (["--tolerance", "nan"], "--tolerance"),
     (["--tolerance", "80"], r"--tolerance: must be a number in \(0, 1\]"), (["--tolerance", "0"], "--tolerance"),
     (["--no-peers", "--peer-batches", "1"], "--peer-batches")],
)  # fmt: skip
def test_bench_flags_are_checked_before_any_measuring(flags, problem, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(flags)
    assert stop.value.code == 2 and re.search(problem, capsys.readouterr().err)


@pytest.mark.parametrize(
    "row, problem",
    [({"decode_tok_s": None}, "decode_tok_s"), ({"decode_tok_s": "300"}, "decode_tok_s"), ({"bits": "4"}, "bits")],
)
def test_a_baseline_with_fields_of_the_wrong_type_is_refused(row, problem, tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps({"rows": [dict(ROWS[0], **row)]}))
    with pytest.raises(ValueError, match=problem):
        load_baseline(path)
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="has no rows"):
        load_baseline(path)


@pytest.mark.parametrize("group,dim", [(1, 128), (4, 64), (8, 128), (1, 16)])
def test_wide_paged_decode_ctas_serve_many_short_rows_within_shared_memory(group, dim):
    """One 256-thread CTA per (row, KV head), no split merge, where the launch fills the GPU's SMs and the rows are
    short; split CTAs of 128 threads otherwise (few rows: batch 1's clusters; long contexts: many steps per CTA)."""
    kv_heads = 16 // group
    for batch, capacity in ((16, 256), (16, 512), (64, 128), (1, 256), (4, 256), (16, 2560), (64, 1280), (16, 4096)):
        wide = batch * kv_heads >= ops_cuda.PAGED_WIDE_MIN_CTAS and capacity <= ops_cuda.PAGED_WIDE_MAX_TOKENS
        fits = 4 * _decode_shared_floats(group, dim, 1, 256) <= _SMEM_LIMIT
        threads, unroll = ops_cuda.decode_shape(batch, kv_heads, group, dim, capacity)
        assert (threads, unroll) == (ops_cuda.PAGED_WIDE if wide and fits else (128, 4)), (batch, capacity)
        splits, _, cluster = decode_partition(batch, kv_heads, group, dim, capacity, 8)
        if threads == 256:
            assert (splits, cluster) == (1, 1)


@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("group,dim", [(1, 128), (4, 64), (8, 128), (8, 256), (1, 16)])
@pytest.mark.parametrize("capacity", [128, 2048, 8192, 16384])
@pytest.mark.parametrize("max_cluster", [1, 8])
def test_decode_partition_fills_the_gpu_within_shared_memory(batch, group, dim, capacity, max_cluster, monkeypatch):
    monkeypatch.setattr(ops_cuda, "PAGED_WIDE", None)  # split CTAs everywhere (wide CTAs: the test below)
    kv_heads = 16 // group if group < 16 else 1
    splits, tokens_per_split, cluster = decode_partition(batch, kv_heads, group, dim, capacity, max_cluster)
    assert splits % cluster == 0 and splits >= cluster
    # Clusters for small batches (one cluster per (row, KV head) stays within ~4 CTAs per SM) and capacities of up
    # to 4 units.
    small = batch * kv_heads * max_cluster <= 528 and capacity <= 4 * max_cluster * tokens_per_split
    assert cluster == (max_cluster if small else 1)
    assert 4 * _decode_shared_floats(group, dim, splits) <= _SMEM_LIMIT
    # A split is two steps of the kernel's token loop (UNROLL 4 tokens per thread, D/8 threads per token).
    assert tokens_per_split == 2 * 4 * 128 // (dim // 8)
    # Enough CTAs for ~4 per SM of 132 when the context is long enough to use them, no more splits than it can use.
    useful = math.ceil(capacity / tokens_per_split)
    assert splits < cluster + min(useful, math.ceil(528 / (batch * kv_heads)))
    if useful * batch * kv_heads >= 528:
        assert splits * batch * kv_heads >= 528 or 4 * _decode_shared_floats(group, dim, splits + cluster) > _SMEM_LIMIT


def test_capacity_buckets_fit_with_a_quarter_or_127_tokens_to_spare_at_most():
    assert capacity_bucket(1) == 128 and capacity_bucket(256) == 256 and capacity_bucket(257) == 384
    assert capacity_bucket(8192 + 128) == 10240 and capacity_bucket(2048 + 128) == 2560
    for tokens in range(1, 70000, 37):
        bucket = capacity_bucket(tokens)
        assert bucket >= tokens and bucket % 128 == 0  # whole 16-token pages
        assert bucket < tokens + max(128, tokens / 4)
        assert capacity_bucket(bucket) == bucket


@pytest.mark.parametrize("int8", [False, True])
def test_kv_memory_per_token_is_what_the_paged_cache_reports(int8):
    model = tiny_model("huginn").to(torch.bfloat16)
    cache = PagedTinyLoopCache(model.config, kv_dtype="int8" if int8 else "auto")
    with torch.no_grad():
        model(torch.randint(1, 256, (1, 6)), past_key_values=cache, use_cache=True, num_loops=3)
    assert cache.bytes_per_token() == kv_bytes_per_token(model.config, 3, int8)
    assert kv_bytes_per_token(ouro_config(4, 4096), 4, False) == 96 * 2 * 16 * 128 * 2  # 768 KiB (kernels.md)


@pytest.mark.parametrize("bits, linears, whole", [(4, 0.2806, 0.2961), (8, 0.5006, 0.5007), (2, 0.1767, 0.1996)])
def test_quantized_weight_memory_of_the_benchmark_model(bits, linears, whole):
    """The byte counts depend only on shapes, so the Ouro-1.4B shape is built on the meta device with empty packed
    modules of the benchmark's formats. The issue's floor: INT4 whole model <= 0.3x bf16 (0.331x with a bf16 table)."""
    with torch.device("meta"):
        model = TinyLoopForCausalLM(ouro_config(4, 4096)).to(torch.bfloat16)
    bf16_linear, bf16_total = weight_bytes(model, True), weight_bytes(model, False)
    replace_linears(model, quant_config(bits))
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and model.model.embed_tokens.format.bits == 8
    assert model.model.embed_tokens.compute_dtype == torch.bfloat16
    assert weight_bytes(model, True) / bf16_linear == pytest.approx(linears, abs=1e-4)  # the embedding is no linear
    assert weight_bytes(model, False) / bf16_total == pytest.approx(whole, abs=1e-4)
    assert bits != 4 or weight_bytes(model, False) / bf16_total <= 0.3


def test_ablate_decode_skips_only_the_named_kernels(monkeypatch):
    from tinyloop_hf.eval.ablate_decode import skip_kernels
    from tinyloop_hf.kernels import ops_cuda

    launched = []
    monkeypatch.setattr(ops_cuda, "kernel", lambda file, name: name)
    monkeypatch.setattr(ops_cuda, "launch", lambda fn, *args, **kwargs: launched.append(fn))
    skip_kernels(["residual_norm", "paged"])
    for name in ("residual_norm<__nv_bfloat16>", "gemv_quant<4>", "paged_decode<__nv_bfloat16, 0, 1, 8, 128>"):
        ops_cuda.launch(ops_cuda.kernel("some.cu", name), (1,), (1,), ())
    assert launched == ["gemv_quant<4>"]


def test_variants_are_quantized_copies_that_leave_the_base_model_as_it_was():
    """The bench keeps its bf16 base model on the CPU and builds each variant on the GPU from a copy."""
    base = tiny_model("ouro", hidden_size=128, intermediate_size=256).to(torch.bfloat16)  # whole 128-column groups
    before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    variant = build_ours(base, 4, device="cpu")
    assert isinstance(variant.model.loop_layers[0].mlp.down_proj, QuantLinear)
    assert not any(isinstance(module, QuantLinear) for module in base.modules())
    assert all(torch.equal(before[name], tensor) for name, tensor in base.state_dict().items())


def test_replay_timeline_adds_up_each_kernels_share_of_the_step():
    """eval/replay_timeline: what a kernel adds is its end minus the latest end before it (overlap counted once),
    per kernel kind; the added times sum to the replay's span."""
    from tinyloop_hf.eval.replay_timeline import kind_of, split_replays, summarize

    replay = [  # (start, end, name) in start order: B starts before A ends (programmatic launch)
        (0.0, 4.0, "void A<1>(int)"),
        (3.0, 10.0, "void B<2>(int, float)"),
        (10.5, 12.0, "void A<1>(int)"),
        (11.0, 11.5, "void C(int)"),  # ends before the A launch running beside it: adds nothing
    ]
    rows = {kind: row for kind, *row in summarize(replay)}
    assert kind_of("void B<2>(int, float)") == "B<2>"
    # calls, median duration, median start before the previous end, median and total added
    assert rows["A<1>"] == [2, 2.75, -0.25, 3.0, 6.0]
    assert rows["B<2>"] == [1, 7.0, 1.0, 6.0, 6.0]
    assert rows["C"] == [1, 0.5, 1.0, 0.0, 0.0]
    assert sum(row[-1] for row in rows.values()) == replay[-2][1] - replay[0][0]
    assert split_replays(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]


def test_generate_steps_count_overlapping_kernels_once_and_idle_time_as_the_rest():
    """replay_timeline --generate: a step's window runs from one LM-head kernel's end to the next; kernels on two
    streams that overlap count once in its busy time."""
    from tinyloop_hf.eval.replay_timeline import step_windows

    kernels = [
        (0.0, 2.0, "void head<8>(int)"),
        (3.0, 6.0, "void layer(int)"),
        (4.0, 5.0, "void other_stream(int)"),  # inside the layer kernel's interval
        (7.0, 8.0, "void head<8>(int)"),
        (8.5, 9.0, "void tail(int)"),
        (9.5, 10.0, "void head<8>(int)"),
    ]
    windows = step_windows(kernels, "head<8>")
    assert [(period, busy) for period, busy, _ in windows] == [(6.0, 4.0), (2.0, 1.0)]
    assert windows[0][2] == {"head<8>": 1.0, "layer": 3.0, "other_stream": 1.0}


def test_fused_profile_hand_off_table_separates_the_producers_skew_from_the_hand_off():
    """fused_profile --global-clock: with one producer CTA 300 ns behind the rest at every hand-off and every consumer
    seeing the data 1,100 ns after that last producer (one consumer 200 ns later still), the table reports exactly
    those three times; CTAs without an attention split (their attention marks never written) do not count."""
    from tinyloop_hf.eval.fused_profile import HANDOFFS, handoff_table

    apps, grid = 6, 8
    ns = torch.zeros(apps, 16, grid, dtype=torch.float64)
    for a in range(apps):
        ns[a, :, :] = 1e6 * a + 1e3 * torch.arange(16, dtype=torch.float64)[:, None]  # marks 1 us apart
    for _, produced, consumed, before in HANDOFFS:
        for a in range(apps):
            base = ns[a, produced, 0].item()
            ns[a, produced, :] = base
            ns[a, produced, 3] = base + 300.0  # the late producer
            target = a + 1 if before else a
            if target < apps:
                ns[target, consumed, :] = base + 300.0 + 1100.0
                ns[target, consumed, 1] += 200.0  # the late consumer
    ns[:, 4:6, 4:] = 0.0  # half the CTAs attend nothing: marks 4 and 5 stay 0
    table = handoff_table(ns)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "hand-off" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == [name for name, *_ in HANDOFFS]
    for row in rows:
        assert row.split(" | ")[1:] == ["0.30", "1.10", "0.20 |"], row


def test_fused_profile_keeps_nanoseconds_of_a_global_timer_trace():
    """The global timer's values (~1.7e18 ns) converted to float64 directly would lose everything below 256 ns."""
    from tinyloop_hf.eval.fused_profile import as_float_ticks

    epoch_ns = 1_764_000_000_000_000_000
    raw = torch.tensor([[epoch_ns + 5, epoch_ns + 37, 0], [epoch_ns + 1000, epoch_ns + 1001, epoch_ns + 1133]])
    ticks = as_float_ticks(raw)
    assert ticks.tolist() == [[1.0, 33.0, 0.0], [996.0, 997.0, 1129.0]]


def test_persistent_probe_reads_the_asked_fraction_of_each_activation():
    """persistent_probe --activation-fraction: each projection CTA reads that share of its input activation (a K
    split's traffic); phases without an activation read none, and without --activations no phase reads any."""
    from tinyloop_hf.eval.persistent_probe import PHASES_PER_LAYER, lay_out, ouro_phases

    layer = ouro_phases(16)[:PHASES_PER_LAYER]  # one layer application (~51 MB of buffers on the CPU)
    whole, _ = lay_out(layer, torch.device("cpu"), True)
    quarter, _ = lay_out(layer, torch.device("cpu"), True, 0.25)
    none, _ = lay_out(layer, torch.device("cpu"), False, 0.25)
    assert whole.act_vectors[0] == 16 * 2048 * 2 // 16  # QKV: all of x, M x K bf16 in 16-byte vectors
    assert quarter.act_vectors == [round(v / 4) for v in whole.act_vectors]
    assert [v == 0 for v in whole.act_vectors] == [name not in ("qkv", "o", "gate_up", "down") for name, *_ in layer]
    assert not any(none.act_vectors) and quarter.vectors == whole.vectors


GPU_ONLY_TOOLS = [
    "ablate_decode", "gemv_sweep", "profile_decode", "speculation_cost", "cluster_probe", "ring_probe", "pipe_probe"
]


@pytest.mark.parametrize("module", GPU_ONLY_TOOLS)
def test_gpu_only_eval_tools_stop_with_one_line_without_a_gpu(module):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, "-m", f"tinyloop_hf.eval.{module}"], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    want = f"python -m tinyloop_hf.eval.{module} needs a CUDA GPU (torch.cuda.is_available() is False)"
    assert done.stderr.strip() == want


@pytest.mark.parametrize(
    "command, problem",
    [(["quality", "--methods", "RTN", "--out", "x"], "invalid choice: 'RTN'"),
     (["early_exit", "--windows", "0", "--out", "x"], "--windows: must be an integer >= 1"),
     (["speculation", "--draft-tokens", "four", "--out", "x"], "--draft-tokens: must be an integer >= 1"),
     (["constraint_overhead", "--repeats", "0"], "--repeats: must be an integer >= 1")],
)  # fmt: skip
def test_cpu_eval_tools_check_their_flags_before_any_work(command, problem):
    done = subprocess.run([sys.executable, "-m", f"tinyloop_hf.eval.{command[0]}", *command[1:]], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 2 and problem in done.stderr and "Traceback" not in done.stderr
