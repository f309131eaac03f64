"""Layout of the trace lake on any fsspec URL (file path, file://, memory://, s3://).

    {lake}/traces/date=YYYY-MM-DD/job_id={job_id}/{name}.parquet   op records (TRACE_SCHEMA)
    {lake}/manifests/date=YYYY-MM-DD/{job_id}.parquet              one row (MANIFEST_SCHEMA)
    {lake}/landing/{job_id}/{session}/worker-{dp}-{stage}.parquet  streaming arrivals (or rank-{r}-of-{w}.json.gz:
                                                                   torch.profiler traces, transforms/live/landing.py)
    {lake}/landing_archive/{job_id}/{session}/...                  sessions the watcher is done with
    {lake}/_lake.json                                              {"schema_version": ...}

A job's trace window for a date is every parquet file under its traces partition;
a file holds whole workers (all rows of a worker for the steps it covers).
"""
from __future__ import annotations

import datetime as dt
import re

__all__ = [
    "TRACES",
    "MANIFESTS",
    "LANDING",
    "LANDING_ARCHIVE",
    "LAKE_MARKER",
    "trace_dir",
    "manifest_path",
    "landing_dir",
    "parse_partition",
    "safe_job_id",
    "iso_date",
]

TRACES = "traces"
MANIFESTS = "manifests"
LANDING = "landing"
LANDING_ARCHIVE = "landing_archive"
LAKE_MARKER = "_lake.json"


_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+@:-]{0,199}")


def safe_job_id(job_id: str, what: str = "job id") -> str:
    """`job_id` when it can name a lake folder and file as it is; ValueError saying why not.

    Letters, digits and . _ + @ : - only, starting with a letter or digit (names starting
    with '.' or '_' are hidden from listings; '/', '=' and '..' would leave the partition).
    The same alphabet names live sessions (what="session").
    """
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id) or ".." in job_id:
        raise ValueError(f"{what} {job_id!r}: use 1-200 letters, digits and . _ + @ : - starting with a letter or "
                         "digit (no '/', '=', '..'; a leading '.' or '_' would hide it)")
    return job_id


def _join(lake: str, *parts: str) -> str:
    return "/".join([lake.rstrip("/"), *parts])


def trace_dir(lake: str, date: dt.date | str, job_id: str) -> str:
    """Folder holding one job's trace files for one date partition (ValueError on an unsafe job id)."""
    return _join(lake, TRACES, f"date={iso_date(date)}", f"job_id={safe_job_id(job_id)}")


def manifest_path(lake: str, date: dt.date | str, job_id: str) -> str:
    """Parquet file holding one job's manifest row for one date partition (ValueError on an unsafe job id)."""
    return _join(lake, MANIFESTS, f"date={iso_date(date)}", f"{safe_job_id(job_id)}.parquet")


def landing_dir(lake: str, job_id: str, session: str | int) -> str:
    """Folder where the per-worker files of one live profiling session land (ValueError on an unsafe id)."""
    return _join(lake, LANDING, safe_job_id(job_id), safe_job_id(str(session), "session"))


def parse_partition(path: str) -> dict[str, str]:
    """Hive keys found in a path: '.../date=2024-01-02/job_id=j1/x.parquet' -> {date:..., job_id:...}."""
    out = {}
    for part in path.split("/"):
        key, sep, value = part.partition("=")
        if sep and key in ("date", "job_id"):
            out[key] = value
    return out


def iso_date(date: dt.date | str) -> str:
    """A date or date text as YYYY-MM-DD (ValueError for text that is no date)."""
    return date.isoformat() if isinstance(date, dt.date) else dt.date.fromisoformat(str(date)).isoformat()
