"""generate(): loop depth as a generation field, decoding strategies, streaming, stopping, padding, the cache."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList, TextStreamer

from helpers import VARIANTS, tiny_model
from tinyloop_hf import TinyLoopCache, TinyLoopForCausalLM
from tinyloop_hf.compat import GENERATE_CACHE_KEY

PROMPT = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(5))


def _greedy(model, ids=PROMPT, **kwargs):
    return model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, **kwargs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_greedy_equals_uncached(variant):
    model = tiny_model(variant)
    assert torch.equal(_greedy(model), _greedy(model, use_cache=False))


def test_num_loops_from_kwarg_generation_config_and_json(tmp_path):
    model = tiny_model("huginn")
    at_one, at_three = _greedy(model, num_loops=1), _greedy(model, num_loops=3)
    assert not torch.equal(at_one, at_three)
    assert torch.equal(_greedy(model, generation_config=GenerationConfig(num_loops=1)), at_one)
    model.generation_config.num_loops = 1
    assert torch.equal(_greedy(model), at_one)
    assert torch.equal(_greedy(model, num_loops=3), at_three)  # the call keyword wins over the stored field
    model.save_pretrained(tmp_path)
    reloaded = TinyLoopForCausalLM.from_pretrained(tmp_path)
    assert reloaded.generation_config.num_loops == 1
    assert torch.equal(_greedy(reloaded), at_one)


def test_exit_threshold_as_a_generation_field():
    model = tiny_model("ouro")
    model.generation_config.exit_threshold = 0.0  # every token exits after the first loop
    assert torch.equal(_greedy(model), _greedy(tiny_model("ouro"), num_loops=1))


def test_per_row_loops_in_generate():
    model = tiny_model("tinyloop")
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    together = _greedy(model, ids=ids, num_loops=[1, 3])
    assert torch.equal(together[0], _greedy(model, ids=ids[:1], num_loops=1)[0])
    assert torch.equal(together[1], _greedy(model, ids=ids[1:], num_loops=3)[0])


def test_seeded_sampling_is_reproducible_and_cache_independent():
    model = tiny_model("huginn")
    kwargs = dict(do_sample=True, temperature=1.3, top_k=50, max_new_tokens=12)
    runs = []
    for use_cache in (True, True, False):
        torch.manual_seed(123)
        runs.append(model.generate(PROMPT, use_cache=use_cache, **kwargs))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    torch.manual_seed(124)
    assert not torch.equal(model.generate(PROMPT, **kwargs), runs[0])


@pytest.mark.parametrize("variant", ["ouro", "huginn"])
def test_beam_search_cached_equals_uncached(variant):
    model = tiny_model(variant)
    kwargs = dict(num_beams=4, num_return_sequences=3, max_new_tokens=8, do_sample=False)
    cached = model.generate(PROMPT, **kwargs)
    assert cached.shape == (3, 14)
    assert torch.equal(cached, model.generate(PROMPT, use_cache=False, **kwargs))


def test_text_streamer_prints_the_generated_text(tokenizer):
    model = tiny_model("ouro")
    ids = tokenizer("Loop", return_tensors="pt").input_ids
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        output = model.generate(
            ids, streamer=TextStreamer(tokenizer, skip_prompt=True), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    generated = output[0, ids.shape[1] :]
    generated = generated[generated != 0]
    assert buffer.getvalue().strip() == tokenizer.decode(generated).strip()


class _StopAfter(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_stopping_criteria_and_eos():
    model = tiny_model("ouro")
    stopped = model.generate(
        PROMPT, max_new_tokens=20, do_sample=False, stopping_criteria=StoppingCriteriaList([_StopAfter(9)])
    )
    assert stopped.shape[1] == 9
    free = _greedy(model)
    eos = int(free[0, 8])
    ended = model.generate(PROMPT, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert ended[0, -1] == eos and ended.shape[1] <= 9


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_left_padded_batch_equals_each_row_alone(variant):
    model = tiny_model(variant)
    rows = [torch.randint(1, 256, (length,), generator=torch.Generator().manual_seed(length)) for length in (3, 7, 5)]
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :], mask[index, width - len(row) :] = row, 1
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    for index, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert torch.equal(batch[index, width:], alone[0, len(row) :]), index


def test_generate_returns_a_tinyloop_cache_that_continues():
    model = tiny_model("huginn")
    first = model.generate(PROMPT, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    cache = first.past_key_values
    assert isinstance(cache, TinyLoopCache) and cache.get_seq_length() == PROMPT.shape[1] + 4
    continued = model.generate(first.sequences, **{GENERATE_CACHE_KEY: cache}, max_new_tokens=5, do_sample=False)
    assert torch.equal(continued, model.generate(PROMPT, max_new_tokens=10, do_sample=False))


def test_prompt_lookup_decoding_crops_the_cache_and_stays_greedy():
    model = tiny_model("ouro")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    assert torch.equal(
        model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=12, do_sample=False),
        model.generate(ids, max_new_tokens=12, do_sample=False),
    )


def test_unsupported_cache_requests_fail_clearly():
    from transformers import DynamicCache

    model = tiny_model("ouro")
    with pytest.raises(ValueError, match="cache_implementation='static' is not supported"):
        model.generate(PROMPT, cache_implementation="static", max_new_tokens=2)
    with pytest.raises(TypeError, match="needs a TinyLoopCache"):
        model.generate(PROMPT, **{GENERATE_CACHE_KEY: DynamicCache()}, max_new_tokens=2)
    with pytest.raises(ValueError, match="assistant_early_exit"):
        model.generate(PROMPT, assistant_early_exit=1, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_loops must be"):
        model.generate(PROMPT, num_loops=0, max_new_tokens=2)
    with pytest.raises(ValueError, match="not used by the model"):
        model.generate(PROMPT, num_loopz=2, max_new_tokens=2)


def test_per_row_loops_survive_beam_expansion():
    model = tiny_model("huginn")
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(8))
    kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False)
    together = model.generate(ids, num_loops=[1, 3], **kwargs)
    assert torch.equal(together[:2], model.generate(ids[:1], num_loops=1, **kwargs))
    assert torch.equal(together[2:], model.generate(ids[1:], num_loops=3, **kwargs))


def test_only_greedy_unconstrained_generate_runs_ahead_on_a_cuda_path(tokenizer):
    """generate() asks the CUDA path to run decode steps ahead (CudaPath.run_ahead) for greedy decoding only, with
    the pad and EOS tokens transformers resolved; sampling, and a constraint (which changes the argmax), do not.
    A stand-in path records the calls; every step runs on the reference ops."""
    from contextlib import contextmanager

    model = tiny_model("ouro", eos_token_id=5, pad_token_id=0)
    calls, settled = [], []

    class RecordingPath:
        def new_cache(self, capacity):
            return TinyLoopCache(model.config)

        def graph_key(self, *args):
            return None

        def settle(self):
            settled.append(True)

        @contextmanager
        def run_ahead(self, pad, eos):
            calls.append((int(pad), eos.tolist()))
            yield

    model._cuda_path = RecordingPath()
    ids = torch.randint(6, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    greedy = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert calls == [(0, [5])] and settled  # eager steps settle any step run ahead first
    model.generate(ids, max_new_tokens=4, do_sample=True)
    model.generate(ids[:1], max_new_tokens=4, do_sample=False, tokenizer=tokenizer, regex=r"[a-z]+")
    assert len(calls) == 1
    del model._cuda_path
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), greedy)  # the stand-in changed nothing


def test_generate_from_inputs_embeds_equals_generate_from_ids():
    model = tiny_model("ouro")
    ids = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    embeds = model.get_input_embeddings()(ids)
    want = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False), want[:, 7:])
