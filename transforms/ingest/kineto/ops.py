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
    n_ops = trace.n_ops[in_steps]
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
    # the label that issued it (interleaved `PP:sSEND_Fm`, GPipe's `Forward k`) says the direction
    direction = trace.direction[in_steps]
    labelled = is_p2p & ~by_peer & (direction != 0)
    optype[labelled & (kind == SEND) & (direction > 0)] = _CODE["forward-send"]
    optype[labelled & (kind == SEND) & (direction < 0)] = _CODE["backward-send"]
    optype[labelled & (kind == RECV) & (direction > 0)] = _CODE["forward-recv"]
    optype[labelled & (kind == RECV) & (direction < 0)] = _CODE["backward-recv"]
    if vpp == 1 and pp > 1 and stage in (0, pp - 1):
        # the ends of a pipeline have one neighbour: the first stage sends activations forward and
        # receives gradients back, the last the reverse
        ends = is_p2p & (optype < 0)
        first = stage == 0
        optype[ends & (kind == SEND)] = _CODE["forward-send" if first else "backward-send"]
        optype[ends & (kind == RECV)] = _CODE["backward-recv" if first else "forward-recv"]
    by_position = is_p2p & (optype < 0)
    if by_position.any():
        _p2p_by_position(kind, start, step, optype, by_position)
    # collectives; ZeRO-style steps reduce-scatter the grads, and their all-reduce over the DP group
    # is then the separate (non-sharded) grads' one
    dp_coll = (kind == COLL) & np.isin(group, list(dp_groups))
    zero = bool((dp_coll & (coll == "reduce_scatter")).any())
    # FSDP / ZeRO-3 gather each layer's parameters just before its forward (and again for its
    # backward), inside the compute: only gathers before the step's first compute are the
    # model's params-all-gather; the others overlap compute, whose spans hold any exposed wait
    compute_kind = (kind == FWD) | (kind == BWD)
    first_compute = {int(s): float(start[compute_kind & (step == s)].min()) for s in np.unique(step[compute_kind]).tolist()}
    for i in np.flatnonzero(kind == COLL).tolist():
        name = coll[i]
        if group[i] in dp_groups and name == "all_gather" and start[i] >= first_compute.get(int(step[i]), np.inf):
            unmapped["all_gather during compute (per-layer parameter gathers)"] += 1
            continue
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
    out = {
        "step": np.concatenate([step[rows], opt_steps]),
        "optype": np.concatenate([optype[rows], np.full(len(opt_steps), _CODE["optimizer"])]),
        "start": np.concatenate([start[rows], opt_start]),
        "end": np.concatenate([end[rows], opt_end]),
        "mb_id": np.concatenate([np.where(compute[rows], microbatch[rows], -1), np.full(len(opt_steps), -1)]),
        "mc": np.concatenate([np.where(is_p2p_row[rows], -1, mc[rows]), np.zeros(len(opt_steps), dtype=np.int64)]),
        "gmc": np.concatenate([np.where(is_p2p_row[rows], -1, gmc[rows]), np.full(len(opt_steps), stage)]),
        "n_ops": np.concatenate([np.where(compute[rows], n_ops[rows], -1), np.full(len(opt_steps), -1)]),
    }
    return out


def _pipeline_end_noops(rows: dict[str, np.ndarray], pp: int, vpp: int) -> dict[str, np.ndarray]:
    """Interleaved schedules: the first and last global model chunk have no neighbour on one side, so
    torch issues no p2p there, while the dependency model matches every compute of a stage to a
    recv / send by order (a Megatron trace records no-op ones). Each such compute gets a
    zero-length no-op at its edge: a forward-recv before each forward of chunk 0 and a backward-send
    after each of its backwards (first stage); a forward-send after each forward of the last chunk
    and a backward-recv before each of its backwards (last stage). The engine makes them groups of one."""
    last = pp * vpp - 1
    adds = []
    fwd, bwd = _CODE["forward-compute"], _CODE["backward-compute"]
    for chunk, kinds in ((0, ((fwd, "forward-recv", "start"), (bwd, "backward-send", "end"))),
                         (last, ((fwd, "forward-send", "end"), (bwd, "backward-recv", "start")))):
        for compute, noop, edge in kinds:
            hit = np.flatnonzero((rows["optype"] == compute) & (rows["gmc"] == chunk))
            adds += [(int(rows["step"][i]), _CODE[noop], float(rows[edge][i])) for i in hit.tolist()]
    if not adds:
        return rows
    step, optype, at = (np.array(column) for column in zip(*adds))
    extra = {"step": step, "optype": optype, "start": at, "end": at, "mb_id": np.full(len(at), -1),
             "mc": np.full(len(at), -1), "gmc": np.full(len(at), -1), "n_ops": np.full(len(at), -1)}
    return {name: np.concatenate([rows[name], extra[name].astype(rows[name].dtype)]) for name in rows}


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
