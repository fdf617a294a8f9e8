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

    dtype: torch.dtype = torch.float32  # both models' weights (computed in fp32)

    def table(self) -> str:
        return (
            f"parity vs transformers reference (weights in {str(self.dtype).removeprefix('torch.')}, run in fp32)\n"
            f"  prompts                 {self.prompts}\n"
            f"  max |delta logit|       {self.max_abs_logit_diff:.3e}\n"
            f"  identical greedy ({self.new_tokens:>3} tokens) {self.greedy_tokens_equal}/{self.prompts}"
        )


def reference_model(source: Source, dtype: torch.dtype = torch.float32) -> PreTrainedModel | None:
    """The source checkpoint in transformers' own implementation, in ``dtype`` (the converted model's: a bfloat16
    conversion is compared in bfloat16, not against fp32 rounding), or None when there is none offline."""
    if not source.format.has_reference_in_transformers:
        return None
    return AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=dtype).eval()


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
    """Both models run in fp32 from weights rounded alike (``reference_model`` loads the reference in the converted
    model's dtype), so that only the conversion shows, not two implementations' bf16 arithmetic."""
    generator = torch.Generator().manual_seed(seed)
    vocab = min(converted.config.vocab_size, reference.config.vocab_size)
    inputs = torch.randint(0, vocab, (prompts, length), generator=generator)
    dtype = converted.dtype
    # torch's own cast: transformers' .float() refuses a model loaded from GGUF (it counts as quantized).
    reference = torch.nn.Module.float(reference)
    try:
        return _compare(converted.float(), reference, inputs, new_tokens, dtype)
    finally:
        converted.to(dtype)  # in place, and exact: the caller's model (it may be written next) keeps its dtype


def _compare(
    converted: PreTrainedModel, reference: PreTrainedModel, inputs: torch.Tensor, new_tokens: int, dtype: torch.dtype
) -> ParityResult:
    logit_diff = (converted(inputs).logits - reference(inputs).logits).abs().max().item()
    equal = 0
    for row in inputs:
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        ours = converted.generate(row[None], **kwargs)
        theirs = reference.generate(row[None], **kwargs)
        equal += int(torch.equal(ours, theirs))
    return ParityResult(len(inputs), logit_diff, equal, new_tokens, dtype)
