"""The attention block kernel (kernels/attention_block.cu: a batch-1 decode step's QKV + RoPE + K/V append, paged
attention and o_proj in one launch) against the three per-op kernels it replaces and the reference path (skipped
cleanly without a GPU)."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from tinyloop_hf import TinyLoopCache, TinyLoopQuantConfig
from tinyloop_hf.convert.quantize import quantize_model

pytestmark = pytest.mark.gpu
if torch.cuda.is_available():
    pytest.importorskip("cupy")
    from tinyloop_hf.kernels import attention_block
    from tinyloop_hf.kernels.loader import sm90_or_newer

    if not sm90_or_newer():
        pytest.skip("the attention block kernel needs sm_90+ (thread-block clusters)", allow_module_level=True)

# hidden 512: head_dim 128 (MHA) or 64 with 4 query heads per KV head.
SHAPES = {
    "ouro": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4),
    "llama": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2),
}
QUANTS = {
    "int4-g32": TinyLoopQuantConfig(bits=4, group_size=32),
    "int4-g128-sym-bf16": TinyLoopQuantConfig(bits=4, group_size=128, symmetric=True, scale_dtype="bfloat16"),
}


def _model(variant, quant="int4-g32", dtype=torch.bfloat16, **overrides):
    model = tiny_model(variant, **{**SHAPES[variant], **overrides})
    quantize_model(model, QUANTS[quant], progress=False)
    return model.to("cuda", dtype)


def _decode_logits(model, ids, prompt, cache):
    with torch.no_grad():
        steps = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in range(prompt, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(steps, 1).float()


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
     ("llama", "int4-g128-sym-bf16", torch.float16), ("ouro", "int4-g128-sym-bf16", torch.bfloat16)],
)  # fmt: skip
def test_attention_block_is_as_close_to_the_reference_as_the_per_op_kernels(variant, quant, dtype, launches):
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(4)).cuda()
    reference = _model(variant, quant, dtype)
    want = _decode_logits(reference, ids, 21, TinyLoopCache(reference.config))
    plain = _model(variant, quant, dtype).use_cuda_path(cuda_graphs=False)
    baseline = launches.off(_decode_logits, plain, ids, 21, plain.new_cache())
    assert launches.count == 0
    fast = _model(variant, quant, dtype).use_cuda_path(cuda_graphs=False)
    got = _decode_logits(fast, ids, 21, fast.new_cache())
    config = fast.config
    assert launches.count == (ids.shape[1] - 21) * config.num_loops * config.num_loop_layers  # every decode step
    scale = want.abs().max()
    per_op_error = (baseline - want).abs().max()
    assert (got - want).abs().max() <= 2 * per_op_error + 2e-3 * scale
    assert (got - baseline).abs().max() <= 3e-2 * scale  # 19 decode steps of bf16 sums in another order


def test_attention_block_over_many_cached_tokens(launches):
    """A 700-token prompt: each of a cluster's 8 CTAs attends ~88 tokens over several pages (two steps of its
    token loop at head_dim 128), the new token in a page of its own."""
    ids = torch.randint(1, 256, (1, 704), generator=torch.Generator().manual_seed(2)).cuda()
    kw = dict(max_position_embeddings=1024)
    plain = _model("ouro", **kw).use_cuda_path(cuda_graphs=False)
    fast = _model("ouro", **kw).use_cuda_path(cuda_graphs=False)
    baseline = launches.off(_decode_logits, plain, ids, 700, plain.new_cache())
    got = _decode_logits(fast, ids, 700, fast.new_cache())
    assert launches.count > 0
    assert (got - baseline).abs().max() <= 1e-2 * baseline.abs().max()


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
