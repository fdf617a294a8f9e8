"""The CUDA path of a model: paged caches whose storage is reused between generate() calls, and CUDA-graph decode.

``model.use_cuda_path()`` creates a CudaPath. Decode steps (one new token per row) that ``generate()`` sends to
``forward`` are replayed from a CUDA graph: the first step of a (batch size, loop count, cache storage) key runs
eagerly (it compiles kernels and warms cuBLAS), the second captures the whole step — every loop, every layer, the
head — and every later step copies its inputs into the graph's static buffers and replays it. The graph reads
sequence lengths and cache positions from device memory, which the cache updates before each replay, so nothing
about the step is frozen except shapes. Everything else generate() does (logits processors, stopping criteria,
streamers, return types) is untouched: the graph only replaces the forward call.

Run-ahead (greedy generate() only, see ``run_ahead``): transformers synchronizes with the GPU once per token (its
stopping check) and then spends 0.25-0.7 ms of host time before the next forward (H200, batch 1-16), while the GPU
would idle. So right after a replay the next step is replayed on a side stream with the tokens greedy decoding will
pick (the argmax of these logits; the pad token for rows that have finished). The next forward compares what it is
given with that guess: the same tokens and positions take the step's logits as they are (the step is committed to
the cache only then), different ones wait for it and run the step again with the real tokens, overwriting its K/V.
The logits generate() sees are the ones a plain step would give, bit for bit, either way.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .compat import graph_capturing
from .configuration_tinyloop import is_int
from .paged_cache import (
    STORAGE_SERIALS,
    PagedStorage,
    PagedTinyLoopCache,
    check_kv_dtype,
    kv_bytes_per_token_per_slot,
)

MIN_CAPACITY = 128
MAX_STORAGES = 4  # cache storages (and their graphs) kept for later generate() calls of the same shapes
PREFILL_BUCKET = 64  # prompt lengths are padded up to a multiple of this inside prefill graphs


def free_device_bytes(device: torch.device) -> float:
    """Bytes the device has free once PyTorch's allocator has handed back what it caches unused (blocks kept for
    CUDA graphs' private pools cannot serve other allocations, so they are not counted); infinite off CUDA devices."""
    if device.type != "cuda":
        return float("inf")
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _reclaim_through(path: weakref.ref, serial: int) -> bool:
    """PagedStorage.reclaim of a storage the CUDA path ``path`` made (False once the path is gone)."""
    owner = path()
    return owner is not None and owner._reclaim(serial)


def capacity_bucket(tokens: int, fraction_bits: int = 3, minimum: int = MIN_CAPACITY) -> int:
    """Round a capacity up to a bucket so successive generate() calls of similar lengths share storage and graphs:
    a multiple of 2^-fraction_bits of the power of two at or above it, and of ``minimum``. With the defaults (an
    eighth) a bucket reserves fewer than max(MIN_CAPACITY, tokens / 4) tokens more than asked for, where powers of
    two reserved up to 2x (K/V for 16k tokens behind an 8k-token prompt)."""
    tokens = max(tokens, minimum)
    step = max(minimum, 1 << max((tokens - 1).bit_length() - fraction_bits, 0))
    return -(-tokens // step) * step


def _written_slots(before: dict[int, int], cache: PagedTinyLoopCache) -> list[int]:
    """The cache slots a step wrote: those whose length changed since ``before`` (slot -> tokens held)."""
    return sorted(slot for slot, held in cache.slot_lengths.items() if held != before.get(slot))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    output: torch.Tensor  # decode: logits [B, 1, V]; prefill: last hidden states [B, bucket, H]
    slots: list[int]


@dataclass
class _StepAhead:
    """A decode step replayed on the side stream before generate() asked for it (not yet committed to the cache)."""

    key: tuple
    cache: PagedTinyLoopCache
    guessed: torch.cuda.Event  # the side stream has written the guessed tokens and positions into the graph's inputs


# Run-ahead stops for the rest of a generate() call once misses exceed hits by more than this: a miss costs about one
# step (the guessed step must finish before the real one runs), so a call whose guesses keep failing (a logits
# processor that changes the argmax) loses at most a few steps.
RUN_AHEAD_MISS_MARGIN = 2


@dataclass
class _StepGraph:
    """A captured continuation step other than plain decode (a self-speculative draft step or verify)."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]
    slots: list[int]


class CudaPath:
    def __init__(self, model: Any, kv_cache_dtype: str, cuda_graphs: bool, run_ahead: bool = True) -> None:
        from .kernels import ops_cuda  # registers the "cuda" ops
        from .kernels.loader import CudaPathUnavailable, check_device

        parameter = next(model.parameters())
        check_device(parameter.device)
        devices = sorted({str(p.device) for p in model.parameters()} | {str(b.device) for b in model.buffers()})
        if len(devices) > 1:
            raise CudaPathUnavailable(f"the CUDA path runs a model on one GPU; this one is on {', '.join(devices)}")
        if parameter.device.index is not None and parameter.device.index != torch.cuda.current_device():
            raise CudaPathUnavailable(
                f"the model is on {parameter.device} but the current device is cuda:{torch.cuda.current_device()}: "
                f"the kernels launch on the current device's stream; call torch.cuda.set_device({parameter.device})"
            )
        if model.dtype not in (torch.float16, torch.bfloat16):
            raise CudaPathUnavailable(
                f"the CUDA path runs float16 or bfloat16 models, this one is {model.dtype}: "
                f"load it with dtype=torch.bfloat16 (or call model.to(torch.bfloat16))"
            )
        self.model = model
        self.kv_cache_dtype = check_kv_dtype(kv_cache_dtype)
        self.storages: dict[tuple, PagedStorage] = {}
        self.graphs: dict[tuple, _Graph | _StepGraph] = {}
        self.warmed: set[tuple] = set()
        self.use_graphs = cuda_graphs
        self.pool: Any = None  # the graphs' shared memory pool (see _record)
        self.device = parameter.device
        self.run_ahead_enabled = run_ahead  # greedy generate() replays decode steps ahead (see run_ahead)
        self.side_stream: torch.cuda.Stream | None = None
        self.ahead: _StepAhead | None = None
        self.finished_token: tuple[torch.Tensor, torch.Tensor] | None = None  # (pad, ids after which a row is done)
        self.run_ahead_counts = {"hits": 0, "misses": 0}  # of the current (or last) run_ahead context
        self._running_ahead = False
        from .kernels.fused_decode import FusedDecode

        self.fused = FusedDecode(model)  # batch-1 decode steps as one kernel where it serves them
        self._advance_greedy = ops_cuda.advance_greedy  # run-ahead's step inputs (bound once, not imported per token)

    # -- caches ------------------------------------------------------------------------------------------------------

    def new_cache(self, capacity: int | None) -> PagedTinyLoopCache:
        self.settle()
        return PagedTinyLoopCache(
            self.model.config,
            capacity=capacity or MIN_CAPACITY,  # as asked: the storage rounds it up to a bucket (see storage)
            kv_dtype=self.kv_cache_dtype,
            storage_provider=self.storage,
        )

    def storage(self, **kwargs: Any) -> PagedStorage:
        """Storage for a generate() cache, reused by later calls of the same shape (one generation at a time). The
        MAX_STORAGES most recently used shapes keep theirs, with their graphs. A new one first drops the least recently
        used while it would not fit beside them (``_make_room``); one whose capacity bucket does not fit even alone
        gets a finer bucket; and if its pages still fail to allocate, the rest are dropped (``_reclaim``)."""
        self.settle()
        # The capacity bucket, or where it did not fit a finer one (1/32 of the power of two, whole prefill buckets:
        # a prompt graph pads the prompt to one), which a call of one more token or 127 more still shares.
        asked = kwargs["capacity"]
        buckets = (capacity_bucket(asked), capacity_bucket(asked, fraction_bits=5, minimum=PREFILL_BUCKET))
        shapes = [{**kwargs, "capacity": capacity} for capacity in buckets]
        keys = [tuple(sorted((name, str(value)) for name, value in shape.items())) for shape in shapes]
        key = next((key for key in keys if key in self.storages), None)
        if key is not None:
            storage = self.storages.pop(key)
        else:
            while len(self.storages) >= MAX_STORAGES:
                self._drop_storage(next(iter(self.storages)))  # the least recently used
            fits = self._make_room(self._expected_bytes(shapes[0]), kwargs["device"])
            shape, key = (shapes[0], keys[0]) if fits else (shapes[1], keys[1])
            serial = next(STORAGE_SERIALS)
            reclaim = functools.partial(_reclaim_through, weakref.ref(self), serial)  # weak: no cycle through it
            storage = PagedStorage(**shape, reclaim=reclaim, serial=serial)
        self.storages[key] = storage  # dicts keep insertion order: the most recently used last
        return storage

    def _expected_bytes(self, shape: dict[str, Any]) -> int:
        """Device memory a generate() call on a new storage of ``shape`` will need: its pages at the model's loop
        count, and a prompt forward's largest activations over all its tokens (QKV, gate/up and SwiGLU outputs, and
        four hidden-size vectors: residual, normed input, attention and projection outputs)."""
        config = self.model.config
        slots = config.kv_slots(config.num_loops)
        per_slot = kv_bytes_per_token_per_slot(shape["kv_heads"], shape["head_dim"], shape["dtype"], shape["int8"])
        qkv = (config.num_attention_heads + 2 * shape["kv_heads"]) * shape["head_dim"]
        activations = (qkv + 3 * config.intermediate_size + 4 * config.hidden_size) * shape["dtype"].itemsize
        return shape["batch"] * shape["capacity"] * (slots * per_slot + activations)

    def _make_room(self, needed: int, device: torch.device) -> bool:
        """Drop the least recently used storages (with their graphs) while ``needed`` bytes do not fit in what the
        device has free (a storage kept for reuse must not make a larger call fail); whether they fit then."""
        while needed > free_device_bytes(device):
            if not self.storages:
                return False
            self._drop_storage(next(iter(self.storages)))
        return True

    def release(self) -> None:
        """Drop every kept storage and every graph (see TinyLoopForCausalLM.release_cuda_caches)."""
        self.settle()
        self.storages.clear()
        self.graphs.clear()
        self.warmed.clear()
        self.fused.drop()

    def _reclaim(self, needy: int) -> bool:
        """Pages of the storage with serial ``needy`` do not fit: drop every other kept storage (with their graphs)
        and say True; when there is none, forget that storage itself, kept or not (the storage then frees its pages,
        so no graph may keep pointing at them), and say False. Dropped memory returns to PyTorch's allocator unless
        a cache the caller still holds uses it."""
        others = [key for key, storage in self.storages.items() if storage.serial != needy]
        for key in others:
            self._drop_storage(key)
        if not others:
            for key in [key for key, storage in self.storages.items() if storage.serial == needy]:
                del self.storages[key]
            self._drop_graphs(needy)
        return bool(others)

    def _drop_storage(self, key: tuple) -> None:
        self._drop_graphs(self.storages.pop(key).serial)

    def _drop_graphs(self, serial: int) -> None:
        """Forget the graphs that read a storage's pages: every graph key ends with (serial, capacity)."""
        self.settle()
        for graph_key in [graph_key for graph_key in self.graphs if graph_key[-2] == serial]:
            del self.graphs[graph_key]
        self.warmed = {warm for warm in self.warmed if warm[-2] != serial}
        self.fused.drop(serial)

    # -- CUDA graphs: decode steps, and prompts padded on the right to a bucket -----------------------------------

    def _pages_ready(self, cache: PagedTinyLoopCache, loops: int) -> bool:
        """Whether the cache's storage has the pages of every slot a step of ``loops`` loops writes (slots are
        numbered prelude, coda, then loop by loop: see TinyLoopCache)."""
        return all(slot in cache.storage.pages for slot in range(self.model.config.kv_slots(loops)))

    def _allocate_pages(self, cache: PagedTinyLoopCache, loops: int) -> None:
        """Allocate every page a step of ``loops`` loops writes before the eager step runs. Allocated layer by layer
        inside the forward, pages interleave with its activations, and the holes the freed activations leave between
        them fragment the allocator: on the H200, a batch-64 prompt of 2,048 tokens failed to allocate a 2.75 GiB
        activation with 18 GiB reserved and free."""
        for slot in range(self.model.config.kv_slots(loops)):
            cache.storage.slot(slot)

    def graph_key(self, input_ids: Any, cache: Any, arguments: dict[str, Any]) -> tuple | None:
        """The key of a step a graph can serve, or None (the step then runs eagerly, on the same kernels).

        Decode: one new token per row. Prefill: a fresh cache, no padding. Prompts are padded on the right to a
        multiple of PREFILL_BUCKET inside the graph (under causal attention the pads never reach a real position, and
        their K/V lie beyond the cache length, where the next tokens overwrite them), and so they are in the eager
        forward that warms the key and on a model without graphs (``run`` computes them): which kernel serves a
        projection, and how it splits its sums, depends on the row count, so an unpadded prompt would give other
        logits than its replays (a later generate() of the same prompt parted from the first at a near-tie)."""
        if graph_capturing() or torch.is_grad_enabled():
            return None
        if input_ids is None or input_ids.dim() != 2 or not isinstance(cache, PagedTinyLoopCache):
            return None
        config = self.model.config
        if config.initial_state == "random":  # the seeded state is drawn on the host, which a graph cannot replay
            return None
        loops = arguments.get("num_loops")
        loops = config.num_loops if loops is None else loops
        if not is_int(loops) or not 1 <= loops <= config.max_loops:
            return None  # (the eager step names a bad one, before any pages are allocated for it)
        plain = (
            arguments.get("inputs_embeds") is None
            and arguments.get("labels") is None
            and arguments.get("exit_threshold") is None
            and config.exit_threshold is None
            and arguments.get("exit_at_step") is None
            and not arguments.get("use_weighted_exit")
            and arguments.get("early_exit") is None
            and arguments.get("early_exit_threshold") is None
            and not arguments.get("output_hidden_states")
        )
        if not plain:
            return None
        batch, steps = input_ids.shape
        if steps == 1:
            if (
                not self.use_graphs
                or cache.storage is None
                or cache.length == 0
                or cache.length + 1 > cache.storage.capacity
            ):
                return None
            # The mask's shape only (free on the host; the eager step names a wrong one): checking a replay's mask and
            # position values would synchronize every token. generate() extends the prompt's, which its eager step
            # checked; a hand-written loop that passes other values gets them as given.
            mask = arguments.get("attention_mask")
            if mask is not None and tuple(mask.shape) != (batch, cache.length + 1):
                return None
            if arguments.get("logits_to_keep") not in (0, 1):
                return None
            return ("decode", batch, loops, cache.storage.serial, cache.storage.capacity)
        bucket = -(-steps // PREFILL_BUCKET) * PREFILL_BUCKET
        if cache.length != 0 or arguments.get("logits_to_keep") != 1 or bucket > capacity_bucket(cache.capacity):
            return None
        if bucket > config.max_position_embeddings:  # the pads' positions would lie past the model's context
            return None
        mask, positions = arguments.get("attention_mask"), arguments.get("position_ids")
        if mask is not None and not bool(mask.all()):
            return None
        if positions is not None and not torch.equal(positions.cpu(), torch.arange(steps).expand(batch, -1)):
            return None
        cache.reserve(batch, bucket, self.model.dtype, input_ids.device)
        return ("prefill", batch, bucket, loops, cache.storage.serial, cache.storage.capacity)

    def run(self, key: tuple, input_ids: torch.Tensor, attention_mask: Any, position_ids: Any, cache: Any) -> Any:
        """Logits of the step from the graph of ``key``; None when this step should run eagerly (warm-up)."""
        if self.ahead is not None and (self.ahead.key != key or self.ahead.cache is not cache):
            self.settle()
        ahead, self.ahead = self.ahead, None
        prefill = key[0] == "prefill"
        if key not in self.graphs:
            # Capture after an eager step of the key, and only once that step has allocated every page the graph
            # writes: an allocation inside a capture would come from the graph's pool, zeroed at every replay (an
            # eager step that failed, say out of memory, can leave some unallocated).
            loops = key[3] if prefill else key[2]
            # A model without graphs gets prefill keys alone, and runs each of them as this warm-up step.
            if not self.use_graphs or key not in self.warmed or not self._pages_ready(cache, loops):
                self.warmed.add(key)
                self._allocate_pages(cache, loops)
                return self._prefill_eagerly(key, input_ids, cache) if prefill else None
            capture = self._capture_prefill if prefill else self._capture_decode
            self.graphs[key] = capture(key, input_ids, cache)
        entry = self.graphs[key]
        if prefill:
            return self._replay_prefill(entry, input_ids, cache)
        config = self.model.config
        if cache.length >= config.max_position_embeddings:
            raise ValueError(
                f"position {cache.length} is beyond the context of this model "
                f"(TinyLoopConfig.max_position_embeddings={config.max_position_embeddings})"
            )
        positions = self._positions(input_ids, attention_mask, position_ids, cache)
        hit = ahead is not None and self._guessed_right(ahead, entry, input_ids, positions)
        if ahead is not None:
            self._count_guess(hit)
        if hit:
            cache.step_tokens = 1  # commit the step run ahead (begin_step ran before its replay)
        else:
            entry.input_ids.copy_(input_ids)
            entry.position_ids.copy_(positions)
            cache.begin_step(input_ids.shape[0], 1, None, entry.output)
            entry.graph.replay()
        cache.mark_all_written(entry.slots)
        cache.end_step()
        logits = entry.output.clone()
        if self._running_ahead:
            self._replay_ahead(key, entry, cache)
        return logits

    # -- run-ahead: greedy decode steps replayed on a side stream before generate() asks for them ------------------

    @contextmanager
    def run_ahead(self, pad_token: torch.Tensor | None, eos_tokens: torch.Tensor | None) -> Iterator[None]:
        """Inside: each replayed decode step is followed by the next one, run on a side stream with the tokens a
        greedy generate() picks: the argmax of the logits, or ``pad_token`` for rows whose last token was an EOS
        (or the pad), which transformers fills with the pad from then on. Decoding then overlaps generate()'s own
        host time. On exit the current stream waits for the side stream; a step run ahead and never asked for
        only wrote K/V beyond the cache's length."""
        if not (self.use_graphs and self.run_ahead_enabled):
            yield
            return
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(self.device)
        finished = None
        if pad_token is not None:
            pad = pad_token.reshape(1).to(self.device, torch.long)
            ends = pad if eos_tokens is None else torch.cat([pad, eos_tokens.reshape(-1).to(self.device, torch.long)])
            finished = (pad, ends)
        self.finished_token, self.run_ahead_counts = finished, {"hits": 0, "misses": 0}
        self._running_ahead = True
        try:
            yield
        finally:
            self._running_ahead = False
            self.settle()

    def settle(self) -> None:
        """Drop a step run ahead (if any) once the current stream is ordered after it: called before anything else
        touches the caches or graphs."""
        if self.ahead is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
            self.ahead = None

    def _guessed_right(
        self, ahead: _StepAhead, entry: _Graph, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> bool:
        """Whether the step run ahead had this step's tokens and positions. Waits for the guess only (not for the
        step itself); the current stream is ordered after the step either way."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(ahead.guessed)
        same = bool(((entry.input_ids == input_ids) & (entry.position_ids == positions)).all())
        stream.wait_stream(self.side_stream)
        return same

    def _count_guess(self, hit: bool) -> None:
        counts = self.run_ahead_counts
        counts["hits" if hit else "misses"] += 1
        if counts["misses"] > counts["hits"] + RUN_AHEAD_MISS_MARGIN:
            self._running_ahead = False  # the guesses keep failing in this call: stop guessing

    def _replay_ahead(self, key: tuple, entry: _Graph, cache: PagedTinyLoopCache) -> None:
        """Replay the next decode step on the side stream with the guessed tokens (see run_ahead)."""
        if cache.length + 1 > cache.storage.capacity or cache.length >= self.model.config.max_position_embeddings:
            return
        side = self.side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))  # the logits are copied out, the inputs written
        with torch.cuda.stream(side):
            # The guessed tokens, positions and the cache's step metadata in one kernel: as separate small kernels
            # (argmax, isin, where, copy, add, two fills) they kept the GPU idle ~40 us between two steps.
            lengths, step_positions = cache.begin_decode_step(entry.input_ids.shape[0], entry.output)
            self._advance_greedy(entry.output[:, -1], entry.input_ids, entry.position_ids, self.finished_token,
                                 lengths, step_positions, cache.length)  # fmt: skip
            guessed = torch.cuda.Event()
            guessed.record(side)
            entry.graph.replay()
        cache.step_tokens = 0  # committed by the next run() if it asks for these tokens
        self.ahead = _StepAhead(key, cache, guessed)

    def _prefill_eagerly(self, key: tuple, input_ids: torch.Tensor, cache: PagedTinyLoopCache) -> torch.Tensor:
        """The prompt's last logits from an eager forward of the prefill graph's shape (the prompt padded to its
        bucket), so that its kernels, and its logits, are those of the graph's replays."""
        ids, positions = self._prefill_inputs(key, input_ids)
        self._load_prompt(ids, input_ids)
        before = dict(cache.slot_lengths)
        hidden = self._prefill_forward(key, ids, positions, cache)
        return self._prompt_logits(hidden, input_ids, cache, _written_slots(before, cache))

    def _replay_prefill(self, entry: _Graph, input_ids: torch.Tensor, cache: PagedTinyLoopCache) -> torch.Tensor:
        self._load_prompt(entry.input_ids, input_ids)
        entry.graph.replay()
        return self._prompt_logits(entry.output, input_ids, cache, entry.slots)

    def _load_prompt(self, padded: torch.Tensor, input_ids: torch.Tensor) -> None:
        """The prompt into the first columns of a prefill key's [batch, bucket] ids, the pads zero."""
        steps = input_ids.shape[1]
        if steps > self.model.config.max_position_embeddings:
            raise ValueError(
                f"position {steps - 1} is beyond the context of this model "
                f"(TinyLoopConfig.max_position_embeddings={self.model.config.max_position_embeddings})"
            )
        padded.zero_()
        padded[:, :steps].copy_(input_ids)

    def _prompt_logits(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, cache: PagedTinyLoopCache, slots: list[int]
    ) -> torch.Tensor:
        """After a padded prompt's forward: the cache holds the prompt's tokens alone (the pads' K/V lie past its
        length, where the next tokens overwrite them); the last prompt token's logits."""
        steps = input_ids.shape[1]
        cache.length = steps
        cache.slot_lengths.update(dict.fromkeys(slots, steps))
        return self.model.lm_head(hidden[:, steps - 1 : steps])

    @staticmethod
    def _positions(input_ids: torch.Tensor, attention_mask: Any, position_ids: Any, cache: Any) -> torch.Tensor:
        if position_ids is not None:
            return position_ids[:, -1:]
        if attention_mask is not None:
            return attention_mask.long().sum(-1, keepdim=True) - 1
        return torch.full_like(input_ids, cache.length)

    def _record(self, cache: PagedTinyLoopCache, step: Any) -> tuple[torch.cuda.CUDAGraph, Any, list[int]]:
        """Capture ``step()`` (which runs the model on ``cache``); the capture executes nothing, so the cache's
        bookkeeping is put back and the slots the step writes are returned for the replays to mark."""
        length, slot_lengths = cache.length, dict(cache.slot_lengths)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # No automatic garbage collection inside the capture: a collection that frees another model's CUDA graph (a
        # dead reference cycle) destroys it there, which capture forbids (the capture fails with
        # cudaErrorStreamCaptureInvalidated; seen on the H200 in the GPU suite). Recent torch.cuda.graph no longer
        # collects on entry, and a gc.collect() here took 0.23 s: the cycles wait for the next collection instead.
        if not self.graphs:
            # A private pool dies with the last graph captured into it: capturing into it again fails inside PyTorch
            # (c10 CUDACachingAllocator: INTERNAL ASSERT "use_count > 0"; seen on the H200 when tinyloop-bench's
            # batch-16 row followed release_cuda_caches()). With no graph kept, the next capture takes a new pool.
            self.pool = torch.cuda.graph_pool_handle()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                output = step()
        finally:
            if collecting:
                gc.enable()
        slots = _written_slots(slot_lengths, cache)
        cache.length, cache.slot_lengths = length, slot_lengths
        return graph, output, slots

    def _capture_decode(self, key: tuple, input_ids: torch.Tensor, cache: PagedTinyLoopCache) -> _Graph:
        static_ids = input_ids.clone()
        static_positions = torch.full_like(input_ids, cache.length)
        graph, logits, slots = self._record(
            cache,
            lambda: (
                self.model(
                    input_ids=static_ids,
                    position_ids=static_positions,
                    past_key_values=cache,
                    use_cache=True,
                    num_loops=key[2],
                    logits_to_keep=1,
                ).logits
            ),
        )
        return _Graph(graph, static_ids, static_positions, logits, slots)

    @staticmethod
    def _prefill_inputs(key: tuple, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed token ids and the positions 0 .. bucket - 1, [batch, bucket] each, of a prefill key."""
        batch, bucket = key[1], key[2]
        ids = torch.zeros(batch, bucket, dtype=input_ids.dtype, device=input_ids.device)
        positions = torch.arange(bucket, device=input_ids.device)[None].expand(batch, -1).contiguous()
        return ids, positions

    def _prefill_forward(
        self, key: tuple, ids: torch.Tensor, positions: torch.Tensor, cache: PagedTinyLoopCache
    ) -> torch.Tensor:
        """The last hidden states [batch, bucket, H] of a padded prompt (what a prefill graph captures)."""
        return self.model.model(
            input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, num_loops=key[3]
        ).last_hidden_state

    def _capture_prefill(self, key: tuple, input_ids: torch.Tensor, cache: PagedTinyLoopCache) -> _Graph:
        static_ids, static_positions = self._prefill_inputs(key, input_ids)
        graph, hidden, slots = self._record(
            cache, lambda: self._prefill_forward(key, static_ids, static_positions, cache)
        )
        return _Graph(graph, static_ids, static_positions, hidden, slots)

    # -- self-speculative decoding: draft steps and verifies ------------------------------------------------------

    def serves_steps(self, cache: Any) -> bool:
        """Whether continuation steps on ``cache`` can be graph-replayed (see continuation_step)."""
        return (
            self.use_graphs
            and isinstance(cache, PagedTinyLoopCache)
            and cache.storage is not None
            and cache.length > 0
            and not torch.is_grad_enabled()
            and self.model.config.initial_state != "random"
        )

    def continuation_step(
        self,
        name: tuple,
        inputs: dict[str, torch.Tensor],
        cache: PagedTinyLoopCache,
        step: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, ...]:
        """``step(inputs)``: a forward of ``inputs["positions"].shape[1]`` new tokens per row on ``cache`` (it must
        take its attention mask as None: the pages know each row's start). Like decode, the first call of a key runs
        eagerly, the second captures, and later calls copy ``inputs`` into the graph's buffers and replay it; the
        cache's device metadata (lengths, positions) is filled before each replay."""
        self.settle()
        key = (*name, cache.storage.serial, cache.storage.capacity)
        if cache.length + inputs["positions"].shape[1] > cache.storage.capacity:
            return step(inputs)  # the storage grows (a graph keeps its buffers): eager, a new key afterwards
        if key not in self.warmed:
            self.warmed.add(key)
            return step(inputs)
        if key not in self.graphs:
            static = {label: tensor.clone() for label, tensor in inputs.items()}
            graph, outputs, slots = self._record(cache, lambda: step(static))
            self.graphs[key] = _StepGraph(graph, static, outputs, slots)
        entry = self.graphs[key]
        for label, tensor in inputs.items():
            entry.inputs[label].copy_(tensor)
        positions = inputs["positions"]
        cache.begin_step(positions.shape[0], positions.shape[1], None, entry.outputs[0])
        cache.mark_all_written(entry.slots)
        entry.graph.replay()
        cache.end_step()
        return tuple(output.clone() for output in entry.outputs)
