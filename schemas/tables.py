"""Arrow schemas of the batch pipeline's per-job output tables, and how they are laid out.

Layout on any fsspec URL (local folder, file://, s3://; memory:// only in-process):

    {out}/{table}/date=YYYY-MM-DD/part-0.parquet     one file per table and date partition
    {out}/_staging/{run_id}/...                      a run's files before its commit (never read)
    {out}/_runs/{run_id}.json                        what a run did: counts, reasons, timings (not a table)
    {out}/_timelines/date=YYYY-MM-DD/{job}.json.gz   `strag batch --timelines`: original + ideal timeline of
                                                     each straggling kept window (Chrome-trace JSON, Perfetto)

`date` is the Hive partition key: it lives in the path, not in the files (DuckDB, Spark,
Trino and `pyarrow.dataset` with Hive partitioning add it as a column; `read_table` below
does too). A batch run for dates D1..D2 replaces exactly the partitions D1..D2 of every
table it writes; every date of the range gets a partition, empty when nothing happened
that day, so "partition present" means "date processed".

Unit of a row: one *job window* = one job's sampled steps of one date (one manifest row).
Times are seconds, GPU-hours are GPU count x wall hours of the window from the manifest
(`end_time - start_time`), slowdowns are ratios (1.0 = no loss).

Every per-job table includes jobs whose replay discrepancy exceeds 5%
(`job_summary.discarded`); join on (date, job_id) and keep `discarded = false` for fleet
statistics. Attribution tables have rows only for windows with S >= 1.03
(`job_summary.attributed`), as in the reference analyzer.

Rows are sorted by each table's `sort_keys` and files are written without timestamps, so a
rerun over the same lake writes byte-identical files. Timelines describe the published
tables: every run replaces those of its dates (none when run without --timelines).
"""
from __future__ import annotations

import datetime as dt

import pyarrow as pa

from schemas.fleet import FLEET_TABLE_SPECS
from schemas.table_spec import PARTITION_KEY, TableSpec

__all__ = [
    "TABLES_SCHEMA_VERSION",
    "PARTITION_KEY",
    "PART_FILE",
    "STAGING_DIR",
    "RUNS_DIR",
    "TIMELINES_DIR",
    "timeline_path",
    "JOB_STATUSES",
    "QUARANTINE_LEVELS",
    "TableSpec",
    "JOB_SUMMARY_SCHEMA",
    "STEP_SLOWDOWN_SCHEMA",
    "WORKER_ATTRIBUTION_SCHEMA",
    "DP_ATTRIBUTION_SCHEMA",
    "STAGE_ATTRIBUTION_SCHEMA",
    "OPTYPE_ATTRIBUTION_SCHEMA",
    "COVERAGE_SCHEMA",
    "KEPT_BY",
    "KEPT_BY_MODEL",
    "QUARANTINE_SCHEMA",
    "BATCH_TABLES",
    "partition_path",
    "table_path",
    "read_table",
    "table_exists",
]

TABLES_SCHEMA_VERSION = "1"
PART_FILE = "part-0.parquet"
STAGING_DIR = "_staging"
RUNS_DIR = "_runs"
TIMELINES_DIR = "_timelines"

# What happened to a job window (coverage.status); same words as schemas/fleet.py.
JOB_STATUSES = ("analysed", "discarded", "quarantined")
# Which rule kept an analysed window (job_summary.kept_by, coverage.kept_by): METHOD.md's replay, or
# the replay with the named workers' untraced time (transforms/whatif/result.py UntracedWork), or
# the replay with each CPU rank's late arrival from its previous step (JobModel.carried_arrivals).
KEPT_BY = ("method", "untraced-model", "arrivals-model")
KEPT_BY_MODEL = KEPT_BY[1:]   # the rules under which only the model keeps a window METHOD.md would discard
# What a quarantine row covers: one row of a file, a whole file, or a whole job window.
QUARANTINE_LEVELS = ("row", "file", "job")


def _schema(name: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={"strag.table": name, "strag.tables_schema_version": TABLES_SCHEMA_VERSION})


# One row per analysed job window (analysed or discarded; quarantined windows are only in
# coverage and quarantine).
JOB_SUMMARY_SCHEMA = _schema(
    "job_summary",
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("gpus", pa.int32(), nullable=False),
        pa.field("dp_size", pa.int32(), nullable=False),
        pa.field("pp_size", pa.int32(), nullable=False),
        pa.field("tp_size", pa.int32(), nullable=False),
        pa.field("dsp_size", pa.int32(), nullable=False),          # context parallel
        pa.field("vpp_size", pa.int32(), nullable=False),
        pa.field("world_size", pa.int32(), nullable=False),
        pa.field("parallelism", pa.string(), nullable=False),      # "dp4-pp4-tp4-cp1-vpp1", for grouping
        pa.field("model_family", pa.string(), nullable=False),
        pa.field("context_length", pa.int32(), nullable=False),
        pa.field("start_time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("end_time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("n_steps", pa.int32(), nullable=False),           # sampled steps analysed
        pa.field("n_ops", pa.int64(), nullable=False),             # op records analysed
        # what the result stands on (transforms/whatif/result.py Evidence); null in files written before
        pa.field("n_microbatches", pa.int32(), nullable=True),     # microbatches per worker and step
        pa.field("dp_peers", pa.int32(), nullable=True),           # other DP ranks of a worker's stage (0: none)
        pa.field("evidence_limits", pa.list_(pa.string()), nullable=True),  # what the trace cannot show, and the fix
        pa.field("step_time_observed", pa.float64(), nullable=False),  # mean step_t_base, s
        # T: mean no-delay replay, s; with the untraced CPU time of untraced_workers given back when
        # the root-cause analysis named them (transforms/whatif/result.py UntracedWork)
        pa.field("step_time", pa.float64(), nullable=False),
        pa.field("step_time_ideal", pa.float64(), nullable=False),  # T_ideal: mean ideal replay, s
        pa.field("slowdown", pa.float64(), nullable=False),        # S = T / T_ideal
        pa.field("waste", pa.float64(), nullable=False),           # 1 - 1/S, fraction of GPU time
        pa.field("gpu_hours", pa.float64(), nullable=False),       # gpus x (end_time - start_time), h
        pa.field("wasted_gpu_hours", pa.float64(), nullable=False),  # gpu_hours x waste
        pa.field("launch_slowdown", pa.float64(), nullable=False),  # METHOD's replay discrepancy mean(base)/mean(nodelay)
        # mean(base) / T: launch_slowdown, or against the replay with untraced_workers' untraced time;
        # null in files written before the column existed
        pa.field("replay_discrepancy", pa.float64(), nullable=True),
        pa.field("untraced_workers", pa.list_(pa.struct([pa.field("dp_rank", pa.int32()), pa.field("stage", pa.int32())])),
                 nullable=True),                                   # whose untraced CPU time T includes; null: none
        pa.field("discarded", pa.bool_(), nullable=False),         # replay_discrepancy off by > 5% either way: not in fleet statistics
        pa.field("discard_reason", pa.string(), nullable=True),    # human reason when discarded
        # METHOD.md section 3 beside the model: S of the no-delay replay (no untraced time modelled), and
        # whether METHOD's rule (launch_slowdown off by > 5%) discards the window; kept_by: which rule kept
        # it ("method": within 5% as METHOD replays it; "untraced-model": METHOD would discard it, the
        # named workers' untraced time brings the model within 5%; "arrivals-model": each CPU rank's late
        # arrival from its previous step's tail does); null when discarded, or in files
        # written before the columns existed
        pa.field("slowdown_method", pa.float64(), nullable=True),
        pa.field("discarded_method", pa.bool_(), nullable=True),
        pa.field("kept_by", pa.string(), nullable=True),
        pa.field("straggling", pa.bool_(), nullable=False),        # S >= 1.1
        pa.field("attributed", pa.bool_(), nullable=False),        # S >= 1.03: attribution tables have rows
        pa.field("m_w", pa.float64(), nullable=True),              # M_W (rem form); null when not attributed
        pa.field("m_w_add", pa.float64(), nullable=True),          # M_W (add form)
        pa.field("m_s", pa.float64(), nullable=True),              # M_S (rem form); 0 without PP
        pa.field("m_s_add", pa.float64(), nullable=True),
        # Root-cause verdict (transforms/whatif/causes.py); null for discarded windows. The
        # evidence, implicated workers and fix estimates are in the job_cause table.
        pa.field("cause", pa.string(), nullable=True),             # primary cause, schemas.fleet.CAUSES ("none": S < 1.1)
        pa.field("causes", pa.list_(pa.string()), nullable=True),  # every detected cause, strongest first
        pa.field("cause_confidence", pa.float64(), nullable=True),  # of the primary cause, 0..1
        pa.field("savings_gpu_hours", pa.float64(), nullable=True),  # GPU-hours fixing the primary cause would save
        # Where the op rows came from (schemas/raw.py SOURCE_FORMATS) and, for converted
        # profiler output, a line for people: profiler and version, ranks, device, what was left out.
        pa.field("source_format", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=True),
        # what converted profiler output recorded (null: not recorded, e.g. lake parquet, taken as GPUs):
        # "cpu" when the ranks ran on CPUs (gpus then counts CPU ranks, gpu_hours their rank-hours)
        pa.field("device", pa.string(), nullable=True),
        # the DP gradient collective: "all_reduce" (DDP) or "reduce_scatter"; op type grads-reduce-scatter
        # either way (the reference's name); people are told which (schemas.trace.optype_words)
        pa.field("grads_collective", pa.string(), nullable=True),
    ],
)

# One row per sampled step of a job window.
STEP_SLOWDOWN_SCHEMA = _schema(
    "step_slowdown",
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("step_time_observed", pa.float64(), nullable=False),  # step_t_base, s
        pa.field("step_time", pa.float64(), nullable=False),           # step_t_nodelay (job_summary.step_time), s
        pa.field("step_time_ideal", pa.float64(), nullable=False),     # step_t_noblk, s
        pa.field("slowdown", pa.float64(), nullable=False),            # S_s = step_time / step_time_ideal
        # the verdict step by step (null without one): the global ranks of blamed workers the worker
        # test finds slow in this step (empty: none), the primary cause and the seconds its fix
        # saves in this step (null where the fix knows only its mean); an intermittent straggler
        # shows here with its steps
        pa.field("slow_ranks", pa.list_(pa.int32()), nullable=True),
        pa.field("fix_cause", pa.string(), nullable=True),
        pa.field("fix_saving", pa.float64(), nullable=True),
    ],
)

# One row per worker (dp_rank, stage) of a job window, always (host and rank even when not
# attributed, so spatial statistics see healthy workers too).
WORKER_ATTRIBUTION_SCHEMA = _schema(
    "worker_attribution",
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("dp_rank", pa.int16(), nullable=False),
        pa.field("stage", pa.int16(), nullable=False),
        pa.field("rank", pa.int32(), nullable=True),               # representative global rank (manifest)
        pa.field("host", pa.string(), nullable=True),              # machine (manifest)
        pa.field("slowdown_dp", pa.float64(), nullable=True),      # S_dp of its DP rank
        pa.field("slowdown_stage", pa.float64(), nullable=True),   # S_stage of its stage
        pa.field("slowdown_worker", pa.float64(), nullable=True),  # S_w = min(S_dp, S_stage)
        pa.field("in_mw_set", pa.bool_(), nullable=True),          # one of the ceil(3%) workers behind M_W
    ],
)

# Attribution of S to one DP rank / stage / op type: S_g with only g's ops kept original.
# `step` null = the whole window (mean step times); otherwise that sampled step. For op
# types, pipeline send/recv are merged into forward-pp-comm and backward-pp-comm as the
# reference does.
def _attribution_schema(name: str, group: pa.Field) -> pa.Schema:
    return _schema(
        name,
        [
            pa.field("job_id", pa.string(), nullable=False),
            group,
            pa.field("step", pa.int64(), nullable=True),
            pa.field("slowdown", pa.float64(), nullable=False),
        ],
    )


DP_ATTRIBUTION_SCHEMA = _attribution_schema("dp_attribution", pa.field("dp_rank", pa.int16(), nullable=False))
STAGE_ATTRIBUTION_SCHEMA = _attribution_schema("stage_attribution", pa.field("stage", pa.int16(), nullable=False))
OPTYPE_ATTRIBUTION_SCHEMA = _attribution_schema("optype_attribution", pa.field("optype", pa.string(), nullable=False))

# One row per job window seen in the date range (from a manifest, a trace folder or both).
COVERAGE_SCHEMA = _schema(
    "coverage",
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),           # JOB_STATUSES
        pa.field("reason_code", pa.string(), nullable=True),       # why discarded / quarantined
        pa.field("reason", pa.string(), nullable=True),            # the same for people
        pa.field("has_manifest", pa.bool_(), nullable=False),
        pa.field("trace_files", pa.int32(), nullable=False),       # files found for the window
        pa.field("rows_read", pa.int64(), nullable=False),         # op rows in readable files
        pa.field("rows_quarantined", pa.int64(), nullable=False),  # of those, rejected by validation
        pa.field("gpus", pa.int32(), nullable=True),               # from the manifest, when readable
        pa.field("gpu_hours", pa.float64(), nullable=True),
        pa.field("launch_slowdown", pa.float64(), nullable=True),  # when the engine got that far
        pa.field("source_format", pa.string(), nullable=False),    # schemas/raw.py SOURCE_FORMATS
        pa.field("kept_by", pa.string(), nullable=True),           # job_summary.kept_by: which rule kept an analysed window
    ],
)

# Everything rejected: one row per bad row, file or job window. Nothing is dropped silently.
QUARANTINE_SCHEMA = _schema(
    "quarantine",
    [
        pa.field("job_id", pa.string(), nullable=True),            # null when a file names no job
        pa.field("source_path", pa.string(), nullable=False),      # file (or trace folder for job-level rows)
        pa.field("level", pa.string(), nullable=False),            # QUARANTINE_LEVELS
        pa.field("reason_code", pa.string(), nullable=False),      # stable, machine-readable
        pa.field("reason", pa.string(), nullable=False),           # human: what is wrong and what to do
        pa.field("detail", pa.string(), nullable=True),            # the op (type, seq, step, worker) and value, or the error
        pa.field("rows", pa.int64(), nullable=True),               # rows affected (level = file / job)
    ],
)

_SPECS = (
    TableSpec("job_summary", JOB_SUMMARY_SCHEMA, ("job_id",)),
    TableSpec("step_slowdown", STEP_SLOWDOWN_SCHEMA, ("job_id", "step")),
    TableSpec("worker_attribution", WORKER_ATTRIBUTION_SCHEMA, ("job_id", "dp_rank", "stage")),
    TableSpec("dp_attribution", DP_ATTRIBUTION_SCHEMA, ("job_id", "dp_rank", "step")),
    TableSpec("stage_attribution", STAGE_ATTRIBUTION_SCHEMA, ("job_id", "stage", "step")),
    TableSpec("optype_attribution", OPTYPE_ATTRIBUTION_SCHEMA, ("job_id", "optype", "step")),
    TableSpec("coverage", COVERAGE_SCHEMA, ("job_id",)),
    TableSpec("quarantine", QUARANTINE_SCHEMA, ("job_id", "source_path", "level", "reason_code")),
)
# Name -> spec of every table the batch pipeline writes per job window.
BATCH_TABLES: dict[str, TableSpec] = {spec.name: spec for spec in _SPECS}


def table_path(out: str, table: str) -> str:
    """Folder of one table under an output URL."""
    return f"{out.rstrip('/')}/{table}"


def partition_path(out: str, table: str, date: dt.date | str | None) -> str:
    """Folder of one date partition of a table (the table folder itself when date is None)."""
    if date is None:
        return table_path(out, table)
    iso = date.isoformat() if isinstance(date, dt.date) else dt.date.fromisoformat(date).isoformat()
    return f"{table_path(out, table)}/{PARTITION_KEY}={iso}"


def timeline_path(date: dt.date | str, job_id: str) -> str:
    """A window's timeline file relative to the output URL (or to a staging folder):
    _timelines/date=D/<job id percent-encoded>.json.gz."""
    import urllib.parse

    iso = date.isoformat() if isinstance(date, dt.date) else dt.date.fromisoformat(date).isoformat()
    return f"{TIMELINES_DIR}/{PARTITION_KEY}={iso}/{urllib.parse.quote(job_id, safe='')}.json.gz"


def table_exists(out: str, table: str, *, storage_options: dict | None = None) -> bool:
    """Whether the folder of `table` exists under the output URL `out` (it may still hold no files)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(table_path(out, table), **(storage_options or {}))
    return _present(fs, root)


def _present(fs, path: str) -> bool:
    """fs.exists, except that a failing call raises instead of answering False (fsspec's exists
    swallows every error: a storage blip would read as an empty table, and a rollup rebuilt from it)."""
    try:
        fs.info(path)
    except FileNotFoundError:
        return False
    return True


def _published_spec(table: str) -> TableSpec | None:
    """The spec of a table the batch publishes: a per-job table, or a fleet table (schemas/fleet.py)."""
    return BATCH_TABLES.get(table) or FLEET_TABLE_SPECS.get(table)


def read_table(out: str, table: str, *, storage_options: dict | None = None) -> pa.Table:
    """Read one published table (every partition) with its `date` column, as DuckDB or Spark would.

    out: the batch pipeline's --out URL; table: a table name (per-job or fleet). Returns an
    empty table with the known schema when the table has no files yet. Staging and run folders are never read.
    """
    import fsspec
    import pyarrow.dataset as ds

    fs, root = fsspec.core.url_to_fs(table_path(out, table), **(storage_options or {}))
    spec = _published_spec(table)
    from transforms.io.storage import find   # a folder that fails to list raises (see _present)

    files = sorted(p for p in find(fs, root) if p.endswith(".parquet") and "/." not in p[len(root):]) if _present(fs, root) else []
    if not files:
        if spec is None:
            raise FileNotFoundError(f"no table {table!r} under {out}")
        fields = list(spec.schema) + ([pa.field(PARTITION_KEY, pa.date32())] if spec.partitioned else [])
        return pa.schema(fields, metadata=spec.schema.metadata).empty_table()
    partitioning = None
    if spec is None or spec.partitioned:
        partitioning = ds.partitioning(pa.schema([pa.field(PARTITION_KEY, pa.date32())]), flavor="hive")
    schema = None
    if spec is not None:   # partitions written before a column existed read it as null, in any file order
        schema = pa.schema(list(spec.schema) + ([pa.field(PARTITION_KEY, pa.date32())] if spec.partitioned else []),
                           metadata=spec.schema.metadata)
    dataset = ds.dataset(files, schema=schema, filesystem=fs, format="parquet", partitioning=partitioning,
                         partition_base_dir=root)
    return dataset.to_table()
