"""Time on a line covered by a union of spans: the one interval arithmetic of strag (the Kineto
converter's data-loading and recorded-GC time per op and its threads' busy runs,
transforms/ingest/kineto; the engine's untraced gaps, transforms/whatif/causes/pauses.py)."""
from __future__ import annotations

import numpy as np

__all__ = ["union_runs", "covered"]


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
