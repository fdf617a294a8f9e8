"""The op layer: reference ops against independent formulas, and the backend seam later paths plug into."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from helpers import tiny_model
from tinyloop_hf import get_op, register_op
from tinyloop_hf.ops_tinyloop import REFERENCE, backends_of, rope_angles, rope_inv_freq

IDS = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(2))


def test_rotate_half_rope_matches_transformers():
    query, key = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16)
    positions = torch.arange(3, 12)[None].expand(2, -1)
    cos, sin = rope_angles(positions, 16, 10000.0)
    rope = get_op("rope", REFERENCE)
    expected_q, expected_k = apply_rotary_pos_emb(query, key, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    assert torch.allclose(rope(query, cos, sin, "rotate_half"), expected_q, atol=1e-6)
    assert torch.allclose(rope(key, cos, sin, "rotate_half"), expected_k, atol=1e-6)


def test_rope_frequencies_are_made_once_and_the_angles_are_unchanged():
    """The inverse frequencies are kept per (device, head_dim, theta), so a CUDA-graph step does not remake them;
    the angles are bit for bit those of the formula."""
    first = rope_inv_freq(16, 12345.0, torch.device("cpu"))
    assert rope_inv_freq(16, 12345.0, torch.device("cpu")) is first
    assert rope_inv_freq(32, 12345.0, torch.device("cpu")) is not first
    positions = torch.arange(7, 40)[None]
    cos, sin = rope_angles(positions, 16, 12345.0)
    angles = positions.float()[..., None] * (1.0 / (12345.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)))
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())


def test_interleaved_rope_is_complex_multiplication():
    x = torch.randn(1, 2, 5, 8)
    cos, sin = rope_angles(torch.arange(5)[None], 8, 50000.0)
    rotated = get_op("rope", REFERENCE)(x, cos, sin, "interleaved")
    expected = torch.view_as_real(
        torch.view_as_complex(x.unflatten(-1, (-1, 2)))
        * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None]
    ).flatten(-2)
    assert torch.allclose(rotated, expected, atol=1e-6)


def test_rms_norm_and_swiglu():
    x, weight = torch.randn(3, 8), torch.rand(8)
    expected = weight * x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(get_op("rms_norm", REFERENCE)(x, weight, 1e-6), expected, atol=1e-6)
    gate, up = torch.randn(4), torch.randn(4)
    assert torch.allclose(get_op("swiglu", REFERENCE)(gate, up), gate * torch.sigmoid(gate) * up)


def test_eager_and_sdpa_attention_agree_with_grouped_heads_and_masks():
    query, key, value = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True
    attention = get_op("attention", REFERENCE)
    sdpa = attention(query, key, value, mask, False, 8**-0.5, "sdpa")
    eager = attention(query, key, value, mask, False, 8**-0.5, "eager")
    assert torch.allclose(sdpa, eager, atol=1e-5)


def test_attn_implementation_eager_gives_the_same_model_output(tmp_path):
    from tinyloop_hf import TinyLoopForCausalLM

    model = tiny_model("huginn")
    model.save_pretrained(tmp_path)
    eager = TinyLoopForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    with torch.no_grad():
        assert torch.allclose(eager(IDS).logits, model(IDS).logits, atol=1e-5)


MODULE_OPS = ("linear", "rms_norm", "self_attention", "mlp", "residual_norm", "junction_attention", "junction_mlp",
              "rope_angles")  # fmt: skip


def test_a_registered_backend_replaces_every_op_without_model_changes():
    """Modules call these ops with their own backend; the reference composites (self_attention, mlp,
    residual_norm, junction_attention, junction_mlp) are built from the small reference ops (rope, attention,
    swiglu, rms_norm) and the modules."""
    calls: dict[str, int] = {}
    for name in MODULE_OPS:
        reference = get_op(name, REFERENCE)

        def counted(*args, _name=name, _reference=reference, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _reference(*args, **kwargs)

        register_op(name, "counting")(counted)
    model = tiny_model("huginn")
    with torch.no_grad():
        expected = model(IDS).logits
        model.set_op_backend("counting")
        assert torch.equal(model(IDS).logits, expected)
    assert set(calls) == set(MODULE_OPS)
    layers = 1 + 3 * 2 + 1  # prelude + loops x loop block + coda
    chains = 1 + 3 + 1  # prelude, each loop's pass over the loop block, coda: runs of blocks in sequence
    # Every block: attention (through junction_attention after a deferred junction) and junction_mlp; the last
    # junction of a chain's final block is its own residual_norm, the others are deferred to the next block.
    assert calls["self_attention"] == calls["mlp"] == calls["junction_mlp"] == layers
    assert calls["junction_attention"] == layers - chains and calls["residual_norm"] == chains
    assert calls["rope_angles"] == 1  # once per forward, shared by every layer
    assert "counting" in backends_of("linear")


def test_a_missing_backend_fails_naming_op_and_backend():
    model = tiny_model("ouro")
    model.set_op_backend("cuda-not-built")
    with pytest.raises(NotImplementedError, match="op '.*' has no implementation for backend 'cuda-not-built'"):
        model(IDS)
