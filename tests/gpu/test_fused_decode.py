"""The fused decode kernel (kernels/fused_decode.cu: a whole batch-1 decode step in one launch) against the per-op
CUDA path and the reference path, inside generate() with and without CUDA graphs (skipped cleanly without a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import decode_logits, tiny_model
from tinyloop_hf import TinyLoopCache, TinyLoopQuantConfig
from tinyloop_hf.convert.quantize import quantize_model

pytestmark = pytest.mark.gpu
if torch.cuda.is_available():
    pytest.importorskip("cupy")
    from tinyloop_hf.kernels import fused_decode
    from tinyloop_hf.kernels.loader import sm90_or_newer

    if not sm90_or_newer():
        pytest.skip("the fused decode kernel needs sm_90+", allow_module_level=True)

# Shapes the kernel serves (its copies need 16-byte rows of scales): hidden 512, head_dim 128 or 64 (GQA).
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


@pytest.fixture(autouse=True)
def fused_on(monkeypatch):
    """The kernel is on by default; these tests keep it on whatever the module's switch says."""
    monkeypatch.setattr(fused_decode, "FUSED_DECODE", True)


@pytest.fixture
def per_op(monkeypatch):
    """Build models whose decode steps run op by op (the fused kernel switched off while they run)."""

    def run(fn, *args):
        monkeypatch.setattr(fused_decode, "FUSED_DECODE", False)
        try:
            return fn(*args)
        finally:
            monkeypatch.setattr(fused_decode, "FUSED_DECODE", True)

    return run


WIDE = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8)  # g128: 8 groups, 16-byte scale rows


@pytest.mark.parametrize(
    "variant, quant, dtype, shape",
    [("ouro", "int4-g32", torch.bfloat16, {}), ("ouro", "int4-g32", torch.float16, {}),
     ("llama", "int4-g32", torch.bfloat16, {}), ("ouro", "int4-g128-sym-bf16", torch.bfloat16, WIDE)],
)  # fmt: skip
def test_fused_decode_is_as_close_to_the_reference_as_the_per_op_path(variant, quant, dtype, shape, per_op):
    assert _check_closeness(variant, quant, dtype, shape, per_op) == {384}  # the CTA size these shapes get


@pytest.mark.parametrize("variant, shape", [("ouro", {}), ("llama", {}), ("ouro", WIDE)])
def test_the_16_warp_kernel_is_as_close_as_the_12_warp_one(variant, shape, per_op, monkeypatch):
    """The 512-thread CTAs (for vectors too wide for 384: 2 QKV units per warp task, 15 consumer warps) forced on the
    shapes the default 384 serves: the same bounds."""
    monkeypatch.setattr(fused_decode, "THREADS", 512)
    assert _check_closeness(variant, "int4-g32", torch.bfloat16, shape, per_op) == {512}


def _check_closeness(variant, quant, dtype, shape, per_op):
    ids = torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(4)).cuda()
    reference = _model(variant, quant, dtype, **shape)
    want = decode_logits(reference, ids, 6, TinyLoopCache(reference.config))
    plain = _model(variant, quant, dtype, **shape).use_cuda_path(cuda_graphs=False)
    baseline = per_op(decode_logits, plain, ids, 6, plain.new_cache())
    fast = _model(variant, quant, dtype, **shape).use_cuda_path(cuda_graphs=False)
    got = decode_logits(fast, ids, 6, fast.new_cache())
    assert fast._cuda_path.fused.steps == ids.shape[1] - 6  # every decode step ran fused
    assert plain._cuda_path.fused.steps == 0
    _assert_as_close(want, baseline, got)
    return {plan.threads for plan in fast._cuda_path.fused.plans.values()}


def _assert_as_close(want, baseline, got):
    """The fused kernel's logits ``got`` are as close to the reference's ``want`` as the per-op path's ``baseline``."""
    scale = want.abs().max()
    per_op_error, fused_error = (baseline - want).abs(), (got - want).abs()
    errors = (f"max error {fused_error.max():.4f} (per-op {per_op_error.max():.4f}), "
              f"mean {fused_error.mean():.5f} (per-op {per_op_error.mean():.5f}), "
              f"fused - per-op {(got - baseline).abs().max():.4f}, scale {scale:.2f}")
    assert fused_error.max() <= 2 * per_op_error.max() + 2e-3 * scale, errors
    assert fused_error.mean() <= 1.5 * per_op_error.mean() + 1e-4 * scale, errors
    # The two CUDA paths may part by 1% of the scale, or by as much as the per-op path parts from the reference where
    # that is more (their sums run in other orders; a wrong rounding would show in the two bounds above).
    assert (got - baseline).abs().max() <= max(1e-2 * scale, per_op_error.max()), errors


def test_fused_graphs_replay_the_eager_steps_and_keep_hf_semantics():
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    graphs, eager = _model("ouro").use_cuda_path(), _model("ouro").use_cuda_path(cuda_graphs=False)
    kwargs = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True)
    want, got = eager.generate(ids, **kwargs), graphs.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))
    # Replays do not call FusedDecode.run: the graphed model runs it at the eager warm-up step and in the capture.
    assert eager._cuda_path.fused.steps >= 8 and graphs._cuda_path.fused.steps >= 2
    assert any(key[0] == "decode" for key in graphs._cuda_path.graphs)
    again = graphs.generate(ids, **kwargs)  # replayed by the next call, which reuses the storage
    assert torch.equal(again.sequences, want.sequences)


def test_a_later_generate_reads_nothing_its_pages_kept_from_the_call_before():
    """A later generate() of the same shape reuses the cache storage and its graphs (the prompt's too): what the
    pages still hold from the call before (here overwritten with noise) must not reach its tokens or scores."""
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    model = _model("ouro").use_cuda_path()
    kwargs = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True)
    first = model.generate(ids, **kwargs)
    storages = list(model._cuda_path.storages.values())
    assert storages and all(storage.pages for storage in storages)
    for storage in storages:
        for pages in storage.pages.values():
            for tensor in pages[:2]:  # K and V
                tensor.normal_(0, 3)
    again = model.generate(ids, **kwargs)
    assert [id(storage) for storage in model._cuda_path.storages.values()] == [id(storage) for storage in storages]
    assert torch.equal(again.sequences, first.sequences)
    assert all(torch.equal(a, b) for a, b in zip(again.scores, first.scores, strict=True))


def test_fused_decode_over_many_cached_tokens(per_op):
    """A prompt long enough that each attention split loops over several steps of its tokens (17 splits of 60 tokens
    a step at this shape), with the exit gate's outputs of an eager step."""
    ids = torch.randint(1, 256, (1, 1300), generator=torch.Generator().manual_seed(2)).cuda()
    kw = dict(max_position_embeddings=2048)
    reference = _model("ouro", **kw)
    want = decode_logits(reference, ids, 1296, TinyLoopCache(reference.config))
    plain = _model("ouro", **kw).use_cuda_path(cuda_graphs=False)
    fast = _model("ouro", **kw).use_cuda_path(cuda_graphs=False)
    baseline = per_op(decode_logits, plain, ids, 1296, plain.new_cache())
    got = decode_logits(fast, ids, 1296, fast.new_cache())
    assert fast._cuda_path.fused.steps == 4
    _assert_as_close(want, baseline, got)
    cache = fast.new_cache()
    with torch.no_grad():
        fast(ids[:, :-1], past_key_values=cache, use_cache=True)
        step = fast(ids[:, -1:], past_key_values=cache, use_cache=True)
        plain_cache = plain.new_cache()
        plain(ids[:, :-1], past_key_values=plain_cache, use_cache=True)
        want = per_op(lambda: plain(ids[:, -1:], past_key_values=plain_cache, use_cache=True))
    assert step.exit_probabilities.shape == want.exit_probabilities.shape == (1, 1, 3)
    assert (step.gate_logits.float() - want.gate_logits.float()).abs().max() <= 5e-2


def test_a_decode_replay_runs_only_the_step_s_own_kernels():
    """A replayed step returns its logits alone, so its graph holds neither the exit distribution's small kernels
    (sigmoid and products per loop) nor the RoPE frequencies' (a power and a reciprocal, the same every step): one
    replay's kernels under torch.profiler (the eager step before it, which returns the gates, has them)."""
    model = _model("ouro").use_cuda_path()
    ids = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(6)).cuda()
    cache = model.new_cache()

    def kernels(step):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        return [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]

    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        eager = kernels(lambda: model(ids[:, -1:], past_key_values=cache, use_cache=True))  # warm-up: no graph yet
        model(ids[:, -1:], past_key_values=cache, use_cache=True)  # captured, then replayed
        replay = kernels(lambda: model(ids[:, -1:], past_key_values=cache, use_cache=True))
    assert any("fused_decode" in name for name in eager) and any("fused_decode" in name for name in replay)
    assert any("sigmoid" in name for name in eager)
    assert not [name for name in replay if "sigmoid" in name or "pow" in name], replay
    assert model._cuda_path.graphs


def test_the_kv_prefetch_changes_no_output(monkeypatch):
    """The attention splits' K/V prefetch into L2 (a spare lane of the producer warp) only moves data into the cache:
    every step's logits are bit for bit those of the kernel without it, over a prompt whose splits span several
    pages."""
    ids = torch.randint(1, 256, (1, 100), generator=torch.Generator().manual_seed(5)).cuda()
    got = {}
    for prefetch in (True, False):
        monkeypatch.setattr(fused_decode, "KV_PREFETCH", prefetch)
        model = _model("ouro").use_cuda_path(cuda_graphs=False)
        got[prefetch] = decode_logits(model, ids, 90, model.new_cache())
        assert model._cuda_path.fused.steps == 10
    assert torch.equal(got[True], got[False])


def test_steps_the_kernel_does_not_serve_run_op_by_op():
    """Batch 2 and INT8 K/V are not served: those steps run on the per-op kernels, with the same tokens as ever."""
    model = _model("ouro").use_cuda_path()
    ids = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(3)).cuda()
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 12) and model._cuda_path.fused.steps == 0
    model.use_cuda_path(kv_cache_dtype="int8")
    model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert model._cuda_path.fused.steps == 0


_TWO_STREAMS = """
import sys, torch
sys.path[:0] = [{tests!r}, {here!r}]
from test_fused_decode import _model
from tinyloop_hf.kernels import fused_decode
fused_decode.FUSED_DECODE = True
models = [_model("ouro", seed=seed).use_cuda_path(cuda_graphs=False) for seed in (0, 1)]
ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(5)).cuda()

def run(model, cache, t):
    return model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1].float()

with torch.no_grad():
    caches = [[m.new_cache() for m in models] for _ in range(2)]
    for pair in caches:
        for model, cache in zip(models, pair):
            model(ids[:, :8], past_key_values=cache, use_cache=True)
    want = [[run(m, c, t) for t in range(8, 40)] for m, c in zip(models, caches[0])]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    got = [[], []]
    for t in range(8, 40):  # both models' steps queued together, never synchronized in between
        for i, (model, cache) in enumerate(zip(models, caches[1])):
            with torch.cuda.stream(streams[i]):
                got[i].append(run(model, cache, t))
    torch.cuda.synchronize()
assert all(m._cuda_path.fused.steps == 64 for m in models), [m._cuda_path.fused.steps for m in models]
for a, b in zip(want, got):
    assert all(torch.equal(x, y) for x, y in zip(a, b))
print("ok")
"""


def test_two_models_decoding_at_once_on_two_streams():
    """Two fused steps queued on two streams of one GPU: a launch that left both partly resident would spin until its
    poll limit traps (which kills the CUDA context, hence the subprocess). The cooperative launch keeps each whole."""
    script = _TWO_STREAMS.format(tests=str(Path(__file__).parents[1]), here=str(Path(__file__).parent))
    # -P: the installed package, as the test process imports it (not the source folder the working directory holds)
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
