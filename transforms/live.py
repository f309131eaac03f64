"""Publish live session results and raise alerts (the end of `strag watch`).

`EmitLiveResults` takes live result rows (dicts shaped like LIVE_RESULT_SCHEMA; times
as epoch seconds), appends each to the live table as its own file, then, keyed by job,
compares it with the job's previous result and appends an alert (and logs one line)
when S crosses the threshold or the verdict changes. Layout and schemas: schemas/live.py.

Duplicates never double-count: a result file is named by (job, session, revision), so
a retried write replaces it; the alert state remembers the highest revision seen per
session, so a repeated or superseded result raises nothing. A late file produces a
higher revision, which readers take as the session's current result
(`transforms.live_tables.current_results`).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import urllib.parse

import apache_beam as beam
import pyarrow as pa
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

from schemas.lake import LANDING
from schemas.live import ALERT_SCHEMA, ALERTS, LIVE_QUARANTINE, LIVE_RESULT_SCHEMA, LIVE_RESULTS
from schemas.tables import QUARANTINE_SCHEMA
from transforms.lake import write_parquet
from transforms.live_tables import DEFAULT_THRESHOLD, count_live_sessions  # noqa: F401 (the watcher imports them from here)

__all__ = [
    "DEFAULT_THRESHOLD",
    "AlertConfig",
    "AlertState",
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


def name_part(value) -> str:
    """An id as one part of a file name, injectively: percent-encoded, '-' included, so the '--'
    that joins the parts never occurs inside one ('a--b' + 'c' and 'a' + 'b--c' stay apart)."""
    return urllib.parse.quote(str(value), safe="").replace("-", "%2D").replace(".", "%2E")


def result_path(out: str, row: dict) -> str:
    """File of one (job, session, revision) result under the output URL."""
    return (f"{out.rstrip('/')}/{LIVE_RESULTS}/date={_date_of(row['first_arrival'])}/"
            f"{name_part(row['job_id'])}--{name_part(row['session'])}--r{int(row['revision']):04d}.parquet")


def alert_path(out: str, alert: dict, first_arrival: float) -> str:
    """File of one alert (per result revision and kind) under the output URL."""
    return (f"{out.rstrip('/')}/{ALERTS}/date={_date_of(first_arrival)}/"
            f"{name_part(alert['job_id'])}--{name_part(alert['session'])}--r{int(alert['revision']):04d}--"
            f"{name_part(alert['kind'])}.parquet")


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
    """out: output URL of the tables; threshold: S at and above which a job straggles."""

    out: str
    threshold: float = DEFAULT_THRESHOLD

    def __post_init__(self):
        if not self.out:
            raise ValueError("AlertConfig.out: give the output URL")
        if not (math.isfinite(self.threshold) and self.threshold >= 1.0):
            raise ValueError(f"AlertConfig.threshold must be a finite slowdown >= 1.0, got {self.threshold!r}")


@dataclasses.dataclass
class AlertState:
    """A job's last published result, between results (kept in Beam state per job)."""

    slowdown: float | None = None
    verdict: str | None = None
    revisions: dict = dataclasses.field(default_factory=dict)  # session -> highest revision seen

    def apply(self, row: dict, threshold: float, now: float) -> list[dict]:
        """Alerts (ALERT_SCHEMA dicts, alert_time epoch seconds) raised by one result row."""
        session, revision = row["session"], int(row["revision"])
        if revision <= self.revisions.get(session, 0):
            return []  # a repeat or an already superseded revision
        self.revisions[session] = revision
        if row["status"] != "analysed" or row.get("slowdown") is None:
            return []  # failed or discarded: no trustworthy S to compare
        slowdown, verdict = float(row["slowdown"]), row.get("verdict")
        alerts = []
        above = slowdown >= threshold
        was_above = None if self.slowdown is None else self.slowdown >= threshold
        if above != was_above and (above or was_above is not None):
            kind = "slowdown-above-threshold" if above else "slowdown-below-threshold"
            alerts.append(self._alert(row, kind, threshold, now,
                                      f"S {slowdown:.3f} {'>=' if above else '<'} threshold {threshold:g}"
                                      + ("" if self.slowdown is None else f" (was {self.slowdown:.3f})")))
        if verdict is not None and self.verdict is not None and verdict != self.verdict:
            alerts.append(self._alert(row, "verdict-changed", threshold, now,
                                      f"verdict {self.verdict} -> {verdict} (S {slowdown:.3f})"))
        self.slowdown = slowdown
        if verdict is not None:
            self.verdict = verdict
        return alerts

    def _alert(self, row: dict, kind: str, threshold: float, now: float, detail: str) -> dict:
        message = f"job {row['job_id']} session {row['session']} r{row['revision']}: {detail}"
        return {
            "job_id": row["job_id"], "session": row["session"], "revision": int(row["revision"]), "kind": kind,
            "slowdown": row.get("slowdown"), "previous_slowdown": self.slowdown, "threshold": threshold,
            "verdict": row.get("verdict"), "previous_verdict": self.verdict, "message": message, "alert_time": now,
        }


class _WriteLiveResultFn(beam.DoFn):
    def __init__(self, out: str):
        self._out = out
        self._written = Metrics.counter("live", "results_written")

    def process(self, row: dict):
        write_parquet(result_path(self._out, row), rows_table([row], LIVE_RESULT_SCHEMA))
        self._written.inc()
        yield row["job_id"], row


class _DetectAlertsFn(beam.DoFn):
    STATE = ReadModifyWriteStateSpec("alert_state", PickleCoder())

    def __init__(self, config: AlertConfig):
        self._config = config
        self._raised = Metrics.counter("live", "alerts_raised")

    def process(self, element, state=beam.DoFn.StateParam(STATE)):
        import time

        _, row = element
        job_state = state.read() or AlertState()
        alerts = job_state.apply(row, self._config.threshold, time.time())
        state.write(job_state)
        for alert in alerts:
            self._raised.inc()
            path = alert_path(self._config.out, alert, row["first_arrival"])
            write_parquet(path, rows_table([alert], ALERT_SCHEMA))
            _LOG.warning("ALERT %s", alert["message"])
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
