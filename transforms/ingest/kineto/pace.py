"""How fast each compute op's machine ran its work, told apart from how much work it held (CPU ranks).

A pipeline chunk's compute time is its work times its machine's pace. The operation count alone
(`n_ops`) cannot split the two: one vocabulary-sized LM-head matmul among four hundred 10 us
operations makes the last chunk's seconds per operation look like a slow machine. Operations are
compared by identity instead: the same operation (its name) on another chunk or rank is the same
work, so its duration there is the other machine's pace for it.

One pace per compute op, against the job (1.0: the job's usual pace): its time at its own typical
pace over its time at the job's, both counted alike. Its recorded operations are grouped by name,
and a name it shares with another model chunk counts twice on each side: (its operations of that
name) x (their median duration here | the job's median of those medians), and (its operations of
that name) x (their mean time until the next recorded operation here | the job's median of those
means). A slower machine stretches every operation and every gap; a slowed operation type (a
degraded kernel) stretches its name, weighted by the time it takes; work the trainer ran
unrecorded after an operation (a hook, Python, another process taking the core) stretches that
name's gaps; a heavy operation or a heavier partition (one vocabulary-sized LM-head matmul among
four hundred block operations, more layers) moves no median and adds no gap, and the names only
one chunk runs (the loss) count on neither side. NaN where the op recorded no operation (GPU
ranks: the kernels' time is the compute).
"""
from __future__ import annotations

import functools

import numpy as np

from transforms.whatif.kernel import group_order

__all__ = ["RecordedOps", "recorded_ops", "op_paces"]


class RecordedOps:
    """A rank's operations autograd recorded, by kind (forward: the ops `fwdbwd` flows start at;
    backward: the nodes they end at): `forward` and `backward` are (start (µs on the rank's span
    axis, sorted), duration (NaN where no CPU op starts at the flow's mark), name id into `names`).
    Resolved when first asked (a job without pipeline chunks never asks)."""

    def __init__(self, forward_marks: np.ndarray, backward_marks: np.ndarray, cpu_ops):
        self._inputs = (forward_marks, backward_marks, cpu_ops)
        self.names: list[str] = list(cpu_ops.name_table) + [""]

    @functools.cached_property
    def _resolved(self) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
        forward, backward, ops = self._inputs
        self._inputs = None
        return tuple(_at_marks(marks, ops, len(self.names) - 1) for marks in (forward, backward))

    @property
    def forward(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._resolved[0]

    @property
    def backward(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._resolved[1]

    def __eq__(self, other) -> bool:
        """The same operations: starts, durations and names (name ids may differ between parses)."""
        if not isinstance(other, RecordedOps):
            return NotImplemented
        for mine, theirs in ((self.forward, other.forward), (self.backward, other.backward)):
            if not (np.array_equal(mine[0], theirs[0]) and np.array_equal(mine[1], theirs[1], equal_nan=True)):
                return False
            names, other_names = np.array(self.names, dtype=object), np.array(other.names, dtype=object)
            if names[mine[2]].tolist() != other_names[theirs[2]].tolist():
                return False
        return True

    __hash__ = None


def _at_marks(marks: np.ndarray, ops, none: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(marks, duration, name id) of the op starting at each (sorted) mark, the longest where several
    do (a flow's timestamp is its op's start); NaN and `none` where none does. The ops are looked up
    in the marks (fewer), not sorted themselves."""
    length = np.full(len(marks), np.nan)
    name = np.full(len(marks), none, dtype=np.int64)
    if not len(marks) or not len(ops.start):
        return marks, length, name
    at = np.minimum(np.searchsorted(marks, ops.start, side="left"), len(marks) - 1)
    hit = np.flatnonzero(np.abs(marks[at] - ops.start) <= 1e-3)
    if len(hit):
        lengths = ops.end[hit] - ops.start[hit]
        order = np.lexsort((lengths, at[hit]))          # per mark, its longest op last: the one kept
        length[at[hit][order]] = lengths[order]
        name[at[hit][order]] = ops.name_ids[hit][order]
    return marks, length, name


def recorded_ops(forward_marks: np.ndarray, backward_marks: np.ndarray, cpu_ops) -> RecordedOps | None:
    """The rank's RecordedOps from its sorted flow marks and CPU ops; None without flows."""
    if not len(forward_marks) and not len(backward_marks):
        return None
    return RecordedOps(forward_marks, backward_marks, cpu_ops)


def _group_medians(group: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Median of the finite `values` of each group (NaN for a group without any), all groups at once."""
    keep = np.isfinite(values)
    group, values = group[keep], values[keep]
    order = group_order(group, values)
    group, values = group[order], values[order]
    count = np.bincount(group, minlength=n_groups)
    first = np.concatenate([[0], np.cumsum(count)[:-1]])
    out = np.full(n_groups, np.nan)
    has = count > 0
    low, high = first + (count - 1) // 2, first + count // 2
    out[has] = 0.5 * (values[low[has]] + values[high[has]])
    return out


def _operations(rows: dict, recorded: dict, forward_code: int, backward_codes: tuple[int, ...]):
    """Every recorded operation inside a compute row, and every row's time before its first one (a
    gap named ""), as flat arrays: row (index into the returned row list), name, duration (NaN for a
    leading gap or an operation without its CPU op), gap (time until the next recorded operation's
    start or the row's end); and the rows as (rank, row index, forward, gmc)."""
    row_list, parts = [], []
    known: dict[str, int] = {"": 0}                     # name -> job-wide id ("": a row's leading gap)
    for rank, r in rows.items():
        rec = recorded.get(rank)
        if rec is None:
            continue
        to_job = np.array([known.setdefault(n, len(known)) for n in rec.names], dtype=np.int64)
        compute = np.flatnonzero(np.isin(r["optype"], (forward_code, *backward_codes)))
        for forward in (True, False):
            chosen = compute[(r["optype"][compute] == forward_code) == forward]
            marks, lengths, ids = rec.forward if forward else rec.backward
            if not len(chosen) or not len(marks):
                continue
            names = to_job[ids]
            starts, ends = r["start"][chosen].astype(np.float64), r["end"][chosen].astype(np.float64)
            first, last = np.searchsorted(marks, starts, side="left"), np.searchsorted(marks, ends, side="right")
            counts = np.maximum(last - first, 0)
            base = len(row_list)
            row_list += [(rank, int(i), forward, int(r["gmc"][i])) for i in chosen.tolist()]
            if not counts.sum():
                continue
            row = np.repeat(np.arange(len(chosen)), counts)
            op = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(first, counts)
            is_last = np.zeros(len(op), dtype=bool)
            is_last[np.cumsum(counts)[counts > 0] - 1] = True
            following = np.where(is_last, ends[row], marks[np.minimum(op + 1, len(marks) - 1)])
            length = lengths[op]
            gap = np.maximum(following - (marks[op] + np.nan_to_num(length)), 0.0)
            gap[~np.isfinite(length)] = np.nan
            opened = np.flatnonzero(counts > 0)
            lead = np.maximum(marks[first[opened]] - starts[opened], 0.0)
            parts.append((np.concatenate([row, opened]) + base,
                          np.concatenate([names[op], np.zeros(len(opened), dtype=np.int64)]),
                          np.concatenate([length, np.full(len(opened), np.nan)]),
                          np.concatenate([gap, lead])))
    if not parts:
        return row_list, None, 0
    return row_list, tuple(np.concatenate(column) for column in zip(*parts)), len(known)


def op_paces(rows: dict[int, dict[str, np.ndarray]], recorded: dict[int, RecordedOps | None],
             forward_code: int, backward_codes: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Per rank, the pace of each of its rows (`rows[rank]`: optype, start, end in µs on the rank's
    span axis, gmc; module docstring), NaN for rows that are not compute or recorded nothing; {}
    when no rank recorded operations. Grouped by sorting and bincount, no loop over operations."""
    if not any(r is not None for r in recorded.values()):
        return {}
    row_list, ops, n_names = _operations(rows, recorded, forward_code, backward_codes)
    out = {rank: np.full(len(r["optype"]), np.nan) for rank, r in rows.items()}
    if ops is None:
        return out
    row, name_id, length, gap = ops
    forward = np.array([f for _, _, f, _ in row_list], dtype=bool)
    gmc = np.array([g for _, _, _, g in row_list], dtype=np.int64)
    # (row, name) groups: count, median duration, mean gap
    cell, cell_of = np.unique(row * n_names + name_id, return_inverse=True)
    n_cells = len(cell)
    cell_row, cell_name = cell // n_names, cell % n_names
    has_gap, has_length = np.isfinite(gap), np.isfinite(length)
    gaps = np.bincount(cell_of[has_gap], minlength=n_cells).astype(np.float64)          # each count only
    lengths = np.bincount(cell_of[has_length], minlength=n_cells).astype(np.float64)    # what it measures
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_gap = np.bincount(cell_of[has_gap], weights=gap[has_gap], minlength=n_cells) / gaps
    duration = _group_medians(cell_of, length, n_cells)
    # names that two or more model chunks ran, per kind, and the job's medians of their cells
    kind_name = cell_name * 2 + forward[cell_row]
    pairs = np.unique(np.stack([kind_name, gmc[cell_row]]), axis=1)
    chunks = np.bincount(pairs[0], minlength=2 * n_names)
    shared = chunks[kind_name] >= 2
    _, key_of = np.unique(kind_name, return_inverse=True)
    n_keys = int(key_of.max()) + 1
    usual_duration = _group_medians(key_of[shared], duration[shared], n_keys)[key_of]
    usual_gap = _group_medians(key_of[shared], mean_gap[shared], n_keys)[key_of]
    own = np.zeros(n_cells)
    usual = np.zeros(n_cells)
    for count, mine, theirs in ((gaps, mean_gap, usual_gap), (lengths, duration, usual_duration)):
        counted = shared & np.isfinite(mine) & np.isfinite(theirs)
        own[counted] += count[counted] * mine[counted]
        usual[counted] += count[counted] * theirs[counted]
    own_row = np.bincount(cell_row, weights=own, minlength=len(row_list))
    usual_row = np.bincount(cell_row, weights=usual, minlength=len(row_list))
    for k, (rank, i, _, _) in enumerate(row_list):
        if usual_row[k] > 0:
            out[rank][i] = own_row[k] / usual_row[k]
    return out
