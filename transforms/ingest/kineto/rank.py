"""Pass 1: one rank's Kineto JSON -> `RankTrace` (events read once, compute and comm spans, steps)."""
from __future__ import annotations

import collections
import itertools
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from transforms.ingest.common import RawInputError, open_bytes
from transforms.ingest.kineto.compute import (_BACKWARD_OP, _NOT_COMPUTE, _UNMAPPED_QUIET, _GpuWork, _compute_spans,
                                             _issued_collectives,
                                             _unlabeled_compute)
from transforms.ingest.kineto.reader import EventColumns, NotStreamable, TraceUnreadable, read_trace
from transforms.ingest.kineto.spans import (BWD, COLL, DEFAULT_BACKWARD_LABELS, DEFAULT_FORWARD_LABELS,
                                            DEFAULT_OPTIMIZER_LABEL, FWD, Group, OPT, RECV, RankTrace, SEND,
                                            WEIGHT_LABEL, WGT, _COLLECTIVES, _NCCL, _STEP)


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
        except TraceUnreadable as error:
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
    _check_info(path, document)
    events = _EventPass(options)
    trace_events = document["traceEvents"]
    for at in range(0, len(trace_events), _DICTS_PER_RUN):
        events.add(EventColumns.of_dicts(trace_events[at:at + _DICTS_PER_RUN]))
    return _rank_of(path, document, events, options)


_DICTS_PER_RUN = 1 << 16


def _check_info(path: str, top: Mapping[str, Any]) -> None:
    info = top.get("distributedInfo")
    if not isinstance(info, Mapping) or "rank" not in info or "world_size" not in info:
        raise RawInputError("raw_not_a_trace", "no distributedInfo (rank, world_size): profile a torch.distributed "
                            "job (the profiler records it once the process group is initialised)", path=path)


# Codes of the event fields the pass tells apart (0: anything else).
_PHASE = {"X": 1, "s": 2, "f": 3}
_RUNTIME, _KERNEL, _COPY, _GPU_LABEL, _CPU_OP, _ANNOTATION, _FLOW = range(1, 8)
_CATEGORY = {"cuda_runtime": _RUNTIME, "cuda_driver": _RUNTIME, "kernel": _KERNEL, "gpu_memcpy": _COPY,
             "gpu_memset": _COPY, "gpu_user_annotation": _GPU_LABEL, "cpu_op": _CPU_OP,
             "user_annotation": _ANNOTATION, "fwdbwd": _FLOW}


def _name_class(name) -> int:
    """0 for a CPU op / annotation name that only joins the op list, else 1: a step, gloo span,
    c10d p2p call or record_param_comms, which the event-by-event part reads."""
    if not isinstance(name, str):
        return 1
    return int(bool(_STEP.match(name)) or name.startswith(("gloo:", "c10d::send", "c10d::recv", "nccl:"))
               or name == "record_param_comms")


class _EventPass:
    """The one pass over a rank's events, a run (`EventColumns`) at a time, in file order.

    The bulk (CUDA launches, GPU work, CPU ops, flows) is classified and kept as numpy columns per
    run; only the few events that need their names or args read (steps, labels, gloo and c10d
    calls, NCCL kernels, GPU annotations) go through Python one by one. Times are kept relative to
    `origin` (µs), set by the first complete event (ph X with ts and dur): a whole 2^32 µs (72 min)."""

    def __init__(self, options: Mapping[str, Any]):
        self.deferred: Exception | None = None   # an options error, raised once the file is known to be a trace
        try:
            self.forward_labels = _compile_labels(options, "forward_label", DEFAULT_FORWARD_LABELS)
            self.backward_labels = _compile_labels(options, "backward_label", DEFAULT_BACKWARD_LABELS)
            self.optimizer_label = re.compile(options.get("optimizer_label") or DEFAULT_OPTIMIZER_LABEL)
        except (RawInputError, re.error) as error:
            self.deferred = error
        self.origin: float | None = None
        self.kernels = 0
        self.unmapped: collections.Counter = collections.Counter()
        self.steps: dict[int, tuple[float, float]] = {}
        self.step_tid = None
        self.cpu_labels: list[tuple[int, float, float, int, int, str]] = []   # kind, start, end, mb, chunk, name
        self.gpu_labels: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self.nccl: list[tuple[str, dict, float, float]] = []           # NCCL kernels: name, args, start, end
        self.comm_meta: list[dict] = []                                 # record_param_comms args, in time order
        self.gloo_cpu: list[tuple[str, float, float, Any]] = []         # name, start, end, tid
        self.c10d_p2p: list[tuple[str, float, float, int]] = []         # c10d::send / recv_: name, start, end, local peer
        self.optimizer: list[tuple[float, float]] = []
        self.p2p_labels: list[tuple[float, float, int, int]] = []       # start, end, direction (+1 F, -1 B), stage
        self.overlapped: list[tuple[float, float, str, str]] = []       # OVERLAP_F_B labels: start, end, actions, name
        self.nccl_ranges: list[tuple[float, float, str, Any]] = []      # `nccl:*` CPU ranges: start, end, name, tid
        # columns, one array (or list) per run
        self._launch: list[tuple[np.ndarray, np.ndarray, list]] = []    # CUDA runtime / driver calls: start, correlation, tid
        self._work: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # kernels, memcpy, memset (not NCCL): correlation, start, end
        self._cpu: list[tuple[np.ndarray, np.ndarray, list, list]] = []  # every cpu_op / user_annotation: start, end, name, tid
        self._annotations: list[tuple[np.ndarray, list]] = []           # user_annotation ranges: start, name
        self._flow_starts: list[np.ndarray] = []                        # fwdbwd flow starts: forward ops autograd recorded
        self._flow_ends: list[np.ndarray] = []                          # ... and their backward nodes
        self._name_classes: dict[Any, int] = {}
        self._nccl_names: dict[Any, bool] = {}

    def add(self, columns: EventColumns) -> None:
        n = len(columns)
        if not n:
            return
        category = columns.codes("cat", _CATEGORY)
        # the rest of an event matters only in the categories above, except that the first complete
        # event of any category sets the origin
        rows = None if self.origin is None else np.flatnonzero(category)
        phase, ts = columns.codes("ph", _PHASE, rows), columns.floats("ts", rows)
        if rows is not None:
            phase, ts = _spread(phase, rows, n, 0), _spread(ts, rows, n, np.nan)
        has_ts = ~np.isnan(ts)
        flows = (phase >= 2) & (category == _FLOW) & has_ts
        if flows.any():
            self._flow_starts.append(ts[flows & (phase == 2)])
            self._flow_ends.append(ts[flows & (phase == 3)])
        complete = (phase == 1) & has_ts
        if not complete.any():
            return
        dur = columns.floats("dur", rows)
        if rows is not None:
            dur = _spread(dur, rows, n, np.nan)
        complete &= ~np.isnan(dur)
        if not complete.any():
            return
        if self.origin is None:
            first = float(ts[np.argmax(complete)])
            self.origin = float(np.floor(first / 2.0 ** 32) * 2.0 ** 32)
        start = ts - self.origin
        end = start + dur
        category = np.where(complete, category, 0)

        runtime = np.flatnonzero(category == _RUNTIME)
        if len(runtime):
            correlation = columns.correlations(runtime)
            if None in correlation:
                given = np.fromiter((c is not None for c in correlation), bool, len(runtime))
                correlation = [c for c in correlation if c is not None]
                runtime = runtime[given]
            self._launch.append((start[runtime], np.array(correlation, dtype=np.int64).reshape(-1),
                                 columns.pick("tid", runtime)))

        rare: list[int] = []
        gpu = np.flatnonzero((category == _KERNEL) | (category == _COPY))
        if len(gpu):
            self.kernels += int(np.count_nonzero(category == _KERNEL))
            nccl = _prefixed(columns.pick("name", gpu), _NCCL, self._nccl_names)
            rare += gpu[nccl].tolist()
            work = gpu[~nccl]
            correlation = columns.correlations(work)
            if None in correlation:
                given = np.fromiter((c is not None for c in correlation), bool, len(work))
                correlation = [c for c in correlation if c is not None]
                work = work[given]
            if len(work):
                self._work.append((np.array(correlation, dtype=np.int64).reshape(-1), start[work], end[work]))
        rare += np.flatnonzero(category == _GPU_LABEL).tolist()

        cpu = np.flatnonzero((category == _CPU_OP) | (category == _ANNOTATION))
        if len(cpu):
            cpu_names = columns.pick("name", cpu)
            self._cpu.append((start[cpu], end[cpu], cpu_names, columns.pick("tid", cpu)))
            annotation = category[cpu] == _ANNOTATION
            if annotation.any():
                self._annotations.append((start[cpu[annotation]], [cpu_names[i] for i in np.flatnonzero(annotation)]))
            known = self._name_classes
            classes = list(map(known.get, cpu_names))
            if None in classes:
                for name in set(cpu_names).difference(known):
                    known[name] = _name_class(name)
                classes = list(map(known.__getitem__, cpu_names))
            special = np.array(classes, dtype=bool) | annotation
            rare += cpu[special].tolist()
        if rare:
            rare.sort()
            self._one_by_one(columns, rare, start[rare].tolist(), end[rare].tolist())

    def _one_by_one(self, columns: EventColumns, indices: list[int], starts: list[float], ends: list[float]) -> None:
        """The events whose names or args matter, in file order."""
        for i, name, cat, tid, ts, end in zip(indices, columns.pick("name", indices), columns.pick("cat", indices),
                                              columns.pick("tid", indices), starts, ends):
            if cat in ("kernel", "gpu_memcpy", "gpu_memset"):   # NCCL: read once the rank and groups are known
                self.nccl.append((name, columns.args_of(i), ts, end))
                continue
            if cat == "gpu_user_annotation":
                if not name.startswith("ProfilerStep#"):
                    self.gpu_labels[name].append((ts, end))
                continue
            step = _STEP.match(name)
            if step:
                self.steps[int(step.group(1))] = (ts, end)
                self.step_tid = tid
                continue
            if name.startswith("gloo:"):
                self.gloo_cpu.append((name[5:], ts, end, tid))
                continue
            if name.startswith("c10d::send") or name.startswith("c10d::recv"):
                inputs = columns.args_of(i).get("Concrete Inputs") or []
                peer = inputs[2] if len(inputs) > 2 and str(inputs[2]).lstrip("-").isdigit() else -1
                self.c10d_p2p.append(("send" if name.startswith("c10d::send") else "recv", ts, end, int(peer)))
                continue
            if name == "record_param_comms":
                args = columns.args_of(i)
                if "Collective name" in args:
                    self.comm_meta.append(dict(args, ts=ts, tid=tid))
                continue
            if name.startswith("nccl:"):   # c10d's range around a NCCL call: names the kernels it launched
                self.nccl_ranges.append((ts, end, name, tid))
            if cat == "user_annotation" and self.deferred is None:
                self._label(name, ts, end)

    def _label(self, name: str, ts: float, end: float) -> None:
        if self.optimizer_label.match(name):
            self.optimizer.append((ts, end))
            return
        found = _match(self.forward_labels, name)
        kind = FWD
        if found is None:
            found, kind = _match(self.backward_labels, name), BWD
        if found is not None:
            groups_found = found.groupdict()
            mb = groups_found.get("mb")
            chunk = groups_found.get("stage") if "stage" in groups_found else groups_found.get("chunk")
            self.cpu_labels.append((kind, ts, end, int(mb) if mb is not None else -1,
                                    int(chunk) if chunk is not None else -1, name))
        elif (weight := WEIGHT_LABEL.match(name)) is not None:
            self.cpu_labels.append((WGT, ts, end, int(weight.group("mb")), int(weight.group("stage")), name))
        elif (overlap := _OVERLAP_LABEL.match(name)) is not None:
            self.overlapped.append((ts, end, overlap.group("actions"), name))
        elif (p2p_label := _P2P_LABEL.match(name)) is not None:
            self.p2p_labels.append((ts, end, 1 if p2p_label.group("dir") == "F" else -1, int(p2p_label.group("stage"))))
        elif not _UNMAPPED_QUIET.match(name):
            self.unmapped[f"label {_label_family(name)}"] += 1

    # ---------------------------------------------------------------- the columns, once all runs are in

    def launches(self) -> list[tuple[float, int]]:
        return list(zip(_joined([r[0] for r in self._launch]).tolist(), _joined([r[1] for r in self._launch], np.int64).tolist()))

    def launch_threads(self, wanted: list[int]) -> dict[int, tuple[float, Any]]:
        """correlation -> (launch start, thread) of the CUDA calls of the `wanted` correlations (the
        last call of a correlation wins)."""
        correlations = _joined([r[1] for r in self._launch], np.int64)
        keep = np.flatnonzero(np.isin(correlations, np.array(wanted, dtype=np.int64)))
        starts = _joined([r[0] for r in self._launch])[keep].tolist()
        threads = list(itertools.chain.from_iterable(r[2] for r in self._launch))
        return dict(zip(correlations[keep].tolist(), zip(starts, (threads[i] for i in keep))))

    def gpu_work(self) -> list[tuple[int, float, float]]:
        return list(zip(*(_joined([r[k] for r in self._work], np.int64 if k == 0 else np.float64).tolist() for k in range(3))))

    def cpu_ops(self) -> list[tuple[float, float, str, Any]]:
        return list(zip(_joined([r[0] for r in self._cpu]).tolist(), _joined([r[1] for r in self._cpu]).tolist(),
                        itertools.chain.from_iterable(r[2] for r in self._cpu),
                        itertools.chain.from_iterable(r[3] for r in self._cpu)))

    def threads(self, cpu_ops: list, step_tid) -> tuple[list, list]:
        """(the ops of the thread that ran the steps, the autograd backward ops of other threads),
        each in file order."""
        tids = np.empty(len(cpu_ops), dtype=object)
        tids[:] = list(itertools.chain.from_iterable(r[3] for r in self._cpu))
        main = tids == step_tid
        if not isinstance(main, np.ndarray) or main.shape != tids.shape:   # a tid numpy cannot compare one by one
            main = np.fromiter((tid == step_tid for tid in tids), bool, len(tids))
        names = list(itertools.chain.from_iterable(r[2] for r in self._cpu))
        backward = ~main & _prefixed(names, _BACKWARD_OP, {})
        return [cpu_ops[i] for i in np.flatnonzero(main)], [cpu_ops[i] for i in np.flatnonzero(backward)]

    def annotations(self) -> set[tuple[float, str]]:
        return set(zip(_joined([r[0] for r in self._annotations]).tolist(),
                       itertools.chain.from_iterable(r[1] for r in self._annotations)))

    def flows(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted fwdbwd flow starts and ends on the span columns' time axis."""
        origin = self.origin or 0.0
        return np.sort(_joined(self._flow_starts) - origin), np.sort(_joined(self._flow_ends) - origin)


def _spread(values: np.ndarray, rows: np.ndarray, n: int, fill) -> np.ndarray:
    """`values` of the events at `rows` placed in a column of all n events, `fill` elsewhere."""
    out = np.full(n, fill, dtype=values.dtype)
    out[rows] = values
    return out


def _prefixed(names: list, prefix, known: dict) -> np.ndarray:
    """Whether each name starts with `prefix` (a str or tuple), through `known` (name -> answer):
    names repeat, so each is looked at once."""
    answers = list(map(known.get, names))
    if None in answers:
        for name in set(names).difference(known):
            known[name] = name.startswith(prefix)
        answers = list(map(known.__getitem__, names))
    return np.array(answers, dtype=bool).reshape(-1)


def _joined(parts: list[np.ndarray], dtype=np.float64) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _rank_of(path: str, top: Mapping[str, Any], events: _EventPass, options: Mapping[str, Any]) -> RankTrace:
    """The RankTrace of a rank whose events went through `events` and whose other top-level keys are `top`."""
    _check_info(path, top)
    if events.deferred is not None:
        raise events.deferred
    info = top["distributedInfo"]
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
    if not steps:
        raise RawInputError("raw_no_steps", "no ProfilerStep#N span: call prof.step() once per training step", path=path)
    device = "cpu"
    properties = top.get("deviceProperties") or []
    if kernels and properties and isinstance(properties[0], Mapping):
        device = str(properties[0].get("name") or "gpu")
    elif kernels:
        device = "gpu"
    versions = {"schemaVersion": top.get("schemaVersion"), "backend": info.get("backend"),
                "nccl_version": info.get("nccl_version"), "trace_id": top.get("trace_id")}
    cpu_ops = events.cpu_ops()
    # the CUDA launch of each NCCL kernel: names the unnamed ones, says when each was issued
    correlations = [(args or {}).get("correlation") for _, args, _, _ in events.nccl]
    launched = events.launch_threads([int(c) for c in correlations if c is not None]) if kernels else {}
    if unnamed:
        # (only the `nccl:` ranges and the unnamed kernels' launches matter to it)
        _name_from_launch(comm, unnamed, launched, events.nccl_ranges)
    if not kernels:
        comm += _gloo_spans(events.gloo_cpu, events.comm_meta, events.c10d_p2p, rank, groups, unmapped)
    # the autograd engine runs a GPU job's backward on threads of its own: its top-level
    # `evaluate_function` ops are the backward work the main thread waits for meanwhile
    main, backward_elsewhere = events.threads(cpu_ops, step_tid)
    if events.overlapped:
        cpu_labels += _split_overlapped(events.overlapped, cpu_ops, path)
    kinds = {label[0] for label in cpu_labels} & {FWD, BWD}
    autograd, flow_ends = events.flows()   # on the span columns' time axis
    if kinds != {FWD, BWD}:
        # no (or only forward) schedule labels: microbatches from the main thread's op runs
        # with the backward on another thread, the main thread's record_function ranges (`## backward ##`)
        # span work they do not hold: they are labels, not ops, and what they hold is
        annotations = events.annotations() if backward_elsewhere else set()
        ops = main if not backward_elsewhere else \
            [op for op in main if (op[0], op[2]) not in annotations or _STEP.match(op[2])] + backward_elsewhere
        cpu_labels = [label for label in cpu_labels if label[0] in kinds] + _unlabeled_by_step(
            ops, sorted(steps.values()), optimizer, forward=FWD not in kinds, autograd=autograd)
    on_gpu = _GpuWork(events.launches(), events.gpu_work()) if kernels else None
    # the CPU time each comm span was issued at: which compute label issued it, and its step
    issued = _issued_at(comm, correlations, launched)
    spans = _compute_spans(cpu_labels, events.gpu_labels if kernels else {}, comm, main, on_gpu,
                           _issued_collectives(comm, issued, groups))
    optimizer = [(s, e, s) for s, e in optimizer]
    if on_gpu is not None:   # the optimizer's time is its kernels' too: one clock for a step's ops
        optimizer = [(*(on_gpu.span(s, e) or (s, e)), s) for s, e, _ in optimizer]
    work = _recorded_ops(spans, autograd, flow_ends) if not kernels else [-1] * len(spans)
    trace = _rank_trace(path, rank, world, str(info.get("backend") or ""), groups, device, versions, steps, spans,
                        comm, optimizer, unmapped, _p2p_directions(comm, cpu_labels, events.p2p_labels), work,
                        issued)
    host = top.get("host_name") or info.get("host_name")
    trace.host = str(host) if host else None
    # Kineto's ts are µs after baseTimeNanoseconds: the recorded instant of time 0 of this rank, in ns
    base = top.get("baseTimeNanoseconds")
    trace.origin_ns = (int(base) if isinstance(base, (int, float)) else 0) + round((origin or 0.0) * 1000)
    # one clock per host; without a host name every rank counts as its own clock
    trace.clock = f"host:{host}" if host else f"rank:{rank}"
    trace.gpu_work, trace.gpu_work_unlinked = (on_gpu.work, on_gpu.unlinked) if on_gpu is not None else (0, 0)
    return trace


def _unlabeled_by_step(ops: list, steps: list[tuple[float, float]], optimizer: list, *, forward: bool,
                       autograd: np.ndarray) -> list:
    """`_unlabeled_compute` a step at a time, given only the ops that start in the step and the
    optimizer spans that overlap it (all it reads of them): the same spans, in time that grows with
    the ops, not with ops x steps (a 500 MB rank holds hundreds of steps)."""
    ordered = sorted(ops, key=lambda op: (op[0], -op[1]))   # its own order, so each slice is sorted already
    starts = np.array([op[0] for op in ordered], dtype=np.float64)
    out = []
    for step_start, step_end in steps:
        lo, hi = np.searchsorted(starts, step_start, side="left"), np.searchsorted(starts, step_end, side="right")
        near = [span for span in optimizer if span[0] <= step_end and span[1] > step_start]
        out += _unlabeled_compute(ordered[lo:hi], [(step_start, step_end)], near, forward=forward, autograd=autograd)
    return out


def _label_family(name: str) -> str:
    """A label with its numbers replaced by N, so that counts group by kind of label."""
    return re.sub(r"\d+", "N", name)[:80]


def _nccl_span(name: str, args: Mapping[str, Any], start: float, end: float, rank: int,
               groups: Mapping[str, Group]) -> tuple[int, float, float, int, str, str, int, int]:
    """(kind, start, end, peer, collective, group, local peer, Seq) of one NCCL kernel (Seq: the
    collective's number in its process group, recent torch; -1 when absent)."""
    collective = args.get("Collective name")
    if collective is None:   # old traces: the kernel name says what it is (ncclKernel_AllReduce_RING_LL_Sum_float)
        token = re.match(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
        collective = token.group(1) if token else name
    canonical = _COLLECTIVES.get(str(collective).lower(), str(collective).lower())
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
        kind, start, end, peer, collective, group, local, seq = comm[index]
        if canonical is None or canonical == collective:
            continue
        if canonical in ("send", "recv") or kind != COLL:
            continue   # a p2p kernel keeps what it is; only collectives are renamed
        comm[index] = (kind, start, end, peer, canonical, group, local, seq)


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
    its gloo span. Tuples: (kind, start, end, peer, collective, group, local peer, Seq = -1)."""
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


def _issued_at(comm: list, correlations: list, launched: Mapping[int, tuple[float, Any]]) -> list[float]:
    """Per comm span, the CPU time it was issued at: a NCCL kernel's CUDA launch (`correlations`
    of the NCCL spans, which come first in `comm`; `launched`: correlation -> (launch start,
    thread)), else (gloo, or a launch the file lacks) its own start."""
    out = []
    for i, span in enumerate(comm):
        correlation = correlations[i] if i < len(correlations) else None
        out.append(launched[int(correlation)][0] if correlation is not None and int(correlation) in launched else span[1])
    return out


def _rank_trace(path, rank, world, backend, groups, device, versions, steps, spans, comm, optimizer, unmapped,
                directions, work, issued) -> RankTrace:
    step_ids = np.array(sorted(steps), dtype=np.int64)
    step_start = np.array([steps[s][0] for s in step_ids])
    step_end = np.array([steps[s][1] for s in step_ids])
    rows = [(k, s, e, mb, ch, -1, "", "", -1, 0, n, piece, -1, at) for (k, s, e, mb, ch, piece, at), n in zip(spans, work)]
    rows += [(k, s, e, -1, stage, peer, coll, group, local, direction, -1, 0, seq, at)
             for (k, s, e, peer, coll, group, local, seq), (direction, stage), at in zip(comm, directions, issued)]
    rows += [(OPT, s, e, -1, -1, -1, "", "", -1, 0, -1, 0, -1, at) for s, e, at in optimizer]
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
    )
