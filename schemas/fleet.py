"""Arrow schemas of the fleet tables: statistics over many jobs, and the per-job verdict.

Where they live (any fsspec URL, next to the batch pipeline's per-job tables):

    {out}/job_cause/date=YYYY-MM-DD/part-0.parquet        one row per analysed job window, kept or discarded (JOB_CAUSE_SCHEMA)
    {out}/fleet_<name>/date=YYYY-MM-DD/part-0.parquet     daily fleet tables, period = "day"
    {out}/fleet_state/date=YYYY-MM-DD/part-0.parquet      the day's combiner accumulators (FLEET_STATE_SCHEMA)
    {out}/fleet_<name>_rollup/part-0.parquet              rollups over all dates: period "week", "month", "all"

Unit of counting: one *job window* = one job's sampled steps of one date (one manifest
row). A job traced on three dates counts three times; with one window per job (the
generator's fleets, the paper's) a window is a job.

How the tables are made (transforms/batch/fleet_stats.py): every daily table is the output of a
CombineFn over that date's job windows. The accumulators are exact (integer fixed-point
sums, sparse integer histograms, sets), so merging is associative and commutative to
the last bit. The batch pipeline writes, per date, the tables and the serialised
accumulators (`fleet_state`); rollups (weekly, monthly, all dates) are rebuilt by
merging the `fleet_state` rows of every date, never by re-running the engine. A 5-month
backfill and 150 nightly runs therefore produce byte-identical rollups.

Every fleet table starts with `period` ("day", "week", "month", "all") and
`period_start` (the date, the Monday of the ISO week, the first of the month, or the
first date seen for "all"), so daily partitions and rollups share one schema and a
trend chart is a query on `period`.

Units: slowdown S is a ratio (>= 1 when straggling, 1.0 = no loss); waste = 1 - 1/S is a
fraction of GPU time; GPU-hours are GPU count x wall hours of the job window. Quantiles
(p50/p90/p99) come from histograms of bin width HISTOGRAM_BIN_WIDTH (error <= one bin).
Readable by DuckDB, Spark and Trino: plain parquet, Hive partition key `date`.
"""
from __future__ import annotations

import pyarrow as pa

from schemas.table_spec import TableSpec

__all__ = [
    "FLEET_SCHEMA_VERSION",
    "CAUSES",
    "OPTYPE_CATEGORIES",
    "PERIODS",
    "HISTOGRAM_BIN_WIDTH",
    "JOB_CAUSE_SCHEMA",
    "FLEET_SUMMARY_SCHEMA",
    "FLEET_DISTRIBUTION_SCHEMA",
    "FLEET_OPTYPE_SCHEMA",
    "FLEET_SIZE_SCHEMA",
    "FLEET_CAUSE_SCHEMA",
    "FLEET_HOST_SCHEMA",
    "FLEET_POSITION_SCHEMA",
    "FLEET_COVERAGE_SCHEMA",
    "FLEET_STATE_SCHEMA",
    "FLEET_TABLES",
    "FLEET_STATE_TABLE",
    "JOB_CAUSE_TABLE",
    "ROLLUP_SUFFIX",
    "FLEET_TABLE_SPECS",
    "rollup_table",
]

FLEET_SCHEMA_VERSION = "2"   # 2: fleet_coverage by source_format

# Root-cause vocabulary (METHOD.md section 5). "none": the job does not straggle (S < 1.1).
CAUSES: tuple[str, ...] = (
    "individual-worker",   # a worker slower than its DP peers beyond the job's jitter (one DP rank: M_W > 0.5)
    "stage-imbalance",     # one model chunk carries more compute (M_S >= 0.5 when it is the last stage)
    "sequence-imbalance",  # forward/backward durations of a microbatch move together (r >= 0.9)
    "python-gc",           # sporadic forward-only stalls on a rotating worker
    "communication",       # comm op types dominate the per-optype attribution
    "untraced-cpu",        # one worker's untraced CPU time makes the replay discrepancy (discarded windows)
    "insufficient-evidence",  # straggling, yet the trace cannot decide (too few steps or peers for the job's noise)
    "unexplained",         # straggling, none of the above
    "none",
)

# How op types fold into the three families the paper compares (plus the step tail).
OPTYPE_CATEGORIES: dict[str, str] = {
    "forward-compute": "compute",
    "backward-compute": "compute",
    "backward-weight-compute": "compute",
    "forward-pp-comm": "pp-comm",
    "backward-pp-comm": "pp-comm",
    "forward-send": "pp-comm",
    "forward-recv": "pp-comm",
    "backward-send": "pp-comm",
    "backward-recv": "pp-comm",
    "params-all-gather": "dp-comm",
    "grads-reduce-scatter": "dp-comm",
    "separate-grads-all-reduce": "dp-comm",
    "all-to-all": "group-comm",
    "group-collective": "group-comm",
    "layernorm-grads-all-reduce": "other",
    "embedding-grads-all-reduce": "other",
    "optimizer-clip-main-grad": "other",
    "optimizer": "other",
    "gc": "other",
}

PERIODS = ("day", "week", "month", "all")
HISTOGRAM_BIN_WIDTH = 0.001

JOB_CAUSE_TABLE = "job_cause"
FLEET_STATE_TABLE = "fleet_state"
ROLLUP_SUFFIX = "_rollup"

_PERIOD = [
    pa.field("period", pa.string(), nullable=False),       # day | week | month | all
    pa.field("period_start", pa.date32(), nullable=False),
]


def _schema(name: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={"strag.table": name, "strag.fleet_schema_version": FLEET_SCHEMA_VERSION})


# One row per analysed job window, straggling or not, kept or discarded: the root-cause verdict with its
# evidence (a discarded window's from measurements only: METHOD.md's replay is off by more than 5%).
JOB_CAUSE_SCHEMA = _schema(
    JOB_CAUSE_TABLE,
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("slowdown", pa.float64(), nullable=False),             # S of the window
        pa.field("cause", pa.string(), nullable=False),                 # primary cause, CAUSES
        pa.field("causes", pa.list_(pa.string()), nullable=False),      # every detected cause, strongest first
        pa.field("confidence", pa.float64(), nullable=False),           # of the primary cause, 0..1 (insufficient-evidence: its strongest undecided finding)
        pa.field("evidence_json", pa.string(), nullable=False),         # metric name -> value (M_W, M_S, r, ...)
        pa.field("implicated_dp_ranks", pa.list_(pa.int16()), nullable=False),  # workers whose machine is blamed (M_W set of an
                                                                                 # individual-worker or located-link verdict)
        pa.field("implicated_stages", pa.list_(pa.int16()), nullable=False),
        pa.field("implicated_hosts", pa.list_(pa.string()), nullable=False),
        pa.field("fixed_slowdown", pa.float64(), nullable=True),        # S after replaying the fix of the primary cause
        pa.field("savings_gpu_hours", pa.float64(), nullable=True),     # GPU-hours the fix of the primary cause saves
        pa.field("savings_json", pa.string(), nullable=False),          # cause -> {"fixed_slowdown", "explained", "savings_fraction",
                                                                         # "savings_gpu_hours", "fix", "explained_given_others",
                                                                         # listed causes: "confidence", "explanation"}; "all": joint fix
        pa.field("explanation", pa.string(), nullable=True),            # one sentence per listed cause, for people (schemas/causes.py)
        pa.field("discarded", pa.bool_(), nullable=True),               # replay off by more than 5%: a verdict from what the trace
                                                                         # measured (no what-if saving of traced ops), left out of the
                                                                         # fleet statistics; null: written before discarded windows had rows
    ],
)

# One row per period: the headline numbers of the fleet (METHOD.md section 6).
FLEET_SUMMARY_SCHEMA = _schema(
    "fleet_summary",
    _PERIOD
    + [
        pa.field("jobs", pa.int64(), nullable=False),                 # job windows seen (every status)
        pa.field("jobs_analysed", pa.int64(), nullable=False),        # kept for fleet statistics
        pa.field("jobs_discarded", pa.int64(), nullable=False),       # analysed, replay discrepancy > 5%
        pa.field("jobs_quarantined", pa.int64(), nullable=False),     # bad input or failed analysis
        pa.field("jobs_straggling", pa.int64(), nullable=False),      # analysed with S >= 1.1
        pa.field("straggling_share", pa.float64(), nullable=True),    # jobs_straggling / jobs_analysed
        pa.field("gpu_hours", pa.float64(), nullable=False),          # of analysed windows
        pa.field("wasted_gpu_hours", pa.float64(), nullable=False),   # sum gpu_hours * (1 - 1/S)
        pa.field("waste_gpu_weighted", pa.float64(), nullable=True),  # wasted_gpu_hours / gpu_hours
        pa.field("slowdown_mean", pa.float64(), nullable=True),
        pa.field("slowdown_p50", pa.float64(), nullable=True),
        pa.field("slowdown_p90", pa.float64(), nullable=True),
        pa.field("slowdown_p99", pa.float64(), nullable=True),
        pa.field("waste_p50", pa.float64(), nullable=True),           # job-weighted
        pa.field("waste_p90", pa.float64(), nullable=True),
        pa.field("waste_p99", pa.float64(), nullable=True),
        pa.field("waste_gpu_p50", pa.float64(), nullable=True),       # GPU-hour-weighted
        pa.field("waste_gpu_p90", pa.float64(), nullable=True),
        pa.field("step_normalised_p50", pa.float64(), nullable=True),  # S_s / S over all (job, step)
        pa.field("step_normalised_p90", pa.float64(), nullable=True),
        pa.field("size_slowdown_pearson", pa.float64(), nullable=True),  # r(log2 GPUs, S) over analysed windows
        pa.field("savings_gpu_hours", pa.float64(), nullable=False),  # sum of per-job estimated savings
    ],
)

# Histograms behind every CDF: one row per non-empty bin of width HISTOGRAM_BIN_WIDTH.
#   metric: slowdown | waste | step_slowdown_normalised | optype_slowdown:<category>
#   weighting: job (count of windows) | gpu_hours | step (count of (job, step) pairs)
FLEET_DISTRIBUTION_SCHEMA = _schema(
    "fleet_distribution",
    _PERIOD
    + [
        pa.field("metric", pa.string(), nullable=False),
        pa.field("weighting", pa.string(), nullable=False),
        pa.field("bin_lower", pa.float64(), nullable=False),
        pa.field("bin_upper", pa.float64(), nullable=False),
        pa.field("count", pa.int64(), nullable=False),
        pa.field("weight", pa.float64(), nullable=False),            # = count for job/step; GPU-hours otherwise
        pa.field("cumulative_share", pa.float64(), nullable=False),  # share of total weight with value < bin_upper
    ],
)

# Waste by op type: one row per category (optype null) and per attributed op type.
# S_t is the per-optype attribution; a category's S is 1 + sum of its members' (S_t - 1).
FLEET_OPTYPE_SCHEMA = _schema(
    "fleet_optype",
    _PERIOD
    + [
        pa.field("category", pa.string(), nullable=False),            # compute | pp-comm | dp-comm | group-comm | other
        pa.field("optype", pa.string(), nullable=True),               # null on the category row
        pa.field("jobs", pa.int64(), nullable=False),                 # windows with attribution (S >= 1.03)
        pa.field("slowdown_mean", pa.float64(), nullable=True),       # mean S_t
        pa.field("slowdown_p90", pa.float64(), nullable=True),
        pa.field("wasted_gpu_hours", pa.float64(), nullable=False),   # sum gpu_hours * (1 - 1/S_t)
        pa.field("share_of_attributed_waste", pa.float64(), nullable=True),  # among category rows
    ],
)

# Slowdown against job size, GPU count in power-of-two buckets [lower, upper).
FLEET_SIZE_SCHEMA = _schema(
    "fleet_size",
    _PERIOD
    + [
        pa.field("gpus_lower", pa.int64(), nullable=False),
        pa.field("gpus_upper", pa.int64(), nullable=False),
        pa.field("jobs", pa.int64(), nullable=False),
        pa.field("jobs_straggling", pa.int64(), nullable=False),
        pa.field("slowdown_mean", pa.float64(), nullable=True),
        pa.field("slowdown_p50", pa.float64(), nullable=True),
        pa.field("slowdown_p90", pa.float64(), nullable=True),
        pa.field("gpu_hours", pa.float64(), nullable=False),
        pa.field("wasted_gpu_hours", pa.float64(), nullable=False),
    ],
)

# Root-cause prevalence among straggling windows (a window may show several causes).
FLEET_CAUSE_SCHEMA = _schema(
    "fleet_cause",
    _PERIOD
    + [
        pa.field("cause", pa.string(), nullable=False),
        pa.field("jobs", pa.int64(), nullable=False),                 # windows where the cause was detected
        pa.field("jobs_primary", pa.int64(), nullable=False),         # ... and is the primary cause
        pa.field("share_of_straggling", pa.float64(), nullable=True),  # jobs / straggling windows
        pa.field("slowdown_mean", pa.float64(), nullable=True),       # mean S of the primary windows
        pa.field("wasted_gpu_hours", pa.float64(), nullable=False),   # of the primary windows
        pa.field("savings_gpu_hours", pa.float64(), nullable=False),  # estimated by replaying the fix
    ],
)

# Spatial, per machine across jobs. A host is *implicated* in a job when the verdict blames
# one of its workers (individual-worker, or a communication verdict located on one worker's
# link); implicated in >= 2 distinct jobs = repeat offender.
FLEET_HOST_SCHEMA = _schema(
    "fleet_host",
    _PERIOD
    + [
        pa.field("host", pa.string(), nullable=False),
        pa.field("job_windows", pa.int64(), nullable=False),          # windows with a worker on the host
        pa.field("worker_windows", pa.int64(), nullable=False),       # (window, worker) pairs with S_w
        pa.field("slowdown_mean", pa.float64(), nullable=True),       # mean S_w of those workers
        pa.field("slowdown_max", pa.float64(), nullable=True),
        pa.field("straggling_workers", pa.int64(), nullable=False),   # worker windows with S_w >= 1.1
        pa.field("implicated_jobs", pa.int64(), nullable=False),      # distinct job ids
        pa.field("repeat_offender", pa.bool_(), nullable=False),
        pa.field("implicated_job_ids", pa.list_(pa.string()), nullable=False),  # sorted
    ],
)

# Spatial, per (dp_rank, stage) position across jobs; `last_stage` separates the loss stage.
FLEET_POSITION_SCHEMA = _schema(
    "fleet_position",
    _PERIOD
    + [
        pa.field("dp_rank", pa.int32(), nullable=False),
        pa.field("stage", pa.int32(), nullable=False),
        pa.field("last_stage", pa.bool_(), nullable=False),
        pa.field("worker_windows", pa.int64(), nullable=False),
        pa.field("slowdown_mean", pa.float64(), nullable=True),       # mean S_w
        pa.field("straggling_share", pa.float64(), nullable=True),    # share with S_w >= 1.1
    ],
)

# Coverage: every job window seen, by what happened to it and where its rows came from.
#   status: analysed | discarded | quarantined; reason: "" for analysed, else the batch's reason code;
#   source_format: lake (native parquet) or the raw profiler format converted (schemas/raw.py).
FLEET_COVERAGE_SCHEMA = _schema(
    "fleet_coverage",
    _PERIOD
    + [
        pa.field("status", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("source_format", pa.string(), nullable=False),
        pa.field("jobs", pa.int64(), nullable=False),
        pa.field("gpu_hours", pa.float64(), nullable=False),
        # analysed windows: how many METHOD.md section 3 alone would discard (kept by the model: untraced
        # time or carried arrivals, job_summary.kept_by), the model's mean S and METHOD.md's mean S (no untraced time; over the windows that
        # recorded it); null for other statuses
        pa.field("kept_by_model", pa.int64(), nullable=True),
        pa.field("slowdown_mean", pa.float64(), nullable=True),
        pa.field("slowdown_method_mean", pa.float64(), nullable=True),
    ],
)

# The serialised, compacted accumulator of each fleet table for one date: deterministic JSON.
FLEET_STATE_SCHEMA = _schema(
    FLEET_STATE_TABLE,
    [
        pa.field("period_start", pa.date32(), nullable=False),
        pa.field("table", pa.string(), nullable=False),
        pa.field("state_version", pa.string(), nullable=False),
        pa.field("state_json", pa.large_string(), nullable=False),
    ],
)

# Fleet table name -> schema, in the order reports list them.
FLEET_TABLES: dict[str, pa.Schema] = {
    s.metadata[b"strag.table"].decode(): s
    for s in (
        FLEET_SUMMARY_SCHEMA,
        FLEET_DISTRIBUTION_SCHEMA,
        FLEET_OPTYPE_SCHEMA,
        FLEET_SIZE_SCHEMA,
        FLEET_CAUSE_SCHEMA,
        FLEET_HOST_SCHEMA,
        FLEET_POSITION_SCHEMA,
        FLEET_COVERAGE_SCHEMA,
    )
}


def rollup_table(name: str) -> str:
    """Name of the unpartitioned rollup table of a daily fleet table: fleet_summary -> fleet_summary_rollup."""
    return name + ROLLUP_SUFFIX


_SORT_KEYS: dict[str, tuple[str, ...]] = {
    "fleet_summary": (),
    "fleet_distribution": ("metric", "weighting", "bin_lower"),
    "fleet_optype": ("category", "optype"),
    "fleet_size": ("gpus_lower",),
    "fleet_cause": ("cause",),
    "fleet_host": ("host",),
    "fleet_position": ("dp_rank", "stage", "last_stage"),
    "fleet_coverage": ("status", "reason", "source_format"),
}

# Everything this module's tables need to be published by the batch commit step
# (transforms/batch/commit.py): daily partitions, their states, the per-job verdicts, and the
# unpartitioned rollups (rebuilt by a commit finalizer, transforms.batch.rollups.fleet_rollup_tables).
FLEET_TABLE_SPECS: dict[str, TableSpec] = {
    spec.name: spec
    for spec in (
        TableSpec(JOB_CAUSE_TABLE, JOB_CAUSE_SCHEMA, ("job_id",)),
        TableSpec(FLEET_STATE_TABLE, FLEET_STATE_SCHEMA, ("table",)),
        *(TableSpec(name, schema, ("period", "period_start") + _SORT_KEYS[name]) for name, schema in FLEET_TABLES.items()),
        *(
            TableSpec(rollup_table(name), schema, ("period", "period_start") + _SORT_KEYS[name], partitioned=False)
            for name, schema in FLEET_TABLES.items()
        ),
    )
}
