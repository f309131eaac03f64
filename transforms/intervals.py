"""Time on a line covered by a union of spans: the one interval arithmetic of strag (the Kineto
converter's data-loading and recorded-GC time per op and its threads' busy runs,
transforms/ingest/kineto; the engine's untraced gaps, transforms/whatif/causes/pauses.py)."""
from __future__ import annotations

import numpy as np

__all__ = ["union_runs", "covered", "covered_grouped"]


def union_runs(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """[k, 2] the disjoint runs covering the union of the spans [start, end] (any order, overlapping,
    nested): sorted by start, a span opens a new run where it begins after every earlier end."""
    if not len(start):
        return np.zeros((0, 2))
    order = np.argsort(start, kind="stable")
    lo, hi = start[order], np.maximum.accumulate(end[order])
    runs = np.flatnonzero(np.r_[True, lo[1:] > hi[:-1]])
    return np.stack([lo[runs], np.append(hi[runs[1:] - 1], hi[-1])], axis=1)


def covered(gap_start: np.ndarray, gap_end: np.ndarray, busy_start: np.ndarray, busy_end: np.ndarray) -> np.ndarray:
    """Per gap [gap_start, gap_end], the time inside it covered by the union of the busy spans (which
    may overlap): the spans merged into disjoint runs, then F(end) - F(start) per gap, F(t) the busy
    time before t (a binary search per gap end, not every gap against every run). A gap may start at
    -inf (nothing before it)."""
    if not len(busy_start) or not len(gap_start):
        return np.zeros(len(gap_start))
    runs = union_runs(busy_start, busy_end)
    lo, hi = runs[:, 0], runs[:, 1]
    before = np.concatenate([[0.0], np.cumsum(hi - lo)])   # busy time of the runs before run k

    def busy_before(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(lo, t, side="right")            # runs starting at or before t
        last = np.maximum(k - 1, 0)
        return np.where(k > 0, before[last] + np.clip(t - lo[last], 0.0, hi[last] - lo[last]), 0.0)

    return np.maximum(busy_before(gap_end) - busy_before(np.minimum(gap_start, gap_end)), 0.0)


def covered_grouped(gap_group: np.ndarray, gap_start: np.ndarray, gap_end: np.ndarray,
                    busy_group: np.ndarray, busy_start: np.ndarray, busy_end: np.ndarray) -> np.ndarray:
    """`covered` on many timelines at once: every gap and busy span carries its timeline's id (an
    integer >= 0), and a gap counts only the busy spans of its own timeline. The same operations
    as `covered` per timeline, in the same order (its runs, their running sums, its searches), so
    the same floats; numpy work per call, not per timeline."""
    out = np.zeros(len(gap_start))
    if not len(busy_start) or not len(gap_start):
        return out
    order = np.lexsort((busy_start, busy_group))           # by timeline, then start (stable, as covered's)
    group, lo, end = busy_group[order].astype(np.int64), busy_start[order], busy_end[order]
    n = len(end)
    # running max of the ends within each timeline: integer keys (timeline, rank of the end)
    # accumulate exactly and restart at every timeline, since a later timeline's keys are larger
    by_end = np.argsort(end, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[by_end] = np.arange(n)
    hi = end[by_end[np.maximum.accumulate(group * n + rank) % n]]
    runs = np.flatnonzero(np.r_[True, (lo[1:] > hi[:-1]) | (group[1:] != group[:-1])])
    run_group, run_lo = group[runs], lo[runs]
    run_hi = np.append(hi[runs[1:] - 1], hi[-1])
    length = run_hi - run_lo
    # busy time of the earlier runs of its timeline: each timeline's runs in a row of their own
    # (zeros after them), summed along the row in covered's order
    starts = np.flatnonzero(np.r_[True, run_group[1:] != run_group[:-1]])
    counts = np.diff(np.r_[starts, len(runs)])
    row, column = np.repeat(np.arange(len(starts)), counts), np.arange(len(runs)) - np.repeat(starts, counts)
    rows = np.zeros((len(starts), int(counts.max())))
    rows[row, column] = length
    before = np.r_[0.0, np.cumsum(rows, axis=1)[row[:-1], column[:-1]]]
    before[starts] = 0.0

    # runs of its timeline starting at or before a time: a search on integer keys (timeline, dense
    # rank of the time), in which equal times rank equal and the runs are in key order
    gap_group = np.asarray(gap_group, dtype=np.int64)
    gap_start = np.minimum(gap_start, gap_end)
    values, rank = np.unique(np.r_[run_lo, gap_end, gap_start], return_inverse=True)
    size = len(values) + 1
    run_key = run_group * size + rank[:len(runs)]

    def busy_before(t: np.ndarray, t_rank: np.ndarray) -> np.ndarray:
        count = np.searchsorted(run_key, gap_group * size + t_rank, side="right")
        last = np.maximum(count - 1, 0)
        mine = (count > 0) & (run_group[last] == gap_group)
        value = before[last] + np.clip(t - run_lo[last], 0.0, run_hi[last] - run_lo[last])
        return np.where(mine, value, 0.0)

    queries = len(gap_end)
    return np.maximum(busy_before(gap_end, rank[len(runs):len(runs) + queries])
                      - busy_before(gap_start, rank[len(runs) + queries:]), 0.0)
