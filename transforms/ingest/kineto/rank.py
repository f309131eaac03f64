"""Pass 1: one rank's Kineto JSON -> `RankTrace` (events read once, compute and comm spans, steps)."""
from __future__ import annotations

import bisect
import collections
import functools
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from transforms.ingest.common import RawInputError, open_bytes
from transforms.ingest.kineto.columns import BadEvent, general_columns
from transforms.ingest.kineto.compute import (_BACKWARD_OP, _NOT_COMPUTE, _GpuWork, _compute_spans, _inside,
                                              _issued_collectives, _unlabeled_compute, optimizer_work,
                                              waited_collectives)
from transforms.ingest.kineto.events import (_OVERLAP_LABEL, _P2P_LABEL, _EventPass, _compile_labels,  # noqa: F401
                                             _label_family, _match)
from transforms.ingest.kineto.pace import recorded_ops
from transforms.ingest.kineto.reader import NotStreamable, TraceUnreadable, read_trace
from transforms.ingest.kineto.spans import BWD, COLL, FWD, Group, OPT, RECV, RankTrace, SEND, _COLLECTIVES, _STEP
from transforms.intervals import union_runs


# --------------------------------------------------------------------------- pass 1: one rank

def _loads(data: bytes):
    """The whole document decoded into dicts (the path of documents the streaming reader does not take)."""
    try:
        import orjson

        return orjson.loads(data)
    except ImportError:   # pragma: no cover - orjson is a declared dependency
        import json

        return json.loads(data)


def _unreadable(path: str, error: BaseException) -> RawInputError:
    if isinstance(error, UnicodeDecodeError):
        return RawInputError("raw_unreadable", f"not UTF-8 JSON: a string holds {error.object[error.start:error.end]!r} "
                             f"({error.reason})", path=path)
    return RawInputError("raw_unreadable", f"not a complete JSON document ({type(error).__name__}: {error})"
                         if not isinstance(error, TraceUnreadable) else f"not a complete JSON document ({error})",
                         path=path)


def parse_rank_bytes(path: str, data: bytes, options: Mapping[str, Any] | None = None) -> RankTrace:
    """One rank's raw file content (JSON, optionally gzipped) -> RankTrace. RawInputError on bad bytes.

    Streamed (transforms/ingest/kineto/reader.py): gunzipped and decoded a few MB at a time into
    typed structs, never the whole document; a document whose shape the reader does not take is
    decoded whole instead (same result)."""
    import gc

    # the reader's structs are not tracked by the cyclic collector, but the columns of a run are
    # lists of many objects: pausing it saves its rescans (74% of the decode time of dicts on 30 MB
    # files, benchmarks/bench_ingest.py); none of them cycle
    enabled = gc.isenabled()
    gc.disable()
    try:
        reader = read_trace(data)
        events = _EventPass(options or {})
        try:
            for columns in reader.chunks():
                events.add(columns)
        except (TraceUnreadable, UnicodeDecodeError) as error:   # (a name or key that is no UTF-8)
            raise _unreadable(path, error) from None
        except NotStreamable:
            del events, reader
            try:
                document = _loads(open_bytes(data))
            except (ValueError, EOFError, OSError) as error:   # JSON decode error, truncated or broken gzip
                raise _unreadable(path, error) from None
            return parse_rank(path, document, options)
        return _rank_of(path, reader.top, events, options or {})
    finally:
        if enabled:
            gc.enable()


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
    _check_info(path, document)
    events = _EventPass(options)
    trace_events = document["traceEvents"]
    try:
        for at in range(0, len(trace_events), _DICTS_PER_RUN):
            events.add(general_columns(trace_events[at:at + _DICTS_PER_RUN], structs=False))
    except BadEvent as error:
        raise RawInputError("raw_not_a_trace", f"{error}: not a torch.profiler trace", path=path) from None
    return _rank_of(path, document, events, options)


_DICTS_PER_RUN = 1 << 16
_DATA_LOADING = "enumerate(DataLoader)"   # torch.utils.data's record_function around each batch fetch
_ZERO_GRAD = "Optimizer.zero_grad#"      # torch.optim's record_function around each zero_grad


_NO_INFO = "no distributedInfo (rank, world_size)"
_ONE_PROCESS = {"rank": 0, "world_size": 1}   # a lone process's trace: no process group, so no distributedInfo


def _check_info(path: str, top: Mapping[str, Any], options: Mapping[str, Any] | None = None) -> None:
    info = top.get("distributedInfo")
    if (options or {}).get("one_process") and info is None:
        return
    if not isinstance(info, Mapping) or "rank" not in info or "world_size" not in info:
        raise RawInputError("raw_not_a_trace", f"{_NO_INFO}: profile a torch.distributed "
                            "job (the profiler records it once the process group is initialised)", path=path)


def _rank_of(path: str, top: Mapping[str, Any], events: _EventPass, options: Mapping[str, Any]) -> RankTrace:
    """The RankTrace of a rank whose events went through `events` and whose other top-level keys are `top`."""
    _check_info(path, top, options)
    if events.deferred is not None:
        raise events.deferred
    info = top.get("distributedInfo") or _ONE_PROCESS
    rank, world = int(info["rank"]), int(info["world_size"])
    groups = _groups(info)
    unmapped = events.unmapped
    steps, step_tid, cpu_labels, optimizer = events.steps, events.step_tid, events.cpu_labels, events.optimizer
    comm: list[tuple[int, float, float, int, str, str, int, int]] = []   # kind, start, end, peer, coll, group, local peer, Seq
    unnamed: list[tuple[int, int]] = []                              # NCCL kernels without a collective name: (comm index, correlation)
    for _, args, _, _ in events.nccl:   # groups pg_config does not list (older torch): from the kernels' args
        group = args.get("Process Group Name")
        if group is not None and str(group) not in groups and args.get("Process Group Ranks") is not None:
            groups[str(group)] = Group(str(group), str(args.get("Process Group Description") or ""),
                                       _ranks_arg(args["Process Group Ranks"]))
    for name, args, ts, end in events.nccl:
        if "Collective name" not in args and args.get("correlation") is not None:
            unnamed.append((len(comm), int(args["correlation"])))
        comm.append(_nccl_span(name, args, ts, end, rank, groups))
    kernels, origin = events.kernels, events.origin
    cpu_ops = events.cpu_ops()
    autograd, flow_ends = events.flows()   # on the span columns' time axis
    optimizer = optimizer_work(optimizer, cpu_ops, autograd)
    loading = cpu_ops.per_name(lambda name: name.startswith(_DATA_LOADING))   # the batch fetches
    backward_ops = cpu_ops.start[cpu_ops.per_name(_is_backward_op)]
    inferred = not steps and bool(optimizer)
    profiled_steps = list(steps.values())
    if inferred:   # profiled without a schedule and without prof.step(): the optimizer's steps tell the steps
        steps, step_tid = _steps_from_optimizer(optimizer, events.optimizer_tids, cpu_ops)
    elif steps and optimizer:
        profiled = len(steps)
        steps = _iterations(steps, optimizer, events.optimizer_tids, step_tid, autograd, backward_ops,
                            cpu_ops.start[cpu_ops.per_name(lambda name: name.startswith(_ZERO_GRAD))],
                            cpu_ops.start[loading])
        if not steps:
            # an iteration spans about profiled / stepped ProfilerSteps: two of them and one more put a
            # whole one between two recorded optimizer steps
            stepped = max(len(_merged([span for span, tid in zip(optimizer, events.optimizer_tids) if tid == step_tid])), 1)
            enough = 2 * math.ceil(profiled / stepped) + 1
            holds = f"{profiled} ProfilerStep{'s hold' if profiled != 1 else ' holds'}"
            raise RawInputError("raw_no_steps", f"the {holds} no whole training iteration (from one optimizer step "
                                f"to the next), with {stepped} optimizer step(s) in all: the steps end mid-iteration "
                                "(PyTorch Lightning's profiler ends one when training_step returns) and the profile "
                                f"began mid-iteration; profile at least {enough} active steps (the profiler schedule's "
                                "`active`: twice the ProfilerSteps of one iteration, and one more)", path=path)
    if not steps:
        raise RawInputError("raw_no_steps", "no ProfilerStep#N span (call prof.step() once per training step) and no "
                            "Optimizer.step span to tell the steps by", path=path)
    device = "cpu"
    properties = top.get("deviceProperties") or []
    if kernels and properties and isinstance(properties[0], Mapping):
        device = str(properties[0].get("name") or "gpu")
    elif kernels:
        device = "gpu"
    versions = {"schemaVersion": top.get("schemaVersion"), "backend": info.get("backend"),
                "nccl_version": info.get("nccl_version"), "trace_id": top.get("trace_id")}
    # the CUDA launch of each NCCL kernel: names the unnamed ones, says when each was issued
    correlations = [(args or {}).get("correlation") for _, args, _, _ in events.nccl]
    launched = events.launch_threads([int(c) for c in correlations if c is not None]) if kernels else {}
    if unnamed:
        # (only the `nccl:` ranges and the unnamed kernels' launches matter to it)
        _name_from_launch(comm, unnamed, launched, events.nccl_ranges)
    called: dict[tuple[float, float, str], float] = {}   # a gloo collective's span -> when its c10d call issued it
    if not kernels:
        comm += _gloo_spans(events.gloo_cpu, events.comm_meta, events.c10d_p2p, rank, groups, unmapped, called,
                            events.c10d_calls)
    # the autograd engine runs a GPU job's backward on threads of its own: its top-level
    # `evaluate_function` ops are the backward work the main thread waits for meanwhile
    main, backward_elsewhere = events.threads(cpu_ops, step_tid)
    if not kernels:
        comm = _one_transfer_per_batch(comm, main, events.c10d_p2p, events.p2p_labels)
    if events.overlapped:
        cpu_labels += _split_overlapped(events.overlapped, cpu_ops, path)
    kinds = {label[0] for label in cpu_labels} & {FWD, BWD}
    if kinds != {FWD, BWD}:
        # no (or only forward) schedule labels: microbatches from the main thread's op runs
        # the main thread's record_function ranges are labels, not ops, and what they hold is: a
        # framework's profiling ranges (PyTorch Lightning's `[pl][profile]run_training_batch`, `## backward ##`)
        # span the microbatches they wrap, and with the backward on another thread work they do not
        # hold; the steps and the optimizer's ranges stay, they bound the runs
        ops = main.without(events.annotations(), unless=_kept_range) + backward_elsewhere
        cpu_labels = [label for label in cpu_labels if label[0] in kinds] + _unlabeled_compute(
            ops, sorted(steps.values()), optimizer, forward=FWD not in kinds, autograd=autograd)
    on_gpu = _GpuWork(*events.launch_columns(), *events.work_columns()) if kernels else None
    # the CPU time each comm span was issued at: which compute label issued it, and its step
    issued = _issued_at(comm, correlations, launched, called)
    if profiled_steps:   # a profile begun mid-iteration: its first iteration gets the others' preamble
        steps = _with_preamble(steps, [min(start for start, _ in profiled_steps), *(end for _, end in optimizer)],
                               comm, issued, autograd, cpu_ops.start[loading], backward_ops)
    waited = waited_collectives(comm, issued, main, cpu_labels) if not kernels else None
    spans = _compute_spans(cpu_labels, events.gpu_labels if kernels else {}, comm, main, on_gpu,
                           _issued_collectives(comm, issued, groups, waited))
    if not kernels:
        optimizer = _from_gradients_ready(optimizer, main, spans, comm)
    optimizer = [(s, e, s) for s, e in optimizer]
    if on_gpu is not None:   # the optimizer's time is its kernels' too: one clock for a step's ops
        optimizer = [(*(on_gpu.span(s, e) or (s, e)), s) for s, e, _ in optimizer]
    work = _recorded_ops(spans, autograd, flow_ends) if not kernels else [-1] * len(spans)
    trace = _rank_trace(path, rank, world, str(info.get("backend") or ""), groups, device, versions, steps, spans,
                        comm, optimizer, unmapped, _p2p_directions(comm, cpu_labels, events.p2p_labels), work,
                        issued, _batch_lengths(spans, events.embeddings, step_tid), waited)
    host = top.get("host_name") or info.get("host_name")
    trace.host = str(host) if host else None
    trace.data_loading = np.stack([cpu_ops.start[loading], cpu_ops.end[loading]], axis=1) if loading.any() else None
    trace.steps_inferred = inferred
    # Kineto's ts are µs after baseTimeNanoseconds: the recorded instant of time 0 of this rank, in ns
    base = top.get("baseTimeNanoseconds")
    trace.origin_ns = (int(base) if isinstance(base, (int, float)) else 0) + round((origin or 0.0) * 1000)
    trace.gc_pauses = _gc_pauses(top.get("strag_gc"), trace.origin_ns)
    trace.host_cpus, trace.host_threads, trace.host_ranks = _host_record(top.get("strag_host"))
    if not kernels:
        traced = main.without(events.annotations(), unless=lambda name: False) + backward_elsewhere
        trace.main_busy = union_runs(traced.start, traced.end)
        trace.recorded = recorded_ops(autograd, flow_ends, cpu_ops)
    # one clock per host; without a host name every rank counts as its own clock
    trace.clock = f"host:{host}" if host else f"rank:{rank}"
    trace.gpu_work, trace.gpu_work_unlinked = (on_gpu.work, on_gpu.unlinked) if on_gpu is not None else (0, 0)
    return trace


def _nccl_span(name: str, args: Mapping[str, Any], start: float, end: float, rank: int,
               groups: Mapping[str, Group]) -> tuple[int, float, float, int, str, str, int, int]:
    """(kind, start, end, peer, collective, group, local peer, Seq) of one NCCL kernel (Seq: the
    collective's number in its process group, recent torch; -1 when absent)."""
    collective = args.get("Collective name")
    canonical = _canonical_collective(name if collective is None else str(collective), collective is None)
    group = str(args.get("Process Group Name", ""))
    seq = args.get("Seq")
    seq = int(seq) if isinstance(seq, (int, float)) or (isinstance(seq, str) and seq.isdigit()) else -1
    peer = -1
    if canonical in ("send", "recv"):
        key = "Dst Rank" if canonical == "send" else "Src Rank"
        if key in args:
            peer = _global_peer(int(args[key]), group, groups, rank)
        return (SEND if canonical == "send" else RECV, start, end, peer, canonical, group, -1, seq)
    return (COLL, start, end, -1, canonical, group, -1, seq)


@functools.lru_cache(maxsize=4096)
def _canonical_collective(name: str, from_kernel: bool) -> str:
    """The collective a `Collective name` says, or (old traces, `from_kernel`) a NCCL kernel's name
    (ncclKernel_AllReduce_RING_LL_Sum_float), in _COLLECTIVES' spelling. Names repeat: asked once each."""
    if from_kernel:
        token = re.match(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
        name = token.group(1) if token else name
    return _COLLECTIVES.get(name.lower(), name.lower())


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
    by_thread: dict[object, list[tuple[int, float]]] = collections.defaultdict(list)   # tid -> (comm index, launch)
    for index, correlation in unnamed:
        launched = launch_tid.get(correlation)
        if launched is not None and launched[1] in ranges:
            by_thread[launched[1]].append((index, launched[0]))
    for tid, wanted in by_thread.items():
        ordered = sorted(ranges[tid])
        starts = np.array([r[0] for r in ordered])
        ends = np.array([r[1] for r in ordered])
        canonical = [_COLLECTIVES.get(name.lower()) for _, _, name in ordered]
        at = np.array([a for _, a in wanted])
        open_at = np.searchsorted(starts, at, side="right") - 1   # the last range started by the launch
        # the innermost open range: nested ranges start later; one that ended before the launch: the
        # ranges before it, walked back (rare)
        for k in np.flatnonzero((open_at >= 0) & (ends[np.maximum(open_at, 0)] < at)).tolist():
            i = open_at[k]
            while i >= 0 and ends[i] < at[k]:
                i -= 1
            open_at[k] = i
        for (index, _), i in zip(wanted, open_at.tolist()):
            name = canonical[i] if i >= 0 else None
            if name is None:
                continue
            entry = comm[index]   # (kind, start, end, peer, collective, group, local peer, Seq)
            if name == entry[4] or name in ("send", "recv") or entry[0] != COLL:
                continue   # a p2p kernel keeps what it is; only collectives are renamed
            comm[index] = entry[:4] + (name,) + entry[5:]


def _global_peer(local: int, group: str, groups: Mapping[str, Group], rank: int) -> int:
    """A group-local peer rank -> global rank (the default group's ranks are global already)."""
    members = groups.get(group)
    if members is None or not (0 <= local < len(members.ranks)):
        return local
    return members.ranks[local]


def _gloo_spans(gloo: list, meta: list[dict], c10d: list, rank: int, groups: Mapping[str, Group],
                unmapped: collections.Counter, called: dict | None = None, c10d_calls: list | None = None
                ) -> list[tuple[int, float, float, int, str, str, int, int]]:
    """gloo's own spans (`gloo:all_reduce` on a runloop thread, `gloo:send` / `gloo:recv` inside the
    c10d call that issued them), with the group and peer of that call: from `record_param_comms`
    where the trace has it, else (CPU traces) the c10d call's `Concrete Inputs` (the group-local
    peer: global through a group that names the pp dim, else kept as `local` for the job level,
    where the layout says which ranks form the rank's pipeline). A p2p op spans its c10d call and
    its gloo span. Tuples: (kind, start, end, peer, collective, group, local peer, Seq = -1).
    called: filled with {(start, end, collective): the time its c10d call issued it} for each
    collective matched to its call (record_param_comms, else its `c10d::` call among `c10d_calls`,
    `_calls_of_spans`): gloo runs it on a thread of its own, whose span may begin well after the call
    (behind another collective), when the caller has gone on."""
    from_call = _calls_of_spans(gloo, c10d_calls or [])
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
            out.append((SEND if canonical == "send" else RECV, start, end, peer, canonical, group, local, -1))
        else:
            out.append((COLL, start, end, -1, canonical, group, -1, -1))
            at = args.get("ts")
            if not isinstance(at, (int, float)):
                at = from_call.get((start, end))
            if called is not None and isinstance(at, (int, float)) and at <= start:
                called[(start, end, canonical)] = float(at)
    return out


def _calls_of_spans(gloo: list, calls: list[tuple[str, float]]) -> dict[tuple[float, float], float]:
    """{(start, end) of a gloo collective span: the time of the c10d call that issued it}: per
    collective, each span takes the latest call at or before its start that is earlier than the call
    the next span took (matched from the last span back: the calls keep the spans' order, a call
    whose span the file lacks is left over, and back-to-back calls go to their spans in turn)."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    for canonical, at in calls:
        times[canonical].append(at)
    spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for name, start, end, _tid in gloo:
        canonical = _COLLECTIVES.get(name.lower())
        if canonical in times:
            spans[canonical].append((start, end))
    out = {}
    for canonical, mine in spans.items():
        at = sorted(times[canonical])
        limit = len(at)
        for start, end in sorted(mine, reverse=True):
            j = bisect.bisect_right(at, start, 0, limit) - 1
            if j < 0:
                break
            out[(start, end)], limit = at[j], j
    return out


def _one_transfer_per_batch(comm: list, main, calls: list, labels: list) -> list:
    """The p2p spans holding the tensors one batch sends to (or receives from) one peer, as one transfer.

    A pipeline stage may pass several tensors across one boundary per microbatch: the tracer frontend
    (`pipeline()` with SplitPoint) sends every value the next stage reads (a decoder layer's hidden
    states, rotary cos and sin, the attention mask), each its own send, issued together in one
    `batch_isend_irecv`. They are one transfer of one microbatch, spanning the first issue to the last
    end. Spans of one kind, peer and group are one batch when the thread that issued them did nothing
    between the issues but issue p2p ops (`main`: its ops; `calls`: the c10d p2p calls, whose own
    allocations are theirs): a microbatch's transfer needs its compute first, and a schedule's
    bookkeeping between two actions is an op too. Under a schedule's action labels (`labels`:
    PP:sSEND_Fm ranges) each action is its own transfer."""
    p2p = sorted((i for i, span in enumerate(comm) if span[0] in (SEND, RECV)), key=lambda i: comm[i][1])
    if len(p2p) < 2:
        return comm
    busy = main.per_name(lambda name: not name.startswith(_NOT_COMPUTE))
    in_call = _inside(main.start, [(start, end) for _, start, end, *_ in calls])
    work = np.sort(main.start[busy & ~in_call])
    label_starts = np.sort(np.array([start for start, *_ in labels], dtype=np.float64))
    head: dict[tuple, int] = {}
    merged: dict[int, tuple] = {}
    for i in p2p:
        span = comm[i]
        key = (span[0], span[3], span[6], span[5])
        at = head.get(key)
        if at is not None:
            first = merged[at]
            issued, now = first[1], span[1]   # nothing but p2p issues between them, under one action label
            if np.searchsorted(work, issued, side="right") == np.searchsorted(work, now, side="left") and \
                    np.searchsorted(label_starts, issued, side="right") == np.searchsorted(label_starts, now, side="right"):
                merged[at] = (*first[:2], max(first[2], span[2]), *first[3:])
                merged[i] = None
                continue
        head[key] = i
        merged[i] = span
    return [merged.get(i, span) for i, span in enumerate(comm) if merged.get(i, span) is not None]


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


def _issued_at(comm: list, correlations: list, launched: Mapping[int, tuple[float, Any]],
               called: Mapping[tuple[float, float, str], float] | None = None) -> list[float]:
    """Per comm span, the CPU time it was issued at: a NCCL kernel's CUDA launch (`correlations`
    of the NCCL spans, which come first in `comm`; `launched`: correlation -> (launch start,
    thread)), a gloo collective's c10d call (`called`, from `_gloo_spans`: its gloo thread may start
    it after the step that issued it has ended), else its own start."""
    called = called or {}
    out = [called.get((span[1], span[2], span[4]), span[1]) if span[0] == COLL else span[1] for span in comm]
    for i, correlation in zip(range(len(out)), correlations):
        if correlation is not None and (launch := launched.get(int(correlation))) is not None:
            out[i] = launch[0]
    return out


def _steps_from_optimizer(optimizer: list[tuple[float, float]], tids: list, cpu_ops: list) -> tuple[dict, Any]:
    """Steps of a trace without ProfilerStep spans (a profile around a few iterations, no schedule,
    no prof.step()): ({n: (start, end)}, thread) where step n ends with the n-th optimizer step of
    the thread that ran most of them and starts where the one before ended (the first: at that
    thread's first op), so zero_grad, data loading and the microbatches fall in the step they begin."""
    thread = collections.Counter(tids).most_common(1)[0][0]
    merged = _merged([span for span, tid in zip(optimizer, tids) if tid == thread])
    first = min((op[0] for op in cpu_ops if op[3] == thread), default=merged[0][0])
    steps, begin = {}, min(first, merged[0][0])
    for number, (_, end) in enumerate(merged):
        steps[number] = (begin, end)
        begin = end
    return steps, thread


def _from_gradients_ready(optimizer: list[tuple[float, float]], main, spans: list, comm: list) -> list[tuple[float, float]]:
    """Each optimizer step from when its gradients are ready (CPU ranks): the step's thread's work
    between the last compute and gradient collective of the iteration and `Optimizer.step` prepares
    the update (DDP copying the reduced buckets back, the gradient norm and clipping, unscaling), the
    optimizer step's work as in Megatron's, whose step clips; without it that work would be untraced
    time. It starts at the first op of the thread at or after the later of the iteration's last
    compute end and the end of every transfer or collective issued before the step (one that a
    recorded end puts after the step's start leaves the step as it is), so no wait is in it."""
    if not optimizer or not len(main):
        return optimizer
    ends = np.sort(np.array([span[2] for span in spans], dtype=np.float64))
    comm_spans = np.array([(span[1], span[2]) for span in comm], dtype=np.float64).reshape(-1, 2)
    comm_spans = comm_spans[np.argsort(comm_spans[:, 0], kind="stable")]
    op_start = np.sort(main.start[main.per_name(lambda name: not name.startswith(_NOT_COMPUTE))])
    out, previous = [], -np.inf
    for start, end in sorted(optimizer):
        issued = comm_spans[np.searchsorted(comm_spans[:, 0], previous, side="right"):
                            np.searchsorted(comm_spans[:, 0], start, side="left"), 1]
        ready = np.concatenate([ends[np.searchsorted(ends, previous, side="right"):np.searchsorted(ends, start, side="right")],
                                issued])
        if len(ready) and ready.max() < start:
            first = op_start[np.searchsorted(op_start, ready.max(), side="left"):][:1]
            if len(first) and first[0] < start:
                start = float(first[0])
        out.append((start, end))
        previous = end
    return out


def _kept_range(name: str) -> bool:
    return bool(_STEP.match(name)) or name.startswith("Optimizer.")


def _is_backward_op(name: str) -> bool:
    return name.startswith(_BACKWARD_OP)


def _merged(spans: list[tuple[float, float]]) -> list[list[float]]:
    """Sorted spans with overlapping ones merged (an optimizer step recorded in parts: one)."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _iterations(steps: dict[int, tuple[float, float]], optimizer: list[tuple[float, float]], tids: list, step_tid,
                forward: np.ndarray, backward: np.ndarray, zero_grads: np.ndarray | None = None,
                fetches: np.ndarray | None = None) -> dict[int, tuple[float, float]]:
    """The training iterations of a trace whose ProfilerSteps are not its iterations, else `steps`.

    An iteration is what the framework means by one: the work between two optimizer steps. Most
    loops call prof.step() once per iteration after the optimizer, and then each ProfilerStep holds
    one optimizer step and the model's work before it; those steps are kept as they are. Others mark
    other boundaries: PyTorch Lightning's PyTorchProfiler ends a ProfilerStep when training_step
    returns (the iteration's backward and optimizer fall in the next one), and a callback stepping
    the profiler per batch under gradient accumulation makes a ProfilerStep per microbatch, only
    the last holding an optimizer step. There, iteration n runs from the end of the optimizer step
    before it (the first: the first ProfilerStep's start) to the end of its own optimizer step, and
    takes the number of the ProfilerStep its optimizer step ended in (its ordinal among the profiled
    optimizer steps when one ProfilerStep holds several). Optimizer steps with no model work between
    them (a dense and a sparse optimizer) end one iteration. `forward`, `backward`: the sorted times of
    the model's work (forward ops autograd recorded, backward ops): work after a ProfilerStep's last
    optimizer step means its iteration goes on past the step's end. The first iteration is kept only
    when the profile began where an iteration does (`_starts_an_iteration`): one that began
    mid-iteration (Lightning's) holds the rest of an iteration whose forward it missed, unless a
    zero_grad in it says where its own gradients began (`_begun_after_zero_grad`; `zero_grads`,
    `fetches`: the start times of the `Optimizer.zero_grad` and `enumerate(DataLoader)` spans)."""
    ends = np.array([end for _, end in _merged([span for span, tid in zip(optimizer, tids) if tid == step_tid])])
    if not len(ends):
        return steps
    numbers = sorted(steps)
    bounds = np.array([steps[n] for n in numbers])
    held = np.searchsorted(ends, bounds[:, 1], side="right") - np.searchsorted(ends, bounds[:, 0], side="right")
    work = np.sort(np.concatenate([forward, backward]))
    last_end = np.array([ends[np.searchsorted(ends, e, side="right") - 1] if h else s
                         for (s, e), h in zip(bounds.tolist(), held.tolist())])
    after = np.searchsorted(work, bounds[:, 1], side="right") - np.searchsorted(work, last_end, side="right")
    if (held >= 1).all() and not (after > 0).any():
        return steps
    # an iteration ends with its last optimizer step (several optimizers step one after another),
    # within the profile (a step the profiler's stop cut is none)
    first, last = bounds[:, 0].min(), bounds[:, 1].max()
    ends = ends[(ends > first) & (ends <= last)]
    between = np.searchsorted(work, ends[1:], side="right") - np.searchsorted(work, ends[:-1], side="right")
    ends = ends[np.append(between > 0, True)] if len(ends) else ends
    where = np.searchsorted(bounds[:, 0], ends, side="right") - 1   # the ProfilerStep each ends in
    ids = [numbers[i] for i in where.tolist()]
    if len(set(ids)) < len(ids):
        ids = list(range(len(ids)))
    starts = np.concatenate([[first], ends[:-1]])
    iterations = {n: (float(s), float(e)) for n, s, e in zip(ids, starts.tolist(), ends.tolist())}
    if len(ends) and not _starts_an_iteration(bounds, ends, forward, backward):
        begun = _begun_after_zero_grad(first, ends[0], forward, backward, zero_grads, fetches)
        if begun is None:
            iterations.pop(ids[0])
        else:
            iterations[ids[0]] = (begun, iterations[ids[0]][1])
    return iterations


def _with_preamble(steps: dict[int, tuple[float, float]], known: list[float], comm: list, issued: list,
                   forward: np.ndarray, fetches: np.ndarray, backward: np.ndarray) -> dict[int, tuple[float, float]]:
    """`steps` with the first iteration of a profile begun mid-iteration given the preamble the
    others have. An iteration starts where the optimizer step before it ended, and the loop's code
    between that end and the batch fetch (a trainer's per-batch hooks: PyTorch Lightning broadcasts
    whether to stop) runs in every iteration; the first one, begun before the profile, starts at
    its batch fetch (`_begun_after_zero_grad`), the optimizer step before it unseen, so its
    preamble's collectives fell outside it and the step's structure differed from the others'.
    Every loop runs the same code, so its start moves back over the collectives of the preamble
    the others show (the modal sequence of (kind, collective) issued between their start and their
    first model work: the start of a batch fetch or forward op, `fetches`, `forward`), when exactly
    those were issued after the previous iteration's last backward op (`backward`: backward op
    starts) and before its start. `comm`, `issued`: the comm spans and their issue times. A first
    iteration whose start is known (`known`: the profile's start, the optimizer steps' ends) is
    left as it is."""
    if len(steps) < 2 or not comm:
        return steps
    order = sorted(steps, key=lambda n: steps[n][0])
    first = order[0]
    start = steps[first][0]
    if start <= known[0] or start in known:
        return steps
    work = np.sort(np.concatenate([forward, fetches]))
    at = np.asarray(issued, dtype=np.float64)
    sequence = np.argsort(at, kind="stable")
    at = at[sequence]
    names = [(comm[i][0], comm[i][4]) for i in sequence.tolist()]

    def issued_in(lo: float, hi: float) -> list:
        return names[np.searchsorted(at, lo, side="left"):np.searchsorted(at, hi, side="left")]

    def first_work(lo: float) -> float:
        i = np.searchsorted(work, lo, side="left")
        return float(work[i]) if i < len(work) else lo

    preambles = collections.Counter(tuple(issued_in(steps[n][0], first_work(steps[n][0]))) for n in order[1:])
    modal, held = preambles.most_common(1)[0]
    if not modal or 2 * held <= len(order) - 1:
        return steps
    own = issued_in(start, first_work(start))
    previous = backward[backward < start]
    if tuple(own) == modal or not len(previous):
        return steps
    lo = float(previous.max())
    earlier = np.flatnonzero((at > lo) & (at < start))
    if len(earlier) + len(own) < len(modal) or tuple((names[i] for i in earlier.tolist()))[
            len(earlier) + len(own) - len(modal):] + tuple(own) != modal:
        return steps
    moved = dict(steps)
    moved[first] = (float(at[earlier[len(earlier) + len(own) - len(modal)]]), steps[first][1])
    return moved


def _begun_after_zero_grad(first: float, end: float, forward: np.ndarray, backward: np.ndarray,
                           zero_grads: np.ndarray | None, fetches: np.ndarray | None) -> float | None:
    """Where the first iteration of a profile begun mid-iteration starts, when the profile holds all
    of its work; else None. An optimizer step applies the gradients accumulated since the last
    zero_grad, so the iteration ending at `end` (its optimizer step's end) is the model work whose
    backward follows the last zero_grad before `end`: the forwards from the first one after the
    last backward op that precedes that zero_grad (PyTorch Lightning zero-grads between
    training_step and backward; a plain loop before the forward). Those forwards are all in the
    profile when that earlier backward is (it ran after the profile's start), and the iteration
    starts at the batch fetch before its first forward, if one was traced after that backward.
    Without such a zero_grad and backward the work before the profile cannot be told apart."""
    if zero_grads is None or not len(zero_grads) or not len(forward) or not len(backward):
        return None
    inside = zero_grads[(zero_grads > first) & (zero_grads < end)]
    if not len(inside):
        return None
    zeroed = inside.max()
    before = backward[(backward >= first) & (backward < zeroed)]
    if not len(before):
        return None
    after = forward[(forward > before.max()) & (forward < end)]
    if not len(after) or not ((backward > zeroed) & (backward < end)).any():
        return None
    start = float(after.min())
    if fetches is not None and len(fetches):
        fetched = fetches[(fetches > before.max()) & (fetches < start)]
        if len(fetched):
            start = float(fetched.max())
    return start


def _starts_an_iteration(bounds: np.ndarray, ends: np.ndarray, forward: np.ndarray, backward: np.ndarray) -> bool:
    """Whether the profile's first ProfilerStep starts an iteration (else its first iteration lacks
    the work done before the profile). A profiler that ends its steps between a forward and its
    backward (Lightning's, when training_step returns: the last model work before a step's end, with
    more after it, is a forward) starts them there too, mid-iteration. Else the first
    iteration must hold as many ProfilerSteps as the others (a profile that began at an accumulated
    batch's second microbatch holds fewer), and its work must start with a forward, not with the
    backward of an iteration begun before the profile."""
    work = np.concatenate([forward, backward])
    is_forward = np.concatenate([np.ones(len(forward), bool), np.zeros(len(backward), bool)])
    order = np.argsort(work, kind="stable")
    work, is_forward = work[order], is_forward[order]
    cut = np.searchsorted(work, bounds[:, 1], side="right")   # the first work after each step's end
    inside = (cut > 0) & (cut < len(work))
    if is_forward[cut[inside] - 1].any():
        return False
    opened = bounds[:, 0][bounds[:, 0] < ends[-1]]   # the ProfilerSteps that start in an iteration
    per_iteration = np.bincount(np.searchsorted(ends, opened, side="left"), minlength=len(ends))
    if len(per_iteration) > 1 and per_iteration[0] != np.bincount(per_iteration[1:]).argmax():
        return False
    first = bounds[:, 0].min()
    first_forward = forward[np.searchsorted(forward, first):][:1]
    first_backward = backward[np.searchsorted(backward, first):][:1]
    return not (len(first_backward) and (not len(first_forward) or first_backward[0] < first_forward[0]))


def _batch_lengths(spans: list, embeddings: list, step_tid) -> list:
    """Per compute span, the sequence lengths of the batch its forward embedded ([T] * B: B
    sequences of T tokens, padding included, as the model computes them), or None. The token
    embedding is the largest table an `aten::embedding` inside the forward looked up (position
    tables are smaller); its index shape (record_shapes' Input Dims) is [B, T] or [T]. Compute
    follows these lengths: the sequence-imbalance detector reads them where the trainer recorded
    none (trace column seq_lens)."""
    if not embeddings:
        return [None] * len(spans)
    main = sorted((ts, rows, shape) for ts, tid, rows, shape in embeddings if tid == step_tid) or sorted(
        (ts, rows, shape) for ts, _, rows, shape in embeddings)
    starts = np.array([ts for ts, *_ in main])
    out = []
    for kind, start, end, *_ in spans:
        if kind != FWD:
            out.append(None)
            continue
        inside = main[np.searchsorted(starts, start, side="left"):np.searchsorted(starts, end, side="right")]
        if not inside:
            out.append(None)
            continue
        _, _, shape = max(inside, key=lambda item: item[1])
        batch, length = (1, shape[0]) if len(shape) == 1 else (int(np.prod(shape[:-1])), shape[-1])
        out.append([int(length)] * int(batch) if length > 0 and batch > 0 else None)
    return out


def _rank_trace(path, rank, world, backend, groups, device, versions, steps, spans, comm, optimizer, unmapped,
                directions, work, issued, lengths=None, waited=None) -> RankTrace:
    step_ids = np.array(sorted(steps), dtype=np.int64)
    step_start = np.array([steps[s][0] for s in step_ids])
    step_end = np.array([steps[s][1] for s in step_ids])
    rows = [(k, s, e, mb, ch, -1, "", "", -1, 0, n, piece, -1, at) for (k, s, e, mb, ch, piece, at), n in zip(spans, work)]
    rows += [(k, s, e, -1, stage, peer, coll, group, local, direction, -1, 0, seq, at)
             for (k, s, e, peer, coll, group, local, seq), (direction, stage), at in zip(comm, directions, issued)]
    rows += [(OPT, s, e, -1, -1, -1, "", "", -1, 0, -1, 0, -1, at) for s, e, at in optimizer]
    lengths = list(lengths or [None] * len(spans)) + [None] * (len(rows) - len(spans))
    kind = np.array([r[0] for r in rows], dtype=np.int8)
    start = np.array([r[1] for r in rows], dtype=np.float64)
    end = np.array([r[2] for r in rows], dtype=np.float64)
    at = np.array([r[13] for r in rows], dtype=np.float64)
    # a span belongs to the profiled step whose CPU span holds the CPU time it was issued at (its GPU
    # work may run past the step's CPU span, a step or more behind on a deep launch queue)
    position = np.searchsorted(step_start, at, side="right") - 1
    inside = (position >= 0) & (at <= step_end[np.maximum(position, 0)])
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
        piece=np.array([r[11] for r in rows], dtype=np.int8) if any(r[11] for r in rows) else None,
        seq=np.array([r[12] for r in rows], dtype=np.int64) if any(r[12] >= 0 for r in rows) else None,
        seq_lens=np.array(lengths + [None], dtype=object)[:-1] if any(v is not None for v in lengths) else None,
        waited=np.array([False] * len(spans) + list(waited) + [False] * len(optimizer))
        if waited is not None and any(waited) else None,
        issued=at,
    )


def _host_record(record: Any) -> tuple[int | None, int | None, int | None]:
    """(cores, torch threads, local ranks) of the collector's host record (strag_collect.hostrecord:
    {"cpus": n, "threads": n or null, "local_ranks": n or null}); None for each value absent or not a
    positive integer (a record this reader does not know counts as none)."""
    if not isinstance(record, dict):
        return None, None, None

    def positive(key: str) -> int | None:
        value = record.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    return positive("cpus"), positive("threads"), positive("local_ranks")


def _gc_pauses(record: Any, origin_ns: int) -> np.ndarray | None:
    """The collector's record of Python's garbage collections (strag_collect.gcrecord: {"clock": "unix_ns",
    "pauses": [[start_ns, stop_ns, generation], ...]}) as [k, 2] µs on this rank's span clock; None
    when the trace holds no record, or one in a form this reader does not know (then it is as if none
    was recorded: the verdict falls back on the gaps' sizes)."""
    if not isinstance(record, dict) or record.get("clock") != "unix_ns" or not isinstance(record.get("pauses"), list):
        return None
    try:
        pauses = np.asarray([(int(p[0]), int(p[1])) for p in record["pauses"]], dtype=np.int64).reshape(-1, 2)
    except (TypeError, ValueError, IndexError):
        return None
    pauses = pauses[pauses[:, 1] >= pauses[:, 0]]
    return (pauses - origin_ns) / 1000.0
