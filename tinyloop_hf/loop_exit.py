"""Ouro's exit distribution over loops, and per-token state selection from it (reference semantics)."""

from __future__ import annotations

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
