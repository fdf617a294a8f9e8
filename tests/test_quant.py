"""Low-bit formats: packing layout, exact dequantization, QuantLinear, RTN/GPTQ, checkpoints and their errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import tiny_model
from tinyloop_hf import QuantFormat, QuantLinear, TinyLoopForCausalLM, TinyLoopQuantConfig
from tinyloop_hf.convert.gptq import HessianAccumulator, gptq_quantize
from tinyloop_hf.convert.quantize import quantize_model
from tinyloop_hf.quant_tinyloop import (
    dequantize,
    pack_codes,
    quantize_rtn,
    unpack,
    unpack_codes,
)

FORMATS = [
    QuantFormat(bits, group, symmetric)
    for bits in (2, 3, 4, 8)
    for group in (32, 128, None)
    for symmetric in (False, True)
]


def _ids(fmt: QuantFormat) -> str:
    return f"int{fmt.bits}-g{fmt.group_size}-{'sym' if fmt.symmetric else 'asym'}"


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (5, 256), generator=torch.Generator().manual_seed(bits))
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (5, 256 * bits // 32)
    assert torch.equal(unpack_codes(words, bits), codes)


def test_int4_word_layout_is_even_columns_low_odd_columns_high():
    codes = torch.arange(8)[None] + 1  # columns k0..k7 hold 1..8
    word = pack_codes(codes, 4)[0, 0].item() & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [1, 3, 5, 7, 2, 4, 6, 8]  # [k0 k2 k4 k6 | k1 k3 k5 k7]
    # the FasterTransformer trick: (w & 0x000F000F) yields the adjacent pair (k0, k1) in the two 16-bit halves
    assert ((word & 0x000F000F) & 0xFFFF, (word & 0x000F000F) >> 16) == (1, 2)


def test_int8_and_int2_layouts_pair_adjacent_columns():
    word8 = pack_codes(torch.tensor([[10, 11, 12, 13]]), 8)[0, 0].item() & 0xFFFFFFFF
    assert [(word8 >> (8 * i)) & 0xFF for i in range(4)] == [10, 12, 11, 13]
    word2 = pack_codes(torch.tensor([[0, 1, 2, 3] * 4]), 2)[0, 0].item() & 0xFFFFFFFF
    assert ((word2 & 0x00030003) & 0xFFFF, (word2 & 0x00030003) >> 16) == (0, 1)


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_rtn_codes_scales_and_error_bound(fmt):
    weight = torch.randn(24, 256, generator=torch.Generator().manual_seed(fmt.bits))
    packed = quantize_rtn(weight, fmt)
    for name, (shape, dtype) in fmt.tensor_shapes(24, 256).items():
        tensor = getattr(packed, name)
        assert tuple(tensor.shape) == shape and tensor.dtype == dtype, name
    codes = unpack(packed, fmt)
    assert codes.min() >= 0 and codes.max() <= fmt.max_code
    width = fmt.group_width(256)
    error = (dequantize(packed, fmt) - weight).abs().reshape(24, -1, width)
    scale = packed.scales.float()[..., None]
    # Inside the grid the error is at most half a step (plus fp16 scale rounding); clipped values may exceed it.
    inside = error <= scale * 0.5 + 1e-6
    assert inside.float().mean() > (0.97 if fmt.symmetric else 0.999)


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_quant_linear_is_exactly_dequantize_then_matmul(fmt):
    weight = torch.randn(40, 128 if fmt.group_size != 32 else 96, generator=torch.Generator().manual_seed(3))
    layer = QuantLinear(weight.shape[1], 40, True, fmt)
    layer.load_packed(quantize_rtn(weight, fmt))
    layer.bias.data.normal_()
    x = torch.randn(3, 7, weight.shape[1])
    expected = torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias)
    assert torch.equal(layer(x), expected)
    x16 = x.to(torch.bfloat16)
    expected16 = torch.nn.functional.linear(
        x16, layer.dequantized_weight().to(torch.bfloat16), layer.bias.to(torch.bfloat16)
    )
    assert torch.equal(layer.to(torch.bfloat16)(x16), expected16)


@pytest.mark.parametrize("columns, group", [(576, 128), (192, 128), (96, 64)])
def test_a_short_last_group(columns, group):
    """SmolLM2's hidden size 576 is 4.5 groups of 128: the last group has 64 columns."""
    fmt = QuantFormat(4, group)
    weight = torch.randn(16, columns, generator=torch.Generator().manual_seed(columns))
    packed = quantize_rtn(weight, fmt)
    assert packed.scales.shape == (16, -(-columns // group)) == fmt.tensor_shapes(16, columns)["scales"][0]
    last = slice((columns // group) * group, columns)
    tail = weight[:, last]
    expected = dequantize(quantize_rtn(tail, fmt), fmt)  # the short group quantized on its own
    assert torch.equal(dequantize(packed, fmt)[:, last], expected)
    hessian = torch.eye(columns) * 2
    gptq = dequantize(gptq_quantize(weight, hessian, fmt), fmt)
    assert (gptq - weight).abs().max() <= packed.scales.float().max() * 0.51  # identity Hessian: plain rounding
    layer = QuantLinear(columns, 16, False, fmt)
    layer.load_packed(packed)
    x = torch.randn(2, columns)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dequantize(packed, fmt)))


def test_moving_to_another_dtype_keeps_the_stored_scales():
    layer = QuantLinear(64, 8, False, QuantFormat(4, 32))
    layer.load_packed(quantize_rtn(torch.randn(8, 64), QuantFormat(4, 32)))
    before = layer.scales.clone()
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and torch.equal(layer.scales, before)


def test_gptq_beats_rtn_on_correlated_inputs():
    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(128, 128, generator=generator)
    inputs = torch.randn(2048, 128, generator=generator) @ mixing  # strongly correlated features
    weight = torch.randn(64, 128, generator=generator)
    accumulator = HessianAccumulator(128, torch.device("cpu"))
    for chunk in inputs.split(256):
        accumulator.add(chunk)
    assert torch.allclose(accumulator.hessian, 2 * inputs.T @ inputs / len(inputs), rtol=1e-3, atol=1e-2)
    for bits, group in ((4, 32), (3, 64), (2, 32)):
        fmt = QuantFormat(bits, group)
        reference = inputs @ weight.T
        rtn = (inputs @ dequantize(quantize_rtn(weight, fmt), fmt).T - reference).pow(2).mean()
        gptq = (inputs @ dequantize(gptq_quantize(weight, accumulator.hessian, fmt), fmt).T - reference).pow(2).mean()
        assert gptq < 0.8 * rtn, (bits, group, gptq.item(), rtn.item())


def _model():
    return tiny_model("huginn", intermediate_size=64)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantized_model_round_trips_through_save_pretrained(method, tmp_path):
    calibration = torch.randint(1, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    config = TinyLoopQuantConfig(
        bits=4,
        group_size=32,
        method=method,
        components={"prelude": {"bits": 8, "group_size": None}, "lm_head": {"bits": 8, "group_size": None}},
    )
    model = quantize_model(_model(), config, calibration, progress=False)
    assert model.model.prelude_layers[0].mlp.up_proj.format.bits == 8
    assert model.model.loop_layers[0].mlp.up_proj.format.bits == 4
    assert model.model.injection.format.bits == 4 and isinstance(model.lm_head, QuantLinear)
    assert not isinstance(
        model.model.exit_gate if hasattr(model.model, "exit_gate") else torch.nn.Linear(1, 1), QuantLinear
    )
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["quantization_config"]["quant_method"] == "tinyloop" and saved["tie_word_embeddings"] is False
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["model.loop_layers.0.mlp.up_proj.qweight"].dtype == torch.int32
    assert "model.loop_layers.0.mlp.up_proj.weight" not in tensors
    reloaded = TinyLoopForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(1, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert reloaded.model.loop_layers[0].self_attn.q_proj.scales.dtype == torch.float16


def test_norms_embeddings_and_exit_gate_stay_high_precision():
    model = quantize_model(
        tiny_model("ouro", intermediate_size=64), TinyLoopQuantConfig(bits=2, group_size=32), progress=False
    )
    assert isinstance(model.model.exit_gate, torch.nn.Linear) and not isinstance(model.model.exit_gate, QuantLinear)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert not isinstance(model.lm_head, QuantLinear)  # the head is 16-bit unless asked


def test_packed_tensor_of_the_wrong_shape_fails_clearly(tmp_path):
    model = quantize_model(_model(), TinyLoopQuantConfig(bits=4, group_size=32), progress=False)
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.loop_layers.0.mlp.up_proj.qweight"] = torch.zeros(64, 3, dtype=torch.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.loop_layers.0.mlp.up_proj.qweight.*\[64, 3\].*\[64, 4\]"):
        TinyLoopForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("bits", 5, r"quantization_config.bits must be one of \[2, 3, 4, 8, 16\], got 5"),
        ("group_size", 48, r"group_size must be one of \[32, 64, 128, None\]"),
        ("scale_dtype", "float32", r"scale_dtype must be one of \['bfloat16', 'float16'\]"),
        ("bits", 4.0, r"quantization_config.bits must be one of \[2, 3, 4, 8, 16\], got 4.0"),
        ("bits", True, r"quantization_config.bits must be one of \[2, 3, 4, 8, 16\], got True"),
        ("group_size", 32.0, r"group_size must be one of \[32, 64, 128, None\] \(None = .*\), got 32.0"),
        ("symmetric", "false", "symmetric must be true or false, got 'false'"),
        ("components", {"loop": None}, "components.loop must be a dict of format fields"),
        ("components", {"loop": {"bits": 4.0}}, r"components.loop.bits must be one of \[2, 3, 4, 8, 16\], got 4.0"),
    ],
)
def test_unsupported_format_in_a_checkpoint_fails_clearly(field, value, message, tmp_path):
    model = quantize_model(_model(), TinyLoopQuantConfig(bits=4, group_size=32), progress=False)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"][field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        TinyLoopForCausalLM.from_pretrained(tmp_path)


def test_layer_shapes_that_cannot_be_grouped_are_named():
    with pytest.raises(ValueError, match=r"model.loop_layers.0.mlp.down_proj: in_features=48 must be a multiple of 32"):
        quantize_model(tiny_model("ouro"), TinyLoopQuantConfig(bits=4, group_size=32), progress=False)


def test_gptq_needs_calibration():
    with pytest.raises(ValueError, match="GPTQ needs calibration"):
        quantize_model(_model(), TinyLoopQuantConfig(bits=4, group_size=32, method="gptq"), progress=False)


def test_quantized_checkpoint_loads_in_a_fresh_process_through_auto_map(tmp_path):
    import os
    import subprocess
    import sys

    model = quantize_model(_model(), TinyLoopQuantConfig(bits=3, group_size=32), progress=False)
    model.save_pretrained(tmp_path / "q3")
    ids = [[5, 9, 200, 17]]
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'q3')!r}, trust_remote_code=True)\n"
        "print(type(model.model.loop_layers[0].mlp.up_proj).__name__)\n"
        f"print(json.dumps(model(torch.tensor({ids})).logits.tolist()))\n"
    )
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-2] == "QuantLinear"
    assert torch.equal(torch.tensor(json.loads(lines[-1])), expected)


def test_rtn_packed_tensors_keep_no_autograd_graph():
    model = quantize_model(_model(), TinyLoopQuantConfig(bits=4, group_size=32), progress=False)
    assert all(buffer.grad_fn is None and not buffer.requires_grad for buffer in model.buffers())
    copied = copy.deepcopy(model)  # a graph in a buffer made deepcopy fail
    ids = torch.randint(1, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, model(ids).logits)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_round_to_nearest_is_off_by_at_most_half_a_step(bits, symmetric, scale_dtype):
    """The stored scale is rounded up, so the grid spans every group's range: no weight is clipped (a bf16 scale
    rounded to nearest often came out smaller, clipping INT8 extremes by up to 1.4 steps)."""
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    fmt = QuantFormat(bits, 32, symmetric, scale_dtype)
    packed = quantize_rtn(weight, fmt)
    steps = (dequantize(packed, fmt) - weight).abs() / packed.scales.float().repeat_interleave(32, 1)
    assert steps.max() <= 0.5 + 1e-4
