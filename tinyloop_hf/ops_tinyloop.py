"""The op layer: every numeric op the model runs, by (op name, backend).

Model modules never compute directly; they look up ``get_op(name, backend)`` with their own ``op_backend``. The
"reference" backend below is plain PyTorch, runs anywhere and defines the expected numbers. Other backends (the
CUDA kernels) register under their own name; asking for a pair nobody registered raises, it never falls back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .compat import graph_capturing
from .mkl_warmup import warm_up

warm_up()  # before the reference path's first multi-threaded unary op (see mkl_warmup)

REFERENCE = "reference"

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {}


def register_op(name: str, backend: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make ``fn`` the implementation of op ``name`` on ``backend``."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY.setdefault(name, {})[backend] = fn
        return fn

    return decorator


def get_op(name: str, backend: str) -> Callable[..., Any]:
    try:
        return _REGISTRY[name][backend]
    except KeyError:
        known = sorted(_REGISTRY.get(name, {}))
        raise NotImplementedError(
            f"op {name!r} has no implementation for backend {backend!r}; backends with this op: {known}"
        ) from None


def backends_of(name: str) -> list[str]:
    return sorted(_REGISTRY.get(name, {}))


# ----------------------------------------------------------------------------------------------------------------------
# Reference implementations
# ----------------------------------------------------------------------------------------------------------------------


@register_op("linear", REFERENCE)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T + b.  x: [..., in], weight: [out, in]."""
    return F.linear(x, weight, bias)


@register_op("rms_norm", REFERENCE)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in fp32 (as Llama, Ouro and Huginn)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@register_op("swiglu", REFERENCE)
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class Junction:
    """A block's residual junction as the fused block-level ops take it (see the residual_norm op): the residual
    stream ``x``, the sublayer output ``branch``, the branch's norm weight (sandwich / post modes), the next
    sublayer's input-norm weight, eps and mode ("pre", "sandwich", "post_residual")."""

    x: torch.Tensor
    branch: torch.Tensor
    branch_weight: torch.Tensor | None
    next_weight: torch.Tensor
    eps: float
    mode: str

    def residual_norm_args(self) -> tuple:
        return self.x, self.branch, self.branch_weight, self.next_weight, self.eps, self.mode


# RoPE inverse frequencies per (device, head_dim, theta). They are the same for every step, and each step of a CUDA
# graph would otherwise replay the four small kernels that make them (an arange, a division, a power, a reciprocal).
_INV_FREQ: dict[tuple[torch.device, int, float], torch.Tensor] = {}


def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """theta^(-2i / head_dim) for i < head_dim / 2 in fp32, computed on ``device`` once (outside a CUDA-graph capture,
    which executes nothing: a tensor made there would hold no values when used eagerly later)."""
    key = (torch.device(device), head_dim, float(theta))
    inv_freq = _INV_FREQ.get(key)
    if inv_freq is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        inv_freq = 1.0 / (theta**exponents)
        if not graph_capturing():
            _INV_FREQ[key] = inv_freq
    return inv_freq


@register_op("rope_angles", REFERENCE)
def rope_angles(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, S, head_dim // 2] in fp32 for integer positions [B, S]."""
    inv_freq = rope_inv_freq(head_dim, theta, position_ids.device)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, S, D/2]
    return angles.cos(), angles.sin()


@register_op("rope", REFERENCE)
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate x [B, H, S, D] by per-position angles (cos/sin [B, S, D/2]); math in fp32, result in x.dtype.

    "rotate_half" pairs dim i with i + D/2 (Llama, Ouro); "interleaved" pairs 2i with 2i + 1 (Huginn).
    """
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, S, D/2]
    x32 = x.float()
    if layout == "rotate_half":
        first, second = x32.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    elif layout == "interleaved":
        pairs = x32.unflatten(-1, (-1, 2))
        real, imag = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((real * cos - imag * sin, imag * cos + real * sin), dim=-1).flatten(-2)
    else:
        raise ValueError(f"rope layout must be 'rotate_half' or 'interleaved', got {layout!r}")
    return rotated.to(x.dtype)


@register_op("attention", REFERENCE)
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    implementation: str = "sdpa",
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with grouped KV heads.

    query [B, Hq, S, D]; key/value [B, Hkv, T, D]; mask: bool [B, 1, S, T] (True = may attend) or None;
    is_causal: top-left causal mask when S == T and mask is None. Returns [B, Hq, S, D].
    ``implementation`` "eager" spells the softmax out (it is what ``attn_implementation="eager"`` selects).
    """
    groups = query.shape[1] // key.shape[1]
    if implementation == "eager":
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
        if mask is None and is_causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(weights, value)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale, enable_gqa=groups > 1
    )
