"""Fuzz: cached generation equals the uncached full forward, over random shapes, depths and padding."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import VARIANTS, tiny_model

CASES = 64
MODELS = {variant: tiny_model(variant, seed=11) for variant in VARIANTS}


def _case(seed: int):
    rng = random.Random(seed)
    variant = rng.choice(sorted(VARIANTS))
    batch = rng.randint(1, 3)
    lengths = [rng.randint(1, 9) for _ in range(batch)]
    if rng.random() < 0.5:
        loops = rng.randint(1, 5)
    else:
        loops = [rng.randint(1, 5) for _ in range(batch)]
    return variant, lengths, loops, rng.randint(1, 6), seed


@pytest.mark.parametrize("variant, lengths, loops, new_tokens, seed", [_case(seed) for seed in range(CASES)])
def test_cached_generation_equals_full_forward(variant, lengths, loops, new_tokens, seed):
    model = MODELS[variant]
    width = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(1, 256, (length,), generator=generator)
        mask[row, width - length :] = 1
    output = model.generate(
        ids,
        attention_mask=mask,
        num_loops=loops,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    step_logits = torch.stack(output.logits, dim=1)  # [B, new, V]
    full_mask = torch.cat([mask, torch.ones(len(lengths), new_tokens, dtype=torch.long)], dim=1)
    with torch.no_grad():
        full = model(output.sequences, attention_mask=full_mask, num_loops=loops).logits
    expected = full[:, width - 1 : width - 1 + new_tokens]
    assert torch.allclose(step_logits, expected, atol=1e-4), (step_logits - expected).abs().max()
    assert torch.equal(output.sequences[:, width:], step_logits.argmax(-1))
