"""The "cuda" op backend: the model's ops on the kernels of this folder (importing this module registers them).

Decode (up to 32 token rows) runs the low-bit GEMV kernels with QKV in one launch and SwiGLU fused into the
gate/up launch; prefill dequantizes each weight into a reused buffer and lets cuBLAS do the GEMM; attention writes
K/V into the paged cache with RoPE in one kernel, then reads pages with the split-KV decode kernel (one query
token per row) or runs PyTorch's SDPA over contiguous K/V for prompts. Dense (16-bit) linears use cuBLAS.
Everything a kernel cannot serve raises CudaPathUnavailable with the reason; nothing falls back to the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tinyloop_hf.ops_tinyloop import REFERENCE, Junction, get_op, register_op, rope_inv_freq
from tinyloop_hf.paged_cache import MAX_CONTINUATION_VECTORS, PagedTinyLoopCache
from tinyloop_hf.quant_tinyloop import PackedModule, QuantEmbedding, QuantLinear

from . import fused_decode
from .loader import (
    CUDA_TYPE,
    CudaPathUnavailable,
    cuda_type,
    f32,
    i32,
    kernel,
    launch,
    multiprocessors,
    programmatic_launches,
    ptr,
    sm90_or_newer,
)

CUDA_TYPES = tuple(CUDA_TYPE.values())

CUDA = "cuda"
GEMV_MAX_ROWS = 32  # token rows served by the GEMV kernels; more rows go through dequantize + cuBLAS
_THREADS = 128
MMA_BITS = (2, 3, 4, 8)  # formats the tensor-core kernel serves
MMA_MIN_ROWS = 2  # token rows from which the tensor-core kernel replaces the CUDA-core GEMV
MMA_WARPS = (8, 16)  # warps per CTA of the tensor-core kernel: 16 where 8-warp CTAs would not fill every SM
_SMEM_LIMIT = 48 * 1024
_DECODE_UNROLL = 4  # paged_attention.cu: tokens per thread per step of the token loop
DECODE_CLUSTER = 8  # CTAs per unit of paged-decode splits on sm_90+ (a thread-block cluster, merged in shared memory)


def instantiations(full: bool = True) -> dict[str, list[str]]:
    """Every kernel name this backend may request, by source file (``full=False``: one per code path)."""
    types = list(CUDA_TYPES)
    gemv_variants = [(m, r, sw, k) for m, r in ((1, 2), (1, 4), (4, 4), (8, 4)) for sw in ("true", "false")
                     for k in (1, 2, 4)]  # fmt: skip
    if not full:
        gemv_variants = [(1, 2, "false", 2), (8, 4, "true", 4)]
    return {
        "gemv_quant.cu": [f"gemv_quant<{b}, {t}, {m}, {r}, {sw}, {k}, {rope}>" for b in (2, 3, 4, 8) for t in types
                          for m, r, sw, k in gemv_variants
                          for rope in (("false", "true") if (m, r, sw) == (1, 2, "false") else ("false",))],
        "dequantize.cu": [f"{name}<{b}, {t}>" for name in ("dequantize_weights", "dequantize_rows") for b in (2, 3, 4, 8)
                          for t in types],
        "swiglu.cu": [f"swiglu<{t}>" for t in types],
        "gemm_quant_mma.cu": [f"gemm_quant_mma<{b}, {t}, {nt}, {sw}, {post}, {w}, {rope}>" for b in MMA_BITS
                              for t in types for nt in ((1, 2) if full else (2,)) for sw in ("true", "false")
                              for post in ("true", "false") for w in MMA_WARPS
                              for rope in (("false", "true") if sw == "false" and (full or w == 8) else ("false",))],
        "gemm_quant_tile.cu": [f"gemm_quant_tile<{b}, {t}, {nt}, {w}>" for b in MMA_BITS for t in types
                               for nt in TILE_NTS for w in ((4, 8) if full else (TILE_WARPS,))
                               if full or (t == "__nv_bfloat16" and (nt == 8 or b == 4))]
        + [f"gemm_tile_reduce<{t}, {sw}>" for t in types for sw in ("false", "true")],
        "norm.cu": [f"rms_norm<{t}>" for t in types] + [f"residual_norm<{t}, {w}>" for t in types
                                                          for w in ("false", "true")],
        "rope_kv_append.cu": [f"rope_kv_append<{t}>" for t in types],
        "rope_angles.cu": ["rope_angles"],
        "paged_attention.cu": [f"paged_decode<{t}, {i}, {g}, {c}, {d}, {n}, {u}>" for t in types for i in (0, 1)
                               for g in (1, 2, 4, 8) for c in (1, DECODE_CLUSTER)
                               for d in (PAGED_DIMS if full else (128,))
                               for n, u in ((_THREADS, _DECODE_UNROLL), *(() if c > 1 else PAGED_WIDE_SHAPES))
                               if full or n == _THREADS or (t, i, g) == ("__nv_bfloat16", 0, 1)],
        "sampling.cu": [f"{name}<{t}>" for name in ("sample_tokens", "advance_greedy") for t in types],
        "fused_decode.cu": [f"fused::fused_decode<{t}, {d}, {g}, {n}>" for t in types for d in (64, 128, 256)
                            for g in (1, 2, 4, 8) for n in fused_decode.THREAD_CHOICES
                            if full or (t, d, g, n) == ("__nv_bfloat16", 128, 1, 384)],
    }  # fmt: skip


def _check_on_gpu(tensor: torch.Tensor, what: str) -> None:
    if not tensor.is_cuda:
        raise CudaPathUnavailable(f"{what} is on {tensor.device}; the CUDA path needs every tensor on the GPU")


def _check(tensor: torch.Tensor, what: str, dtype: torch.dtype | None = None) -> None:
    _check_on_gpu(tensor, what)
    cuda_type(tensor.dtype)
    if dtype is not None and tensor.dtype != dtype:
        raise CudaPathUnavailable(f"{what} is {tensor.dtype} but the activations are {dtype}")


# ----------------------------------------------------------------------------------------------------------------------
# Linear layers
# ----------------------------------------------------------------------------------------------------------------------


def group_shift(fmt: Any) -> int:
    """log2 of the group width (the kernels index groups with a shift); 31 = one group per row."""
    return 31 if fmt.group_size is None else fmt.group_size.bit_length() - 1


@dataclass
class _GemvPlan:
    """What a GEMV launch over fixed layers always passes (built once per layer tuple: Python time per call
    dominates an eager decode step, ~1,000 launches)."""

    pointers: tuple[int, ...]  # every tensor the launch reads: the plan is rebuilt when any of them moves
    matrices: tuple
    tail: tuple
    out_features: int
    launches: dict[int, tuple[str, int]]  # rows per pass (1, 4, 8) -> (kernel name, CTAs)
    rope_launch: tuple[str, int]  # one token with the RoPE epilogue (QKV)
    # The tensor-core kernel: n-tiles (1, 2) -> (name, CTAs, threads); the name ends ", false>" (", true>": RoPE).
    mma_launches: dict[int, tuple[str, int, int]] | None


_GEMV_TENSORS = ("qweight", "qweight_high", "scales", "zeros", "bias")  # per matrix, in kernel argument order
_PACKED_TENSORS = _GEMV_TENSORS[:4]  # what dequantize reads


def _layer_tensors(layer: QuantLinear) -> tuple[torch.Tensor | None, ...]:
    """The tensors a GEMV launch reads from one layer, in kernel argument order."""
    return tuple(getattr(layer, name, None) for name in _GEMV_TENSORS)


def _packed_pointers(module: PackedModule | None, tensor_names: tuple[str, ...]) -> list:
    """The pointers of a packed module's ``tensor_names`` (null where missing, or for no module), refusing tensors the
    low-bit kernels' 32-bit offsets cannot index."""
    tensors = [None if module is None else getattr(module, name, None) for name in tensor_names]
    if any(t is not None and t.numel() >= 2**31 for t in tensors):
        rows, columns = module.packed_dims
        raise CudaPathUnavailable(
            f"the low-bit kernels index packed tensors with 32-bit offsets; a {rows}x{columns} layer has 2^31 or more "
            "packed elements"
        )
    return [*map(ptr, tensors)]


def _matrix_arguments(layers: list[QuantLinear], tensor_names: tuple[str, ...]) -> list:
    """The per-matrix arguments of a fused launch (up to three matrices; missing ones null): the pointers of
    ``tensor_names`` and the matrix's rows."""
    arguments: list = []
    for index in range(3):
        layer = layers[index] if index < len(layers) else None
        arguments += [*_packed_pointers(layer, tensor_names), i32(0 if layer is None else layer.out_features)]
    return arguments


def _format_arguments(layer: PackedModule) -> tuple:
    """K and the packed format as the low-bit kernels take them: K, group shift, groups, bf16 scales, midpoint."""
    fmt, K = layer.format, layer.packed_dims[1]
    return (i32(K), i32(group_shift(fmt)), i32(fmt.groups(K)), i32(int(layer.scales.dtype == torch.bfloat16)),
            i32(fmt.midpoint))  # fmt: skip


def _columns_per_word(fmt: Any) -> int:
    return 32 // (2 if fmt.bits == 3 else fmt.bits)  # INT3's low plane is INT2's layout


def gemv_k_split(chunks: int, row_groups: int) -> int:
    """Warps sharing one row group of the CUDA-core GEMV (K split between them), for ``row_groups`` groups of
    weight rows of ``chunks`` 16-byte chunks. Measured on the H200 (eval/gemv_sweep.py, INT4, one token row):
    layers with many rows (QKV 3072 row groups, gate/up, 8192-16384 rows) lose from splitting; o_proj (1024 groups of
    64 chunks) gains from 2 ways, down_proj (1024 groups of 176 chunks) from 4, and 4096 x 16384 (2048 groups of 512
    chunks) from 2 (14.2 us vs 17.3 unsplit and 15.3 with 4)."""
    if row_groups > 2048 or chunks < 64:
        return 1
    return 4 if chunks >= 128 and row_groups <= 1024 else 2


def mma_warps(ctas: int, device: torch.device) -> int:
    """Warps per CTA of a tensor-core GEMM launch of ``ctas`` CTAs (16 output rows each, the warps splitting K): 16
    when there are no more CTAs than SMs (o_proj and down_proj of the Ouro-1.4B shape, 128 CTAs on 132 SMs), where
    8-warp CTAs leave most of the GPU's warp slots, and with them its loads in flight, empty; 8 otherwise."""
    return MMA_WARPS[1] if MMA_WIDE and ctas <= multiprocessors(device) else MMA_WARPS[0]


MMA_WIDE = True  # A/B switch for mma_warps (eval scripts)


def _gemv_plan(layers: list[QuantLinear], swiglu: bool, dtype: torch.dtype) -> _GemvPlan:
    owner = layers[0]
    tensors = [_layer_tensors(layer) for layer in layers]
    pointers = tuple(0 if t is None else t.data_ptr() for group in tensors for t in group)
    cached = owner.__dict__.get("_gemv_plans", {}).get((swiglu, dtype, len(layers)))
    if cached is not None and cached.pointers == pointers:
        return cached
    fmt = owner.format
    if any(layer.format != fmt for layer in layers):
        raise CudaPathUnavailable("fused projections need one quantization format for all of them")
    K = owner.in_features
    sizes = [layer.out_features for layer in layers]
    out_features = sizes[0] if swiglu else sum(sizes)
    row_sizes = sizes[:1] if swiglu else sizes  # the rows CTAs are assigned to (SwiGLU: gate and up share them)
    matrices = _matrix_arguments(layers, _GEMV_TENSORS)
    tail = (i32(out_features), *_format_arguments(owner))
    flag = "true" if swiglu else "false"
    launches = {}
    columns_per_word = _columns_per_word(fmt)
    words = K // columns_per_word
    for rows in (1, 4, 8):
        # One token row: 2 weight rows per warp (64 registers: 8 CTAs per SM). Several token rows: 4 weight rows per
        # warp, so each activation load (one per token row and word) serves 4 rows.
        R = 2 if rows == 1 else 4
        split = gemv_k_split(words // 4, sum(math.ceil(n / R) for n in row_sizes))
        ctas = sum(math.ceil(n / (4 // split * R)) for n in row_sizes)
        launches[rows] = (f"gemv_quant<{fmt.bits}, {cuda_type(dtype)}, {rows}, {R}, {flag}, {split}, false>", ctas)
    rope_name, rope_ctas = launches[1]
    rope_launch = (rope_name.replace(", false>", ", true>"), rope_ctas)
    mma_launches = None
    if fmt.bits in MMA_BITS and words % 4 == 0:
        ctas = sum(math.ceil(n / 16) for n in row_sizes)
        # A step spans 16 words of a row; when that is one group, the scale multiplies the step's fp32 sums.
        post = "true" if fmt.group_size is None or fmt.group_size >= 16 * columns_per_word else "false"
        warps = mma_warps(ctas, owner.qweight.device)
        name = f"gemm_quant_mma<{fmt.bits}, {cuda_type(dtype)}, {{}}, {flag}, {post}, {warps}, false>"
        mma_launches = {nt: (name.format(nt), ctas, 32 * warps) for nt in (1, 2)}
    plan = _GemvPlan(pointers, tuple(matrices), tail, out_features, launches, rope_launch, mma_launches)
    owner.__dict__.setdefault("_gemv_plans", {})[(swiglu, dtype, len(layers))] = plan
    return plan


_NO_JUNCTION = (ptr(None),) * 5 + (f32(0.0), i32(0))
_NO_ROPE = (ptr(None),) * 7 + (i32(0),) * 5


def _gemv(
    x: torch.Tensor,
    layers: list[QuantLinear],
    swiglu: bool,
    junction: tuple = _NO_JUNCTION,
    rope: Callable[[int], tuple] | None = None,
) -> torch.Tensor | None:
    """x [M, K] (M <= 32) times 1-3 QuantLinears of one format -> [M, sum N] (or [M, N] gate*up for swiglu).
    ``junction``: the gemv_quant junction-prologue arguments (then x is only the shape, see junction_mlp);
    ``rope``: the RoPE-epilogue arguments of a decode step's QKV launch for the rows from a given one on (see _attend;
    one token per row), which writes q and the K/V pages instead of y (None is returned)."""
    plan = _gemv_plan(layers, swiglu, x.dtype)
    rows, K = x.shape
    fused = junction is not _NO_JUNCTION
    with_rope = rope is not None
    if with_rope and (swiglu or len(layers) != 3 or (rows > 1 and plan.mma_launches is None)):
        raise ValueError("the RoPE epilogue serves the QKV projection: one row, or the tensor-core kernel's rows")
    y = None if with_rope else torch.empty(rows, plan.out_features, dtype=x.dtype, device=x.device)
    row_bytes, out_bytes = K * x.element_size(), plan.out_features * x.element_size()

    def arguments(start: int, chunk: int) -> tuple:
        """The arguments both kernels share (rows start .. start + chunk of x and y)."""
        out = ptr(None) if y is None else np.uint64(y.data_ptr() + start * out_bytes)
        return (np.uint64(x.data_ptr() + start * row_bytes), i32(chunk), i32(K), *plan.matrices, ptr(None),
                plan.tail[0], out, *plan.tail)  # fmt: skip

    if rows >= MMA_MIN_ROWS and plan.mma_launches is not None and not fused:
        for start in range(0, rows, 16):
            chunk = min(16, rows - start)
            name, ctas, threads = plan.mma_launches[1 if chunk <= 8 else 2]
            if with_rope:
                name = name.replace(", false>", ", true>")
            args = (*arguments(start, chunk), *(rope(start) if with_rope else _NO_ROPE))
            launch(kernel("gemm_quant_mma.cu", name), (ctas,), (threads,), args, dependent=True)
        return y
    for start in range(0, rows, 8):
        chunk = min(8, rows - start)
        maxm = 1 if chunk == 1 else (4 if chunk <= 4 else 8)
        if fused and (start or chunk != rows):
            raise ValueError("the junction prologue serves up to 8 rows in one launch")
        args = (*arguments(start, chunk), *junction, *(rope(start) if with_rope else _NO_ROPE))
        name, ctas = plan.rope_launch if with_rope else plan.launches[maxm]
        shared = chunk * row_bytes if fused else 0  # the junction's output, staged for every CTA
        launch(kernel("gemv_quant.cu", name), (ctas,), (_THREADS,), args, shared_mem=shared, dependent=True)
    return y


def rope_epilogue_serves(rows: torch.Tensor, layers: list[Any], dim: int) -> bool:
    """Whether the QKV projection of these decode rows (one new token each) can write RoPE'd q and K/V pages itself:
    quantized layers, a 16-byte aligned activation, and one row (the CUDA-core GEMV) or up to GEMV_MAX_ROWS rows
    through the tensor-core kernel, whose 16-row tiles are 8 dim pairs of a head (head_dim % 16 == 0)."""
    if not all(isinstance(layer, QuantLinear) for layer in layers) or rows.data_ptr() % 16:
        return False
    count = rows.shape[0]
    if not ROPE_EPILOGUE:
        return False
    if count == 1:
        return True
    if count > GEMV_MAX_ROWS or dim % 16 or (TILE_GEMM and count >= TILE_MIN_ROWS):  # the tile kernel has no epilogue
        return False
    return _gemv_plan(layers, False, rows.dtype).mma_launches is not None


ROPE_EPILOGUE = True  # A/B switch: the QKV launch's RoPE + KV-append epilogue (else the rope_kv_append kernel)


_DEQUANT_BUFFERS: dict[tuple, torch.Tensor] = {}


def dequantize_weights(layers: list[QuantLinear], dtype: torch.dtype) -> torch.Tensor:
    """The layers' weights stacked along rows, [sum N, K] in ``dtype``, in a buffer reused by every layer tuple of
    that shape (fused projections then need one GEMM and no concatenation); one launch for up to three layers."""
    owner = layers[0]
    fmt, K, device = owner.format, owner.in_features, owner.qweight.device
    if len(layers) > 3 or any(layer.format != fmt or layer.in_features != K for layer in layers):
        raise CudaPathUnavailable("one dequantize launch serves up to three layers of one format and in_features")
    rows = [layer.out_features for layer in layers]
    key = (tuple(rows), K, dtype, device)
    out = _DEQUANT_BUFFERS.get(key)
    if out is None:
        out = _DEQUANT_BUFFERS[key] = torch.empty(sum(rows), K, dtype=dtype, device=device)
    args = (*_matrix_arguments(layers, _PACKED_TENSORS), ptr(out), *_format_arguments(owner))
    words = K // _columns_per_word(fmt)
    name = f"dequantize_weights<{fmt.bits}, {cuda_type(dtype)}>"
    launch(kernel("dequantize.cu", name), (min(4096, math.ceil(max(rows) * words / 256)), len(layers)), (256,), args)
    return out


@register_op("quant_embedding", CUDA)
def quant_embedding(input_ids: torch.Tensor, table: QuantEmbedding) -> torch.Tensor:
    """The rows ``input_ids`` of a packed embedding table in its compute dtype, [*input_ids.shape, dim]: one launch
    (kernels/dequantize.cu dequantize_rows), the reference lookup's values exactly."""
    _check_on_gpu(table.qweight, "the embedding table")
    if input_ids.device != table.qweight.device:
        raise CudaPathUnavailable(f"input_ids are on {input_ids.device}, the embedding table on {table.qweight.device}")
    fmt, (rows, dim) = table.format, table.packed_dims
    ids = input_ids.reshape(-1).to(torch.long).contiguous()
    out = torch.empty(ids.numel(), dim, dtype=table.compute_dtype, device=ids.device)
    if ids.numel():
        args = (*_packed_pointers(table, _PACKED_TENSORS), ptr(ids), i32(rows), ptr(out), *_format_arguments(table))
        words = dim // _columns_per_word(fmt)
        name = f"dequantize_rows<{fmt.bits}, {cuda_type(table.compute_dtype)}>"
        launch(kernel("dequantize.cu", name), (ids.numel(), math.ceil(words / 256)), (256,), args)
    return out.view(*input_ids.shape, dim)


@register_op("rope_angles", CUDA)
def rope_angles(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, head_dim // 2] (fp32) of integer positions [B, S]: the reference's values, in one launch."""
    _check_on_gpu(position_ids, "position_ids")
    half = head_dim // 2
    positions = position_ids.to(torch.long).contiguous()
    cos = torch.empty(*positions.shape, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    count = positions.numel() * half
    if count:
        inv_freq = rope_inv_freq(head_dim, theta, positions.device)
        args = (ptr(positions), ptr(inv_freq), i32(half), i32(positions.numel()), ptr(cos), ptr(sin))
        launch(kernel("rope_angles.cu", "rope_angles"), (math.ceil(count / 256),), (256,), args)
    return cos, sin


def dequantize_weight(layer: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight [N, K] in ``dtype`` (in a buffer reused by every layer of that shape)."""
    return dequantize_weights([layer], dtype)


def project(x: torch.Tensor, layers: list[torch.nn.Module], swiglu: bool = False) -> torch.Tensor:
    """x [M, K] through one or more linears (outputs concatenated), or silu(gate(x)) * up(x) when ``swiglu``."""
    _check(x, "the activation")
    x = x.contiguous()
    quantized = [isinstance(layer, QuantLinear) for layer in layers]
    tile_rows = TILE_GEMM and TILE_MIN_ROWS <= x.shape[0] <= TILE_MAX_ROWS  # where it is the faster kernel
    tile = all(quantized) and tile_rows and tile_gemm_serves(x, layers)
    if all(quantized) and not tile and x.shape[0] <= GEMV_MAX_ROWS and x.data_ptr() % 16 == 0:
        return _gemv(x, layers, swiglu)
    if all(quantized):  # prefill: the tile kernel, or one dequantized stack and one GEMM
        bias = _stacked_bias(layers, x.dtype)
        if tile:
            return tile_gemm(x, layers, bias, swiglu=swiglu)
        y = F.linear(x, dequantize_weights(layers, x.dtype), bias)
        return _swiglu(*y.split(layers[0].out_features, dim=-1)) if swiglu else y
    outputs = []
    for layer in layers:
        weight = dequantize_weight(layer, x.dtype) if isinstance(layer, QuantLinear) else layer.weight
        _check(weight, f"the weight of a {type(layer).__name__}", x.dtype)
        bias = layer.bias.to(x.dtype) if layer.bias is not None else None
        outputs.append(F.linear(x, weight, bias))
    if swiglu:
        return _swiglu(*outputs)
    return torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]


def _stacked_bias(layers: list[QuantLinear], dtype: torch.dtype) -> torch.Tensor | None:
    """The layers' biases concatenated in ``dtype`` (zeros for a layer without one), or None if none has one."""
    biases = [layer.bias for layer in layers]
    if all(b is None for b in biases):
        return None
    device = layers[0].qweight.device
    parts = [torch.zeros(layer.out_features, device=device) if b is None else b
             for layer, b in zip(layers, biases, strict=True)]  # fmt: skip
    return torch.cat(parts).to(dtype)


# Prompt forwards and decode batches past GEMV_MAX_ROWS (TILE_MIN_ROWS) through the tensor-core tile kernel
# (kernels/gemm_quant_tile.cu: each weight dequantized in registers once per 16-64 tokens, the activations staged in
# shared memory once per CTA) instead of dequantize + cuBLAS, which writes and re-reads a 16-bit copy of every weight
# (INT4 at batch 64 ran slower than bf16 for it: 5,019 against 6,353 tok/s, thirty-third session). H100, thirty-eighth
# session: batch-64 replays 10.87 ms against 14.06, batch 40 9.10 against 12.57, a 128-token prompt's kernels 11.1 ms
# against 11.4; at 16 rows it is slower than the 16-row kernel (QKV 10.6 against 6.4 us), hence TILE_MIN_ROWS.
# Past 128 rows cuBLAS's GEMM wins and the dequantize launch is paid once for many rows (H100, thirty-ninth session,
# kernels of one prompt forward: 256 rows 17.2 ms against 13.3, 512 rows 33.7 against 17.5, batch 16 x 128 tokens
# 113.4 against 43.1), hence TILE_MAX_ROWS.
TILE_GEMM = True
TILE_MIN_ROWS = GEMV_MAX_ROWS + 1  # rows from which TILE_GEMM serves a projection (lower: A/B of the 16-row one)
TILE_MAX_ROWS = 128  # rows past which dequantize + cuBLAS serves instead
TILE_WARPS = 4  # warps per CTA, 16 weight rows each (8 is instantiated too, for measurements)
TILE_NTS = (2, 4, 8)  # n-tiles of 8 tokens per CTA: 16, 32 or 64 tokens (the fewest that hold the rows; 64 past that)
TILE_STAGES = 3  # kernels/gemm_quant_tile.cu TILE_STAGES: staged activation steps (dynamic shared memory)
TILE_WAVES = 2  # K is split across CTAs until the grid has about this many CTAs per SM (each split >= 2 steps)


def tile_gemm_serves(x: torch.Tensor, layers: list[QuantLinear]) -> bool:
    """Whether the tile kernel can serve x [M, K] times these layers: a tensor-core format, one format and K for all,
    16-byte aligned contiguous activation rows, and whole 4-word lane chunks (as the 16-row tensor-core kernel)."""
    owner = layers[0]
    fmt, K = owner.format, owner.in_features
    if fmt.bits not in MMA_BITS or len(layers) > 3:
        return False
    if any(layer.format != fmt or layer.in_features != K for layer in layers):
        return False
    return K % 8 == 0 and (K // _columns_per_word(fmt)) % 4 == 0 and x.data_ptr() % 16 == 0 and x.stride(0) == K


def tile_gemm(
    x: torch.Tensor, layers: list[QuantLinear], bias: torch.Tensor | None, splits: int | None = None,
    warps: int | None = None, swiglu: bool = False,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (contiguous) times 1-3 QuantLinears of one format -> [M, sum N] (+ ``bias``, the stacked biases), in
    one launch of the tile kernel, plus a reduce launch where K is split over ``splits`` CTAs (None: picked here).
    ``swiglu`` (layers gate, up): silu(gate) * up [M, N], applied by the reduce launch, which then always runs."""
    owner = layers[0]
    fmt, K = owner.format, owner.in_features
    warps = TILE_WARPS if warps is None else warps
    M, out_features = x.shape[0], sum(layer.out_features for layer in layers)
    if swiglu and (len(layers) != 2 or layers[0].out_features != layers[1].out_features):
        raise ValueError("the tile kernel's SwiGLU takes two layers of one out_features (gate, up)")
    y = torch.empty(M, out_features // 2 if swiglu else out_features, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    columns_per_word = _columns_per_word(fmt)
    steps = math.ceil(K // columns_per_word / 16)
    row_tiles = sum(math.ceil(layer.out_features / (16 * warps)) for layer in layers)
    nt = next((n for n in TILE_NTS if 8 * n >= M), TILE_NTS[-1])
    token_tiles = math.ceil(M / (8 * nt))
    if splits is None:
        wanted = math.ceil(TILE_WAVES * multiprocessors(x.device) / (row_tiles * token_tiles))
        splits = min(steps // 2, wanted)
    per_split = math.ceil(steps / min(max(1, splits), steps))
    splits = math.ceil(steps / per_split)
    with_partial = splits > 1 or swiglu
    partial = torch.empty(splits, M, out_features, dtype=torch.float32, device=x.device) if with_partial else None
    fn = kernel("gemm_quant_tile.cu", f"gemm_quant_tile<{fmt.bits}, {cuda_type(x.dtype)}, {nt}, {warps}>")
    shared = TILE_STAGES * 8 * nt * 2 * columns_per_word * 16
    if shared > _SMEM_LIMIT and fn.max_dynamic_shared_size_bytes < shared:
        fn.max_dynamic_shared_size_bytes = shared
    args = (ptr(x), i32(M), i32(K), *_matrix_arguments(layers, _PACKED_TENSORS), ptr(bias), ptr(y), ptr(partial),
            i32(out_features), *_format_arguments(owner), i32(per_split))  # fmt: skip
    launch(fn, (row_tiles, token_tiles, splits), (32 * warps,), args, shared_mem=shared)
    if partial is not None:
        count, width = y.numel(), y.shape[1]
        reduce = kernel("gemm_quant_tile.cu", f"gemm_tile_reduce<{cuda_type(x.dtype)}, {str(swiglu).lower()}>")
        args = (ptr(partial), i32(splits), i32(count), i32(width), ptr(bias), ptr(y))
        launch(reduce, (math.ceil(count / 256),), (256,), args)
    return y


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [M, N] halves sharing a row stride (one kernel; PyTorch's two ops where the kernel's
    16-byte accesses do not fit)."""
    rows, width = gate.shape
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 and t.stride(1) == 1 for t in (gate, up))
    if width % 8 or not aligned or gate.stride(0) != up.stride(0):
        return F.silu(gate) * up
    out = torch.empty(rows, width, dtype=gate.dtype, device=gate.device)
    args = (ptr(gate), ptr(up), i32(gate.stride(0)), ptr(out), i32(rows), i32(width))
    launch(kernel("swiglu.cu", f"swiglu<{cuda_type(gate.dtype)}>"), (min(4096, math.ceil(rows * width / 8 / 256)),),
           (256,), args)  # fmt: skip
    return out


@register_op("quant_linear", CUDA)
def quant_linear(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    return project(x.reshape(-1, x.shape[-1]), [layer]).view(*x.shape[:-1], layer.out_features)


@register_op("linear", CUDA)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check(x, "the activation")
    return F.linear(x, weight, bias)


@register_op("mlp", CUDA)
def mlp(module: Any, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    hidden = project(rows, [module.gate_proj, module.up_proj], swiglu=True)
    return project(hidden, [module.down_proj]).view(*x.shape[:-1], -1)


JUNCTION_PROLOGUE_MAX_HIDDEN = 8 * 4 * _THREADS  # norm.cuh: 8 values x MAX_VECS vectors per thread


@register_op("junction_mlp", CUDA)
def junction_mlp(module: Any, junction: Junction) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual junction after attention and the MLP on its normed output. One decode row with quantized
    gate/up, where graphs are not captured with programmatic launches: the junction runs in the prologue of the
    gate/up GEMV (every CTA normalizes the row into shared memory, CTA 0 writes the new residual stream); otherwise
    the junction kernel, then the MLP (see _junction_prologue)."""
    gate_up = [module.gate_proj, module.up_proj]
    prologue = _junction_prologue(junction, gate_up)
    if prologue is None:
        total, normed = residual_norm(*junction.residual_norm_args())
        return total, mlp(module, normed)
    rows, total, arguments = prologue
    activated = _gemv(rows, gate_up, swiglu=True, junction=arguments)
    return total, project(activated, [module.down_proj]).view(*junction.x.shape[:-1], -1)


def _junction_prologue(junction: Junction, layers: list[Any]) -> tuple[torch.Tensor, torch.Tensor, tuple] | None:
    """(x's rows, the new residual stream to be written, gemv_quant junction arguments) for a GEMV launch over
    ``layers`` with the junction in its prologue, or None where that launch cannot serve the step (several rows,
    unquantized layers, hidden too large) or where the separate junction kernel is faster: with programmatic launches
    (sm_90+) a captured GEMV loads its first weights while the junction kernel runs, whereas a prologue recomputed by
    each of its 700+ CTAs delays every weight load (H200, INT4 batch-1 decode step: 3.12 against 3.57 ms; with the
    prologue run after each CTA's first weight loads are issued, still 3.19 against 2.84). Eager steps choose the
    same, so that graphs replay the eager numerics."""
    if programmatic_launches(junction.x.device):
        return None
    x = junction.x
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    fusable = (
        rows.shape[0] == 1
        and all(isinstance(layer, QuantLinear) for layer in layers)
        and hidden <= JUNCTION_PROLOGUE_MAX_HIDDEN
        and hidden % 8 == 0
    )
    if not fusable:
        return None
    _check(x, "the residual stream")
    rows, branch = rows.contiguous(), junction.branch.reshape(-1, hidden).contiguous()
    weights = [w for w in (junction.branch_weight, junction.next_weight) if w is not None]
    if any(t.data_ptr() % 16 for t in (rows, branch, *weights)):  # the prologue reads 16-byte vectors
        return None
    total = torch.empty_like(x)
    arguments = (ptr(rows), ptr(branch), ptr(junction.branch_weight), ptr(junction.next_weight), ptr(total),
                 f32(junction.eps), i32(JUNCTION_MODES[junction.mode]))  # fmt: skip
    return rows, total, arguments


# ----------------------------------------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------------------------------------


def _norm_launch(name: str, rows: int, hidden: int, args: tuple, dependent: bool = False) -> None:
    if hidden % 8 or hidden > 8 * 4 * 1024:
        raise CudaPathUnavailable(f"the norm kernels need hidden_size % 8 == 0 and <= 32768, got {hidden}")
    threads = min(1024, max(128, 32 * math.ceil(hidden / 8 / 32)))
    launch(kernel("norm.cu", name), (rows,), (threads,), args, dependent=dependent)


# Steps of at least this many rows launch the residual junction programmatically: its norm weights are loaded while
# the GEMV before it runs, and the next launch may start once it is past pdl_wait. Fewer rows launch it plainly: it
# starts when the GEMV before it is done and lets the GEMV after it start at once (that GEMV then loads its weights
# while the junction runs). H200, Ouro-1.4B shape, INT4, L = 4, 192 cached tokens, GPU time of one graph replay
# (ablate_decode [--junction-programmatic], seventeenth session): batch 16 4.626 / 4.623 ms against 4.689 / 4.684
# plain; batch 1 2.997 against 2.809 plain. Forwards of more than JUNCTION_PROGRAMMATIC_MAX_ROWS rows (prompts) keep
# the plain launch, whose TTFT was measured; the programmatic one was not measured there. A/B switch for eval scripts
# (1: every decode step; a large number: none).
JUNCTION_PROGRAMMATIC_ROWS = 2
JUNCTION_PROGRAMMATIC_MAX_ROWS = 64  # the benchmark's largest decode batch


@register_op("rms_norm", CUDA)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, "the activation")
    x = x.contiguous()
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    args = (ptr(x), ptr(weight), ptr(out), i32(hidden), f32(eps))
    _norm_launch(f"rms_norm<{cuda_type(x.dtype)}>", x.numel() // hidden, hidden, args)
    return out


JUNCTION_MODES = {"pre": 0, "sandwich": 1, "post_residual": 2}


@register_op("residual_norm", CUDA)
def residual_norm(
    x: torch.Tensor,
    branch: torch.Tensor,
    branch_weight: torch.Tensor | None,
    next_weight: torch.Tensor | None,
    eps: float,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(x, "the residual stream")
    x, branch = x.contiguous(), branch.contiguous()
    total = torch.empty_like(x)
    following = torch.empty_like(x) if next_weight is not None else None
    hidden = x.shape[-1]
    args = (ptr(x), ptr(branch), ptr(branch_weight), ptr(next_weight), ptr(total), ptr(following), i32(hidden),
            f32(eps), i32(JUNCTION_MODES[mode]))  # fmt: skip
    rows = x.numel() // hidden
    # Eager steps pick the same kernel as captured ones (same arithmetic either way).
    programmatic = JUNCTION_PROGRAMMATIC_ROWS <= rows <= JUNCTION_PROGRAMMATIC_MAX_ROWS
    wait = "true" if programmatic else "false"
    _norm_launch(f"residual_norm<{cuda_type(x.dtype)}, {wait}>", rows, hidden, args, dependent=programmatic)
    return total, following


# ----------------------------------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------------------------------


@register_op("self_attention", CUDA)
def self_attention(module: Any, x: torch.Tensor, context: Any, slot: int) -> torch.Tensor:
    batch, steps, _ = x.shape
    rows = x.reshape(batch * steps, -1).contiguous()
    layers = [module.q_proj, module.k_proj, module.v_proj]

    def qkv_projection(rope: Callable[[int], tuple] | None) -> torch.Tensor | None:
        return project(rows, layers) if rope is None else _gemv(rows, layers, swiglu=False, rope=rope)

    return _attend(module, qkv_projection, rope_epilogue_serves(rows, layers, module.head_dim), batch, steps,
                   context, slot)  # fmt: skip


@register_op("junction_attention", CUDA)
def junction_attention(module: Any, junction: Junction, context: Any, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous block's last junction and this block's attention on its normed output. One decode row with
    quantized projections, where graphs are not captured with programmatic launches: the junction runs in the
    prologue of the QKV GEMV (and RoPE + KV append in its epilogue where the cache allows); otherwise the junction
    kernel, then attention."""
    batch, steps, _ = junction.x.shape
    layers = [module.q_proj, module.k_proj, module.v_proj]
    prologue = _junction_prologue(junction, layers)
    if prologue is None:
        total, normed = residual_norm(*junction.residual_norm_args())
        return total, self_attention(module, normed, context, slot)
    rows, total, arguments = prologue

    def qkv_projection(rope: Callable[[int], tuple] | None) -> torch.Tensor | None:
        return _gemv(rows, layers, swiglu=False, junction=arguments, rope=rope)

    epilogue = rope_epilogue_serves(rows, layers, module.head_dim)  # ROPE_EPILOGUE off: rope_kv_append
    return total, _attend(module, qkv_projection, epilogue, batch, steps, context, slot)


def _attend(
    module: Any,
    qkv_projection: Callable[[Callable[[int], tuple] | None], torch.Tensor | None],
    rope_epilogue: bool,
    batch: int,
    steps: int,
    context: Any,
    slot: int,
) -> torch.Tensor:
    """Attention through the output projection. ``qkv_projection(None)`` returns the fused QKV projection
    [batch * steps, (Hq + 2 Hkv) * D]; when ``rope_epilogue`` (its launches can take the RoPE epilogue, see
    rope_epilogue_serves) and the step is one token per row, ``qkv_projection(rope)`` (``rope(start)``: the
    epilogue's kernel arguments for the rows from ``start`` on) instead writes rotated q and the tokens' K/V itself,
    and the rope_kv_append kernel is skipped: into the pages of a 16-bit cache, or into the staging pages of an INT8
    one, which paged decode quantizes into its pages (PagedStorage.staging)."""
    config = module.config
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, module.head_dim
    cache = context.cache
    if cache is not None and not isinstance(cache, PagedTinyLoopCache):
        raise CudaPathUnavailable(
            "the CUDA path keeps K/V in a paged cache: pass PagedTinyLoopCache (model.new_cache() makes one) "
            "or let generate() create it"
        )
    storage = cache.storage if cache is not None else None
    if cache is not None:
        cache.mark_written(slot)
    pages = storage.slot(slot) if storage is not None else (None, None)
    scales = pages[2:] if storage is not None and storage.int8 else (None, None)
    table = storage.block_table if storage is not None else None
    positions = cache.step_positions if cache is not None else None
    cos, sin = context.cos.contiguous(), context.sin.contiguous()
    layout = 0 if config.rope_layout == "rotate_half" else 1
    epilogue = rope_epilogue and steps == 1 and storage is not None and dim % 2 == 0
    staged = storage.staging() if epilogue and storage.int8 else None
    if epilogue:
        targets = staged if staged is not None else (pages[0], pages[1], table)  # K pages, V pages, block table
        dtype, device = targets[0].dtype, targets[0].device
        query = torch.empty(batch * steps, heads, dim, dtype=dtype, device=device)
        scalars = tuple(map(i32, (targets[2].shape[1], heads, kv_heads, dim, layout)))

        def rope(start: int) -> tuple:
            """The epilogue's arguments for the rows from ``start`` on (a tensor-core launch serves 16): the per-row
            tensors (angles, q, block table, positions) from that row, the pages and scalars whole."""
            per_row = [t[start:] for t in (cos, sin, query, targets[2], positions)]
            return (*map(ptr, (*per_row[:3], targets[0], targets[1], *per_row[3:])), *scalars)

        qkv_projection(rope)
        key = value = None
    else:
        qkv = qkv_projection(None)
        dtype, device = qkv.dtype, qkv.device
        query = torch.empty(batch * steps, heads, dim, dtype=dtype, device=device)
        contiguous = steps > 1 or cache is None
        key = torch.empty(batch * steps, kv_heads, dim, dtype=dtype, device=device) if contiguous else None
        value = torch.empty_like(key) if contiguous else None
        warps = batch * steps * (heads + 2 * kv_heads)
        args = (
            *map(ptr, (qkv, cos, sin, query, pages[0], pages[1], scales[0], scales[1], table, positions, key, value)),
            *map(i32, (batch * steps, steps, heads, kv_heads, dim, table.shape[1] if table is not None else 0, layout)),
            i32(int(scales[0] is not None)),
        )
        launch(
            kernel("rope_kv_append.cu", f"rope_kv_append<{cuda_type(dtype)}>"), (math.ceil(warps / 4),), (128,), args
        )

    # Decode, and short continuations of a cached sequence (e.g. a speculative verify): paged attention in place.
    continuation = cache is not None and cache.length > 0 and steps <= cache.max_continuation_tokens(config)
    if cache is not None and (steps == 1 or (continuation and dim in PAGED_DIMS)):
        out = paged_decode(query, cache, pages, module.scaling, new_tokens=steps, staged=staged)
    else:
        q = query.view(batch, steps, heads, dim).transpose(1, 2)
        if cache is None or cache.length == 0:
            k, v = (t.view(batch, steps, kv_heads, dim).transpose(1, 2) for t in (key, value))
        else:
            k, v = cache.gather(slot, cache.length + steps, dtype)
        implementation = "eager" if config._attn_implementation == "eager" else "sdpa"
        # Prompts: PyTorch's fused SDPA over contiguous K/V (compute-bound; the reference op is that call).
        attended = get_op("attention", REFERENCE)(q, k, v, context.mask, context.is_causal, module.scaling,
                                                   implementation)  # fmt: skip
        out = attended.transpose(1, 2).reshape(batch * steps, heads * dim)
    return project(out.reshape(batch * steps, -1), [module.o_proj]).view(batch, steps, -1)


def decode_cluster(device: torch.device) -> int:
    """The largest unit of paged-decode splits: a cluster of DECODE_CLUSTER CTAs on sm_90+, single CTAs before."""
    return DECODE_CLUSTER if sm90_or_newer(device) else 1


def _decode_shared_floats(vectors: int, dim: int, splits: int, threads: int = _THREADS) -> int:
    """Shared memory of paged_decode in 4-byte words: q (then the CTA's o), per-sub o and (m, l), the CTA's (m, l),
    the global merge's weight per split."""
    subs = threads // (dim // 8)
    return vectors * dim + subs * vectors * (dim + 2) + 2 * vectors + vectors * splits


_DECODE_CTAS = 528  # ~4 CTAs per SM of an H100 / H200 (132 SMs)
# (threads, tokens per thread per step) of paged-decode CTAs where every (row, KV head) gets one CTA of its own:
# launches of at least PAGED_WIDE_MIN_CTAS (row, KV head) pairs whose capacity is at most PAGED_WIDE_MAX_TOKENS. No
# split merge through global memory (partials, fence, counter, the last CTA's merge). H200, Ouro-1.4B shape, INT4,
# L = 4, batch 16, 192 cached tokens, one graph replay: 4.371 ms with (256, 4) and 4.378 with (256, 8) against 4.594
# for 3 split CTAs of 128 threads per (row, KV head); paged decode adds 9.6 us per layer application instead of 12.6;
# tinyloop-bench batch 16: 3,650 tok/s against 3,436. 8 tokens per thread a step (128 a step: one step fewer from
# 128 cached tokens on) since the thirty-fourth session: batch 16 at 192 tokens 4.202 / 4.234 ms against 4.293 / 4.300
# with 4, batch 64 12.141 against 12.367; at 100 tokens (one step either way) 3.958 against 3.927; tinyloop-bench
# batch 16 3,749.0 / 3,742.3 tok/s against 3,723.6 / 3,728.5.
# None: split CTAs everywhere. A/B switch for eval scripts (ablate_decode --paged-wide THREADS UNROLL).
PAGED_WIDE: tuple[int, int] | None = (256, 8)
PAGED_WIDE_SHAPES = ((256, 4), (256, 8))  # the shapes compiled for it
PAGED_WIDE_MIN_CTAS = 132
# H200, batch 16 at 300 cached tokens: 5.166 ms per replay with one CTA against 5.451 with split CTAs (twenty-eighth
# session). H100, forty-third session, one replay each (`ablate_decode --context C`, page capacity in brackets): batch
# 16 at 700 [768] 6.665 against 7.036 ms, at 1,000 [1,280] 7.855 against 8.257, at 2,000 [2,560] 11.830 against
# 12.340; batch 64 at 1,000 [1,280] 23.817 against 26.017. 2,560 is also the capacity bucket of the bench's 2,048-token
# prompts with 128 new tokens. Longer rows keep the split CTAs (not measured there with one CTA).
PAGED_WIDE_MAX_TOKENS = 2560


def decode_shape(batch: int, kv_heads: int, vectors: int, dim: int, capacity: int) -> tuple[int, int]:
    """(threads, unroll) of a paged-decode launch over ``batch`` rows of ``kv_heads`` KV heads, ``vectors`` query
    vectors of ``dim`` per CTA, pages for ``capacity`` tokens per row."""
    wide = PAGED_WIDE is not None and batch * kv_heads >= PAGED_WIDE_MIN_CTAS and capacity <= PAGED_WIDE_MAX_TOKENS
    if wide and 4 * _decode_shared_floats(vectors, dim, 1, PAGED_WIDE[0]) <= _SMEM_LIMIT:
        return PAGED_WIDE
    return _THREADS, _DECODE_UNROLL


def decode_partition(
    batch: int, kv_heads: int, vectors: int, dim: int, capacity: int, max_cluster: int,
    shape: tuple[int, int] | None = None,
) -> tuple[int, int, int]:
    """(splits, tokens_per_split, cluster) for paged decode. splits (a multiple of ``cluster``) is what the longest
    context uses: ~4 CTAs per SM; at run time a row's length activates only as many units of ``cluster`` splits as
    keep each CTA at <= tokens_per_split tokens (two steps of its token loop), so a short context is one unit.
    Clusters (up to ``max_cluster``) serve small batches and capacities of up to 4 units. Measured on the H200
    (16 KV heads, D 128, one call, KV in HBM): batch 1 at 200 tokens 6.4 us in clusters of 8 against 10.8 us in
    single CTAs; at 2,000 tokens 15.7 against 16.1; at 8,000 tokens (5 units of 8) 51.4 against 36.1 (33 single
    CTAs); batch 16 x 16 KV heads in clusters of 8 27.7 us against 18.1 for 3 single-CTA splits."""
    threads, unroll = shape or decode_shape(batch, kv_heads, vectors, dim, capacity)  # shape: the caller's
    tokens_per_split = 2 * unroll * (threads // (dim // 8))
    if threads != _THREADS:  # wide CTAs: one per (row, KV head), a long context's tokens in more steps
        return 1, tokens_per_split, 1
    small_batch = batch * kv_heads * max_cluster <= _DECODE_CTAS
    cluster = max_cluster if small_batch and capacity <= 4 * max_cluster * tokens_per_split else 1
    wanted = min(math.ceil(_DECODE_CTAS / (batch * kv_heads)), math.ceil(capacity / tokens_per_split))
    fits = (_SMEM_LIMIT // 4 - _decode_shared_floats(vectors, dim, 0)) // vectors  # the merge weights
    splits = min(math.ceil(max(1, wanted) / cluster), fits // cluster) * cluster
    return splits, tokens_per_split, cluster


PAGED_DIMS = (16, 32, 64, 128, 256)
# Graphs launch paged decode programmatically where its splits are single CTAs (batch 16 on the H200): the first
# step of its token loop (the cached tokens' K/V) is then loaded while the QKV projection before it runs. H200,
# Ouro-1.4B shape, INT4, 192 cached tokens, GPU time of one graph replay: batch 16 4.73-4.76 ms against 4.87 plain;
# batch 1 (clusters of 8) 2.97 against 2.83 plain, so cluster launches stay plain. A/B switch for eval scripts.
PAGED_PROGRAMMATIC = True
# Cluster launches (batch 1) programmatic too, with the next launch let start only once paged decode is past
# pdl_wait (kernel argument trigger_late). A/B switch for eval scripts.
PAGED_CLUSTER_PROGRAMMATIC = False


def paged_decode(
    query: torch.Tensor,
    cache: PagedTinyLoopCache,
    pages: tuple,
    scaling: float,
    new_tokens: int = 1,
    staged: tuple | None = None,
) -> torch.Tensor:
    """query [B * Q, Hq, D] (Q = ``new_tokens`` per row, already in the cache; causal among themselves) ->
    attention output [B * Q, Hq * D]. ``staged`` (INT8 cache, Q = 1: PagedStorage.staging()): the new tokens' K/V
    are in its staging pages, not yet in ``pages``; the kernel quantizes them into ``pages``."""
    storage = cache.storage
    rows, heads, dim = query.shape
    batch = rows // new_tokens
    kv_heads = storage.kv_heads
    vectors = heads // kv_heads * new_tokens
    if vectors > MAX_CONTINUATION_VECTORS or dim not in PAGED_DIMS:
        raise CudaPathUnavailable(
            f"paged attention serves up to {MAX_CONTINUATION_VECTORS} query vectors (query heads per KV head x new "
            f"tokens) and head_dim in {PAGED_DIMS}, got {vectors} and {dim}"
        )
    threads, unroll = decode_shape(batch, kv_heads, vectors, dim, storage.capacity)
    splits, tokens_per_split, cluster = decode_partition(
        batch, kv_heads, vectors, dim, storage.capacity, decode_cluster(query.device), (threads, unroll)
    )
    out = torch.empty(rows, heads, dim, dtype=query.dtype, device=query.device)
    partial_o = partial_ml = None
    if splits > cluster:
        partial_o = torch.empty(rows * heads * splits * dim, dtype=torch.float32, device=query.device)
        partial_ml = torch.empty(rows * heads * splits * 2, dtype=torch.float32, device=query.device)
    int8 = storage.int8
    if staged is not None and (not int8 or new_tokens != 1):
        raise ValueError("staged K/V serve one new token per row of an INT8 cache")
    type_name = cuda_type(query.dtype)
    args = (ptr(query), ptr(pages[0]), ptr(pages[1]), ptr(pages[2] if int8 else None),
            ptr(pages[3] if int8 else None), *map(ptr, staged[:2] if staged is not None else (None, None)),
            ptr(storage.block_table), ptr(storage.lengths), ptr(storage.starts),
            ptr(out), ptr(partial_o), ptr(partial_ml), ptr(storage.split_counters), i32(heads), i32(kv_heads),
            i32(new_tokens), i32(storage.blocks_per_row), i32(tokens_per_split),
            f32(scaling * math.log2(math.e)), i32(cluster > 1 and PAGED_CLUSTER_PROGRAMMATIC))  # fmt: skip
    smem = 4 * _decode_shared_floats(vectors, dim, splits, threads)
    max_vectors = next(g for g in (1, 2, 4, 8) if g >= vectors)
    name = f"paged_decode<{type_name}, {int(int8)}, {max_vectors}, {cluster}, {dim}, {threads}, {unroll}>"
    launch(kernel("paged_attention.cu", name), (kv_heads, batch, splits), (threads,), args, shared_mem=smem,
           dependent=PAGED_PROGRAMMATIC and (cluster == 1 or PAGED_CLUSTER_PROGRAMMATIC), cluster=cluster)  # fmt: skip
    return out.view(rows, heads * dim)


# ----------------------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------------------


def sample_tokens(logits: torch.Tensor, temperature: float = 0.0, seed: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row of logits [B, V]: argmax (temperature 0) or an exact softmax(logits / T) draw by the
    Gumbel-max trick with noise from ``seed`` (uint64 scalar tensor on the GPU)."""
    _check(logits, "the logits")
    logits = logits.contiguous()
    if temperature > 0 and seed is None:
        raise ValueError("sampling with temperature > 0 needs a seed tensor")
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    args = (ptr(logits), ptr(tokens), i32(logits.shape[-1]), ptr(seed), f32(temperature))
    launch(kernel("sampling.cu", f"sample_tokens<{cuda_type(logits.dtype)}>"), (logits.shape[0],), (1024,), args)
    return tokens


def advance_greedy(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    finished: tuple[torch.Tensor, torch.Tensor] | None,
    lengths: torch.Tensor,
    step_positions: torch.Tensor,
    length: int,
) -> None:
    """The next greedy decode step's inputs in one launch (kernels/sampling.cu advance_greedy): per row of logits [B, V]
    the argmax, or the pad of ``finished`` (pad [1], ends [n]) where the row's token in input_ids [B, 1] is one of the
    ends, into input_ids; position_ids [B, 1] + 1; lengths [B] = length + 1 and step_positions [B] = length."""
    _check(logits, "the logits")
    if logits.stride(-1) != 1 or input_ids.shape[0] != logits.shape[0]:
        raise ValueError("advance_greedy takes logits [B, V] with contiguous rows and one input id per row")
    for tensor, dtype, what in ((input_ids, torch.long, "input_ids"), (position_ids, torch.long, "position_ids"),
                                (lengths, torch.int32, "lengths"), (step_positions, torch.int32, "step positions")):
        if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.numel() != logits.shape[0]:
            raise ValueError(f"advance_greedy: {what} must be a contiguous {dtype} tensor of one value per row")
    pad, ends = finished if finished is not None else (None, None)
    args = (ptr(logits), np.int64(logits.stride(0)), i32(logits.shape[-1]), ptr(input_ids), ptr(position_ids),
            ptr(ends), i32(0 if ends is None else ends.numel()), ptr(pad), ptr(lengths), ptr(step_positions),
            i32(length))  # fmt: skip
    launch(kernel("sampling.cu", f"advance_greedy<{cuda_type(logits.dtype)}>"), (logits.shape[0],), (1024,), args)
