"""Arrow schemas and layout of the streaming monitor's tables (`strag watch`).

    {out}/live_results/date=YYYY-MM-DD/{job}--{session}--r{revision:04d}.parquet   one row
    {out}/alerts/date=YYYY-MM-DD/{job}--{fingerprint}--{kind}--{time}.parquet        one row
    {out}/alert_state/{job}.json                                                     open alerts (transforms/live/paging.py)
    {out}/live_quarantine/date=YYYY-MM-DD/{name}.parquet                               QUARANTINE_SCHEMA rows

{job}, {session}, {kind}: the ids percent-encoded, "-" and "." included (transforms.live.results.name_part),
so the "--" joining them never occurs inside one and no two (job, session) pairs share a file.

Append-only: every (job, session, revision) is its own file, written atomically and
named by its key, so a retried write replaces the same file and a duplicate can never
be counted twice. `date` (Hive key, in the path) is the UTC day of the session's first
file. A session's current result is its highest revision (`current_results` in
transforms/live/results.py); lower revisions stay for the record, superseded.

Times are UTC timestamps; slowdowns are ratios (1.0 = no loss).
"""
from __future__ import annotations

import pyarrow as pa

__all__ = [
    "LIVE_SCHEMA_VERSION",
    "LIVE_RESULTS",
    "ALERTS",
    "LIVE_QUARANTINE",
    "LIVE_STATUSES",
    "ALERT_KINDS",
    "MISSING_WORKER",
    "BLAMED_WORKER",
    "LIVE_RESULT_SCHEMA",
    "ALERT_SCHEMA",
]

LIVE_SCHEMA_VERSION = "1"
LIVE_RESULTS = "live_results"
ALERTS = "alerts"
LIVE_QUARANTINE = "live_quarantine"

# analysed: the engine ran (S and the rest are set); discarded: analysed, but the replay
# discrepancy exceeds 5% (S is not trustworthy); failed: no result, `error` says why
# (no manifest, no complete DP rank, a trace the engine rejects).
LIVE_STATUSES = ("analysed", "discarded", "failed")
# firing: a session's verdict names something to fix (transforms/live/paging.py); resolved: a later
# session is healthy, names other workers or another cause, or the job went silent
ALERT_KINDS = ("firing", "resolved")

_TIME = pa.timestamp("us", tz="UTC")
# A worker the verdict blames: its global rank, place, machine, its slower kind of work (forward,
# backward) over its DP peers' (null where the cause is not measured against peers) and the
# steps it was slow in.
BLAMED_WORKER = pa.struct([
    pa.field("rank", pa.int32(), nullable=True), pa.field("dp_rank", pa.int16(), nullable=False),
    pa.field("stage", pa.int16(), nullable=False), pa.field("host", pa.string(), nullable=True),
    pa.field("ratio", pa.float64(), nullable=True), pa.field("work", pa.string(), nullable=True),
    pa.field("steps", pa.list_(pa.int64()), nullable=True),
])
MISSING_WORKER = pa.struct([pa.field("dp_rank", pa.int16(), nullable=False), pa.field("stage", pa.int16(), nullable=False)])


def _schema(name: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={"strag.table": name, "strag.live_schema_version": LIVE_SCHEMA_VERSION})


LIVE_RESULT_SCHEMA = _schema(
    LIVE_RESULTS,
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("session", pa.string(), nullable=False),
        pa.field("revision", pa.int32(), nullable=False),            # 1, 2, ...: the highest supersedes
        pa.field("reason", pa.string(), nullable=False),             # complete | timeout | late | watcher-stopped
        pa.field("status", pa.string(), nullable=False),             # LIVE_STATUSES
        pa.field("error", pa.string(), nullable=True),               # why failed (job, file, op)
        pa.field("complete", pa.bool_(), nullable=False),            # manifest and every listed worker present
        pa.field("workers_expected", pa.int32(), nullable=False),    # listed by the manifest (0 without one); Kineto: world size
        pa.field("workers_present", pa.int32(), nullable=False),     # Kineto: rank traces landed
        pa.field("missing_workers", pa.list_(MISSING_WORKER), nullable=False),
        # Kineto sessions count global ranks (workers_expected = world size): the ranks that had not
        # landed; null for parquet sessions (and in files written before the column existed)
        pa.field("missing_ranks", pa.list_(pa.int32()), nullable=True),
        pa.field("source_format", pa.string(), nullable=True),       # lake (parquet session) | kineto; null: lake
        pa.field("dp_ranks_analysed", pa.int32(), nullable=False),   # DP ranks with every stage present
        pa.field("duplicate_deliveries", pa.int32(), nullable=False),  # files delivered again (ignored)
        pa.field("dp_size", pa.int32(), nullable=True),
        pa.field("pp_size", pa.int32(), nullable=True),
        pa.field("n_steps", pa.int32(), nullable=True),
        pa.field("slowdown", pa.float64(), nullable=True),           # S over the analysed DP ranks
        pa.field("waste", pa.float64(), nullable=True),              # 1 - 1/S
        pa.field("launch_slowdown", pa.float64(), nullable=True),    # replay discrepancy
        pa.field("straggling", pa.bool_(), nullable=True),           # S >= 1.1 (METHOD.md)
        pa.field("m_w", pa.float64(), nullable=True),
        pa.field("m_s", pa.float64(), nullable=True),
        pa.field("verdict", pa.string(), nullable=True),             # root cause (transforms/whatif/causes.py)
        pa.field("verdict_confidence", pa.float64(), nullable=True),
        pa.field("verdict_explanation", pa.string(), nullable=True),  # one sentence per listed cause, for people
        pa.field("blamed", pa.list_(BLAMED_WORKER), nullable=True),  # the verdict's workers (pages name them)
        pa.field("verdict_saving", pa.float64(), nullable=True),     # share of the step the primary fix saves
        pa.field("undecided_workers", pa.int32(), nullable=True),   # workers the worker test could not decide on
        # JSON: the worker test's per-worker means, jitter and the workers' ranks and hosts
        # (WorkerTests.summary + "where"), pooled over the job's windows by the pager; null when
        # the session had no peer test or was analysed around missing workers
        pa.field("worker_summary", pa.string(), nullable=True),
        pa.field("steps", pa.list_(pa.int64()), nullable=True),
        pa.field("step_slowdown", pa.list_(pa.float64()), nullable=True),   # S_s, aligned with steps
        # Worker heatmap: S_w row-major [dp_rank][stage], dp_size x pp_size values; null for
        # workers not analysed (missing) or when S < 1.03 (no attribution, as the reference).
        pa.field("worker_slowdown", pa.list_(pa.float64()), nullable=True),
        pa.field("first_arrival", _TIME, nullable=False),            # poll that first saw the session
        pa.field("assembled", _TIME, nullable=False),                # poll that triggered this revision
        pa.field("analysed", _TIME, nullable=False),                 # when this row was computed
    ],
)

ALERT_SCHEMA = _schema(
    ALERTS,
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("session", pa.string(), nullable=False),            # the session that fired the alert
        pa.field("revision", pa.int32(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),               # ALERT_KINDS
        pa.field("fingerprint", pa.string(), nullable=True),         # digest of (job, cause, ranks): the alert's id
        pa.field("cause", pa.string(), nullable=True),
        pa.field("workers", pa.list_(BLAMED_WORKER), nullable=True),
        pa.field("ranks", pa.list_(pa.int32()), nullable=True),      # global ranks blamed
        pa.field("slowdown", pa.float64(), nullable=True),
        pa.field("discarded", pa.bool_(), nullable=True),            # the replay was off by > 5% (S not trustworthy)
        pa.field("confidence", pa.float64(), nullable=True),
        pa.field("saving", pa.float64(), nullable=True),             # share of the step the fix saves
        pa.field("threshold", pa.float64(), nullable=False),
        pa.field("verdict", pa.string(), nullable=True),
        pa.field("explanation", pa.string(), nullable=True),
        pa.field("message", pa.string(), nullable=False),
        pa.field("alert_time", _TIME, nullable=False),               # when this row was written
        pa.field("starts_at", _TIME, nullable=True),                 # when the alert fired
        pa.field("ends_at", _TIME, nullable=True),                   # when it resolved
        pa.field("resolved_reason", pa.string(), nullable=True),
        pa.field("resolved_by_session", pa.string(), nullable=True),
    ],
)
