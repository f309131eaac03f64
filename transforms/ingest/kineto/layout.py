"""Which (dp rank, stage) each rank is: process-group descriptions, job.yaml sizes and order, or p2p peers; the data-parallel groups of a rank."""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from transforms.components import components
from transforms.ingest.common import RawInputError
from transforms.ingest.kineto.spans import FWD, RECV, RankTrace, SEND


# --------------------------------------------------------------------------- pass 2: the job

@dataclasses.dataclass(frozen=True)
class _Layout:
    """Sizes and the (dp_rank, stage) of every analysed (representative) rank."""

    dp: int
    pp: int
    tp: int
    cp: int
    worker: dict[int, tuple[int, int]]      # global rank -> (dp_rank, stage), representatives only
    how: str                                # where the layout came from

    def rank_of(self) -> dict[tuple[int, int], int]:
        return {cell: rank for rank, cell in self.worker.items()}


def _layout_from_yaml(world: int, options: Mapping[str, Any], job_id: str) -> _Layout:
    pp, tp, cp = (int(options.get(k, 1)) for k in ("pp_size", "tp_size", "cp_size"))
    dp = int(options.get("dp_size") or world // max(1, pp * tp * cp))
    if dp * pp * tp * cp != world:
        raise RawInputError("raw_layout_unknown", f"job.yaml sizes dp {dp} x pp {pp} x tp {tp} x cp {cp} != world size {world}",
                            job_id=job_id)
    order = str(options.get("layout") or "tp-cp-dp-pp").split("-")
    if sorted(order) != sorted(("tp", "cp", "dp", "pp")):
        raise RawInputError("raw_bad_job_yaml", f"layout {options.get('layout')!r}: name each of tp, cp, dp, pp once, "
                            "fastest-varying first (e.g. tp-cp-dp-pp)", job_id=job_id)
    sizes = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
    worker = {}
    for rank in range(world):
        rest, coords = rank, {}
        for dim in order:
            coords[dim], rest = rest % sizes[dim], rest // sizes[dim]
        if coords["tp"] == 0 and coords["cp"] == 0:
            worker[rank] = (coords["dp"], coords["pp"])
    return _Layout(dp, pp, tp, cp, worker, f"job.yaml layout {'-'.join(order)}")


def _layout_from_groups(ranks: Sequence[RankTrace], world: int) -> _Layout | None:
    """Coordinates from process groups whose description names one dim (DeviceMesh `mesh_pp`, Megatron names)."""
    coords: dict[int, dict[str, int]] = collections.defaultdict(dict)
    sizes: dict[str, int] = {}
    data_context: list[tuple[int, ...]] = []   # groups over data x context (grads sync)
    for trace in ranks:
        for group in trace.groups.values():
            dims = group.dims()
            if dims == {"dp", "cp"}:
                data_context.append(group.ranks)
            if len(dims) != 1:
                continue
            (dim,) = dims
            if sizes.setdefault(dim, len(group.ranks)) != len(group.ranks):
                return None
            for index, rank in enumerate(group.ranks):
                coords[rank][dim] = index
    if "dp" not in sizes and data_context:
        # only the data x context group is described: context-parallel ranks vary fastest within it
        # (Megatron's order tp-cp-ep-dp-pp, torchtitan's mesh [pp, dp, cp, tp])
        cp = sizes.get("cp", 1)
        if len({len(g) for g in data_context}) != 1 or len(data_context[0]) % cp:
            return None
        sizes["dp"] = len(data_context[0]) // cp
        for group in data_context:
            for index, rank in enumerate(group):
                coords[rank]["dp"] = index // cp
    if not {"dp", "pp"} & set(sizes):
        return None
    dp, pp, tp, cp = (sizes.get(d, 1) for d in ("dp", "pp", "tp", "cp"))
    if dp * pp * tp * cp != world:
        if "dp" in sizes:
            return None
        dp = world // (pp * tp * cp)
    worker = {}
    for rank in range(world):
        c = coords.get(rank, {})
        if c.get("tp", 0) or c.get("cp", 0):
            continue
        if "pp" in sizes and "pp" not in c or "dp" in sizes and "dp" not in c:
            continue   # a rank no group lists: reported missing below when it is needed
        worker[rank] = (c.get("dp", 0), c.get("pp", 0))
    described = ", ".join(f"{d} {sizes[d]}" for d in ("dp", "pp", "tp", "cp") if d in sizes)
    return _Layout(dp, pp, tp, cp, worker, f"process-group descriptions ({described})")


def _first_p2p_sends(trace: RankTrace) -> bool | None:
    """Whether the rank's first p2p op of a step is a send, in most of its steps (None: no p2p).
    The first stage of a pipeline starts a step with its first forward and sends it on; every other
    stage (interleaved: every rank but the one holding stage 0) waits on a recv first. Dependencies
    fix this order, so timing noise cannot flip it."""
    p2p = ((trace.kind == SEND) | (trace.kind == RECV)) & (trace.step >= 0)
    if not p2p.any():
        return None
    index = np.flatnonzero(p2p)
    order = index[np.lexsort((trace.start[index], trace.step[index]))]
    _, first = np.unique(trace.step[order], return_index=True)
    sends = int((trace.kind[order[first]] == SEND).sum())
    return 2 * sends > len(first)


def _first_forward(trace: RankTrace, step: int) -> float:
    """Start (µs, the rank's clock) of the rank's first forward compute in `step` (inf: none)."""
    hit = (trace.kind == FWD) & (trace.step == step)
    return float(trace.start[hit].min()) if hit.any() else np.inf


def _layout_from_structure(ranks: Sequence[RankTrace], world: int) -> _Layout | None:
    """No group names a dim, no job.yaml: the pipeline from what the ranks did (tp = cp = 1).

    - No rank sends or receives p2p: one data-parallel group of every rank.
    - Else the first stages are the ranks whose steps start with a send (`_first_p2p_sends`): dp =
      their count, pp = world / dp. Pipelines are the process groups (`pg_config`, any name, e.g.
      from `dist.new_group`) of pp ranks holding exactly one first stage, or the whole world when
      pp = world, or the components of known (global) p2p peers. Within a pipeline, stages run in
      the order of their first forward of a step (a stage computes only once the previous one sent;
      ranks of one host share a clock), else the group's rank order. DP rank = the order of the
      pipelines' first stages."""
    by_rank = {t.rank: t for t in ranks}
    starts = {rank: _first_p2p_sends(t) for rank, t in by_rank.items()}
    if all(v is None for v in starts.values()):
        return _Layout(world, 1, 1, 1, {rank: (rank, 0) for rank in range(world)},
                       "one data-parallel group (no rank sends or receives pipeline p2p)")
    if len(by_rank) < world:
        return None   # a pipeline, with ranks missing: `_layout` says which
    first = {rank for rank, v in starts.items() if v}
    if any(v is None for v in starts.values()) or not first or world % len(first):
        return None
    dp, pp = len(first), world // len(first)
    candidates = {g.ranks for t in ranks for g in t.groups.values() if len(g.ranks) == pp and len(set(g.ranks) & first) == 1}
    pipes = sorted({tuple(sorted(g)) for g in candidates})
    how = "process groups of the pipelines"
    if sum(len(p) for p in pipes) != world or len(set().union(*map(set, pipes))) != world:
        if pp == world:
            pipes, how = [tuple(range(world))], "one pipeline of every rank"
        else:
            links = []
            for trace in ranks:
                peers = trace.peer[(trace.kind == SEND) | (trace.kind == RECV)]
                links += [(trace.rank, peer) for peer in np.unique(peers[(peers >= 0) & (peers < world)]).tolist()]
            component = components(world, links)
            members: dict[int, list[int]] = collections.defaultdict(list)
            for rank in range(world):
                members[component[rank]].append(rank)
            pipes, how = sorted(tuple(m) for m in members.values()), "p2p peers"
            if any(len(p) != pp or len(set(p) & first) != 1 for p in pipes):
                return None
    common = set.intersection(*(set(t.steps.tolist()) for t in ranks))
    step = min(common) if common else None
    worker = {}
    for pipe in sorted(pipes, key=lambda p: min(set(p) & first)):
        same_clock = len({by_rank[r].clock for r in pipe}) == 1
        if same_clock and step is not None:
            timed = {r: by_rank[r].origin_ns / 1e3 + _first_forward(by_rank[r], step) for r in pipe}
            order = sorted(pipe, key=lambda r: (timed[r], r)) if all(np.isfinite(list(timed.values()))) else list(pipe)
        else:
            order = list(pipe)
        if order[0] not in first:
            order = [r for r in pipe if r in first] + [r for r in pipe if r not in first]
        dp_rank = len({d for d, _ in worker.values()})
        for stage, rank in enumerate(order):
            worker[rank] = (dp_rank, stage)
    return _Layout(dp, pp, 1, 1, worker, f"{how} (dp {dp}, pp {pp}; first stages: the ranks whose steps start with a send)"
                   if pp > 1 else "one data-parallel group")


def _layout(ranks: Sequence[RankTrace], world: int, options: Mapping[str, Any], job_id: str) -> _Layout:
    if any(k in options for k in ("dp_size", "pp_size", "tp_size", "cp_size", "layout")):
        return _layout_from_yaml(world, options, job_id)
    found = _layout_from_groups(ranks, world) or _layout_from_structure(ranks, world)
    present = {t.rank for t in ranks}
    if found is None and len(present) < world:
        missing = sorted(set(range(world)) - present)
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise RawInputError("raw_missing_rank", f"{len(missing)} rank(s) the analysis needs have no trace: ranks {shown} "
                            f"(the pipeline layout is read from every rank's p2p); found {len(present)} readable rank "
                            f"file(s) of world size {world}", job_id=job_id)
    if found is None:
        raise RawInputError("raw_layout_unknown", "no process group names the dims and the ranks' p2p does not show "
                            "the pipelines (first stages, groups or peers); give dp_size, pp_size, tp_size and layout "
                            "in job.yaml", job_id=job_id)
    return found


def _resolve_local_peers(trace: RankTrace, layout: _Layout) -> None:
    """p2p peers recorded as ranks of an unnamed group (gloo's c10d call arguments): that group is
    the rank's pipeline (ranks in group-rank order = sorted); peers it cannot name stay unknown."""
    local = trace.peer_local
    if not (local >= 0).any():
        return
    dp = layout.worker.get(trace.rank, (None,))[0]
    pipe = sorted(rank for rank, (d, _) in layout.worker.items() if d == dp)
    if layout.tp * layout.cp > 1 or not pipe:
        return
    hit = (trace.peer < 0) & (local >= 0) & (local < len(pipe))
    trace.peer = trace.peer.copy()
    trace.peer[hit] = np.array(pipe)[local[hit]]


def _dp_groups(trace: RankTrace, layout: _Layout, described: bool) -> set[str]:
    """Names (as this rank's trace spells them: pg_name differs between ranks) of the rank's
    data-parallel groups. None when dp = 1. When some group of the job names the dp dim (alone or
    with cp: Group.syncs_grads), only such groups; otherwise the groups whose members are exactly this stage's DP ranks and that name no
    other dim (the default group of plain DDP). Collectives whose group the trace does not name
    (gloo CPU traces, old NCCL ones) count as data-parallel: the only collectives a training step
    issues outside its compute."""
    if layout.dp == 1:
        return set()
    stage = layout.worker[trace.rank][1]
    peers = frozenset(rank for rank, (_, s) in layout.worker.items() if s == stage)
    names = {""}
    for group in trace.groups_of_rank():
        if group.syncs_grads() or (not described and not group.dims() - {"dp"} and frozenset(group.ranks) == peers):
            names.add(group.name)
    return names
