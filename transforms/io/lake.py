"""Reading and writing the trace lake on any fsspec URL (local path, file://, memory://, s3://).

Layout (schemas/lake.py):

    {lake}/_lake.json                                         {"schema_version": "1", ...}
    {lake}/traces/date=YYYY-MM-DD/job_id={job_id}/*.parquet   op records (TRACE_SCHEMA)
    {lake}/manifests/date=YYYY-MM-DD/{job_id}.parquet         one row (MANIFEST_SCHEMA)

Every path returned here is the lake URL as given plus a relative part, so it can be
opened by any process with `fsspec.open` (credentials come only from the environment
or fsspec configuration). Writes are atomic: a local file is written under a hidden
temporary name and renamed; an object-store put (and memory://) is atomic by itself.
Readers skip names starting with "." or "_" (temporary files, markers). Listings and writes are
retried like reads (transforms/io/storage.py `retry`): a listing that fails for good raises StorageError,
never returns part of the lake.
Parquet files are written with page checksums and read with verification, so corrupt
bytes are reported as unreadable instead of being decoded into wrong values.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import io
import json
import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.expectations import TraceContractError
from schemas.lake import LAKE_MARKER, MANIFESTS, TRACES, iso_date, manifest_path, trace_dir
from schemas.raw import SOURCE_KEY
from transforms.io.storage import exists as _exists, find as _find, read_bytes, retry
from transforms.validation import conform_trace
from schemas.trace import MANIFEST_SCHEMA, SCHEMA_VERSION, TRACE_SCHEMA

__all__ = [
    "LAKE_PARTS",
    "is_local",
    "write_file_atomic",
    "check_lake",
    "LakeError",
    "LakeReadError",
    "LakeJob",
    "filesystem",
    "write_parquet",
    "read_parquet",
    "write_lake_marker",
    "read_lake_marker",
    "write_job",
    "list_jobs",
    "list_raw_jobs",
    "lake_dates",
    "StrayEntry",
    "find_job",
    "read_manifest",
    "read_manifest_table",
    "manifest_table",
    "read_trace_file",
    "read_trace_files",
    "read_manifests",
    "read_validated_job",
    "read_job_files",
]


class LakeError(RuntimeError):
    """The lake as a whole is unusable (wrong schema version, bad arguments)."""


class LakeReadError(LakeError):
    """A file of the lake cannot be read or does not satisfy the contract; names the file."""

    def __init__(self, message: str, path: str, reason: str):
        super().__init__(message)
        self.path = path
        self.reason = reason  # a code of schemas.expectations.REASONS


@dataclasses.dataclass(frozen=True)
class LakeJob:
    """One job's trace window for one date: what the batch pipeline processes as a unit."""

    lake: str
    date: str                      # YYYY-MM-DD
    job_id: str
    trace_files: tuple[str, ...]   # URLs, sorted (raw windows: the raw files, job.yaml included)
    manifest_path: str | None      # URL, or None when the job has no manifest for the date
    raw_format: str | None = None  # schemas.raw.RAW_FORMATS: raw uploads converted on the worker


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a lake URL or any file URL inside it."""
    return fsspec.core.url_to_fs(url)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol or isinstance(fs, LocalFileSystem)


def write_file_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a whole file so that readers see either nothing (or the old file) or the new one, durably.

    Local disk: a hidden temporary file beside it, flushed and fsynced, then renamed over
    (atomic on POSIX). Object stores (S3, multipart too) and memory://: one put, whole or nothing.
    Retried as a whole (transforms/io/storage.py), then StorageError.
    """
    parent = path.rsplit("/", 1)[0]

    def write() -> None:
        fs.makedirs(parent, exist_ok=True)
        if is_local(fs):
            temporary = f"{parent}/.{path.rsplit('/', 1)[-1]}.{uuid.uuid4().hex}.tmp"
            try:
                with fs.open(temporary, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                fs.mv(temporary, path)   # a rename: atomic on POSIX
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
        else:
            fs.pipe_file(path, data)

    retry("writing", path, write)


def _write_bytes(url: str, data: bytes) -> None:
    """Write `data` to the file URL `url` atomically (write_file_atomic)."""
    write_file_atomic(*filesystem(url), data)


def write_parquet(url: str, table: pa.Table) -> None:
    """Write one parquet file atomically, zstd-compressed, with page checksums."""
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd", write_page_checksum=True)
    _write_bytes(url, buffer.getvalue())


def read_parquet(url: str, dictionary: Sequence[str] = ()) -> pa.Table:
    """Read one parquet file as written (no casting), verifying the page checksums of what it
    decodes; the string columns named in `dictionary` are read dictionary-encoded (as parquet
    stores them) rather than decoded into one string per row. Columns whose footer statistics pin
    every value (`_footer_columns`: a trace file's job_id, optional columns no row fills) are made
    from the footer rather than decoded; the table is the same.

    Raises LakeReadError(reason "unreadable_file") naming the file when its bytes are truncated
    or corrupt (bad data); StorageError (transforms/io/storage.py) when storage does not deliver them
    after retries (infrastructure: never quarantined).
    """
    data = read_bytes(url)
    try:
        file = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True,
                              read_dictionary=list(dictionary) or None)
        made = _footer_columns(file)
        if not made:
            return file.read()
        schema = file.schema_arrow
        table = file.read(columns=[name for name in schema.names if name not in made])
        return pa.Table.from_arrays([made[field.name](table.num_rows) if field.name in made else table.column(field.name)
                                     for field in schema], schema=schema)
    except (OSError, pa.ArrowException, ValueError, EOFError) as error:
        raise LakeReadError(f"file {url}: cannot be read ({type(error).__name__}: {error})",
                            url, "unreadable_file") from None


_EXACT_STATISTICS = 64   # bytes: parquet writers may truncate longer string min / max statistics


def _footer_columns(file: pq.ParquetFile) -> dict[str, Callable[[int], pa.Array]]:
    """Top-level columns whose footer statistics pin every value: {name: rows -> the column}.

    Two kinds, each costing about as much to decode as a column of values (on
    benchmarks/bench_batch.py's fleet, decoding job_id was 40% of reading a file, and the six
    optional columns its trace files leave empty a fifth of the rest):
    - a string column with no nulls and min == max in every row group, short enough for its
      statistics to be exact (a trace file's job_id, one value repeated);
    - a nullable flat column (not a list or struct) whose null count is every row of every row
      group (optional columns the writer had nothing for). A nested column's leaf statistics
      count empty lists as nulls, so those are decoded.
    Any row group without statistics for a column rules it out."""
    metadata, schema = file.metadata, file.schema_arrow
    if metadata.num_row_groups == 0:
        return {}
    groups = [metadata.row_group(group) for group in range(metadata.num_row_groups)]
    out: dict[str, Callable[[int], pa.Array]] = {}
    leaf = 0     # the parquet column (leaf) of each top-level field: a struct spans several
    for field in schema:
        index, leaf = leaf, leaf + _leaves(field.type)
        flat = not pa.types.is_nested(field.type)
        if not flat or not (field.nullable or pa.types.is_string(field.type)):
            continue     # (statistics are read only for the columns they could pin: per call, not free)
        stats = [group.column(index).statistics for group in groups]
        if any(s is None or not s.has_null_count for s in stats):
            continue
        if field.nullable and all(s.null_count == group.num_rows for s, group in zip(stats, groups)):
            out[field.name] = functools.partial(pa.nulls, type=field.type)
        elif pa.types.is_string(field.type) and all(s.null_count == 0 and s.has_min_max and s.min == s.max for s in stats):
            values = {s.min for s in stats}
            if len(values) == 1:
                (value,) = values
                if isinstance(value, str) and len(value.encode()) < _EXACT_STATISTICS:
                    out[field.name] = functools.partial(pa.repeat, pa.scalar(value, field.type))
    return out


def _leaves(kind: pa.DataType) -> int:
    """Parquet columns (leaves) a field of this Arrow type is stored in."""
    if pa.types.is_struct(kind):
        return sum(_leaves(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_map(kind):
        return _leaves(kind.key_type) + _leaves(kind.item_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _leaves(kind.value_type)
    return 1


def write_lake_marker(lake: str) -> dict:
    """Create `{lake}/_lake.json` if absent; return its content. Fails on a different version."""
    existing = read_lake_marker(lake)
    if existing is not None:
        return existing
    content = {
        "schema_version": SCHEMA_VERSION,
        "traces": f"{TRACES}/date=YYYY-MM-DD/job_id=JOB/*.parquet",
        "manifests": f"{MANIFESTS}/date=YYYY-MM-DD/JOB.parquet",
    }
    _write_bytes(f"{lake.rstrip('/')}/{LAKE_MARKER}", json.dumps(content, indent=2).encode())
    return content


def read_lake_marker(lake: str) -> dict | None:
    """Content of `_lake.json`, or None for a lake without one (read as the current version).

    Raises LakeError when the lake declares a schema version this code does not read.
    """
    url = f"{lake.rstrip('/')}/{LAKE_MARKER}"
    fs, path = filesystem(url)
    try:
        text = retry("reading", url, lambda: fs.cat_file(path), absent=(FileNotFoundError,))
    except FileNotFoundError:
        return None
    try:
        content = json.loads(text)
    except ValueError as error:
        raise LakeError(f"lake {lake}: {LAKE_MARKER} is not readable JSON ({error})") from None
    version = str(content.get("schema_version"))
    if version != SCHEMA_VERSION:
        raise LakeError(f"lake {lake}: schema version {version}, this strag reads version {SCHEMA_VERSION}; "
                        f"use a matching strag or migrate the lake")
    return content


def manifest_table(manifest: Mapping[str, Any] | pa.Table) -> pa.Table:
    """A one-row MANIFEST_SCHEMA table from a dict (or a table with compatible columns)."""
    if isinstance(manifest, pa.Table):
        if manifest.num_rows != 1:
            raise ValueError(f"a manifest has exactly one row, got {manifest.num_rows}")
        return manifest.select(MANIFEST_SCHEMA.names).cast(MANIFEST_SCHEMA)
    missing = [name for name in MANIFEST_SCHEMA.names if name not in manifest]
    if missing:
        raise ValueError(f"manifest of job {manifest.get('job_id')!r} lacks field(s) {', '.join(missing)}")
    return pa.Table.from_pylist([{name: manifest[name] for name in MANIFEST_SCHEMA.names}], schema=MANIFEST_SCHEMA)


def write_job(lake: str, date: dt.date | str, job_id: str,
              traces: pa.Table | Sequence[pa.Table] | Mapping[str, pa.Table],
              manifest: Mapping[str, Any] | pa.Table, *,
              manifest_metadata: Mapping[str, str] | None = None) -> LakeJob:
    """Write one job's trace window for one date and its manifest; return the written job.

    traces: one table, a list (files part-00000.parquet, ...) or {file name: table};
    each is cast to TRACE_SCHEMA (job_id filled when absent). A file should hold whole
    workers. manifest: MANIFEST_SCHEMA row as dict or one-row table; its job_id and
    date must match. manifest_metadata: extra key/values kept in the manifest file's
    schema metadata (e.g. the published meta yaml of an imported job).
    Creates `_lake.json` on first write. Raises TraceContractError or ValueError on
    tables that break the contract, naming the job and file.
    """
    date = iso_date(date)
    write_lake_marker(lake)
    if isinstance(traces, pa.Table):
        named = {"part-00000.parquet": traces}
    elif isinstance(traces, Mapping):
        named = dict(traces)
    else:
        named = {f"part-{i:05d}.parquet": table for i, table in enumerate(traces)}
    table = manifest_table(manifest)
    row = table.to_pylist()[0]
    if row["job_id"] != job_id or row["date"].isoformat() != date:
        raise ValueError(f"manifest is for job {row['job_id']!r} on {row['date']}, "
                         f"but is being written for job {job_id!r} on {date}")
    folder = trace_dir(lake, date, job_id)
    paths = []
    for name, trace in named.items():
        if "/" in name or not name.endswith(".parquet") or name[0] in "._":
            raise ValueError(f"job {job_id}: trace file name {name!r} must be a plain 'name.parquet'")
        path = f"{folder}/{name}"
        write_parquet(path, conform_trace(trace, job_id=job_id, source_path=path, strict=True))
        paths.append(path)
    if manifest_metadata:
        metadata = dict(MANIFEST_SCHEMA.metadata)
        metadata.update({k.encode(): v.encode() for k, v in manifest_metadata.items()})
        table = table.replace_schema_metadata(metadata)
    write_parquet(manifest_path(lake, date, job_id), table)
    return LakeJob(lake, date, job_id, tuple(sorted(paths)), manifest_path(lake, date, job_id))


def _visible(name: str) -> bool:
    return not name.rsplit("/", 1)[-1].startswith((".", "_"))


@dataclasses.dataclass(frozen=True)
class StrayEntry:
    """Something under traces/, manifests/ or raw/ that the listing does not pick up, and why.

    date: its date partition, None when its partition name is not a date; reason: a code of
    schemas.expectations.REASONS (misplaced_file, bad_partition, unsafe_job_id)."""

    date: str | None
    path: str
    reason: str
    detail: str


def _partition_dates(lake: str, top: str, date_from: str | None, date_to: str | None,
                     strays: list | None = None) -> list[str]:
    url = f"{lake.rstrip('/')}/{top}"
    fs, root = filesystem(url)

    def listing():
        fs.invalidate_cache(root)  # object-store listings are cached per process; the lake changes under us
        return fs.ls(root, detail=False)

    try:
        entries = retry("listing", url, listing, absent=(FileNotFoundError,))
    except FileNotFoundError:
        return []
    dates = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        date = name.removeprefix("date=")
        try:
            if not name.startswith("date=") or dt.date.fromisoformat(date).isoformat() != date:
                raise ValueError(name)
        except ValueError:
            if strays is not None and _visible(name):
                strays.append(StrayEntry(None, f"{lake.rstrip('/')}/{top}/{name}", "bad_partition",
                                         f"{top}/{name}: not a date=YYYY-MM-DD partition; its files are not read"))
            continue
        if (date_from is None or date >= date_from) and (date_to is None or date <= date_to):
            dates.append(date)
    return sorted(dates)


def _relative_listing(url: str) -> list[str]:
    """Recursive listing of `url` as paths relative to it ('' when absent)."""
    fs, root = filesystem(url)

    def listing():
        fs.invalidate_cache(root)
        return _find(fs, root)

    try:
        found = retry("listing", url, listing, absent=(FileNotFoundError,))
    except FileNotFoundError:
        return []
    root = root.rstrip("/")
    return sorted(path[len(root) + 1:] for path in found if path.startswith(root + "/"))


def list_jobs(lake: str, date_from: dt.date | str | None = None,
              date_to: dt.date | str | None = None, *, strays: list | None = None) -> list[LakeJob]:
    """Every (date, job) of the lake with dates in [date_from, date_to] (inclusive; None = open).

    A job appears when it has trace files or a manifest for the date; trace_files is
    empty or manifest_path is None for the incomplete ones (the validator reports them).
    strays: a list to which every entry not picked up is appended as a StrayEntry (a file in
    the wrong place, a partition name that is not a date, a job id outside the alphabet of
    schemas.lake.safe_job_id); names starting with '.' or '_' (in-flight writes, markers)
    are not strays. Raises LakeError when `_lake.json` declares another schema version.
    """
    lake = lake.rstrip("/")
    read_lake_marker(lake)
    low = iso_date(date_from) if date_from is not None else None
    high = iso_date(date_to) if date_to is not None else None
    found: list = [] if strays is None else strays
    jobs: dict[tuple[str, str], dict] = {}
    for date in _partition_dates(lake, TRACES, low, high, found):
        base = f"{lake}/{TRACES}/date={date}"
        for relative in _relative_listing(base):
            parts = relative.split("/")
            if not all(_visible(part) for part in parts):
                continue
            if len(parts) != 2 or not parts[0].startswith("job_id=") or not parts[1].endswith(".parquet"):
                found.append(StrayEntry(date, f"{base}/{relative}", "misplaced_file",
                                        f"traces/date={date}/{relative}: expected traces/date=D/job_id=J/NAME.parquet"))
                continue
            job_id = parts[0].removeprefix("job_id=")
            if _unsafe(job_id, date, f"{base}/{relative}", found):
                continue
            jobs.setdefault((date, job_id), {"traces": [], "manifest": None})["traces"].append(f"{base}/{relative}")
    for date in _partition_dates(lake, MANIFESTS, low, high, found):
        base = f"{lake}/{MANIFESTS}/date={date}"
        for relative in _relative_listing(base):
            if not all(_visible(part) for part in relative.split("/")):
                continue
            if "/" in relative or not relative.endswith(".parquet"):
                found.append(StrayEntry(date, f"{base}/{relative}", "misplaced_file",
                                        f"manifests/date={date}/{relative}: expected manifests/date=D/JOB.parquet"))
                continue
            job_id = relative.removesuffix(".parquet")
            if _unsafe(job_id, date, f"{base}/{relative}", found):
                continue
            jobs.setdefault((date, job_id), {"traces": [], "manifest": None})["manifest"] = f"{base}/{relative}"
    native = [LakeJob(lake, date, job_id, tuple(sorted(entry["traces"])), entry["manifest"])
              for (date, job_id), entry in sorted(jobs.items())]
    raw = [job for job in list_raw_jobs(lake, low, high, strays=found) if (job.date, job.job_id) not in jobs]
    return sorted(native + raw, key=lambda job: (job.date, job.job_id))


def _unsafe(job_id: str, date: str, path: str, strays: list) -> bool:
    """Whether `job_id` breaks schemas.lake.safe_job_id (then recorded as a stray)."""
    from schemas.lake import safe_job_id

    try:
        safe_job_id(job_id)
    except ValueError as error:
        strays.append(StrayEntry(date, path, "unsafe_job_id", f"{path}: {error}"))
        return True
    return False


def list_raw_jobs(lake: str, date_from: str | None = None, date_to: str | None = None, *,
                  strays: list | None = None) -> list[LakeJob]:
    """Raw job windows `{lake}/raw/{format}/date=D/job_id=J/*` (schemas/raw.py) with dates in the range.

    A window's trace_files are its raw files of that format plus job.yaml. list_jobs leaves
    out a raw window whose job also has native traces or a manifest that date (an imported
    copy): the native one is analysed.
    """
    from schemas.raw import JOB_YAML, RAW, RAW_FORMATS, raw_format_of

    found: list = [] if strays is None else strays
    out = []
    for fmt in RAW_FORMATS:
        top = f"{RAW}/{fmt}"
        for date in _partition_dates(lake, top, date_from, date_to, found):
            base = f"{lake}/{top}/date={date}"
            windows: dict[str, list[str]] = {}
            for relative in _relative_listing(base):
                parts = relative.split("/")
                if not all(_visible(part) for part in parts):
                    continue
                if len(parts) != 2 or not parts[0].startswith("job_id=") or (
                        parts[1] != JOB_YAML and raw_format_of(parts[1]) != fmt):
                    found.append(StrayEntry(date, f"{base}/{relative}", "misplaced_file",
                                            f"{top}/date={date}/{relative}: expected {top}/date=D/job_id=J/ with "
                                            + ("*.json[.gz] rank traces" if fmt == "kineto" else "*.jsonl[.gz] records")
                                            + " and job.yaml"))
                    continue
                if _unsafe(parts[0].removeprefix("job_id="), date, f"{base}/{relative}", found):
                    continue
                windows.setdefault(parts[0].removeprefix("job_id="), []).append(f"{base}/{relative}")
            out += [LakeJob(lake, date, job_id, tuple(sorted(files)), None, fmt) for job_id, files in sorted(windows.items())]
    return out


def lake_dates(lake: str) -> list[str]:
    """The dates (YYYY-MM-DD, sorted) of the lake's date partitions: traces, manifests and raw of
    any format. What a date range without job windows is told it missed."""
    from schemas.raw import RAW, RAW_FORMATS

    tops = (TRACES, MANIFESTS, *(f"{RAW}/{fmt}" for fmt in RAW_FORMATS))
    return sorted({date for top in tops for date in _partition_dates(lake.rstrip("/"), top, None, None)})


# What a folder holds when it is a lake: trace or raw partitions, manifests or the marker file.
LAKE_PARTS = ("traces", "manifests", "raw", "_lake.json")


def check_lake(lake: str, parts: tuple[str, ...] = LAKE_PARTS) -> None:
    """Raise LakeError unless the URL `lake` opens and holds one of `parts` (a mistyped --lake
    must be named as such, not read as a lake with no jobs). parts=(): the folder need only exist."""
    try:
        fs, root = fsspec.core.url_to_fs(lake)
        exists = retry("listing", lake, lambda: _exists(fs, root) and (
            not parts or any(_exists(fs, f"{root}/{part}") for part in parts)))
    except (OSError, ValueError, ImportError) as error:
        raise LakeError(f"--lake {lake}: cannot be opened ({type(error).__name__}: {error})") from None
    if not exists:
        what = f"no lake there (expected {', '.join(p if '.' in p else p + '/' for p in parts)})" if parts else "no folder there"
        raise LakeError(f"--lake {lake}: {what}; check the URL" + (" (memory:// is per process)" if lake.startswith("memory://") else ""))


def find_job(lake: str, job_id: str, date: dt.date | str | None = None) -> LakeJob:
    """The lake job `job_id` (on `date`, or its only date). Raises LakeError if absent or ambiguous."""
    found = [job for job in list_jobs(lake, date, date) if job.job_id == job_id]
    if not found:
        check_lake(lake)   # a mistyped --lake is named as such, not as a missing job
        raise LakeError(f"lake {lake}: no job {job_id!r}" + (f" on {iso_date(date)}" if date else ""))
    if len(found) > 1:
        raise LakeError(f"lake {lake}: job {job_id!r} has trace windows on {[j.date for j in found]}; pass a date")
    return found[0]


def read_manifest_table(path: str) -> pa.Table:
    """The manifest file as a one-row MANIFEST_SCHEMA table, file metadata kept."""
    table = read_parquet(path)
    try:
        cast = table.select(MANIFEST_SCHEMA.names).cast(MANIFEST_SCHEMA)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
        raise LakeReadError(f"manifest {path}: does not match MANIFEST_SCHEMA ({error})", path,
                            "invalid_manifest") from None
    if cast.num_rows != 1:
        raise LakeReadError(f"manifest {path}: holds {cast.num_rows} rows, expected 1", path, "invalid_manifest")
    return cast.replace_schema_metadata(table.schema.metadata)


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest row as a dict of MANIFEST_SCHEMA fields (date: datetime.date, times: datetime UTC)."""
    return read_manifest_table(path).to_pylist()[0]


def read_trace_file(path: str, *, strict: bool = True) -> pa.Table:
    """One trace file cast to TRACE_SCHEMA (job_id filled from the partition when absent).

    Raises LakeReadError naming the file, with `reason` unreadable_file, missing_column,
    wrong_type or unknown_optype (strict=False keeps unknown optypes for validation).
    """
    from schemas.lake import parse_partition

    raw = read_parquet(path)
    try:
        return conform_trace(raw, job_id=parse_partition(path).get("job_id"), source_path=path, strict=strict)
    except TraceContractError as error:
        raise LakeReadError(str(error), path, error.reason) from None


def read_trace_files(paths: Iterable[str]) -> pa.Table:
    """Several trace files as one TRACE_SCHEMA table (file order kept). Errors name the file."""
    tables = [read_trace_file(path) for path in paths]
    return pa.concat_tables(tables) if tables else TRACE_SCHEMA.empty_table()


def read_manifests(paths: Iterable[str], validator) -> dict[str, tuple[dict | None, list]]:
    """Read and validate many manifests with one GX run: path -> (manifest or None, problems).

    The manifest is None when it is unreadable or invalid (its problems say why).
    validator: a transforms.validation.Validator. GX costs ~0.2 s per run whatever the
    row count, so the batch pipeline validates all manifests of a run together.
    """
    from schemas.expectations import INVALID_MANIFEST, Problem

    out: dict[str, tuple[dict | None, list]] = {}
    readable = []
    for path in paths:
        job_id = path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".parquet")
        try:
            table = read_manifest_table(path)
            manifest = table.to_pylist()[0]
            stored = (table.schema.metadata or {}).get(SOURCE_KEY.encode())
            if stored:   # an imported raw job: where its rows came from (not a manifest column)
                manifest["source"] = json.loads(stored)
            readable.append((path, manifest))
        except LakeReadError as error:
            if error.reason == "invalid_manifest":
                out[path] = (None, [Problem(INVALID_MANIFEST, job_id, path, f"job {job_id}, {error}")])
            else:
                out[path] = (None, validator.unreadable(path, error, job_id, manifest=True).problems)
    for (path, manifest), problems in zip(readable, validator.validate_manifests(readable)):
        out[path] = (None if problems else manifest, problems)
    return out


def read_validated_job(job: LakeJob, validator, manifests: Mapping[str, tuple[dict | None, list]] | None = None):
    """Read and validate one lake job: the batch pipeline's per-job call.

    validator: a transforms.validation.Validator (built once per worker). manifests:
    output of `read_manifests` covering this job's manifest (read here when None).
    Unreadable files and manifests become problems of the returned
    schemas.expectations.ValidationReport, never exceptions: `valid` holds the rows that
    passed (TRACE_SCHEMA), `invalid` the rejected rows, `problems` every file-, job- and
    row-level rejection with its reason code.
    """
    manifest, issues = None, []
    if job.manifest_path is not None:
        if manifests is None or job.manifest_path not in manifests:
            manifests = read_manifests([job.manifest_path], validator)
        manifest, issues = manifests[job.manifest_path]
    return validator.validate_job(job.job_id, manifest, read_job_files(job), manifest_path=job.manifest_path,
                                  manifest_issues=issues)


# A trace's string columns of a few values repeated (a host per rank): decoding them into a string
# per row was a quarter of reading a trace file (benchmarks/bench_batch.py's fleet); conform_trace
# makes them strings again, from the dictionary, for less than half of that.
_DICTIONARY_COLUMNS = ("host",)


def read_job_files(job: LakeJob) -> list[tuple[str, pa.Table | BaseException]]:
    """(path, table as written) per trace file of a job window, or (path, LakeReadError) for
    a file that cannot be read (validation turns that into a quarantine row)."""
    files: list[tuple[str, pa.Table | BaseException]] = []
    for path in job.trace_files:
        try:
            files.append((path, read_parquet(path, _DICTIONARY_COLUMNS)))
        except LakeReadError as error:
            files.append((path, error))
    return files
