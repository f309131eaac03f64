"""Comm ops matched across ranks: p2p pairs, the check that every collective and transfer has its peers, idle waits cut off p2p pairs."""
from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np

from schemas.trace import COMPUTE_OPTYPES, IN_COMPUTE_OPTYPES, OPTYPES
from transforms.ingest.common import RawInputError
from transforms.ingest.kineto.layout import _Layout
from transforms.ingest.kineto.spans import COLL, RankTrace, _CODE, first_start_per_step


def _channels(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout):
    """Each p2p channel of the job: (send rank, its send rows, recv rank, its recv rows, send type,
    recv type), rows in (step, start) order. A channel runs from a stage to the stage its ops name as
    peer (`peer_stage`), within one pipeline (DP rank): forward-send k of (dp, s) to (dp, t) pairs with
    forward-recv k of (dp, t) from (dp, s), backward likewise, k counting within the step: the
    engine pairs them the same way."""
    rank_of = layout.rank_of()
    for send, recv in (("forward-send", "forward-recv"), ("backward-send", "backward-recv")):
        channels: set[tuple[int, int]] = set()   # (send rank, recv rank), named by either end
        for rank, r in rows.items():
            dp, stage = layout.worker[rank]
            for code, outgoing in ((_CODE[send], True), (_CODE[recv], False)):
                for other in np.unique(r["peer_stage"][r["optype"] == code]).tolist():
                    peer = rank_of.get((dp, other))
                    if peer is not None and peer in rows and peer != rank:
                        channels.add((rank, peer) if outgoing else (peer, rank))
        for rank, peer in sorted(channels):
            r, p = rows[rank], rows[peer]
            mine = np.flatnonzero((r["optype"] == _CODE[send]) & (r["peer_stage"] == layout.worker[peer][1]))
            theirs = np.flatnonzero((p["optype"] == _CODE[recv]) & (p["peer_stage"] == layout.worker[rank][1]))
            mine = mine[np.lexsort((r["start"][mine], r["step"][mine]))]
            theirs = theirs[np.lexsort((p["start"][theirs], p["step"][theirs]))]
            yield rank, mine, peer, theirs, send, recv


def _p2p_pairs(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout) -> list[tuple[int, int, int, int]]:
    """(send rank, send row, recv rank, recv row) of every p2p pair (see `_channels`)."""
    pairs = []
    for rank, mine, peer, theirs, _, _ in _channels(rows, layout):
        r, p = rows[rank], rows[peer]
        for step in np.intersect1d(r["step"][mine], p["step"][theirs]).tolist():
            a, b = mine[r["step"][mine] == step], theirs[p["step"][theirs] == step]
            pairs += [(rank, int(i), peer, int(j)) for i, j in zip(a, b)]
    return pairs


def _per_step(steps: np.ndarray) -> dict[int, int]:
    """Step -> how many of these rows it holds."""
    values, n = np.unique(steps, return_counts=True)
    return dict(zip(values.tolist(), n.tolist()))


def _check_comm_pairs(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout, job_id: str) -> None:
    """Every step's comm ops must pair up across ranks: each DP collective type as many times on
    every DP rank of a stage, each forward-send of stage s with a forward-recv of stage s+1 (and
    backward likewise). Raises raw_unmatched_comm naming the ranks, step and op type."""
    rank_of = layout.rank_of()

    def counts(rank: int, code: int) -> dict[int, int]:
        return _per_step(rows[rank]["step"][rows[rank]["optype"] == code])

    steps = sorted(set(np.concatenate([r["step"] for r in rows.values()]).tolist()))
    for code in (_CODE["grads-reduce-scatter"], _CODE["params-all-gather"], _CODE["separate-grads-all-reduce"],
                 *(_CODE[name] for name in IN_COMPUTE_OPTYPES)):
        for stage in range(layout.pp):
            members = [rank_of[(d, stage)] for d in range(layout.dp) if (d, stage) in rank_of]
            per_rank = {rank: counts(rank, code) for rank in members}
            for step in steps:
                seen = {rank: per_rank[rank].get(step, 0) for rank in members}
                if len(set(seen.values())) > 1:
                    raise RawInputError("raw_unmatched_comm", f"step {step}, stage {stage}: {OPTYPES[code]} ops per DP "
                                        f"rank differ ({', '.join(f'rank {r}: {n}' for r, n in seen.items())}); every "
                                        "DP rank issues the same collectives", job_id=job_id, op=OPTYPES[code])
    wrap = any(len(r["mc"]) and int(r["mc"].max()) > 0 for r in rows.values())
    for rank, mine, peer, theirs, send, recv in _channels(rows, layout):
        sent, received = _per_step(rows[rank]["step"][mine]), _per_step(rows[peer]["step"][theirs])
        for step in steps:
            if sent.get(step, 0) != received.get(step, 0):
                hint = ("; several model chunks per stage: a p2p op's direction and peer come from the schedule's "
                        "`PP:sSEND_Fm` / `PP:sRECV_Bm` labels" if wrap else "")
                raise RawInputError("raw_unmatched_comm", f"step {step}: rank {rank} (stage {layout.worker[rank][1]}) "
                                    f"has {sent.get(step, 0)} {send} ops to stage {layout.worker[peer][1]} but rank "
                                    f"{peer} {received.get(step, 0)} {recv} ops from stage {layout.worker[rank][1]}{hint}",
                                    job_id=job_id, op=send)


def _seq_gaps(ranks: Sequence[RankTrace], steps: np.ndarray) -> dict[int, str]:
    """Recent NCCL traces number each collective in its process group (`Seq`): the members of a group
    ran the same ones, in Seq order on one stream. Within the Seq range every member profiled, a
    Seq one member has and another lacks is an event lost from that other's trace (a full profiler
    buffer, a cut export), and pairing that step's collectives by order would pair the wrong ones.
    Returns {step: why} for the steps holding such a Seq (the first gap of each step)."""
    held: dict[str, dict[int, dict[int, tuple[int, str]]]] = collections.defaultdict(dict)   # group -> rank -> Seq -> (step, coll)
    for trace in ranks:
        if trace.seq is None:
            continue
        hit = (trace.seq >= 0) & (trace.kind == COLL) & np.isin(trace.step, steps)
        for group in sorted({str(g) for g in trace.group[hit]}):
            mine = hit & (trace.group == group)
            held[group][trace.rank] = dict(zip(trace.seq[mine].tolist(), zip(trace.step[mine].tolist(), trace.coll[mine])))
    gaps: dict[int, str] = {}
    for group, members in sorted(held.items()):
        if len(members) < 2:
            continue
        lo = max(min(seqs) for seqs in members.values())   # windows may start or end a collective apart
        hi = min(max(seqs) for seqs in members.values())
        union = {n: where for seqs in members.values() for n, where in seqs.items() if lo <= n <= hi}
        for rank, seqs in sorted(members.items()):
            for n in sorted(set(union) - set(seqs)):
                step, coll = union[n]
                others = ", ".join(str(r) for r, s in sorted(members.items()) if n in s)
                gaps.setdefault(int(step), f"rank {rank} has no {coll} Seq {n} of process group {group!r}, which "
                                           f"rank(s) {others} ran: an event lost from its trace")
    return gaps


def _clip_p2p_waits(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout, offsets: Mapping[int, float],
                    step_starts: Mapping[int, Mapping[int, float]] | None = None) -> int:
    """Cut the idle waits off both ends of every p2p pair (clocks aligned by `offsets`, µs).

    - A recv that opens the rank's step (before its first compute) and was posted before its
      pipeline began the step waits idle: it starts when the pipeline began, or with its peer's
      send if that is earlier. A pipeline begins its step when its first stage does (the ranks of
      the DP replica whose step does not open with a recv; `step_starts`: per rank, its
      ProfilerStep starts on the rows' time axis; without them, at the send). The step's observed
      span no longer counts stages idling on their first recv while the first stage still
      finishes the previous step (pipelines without a global sync at the step's end drift
      apart); what the first stage does in its step before its first op (loading data, zeroing
      grads) is the step's work, its untraced time (launch delay), which the later stages wait
      for. Transfer times (end - latest start of the pair) do not change. Later recvs keep their
      start: their wait is the pair's (the replay ends them at the send's start + transfer), and
      moving it into a gap before the recv would make it the receiver's untraced time.
    - An asynchronous send (gloo's isend) stays open until the schedule waits on it, often after
      the data arrived: it ends when its recv ended. Otherwise the send chain of the dependency
      model would serialise sends that overlapped.
    Returns the number of ops changed."""
    changed = 0
    compute = [_CODE["forward-compute"], _CODE["backward-compute"]]
    first_compute = {rank: first_start_per_step(r["step"], r["start"], np.isin(r["optype"], compute)) for rank, r in rows.items()}
    began = _pipeline_starts(rows, layout, offsets, step_starts or {})
    for send_rank, i, recv_rank, j in _p2p_pairs(rows, layout):
        send, recv = rows[send_rank], rows[recv_rank]
        shift = offsets[recv_rank] - offsets[send_rank]   # send clock -> recv clock
        step = int(recv["step"][j])
        pipeline = began.get((layout.worker[recv_rank][0], step), np.inf) + offsets[recv_rank]
        ready = min(send["start"][i] + shift, pipeline)
        opening = recv["start"][j] < first_compute[recv_rank].get(step, np.inf)
        if opening and ready > recv["start"][j]:
            recv["start"][j] = min(ready, recv["end"][j])
            changed += 1
        recv_end = recv["end"][j] - shift                  # recv clock -> send clock
        if send["end"][i] > recv_end:
            send["end"][i] = max(send["start"][i], recv_end)
            changed += 1
    return changed


def _pipeline_starts(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout, offsets: Mapping[int, float],
                     step_starts: Mapping[int, Mapping[int, float]]) -> dict[tuple[int, int], float]:
    """(dp replica, step) -> when its pipeline began the step, on the aligned clock: the earliest
    ProfilerStep start of its ranks whose step does not open with a recv (its first stages)."""
    recvs = [_CODE["forward-recv"], _CODE["backward-recv"]]
    out: dict[tuple[int, int], float] = {}
    for rank, r in rows.items():
        dp = layout.worker[rank][0]
        order = np.lexsort((r["start"], r["step"]))
        steps, first = np.unique(r["step"][order], return_index=True)
        for step, i in zip(steps.tolist(), order[first].tolist()):
            start = step_starts.get(rank, {}).get(step)
            if start is None or r["optype"][i] in recvs:
                continue
            key = (dp, step)
            out[key] = min(out.get(key, np.inf), start - offsets[rank])
    return out


_P2P_CHAINS = ("forward-send", "forward-recv", "backward-send", "backward-recv")
_DP_CHAIN = ("params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce")


def _serialise_chains(rows: Mapping[int, dict[str, np.ndarray]]) -> int:
    """The dependency model runs each p2p type of a rank as one chain in start order, and its DP
    collectives as one more (METHOD.md section 2); asynchronous schedules post the next recv (send)
    before the previous one completed, and DDP's buckets or per-parameter async all-reduces run
    side by side. Each op of a chain starts no earlier than the previous one ended: the time
    before is spent waiting behind it, and a chain whose ops overlapped would otherwise replay
    them one after the other with their whole spans, slower than what ran. Returns the number of
    ops changed."""
    changed = 0
    chains = ([[_CODE[name]] for name in _P2P_CHAINS] + [[_CODE[name] for name in _DP_CHAIN]]
              + [[_CODE[name] for name in IN_COMPUTE_OPTYPES]])
    for r in rows.values():
        for codes in chains:
            hit = np.flatnonzero(np.isin(r["optype"], codes))
            if len(hit) < 2:
                continue
            hit = hit[np.lexsort((r["start"][hit], r["step"][hit]))]
            for before, after in zip(hit[:-1].tolist(), hit[1:].tolist()):
                if r["step"][before] == r["step"][after] and r["start"][after] < r["end"][before]:
                    r["start"][after] = min(r["end"][before], r["end"][after])
                    changed += 1
    return changed


def _collectives_after_compute(rows: Mapping[int, dict[str, np.ndarray]]) -> int:
    """A DP collective issued while its rank still computes (DDP's bucket all-reduces and per-
    parameter async all-reduces start inside the backward that produced the gradients) delays
    the step only from the end of that compute: the dependency model runs DP collectives after
    the compute, so the collective's start moves to the end of the compute op running when it was
    issued, and its transfer (end - latest start over the DP group) is the exposed part. Returns
    the number of collectives changed."""
    changed = 0
    compute_codes = [_CODE[name] for name in COMPUTE_OPTYPES]
    dp_codes = [_CODE[name] for name in _DP_CHAIN]
    for r in rows.values():
        compute = np.flatnonzero(np.isin(r["optype"], compute_codes))
        coll = np.flatnonzero(np.isin(r["optype"], dp_codes))
        if not len(compute) or not len(coll):
            continue
        # a microbatch's compute is one unit however many pieces collectives inside it cut it into
        key = np.stack([r["step"][compute], r["optype"][compute], r["gmc"][compute], r["mb_id"][compute]])
        _, unit = np.unique(key, axis=1, return_inverse=True)
        unit = unit.reshape(-1)
        first = np.full(unit.max() + 1, np.inf)
        last = np.full(unit.max() + 1, -np.inf)
        np.minimum.at(first, unit, r["start"][compute])
        np.maximum.at(last, unit, r["end"][compute])
        head = np.full(unit.max() + 1, -1)
        head[unit[::-1]] = compute[::-1]          # a representative op of each unit
        order = np.argsort(first, kind="stable")
        starts, ends = first[order], np.maximum.accumulate(last[order])
        running = np.searchsorted(starts, r["start"][coll], side="right") - 1
        inside = (running >= 0) & (ends[np.maximum(running, 0)] > r["start"][coll])
        moved = coll[inside]
        r["start"][moved] = np.minimum(ends[running[inside]], r["end"][moved])
        # the gradients it reduces are of the model chunk whose backward was running
        issuer = head[order][running[inside]]
        r["mc"][moved], r["gmc"][moved] = r["mc"][issuer], r["gmc"][issuer]
        changed += int(inside.sum())
    return changed


def _overlapped_dp_marker(rows: Mapping[int, dict[str, np.ndarray]]) -> int:
    """DP collectives issued during the backward (DDP buckets, per-parameter async all-reduce) are
    the method's overlapped DP: each chunk's reduction follows that chunk's last backward, not the
    step's last compute. The engine reads that mode from the separate-grads all-reduce of its tail
    (METHOD.md section 2); such jobs have none, so each rank gets an empty one per step, at the
    end of its last reduction (zero time: it changes no span, only the dependencies).
    Returns the number of ops added (0 when the job has separate-grads all-reduces already)."""
    separate, scatter = _CODE["separate-grads-all-reduce"], _CODE["grads-reduce-scatter"]
    if any((r["optype"] == separate).any() for r in rows.values()):
        return 0
    added = 0
    for rank, r in rows.items():
        hit = r["optype"] == scatter
        steps = np.unique(r["step"][hit])
        if not len(steps):
            continue
        at = np.array([r["end"][hit & (r["step"] == s)].max() for s in steps.tolist()])
        stage_gmc = int(r["gmc"][r["optype"] == _CODE["optimizer"]][0]) if (r["optype"] == _CODE["optimizer"]).any() else 0
        extra = {"step": steps, "optype": np.full(len(steps), separate), "start": at, "end": at.copy(),
                 "mb_id": np.full(len(steps), -1), "mc": np.zeros(len(steps), dtype=np.int64),
                 "gmc": np.full(len(steps), stage_gmc), "n_ops": np.full(len(steps), -1),
                 "peer_stage": np.full(len(steps), -1), "seq_lens": np.full(len(steps), None, dtype=object)}
        for name in r:
            r[name] = np.concatenate([r[name], extra[name].astype(r[name].dtype)])
        added += len(steps)
    return added


def _recv_waits_after_compute(rows: Mapping[int, dict[str, np.ndarray]], host_thread: bool = False) -> int:
    """A recv posted ahead (asynchronous schedules post it before the compute it serves, and before
    the computes in between) only starts waiting once the rank is done with the compute before
    it: its start moves to the end of the rank's last compute op that ended before the recv did.
    Its transfer (end - latest start of the pair) then no longer counts the receiver's own work
    in between, and the dependency model's compute(i-1) -> recv(i) edge holds.

    host_thread (CPU jobs: one thread computes, issues the sends and waits on the recvs): nor does
    it wait while it issues a send, so a send issued after the recv was posted and before it
    completed moves the recv's start to that send's issue too. What the thread did before that
    issue (an untraced pause, say) then shows as the recv's launch delay, the receiver's untraced
    time, instead of as a slow transfer. Returns the number of recvs changed."""
    changed = 0
    compute_codes = [_CODE[name] for name in COMPUTE_OPTYPES]
    send_codes = [_CODE["forward-send"], _CODE["backward-send"]]
    for r in rows.values():
        compute = np.isin(r["optype"], compute_codes)
        recv = np.flatnonzero(np.isin(r["optype"], [_CODE["forward-recv"], _CODE["backward-recv"]]))
        if not compute.any() or not len(recv):
            continue
        ends = np.sort(r["end"][compute])
        before = np.searchsorted(ends, r["end"][recv], side="right") - 1
        last = np.where(before >= 0, ends[np.maximum(before, 0)], -np.inf)
        sends = np.sort(r["start"][np.isin(r["optype"], send_codes)]) if host_thread else r["start"][:0]
        if len(sends):
            issued = np.searchsorted(sends, r["end"][recv], side="left") - 1
            last = np.maximum(last, np.where(issued >= 0, sends[np.maximum(issued, 0)], -np.inf))
        moved = last > r["start"][recv]
        r["start"][recv[moved]] = np.minimum(last[moved], r["end"][recv[moved]])
        changed += int(moved.sum())
    return changed
