"""The fused decode kernel's work split and shared-memory plan (kernels/fused_decode.py ``layout``), checked without a
GPU: every projection row is owned by exactly one CTA, every TMA copy brings the rows the kernel reads at the local
index it reads them from, copies are 16-byte aligned and stay inside their slot, and the structs match the kernel's."""

from __future__ import annotations

import ctypes

import pytest

from tinyloop_hf.kernels import fused_decode as fd

OURO_1_4B = fd.Shapes(2048, 5632, 16, 16, 128, {2048: 16, 5632: 44}, True, 2, False)
SMALL_GQA = fd.Shapes(512, 1024, 8, 2, 64, {512: 16, 1024: 32}, False, 2, True)


def _matrix_rows(shapes: fd.Shapes) -> dict[int, int]:
    H, F, D = shapes.hidden, shapes.intermediate, shapes.head_dim
    return {0: shapes.heads * D, 1: shapes.kv_heads * D, 2: shapes.kv_heads * D, 3: H, 4: F, 5: F, 6: H}


@pytest.mark.parametrize("shapes", [OURO_1_4B, SMALL_GQA], ids=["ouro-1.4b", "small-gqa"])
@pytest.mark.parametrize("ctas", [132, 114, 7])
def test_every_row_is_copied_once_to_where_the_kernel_reads_it(shapes, ctas):
    plan = fd.layout(shapes, ctas)
    assert isinstance(plan, fd.Layout), plan  # layout does not judge size; the plan checks the device's limit
    owned: dict[tuple[int, int], int] = {}
    for cta, work in enumerate(plan.ctas):
        local: dict[tuple[int, int], tuple[int, int]] = {}  # (slot, local row) -> (matrix, row), from weight copies
        spans: list[tuple[int, int]] = []
        for piece in work.pieces:
            slot = plan.slots[piece.slot]
            assert piece.offset % 16 == 0 and piece.bytes % 16 == 0 and piece.smem % 16 == 0
            spans.append((piece.smem, piece.smem + piece.bytes))
            if piece.kind == 0:
                width = slot["row_bytes"]
                assert piece.offset % width == 0 and piece.bytes % width == 0
                first_local = (piece.smem - slot["weights"]) // width
                for i in range(piece.bytes // width):
                    key = (piece.mat, piece.offset // width + i)
                    local[(piece.slot, first_local + i)] = key
                    assert key not in owned, f"{key} copied by CTAs {owned[key]} and {cta}"
                    owned[key] = cta
                assert piece.smem + piece.bytes <= slot["scales"]
            elif piece.kind == 1:
                assert slot["scales"] <= piece.smem and piece.smem + piece.bytes <= slot["zeros"] or not shapes.zeros
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "copies overlap"
        assert spans[-1][1] <= plan.xres
        # QKV: the local rows of each unit hold its pair's rows.
        first, count = work.units
        for j, packed in enumerate(work.unit_rows):
            matrix, row0, row1 = fd.unit_rows(first + j, shapes)
            assert local[(0, packed & 0xFFFF)] == (matrix, row0)
            assert local[(0, packed >> 16)] == (matrix, row1)
        # O, gate / up and down: quads at local rows 4q.. (up rows from rows_cap on).
        for slot_index, matrix, (q0, quads), base in ((1, 3, work.o_quads, 0), (2, 4, work.g_quads, 0),
                                                     (2, 5, work.g_quads, plan.slots[2]["rows_cap"]),
                                                     (3, 6, work.d_quads, 0)):  # fmt: skip
            for r in range(4 * quads):
                assert local[(slot_index, base + r)] == (matrix, 4 * q0 + r)
        # Batches: each completes one ring mbarrier with its bytes; about CHUNK_BYTES each, never across slots.
        batch: list[fd.Piece] = []
        for piece in work.pieces:
            if not batch:
                assert piece.batch_bytes > 0
            else:
                assert piece.batch_bytes == 0 and piece.slot == batch[0].slot
            batch.append(piece)
            if piece.last:
                total = sum(p.bytes for p in batch)
                assert total == batch[0].batch_bytes and (total <= fd.CHUNK_BYTES or len(batch) == 1)
                batch = []
        assert not batch
    for matrix, rows in _matrix_rows(shapes).items():
        assert all((matrix, row) in owned for row in range(rows)), f"{fd.MATRICES[matrix]} has rows no CTA copies"


def test_ouro_1_4b_fits_an_h200_cta():
    plan = fd.layout(OURO_1_4B, 132)
    assert plan.smem_bytes <= 232448 - 4096  # H100 / H200 opt-in shared memory per block, less the static part
    assert plan.splits == 8  # 16 KV heads x 8 splits = 128 attention CTAs
    assert max(sum(fd.batches(cta)) for cta in plan.ctas) <= fd.RING // 2


def test_ouro_1_4b_gets_12_warp_ctas():
    """11 consumer warps still stage the widest input (F / 4 = 1408 LL words, 4 a thread) and own every junction
    column, so Ouro-1.4B gets 384-thread CTAs, and each CTA's down rows split into at most one task per warp."""
    plan = fd.layout(OURO_1_4B, 132)
    assert not isinstance(plan, str) and plan.smem_bytes <= 232448 - 4096
    assert plan.threads == 384
    warps = (plan.threads - 32) // 32
    for cta in plan.ctas:
        assert -(-cta.units[1] // 3) <= warps  # QKV tasks of 3 units (QKV_UNITS in the kernel)
        assert cta.g_quads[1] <= warps and cta.o_quads[1] <= warps
        assert cta.d_quads[1] * 2 <= warps  # down: 2 parts of 88 chunks a quad


def test_the_grid_leaves_spare_sms_and_ouro_1_4b_still_fits():
    """SPARE_SMS SMs stay free for generate()'s own kernels (a CTA fills its SM's register file): 128 CTAs on the
    H200's 132 SMs, which still hold Ouro-1.4B's plan (24 QKV units a CTA); a small model gets one CTA per unit."""
    assert fd.SPARE_SMS == 4 and fd.grid_for(132, OURO_1_4B) == 128
    assert fd.layout(OURO_1_4B, 128).smem_bytes <= 232448 - 4096
    assert fd.grid_for(132, SMALL_GQA) == 128 and fd.grid_for(4, SMALL_GQA) == 1
    assert fd.grid_for(132, fd.Shapes(64, 64, 1, 1, 64, {64: 2}, True, 2, False)) == 16  # F / 4 quads


def test_wider_vectors_get_16_warp_ctas_and_wider_still_are_refused():
    """A vector of more than 4 x 352 LL words (F = 5632) needs the 480 consumer threads of a 512-thread CTA; past
    4 x 480 words (F = 7680) no CTA size covers it, and the layout says so."""
    assert fd.threads_for(2048, 5632) == 384 and fd.threads_for(2048, 5664) == 512
    assert fd.threads_for(2048, 7680) == 512 and fd.threads_for(2048, 7712) is None
    assert fd.threads_for(2816, 2816) == 384 and fd.threads_for(2848, 2848) == 512  # hidden / 8 against 352
    wide = fd.Shapes(2048, 7680, 16, 16, 128, {2048: 16, 7680: 60}, True, 2, False)
    assert fd.layout(wide, 132).threads == 512
    llama_1b = fd.Shapes(2048, 8192, 32, 8, 64, {2048: 16, 8192: 64}, True, 2, False)
    reason = fd.layout(llama_1b, 132)
    assert isinstance(reason, str) and "8192" in reason and "(384, 512)" in reason


def test_threads_forces_one_cta_size(monkeypatch):
    """fused_decode.THREADS (experiments, tests) replaces the choice; a shape it cannot cover is refused."""
    monkeypatch.setattr(fd, "THREADS", 512)
    assert fd.layout(OURO_1_4B, 132).threads == 512
    monkeypatch.setattr(fd, "THREADS", 384)
    assert fd.threads_for(2048, 5664) is None


@pytest.mark.parametrize("splits", [1, 2, 4, 64])
def test_fewer_attention_splits_when_asked(monkeypatch, splits):
    """fused_decode.SPLITS caps the splits per KV head (never above what the CTAs allow: 8 here)."""
    monkeypatch.setattr(fd, "SPLITS", splits)
    assert fd.layout(OURO_1_4B, 132).splits == min(splits, 8)


def test_a_misaligned_copy_is_refused_with_its_name():
    # 8-column-group scales of 64-wide rows: 4 bytes a row, so a pair of rows is no 16-byte copy.
    shapes = fd.Shapes(64, 128, 4, 4, 16, {64: 2, 128: 4}, True, 2, False)
    reason = fd.layout(shapes, 132)
    assert isinstance(reason, str) and "not a 16-byte aligned copy" in reason and "proj" in reason


def test_structs_match_the_kernel():
    """Sizes of the ctypes mirrors against fused_decode.cu's structs (all 4- and 8-byte fields)."""
    assert ctypes.sizeof(fd.AppStruct) == 21 * 8 + 4 * 8 + 2 * 8 + 4 * 4
    assert ctypes.sizeof(fd.PieceStruct) == 32
    assert ctypes.sizeof(fd.WorkStruct) == 29 * 4
    assert ctypes.sizeof(fd.SlotStruct) == 32
    source = fd.__file__.rsplit("/", 1)[0] + "/fused_decode.cu"
    text = open(source).read()
    for name in ("RING", "MAX_TASKS", "MAX_UNITS"):
        assert f"constexpr int {name} = {getattr(fd, name)};" in text
    assert f"constexpr int STAGE_WORDS = {fd.STAGE_WORDS};" in text
    assert "constexpr int CONSUMERS = THREADS - 32;" in text  # threads_for's consumer count
    # Params: every field, in order, by name.
    body = text[text.index("struct Params {") : text.index("};", text.index("struct Params {"))]
    position = 0
    for field, _ in fd.ParamsStruct._fields_:
        if field == "pad":
            continue
        found = body.find(field, position)
        assert found >= 0, field
        position = found
