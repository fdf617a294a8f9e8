"""Parity report: the converted model against the source's own implementation, where one runs offline.

Llama and Qwen2 sources are compared with transformers' own classes. Ouro and Huginn need their remote code,
which is not part of transformers; their parity is tested against recorded reference outputs in tests/.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from .core import Source


@dataclass
class ParityResult:
    prompts: int
    max_abs_logit_diff: float
    greedy_tokens_equal: int  # prompts whose greedy continuation is identical
    new_tokens: int

    def table(self) -> str:
        return (
            "parity vs transformers reference (fp32)\n"
            f"  prompts                 {self.prompts}\n"
            f"  max |delta logit|       {self.max_abs_logit_diff:.3e}\n"
            f"  identical greedy ({self.new_tokens:>3} tokens) {self.greedy_tokens_equal}/{self.prompts}"
        )


def reference_model(source: Source) -> PreTrainedModel | None:
    """The source checkpoint in transformers' own implementation, or None when there is none offline."""
    if not source.format.has_reference_in_transformers:
        return None
    return AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=torch.float32
    ).eval()


@torch.no_grad()
def compare(
    converted: PreTrainedModel,
    reference: PreTrainedModel,
    *,
    prompts: int = 4,
    length: int = 16,
    new_tokens: int = 16,
    seed: int = 0,
) -> ParityResult:
    generator = torch.Generator().manual_seed(seed)
    vocab = min(converted.config.vocab_size, reference.config.vocab_size)
    inputs = torch.randint(0, vocab, (prompts, length), generator=generator)
    converted, reference = converted.float(), reference.float()
    logit_diff = (converted(inputs).logits - reference(inputs).logits).abs().max().item()
    equal = 0
    for row in inputs:
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        ours = converted.generate(row[None], **kwargs)
        theirs = reference.generate(row[None], **kwargs)
        equal += int(torch.equal(ours, theirs))
    return ParityResult(prompts, logit_diff, equal, new_tokens)
