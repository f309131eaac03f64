"""Arrow schemas of the trace lake: op records and job manifests.

The single source of truth for column names and types. Every reader and writer
(importers, generator, pipelines, engine adapters) uses these objects.
See ../shared/docs/METHOD.md section 1 for the meaning of each column.
"""
from __future__ import annotations

import pyarrow as pa

__all__ = [
    "SCHEMA_VERSION",
    "OPTYPES",
    "COMPUTE_OPTYPES",
    "P2P_OPTYPES",
    "DP_COMM_OPTYPES",
    "IN_COMPUTE_OPTYPES",
    "optype_words",
    "TRACE_SCHEMA",
    "TRACE_REQUIRED",
    "trace_table",
    "MANIFEST_SCHEMA",
    "WORKER_STRUCT",
    "PUBLISHED_COLUMNS",
]

SCHEMA_VERSION = "1"

# Op-type vocabulary (METHOD.md section 1), in a fixed order: its index is the
# dictionary code used in parquet and inside the engine.
OPTYPES: tuple[str, ...] = (
    "forward-compute",
    "backward-compute",
    "forward-send",
    "forward-recv",
    "backward-send",
    "backward-recv",
    "params-all-gather",
    "grads-reduce-scatter",
    "separate-grads-all-reduce",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "optimizer-clip-main-grad",
    "optimizer",
    "gc",
    # zero-bubble schedules split a microbatch's backward: backward-compute is the input-gradient
    # half (it feeds the backward-send), this the weight-gradient half the schedule runs where it fits
    "backward-weight-compute",
    # collectives of a group that spans workers, inside the step's compute (not DP grad sync, which
    # has its own types): expert / embedding parallel all-to-all, and any other (broadcast, barrier,
    # FSDP's per-layer gathers ...); each synchronises its group and sits between compute ops
    "all-to-all",
    "group-collective",
)
COMPUTE_OPTYPES = ("forward-compute", "backward-compute", "backward-weight-compute")
P2P_OPTYPES = ("forward-send", "forward-recv", "backward-send", "backward-recv")
DP_COMM_OPTYPES = ("params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce")
IN_COMPUTE_OPTYPES = ("all-to-all", "group-collective")


def optype_words(optype: str, grads_collective: str | None = None) -> str:
    """An op type as people should read it. The names above are the reference analyzer's and stay
    in every table; but its grads-reduce-scatter is also DDP's gradient all-reduce, which a DDP user
    would not recognise under that name. grads_collective: the collective the job's trace shows for
    it ("all_reduce", "reduce_scatter"; None when unknown: the name as it is)."""
    if optype == "grads-reduce-scatter" and grads_collective == "all_reduce":
        return "grads-all-reduce"
    return optype

# One row per op occurrence. Timestamps and durations are seconds (float64 in the
# lake: a lossless superset of the published float32 traces).
TRACE_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("dp_rank", pa.int16(), nullable=False),
        pa.field("stage", pa.int16(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("optype", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("start_ts", pa.float64(), nullable=False),
        pa.field("duration", pa.float64(), nullable=False),
        pa.field("seq_id", pa.int32(), nullable=False),
        pa.field("mc", pa.int16(), nullable=False),
        pa.field("mb_id", pa.int32(), nullable=False),
        pa.field("gmc", pa.int16(), nullable=False),
        # Optional: machine of the worker, and per-microbatch sequence (document)
        # lengths on compute ops when the trainer records them.
        pa.field("host", pa.string(), nullable=True),
        pa.field("seq_lens", pa.list_(pa.int32()), nullable=True),
        # Optional: on compute ops, how many operations autograd recorded inside them (torch
        # traces: `fwdbwd` flows), when the converter counts them: a chunk's amount of work,
        # apart from how fast its machine runs it.
        pa.field("n_ops", pa.int32(), nullable=True),
        # Optional: seconds of the idle time before this op (since the worker's previous op
        # ended) that its thread spent fetching a batch from a DataLoader (torch traces: the
        # `enumerate(DataLoader)` spans): untraced time that is data loading, not GC or Python.
        pa.field("data_wait", pa.float64(), nullable=True),
        # Optional: seconds of the idle time before this op that Python's garbage collector ran, as
        # the trainer recorded it (strag_collect's gc.callbacks record; the column is present, with
        # 0 where no collection ran, only when every rank recorded): GC, known rather than inferred.
        pa.field("gc_wait", pa.float64(), nullable=True),
        # Optional: on compute ops of CPU ranks, seconds of the longest stretch inside the op's span
        # in which its thread ran no traced op (torch traces: the step thread's ops, annotations
        # left out): untraced Python inside the compute (a garbage collection, the OS running
        # another process), apart from the compute itself; 0 where the ops fill the span.
        pa.field("idle_within", pa.float64(), nullable=True),
        # Optional: seconds Python's garbage collector ran inside the op's span, as the trainer
        # recorded it (present exactly when gc_wait is): a collection that struck mid-compute.
        pa.field("gc_within", pa.float64(), nullable=True),
        # Optional: on CPU ranks, when the op's rank entered its step (the converter's step start:
        # where its loop called prof.step() after the previous iteration, or the end of that
        # iteration's optimizer step), on the start_ts clock; the same on every op of a rank and
        # step. A rank entering later than its DP peers is still finishing its previous step.
        pa.field("step_entered", pa.float64(), nullable=True),
        # Optional: on CPU ranks, when the op's rank left its step (where its loop called
        # prof.step() at the end of the iteration, or the next iteration's start), on the start_ts
        # clock; the same on every op of a rank and step. What the rank did after its last op of
        # the step (a planned gc.collect(), per-step callbacks) is untraced time of that step.
        pa.field("step_left", pa.float64(), nullable=True),
        # Optional: seconds Python's garbage collector ran after the op's rank ended its last op of
        # the step and before it left the step (step_left), as the trainer recorded it (present
        # exactly when gc_wait and step_left are); the same on every op of a rank and step. A
        # planned gc.collect() at the end of an iteration; the last profiled step has no later op
        # whose gc_wait could hold it.
        pa.field("gc_tail", pa.float64(), nullable=True),
        # Optional: the threads the job ran on the op's host per core its rank could use (the
        # host's ranks x torch's intra-op threads on CPU ranks, one per rank on GPU ranks, over the
        # cores of its CPU affinity), as strag_collect recorded it; the same on every op of a rank.
        # Above 1 the host is oversubscribed: a rank's untraced time includes its wait for a core.
        pa.field("host_load", pa.float64(), nullable=True),
        # Optional: on compute ops of CPU ranks of a pipeline, how fast their machine ran their
        # work against the job's usual pace (1.0), operations compared by identity (torch traces:
        # transforms/ingest/kineto/pace.py): a heavier partition holds more operations at pace 1,
        # a slower machine runs the same ones slower.
        pa.field("pace", pa.float64(), nullable=True),
    ],
    metadata={"strag.schema_version": SCHEMA_VERSION, "strag.table": "trace"},
)
TRACE_REQUIRED: tuple[str, ...] = tuple(f.name for f in TRACE_SCHEMA if not f.nullable)


def trace_table(columns: dict[str, pa.Array], num_rows: int) -> pa.Table:
    """A TRACE_SCHEMA table of the given columns (every required one), each optional column not
    given all null: writers of the trace need not name every optional measurement there is."""
    return pa.Table.from_arrays([columns[f.name] if f.name in columns else pa.nulls(num_rows, f.type)
                                 for f in TRACE_SCHEMA], schema=TRACE_SCHEMA)

WORKER_STRUCT = pa.struct(
    [
        pa.field("dp_rank", pa.int16(), nullable=False),
        pa.field("stage", pa.int16(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("host", pa.string(), nullable=False),
    ]
)

# One row per job per date partition (a "trace window": the job's sampled steps of that day).
MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("date", pa.date32(), nullable=False),
        pa.field("submit_time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("start_time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("end_time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("gpus", pa.int32(), nullable=False),
        pa.field("dp_size", pa.int32(), nullable=False),
        pa.field("pp_size", pa.int32(), nullable=False),
        pa.field("tp_size", pa.int32(), nullable=False),
        pa.field("dsp_size", pa.int32(), nullable=False),  # context parallel (cp)
        pa.field("vpp_size", pa.int32(), nullable=False),
        pa.field("world_size", pa.int32(), nullable=False),
        pa.field("microbatches", pa.int32(), nullable=False),
        pa.field("model_family", pa.string(), nullable=False),  # e.g. "dense", "moe"
        pa.field("context_length", pa.int32(), nullable=False),
        pa.field("workers", pa.list_(WORKER_STRUCT), nullable=False),  # one entry per (dp_rank, stage)
    ],
    metadata={"strag.schema_version": SCHEMA_VERSION, "strag.table": "manifest"},
)

# The authors' published trace format (strag import-reference / export-reference):
# column -> published type (their pandas dtypes).
PUBLISHED_COLUMNS: dict[str, pa.DataType] = {
    "dp_rank": pa.int8(),
    "stage": pa.int8(),
    "rank": pa.int16(),
    "step": pa.int64(),
    "optype": pa.dictionary(pa.int8(), pa.string()),
    "start_ts": pa.float32(),
    "duration": pa.float32(),
    "seq_id": pa.int32(),
    "mc": pa.int8(),
    "mb_id": pa.int8(),
    "gmc": pa.int16(),
}
