"""Registers, spills, stack and code size of every kernel instantiation, from ptxas through NVRTC — on a machine
without a GPU.
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
import struct

from . import loader, ops_cuda


def compile_log(
    file: str, names: list[str], arch: str = "compute_80", options: tuple[str, ...] = ()
) -> tuple[int, str]:
    """Compile ``names`` (template instantiations) of ``file`` with NVRTC: (status, compiler log). ``arch`` a
    virtual architecture (compute_XY) only compiles to PTX; a real one (sm_XY) runs ptxas too."""
    status, log, _ = compile_program(file, names, arch, options)
    return status, log


def compile_program(
    file: str, names: list[str], arch: str = "compute_80", options: tuple[str, ...] = ()
) -> tuple[int, str, bytes]:
    """As compile_log, with the cubin too (empty for a virtual architecture or a failed compile)."""
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
    cubin = b""
    if status == 0 and arch.startswith("sm_"):
        nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
        buffer = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(program, buffer)
        cubin = buffer.raw
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace"), cubin


def code_bytes(cubin: bytes) -> dict[str, int]:
    """Bytes of SASS per function of a cubin (its ELF64 ``.text.<mangled name>`` sections; 16 per instruction on
    sm_90). Large kernels matter where each pass through them is straight-line code: the fused decode kernel runs
    its whole layer-application body once per application, so a body larger than the SM's instruction cache is
    fetched again every time."""
    section_offset = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names_at = headers[names_index][4]  # the section-name string table's file offset

    def name(offset: int) -> str:
        start = names_at + offset
        return cubin[start : cubin.index(b"\0", start)].decode()

    return {name(h[0])[len(".text.") :]: h[5] for h in headers if name(h[0]).startswith(".text.")}


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
        status, log, cubin = compile_program(file, selected, args.arch, ("--ptxas-options=-v",))
        sizes = code_bytes(cubin) if cubin else {}
        print(f"== {file}: {'ok' if status == 0 else 'FAILED'}")
        entry = ""
        for line in log.splitlines():
            if "Compiling entry" in line:
                entry = line.split("'")[1]
            elif "registers" in line:
                code = f", {sizes[entry] / 1024:.0f} KiB of code" if entry in sizes else ""
                print(f"  {entry[:90]:90s} {line.split(':', 1)[1].strip()}{code}")
            elif "spill" in line and " 0 bytes spill stores" not in line:
                print(f"  {'':90s} {line.split('.', 1)[1].strip()}")
            elif status != 0:
                print(line)


if __name__ == "__main__":
    main()
