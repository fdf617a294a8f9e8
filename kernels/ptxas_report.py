"""Registers, spills and stack of every kernel instantiation, from ptxas through NVRTC — on a machine without a GPU.
(``compile_log`` is also what tests/test_kernels_compile.py compiles with.)

    python -m tinyloop_hf.kernels.ptxas_report [FILE [NAME_REGEX]] [--arch sm_90]

Needs the NVRTC and CUDA-header wheels of the ``test`` extra. A kernel that spills or needs many registers is
worth a look before any device time is spent on it.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import re

from . import loader, ops_cuda


def compile_log(
    file: str, names: list[str], arch: str = "compute_80", options: tuple[str, ...] = ()
) -> tuple[int, str]:
    """Compile ``names`` (template instantiations) of ``file`` with NVRTC: (status, compiler log). ``arch`` a
    virtual architecture (compute_XY) only compiles to PTX; a real one (sm_XY) runs ptxas too."""
    import nvidia.cuda_nvrtc
    import nvidia.cuda_runtime

    libraries = sorted(glob.glob(f"{list(nvidia.cuda_nvrtc.__path__)[0]}/lib/libnvrtc.so*"))
    nvrtc = ctypes.CDLL(next(path for path in libraries if "builtins" not in path))
    include = f"{list(nvidia.cuda_runtime.__path__)[0]}/include"
    program = ctypes.c_void_p()
    nvrtc.nvrtcCreateProgram(ctypes.byref(program), loader.source(file).encode(), file.encode(), 0, None, None)
    for name in names:
        nvrtc.nvrtcAddNameExpression(program, name.encode())
    flags = [b"--std=c++17", f"--gpu-architecture={arch}".encode(), f"-I{include}".encode()]
    flags += [option.encode() for option in options]
    status = nvrtc.nvrtcCompileProgram(program, len(flags), (ctypes.c_char_p * len(flags))(*flags))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="one .cu file (default: all)")
    parser.add_argument("pattern", nargs="?", default=".", help="regex over instantiation names")
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    for file, names in ops_cuda.instantiations(full=True).items():
        if args.file and file != args.file:
            continue
        selected = [name for name in names if re.search(args.pattern, name)]
        if not selected:
            continue
        status, log = compile_log(file, selected, args.arch, ("--ptxas-options=-v",))
        print(f"== {file}: {'ok' if status == 0 else 'FAILED'}")
        entry = ""
        for line in log.splitlines():
            if "Compiling entry" in line:
                entry = line.split("'")[1]
            elif "registers" in line:
                print(f"  {entry[:90]:90s} {line.split(':', 1)[1].strip()}")
            elif "spill" in line and " 0 bytes spill stores" not in line:
                print(f"  {'':90s} {line.split('.', 1)[1].strip()}")
            elif status != 0:
                print(line)


if __name__ == "__main__":
    main()
