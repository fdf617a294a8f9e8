"""Host side of attention_block.cu: the attention block of a batch-1 decode step (QKV + RoPE + K/V append, paged
attention, o_proj) in one launch of thread-block clusters, one cluster per KV head.

``refusal`` says why a step cannot take it (then the per-op kernels serve it: QKV GEMV, paged decode, O GEMV, all
CUDA-path kernels); the choice depends on the model, the batch and the cache storage's capacity, never on the
current length, so an eager step and a graph replayed at a later length run the same kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tinyloop_hf.paged_cache import PagedTinyLoopCache
from tinyloop_hf.quant_tinyloop import QuantLinear

from .loader import cuda_type, f32, i32, kernel, launch, ptr, sm90_or_newer

# Off by default: not faster. H200, Ouro-1.4B shape, INT4, L = 4, batch 1, 192 cached tokens, graph replay: 3.08 ms per
# step against 2.82 with the three per-op kernels (a first revision, one 24-warp CTA per SM, took 3.69-3.72: its 16
# clusters did not fit on the GPU at once). Its trace (eval/attention_block_profile.py): 16.25 us a launch, the QKV
# projection 5.25 of it, against ~13 us of the step's critical path for the kernels it replaces, which overlap each
# other's weight loads through programmatic launch (eval/results/BENCH.md, sixteenth session).
ATTENTION_BLOCK = False
# Launched programmatically inside graphs: the L2 prefetch of the cached K/V and o_proj slice, and the QKV weights'
# first loads, overlap the junction kernel before it.
PROGRAMMATIC = True
CLUSTER = 8  # attention_block.cu's CTAs per KV head
# Longest cache capacity served: each CTA attends capacity / CLUSTER tokens, where paged decode spreads a long
# context over more clusters.
MAX_TOKENS = 1024
# Warps per CTA: the fewest that give each warp one QKV task (two RoPE pairs), at most 12 (more tasks: a warp loops).
# Bounded to 2 CTAs per SM (80 registers), so that every cluster of a launch fits at once.
WARPS = (4, 8, 12)
_STATIC_SHARED = 1024  # bytes of the kernel's static shared memory (matrices, is_last: 80 by ptxas), with margin
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Profiling (eval/attention_block_profile.py): int64 [launches][KV heads * CLUSTER][8] of %globaltimer stamps, one
# launch's slice per eager launch while set; None (the default) passes no trace.
trace: torch.Tensor | None = None
trace_launches = 0


def _trace_slot(kv_heads: int) -> torch.Tensor | None:
    global trace_launches
    if trace is None:
        return None
    width = kv_heads * CLUSTER * 8
    slot = trace[trace_launches * width : (trace_launches + 1) * width]
    trace_launches += 1
    return slot if slot.numel() == width else None


@dataclass(frozen=True)
class _Plan:
    """What every launch for one attention module and activation dtype passes (built once: the eager step's Python
    time is ~100 launches)."""

    name: str
    warps: int
    smem: int
    counters: torch.Tensor  # [CLUSTER] int32: the last-CTA counts, reset by the kernel
    arguments: tuple  # hidden, group shift, groups of q/k/v rows, groups of o rows, midpoint (after the matrices)
    rope_layout: int
    scale_log2: float


def _plan(module: Any, dtype: torch.dtype) -> _Plan | str:
    """The launch plan of the attention module with activations in ``dtype``, or why it cannot take the kernel."""
    from .ops_cuda import group_shift

    config = module.config
    layers = [getattr(module, name) for name in _PROJECTIONS]
    if not all(isinstance(layer, QuantLinear) and layer.format.bits == 4 and layer.bias is None for layer in layers):
        return "it serves INT4 q/k/v/o projections without bias"
    if len({layer.format for layer in layers}) != 1 or len({layer.scales.dtype for layer in layers}) != 1:
        return "it needs one quantization format for q, k, v and o"
    device = layers[0].qweight.device
    if dtype not in (torch.float16, torch.bfloat16) or not sm90_or_newer(device):
        return "it needs fp16/bf16 activations on sm_90+ (thread-block clusters)"
    heads, kv_heads, dim, hidden = (config.num_attention_heads, config.num_key_value_heads, module.head_dim,
                                    config.hidden_size)  # fmt: skip
    group = heads // kv_heads
    slice_chunks = group * dim // 32  # o_proj columns of one KV group, in 32-column chunks
    fmt = layers[0].format
    # Query heads per KV head <= 4: at 80 registers a thread's 8 dims of o for 8 query vectors would spill.
    if (dim not in (64, 128) or heads % kv_heads or group > 4 or ((group + 2) * dim // 4) % CLUSTER
            or hidden % (32 * CLUSTER) or slice_chunks & (slice_chunks - 1) or slice_chunks > 32
            or (fmt.group_size is not None and (group * dim) % fmt.group_size)):  # fmt: skip
        return f"head_dim {dim}, {heads} heads / {kv_heads} KV heads, hidden {hidden}: outside its work split"
    tasks = (group + 2) * dim // 4 // CLUSTER  # QKV tasks (4 rows) per CTA
    warps = next((w for w in WARPS if w >= tasks), WARPS[-1])
    smem = shared_bytes(group, dim, warps, torch.finfo(dtype).bits // 8)
    if smem > 48 * 1024 - _STATIC_SHARED:
        return "its shared memory exceeds 48 KiB"
    if torch.cuda.is_current_stream_capturing():  # the counters' zero-fill would only be recorded, not run
        raise RuntimeError("attention_block's plan is built by an eager step before graphs are captured")
    maxg = next(g for g in (1, 2, 4) if g >= group)
    scale_bf16 = int(layers[0].scales.dtype == torch.bfloat16)
    return _Plan(
        name=f"ablock::attention_block<{cuda_type(dtype)}, {dim}, {maxg}, {warps}, {scale_bf16}>",
        warps=warps,
        smem=smem,
        counters=torch.zeros(CLUSTER, dtype=torch.int32, device=device),
        arguments=tuple(map(i32, (hidden, group_shift(fmt), fmt.groups(hidden), fmt.groups(heads * dim),
                                  fmt.midpoint))),  # fmt: skip
        rope_layout=0 if config.rope_layout == "rotate_half" else 1,
        scale_log2=module.scaling * math.log2(math.e),
    )


def refusal(module: Any, rows: torch.Tensor, batch: int, steps: int, cache: Any) -> str | None:
    """Why this attention step cannot run as one attention_block launch (None: it can)."""
    if not ATTENTION_BLOCK:
        return "switched off (attention_block.ATTENTION_BLOCK)"
    if batch * steps != 1:
        return "it serves one decode token (batch 1)"
    if not isinstance(cache, PagedTinyLoopCache) or cache.storage is None:
        return "it needs a paged cache"
    storage = cache.storage
    if storage.int8 or storage.batch != 1 or storage.capacity > MAX_TOKENS or storage.dtype != rows.dtype:
        return f"it serves 16-bit K/V of one row in the activation dtype, up to {MAX_TOKENS} tokens of capacity"
    if rows.data_ptr() % 16:
        return "its input row is not 16-byte aligned"
    plan = _plan_of(module, rows)
    return plan if isinstance(plan, str) else None


def _plan_of(module: Any, rows: torch.Tensor) -> _Plan | str:
    plans = module.__dict__.setdefault("_attention_block_plans", {})
    key = (rows.dtype, rows.device)
    if key not in plans:
        plans[key] = _plan(module, rows.dtype)
    return plans[key]


def shared_bytes(group: int, dim: int, warps: int, itemsize: int) -> int:
    """attention_block.cu's dynamic shared memory: mine, full, per-warp states, the CTA state, the output in T."""
    values = (group + 2) * dim
    floats = 2 * values + warps * group * (dim + 2) + group * dim + (2 * group + 3) // 4 * 4
    return 4 * floats + group * dim * itemsize


def attend(module: Any, rows: torch.Tensor, context: Any, slot: int) -> torch.Tensor:
    """The o_proj output [1, hidden] of attention over the normed input ``rows`` [1, hidden] (see refusal)."""
    plan = _plan_of(module, rows)
    config, cache = module.config, context.cache
    storage = cache.storage
    cache.mark_written(slot)
    k_pages, v_pages = storage.slot(slot)[:2]
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    cos, sin = context.cos.contiguous(), context.sin.contiguous()  # kept alive until the launch is queued
    partials = torch.empty(kv_heads * hidden, dtype=torch.float32, device=rows.device)
    out = torch.empty(1, hidden, dtype=rows.dtype, device=rows.device)
    matrices = [ptr(getattr(getattr(module, projection), name, None)) for projection in _PROJECTIONS
                for name in ("qweight", "scales", "zeros")]  # fmt: skip
    args = (ptr(rows), *matrices, *plan.arguments, ptr(cos), ptr(sin), i32(plan.rope_layout), ptr(k_pages),
            ptr(v_pages), ptr(storage.block_table), ptr(cache.step_positions), ptr(storage.lengths),
            ptr(storage.starts), ptr(partials), ptr(plan.counters), ptr(out), i32(heads), i32(kv_heads),
            f32(plan.scale_log2), ptr(_trace_slot(kv_heads)))  # fmt: skip
    launch(kernel("attention_block.cu", plan.name), (kv_heads, 1, CLUSTER), (32 * plan.warps,), args,
           shared_mem=plan.smem, dependent=PROGRAMMATIC, cluster=CLUSTER)  # fmt: skip
    return out
