"""The attention block kernel's work split (kernels/attention_block.cu), checked without a GPU: the QKV tasks of a
cluster cover every projected value of the KV group exactly once, each RoPE pair lands in one lane with its angle,
and the gather reads each value from the CTA that wrote it. The formulas are transcribed from the kernel."""

from __future__ import annotations

import pytest

from tinyloop_hf.kernels import attention_block

CLUSTER = attention_block.CLUSTER


def _task_values(task: int, dim: int, group: int, layout: int) -> list[tuple[int, int, int, int]]:
    """(matrix head m, dim d0, dim d1, angle p) of the two pairs a task's lanes 0 and 1 finish (kernel step 1)."""
    quarter = dim // 4
    m, jj = divmod(task, quarter)
    first, step = (jj, quarter) if layout == 0 else (4 * jj, 1)
    pairs = []
    for lane in range(2):
        r0, r1 = (lane, lane + 2) if layout == 0 else (2 * lane, 2 * lane + 1)
        d0, d1 = first + r0 * step, first + r1 * step
        pairs.append((m, d0, d1, d0 if layout == 0 else d0 // 2))
    return pairs


def _owner(index: int, dim: int, tasks_per_cta: int, layout: int) -> int:
    """The rank the gather (kernel step 2) reads value ``index`` of [(G + 2) D] from."""
    quarter = dim // 4
    m, d = divmod(index, dim)
    jj = d % quarter if layout == 0 else d // 4
    return (m * quarter + jj) // tasks_per_cta


SERVED = [(128, 1), (128, 2), (128, 4), (64, 1), (64, 2), (64, 4)]  # (head_dim, query heads per KV head)


@pytest.mark.parametrize("dim, group", SERVED)
@pytest.mark.parametrize("layout", [0, 1])
def test_tasks_cover_the_group_once_and_the_gather_reads_the_writer(dim, group, layout):
    tasks_per_cta = (group + 2) * dim // 4 // CLUSTER
    written: dict[int, int] = {}
    for rank in range(CLUSTER):
        for j in range(tasks_per_cta):
            for m, d0, d1, p in _task_values(rank * tasks_per_cta + j, dim, group, layout):
                # RoPE's pairs: (p, p + D/2) for rotate_half, (2p, 2p + 1) interleaved; p < D/2.
                assert (d0, d1) == ((p, p + dim // 2) if layout == 0 else (2 * p, 2 * p + 1)) and p < dim // 2
                for d in (d0, d1):
                    assert m * dim + d not in written
                    written[m * dim + d] = rank
    assert sorted(written) == list(range((group + 2) * dim))
    assert all(_owner(i, dim, tasks_per_cta, layout) == rank for i, rank in written.items())


def test_shared_memory_stays_under_the_default_48_kib_at_the_served_shapes():
    for dim, group in SERVED:
        tasks = (group + 2) * dim // 4 // CLUSTER
        warps = next((w for w in attention_block.WARPS if w >= tasks), attention_block.WARPS[-1])
        assert attention_block.shared_bytes(group, dim, warps, 2) <= 48 * 1024 - attention_block._STATIC_SHARED
