"""Pass 1: one rank's Kineto JSON -> `RankTrace` (events scanned once, compute and comm spans, steps)."""
from __future__ import annotations

import collections
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from transforms.ingest.common import RawInputError, open_bytes
from transforms.ingest.kineto.compute import (_BACKWARD_OP, _NOT_COMPUTE, _UNMAPPED_QUIET, _GpuWork, _compute_spans,
                                             _unlabeled_compute)
from transforms.ingest.kineto.spans import (BWD, COLL, DEFAULT_BACKWARD_LABELS, DEFAULT_FORWARD_LABELS,
                                            DEFAULT_OPTIMIZER_LABEL, FWD, Group, OPT, RECV, RankTrace, SEND,
                                            WEIGHT_LABEL, WGT, _COLLECTIVES, _NCCL, _STEP)


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
    comm: list[tuple[int, float, float, int, str, str, int]] = []          # kind, start, end, peer, coll, group, local peer
    comm_meta: list[dict] = []                                      # record_param_comms args, in time order
    gloo_cpu: list[tuple[str, float, float, int]] = []               # name, start, end, tid
    c10d_p2p: list[tuple[str, float, float, int]] = []               # c10d::send / recv_: name, start, end, local peer
    cpu_ops: list[tuple[float, float, str, object]] = []             # every cpu_op / user_annotation: start, end, name, tid
    optimizer: list[tuple[float, float]] = []
    p2p_labels: list[tuple[float, float, int, int]] = []              # start, end, direction (+1 F, -1 B), stage
    overlapped: list[tuple[float, float, str, str]] = []              # OVERLAP_F_B labels: start, end, actions, name
    launches: list[tuple[float, int]] = []                           # CUDA runtime / driver calls: start, correlation
    gpu_work: list[tuple[int, float, float]] = []                    # kernels, memcpy, memset (not NCCL): correlation, start, end
    annotations: set[tuple[float, str]] = set()                      # user_annotation ranges: start, name
    kernels = 0
    launch_tid: dict[int, tuple[float, object]] = {}                # correlation -> (launch start, thread)
    unnamed: list[tuple[int, int]] = []                              # NCCL kernels without a collective name: (comm index, correlation)
    origin = None   # times are kept relative to it (µs), so durations stay exact
    flow_starts: list[float] = []                                   # fwdbwd flow starts: forward ops autograd recorded
    flow_ends: list[float] = []                                     # ... and their backward nodes
    for event in document["traceEvents"]:
        if event.get("ph") != "X":
            if event.get("cat") == "fwdbwd" and event.get("ts") is not None:
                if event.get("ph") == "s":
                    flow_starts.append(float(event["ts"]))
                elif event.get("ph") == "f":
                    flow_ends.append(float(event["ts"]))
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
        if cat in ("cuda_runtime", "cuda_driver"):
            correlation = (event.get("args") or {}).get("correlation")
            if correlation is not None:
                launches.append((ts, int(correlation)))
                launch_tid[int(correlation)] = (ts, event.get("tid"))
            continue
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels += cat == "kernel"
            args = event.get("args") or {}
            if name.startswith(_NCCL):
                if "Collective name" not in args and args.get("correlation") is not None:
                    unnamed.append((len(comm), int(args["correlation"])))
                comm.append(_nccl_span(name, args, ts, end, rank, groups))
            elif args.get("correlation") is not None:
                gpu_work.append((int(args["correlation"]), ts, end))
            continue
        if cat not in ("user_annotation", "cpu_op", "gpu_user_annotation"):
            continue
        if cat == "gpu_user_annotation":
            if not name.startswith("ProfilerStep#"):
                gpu_labels[name].append((ts, end))
            continue
        cpu_ops.append((ts, end, name, event.get("tid")))
        if cat == "user_annotation":
            annotations.add((ts, name))
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
            elif (weight := WEIGHT_LABEL.match(name)) is not None:
                cpu_labels.append((WGT, ts, end, int(weight.group("mb")), int(weight.group("stage")), name))
            elif (overlap := _OVERLAP_LABEL.match(name)) is not None:
                overlapped.append((ts, end, overlap.group("actions"), name))
            elif (p2p_label := _P2P_LABEL.match(name)) is not None:
                p2p_labels.append((ts, end, 1 if p2p_label.group("dir") == "F" else -1, int(p2p_label.group("stage"))))
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
    if unnamed:
        _name_from_launch(comm, unnamed, launch_tid, cpu_ops)
    if not kernels:
        comm += _gloo_spans(gloo_cpu, comm_meta, c10d_p2p, rank, groups, unmapped)
    main = [op for op in cpu_ops if op[3] == step_tid]
    # the autograd engine runs a GPU job's backward on threads of its own: its top-level
    # `evaluate_function` ops are the backward work the main thread waits for meanwhile
    backward_elsewhere = [op for op in cpu_ops if op[3] != step_tid and op[2].startswith(_BACKWARD_OP)]
    if overlapped:
        cpu_labels += _split_overlapped(overlapped, cpu_ops, path)
    kinds = {label[0] for label in cpu_labels} & {FWD, BWD}
    autograd = np.sort(np.array(flow_starts) - (origin or 0.0))   # on the span columns' time axis
    if kinds != {FWD, BWD}:
        # no (or only forward) schedule labels: microbatches from the main thread's op runs
        # with the backward on another thread, the main thread's record_function ranges (`## backward ##`)
        # span work they do not hold: they are labels, not ops, and what they hold is
        ops = main if not backward_elsewhere else \
            [op for op in main if (op[0], op[2]) not in annotations or _STEP.match(op[2])] + backward_elsewhere
        cpu_labels = [label for label in cpu_labels if label[0] in kinds] + _unlabeled_compute(
            ops, sorted(steps.values()), optimizer, forward=FWD not in kinds, autograd=autograd)
    on_gpu = _GpuWork(launches, gpu_work) if kernels else None
    spans = _compute_spans(cpu_labels, gpu_labels if kernels else {}, comm, main, on_gpu)
    if on_gpu is not None:   # the optimizer's time is its kernels' too: one clock for a step's ops
        optimizer = [on_gpu.span(s, e) or (s, e) for s, e in optimizer]
    work = _recorded_ops(spans, autograd, np.sort(np.array(flow_ends) - (origin or 0.0))) if not kernels else [-1] * len(spans)
    trace = _rank_trace(path, rank, world, str(info.get("backend") or ""), groups, device, versions, steps, spans,
                        comm, optimizer, unmapped, _p2p_directions(comm, cpu_labels, p2p_labels), work)
    host = document.get("host_name") or info.get("host_name")
    trace.host = str(host) if host else None
    # Kineto's ts are µs after baseTimeNanoseconds: the recorded instant of time 0 of this rank, in ns
    base = document.get("baseTimeNanoseconds")
    trace.origin_ns = (int(base) if isinstance(base, (int, float)) else 0) + round((origin or 0.0) * 1000)
    # one clock per host; without a host name every rank counts as its own clock
    trace.clock = f"host:{host}" if host else f"rank:{rank}"
    trace.gpu_work, trace.gpu_work_unlinked = (on_gpu.work, on_gpu.unlinked) if on_gpu is not None else (0, 0)
    return trace


def _label_family(name: str) -> str:
    """A label with its numbers replaced by N, so that counts group by kind of label."""
    return re.sub(r"\d+", "N", name)[:80]


def _nccl_span(name: str, args: Mapping[str, Any], start: float, end: float, rank: int,
               groups: Mapping[str, Group]) -> tuple[int, float, float, int, str, str, int]:
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
        return (SEND if canonical == "send" else RECV, start, end, peer, canonical, group, -1)
    return (COLL, start, end, -1, canonical, group, -1)


def _name_from_launch(comm: list, unnamed: list[tuple[int, int]], launch_tid: Mapping[int, tuple[float, object]],
                      cpu_ops: list) -> None:
    """Older traces give NCCL kernels no `Collective name`, and one kernel (`ncclKernel_SendRecv`)
    serves send, recv and all_to_all alike: the c10d range open on the launching thread when the
    kernel was launched (`nccl:all_to_all`, `nccl:all_reduce`) says which collective it ran. In place."""
    ranges: dict[object, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for start, end, name, tid in cpu_ops:
        if name.startswith("nccl:"):
            ranges[tid].append((start, end, name[5:]))
    if not ranges:
        return
    starts = {tid: np.array([r[0] for r in sorted(spans)]) for tid, spans in ranges.items()}
    ordered = {tid: sorted(spans) for tid, spans in ranges.items()}
    for index, correlation in unnamed:
        launched = launch_tid.get(correlation)
        if launched is None or launched[1] not in ordered:
            continue
        at, tid = launched
        i = int(np.searchsorted(starts[tid], at, side="right")) - 1
        while i >= 0 and ordered[tid][i][1] < at:   # the innermost open range: nested ranges start later
            i -= 1
        if i < 0:
            continue
        canonical = _COLLECTIVES.get(ordered[tid][i][2].lower())
        kind, start, end, peer, collective, group, local = comm[index]
        if canonical is None or canonical == collective:
            continue
        if canonical in ("send", "recv") or kind != COLL:
            continue   # a p2p kernel keeps what it is; only collectives are renamed
        comm[index] = (kind, start, end, peer, canonical, group, local)


def _global_peer(local: int, group: str, groups: Mapping[str, Group], rank: int) -> int:
    """A group-local peer rank -> global rank (the default group's ranks are global already)."""
    members = groups.get(group)
    if members is None or not (0 <= local < len(members.ranks)):
        return local
    return members.ranks[local]


def _gloo_spans(gloo: list, meta: list[dict], c10d: list, rank: int, groups: Mapping[str, Group],
                unmapped: collections.Counter) -> list[tuple[int, float, float, int, str, str, int]]:
    """gloo's own spans (`gloo:all_reduce` on a runloop thread, `gloo:send` / `gloo:recv` inside the
    c10d call that issued them), with the group and peer of that call: from `record_param_comms`
    where the trace has it, else (CPU traces) the c10d call's `Concrete Inputs` (the group-local
    peer: global through a group that names the pp dim, else kept as `local` for the job level,
    where the layout says which ranks form the rank's pipeline). A p2p op spans its c10d call and
    its gloo span. Tuples: (kind, start, end, peer, collective, group, local peer)."""
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
        local = -1
        if canonical in ("send", "recv"):
            key = "Dst Rank" if canonical == "send" else "Src Rank"
            peer = _global_peer(int(args[key]), group, groups, rank) if key in args else -1
            call = calls[canonical][position] if position < len(calls[canonical]) else None
            if call is not None and call[1] <= start + 1.0:
                start, end = call[1], max(end, call[2])
                if peer < 0 and call[3] >= 0 and pipeline and call[3] < len(pipeline.ranks):
                    peer = pipeline.ranks[call[3]]
                elif peer < 0 and call[3] >= 0:
                    local = call[3]   # a rank of the (unnamed) group the call used: resolved with the layout
            out.append((SEND if canonical == "send" else RECV, start, end, peer, canonical, group, local))
        else:
            out.append((COLL, start, end, -1, canonical, group, -1))
    return out


# torch.distributed.pipelining's OVERLAP_F_B action (DualPipeV): `PP:(0F3;3B1)OVERLAP_F_B` runs its
# sub-actions one after the other under one label
_OVERLAP_LABEL = re.compile(r"^PP:\((?P<actions>[^()]*)\)OVERLAP_F_B$")
_SUB_ACTION = re.compile(r"^(?P<stage>\d+)(?P<op>F|B|I|W)(?P<mb>\d+)$")


def _split_overlapped(overlapped: list, cpu_ops: list, path: str) -> list[tuple]:
    """Compute labels (kind, start, end, mb, stage, name) of the forward and backward an OVERLAP_F_B
    label runs in turn: the backward starts with the first autograd backward op inside the label
    (on any thread: the autograd engine's own on GPU), the forward is what precedes it. A weight-
    gradient sub-action (W) is no op of the model. A label whose sub-actions are not one forward
    then one backward, or that holds no backward op, is refused (raw_unsupported_schedule)."""
    backward_starts = np.sort(np.array([op[0] for op in cpu_ops if op[2].startswith(_BACKWARD_OP)]))
    work = sorted((op[0], op[1]) for op in cpu_ops if not op[2].startswith(_NOT_COMPUTE) and not _OVERLAP_LABEL.match(op[2]))
    work_start, work_end = (np.array(column, dtype=np.float64) for column in zip(*work)) if work else (np.zeros(0),) * 2
    out = []
    for start, end, actions, name in overlapped:
        subs = [_SUB_ACTION.match(a.strip()) for a in actions.split(";")]
        compute = [m for m in subs if m is not None and m.group("op") != "W"]
        if None in subs or [m.group("op") for m in compute][:1] != ["F"] or len(compute) != 2:
            raise RawInputError("raw_unsupported_schedule", f"label {name!r}: an overlapped action other than one "
                                "forward then one backward", path=path)
        first = np.searchsorted(backward_starts, start, side="left")
        if first == len(backward_starts) or backward_starts[first] > end:
            raise RawInputError("raw_unsupported_schedule", f"label {name!r} at {start:.0f} µs holds no autograd "
                                "backward op: where its forward ends cannot be told", path=path)
        split = float(backward_starts[first])
        # the forward ends with its last op: a wait for the backward's input (a recv) is not its work
        ends = work_end[np.searchsorted(work_start, start):np.searchsorted(work_start, split)]
        ends = ends[ends <= split]
        forward_end = float(ends.max()) if len(ends) else split
        forward, backward = compute
        out.append((FWD, start, forward_end, int(forward.group("mb")), int(forward.group("stage")), name + ":F"))
        out.append((BWD, split, end, int(backward.group("mb")), int(backward.group("stage")), name + ":B"))
    return out


# torch.distributed.pipelining's p2p actions (`PP:2SEND_F0`): they hold the issue of the send / recv
_P2P_LABEL = re.compile(r"^PP:(?P<stage>\d+)(?P<op>SEND|RECV)_(?P<dir>[FB])(?P<mb>\d+)$")


def _p2p_directions(comm: list, labels: list, p2p_labels: list) -> list[tuple[int, int]]:
    """(direction, stage) of each comm span from the labels that issued it: a p2p action label
    (`PP:sSEND_Fm`: forward, stage s) or a compute label holding the issue (GPipe's `Forward k` issues
    its recv and send: forward). (0, -1) where no label says (collectives, unlabelled schedules)."""
    holders = sorted([(s, e, d, stage) for s, e, d, stage in p2p_labels]
                     + [(s, e, 1 if kind == FWD else -1, -1) for kind, s, e, *_ in labels if kind in (FWD, BWD)])
    starts = np.array([h[0] for h in holders]) if holders else np.zeros(0)
    out = []
    for kind, start, *_ in comm:
        found = (0, -1)
        if kind in (SEND, RECV) and len(starts):
            # the innermost (latest-starting) label open at the span's start; gloo's span starts up to
            # a few µs before its issue op ends, inside the label
            i = int(np.searchsorted(starts, start + 1e-3, side="right")) - 1
            while i >= 0:
                s, e, d, stage = holders[i]
                if s <= start <= e:
                    found = (d, stage)
                    break
                i -= 1
                if start - s > 60e6:
                    break
        out.append(found)
    return out


def _recorded_ops(spans: list, starts: np.ndarray, ends: np.ndarray) -> list[int]:
    """Per compute span, the operations autograd recorded inside it (`fwdbwd` flows: a flow starts
    at a forward op and ends at its backward node): the span's amount of work, however fast its
    machine ran it. -1 when the trace has no flows."""
    if not len(starts):
        return [-1] * len(spans)
    out = []
    for kind, start, end, *_ in spans:
        marks = starts if kind == FWD else ends
        out.append(int(np.searchsorted(marks, end, side="right") - np.searchsorted(marks, start, side="left")))
    return out


def _rank_trace(path, rank, world, backend, groups, device, versions, steps, spans, comm, optimizer, unmapped,
                directions, work) -> RankTrace:
    step_ids = np.array(sorted(steps), dtype=np.int64)
    step_start = np.array([steps[s][0] for s in step_ids])
    step_end = np.array([steps[s][1] for s in step_ids])
    rows = [(k, s, e, mb, ch, -1, "", "", -1, 0, n) for (k, s, e, mb, ch), n in zip(spans, work)]
    rows += [(k, s, e, -1, stage, peer, coll, group, local, direction, -1)
             for (k, s, e, peer, coll, group, local), (direction, stage) in zip(comm, directions)]
    rows += [(OPT, s, e, -1, -1, -1, "", "", -1, 0, -1) for s, e in optimizer]
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
        unmapped=unmapped, peer_local=np.array([r[8] for r in rows], dtype=np.int64),
        direction=np.array([r[9] for r in rows], dtype=np.int8), n_ops=np.array([r[10] for r in rows], dtype=np.int64),
    )
