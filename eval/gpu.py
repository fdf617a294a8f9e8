"""The GPU-only eval tools' first check: on a machine without a CUDA GPU they stop with one line, not a traceback."""

from __future__ import annotations

import sys

import torch


def require_gpu(tool: str) -> None:
    """Exit with status 2 and a message naming ``tool`` unless a CUDA GPU is available."""
    if not torch.cuda.is_available():
        print(f"{tool} needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        sys.exit(2)
