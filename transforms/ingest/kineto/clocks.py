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
    keys, members, ends = [], [], []
    for rank in ranks:
        r = rows[rank]
        _, stage = layout.worker[rank]
        seq = _index_within(r["step"], r["optype"], r["start"])
        for code in (_CODE["grads-reduce-scatter"], _CODE["params-all-gather"], _CODE["separate-grads-all-reduce"]):
            hit = np.flatnonzero(r["optype"] == code)
            keys += [("dp", int(s), stage, code, int(k)) for s, k in zip(r["step"][hit], seq[hit])]
            members += [index[rank]] * len(hit)
            ends += r["end"][hit].tolist()
    for number, (send_rank, i, recv_rank, j) in enumerate(_p2p_pairs(rows, layout)):
        keys += [("p2p", number)] * 2
        members += [index[send_rank], index[recv_rank]]
        ends += [float(rows[send_rank]["end"][i]), float(rows[recv_rank]["end"][j])]
    if not keys:
        return {rank: 0.0 for rank in ranks}
    _, instance = np.unique(np.array([repr(k) for k in keys]), return_inverse=True)
    member = np.array(members, dtype=np.int64)
    end = np.array(ends, dtype=np.float64)
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
    # anchor each connected set of clocks at its first clock
    first_member = {}
    for inst, m in zip(instance.tolist(), member.tolist()):
        first_member.setdefault(inst, m)
    component = components(n, [(first_member[inst], m) for inst, m in zip(instance.tolist(), member.tolist())])
    anchor = {}
    for i in range(n):
        anchor.setdefault(component[i], i)
    return {rank: float(x[index[rank]] - x[anchor[component[index[rank]]]]) for rank in ranks}


def _index_within(step: np.ndarray, optype: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Index of each op among the same (step, optype) by start time."""
    from transforms.ingest.common import seq_ids

    return seq_ids(step, np.zeros_like(step), optype, start)
