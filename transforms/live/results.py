"""Publish live session results and raise alerts (the end of `strag watch`).

`EmitLiveResults` takes live result rows (dicts shaped like LIVE_RESULT_SCHEMA; times
as epoch seconds), appends each to the live table as its own file, then, keyed by job,
decides what it pages for (transforms/live/paging.py: an alert fires when a verdict names workers or a
cause to fix, and resolves when the job turns healthy or goes silent), appending each alert event
to the alerts table (and a log line). Layout and schemas: schemas/live.py.

Duplicates never double-count: a result file is named by (job, session, revision), so
a retried write replaces it; the alert state (in the output folder) remembers the highest
revision seen per session, so a repeated or superseded result, or a restarted watcher's second
look at a session, raises nothing. A late file produces a
higher revision, which readers take as the session's current result
(`transforms.live.tables.current_results`).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math

import apache_beam as beam
import pyarrow as pa
from apache_beam.metrics import Metrics

from schemas.lake import LANDING
from schemas.live import ALERT_SCHEMA, ALERTS, LIVE_QUARANTINE, LIVE_RESULT_SCHEMA, LIVE_RESULTS
from schemas.tables import QUARANTINE_SCHEMA
from transforms.io.lake import write_parquet
from transforms.live.paging import AlertBook
from transforms.live.tables import DEFAULT_THRESHOLD, count_live_sessions, name_part  # noqa: F401 (the watcher imports them from here)

__all__ = [
    "DEFAULT_THRESHOLD",
    "AlertConfig",
    "record_alert",
    "EmitLiveResults",
    "result_path",
    "alert_path",
    "rows_table",
    "count_live_sessions",
    "quarantine_path",
    "WriteLiveQuarantine",
]

_LOG = logging.getLogger("strag.watch")

def _date_of(epoch_seconds: float) -> str:
    return dt.datetime.fromtimestamp(epoch_seconds, dt.timezone.utc).date().isoformat()


def result_path(out: str, row: dict) -> str:
    """File of one (job, session, revision) result under the output URL."""
    return (f"{out.rstrip('/')}/{LIVE_RESULTS}/date={_date_of(row['first_arrival'])}/"
            f"{name_part(row['job_id'])}--{name_part(row['session'])}--r{int(row['revision']):04d}.parquet")


def alert_path(out: str, alert: dict) -> str:
    """File of one alert event under the output URL: named by the alert (job, fingerprint, the session
    and revision that fired it) and the event (firing, resolved), so a retried write replaces it."""
    return (f"{out.rstrip('/')}/{ALERTS}/date={_date_of(alert['starts_at'])}/"
            f"{name_part(alert['job_id'])}--{alert['fingerprint']}--{name_part(alert['session'])}--"
            f"r{int(alert['revision']):04d}--{name_part(alert['kind'])}.parquet")


def rows_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """Dict rows -> table of `schema`; timestamp fields given as epoch seconds are converted."""
    converted = []
    for row in rows:
        item = {}
        for field in schema:
            value = row.get(field.name)
            if pa.types.is_timestamp(field.type) and isinstance(value, (int, float)):
                value = dt.datetime.fromtimestamp(value, dt.timezone.utc)
            item[field.name] = value
        converted.append(item)
    return pa.Table.from_pylist(converted, schema=schema)


def quarantine_path(out: str, records: list[dict]) -> str:
    """File of one batch of live quarantine rows (one session's rows of one bundle, all of one UTC
    day): named by the session and a digest of what the rows say, so a repeated batch replaces it."""
    import hashlib

    first = records[0]
    key = "\n".join("|".join(str(record.get(name)) for name in ("job_id", "session", "source_path", "reason_code", "detail"))
                    for record in records)
    return (f"{out.rstrip('/')}/{LIVE_QUARANTINE}/date={_date_of(first.get('seen_time') or 0.0)}/"
            f"{name_part(first.get('job_id') or LANDING)}--{name_part(first.get('session'))}--"
            f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.parquet")


@dataclasses.dataclass(frozen=True)
class AlertConfig:
    """out: output URL of the tables; threshold: S at and above which a kept window straggles;
    resolve_after: seconds without a new session after which a job's alerts resolve (None:
    derived from its profiling cadence); archived_after: seconds after which the watcher archives
    a done session (alerts never resolve by silence before that). See transforms/live/paging.py."""

    out: str
    threshold: float = DEFAULT_THRESHOLD
    resolve_after: float | None = None
    archived_after: float = 0.0

    def __post_init__(self):
        if not self.out:
            raise ValueError("AlertConfig.out: give the output URL")
        if not (math.isfinite(self.threshold) and self.threshold >= 1.0):
            raise ValueError(f"AlertConfig.threshold must be a finite slowdown >= 1.0, got {self.threshold!r}")

    def book(self) -> AlertBook:
        return AlertBook(self.out, self.threshold, self.resolve_after, self.archived_after)


class _WriteLiveResultFn(beam.DoFn):
    def __init__(self, out: str):
        self._out = out
        self._written = Metrics.counter("live", "results_written")

    def process(self, row: dict):
        write_parquet(result_path(self._out, row), rows_table([row], LIVE_RESULT_SCHEMA))
        self._written.inc()
        yield row["job_id"], row


class _DetectAlertsFn(beam.DoFn):
    """Keyed by job, so one job's results are decided one at a time (transforms/live/paging.py)."""

    def __init__(self, config: AlertConfig):
        self._config = config
        self._raised = Metrics.counter("live", "alerts_raised")

    def setup(self):
        self._book = self._config.book()

    def process(self, element):
        import time

        _, row = element
        for alert in self._book.apply(row, time.time()):
            yield from record_alert(self._config.out, alert, self._raised)


def record_alert(out: str, alert: dict, counter=None):
    """Write one alert event to the alerts table and log it; yields it (for delivery)."""
    write_parquet(alert_path(out, alert), rows_table([alert], ALERT_SCHEMA))
    if alert["kind"] == "firing":
        if counter is not None:
            counter.inc()
        _LOG.warning("ALERT %s", alert["message"])
    else:
        _LOG.info("RESOLVED %s", alert["message"])
    yield alert


class EmitLiveResults(beam.PTransform):
    """Live result rows -> files in live_results; alerts -> files in alerts (+ a log line).

    Returns the PCollection of alert dicts (ALERT_SCHEMA fields).
    """

    def __init__(self, config: AlertConfig):
        super().__init__()
        self._config = config

    def expand(self, results):
        return (
            results
            | "WriteLiveResult" >> beam.ParDo(_WriteLiveResultFn(self._config.out)).with_output_types(tuple[str, dict])
            | "DetectAlerts" >> beam.ParDo(_DetectAlertsFn(self._config))
        )


class _WriteQuarantineFn(beam.DoFn):
    """Quarantine rows are written per session and bundle (one poll's worth), not per row: a bad
    session of a million rows makes a handful of files and one log line per poll, not a million."""

    def __init__(self, out: str):
        self._out = out

    def start_bundle(self):
        self._pending: dict[tuple, list[dict]] = {}

    def process(self, record: dict):
        key = (_date_of(record.get("seen_time") or 0.0), record.get("job_id"), record.get("session"))
        self._pending.setdefault(key, []).append(record)
        Metrics.counter("strag.quarantine", str(record.get("reason_code"))).inc()

    def finish_bundle(self):
        for (_, job_id, session), records in sorted(self._pending.items(), key=lambda item: str(item[0])):
            write_parquet(quarantine_path(self._out, records), rows_table(records, QUARANTINE_SCHEMA))
            codes = sorted({str(record.get("reason_code")) for record in records})
            first = records[0]
            subject = f"job {job_id} session {session}" if job_id else "landing area"
            _LOG.warning("QUARANTINE %s: %d row(s) (%s), e.g. %s", subject, len(records), ", ".join(codes),
                         first.get("detail") or first.get("reason"))
        self._pending = {}


class WriteLiveQuarantine(beam.PTransform):
    """Quarantine rows (QUARANTINE_SCHEMA dicts + seen_time epoch seconds) -> live_quarantine files."""

    def __init__(self, out: str):
        super().__init__()
        self._out = out

    def expand(self, records):
        return records | "WriteQuarantineRow" >> beam.ParDo(_WriteQuarantineFn(self._out))
