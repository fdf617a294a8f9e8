"""Self-speculative decoding (draft_loops / num_draft_tokens generation fields): greedy output equals plain
decoding, sampling keeps the output distribution, the verifier reuses the draft's loops, bad settings fail early."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline
from transformers.generation.streamers import BaseStreamer

from helpers import VARIANTS, tiny_model
from tinyloop_hf import TinyLoopForCausalLM
from tinyloop_hf.compat import GENERATE_CACHE_KEY
from tinyloop_hf.embedded import embedded_model_path
from tinyloop_hf.paged_cache import PagedTinyLoopCache

PROMPTS = torch.randint(1, 256, (3, 7), generator=torch.Generator().manual_seed(11))
MASK = torch.ones_like(PROMPTS)
MASK[1, :3] = 0  # left padding
MASK[2, :1] = 0


def _generate(model, ids, mask=None, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=14, min_new_tokens=14, do_sample=False, **kwargs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("draft_tokens", [1, 3, "adaptive"])
def test_greedy_equals_plain_decoding(variant, draft_tokens):
    model = tiny_model(variant, num_loops=max(VARIANTS[variant]["num_loops"], 1) + 1)
    loops = model.config.num_loops
    for ids, mask in ((PROMPTS[:1], None), (PROMPTS, MASK)):
        want = _generate(model, ids, mask)
        for draft_loops in sorted({1, loops - 1, loops}):
            got = _generate(model, ids, mask, draft_loops=draft_loops, num_draft_tokens=draft_tokens)
            assert torch.equal(got, want), (draft_loops, ids.shape)
            stats = model.speculation_stats
            assert stats.rounds > 0 and stats.draft_loops == draft_loops and stats.full_loops == loops
            if draft_loops == loops:  # drafting with the verifier's own depth: every draft is accepted
                assert stats.acceptance_rate == 1.0


def test_embedded_model_greedy_and_acceptance():
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = tokenizer(["The old man walked", "It was a dark and stormy night"], return_tensors="pt", padding=True)
    want = model.generate(**batch, max_new_tokens=32, do_sample=False)
    got = model.generate(**batch, max_new_tokens=32, do_sample=False, draft_loops=2, num_draft_tokens=4)
    assert torch.equal(got, want)
    assert model.speculation_stats.acceptance_rate > 0.5  # the trained model's shallow loops predict well
    assert model.speculation_stats.tokens_per_round > 2


def test_verifier_reuses_the_drafts_loops():
    """Every token position runs each loop exactly once at full depth: the verifier does not redo the draft's loops."""
    model = tiny_model("huginn", num_loops=4)
    positions = []
    model.model.loop_layers[0].register_forward_hook(lambda module, args, out: positions.append(args[0].shape[1]))
    _generate(model, PROMPTS[:1], draft_loops=2, num_draft_tokens=3)
    stats = model.speculation_stats
    prompt_runs = PROMPTS.shape[1] * 4
    # Each round: x and the k drafts through loops 0-1 (one token per forward), then loops 2-3 over k + 1 tokens.
    assert sum(positions) == prompt_runs + sum((k + 1) * 4 for k in stats.draft_lengths)
    assert len(positions) == 4 + sum((k + 1) * 2 + 2 for k in stats.draft_lengths)


def test_cache_holds_what_plain_decoding_holds():
    model = tiny_model("huginn", num_loops=3)
    plain = model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=9, do_sample=False,
                           return_dict_in_generate=True, output_scores=True)  # fmt: skip
    spec = model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=9, do_sample=False, draft_loops=1,
                          return_dict_in_generate=True, output_scores=True)  # fmt: skip
    assert torch.equal(spec.sequences, plain.sequences)
    assert len(spec.scores) == len(plain.scores) == 9
    for mine, theirs in zip(spec.scores, plain.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    plain_cache, spec_cache = (
        plain.past_key_values if hasattr(plain, "past_key_values") else plain.cache,
        (spec.past_key_values if hasattr(spec, "past_key_values") else spec.cache),
    )
    assert len(spec_cache.layers) == len(plain_cache.layers)
    for mine, theirs in zip(spec_cache.layers, plain_cache.layers, strict=True):
        assert mine.get_seq_length() == theirs.get_seq_length() == PROMPTS.shape[1] + 8
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-5)


def test_stopping_on_eos_and_streaming():
    model = tiny_model("ouro", num_loops=3)
    plain = _generate(model, PROMPTS[:1])
    eos = int(plain[0, PROMPTS.shape[1] + 5])  # a token greedy decoding emits: generation stops there

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.chunks.append("end")

    streamer = Collect()
    kwargs = dict(max_new_tokens=14, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = model.generate(PROMPTS, attention_mask=MASK, **kwargs)
    got = model.generate(PROMPTS, attention_mask=MASK, draft_loops=1, num_draft_tokens=4, **kwargs)
    assert torch.equal(got, want)
    got = model.generate(PROMPTS[:1], draft_loops=2, num_draft_tokens=4, streamer=streamer, **kwargs)
    assert torch.equal(got, model.generate(PROMPTS[:1], **kwargs)) and int(got[0, -1]) == eos
    assert streamer.chunks[0] == PROMPTS[0].tolist() and streamer.chunks[-1] == "end"
    assert sum(streamer.chunks[1:-1], []) == got[0, PROMPTS.shape[1] :].tolist()


def _peaky_model(loops: int) -> TinyLoopForCausalLM:
    """A small-vocabulary model whose next-token distributions are far from uniform and change with depth."""
    model = tiny_model("huginn", num_loops=loops, vocab_size=12, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model


def _exact_second_and_third(model: TinyLoopForCausalLM, prompt: torch.Tensor, loops: int) -> torch.Tensor:
    """P(second and third new token) [V, V] of plain sampling at ``loops`` (the first one summed out; it comes from
    the prompt's forward, before any drafting)."""
    with torch.no_grad():
        vocab = model.config.vocab_size
        tokens = torch.arange(vocab)

        def next_probs(ids: torch.Tensor) -> torch.Tensor:
            return torch.softmax(model(ids, num_loops=loops).logits[:, -1].float(), -1)

        first = next_probs(prompt)[0]  # [V]
        one = torch.cat([prompt.expand(vocab, -1), tokens[:, None]], dim=1)
        second = next_probs(one)  # [V1, V2]
        two = torch.cat([one.repeat_interleave(vocab, 0), tokens.repeat(vocab)[:, None]], dim=1)
        third = next_probs(two).view(vocab, vocab, vocab)  # [V1, V2, V3]
    return (first[:, None, None] * second[:, :, None] * third).sum(0)


def test_sampling_keeps_the_target_distribution():
    model = _peaky_model(loops=4)
    prompt = torch.tensor([[3, 7, 1, 9]])
    target, draft = _exact_second_and_third(model, prompt, 4), _exact_second_and_third(model, prompt, 1)
    assert 0.5 * (target - draft).abs().sum() > 0.15  # drafts alone would be visibly wrong
    rows = 20000
    torch.manual_seed(0)
    out = model.generate(prompt.expand(rows, -1), max_new_tokens=3, min_new_tokens=3, do_sample=True, top_k=0,
                         draft_loops=1, num_draft_tokens=2, pad_token_id=0)  # fmt: skip
    stats = model.speculation_stats
    assert stats.drafted > 0 and 0.2 < stats.acceptance_rate < 0.9  # accepted drafts and rejections both occur
    pairs = out[:, -2] * 12 + out[:, -1]
    empirical = torch.bincount(pairs, minlength=144).float().view(12, 12) / rows
    assert 0.5 * (empirical - target).abs().sum() < 0.02  # sampling noise at 20000 rows: 0.004-0.006


def test_fields_survive_save_and_reload_and_reach_pipeline(tmp_path):
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.draft_loops = 2
    model.generation_config.num_draft_tokens = 3
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert (reloaded.generation_config.draft_loops, reloaded.generation_config.num_draft_tokens) == (2, 3)
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    got = reloaded.generate(ids, max_new_tokens=12, do_sample=False)
    assert set(reloaded.speculation_stats.draft_lengths) <= {3, 2, 1, 0} and reloaded.speculation_stats.rounds > 0
    plain = reloaded.generate(ids, max_new_tokens=12, do_sample=False,
                              generation_config=GenerationConfig(do_sample=False, max_new_tokens=12))  # fmt: skip
    assert torch.equal(got, plain)
    generator = pipeline("text-generation", model=reloaded, tokenizer=tokenizer)
    reloaded.speculation_stats = None
    text = generator("Once upon a time", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert reloaded.speculation_stats is not None and text == tokenizer.decode(got[0], skip_special_tokens=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draft_loops=0), r"draft_loops must be an integer in \[1, num_loops=3\]"),
        (dict(draft_loops=4), r"draft_loops must be an integer in \[1, num_loops=3\]"),
        (dict(draft_loops="2"), "draft_loops must be an integer"),
        (dict(draft_loops=1, num_draft_tokens=0), "num_draft_tokens must be a positive integer or 'adaptive'"),
        (dict(draft_loops=1, num_draft_tokens="fast"), "num_draft_tokens must be a positive integer or 'adaptive'"),
        (dict(num_draft_tokens=3), "num_draft_tokens needs draft_loops"),
        (dict(draft_loops=1, num_beams=2), "draft_loops needs num_beams=1"),
        (dict(draft_loops=1, num_loops=[3]), "draft_loops needs one num_loops for every row"),
        (dict(draft_loops=1, exit_threshold=0.5), "cannot be combined with exit_threshold"),
        (dict(draft_loops=1, exit_threshold=0.0), "cannot be combined with exit_threshold"),
        (dict(draft_loops=1, exit_at_step=0), "cannot be combined with exit_at_step"),
        (dict(draft_loops=1, use_cache=False), "needs the KV cache"),
    ],
)
def test_bad_settings_fail_when_generate_starts(kwargs, match):
    model = tiny_model("ouro")
    with pytest.raises(ValueError, match=match):
        model.generate(PROMPTS[:1], max_new_tokens=3, **kwargs)


@pytest.mark.parametrize("variant", ["ouro", "huginn", "llama"])
def test_paged_cache_greedy_equals_plain_decoding(variant):
    """The CUDA path's paged cache (here on the reference path): one length serves every slot, the verifier steps
    back over the draft's tokens and appends them at its deeper loops; what it holds afterwards is what plain
    decoding holds, and a verify never appends more tokens than paged attention serves."""
    model = tiny_model(variant, num_loops=3)
    config = model.config
    longest = PagedTinyLoopCache(config).max_continuation_tokens(config)
    for ids, mask in ((PROMPTS[:1], None), (PROMPTS, MASK)):
        caches = [PagedTinyLoopCache(config, capacity=64) for _ in range(2)]
        want = _generate(model, ids, mask, **{GENERATE_CACHE_KEY: caches[0]})
        got = _generate(model, ids, mask, draft_loops=1, num_draft_tokens=16, **{GENERATE_CACHE_KEY: caches[1]})
        assert torch.equal(got, want), variant
        stats = model.speculation_stats
        assert stats.rounds > 0 and max(stats.draft_lengths) == longest - 1
        assert caches[0].length == caches[1].length == got.shape[1] - 1
        assert caches[0].slot_lengths == caches[1].slot_lengths
        for slot in caches[0].slot_lengths:
            plain, speculative = (cache.gather(slot, cache.length, torch.float32) for cache in caches)
            for want_kv, got_kv in zip(plain, speculative, strict=True):
                torch.testing.assert_close(got_kv, want_kv, rtol=1e-4, atol=1e-5)


def test_paged_resume_steps_back_over_the_draft():
    model = tiny_model("huginn", num_loops=3)
    assert model.config.num_coda_layers == 1
    cache = PagedTinyLoopCache(model.config, capacity=64)
    with torch.no_grad():
        model(PROMPTS[:1], past_key_values=cache, use_cache=True)
    coda = cache.slot_index("coda", 0)
    before = dict(cache.slot_lengths)
    cache.prepare_resume(2)
    assert cache.length == PROMPTS.shape[1] - 2 and cache.slot_lengths[coda] == cache.length
    assert all(cache.slot_lengths[slot] == before[slot] for slot in before if slot != coda)  # pages keep the rest
    with pytest.raises(ValueError, match="cannot resume 9 tokens"):
        cache.prepare_resume(9)
