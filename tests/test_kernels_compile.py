"""Every CUDA kernel compiles with NVRTC — on the CPU-only CI machine too (NVRTC needs no GPU).

The CUDA path compiles the same sources through CuPy at first use on a GPU; this catches syntax and template errors
without one. Needs the NVRTC and CUDA-header wheels from the ``test`` extra (nvidia-cuda-nvrtc-cu12,
nvidia-cuda-runtime-cu12).
"""

from __future__ import annotations

import ctypes
import glob
from pathlib import Path

import pytest

from tinyloop_hf.kernels import loader, ops_cuda


def _nvrtc() -> tuple[ctypes.CDLL, Path]:
    try:
        import nvidia.cuda_nvrtc
        import nvidia.cuda_runtime
    except ImportError:
        pytest.fail("the test extra installs nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12; they are missing")
    libraries = sorted(glob.glob(f"{list(nvidia.cuda_nvrtc.__path__)[0]}/lib/libnvrtc.so*"))
    return ctypes.CDLL(next(p for p in libraries if "builtins" not in p)), Path(list(nvidia.cuda_runtime.__path__)[0])


def _compile(file: str, names: list[str]) -> tuple[int, str]:
    nvrtc, runtime = _nvrtc()
    program = ctypes.c_void_p()
    assert (
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), loader.source(file).encode(), file.encode(), 0, None, None) == 0
    )
    for name in names:
        assert nvrtc.nvrtcAddNameExpression(program, name.encode()) == 0
    options = [b"--std=c++17", b"--gpu-architecture=compute_80", f"-I{runtime / 'include'}".encode()]
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


@pytest.mark.parametrize("file", sorted(ops_cuda.instantiations(full=False)))
def test_kernel_sources_compile(file):
    status, log = _compile(file, ops_cuda.instantiations(full=False)[file])
    assert status == 0, log


def test_a_broken_instantiation_fails_with_the_compiler_log():
    status, log = _compile("gemv_quant.cu", ["gemv_quant<4, float, 1, 2, false>"])
    assert status != 0 and "error" in log
