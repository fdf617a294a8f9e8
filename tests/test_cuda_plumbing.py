"""The CUDA backend's Python side on a CPU: every launch the model makes, with kernels mocked out.

Numbers come from tests/gpu; this checks the plumbing a GPU run would otherwise be the first to exercise: which
kernels a decode step launches per layer, that each launch passes exactly as many arguments as the kernel declares,
that the pointers a kernel always reads are set, and that the paged-decode grid and shared memory fit.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import tiny_model
from tinyloop_hf import PagedTinyLoopCache, QuantFormat, QuantLinear, TinyLoopQuantConfig
from tinyloop_hf.convert.quantize import quantize_model
from tinyloop_hf.kernels import loader, ops_cuda
from tinyloop_hf.quant_tinyloop import quantize_rtn

KERNELS = Path(loader.__file__).parent


def declared_parameters(file: str, kernel: str) -> int:
    source = (KERNELS / file).read_text()
    start = re.search(rf"__global__ void(?: __launch_bounds__\([^()]+\))?\s+{kernel}\s*\(", source).end()
    depth, commas = 1, 0
    for index, char in enumerate(source[start:]):
        depth += {"(": 1, ")": -1}.get(char, 0)
        commas += char == "," and depth == 1
        if depth == 0:
            return commas + 1 if source[start : start + index].strip() else 0
    raise AssertionError(f"unterminated parameter list of {kernel}")


def junction_arguments(args: tuple) -> tuple:
    """A gemv_quant launch's 7 junction-prologue arguments (jx, jbranch, jw_branch, jw_next, jsum, eps, mode): the
    ones before its 12 RoPE-epilogue arguments."""
    return args[-19:-12]


def rope_arguments(args: tuple) -> tuple:
    """A QKV launch's 12 RoPE-epilogue arguments (cos, sin, q, K pages, V pages, block table, positions,
    max_blocks, Hq, Hkv, D, layout): the last ones of gemv_quant and of the tensor-core kernel."""
    return args[-12:]


@pytest.fixture
def launches(monkeypatch):
    recorded = []
    monkeypatch.setattr(ops_cuda, "kernel", lambda file, name: (file, name))
    monkeypatch.setattr(ops_cuda, "_check", lambda *args: None)
    monkeypatch.setattr(ops_cuda, "_check_on_gpu", lambda *args: None)
    monkeypatch.setattr(ops_cuda, "decode_cluster", lambda device: ops_cuda.DECODE_CLUSTER)  # as on sm_90+
    monkeypatch.setattr(ops_cuda, "multiprocessors", lambda device: 132)  # an H100 / H200
    # Graphs without programmatic launches (before sm_90, or turned off): junctions fused into GEMV prologues.
    monkeypatch.setattr(ops_cuda, "programmatic_launches", lambda device: False)
    monkeypatch.setattr(
        ops_cuda,
        "launch",
        lambda fn, grid, block, args, shared_mem=0, dependent=False, cluster=1: recorded.append(
            (*fn, grid, args, shared_mem)
        ),
    )
    return recorded


def launches_of(monkeypatch, prefix):
    """(dependent, cluster, name, grid) of every launch of a kernel whose name starts with ``prefix``; the launches
    are still recorded by the ``launches`` fixture."""
    found = []
    record = ops_cuda.launch

    def launch(fn, grid, block, args, shared_mem=0, dependent=False, cluster=1):
        if fn[1].startswith(prefix):
            found.append((dependent, cluster, fn[1], grid))
        record(fn, grid, block, args, shared_mem, dependent, cluster)

    monkeypatch.setattr(ops_cuda, "launch", launch)
    return found


def _model(variant, bits):
    model = tiny_model(variant, hidden_size=64, intermediate_size=128)
    if bits:
        quantize_model(model, TinyLoopQuantConfig(bits=bits, group_size=32), progress=False)
    model = model.to(torch.bfloat16)
    model.set_op_backend("cuda")
    return model


@pytest.mark.parametrize("tile", [True, False])  # prompts through the tile kernel (the default) or dequantize + GEMM
@pytest.mark.parametrize("variant", ["ouro", "llama", "huginn"])
def test_every_launch_matches_its_kernel_signature(variant, tile, launches, monkeypatch):
    monkeypatch.setattr(ops_cuda, "TILE_GEMM", tile)
    model = _model(variant, 4)
    for batch in (1, 2):  # decode: one row through the CUDA-core GEMV, two through the tensor-core kernel
        cache = PagedTinyLoopCache(model.config, capacity=64)
        ids = torch.randint(1, 256, (batch, 44))
        with torch.no_grad():  # prompt (40 rows or 80), decode, 3 tokens on a past (paged attention, Q = 3)
            model(ids[:, :40], past_key_values=cache, use_cache=True)
            model(ids[:, 40:41], past_key_values=cache, use_cache=True)
            model(ids[:, 41:], past_key_values=cache, use_cache=True)
    kernels = {name.split("<")[0] for _, name, *_ in launches}
    expected = {
        *(("gemm_quant_tile", "gemm_tile_reduce") if tile else ("dequantize_weights", "swiglu")),
        "gemv_quant",
        "gemm_quant_mma",
        "paged_decode",
        "rope_kv_append",
        "residual_norm",
    }
    assert expected <= kernels
    new_tokens = {int(args[16]) for _, name, _, args, _ in launches if name.startswith("paged_decode")}
    assert new_tokens == {1, 3}  # decode, and the 3-token continuation read from the pages
    for file, name, grid, args, shared_mem in launches:
        kernel = name.split("<")[0]
        assert len(args) == declared_parameters(file, kernel), name
        assert all(isinstance(arg, (np.uint64, np.int32, np.float32)) for arg in args), name
        assert shared_mem <= 48 * 1024 and all(isinstance(g, int) and g > 0 for g in grid), name


def test_a_packed_embedding_lookup_is_one_launch(launches):
    """QuantEmbedding on the CUDA path: one dequantize_rows launch per lookup, a CTA per token along grid x (whose
    limit, unlike y's 65,535, no prompt reaches), its arguments as the kernel declares them."""
    model = tiny_model("llama", hidden_size=64, intermediate_size=128, tie_word_embeddings=False)
    components = {"embed_tokens": {"bits": 8, "group_size": None}}
    quantize_model(model, TinyLoopQuantConfig(bits=4, group_size=32, components=components), progress=False)
    model = model.to(torch.bfloat16)
    model.set_op_backend("cuda")
    out = model.model.embed_tokens(torch.randint(1, 256, (2, 3)))
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    (file, name, grid, args, _), *others = [launch for launch in launches if launch[1].startswith("dequantize_rows")]
    assert not others and name == "dequantize_rows<8, __nv_bfloat16>" and grid == (6, 1)
    assert len(args) == declared_parameters(file, "dequantize_rows")
    assert int(args[5]) == 256 and int(args[7]) == 64  # table rows, K


def _ouro_decode_step(launches: list) -> tuple:
    """An INT4 Ouro model (2 loop-block layers x 3 loops, sandwich norms) and its cache, with ``launches`` holding
    the kernels of one decode step after an 8-token prompt, from its first layer on (the step's RoPE angles, one
    launch, come first and are checked and dropped here)."""
    model = _model("ouro", 4)
    cache = PagedTinyLoopCache(model.config, capacity=64)
    ids = torch.randint(1, 256, (1, 9))
    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        launches.clear()
        model(ids[:, 8:], past_key_values=cache, use_cache=True)
    assert launches[0][1] == "rope_angles" and sum(launch[1] == "rope_angles" for launch in launches) == 1
    del launches[0]
    return model, cache


def test_a_decode_step_launches_the_fused_kernels_per_layer(launches):
    model, cache = _ouro_decode_step(launches)
    heads, kv_heads, dim = 4, model.config.num_key_value_heads, model.config.head_dim
    splits, _, cluster = ops_cuda.decode_partition(
        1, kv_heads, heads // kv_heads, dim, cache.storage.capacity, ops_cuda.DECODE_CLUSTER
    )
    assert cluster == ops_cuda.DECODE_CLUSTER
    names = [name for _, name, *_ in launches]
    kernels = [n.split("<")[0] for n in names]
    # A loop: the first block's input norm, then per block QKV (from the second block on with the previous block's
    # last junction in its prologue; RoPE + KV append in its epilogue), attention (split-KV partials merged inside
    # paged_decode), O, gate/up (with the junction after attention in its prologue), down; the last block's
    # junction; Ouro's norm.
    block = ["gemv_quant", "paged_decode", "gemv_quant", "gemv_quant", "gemv_quant"]
    loop = ["rms_norm", *block * model.config.num_loop_layers, "residual_norm", "rms_norm"]
    assert kernels[: len(loop)] == loop
    junction_of = lambda launch: junction_arguments(launch[3])  # noqa: E731
    rope_of = lambda launch: rope_arguments(launch[3])  # noqa: E731
    first_qkv, second_qkv = launches[1], launches[1 + len(block)]
    assert all(int(a) == 0 for a in junction_of(first_qkv)[:5])  # the first block's QKV launch has no junction
    assert all(int(a) != 0 for a in junction_of(second_qkv)[:5]) and int(junction_of(second_qkv)[6]) == 1  # sandwich
    for qkv_launch in (first_qkv, second_qkv):
        assert qkv_launch[1].endswith(", true>")  # the RoPE epilogue
        rope = rope_of(qkv_launch)
        assert all(int(a) != 0 for a in rope[:7])
        assert [int(a) for a in rope[7:]] == [cache.storage.blocks_per_row, heads, kv_heads, dim, 0]  # rotate_half
        page_pointers = {t.data_ptr() for pages in cache.storage.pages.values() for t in pages[:2]}
        assert {int(rope[3]), int(rope[4])} <= page_pointers and int(rope[3]) != int(rope[4])
    qkv = first_qkv[3]
    assert [int(qkv[8]), int(qkv[14]), int(qkv[20])] == [heads * dim, kv_heads * dim, kv_heads * dim]  # N0, N1, N2
    gate_up_launch = launches[4]
    assert ", true, " in gate_up_launch[1] and ", true, " not in first_qkv[1]  # SwiGLU fused into gate/up
    assert all(int(p) != 0 for p in junction_of(gate_up_launch)[:5]) and int(junction_of(gate_up_launch)[6]) == 1
    assert gate_up_launch[4] == model.config.hidden_size * 2  # the normed row staged in shared memory (bf16)
    assert launches[2][2] == (kv_heads, 1, splits) and splits % cluster == 0  # paged decode grid: whole clusters
    assert names[2].endswith(f", {cluster}, {dim}, 128, 4>")  # 128-thread CTAs of split-KV, 4 tokens a step
    assert int(launches[2][3][13]) == cache.storage.split_counters.data_ptr()
    attention_launches = sum(name.startswith("paged_decode<__nv_bfloat16, 0, ") for name in names)
    assert attention_launches == model.config.num_loop_layers * model.config.num_loops


def test_rope_epilogue_switch_holds_with_the_junction_prologue(launches, monkeypatch):
    """ROPE_EPILOGUE off: every QKV launch writes y and rope_kv_append rotates, the launches with the junction in
    their prologue (one row, without programmatic launches) included."""
    monkeypatch.setattr(ops_cuda, "ROPE_EPILOGUE", False)
    model, _ = _ouro_decode_step(launches)
    names = [name for _, name, *_ in launches]
    qkv = [launch for launch in launches if launch[1].startswith("gemv_quant") and int(launch[3][20]) != 0]  # N2
    assert any(int(junction_arguments(launch[3])[0]) != 0 for launch in qkv)  # a QKV launch with the prologue
    assert not any(name.startswith("gemv_quant") and name.endswith(", true>") for name in names)
    assert sum(name.startswith("rope_kv_append") for name in names) == len(qkv)


def test_programmatic_launches_keep_the_junctions_in_their_own_kernel(launches, monkeypatch):
    """With programmatic launches (sm_90+) a GEMV loads its first weights while the junction kernel before it runs,
    so the decode step keeps the junctions out of the GEMV prologues, eagerly as in the graph."""
    monkeypatch.setattr(ops_cuda, "programmatic_launches", lambda device: True)
    model, _ = _ouro_decode_step(launches)
    kernels = [name.split("<")[0] for _, name, *_ in launches]
    attention = ["gemv_quant", "paged_decode", "gemv_quant"]  # QKV with the RoPE epilogue, attention, O
    mlp = ["residual_norm", "gemv_quant", "gemv_quant"]  # the junction after attention, gate/up, down
    loop = ["rms_norm", *attention, *mlp]
    loop += ["residual_norm", *attention, *mlp] * (model.config.num_loop_layers - 1) + ["residual_norm", "rms_norm"]
    assert kernels[: len(loop)] == loop
    gemvs = [launch for launch in launches if launch[1].startswith("gemv_quant")]
    assert all(int(a) == 0 for launch in gemvs for a in junction_arguments(launch[3])[:5])  # no prologue anywhere
    assert gemvs[0][1].endswith(", true>") and ", true, " in gemvs[2][1]  # RoPE epilogue; SwiGLU in gate/up


def test_a_batched_decode_step_rotates_in_the_tensor_core_qkv_launch(launches):
    """Decode rows through the tensor-core kernel (2+ rows, 16 per launch) write rotated q and K/V pages from the
    QKV launch's epilogue: no rope_kv_append, and each launch's per-row pointers start at its first row."""
    model = _model("llama", 4)
    config = model.config
    batch, heads, kv_heads, dim = 20, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    cache = PagedTinyLoopCache(config, capacity=64)
    with torch.no_grad():
        model(torch.randint(1, 256, (batch, 8)), past_key_values=cache, use_cache=True)
        launches.clear()
        model(torch.randint(1, 256, (batch, 1)), past_key_values=cache, use_cache=True)
    names = [name for _, name, *_ in launches]
    assert not any(name.startswith("rope_kv_append") for name in names)
    qkv = [args for _, name, _, args, _ in launches if name.startswith("gemm_quant_mma") and name.endswith(", true>")]
    assert len(qkv) == 2 * config.num_hidden_layers  # rows 0-15 and 16-19 of each layer's QKV projection
    first, second = (rope_arguments(launch) for launch in qkv[:2])
    table_row, angles_row = cache.storage.blocks_per_row * 4, dim // 2 * 4  # bytes per row of int32 / fp32 tables
    advanced = [int(b) - int(a) for a, b in zip(first[:7], second[:7], strict=True)]
    # cos, sin, q, K pages, V pages, block table, positions: the second launch starts at row 16
    assert advanced == [16 * angles_row, 16 * angles_row, 16 * heads * dim * 2, 0, 0, 16 * table_row, 16 * 4]
    assert [int(v) for v in first[7:]] == [cache.storage.blocks_per_row, heads, kv_heads, dim, 0]


@pytest.mark.parametrize("batch", [1, 48])
def test_paged_decode_is_programmatic_only_in_single_cta_splits(launches, monkeypatch, batch):
    """Paged decode loads its first K/V before pdl_wait; graphs launch it programmatically where its splits are
    single CTAs (many rows), and plainly as clusters (few rows: slower programmatically on the H200)."""
    paged = launches_of(monkeypatch, "paged_decode")
    model = _model("llama", 4)
    cache = PagedTinyLoopCache(model.config, capacity=64)
    with torch.no_grad():
        model(torch.randint(1, 256, (batch, 8)), past_key_values=cache, use_cache=True)
        paged.clear()
        model(torch.randint(1, 256, (batch, 1)), past_key_values=cache, use_cache=True)
    assert len(paged) == model.config.num_hidden_layers
    expected_cluster = ops_cuda.DECODE_CLUSTER if batch == 1 else 1
    assert all(cluster == expected_cluster for _, cluster, *_ in paged)
    assert all(dependent == (cluster == 1) for dependent, cluster, *_ in paged)
    assert all(name.endswith(f", {expected_cluster}, {model.config.head_dim}, 128, 4>") for _, _, name, _ in paged)


def test_int8_kv_passes_scales(launches):
    model = _model("llama", 8)
    cache = PagedTinyLoopCache(model.config, kv_dtype="int8")
    with torch.no_grad():
        model(torch.randint(1, 256, (1, 5)), past_key_values=cache, use_cache=True)
        model(torch.randint(1, 256, (1, 1)), past_key_values=cache, use_cache=True)
    rope = next(args for _, name, _, args, _ in launches if name.startswith("rope_kv_append"))
    assert int(rope[6]) != 0 and int(rope[7]) != 0 and int(rope[-1]) == 1  # k/v scales, kv_int8 flag
    assert any(name.startswith("paged_decode<__nv_bfloat16, 1, ") for _, name, *_ in launches)


@pytest.mark.parametrize("batch", [1, 20])  # the CUDA-core GEMV's RoPE epilogue, the tensor-core kernel's
def test_an_int8_decode_step_stages_new_kv_for_paged_decode(launches, batch):
    """With an INT8 cache the QKV launch's RoPE epilogue writes the new K/V (model dtype) into the storage's staging
    pages through their block table, and paged decode gets the staging pages to quantize from: no rope_kv_append."""
    model = _model("llama", 4)
    cache = PagedTinyLoopCache(model.config, capacity=64, kv_dtype="int8")
    with torch.no_grad():
        model(torch.randint(1, 256, (batch, 8)), past_key_values=cache, use_cache=True)
        launches.clear()
        model(torch.randint(1, 256, (batch, 1)), past_key_values=cache, use_cache=True)
    staged_k, staged_v, staged_table = cache.storage.staging()
    assert staged_k.dtype == torch.bfloat16 and staged_k.shape == (batch, 2, 16, model.config.head_dim)
    assert torch.equal(staged_table, torch.arange(batch, dtype=torch.int32)[:, None].expand_as(staged_table))
    names = [name for _, name, *_ in launches]
    assert not any(name.startswith("rope_kv_append") for name in names)
    qkv = [rope_arguments(args) for _, name, _, args, _ in launches
           if name.startswith(("gemv_quant", "gemm_quant_mma")) and name.endswith(", true>")]  # fmt: skip
    assert qkv and all(int(rope[3]) == staged_k.data_ptr() and int(rope[4]) == staged_v.data_ptr() for rope in qkv)
    assert all(int(rope[5]) == staged_table.data_ptr() for rope in qkv[:1])  # the first launch starts at row 0
    paged = [args for _, name, _, args, _ in launches if name.startswith("paged_decode<__nv_bfloat16, 1, ")]
    assert len(paged) == model.config.num_hidden_layers
    assert all((int(args[5]), int(args[6])) == (staged_k.data_ptr(), staged_v.data_ptr()) for args in paged)


def test_a_16_bit_decode_step_stages_nothing(launches):
    model = _model("llama", 4)
    cache = PagedTinyLoopCache(model.config, capacity=64)
    with torch.no_grad():
        model(torch.randint(1, 256, (1, 8)), past_key_values=cache, use_cache=True)
        model(torch.randint(1, 256, (1, 1)), past_key_values=cache, use_cache=True)
    paged = [args for _, name, _, args, _ in launches if name.startswith("paged_decode")]
    assert paged and all(int(args[5]) == int(args[6]) == 0 for args in paged)
    with pytest.raises(ValueError, match="INT8 storage"):
        cache.storage.staging()


def test_gemv_launches_read_the_layers_current_tensors(launches):
    model = _model("huginn", 4)  # q/k biases
    attention = model.model.prelude_layers[0].self_attn  # the first QKV launch of a forward
    ids = torch.randint(1, 256, (1, 3))

    def qkv_args():
        launches.clear()
        with torch.no_grad():
            model(ids, past_key_values=PagedTinyLoopCache(model.config), use_cache=True)
        q_width = attention.q_proj.out_features
        projections = [args for _, name, _, args, _ in launches if name.startswith(("gemv", "gemm"))]
        return next(args for args in projections if int(args[8]) == q_width)

    args = qkv_args()
    q, k = attention.q_proj, attention.k_proj
    assert [int(args[i]) for i in (3, 5, 6, 7)] == [q.qweight.data_ptr(), q.scales.data_ptr(), q.zeros.data_ptr(),
                                                    q.bias.data_ptr()]  # fmt: skip
    assert int(args[9]) == k.qweight.data_ptr() and int(args[13]) == k.bias.data_ptr()
    k.bias.data = k.bias.data.clone()  # a tensor moves (as .to() would): the cached launch plan must follow
    assert int(qkv_args()[13]) == k.bias.data_ptr()


def test_prefill_swiglu_is_applied_by_the_tile_kernel_s_reduce_launch(launches):
    """Prompt rows past GEMV_MAX_ROWS go through the tile kernel; gate/up's partial sums always go to the reduce
    launch, which writes silu(gate) * up ([M, intermediate], not [M, 2 intermediate]) with no separate SwiGLU kernel."""
    model = _model("llama", 4)
    with torch.no_grad():
        model(torch.randint(1, 256, (1, 40)), past_key_values=PagedTinyLoopCache(model.config), use_cache=True)
    names = [name for _, name, *_ in launches]
    assert not any(name.startswith(("dequantize_weights", "swiglu")) for name in names), names
    swiglu = [args for _, name, _, args, _ in launches if name.startswith("gemm_tile_reduce") and "true>" in name]
    assert len(swiglu) == model.config.num_hidden_layers
    F = model.config.intermediate_size
    assert {(int(args[2]), int(args[3])) for args in swiglu} == {(40 * F, F)}  # count, width of y
    tiles = [args for _, name, _, args, _ in launches if name.startswith("gemm_quant_tile")]
    gate_up = [args for args in tiles if int(args[7]) == F and int(args[12]) == F and int(args[21]) == 2 * F]
    assert gate_up and all(int(args[20]) != 0 for args in gate_up)  # partial: written even with one split


def test_prefill_dequantizes_fused_projections_into_one_stack(launches, monkeypatch):
    monkeypatch.setattr(ops_cuda, "TILE_GEMM", False)  # the path for formats the tile kernel does not serve
    model = _model("llama", 4)
    attention = next(
        layer for layers in (model.model.prelude_layers, model.model.loop_layers) for layer in layers
    ).self_attn
    with torch.no_grad():
        model(torch.randint(1, 256, (1, 40)), past_key_values=PagedTinyLoopCache(model.config), use_cache=True)
    dequant = [(grid, args) for _, name, grid, args, _ in launches if name.startswith("dequantize_weights")]
    grid, args = dequant[0]  # q, k, v of the first layer: one launch, one matrix per grid row, one output buffer
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    assert grid[1] == 3
    assert [int(args[5 * i]) for i in range(3)] == [p.qweight.data_ptr() for p in projections]
    assert [int(args[5 * i + 4]) for i in range(3)] == [p.out_features for p in projections]
    o_grid, o_args = dequant[1]  # o_proj alone
    assert o_grid[1] == 1 and int(o_args[4]) == attention.o_proj.out_features and int(o_args[9]) == 0


def test_launch_attribute_structs_match_cuda_h():
    """CUlaunchAttribute / CUlaunchConfig as cuda.h lays them out (64-bit)."""
    assert ctypes.sizeof(loader._LaunchAttribute) == 72 and loader._LaunchAttribute.value.offset == 8
    config = loader._LaunchConfig
    assert (config.stream.offset, config.attrs.offset, config.num_attrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(config) == 56


def test_attribute_launch_passes_the_arguments_and_attributes(monkeypatch):
    seen = {}

    def fake_launch(config_ref, function, params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(loader._LaunchConfig)).contents
        attributes = [config.attrs[i] for i in range(config.num_attrs)]
        seen.update(grid=(config.grid_x, config.grid_y, config.grid_z), block=(config.block_x, config.block_y),
                    shared=config.shared_mem, stream=config.stream, function=function,
                    attributes=[(a.id, a.value, a.value_y, a.value_z) for a in attributes])  # fmt: skip
        seen["args"] = (
            ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64)).contents.value,
            ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int32)).contents.value,
            ctypes.cast(params[2], ctypes.POINTER(ctypes.c_float)).contents.value,
        )
        return 0

    monkeypatch.setattr(loader, "_cu_launch_kernel_ex", lambda: fake_launch)
    compiled = type("Function", (), {"ptr": 0xABC})()  # cupy.cuda.function.Function: .ptr is the CUfunction
    function = type("RawKernel", (), {"kernel": compiled})()
    args = (np.uint64(2**40 + 5), np.int32(-3), np.float32(0.5))
    attributes = [loader._LaunchAttribute(id=loader._PROGRAMMATIC_STREAM_SERIALIZATION, value=1),
                  loader._LaunchAttribute(id=loader._CLUSTER_DIMENSION, value=1, value_y=1, value_z=8)]  # fmt: skip
    loader._launch_ex(function, (7, 2, 16), (128,), args, 4096, 0x1234, attributes)
    assert seen == {"grid": (7, 2, 16), "block": (128, 1), "shared": 4096, "stream": 0x1234, "function": 0xABC,
                    "attributes": [(6, 1, 0, 0), (4, 1, 1, 8)], "args": (2**40 + 5, -3, 0.5)}  # fmt: skip
    monkeypatch.setattr(loader, "_cu_launch_kernel_ex", lambda: lambda *a: 1)
    with pytest.raises(RuntimeError, match=r"attributes \[4\]\) failed with CUresult 1"):
        loader._launch_ex(function, (1,), (32,), args, 0, 0, attributes[1:])


@pytest.mark.parametrize("batch", [1, 16])
def test_residual_junctions_are_programmatic_only_in_multi_row_steps(launches, monkeypatch, batch):
    """With programmatic launches (sm_90+) the junctions are their own kernels; a step of several rows launches
    them programmatically (the kernel variant that loads its norm weights before pdl_wait), one row plainly (slower
    programmatically on the H200)."""
    monkeypatch.setattr(ops_cuda, "programmatic_launches", lambda device: True)
    junctions = launches_of(monkeypatch, "residual_norm")
    model = _model("ouro", 4)
    cache = PagedTinyLoopCache(model.config, capacity=64)
    with torch.no_grad():
        model(torch.randint(1, 256, (batch, 8)), past_key_values=cache, use_cache=True)
        prompt = list(junctions)
        junctions.clear()
        model(torch.randint(1, 256, (batch, 1)), past_key_values=cache, use_cache=True)
    # the prompt's forward (more rows than any decode batch of the bench) keeps the plain launch
    prompt_rows = 8 * batch
    assert all(dependent == (prompt_rows <= ops_cuda.JUNCTION_PROGRAMMATIC_MAX_ROWS) for dependent, *_ in prompt)
    assert junctions, "a decode step runs its residual junctions as kernels"
    assert all(grid == (batch,) for *_, grid in junctions)
    programmatic = ops_cuda.JUNCTION_PROGRAMMATIC_ROWS <= batch <= ops_cuda.JUNCTION_PROGRAMMATIC_MAX_ROWS
    assert all(dependent == programmatic for dependent, *_ in junctions)
    assert all(name.endswith(f", {'true' if programmatic else 'false'}>") for _, _, name, _ in junctions)


def test_a_cooperative_launch_carries_the_attribute(monkeypatch):
    """loader.launch(cooperative=True) goes through cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_COOPERATIVE (2) set to
    1 (the fused decode kernel's launch); a plain launch of the same function carries no attribute."""
    from tinyloop_hf.kernels import loader

    seen: list = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7})())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(loader, "_launch_ex", lambda fn, grid, block, args, smem, stream, attributes: seen.append(
        [(a.id, a.value) for a in attributes]))
    plain: list = []
    loader.launch(lambda *a, **k: plain.append(a), (128,), (384,), (), shared_mem=1024, cooperative=True)
    assert seen == [[(2, 1)]] and plain == []
    loader.launch(lambda *a, **k: plain.append(a), (128,), (384,), (), shared_mem=1024)
    assert len(seen) == 1 and len(plain) == 1


@pytest.mark.parametrize(
    ("rows", "kernel"),
    [(32, "gemm_quant_mma"), (33, "gemm_quant_tile"), (128, "gemm_quant_tile"), (129, "dequantize_weights"),
     (2048, "dequantize_weights")],
)  # fmt: skip
def test_projections_take_the_tile_kernel_only_where_it_is_the_faster_one(rows, kernel, launches):
    """Rows past GEMV_MAX_ROWS go through the tile kernel up to TILE_MAX_ROWS; longer prompts (batch 16 x 128 tokens:
    2.6x slower through it on an H100) through dequantize + cuBLAS."""
    fmt = QuantFormat(bits=4, group_size=32)
    layer = QuantLinear(64, 96, False, fmt)
    layer.load_packed(quantize_rtn(torch.randn(96, 64), fmt))
    layer = layer.to(torch.bfloat16)
    ops_cuda.project(torch.randn(rows, 64, dtype=torch.bfloat16), [layer])
    used = {name.split("<")[0] for _, name, *_ in launches}
    assert kernel in used and not used & ({"gemm_quant_mma", "gemm_quant_tile", "dequantize_weights"} - {kernel})
