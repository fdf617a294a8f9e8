"""Ouro's exit distribution over loops, and per-token state selection from it (reference semantics)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def exit_distribution(gate_logits: list[torch.Tensor], loops_per_row: torch.Tensor | None) -> torch.Tensor:
    """p_t = sigmoid(g_t) * prod_{j<t} (1 - sigmoid(g_j)); the last loop of each row takes the remaining mass.

    gate_logits: one [B, S] tensor per loop run; loops_per_row: [B] depths (None = all rows ran every loop).
    Returns [B, S, T]; rows that ran fewer loops have p = 0 beyond their depth. The arithmetic order is the
    reference's, so a uniform batch reproduces it bit for bit.
    """
    total = len(gate_logits)
    remaining = torch.ones_like(gate_logits[0])
    probabilities = []
    for step, gate in enumerate(gate_logits):
        exit_here = torch.sigmoid(gate)
        if loops_per_row is None:
            probability = exit_here * remaining if step < total - 1 else remaining
        else:
            last = (loops_per_row - 1)[:, None]
            probability = torch.where(step < last, exit_here * remaining, remaining)
            probability = torch.where(step > last, torch.zeros_like(remaining), probability)
        probabilities.append(probability)
        remaining = remaining * (1.0 - exit_here)
    return torch.stack(probabilities, dim=2)


def threshold_exit_steps(
    probabilities: torch.Tensor, threshold: float, loops_per_row: torch.Tensor | None
) -> torch.Tensor:
    """First loop whose cumulative exit probability reaches ``threshold`` ([B, S], 0-based); else the row's last."""
    reached = torch.cumsum(probabilities, dim=2) >= threshold
    steps = torch.argmax(reached.float(), dim=2)
    last = probabilities.shape[2] - 1 if loops_per_row is None else (loops_per_row - 1)[:, None].expand_as(steps)
    return torch.where(reached.any(dim=2), steps, last)


def select_states(states: list[torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
    """Per token, the state of loop ``steps[b, s]``: states are [B, S, H] per loop, steps [B, S]."""
    stacked = torch.stack(states, dim=2)  # [B, S, T, H]
    index = steps[..., None, None].expand(-1, -1, 1, stacked.shape[-1])
    return torch.gather(stacked, 2, index).squeeze(2)


EARLY_EXIT_CRITERIA = ("gate", "state_delta", "kl")


class EarlyExit:
    """Per-token early exit that saves compute (decode steps, one token per row): after each loop a row stops when
    its criterion is met, and the loops it skips reuse its last computed loop's K/V.

    - "gate": Ouro's rule, the cumulative exit probability of the exit gate reaches ``threshold`` (in (0, 1]);
    - "state_delta": the loop changed the state by less than ``threshold`` of its size, |h_t - h_t-1| / |h_t-1|;
    - "kl": KL(p_t || p_t-1) < ``threshold`` nats between successive loops' next-token distributions, read from the
      state through the final norm and the LM head (``read_logits``; the coda is not run for this).
    """

    def __init__(self, criterion: Any, threshold: Any, exit_gate: bool, read_logits: Callable | None = None) -> None:
        """Fails naming the field and the allowed values; "kl" needs ``read_logits`` (the LM head)."""
        if criterion not in EARLY_EXIT_CRITERIA:
            raise ValueError(f"early_exit must be one of {list(EARLY_EXIT_CRITERIA)}, got {criterion!r}")
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 < threshold < math.inf:
            raise ValueError(f"early_exit_threshold must be a positive number, finite, for early_exit={criterion!r}, "
                             f"got {threshold!r}")  # fmt: skip
        if criterion == "gate" and (threshold > 1 or not exit_gate):
            raise ValueError(
                "early_exit='gate' needs a model with an exit gate (TinyLoopConfig.exit_gate=True) and "
                f"early_exit_threshold in (0, 1], got exit_gate={exit_gate}, early_exit_threshold={threshold!r}"
            )
        if criterion == "kl" and read_logits is None:
            raise ValueError("early_exit='kl' reads next-token distributions: call TinyLoopForCausalLM")
        self.criterion, self.threshold, self.read_logits = criterion, float(threshold), read_logits
        self._remaining: torch.Tensor | None = None
        self._cumulative: torch.Tensor | None = None
        self._previous: torch.Tensor | None = None

    def exits(self, loop: int, state: torch.Tensor, previous: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """[B] rows whose criterion is met after ``loop`` (state, previous: [B, 1, H]; gate logits [B, 1])."""
        if self.criterion == "gate":
            exit_here = torch.sigmoid(gate[:, 0].float())
            if loop == 0 or self._remaining is None:
                self._remaining, self._cumulative = torch.ones_like(exit_here), torch.zeros_like(exit_here)
            self._cumulative = self._cumulative + exit_here * self._remaining
            self._remaining = self._remaining * (1.0 - exit_here)
            return self._cumulative >= self.threshold
        if self.criterion == "state_delta":
            if loop == 0:
                return torch.zeros(state.shape[0], dtype=torch.bool, device=state.device)
            change = (state - previous).float().norm(dim=-1) / previous.float().norm(dim=-1).clamp(min=1e-6)
            return change[:, 0] < self.threshold
        log_probs = torch.log_softmax(self.read_logits(state)[:, 0].float(), dim=-1)
        before, self._previous = self._previous if loop > 0 else None, log_probs
        if before is None:
            return torch.zeros(state.shape[0], dtype=torch.bool, device=state.device)
        divergence = (log_probs.exp() * (log_probs - before)).sum(dim=-1)
        return divergence < self.threshold
