"""What a job window comes to (transforms/batch/elements.py JobOutcome): its coverage row, and the
outcome of a window quarantined whole, by a validation problem (transforms/batch/read_windows.py finds it)
or by an unexpected error (a dead letter). transforms/batch/analyze_jobs.py builds the analysed outcomes
from these; validation only reports problems.

An unexpected error (a bug meeting odd data: QUARANTINED_ERRORS) quarantines its window with
reason `unexpected_error`; anything else, above all OSError (storage: transforms/io/storage.py),
fails the run: failing infrastructure is not bad data.
"""
from __future__ import annotations

import traceback
from collections.abc import Iterable
from typing import Any, Iterator

import apache_beam as beam
import pyarrow as pa

from schemas.tables import COVERAGE_SCHEMA, QUARANTINE_SCHEMA
from transforms.batch.elements import JobOutcome, JobProblem, JobStats, MatchedJob, ValidatedJob, WindowGroup
from transforms.io.lake import LakeJob
from transforms.batch.read_windows import window_path

__all__ = [
    "UNEXPECTED_ERROR",
    "QUARANTINED_ERRORS",
    "gpu_hours",
    "source_format",
    "coverage_row",
    "quarantined_outcome",
    "unexpected_error_outcome",
    "count_quarantine_error",
    "dead_letters",
    "quarantine_on_error",
    "error_details",
]

UNEXPECTED_ERROR = "unexpected_error"
# Unexpected errors that quarantine their window (a bug meets odd data). Everything else, above all
# OSError (storage: transforms/io/storage.py), fails the run: failing infrastructure is not bad data.
QUARANTINED_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError, AssertionError,
                      RuntimeError, NotImplementedError, pa.ArrowException)
_UNEXPECTED_REASON = "an unexpected error stopped this job window (a bug meeting this data); see detail, fix, rerun the date"


def gpu_hours(manifest: dict[str, Any]) -> float:
    """GPU count x wall-clock hours of the window (manifest end_time - start_time)."""
    return int(manifest["gpus"]) * (manifest["end_time"] - manifest["start_time"]).total_seconds() / 3600.0


def source_format(job: LakeJob, manifest: dict[str, Any] | None = None) -> str:
    """schemas/raw.py SOURCE_FORMATS: the raw format a window was converted from (on the worker,
    or earlier by `strag import`: the manifest's source record), else "lake"."""
    source = (manifest or {}).get("source")
    return job.raw_format or (source.get("format") if isinstance(source, dict) else None) or "lake"


def coverage_row(job: LakeJob, status: str, stats: JobStats, *, reason_code: str | None = None, reason: str | None = None,
                 manifest: dict[str, Any] | None = None, launch_slowdown: float | None = None,
                 kept_by: str | None = None) -> pa.Table:
    """The window's coverage row (COVERAGE_SCHEMA)."""
    gpus = int(manifest["gpus"]) if manifest is not None else None
    return pa.Table.from_pylist(
        [{
            "job_id": job.job_id,
            "status": status,
            "reason_code": reason_code,
            "reason": reason,
            "has_manifest": job.manifest_path is not None,
            "trace_files": len(job.trace_files),
            "rows_read": stats.rows_read,
            "rows_quarantined": stats.rows_quarantined,
            "gpus": gpus,
            "gpu_hours": gpu_hours(manifest) if manifest is not None else None,
            "launch_slowdown": launch_slowdown,
            "source_format": source_format(job, manifest),
            "kept_by": kept_by,
        }],
        schema=COVERAGE_SCHEMA,
    )


def quarantined_outcome(job: LakeJob, problem: JobProblem, quarantine: pa.Table, stats: JobStats,
                        manifest: dict[str, Any] | None = None) -> JobOutcome:
    """JobOutcome of a window quarantined whole: coverage row + quarantine rows."""
    stats.status, stats.reason_code = "quarantined", problem.reason_code
    coverage = coverage_row(job, "quarantined", stats, reason_code=problem.reason_code, reason=problem.reason, manifest=manifest)
    return JobOutcome(job.job_id, job.date, {"coverage": coverage, "quarantine": quarantine}, stats)


def unexpected_error_outcome(element: Any, error: tuple) -> JobOutcome:
    """JobOutcome quarantining the window behind a dead-letter element of with_exception_handling()."""
    job = element.job if isinstance(element, (ValidatedJob, MatchedJob)) else element
    if not isinstance(job, LakeJob):
        raise TypeError(f"dead letter for an element of type {type(element).__name__}, expected MatchedJob or ValidatedJob")
    error_type, message, lines = error
    name = getattr(error_type, "__name__", str(error_type))
    detail = f"{name}: {message}\n" + "".join(lines[-6:] if isinstance(lines, list) else [str(lines)])
    stats = element.stats if isinstance(element, ValidatedJob) else JobStats(job.job_id, job.date, "quarantined")
    problem = JobProblem(UNEXPECTED_ERROR, _UNEXPECTED_REASON, detail, window_path(job))
    record = pa.Table.from_pylist(
        [{"job_id": job.job_id, "source_path": window_path(job), "level": "job", "reason_code": UNEXPECTED_ERROR,
          "reason": _UNEXPECTED_REASON, "detail": detail, "rows": stats.rows_read}],
        schema=QUARANTINE_SCHEMA,
    )
    if isinstance(element, ValidatedJob):
        return quarantined_outcome(job, problem, pa.concat_tables([element.quarantine, record]), stats, element.manifest)
    return quarantined_outcome(job, problem, record, stats, getattr(element, "manifest", None))


def count_quarantine_error() -> None:
    """Bump the counters of a window quarantined by an unexpected error."""
    beam.metrics.Metrics.counter("strag.quarantine", UNEXPECTED_ERROR).inc()
    beam.metrics.Metrics.counter("strag.jobs", "quarantined").inc()


def dead_letters(element) -> Iterator[JobOutcome]:
    """Dead-letter tuples (element, (type, repr, traceback)) -> a quarantined JobOutcome per
    window of the element (a WindowGroup gives one per window)."""
    if isinstance(element, tuple) and len(element) == 2 and isinstance(element[1], tuple) and len(element[1]) == 3:
        failed, error = element
        for window in failed.windows if isinstance(failed, WindowGroup) else (failed,):
            count_quarantine_error()
            yield unexpected_error_outcome(window, error)


def quarantine_on_error(element, outcomes: Iterable[JobOutcome]) -> list[JobOutcome]:
    """All of `outcomes`, or, when producing them raises an unexpected error (QUARANTINED_ERRORS),
    none of them but a quarantined JobOutcome per window of `element`, inside the DoFn: no
    second output (with_exception_handling's) to flatten back in."""
    try:
        return list(outcomes)
    except QUARANTINED_ERRORS as error:   # storage errors (OSError) are not bad data: they fail the run
        return list(dead_letters((element, error_details(error))))


def error_details(error: BaseException) -> tuple:
    """(type, repr, traceback lines) of an exception: the error part of a dead letter."""
    return type(error), repr(error), traceback.format_exception(error)
