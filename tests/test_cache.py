"""TinyLoopCache: slot layout, growth, crop, beam reorder, batch repeat/select, mask sizes, depth mismatch."""

from __future__ import annotations

import re

import pytest
import torch

from helpers import tiny_model
from tinyloop_hf import PagedTinyLoopCache, TinyLoopCache

IDS = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(3))


def _prefill(model, ids, **kwargs):
    cache = TinyLoopCache(model.config)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True, **kwargs).logits
    return cache, logits


def test_one_slot_per_loop_and_layer():
    model = tiny_model("huginn")  # prelude 1, loop block 2, coda 1
    cache, _ = _prefill(model, IDS, num_loops=3)
    assert len(cache.layers) == 1 + 1 + 3 * 2
    assert cache.slot_index("prelude", 0) == 0 and cache.slot_index("coda", 0) == 1
    assert cache.slot_index("loop", 1, loop=2) == 2 + 2 * 2 + 1
    assert cache.describe_slot(7) == "(loop 2, layer 1)"
    assert all(layer.get_seq_length() == 12 for layer in cache.layers)
    assert cache.get_mask_sizes(1, 0) == (13, 0)
    kv_heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    assert cache.memory_bytes() == len(cache.layers) * 2 * 2 * kv_heads * 12 * head_dim * 4


def test_buffers_grow_past_their_capacity_and_match_the_full_forward():
    model = tiny_model("ouro")
    ids = torch.randint(1, 256, (1, 100), generator=torch.Generator().manual_seed(9))
    cache, _ = _prefill(model, ids[:, :60])
    with torch.no_grad():
        steps = [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(60, 100)]
        full = model(ids).logits
    assert cache.get_seq_length() == 100
    assert torch.allclose(torch.cat(steps, 1), full[:, 60:], atol=1e-5)


@pytest.mark.parametrize("remove", [0, -1, -5])
def test_crop_negative_removes_trailing_tokens(remove):
    model = tiny_model("huginn")
    cache, _ = _prefill(model, IDS)
    cache.crop(remove)
    kept = 12 + remove
    assert cache.get_seq_length() == kept
    with torch.no_grad():
        resumed = model(IDS[:, kept:], past_key_values=cache, use_cache=True).logits if remove else None
        full = model(IDS).logits
    if resumed is not None:
        assert torch.allclose(resumed, full[:, kept:], atol=1e-5)


def test_crop_positive_keeps_that_many_and_overcrop_fails():
    model = tiny_model("ouro")
    cache, _ = _prefill(model, IDS)
    cache.crop(8)
    assert cache.get_seq_length() == 8
    with pytest.raises(ValueError, match="cannot crop 9 tokens"):
        cache.crop(-9)


def test_reorder_and_batch_select_follow_the_rows():
    model = tiny_model("ouro")
    cache, _ = _prefill(model, IDS)
    cache.reorder_cache(torch.tensor([1, 1]))
    with torch.no_grad():
        step = model(IDS[[1, 1], :1], past_key_values=cache, use_cache=True).logits
        reference = model(torch.cat([IDS[[1, 1]], IDS[[1, 1], :1]], 1)).logits[:, -1:]
    assert torch.allclose(step, reference, atol=1e-5)
    cache.batch_select_indices(torch.tensor([0]))
    assert cache.layers[0].keys.shape[0] == 1


def test_batch_repeat_interleave():
    model = tiny_model("ouro")
    cache, _ = _prefill(model, IDS)
    cache.batch_repeat_interleave(3)
    assert cache.layers[0].keys.shape[0] == 6
    assert torch.equal(cache.layers[0].keys[0], cache.layers[0].keys[2])
    assert torch.equal(cache.layers[0].keys[3], cache.layers[0].keys[5])


def test_asking_for_more_loops_than_cached_fails_clearly():
    model = tiny_model("ouro")
    cache, _ = _prefill(model, IDS, num_loops=2)
    with pytest.raises(ValueError, match=r"slot \(loop 2, layer 0\) holds 0 tokens but the cache holds 12"):
        with torch.no_grad():
            model(IDS[:, :1], past_key_values=cache, use_cache=True, num_loops=3)


def test_reset_empties_every_slot():
    model = tiny_model("ouro")
    cache, _ = _prefill(model, IDS)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.memory_bytes() == 0


def test_cache_works_with_gradients():
    model = tiny_model("llama").train()
    cache = TinyLoopCache(model.config)
    first = model(IDS[:, :6], past_key_values=cache, use_cache=True).logits
    second = model(IDS[:, 6:], past_key_values=cache, use_cache=True).logits
    (first.sum() + second.sum()).backward()
    assert model.lm_head.weight.grad is not None


def test_a_replayed_step_marks_its_slots_at_once_and_names_one_out_of_step():
    model = tiny_model("ouro").to(torch.bfloat16)
    cache = PagedTinyLoopCache(model.config, capacity=64)
    with torch.no_grad():
        model(IDS, past_key_values=cache, use_cache=True, num_loops=2)
    slots = sorted(cache.slot_lengths)
    cache.step_tokens = 1  # as begin_step sets it for a decode step
    cache.mark_all_written(slots)
    assert all(cache.slot_lengths[slot] == IDS.shape[1] + 1 for slot in slots)
    cache.end_step()
    cache.step_tokens = 1
    cache.slot_lengths[slots[1]] -= 1
    with pytest.raises(ValueError, match=rf"slot {re.escape(cache.describe_slot(slots[1]))} holds 12 tokens"):
        cache.mark_all_written(slots)
