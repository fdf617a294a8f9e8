"""Every CUDA kernel compiles with NVRTC — on the CPU-only CI machine too (NVRTC needs no GPU).

The CUDA path compiles the same sources through CuPy at first use on a GPU; this catches syntax and template errors
without one. Needs the NVRTC and CUDA-header wheels from the ``test`` extra (nvidia-cuda-nvrtc-cu12,
nvidia-cuda-runtime-cu12).
"""

from __future__ import annotations

import pytest

from tinyloop_hf.eval.ablate_decode import PATCHES
from tinyloop_hf.kernels import ops_cuda
from tinyloop_hf.kernels.ptxas_report import code_bytes, compile_log, compile_program


def _require_wheels() -> None:
    try:
        import nvidia.cuda_nvrtc  # noqa: F401
        import nvidia.cuda_runtime  # noqa: F401
    except ImportError:
        pytest.fail("the test extra installs nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12; they are missing")


def _compile(file: str, names: list[str], arch: str = "compute_80", options: tuple[str, ...] = ()) -> tuple[int, str]:
    _require_wheels()
    return compile_log(file, names, arch, options)


@pytest.mark.parametrize("file", sorted(ops_cuda.instantiations(full=False)))
def test_kernel_sources_compile(file):
    status, log = _compile(file, ops_cuda.instantiations(full=False)[file])
    assert status == 0, log


@pytest.mark.parametrize(
    "file, name",
    [("gemv_quant.cu", "gemv_quant<4, __nv_bfloat16, 1, 2, false, 1, true>"),
     ("gemm_quant_mma.cu", "gemm_quant_mma<4, __nv_bfloat16, 2, false, true, 8, true>")],
)  # fmt: skip
def test_hopper_only_code_assembles(file, name):
    """The sm_90-only code (programmatic dependent launch, common.cuh) through ptxas, in the two QKV instantiations
    (the RoPE epilogue, rope_epilogue.cuh)."""
    status, log = _compile(file, [name], arch="sm_90")
    assert status == 0, log


def test_the_fused_decode_kernel_assembles_for_sm90():
    """kernels/fused_decode.cu (TMA bulk copies, mbarrier transaction counts: sm_90 only), through ptxas, for the
    paths its templates select: bf16 MHA at head_dim 128 and fp16 GQA at head_dim 64, in both CTA sizes."""
    names = ["fused::fused_decode<__nv_bfloat16, 128, 1, 384>", "fused::fused_decode<__half, 64, 4, 512>"]
    status, log = _compile("fused_decode.cu", names, arch="sm_90")
    assert status == 0, log


def test_the_384_thread_fused_kernel_assembles_without_spills():
    """The fused kernel in 12-warp CTAs (the default where the shapes fit: 168 registers a thread instead of 128,
    3 QKV units per warp task, down split to fit 11 consumer warps) through ptxas, with no spill stores at bf16 MHA."""
    status, log = _compile("fused_decode.cu", ["fused::fused_decode<__nv_bfloat16, 128, 1, 384>"], arch="sm_90",
                           options=("--ptxas-options=-v",))  # fmt: skip
    assert status == 0, log
    assert "Used 168 registers" in log and " 0 bytes spill stores" in log, log


@pytest.mark.parametrize("probe", ["ring_probe", "pipe_probe"])
def test_the_megakernel_probes_compile(probe):
    """eval/ring_probe.py's and eval/pipe_probe.py's kernels (measurements, not used by the model), for sm_90."""
    status, log = _compile(f"{probe}.cu", [probe], arch="sm_90")
    assert status == 0, log


def test_code_sizes_are_read_per_entry_from_the_cubin():
    """ptxas_report's code sizes: one per compiled entry (the names ptxas reports), whole sm_90 instructions (16
    bytes each), and a kernel that does more is larger (residual_norm against rms_norm)."""
    _require_wheels()
    names = ["rms_norm<__nv_bfloat16>", "residual_norm<__nv_bfloat16, false>"]
    status, log, cubin = compile_program("norm.cu", names, "sm_90", ("--ptxas-options=-v",))
    assert status == 0, log
    entries = {line.split("'")[1] for line in log.splitlines() if "Compiling entry" in line}
    sizes = code_bytes(cubin)
    assert set(sizes) == entries and len(entries) == 2
    assert all(size > 0 and size % 16 == 0 for size in sizes.values())
    rms, residual = (next(size for entry, size in sizes.items() if entry.startswith(prefix))
                     for prefix in ("_Z8rms_norm", "_Z13residual_norm"))  # fmt: skip
    assert residual > rms


def test_the_cluster_probe_compiles():
    """eval/cluster_probe.py's kernel (a measurement, not used by the model), through ptxas for sm_90."""
    status, log = _compile("cluster_probe.cu", ["cluster_probe"], arch="sm_90")
    assert status == 0, log


def test_the_persistent_probe_compiles():
    """eval/persistent_probe.py's kernels (a measurement, not used by the model), through ptxas for sm_90."""
    status, log = _compile("persistent_probe.cu", ["probe_phase", "probe_chain"], arch="sm_90")
    assert status == 0, log


def test_a_broken_instantiation_fails_with_the_compiler_log():
    status, log = _compile("gemv_quant.cu", ["gemv_quant<4, float, 1, 2, false, 1, false>"])
    assert status != 0 and "error" in log


_ABLATED_KERNELS = {
    "gemv_quant.cu": ["gemv_quant<4, __nv_bfloat16, 1, 2, false, 1, true>",
                      "gemv_quant<4, __half, 8, 4, true, 4, false>"],
    "gemm_quant_mma.cu": ["gemm_quant_mma<4, __nv_bfloat16, 2, false, true, 8, true>",
                          "gemm_quant_mma<2, __half, 1, true, false, 16, false>"],
    "fused_decode.cu": ["fused::fused_decode<__nv_bfloat16, 128, 1, 384>"],
    "paged_attention.cu": ["paged_decode<__nv_bfloat16, 0, 1, 1, 128, 256, 8>",  # the default wide shape
                           "paged_decode<__half, 1, 8, 8, 64, 128, 4>"],
}  # fmt: skip


@pytest.mark.parametrize("removed", sorted(PATCHES))
def test_the_ablation_patches_match_the_kernel_sources_and_compile(monkeypatch, removed):
    """eval/ablate_decode.py --without / --variant: each patch still matches its kernel's source (once) and changes
    it, and the patched kernels compile (with POST_SCALE and without, for the tensor-core kernel's two call sites)."""
    from tinyloop_hf.eval.ablate_decode import patch_sources
    from tinyloop_hf.kernels import loader

    patches = PATCHES[removed]
    monkeypatch.setattr(loader, "source", loader.source)  # restored after the test
    prefixes = {"mma": "gemm_quant_mma.cu", "fus": "fused_decode.cu", "pag": "paged_attention.cu"}
    file = prefixes.get(removed[:3], "gemv_quant.cu")
    assert {target for target, _, _ in patches} <= {file, "gemv_dot.cuh"}
    unpatched = loader.source(file)
    patch_sources([removed])
    patched = loader.source(file)
    assert patched != unpatched and all(new in patched for _, _, new in patches)
    status, log = _compile(file, _ABLATED_KERNELS[file])
    assert status == 0, log
