"""Adaptive early exit that saves compute (early_exit / early_exit_threshold), the KV policy for skipped loops, and
loop schedules (warmup_tokens / warmup_loops, per-row depth): all through forward() and generate()."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from tinyloop_hf import TinyLoopCache, TinyLoopForCausalLM
from tinyloop_hf.compat import GENERATE_CACHE_KEY
from tinyloop_hf.paged_cache import PagedTinyLoopCache

IDS = torch.randint(1, 256, (3, 9), generator=torch.Generator().manual_seed(21))
MASK = torch.ones_like(IDS)
MASK[1, :4] = 0
CRITERIA = [("gate", 0.6), ("state_delta", 0.6), ("kl", 0.05)]


def _model(**overrides) -> TinyLoopForCausalLM:
    return tiny_model("tinyloop", num_loops=4, num_loop_layers=2, **overrides)  # prelude, 2-layer loop, coda, gate


def _count_loop_passes(model: TinyLoopForCausalLM) -> list[int]:
    """Token positions that went through the first loop layer, per call."""
    counts: list[int] = []
    model.model.loop_layers[0].register_forward_hook(
        lambda m, args, out: counts.append(args[0].shape[0] * args[0].shape[1])
    )
    return counts


@pytest.mark.parametrize("criterion, threshold", CRITERIA)
def test_an_exit_equals_a_step_at_that_depth_and_skipped_loops_reuse_kv(criterion, threshold):
    """Token by token with early exit; a second cache replays each step at exactly the loops it ran: same logits,
    and the slots of the loops a token skipped hold its last computed loop's K/V."""
    model = _model()
    exited, replayed = TinyLoopCache(model.config), TinyLoopCache(model.config)
    tokens = IDS[:1]
    loops_seen = set()
    with torch.no_grad():
        model(tokens[:, :3], past_key_values=exited, use_cache=True)
        model(tokens[:, :3], past_key_values=replayed, use_cache=True)
        for t in range(3, tokens.shape[1]):
            out = model(tokens[:, t : t + 1], past_key_values=exited, use_cache=True, early_exit=criterion,
                        early_exit_threshold=threshold)  # fmt: skip
            loops = int(out.loops_run[0])
            loops_seen.add(loops)
            again = model(tokens[:, t : t + 1], past_key_values=replayed, use_cache=True, num_loops=loops)
            torch.testing.assert_close(out.logits, again.logits, rtol=0, atol=0)
            for layer in range(2):
                last = exited.layers[exited.slot_index("loop", layer, loops - 1)].keys[:, :, t]
                for skipped in range(loops, 4):
                    assert torch.equal(exited.layers[exited.slot_index("loop", layer, skipped)].keys[:, :, t], last)
    assert len(loops_seen) > 1 or loops_seen != {4}, "the threshold should make some tokens exit early"


@pytest.mark.parametrize("criterion, threshold", CRITERIA)
def test_batched_rows_that_exit_stop_computing_and_equal_each_row_alone(criterion, threshold):
    model = _model()
    counts = _count_loop_passes(model)
    kwargs = dict(max_new_tokens=8, do_sample=False, early_exit=criterion, early_exit_threshold=threshold)
    batched = model.generate(IDS, attention_mask=MASK, **kwargs)
    passes = sum(counts)
    for row in range(IDS.shape[0]):
        alone = model.generate(IDS[row : row + 1, MASK[row].bool()], **kwargs)
        assert torch.equal(alone[0, -8:], batched[row, -8:])
    counts.clear()
    model.generate(IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False)
    assert passes < sum(counts)  # rows that exited did not run the remaining loops


def test_gate_exit_picks_the_state_exit_threshold_picks():
    """At a decode step, early_exit='gate' stops where Ouro's exit_threshold selects its state (same logits); the
    difference is only what later loops cost and store."""
    model = _model()
    cache_a, cache_b = TinyLoopCache(model.config), TinyLoopCache(model.config)
    with torch.no_grad():
        model(IDS[:1, :5], past_key_values=cache_a, use_cache=True)
        model(IDS[:1, :5], past_key_values=cache_b, use_cache=True)
        saving = model(
            IDS[:1, 5:6], past_key_values=cache_a, use_cache=True, early_exit="gate", early_exit_threshold=0.5
        )
        selecting = model(IDS[:1, 5:6], past_key_values=cache_b, use_cache=True, exit_threshold=0.5)
    torch.testing.assert_close(saving.logits, selecting.logits, rtol=1e-5, atol=1e-5)


def test_per_row_depth_rows_stop_computing_and_equal_each_row_alone():
    model = _model()
    counts = _count_loop_passes(model)
    depths = [1, 4, 2]
    with torch.no_grad():
        batched = model(IDS, attention_mask=MASK, num_loops=depths).logits
        passes = sum(counts)
        for row, depth in enumerate(depths):
            alone = model(IDS[row : row + 1, MASK[row].bool()], num_loops=depth).logits
            torch.testing.assert_close(alone[0], batched[row, MASK[row].bool()], rtol=1e-5, atol=1e-5)
    assert passes == IDS.shape[1] * sum(depths)


def test_warmup_schedule_decodes_the_first_tokens_shallower():
    model = _model()
    counts = _count_loop_passes(model)
    prompt = IDS[:1]
    got = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, warmup_tokens=3, warmup_loops=1)
    assert sum(counts) == prompt.shape[1] * 4 + 2 * 1 + 3 * 4  # prompt at full depth; tokens 2-3 at 1 loop
    # The same schedule by hand: the prompt at full depth read at loop 1, two steps at one loop, then full depth.
    cache = TinyLoopCache(model.config)
    with torch.no_grad():
        logits = model(prompt, past_key_values=cache, use_cache=True, exit_at_step=0).logits[:, -1]
        tokens = [logits.argmax(-1)]
        for step in range(1, 6):
            loops = 1 if step < 3 else 4
            out = model(tokens[-1][:, None], past_key_values=cache, use_cache=True, num_loops=loops)
            tokens.append(out.logits[:, -1].argmax(-1))
    assert torch.equal(got[0, prompt.shape[1] :], torch.cat(tokens))
    plain = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(
        model.generate(prompt, max_new_tokens=6, do_sample=False, warmup_tokens=0, warmup_loops=2), plain
    )


def test_warmup_schedule_counts_from_the_whole_prompt_when_it_is_prefilled_in_chunks():
    model = _model()
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, warmup_tokens=2, warmup_loops=1)
    counts = _count_loop_passes(model)
    want = model.generate(IDS[:1], **kwargs)
    whole = sum(counts)
    counts.clear()
    assert torch.equal(model.generate(IDS[:1], prefill_chunk_size=3, **kwargs), want)
    assert sum(counts) == whole  # every chunk at full depth, then the same steps


def test_warmup_schedule_on_the_paged_cache_fills_the_deeper_slots():
    """The CUDA path's paged cache: a shallow step's deeper loop slots take its last loop's K/V (copied page rows),
    so the schedule's tokens and every slot's K/V equal the dynamic cache's."""
    model = _model()
    for ids, mask in ((IDS[:1], None), (IDS, MASK)):
        paged = PagedTinyLoopCache(model.config, capacity=64)
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, warmup_tokens=3, warmup_loops=2)
        got = model.generate(ids, **{GENERATE_CACHE_KEY: paged}, **kwargs)
        dynamic = model.generate(ids, return_dict_in_generate=True, **kwargs)
        assert torch.equal(got, dynamic.sequences)
        cache = dynamic.past_key_values if hasattr(dynamic, "past_key_values") else dynamic.cache
        assert paged.length == cache.get_seq_length() and len(paged.slot_lengths) == len(cache.layers)
        for slot, layer in enumerate(cache.layers):
            keys, values = paged.gather(slot, paged.length, torch.float32)
            torch.testing.assert_close(keys, layer.keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(values, layer.values, rtol=1e-5, atol=1e-6)


def test_fields_survive_save_and_reload(tmp_path):
    model = _model()
    model.generation_config.early_exit = "state_delta"
    model.generation_config.early_exit_threshold = 0.6
    model.generation_config.warmup_tokens = 2
    model.generation_config.warmup_loops = 2
    want = model.generate(IDS[:1], max_new_tokens=6, do_sample=False)
    model.save_pretrained(tmp_path)
    reloaded = TinyLoopForCausalLM.from_pretrained(tmp_path)
    config = reloaded.generation_config
    assert (config.early_exit, config.early_exit_threshold, config.warmup_tokens, config.warmup_loops) == (
        "state_delta",
        0.6,
        2,
        2,
    )
    counts = _count_loop_passes(reloaded)
    assert torch.equal(reloaded.generate(IDS[:1], max_new_tokens=6, do_sample=False), want)
    assert sum(counts) < IDS.shape[1] * 4 + 5 * 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(early_exit="fast", early_exit_threshold=0.5),
            r"early_exit must be one of \['gate', 'state_delta', 'kl'\]",
        ),
        (dict(early_exit="kl"), "early_exit_threshold must be a positive number"),
        (dict(early_exit="gate", early_exit_threshold=1.5), r"early_exit_threshold in \(0, 1\]"),
        (dict(early_exit_threshold=0.5), "early_exit_threshold needs early_exit"),
        (
            dict(early_exit="gate", early_exit_threshold=0.5, exit_threshold=0.5),
            "cannot be combined with exit_threshold",
        ),
        (dict(warmup_tokens=2), "needs both warmup_tokens and warmup_loops"),
        (dict(warmup_tokens=2, warmup_loops=5), r"warmup_loops must be an integer in \[1, num_loops=4\]"),
        (dict(warmup_tokens=-1, warmup_loops=1), "warmup_tokens must be a non-negative integer"),
        (dict(warmup_tokens=2, warmup_loops=1, draft_loops=1), "cannot be combined with draft_loops"),
        (dict(warmup_tokens=2, warmup_loops=1, use_cache=False), "warmup_tokens / warmup_loops need the KV cache"),
        (dict(early_exit="kl", early_exit_threshold=0.1, use_cache=False), "early_exit needs the KV cache"),
        (dict(exit_threshold=1.5), r"exit_threshold must be None or a number in \[0, 1\], got 1.5"),
        (dict(exit_threshold=True), r"exit_threshold must be None or a number in \[0, 1\], got True"),
        (dict(exit_at_step=True), r"exit_at_step must be an integer in \[0, num_loops - 1 = 3\], got True"),
        (dict(early_exit="state_delta", early_exit_threshold=float("nan")), "must be a positive number, finite"),
        (dict(use_weighted_exit="false"), "use_weighted_exit must be True, False or None, got 'false'"),
        (dict(warmup_tokens=2, warmup_loops=1, exit_at_step=2), "do not pass exit_at_step"),
        (dict(warmup_tokens=2, warmup_loops=1, prompt_lookup_num_tokens=2), "assisted decoding"),
        (dict(early_exit="gate", early_exit_threshold=0.5, prompt_lookup_num_tokens=2), "assisted decoding"),
    ],
)
def test_bad_settings_fail_with_the_field_and_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _model().generate(IDS[:1], max_new_tokens=3, **kwargs)


def test_gate_needs_an_exit_gate_and_the_paged_cache_is_refused():
    model = tiny_model("huginn")  # no exit gate
    with pytest.raises(ValueError, match="needs a model with an exit gate"):
        model.generate(IDS[:1], max_new_tokens=2, early_exit="gate", early_exit_threshold=0.5)
    model = _model()
    with torch.no_grad(), pytest.raises(ValueError, match="early_exit needs a TinyLoopCache: a paged cache"):
        model(IDS[:1, :1], past_key_values=PagedTinyLoopCache(model.config), use_cache=True, early_exit="state_delta",
              early_exit_threshold=0.5)  # fmt: skip
    with pytest.raises(ValueError, match="call TinyLoopForCausalLM"):
        model.model(IDS[:1, :1], early_exit="kl", early_exit_threshold=0.5)


@pytest.mark.parametrize("criterion, threshold", CRITERIA)
def test_a_one_token_prompt_runs_every_loop_then_exits_early(criterion, threshold):
    """A one-token prompt (BOS only, "Hi") is a prompt, not a decode step: it runs every loop, so the tokens after it
    equal those of the same prompt inside a left-padded batch."""
    model = _model()
    prompt = IDS[:1, :1]
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, early_exit=criterion,
                  early_exit_threshold=threshold)  # fmt: skip
    alone = model.generate(prompt, **kwargs)
    ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt], dim=1), IDS[1:2, :5]
    batch, mask = torch.cat(ids), torch.tensor([[0, 0, 0, 0, 1], [1] * 5])
    together = model.generate(batch, attention_mask=mask, **kwargs)
    assert torch.equal(alone[0, 1:], together[0, 5:])


def test_early_exit_overrides_the_exit_threshold_a_converted_ouro_config_sets():
    """Ouro checkpoints set config.exit_threshold (the default exit selection); early_exit replaces it, while an
    exit_threshold passed with early_exit is refused."""
    model = _model(exit_threshold=1.0)
    kwargs = dict(max_new_tokens=6, do_sample=False, early_exit="gate", early_exit_threshold=0.6)
    model.config.exit_threshold = None
    want = model.generate(IDS[:1], **kwargs)
    model.config.exit_threshold = 1.0
    assert torch.equal(model.generate(IDS[:1], **kwargs), want)
    with pytest.raises(ValueError, match="cannot be combined with exit_threshold"):
        model.generate(IDS[:1], exit_threshold=0.5, **kwargs)
