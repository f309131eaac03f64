"""The event pass of one rank: a run of events (`EventColumns`) at a time, in file order, into
the columns and lists `_rank_of` (rank.py) reads: CUDA launches, GPU work, CPU ops, flows, and the
few events whose names or args matter (steps, labels, gloo and c10d calls, NCCL kernels)."""
from __future__ import annotations

import collections
import itertools
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from transforms.ingest.common import RawInputError
from transforms.ingest.kineto.columns import ANNOTATION, KERNEL, EventColumns, Group
from transforms.ingest.kineto.compute import _BACKWARD_OP, _UNMAPPED_QUIET
from transforms.ingest.kineto.spans import (BWD, DEFAULT_BACKWARD_LABELS, DEFAULT_FORWARD_LABELS,
                                            DEFAULT_OPTIMIZER_LABEL, FWD, WEIGHT_LABEL, WGT, _COLLECTIVES, _NCCL, _STEP)

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



def _label_family(name: str) -> str:
    """A label with its numbers replaced by N, so that counts group by kind of label."""
    return re.sub(r"\d+", "N", name)[:80]



# torch.distributed.pipelining's OVERLAP_F_B action (DualPipeV): `PP:(0F3;3B1)OVERLAP_F_B` runs its
# sub-actions one after the other under one label
_OVERLAP_LABEL = re.compile(r"^PP:\((?P<actions>[^()]*)\)OVERLAP_F_B$")
_SUB_ACTION = re.compile(r"^(?P<stage>\d+)(?P<op>F|B|I|W)(?P<mb>\d+)$")

# torch.distributed.pipelining's p2p actions (`PP:2SEND_F0`): they hold the issue of the send / recv
_P2P_LABEL = re.compile(r"^PP:(?P<stage>\d+)(?P<op>SEND|RECV)_(?P<dir>[FB])(?P<mb>\d+)$")



def _name_class(name: str) -> int:
    """0 for a CPU op / annotation name that only joins the op list, else 1: a step, gloo span,
    c10d p2p call or record_param_comms, which the event-by-event part reads. (A name that is no
    string never gets here: columns.BadEvent.)"""
    return int(bool(_STEP.match(name)) or name.startswith(("gloo:", "c10d::", "nccl:"))
               or name in ("record_param_comms", _EMBEDDING_OP))



_GPU, _GPU_LABEL, _CPU = range(3)   # the groups of rare events


_STEP_SPAN, _GLOO, _P2P, _COMMS, _NCCL_RANGE, _EMBEDDING, _C10D, _OTHER = range(8)   # what a CPU op whose name matters is
_EMBEDDING_OP = "aten::embedding"   # its input shapes (record_shapes) say how many tokens a forward ran


def _cpu_action(name: str) -> tuple[int, Any]:
    """(what a CPU op or annotation of this name is, what its name says): a step and its number, a
    gloo span and its collective, a c10d p2p call and its direction, record_param_comms, c10d's
    `nccl:` range, or other (a label when it is an annotation)."""
    step = _STEP.match(name)
    if step:
        return _STEP_SPAN, int(step.group(1))
    if name.startswith("gloo:"):
        return _GLOO, name[5:]
    if name.startswith("c10d::send") or name.startswith("c10d::recv"):
        return _P2P, "send" if name.startswith("c10d::send") else "recv"
    if name.startswith("c10d::"):   # a collective's c10d call (`c10d::_allgather_base_`): when the thread issued it
        canonical = _COLLECTIVES.get(name[6:].rstrip("_").lower())
        return (_C10D, canonical) if canonical is not None else (_OTHER, None)
    if name == "record_param_comms":
        return _COMMS, None
    if name.startswith("nccl:"):
        return _NCCL_RANGE, None
    if name == _EMBEDDING_OP:
        return _EMBEDDING, None
    return _OTHER, None


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
        self.c10d_calls: list[tuple[str, float]] = []                   # other c10d collective calls: collective, start
        self.optimizer: list[tuple[float, float]] = []
        self.optimizer_tids: list = []          # the thread of each optimizer span
        self.p2p_labels: list[tuple[float, float, int, int]] = []       # start, end, direction (+1 F, -1 B), stage
        self.overlapped: list[tuple[float, float, str, str]] = []       # OVERLAP_F_B labels: start, end, actions, name
        self.nccl_ranges: list[tuple[float, float, str, Any]] = []      # `nccl:*` CPU ranges: start, end, name, tid
        self.embeddings: list[tuple[float, Any, int, tuple]] = []       # aten::embedding: start, tid, table rows, index shape
        # columns, one array per run
        # names and tids as ids into the file's tables (`_Interned`): what is asked of a name, once per name
        self._names, self._tids = _Interned(), _Interned()
        self._nccl_name = _PerName(lambda name: name.startswith(_NCCL), bool)
        self._special_name = _PerName(_name_class, bool)
        self._comms_name = _PerName(lambda name: name == "record_param_comms", bool)
        self._launch: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []   # CUDA runtime / driver calls: start, correlation, tid id
        self._work: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # kernels, memcpy, memset (not NCCL): correlation, start, end
        self._cpu: list[tuple[np.ndarray, ...]] = []   # every cpu_op / user_annotation: start, end, name id, tid id
        self._annotations: list[tuple[np.ndarray, np.ndarray]] = []     # user_annotation ranges: start, name id
        self._flow_starts: list[np.ndarray] = []                        # fwdbwd flow starts: forward ops autograd recorded
        self._flow_ends: list[np.ndarray] = []                          # ... and their backward nodes
        self._label_meanings: dict[str, tuple] = {}
        self._cpu_actions: dict[str, tuple[int, Any]] = {}

    def add(self, columns: EventColumns) -> None:
        if self.origin is None:
            if columns.first_complete is None:   # flows before any complete event keep their raw ts
                self._flows(columns)
                return
            self.origin = float(np.floor(columns.first_complete / 2.0 ** 32) * 2.0 ** 32)
        self._flows(columns)
        origin = self.origin
        rare: list[tuple[np.ndarray, int, Group, list, list | None, np.ndarray, np.ndarray]] = []

        launch = columns.launch
        if len(launch):
            start = launch.ts - origin
            correlation, given = columns.correlations(launch)
            tids = self._tids.of(*columns.tid_ids(launch))
            if not given.all():
                start, correlation, tids = start[given], correlation[given], tids[given]
            self._launch.append((start, correlation, tids))

        gpu = columns.gpu
        if len(gpu):
            start = gpu.ts - origin
            end = start + gpu.dur
            self.kernels += int(np.count_nonzero(gpu.code == KERNEL))
            names = self._names.of(*columns.name_ids(gpu))
            nccl = self._nccl_name.of(names, self._names.table)
            if nccl.any():
                rare.append((np.flatnonzero(nccl), _GPU, gpu, names, None, start, end))
            correlation, given = columns.correlations(gpu)
            work = ~nccl & given
            if work.any():
                self._work.append((correlation[work], start[work], end[work]))

        label = columns.gpu_label
        if len(label):
            start = label.ts - origin
            rare.append((np.arange(len(label)), _GPU_LABEL, label, self._names.of(*columns.name_ids(label)), None, start,
                         start + label.dur))

        cpu = columns.cpu
        if len(cpu):
            start = cpu.ts - origin
            end = start + cpu.dur
            names, tids = self._names.of(*columns.name_ids(cpu)), self._tids.of(*columns.tid_ids(cpu))
            self._cpu.append((start, end, names, tids))
            annotation = cpu.code == ANNOTATION
            if annotation.any():
                self._annotations.append((start[annotation], names[annotation]))
            special = self._special_name.of(names, self._names.table) | annotation
            comms = np.flatnonzero(special & self._comms_name.of(names, self._names.table))
            if len(comms):   # a record_param_comms that names no collective (older torch) is read for nothing:
                # its args' bytes tell, undecoded
                special[comms[~np.array(columns.args_holding(cpu, comms.tolist(), "Collective name"), dtype=bool)]] = False
            if special.any():
                rare.append((np.flatnonzero(special), _CPU, cpu, names, tids, start, end))
        if rare:
            self._one_by_one(columns, rare)

    def _flows(self, columns: EventColumns) -> None:
        if len(columns.flow_starts) or len(columns.flow_ends):
            self._flow_starts.append(columns.flow_starts)
            self._flow_ends.append(columns.flow_ends)

    def _one_by_one(self, columns: EventColumns, rare: list) -> None:
        """The events whose names or args matter (`rare`: per group, the positions of those events
        and the group's name ids, tid ids (None for GPU work), starts, ends). Each group feeds lists of its own (NCCL kernels,
        GPU labels; the CPU ops everything else), so each is read in its own file order."""
        name_of, tid_of = self._names.table.__getitem__, self._tids.table.__getitem__
        for at, kind, group, names, tids, starts, ends in rare:
            positions = at.tolist()
            named = list(map(name_of, names[at].tolist()))
            spans = zip(named, starts[at].tolist(), ends[at].tolist())
            if kind == _GPU:   # NCCL: read once the rank and groups are known
                self.nccl += [(name, args, ts, end) for (name, ts, end), args
                              in zip(spans, columns.args_many(group, positions))]
            elif kind == _GPU_LABEL:
                for name, ts, end in spans:
                    if not name.startswith("ProfilerStep#"):
                        self.gpu_labels[name].append((ts, end))
            else:
                self._cpu_events(columns, group, positions, named, spans, list(map(tid_of, tids[at].tolist())),
                                 (group.code[at] == ANNOTATION).tolist())

    def _cpu_events(self, columns: EventColumns, group: Group, positions: list[int], names: list[str], spans,
                    tids: list, annotation: list[bool]) -> None:
        """The CPU ops and annotations of a run whose names matter (steps, gloo and c10d calls,
        labels), in file order; what each is, asked once per name (`_cpu_action`)."""
        known = self._cpu_actions
        actions = [known.get(name) or known.setdefault(name, _cpu_action(name)) for name in names]
        # the args read, decoded together: those of c10d's p2p calls and record_param_comms
        wanted = [i for i, action in zip(positions, actions) if action[0] in (_P2P, _COMMS, _EMBEDDING)]
        args = dict(zip(wanted, columns.args_many(group, wanted))) if wanted else {}
        labels = self.deferred is None
        for i, (name, ts, end), tid, is_annotation, (action, value) in zip(positions, spans, tids, annotation, actions):
            if action == _STEP_SPAN:
                self.steps[value] = (ts, end)
                self.step_tid = tid
            elif action == _GLOO:
                self.gloo_cpu.append((value, ts, end, tid))
            elif action == _P2P:
                inputs = args[i].get("Concrete Inputs") or []
                peer = inputs[2] if len(inputs) > 2 and str(inputs[2]).lstrip("-").isdigit() else -1
                self.c10d_p2p.append((value, ts, end, int(peer)))
            elif action == _C10D:
                self.c10d_calls.append((value, ts))
            elif action == _COMMS:
                if "Collective name" in args[i]:
                    self.comm_meta.append(dict(args[i], ts=ts, tid=tid))
            elif action == _EMBEDDING:
                shapes = args[i].get("Input Dims") or []
                if len(shapes) >= 2 and shapes[0] and shapes[1] and all(isinstance(v, int) for v in [*shapes[0], *shapes[1]]):
                    self.embeddings.append((ts, tid, int(shapes[0][0]), tuple(shapes[1])))
            else:
                if action == _NCCL_RANGE:   # c10d's range around a NCCL call: names the kernels it launched
                    self.nccl_ranges.append((ts, end, name, tid))
                if is_annotation and labels:
                    self._label(name, ts, end, tid)

    def _label(self, name: str, ts: float, end: float, tid=None) -> None:
        meaning = self._label_meanings.get(name)
        if meaning is None:
            meaning = self._label_meanings[name] = self._meaning(name)
        what, *details = meaning
        if what == "optimizer":
            self.optimizer.append((ts, end))
            self.optimizer_tids.append(tid)
        elif what == "compute":
            self.cpu_labels.append((details[0], ts, end, details[1], details[2], name))
        elif what == "overlap":
            self.overlapped.append((ts, end, details[0], name))
        elif what == "p2p":
            self.p2p_labels.append((ts, end, details[0], details[1]))
        elif what == "unmapped":
            self.unmapped[details[0]] += 1

    def _meaning(self, name: str) -> tuple:
        """What a label of this name is (labels repeat: asked once per name): ("optimizer",),
        ("compute", kind, mb, chunk), ("overlap", actions), ("p2p", direction, stage),
        ("unmapped", family) or ("quiet",)."""
        if self.optimizer_label.match(name):
            return ("optimizer",)
        found = _match(self.forward_labels, name)
        kind = FWD
        if found is None:
            found, kind = _match(self.backward_labels, name), BWD
        if found is not None:
            groups_found = found.groupdict()
            mb = groups_found.get("mb")
            chunk = groups_found.get("stage") if "stage" in groups_found else groups_found.get("chunk")
            return ("compute", kind, int(mb) if mb is not None else -1, int(chunk) if chunk is not None else -1)
        if (weight := WEIGHT_LABEL.match(name)) is not None:
            return ("compute", WGT, int(weight.group("mb")), int(weight.group("stage")))
        if (overlap := _OVERLAP_LABEL.match(name)) is not None:
            return ("overlap", overlap.group("actions"))
        if (p2p_label := _P2P_LABEL.match(name)) is not None:
            return ("p2p", 1 if p2p_label.group("dir") == "F" else -1, int(p2p_label.group("stage")))
        if not _UNMAPPED_QUIET.match(name):
            return ("unmapped", f"label {_label_family(name)}")
        return ("quiet",)

    # ---------------------------------------------------------------- the columns, once all runs are in

    def launch_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, correlation) of the CUDA calls."""
        return _joined([r[0] for r in self._launch]), _joined([r[1] for r in self._launch], np.int64)

    def launch_threads(self, wanted: list[int]) -> dict[int, tuple[float, Any]]:
        """correlation -> (launch start, thread) of the CUDA calls of the `wanted` correlations (the
        last call of a correlation wins)."""
        correlations = _joined([r[1] for r in self._launch], np.int64)
        keep = np.flatnonzero(np.isin(correlations, np.array(wanted, dtype=np.int64)))
        starts = _joined([r[0] for r in self._launch])[keep].tolist()
        threads = map(self._tids.table.__getitem__, _joined([r[2] for r in self._launch], np.int64)[keep].tolist())
        return dict(zip(correlations[keep].tolist(), zip(starts, threads)))

    def work_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(correlation, start, end) of the GPU work other than NCCL kernels."""
        return tuple(_joined([r[k] for r in self._work], np.int64 if k == 0 else np.float64) for k in range(3))

    def cpu_ops(self) -> CpuOps:
        return CpuOps(_joined([r[0] for r in self._cpu]), _joined([r[1] for r in self._cpu]),
                      _joined([r[2] for r in self._cpu], np.int64), _joined([r[3] for r in self._cpu], np.int64),
                      self._names.table, self._tids.table)

    def threads(self, cpu_ops: CpuOps, step_tid) -> tuple[CpuOps, CpuOps]:
        """(the ops of the thread that ran the steps, the autograd backward ops of other threads),
        each in file order."""
        main = cpu_ops.per_tid(lambda tid: bool(tid == step_tid))
        backward = ~main & cpu_ops.per_name(lambda name: name.startswith(_BACKWARD_OP))
        return cpu_ops.take(np.flatnonzero(main)), cpu_ops.take(np.flatnonzero(backward))

    def annotations(self) -> set[tuple[float, str]]:
        names = _joined([r[1] for r in self._annotations], np.int64).tolist()
        return set(zip(_joined([r[0] for r in self._annotations]).tolist(), map(self._names.table.__getitem__, names)))

    def flows(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted fwdbwd flow starts and ends on the span columns' time axis."""
        origin = self.origin or 0.0
        return np.sort(_joined(self._flow_starts) - origin), np.sort(_joined(self._flow_ends) - origin)



class CpuOps:
    """A rank's CPU ops and annotations as columns, in file order: start, end (µs on the span axis),
    and their names and tids as ids into tables (`name_table[name_ids[i]]` is op i's name), so that
    what is asked of a name or tid is asked once per distinct one (`per_name`, `per_tid`). `names`
    and `tids` list them; iterating gives (start, end, name, tid) tuples, for the few readers that
    go op by op."""

    __slots__ = ("start", "end", "name_ids", "tid_ids", "name_table", "tid_table")

    def __init__(self, start: np.ndarray, end: np.ndarray, name_ids: np.ndarray, tid_ids: np.ndarray,
                 name_table: list, tid_table: list):
        self.start, self.end, self.name_ids, self.tid_ids = start, end, name_ids, tid_ids
        self.name_table, self.tid_table = name_table, tid_table

    @classmethod
    def from_tuples(cls, ops) -> "CpuOps":
        ops = list(ops)
        names, tids = _Interned(), _Interned()
        return cls(np.array([op[0] for op in ops], dtype=np.float64), np.array([op[1] for op in ops], dtype=np.float64),
                   names.of(np.arange(len(ops)), [op[2] for op in ops]),
                   tids.of(np.arange(len(ops)), [op[3] for op in ops]), names.table, tids.table)

    @property
    def names(self) -> list:
        return list(map(self.name_table.__getitem__, self.name_ids.tolist()))

    @property
    def tids(self) -> list:
        return list(map(self.tid_table.__getitem__, self.tid_ids.tolist()))

    def per_name(self, function, dtype=bool) -> np.ndarray:
        """function(name) of each op, computed once per distinct name."""
        return np.fromiter(map(function, self.name_table), dtype, len(self.name_table))[self.name_ids]

    def per_tid(self, function, dtype=bool) -> np.ndarray:
        """function(tid) of each op, computed once per distinct tid."""
        return np.fromiter(map(function, self.tid_table), dtype, len(self.tid_table))[self.tid_ids]

    def __len__(self) -> int:
        return len(self.name_ids)

    def __iter__(self):
        return zip(self.start.tolist(), self.end.tolist(), self.names, self.tids)

    def take(self, rows: np.ndarray) -> "CpuOps":
        rows = np.asarray(rows, dtype=np.int64)
        return CpuOps(self.start[rows], self.end[rows], self.name_ids[rows], self.tid_ids[rows], self.name_table,
                      self.tid_table)

    def __add__(self, other: "CpuOps") -> "CpuOps":
        if self.name_table is not other.name_table or self.tid_table is not other.tid_table:
            return CpuOps.from_tuples(itertools.chain(self, other))
        return CpuOps(np.concatenate([self.start, other.start]), np.concatenate([self.end, other.end]),
                      np.concatenate([self.name_ids, other.name_ids]), np.concatenate([self.tid_ids, other.tid_ids]),
                      self.name_table, self.tid_table)

    def without(self, spans: set[tuple[float, str]], unless) -> "CpuOps":
        """These ops but those whose (start, name) is in `spans`, unless `unless(name)`."""
        if not spans or not len(self):
            return self
        candidates = np.flatnonzero(np.isin(self.start, np.fromiter((s for s, _ in spans), np.float64, len(spans))))
        names = self.name_table
        drop = [i for i, name_id in zip(candidates.tolist(), self.name_ids[candidates].tolist())
                if (float(self.start[i]), names[name_id]) in spans and not unless(names[name_id])]
        if not drop:
            return self
        keep = np.ones(len(self), dtype=bool)
        keep[drop] = False
        return self.take(np.flatnonzero(keep))


class _Interned:
    """A file's distinct names (or tids), each with an id (its position in `table`). `of(ids, table)`
    turns ids into some other table (the scanner's, which only grows, or a run's own list of
    values) into ids into this one, looking at each value of that table once."""

    __slots__ = ("table", "_index", "_foreign", "_map")

    def __init__(self):
        self.table: list = []
        self._index: dict = {}
        self._foreign: list | None = None
        self._map = np.zeros(0, dtype=np.int64)

    def of(self, ids: np.ndarray, table: list) -> np.ndarray:
        if table is not self._foreign:
            self._foreign, self._map = table, np.zeros(0, dtype=np.int64)
        if len(self._map) < len(table):
            new = table[len(self._map):]
            self._map = np.concatenate([self._map, np.fromiter(map(self._id, new), np.int64, len(new))])
        return self._map[ids]

    def _id(self, value) -> int:
        try:
            found = self._index.get(value)
        except TypeError:   # an unhashable tid (a JSON array): an id of its own
            self.table.append(value)
            return len(self.table) - 1
        if found is None:
            found = self._index[value] = len(self.table)
            self.table.append(value)
        return found


class _PerName:
    """function(value) per id of a growing `_Interned` table, each value asked once."""

    __slots__ = ("function", "dtype", "values")

    def __init__(self, function, dtype):
        self.function, self.dtype, self.values = function, dtype, np.zeros(0, dtype=dtype)

    def of(self, ids: np.ndarray, table: list) -> np.ndarray:
        if len(self.values) < len(table):
            new = table[len(self.values):]
            self.values = np.concatenate([self.values, np.fromiter(map(self.function, new), self.dtype, len(new))])
        return self.values[ids]


def _joined(parts: list[np.ndarray], dtype=np.float64) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

