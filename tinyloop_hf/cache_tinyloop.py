"""TinyLoopCache: one KV slot per (loop, layer) of the loop block and one per prelude/coda layer.

Slot order is fixed so that slots can appear lazily as deeper loops run: prelude layers first, then coda layers,
then loop ``t`` layer ``j`` at ``P + C + t * K + j`` (K = loop-block layers). Each slot keeps K/V in a buffer that
grows geometrically and is written by index, so decoding does not re-copy the whole past every step.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .configuration_tinyloop import TinyLoopConfig

STAGES = ("prelude", "loop", "coda")
_MIN_CAPACITY = 64


class TinyLoopKVLayer(CacheLayerMixin):
    """K/V of one slot: ``keys``/``values`` are views [B, H_kv, length, D] into larger buffers."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._key_buffer = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self._value_buffer = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        self.is_initialized = True
        self._refresh_views()

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        rows: torch.Tensor | None = None,
        batch: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append K/V [B, H_kv, S, D]; with ``rows`` (indices into a batch of ``batch`` rows) only those rows computed
        this step: the others get zeros here, which fill_rows() replaces. Returns the (selected rows') K/V."""
        if rows is not None:
            full = (batch, *key_states.shape[1:])
            keys, values = self.update(
                key_states.new_zeros(full).index_copy(0, rows, key_states),
                value_states.new_zeros(full).index_copy(0, rows, value_states),
            )
            return keys[rows], values[rows]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_length = self.length + key_states.shape[-2]
        if key_states.requires_grad or value_states.requires_grad:
            # Autograd must not see later in-place writes into tensors it saved: grow by concatenation instead.
            self._key_buffer = torch.cat((self.keys, key_states), dim=-2)
            self._value_buffer = torch.cat((self.values, value_states), dim=-2)
        else:
            self._reserve(new_length)
            self._key_buffer[:, :, self.length : new_length] = key_states
            self._value_buffer[:, :, self.length : new_length] = value_states
        self.length = new_length
        self._refresh_views()
        return self.keys, self.values

    def _reserve(self, needed: int) -> None:
        capacity = self._key_buffer.shape[-2]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity, _MIN_CAPACITY)
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            grown = old.new_empty((*old.shape[:2], new_capacity, old.shape[3]))
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def _refresh_views(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers 5.17 passes cache_position
            query_length = query_length.shape[0]
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self._key_buffer = self._value_buffer = None
        self.keys = self.values = None
        self.is_initialized = False

    def fill_rows(self, source: TinyLoopKVLayer, rows: torch.Tensor, start: int, steps: int) -> None:
        """Positions [start, start + steps) of ``rows`` become ``source``'s (a loop the tokens skipped reuses the
        K/V of the last loop they computed); a slot this step did not reach is first extended to start + steps."""
        if self.length == start:
            zeros = source.keys[:, :, start : start + steps]
            self.update(torch.zeros_like(zeros), torch.zeros_like(zeros))
        for mine, theirs in ((self._key_buffer, source._key_buffer), (self._value_buffer, source._value_buffer)):
            mine[rows, :, start : start + steps] = theirs[rows, :, start : start + steps]

    def crop(self, tokens_to_remove: int) -> None:
        """Zero or negative: drop that many trailing tokens. Positive (transformers < 5.24 style): keep that many."""
        keep = self.length + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, self.length)
        if keep < 0:
            raise ValueError(f"cannot crop {-tokens_to_remove} tokens from a cache holding {self.length}")
        if self.is_initialized:
            self.length = keep
            self._refresh_views()

    def _map_batch(self, fn: Any) -> None:
        if self.is_initialized:
            self._key_buffer = fn(self._key_buffer)
            self._value_buffer = fn(self._value_buffer)
            self._refresh_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda buffer: buffer.index_select(0, beam_idx.to(buffer.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda buffer: buffer.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda buffer: buffer[indices])

    def memory_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() * 2


class TinyLoopCache(Cache):
    """KV cache with one slot per (stage, loop, layer); pass it as ``past_key_values`` (or ``cache``)."""

    supports_row_subsets = True  # rows of a batch may stop looping early (their skipped loops reuse K/V)
    fill_deeper_loops = True  # a step with fewer loops than the cache holds fills the deeper slots (KV policy)

    def __init__(self, config: TinyLoopConfig) -> None:
        super().__init__(layers=[])
        self.num_prelude_layers = config.num_prelude_layers
        self.num_loop_layers = config.num_loop_layers
        self.num_coda_layers = config.num_coda_layers
        self.max_loops = config.max_loops

    def begin_step(self, batch: int, new_tokens: int, attention_mask: torch.Tensor | None, like: torch.Tensor) -> None:
        """Called by the model before its layers run (the paged mode prepares device metadata here)."""

    def end_step(self) -> None:
        """Called by the model after its layers ran."""

    def slot_index(self, stage: str, layer: int, loop: int = 0) -> int:
        """Flat slot of ``layer`` in ``stage`` ("prelude", "loop", "coda") at loop ``loop`` (loop stage only)."""
        if stage == "prelude":
            return layer
        if stage == "coda":
            return self.num_prelude_layers + layer
        if stage == "loop":
            return self.num_prelude_layers + self.num_coda_layers + loop * self.num_loop_layers + layer
        raise ValueError(f"stage must be one of {list(STAGES)}, got {stage!r}")

    def loops_cached(self) -> int:
        """Number of loops for which this cache holds keys and values."""
        loop_slots = len(self.layers) - self.num_prelude_layers - self.num_coda_layers
        return max(0, loop_slots // self.num_loop_layers)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        past_length: int | None = None,
        rows: torch.Tensor | None = None,
        batch: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append K/V [B, H_kv, S, D] to slot ``layer_idx``; return the slot's whole K/V.

        ``past_length`` (the tokens the caller believes are cached) turns a silent mismatch into an error, e.g.
        a later call asking for more loops than the cache was filled with. ``rows``: only these rows of a batch of
        ``batch`` computed this step (see fill_skipped_loops).
        """
        while len(self.layers) <= layer_idx:
            self.layers.append(TinyLoopKVLayer())
        layer = self.layers[layer_idx]
        if past_length is not None and layer.length != past_length:
            raise ValueError(
                f"TinyLoopCache slot {self.describe_slot(layer_idx)} holds {layer.length} tokens but the cache holds "
                f"{past_length}: earlier tokens were run with fewer loops than this call's num_loops. Keep num_loops "
                f"fixed while a cache is in use, or start a new cache."
            )
        return layer.update(key_states, value_states, rows=rows, batch=batch)

    def fill_skipped_loops(
        self, last_loop: torch.Tensor, first_loop: int, total_loops: int, start: int, steps: int
    ) -> None:
        """KV policy for loops a row skipped this step (it exited early, its depth was reached, or the step ran
        fewer loops than the cache holds): positions [start, start + steps) of every loop slot after the row's
        ``last_loop`` [B] reuse that loop's K/V. Loops past the step's ``total_loops`` are filled only while
        ``fill_deeper_loops`` (a self-speculative draft leaves them to its verifier)."""
        depth = self.loops_cached() if self.fill_deeper_loops else total_loops
        for source_loop in last_loop.unique().tolist():  # rows that stopped after the same loop share a copy
            rows = (last_loop == source_loop).nonzero().squeeze(1)
            for loop in range(max(first_loop, source_loop + 1), depth):
                for layer in range(self.num_loop_layers):
                    target = self.layers[self.slot_index("loop", layer, loop)]
                    target.fill_rows(self.layers[self.slot_index("loop", layer, source_loop)], rows, start, steps)

    def prepare_resume(self, new_tokens: int) -> None:
        """Before a self-speculative verifier resumes the last ``new_tokens`` tokens (a draft ran them through the
        prelude, the first loops and the coda): their coda K/V, computed from a shallower state, are dropped; the
        verifier appends them again with its deeper loops."""
        for index in range(self.num_coda_layers):
            self.layers[self.slot_index("coda", index)].crop(-new_tokens)

    def max_continuation_tokens(self, config: TinyLoopConfig) -> int | None:
        """New tokens per row one continuation step (a speculative verify) may append; None: no limit."""
        return None

    def describe_slot(self, index: int) -> str:
        if index < self.num_prelude_layers:
            return f"(prelude layer {index})"
        index -= self.num_prelude_layers
        if index < self.num_coda_layers:
            return f"(coda layer {index})"
        loop, layer = divmod(index - self.num_coda_layers, self.num_loop_layers)
        return f"(loop {loop}, layer {layer})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.get_seq_length(layer_idx) + query_length, 0

    def memory_bytes(self) -> int:
        """Bytes of K/V currently held (valid tokens only, not spare capacity)."""
        return sum(layer.memory_bytes() for layer in self.layers)
