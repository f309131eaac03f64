"""`strag export`: a lake job -> raw profiler output, the inverse of the raw landing contract.

    strag export --format ndtimeline --lake URL --job-id ID [--date D] --out URL

writes `{out}/ndtimeline-{job_id}.jsonl.gz` (veScale NDTimeline records, one per step, worker,
metric and model chunk) and `{out}/job.yaml` (the sizes a record cannot carry); see
transforms/ingest/ndtimeline.py. With `--out {lake}/raw/ndtimeline/date=D/job_id=J` the export is
a landed raw job. The trial name and run id come from the job's import (published meta yaml or
raw source record), else the job id and 0.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys

import numpy as np

from pipelines.cli import date_argument
from pipelines.usage import ArgumentParser

__all__ = ["EXPORT_FORMATS", "ExportOptions", "ExportSummary", "export_job", "parse", "run"]

EXPORT_FORMATS = ("ndtimeline",)


@dataclasses.dataclass
class ExportOptions:
    format: str
    lake: str
    job_id: str
    out: str
    date: dt.date | None = None

    def __post_init__(self):
        if self.format not in EXPORT_FORMATS:
            raise ValueError(f"--format {self.format!r}: expected one of {', '.join(EXPORT_FORMATS)}")


@dataclasses.dataclass
class ExportSummary:
    job_id: str
    date: str
    paths: list[str]
    ops: int
    workers: int
    steps: int


def _run_identity(metadata: dict[bytes, bytes] | None, job_id: str) -> tuple[str, object]:
    """(trial, run_id) recorded when the job was imported, else (job id, 0)."""
    from pipelines.reference import REFERENCE_META_KEY
    from transforms.ingest import SOURCE_KEY

    metadata = metadata or {}
    if REFERENCE_META_KEY.encode() in metadata:
        meta = json.loads(metadata[REFERENCE_META_KEY.encode()])
        return str(meta.get("trial_name", job_id)), meta.get("run_id", 0)
    if SOURCE_KEY.encode() in metadata:
        source = json.loads(metadata[SOURCE_KEY.encode()])
        if source.get("trial") is not None:
            return str(source["trial"]), source.get("run_id", 0) if source.get("run_id") is not None else 0
    return job_id, 0


def export_job(options: ExportOptions) -> ExportSummary:
    """Write lake job `options.job_id` in `options.format` under `options.out`.

    Raises LakeError when the job is absent, ambiguous or has no manifest (its sizes are
    unknown), LakeReadError naming a file that breaks the contract.
    """
    from transforms.ingest.ndtimeline import write_ndtimeline
    from transforms.io.lake import LakeError, find_job, read_manifest_table, read_trace_files

    job = find_job(options.lake, options.job_id, options.date)
    if job.manifest_path is None:
        raise LakeError(f"job {job.job_id} on {job.date}: no manifest, so its parallelism is unknown; "
                        f"write manifests/date={job.date}/{job.job_id}.parquet")
    if not job.trace_files:
        raise LakeError(f"job {job.job_id} on {job.date}: no trace files under traces/date={job.date}/job_id={job.job_id}")
    manifest_table = read_manifest_table(job.manifest_path)
    manifest = manifest_table.to_pylist()[0]
    trial, run_id = _run_identity(manifest_table.schema.metadata, job.job_id)
    trace = read_trace_files(job.trace_files)
    paths = write_ndtimeline(trace, manifest, options.out, job.job_id, trial=trial, run_id=run_id)
    return ExportSummary(job.job_id, job.date, paths, trace.num_rows, int(manifest["dp_size"]) * int(manifest["pp_size"]),
                         len(np.unique(trace.column("step").to_numpy())))


def parse(argv: list[str]) -> ExportOptions:
    parser = ArgumentParser(
        prog="strag export",
        description="Export a lake job as raw profiler output (NDTimeline JSON-lines records + job.yaml). "
                    "--out {lake}/raw/ndtimeline/date=D/job_id=J lands it for `strag import`.")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="raw format to write")
    parser.add_argument("--lake", required=True, help="lake URL (path, file://, memory://, s3://)")
    parser.add_argument("--job-id", required=True, help="the lake job to export")
    parser.add_argument("--date", type=date_argument, default=None, help="date partition YYYY-MM-DD (needed when the job has several)")
    parser.add_argument("--out", required=True, help="output folder (path or fsspec URL)")
    args = parser.parse_args(argv)
    return ExportOptions(args.format, args.lake, args.job_id, args.out, args.date)


def run(argv: list[str]) -> int:
    """`strag export`: returns the exit code (2 on bad input, with the reason on stderr)."""
    from transforms.io.lake import LakeError

    options = parse(argv)
    try:
        summary = export_job(options)
    except (LakeError, ValueError) as error:
        print(f"strag export: {error}", file=sys.stderr)
        return 2
    records, job_yaml = summary.paths
    print(f"exported job {summary.job_id} on {summary.date} as {options.format}: {summary.ops:,} ops of "
          f"{summary.workers} workers x {summary.steps} steps\n  records  {records}\n  job.yaml {job_yaml}")
    return 0
