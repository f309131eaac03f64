"""`strag land`: torch.profiler traces already on disk -> the lake's raw landing, as the collector writes them.

    strag land DIR --lake URL --job-id ID [--date YYYY-MM-DD]

DIR: a local folder of rank traces (`*.json`, `*.json.gz`: `export_chrome_trace` or
`tensorboard_trace_handler` output, one per rank) and an optional job.yaml. Each trace is
written to `{lake}/raw/kineto/date=D/job_id=ID/` under its own name, gzipped when it is plain
JSON, atomically and with retries (strag_collect.land_file); job.yaml is checked against
schemas/raw.py JOB_YAML_KEYS first. JSON files that are not torch.profiler traces (a run's
notes, truth.json) and hidden names are left out and listed. `strag batch` then analyses
the window, or `strag import` makes it a native lake job.

Exit 2 with one line on a usage error (no DIR, no traces in it, a bad job id or job.yaml,
`--live`: live Kineto sessions are not supported yet); exit 1 when storage fails.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import gzip
import pathlib
import sys

from pipelines.cli import date_argument
from pipelines.usage import ArgumentParser
from schemas.raw import JOB_YAML, raw_dir, raw_format_of

__all__ = ["LandOptions", "parse", "trace_files", "land", "run"]

# Kineto's export starts `{"schemaVersion": 1, "deviceProperties": [...], ...`: a few KB on a GPU
# node before the events, well inside this much of the decompressed head.
_SNIFF_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class LandOptions:
    folder: pathlib.Path
    lake: str
    job_id: str
    date: dt.date


def _is_kineto_trace(path: pathlib.Path) -> bool:
    """Whether the file's head looks like a torch.profiler Chrome trace (unreadable gzip: no)."""
    try:
        with (gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")) as handle:
            head = handle.read(_SNIFF_BYTES)
    except (OSError, EOFError):
        return False
    return b'"schemaVersion"' in head or b'"traceEvents"' in head


def trace_files(folder: pathlib.Path) -> tuple[list[pathlib.Path], pathlib.Path | None, list[str]]:
    """(rank traces, job.yaml or None, names left out with why) of a folder, one level deep.

    ValueError when the folder is missing or holds no torch.profiler trace."""
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder (give the folder holding the rank traces)")
    traces, job_yaml, left_out = [], None, []
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            continue
        if path.name == JOB_YAML:
            job_yaml = path
        elif raw_format_of(path.name) != "kineto":
            continue
        elif path.name.startswith((".", "_")):
            left_out.append(f"{path.name} (hidden name)")
        elif not _is_kineto_trace(path):
            left_out.append(f"{path.name} (not a torch.profiler trace)")
        else:
            traces.append(path)
    if not traces:
        raise ValueError(f"{folder}: no torch.profiler traces (*.json or *.json.gz, one per rank)"
                         + (f"; left out: {', '.join(left_out)}" if left_out else ""))
    return traces, job_yaml, left_out


def land(options: LandOptions) -> tuple[str, list[str], list[str]]:
    """Write the folder's traces (and job.yaml) into the raw window; returns (window URL, URLs written,
    names left out). ValueError / RawInputError on bad input, OSError when storage fails after retries."""
    from strag_collect import land_file
    from transforms.ingest.common import read_job_yaml
    from transforms.storage import RetryPolicy

    traces, job_yaml, left_out = trace_files(options.folder)
    if job_yaml is not None:
        read_job_yaml(job_yaml.read_bytes(), job_id=options.job_id, path=str(job_yaml))
    window = raw_dir(options.lake, "kineto", options.date.isoformat(), options.job_id)
    policy = RetryPolicy.from_env()
    written = []
    for path in ([job_yaml] if job_yaml else []) + traces:
        compress = path.name.lower().endswith(".json")
        url = f"{window}/{path.name}" + (".gz" if compress else "")
        try:
            land_file(str(path), url, compress=compress, retries=policy.attempts - 1, backoff=policy.backoff,
                      backoff_max=policy.backoff_max)
        except OSError as error:
            raise OSError(f"{url} not written after {policy.attempts} attempt(s) ({type(error).__name__}: {error})") from error
        written.append(url)
    return window, written, left_out


def parse(argv: list[str]) -> LandOptions:
    parser = ArgumentParser(
        prog="strag land",
        description="Copy torch.profiler traces already on disk (one per rank, and job.yaml) into the lake's raw "
                    "landing {lake}/raw/kineto/date=D/job_id=ID/, gzipped and atomically, as strag_collect writes them.")
    parser.add_argument("folder", metavar="DIR", type=pathlib.Path,
                        help="local folder of rank traces (*.json, *.json.gz) and an optional job.yaml")
    parser.add_argument("--lake", required=True, help="lake URL (folder, file://, s3://)")
    parser.add_argument("--job-id", required=True, help="job id in the lake")
    parser.add_argument("--date", type=date_argument, default=None, help="date partition YYYY-MM-DD (default: today, UTC)")
    parser.add_argument("--live", action="store_true", help="land as a live session for `strag watch` (not supported yet)")
    args = parser.parse_args(argv)
    if args.live:
        parser.error("--live: live Kineto sessions are not supported yet (strag watch reads strag's parquet sessions "
                     "only); land without --live, then run `strag batch` or `strag import`")
    from schemas.lake import safe_job_id

    try:
        safe_job_id(args.job_id)
    except ValueError as error:
        parser.error(f"--job-id: {error}")
    date = args.date or dt.datetime.now(dt.timezone.utc).date()
    return LandOptions(args.folder, args.lake, args.job_id, date)


def run(argv: list[str]) -> int:
    options = parse(argv)
    from transforms.ingest import RawInputError

    try:
        window, written, left_out = land(options)
    except (RawInputError, ValueError) as error:
        code = f" [{error.reason_code}]" if isinstance(error, RawInputError) else ""
        print(f"strag land: {error}{code}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"strag land: storage failed, the window is incomplete: {error}; "
              "fix the storage or credentials and run the same command again", file=sys.stderr)
        return 1
    traces = sum(not url.endswith("/" + JOB_YAML) for url in written)
    print(f"landed {traces} rank trace{'s' if traces != 1 else ''}"
          + (" and job.yaml" if traces != len(written) else "") + f" of job {options.job_id} on {options.date}\n"
          f"  window  {window}\n"
          f"  next    strag batch --lake {options.lake} --from {options.date} --to {options.date} --out TABLES"
          f"  (or strag import --format kineto {window} --lake {options.lake} --job-id {options.job_id} --date {options.date})")
    if left_out:
        print(f"  left out: {', '.join(left_out)}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
