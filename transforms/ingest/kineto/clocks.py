"""Per-host clock offsets from the ends of matched comm ops (least squares)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from transforms.components import components
from transforms.ingest.kineto.layout import _Layout
from transforms.ingest.kineto.pairing import _p2p_pairs
from transforms.ingest.kineto.spans import _CODE



def _clock_offsets(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout, clock_of: Mapping[int, str]) -> dict[int, float]:
    """Per-rank clock offsets (µs) that make the ends of matched comm ops coincide, least squares.

    Ranks with the same clock key (one host) share one offset. Instances: each DP collective
    (step, stage, optype, its index) over the stage's DP ranks, and each p2p pair. Offsets are
    relative to the clock of the lowest rank of each connected set, so a shift of one host's
    clock moves its offset by exactly that shift: the result does not depend on it.
    """
    ranks = sorted(rows)
    clocks = sorted(set(clock_of[rank] for rank in ranks), key=lambda c: min(r for r in ranks if clock_of[r] == c))
    if len(clocks) < 2:
        return {rank: 0.0 for rank in ranks}
    index = {rank: clocks.index(clock_of[rank]) for rank in ranks}
    # one row per op end: its instance's key (p2p 0 / dp 1, step or pair number, stage, op type, index
    # within the step) as integer columns, the clock it was read on, the end
    keys, members, ends = [], [], []
    dp_codes = np.array([_CODE["grads-reduce-scatter"], _CODE["params-all-gather"], _CODE["separate-grads-all-reduce"]])
    for rank in ranks:
        r = rows[rank]
        _, stage = layout.worker[rank]
        seq = _index_within(r["step"], r["optype"], r["start"])
        hit = np.concatenate([np.flatnonzero(r["optype"] == code) for code in dp_codes])   # (the order sums go in)
        keys.append(np.stack([np.ones(len(hit), dtype=np.int64), r["step"][hit].astype(np.int64),
                              np.full(len(hit), stage, dtype=np.int64), r["optype"][hit].astype(np.int64),
                              seq[hit].astype(np.int64)], axis=1))
        members.append(np.full(len(hit), index[rank], dtype=np.int64))
        ends.append(r["end"][hit].astype(np.float64))
    pairs = _p2p_pairs(rows, layout)
    if pairs:
        numbers = np.repeat(np.arange(len(pairs), dtype=np.int64), 2)
        keys.append(np.stack([np.zeros_like(numbers), numbers] + [np.zeros_like(numbers)] * 3, axis=1))
        members.append(np.array([index[rank] for send, _, recv, _ in pairs for rank in (send, recv)], dtype=np.int64))
        ends.append(np.array([float(rows[rank]["end"][at]) for send, i, recv, j in pairs
                              for rank, at in ((send, i), (recv, j))], dtype=np.float64))
    key = np.concatenate(keys) if keys else np.zeros((0, 5), dtype=np.int64)
    if not len(key):
        return {rank: 0.0 for rank in ranks}
    # instance number of each row: its key's rank among the distinct keys (rows sorted, runs numbered)
    order = np.lexsort(key.T[::-1])
    ordered = key[order]
    instance = np.empty(len(key), dtype=np.int64)
    instance[order] = np.concatenate([[0], np.cumsum(np.any(ordered[1:] != ordered[:-1], axis=1))])
    member = np.concatenate(members)
    end = np.concatenate(ends)
    # an instance within one clock says nothing about offsets
    spread = np.zeros(instance.max() + 1, dtype=bool)
    first_member = np.full(instance.max() + 1, -1)
    first_member[instance[::-1]] = member[::-1]
    spread[instance[member != first_member[instance]]] = True
    shared = spread[instance]
    instance, member, end = instance[shared], member[shared], end[shared]
    if not len(instance):
        return {rank: 0.0 for rank in ranks}
    _, instance = np.unique(instance, return_inverse=True)
    size = np.bincount(instance).astype(np.float64)
    n = len(clocks)
    end = end - end.min()
    mean_end = np.bincount(instance, end) / size
    rhs = np.bincount(member, end - mean_end[instance], minlength=n)

    def laplacian(x):
        mean_x = np.bincount(instance, x[member]) / size
        return np.bincount(member, x[member] - mean_x[instance], minlength=n)

    # conjugate gradients on the (singular, consistent) normal equations; min-norm solution from 0
    x = np.zeros(n)
    residual = rhs - laplacian(x)
    direction = residual.copy()
    norm = residual @ residual
    scale = max(1.0, float(np.abs(rhs).max()))
    for _ in range(4 * n + 50):
        if norm <= (1e-13 * scale) ** 2:
            break
        applied = laplacian(direction)
        step = norm / (direction @ applied)
        x += step * direction
        residual -= step * applied
        new_norm = residual @ residual
        direction = residual + (new_norm / norm) * direction
        norm = new_norm
    # anchor each connected set of clocks at its first clock: an instance links its first clock to the others
    first_member = np.full(instance.max() + 1, -1)
    first_member[instance[::-1]] = member[::-1]
    linked = np.unique(first_member[instance] * n + member)
    component = components(n, list(zip((linked // n).tolist(), (linked % n).tolist())))
    anchor = {}
    for i in range(n):
        anchor.setdefault(component[i], i)
    return {rank: float(x[index[rank]] - x[anchor[component[index[rank]]]]) for rank in ranks}


def _index_within(step: np.ndarray, optype: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Index of each op among the same (step, optype) by start time."""
    from transforms.ingest.common import seq_ids

    return seq_ids(step, np.zeros_like(step), optype, start)
