"""Paged mode of TinyLoopCache: K/V in 16-token pages addressed through a block table, bf16/fp16 or INT8 KV.

Layout (shared with kernels/rope_kv_append.cu and kernels/paged_attention.cu):
  pages  K, V: [blocks, H_kv, 16, D] per slot (model dtype, or int8)
  scales K, V: [blocks, H_kv, 16] fp32 per slot when INT8 (one scale per token and KV head: max|x| / 127)
  block_table: int32 [B, blocks_per_row]; token p of row b lives in page block_table[b, p // 16], row p % 16.
Every slot (prelude/coda layer, loop x loop-block layer) shares the block table and the sequence bookkeeping, so
one table serves all of them. Rows get their blocks from one pool in row order; beam reorder and batch selection
copy page contents in place, so buffers never move and a captured CUDA graph stays valid.

The reference path runs on this cache too (``update`` writes pages with torch ops and returns the gathered K/V), which
makes the layout and the INT8 rounding testable on a CPU; the CUDA path's kernels read and write the same pages.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache_tinyloop import TinyLoopCache
from .compat import graph_capturing
from .configuration_tinyloop import TinyLoopConfig, is_int

PAGE_SIZE = 16
MAX_CONTINUATION_VECTORS = 8  # query vectors (query heads of a KV group x new tokens) of one paged-attention CTA
STEP_POSITION_SLOTS = 32  # new tokens per row whose cache positions a captured continuation step reads from memory
KV_DTYPES = ("auto", "int8")
STORAGE_SERIALS = itertools.count()  # PagedStorage.serial
_LEFT_PADDING_ONLY = (
    "a paged TinyLoopCache supports left padding only (attention_mask rows of zeros then ones); "
    "this attention_mask has zeros after the first one"
)


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {list(KV_DTYPES)} ('auto' = the model dtype), got {kv_dtype!r}"
        )
    return kv_dtype


@dataclass
class PagedStorage:
    """Device buffers of a paged cache for ``batch`` rows of up to ``capacity`` tokens (reusable across caches)."""

    batch: int
    capacity: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    int8: bool
    device: torch.device
    pages: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # slot -> (k, v[, k_scale, v_scale])
    staged: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)  # INT8: see staging()
    # Called when a slot's pages do not fit in device memory: True when it freed something (the CUDA path drops the
    # storages of earlier generate() calls) and the allocation is tried again; False when it gave up on this storage.
    reclaim: Callable[[], bool] | None = field(default=None, repr=False)
    serial: int = field(default_factory=lambda: next(STORAGE_SERIALS))  # unique in the process (graph keys use it)

    def __post_init__(self) -> None:
        self.blocks_per_row = math.ceil(self.capacity / PAGE_SIZE)
        blocks = torch.arange(self.batch * self.blocks_per_row, dtype=torch.int32, device=self.device)
        self.block_table = blocks.view(self.batch, self.blocks_per_row)
        # Per-step metadata in device memory (graph-safe): cache positions of a continuation step's tokens (row-major
        # [B, S]), lengths, first valid position.
        self.positions = torch.zeros(self.batch * STEP_POSITION_SLOTS, dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(self.batch, dtype=torch.int32, device=self.device)
        self.starts = torch.zeros(self.batch, dtype=torch.int32, device=self.device)
        # Split-KV decode: per (row, KV head), how many splits have finished (the last one merges and resets it).
        self.split_counters = torch.zeros(self.batch * self.kv_heads, dtype=torch.int32, device=self.device)
        if self.int8:  # made here, not at first use: a first use inside a CUDA-graph capture would execute nothing
            shape = (self.batch, self.kv_heads, PAGE_SIZE, self.head_dim)
            rows = torch.arange(self.batch, dtype=torch.int32, device=self.device)
            table = rows[:, None].expand(self.batch, self.blocks_per_row).contiguous()
            self.staged = (*(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2)), table)

    def step_positions(self, new_tokens: int) -> torch.Tensor:
        """The int32 [B * new_tokens] view of the positions buffer a continuation step (decode: 1 token) reads."""
        return self.positions[: self.batch * new_tokens]

    def slot(self, index: int) -> tuple[torch.Tensor, ...]:
        while index not in self.pages:
            try:
                self.pages[index] = self._new_pages()
            except torch.OutOfMemoryError:
                if self.reclaim is None:
                    raise
                if self.reclaim():
                    continue
                # The provider gave up on this storage (and dropped the graphs that use it): the forward that needed
                # the slot fails, which leaves its cache unusable, so its pages go back to the allocator now.
                self.pages.clear()
                raise
        return self.pages[index]

    def _new_pages(self) -> tuple[torch.Tensor, ...]:
        shape = (self.batch * self.blocks_per_row, self.kv_heads, PAGE_SIZE, self.head_dim)
        dtype = torch.int8 if self.int8 else self.dtype
        tensors = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2)]
        if self.int8:
            tensors += [torch.ones(shape[:3], dtype=torch.float32, device=self.device) for _ in range(2)]
        return tuple(tensors)

    def staging(self) -> tuple[torch.Tensor, ...]:
        """INT8 storage: where a decode step's QKV launch leaves the new tokens' K and V in the model dtype for
        paged decode to quantize into the pages: K and V staging pages [batch, kv_heads, 16, head_dim] (row b's token
        in page b) and the block table [batch, blocks_per_row] that maps every block of row b to page b. Shared by
        every slot (each layer's attention consumes them before the next layer's QKV launch writes them)."""
        if self.staged is None:
            raise ValueError("staging pages serve INT8 storage; 16-bit pages take the new K/V directly")
        return self.staged

    def bytes_per_token_per_slot(self) -> int:
        return kv_bytes_per_token_per_slot(self.kv_heads, self.head_dim, self.dtype, self.int8)


def kv_bytes_per_token_per_slot(kv_heads: int, head_dim: int, dtype: torch.dtype, int8: bool) -> int:
    """K and V of one token in one (loop, layer) slot: values in ``dtype``, or int8 values and an fp32 scale per
    KV head."""
    element = 1 if int8 else torch.empty((), dtype=dtype).element_size()
    return 2 * kv_heads * (head_dim * element + (4 if int8 else 0))


class PagedTinyLoopCache(TinyLoopCache):
    """TinyLoopCache in paged mode. ``capacity``: tokens per row reserved up front (grows when exceeded, except while
    a CUDA graph uses the storage); ``kv_dtype``: "auto" (model dtype) or "int8"."""

    supports_row_subsets = False  # every row of a step computes every loop (rows past their depth keep their state)

    def __init__(
        self,
        config: TinyLoopConfig,
        capacity: int = 256,
        kv_dtype: str = "auto",
        storage_provider: Any = None,
    ) -> None:
        super().__init__(config)
        if not is_int(capacity) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer (tokens per row), got {capacity!r}")
        self.kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        self.capacity = capacity
        self.max_positions = config.max_position_embeddings
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.storage: PagedStorage | None = None
        self._provider = storage_provider or PagedStorage
        self.length = 0  # tokens cached (every written slot holds the same positions)
        self.slot_lengths: dict[int, int] = {}
        self.step_positions: torch.Tensor | None = None  # int32 [B * S] cache positions of the step's tokens
        self.step_tokens = 0

    # -- sequence bookkeeping ---------------------------------------------------------------------------------------

    def begin_step(self, batch: int, new_tokens: int, attention_mask: torch.Tensor | None, like: torch.Tensor) -> None:
        """Called by the model before its layers run: reserve room and fill the step's device metadata."""
        needed = self.length + new_tokens
        continuation = self.length > 0 and new_tokens <= STEP_POSITION_SLOTS
        if continuation and graph_capturing():  # a decode / verify graph: each replay's metadata is filled before it
            self.step_positions, self.step_tokens = self.storage.step_positions(new_tokens), new_tokens
            return
        self.reserve(batch, needed, like.dtype, like.device)
        storage = self.storage
        if continuation:  # into the buffer a captured graph reads
            self.step_positions = storage.step_positions(new_tokens)
            if new_tokens == 1:
                self.step_positions.fill_(self.length)
            else:
                self.step_positions.copy_(torch.arange(self.length, needed, dtype=torch.int32).repeat(batch))
        else:
            self.step_positions = torch.arange(self.length, needed, dtype=torch.int32, device=like.device).repeat(batch)
        storage.lengths.fill_(needed)
        if self.length == 0:
            self._set_starts(attention_mask)
        elif attention_mask is not None and not bool(attention_mask[:, self.length :].all()):
            raise ValueError(_LEFT_PADDING_ONLY)  # the padding was fixed by the prompt; new tokens are all attended
        self.step_tokens = new_tokens

    def begin_decode_step(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """begin_step of a one-token continuation whose device metadata the caller writes (CUDA-path run-ahead, in
        one kernel with the step's tokens): reserve room and point step_positions at its buffer. Returns the int32
        buffers to fill: lengths [B] with length + 1 and step positions [B] with length."""
        if self.length == 0:
            raise ValueError("begin_decode_step continues a cached sequence; a prompt starts with begin_step")
        self.reserve(batch, self.length + 1, like.dtype, like.device)
        self.step_positions, self.step_tokens = self.storage.step_positions(1), 1
        return self.storage.lengths, self.step_positions

    def reserve(self, batch: int, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        """Storage for ``batch`` rows of at least ``tokens`` tokens (allocated, or grown keeping the contents: to
        twice its size, up to the model's positions, so that a long generation copies its pages a few times, not at
        every token)."""
        storage = self.storage
        if storage is not None and storage.batch == batch and tokens <= storage.capacity:
            return
        capacity = max(tokens, min(self.capacity, self.max_positions))  # no room for positions the model lacks
        if storage is not None and storage.batch == batch:
            capacity = max(tokens, min(2 * storage.capacity, self.max_positions))
        self._allocate(batch, capacity, dtype, device)

    def _set_starts(self, attention_mask: torch.Tensor | None) -> None:
        """First attended position of each row (set by the prompt); only left padding can be expressed (checked)."""
        if attention_mask is None:
            self.storage.starts.zero_()
            return
        mask = attention_mask.to(device=self.storage.device, dtype=torch.int32)
        starts = (mask.cumsum(-1) == 0).sum(-1).to(torch.int32)
        positions = torch.arange(mask.shape[1], device=mask.device)
        expected = (positions[None] >= starts[:, None]).to(torch.int32)
        if not torch.equal(mask, expected):
            raise ValueError(_LEFT_PADDING_ONLY)
        self.storage.starts.copy_(starts)

    def end_step(self) -> None:
        self.length += self.step_tokens
        self.step_tokens = 0

    def mark_written(self, slot: int, past_length: int | None = None) -> None:
        held = self.slot_lengths.get(slot, 0)
        if held != self.length or (past_length is not None and past_length != self.length):
            raise ValueError(
                f"TinyLoopCache slot {self.describe_slot(slot)} holds {held} tokens but the cache holds {self.length}: "
                f"earlier tokens were run with fewer loops than this call's num_loops. Keep num_loops fixed while a "
                f"cache is in use, or start a new cache."
            )
        self.slot_lengths[slot] = self.length + self.step_tokens

    def mark_all_written(self, slots: list[int]) -> None:
        """mark_written for each of ``slots`` (a replayed step's), with one pass over them when all are in step."""
        if any(self.slot_lengths.get(slot, 0) != self.length for slot in slots):
            for slot in slots:
                self.mark_written(slot)  # raises, naming the first slot out of step
        self.slot_lengths.update(dict.fromkeys(slots, self.length + self.step_tokens))

    def _allocate(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        old = self.storage
        self.storage = self._new_storage(batch, capacity, dtype, torch.device(device))
        if old is not None and self.length:
            if old.batch != batch:
                raise ValueError(f"the batch changed from {old.batch} to {batch} rows while the cache holds tokens")
            self._copy_rows(old, torch.arange(batch, device=old.device))

    def _new_storage(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> PagedStorage:
        return self._provider(
            batch=batch,
            capacity=capacity,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            int8=self.kv_dtype == "int8",
            device=device,
        )

    def _copy_rows(self, old: PagedStorage, rows: torch.Tensor) -> None:
        """Row b of the (new) storage takes the pages and start of ``old`` row rows[b] (a larger storage keeps
        them in its first blocks)."""
        for slot, tensors in old.pages.items():
            for new, previous in zip(self.storage.slot(slot), tensors, strict=True):
                _row_view(new, len(rows))[:, : old.blocks_per_row].copy_(_row_view(previous, old.batch)[rows])
        self.storage.starts.copy_(old.starts[rows])

    # -- reference-path read/write ------------------------------------------------------------------------------------

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        past_length: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V [B, H_kv, S, D] of this step into the slot's pages; return the slot's whole K/V (dequantized)."""
        self.mark_written(layer_idx, past_length)
        tensors = self.storage.slot(layer_idx)
        batch, _, steps, _ = key_states.shape
        positions = torch.arange(self.length, self.length + steps, device=key_states.device)
        blocks = self.storage.block_table[:, positions // PAGE_SIZE].long()  # [B, S]
        rows = positions % PAGE_SIZE
        for index, states in enumerate((key_states, value_states)):
            states = states.transpose(1, 2)  # [B, S, H, D]
            if self.storage.int8:
                values, scales = quantize_kv(states)
                tensors[index][blocks, :, rows[None].expand_as(blocks)] = values
                tensors[index + 2][blocks, :, rows[None].expand_as(blocks)] = scales
            else:
                tensors[index][blocks, :, rows[None].expand_as(blocks)] = states.to(tensors[index].dtype)
        total = self.length + steps
        return self.gather(layer_idx, total, key_states.dtype)

    def gather(self, slot: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions [0, length) of every row as [B, H_kv, length, D] in ``dtype``."""
        tensors = self.storage.slot(slot)
        blocks = self.storage.block_table[:, : math.ceil(length / PAGE_SIZE)].long()  # [B, nb]
        out = []
        for index in range(2):
            pages = tensors[index][blocks]  # [B, nb, H, 16, D]
            if self.storage.int8:
                pages = pages.float() * tensors[index + 2][blocks][..., None]
            flat = pages.permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :length]
            out.append(flat.to(dtype))
        return out[0], out[1]

    # -- Cache API ---------------------------------------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:  # slots written (the pages hold them; there are no per-slot layer objects)
        return len(self.slot_lengths)

    @property
    def is_initialized(self) -> bool:
        return bool(self.slot_lengths)

    def get_max_length(self) -> int:
        return -1  # grows as needed, as TinyLoopCache

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.length + query_length, 0

    def loops_cached(self) -> int:
        loop_slots = [s for s in self.slot_lengths if s >= self.num_prelude_layers + self.num_coda_layers]
        return len(loop_slots) // self.num_loop_layers

    def crop(self, tokens_to_remove: int) -> None:
        keep = self.length + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, self.length)
        if keep < 0:
            raise ValueError(f"cannot crop {-tokens_to_remove} tokens from a cache holding {self.length}")
        self.length = keep
        self.slot_lengths = {slot: min(held, keep) for slot, held in self.slot_lengths.items()}

    def fill_deeper_slots(self, source_loop: int) -> None:
        """KV policy of a step that ran fewer loops than the cache holds (a loop schedule's shallow tokens): the
        step's positions in every deeper loop slot take loop ``source_loop``'s K/V. Pages are copied on the device
        through the step's position buffer, so a captured graph replays it (unless ``fill_deeper_loops`` is off: a
        self-speculative draft leaves the deeper loops to its verifier)."""
        depth = self.loops_cached()
        if not self.fill_deeper_loops or depth <= source_loop + 1:
            return
        storage = self.storage
        positions = self.step_positions.view(storage.batch, -1).long()  # [B, S] cache positions of the step
        blocks = storage.block_table.gather(1, positions // PAGE_SIZE).long()
        rows = positions % PAGE_SIZE
        for layer in range(self.num_loop_layers):
            source = storage.slot(self.slot_index("loop", layer, source_loop))
            for loop in range(source_loop + 1, depth):
                target = self.slot_index("loop", layer, loop)
                self.mark_written(target)
                for source_pages, target_pages in zip(source, storage.slot(target), strict=True):
                    target_pages[blocks, :, rows] = source_pages[blocks, :, rows]

    def fill_row_depths(self, loops_per_row: torch.Tensor, first_loop: int, total_loops: int) -> None:
        """KV policy of per-row depths on this cache, where every row ran every loop of the step (rows past their
        depth discarding the state): the step's positions in the slots of loops at or past a row's depth take its
        last computed loop's K/V, as TinyLoopCache.fill_skipped_loops does. Masked copies on the device, loop by
        loop (slot loop - 1 already holds the row's last loop's K/V), so a captured graph replays them."""
        storage = self.storage
        positions = self.step_positions.view(storage.batch, -1).long()  # [B, S] cache positions of the step
        blocks = storage.block_table.gather(1, positions // PAGE_SIZE).long()
        rows = positions % PAGE_SIZE
        for loop in range(max(first_loop, 1), total_loops):
            skipped = loops_per_row <= loop  # [B]
            for layer in range(self.num_loop_layers):
                source = storage.slot(self.slot_index("loop", layer, loop - 1))
                target = storage.slot(self.slot_index("loop", layer, loop))
                for source_pages, target_pages in zip(source, target, strict=True):
                    kept = target_pages[blocks, :, rows]  # [B, S, heads, ...]
                    mask = skipped.view(-1, *[1] * (kept.dim() - 1))
                    target_pages[blocks, :, rows] = torch.where(mask, source_pages[blocks, :, rows], kept)

    def prepare_resume(self, new_tokens: int) -> None:
        """The paged form of TinyLoopCache.prepare_resume: one length serves every slot, so the cache steps back
        ``new_tokens``; the verifier's step then appends them to its deeper loop slots and the coda (which it
        rewrites), while the shallower slots keep their draft K/V (the pages hold them; nothing is copied)."""
        if not 0 < new_tokens <= self.length:
            raise ValueError(f"cannot resume {new_tokens} tokens of a cache holding {self.length}")
        self.length -= new_tokens
        for index in range(self.num_coda_layers):
            slot = self.slot_index("coda", index)
            self.slot_lengths[slot] = min(self.slot_lengths.get(slot, 0), self.length)

    def max_continuation_tokens(self, config: TinyLoopConfig) -> int:
        """New tokens per row one continuation step (a speculative verify) may append: paged attention serves
        MAX_CONTINUATION_VECTORS query vectors per KV head."""
        return max(1, MAX_CONTINUATION_VECTORS // (config.num_attention_heads // config.num_key_value_heads))

    def reset(self) -> None:
        self.length, self.slot_lengths = 0, {}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row b takes the contents of row beam_idx[b], in place: buffers keep their addresses (graphs stay valid)."""
        if self.storage is not None:
            self._copy_rows(self.storage, beam_idx.to(self.storage.device))

    def _rebuild(self, index: torch.Tensor) -> None:
        old = self.storage
        if old is None:
            return
        self.storage = self._new_storage(len(index), old.capacity, old.dtype, old.device)
        self._copy_rows(old, index.to(old.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.storage is not None:
            self._rebuild(torch.arange(self.storage.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebuild(torch.as_tensor(indices).flatten())

    def bytes_per_token(self) -> int:
        """K/V bytes one token costs across every slot written so far (the memory per token of this cache)."""
        if self.storage is None:
            return 0
        return self.storage.bytes_per_token_per_slot() * len(self.storage.pages)

    def memory_bytes(self) -> int:
        """Bytes of K/V held for the cached tokens (valid tokens only, all rows)."""
        batch = self.storage.batch if self.storage is not None else 0
        return self.bytes_per_token() * self.length * batch


def _row_view(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    return tensor.view(batch, -1, *tensor.shape[1:])


def quantize_kv(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 per (token, KV head): scale = max|x| / 127 (1 for an all-zero vector), q = round(x / scale)."""
    values = states.float()
    amax = values.abs().amax(-1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(values / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scales
