"""What of a model the fused decode kernel serves (kernels/fused_decode.py ``model_refusal``), checked without a GPU:
a model it does not serve gets a reason naming what is missing, and its batch-1 steps then run op by op."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from tinyloop_hf import TinyLoopQuantConfig
from tinyloop_hf.convert.quantize import quantize_model
from tinyloop_hf.kernels import fused_decode as fd

SERVED = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4)


def _refusal(variant="ouro", bits=4, dtype=torch.bfloat16, **overrides):
    model = tiny_model(variant, **{**SERVED, **overrides})
    quantize_model(model, TinyLoopQuantConfig(bits=bits, group_size=32), progress=False)
    return fd.model_refusal(model.to(dtype).model, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_int4_ouro_loop_block_is_served(dtype):
    assert _refusal(dtype=dtype) is None


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(bits=8), "INT4 loop-block projections"),
        (dict(variant="huginn", attention_bias="none"), "without prelude, coda or input injection"),
        (dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16), "outside what one CTA"),
        (dict(num_attention_heads=16), "head_dim 32"),
        (dict(attention_bias="qkv"), "without bias"),
    ],
)  # fmt: skip
def test_what_the_kernel_does_not_serve_is_named(overrides, reason):
    got = _refusal(**overrides)
    assert got is not None and reason in got, got


def test_unquantized_projections_are_refused():
    model = tiny_model("ouro", **SERVED).to(torch.bfloat16)
    assert "INT4" in fd.model_refusal(model.model, torch.bfloat16)
