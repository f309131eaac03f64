"""`strag import`: one job's raw profiler output -> a native lake job.

    strag import --format kineto|ndtimeline PATH... --lake URL --job-id ID [--date YYYY-MM-DD]
                 [--job-yaml FILE] [--workers N]

PATH: files or folders (a folder contributes its *.json, *.json.gz, *.jsonl, *.jsonl.gz and
job.yaml); local paths or fsspec URLs. The converter (transforms/ingest/) validates the
raw input; the job is written as TRACE_SCHEMA parquet + manifest, with the converter's
source record (format, profiler version, ranks, clock offsets, unmapped events) kept in
the manifest file's metadata. Exit code 2 with the reason on bad input.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import sys

from pipelines.cli import date_argument
from pipelines.usage import ArgumentParser
from schemas.raw import JOB_YAML, RAW_FORMATS, raw_format_of

__all__ = ["ImportOptions", "parse", "raw_files", "import_raw", "run"]


@dataclasses.dataclass(frozen=True)
class ImportOptions:
    fmt: str
    paths: tuple[str, ...]
    lake: str
    job_id: str
    date: dt.date
    job_yaml: str | None = None
    workers: int = 1


def raw_files(paths: tuple[str, ...] | list[str], fmt: str) -> list[str]:
    """The raw files of `fmt` (and job.yaml) named by PATHs: files as given, folders listed one level deep.

    ValueError when nothing of the format is found."""
    import fsspec

    found = []
    for path in paths:
        fs, inner = fsspec.core.url_to_fs(path)
        if not fs.exists(inner):
            raise ValueError(f"{path}: no such file or folder")
        protocol = path.split("://", 1)[0] + "://" if "://" in path else ""
        if fs.isdir(inner):
            for entry in sorted(fs.ls(inner, detail=False)):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if name == JOB_YAML or raw_format_of(name) == fmt:
                    found.append(protocol + entry if protocol and not entry.startswith(protocol) else entry)
        else:
            found.append(path)
    if not any(raw_format_of(p.rsplit("/", 1)[-1]) == fmt for p in found):
        raise ValueError(f"no {fmt} trace files in {', '.join(paths)} (expected "
                         + ("*.json or *.json.gz, one per rank" if fmt == "kineto" else "*.jsonl or *.jsonl.gz") + ")")
    return found


def _options(job_yaml: str | None) -> dict:
    if job_yaml is None:
        return {}
    from transforms.ingest import read_raw_file
    from transforms.ingest.common import read_job_yaml

    return read_job_yaml(read_raw_file(job_yaml), path=job_yaml)


def import_raw(options: ImportOptions):
    """Convert and write the job; returns (LakeJob, ConvertedJob). Raises RawInputError / ValueError."""
    from transforms.ingest import SOURCE_KEY, convert_window
    from transforms.io.lake import write_job

    files = raw_files(options.paths, options.fmt)
    converted = convert_window(options.fmt, files, options.job_id, options.date.isoformat(),
                               job_yaml=_options(options.job_yaml), workers=options.workers)
    job = write_job(options.lake, options.date, options.job_id, converted.trace, converted.manifest,
                    manifest_metadata={SOURCE_KEY: converted.source_json()})
    return job, converted


def parse(argv: list[str]) -> ImportOptions:
    parser = ArgumentParser(
        prog="strag import",
        description="Convert one job's raw profiler output (torch.profiler traces, one per rank, or NDTimeline "
                    "records) into a lake job.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="raw files or folders (local or fsspec URLs)")
    parser.add_argument("--format", dest="fmt", required=True, choices=RAW_FORMATS, help="raw format")
    parser.add_argument("--lake", required=True, help="lake URL (folder, file://, memory://, s3://)")
    parser.add_argument("--job-id", required=True, help="job id in the lake")
    parser.add_argument("--date", type=date_argument, default=None, help="date partition YYYY-MM-DD (default: today, UTC)")
    parser.add_argument("--job-yaml", default=None,
                        help="job.yaml with what the traces cannot say (sizes, layout, labels; schemas/raw.py)")
    parser.add_argument("--workers", type=int, default=1, help="processes parsing rank files (default 1)")
    args = parser.parse_args(argv)
    from schemas.lake import safe_job_id

    try:
        safe_job_id(args.job_id)
    except ValueError as error:
        parser.error(f"--job-id: {error}")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    date = args.date or dt.datetime.now(dt.timezone.utc).date()
    return ImportOptions(args.fmt, tuple(args.paths), args.lake, args.job_id, date, args.job_yaml, args.workers)


def run(argv: list[str]) -> int:
    options = parse(argv)
    from transforms.ingest import RawInputError, describe_source
    from transforms.io.lake import LakeError

    try:
        job, converted = import_raw(options)
    except (RawInputError, LakeError, ValueError) as error:
        lines = error.lines() if isinstance(error, RawInputError) else [str(error)]   # the cause first
        print(f"strag import: {lines[0]}", *lines[1:], sep="\n", file=sys.stderr)
        return 2
    manifest = converted.manifest
    print(f"imported job {job.job_id} on {job.date}: {converted.trace.num_rows:,} ops, dp {manifest['dp_size']} x "
          f"pp {manifest['pp_size']} workers, steps {converted.source.get('steps')}\n"
          f"  source   {describe_source(converted.source)}\n"
          f"  traces   {', '.join(job.trace_files)}\n  manifest {job.manifest_path}")
    unmapped = converted.source.get("unmapped") or {}
    if unmapped:
        print("  not mapped to an op type (counted, not analysed): "
              + ", ".join(f"{name} x{count}" for name, count in sorted(unmapped.items(), key=lambda kv: -kv[1])[:8]))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
