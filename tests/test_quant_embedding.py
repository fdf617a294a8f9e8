"""QuantEmbedding: exact row lookups, dtype rules, quantize_model / save-load / generate with a packed embedding,
the ``embed_tokens`` component's config and CLI flag, and the errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import tiny_model
from tinyloop_hf import QuantEmbedding, QuantFormat, QuantLinear, TinyLoopForCausalLM, TinyLoopQuantConfig
from tinyloop_hf.convert.__main__ import parse_args, quantization_config
from tinyloop_hf.convert.quantize import quantize_model
from tinyloop_hf.eval.bench import weight_bytes
from tinyloop_hf.quant_tinyloop import dequantize, quantize_rtn

FORMATS = [
    QuantFormat(bits, group, symmetric)
    for bits in (2, 3, 4, 8)
    for group in (32, 128, None)
    for symmetric in (False, True)
]
VOCAB, DIM = 50, 160  # 160 = 128 + 32: a short last group at g128
IDS = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
PROMPT = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(5))


def _ids(fmt: QuantFormat) -> str:
    return f"int{fmt.bits}-g{fmt.group_size}-{'sym' if fmt.symmetric else 'asym'}"


def _embedding(fmt: QuantFormat) -> QuantEmbedding:
    embedding = QuantEmbedding(VOCAB, DIM, fmt)
    embedding.load_packed(quantize_rtn(torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(1)), fmt))
    return embedding


def _embed_only(bits: int, **settings) -> TinyLoopQuantConfig:
    return TinyLoopQuantConfig(bits=16, components={"embed_tokens": {"bits": bits, **settings}})


# ----------------------------------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_lookup_is_exactly_the_dequantized_table_rows(fmt, dtype):
    embedding = _embedding(fmt).to(dtype)
    table = dequantize(embedding.packed(), fmt)
    for ids in (IDS, IDS[0], torch.tensor([[VOCAB - 1, 0, 0]])):
        out = embedding(ids)
        assert out.dtype == dtype and out.shape == (*ids.shape, DIM)
        assert torch.equal(out, table[ids].to(dtype))


def test_compute_dtype_follows_the_model_and_the_stored_scales_keep_theirs():
    embedding = _embedding(QuantFormat(4, 32))
    scales = embedding.scales.clone()
    assert embedding.compute_dtype == torch.float32  # the default
    assert embedding.half().compute_dtype == torch.float16
    assert embedding.bfloat16().compute_dtype == torch.bfloat16
    assert embedding.to("cpu").compute_dtype == torch.bfloat16  # a device move keeps it
    assert embedding.to(torch.float32).compute_dtype == torch.float32
    assert embedding.scales.dtype == torch.float16 and torch.equal(embedding.scales, scales)
    assert embedding(IDS).dtype == torch.float32
    assert embedding.padding_idx is None and "compute_dtype=torch.float32" in repr(embedding)


class _DeviceLog(TorchDispatchMode):
    """Every op's name and the devices of the tensors it reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), {t.device.type for t in tensors}))
        return out


@pytest.mark.parametrize("fmt", [QuantFormat(3, 32), QuantFormat(4, 128, True), QuantFormat(8, None)], ids=_ids)
def test_lookup_stays_on_the_ids_device_and_never_reads_back(fmt):
    """What a CUDA graph capture needs: no host tensor copied in, no value read to the host (on the meta device
    any data-dependent op would fail, and every tensor an op touches is logged)."""
    embedding, ids = _embedding(fmt).to("meta"), IDS.to("meta")
    log = _DeviceLog()
    with log:
        out = embedding(ids)
    assert out.shape == (*IDS.shape, DIM) and out.device.type == "meta"
    assert log.ops and all(devices == {"meta"} for _, devices in log.ops), log.ops
    assert not any("_local_scalar_dense" in name or "nonzero" in name for name, _ in log.ops)


# ----------------------------------------------------------------------------------------------------------------------
# quantize_model
# ----------------------------------------------------------------------------------------------------------------------


def test_int8_embedding_is_close_to_the_unquantized_model_and_smaller():
    reference = tiny_model("ouro", intermediate_size=64)
    model = quantize_model(copy.deepcopy(reference), _embed_only(8, group_size=None), progress=False)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert not any(isinstance(module, QuantLinear) for module in model.modules())  # only the embedding was asked for
    with torch.no_grad():
        expected, int8 = reference(PROMPT).logits, model(PROMPT).logits
        int4 = quantize_model(copy.deepcopy(reference), _embed_only(4, group_size=32), progress=False)(PROMPT).logits
    error8, error4 = (int8 - expected).abs().max(), (int4 - expected).abs().max()
    assert error8 <= 0.02 * expected.abs().max(), error8  # measured 0.015 (random weights amplify over 3 loops)
    assert (int8 - expected).pow(2).mean().sqrt() <= 0.01 * expected.std()  # measured 0.007
    assert error8 < error4 / 5  # the tolerances above are tight enough to tell INT8 from INT4 (measured 8.8x)
    table, step = model.model.embed_tokens.dequantized_weight(), model.model.embed_tokens.scales.float()
    # Within one step of each row's grid (nearest code, with the integer zero point shifting the grid by <= 1/2).
    assert ((table - reference.model.embed_tokens.weight).abs() <= step).all()
    vocab, dim = reference.model.embed_tokens.weight.shape
    packed = vocab * dim + vocab * (2 + 1)  # INT8 codes, one fp16 scale and one uint8 zero per row
    assert weight_bytes(reference, False) - weight_bytes(model, False) == vocab * dim * 4 - packed
    assert weight_bytes(model, True) == weight_bytes(reference, True)  # linear_only counts only linears


def test_gptq_rounds_the_embedding_to_nearest():
    reference = tiny_model("huginn", intermediate_size=64)
    config = TinyLoopQuantConfig(bits=4, group_size=32, method="gptq", components={"embed_tokens": {"bits": 4}})
    calibration = torch.randint(1, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    model = quantize_model(copy.deepcopy(reference), config, calibration, progress=False)
    fmt = QuantFormat(4, 32)
    expected = quantize_rtn(reference.model.embed_tokens.weight, fmt)
    for name, tensor in expected.tensors().items():
        assert torch.equal(getattr(model.model.embed_tokens, name), tensor), name
    assert isinstance(model.model.loop_layers[0].mlp.up_proj, QuantLinear)


def test_an_embedding_that_cannot_be_packed_is_named_before_any_work():
    model = tiny_model("ouro", hidden_size=40, intermediate_size=64)
    with pytest.raises(ValueError, match=r"model.embed_tokens: embedding_dim=40 must be a multiple of 32"):
        quantize_model(model, _embed_only(8), progress=False)
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding) and not isinstance(model.lm_head, QuantLinear)


def test_a_tied_head_keeps_a_full_precision_copy():
    reference = tiny_model("huginn", intermediate_size=64)
    assert reference.config.tie_word_embeddings
    model = quantize_model(copy.deepcopy(reference), _embed_only(8, group_size=None), progress=False)
    assert model.config.tie_word_embeddings is False and model.all_tied_weights_keys == {}
    assert not isinstance(model.lm_head, QuantLinear)
    model.tie_weights()  # nothing left to tie
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)


def test_resizing_a_packed_embedding_fails_clearly():
    model = quantize_model(tiny_model("ouro", intermediate_size=64), _embed_only(8), progress=False)
    with pytest.raises(ValueError, match=r"QuantEmbedding holds packed low-bit rows.*resize the unquantized model"):
        model.resize_token_embeddings(300)


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints and generate()
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, components",
    [
        ("ouro", {"embed_tokens": {"bits": 4}, "lm_head": {"bits": 8, "group_size": None}}),
        ("huginn", {"embed_tokens": {"bits": 8, "group_size": None}, "lm_head": {"bits": 8, "group_size": None}}),
        ("huginn", {"embed_tokens": {"bits": 3, "symmetric": True}}),  # tied; the head stays high precision
    ],
    ids=["untied", "tied-both-quantized", "tied-head-fp"],
)
def test_quantized_embedding_round_trips_through_save_pretrained(variant, components, tmp_path):
    tied = tiny_model(variant).config.tie_word_embeddings
    config = TinyLoopQuantConfig(bits=4, group_size=32, components=components)
    model = quantize_model(tiny_model(variant, intermediate_size=64), config, progress=False)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["quantization_config"]["components"]["embed_tokens"] == components["embed_tokens"]
    assert saved["tie_word_embeddings"] is False
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["model.embed_tokens.qweight"].dtype == torch.int32 and "model.embed_tokens.weight" not in tensors
    assert ("lm_head.weight" in tensors) == ("lm_head" not in components)
    reloaded = TinyLoopForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert isinstance(reloaded.model.embed_tokens, QuantEmbedding)
    assert reloaded.model.embed_tokens.scales.dtype == torch.float16
    with torch.no_grad():
        assert torch.equal(reloaded(PROMPT).logits, model(PROMPT).logits)
        # Loading in bf16 gives the embedding bf16 output, exactly as converting the model in memory does.
        in_bf16 = TinyLoopForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        assert in_bf16.model.embed_tokens.compute_dtype == torch.bfloat16
        assert torch.equal(in_bf16(PROMPT).logits, copy.deepcopy(model).to(torch.bfloat16)(PROMPT).logits)
    if tied:
        config = json.loads((tmp_path / "config.json").read_text())
        config["tie_word_embeddings"] = True
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=r"quantizing embed_tokens( and lm_head)? needs tie_word_embeddings=False"):
            TinyLoopForCausalLM.from_pretrained(tmp_path)


def test_generate_with_a_packed_embedding_equals_the_dequantized_table():
    original = tiny_model("ouro", intermediate_size=64)
    model = quantize_model(copy.deepcopy(original), _embed_only(4, group_size=32), progress=False)
    reference = copy.deepcopy(original)
    with torch.no_grad():
        reference.model.embed_tokens.weight.copy_(model.model.embed_tokens.dequantized_weight())
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    tokens = model.generate(PROMPT, **kwargs)
    assert torch.equal(tokens, reference.generate(PROMPT, **kwargs))
    assert not torch.equal(model.model.embed_tokens(PROMPT), original.model.embed_tokens(PROMPT))  # really packed


# ----------------------------------------------------------------------------------------------------------------------
# Config and CLI
# ----------------------------------------------------------------------------------------------------------------------


def test_the_embedding_is_high_precision_unless_asked():
    config = TinyLoopQuantConfig(bits=4, group_size=32)
    assert config.format_for("model.embed_tokens") is None
    assert config.describe().endswith("lm_head=16, embed_tokens=16")
    config = TinyLoopQuantConfig(bits=4, components={"embed_tokens": {"bits": 8, "group_size": None}})
    assert config.format_for("model.embed_tokens") == QuantFormat(8, None)
    assert config.describe().endswith("embed_tokens=8/channel/asym")
    assert TinyLoopQuantConfig(bits=16, components={"embed_tokens": {"bits": 4}}).quantizes_anything()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"bits": 5}, r"quantization_config.components.embed_tokens.bits must be one of \[2, 3, 4, 8, 16\], got 5"),
        (
            {"bits": 4, "group_size": 48},
            r"quantization_config.components.embed_tokens: .*group_size must be one of \[32, 64, 128, None\]",
        ),
        ({"bits": 4, "rows": 2}, r"quantization_config.components.embed_tokens: unknown fields \['rows'\]"),
    ],
)
def test_a_bad_embedding_setting_names_the_component_and_the_allowed_values(settings, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        TinyLoopQuantConfig(components={"embed_tokens": settings})
    model = quantize_model(tiny_model("ouro", intermediate_size=64), _embed_only(8), progress=False)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["components"]["embed_tokens"] = settings
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        TinyLoopForCausalLM.from_pretrained(tmp_path)


def test_a_bad_top_level_group_size_is_not_blamed_on_a_component():
    with pytest.raises(ValueError, match=r"^quantization group_size must be one of"):
        TinyLoopQuantConfig(bits=4, group_size=48)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--embed-tokens-bits", "8"], {"bits": 8, "group_size": None}),  # INT8: one scale per vocabulary row
        (["--embed-tokens-bits", "4"], {"bits": 4}),  # the top-level group size
    ],
)
def test_the_converter_flag_selects_the_embedding(flags, expected):
    config = quantization_config(parse_args(["src", "dst", *flags]))
    assert config is not None and config.components == {"embed_tokens": expected}
    assert config.format_for("model.loop_layers.0.mlp.up_proj") is None  # --bits stays 16
