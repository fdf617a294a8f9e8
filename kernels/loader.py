"""Compile the CUDA C++ kernels of this folder with CuPy (NVRTC) at first use and launch them on PyTorch's stream.

Kernels are compiled once per (file, instantiation) and cached: in memory here, on disk by CuPy (``CUPY_CACHE_DIR``).
Local headers (``#include "x.cuh"``) are inlined into each source before compiling, so CuPy's disk cache (keyed by
the source text) never serves a kernel built against an older header. Launches take raw pointers (``np.uint64``),
``np.int32`` and ``np.float32`` arguments — no per-call array conversion.
"""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

KERNEL_DIR = Path(__file__).parent
MIN_CAPABILITY = (8, 0)  # bf16 math, cp.async-era GPUs (Ampere, Ada, Hopper, Blackwell)


class CudaPathUnavailable(RuntimeError):
    """The CUDA path cannot run here (no CuPy, no GPU, unsupported GPU)."""


class KernelCompileError(RuntimeError):
    """A kernel failed to compile; the message names it and carries NVRTC's log."""


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as error:
        raise CudaPathUnavailable(
            "the CUDA path needs CuPy: pip install 'tinyloop-hf[cuda12]' (CUDA 12 driver) or 'tinyloop-hf[cuda13]' "
            f"(CUDA 13 driver) ({error})"
        ) from None
    return cupy


def check_device(device: torch.device | str | None = None) -> None:
    """Raise CudaPathUnavailable unless ``device`` is a CUDA GPU this path supports and CuPy is importable."""
    device = torch.device(device or "cuda")
    if device.type != "cuda":
        raise CudaPathUnavailable(f"the CUDA path runs on a CUDA device; the model is on {device}")
    if not torch.cuda.is_available():
        raise CudaPathUnavailable("the CUDA path needs a CUDA GPU, and torch.cuda.is_available() is False")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise CudaPathUnavailable(
            f"unsupported GPU {name} (sm_{capability[0]}{capability[1]}): the CUDA path needs sm_80 or newer"
        )
    _cupy()


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"$', re.MULTILINE)


def source(file: str, _seen: set[str] | None = None) -> str:
    """The text of ``file`` with its local headers inlined (each once, in include order)."""
    seen = set() if _seen is None else _seen

    def inline(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return source(header, seen).replace("#pragma once", "")

    return _LOCAL_INCLUDE.sub(inline, (KERNEL_DIR / file).read_text())


@functools.cache
def kernel(file: str, name: str) -> Any:
    """The compiled function ``name`` (a template instantiation like ``gemv_quant<4, __half, 1, 2, false, 1>``)."""
    cupy = _cupy()
    module = cupy.RawModule(code=source(file), options=("--std=c++17",), name_expressions=[name])
    try:
        return module.get_function(name)
    except cupy.cuda.compiler.CompileException as error:
        raise KernelCompileError(f"kernel {name} ({file}) failed to compile:\n{error.get_message()}") from None


class _TorchStream:
    """CuPy launches accept any object with ``.ptr``: this one is PyTorch's current stream."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def launch(
    fn: Any,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple,
    shared_mem: int = 0,
    dependent: bool = False,
    cluster: int = 1,
    cooperative: bool = False,
) -> None:
    """Launch ``fn`` on PyTorch's current stream. ``dependent``: a kernel that calls pdl_wait() before reading
    earlier kernels' outputs; inside a CUDA-graph capture on sm_90+ it is launched with programmatic dependent
    launch, so its start (and its first weight loads) overlap the previous kernel's end; eager, it stays a plain CuPy
    launch (the ctypes launch costs more host time than it saves outside graphs). ``cluster`` > 1: every
    ``cluster`` consecutive CTAs along grid z form a thread-block cluster (sm_90+; always a ctypes launch).
    ``cooperative``: every CTA is resident at once or the launch fails (kernels whose CTAs wait on one another);
    two such launches on two streams never share the GPU partly resident (always a ctypes launch)."""
    stream = torch.cuda.current_stream().cuda_stream
    attributes = []
    # The capture test first: eager launches (hundreds per eager step) then skip the device-capability lookup.
    if dependent and torch.cuda.is_current_stream_capturing() and programmatic_launches():
        attributes.append(_LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1))
    if cluster > 1:
        attributes.append(_LaunchAttribute(id=_CLUSTER_DIMENSION, value=1, value_y=1, value_z=cluster))
    if cooperative:
        attributes.append(_LaunchAttribute(id=_COOPERATIVE, value=1))
    if attributes:
        _launch_ex(fn, grid, block, args, shared_mem, stream, attributes)
        return
    fn(grid, block, args, shared_mem=shared_mem, stream=_TorchStream(stream))


# cuLaunchKernelEx with launch attributes (cuda.h), through ctypes.
# Graphs capture programmatic launches of the kernels launched ``dependent`` (the GEMVs). H200, Ouro-1.4B shape,
# INT4, batch-1 decode step, each A/B from one device call: 3.12 ms with the junctions as their own kernels against
# 3.57 ms without programmatic launch (junctions fused into the GEMV prologues, the best choice there) and 3.76 ms for
# separate junctions without it; with the norm / paged-decode kernels launched programmatically too, 3.39 against 3.11.
# (Paged decode is programmatic where its splits are single CTAs: see ops_cuda.PAGED_PROGRAMMATIC.)
PROGRAMMATIC_LAUNCH = True
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: value {x, y, z}
_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_COOPERATIVE = 2  # CU_LAUNCH_ATTRIBUTE_COOPERATIVE


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (here its first three ints)."""

    _fields_ = [
        ("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
        ("value", ctypes.c_int), ("value_y", ctypes.c_uint), ("value_z", ctypes.c_uint), ("rest", ctypes.c_char * 52),
    ]  # fmt: skip


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        ("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
        ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint),
    ]  # fmt: skip


_ARGUMENT_CTYPES = {np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float}


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device | None) -> int:
    """The CUDA device index of ``device`` (None, or a device without an index: the current one)."""
    return device.index if device is not None and device.index is not None else torch.cuda.current_device()


def multiprocessors(device: torch.device) -> int:
    """The number of SMs of ``device`` (launch shapes that must fill the GPU depend on it)."""
    return _multiprocessors(_index(device))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programmatic_launches(device: torch.device | None = None) -> bool:
    """Whether graph captures on ``device`` (default: the current one) record dependent kernels as programmatic
    launches (sm_90+). Eager launches never are; kernel choices that depend on it are made the same way eagerly, so
    a replayed graph computes exactly what the eager step does."""
    return PROGRAMMATIC_LAUNCH and sm90_or_newer(device)


def sm90_or_newer(device: torch.device | None = None) -> bool:
    """Whether ``device`` (default: the current one) has thread-block clusters and programmatic dependent launch."""
    return _capability(_index(device)) >= (9, 0)


@functools.cache
def _cu_launch_kernel_ex() -> Any:
    function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.POINTER(_LaunchConfig),
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
    ]
    return function


def _launch_ex(
    fn: Any, grid: tuple, block: tuple, args: tuple, shared_mem: int, stream: int, attributes: list[_LaunchAttribute]
) -> None:
    values = [_ARGUMENT_CTYPES[type(arg)](arg.item()) for arg in args]  # kept alive until the launch returns
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(value) for value in values))
    array = (_LaunchAttribute * len(attributes))(*attributes)
    grid3, block3 = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
    config = _LaunchConfig(*grid3, *block3, shared_mem, stream, array, len(attributes))
    status = _cu_launch_kernel_ex()(ctypes.byref(config), fn.kernel.ptr, params, None)  # CUfunction
    if status != 0:
        ids = [attribute.id for attribute in attributes]
        raise RuntimeError(f"cuLaunchKernelEx (launch attributes {ids}) failed with CUresult {status}")


def ptr(tensor: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def i32(value: int) -> np.int32:
    return np.int32(value)


def f32(value: float) -> np.float32:
    return np.float32(value)


CUDA_TYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


def cuda_type(dtype: torch.dtype) -> str:
    try:
        return CUDA_TYPE[dtype]
    except KeyError:
        raise CudaPathUnavailable(
            f"the CUDA path runs in float16 or bfloat16, got {dtype}: load the model with dtype=torch.bfloat16"
        ) from None
