"""One analysed rank's spans -> op rows (op types, microbatch ids, model chunks, one optimizer op per step)."""
from __future__ import annotations

import collections

import numpy as np

from transforms.ingest.common import RawInputError
from transforms.ingest.kineto.layout import _Layout
from transforms.ingest.kineto.spans import (BWD, COLL, FWD, OPT, RECV, RankTrace, SEND, _CODE, _COLLECTIVES,
                                            _DP_OPTYPE, _KIND_NAMES)


def _ops_of_rank(trace: RankTrace, stage: int, layout: _Layout, steps: np.ndarray, dp_groups: set[str],
                 job_id: str, unmapped: collections.Counter) -> dict[str, np.ndarray]:
    """The op rows of one analysed rank over the kept steps (times in µs on its own clock)."""
    in_steps = np.isin(trace.step, steps)
    kind, start, end, step = trace.kind[in_steps], trace.start[in_steps], trace.end[in_steps], trace.step[in_steps]
    mb, chunk, peer, coll, group = (a[in_steps] for a in (trace.mb, trace.chunk, trace.peer, trace.coll, trace.group))
    optype = np.full(len(kind), -1, dtype=np.int64)
    optype[kind == FWD] = _CODE["forward-compute"]
    optype[kind == BWD] = _CODE["backward-compute"]
    pp = layout.pp
    # model chunk: a `PP:` label names the global stage index (chunk * pp + stage)
    mc = np.where(chunk >= 0, chunk // pp, 0)
    gmc = np.where(chunk >= 0, chunk, mc * pp + stage)
    vpp = int(mc.max()) + 1 if len(mc) else 1
    worker_of = layout.worker
    is_p2p = (kind == SEND) | (kind == RECV)
    peer_stage = np.array([worker_of[p][1] if p in worker_of else -1 for p in peer.tolist()], dtype=np.int64)
    by_peer = is_p2p & (peer_stage >= 0) & (vpp == 1)
    forward_dir = peer_stage > stage
    optype[by_peer & (kind == SEND) & forward_dir] = _CODE["forward-send"]
    optype[by_peer & (kind == SEND) & ~forward_dir] = _CODE["backward-send"]
    optype[by_peer & (kind == RECV) & ~forward_dir] = _CODE["forward-recv"]
    optype[by_peer & (kind == RECV) & forward_dir] = _CODE["backward-recv"]
    by_position = is_p2p & ~by_peer
    if by_position.any():
        _p2p_by_position(kind, start, step, optype, by_position)
    # collectives; ZeRO-style steps reduce-scatter the grads, and their all-reduce over the DP group
    # is then the separate (non-sharded) grads' one
    dp_coll = (kind == COLL) & np.isin(group, list(dp_groups))
    zero = bool((dp_coll & (coll == "reduce_scatter")).any())
    for i in np.flatnonzero(kind == COLL).tolist():
        name = coll[i]
        if group[i] in dp_groups:
            mapped = "separate-grads-all-reduce" if zero and name == "all_reduce" else _DP_OPTYPE.get(name)
            if mapped is None and name not in _COLLECTIVES.values():
                raise RawInputError("raw_unknown_collective", f"collective {name!r} over the data-parallel group "
                                    f"(step {int(step[i])}); known: {', '.join(sorted(set(_COLLECTIVES.values())))}",
                                    job_id=job_id, path=trace.path, op=name)
            if mapped is not None:
                optype[i] = _CODE[mapped]
                continue
        unmapped[f"{name} over group {group[i] or '?'}"] += 1
    # p2p whose direction is unknown and anything left
    left = (optype < 0) & (kind != OPT)
    for i in np.flatnonzero(left & is_p2p).tolist():
        unmapped[f"{_KIND_NAMES[kind[i]]} with no known peer or compute"] += 1
    rows = (optype >= 0)
    # one optimizer op per step: the union of its optimizer spans
    opt = kind == OPT
    opt_steps, opt_index = np.unique(step[opt], return_inverse=True)
    opt_start = np.full(len(opt_steps), np.inf)
    opt_end = np.full(len(opt_steps), -np.inf)
    np.minimum.at(opt_start, opt_index, start[opt])
    np.maximum.at(opt_end, opt_index, end[opt])
    # microbatch ids: from the label, else order of the kind within the step
    microbatch = mb.copy()
    compute = (kind == FWD) | (kind == BWD)
    unlabeled = compute & (microbatch < 0)
    if unlabeled.any():
        order = np.lexsort((start, kind, step))
        seen: dict[tuple[int, int, int], int] = collections.Counter()
        for i in order.tolist():
            if unlabeled[i]:
                key = (int(step[i]), int(kind[i]), int(mc[i]))
                microbatch[i] = seen[key]
                seen[key] += 1
    is_p2p_row = rows & is_p2p
    return {
        "step": np.concatenate([step[rows], opt_steps]),
        "optype": np.concatenate([optype[rows], np.full(len(opt_steps), _CODE["optimizer"])]),
        "start": np.concatenate([start[rows], opt_start]),
        "end": np.concatenate([end[rows], opt_end]),
        "mb_id": np.concatenate([np.where(compute[rows], microbatch[rows], -1), np.full(len(opt_steps), -1)]),
        "mc": np.concatenate([np.where(is_p2p_row[rows], -1, mc[rows]), np.zeros(len(opt_steps), dtype=np.int64)]),
        "gmc": np.concatenate([np.where(is_p2p_row[rows], -1, gmc[rows]), np.full(len(opt_steps), stage)]),
    }


def _p2p_by_position(kind, start, step, optype, which) -> None:
    """Direction from the compute served: a send carries the compute before it, a recv feeds the one after."""
    compute = np.flatnonzero((kind == FWD) | (kind == BWD))
    for step_value in np.unique(step[which]).tolist():
        mine = compute[step[compute] == step_value]
        mine = mine[np.argsort(start[mine], kind="stable")]
        starts = start[mine]
        for i in np.flatnonzero(which & (step == step_value)).tolist():
            if kind[i] == SEND:
                before = np.searchsorted(starts, start[i], side="right") - 1
                if before >= 0:
                    optype[i] = _CODE["forward-send" if kind[mine[before]] == FWD else "backward-send"]
            else:
                after = np.searchsorted(starts, start[i], side="left")
                if after < len(mine):
                    optype[i] = _CODE["forward-recv" if kind[mine[after]] == FWD else "backward-recv"]
