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

Here: reading the trace's columns, laying every lane out on the template's op
order, the original costs and launch delays, and the model's per-job quantities
(ideal costs, evidence). The graph itself -- which op waits for which, inferred
from the template slice, the first step of dp_rank 0 -- is graph.py's.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from schemas.trace import COMPUTE_OPTYPES, OPTYPES
from transforms.whatif.errors import (
    WhatIfError,
    TooFewStepsError,
    TraceStructureError,
    TraceValueError,
    UnknownOptypeError,
)
from transforms.whatif.graph import (   # the template's dependency graph, in replay order
    BWD,
    DP_COMM,
    FWD,
    IN_COMPUTE,
    NOOP_TOLERANCE,
    WGT,
    _CODE,
    Level,
    _infer_structure,
    _op_name,
    _Template,
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
# Transfer times and launch delays at or below -10 ms are profiler clock noise: set to 0.
NEGATIVE_CLAMP = 1e-2
# Op types idealised by their mean duration; all others (comm types) by their median.
COMPUTE_LIKE_OPTYPES = (*COMPUTE_OPTYPES, "optimizer", "gc")

_REQUIRED_COLUMNS = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id", "mc", "mb_id", "gmc")



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
        classes = self.ideal_classes()
        for code in self.optype_codes():
            for cls in distinct(classes[self.op_optype == code]):
                rows = (self.op_optype == code) & (classes == cls)
                values = self.original_cost[rows]
                ideal[rows] = values.mean() if OPTYPES[code] in COMPUTE_LIKE_OPTYPES else median(values)
        ideal.setflags(write=False)
        self.__dict__["_ideal_cost"] = (self.original_cost, ideal)
        return ideal

    def ideal_classes(self) -> np.ndarray:
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
        pa.types.is_float32(trace.schema.field(name).type) or _float32_exact(values)
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


def _float32_exact(values: np.ndarray, sample: int = 4096) -> bool:
    """Whether every value is a float32 number (a published-format trace widened to float64): the
    first `sample` values decide "no" without converting the whole column, as they do on traces
    recorded in float64."""
    head = values[:sample]
    if not (head.astype(np.float32).astype(np.float64) == head).all():
        return False
    return bool((values.astype(np.float32).astype(np.float64) == values).all())


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
    # rows come in runs of one (dp_rank, stage, rank), a file or rank at a time: the first row of
    # each run stands for the run, so the check reads one row per run, not every row
    dp_rank, stage, ranks = columns.dp_rank, columns.stage, columns.rank
    heads = np.ones(len(ranks), dtype=bool)
    np.not_equal(dp_rank[1:], dp_rank[:-1], out=heads[1:])
    heads[1:] |= stage[1:] != stage[:-1]
    heads[1:] |= ranks[1:] != ranks[:-1]
    heads = np.flatnonzero(heads)
    worker = dp_rank[heads].astype(np.int64) * pp_size + stage[heads]
    ranks = ranks[heads].astype(np.int64)
    rank = np.zeros(dp_size * pp_size, dtype=np.int64)
    rank[worker] = ranks                   # any row's rank; then check that every row agrees
    if (rank[worker] == ranks).all():
        return rank.reshape(dp_size, pp_size)
    low = np.full(dp_size * pp_size, np.iinfo(np.int64).max)
    high = np.full(dp_size * pp_size, np.iinfo(np.int64).min)
    np.minimum.at(low, worker, ranks)
    np.maximum.at(high, worker, ranks)
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

