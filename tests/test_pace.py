"""Pace by operation identity (transforms/ingest/kineto/pace.py): a heavy operation is work, a
slower machine, a slowed operation type or unrecorded work between operations is pace."""
from __future__ import annotations

import numpy as np
import pytest

from transforms.ingest.kineto.events import CpuOps
from transforms.ingest.kineto.pace import op_paces, recorded_ops

FWD, BWD = 1, 2


def _chunk(operations: list[tuple[str, float]], gap: float = 10.0, extra_gap: dict[int, float] | None = None,
           scale: float = 1.0, t0: float = 0.0):
    """One forward compute row of recorded operations (name, µs), `gap` µs after each (plus
    `extra_gap` after the k-th), every time scaled by `scale`: (row start, row end, ops, marks)."""
    t, ops, marks = t0, [], []
    for k, (name, length) in enumerate(operations):
        marks.append(t)
        ops.append((t, t + length * scale, name, 1))
        t += (length + gap + (extra_gap or {}).get(k, 0.0)) * scale
    return t0, t, ops, marks


BLOCK = [("aten::mm", 100.0), ("aten::add", 10.0), ("aten::view", 2.0), ("aten::mul", 8.0)] * 10
HEAD = [("aten::mm", 16000.0), ("aten::_log_softmax", 5000.0)]


def paces(chunks) -> np.ndarray:
    """Pace of each chunk, each on a rank of its own (one forward row per rank)."""
    rows, recorded = {}, {}
    for rank, (gmc, (start, end, ops, marks)) in enumerate(chunks):
        rows[rank] = {"optype": np.array([FWD]), "gmc": np.array([gmc]), "start": np.array([start]),
                      "end": np.array([end])}
        recorded[rank] = recorded_ops(np.array(marks), np.zeros(0), CpuOps.from_tuples(ops))
    out = op_paces(rows, recorded, FWD, (BWD,))
    return np.array([out[rank][0] for rank in rows])


def test_a_vocabulary_sized_head_is_work_not_pace():
    """The last chunk's LM-head matmul (160x a block's) and its loss: the count-based pace (seconds per
    operation) reads that chunk 3.3x slower, the pace by identity 1.0 (the loss is its alone)."""
    first, last = _chunk(BLOCK), _chunk(BLOCK + HEAD)
    per_op = [(c[1] - c[0]) / len(c[2]) for c in (first, last)]
    assert per_op[1] / per_op[0] > 3
    np.testing.assert_allclose(paces([(0, first), (1, last)]), [1.0, 1.0])


def test_a_machine_slower_at_everything_reads_its_factor():
    p = paces([(0, _chunk(BLOCK)), (1, _chunk(BLOCK + HEAD, scale=1.5)), (2, _chunk(BLOCK))])
    assert p[1] / p[0] == pytest.approx(1.5) and p[2] == pytest.approx(p[0])


def test_a_slowed_operation_type_counts_by_the_time_it_takes():
    """Every matmul 2x on chunk 1: its time share of the shared operations and gaps moves the pace."""
    slow = [(n, d * 2 if n == "aten::mm" else d) for n, d in BLOCK]
    p = paces([(0, _chunk(BLOCK)), (1, _chunk(slow)), (2, _chunk(BLOCK))])
    usual = sum(d + 10.0 for _, d in BLOCK)
    assert p[1] / p[0] == pytest.approx((usual + sum(d for n, d in BLOCK if n == "aten::mm")) / usual)


def test_unrecorded_work_between_operations_is_pace():
    """A hook re-running a block after 4 of chunk 1's adds (500 µs each, no operation recorded):
    the gaps after `aten::add` stretch, and with them the pace, by the time they add."""
    adds = [k for k, (n, _) in enumerate(BLOCK) if n == "aten::add"][:4]
    p = paces([(0, _chunk(BLOCK)), (1, _chunk(BLOCK, extra_gap={k: 500.0 for k in adds})), (2, _chunk(BLOCK))])
    usual = sum(d + 10.0 for _, d in BLOCK)
    assert p[1] / p[0] == pytest.approx((usual + 4 * 500.0) / usual)


def test_rows_without_recorded_operations_and_ranks_without_flows_have_no_pace():
    start, end, ops, marks = _chunk(BLOCK)
    rows = {0: {"optype": np.array([FWD, 7]), "gmc": np.array([0, -1]), "start": np.array([start, end]),
                "end": np.array([end, end + 5])},
            1: {"optype": np.array([FWD]), "gmc": np.array([1]), "start": np.array([0.0]), "end": np.array([9.0])}}
    out = op_paces(rows, {0: recorded_ops(np.array(marks), np.zeros(0), CpuOps.from_tuples(ops)), 1: None}, FWD, (BWD,))
    assert np.isnan(out[0][1]) and np.isnan(out[1][0])
    assert op_paces(rows, {0: None, 1: None}, FWD, (BWD,)) == {}


def test_recorded_operations_are_equal_when_their_starts_durations_and_names_are():
    _, _, ops, marks = _chunk(BLOCK)
    same = recorded_ops(np.array(marks), np.zeros(0), CpuOps.from_tuples(list(reversed(ops))))   # other name ids
    assert recorded_ops(np.array(marks), np.zeros(0), CpuOps.from_tuples(ops)) == same
    longer = [(s, e + 1.0, n, t) if k == 3 else (s, e, n, t) for k, (s, e, n, t) in enumerate(ops)]
    renamed = [(s, e, "aten::bmm" if n == "aten::mm" else n, t) for s, e, n, t in ops]
    for other in (longer, renamed):
        assert recorded_ops(np.array(marks), np.zeros(0), CpuOps.from_tuples(other)) != same
