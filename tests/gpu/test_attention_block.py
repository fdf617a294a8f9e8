"""The attention block kernel (kernels/attention_block.cu: a batch-1 decode step's QKV + RoPE + K/V append, paged
attention and o_proj in one launch) against the three per-op kernels it replaces and the reference path (skipped
cleanly without a GPU)."""

from __future__ import annotations

import pytest
import torch

from helpers import decode_logits, tiny_model
from tinyloop_hf import TinyLoopCache, TinyLoopQuantConfig
from tinyloop_hf.convert.quantize import quantize_model

pytestmark = pytest.mark.gpu
if torch.cuda.is_available():
    pytest.importorskip("cupy")
    from tinyloop_hf.kernels import attention_block, fused_decode
    from tinyloop_hf.kernels.loader import sm90_or_newer

    if not sm90_or_newer():
        pytest.skip("the attention block kernel needs sm_90+ (thread-block clusters)", allow_module_level=True)

# Model shapes the kernel serves: (architecture variant, overrides). hidden 512: head_dim 128 (MHA, one QKV task per
# warp) or 64 with 4 query heads per KV head; huginn without its q/k bias: interleaved RoPE, and a prelude and a coda
# block; hidden 1024 with 4 query heads per KV head at head_dim 128: two QKV tasks per warp.
SHAPES = {
    "ouro": ("ouro", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4)),
    "llama": ("llama", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)),
    "huginn": ("huginn", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, attention_bias="none")),
    "llama-wide": (
        "llama",
        dict(hidden_size=1024, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2),
    ),  # fmt: skip
}
QUANTS = {
    "int4-g32": TinyLoopQuantConfig(bits=4, group_size=32),
    "int4-g128-sym-bf16": TinyLoopQuantConfig(bits=4, group_size=128, symmetric=True, scale_dtype="bfloat16"),
}


def _model(shape, quant="int4-g32", dtype=torch.bfloat16, **overrides):
    variant, sizes = SHAPES[shape]
    model = tiny_model(variant, **{**sizes, **overrides})
    quantize_model(model, QUANTS[quant], progress=False)
    return model.to("cuda", dtype)


def _attention_calls(config, decode_steps):
    """attention_block launches of ``decode_steps`` batch-1 decode steps: one per attention block application."""
    blocks = config.num_prelude_layers + config.num_loops * config.num_loop_layers + config.num_coda_layers
    return decode_steps * blocks


@pytest.fixture(autouse=True)
def per_op_steps(monkeypatch):
    """The fused decode kernel (on by default) would take the batch-1 steps whose attention blocks these tests count."""
    monkeypatch.setattr(fused_decode, "FUSED_DECODE", False)


@pytest.fixture
def launches(monkeypatch):
    """Counts attention_block launches; ``launches.off(fn, *args)`` runs fn with the kernel switched off."""

    class Counter:
        count = 0

        def off(self, fn, *args):
            monkeypatch.setattr(attention_block, "ATTENTION_BLOCK", False)
            try:
                return fn(*args)
            finally:
                monkeypatch.setattr(attention_block, "ATTENTION_BLOCK", True)

    counter = Counter()
    attend = attention_block.attend

    def counted(*args, **kwargs):
        counter.count += 1
        return attend(*args, **kwargs)

    monkeypatch.setattr(attention_block, "attend", counted)
    monkeypatch.setattr(attention_block, "ATTENTION_BLOCK", True)
    return counter


@pytest.mark.parametrize(
    "variant, quant, dtype",
    [("ouro", "int4-g32", torch.bfloat16), ("ouro", "int4-g32", torch.float16), ("llama", "int4-g32", torch.bfloat16),
     ("llama", "int4-g128-sym-bf16", torch.float16), ("ouro", "int4-g128-sym-bf16", torch.bfloat16),
     ("huginn", "int4-g32", torch.bfloat16), ("llama-wide", "int4-g32", torch.bfloat16)],
)  # fmt: skip
def test_attention_block_is_as_close_to_the_reference_as_the_per_op_kernels(variant, quant, dtype, launches):
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(4)).cuda()
    reference = _model(variant, quant, dtype)
    want = decode_logits(reference, ids, 21, TinyLoopCache(reference.config))
    plain = _model(variant, quant, dtype).use_cuda_path(cuda_graphs=False)
    baseline = launches.off(decode_logits, plain, ids, 21, plain.new_cache())
    assert launches.count == 0
    fast = _model(variant, quant, dtype).use_cuda_path(cuda_graphs=False)
    got = decode_logits(fast, ids, 21, fast.new_cache())
    assert launches.count == _attention_calls(fast.config, ids.shape[1] - 21)  # every decode step
    scale = want.abs().max()
    per_op_error = (baseline - want).abs().max()
    assert (got - want).abs().max() <= 2 * per_op_error + 2e-3 * scale
    assert (got - baseline).abs().max() <= 3e-2 * scale  # 19 decode steps of bf16 sums in another order


def test_attention_block_over_many_cached_tokens(launches):
    """A 700-token prompt: each of a cluster's 8 CTAs attends ~88 tokens over several pages (two steps of its
    token loop at head_dim 128), the new token in a page of its own."""
    ids = torch.randint(1, 256, (1, 704), generator=torch.Generator().manual_seed(2)).cuda()
    kw = dict(max_position_embeddings=1024)
    reference = _model("ouro", **kw)
    want = decode_logits(reference, ids, 700, TinyLoopCache(reference.config))
    plain = _model("ouro", **kw).use_cuda_path(cuda_graphs=False)
    fast = _model("ouro", **kw).use_cuda_path(cuda_graphs=False)
    baseline = launches.off(decode_logits, plain, ids, 700, plain.new_cache())
    got = decode_logits(fast, ids, 700, fast.new_cache())
    assert launches.count == _attention_calls(fast.config, 4)
    # As close to the reference as the per-op kernels (the closeness test's bounds); the two CUDA paths part by at
    # most 1% of the scale, or the per-op kernels' own distance from the reference where that is more.
    scale, per_op_error = want.abs().max(), (baseline - want).abs().max()
    assert (got - want).abs().max() <= 2 * per_op_error + 2e-3 * scale
    assert (got - baseline).abs().max() <= max(1e-2 * scale, per_op_error)


def test_attention_block_graphs_replay_the_eager_steps(launches):
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    graphs, eager = _model("ouro").use_cuda_path(), _model("ouro").use_cuda_path(cuda_graphs=False)
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True)
    want, got = eager.generate(ids, **kwargs), graphs.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))
    assert any(key[0] == "decode" for key in graphs._cuda_path.graphs) and launches.count > 0
    again = graphs.generate(ids, **kwargs)  # replayed again: the counters were reset by the last CTAs
    assert torch.equal(again.sequences, want.sequences)


def test_a_left_padded_prompt_masks_its_padding(launches):
    """Batch 1 with left padding (the cache's start > 0): the padded positions are never attended, as on the per-op
    path."""
    ids = torch.randint(1, 256, (1, 14), generator=torch.Generator().manual_seed(6)).cuda()
    ids[:, :4] = 0
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_scores=True)  # fmt: skip
    plain = _model("ouro").use_cuda_path(cuda_graphs=False)
    want = launches.off(lambda: plain.generate(ids, **kwargs))
    fast = _model("ouro").use_cuda_path(cuda_graphs=False)
    got = fast.generate(ids, **kwargs)
    assert launches.count == _attention_calls(fast.config, 5)
    want_scores, got_scores = torch.stack(want.scores).float(), torch.stack(got.scores).float()
    assert (got_scores - want_scores).abs().max() <= 3e-2 * want_scores.abs().max()


def test_steps_it_does_not_serve_run_on_the_per_op_kernels(launches):
    """Batch 2, INT8 K/V and a cache longer than MAX_TOKENS take the per-op kernels; the tokens do not change."""
    model = _model("ouro", max_position_embeddings=4096).use_cuda_path(cuda_graphs=False)
    ids = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(3)).cuda()
    model.generate(ids, max_new_tokens=3, do_sample=False)
    assert launches.count == 0
    model.use_cuda_path(kv_cache_dtype="int8", cuda_graphs=False)
    model.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert launches.count == 0
    model.use_cuda_path(cuda_graphs=False)
    long_cache = model.new_cache(attention_block.MAX_TOKENS + 64)
    with torch.no_grad():
        model(ids[:1], past_key_values=long_cache, use_cache=True)
        model(ids[:1, :1], past_key_values=long_cache, use_cache=True)
    assert long_cache.storage.capacity > attention_block.MAX_TOKENS and launches.count == 0
