"""Trace -> compiled dependency model (METHOD.md sections 2 and 3), built once per job.

`compile_job(trace, meta)` reads an op trace (a `pyarrow.Table` in the lake's
TRACE_SCHEMA or in the published reference format) and returns a `JobModel`:

* the dependency graph of one (step, dp_rank) slice -- every step and DP rank
  shares it -- as integer arrays in *replay order*: ops sorted by topological
  level, so that each level is one contiguous slice of the op axis;
* per level: the predecessor rows (CSR), and the comm groups of the level laid
  out contiguously (own-timed ops first, then multi-member groups, then groups
  synchronised across DP ranks);
* the observed timeline as `[op, lane]` float64 arrays, a lane being one
  (step, dp_rank) pair (lane = step_index * dp_size + dp_rank), with times in
  seconds relative to the step's earliest op start;
* the original cost of every op (duration for compute-like ops, transfer time
  for comm-group members) and its launch delay.

The graph rules follow the authors' analyzer (ByteDance-Seed/StragglerAnalysis),
written here from its documented behaviour: op names `{optype}_{seq_id}_{stage}`,
the template slice is the first step of dp_rank 0, ops in a stream are chained in
observed (start, seq_id, optype name) order, p2p no-op detection with a 0.05 ms
tolerance, the first backward p2p waits for the forward compute two places before
the first backward compute, and the step tail per DP mode.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pyarrow as pa

from schemas.trace import COMPUTE_OPTYPES, DP_COMM_OPTYPES, IN_COMPUTE_OPTYPES, OPTYPES
from transforms.components import components
from transforms.whatif.errors import (
    WhatIfError,
    CycleError,
    DisconnectedGraphError,
    MissingOpError,
    MissingPeerError,
    TooFewStepsError,
    TraceStructureError,
    TraceValueError,
    UnknownOptypeError,
)
from transforms.whatif.result import Evidence, JobMeta

__all__ = [
    "MIN_STEPS",
    "NOOP_TOLERANCE",
    "NEGATIVE_CLAMP",
    "COMPUTE_LIKE_OPTYPES",
    "TraceColumns",
    "Level",
    "JobModel",
    "read_trace_columns",
    "compile_job",
    "median",
    "distinct",
]

# A job needs at least this many complete steps. With a single step nothing checks
# that the structure (taken from the first step) holds across steps, the ideal
# (a mean over steps) cannot separate persistent stragglers from one bad step, and
# the per-step slowdown is the job slowdown by definition.
MIN_STEPS = 1   # one profiled step is enough: the model is built from the first step, each step replays alone
# Tolerance (seconds) of the p2p no-op test: a recv starting after the last compute
# of its direction started, or a send ending before the first one ended.
NOOP_TOLERANCE = 5e-5
# Transfer times and launch delays at or below -10 ms are profiler clock noise: set to 0.
NEGATIVE_CLAMP = 1e-2
# Op types idealised by their mean duration; all others (comm types) by their median.
COMPUTE_LIKE_OPTYPES = (*COMPUTE_OPTYPES, "optimizer", "gc")

_CODE = {name: code for code, name in enumerate(OPTYPES)}
FWD, BWD = _CODE["forward-compute"], _CODE["backward-compute"]
FSEND, FRECV = _CODE["forward-send"], _CODE["forward-recv"]
BSEND, BRECV = _CODE["backward-send"], _CODE["backward-recv"]
AG, RS = _CODE["params-all-gather"], _CODE["grads-reduce-scatter"]
SEP, LN = _CODE["separate-grads-all-reduce"], _CODE["layernorm-grads-all-reduce"]
EMB, CLIP = _CODE["embedding-grads-all-reduce"], _CODE["optimizer-clip-main-grad"]
OPT, GC, WGT = _CODE["optimizer"], _CODE["gc"], _CODE["backward-weight-compute"]
IN_COMPUTE = tuple(_CODE[name] for name in IN_COMPUTE_OPTYPES)
DP_COMM = tuple(_CODE[name] for name in DP_COMM_OPTYPES)
P2P = (FSEND, FRECV, BSEND, BRECV)
# Ties in start time and seq_id are broken by optype name, alphabetically.
_NAME_RANK = np.argsort(np.argsort(np.array(OPTYPES, dtype=object)))
# p2p optype -> (peer optype, offset of the peer's model chunk from the chunk the op serves)
_PEER = {FSEND: (FRECV, +1), FRECV: (FSEND, -1), BSEND: (BRECV, -1), BRECV: (BSEND, +1)}
_REQUIRED_COLUMNS = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id", "mc", "mb_id", "gmc")

# Op kinds inside a level (their order in the level's slice).
OWN, MULTI, SYNCED = 0, 1, 2


@dataclasses.dataclass
class TraceColumns:
    """The trace as flat numpy columns (one entry per row), optype as an OPTYPES code.
    Integer and float columns keep the table's widths: widen before arithmetic that could overflow."""

    dp_rank: np.ndarray
    stage: np.ndarray
    rank: np.ndarray
    step: np.ndarray
    optype: np.ndarray
    start: np.ndarray      # seconds, as recorded (float32 or float64)
    duration: np.ndarray   # seconds
    seq_id: np.ndarray
    mc: np.ndarray
    mb_id: np.ndarray
    gmc: np.ndarray
    # True when every start and duration is a float32 value (the published traces, or a
    # lake copy of one): end times, transfers and launch delays are then rounded to
    # float32 as the reference analyzer does, which keeps its outputs reproducible to
    # ~1e-9 instead of ~1e-5 on the ratio fields that subtract near-equal step times.
    float32: bool = False
    # optional: seconds of each op's idle gap spent fetching a batch from a DataLoader (None: not recorded)
    data_wait: np.ndarray | None = None
    gc_wait: np.ndarray | None = None
    idle_within: np.ndarray | None = None
    gc_within: np.ndarray | None = None
    step_entered: np.ndarray | None = None
    step_left: np.ndarray | None = None
    gc_tail: np.ndarray | None = None
    host_load: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.step)


@dataclasses.dataclass(frozen=True)
class Level:
    """One topological level: ops [lo, hi) of the replay order.

    Ops [lo, multi_lo) time themselves (compute, or a comm group of one that is not
    DP-synchronised); [multi_lo, synced_lo) are groups of several members, ended
    together; [synced_lo, hi) are groups synchronised across the DP ranks of a step.
    Group members are contiguous and groups of equal size adjacent: `multi_runs` /
    `synced_runs` list (first op, number of groups, group size) of each run.
    `pred_columns[j]` holds each op's j-th predecessor row (padding: the -inf row).
    """

    lo: int
    hi: int
    multi_lo: int
    synced_lo: int
    pred_columns: tuple[np.ndarray, ...]
    multi_runs: tuple[tuple[int, int, int], ...]
    synced_runs: tuple[tuple[int, int, int], ...]


@dataclasses.dataclass
class JobModel:
    """A job's compiled dependency model and observed timeline. Op axis = replay order.

    Arrays indexed by op (length n_ops): `op_optype` (OPTYPES code), `op_seq_id`,
    `op_stage`, `op_mc`, `op_gmc`, `op_group` (comm group id or -1), `op_noop` (p2p
    no-op), `op_kind` (OWN / MULTI / SYNCED). CSR predecessors: `pred_ptr`
    (n_ops + 1), `pred_index` (row n_ops is the step start, time 0).
    Lane arrays (length n_lanes): `lane_step` (step number), `lane_dp`.
    `[op, lane]` float64 arrays, seconds relative to the step start:
    `observed_start`, `observed_end`, `duration`, `original_cost` (duration, or
    transfer time for comm-group members), `launch_delay`.
    """

    job_id: str
    meta: JobMeta
    steps: np.ndarray
    dp_size: int
    pp_size: int
    vpp_size: int
    uses_dp: bool
    dp_overlapped: bool
    op_optype: np.ndarray
    op_seq_id: np.ndarray
    op_stage: np.ndarray
    op_mc: np.ndarray
    op_gmc: np.ndarray
    op_group: np.ndarray
    op_noop: np.ndarray
    op_kind: np.ndarray
    group_synced: np.ndarray
    pred_ptr: np.ndarray
    pred_index: np.ndarray
    levels: list[Level]
    optimizer_ops: np.ndarray
    source_ops: np.ndarray
    lane_step: np.ndarray
    lane_dp: np.ndarray
    worker_rank: np.ndarray            # [dp_size, pp_size] global rank of each worker
    step_start: np.ndarray             # [n_steps] absolute start of each step (trace clock)
    observed_start: np.ndarray
    observed_end: np.ndarray
    duration: np.ndarray
    original_cost: np.ndarray
    launch_delay: np.ndarray
    mb_id: np.ndarray                  # [op, lane] int32 microbatch id (-1 when none)
    recorded_float32: bool = False     # see TraceColumns.float32
    data_wait: np.ndarray | None = None  # [op, lane] seconds of the gap before the op spent in DataLoader fetches
    gc_wait: np.ndarray | None = None    # [op, lane] seconds of it Python's collector ran (recorded; None: no record)
    idle_within: np.ndarray | None = None  # [op, lane] seconds of the longest untraced stretch inside a compute op (CPU ranks)
    gc_within: np.ndarray | None = None    # [op, lane] seconds Python's collector ran inside the op (recorded, with gc_wait)
    step_entered: np.ndarray | None = None  # [op, lane] seconds after the step start its rank entered the step (CPU ranks)
    step_left: np.ndarray | None = None     # [op, lane] seconds after the step start its rank left the step (CPU ranks)
    gc_tail: np.ndarray | None = None       # [op, lane] seconds the collector ran after its rank's last op of the step (recorded)
    worker_load: np.ndarray | None = None   # [dp_size, pp_size] threads per core on the worker's host (recorded; None: not)

    @property
    def n_ops(self) -> int:
        return len(self.op_optype)

    @property
    def n_lanes(self) -> int:
        return len(self.lane_step)

    def evidence(self) -> Evidence:
        """How much the job's result stands on (steps, microbatches per worker and step, DP peers, stages)."""
        forward = (self.op_optype == FWD) & (self.op_stage == 0)
        # a microbatch's compute cut into pieces (collectives inside it) keeps its microbatch id
        ids = self.mb_id[forward, 0] if self.mb_id is not None and len(self.mb_id) else np.zeros(0)
        ids = ids if len(ids) and (ids >= 0).all() else self.op_seq_id[forward]
        microbatches = len(distinct(ids)) if forward.any() else 0
        return Evidence(steps=int(self.n_steps), microbatches=int(microbatches), dp_peers=int(self.dp_size) - 1,
                        stages=int(self.pp_size))

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def op_names(self) -> list[str]:
        """`{optype}_{seq_id}_{stage}` of each op, in replay order."""
        return [_op_name(t, s, p) for t, s, p in zip(self.op_optype, self.op_seq_id, self.op_stage)]

    @property
    def op_is_comm(self) -> np.ndarray:
        return self.op_group >= 0

    def op_index(self, name: str) -> int:
        """Replay-order index of the op named `{optype}_{seq_id}_{stage}`."""
        optype, seq_id, stage = name.rsplit("_", 2)
        hit = np.flatnonzero((self.op_optype == _CODE[optype]) & (self.op_seq_id == int(seq_id)) & (self.op_stage == int(stage)))
        if not len(hit):
            raise KeyError(name)
        return int(hit[0])

    def ideal_cost(self) -> np.ndarray:
        """Ideal cost per op [n_ops] (seconds, read-only): one scalar per optype over all steps,
        DP ranks, stages, microbatches and chunks: the mean for compute-like types,
        the median (of transfer time, or of duration for ops outside comm groups) for comm types.

        Computed once per original_cost (the analysis, the classifier and the timeline all
        ask; a pass over every [op, lane] value each time, ~60 ms on an 8,192-GPU job)."""
        cached = self.__dict__.get("_ideal_cost")
        if cached is not None and cached[0] is self.original_cost:
            return cached[1]
        ideal = np.zeros(self.n_ops)
        classes = self._ideal_classes()
        for code in self.optype_codes():
            for cls in distinct(classes[self.op_optype == code]):
                rows = (self.op_optype == code) & (classes == cls)
                values = self.original_cost[rows]
                ideal[rows] = values.mean() if OPTYPES[code] in COMPUTE_LIKE_OPTYPES else median(values)
        ideal.setflags(write=False)
        self.__dict__["_ideal_cost"] = (self.original_cost, ideal)
        return ideal

    def _ideal_classes(self) -> np.ndarray:
        """Per op, which ops of its type share its ideal: all of them (0), as METHOD.md section 4
        states, unless collectives inside the compute cut it into pieces of different sizes (a
        recommendation model's embedding all-to-all inside the forward). Then the k-th piece of a
        microbatch's compute shares its ideal with the k-th pieces of the others, and each
        in-compute collective of a step (seq_id) has its own. With `meta.distinct_dp_collectives`
        (one DP collective per bucket or parameter, each its own size), each DP collective of a
        step (stage, seq_id) has its own too: the same collective over steps and DP ranks."""
        classes = np.zeros(self.n_ops, dtype=np.int64)
        if self.meta.distinct_dp_collectives:
            dp = np.isin(self.op_optype, DP_COMM)
            classes[dp] = self.op_stage[dp].astype(np.int64) * (1 << 32) + self.op_seq_id[dp]
        inside = np.isin(self.op_optype, IN_COMPUTE)
        if not inside.any():
            return classes
        classes[inside] = self.op_seq_id[inside]
        compute = np.flatnonzero(np.isin(self.op_optype, (FWD, BWD, WGT)))
        key = ((self.op_optype[compute].astype(np.int64) * (self.pp_size + 1) + self.op_stage[compute])
               * (int(self.op_gmc.max()) + 2) + self.op_gmc[compute]) * (1 << 20) + self.mb_id[compute, 0]
        order = np.lexsort((self.observed_start[compute, 0], key))
        first = np.r_[True, key[order][1:] != key[order][:-1]]
        group_start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
        classes[compute[order]] = np.arange(len(order)) - group_start
        return classes

    def ideal_by_optype(self, ideal: np.ndarray | None = None) -> dict[str, float]:
        """optype name -> ideal cost; `ideal` is `ideal_cost()` when the caller already has it."""
        ideal = self.ideal_cost() if ideal is None else ideal
        return {OPTYPES[code]: float(ideal[np.flatnonzero(self.op_optype == code)[0]]) for code in self.optype_codes()}

    def optype_codes(self) -> np.ndarray:
        """Sorted OPTYPES codes present (bincount: np.unique would import numpy.ma, ~15 ms)."""
        return np.flatnonzero(np.bincount(self.op_optype, minlength=len(OPTYPES)))

    def carried_arrivals(self) -> np.ndarray | None:
        """[op, lane] launch delays of the ops that open a worker's step (their only predecessor is
        the step start), as far as the worker's late arrival is its previous step's tail: at most
        how much later it finished that step (consecutive, profiled) than the first of its stage's
        DP peers to finish, or, where that step was not profiled, how much later it entered this
        one. None when nothing is carried (not host_compute, no DP peers, no tail measured).

        METHOD.md replays each step from one common start, and measures a step from its earliest
        op start to its latest end. Nothing makes DP ranks end a step together (the optimizer runs
        after the last collective), so a rank still finishing step k-1 arrives late at step k, and
        its peers wait for it at their first collective: the same seconds measured in both steps,
        replayed in one. A CPU rank's thread is the step's only timeline, so its arrival is that
        tail and not work of the step. Given as the step's initial condition, it lets the replay be
        compared with what ran (`WhatIfResult.replay_discrepancy`); a worker arriving later than its
        tail explains (its own time between steps: a data stall) keeps the rest as untraced time."""
        cached = self.__dict__.get("_carried_arrivals")
        if cached is not None and cached[0] is self.launch_delay:
            return cached[1]
        delay = self._carried() if self.meta.host_compute and self.dp_size >= 2 else None
        self.__dict__["_carried_arrivals"] = (self.launch_delay, delay)
        return delay

    def _carried(self) -> np.ndarray | None:
        """carried_arrivals, computed. A step whose previous step was not profiled (the first) takes
        the tail from where each rank entered it (`step_entered`: its loop's step boundary, after
        the previous iteration's optimizer step), behind the first of its stage's DP peers to enter."""
        consecutive = np.flatnonzero(np.diff(self.steps) == 1) + 1      # steps k whose k - 1 was profiled
        entered = self.step_entered
        if not len(consecutive) and entered is None:
            return None
        source = self.pred_index[self.pred_ptr[:-1]] == self.n_ops
        shape = (self.n_steps, self.dp_size)
        delay = np.zeros_like(self.launch_delay)
        for stage in range(self.pp_size):
            ops = np.flatnonzero(self.op_stage == stage)
            opening = ops[source[ops]]
            if not len(opening):
                continue
            end = self.observed_end[ops].max(axis=0).reshape(shape) + self.step_start[:, None]   # absolute
            carry = end - end.min(axis=1, keepdims=True)                                      # behind the first to end
            given = np.zeros(shape)
            if entered is not None:
                began = entered[ops].max(axis=0).reshape(shape)
                given = began - began.min(axis=1, keepdims=True)
            given[consecutive] = carry[consecutive - 1]
            delay[opening] = np.minimum(np.maximum(self.launch_delay[opening], 0.0), given.reshape(-1)[None, :])
        return delay if delay.any() else None

    def step_times_observed(self) -> np.ndarray:
        """step_t_base [n_steps]: latest op end minus earliest op start of each step (seconds)."""
        shape = (self.n_steps, self.dp_size)
        end = self.observed_end.max(axis=0).reshape(shape).max(axis=1)
        start = self.observed_start.min(axis=0).reshape(shape).min(axis=1)
        return end - start


def median(values, axis: int | None = None, keepdims: bool = False):
    """np.median of a non-empty array, equal to it bit for bit (the mean of the two middle values
    when the count is even; NaN when any value is) but without its numpy.ma import (~10 ms a process).
    With `axis`: per slice along it, an array (NaN where the slice holds one)."""
    values = np.asarray(values, dtype=np.float64) if not isinstance(values, np.ndarray) else values
    if axis is not None:
        ordered = np.sort(values, axis=axis)              # NaN sorts last
        n = values.shape[axis]
        low = np.take(ordered, [(n - 1) // 2], axis=axis)
        high = np.take(ordered, [n // 2], axis=axis)
        out = np.where(np.isnan(values).any(axis=axis, keepdims=True), np.nan, (low + high) / 2)
        return out if keepdims else np.squeeze(out, axis=axis)
    values = values.ravel()
    if np.isnan(values).any():
        return float("nan")
    half = len(values) // 2
    if len(values) % 2:
        return float(np.partition(values, half)[half])
    middle = np.partition(values, (half - 1, half))
    return float((middle[half - 1] + middle[half]) / 2)


def distinct(values: np.ndarray) -> np.ndarray:
    """np.unique(values) (sorted distinct values) of a NaN-free array, without the masked-array
    check numpy 2.4's np.unique makes, which imports numpy.ma (~12 ms a process)."""
    ordered = np.sort(np.asarray(values).ravel())
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered


def _op_name(optype: int, seq_id: int, stage: int) -> str:
    return f"{OPTYPES[optype]}_{seq_id}_{stage}"


# --------------------------------------------------------------------------- reading

def _whole_column(trace: pa.Table, name: str) -> np.ndarray | None:
    """An optional float column as float64, when the trace has it on every row (a recorded
    measurement: gc_wait, idle_within, gc_within); None when absent or partly null."""
    if name not in trace.column_names or not trace.num_rows or trace.column(name).null_count:
        return None
    return trace.column(name).to_numpy(zero_copy_only=False).astype(np.float64)


def read_trace_columns(trace: pa.Table, job_id: str = "") -> TraceColumns:
    """Normalise a trace table (lake TRACE_SCHEMA or the published float32/int8 format)
    into numpy columns. Raises TraceValueError / UnknownOptypeError on bad values."""
    missing = [name for name in _REQUIRED_COLUMNS if name not in trace.column_names]
    if missing:
        raise TraceValueError(f"missing columns {missing}; the trace needs {list(_REQUIRED_COLUMNS)}", job_id=job_id)
    if trace.num_rows == 0:
        raise TooFewStepsError(f"the trace has no rows; at least {MIN_STEPS} complete steps are needed", job_id=job_id)
    for name in _REQUIRED_COLUMNS:
        nulls = trace.column(name).null_count
        if nulls:
            raise TraceValueError(f"column {name!r} has {nulls} null values", job_id=job_id)

    # Columns keep their recorded widths (int8 ranks, float32 times in the published format):
    # often zero-copy views of the Arrow buffers, a third of the memory of int64 / float64.
    def ints(name: str) -> np.ndarray:
        values = column_values(trace.column(name))
        return values if values.dtype.kind in "iu" else values.astype(np.int64)

    def floats(name: str) -> np.ndarray:
        values = column_values(trace.column(name))
        return values if values.dtype.kind == "f" else values.astype(np.float64)

    columns = TraceColumns(
        dp_rank=ints("dp_rank"), stage=ints("stage"), rank=ints("rank"), step=ints("step"),
        optype=optype_codes(trace.column("optype"), job_id),
        start=floats("start_ts"), duration=floats("duration"), seq_id=ints("seq_id"),
        mc=ints("mc"), mb_id=ints("mb_id"), gmc=ints("gmc"),
    )
    if "data_wait" in trace.column_names and trace.column("data_wait").null_count < trace.num_rows:
        columns.data_wait = np.nan_to_num(trace.column("data_wait").to_numpy(zero_copy_only=False).astype(np.float64))
    columns.gc_wait, columns.idle_within = _whole_column(trace, "gc_wait"), _whole_column(trace, "idle_within")
    columns.gc_within = _whole_column(trace, "gc_within") if columns.gc_wait is not None else None
    columns.step_entered = _whole_column(trace, "step_entered")
    columns.step_left = _whole_column(trace, "step_left") if columns.step_entered is not None else None
    columns.gc_tail = _whole_column(trace, "gc_tail") if columns.gc_wait is not None and columns.step_left is not None else None
    columns.host_load = _whole_column(trace, "host_load")
    columns.float32 = all(
        pa.types.is_float32(trace.schema.field(name).type)
        or bool((values.astype(np.float32).astype(np.float64) == values).all())
        for name, values in (("start_ts", columns.start), ("duration", columns.duration))
    )
    bad = ~(np.isfinite(columns.start) & np.isfinite(columns.duration)) | (columns.duration < 0)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise TraceValueError(
            f"{int(bad.sum())} rows have a non-finite start/duration or a negative duration "
            f"(first: start_ts={columns.start[row]!r}, duration={columns.duration[row]!r})",
            **_row_context(columns, row),
        ).with_context(job_id=job_id)
    return columns


def column_values(column: pa.ChunkedArray) -> np.ndarray:
    """A null-free integer or float column as one numpy array, read from its value buffers.

    Not `to_numpy()`: since pyarrow 2x that imports pandas (~0.3 s), which the one-job path
    of `strag analyze` otherwise never needs. Other types fall back to `to_numpy()`."""
    kind = column.type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        return column.to_numpy()
    prefix = "f" if pa.types.is_floating(kind) else "i" if pa.types.is_signed_integer(kind) else "u"
    dtype = np.dtype(f"{prefix}{kind.bit_width // 8}")
    parts = [np.frombuffer(chunk.buffers()[1], dtype=dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize)
             for chunk in column.chunks if len(chunk)]
    if not parts:
        return np.empty(0, dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def nullable_values(column: pa.ChunkedArray) -> np.ndarray:
    """A numeric column as float64, NaN where null (value buffers when it has no nulls)."""
    if column.null_count == 0:
        return column_values(column).astype(np.float64, copy=False)
    parts = [chunk.to_numpy(zero_copy_only=False).astype(np.float64) for chunk in column.chunks]
    return np.concatenate(parts) if parts else np.empty(0)




def optype_codes(column: pa.ChunkedArray, job_id: str = "") -> np.ndarray:
    """OPTYPES codes of a string or dictionary column; unknown names raise UnknownOptypeError."""
    if not pa.types.is_dictionary(column.type):
        column = column.dictionary_encode()   # a method: no pyarrow.compute import on this path
    column = column.unify_dictionaries() if isinstance(column, pa.ChunkedArray) else column
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if not chunks:
        return np.zeros(0, dtype=np.int64)
    names = chunks[0].dictionary.to_pylist()
    lookup = np.array([_CODE.get(name, -1) for name in names] + [-1], dtype=np.int8)
    indices = np.asarray(column_values(pa.chunked_array([chunk.indices for chunk in chunks])), dtype=np.int64)
    codes = lookup[indices]
    if (codes < 0).any():
        row = int(np.flatnonzero(codes < 0)[0])
        raise UnknownOptypeError(
            f"unknown optype {names[indices[row]]!r} (row {row}); known op types: {', '.join(OPTYPES)}",
            op=names[indices[row]], job_id=job_id,
        )
    return codes


def _row_context(columns: TraceColumns, row: int) -> dict:
    return dict(
        step=int(columns.step[row]), dp_rank=int(columns.dp_rank[row]), stage=int(columns.stage[row]),
        op=_op_name(int(columns.optype[row]), int(columns.seq_id[row]), int(columns.stage[row])) if columns.optype[row] >= 0 else None,
    )


# --------------------------------------------------------------------------- compiling

def compile_job(trace: pa.Table | TraceColumns, meta: JobMeta, job_id: str = "", *,
                structure_from: JobModel | None = None) -> JobModel:
    """Build the dependency model of a job and lay its trace out as [op, lane] arrays.

    structure_from: reuse the dependency graph of an earlier model of the same job
    (another session, or a replayed timeline) instead of inferring it from this
    trace's timing; the trace must then hold exactly that model's ops in every lane.

    Raises a `WhatIfError` subclass (naming job, step, worker and op) when the trace
    cannot be analysed: see transforms.whatif.errors.
    """
    columns = trace if isinstance(trace, TraceColumns) else read_trace_columns(trace, job_id)
    try:
        return _compile(columns, meta, job_id, structure_from)
    except WhatIfError as error:
        raise error.with_context(job_id=job_id)


_STRUCTURE_FIELDS = (
    "vpp_size", "uses_dp", "dp_overlapped", "op_optype", "op_seq_id", "op_stage", "op_mc", "op_gmc",
    "op_group", "op_noop", "op_kind", "group_synced", "pred_ptr", "pred_index", "levels",
    "optimizer_ops", "source_ops",
)


def _compile(columns: TraceColumns, meta: JobMeta, job_id: str, structure_from: JobModel | None) -> JobModel:
    dp_size, pp_size = int(meta.dp_size), int(meta.pp_size)
    _check_ranges(columns, dp_size, pp_size)
    steps, step_index = _factorize_steps(columns.step)
    if len(steps) < MIN_STEPS:
        raise TooFewStepsError(
            f"the trace has {len(steps)} step(s) ({steps.tolist()}); the analysis needs at least {MIN_STEPS} complete steps",
        )
    seq_dim = int(columns.seq_id.max()) + 1
    if structure_from is not None:
        structure = {name: getattr(structure_from, name) for name in _STRUCTURE_FIELDS}
        seq_dim = max(seq_dim, int(structure["op_seq_id"].max()) + 1)
    # op key of every row; int32 when the key space fits (half the memory traffic of int64)
    key_type = np.int32 if len(OPTYPES) * pp_size * seq_dim < 2**31 else np.int64
    keys = (columns.optype.astype(key_type) * pp_size + columns.stage) * seq_dim + columns.seq_id

    if structure_from is None:
        # Template: the first step of dp_rank 0 (every step and DP rank must match it).
        template_rows = np.flatnonzero((step_index == 0) & (columns.dp_rank == 0))
        if not len(template_rows):
            raise TraceStructureError("dp_rank 0 has no ops in the first step", step=int(steps[0]), dp_rank=0)
        template_rows = template_rows[np.argsort(keys[template_rows], kind="stable")]
        duplicate = np.flatnonzero(np.diff(keys[template_rows]) == 0)
        if len(duplicate):
            row = int(template_rows[duplicate[0]])
            raise TraceStructureError("op recorded twice in the same step and worker", **_row_context(columns, row))
        template = _Template(columns, template_rows, pp_size, steps[0])
        if template.vpp != int(meta.vpp_size):
            raise TraceStructureError(
                f"the trace has {template.vpp} model chunk(s) per stage (max mc + 1) but the job meta says vpp_size={meta.vpp_size}",
                step=int(steps[0]), dp_rank=0,
            )
        structure = _infer_structure(template, dp_size, meta)
    # Sorted op keys of the structure and the replay index of each.
    op_keys = (structure["op_optype"] * pp_size + structure["op_stage"]) * seq_dim + structure["op_seq_id"]
    order = np.argsort(op_keys, kind="stable")
    flat = _map_rows_to_ops(columns, keys, op_keys[order], order, step_index, dp_size, steps, structure)
    del keys, step_index
    n_ops, n_lanes = len(op_keys), len(steps) * dp_size

    def layout(values: np.ndarray, dtype=np.float64) -> np.ndarray:
        out = np.empty(n_ops * n_lanes, dtype=dtype)
        out[flat] = values
        return out.reshape(n_ops, n_lanes)

    observed_start = layout(columns.start)   # absolute, made relative to the step start in place
    step_start = observed_start.min(axis=0).reshape(len(steps), dp_size).min(axis=1)
    lane_start = np.repeat(step_start, dp_size)[None, :]
    observed_start -= lane_start
    duration = layout(columns.duration)
    if columns.float32:
        observed_end = layout(np.add(columns.start, columns.duration, dtype=np.float32))   # no copies of float32 inputs
        observed_end -= lane_start
    else:
        observed_end = observed_start + duration

    model = JobModel(
        job_id=job_id, meta=meta, steps=steps, dp_size=dp_size, pp_size=pp_size, **structure,
        lane_step=np.repeat(steps, dp_size), lane_dp=np.tile(np.arange(dp_size), len(steps)),
        worker_rank=_worker_ranks(columns, dp_size, pp_size),
        step_start=step_start,
        observed_start=observed_start, observed_end=observed_end, duration=duration,
        original_cost=duration, launch_delay=np.zeros(0),
        mb_id=layout(columns.mb_id, np.int32), recorded_float32=columns.float32,
        data_wait=None if columns.data_wait is None else layout(columns.data_wait),
        gc_wait=None if columns.gc_wait is None else layout(columns.gc_wait),
        idle_within=None if columns.idle_within is None else layout(columns.idle_within),
        gc_within=None if columns.gc_within is None else layout(columns.gc_within),
        step_entered=None if columns.step_entered is None else layout(columns.step_entered) - lane_start,
        step_left=None if columns.step_left is None else layout(columns.step_left) - lane_start,
        gc_tail=None if columns.gc_tail is None else layout(columns.gc_tail),
        worker_load=None if columns.host_load is None else _worker_load(columns, dp_size, pp_size),
    )
    model.original_cost = _original_cost(model)
    model.launch_delay = _launch_delays(model)
    return model


def _infer_structure(template: "_Template", dp_size: int, meta: JobMeta) -> dict:
    """The dependency graph of the template as replay-order arrays (the _STRUCTURE_FIELDS)."""
    graph = _build_graph(template, dp_size, meta)
    graph.check_connected(template)
    node_level = graph.levels(template)

    # Replay order: by level, then kind (own / multi / synced), group size, group, template order.
    kind = graph.kinds()
    size = np.array([len(graph.group_members[g]) if g >= 0 else 0 for g in graph.op_group])
    perm = np.lexsort((np.arange(template.n), graph.op_group, size, kind, node_level))
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(len(perm))
    n_ops = template.n

    # Groups renumbered in replay order.
    group_t = graph.op_group[perm]
    in_order = group_t[group_t >= 0]
    first = np.unique(in_order, return_index=True)[1]
    renumber = in_order[np.sort(first)]
    group_order = np.full(graph.n_groups, -1, dtype=np.int64)
    group_order[renumber] = np.arange(len(renumber))
    op_group = np.full(len(group_t), -1, dtype=np.int64)   # a job without groups (one worker) has none
    op_group[group_t >= 0] = group_order[group_t[group_t >= 0]]
    group_synced = np.zeros(len(renumber), dtype=bool)
    group_synced[group_order] = graph.group_synced

    pred_lists = [sorted(int(inverse[p]) for p in graph.preds[old]) for old in perm]
    pred_count = np.array([max(len(p), 1) for p in pred_lists], dtype=np.int64)
    pred_ptr = np.concatenate([[0], np.cumsum(pred_count)])
    pred_index = np.array([x for p in pred_lists for x in (p or [n_ops])], dtype=np.int64)
    return dict(
        vpp_size=template.vpp, uses_dp=graph.uses_dp, dp_overlapped=graph.dp_overlapped,
        op_optype=template.optype[perm], op_seq_id=template.seq_id[perm], op_stage=template.stage[perm],
        op_mc=template.mc[perm], op_gmc=template.gmc[perm], op_group=op_group,
        op_noop=graph.noop[perm], op_kind=kind[perm], group_synced=group_synced,
        pred_ptr=pred_ptr, pred_index=pred_index,
        levels=_levels(node_level[perm], kind[perm], op_group, pred_ptr, pred_index, n_ops),
        optimizer_ops=np.flatnonzero(template.optype[perm] == OPT),
        source_ops=np.flatnonzero(np.array([not p for p in pred_lists])),
    )


def _check_ranges(columns: TraceColumns, dp_size: int, pp_size: int) -> None:
    for name, size, meta_field in (("dp_rank", dp_size, "dp_size"), ("stage", pp_size, "pp_size")):
        values = getattr(columns, name)
        bad = (values < 0) | (values >= size)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise TraceValueError(
                f"{name} {int(values[row])} outside the job's parallelism ({meta_field}={size}): check the meta file",
                **_row_context(columns, row),
            )
    if (columns.seq_id < 0).any():
        row = int(np.flatnonzero(columns.seq_id < 0)[0])
        raise TraceValueError(f"negative seq_id {int(columns.seq_id[row])}", **_row_context(columns, row))


def _factorize_steps(step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct steps and each row's index into them (O(n) when steps are dense)."""
    low, high = int(step.min()), int(step.max())
    if high - low < 50_000_000:
        offset = step - low
        present = np.bincount(offset, minlength=high - low + 1) > 0
        index_of = np.cumsum(present) - 1
        return np.flatnonzero(present) + low, index_of[offset]
    steps, index = np.unique(step, return_inverse=True)
    return steps, index


def _map_rows_to_ops(columns, keys, template_keys, inverse, step_index, dp_size, steps, structure) -> np.ndarray:
    """Position of every row in the [op, lane] layout (op * n_lanes + lane; template_keys: sorted
    op keys, inverse: the replay index of each); raises when a lane's op set differs from the template."""
    key_space = int(keys.max()) + 1
    if key_space <= 50_000_000:   # key -> replay index in one gather
        lookup = np.full(key_space, -1, dtype=np.int64)
        lookup[template_keys] = inverse
        op = lookup[keys]
    else:
        pos = np.minimum(np.searchsorted(template_keys, keys), len(template_keys) - 1)
        op = np.where(template_keys[pos] == keys, inverse[pos], -1)
    unknown = op < 0
    if unknown.any():
        row = int(np.flatnonzero(unknown)[0])
        raise TraceStructureError(
            f"op not present in the template (step {int(steps[0])}, dp_rank 0): the op structure must be the same "
            f"in every step and DP rank", **_row_context(columns, row),
        )
    n_ops, n_lanes = len(template_keys), len(steps) * dp_size
    flat = op   # in place, no [row]-sized temporaries: flat = op * n_lanes + step_index * dp_size + dp_rank
    flat *= n_lanes
    flat += step_index * dp_size
    flat += columns.dp_rank
    seen = np.zeros(n_ops * n_lanes, dtype=bool)
    seen[flat] = True
    if len(flat) == n_ops * n_lanes and seen.all():   # every (op, lane) present, so each exactly once
        return flat
    lane = flat % n_lanes
    counts = np.bincount(flat, minlength=n_ops * n_lanes)
    lane_rows = np.bincount(lane, minlength=n_lanes)
    if (lane_rows == 0).any():
        empty = int(np.flatnonzero(lane_rows == 0)[0])
        raise TraceStructureError(
            f"no ops recorded for this step and DP rank (the job has dp_size={dp_size}); "
            "every sampled step needs all DP ranks",
            step=int(steps[empty // dp_size]), dp_rank=empty % dp_size,
        )
    bad = int(np.flatnonzero(counts != 1)[0])
    bad_op, bad_lane = divmod(bad, n_lanes)
    what = "missing" if counts[bad] == 0 else f"recorded {int(counts[bad])} times"
    raise TraceStructureError(
        f"op {what} in this step and DP rank but present once in the template (step {int(steps[0])}, dp_rank 0): "
        "the op structure must be the same in every step and DP rank",
        step=int(steps[bad_lane // dp_size]), dp_rank=bad_lane % dp_size, stage=int(structure["op_stage"][bad_op]),
        op=_op_name(int(structure["op_optype"][bad_op]), int(structure["op_seq_id"][bad_op]), int(structure["op_stage"][bad_op])),
    )


def _worker_load(columns: TraceColumns, dp_size: int, pp_size: int) -> np.ndarray:
    """[dp_size, pp_size] the largest host_load of each worker's rows (one value per rank)."""
    load = np.zeros(dp_size * pp_size)
    np.maximum.at(load, columns.dp_rank.astype(np.int64) * pp_size + columns.stage, columns.host_load)
    return load.reshape(dp_size, pp_size)


def _worker_ranks(columns: TraceColumns, dp_size: int, pp_size: int) -> np.ndarray:
    """[dp_size, pp_size] global rank of each worker; raises when a worker has several."""
    worker = columns.dp_rank.astype(np.int32 if dp_size * pp_size < 2**31 else np.int64) * pp_size + columns.stage
    rank = np.zeros(dp_size * pp_size, dtype=np.int64)
    rank[worker] = columns.rank            # any row's rank; then check that every row agrees
    if (rank[worker] == columns.rank).all():
        return rank.reshape(dp_size, pp_size)
    low = np.full(dp_size * pp_size, np.iinfo(np.int64).max)
    high = np.full(dp_size * pp_size, np.iinfo(np.int64).min)
    np.minimum.at(low, worker, columns.rank)
    np.maximum.at(high, worker, columns.rank)
    if (low != high).any():
        bad = int(np.flatnonzero(low != high)[0])
        raise TraceStructureError(
            f"worker recorded under several global ranks ({int(low[bad])}..{int(high[bad])}); one rank per worker expected",
            dp_rank=bad // pp_size, stage=bad % pp_size,
        )
    return low.reshape(dp_size, pp_size)


def _original_cost(model: JobModel) -> np.ndarray:
    """Duration for ops outside comm groups; transfer time (end - latest start of the group
    in the step, DP ranks included when synchronised) for members. <= -10 ms -> 0."""
    cost = model.duration.copy()
    comm = np.flatnonzero(model.op_group >= 0)
    if not len(comm):
        return cost
    comm = comm[np.argsort(model.op_group[comm], kind="stable")]
    groups, first = np.unique(model.op_group[comm], return_index=True)
    sizes = np.diff(np.append(first, len(comm)))
    latest = _segment_max(model.observed_start, comm, first, sizes)
    synced = model.group_synced[groups]
    if synced.any():
        shape = (int(synced.sum()), model.n_steps, model.dp_size)
        latest[synced] = np.broadcast_to(latest[synced].reshape(shape).max(axis=2, keepdims=True), shape).reshape(shape[0], -1)
    transfer = model.observed_end[comm] - np.repeat(latest, sizes, axis=0)
    if model.recorded_float32:
        transfer = transfer.astype(np.float32).astype(np.float64)
    transfer[transfer <= -NEGATIVE_CLAMP] = 0.0
    cost[comm] = transfer
    return cost


def _launch_delays(model: JobModel) -> np.ndarray:
    """start - latest end of the op's predecessors (or - step start when it has none); <= -10 ms -> 0."""
    # Source ops have the single predecessor n_ops (the step start, time 0): read row 0, then zero it.
    index = np.where(model.pred_index < model.n_ops, model.pred_index, 0)
    ready = _segment_max(model.observed_end, index, model.pred_ptr[:-1], np.diff(model.pred_ptr))
    ready[model.pred_index[model.pred_ptr[:-1]] == model.n_ops] = 0.0
    delay = np.subtract(model.observed_start, ready, out=ready)
    if model.recorded_float32:
        delay[...] = delay.astype(np.float32)
    delay[delay <= -NEGATIVE_CLAMP] = 0.0
    return delay


def _segment_max(values: np.ndarray, index: np.ndarray, first: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Row-wise max over segments of rows: out[i] = max of values[index[first[i] + j]] for
    j < sizes[i] (every size >= 1). The same as np.maximum.reduceat(values[index], first, axis=0),
    without gathering every row first and ~6x faster on [op, lane] arrays: one pass per position
    in a segment (segments are short), not per segment."""
    out = values[index[first]]
    for j in range(1, int(sizes.max())):
        rows = np.flatnonzero(sizes > j)
        if 2 * len(rows) > len(first):   # most segments go on: one pass over all (a short one repeats its last)
            np.maximum(out, values[index[first + np.minimum(j, sizes - 1)]], out=out)
        else:
            out[rows] = np.maximum(out[rows], values[index[first[rows] + j]])
    return out


def _levels(level: np.ndarray, kind: np.ndarray, group: np.ndarray, pred_ptr: np.ndarray, pred_index: np.ndarray,
            n_ops: int) -> list[Level]:
    """Per-level replay plans; ops must already be sorted by level, kind, group size, group.
    The predecessor columns of every level are views of one [max predecessors, op] table;
    the rest is plain Python over the template's few hundred ops (cheaper than numpy calls)."""
    counts = np.diff(pred_ptr)
    table = np.full((int(counts.max()), n_ops), n_ops + 1, dtype=np.int64)   # padding: the -inf row of the replay
    for j in range(len(table)):
        has = np.flatnonzero(counts > j)
        table[j, has] = pred_index[pred_ptr[has] + j]
    bounds = (np.flatnonzero(np.diff(level)) + 1).tolist()
    starts, ends = [0, *bounds], [*bounds, n_ops]
    widths = np.maximum.reduceat(counts, starts).tolist()
    own = np.concatenate([[0], np.cumsum(kind == OWN)]).tolist()
    multi = np.concatenate([[0], np.cumsum(kind == MULTI)]).tolist()
    groups = group.tolist()
    out = []
    for lo, hi, width in zip(starts, ends, widths):
        multi_lo = lo + own[hi] - own[lo]
        synced_lo = multi_lo + multi[hi] - multi[lo]
        out.append(Level(
            lo=lo, hi=hi, multi_lo=multi_lo, synced_lo=synced_lo, pred_columns=tuple(table[:width, lo:hi]),
            multi_runs=_group_runs(groups, multi_lo, synced_lo), synced_runs=_group_runs(groups, synced_lo, hi),
        ))
    return out


def _group_runs(groups: list[int], lo: int, hi: int) -> tuple[tuple[int, int, int], ...]:
    """(first op, number of groups, group size) of each run of equal-size groups in [lo, hi)
    (a group: consecutive ops with the same group id)."""
    runs: list[tuple[int, int, int]] = []
    first = lo
    while first < hi:
        end = first + 1
        while end < hi and groups[end] == groups[first]:
            end += 1
        size = end - first
        if runs and runs[-1][2] == size:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, size)
        else:
            runs.append((first, 1, size))
        first = end
    return tuple(runs)


# --------------------------------------------------------------------------- template and graph

class _Template:
    """The ops of the template slice (first step, dp_rank 0), indexed 0..n-1 (sorted by key)."""

    def __init__(self, columns: TraceColumns, rows: np.ndarray, pp_size: int, step: int):
        self.step = int(step)
        self.optype = columns.optype[rows].astype(np.int64)
        self.seq_id = columns.seq_id[rows].astype(np.int64)
        self.stage = columns.stage[rows].astype(np.int64)
        self.mc = columns.mc[rows].astype(np.int64)
        self.gmc = columns.gmc[rows].astype(np.int64)
        self.start = columns.start[rows].astype(np.float64)
        self.end = self.start + columns.duration[rows].astype(np.float64)
        self.n = len(rows)
        self.pp = pp_size
        self.vpp = max(int(self.mc.max()) + 1, 1) if self.n else 1
        self.index = {key: i for i, key in enumerate(zip(self.optype.tolist(), self.seq_id.tolist(), self.stage.tolist()))}
        # Observed order within each stage (start, seq_id, optype name), for `ordered`.
        self._observed = np.lexsort((_NAME_RANK[self.optype], self.seq_id, self.start, self.stage))
        self._stage_bounds = np.searchsorted(self.stage[self._observed], np.arange(pp_size + 1)).tolist()
        for stage in range(pp_size):
            if not (self.stage == stage).any():
                raise TraceStructureError(
                    f"stage has no ops in the template (step {self.step}, dp_rank 0) but the job has pp_size={pp_size}",
                    step=self.step, dp_rank=0, stage=stage,
                )

    def name(self, op: int) -> str:
        return _op_name(int(self.optype[op]), int(self.seq_id[op]), int(self.stage[op]))

    def find(self, optype: int, seq_id: int, stage: int) -> int | None:
        return self.index.get((optype, int(seq_id), int(stage)))

    def has(self, optype: int) -> bool:
        """Whether the template holds any op of this type (on any stage)."""
        return bool((self.optype == optype).any())

    def tail_op(self, optype: int, stage: int, why: str) -> list[int]:
        """[the op `{optype}_0_{stage}`], or [] when the job records no op of this type at all
        (a trainer without that step, e.g. no grad clipping, or a converted profiler trace
        that has no gc or layernorm all-reduce); missing on only some stages is an error."""
        return [self.require(optype, 0, stage, why)] if self.has(optype) else []

    def require(self, optype: int, seq_id: int, stage: int, why: str) -> int:
        op = self.find(optype, seq_id, stage)
        if op is None:
            raise MissingOpError(
                f"op {_op_name(optype, seq_id, stage)} is missing from the template (step {self.step}, dp_rank 0): {why}",
                step=self.step, dp_rank=0, stage=stage, op=_op_name(optype, seq_id, stage),
            )
        return op

    def ordered(self, stage: int, optypes: tuple[int, ...]) -> np.ndarray:
        """Ops of these types on a stage in observed order: start, seq_id, optype name."""
        ops = self._observed[self._stage_bounds[stage]:self._stage_bounds[stage + 1]]
        types = self.optype[ops]
        keep = types == optypes[0]
        for optype in optypes[1:]:
            keep |= types == optype
        return ops[keep]

    def error(self, cls, message: str, op: int | None = None, stage: int | None = None):
        return cls(message, step=self.step, dp_rank=0, stage=stage if op is None else int(self.stage[op]),
                   op=None if op is None else self.name(op))


class _Graph:
    """Dependency edges (predecessor sets) and comm groups over template ops."""

    def __init__(self, n: int):
        self.preds: list[set[int]] = [set() for _ in range(n)]
        self.op_group = np.full(n, -1, dtype=np.int64)
        self.noop = np.zeros(n, dtype=bool)
        self.group_members: list[list[int]] = []
        self.synced: list[bool] = []
        self.uses_dp = False
        self.dp_overlapped = False

    @property
    def n_groups(self) -> int:
        return len(self.group_members)

    @property
    def group_synced(self) -> np.ndarray:
        return np.array(self.synced, dtype=bool)

    def edge(self, before: int, after: int) -> None:
        self.preds[after].add(before)

    def chain(self, ops, after=()) -> None:
        """Each op waits for the previous one; the first waits for every op in `after`."""
        previous = list(after)
        for op in ops:
            for before in previous:
                self.edge(before, int(op))
            previous = [int(op)]

    def group(self, members: list[int], synced: bool) -> None:
        for op in members:
            self.op_group[op] = len(self.group_members)
        self.group_members.append([int(op) for op in members])
        self.synced.append(synced)

    def kinds(self) -> np.ndarray:
        kind = np.full(len(self.preds), OWN, dtype=np.int64)
        for members, synced in zip(self.group_members, self.synced):
            if synced:
                kind[members] = SYNCED
            elif len(members) > 1:
                kind[members] = MULTI
        return kind

    def levels(self, template: _Template) -> np.ndarray:
        """Topological level of each op, comm groups contracted to one node (Kahn's algorithm)."""
        n = len(self.preds)
        node = np.where(self.op_group >= 0, n + self.op_group, np.arange(n))
        node_preds: dict[int, set[int]] = {}
        for op, preds in enumerate(self.preds):
            node_preds.setdefault(int(node[op]), set()).update(int(node[p]) for p in preds)
        succ: dict[int, list[int]] = {v: [] for v in node_preds}
        indegree = {}
        for v, preds in node_preds.items():
            indegree[v] = len(preds)
            for u in preds:
                succ[u].append(v)
        level = {}
        frontier = [v for v, d in indegree.items() if d == 0]
        depth = 0
        while frontier:
            following = []
            for v in frontier:
                level[v] = depth
                for w in succ[v]:
                    indegree[w] -= 1
                    if indegree[w] == 0:
                        following.append(w)
            frontier, depth = following, depth + 1
        if len(level) < len(node_preds):
            self._raise_cycle(template, node, node_preds, set(node_preds) - set(level))
        return np.array([level[int(v)] for v in node], dtype=np.int64)

    def _raise_cycle(self, template: _Template, node: np.ndarray, node_preds, stuck: set[int]) -> None:
        members = {}
        for op, v in enumerate(node.tolist()):
            members.setdefault(v, []).append(op)
        # Walk predecessors inside the stuck set until a node repeats: that closes a cycle.
        v = min(stuck)
        path, seen = [], {}
        while v not in seen:
            seen[v] = len(path)
            path.append(v)
            v = min(u for u in node_preds[v] if u in stuck)
        cycle = path[seen[v]:]
        names = [" + ".join(template.name(op) for op in members[u]) for u in cycle]
        first = members[cycle[0]][0]
        raise template.error(
            CycleError,
            "dependency cycle (comm groups contracted; the replay would deadlock): "
            + " -> ".join(reversed(names + names[:1])),
            op=first,
        )

    def check_connected(self, template: _Template) -> None:
        """Every op must be linked (by dependencies or comm groups) to a step's optimizer,
        except p2p no-ops, which may form chains of their own."""
        links = [(p, op) for op, preds in enumerate(self.preds) for p in preds]
        links += [(op, members[0]) for members in self.group_members for op in members[1:]]
        roots = np.array(components(len(self.preds), links))
        with_optimizer = set(roots[template.optype == OPT].tolist())
        loose = ~np.isin(roots, list(with_optimizer)) & ~self.noop
        if loose.any():
            ops = np.flatnonzero(loose)
            ops = ops[np.lexsort((template.seq_id[ops], template.start[ops]))]
            listed = ", ".join(template.name(op) for op in ops[:6]) + (" ..." if len(ops) > 6 else "")
            raise template.error(
                DisconnectedGraphError,
                f"{len(ops)} op(s) not linked to any optimizer op by dependencies or comm groups ({listed}); "
                "the dependency model has no place for them: check that the op types and seq_ids match the job's "
                "parallelism (e.g. DP comm ops in a job without DP, or an extra tail op)",
                op=int(ops[0]),
            )


def _build_graph(template: _Template, dp_size: int, meta: JobMeta) -> _Graph:
    graph = _Graph(template.n)
    pp = template.pp
    _p2p_dependencies(template, graph, meta.host_compute)
    for stage in range(pp):
        graph.chain(template.ordered(stage, (FWD, BWD, WGT)))   # a stage computes one op at a time
        compute = template.ordered(stage, (FWD, BWD))
        for optype in P2P:
            graph.chain(template.ordered(stage, (optype,)))
        _first_backward_p2p(template, graph, stage, compute)

    graph.uses_dp = dp_size * int(meta.dsp_size) > 1
    graph.dp_overlapped = bool((template.optype == SEP).any())
    if graph.uses_dp:
        for stage in range(pp):
            graph.chain(template.ordered(stage, (AG, RS)))
        _chunk_dp_dependencies(template, graph)
    _step_tail(template, graph)
    _in_compute_collectives(template, graph, meta.host_compute)

    # Comm groups beyond p2p: DP collectives (each synchronised over DP ranks), embedding
    # all-reduce between the first and last stage, clip over all stages and DP ranks.
    if graph.uses_dp:
        for op in np.flatnonzero(np.isin(template.optype, (AG, RS, SEP))):
            graph.group([int(op)], synced=True)
    if template.has(EMB):
        embedding = sorted({0, pp - 1})
        graph.group([template.require(EMB, 0, stage, "the embedding all-reduce links the first and last stage") for stage in embedding], synced=False)
    if template.has(CLIP):
        graph.group([template.require(CLIP, 0, stage, "the grad-norm all-reduce synchronises all workers") for stage in range(pp)], synced=True)
    return graph


def _in_compute_collectives(template: _Template, graph: _Graph, host_compute: bool = False) -> None:
    """Collectives of a group spanning workers inside the step (all-to-all, group-collective): in
    start order on a stream of their own per stage, each after the last compute op done when it
    started (the one before its launch), and before the compute op that starts when it ends
    after the compute stream idled (it waited for it: the converter cuts a compute span at the
    collectives it issued), else before the optimizer when it ended before that started. Where
    the thread that computes is the one that called the collective (host_compute: CPU ranks), an
    idle stream means the thread was blocked in the call: the next compute waited for it whatever
    untraced time the thread spent between the two. Each synchronises its group over the DP
    ranks, like the DP collectives."""
    for stage in range(template.pp):
        ops = template.ordered(stage, IN_COMPUTE)
        if not len(ops):
            continue
        graph.chain(ops)
        compute = template.ordered(stage, (FWD, BWD, WGT))
        starts, ends = template.start[compute], template.end[compute]
        tail = template.require(OPT, 0, stage, "every stage ends its step with the optimizer")
        reached = np.maximum.accumulate(ends) if len(ends) else ends
        for op in ops.tolist():
            # the compute it followed: the last one done when it started (on a GPU the compute
            # launched after it may start first, while its stream waits for the compute before it)
            launched_in = int(np.searchsorted(reached, template.start[op] + NOOP_TOLERANCE, side="right")) - 1
            if launched_in >= 0:
                graph.edge(int(compute[launched_in]), op)
            waiting = max(np.searchsorted(starts, template.end[op] - NOOP_TOLERANCE, side="left"), launched_in + 1)
            idle = waiting < len(compute) and (waiting == 0 or ends[waiting - 1] <= template.end[op] + NOOP_TOLERANCE)
            if idle and (host_compute or starts[waiting] - template.end[op] <= NOOP_TOLERANCE):
                graph.edge(op, int(compute[waiting]))
            elif template.end[op] <= template.start[tail] + NOOP_TOLERANCE:
                graph.edge(op, tail)
        for op in ops.tolist():
            graph.group([op], synced=graph.uses_dp)


def _p2p_dependencies(template: _Template, graph: _Graph, host_compute: bool = False) -> None:
    """Match each send/recv to the compute op it serves, mark no-ops, pair peers. The peer is the
    stage holding the neighbouring model chunk (`_placement`); an op whose neighbour chunk does not
    exist or runs on its own stage is a no-op. Valid ops pair by order per channel (optype, stage,
    peer stage): with chunk g on stage g mod pp that is the k-th forward-send of stage s with the
    k-th forward-recv of stage s+1 (mod pp), as METHOD.md section 2 states.

    A recv follows the previous compute of its direction (METHOD.md). With host_compute (the
    compute ran on the thread that issues the recv: CPU jobs), it also follows the compute op run
    just before the one it serves, of any kind, when the template saw it issued after that op
    ended: a thread that computes one op at a time issues nothing during it. Without this, a
    schedule that runs other work between two computes of a direction (1F1B's steady state,
    interleaved and zero-bubble schedules) replays its recvs early and the gap as launch delay."""
    pp, total_chunks = template.pp, template.vpp * template.pp
    placement = _placement(template)
    stream_before = {}   # compute op -> the compute op run just before it on its stage
    if host_compute:
        for stage in range(pp):
            stream = template.ordered(stage, (FWD, BWD, WGT)).tolist()
            stream_before.update(zip(stream[1:], stream[:-1]))
    valid: dict[tuple[int, int, int, int], int] = {}   # (optype, stage, peer stage, k) -> op
    counted: collections.Counter = collections.Counter()   # (optype, stage, peer stage) -> valid ops so far
    for stage in range(pp):
        for compute_type, send, recv in ((FWD, FSEND, FRECV), (BWD, BSEND, BRECV)):
            compute = template.ordered(stage, (compute_type,))
            for optype in (send, recv):
                ops = template.ordered(stage, (optype,))
                if not len(ops):
                    continue
                if not len(compute):
                    raise template.error(TraceStructureError, f"{OPTYPES[optype]} ops on a stage without {OPTYPES[compute_type]} ops", op=int(ops[0]))
                if optype == recv:   # a recv after the last compute of its direction started serves nothing
                    active = template.start[ops] <= template.start[compute].max() + NOOP_TOLERANCE
                else:                # a send that ended before the first compute ended serves nothing
                    active = template.end[ops] >= template.end[compute].min() - NOOP_TOLERANCE
                count, n_compute = int(active.sum()), len(compute)
                compute_seq = 0
                if count != n_compute:
                    if stage not in (0, pp - 1):
                        raise template.error(
                            TraceStructureError,
                            f"{count} active {OPTYPES[optype]} ops for {n_compute} {OPTYPES[compute_type]} ops: "
                            "a middle pipeline stage needs one per compute op", stage=stage,
                        )
                    if count not in (0, n_compute - 1):
                        raise template.error(
                            TraceStructureError,
                            f"{count} active {OPTYPES[optype]} ops for {n_compute} {OPTYPES[compute_type]} ops: "
                            "a pipeline end may lack at most one", stage=stage,
                        )
                    if optype == recv and count == n_compute - 1:
                        compute_seq = 1   # the first recv of the stage was not recorded: skip its compute
                peer_type, chunk_offset = _PEER[optype]
                for op, is_active in zip(ops.tolist(), active.tolist()):
                    if not is_active:
                        graph.noop[op] = True
                        continue
                    served = template.find(compute_type, compute_seq, stage)
                    if served is None:
                        raise template.error(
                            TraceStructureError,
                            f"no {OPTYPES[compute_type]} with seq_id {compute_seq} for this op to serve", op=op,
                        )
                    compute_seq += 1
                    peer_chunk = int(template.gmc[served]) + chunk_offset
                    # no neighbouring chunk, or the neighbour runs here (a V-shaped schedule's turn)
                    peer_stage = int(placement[peer_chunk]) if 0 <= peer_chunk < total_chunks else stage
                    graph.noop[op] = peer_stage == stage
                    if optype == send:
                        graph.edge(served, op)
                    else:
                        graph.edge(op, served)
                        previous = template.find(compute_type, int(template.seq_id[served]) - 1, stage)
                        if previous is not None:
                            graph.edge(previous, op)
                        before = stream_before.get(served)
                        if before is not None and template.end[before] <= template.start[op] + NOOP_TOLERANCE:
                            graph.edge(before, op)
                    if not graph.noop[op]:
                        channel = (optype, stage, peer_stage)
                        valid[(*channel, counted[channel])] = op
                        counted[channel] += 1
    for (optype, stage, peer_stage, k), op in sorted(valid.items()):
        peer_type = _PEER[optype][0]
        peer = valid.get((peer_type, peer_stage, stage, k))
        if peer is None:
            peer_name = f"{OPTYPES[peer_type]} number {k} (counting valid ops) on stage {peer_stage} from stage {stage}"
            raise template.error(MissingPeerError, f"its peer {peer_name} is missing or a no-op", op=op)
        if optype in (FSEND, BSEND):
            graph.group([op, peer], synced=False)
    for op in np.flatnonzero(graph.noop):
        graph.group([int(op)], synced=False)


def _placement(template: _Template) -> np.ndarray:
    """The stage holding each global model chunk (gmc): chunk g on stage g mod pp unless the trace's
    compute ops place it elsewhere (V-shaped schedules hold chunks s and 2 pp - 1 - s on stage s)."""
    pp, total = template.pp, template.vpp * template.pp
    placement = np.arange(total) % pp
    compute = np.flatnonzero(np.isin(template.optype, (FWD, BWD)) & (template.gmc >= 0) & (template.gmc < total))
    if not len(compute):
        return placement
    pairs = np.unique(np.stack([template.gmc[compute], template.stage[compute]]), axis=1, return_index=True)[0]   # (no numpy.ma)
    chunks, counts = np.unique(pairs[0], return_counts=True)
    if (counts > 1).any():
        chunk = int(chunks[counts > 1][0])
        op = int(compute[template.gmc[compute] == chunk][0])
        raise template.error(TraceStructureError, f"model chunk (gmc) {chunk} has compute on stages "
                             f"{sorted(set(pairs[1][pairs[0] == chunk].tolist()))}: a chunk runs on one stage", op=op)
    placement[pairs[0]] = pairs[1]
    return placement


def _first_backward_p2p(template: _Template, graph: _Graph, stage: int, compute: np.ndarray) -> None:
    """The first backward send/recv waits for the forward compute two places before the first backward."""
    backward = np.flatnonzero(template.optype[compute] == BWD)
    if not len(backward):
        raise template.error(MissingOpError, "stage has no backward-compute op", stage=stage)
    first = int(backward[0])
    if first < 2:
        return   # no pipeline warm-up (pp = 1 or a single microbatch)
    for before in (first - 1, first - 2):
        if template.optype[compute[before]] != FWD:
            raise template.error(
                TraceStructureError,
                f"the compute op {before - first} places before the first backward is not a forward", op=int(compute[before]),
            )
    for optype in (BRECV, BSEND):
        op = template.find(optype, 0, stage)
        if op is not None:
            graph.edge(int(compute[first - 2]), op)


def _chunk_dp_dependencies(template: _Template, graph: _Graph) -> None:
    """params-all-gather of a chunk precedes its first forward; with overlapped DP the
    chunk's last backward precedes its first grads-reduce-scatter."""
    for stage in range(template.pp):
        compute = template.ordered(stage, (FWD, BWD))
        gathers = np.flatnonzero((template.stage == stage) & (template.optype == AG))
        assigned = set()
        for op in gathers[np.argsort(-template.seq_id[gathers], kind="stable")].tolist():   # last gather per chunk
            chunk = int(template.mc[op])
            if chunk in assigned:
                continue
            forwards = compute[(template.optype[compute] == FWD) & (template.mc[compute] == chunk)]
            if not len(forwards):
                raise template.error(TraceStructureError, f"no forward-compute of model chunk {chunk} for this all-gather", op=op)
            graph.edge(op, int(forwards[np.argmin(template.start[forwards])]))
            assigned.add(chunk)
        if not graph.dp_overlapped:
            continue
        scatters = np.flatnonzero((template.stage == stage) & (template.optype == RS))
        assigned = set()
        for op in scatters[np.argsort(template.seq_id[scatters], kind="stable")].tolist():   # first scatter per chunk
            chunk = int(template.mc[op])
            if chunk in assigned:
                continue
            backwards = compute[(template.optype[compute] == BWD) & (template.mc[compute] == chunk)]
            if not len(backwards):
                raise template.error(TraceStructureError, f"no backward-compute of model chunk {chunk} for this reduce-scatter", op=op)
            graph.edge(int(backwards[np.argmax(template.end[backwards])]), op)
            assigned.add(chunk)


def _step_tail(template: _Template, graph: _Graph) -> None:
    """gc after the last compute, then the per-stage tail chain ending in the optimizer."""
    pp = template.pp
    for stage in range(pp):
        compute = template.ordered(stage, (FWD, BWD, WGT))
        if not len(compute):
            raise template.error(MissingOpError, "stage has no compute ops", stage=stage)
        last_compute = int(compute[np.argmax(template.end[compute])])
        gc = template.tail_op(GC, stage, "gc follows the last compute op of every stage")
        for op in gc:
            graph.edge(last_compute, op)
        after = gc or [last_compute]
        layernorm = template.tail_op(LN, stage, "every stage ends its step with the layernorm all-reduce")
        embedding = template.tail_op(EMB, stage, "the first and last stage all-reduce embedding grads") if stage in (0, pp - 1) else []
        clip = template.tail_op(CLIP, stage, "every stage joins the grad-norm all-reduce before the optimizer")
        optimizer = template.require(OPT, 0, stage, "every stage ends its step with the optimizer")
        scatters = np.flatnonzero((template.stage == stage) & (template.optype == RS))
        if not graph.uses_dp:
            graph.chain([*layernorm, *embedding, *clip, optimizer], after=after)
            continue
        if not len(scatters):
            raise template.error(MissingOpError, "a job with data parallelism needs grads-reduce-scatter ops on every stage", stage=stage)
        n_scatter = int(template.seq_id[scatters].max()) + 1
        if graph.dp_overlapped:
            last_scatter = template.require(RS, n_scatter - 1, stage, "the last reduce-scatter precedes the step tail")
            separate = template.require(SEP, 0, stage, "overlapped DP all-reduces the separate grads before clipping")
            # (a converted trace may all-reduce more than one set of separate grads: all in the tail)
            more = [op for op in template.ordered(stage, (SEP,)).tolist() if op != separate]
            graph.chain([*layernorm, *embedding, separate, *more, *clip, optimizer], after=[last_scatter, *after])
        else:
            chain = [template.require(RS, i, stage, "non-overlapped DP reduce-scatters all grads in the tail") for i in range(n_scatter)]
            graph.chain([*layernorm, *embedding, *chain, *clip, optimizer], after=after)

