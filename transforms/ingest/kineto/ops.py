"""One analysed rank's spans -> op rows (op types, microbatch ids, model chunks, one optimizer op per step)."""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from transforms.ingest.common import RawInputError
from transforms.ingest.kineto.layout import _Layout
from transforms.ingest.kineto.spans import (BWD, COLL, FWD, IN_COMPUTE_COLLECTIVES, OPT, RECV, RankTrace, SEND, WGT,
                                            _CODE, _COLLECTIVES, _DP_OPTYPE, _KIND_NAMES, first_start_per_step)


def _ops_of_rank(trace: RankTrace, stage: int, layout: _Layout, steps: np.ndarray, dp_groups: set[str],
                 job_id: str, unmapped: collections.Counter, placement: np.ndarray) -> dict[str, np.ndarray]:
    """The op rows of one analysed rank over the kept steps (times in µs on its own clock), with
    `peer_stage` (the pipeline rank a p2p op pairs with, -1 for other ops) for the job level;
    `placement` is the stage of each global model chunk."""
    if trace.piece is not None and layout.pp > 1:
        trace = _whole_labels(trace)   # a pipeline's p2p serve whole microbatches: no cut compute
    in_steps = np.isin(trace.step, steps)
    piece = trace.piece[in_steps] if trace.piece is not None else np.zeros(int(in_steps.sum()), dtype=np.int8)
    kind, start, end, step = trace.kind[in_steps], trace.start[in_steps], trace.end[in_steps], trace.step[in_steps]
    mb, chunk, peer, coll, group = (a[in_steps] for a in (trace.mb, trace.chunk, trace.peer, trace.coll, trace.group))
    n_ops = trace.n_ops[in_steps]
    waited = trace.waited[in_steps] if trace.waited is not None else np.zeros(len(kind), dtype=bool)
    lengths = trace.seq_lens[in_steps] if trace.seq_lens is not None else np.full(len(kind), None, dtype=object)
    optype = np.full(len(kind), -1, dtype=np.int64)
    optype[kind == FWD] = _CODE["forward-compute"]
    optype[kind == BWD] = _CODE["backward-compute"]
    optype[kind == WGT] = _CODE["backward-weight-compute"]
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
    # model's params-all-gather; the others synchronise the DP ranks between layers (the compute
    # they are issued in is cut at them), without a pipeline (whose p2p serve whole microbatches:
    # there the compute holds them, waits included)
    compute_kind = (kind == FWD) | (kind == BWD)
    first_compute = first_start_per_step(step, start, compute_kind)
    # before or after the first compute by when the thread issued it: on CPU ranks a gloo collective's
    # span starts when its worker thread gets to it, which may be after a compute the issuing thread
    # began later (a pipeline schedule's UNSHARD of its second chunk); GPU spans keep their start,
    # the clock their compute is on
    when = trace.issued[in_steps] if trace.issued is not None and trace.device == "cpu" else start
    spanning = _spanning_groups(trace, layout, dp_groups)
    for i in np.flatnonzero(kind == COLL).tolist():
        name = coll[i]
        if pp == 1 and group[i] in spanning and name in IN_COMPUTE_COLLECTIVES:
            # all-to-all (expert / embedding parallel), broadcast, barrier ...: a synchronising
            # collective of its group between compute ops (a pipeline's compute is not cut: its
            # p2p ops serve whole microbatches)
            optype[i] = _CODE["all-to-all" if name == "all_to_all" else "group-collective"]
            continue
        if pp == 1 and waited[i] and group[i] in dp_groups:
            # a gradient sync the compute waited out between layers (FSDP's per-layer reduce-scatter)
            optype[i] = _CODE["group-collective"]
            continue
        if group[i] in dp_groups and name == "all_gather" and when[i] >= first_compute.get(int(step[i]), np.inf):
            if pp == 1:   # synchronises the DP ranks between the layers' compute
                optype[i] = _CODE["group-collective"]
            else:
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
    compute = (kind == FWD) | (kind == BWD) | (kind == WGT)
    unlabeled = compute & (microbatch < 0)
    if unlabeled.any():
        order = np.lexsort((start, kind, step))
        seen: dict[tuple[int, int, int], int] = collections.Counter()
        for i in order.tolist():
            if unlabeled[i]:
                key = (int(step[i]), int(kind[i]), int(mc[i]))
                if piece[i] > 0:   # a later piece of the compute before it (cut at a collective)
                    microbatch[i] = max(seen[key] - 1, 0)
                    continue
                microbatch[i] = seen[key]
                seen[key] += 1
    is_p2p_row = rows & is_p2p
    pair_stage = _peer_stages(optype, chunk, peer_stage, stage, pp, placement, vpp > 1)
    out = {
        "step": np.concatenate([step[rows], opt_steps]),
        "optype": np.concatenate([optype[rows], np.full(len(opt_steps), _CODE["optimizer"])]),
        "start": np.concatenate([start[rows], opt_start]),
        "end": np.concatenate([end[rows], opt_end]),
        "mb_id": np.concatenate([np.where(compute[rows], microbatch[rows], -1), np.full(len(opt_steps), -1)]),
        "mc": np.concatenate([np.where(is_p2p_row[rows], -1, mc[rows]), np.zeros(len(opt_steps), dtype=np.int64)]),
        "gmc": np.concatenate([np.where(is_p2p_row[rows], -1, gmc[rows]), np.full(len(opt_steps), stage)]),
        "n_ops": np.concatenate([np.where(compute[rows], n_ops[rows], -1), np.full(len(opt_steps), -1)]),
        "seq_lens": np.concatenate([lengths[rows], np.full(len(opt_steps), None, dtype=object)]),
        "peer_stage": np.concatenate([np.where(is_p2p_row[rows], pair_stage[rows], -1), np.full(len(opt_steps), -1)]),
    }
    return out


def _whole_labels(trace: RankTrace) -> RankTrace:
    """The trace with each compute label's pieces (cut at the collectives it issued) joined again."""
    later = trace.piece > 0
    end, n_ops = trace.end.copy(), trace.n_ops.copy()
    order = np.argsort(trace.start, kind="stable")
    whole = order[~later[order]]
    for i in np.flatnonzero(later).tolist():   # extends the last whole span of its kind before it
        same = whole[(trace.kind[whole] == trace.kind[i]) & (trace.start[whole] <= trace.start[i])]
        if len(same):
            end[same[-1]] = max(end[same[-1]], end[i])
            n_ops[same[-1]] += max(int(n_ops[i]), 0)
    columns = {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace)}
    columns.update(end=end, n_ops=n_ops, piece=None)
    for name in ("kind", "start", "end", "step", "mb", "chunk", "peer", "coll", "group", "peer_local", "direction", "n_ops",
                 "seq", "seq_lens", "waited", "issued"):
        if columns[name] is not None:
            columns[name] = columns[name][~later]
    return RankTrace(**columns)


def unwaited(trace: RankTrace) -> RankTrace:
    """The trace with its gradient syncs no longer taken as waited out by the compute
    (compute.waited_collectives): each compute piece that began where a waited sync ended joins the
    piece before it (the pieces after renumbered), and `waited` is cleared. For a rank whose DP peers
    waited out none: how a framework syncs is the job's, and every DP rank cuts its compute at the
    same collectives (a straggling peer makes the rank's DDP all-reduces short, at the end of its
    backward, and the vote of one rank can flip)."""
    if trace.waited is None:
        return trace
    ends = trace.end[trace.waited]
    kind, start, end, piece, n_ops = trace.kind, trace.start, trace.end.copy(), trace.piece, trace.n_ops.copy()
    if piece is None:
        return dataclasses.replace(trace, waited=None)
    piece = piece.copy()
    joined = np.zeros(len(kind), dtype=bool)
    order = np.argsort(start, kind="stable")
    last_of_kind: dict[int, int] = {}
    shift: dict[int, int] = {}              # row of a label's piece 0 -> how many of its cuts are undone so far
    head: dict[int, int] = {}               # row -> the row of its label's piece 0
    for i in order.tolist():
        if kind[i] not in (FWD, BWD, WGT):
            continue
        if piece[i] == 0:
            head[i], shift[i] = i, 0
        else:
            before = last_of_kind.get(int(kind[i]))
            if before is None:
                continue
            head[i] = head.get(before, before)
            if np.isclose(ends, start[i], rtol=0.0, atol=1e-3).any():
                end[before] = max(end[before], end[i])
                n_ops[before] += max(int(n_ops[i]), 0)
                joined[i] = True
                shift[head[i]] += 1
                continue            # the joined piece's row stays the last of its kind
            piece[i] -= shift[head[i]]
        last_of_kind[int(kind[i])] = i
    columns = {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace)}
    columns.update(end=end, n_ops=n_ops, piece=piece if (piece[~joined] > 0).any() else None, waited=None)
    for name in ("kind", "start", "end", "step", "mb", "chunk", "peer", "coll", "group", "peer_local", "direction", "n_ops",
                 "piece", "seq", "seq_lens", "issued"):
        if columns[name] is not None:
            columns[name] = columns[name][~joined]
    return RankTrace(**columns)


def _spanning_groups(trace: RankTrace, layout: _Layout, dp_groups: set[str]) -> set[str]:
    """Names of this rank's groups whose members are more than one worker: its DP groups (a group
    the trace does not name among them) and any other group over ranks of several workers (an
    expert-parallel one). A group within one worker (tensor / context parallel: one representative
    rank among its members) is the worker's compute."""
    out = set(dp_groups)
    for group in trace.groups_of_rank():
        if sum(rank in layout.worker for rank in group.ranks) > 1:
            out.add(group.name)
    return out


# p2p op type -> the global model chunk of its peer, relative to the chunk it serves
_PEER_CHUNK = {_CODE["forward-send"]: 1, _CODE["forward-recv"]: -1, _CODE["backward-send"]: -1, _CODE["backward-recv"]: 1}


def _peer_stages(optype: np.ndarray, chunk: np.ndarray, peer_stage: np.ndarray, stage: int, pp: int,
                 placement: np.ndarray, wrap: bool) -> np.ndarray:
    """The stage each p2p op pairs with: the holder of the neighbouring model chunk of the chunk its
    label names (V-shaped schedules send both ways from one rank), else the stage of its known peer
    rank, else the next / previous stage (modulo pp when several chunks per stage wrap around)."""
    out = np.full(len(optype), -1, dtype=np.int64)
    for code, offset in _PEER_CHUNK.items():
        mine = optype == code
        neighbour = chunk + offset
        by_label = mine & (chunk >= 0) & (neighbour >= 0) & (neighbour < len(placement))
        out[by_label] = placement[neighbour[by_label]]
        by_peer = mine & ~by_label & (peer_stage >= 0)
        out[by_peer] = peer_stage[by_peer]
        default = (stage + offset) % pp if wrap else stage + offset
        out[mine & ~by_label & ~by_peer] = default
    return out


def _pipeline_end_noops(rows: dict[str, np.ndarray], stage: int, placement: np.ndarray) -> dict[str, np.ndarray]:
    """Several model chunks per stage: a compute whose neighbouring chunk on one side does not exist
    (the first and last global chunk) or runs on the same rank (the turn of a V-shaped schedule,
    whose stages hand over in memory) has no p2p there, while the dependency model matches every
    compute of a stage to a recv / send by order (a Megatron trace records no-op ones). Each such
    compute gets a zero-length no-op at that edge: a forward-recv before a forward and a
    backward-send after a backward on the side of the previous chunk; a forward-send after a
    forward and a backward-recv before a backward on the side of the next one. The engine makes
    them groups of one."""
    last = len(placement) - 1
    g = rows["gmc"]
    fwd = rows["optype"] == _CODE["forward-compute"]
    bwd = rows["optype"] == _CODE["backward-compute"]
    valid = (g >= 0) & (g <= last)
    no_previous = valid & ((g == 0) | (placement[np.clip(g - 1, 0, last)] == stage))
    no_next = valid & ((g == last) | (placement[np.clip(g + 1, 0, last)] == stage))
    adds = []
    for hit, noop, edge in ((fwd & no_previous, "forward-recv", "start"), (bwd & no_previous, "backward-send", "end"),
                            (fwd & no_next, "forward-send", "end"), (bwd & no_next, "backward-recv", "start")):
        adds += [(int(rows["step"][i]), _CODE[noop], float(rows[edge][i])) for i in np.flatnonzero(hit).tolist()]
    if not adds:
        return rows
    step, optype, at = (np.array(column) for column in zip(*adds))
    _after_chain(rows, step, optype, at)
    extra = {"step": step, "optype": optype, "start": at, "end": at, "mb_id": np.full(len(at), -1),
             "mc": np.full(len(at), -1), "gmc": np.full(len(at), -1), "n_ops": np.full(len(at), -1),
             "peer_stage": np.full(len(at), -1), "seq_lens": np.full(len(at), None, dtype=object)}
    return {name: np.concatenate([rows[name], extra[name].astype(rows[name].dtype)]) for name in rows}


def _after_chain(rows: dict[str, np.ndarray], step: np.ndarray, optype: np.ndarray, at: np.ndarray) -> None:
    """Move each no-op (in place) past the end of the real op of its type before it in the step: the
    dependency model chains a rank's p2p ops of one type, and a no-op placed while an asynchronous
    send or recv of another chunk is still open would hold every later op of the chain back in the
    replay. It stays before the next real op of its chain."""
    for key_step, code in set(zip(step.tolist(), optype.tolist())):
        real = np.flatnonzero((rows["step"] == key_step) & (rows["optype"] == code))
        if not len(real):
            continue
        real = real[np.argsort(rows["start"][real], kind="stable")]
        starts, ends = rows["start"][real], np.maximum.accumulate(rows["end"][real])
        mine = np.flatnonzero((step == key_step) & (optype == code))
        before = np.searchsorted(starts, at[mine], side="right") - 1
        moved = np.where(before >= 0, np.maximum(at[mine], ends[np.maximum(before, 0)]), at[mine])
        following = before + 1
        limit = np.where(following < len(starts), starts[np.minimum(following, len(starts) - 1)], np.inf)
        # strictly before the next real op: equal start times would be ordered by op type, not time
        at[mine] = np.minimum(moved, np.maximum(np.nextafter(limit, -np.inf), at[mine]))


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
