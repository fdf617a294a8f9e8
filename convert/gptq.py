"""GPTQ (Frantar et al., 2022) for one weight matrix, writing the package's packed format.

Columns are quantized one at a time; each column's rounding error is spread over the not-yet-quantized columns
through the inverse Hessian of the layer inputs (H = 2/n sum x x^T), in blocks of 128 columns. By default columns
go in activation order with static groups (see ``gptq_quantize``); without act_order they go left to right and a
group's parameters come from the error-updated weights when the group starts (groups start at multiples of their
size, so they never straddle a block; a short last group is simply narrower).
"""

from __future__ import annotations

import torch

from tinyloop_hf.quant_tinyloop import (
    SCALE_DTYPES,
    PackedWeight,
    QuantFormat,
    group_parameters,
    pack,
    quantize_codes,
    split_groups,
)

BLOCK = 128


class HessianAccumulator:
    """Running H = 2/n sum_i x_i x_i^T over every row x_i [K] seen by a linear layer (all loops included)."""

    def __init__(self, columns: int, device: torch.device) -> None:
        self.hessian = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, inputs: torch.Tensor) -> None:
        x = inputs.reshape(-1, inputs.shape[-1]).float()
        total = self.rows + x.shape[0]
        self.hessian *= self.rows / total
        x = x * (2.0 / total) ** 0.5
        self.hessian += x.T @ x
        self.rows = total


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, fmt: QuantFormat, damping: float = 0.01, act_order: bool = True
) -> PackedWeight:
    """Quantize ``weight`` [N, K] given the input Hessian [K, K].

    ``act_order`` visits columns by decreasing Hessian diagonal (the inputs with the most energy first, which matters
    for models with outlier features) with *static* groups: each group's scale and zero come from the original
    weights of its contiguous columns, so the packed layout stays the plain contiguous-group one.
    """
    rows, columns = weight.shape
    fmt.check_shape(columns)
    width = fmt.group_width(columns)
    W = weight.detach().float().clone()
    H = hessian.clone().float().to(W.device)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    scales = torch.zeros(rows, fmt.groups(columns), dtype=torch.float32, device=W.device)
    zeros = torch.zeros(rows, fmt.groups(columns), dtype=torch.int64, device=W.device)
    static = act_order or fmt.group_size is None
    if static:
        scale, zero = group_parameters(split_groups(W, fmt), fmt)
        scales[:], zeros[:] = scale.reshape(rows, -1), zero.reshape(rows, -1).to(torch.int64)
    order = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(columns, device=W.device)
    W, H = W[:, order], H[order][:, order]
    H += damping * torch.mean(torch.diag(H)) * torch.eye(columns, device=H.device)
    H_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.zeros(rows, columns, dtype=torch.int64, device=W.device)
    for start in range(0, columns, BLOCK):
        end = min(start + BLOCK, columns)
        block = W[:, start:end].clone()
        errors = torch.zeros_like(block)
        block_inv = H_inv[start:end, start:end]
        for offset in range(end - start):
            column = int(order[start + offset])  # position in the original (packed) layout
            group = column // width
            if not static and column % width == 0:
                scales[:, group], zeros[:, group] = group_parameters(block[:, offset : offset + width], fmt)
            code = quantize_codes(block[:, offset : offset + 1], scales[:, group], zeros[:, group], fmt)[:, 0]
            codes[:, column] = code.to(torch.int64)
            dequantized = (code - zeros[:, group]) * scales[:, group]
            error = (block[:, offset] - dequantized) / block_inv[offset, offset]
            block[:, offset:] -= error[:, None] * block_inv[offset, offset:][None, :]
            errors[:, offset] = error
        W[:, end:] -= errors @ H_inv[start:end, end:]
    return pack(codes.cpu(), scales.to(SCALE_DTYPES[fmt.scale_dtype]).cpu(), zeros.cpu(), fmt)
