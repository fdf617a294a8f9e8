"""Paged mode of TinyLoopCache on the reference path: the page layout, INT8 KV and the bookkeeping the CUDA kernels
rely on, checked on the CPU against the plain cache."""

from __future__ import annotations

import pytest
import torch

from helpers import VARIANTS, tiny_model
from tinyloop_hf import PagedTinyLoopCache, TinyLoopCache
from tinyloop_hf.compat import GENERATE_CACHE_KEY
from tinyloop_hf.paged_cache import PAGE_SIZE, quantize_kv

IDS = torch.randint(1, 256, (2, 21), generator=torch.Generator().manual_seed(5))


def _decode(model, cache, ids, prompt, **kwargs):
    with torch.no_grad():
        logits = [model(ids[:, :prompt], past_key_values=cache, use_cache=True, **kwargs).logits[:, -1]]
        for t in range(prompt, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **kwargs).logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_paged_cache_equals_plain_cache(variant):
    model = tiny_model(variant)
    plain = _decode(model, TinyLoopCache(model.config), IDS, 5)
    cache = PagedTinyLoopCache(model.config, capacity=8)  # grows past its capacity on the way
    paged = _decode(model, cache, IDS, 5)
    assert torch.equal(plain, paged)
    assert cache.get_seq_length() == IDS.shape[1] and cache.storage.capacity >= IDS.shape[1]
    plain_cache = TinyLoopCache(model.config)
    _decode(model, plain_cache, IDS[:, :6], 5)
    cache_api = (len(cache), cache.is_initialized, cache.get_max_length(), cache.get_max_cache_shape())
    assert cache_api == (len(plain_cache), True, -1, -1) and len(cache) > 0
    slots = len(cache.storage.pages)
    assert cache.bytes_per_token() == slots * 2 * model.config.num_key_value_heads * model.config.head_dim * 4


def test_a_growing_cache_doubles_its_storage_instead_of_copying_at_every_token(monkeypatch):
    model = tiny_model("ouro", max_position_embeddings=256)
    cache = PagedTinyLoopCache(model.config, capacity=8)
    capacities = []
    allocate = PagedTinyLoopCache._allocate

    def recording(self, batch, capacity, *args):
        capacities.append(capacity)
        return allocate(self, batch, capacity, *args)

    monkeypatch.setattr(PagedTinyLoopCache, "_allocate", recording)
    ids = torch.randint(1, 256, (1, 100), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_decode(model, cache, ids, 5), _decode(model, TinyLoopCache(model.config), ids, 5))
    assert capacities == [8, 16, 32, 64, 128]
    cache.reserve(1, 200, torch.float32, torch.device("cpu"))  # never past the model's positions
    assert capacities[-1] == 256


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_per_row_depths_that_change_between_steps_keep_the_skipped_loops_policy(kv_dtype):
    """Every row runs every loop on the paged cache; a row's slots past its depth must still take its last computed
    loop's K/V, as on the plain cache: row 0's logits do not depend on the deeper row beside it."""
    model = tiny_model("ouro", num_loops=4)
    depths = [1, 4, 2, 4, 3, 4, 1, 4]

    def row0(cache, batched):
        ids = IDS[:, :13] if batched else IDS[:1, :13]
        logits = []
        with torch.no_grad():
            model(ids[:, :5], past_key_values=cache, use_cache=True)
            for step, t in enumerate(range(5, 13)):
                loops = [depths[step], 4] if batched else depths[step]
                logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, num_loops=loops).logits)
        return torch.cat(logits, 1)[0]

    paged = row0(PagedTinyLoopCache(model.config, kv_dtype=kv_dtype), True)
    alone = row0(PagedTinyLoopCache(model.config, kv_dtype=kv_dtype), False)
    torch.testing.assert_close(paged, alone, rtol=1e-5, atol=1e-5)  # batched matmuls round apart (the bug: ~2.6)
    if kv_dtype == "auto":
        assert torch.equal(paged, row0(TinyLoopCache(model.config), True))


def test_a_decode_step_begun_for_device_metadata_matches_begin_step():
    """begin_decode_step (CUDA-path run-ahead writes the metadata in its own kernel) leaves the cache as begin_step
    does once its buffers hold length + 1 and length; a cache without tokens is refused."""
    model = tiny_model("ouro")
    caches = [PagedTinyLoopCache(model.config, capacity=32) for _ in range(2)]
    for cache in caches:
        with torch.no_grad():
            model(IDS[:, :6], past_key_values=cache, use_cache=True)
    like = torch.zeros(2, 1, model.config.hidden_size)
    caches[0].begin_step(2, 1, None, like)
    lengths, positions = caches[1].begin_decode_step(2, like)
    assert lengths is caches[1].storage.lengths and positions is caches[1].step_positions
    lengths.fill_(caches[1].length + 1)
    positions.fill_(caches[1].length)
    assert caches[1].step_tokens == caches[0].step_tokens == 1
    assert torch.equal(caches[1].step_positions, caches[0].step_positions)
    assert torch.equal(caches[1].storage.lengths, caches[0].storage.lengths)
    with pytest.raises(ValueError, match="continues a cached sequence"):
        PagedTinyLoopCache(model.config).begin_decode_step(2, like)


def test_pages_follow_the_block_table():
    model = tiny_model("ouro")
    cache = PagedTinyLoopCache(model.config, capacity=40)
    with torch.no_grad():
        model(IDS, past_key_values=cache, use_cache=True)
    storage = cache.storage
    assert storage.block_table.shape == (2, 3) and storage.block_table.dtype == torch.int32
    keys, values = cache.gather(0, IDS.shape[1], torch.float32)
    position = 17
    page = storage.block_table[1, position // PAGE_SIZE]
    assert torch.equal(storage.slot(0)[0][page, :, position % PAGE_SIZE], keys[1, :, position])
    assert torch.equal(storage.slot(0)[1][page, :, position % PAGE_SIZE], values[1, :, position])


def test_int8_kv_rounds_per_token_and_head_and_stays_close():
    states = torch.randn(3, 5, 2, 16)
    codes, scales = quantize_kv(states)
    assert codes.dtype == torch.int8 and scales.shape == (3, 5, 2)
    assert torch.equal(codes.abs().amax(-1), torch.full((3, 5, 2), 127, dtype=torch.int8))
    assert (codes.float() * scales[..., None] - states).abs().max() <= scales.max() / 2 + 1e-6
    model = tiny_model("ouro")
    plain = _decode(model, TinyLoopCache(model.config), IDS, 5)
    cache = PagedTinyLoopCache(model.config, kv_dtype="int8")
    quantized = _decode(model, cache, IDS, 5)
    assert 0 < (quantized - plain).abs().max() < 0.05 * plain.abs().max()
    assert cache.bytes_per_token() == len(cache.storage.pages) * 2 * model.config.num_key_value_heads * (
        model.config.head_dim + 4
    )


def test_left_padding_and_beam_search_match_the_plain_cache():
    model = tiny_model("huginn")
    ids = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)
    with torch.no_grad():
        plain = model.generate(ids, **{GENERATE_CACHE_KEY: TinyLoopCache(model.config)}, **kwargs)
        paged = model.generate(ids, **{GENERATE_CACHE_KEY: PagedTinyLoopCache(model.config)}, **kwargs)
    assert torch.equal(plain, paged)


def test_holes_in_the_mask_and_depth_changes_are_refused():
    model = tiny_model("ouro")
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[0, 4] = 0
    with pytest.raises(ValueError, match="left padding only"):
        model(IDS, attention_mask=mask, past_key_values=PagedTinyLoopCache(model.config), use_cache=True)
    cache = PagedTinyLoopCache(model.config)
    with torch.no_grad():
        model(IDS[:, :4], past_key_values=cache, use_cache=True, num_loops=2)
        with pytest.raises(ValueError, match="fewer loops"):
            model(IDS[:, 4:5], past_key_values=cache, use_cache=True, num_loops=3)


def test_crop_and_batch_select():
    model = tiny_model("llama")
    cache = PagedTinyLoopCache(model.config)
    with torch.no_grad():
        model(IDS[:, :10], past_key_values=cache, use_cache=True)
        cache.crop(-3)
        resumed = model(IDS[:, 7:9], past_key_values=cache, use_cache=True).logits
        full = model(IDS[:, :9]).logits
    assert torch.allclose(resumed, full[:, 7:], atol=1e-5)
    cache.batch_select_indices(torch.tensor([1]))
    with torch.no_grad():
        step = model(IDS[1:, 9:10], past_key_values=cache, use_cache=True).logits
        full = model(IDS[1:, :10]).logits
    assert torch.allclose(step, full[:, 9:], atol=1e-5)


def test_bad_kv_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'int8'\]"):
        PagedTinyLoopCache(tiny_model("ouro").config, kv_dtype="fp8")


def test_cuda_path_without_a_gpu_fails_clearly():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from tinyloop_hf.kernels.loader import CudaPathUnavailable

    with pytest.raises(CudaPathUnavailable, match="CUDA device|CuPy"):
        tiny_model("ouro").use_cuda_path()


def _cpu_cuda_path(monkeypatch, **overrides):
    """A CudaPath over CPU tensors (its storage bookkeeping needs no GPU; graphs are off)."""
    from tinyloop_hf.kernels import loader

    monkeypatch.setattr(loader, "check_device", lambda device: None)
    return tiny_model("ouro", **overrides).to(torch.bfloat16).use_cuda_path(cuda_graphs=False)._cuda_path


def test_cuda_path_settings_and_capacities_are_checked(monkeypatch):
    model = tiny_model("ouro").to(torch.bfloat16)
    for field, value in (("cuda_graphs", "false"), ("run_ahead", None)):
        with pytest.raises(ValueError, match=rf"use_cuda_path\({field}=...\) must be True or False, got {value!r}"):
            model.use_cuda_path(**{field: value})
    for capacity in (2.5, "256", 0, -100, True):
        with pytest.raises(ValueError, match=r"capacity must be None or a positive integer \(tokens per row\)"):
            model.new_cache(capacity)
        with pytest.raises(ValueError, match="capacity must be a positive integer"):
            PagedTinyLoopCache(model.config, capacity=capacity)
    cache = PagedTinyLoopCache(model.config, capacity=10**12)  # no storage past the model's positions
    cache.reserve(1, 16, torch.bfloat16, torch.device("cpu"))
    assert cache.storage.capacity == model.config.max_position_embeddings


def test_a_model_spread_over_devices_is_refused_by_the_cuda_path(monkeypatch):
    from tinyloop_hf.kernels import loader
    from tinyloop_hf.kernels.loader import CudaPathUnavailable

    monkeypatch.setattr(loader, "check_device", lambda device: None)
    model = tiny_model("ouro").to(torch.bfloat16)
    model.lm_head.to("meta")
    with pytest.raises(CudaPathUnavailable, match="the CUDA path runs a model on one GPU; this one is on cpu, meta"):
        model.use_cuda_path()


def test_graph_keys_leave_requests_the_eager_step_refuses_to_it(monkeypatch):
    """A decode step the eager forward would refuse (a depth past max_loops, early_exit_threshold alone, a mask of
    the wrong length) gets no graph: it runs eagerly and fails there, before any pages are allocated for it."""
    path = _cpu_cuda_path(monkeypatch)
    path.use_graphs = True
    cache = path.new_cache(64)
    cache.reserve(1, 16, torch.bfloat16, torch.device("cpu"))
    cache.length = 8
    ids, plain = torch.ones(1, 1, dtype=torch.long), {"attention_mask": torch.ones(1, 9), "logits_to_keep": 1}
    with torch.no_grad():
        assert path.graph_key(ids, cache, plain)[0] == "decode"
        for arguments in ({"num_loops": 40}, {"num_loops": 0}, {"early_exit_threshold": 0.5},
                          {"attention_mask": torch.ones(1, 3)}):  # fmt: skip
            assert path.graph_key(ids, cache, {**plain, **arguments}) is None, arguments


def _storage(path, batch, capacity=100):
    return path.storage(batch=batch, capacity=capacity, kv_heads=2, head_dim=8, dtype=torch.bfloat16, int8=False,
                        device=torch.device("cpu"))  # fmt: skip


def test_cuda_path_keeps_the_storages_of_the_latest_shapes_with_their_graphs(monkeypatch):
    from tinyloop_hf.cuda_path import MAX_STORAGES

    path = _cpu_cuda_path(monkeypatch)
    first = _storage(path, batch=1)
    assert _storage(path, batch=1, capacity=120) is first  # the same capacity bucket: reused
    path.graphs[("decode", 1, 4, first.serial, first.capacity)] = "graph of the first storage"
    path.warmed.add(("decode", 1, 4, first.serial, first.capacity))
    later = [_storage(path, batch) for batch in range(2, MAX_STORAGES + 1)]
    assert _storage(path, batch=1) is first  # used again: now the most recent
    newest = _storage(path, batch=MAX_STORAGES + 1)  # drops the least recently used, batch 2's
    kept = list(path.storages.values())
    assert len(kept) == MAX_STORAGES and later[0] not in kept and first in kept and newest in kept
    assert ("decode", 1, 4, first.serial, first.capacity) in path.graphs
    for batch in range(MAX_STORAGES + 2, 2 * MAX_STORAGES + 3):
        _storage(path, batch)
    assert first not in path.storages.values()
    assert not path.graphs and not path.warmed  # its graph went with it
    assert len({storage.serial for storage in [first, *later, newest]}) == MAX_STORAGES + 1


def test_pages_that_do_not_fit_drop_the_other_storages_first(monkeypatch):
    from tinyloop_hf.paged_cache import PagedStorage

    path = _cpu_cuda_path(monkeypatch)
    old, new = _storage(path, batch=1), _storage(path, batch=2)
    old.slot(0)
    new_pages, failures = PagedStorage._new_pages, []

    def fits_once_the_old_storage_is_gone(storage):
        if any(kept is old for kept in path.storages.values()):
            failures.append(storage.batch)
            raise torch.OutOfMemoryError("out of memory")
        return new_pages(storage)

    monkeypatch.setattr(PagedStorage, "_new_pages", fits_once_the_old_storage_is_gone)
    pages = new.slot(3)
    assert failures == [2] and pages[0].shape[0] == 2 * new.blocks_per_row
    assert list(path.storages.values()) == [new]
    path.graphs[("decode", 2, 4, new.serial, new.capacity)] = "graph reading the new storage's pages"
    monkeypatch.setattr(PagedStorage, "_new_pages", lambda storage: (_ for _ in ()).throw(torch.OutOfMemoryError()))
    with pytest.raises(torch.OutOfMemoryError):  # nothing left to drop: the error is the allocator's
        new.slot(4)
    assert not new.pages and not path.storages and not path.graphs  # the failed storage holds no memory
    monkeypatch.setattr(PagedStorage, "_new_pages", new_pages)
    again = _storage(path, batch=2)
    assert again is not new and again.slot(0)[0].shape[0] == 2 * again.blocks_per_row


def test_a_new_storage_that_would_not_fit_drops_the_least_recently_used_first(monkeypatch):
    from tinyloop_hf import cuda_path

    path = _cpu_cuda_path(monkeypatch)
    kept = [_storage(path, batch) for batch in (1, 2, 3)]
    shape = dict(batch=4, capacity=128, kv_heads=2, head_dim=8, dtype=torch.bfloat16, int8=False)
    config = path.model.config
    slots = config.num_prelude_layers + config.num_coda_layers + config.num_loops * config.num_loop_layers
    pages = 4 * 128 * slots * 2 * 2 * 8 * 2  # rows x tokens x slots x (K, V) x KV heads x head_dim x bf16
    width = (config.num_attention_heads + 2 * 2) * 8 + 3 * config.intermediate_size + 4 * config.hidden_size
    assert path._expected_bytes(shape) == pages + 4 * 128 * width * 2  # and a prompt forward's activations
    # The device has room for the new storage once two of the three kept ones are gone.
    monkeypatch.setattr(cuda_path, "free_device_bytes", lambda device: 10**12 if len(path.storages) <= 1 else 0)
    newest = _storage(path, batch=4)
    assert list(path.storages.values()) == [kept[2], newest]
    path.model.release_cuda_caches()
    assert not path.storages and not path.graphs and not path.warmed


def test_a_capacity_bucket_that_cannot_fit_gives_way_to_a_finer_one(monkeypatch):
    from tinyloop_hf import cuda_path

    path = _cpu_cuda_path(monkeypatch)
    shape = dict(batch=2, kv_heads=2, head_dim=8, dtype=torch.bfloat16, int8=False)
    asked, bucket = 2100, cuda_path.capacity_bucket(2100)  # 2,560
    room = path._expected_bytes({**shape, "capacity": 2176})  # 1/32 of 4,096: the finer bucket
    monkeypatch.setattr(cuda_path, "free_device_bytes", lambda device: room)
    storage = _storage(path, batch=2, capacity=asked)
    assert storage.capacity == 2176 and bucket == 2560
    for tokens in (asked, 2049, 2176):  # later calls of the shape share it: one token more or 127
        assert _storage(path, batch=2, capacity=tokens) is storage
    monkeypatch.setattr(cuda_path, "free_device_bytes", lambda device: float("inf"))
    assert _storage(path, batch=2, capacity=asked) is storage  # kept while it is kept, even with room now
    path.release()
    assert _storage(path, batch=2, capacity=asked).capacity == bucket  # a new one, with room: the bucket


def test_a_storage_no_longer_kept_that_runs_out_of_memory_takes_its_graphs_along(monkeypatch):
    """A cache the caller still holds can outlive its storage's place among the kept ones; when its pages cannot be
    allocated, the graphs captured on it must go (the storage frees its pages), whatever else is kept."""
    from tinyloop_hf.paged_cache import PagedStorage

    path = _cpu_cuda_path(monkeypatch)
    held = _storage(path, batch=1)
    path.release()  # no longer kept, but still in use
    path.graphs[("decode", 1, 4, held.serial, held.capacity)] = "graph on the held storage's pages"
    newer = _storage(path, batch=1)  # the same shape, kept
    held.slot(0)
    monkeypatch.setattr(PagedStorage, "_new_pages", lambda storage: (_ for _ in ()).throw(torch.OutOfMemoryError()))
    with pytest.raises(torch.OutOfMemoryError):
        held.slot(1)
    assert newer not in path.storages.values()  # dropped to make room first
    assert not path.graphs and not held.pages


def test_a_cuda_path_cache_keeps_the_capacity_asked_for_and_its_storage_the_bucket(monkeypatch):
    from tinyloop_hf.cuda_path import capacity_bucket

    path = _cpu_cuda_path(monkeypatch, max_position_embeddings=512)
    cache = path.new_cache(300)
    cache.reserve(1, 20, torch.bfloat16, torch.device("cpu"))
    assert cache.capacity == 300 and cache.storage.capacity == capacity_bucket(300) == 384


def test_a_graph_is_captured_only_once_every_page_it_writes_exists(monkeypatch):
    path = _cpu_cuda_path(monkeypatch)
    config = path.model.config
    cache = path.new_cache(64)
    cache.reserve(1, 16, torch.bfloat16, torch.device("cpu"))
    slots = config.num_prelude_layers + config.num_coda_layers + 2 * config.num_loop_layers
    for slot in range(slots - 1):
        cache.storage.slot(slot)
    assert not path._pages_ready(cache, 2)  # an eager step that stopped early left the last slot out
    cache.storage.slot(slots - 1)
    assert path._pages_ready(cache, 2) and not path._pages_ready(cache, 3)


def test_an_eager_warm_up_step_gets_all_its_pages_before_its_forward(monkeypatch):
    """The step before a capture (for a prompt, CudaPath._prefill_eagerly) finds every page of its loop count
    allocated, so no page is allocated between the forward's activations (which fragmented the allocator at batch
    64 x 2,048)."""
    path = _cpu_cuda_path(monkeypatch)
    cache = path.new_cache(64)
    cache.reserve(1, 16, torch.bfloat16, torch.device("cpu"))
    key = ("prefill", 1, 16, 2, cache.storage.serial, cache.storage.capacity)
    assert not cache.storage.pages
    ready = []
    monkeypatch.setattr(path, "_prefill_eagerly", lambda key, ids, cache: ready.append(path._pages_ready(cache, 2)))
    path.run(key, torch.ones(1, 16, dtype=torch.long), None, None, cache)
    assert ready == [True] and not path._pages_ready(cache, 3)


@pytest.mark.parametrize("max_positions", [256, 40])  # 40: the pads would lie past the context, so no padding
def test_a_prompt_on_the_cuda_path_runs_padded_to_its_bucket_graphs_or_not(max_positions, monkeypatch):
    """generate()'s prompt runs as its prefill graph's replays will, padded on the right to a multiple of
    PREFILL_BUCKET, also in the eager forward before a capture and on a model without graphs: the row count decides
    which kernel serves each projection and how it splits its sums, so an unpadded first prompt gave other logits
    than its replays (a later generate() parted from the first at a near-tie). The cache keeps the prompt's tokens
    alone, and the tokens are those of the model without a CUDA path (reference ops here, on CPU)."""
    from tinyloop_hf.cuda_path import PREFILL_BUCKET
    from tinyloop_hf.kernels import fused_decode

    monkeypatch.setattr(fused_decode, "FUSED_DECODE", False)
    model = _cpu_cuda_path(monkeypatch, max_position_embeddings=max_positions).model
    model.set_op_backend("reference")
    shapes = []
    forward = type(model.model).forward
    monkeypatch.setattr(type(model.model), "forward",
                        lambda self, *a, **k: shapes.append(tuple(k["input_ids"].shape)) or forward(self, *a, **k))
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    got = model.generate(ids, **kwargs)
    assert shapes == [(2, PREFILL_BUCKET if PREFILL_BUCKET <= max_positions else 12)] + [(2, 1)] * 4
    assert got.past_key_values.get_seq_length() == 12 + 4
    monkeypatch.setattr(type(model.model), "forward", forward)
    want = tiny_model("ouro", max_position_embeddings=max_positions).to(torch.bfloat16).generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):  # bf16 sums over 64 rows against 12: close, not equal
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()
