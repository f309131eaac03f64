"""Which (dp rank, stage) each rank is: process-group descriptions, job.yaml sizes and order, or p2p peers; the data-parallel groups of a rank."""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from transforms.ingest.common import RawInputError
from transforms.ingest.kineto.spans import RECV, RankTrace, SEND


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
    for trace in ranks:
        for group in trace.groups.values():
            dims = group.dims()
            if len(dims) != 1:
                continue
            (dim,) = dims
            if sizes.setdefault(dim, len(group.ranks)) != len(group.ranks):
                return None
            for index, rank in enumerate(group.ranks):
                coords[rank][dim] = index
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


def _layout_from_peers(ranks: Sequence[RankTrace], world: int) -> _Layout:
    """No description, no job.yaml: p2p peers chain the stages (stage = position in the rank-sorted
    pipeline), the rest are data-parallel replicas; tp = cp = 1."""
    links = []
    for trace in ranks:
        peers = trace.peer[(trace.kind == SEND) | (trace.kind == RECV)]
        links += [(trace.rank, peer) for peer in np.unique(peers[(peers >= 0) & (peers < world)]).tolist()]
    component = _components(world, links)
    pipelines: dict[int, list[int]] = collections.defaultdict(list)
    for rank in range(world):
        pipelines[component[rank]].append(rank)
    sizes = {len(members) for members in pipelines.values()}
    if len(sizes) != 1:
        return None
    pp = sizes.pop()
    dp = world // pp
    worker = {}
    for dp_rank, members in enumerate(sorted(pipelines.values())):
        for stage, rank in enumerate(sorted(members)):
            worker[rank] = (dp_rank, stage)
    return _Layout(dp, pp, 1, 1, worker, "p2p peers (no process-group descriptions)" if pp > 1 else "one data-parallel group")


def _layout(ranks: Sequence[RankTrace], world: int, options: Mapping[str, Any], job_id: str) -> _Layout:
    if any(k in options for k in ("dp_size", "pp_size", "tp_size", "cp_size", "layout")):
        return _layout_from_yaml(world, options, job_id)
    found = _layout_from_groups(ranks, world) or _layout_from_peers(ranks, world)
    if found is None:
        raise RawInputError("raw_layout_unknown", "pipelines of different lengths among the p2p peers and no process "
                            "group names the dims; give dp_size, pp_size, tp_size and layout in job.yaml", job_id=job_id)
    return found


def _dp_groups(trace: RankTrace, layout: _Layout, described: bool) -> set[str]:
    """Names (as this rank's trace spells them: pg_name differs between ranks) of the rank's
    data-parallel groups. None when dp = 1. When some group of the job names the dp dim, only such
    groups; otherwise the groups whose members are exactly this stage's DP ranks and that name no
    other dim (the default group of plain DDP). Collectives whose group the trace does not name
    (gloo CPU traces, old NCCL ones) count as data-parallel: the only collectives a training step
    issues outside its compute."""
    if layout.dp == 1:
        return set()
    stage = layout.worker[trace.rank][1]
    peers = frozenset(rank for rank, (_, s) in layout.worker.items() if s == stage)
    names = {""}
    for group in trace.groups_of_rank():
        dims = group.dims()
        if dims == {"dp"} or (not described and not dims - {"dp"} and frozenset(group.ranks) == peers):
            names.add(group.name)
    return names


def _components(n: int, links) -> list[int]:
    """Connected-component label (a member index) of each of n nodes linked by (a, b) pairs."""
    parent = list(range(n))

    def root(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for a, b in links:
        parent[root(int(a))] = root(int(b))
    return [root(v) for v in range(n)]
