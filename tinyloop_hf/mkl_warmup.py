"""Resolve oneMKL's VML kernel dispatch before the reference path's first parallel op.

PyTorch CPU builds route contiguous float32 / float64 unary ops (cos, sin, exp, sqrt, ...) to MKL VML, each intra-op
thread calling it on its chunk. oneMKL 2024.2 (the version torch 2.10-2.13 wheels bundle) picks a function's kernel
lazily on its first call, and when that first call runs on several threads at once one thread can use a
low-accuracy kernel for its whole chunk (pytorch/pytorch#188792, fix proposed in #188791; oneMKL >= 2025.0 is not
affected). Here: torch 2.13 with 2 threads, ``rope_angles``'s first call in about 1 process in 20 had cos values
7.8e-5 off for the half of the table the second thread computed. One single-element call of each function and
dtype, made once at import, settles the dispatch on one thread (measured: 2 of 40 fresh processes corrupted without
it, 0 of 40 with it).
"""

from __future__ import annotations

import torch

# Unary ops ATen sends to VML (aten/src/ATen/cpu/vml.h) that models or their tests may call.
VML_UNARY = (
    "acos", "asin", "atan", "cos", "cosh", "erf", "erfc", "erfinv", "exp", "expm1", "lgamma", "log", "log10", "log1p",
    "log2", "reciprocal", "rsqrt", "sigmoid", "sin", "sinh", "sqrt", "tan", "tanh",
)  # fmt: skip


def warm_up() -> None:
    """Call every VML_UNARY op once on a one-element float32 and float64 tensor (a few hundred microseconds)."""
    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_UNARY:
            getattr(torch, name)(x)
