"""Llama and Qwen2 (the L = 1 case) against transformers' own implementations, on random tiny configs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tinyloop_hf import TinyLoopForCausalLM
from tinyloop_hf.convert import convert_checkpoint

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=None,
    bos_token_id=None,
)
CASES = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig(**COMMON, num_key_value_heads=2, rope_theta=500000.0)),
    "llama-tied-mha": (LlamaForCausalLM, LlamaConfig(**COMMON, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2": (
        Qwen2ForCausalLM,
        Qwen2Config(**COMMON, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=False),
    ),
    "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config(**COMMON, num_key_value_heads=1, tie_word_embeddings=True)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "norm" in name:
                parameter.copy_(torch.rand(parameter.shape, generator=generator) * 0.8 + 0.6)
            elif parameter.dim() == 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    model_class, config = CASES[request.param]
    torch.manual_seed(0)
    reference = model_class(config).eval()
    _randomize(reference, seed=len(request.param))
    source = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(source)
    destination = convert_checkpoint(source, tmp_path_factory.mktemp(request.param + "-tl"))
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    converted = TinyLoopForCausalLM.from_pretrained(destination).eval()
    return reference, converted


def test_logits_match(pair):
    reference, converted = pair
    ids = torch.randint(1, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (converted(ids).logits - reference(ids).logits).abs().max().item() <= 1e-4


def test_greedy_and_left_padded_batch_match(pair):
    reference, converted = pair
    ids = torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0  # row 0 is left-padded
    kwargs = dict(attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(converted.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_beam_search_matches(pair):
    reference, converted = pair
    ids = torch.randint(1, 300, (1, 8), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=10, num_beams=3, num_return_sequences=2, do_sample=False)
    assert torch.equal(converted.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_labels_loss_matches(pair):
    reference, converted = pair
    ids = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = converted(ids, labels=ids).loss, reference(ids, labels=ids).loss
    assert torch.allclose(ours, theirs, atol=1e-5)
