"""Quality of a quantized model against its unquantized source, per loop depth, on held-out text."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from tinyloop_hf import TinyLoopForCausalLM


def text_windows(tokenizer: PreTrainedTokenizerBase, text: str, length: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [n, length] of the tokenized text (the remainder is dropped)."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False).input_ids, dtype=torch.long)
    count = len(ids) // length if limit is None else min(limit, len(ids) // length)
    if count == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {length}")
    return ids[: count * length].reshape(count, length)


def calibration_windows(
    tokenizer: PreTrainedTokenizerBase, text: str, samples: int, length: int, seed: int = 0
) -> torch.Tensor:
    """``samples`` windows of ``length`` tokens at random (seeded) offsets of the tokenized text."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False).input_ids, dtype=torch.long)
    if len(ids) <= length:
        raise ValueError(f"calibration text has {len(ids)} tokens; need more than {length}")
    starts = torch.randint(0, len(ids) - length, (samples,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([ids[start : start + length] for start in starts.tolist()])


@dataclass
class DepthQuality:
    depth: int
    top1_agreement: float
    kl: float  # mean KL(p_reference || p_quantized) per token, nats
    perplexity_reference: float
    perplexity_quantized: float

    @property
    def perplexity_change(self) -> float:
        return self.perplexity_quantized / self.perplexity_reference - 1.0


@torch.no_grad()
def compare(
    reference: TinyLoopForCausalLM,
    quantized: TinyLoopForCausalLM,
    windows: torch.Tensor,
    depths: list[int],
    batch_size: int = 4,
) -> list[DepthQuality]:
    device = next(quantized.parameters()).device
    rows = []
    for depth in depths:
        agree = kl = nll_reference = nll_quantized = 0.0
        tokens = 0
        for start in range(0, windows.shape[0], batch_size):
            ids = windows[start : start + batch_size].to(device)
            log_p = reference(ids, num_loops=depth).logits.float().log_softmax(-1)[:, :-1]
            log_q = quantized(ids, num_loops=depth).logits.float().log_softmax(-1)[:, :-1]
            targets = ids[:, 1:, None]
            agree += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
            kl += (log_p.exp() * (log_p - log_q)).sum().item()
            nll_reference -= log_p.gather(-1, targets).sum().item()
            nll_quantized -= log_q.gather(-1, targets).sum().item()
            tokens += targets.numel()
        rows.append(
            DepthQuality(
                depth, agree / tokens, kl / tokens, math.exp(nll_reference / tokens), math.exp(nll_quantized / tokens)
            )
        )
    return rows


@torch.no_grad()
def perplexity(
    model: TinyLoopForCausalLM, windows: torch.Tensor, depth: int | None = None, batch_size: int = 8
) -> float:
    device = next(model.parameters()).device
    nll, tokens = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start : start + batch_size].to(device)
        log_p = model(ids, num_loops=depth).logits.float().log_softmax(-1)[:, :-1]
        nll -= log_p.gather(-1, ids[:, 1:, None]).sum().item()
        tokens += ids[:, 1:].numel()
    return math.exp(nll / tokens)


def format_table(rows: list[DepthQuality], title: str) -> str:
    lines = [
        title,
        f"{'loops':>5}  {'top-1 agree':>11}  {'KL (nats)':>9}  {'ppl fp':>9}  {'ppl quant':>9}  {'change':>7}",
    ]
    for row in rows:
        lines.append(
            f"{row.depth:>5}  {row.top1_agreement:>11.4f}  {row.kl:>9.5f}  {row.perplexity_reference:>9.3f}  "
            f"{row.perplexity_quantized:>9.3f}  {100 * row.perplexity_change:>+6.2f}%"
        )
    return "\n".join(lines)
