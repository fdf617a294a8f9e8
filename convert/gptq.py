"""GPTQ (Frantar et al., 2022) for one weight matrix, writing the package's packed format.

Columns are quantized left to right; each column's rounding error is spread over the not-yet-quantized columns
through the inverse Hessian of the layer inputs (H = 2/n sum x x^T), in blocks of 128 columns. Group parameters
are taken from the error-updated weights when a group starts (groups of 32/64/128 start at multiples of their size,
so they never straddle a block; a short last group is simply narrower).
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


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, fmt: QuantFormat, damping: float = 0.01) -> PackedWeight:
    """Quantize ``weight`` [N, K] given the input Hessian [K, K]."""
    rows, columns = weight.shape
    fmt.check_shape(columns)
    width = fmt.group_width(columns)
    W = weight.detach().float().clone()
    H = hessian.clone().float()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damping * torch.mean(torch.diag(H)) * torch.eye(columns, device=H.device)
    H_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.zeros(rows, columns, dtype=torch.int64, device=W.device)
    scales = torch.zeros(rows, fmt.groups(columns), dtype=torch.float32, device=W.device)
    zeros = torch.zeros(rows, fmt.groups(columns), dtype=torch.int64, device=W.device)
    if fmt.group_size is None:
        scale, zero = group_parameters(W, fmt)
        scales[:, 0], zeros[:, 0] = scale, zero
    for start in range(0, columns, BLOCK):
        end = min(start + BLOCK, columns)
        block = W[:, start:end].clone()
        errors = torch.zeros_like(block)
        block_inv = H_inv[start:end, start:end]
        for offset in range(end - start):
            column = start + offset
            if fmt.group_size is not None and column % width == 0:
                scale, zero = group_parameters(block[:, offset : offset + width], fmt)
                scales[:, column // width], zeros[:, column // width] = scale, zero
            group = column // width
            code = quantize_codes(block[:, offset : offset + 1], scales[:, group], zeros[:, group], fmt)[:, 0]
            codes[:, column] = code.to(torch.int64)
            dequantized = (code - zeros[:, group]) * scales[:, group]
            error = (block[:, offset] - dequantized) / block_inv[offset, offset]
            block[:, offset:] -= error[:, None] * block_inv[offset, offset:][None, :]
            errors[:, offset] = error
        W[:, end:] -= errors @ H_inv[start:end, end:]
    return pack(codes.cpu(), scales.to(SCALE_DTYPES[fmt.scale_dtype]).cpu(), zeros.cpu(), fmt)
