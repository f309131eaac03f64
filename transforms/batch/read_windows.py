"""Validation of job windows' trace files against the lake contract, on the worker.

`validate_job_windows` (plain function) reads a group of windows' trace files and checks
them with the Validator of transforms/validation.py (the Great Expectations suites of
schemas/expectations.py plus structural checks)
(one GX screen run for the whole group; the Validator is built once per worker thread in
`setup()`); AnalyzeJobs calls it in the same DoFn that runs the engine, so op rows never
leave the worker that read them. `validate_job_window` does one window.

Rules (reason codes live in schemas/expectations.py):
- rejected rows go to the quarantine table one row each, and the window goes on with the
  valid rest (the engine then decides whether the rest is still a complete trace);
- a rejected file is one quarantine row, and its window is quarantined whole (`incomplete_window`):
  the rest is partial input, whose S would be reported as if complete;
- a window with a job-level problem (no manifest, unreadable or invalid manifest, no trace
  files, missing workers or steps), or a row problem whose rows cannot be removed (the same
  op in two files), is quarantined whole; coverage names the most basic reason (a file
  missing a column before the workers it then lacks);
- an unexpected error (a bug meeting odd data: QUARANTINED_ERRORS) is caught (per window, or
  per group in the DoFn by `quarantine_on_error`; transforms/batch/outcomes.py builds those outcomes) and
  quarantines that window with reason `unexpected_error`; a storage failure (OSError, StorageError
  after retries) is not bad data and fails the run.
Every quarantine row bumps the Beam counter `strag.quarantine/<reason_code>`.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import apache_beam as beam
import numpy as np
import pyarrow as pa

from schemas.expectations import INCOMPLETE_WINDOW, REASONS, JobFiles, Problem, ValidationReport
from schemas.lake import trace_dir
from schemas.tables import QUARANTINE_SCHEMA
from transforms.batch.elements import JobProblem, JobStats, MatchedJob, ValidatedJob
from transforms.io.lake import LakeJob, read_job_files
from transforms.validation import Validator

__all__ = [
    "validate_job_window",
    "validate_job_windows",
    "quarantine_rows",
    "window_path",
    "worker_validator",
    "count_quarantine",
]

def window_path(job: LakeJob) -> str:
    """The folder a window's files came from: its traces partition, or its raw upload folder."""
    return trace_dir(job.lake, job.date, job.job_id) if job.raw_format is None else _raw_path(job)


def quarantine_rows(job: LakeJob, problems: list[Problem], invalid: pa.Table | None = None) -> pa.Table:
    """Quarantine rows (QUARANTINE_SCHEMA) of one window: one per invalid row, one per
    file- or job-level problem, and one per row-level problem whose rows are not listed
    in `invalid` (e.g. duplicates across files)."""
    listed: set[tuple[str, str]] = set()
    parts = []
    if invalid is not None and invalid.num_rows:
        n = invalid.num_rows
        codes = invalid.column("reason").to_pylist()
        paths = invalid.column("source_path").to_pylist()
        listed = set(zip(paths, codes))
        job_ids = invalid.column("job_id").to_pylist() if "job_id" in invalid.column_names else [job.job_id] * n
        parts.append(pa.table(
            {
                "job_id": [j or job.job_id for j in job_ids],
                "source_path": paths,
                "level": ["row"] * n,
                "reason_code": codes,
                "reason": [REASONS.get(code, ("row", code))[1] for code in codes],
                "detail": invalid.column("detail").to_pylist(),
                "rows": pa.nulls(n, pa.int64()),
            },
            schema=QUARANTINE_SCHEMA,
        ))
    records = [
        {
            "job_id": p.job_id or job.job_id,
            "source_path": p.source_path or window_path(job),
            "level": "job" if p.level == "row" else p.level,
            "reason_code": p.reason,
            "reason": REASONS[p.reason][1] if p.reason in REASONS else p.reason,
            "detail": p.detail,
            "rows": p.rows,
        }
        for p in problems
        if p.level != "row" or (p.source_path, p.reason) not in listed
    ]
    if records:
        parts.append(pa.Table.from_pylist(records, schema=QUARANTINE_SCHEMA))
    return pa.concat_tables(parts) if parts else QUARANTINE_SCHEMA.empty_table()


def _job_problem(job: LakeJob, report: ValidationReport) -> JobProblem | None:
    """The problem that quarantines the whole window, or None when its valid rows go on."""
    listed = {(p, r) for p, r in zip(report.invalid.column("source_path").to_pylist(), report.invalid.column("reason").to_pylist())}
    unremovable = [p for p in report.problems if p.level == "job" or (p.level == "row" and (p.source_path, p.reason) not in listed)]
    lost = [p for p in report.problems if p.level == "file"]
    if lost and not unremovable:
        # a window that lost a file is partial input: analysing the rest would report a wrong S as complete
        names = ", ".join(f"{p.source_path} ({p.reason})" for p in lost[:5]) + (" ..." if len(lost) > 5 else "")
        return JobProblem(INCOMPLETE_WINDOW, REASONS[INCOMPLETE_WINDOW][1],
                          f"job {job.job_id} on {job.date}: {len(lost)} file(s) rejected: {names}", window_path(job))
    if not unremovable and report.valid.num_rows:
        return None
    # The reason shown for the window is the most basic one (REASONS lists file problems
    # first): a file without a column explains the workers then missing, not the reverse.
    candidates = unremovable + [p for p in report.problems if p.level == "file"]
    if not candidates:
        return JobProblem("no_valid_rows", f"job {job.job_id} on {job.date}: no valid op rows to analyse", None, window_path(job))
    order = {code: i for i, code in enumerate(REASONS)}
    first = min(candidates, key=lambda p: order.get(p.reason, len(order)))
    return JobProblem(first.reason, REASONS.get(first.reason, ("job", first.reason))[1], first.detail, first.source_path or window_path(job))


def count_quarantine(quarantine: pa.Table) -> None:
    """Bump the Beam counter strag.quarantine/<reason_code> once per quarantine row."""
    if quarantine.num_rows == 0:
        return
    codes, counts = np.unique(np.asarray(quarantine.column("reason_code").to_pylist(), dtype=object), return_counts=True)
    for code, count in zip(codes.tolist(), counts.tolist()):
        beam.metrics.Metrics.counter("strag.quarantine", code).inc(count)


def validate_job_windows(windows: Sequence[MatchedJob], validator: Validator) -> list[ValidatedJob]:
    """Read and validate several job windows on this worker (plain function, the DoFn's body).

    windows: as MatchJobs planned them, each with its validated manifest. All are read,
    then validated in one Validator.validate_jobs call (one GX screen run for all of
    them). Returns one ValidatedJob per window, in order, whose `problem` is set when the
    window is quarantined whole. Seconds per window: reading its files, and validating
    (its share of the screen, its own checks and of the manifest validation).
    """
    windows = list(windows)
    prepared: list = []   # per window: JobFiles to validate, a ConvertedJob, or a ValidatedJob quarantining it
    read_seconds = []
    for matched in windows:
        started = time.perf_counter()
        if matched.job.raw_format is None:
            prepared.append(JobFiles(matched.job.job_id, matched.manifest, read_job_files(matched.job),
                                     matched.job.manifest_path, tuple(matched.manifest_problems)))
        else:
            prepared.append(_convert(matched))   # conversion counts as reading
        read_seconds.append(time.perf_counter() - started)
    raw = [i for i, item in enumerate(prepared) if not isinstance(item, (JobFiles, ValidatedJob))]
    rejected = {i: prepared[i].rejected for i in raw}
    if raw:   # converted manifests, validated together (one GX run) as MatchJobs does for the lake's
        started = time.perf_counter()
        # no manifest file: the converter made it, so no file name to check against the job id
        issues = validator.validate_manifests([(None, prepared[i].manifest) for i in raw])
        share = (time.perf_counter() - started) / len(raw)
        for i, problems in zip(raw, issues):
            converted, path = prepared[i], _raw_path(windows[i].job)
            manifest = None if problems else dict(converted.manifest, source=converted.source)
            windows[i] = MatchedJob(windows[i].job, manifest, tuple(problems), windows[i].seconds + share)
            prepared[i] = JobFiles(converted.job_id, manifest, [(path, converted.trace)], path, tuple(problems))
    reports = iter(validator.validate_jobs([item for item in prepared if isinstance(item, JobFiles)]))
    out = [item if isinstance(item, ValidatedJob) else _validated(matched, next(reports), seconds)
           for matched, item, seconds in zip(windows, prepared, read_seconds)]
    for i in raw:   # raw files the converter set aside: quarantined, the window goes on without them
        if rejected[i]:
            out[i].quarantine = pa.concat_tables([_raw_rows(windows[i].job, rejected[i]), out[i].quarantine])
    return out


def _raw_path(job: LakeJob) -> str:
    from schemas.raw import raw_dir

    return raw_dir(job.lake, job.raw_format, job.date, job.job_id)


def _raw_rows(job: LakeJob, errors) -> pa.Table:
    """Quarantine rows (QUARANTINE_SCHEMA) of raw input errors: one per file set aside or job refused."""
    return pa.Table.from_pylist(
        [{"job_id": job.job_id, "source_path": error.path or _raw_path(job), "level": error.level,
          "reason_code": error.reason_code, "reason": REASONS[error.reason_code][1],
          "detail": str(error.with_job(job.job_id)), "rows": None} for error in errors],
        schema=QUARANTINE_SCHEMA,
    )


def _convert(matched: MatchedJob):
    """The ConvertedJob of a raw window (files it set aside in `.rejected`), or the ValidatedJob
    quarantining it (RawInputError). OSError (storage) is not bad data: it propagates."""
    from transforms.ingest import RawInputError, convert_window

    job = matched.job
    started = time.perf_counter()
    try:
        if matched.converted is None:
            return convert_window(job.raw_format, job.trace_files, job.job_id, job.date)
        if isinstance(matched.converted, RawInputError):
            raise matched.converted
        return matched.converted
    except RawInputError as error:
        errors = [*error.rejected, error]
        stats = JobStats(job.job_id, job.date, "quarantined", seconds={"read": time.perf_counter() - started})
        # the window's reason is the most basic one: the file set aside explains the rank then missing
        cause = errors[0].with_job(job.job_id)
        problem = JobProblem(cause.reason_code, REASONS[cause.reason_code][1], str(cause), cause.path or _raw_path(job))
        return ValidatedJob(job, None, None, _raw_rows(job, errors), problem, stats)


def validate_job_window(matched: MatchedJob, validator: Validator) -> ValidatedJob:
    """Read and validate one job window's trace files (validate_job_windows of one)."""
    return validate_job_windows([matched], validator)[0]


def _validated(matched: MatchedJob, report: ValidationReport, read_seconds: float) -> ValidatedJob:
    job, manifest = matched.job, matched.manifest
    quarantine = quarantine_rows(job, report.problems, report.invalid)
    rows_read = report.valid.num_rows + report.invalid.num_rows + sum(p.rows for p in report.problems if p.level == "file")
    stats = JobStats(job.job_id, job.date, "analysed", rows_read=rows_read, rows_quarantined=rows_read - report.valid.num_rows,
                     seconds={"read": read_seconds, "validate": report.seconds + matched.seconds})
    problem = _job_problem(job, report)
    if problem is None and manifest is None:
        problem = JobProblem("missing_manifest", REASONS["missing_manifest"][1], f"job {job.job_id} on {job.date}: no usable manifest", window_path(job))
    if problem is not None and problem.reason_code == INCOMPLETE_WINDOW:
        quarantine = pa.concat_tables([quarantine, quarantine_rows(job, [Problem(
            INCOMPLETE_WINDOW, job.job_id, problem.source_path, problem.detail, report.valid.num_rows)])])
    trace = None if problem else report.valid
    return ValidatedJob(job, manifest, trace, quarantine, problem, stats)


_VALIDATORS = threading.local()


def worker_validator() -> Validator:
    """One Validator per worker thread, kept across DoFn instances: the DaskRunner calls
    setup() once per partition (= per job window here), and a GX context costs seconds."""
    validator = getattr(_VALIDATORS, "validator", None)
    if validator is None:
        validator = _VALIDATORS.validator = Validator()
    return validator
