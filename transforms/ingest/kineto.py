"""torch.profiler (Kineto) Chrome-trace JSON, one file per rank -> TRACE_SCHEMA rows + manifest.

Two passes, both plain functions:

1. `parse_rank(path, data)`: one rank's JSON -> `RankTrace`, compact numpy columns of the
   spans that matter (profiled steps, per-microbatch forward/backward compute, p2p and
   collective comm, optimizer) plus counts of everything that fit no op type. One pass over
   the events in Python, the rest vectorised. Only this pass touches the JSON, one rank at
   a time, so memory stays bounded by the largest rank file.
2. `assemble(ranks, job_id, date, options)`: the ranks of one job -> `ConvertedJob`:
   checks (duplicate, missing or foreign ranks, steps that do not line up), the dp/pp
   layout, op types, seq ids, clock alignment, manifest.

The mapping (ARCHITECTURE.md, "Kineto mapping"):
- steps: `ProfilerStep#N`; a step is kept when every analysed rank has it complete
  (an optimizer span and every kind of compute), others are listed in source.steps_dropped;
- rank and world: `distributedInfo`; process groups: `distributedInfo.pg_config`
  ({pg_name, pg_desc, ranks}); the pp / dp coordinates of a rank are its index in the
  group whose description names the dim (`mesh_pp`, `PIPELINE...`, `DATA_PARALLEL...`),
  else job.yaml sizes + layout, else inferred (p2p peers make the pipeline, the
  collectives' group the data-parallel replicas);
- compute: the schedule's record_function labels (`PP:{stage}F{mb}` / `PP:{stage}B{mb}` of
  torch.distributed.pipelining, `Forward k` / `Backward k` of its GPipe, `forward-compute k`,
  or job.yaml forward_label / backward_label), with p2p waits nested at a label's edges
  cut off; on GPU traces the label's `gpu_user_annotation` span (kernel time) when present;
- p2p: gloo `gloo:send` / `gloo:recv` spans (CPU) or NCCL send/recv kernels (GPU); the
  direction is the compute it serves: a send carries the compute before it, a recv feeds
  the compute after it;
- DP collectives (all_reduce, reduce_scatter, all_gather over the data-parallel group):
  gloo spans on the runloop threads or NCCL kernels; all_reduce and reduce_scatter of
  gradients -> grads-reduce-scatter, all_gather -> params-all-gather, matched across
  ranks by their order in the group within the step (= NCCL's sequence number order);
- optimizer: `Optimizer.step#...` (union of the step's optimizer spans);
- everything else that is communication or a label (broadcast, barrier, all_to_all,
  collectives of other groups, unknown labels) is counted in source.unmapped.
- clocks: per-rank offsets estimated so that the ends of matched collectives and p2p
  pairs coincide (least squares); the analysis then depends only on durations and the
  order of ops within each rank. job.yaml `clock: trust` keeps the recorded clocks.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from schemas.trace import OPTYPES
from transforms.ingest.common import ConvertedJob, RawInputError, build_manifest, build_trace, open_bytes

__all__ = [
    "RankTrace",
    "Group",
    "parse_rank",
    "parse_rank_bytes",
    "assemble",
    "convert_kineto",
    "DEFAULT_FORWARD_LABELS",
    "DEFAULT_BACKWARD_LABELS",
    "DEFAULT_OPTIMIZER_LABEL",
]

_CODE = {name: code for code, name in enumerate(OPTYPES)}

# Span kinds inside a RankTrace.
FWD, BWD, OPT, SEND, RECV, COLL = range(6)
_KIND_NAMES = ("forward", "backward", "optimizer", "send", "recv", "collective")

DEFAULT_FORWARD_LABELS = (
    r"^PP:(?P<stage>\d+)F(?P<mb>\d+)$",                         # torch.distributed.pipelining runtime
    r"^Forward (?P<mb>\d+)$",                                   # torch.distributed.pipelining GPipe / 1F1B
    r"^forward[-_ ](?:compute|step)(?:[ #:_=-]*(?:mb|microbatch)?[ #:_=-]*(?P<mb>\d+))?$",
)
DEFAULT_BACKWARD_LABELS = (
    r"^PP:(?P<stage>\d+)B(?P<mb>\d+)$",
    r"^Backward (?P<mb>\d+)$",
    r"^backward[-_ ](?:compute|step)(?:[ #:_=-]*(?:mb|microbatch)?[ #:_=-]*(?P<mb>\d+))?$",
)
DEFAULT_OPTIMIZER_LABEL = r"^Optimizer\.step#"
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_NCCL = ("ncclKernel_", "ncclDevKernel_")
# Collective names as c10d / NCCL / gloo spell them -> canonical name.
_COLLECTIVES = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "allreduce_sparse": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "reduce_scatter": "reduce_scatter", "reducescatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allgather": "all_gather", "all_gather": "all_gather", "_allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
    "allgather_coalesced": "all_gather",
    "all_to_all": "all_to_all", "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_allv": "all_to_all",
    "broadcast": "broadcast", "barrier": "barrier", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recv_anysource": "recv", "sendrecv": "sendrecv",
}
# Canonical DP collective -> op type; the other known collectives are counted as unmapped.
_DP_OPTYPE = {"all_reduce": "grads-reduce-scatter", "reduce_scatter": "grads-reduce-scatter", "all_gather": "params-all-gather"}
_DIM_TOKENS = {
    "pp": {"pp", "pipe", "pipeline"},
    "dp": {"dp", "data", "ddp", "fsdp", "replicate", "shard"},
    "tp": {"tp", "tensor"},
    "cp": {"cp", "context"},
}


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group as `distributedInfo.pg_config` lists it (ranks in group-rank order)."""

    name: str
    desc: str
    ranks: tuple[int, ...]

    def dims(self) -> set[str]:
        tokens = set(re.split(r"[^a-z]+", self.desc.lower()))
        return {dim for dim, names in _DIM_TOKENS.items() if tokens & names}


@dataclasses.dataclass
class RankTrace:
    """One rank's spans (times in µs on the rank's own clock), before the job is assembled.

    Span columns (equal length): kind (FWD/BWD/OPT/SEND/RECV/COLL), start, end, step
    (ProfilerStep number, -1 outside every step), mb (microbatch id or -1), chunk (global
    pipeline stage index from a `PP:` label, else -1), peer (global rank of a p2p peer or
    -1), coll (canonical collective name for COLL spans), group (pg_name or "").
    """

    path: str
    rank: int
    world: int
    backend: str
    groups: dict[str, Group]
    device: str
    versions: dict[str, Any]
    steps: np.ndarray            # ProfilerStep numbers, sorted
    step_start: np.ndarray       # µs
    step_end: np.ndarray
    kind: np.ndarray
    start: np.ndarray
    end: np.ndarray
    step: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    peer: np.ndarray
    coll: np.ndarray             # object: str
    group: np.ndarray            # object: str
    unmapped: collections.Counter

    def groups_of_rank(self) -> list[Group]:
        return [g for g in self.groups.values() if self.rank in g.ranks]


# --------------------------------------------------------------------------- pass 1: one rank

def _loads(data: bytes):
    try:
        import orjson

        return orjson.loads(data)
    except ImportError:   # pragma: no cover - orjson is a declared dependency
        import json

        return json.loads(data)


def parse_rank_bytes(path: str, data: bytes, options: Mapping[str, Any] | None = None) -> RankTrace:
    """One rank's raw file content (JSON, optionally gzipped) -> RankTrace. RawInputError on bad bytes."""
    try:
        document = _loads(open_bytes(data))
    except (ValueError, EOFError, OSError) as error:   # JSON decode error, truncated or broken gzip
        raise RawInputError("raw_unreadable", f"not a complete JSON document ({type(error).__name__}: {error})",
                            path=path) from None
    return parse_rank(path, document, options)


def _compile_labels(options: Mapping[str, Any], key: str, defaults: tuple[str, ...]) -> list[re.Pattern]:
    given = options.get(key)
    patterns = [given] if isinstance(given, str) else list(given or defaults)
    try:
        return [re.compile(p) for p in patterns]
    except re.error as error:
        raise RawInputError("raw_bad_job_yaml", f"{key} {given!r} is not a regular expression ({error})") from None


def _match(patterns: list[re.Pattern], name: str):
    for pattern in patterns:
        found = pattern.match(name)
        if found:
            return found
    return None


def _groups(info: Mapping[str, Any]) -> dict[str, Group]:
    config = info.get("pg_config") or []
    if isinstance(config, Mapping):     # some versions key the groups by name
        config = [dict(value, pg_name=value.get("pg_name", key)) for key, value in config.items()]
    out = {}
    for entry in config:
        if not isinstance(entry, Mapping) or "ranks" not in entry:
            continue
        ranks = entry["ranks"]
        if isinstance(ranks, str):
            ranks = [int(x) for x in re.findall(r"\d+", ranks)]
        name = str(entry.get("pg_name", len(out)))
        out[name] = Group(name, str(entry.get("pg_desc") or ""), tuple(int(r) for r in ranks))
    return out


def _ranks_arg(value) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return tuple(int(x) for x in re.findall(r"-?\d+", str(value or "")))


def parse_rank(path: str, document: Any, options: Mapping[str, Any] | None = None) -> RankTrace:
    """A parsed Kineto JSON document -> RankTrace (see the module docstring for what is kept)."""
    options = options or {}
    if not isinstance(document, Mapping) or not isinstance(document.get("traceEvents"), list):
        raise RawInputError("raw_not_a_trace", "no traceEvents list: not a torch.profiler Chrome trace", path=path)
    info = document.get("distributedInfo")
    if not isinstance(info, Mapping) or "rank" not in info or "world_size" not in info:
        raise RawInputError("raw_not_a_trace", "no distributedInfo (rank, world_size): profile a torch.distributed "
                            "job (the profiler records it once the process group is initialised)", path=path)
    forward_labels = _compile_labels(options, "forward_label", DEFAULT_FORWARD_LABELS)
    backward_labels = _compile_labels(options, "backward_label", DEFAULT_BACKWARD_LABELS)
    optimizer_label = re.compile(options.get("optimizer_label") or DEFAULT_OPTIMIZER_LABEL)
    rank, world = int(info["rank"]), int(info["world_size"])
    groups = _groups(info)
    unmapped: collections.Counter = collections.Counter()

    steps: dict[int, tuple[float, float]] = {}
    cpu_labels: list[tuple[int, float, float, int, int, str]] = []   # kind, start, end, mb, chunk, name
    gpu_labels: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    comm: list[tuple[int, float, float, int, str, str]] = []          # kind, start, end, peer, coll, group
    comm_meta: list[dict] = []                                      # record_param_comms args, in time order
    gloo_cpu: list[tuple[str, float, float, int]] = []               # name, start, end, tid
    optimizer: list[tuple[float, float]] = []
    kernels = 0
    for event in document["traceEvents"]:
        if event.get("ph") != "X":
            continue
        name = event.get("name", "")
        cat = event.get("cat", "")
        ts = event.get("ts")
        dur = event.get("dur")
        if ts is None or dur is None:
            continue
        ts, end = float(ts), float(ts) + float(dur)
        if cat == "kernel":
            kernels += 1
            if name.startswith(_NCCL):
                args = event.get("args") or {}
                comm.append(_nccl_span(name, args, ts, end, rank, groups))
            continue
        if cat in ("user_annotation", "cpu_op", "gpu_user_annotation"):
            step = _STEP.match(name)
            if step:
                if cat != "gpu_user_annotation":
                    steps[int(step.group(1))] = (ts, end)
                continue
            if cat == "gpu_user_annotation":
                gpu_labels[name].append((ts, end))
                continue
            if name.startswith("gloo:"):
                gloo_cpu.append((name[5:], ts, end, event.get("tid")))
                continue
            if name == "record_param_comms":
                args = event.get("args") or {}
                if "Collective name" in args:
                    comm_meta.append(dict(args, ts=ts, tid=event.get("tid")))
                continue
            if cat == "user_annotation":
                if optimizer_label.match(name):
                    optimizer.append((ts, end))
                    continue
                found = _match(forward_labels, name)
                kind = FWD
                if found is None:
                    found, kind = _match(backward_labels, name), BWD
                if found is not None:
                    groups_found = found.groupdict()
                    mb = groups_found.get("mb")
                    chunk = groups_found.get("stage") if "stage" in groups_found else groups_found.get("chunk")
                    cpu_labels.append((kind, ts, end, int(mb) if mb is not None else -1,
                                       int(chunk) if chunk is not None else -1, name))
                else:
                    unmapped[f"label {_label_family(name)}"] += 1
    if not steps:
        raise RawInputError("raw_no_steps", "no ProfilerStep#N span: call prof.step() once per training step", path=path)
    device = "cpu"
    properties = document.get("deviceProperties") or []
    if kernels and properties and isinstance(properties[0], Mapping):
        device = str(properties[0].get("name") or "gpu")
    elif kernels:
        device = "gpu"
    versions = {"schemaVersion": document.get("schemaVersion"), "backend": info.get("backend"),
                "nccl_version": info.get("nccl_version"), "trace_id": document.get("trace_id")}
    if not kernels:
        comm += _gloo_spans(gloo_cpu, comm_meta, rank, groups, unmapped)
    spans = _compute_spans(cpu_labels, gpu_labels if kernels else {}, comm)
    return _rank_trace(path, rank, world, str(info.get("backend") or ""), groups, device, versions, steps, spans,
                       comm, optimizer, unmapped)


def _label_family(name: str) -> str:
    """A label with its numbers replaced by N, so that counts group by kind of label."""
    return re.sub(r"\d+", "N", name)[:80]


def _nccl_span(name: str, args: Mapping[str, Any], start: float, end: float, rank: int,
               groups: Mapping[str, Group]) -> tuple[int, float, float, int, str, str]:
    """(kind, start, end, peer, collective, group) of one NCCL kernel."""
    collective = args.get("Collective name")
    if collective is None:   # old traces: the kernel name says what it is (ncclKernel_AllReduce_RING_LL_Sum_float)
        token = re.match(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
        collective = token.group(1) if token else name
    canonical = _COLLECTIVES.get(str(collective).lower(), str(collective).lower())
    group = str(args.get("Process Group Name", ""))
    peer = -1
    if canonical in ("send", "recv"):
        key = "Dst Rank" if canonical == "send" else "Src Rank"
        if key in args:
            peer = _global_peer(int(args[key]), group, groups, rank)
        return (SEND if canonical == "send" else RECV, start, end, peer, canonical, group)
    return (COLL, start, end, -1, canonical, group)


def _global_peer(local: int, group: str, groups: Mapping[str, Group], rank: int) -> int:
    """A group-local peer rank -> global rank (the default group's ranks are global already)."""
    members = groups.get(group)
    if members is None or not (0 <= local < len(members.ranks)):
        return local
    return members.ranks[local]


def _gloo_spans(gloo: list, meta: list[dict], rank: int, groups: Mapping[str, Group],
                unmapped: collections.Counter) -> list[tuple[int, float, float, int, str, str]]:
    """gloo's own spans (`gloo:all_reduce` on a runloop thread, `gloo:send`/`gloo:recv`) with the group
    and peer of the c10d call that issued them (`record_param_comms`, matched in issue order per collective)."""
    issued: dict[str, list[dict]] = collections.defaultdict(list)
    for args in sorted(meta, key=lambda a: a["ts"]):
        canonical = _COLLECTIVES.get(str(args["Collective name"]).lower(), str(args["Collective name"]).lower())
        issued[canonical].append(args)
    taken: dict[str, int] = collections.Counter()
    out = []
    for name, start, end, _tid in sorted(gloo, key=lambda g: g[1]):
        canonical = _COLLECTIVES.get(name.lower())
        if canonical is None:
            unmapped[f"gloo:{name}"] += 1
            continue
        queue = issued.get(canonical, [])
        args = queue[taken[canonical]] if taken[canonical] < len(queue) else {}
        taken[canonical] += 1
        group = str(args.get("Process Group Name", ""))
        if canonical in ("send", "recv"):
            key = "Dst Rank" if canonical == "send" else "Src Rank"
            peer = _global_peer(int(args[key]), group, groups, rank) if key in args else -1
            out.append((SEND if canonical == "send" else RECV, start, end, peer, canonical, group))
        else:
            out.append((COLL, start, end, -1, canonical, group))
    return out


def _compute_spans(labels: list, gpu_labels: Mapping[str, list], comm: list) -> list[tuple[int, float, float, int, int]]:
    """(kind, start, end, mb, chunk) of each compute label: its GPU span when the trace has one
    (kernel time), else the CPU span with p2p waits nested at its edges cut off."""
    occurrences: dict[str, int] = collections.Counter()
    p2p = sorted((s, e, k) for k, s, e, *_ in comm if k in (SEND, RECV))
    p2p_start = np.array([s for s, _, _ in p2p]) if p2p else np.zeros(0)
    out = []
    for kind, start, end, mb, chunk, name in sorted(labels, key=lambda l: l[1]):
        index = occurrences[name]
        occurrences[name] += 1
        on_gpu = gpu_labels.get(name)
        if on_gpu is not None and index < len(on_gpu):
            gpu_start, gpu_end = on_gpu[index]
            out.append((kind, gpu_start, gpu_end, mb, chunk))
            continue
        lo, hi = np.searchsorted(p2p_start, start), np.searchsorted(p2p_start, end)
        compute_start, compute_end = start, end
        nested = p2p[lo:hi]
        for s, e, k in nested:             # waits at the front: the compute starts after them
            if k == RECV and e <= end and s - compute_start <= max(0.0, (end - start) * 0.5):
                compute_start = max(compute_start, e)
        for s, e, k in reversed(nested):   # sends at the back: the compute ended before them
            if k == SEND and s >= compute_start:
                compute_end = min(compute_end, s)
        out.append((kind, compute_start, max(compute_end, compute_start), mb, chunk))
    return out


def _rank_trace(path, rank, world, backend, groups, device, versions, steps, spans, comm, optimizer, unmapped) -> RankTrace:
    step_ids = np.array(sorted(steps), dtype=np.int64)
    step_start = np.array([steps[s][0] for s in step_ids])
    step_end = np.array([steps[s][1] for s in step_ids])
    rows = [(k, s, e, mb, ch, -1, "", "") for k, s, e, mb, ch in spans]
    rows += [(k, s, e, -1, -1, peer, coll, group) for k, s, e, peer, coll, group in comm]
    rows += [(OPT, s, e, -1, -1, -1, "", "") for s, e in optimizer]
    kind = np.array([r[0] for r in rows], dtype=np.int8)
    start = np.array([r[1] for r in rows], dtype=np.float64)
    end = np.array([r[2] for r in rows], dtype=np.float64)
    # a span belongs to the profiled step whose CPU span holds its start (GPU work launched late
    # in a step may run past the step's CPU span: it still starts before the next step ends)
    position = np.searchsorted(step_start, start, side="right") - 1
    inside = (position >= 0) & (start < np.append(step_start[1:], np.inf)[np.maximum(position, 0)])
    inside &= start <= step_end[np.maximum(position, 0)] + (0 if device == "cpu" else np.inf)
    step = np.where(inside, step_ids[np.maximum(position, 0)], -1)
    outside = int((~inside).sum())
    if outside:
        unmapped["outside a profiled step"] += outside
    return RankTrace(
        path=path, rank=rank, world=world, backend=backend, groups=groups, device=device, versions=versions,
        steps=step_ids, step_start=step_start, step_end=step_end,
        kind=kind, start=start, end=end, step=step,
        mb=np.array([r[3] for r in rows], dtype=np.int64), chunk=np.array([r[4] for r in rows], dtype=np.int64),
        peer=np.array([r[5] for r in rows], dtype=np.int64),
        coll=np.array([r[6] for r in rows], dtype=object), group=np.array([r[7] for r in rows], dtype=object),
        unmapped=unmapped,
    )


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
    parent = list(range(world))

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for trace in ranks:
        peers = trace.peer[(trace.kind == SEND) | (trace.kind == RECV)]
        for peer in np.unique(peers[(peers >= 0) & (peers < world)]).tolist():
            parent[root(peer)] = root(trace.rank)
    pipelines: dict[int, list[int]] = collections.defaultdict(list)
    for rank in range(world):
        pipelines[root(rank)].append(rank)
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


def _dp_groups(ranks: Sequence[RankTrace], layout: _Layout) -> set[str]:
    """pg_names of the groups whose members are exactly a stage's data-parallel ranks."""
    by_stage: dict[int, set[int]] = collections.defaultdict(set)
    for rank, (_, stage) in layout.worker.items():
        by_stage[stage].add(rank)
    wanted = {frozenset(members) for members in by_stage.values()}
    names = set()
    for trace in ranks:
        for group in trace.groups.values():
            if frozenset(group.ranks) in wanted:
                names.add(group.name)
    if layout.pp == 1:
        names.add("")   # old traces name no group: with no pipeline every collective is data-parallel
    return names


def _step_structure(trace: RankTrace, steps: np.ndarray) -> dict[int, tuple]:
    """Per step: counts of spans by kind (the step's op structure as far as kinds go)."""
    out = {}
    for step in steps.tolist():
        kinds = trace.kind[trace.step == step]
        out[step] = tuple(np.bincount(kinds, minlength=len(_KIND_NAMES)).tolist())
    return out


def _kept_steps(ranks: Sequence[RankTrace], job_id: str) -> tuple[np.ndarray, list[int]]:
    """Steps every analysed rank has complete (optimizer, forward and backward spans, the same
    structure as the rank's other steps); returns (kept, dropped)."""
    common = None
    union: set[int] = set()
    for trace in ranks:
        present = set(trace.steps.tolist())
        union |= present
        common = present if common is None else common & present
    if not common:
        spans = {t.rank: f"{t.steps.min()}..{t.steps.max()}" for t in ranks[:4]}
        raise RawInputError("raw_steps_misaligned", f"no ProfilerStep is common to all ranks (steps per rank: {spans}"
                            f"{' ...' if len(ranks) > 4 else ''})", job_id=job_id)
    candidates = np.array(sorted(common), dtype=np.int64)
    keep = np.ones(len(candidates), dtype=bool)
    for trace in ranks:
        structure = _step_structure(trace, candidates)
        counts = collections.Counter(structure.values())
        modal = counts.most_common(1)[0][0]
        for i, step in enumerate(candidates.tolist()):
            kinds = structure[step]
            if kinds != modal or not (kinds[FWD] and kinds[BWD] and kinds[OPT]):
                keep[i] = False
    kept = candidates[keep]
    dropped = sorted(union - set(kept.tolist()))
    if len(kept) < 2:
        raise RawInputError("raw_no_steps", f"{len(kept)} profiled step(s) complete on every rank (common steps "
                            f"{candidates.tolist()}); the analysis needs at least 2: profile more active steps",
                            job_id=job_id)
    return kept, dropped


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
    # collectives
    for i in np.flatnonzero(kind == COLL).tolist():
        name = coll[i]
        if group[i] in dp_groups:
            mapped = _DP_OPTYPE.get(name)
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


def _clock_offsets(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout) -> dict[int, float]:
    """Per-rank clock offsets (µs) that make the ends of matched comm ops coincide, least squares.

    Instances: each DP collective (step, stage, optype, its index) over the stage's DP ranks, and
    each p2p pair (forward-send k of stage s with forward-recv k of stage s+1, backward likewise).
    Offsets are relative to the lowest rank of each connected set of ranks, so a shift of one
    rank's clock moves its offset by exactly that shift: the result does not depend on it.
    """
    ranks = sorted(rows)
    index = {rank: i for i, rank in enumerate(ranks)}
    keys, members, ends = [], [], []
    for rank in ranks:
        r = rows[rank]
        dp, stage = layout.worker[rank]
        seq = _index_within(r["step"], r["optype"], r["start"])
        for code in (_CODE["grads-reduce-scatter"], _CODE["params-all-gather"], _CODE["separate-grads-all-reduce"]):
            hit = np.flatnonzero(r["optype"] == code)
            keys += [("dp", int(s), stage, code, int(k)) for s, k in zip(r["step"][hit], seq[hit])]
            members += [index[rank]] * len(hit)
            ends += r["end"][hit].tolist()
        for code, offset, name in ((_CODE["forward-send"], 0, "f"), (_CODE["forward-recv"], -1, "f"),
                                   (_CODE["backward-send"], -1, "b"), (_CODE["backward-recv"], 0, "b")):
            hit = np.flatnonzero(r["optype"] == code)
            boundary = stage + offset   # the stage boundary (s, s+1) the op crosses, named by its lower stage
            keys += [("p2p", name, dp, boundary, int(s), int(k)) for s, k in zip(r["step"][hit], seq[hit])]
            members += [index[rank]] * len(hit)
            ends += r["end"][hit].tolist()
    if not keys:
        return {rank: 0.0 for rank in ranks}
    _, instance = np.unique(np.array([repr(k) for k in keys]), return_inverse=True)
    member = np.array(members, dtype=np.int64)
    end = np.array(ends, dtype=np.float64)
    size = np.bincount(instance)
    shared = size[instance] > 1
    instance, member, end = instance[shared], member[shared], end[shared]
    if not len(instance):
        return {rank: 0.0 for rank in ranks}
    _, instance = np.unique(instance, return_inverse=True)
    size = np.bincount(instance).astype(np.float64)
    n = len(ranks)
    base = end.min()
    end = end - base
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
    # anchor each connected set of ranks at its lowest rank
    parent = list(range(n))

    def root(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    first = np.full(len(size), -1)
    for inst, m in zip(instance.tolist(), member.tolist()):
        if first[inst] < 0:
            first[inst] = m
        else:
            parent[root(m)] = root(int(first[inst]))
    anchor = {}
    for i in range(n):
        anchor.setdefault(root(i), i)
    return {rank: float(x[i] - x[anchor[root(i)]]) for i, rank in enumerate(ranks)}


def _index_within(step: np.ndarray, optype: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Index of each op among the same (step, optype) by start time."""
    from transforms.ingest.common import seq_ids

    return seq_ids(step, np.zeros_like(step), optype, start)


def _check_job(ranks: Sequence[RankTrace], job_id: str) -> int:
    """Duplicate ranks and ranks of another job; returns the world size."""
    seen: dict[int, str] = {}
    for trace in ranks:
        if trace.rank in seen:
            raise RawInputError("raw_duplicate_rank", f"rank {trace.rank} appears in {seen[trace.rank]} and {trace.path}",
                                job_id=job_id, path=trace.path)
        seen[trace.rank] = trace.path
    worlds = collections.Counter(t.world for t in ranks)
    if len(worlds) > 1:
        odd = min(ranks, key=lambda t: worlds[t.world])
        raise RawInputError("raw_mixed_jobs", f"world sizes differ ({dict(worlds)}); {odd.path} says {odd.world}",
                            job_id=job_id, path=odd.path)
    world = next(iter(worlds))
    for trace in ranks:
        if not 0 <= trace.rank < world:
            raise RawInputError("raw_mixed_jobs", f"rank {trace.rank} outside world size {world}", job_id=job_id, path=trace.path)
    defined: dict[str, tuple[int, ...]] = {}
    for trace in ranks:
        for group in trace.groups.values():
            if len(group.ranks) == world and defined.setdefault(f"world:{group.name}", group.ranks) != group.ranks:
                raise RawInputError("raw_mixed_jobs", f"process group {group.name!r} has ranks {group.ranks} here but "
                                    f"{defined[f'world:{group.name}']} in another file", job_id=job_id, path=trace.path)
    return world


def assemble(ranks: Sequence[RankTrace], job_id: str, date: str, options: Mapping[str, Any] | None = None,
             files: int | None = None) -> ConvertedJob:
    """The parsed ranks of one job -> ConvertedJob (op rows, manifest, source). RawInputError on bad input."""
    options = options or {}
    if not ranks:
        raise RawInputError("raw_missing_rank", "no rank trace in the window", job_id=job_id)
    world = _check_job(ranks, job_id)
    layout = _layout(ranks, world, options, job_id)
    by_rank = {t.rank: t for t in ranks}
    missing = sorted(set(layout.worker) - set(by_rank))
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise RawInputError("raw_missing_rank", f"{len(missing)} of the {len(layout.worker)} ranks the analysis needs "
                            f"(dp {layout.dp} x pp {layout.pp}, layout from {layout.how}) have no trace: ranks {shown}; "
                            f"found {len(by_rank)} file(s) of world size {world}", job_id=job_id)
    analysed = [by_rank[rank] for rank in sorted(layout.worker)]
    steps, dropped = _kept_steps(analysed, job_id)
    dp_groups = _dp_groups(ranks, layout)
    unmapped: collections.Counter = collections.Counter()
    for trace in ranks:
        unmapped.update(trace.unmapped)
    rows = {t.rank: _ops_of_rank(t, layout.worker[t.rank][1], layout, steps, dp_groups, job_id, unmapped) for t in analysed}
    collapsed = len(ranks) - len(analysed)
    offsets = {rank: 0.0 for rank in rows} if options.get("clock") == "trust" else _clock_offsets(rows, layout)
    base = min(float(r["start"].min() - offsets[rank]) for rank, r in rows.items() if len(r["start"]))
    columns: dict[str, list] = collections.defaultdict(list)
    for rank, r in rows.items():
        dp, stage = layout.worker[rank]
        n = len(r["step"])
        start = (r["start"] - offsets[rank] - base) * 1e-6
        columns["dp_rank"].append(np.full(n, dp))
        columns["stage"].append(np.full(n, stage))
        columns["rank"].append(np.full(n, rank))
        columns["step"].append(r["step"])
        columns["optype"].append(r["optype"])
        columns["start_ts"].append(start)
        columns["duration"].append(np.maximum(r["end"] - r["start"], 0.0) * 1e-6)
        columns["mb_id"].append(r["mb_id"])
        columns["mc"].append(r["mc"])
        columns["gmc"].append(r["gmc"])
    hosts = options.get("hosts")
    host_of = {rank: str(hosts[rank]) for rank in rows} if isinstance(hosts, list) and len(hosts) >= world else {}
    if host_of:
        columns["host"] = [np.full(len(rows[rank]["step"]), host_of[rank], dtype=object) for rank in rows]
    trace = build_trace(job_id, **{name: np.concatenate(parts) for name, parts in columns.items()})
    vpp = int(trace.column("mc").to_numpy().max()) + 1 if trace.num_rows else 1
    if "vpp_size" in options and int(options["vpp_size"]) != vpp:
        raise RawInputError("raw_layout_unknown", f"job.yaml vpp_size {options['vpp_size']} but the labels show {vpp} "
                            "model chunk(s) per stage", job_id=job_id)
    first = analysed[0]
    manifest = build_manifest(
        job_id, date, trace, dp_size=layout.dp, pp_size=layout.pp, tp_size=layout.tp, cp_size=layout.cp, vpp_size=vpp,
        world_size=world, worker_rank=layout.rank_of(),
        worker_host={cell: host_of[rank] for cell, rank in layout.rank_of().items()} if host_of else None,
        start_time=_start_time(options), model_family=str(options.get("model_family", "unknown")),
        context_length=int(options.get("context_length", 0)), gpu_hours_scale=float(options.get("gpu_hours_scale", 1.0)),
    )
    source = {
        "format": "kineto",
        "profiler": "torch.profiler (Kineto)",
        "version": {k: v for k, v in first.versions.items() if v is not None},
        "device": first.device,
        "backend": first.backend,
        "ranks": len(ranks),
        "world_size": world,
        "files": files if files is not None else len(ranks),
        "analysed_ranks": len(analysed),
        "tp_cp_collapsed": collapsed,
        "layout": layout.how,
        "steps": steps.tolist(),
        "steps_dropped": dropped,
        "clock": "trust" if options.get("clock") == "trust" else "align",
        "clock_offset_max_s": max(abs(v) for v in offsets.values()) * 1e-6 if offsets else 0.0,
        "unmapped": dict(sorted(unmapped.items())),
    }
    return ConvertedJob(job_id, trace, manifest, source)


def _start_time(options: Mapping[str, Any]):
    import datetime as dt

    value = options.get("start_time")
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    try:
        parsed = dt.datetime.fromisoformat(str(value))
    except ValueError:
        raise RawInputError("raw_bad_job_yaml", f"start_time {value!r} is not an ISO timestamp") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def convert_kineto(paths: Sequence[str], job_id: str, date: str, options: Mapping[str, Any] | None = None,
                   *, workers: int = 1) -> ConvertedJob:
    """Convert one job's per-rank torch.profiler traces (URLs) -> ConvertedJob.

    workers > 1 parses rank files in that many processes (big jobs on a machine of their own).
    OSError while reading a file propagates (infrastructure); bad content raises RawInputError.
    """
    from transforms.ingest import read_raw_file

    options = dict(options or {})
    if not paths:
        raise RawInputError("raw_missing_rank", "no trace file (*.json or *.json.gz) in the window", job_id=job_id)
    if workers > 1 and len(paths) > 1:
        import concurrent.futures

        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            ranks = list(pool.map(_parse_path, paths, [options] * len(paths)))
    else:
        ranks = [parse_rank_bytes(path, read_raw_file(path), options) for path in paths]
    return assemble(ranks, job_id, date, options, files=len(paths))


def _parse_path(path: str, options: Mapping[str, Any]) -> RankTrace:
    from transforms.ingest import read_raw_file

    return parse_rank_bytes(path, read_raw_file(path), options)
