"""Host side of fused_decode.cu: whether a batch-1 decode step can run as one launch, the launch's tables, the launch.

The kernel runs every layer application of the step (all loops) on one CTA per SM but SPARE_SMS (see
fused_decode.cu). What it serves is checked here, and a step it cannot serve runs on the per-op CUDA kernels instead,
with the reason available from ``refusal`` (``model_refusal`` for the model alone). Both are the CUDA path; nothing
falls back to the reference. The layout — which rows of each projection a CTA owns, where they sit in its shared
memory, which TMA copies bring them — is computed by ``layout()`` in plain Python (tests check it without a GPU).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any

import torch

# On by default since the twenty-first session: H200, Ouro-1.4B shape, INT4, L = 4, batch 1, graph replay: 2.47 ms
# (384-thread CTAs) against 2.76 per-op. Its structure alone (six LL hand-offs per layer application, no math, weights
# or attention; timing only) takes 1.38 ms of that (eval/results/BENCH.md, twentieth session). Switch it off to
# measure the per-op chain: ``fused_decode.FUSED_DECODE = False``.
FUSED_DECODE = True
CHUNK_BYTES = 16 * 1024  # a TMA batch: about this many bytes per ring mbarrier
INFLIGHT = 2  # batches in flight per CTA (H200 probe: deep weight queues slow every poll and barrier)
# Attention splits per KV head (None: as many as the CTAs allow, 8 on the H200 at 16 KV heads). Fewer splits attend
# longer on fewer CTAs but shorten the merge; they did not pay (eval/fused_profile.py --replay --splits, H200: 3.61 ms
# at 2 splits, 3.49 at 4, 3.42-3.55 at 8).
SPLITS: int | None = None
# A spare lane of the producer warp prefetches each attention split's cached K / V pages into L2, one layer application
# ahead, so that the split's first loads (issued before its q / K / V poll) do not queue from HBM ahead of that poll.
KV_PREFETCH = True
# SMs left free of the kernel's CTAs. A CTA fills its SM's register file (384 x 168 or 512 x 128 registers), so on a
# full grid nothing else runs until the step ends: generate()'s own kernels for the previous token (argmax, stopping
# check) then wait behind a step run ahead (cuda_path run-ahead), and so does the host. H200, greedy generate() of
# the Ouro-1.4B shape with no SM spare: replays 2.49 ms but 3.35 ms per token, the GPU idle 0.87 ms between replays;
# 2 or 4 spare: 2.52 ms per token, 40 us idle. At 8 spare (124 CTAs) that shape's plan outgrows shared memory.
SPARE_SMS = 4
# The kernel's CTAs wait on one another, so all must be resident at once. A cooperative launch guarantees it (or fails
# with a clear CUresult): without it two fused steps queued on two streams of one GPU (two models decoding at once)
# could each get part of the SMs and spin until SPIN_LIMIT traps. H200, Ouro-1.4B shape: 2.473 ms per replay
# cooperative against 2.475 / 2.479 plain (twenty-second session). Off only for that A/B
# (``ablate_decode --plain-fused-launch``).
COOPERATIVE = True
# In a graph the kernel is launched programmatically: the RoPE angles kernel before it lets it start at once, so its
# CTAs start up and its weight stream begins while that kernel runs (it reads their outputs after pdl_wait), and it lets
# the LM head after it start while CTA 0 finishes the last junction. Off for A/B (``ablate_decode
# --no-fused-programmatic``).
PROGRAMMATIC = True
RING, MAX_TASKS, MAX_UNITS, STAGE_WORDS = 128, 64, 128, 4  # fused_decode.cu constants
# CTA sizes, in the order tried: 384 threads (11 consumer warps, 168 registers, no spills) where a staged vector fits
# their STAGE_WORDS words each, else 512 (15 consumer warps at the 128-register cap). H200, Ouro-1.4B shape: 2.47 ms
# per replay at 384 against 2.60 at 512 (twenty-first session).
THREAD_CHOICES = (384, 512)
# Experiments and tests: one CTA size instead of the choice (a model it cannot serve is refused).
THREADS: int | None = None
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KINDS = ("qweight", "scales", "zeros")
LOOP_END = 1
JUNCTION_MODES = {"pre": 0, "sandwich": 1, "post_residual": 2}


def threads_for(hidden: int, widest: int) -> int | None:
    """The CTA size for a hidden size and the widest staged vector (max of intermediate, hidden, heads x head_dim):
    the first of THREAD_CHOICES (or THREADS) whose consumer threads cover a hidden vector 8 values each and the
    widest vector in STAGE_WORDS words of 4 values each; None when none does."""
    for threads in (THREADS,) if THREADS else THREAD_CHOICES:
        consumers = threads - 32
        if hidden // 8 <= consumers and widest // 4 <= STAGE_WORDS * consumers:
            return threads
    return None


# ----------------------------------------------------------------------------------------------------------------------
# The kernel's structs (fused_decode.cu), field for field
# ----------------------------------------------------------------------------------------------------------------------

_ptr, _i32, _u32, _f32, _u8 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float, ctypes.c_uint8


class AppStruct(ctypes.Structure):
    _fields_ = [("mat", _ptr * 21), ("norm", _ptr * 4), ("k_pages", _ptr), ("v_pages", _ptr), ("flags", _i32),
                ("loop", _i32), ("pad", _i32 * 2)]  # fmt: skip


class PieceStruct(ctypes.Structure):
    _fields_ = [("mat", _u8), ("kind", _u8), ("last", _u8), ("pad", _u8), ("offset", _u32), ("bytes", _u32),
                ("smem", _u32), ("batch_bytes", _u32), ("pad2", _u32 * 3)]  # fmt: skip


class WorkStruct(ctypes.Structure):
    _fields_ = [("unit0", _i32), ("units", _i32), ("o_quad0", _i32), ("o_quads", _i32), ("g_quad0", _i32),
                ("g_quads", _i32), ("d_quad0", _i32), ("d_quads", _i32), ("piece0", _i32),
                ("slot_piece0", _i32 * 4), ("slot_pieces", _i32 * 4), ("slot_batch0", _i32 * 4),
                ("slot_batches", _i32 * 4), ("batches_per_app", _i32), ("pad", _i32 * 3)]  # fmt: skip


class SlotStruct(ctypes.Structure):
    _fields_ = [("weights", _u32), ("scales", _u32), ("zeros", _u32), ("row_bytes", _i32), ("groups", _i32),
                ("group_shift", _i32), ("rows_cap", _i32), ("pad", _i32)]  # fmt: skip


class ParamsStruct(ctypes.Structure):
    _fields_ = [(name, _i32) for name in ("H", "F", "Hq", "Hkv", "D", "Gq", "apps", "S", "G", "mode",
                                          "final_every_loop", "final_end", "rope_interleaved", "scale_bf16",
                                          "midpoint", "chunk", "inflight")]  # fmt: skip
    _fields_ += [("eps", _f32), ("scale_log2", _f32)]
    _fields_ += [(name, _ptr) for name in ("block_table", "lengths", "starts", "positions", "final_w", "gate_w",
                                           "gate_b", "hidden_out", "gates_out", "epoch", "q_ll", "k_ll", "v_ll",
                                           "part_ll", "attn_ll", "o_ll", "h_ll", "down_ll", "apps_table", "work",
                                           "pieces", "unit_rows", "trace")]  # fmt: skip
    _fields_ += [("slot", SlotStruct * 4), ("xres", _u32), ("stage", _u32), ("partials", _u32),
                 ("smem_bytes", _u32), ("kv_prefetch", _i32)]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# Layout: work per CTA, shared memory, TMA pieces (no GPU needed)
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    groups_of: dict  # in_features -> scale groups per row
    zeros: bool
    itemsize: int  # activation bytes
    interleaved: bool  # RoPE pairs (2p, 2p + 1) instead of (p, p + D/2)


@dataclass
class Piece:
    slot: int
    mat: int
    kind: int
    offset: int
    bytes: int
    smem: int
    last: bool = False
    batch_bytes: int = 0


@dataclass
class CtaWork:
    units: tuple[int, int]  # first, count
    o_quads: tuple[int, int]
    g_quads: tuple[int, int]
    d_quads: tuple[int, int]
    unit_rows: list[int] = field(default_factory=list)  # local row of each unit's first row | second << 16
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Layout:
    ctas: list[CtaWork]
    slots: list[dict]  # weights / scales / zeros offsets, row_bytes, groups, rows_cap
    xres: int
    stage: int
    partials: int
    smem_bytes: int
    splits: int
    threads: int  # per CTA


def grid_for(sms: int, shapes: Shapes) -> int:
    """CTAs of a launch on a device of ``sms`` SMs: one per SM but SPARE_SMS, at most one per QKV pair unit and per
    gate/up quad (the LL buffers are reused safely only because each phase's next writer depends on every CTA through
    those two phases)."""
    units = (shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim // 2
    return min(max(1, sms - SPARE_SMS), units, shapes.intermediate // 4)


def _share(total: int, cta: int, ctas: int) -> tuple[int, int]:
    first = cta * total // ctas
    return first, (cta + 1) * total // ctas - first


def _align(value: int, to: int = 128) -> int:
    return -(-value // to) * to


def unit_rows(unit: int, shapes: Shapes) -> tuple[int, int, int]:
    """(matrix: 0 q / 1 k / 2 v, row of the pair's first dim, row of its second) of QKV pair unit ``unit``."""
    half = shapes.head_dim // 2
    head, pair = divmod(unit, half)
    first, second = (2 * pair, 2 * pair + 1) if shapes.interleaved else (pair, pair + half)
    if head < shapes.heads:
        return 0, head * shapes.head_dim + first, head * shapes.head_dim + second
    head -= shapes.heads
    matrix = 1 if head < shapes.kv_heads else 2
    head %= shapes.kv_heads
    return matrix, head * shapes.head_dim + first, head * shapes.head_dim + second


def layout(shapes: Shapes, ctas: int, chunk: int = CHUNK_BYTES) -> Layout | str:
    """The kernel's work split and shared-memory plan for ``ctas`` CTAs, or why the kernel cannot take the shapes."""
    H, F, D = shapes.hidden, shapes.intermediate, shapes.head_dim
    Hq, Hkv = shapes.heads, shapes.kv_heads
    widest = max(F, H, Hq * D)
    threads = threads_for(H, widest)
    if threads is None:
        return f"no CTA size of {THREADS or THREAD_CHOICES} threads covers hidden {H} / widest vector {widest}"
    units = (Hq + 2 * Hkv) * D // 2
    work = [
        CtaWork(_share(units, c, ctas), _share(H // 4, c, ctas), _share(F // 4, c, ctas), _share(H // 4, c, ctas))
        for c in range(ctas)
    ]
    # Slot geometry: 0 QKV (K = H), 1 O (K = Hq * D), 2 gate/up (K = H), 3 down (K = F).
    in_features = (H, Hq * D, H, F)
    max_rows = (
        2 * max(w.units[1] for w in work),
        4 * max(w.o_quads[1] for w in work),
        8 * max(w.g_quads[1] for w in work),
        4 * max(w.d_quads[1] for w in work),
    )
    slots, offset = [], 0
    for K, rows in zip(in_features, max_rows, strict=True):
        groups = shapes.groups_of[K]
        slot = {"row_bytes": K // 2, "groups": groups, "rows_cap": rows // 2, "weights": offset}
        offset = _align(offset + rows * K // 2)
        slot["scales"] = offset
        offset = _align(offset + rows * groups * 2)
        slot["zeros"] = offset if shapes.zeros else 0
        offset = _align(offset + (rows * groups if shapes.zeros else 0))
        slots.append(slot)
    xres = offset
    offset = _align(offset + H * shapes.itemsize)
    stage = offset
    gq = Hq // Hkv
    maxg = next(g for g in (1, 2, 4, 8) if g >= gq)
    attention_floats = gq * D + 2 * D + (threads - 32) // 32 * maxg * (D + 2)
    splits = max(1, ctas // Hkv if SPLITS is None else min(SPLITS, ctas // Hkv))
    stage_bytes = widest * shapes.itemsize
    while splits > 1 and 4 * gq * splits * (D + 2) > max(stage_bytes, 4 * attention_floats):
        splits -= 1  # the split merge's states must fit in the stage
    stage_bytes = max(stage_bytes, 4 * attention_floats, 4 * gq * splits * (D + 2))
    offset = _align(offset + stage_bytes)
    partials = offset
    offset = _align(offset + MAX_TASKS * 4 * 4)
    for cta in work:
        reason = _pieces(cta, slots, shapes, chunk)
        if reason:
            return reason
    return Layout(work, slots, xres, stage, partials, offset, splits, threads)


def _pieces(cta: CtaWork, slots: list[dict], shapes: Shapes, chunk: int) -> str | None:
    """Fill cta.unit_rows and cta.pieces (TMA copies in batches); the reason when a copy would be misaligned."""
    # Local rows of slot 0: the CTA's QKV rows sorted by (matrix, row), so that runs of rows are one copy each.
    first_unit, count = cta.units
    pairs = [unit_rows(u, shapes) for u in range(first_unit, first_unit + count)]
    rows = sorted({(matrix, row) for matrix, *both in pairs for row in both})
    local = {key: index for index, key in enumerate(rows)}
    cta.unit_rows = [local[(matrix, first)] | local[(matrix, second)] << 16 for matrix, first, second in pairs]
    runs: list[tuple[int, int, int, int, int]] = []  # (slot, matrix, first row, rows, first local row)
    for index, (matrix, row) in enumerate(rows):
        last = runs[-1] if runs else None
        if last and last[1] == matrix and last[2] + last[3] == row:
            runs[-1] = (0, matrix, last[2], last[3] + 1, last[4])
        else:
            runs.append((0, matrix, row, 1, index))
    o0, on = cta.o_quads
    g0, gn = cta.g_quads
    d0, dn = cta.d_quads
    runs += [(1, 3, 4 * o0, 4 * on, 0), (2, 4, 4 * g0, 4 * gn, 0), (2, 5, 4 * g0, 4 * gn, slots[2]["rows_cap"]),
             (3, 6, 4 * d0, 4 * dn, 0)]  # fmt: skip
    for slot_index, matrix, row, n, local_row in runs:
        if n == 0:
            continue
        slot = slots[slot_index]
        widths = (slot["row_bytes"], 2 * slot["groups"], slot["groups"])
        bases = (slot["weights"], slot["scales"], slot["zeros"])
        for kind in range(3 if shapes.zeros else 2):
            width = widths[kind]
            step = max(1, chunk // width) if kind == 0 else n  # weights split into batch-sized copies
            for r in range(0, n, step):
                rows_here = min(step, n - r)
                piece = Piece(slot_index, matrix, kind, (row + r) * width, rows_here * width,
                              bases[kind] + (local_row + r) * width)  # fmt: skip
                if piece.offset % 16 or piece.bytes % 16 or piece.smem % 16:
                    return (f"{MATRICES[matrix]}.{KINDS[kind]} rows {row + r}..{row + r + rows_here} are not a "
                            f"16-byte aligned copy ({width} bytes a row)")  # fmt: skip
                cta.pieces.append(piece)
    # Batches of about `chunk` bytes, never across slots (a slot's consumers wait for its batches).
    cta.pieces.sort(key=lambda piece: piece.slot)  # stable: runs keep their order
    batch: list[Piece] = []
    for index, piece in enumerate(cta.pieces):
        batch.append(piece)
        following = cta.pieces[index + 1] if index + 1 < len(cta.pieces) else None
        size = sum(p.bytes for p in batch)
        if following is None or following.slot != piece.slot or size + following.bytes > chunk:
            batch[0].batch_bytes = size
            batch[-1].last = True
            batch = []
    return None


def batches(cta: CtaWork) -> list[int]:
    """Batches per slot of a CTA."""
    counts = [0, 0, 0, 0]
    for piece in cta.pieces:
        counts[piece.slot] += piece.last
    return counts


# ----------------------------------------------------------------------------------------------------------------------
# Serving checks and the plan on the device
# ----------------------------------------------------------------------------------------------------------------------


def _linears(layer: Any) -> list[Any]:
    """The block's projections in MATRICES order."""
    return [getattr(layer.self_attn if index < 4 else layer.mlp, name) for index, name in enumerate(MATRICES)]


def refusal(model: Any, hidden: torch.Tensor, cache: Any, loops: int) -> str | None:
    """Why the fused kernel cannot run this decode step (None: it can)."""
    return step_refusal(hidden, cache, loops) or model_refusal(model, hidden.dtype)


def step_refusal(hidden: torch.Tensor, cache: Any, loops: int) -> str | None:
    """What of the step itself the kernel does not serve."""
    from tinyloop_hf.paged_cache import PagedTinyLoopCache

    from .loader import sm90_or_newer

    if not FUSED_DECODE:
        return "switched off (fused_decode.FUSED_DECODE)"
    if not sm90_or_newer(hidden.device):
        return "it needs sm_90+ (TMA bulk copies)"
    if hidden.shape[:2] != (1, 1) or hidden.dtype not in (torch.float16, torch.bfloat16):
        return "it serves one fp16/bf16 token row (batch 1 decode)"
    if not isinstance(cache, PagedTinyLoopCache) or cache.storage is None or cache.length == 0:
        return "it needs a paged cache holding the prompt"
    if cache.storage.int8 or cache.storage.batch != 1 or cache.loops_cached() > loops:
        return "it serves 16-bit K/V of one row at the cache's loop depth"
    if loops < 1:
        return "no loop to run"
    return None


def model_refusal(model: Any, dtype: torch.dtype) -> str | None:
    """What of the model (TinyLoopModel) the kernel does not serve, with activations in ``dtype``."""
    from tinyloop_hf.quant_tinyloop import QuantLinear

    config = model.config
    if config.num_prelude_layers or config.num_coda_layers or config.input_injection != "none":
        return "it serves loop blocks without prelude, coda or input injection"
    if config.initial_state != "input" or config.final_norm not in ("every_loop", "end"):
        return "it serves initial_state 'input' with final_norm 'every_loop' or 'end'"
    if config.attention_bias != "none":
        return "it serves projections without bias"
    layers = model.loop_layers
    linears = [linear for layer in layers for linear in _linears(layer)]
    if not all(isinstance(linear, QuantLinear) and linear.format.bits == 4 and linear.bias is None
               for linear in linears):  # fmt: skip
        return "it serves INT4 loop-block projections without bias"
    formats = {linear.format for linear in linears}
    if len(formats) != 1:
        return "it needs one quantization format for every projection"
    gate = getattr(model, "exit_gate", None)
    if config.exit_gate and (not isinstance(gate, torch.nn.Linear) or gate.weight.dtype != dtype):
        return "it needs an unquantized exit gate in the activation dtype"
    H, F, D = config.hidden_size, config.intermediate_size, config.head_dim
    if H % 32 or F % 32 or threads_for(H, max(F, H, config.num_attention_heads * D)) is None:
        return f"hidden_size {H} / intermediate_size {F} / heads x head_dim outside what one CTA's threads cover"
    norms = [model.norm.weight] + [norm.weight for layer in layers for norm in layer.modules()
                                   if norm is not layer and hasattr(norm, "eps")]  # fmt: skip
    if config.exit_gate:
        norms += [model.exit_gate.weight] + ([model.exit_gate.bias] if model.exit_gate.bias is not None else [])
    if any(weight.dtype != dtype for weight in norms):
        return "its norm and exit-gate weights must be in the activation dtype"
    if D not in (64, 128, 256) or config.num_attention_heads % config.num_key_value_heads:
        return f"head_dim {D} (64, 128 or 256 served)"
    if config.num_attention_heads // config.num_key_value_heads > 8:
        return "more than 8 query heads per KV head"
    return None


@dataclass
class Plan:
    """Device tables and buffers of one (model, cache storage, loop count)."""

    params: torch.Tensor
    keep: list  # tensors the tables point into
    hidden_out: torch.Tensor
    gates_out: torch.Tensor
    name: str
    grid: int
    threads: int
    smem: int
    slots: list[int]  # cache slots written, in application order


class FusedDecode:
    """The fused decode kernel for one model (CudaPath owns one): plans per (storage serial, loops)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.plans: dict[tuple, Plan | str] = {}
        self.model_refusals: dict[torch.dtype, str | None] = {}  # model_refusal per dtype (it walks every layer)
        self.steps = 0  # decode steps run fused (tests read it)
        self.trace: torch.Tensor | None = None  # int64 [apps * 16 * grid]: phase timestamps of plans built from now on

    def drop(self, serial: int | None = None) -> None:
        self.plans = {} if serial is None else {k: v for k, v in self.plans.items() if k[0] != serial}

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, loops: int) -> Any:
        """(last hidden state [1, 1, H], exit-gate logits per loop or None) of the decode step, or None when the
        kernel does not serve it (``refusal`` says why)."""
        from .loader import kernel, launch, ptr

        model = self.model.model if hasattr(self.model, "model") else self.model
        if step_refusal(hidden, cache, loops) is not None:
            return None
        if hidden.dtype not in self.model_refusals:
            self.model_refusals[hidden.dtype] = model_refusal(model, hidden.dtype)
        if self.model_refusals[hidden.dtype] is not None:
            return None
        key = (cache.storage.serial, loops, hidden.dtype)
        plan = self.plans.get(key)
        if plan is None:
            if torch.cuda.is_current_stream_capturing():
                return None  # tables are built by an eager step (a capture cannot copy them to the device)
            plan = self.plans[key] = self._plan(model, cache, loops, hidden.dtype)
        if isinstance(plan, str):
            return None
        function = kernel("fused_decode.cu", plan.name)
        if function.max_dynamic_shared_size_bytes != plan.smem:
            function.max_dynamic_shared_size_bytes = plan.smem
        launch(function, (plan.grid,), (plan.threads,), (ptr(plan.params), ptr(cos), ptr(sin), ptr(hidden)),
               shared_mem=plan.smem, dependent=PROGRAMMATIC, cooperative=COOPERATIVE)  # fmt: skip
        for slot in plan.slots:
            cache.mark_written(slot)
        self.steps += 1
        out = plan.hidden_out.view(1, 1, -1)
        gates = [plan.gates_out[loop].view(1, 1) for loop in range(loops)] if model.config.exit_gate else None
        if not torch.cuda.is_current_stream_capturing():  # eager callers keep what they get
            out = out.clone()
            gates = [gate.clone() for gate in gates] if gates is not None else None
        return out, gates

    def _plan(self, model: Any, cache: Any, loops: int, dtype: torch.dtype) -> Plan | str:
        from .loader import cuda_type, multiprocessors
        from .ops_cuda import group_shift

        config, storage, device = model.config, cache.storage, cache.storage.device
        layers = model.loop_layers
        fmt = layers[0].self_attn.q_proj.format
        H, F, D, Hq, Hkv = (config.hidden_size, config.intermediate_size, config.head_dim, config.num_attention_heads,
                            config.num_key_value_heads)  # fmt: skip
        itemsize = torch.empty((), dtype=dtype).element_size()
        shapes = Shapes(H, F, Hq, Hkv, D, {K: fmt.groups(K) for K in (H, Hq * D, F)}, not fmt.symmetric, itemsize,
                        config.rope_layout == "interleaved")  # fmt: skip
        grid = grid_for(multiprocessors(device), shapes)
        if grid < Hkv:
            return f"fewer CTAs ({grid}) than KV heads ({Hkv})"
        misaligned = [name for layer in layers for name, linear in zip(MATRICES, _linears(layer), strict=True)
                      for kind in KINDS if getattr(linear, kind, None) is not None
                      and getattr(linear, kind).data_ptr() % 16]  # fmt: skip
        if misaligned:
            return f"{misaligned[0]} tensors are not 16-byte aligned"
        plan = layout(shapes, grid, CHUNK_BYTES)
        if isinstance(plan, str):
            return plan
        gq = Hq // Hkv
        maxg = next(g for g in (1, 2, 4, 8) if g >= gq)
        name = f"fused::fused_decode<{cuda_type(dtype)}, {D}, {maxg}, {plan.threads}>"
        limit = _smem_limit(device) - 4096  # less the kernel's static shared memory (3,456 bytes: ptxas, sm_90)
        if plan.smem_bytes > limit:
            return f"its shared memory ({plan.smem_bytes} bytes) exceeds the device's {limit}"
        counts = [batches(cta) for cta in plan.ctas]
        if max(sum(c) for c in counts) > RING // 2 or max(w.units[1] for w in plan.ctas) > MAX_UNITS:
            return "too many copies or QKV units per CTA"
        parts = -(-F // 32 // 64)
        if max(w.d_quads[1] for w in plan.ctas) * parts > MAX_TASKS:
            return "too many down-projection tasks per CTA"
        keep: list = []

        def device_bytes(structs: ctypes.Array) -> torch.Tensor:
            tensor = torch.frombuffer(bytearray(bytes(structs)), dtype=torch.uint8).to(device)
            keep.append(tensor)
            return tensor

        # Applications: loop-major, each with its layer's tensors and its slot's pages.
        apps = (AppStruct * (loops * len(layers)))()
        slots = []
        for index in range(loops * len(layers)):
            loop, layer_index = divmod(index, len(layers))
            layer = layers[layer_index]
            slot = cache.slot_index("loop", layer_index, loop)
            slots.append(slot)
            pages = storage.slot(slot)
            app = apps[index]
            for m, linear in enumerate(_linears(layer)):
                for k, kind in enumerate(KINDS):
                    tensor = getattr(linear, kind, None)
                    app.mat[3 * m + k] = 0 if tensor is None else tensor.data_ptr()
            norms = (layer.input_layernorm, getattr(layer, "input_layernorm_2", None), layer.post_attention_layernorm,
                     getattr(layer, "post_attention_layernorm_2", None))  # fmt: skip
            for n, norm in enumerate(norms):
                app.norm[n] = 0 if norm is None else norm.weight.data_ptr()
            app.k_pages, app.v_pages = pages[0].data_ptr(), pages[1].data_ptr()
            app.flags = LOOP_END if layer_index == len(layers) - 1 else 0
            app.loop = loop
        pieces, work = [], (WorkStruct * grid)()
        rows = (ctypes.c_uint32 * (grid * MAX_UNITS))()
        for c, cta in enumerate(plan.ctas):
            w = work[c]
            w.unit0, w.units = cta.units
            w.o_quad0, w.o_quads = cta.o_quads
            w.g_quad0, w.g_quads = cta.g_quads
            w.d_quad0, w.d_quads = cta.d_quads
            w.piece0 = len(pieces)
            first_piece = first_batch = 0
            for s in range(4):
                mine = [p for p in cta.pieces if p.slot == s]
                w.slot_piece0[s], w.slot_pieces[s] = first_piece, len(mine)
                w.slot_batch0[s], w.slot_batches[s] = first_batch, counts[c][s]
                first_piece += len(mine)
                first_batch += counts[c][s]
            w.batches_per_app = first_batch
            pieces += cta.pieces
            for j, value in enumerate(cta.unit_rows):
                rows[c * MAX_UNITS + j] = value
        piece_structs = (PieceStruct * max(1, len(pieces)))()
        for i, p in enumerate(pieces):
            target = piece_structs[i]
            target.mat, target.kind, target.last = p.mat, p.kind, int(p.last)
            target.offset, target.bytes, target.smem, target.batch_bytes = p.offset, p.bytes, p.smem, p.batch_bytes

        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            tensor = torch.zeros(*shape, dtype=dtype, device=device)
            keep.append(tensor)
            return tensor

        S = plan.splits
        params = ParamsStruct()
        for member, value in dict(H=H, F=F, Hq=Hq, Hkv=Hkv, D=D, Gq=gq, apps=loops * len(layers), S=S, G=grid,
                                mode=JUNCTION_MODES[config.block_norm],
                                final_every_loop=int(config.final_norm == "every_loop"),
                                final_end=int(config.final_norm == "end"), rope_interleaved=int(shapes.interleaved),
                                scale_bf16=int(layers[0].self_attn.q_proj.scales.dtype == torch.bfloat16),
                                midpoint=fmt.midpoint, chunk=CHUNK_BYTES, inflight=INFLIGHT).items():  # fmt: skip
            setattr(params, member, value)
        params.eps = config.rms_norm_eps
        params.scale_log2 = D**-0.5 * math.log2(math.e)
        params.block_table, params.lengths = storage.block_table.data_ptr(), storage.lengths.data_ptr()
        params.starts, params.positions = storage.starts.data_ptr(), storage.step_positions(1).data_ptr()
        params.final_w = model.norm.weight.data_ptr()
        if config.exit_gate:
            params.gate_w = model.exit_gate.weight.data_ptr()
            params.gate_b = 0 if model.exit_gate.bias is None else model.exit_gate.bias.data_ptr()
        hidden_out = zeros(H, dtype=dtype)
        gates_out = zeros(loops, dtype=dtype)
        params.hidden_out, params.gates_out = hidden_out.data_ptr(), gates_out.data_ptr()
        params.epoch = zeros(1).data_ptr()  # launches so far: part of every sequence number
        # LL buffers (8-byte words: 2 ints; 16-byte words: 4 ints), zeroed: no sequence number is 0.
        params.q_ll, params.k_ll, params.v_ll = (zeros(n, 2).data_ptr() for n in (Hq * D, Hkv * D, Hkv * D))
        params.part_ll = zeros(Hkv * S * gq * (D + 2), 2).data_ptr()
        params.attn_ll, params.o_ll, params.h_ll, params.down_ll = (zeros(n // 4, 4).data_ptr()
                                                                    for n in (Hq * D, H, F, H))  # fmt: skip
        params.apps_table = device_bytes(apps).data_ptr()
        params.work = device_bytes(work).data_ptr()
        params.pieces = device_bytes(piece_structs).data_ptr()
        params.unit_rows = device_bytes(rows).data_ptr()
        params.trace = 0 if self.trace is None else self.trace.data_ptr()
        for s, slot in enumerate(plan.slots):
            target = params.slot[s]
            target.weights, target.scales, target.zeros = slot["weights"], slot["scales"], slot["zeros"]
            target.row_bytes, target.groups, target.rows_cap = slot["row_bytes"], slot["groups"], slot["rows_cap"]
            target.group_shift = group_shift(fmt)
        params.xres, params.stage, params.partials, params.smem_bytes = (plan.xres, plan.stage, plan.partials,
                                                                         plan.smem_bytes)  # fmt: skip
        params.kv_prefetch = int(KV_PREFETCH)
        return Plan(device_bytes(params), keep, hidden_out, gates_out, name, grid, plan.threads, plan.smem_bytes, slots)


def _smem_limit(device: torch.device) -> int:
    """Opt-in shared memory per block of ``device``."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(cupy.cuda.runtime.getDeviceProperties(index)["sharedMemPerBlockOptin"])
