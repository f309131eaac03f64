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
- clocks: a rank's times are `baseTimeNanoseconds` + ts; ranks of one host (`host_name`) share
  a clock, and between hosts offsets are estimated so that the ends of matched collectives and
  p2p pairs coincide (least squares). A shift of one host's clock then changes nothing: the
  analysis depends on durations, each rank's order of ops, and where matched ops end (exact when
  they end together, else within their spread). job.yaml `clock: trust` keeps the recorded
  clocks, `clock: align` gives every rank its own.
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
    """One rank's spans (times in µs after `origin_ns` on the rank's own clock), before the job is assembled.

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
    host: str | None = None      # the trace's host_name, when torch wrote it
    clock: str = ""              # ranks with equal clock keys share one clock (their host)
    origin_ns: int = 0           # recorded instant of time 0 of the span columns (baseTimeNanoseconds + first ts)

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
    import gc

    # a trace decodes into millions of small dicts: the cyclic collector would rescan them over and
    # over (74% of the decode time on 30 MB files, benchmarks/bench_ingest.py); none of them cycle
    enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            document = _loads(open_bytes(data))
        except (ValueError, EOFError, OSError) as error:   # JSON decode error, truncated or broken gzip
            raise RawInputError("raw_unreadable", f"not a complete JSON document ({type(error).__name__}: {error})",
                                path=path) from None
        return parse_rank(path, document, options)
    finally:
        if enabled:
            gc.enable()


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
    step_tid = None
    cpu_labels: list[tuple[int, float, float, int, int, str]] = []   # kind, start, end, mb, chunk, name
    gpu_labels: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    comm: list[tuple[int, float, float, int, str, str]] = []          # kind, start, end, peer, coll, group
    comm_meta: list[dict] = []                                      # record_param_comms args, in time order
    gloo_cpu: list[tuple[str, float, float, int]] = []               # name, start, end, tid
    c10d_p2p: list[tuple[str, float, float, int]] = []               # c10d::send / recv_: name, start, end, local peer
    cpu_ops: list[tuple[float, float, str, object]] = []             # every cpu_op / user_annotation: start, end, name, tid
    optimizer: list[tuple[float, float]] = []
    kernels = 0
    origin = None   # times are kept relative to it (µs), so durations stay exact
    for event in document["traceEvents"]:
        if event.get("ph") != "X":
            continue
        name = event.get("name", "")
        cat = event.get("cat", "")
        ts = event.get("ts")
        dur = event.get("dur")
        if ts is None or dur is None:
            continue
        if origin is None:   # a whole 2^32 µs (72 min): the same for any event order
            origin = float(np.floor(float(ts) / 2.0 ** 32) * 2.0 ** 32)
        ts = float(ts) - origin
        end = ts + float(dur)
        if cat == "kernel":
            kernels += 1
            if name.startswith(_NCCL):
                args = event.get("args") or {}
                comm.append(_nccl_span(name, args, ts, end, rank, groups))
            continue
        if cat not in ("user_annotation", "cpu_op", "gpu_user_annotation"):
            continue
        if cat == "gpu_user_annotation":
            if not name.startswith("ProfilerStep#"):
                gpu_labels[name].append((ts, end))
            continue
        cpu_ops.append((ts, end, name, event.get("tid")))
        step = _STEP.match(name)
        if step:
            steps[int(step.group(1))] = (ts, end)
            step_tid = event.get("tid")
            continue
        if name.startswith("gloo:"):
            gloo_cpu.append((name[5:], ts, end, event.get("tid")))
            continue
        if name.startswith("c10d::send") or name.startswith("c10d::recv"):
            inputs = (event.get("args") or {}).get("Concrete Inputs") or []
            peer = inputs[2] if len(inputs) > 2 and str(inputs[2]).lstrip("-").isdigit() else -1
            c10d_p2p.append(("send" if name.startswith("c10d::send") else "recv", ts, end, int(peer)))
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
            elif not _UNMAPPED_QUIET.match(name):
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
        comm += _gloo_spans(gloo_cpu, comm_meta, c10d_p2p, rank, groups, unmapped)
    kinds = {label[0] for label in cpu_labels}
    if kinds != {FWD, BWD}:
        # no (or only forward) schedule labels: microbatches from the main thread's op runs
        main = [op for op in cpu_ops if op[3] == step_tid]
        cpu_labels = [label for label in cpu_labels if label[0] in kinds] + _unlabeled_compute(
            main, sorted(steps.values()), optimizer, forward=FWD not in kinds)
    spans = _compute_spans(cpu_labels, gpu_labels if kernels else {}, comm)
    trace = _rank_trace(path, rank, world, str(info.get("backend") or ""), groups, device, versions, steps, spans,
                        comm, optimizer, unmapped)
    host = document.get("host_name") or info.get("host_name")
    trace.host = str(host) if host else None
    # Kineto's ts are µs after baseTimeNanoseconds: the recorded instant of time 0 of this rank, in ns
    base = document.get("baseTimeNanoseconds")
    trace.origin_ns = (int(base) if isinstance(base, (int, float)) else 0) + round((origin or 0.0) * 1000)
    # one clock per host; without a host name every rank counts as its own clock
    trace.clock = f"host:{host}" if host else f"rank:{rank}"
    return trace


# Labels torch emits that are neither compute nor communication of the step (counted nowhere).
_UNMAPPED_QUIET = re.compile(r"^(Optimizer\.zero_grad#|## |enumerate\(DataLoader\)|PP:\d*(RECV|SEND|WAIT|REDUCE))")
_BACKWARD_OP = "autograd::engine::evaluate_function:"
# Ops that end a run of compute on the main thread: p2p, labels, the optimizer.
_RUN_BREAK = ("c10d::send", "c10d::recv", "gloo:send", "gloo:recv", "c10d::batch_isend_irecv", "Optimizer.")
# Ops that neither compute nor break a run (collective issue calls inside DDP's backward hooks).
_RUN_NEUTRAL = ("c10d::", "gloo:", "record_param_comms", "nccl:")


def _unlabeled_compute(ops: list, steps: list[tuple[float, float]], optimizer: list, *, forward: bool) -> list:
    """Per-microbatch compute spans of a trace without schedule labels (torch.distributed.pipelining's
    Schedule1F1B, plain DDP), from the main thread's top-level ops in each step: a run of
    `autograd::engine::evaluate_function:` ops is one microbatch's backward, a run of other ops
    between p2p calls is a forward when a backward run follows it in the step (trailing grad-sync
    copies are not); runs shorter than a tenth of the step's median backward run are bookkeeping
    between p2p calls, not compute, and of more forward runs than backward ones the longest are the
    forwards. Returns label tuples (kind, start, end, mb=-1, chunk=-1, name)."""
    ops = sorted(ops, key=lambda op: (op[0], -op[1]))
    out = []
    for step_start, step_end in steps:
        runs: list[list] = []            # [kind, start, end]
        stack: list[float] = []          # ends of open ancestors below the step span
        current = None
        for start, end, name, _ in ops:
            if start < step_start or start > step_end or (start == step_start and _STEP.match(name)):
                continue
            if name.startswith("gloo:"):
                # gloo's p2p spans are asynchronous: they stay open until the schedule waits on
                # them, over the compute issued meanwhile; only their start breaks a run
                if name.startswith(("gloo:send", "gloo:recv")):
                    current = None
                continue
            while stack and stack[-1] <= start:
                stack.pop()
            depth = len(stack)
            stack.append(end)
            if depth:
                continue                 # inside a top-level op of the step
            if name.startswith(_RUN_BREAK) or _STEP.match(name) or any(s <= start < e for s, e in optimizer):
                current = None
                continue
            if name.startswith(_RUN_NEUTRAL):
                continue
            kind = BWD if name.startswith(_BACKWARD_OP) else FWD
            if current is not None and current[0] == kind:
                current[2] = max(current[2], end)
            else:
                current = [kind, start, end]
                runs.append(current)
        backward = [end - start for kind, start, end in runs if kind == BWD]
        # bookkeeping between p2p calls (splitting inputs, allocating buffers) makes runs of
        # microseconds; a microbatch's compute is a sizeable share of a backward
        floor = 0.1 * float(np.median(backward)) if backward else 0.0
        runs = [run for run in runs if run[2] - run[1] >= floor]
        last_backward = max((i for i, run in enumerate(runs) if run[0] == BWD), default=-1)
        forwards = [i for i, run in enumerate(runs) if run[0] == FWD and i < last_backward]
        if len(forwards) > len(backward):
            # every microbatch has one forward and one backward: the longest runs are the forwards,
            # the rest is bookkeeping the OS stretched (splitting inputs, allocating recv buffers)
            forwards = sorted(sorted(forwards, key=lambda i: runs[i][1] - runs[i][2])[:len(backward)])
        for i, (kind, start, end) in enumerate(runs):
            if kind == BWD:
                out.append((BWD, start, end, -1, -1, "autograd backward"))
            elif forward and i in forwards:
                out.append((FWD, start, end, -1, -1, "forward ops"))
    return out


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


def _gloo_spans(gloo: list, meta: list[dict], c10d: list, rank: int, groups: Mapping[str, Group],
                unmapped: collections.Counter) -> list[tuple[int, float, float, int, str, str]]:
    """gloo's own spans (`gloo:all_reduce` on a runloop thread, `gloo:send` / `gloo:recv` inside the
    c10d call that issued them), with the group and peer of that call: from `record_param_comms`
    where the trace has it, else (CPU traces) the c10d call's `Concrete Inputs` (the group-local
    peer, read in the rank's pipeline group). A p2p op spans its c10d call and its gloo span."""
    issued: dict[str, list[dict]] = collections.defaultdict(list)
    for args in sorted(meta, key=lambda a: a["ts"]):
        canonical = _COLLECTIVES.get(str(args["Collective name"]).lower(), str(args["Collective name"]).lower())
        issued[canonical].append(args)
    calls = {kind: sorted(op for op in c10d if op[0] == kind) for kind in ("send", "recv")}
    pipeline = next((g for g in groups.values() if g.dims() == {"pp"} and rank in g.ranks), None)
    taken: dict[str, int] = collections.Counter()
    out = []
    for name, start, end, _tid in sorted(gloo, key=lambda g: g[1]):
        canonical = _COLLECTIVES.get(name.lower())
        if canonical is None:
            unmapped[f"gloo:{name}"] += 1
            continue
        queue = issued.get(canonical, [])
        args = queue[taken[canonical]] if taken[canonical] < len(queue) else {}
        position = taken[canonical]
        taken[canonical] += 1
        group = str(args.get("Process Group Name", ""))
        if canonical in ("send", "recv"):
            key = "Dst Rank" if canonical == "send" else "Src Rank"
            peer = _global_peer(int(args[key]), group, groups, rank) if key in args else -1
            call = calls[canonical][position] if position < len(calls[canonical]) else None
            if call is not None and call[1] <= start + 1.0:
                start, end = call[1], max(end, call[2])
                if peer < 0 and call[3] >= 0:
                    peer = pipeline.ranks[call[3]] if pipeline and call[3] < len(pipeline.ranks) else call[3]
            out.append((SEND if canonical == "send" else RECV, start, end, peer, canonical, group))
        else:
            out.append((COLL, start, end, -1, canonical, group))
    return out


def _compute_spans(labels: list, gpu_labels: Mapping[str, list], comm: list) -> list[tuple[int, float, float, int, int]]:
    """(kind, start, end, mb, chunk) of each compute label: its GPU span when the trace has one
    (kernel time), else the CPU span with p2p waits nested at its edges cut off."""
    next_gpu: dict[str, int] = collections.Counter()
    gpu_sorted = {name: sorted(spans) for name, spans in gpu_labels.items()}
    p2p = sorted((s, e, k) for k, s, e, *_ in comm if k in (SEND, RECV))
    p2p_start = np.array([s for s, _, _ in p2p]) if p2p else np.zeros(0)
    out = []
    for kind, start, end, mb, chunk, name in sorted(labels, key=lambda l: l[1]):
        # the label's GPU span: the next one of that name starting after the CPU label did (GPU work
        # follows its launch), so a span the profiler dropped costs only its own step
        on_gpu = gpu_sorted.get(name, ())
        position = next_gpu[name]
        while position < len(on_gpu) and on_gpu[position][0] < start:
            position += 1
        if position < len(on_gpu):
            next_gpu[name] = position + 1
            gpu_start, gpu_end = on_gpu[position]
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
    for trace in ranks:
        in_common = np.isin(trace.step, candidates)
        for kind in (FWD, BWD):
            if not ((trace.kind == kind) & in_common).any():
                raise RawInputError("raw_no_microbatches", f"rank {trace.rank} has no {_KIND_NAMES[kind]} compute in "
                                    "its profiled steps: the schedule's labels were not recognised (set forward_label "
                                    "/ backward_label in job.yaml) and its main thread shows no "
                                    + ("forward ops between p2p calls" if kind == FWD else "autograd backward ops"),
                                    job_id=job_id, path=trace.path)
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


def _p2p_pairs(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout) -> list[tuple[int, int, int, int]]:
    """(send rank, send row, recv rank, recv row) of every p2p pair: forward-send k of (dp, stage s)
    with forward-recv k of (dp, s+1), backward-send k of (dp, s) with backward-recv k of (dp, s-1),
    k counting within the step (the engine pairs them the same way)."""
    rank_of = layout.rank_of()
    pairs = []
    for send, recv, direction in (("forward-send", "forward-recv", 1), ("backward-send", "backward-recv", -1)):
        for rank, r in rows.items():
            dp, stage = layout.worker[rank]
            peer = rank_of.get((dp, stage + direction))
            if peer is None or peer not in rows:
                continue
            p = rows[peer]
            mine = np.flatnonzero(r["optype"] == _CODE[send])
            theirs = np.flatnonzero(p["optype"] == _CODE[recv])
            mine = mine[np.lexsort((r["start"][mine], r["step"][mine]))]
            theirs = theirs[np.lexsort((p["start"][theirs], p["step"][theirs]))]
            for step in np.intersect1d(r["step"][mine], p["step"][theirs]).tolist():
                a, b = mine[r["step"][mine] == step], theirs[p["step"][theirs] == step]
                pairs += [(rank, int(i), peer, int(j)) for i, j in zip(a, b)]
    return pairs


def _check_comm_pairs(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout, job_id: str) -> None:
    """Every step's comm ops must pair up across ranks: each DP collective type as many times on
    every DP rank of a stage, each forward-send of stage s with a forward-recv of stage s+1 (and
    backward likewise). Raises raw_unmatched_comm naming the ranks, step and op type."""
    rank_of = layout.rank_of()

    def counts(rank: int, code: int) -> dict[int, int]:
        r = rows[rank]
        steps, n = np.unique(r["step"][r["optype"] == code], return_counts=True)
        return dict(zip(steps.tolist(), n.tolist()))

    steps = sorted(set(np.concatenate([r["step"] for r in rows.values()]).tolist()))
    for code in (_CODE["grads-reduce-scatter"], _CODE["params-all-gather"], _CODE["separate-grads-all-reduce"]):
        for stage in range(layout.pp):
            members = [rank_of[(d, stage)] for d in range(layout.dp) if (d, stage) in rank_of]
            per_rank = {rank: counts(rank, code) for rank in members}
            for step in steps:
                seen = {rank: per_rank[rank].get(step, 0) for rank in members}
                if len(set(seen.values())) > 1:
                    raise RawInputError("raw_unmatched_comm", f"step {step}, stage {stage}: {OPTYPES[code]} ops per DP "
                                        f"rank differ ({', '.join(f'rank {r}: {n}' for r, n in seen.items())}); every "
                                        "DP rank issues the same collectives", job_id=job_id, op=OPTYPES[code])
    for send, recv, direction in (("forward-send", "forward-recv", 1), ("backward-send", "backward-recv", -1)):
        for (dp, stage), rank in rank_of.items():
            peer = rank_of.get((dp, stage + direction))
            if peer is None:
                continue
            sent, received = counts(rank, _CODE[send]), counts(peer, _CODE[recv])
            for step in steps:
                if sent.get(step, 0) != received.get(step, 0):
                    vpp = max(int(r["mc"].max()) + 1 if len(r["mc"]) else 1 for r in rows.values())
                    hint = (f"; an interleaved schedule (vpp {vpp}): its asynchronous p2p ops cannot be told apart by "
                            "direction yet, profile a non-interleaved schedule" if vpp > 1 else "")
                    raise RawInputError("raw_unmatched_comm", f"step {step}: rank {rank} (stage {stage}) has "
                                        f"{sent.get(step, 0)} {send} ops but rank {peer} (stage {stage + direction}) "
                                        f"{received.get(step, 0)} {recv} ops{hint}", job_id=job_id, op=send)


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
    component = _components(n, [(first_member[inst], m) for inst, m in zip(instance.tolist(), member.tolist())])
    anchor = {}
    for i in range(n):
        anchor.setdefault(component[i], i)
    return {rank: float(x[index[rank]] - x[anchor[component[index[rank]]]]) for rank in ranks}


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


def _clip_p2p_waits(rows: Mapping[int, dict[str, np.ndarray]], layout: _Layout, offsets: Mapping[int, float]) -> int:
    """Cut the idle waits off both ends of every p2p pair (clocks aligned by `offsets`, µs).

    - A recv posted before its peer's send started waits idle: it starts with the send. Transfer
      times (end - latest start of the pair) do not change; the step's observed span no longer
      counts a stage idling on its first recv while the previous stage still finishes the
      previous step (pipelines without a global sync at the step's end drift apart).
    - An asynchronous send (gloo's isend) stays open until the schedule waits on it, often after
      the data arrived: it ends when its recv ended. Otherwise the send chain of the dependency
      model would serialise sends that overlapped.
    Returns the number of ops changed."""
    changed = 0
    for send_rank, i, recv_rank, j in _p2p_pairs(rows, layout):
        send, recv = rows[send_rank], rows[recv_rank]
        shift = offsets[recv_rank] - offsets[send_rank]   # send clock -> recv clock
        send_start = send["start"][i] + shift
        if send_start > recv["start"][j]:
            recv["start"][j] = min(send_start, recv["end"][j])
            changed += 1
        recv_end = recv["end"][j] - shift                  # recv clock -> send clock
        if send["end"][i] > recv_end:
            send["end"][i] = max(send["start"][i], recv_end)
            changed += 1
    return changed


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
    # ranks sharing a clock (one host) ran their profiled steps at the same time, give or take the
    # drift of a pipeline: a rank whose steps ran minutes away from the others' belongs to another run
    by_clock: dict[str, list[RankTrace]] = collections.defaultdict(list)
    for trace in ranks:
        if trace.host:
            by_clock[trace.clock].append(trace)
    for members in by_clock.values():
        if len(members) < 2:
            continue
        spans = {t.rank: (t.origin_ns / 1e3 + t.step_start.min(), t.origin_ns / 1e3 + t.step_end.max()) for t in members}
        for trace in members:
            start, end = spans[trace.rank]
            others = [span for rank, span in spans.items() if rank != trace.rank]
            slack = max(end - start, 1e6)   # µs: a whole profiled window (at least a second) of drift
            if not any(o_start - slack <= end and start <= o_end + slack for o_start, o_end in others):
                import datetime as dt

                when = dt.datetime.fromtimestamp(start / 1e6, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
                raise RawInputError("raw_mixed_jobs", f"rank {trace.rank} profiled its steps at {when} UTC on host "
                                    f"{trace.host}, away from the other ranks of that host: a trace of another run",
                                    job_id=job_id, path=trace.path)
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
        raise RawInputError("raw_missing_rank", f"no readable rank trace in the window ({files or 0} file(s))", job_id=job_id)
    world = _check_job(ranks, job_id)
    layout = _layout(ranks, world, options, job_id)
    by_rank = {t.rank: t for t in ranks}
    missing = sorted(set(layout.worker) - set(by_rank))
    if len(layout.worker) < layout.dp * layout.pp:
        # the groups of the traces present do not place every worker: the absent ranks would
        missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise RawInputError("raw_missing_rank", f"{len(missing)} rank(s) the analysis needs have no trace: ranks {shown} "
                            f"(dp {layout.dp} x pp {layout.pp} workers, layout from {layout.how}); found "
                            f"{len(by_rank)} readable rank file(s) of world size {world}", job_id=job_id)
    analysed = [by_rank[rank] for rank in sorted(layout.worker)]
    steps, dropped = _kept_steps(analysed, job_id)
    described = any(g.dims() == {"dp"} for t in ranks for g in t.groups.values())
    unmapped: collections.Counter = collections.Counter()
    for trace in ranks:
        unmapped.update(trace.unmapped)
    rows = {t.rank: _ops_of_rank(t, layout.worker[t.rank][1], layout, steps, _dp_groups(t, layout, described), job_id,
                                 unmapped) for t in analysed}
    _check_comm_pairs(rows, layout, job_id)
    first_origin = min(by_rank[rank].origin_ns for rank in rows)
    for rank, r in rows.items():   # every rank on the recorded clock, µs after the earliest origin
        shift = (by_rank[rank].origin_ns - first_origin) / 1000.0
        r["start"], r["end"] = r["start"] + shift, r["end"] + shift
    collapsed = len(ranks) - len(analysed)
    clock = options.get("clock", "auto")
    clock_of = {rank: (by_rank[rank].clock if clock == "auto" else f"rank:{rank}") for rank in rows}
    offsets = {rank: 0.0 for rank in rows} if clock == "trust" else _clock_offsets(rows, layout, clock_of)
    p2p_clipped = _clip_p2p_waits(rows, layout, offsets)
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
    if isinstance(hosts, list) and len(hosts) >= world:
        host_of = {rank: str(hosts[rank]) for rank in rows}
    elif all(by_rank[rank].host for rank in rows):   # torch >= 2.13 writes the host's name
        host_of = {rank: str(by_rank[rank].host) for rank in rows}
    else:
        host_of = {}
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
        start_time=_start_time(options) or _recorded_start(first_origin, base), model_family=str(options.get("model_family", "unknown")),
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
        "clock": clock,
        "clocks": len(set(clock_of.values())) if clock != "trust" else 1,
        "clock_offset_max_s": max(abs(v) for v in offsets.values()) * 1e-6 if offsets else 0.0,
        "clock_offsets_s": {key: offsets[rank] * 1e-6 for rank, key in sorted(clock_of.items()) if offsets[rank]},
        "p2p_waits_clipped": p2p_clipped,
        "unmapped": dict(sorted(unmapped.items())),
    }
    return ConvertedJob(job_id, trace, manifest, source)


def _recorded_start(origin_ns: int, offset_us: float):
    """The wall-clock instant `offset_us` after `origin_ns` (baseTimeNanoseconds + first ts) when it is
    a plausible date (torch writes the epoch there; some traces do not), else None."""
    import datetime as dt

    seconds = origin_ns / 1e9 + offset_us * 1e-6
    if not 946684800 <= seconds <= 4102444800:   # 2000-01-01 .. 2100-01-01
        return None
    return dt.datetime.fromtimestamp(round(seconds, 6), tz=dt.timezone.utc)


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

    A file that is not a readable trace (`raw_unreadable`, `raw_not_a_trace`) is set aside in
    `ConvertedJob.rejected` and the job is assembled from the others; when that fails too (a rank
    is then missing), the RawInputError raised carries the set-aside files in `.rejected`.
    workers > 1 parses rank files in that many processes (big jobs on a machine of their own).
    OSError while reading a file propagates (infrastructure); bad content raises RawInputError.
    """
    options = dict(options or {})
    if not paths:
        raise RawInputError("raw_missing_rank", "no trace file (*.json or *.json.gz) in the window", job_id=job_id)
    if workers > 1 and len(paths) > 1:
        import concurrent.futures

        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            parsed = list(pool.map(_parse_path, paths, [options] * len(paths)))
    else:
        parsed = [_parse_path(path, options) for path in paths]
    ranks = [item for item in parsed if isinstance(item, RankTrace)]
    rejected = [item.with_job(job_id) for item in parsed if not isinstance(item, RankTrace)]
    try:
        converted = assemble(ranks, job_id, date, options, files=len(paths))
    except RawInputError as error:
        error.rejected = rejected
        raise
    converted.rejected = rejected
    if rejected:
        converted.source["files_rejected"] = {error.path: error.reason_code for error in rejected}
    return converted


def _parse_path(path: str, options: Mapping[str, Any]) -> RankTrace | RawInputError:
    """One rank file by URL -> RankTrace, or the file-level RawInputError that sets it aside
    (job-level errors, e.g. a bad job.yaml regex, and OSError propagate)."""
    from transforms.ingest import read_raw_file

    try:
        return parse_rank_bytes(path, read_raw_file(path), options)
    except RawInputError as error:
        if error.level != "file":
            raise
        return error
