"""`strag import-reference` and `strag export-reference`: the published trace format <-> the lake.

The published format (ByteDance-Seed/StragglerAnalysis, ../shared/reference/straggler-analysis/)
is one parquet per job, columns dp_rank int8, stage int8, rank int16, step int64,
optype dictionary<int8, string>, start_ts float32, duration float32 (seconds; start_ts is
an offset from the step's first op), seq_id int32, mc int8, mb_id int8, gmc int16, plus a
meta yaml (trial_name, run_id, dp_size, dsp_size, pp_size, tp_size, vpp_size, world_size).

Import is lossless: lake columns are wider (int16/int32/float64 hold int8/int16/float32
exactly), rows keep their order, and the whole yaml is kept in the manifest file's
metadata (key `strag.reference_meta`). Manifest fields the published format lacks get
these documented defaults:

    date          --date, else today (UTC)
    submit_time,  start_time = date 00:00 UTC (the published traces carry no wall clock)
    end_time      start_time + sum over steps of the step's span (max end - min start)
    gpus          world_size
    microbatches  max(mb_id) + 1
    model_family  "unknown";  context_length 0 (unknown)
    workers       from the trace: (dp_rank, stage, rank), host "unknown:{job_id}:rank{rank}"
                  (job-qualified so that unknown hosts never look shared across jobs)

Export writes any lake job (imported or generated) back as trace-{trial}.parquet +
meta-{trial}.yaml: the published dtypes (an integer column is widened to the next
width only when its values do not fit, and a note says so), the optype dictionary in
the published order (sorted names of the optypes present, then "first-op", which the
authors' analyzer adds), start_ts as offsets from each step's first op (exact for
imported jobs, whose offsets already start at 0), and the yaml with exactly the
analyzer's JobMeta fields (trial_name = the imported trial, else the job id).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from pipelines.cli import date_argument
from pipelines.usage import ArgumentParser
from schemas.trace import PUBLISHED_COLUMNS
from transforms.io.lake import LakeJob, filesystem, find_job, read_manifest_table, read_trace_files, write_job

__all__ = [
    "META_FIELDS",
    "REFERENCE_META_KEY",
    "ReferenceFormatError",
    "ImportOptions",
    "ExportOptions",
    "import_reference",
    "export_reference",
    "lake_trace_from_published",
    "published_trace_from_lake",
    "manifest_from_published",
    "parse_import",
    "parse_export",
    "run_import_reference",
    "run_export_reference",
]

# The analyzer builds JobMeta(**yaml): exactly these keys, in the published order.
META_FIELDS = ("trial_name", "run_id", "dp_size", "dsp_size", "pp_size", "tp_size", "vpp_size", "world_size")
SIZE_FIELDS = ("dp_size", "dsp_size", "pp_size", "tp_size", "vpp_size", "world_size")
REFERENCE_META_KEY = "strag.reference_meta"
# The authors' analyzer appends this category to optype; published files carry it unused.
FIRST_OP = "first-op"


class ReferenceFormatError(ValueError):
    """A published trace or meta file (or a lake job to export) breaks the format; names the file."""


# ---------------------------------------------------------------------------
# Import


def _read_meta(path: str) -> dict[str, Any]:
    from transforms.io.meta_yaml import MetaYamlError, read_meta_yaml

    fs, inner = filesystem(path)
    try:
        with fs.open(inner, "rb") as handle:
            meta = read_meta_yaml(handle.read())
    except OSError as error:
        raise ReferenceFormatError(f"meta file {path}: cannot be read ({error})") from None
    except MetaYamlError as error:
        raise ReferenceFormatError(f"meta file {path}: {error}") from None
    missing = [k for k in SIZE_FIELDS if k not in meta]
    if missing:
        raise ReferenceFormatError(f"meta file {path}: missing field(s) {', '.join(missing)}")
    bad = [k for k in SIZE_FIELDS if not isinstance(meta[k], int) or meta[k] < 1]
    if bad:
        raise ReferenceFormatError(f"meta file {path}: {', '.join(bad)} must be positive integers")
    product = meta["dp_size"] * meta["pp_size"] * meta["tp_size"] * meta["dsp_size"]
    if product != meta["world_size"]:
        raise ReferenceFormatError(f"meta file {path}: world_size {meta['world_size']} != dp*pp*tp*dsp = {product}")
    return meta


def lake_trace_from_published(table: pa.Table, job_id: str, source: str = "<table>") -> pa.Table:
    """Published trace columns -> TRACE_SCHEMA table (lossless widening; optype in OPTYPES order)."""
    from schemas.expectations import TraceContractError
    from transforms.validation import conform_trace

    missing = [c for c in PUBLISHED_COLUMNS if c not in table.column_names]
    if missing:
        raise ReferenceFormatError(f"trace {source}: missing column(s) {', '.join(missing)}")
    try:
        return conform_trace(table.select(list(PUBLISHED_COLUMNS)), job_id=job_id, source_path=source)
    except TraceContractError as error:
        raise ReferenceFormatError(f"trace {source}: {error}") from None


def manifest_from_published(trace: pa.Table, meta: dict[str, Any], job_id: str, date: dt.date) -> dict[str, Any]:
    """Manifest row for an imported trace; fields the format lacks get the documented defaults."""
    workers = (trace.group_by(["dp_rank", "stage"]).aggregate([("rank", "min"), ("rank", "max")])
               .sort_by([("dp_rank", "ascending"), ("stage", "ascending")]).to_pylist())
    split = [w for w in workers if w["rank_min"] != w["rank_max"]]
    if split:
        raise ReferenceFormatError(f"job {job_id}: worker (dp {split[0]['dp_rank']}, stage {split[0]['stage']}) "
                                   f"has ranks {split[0]['rank_min']}..{split[0]['rank_max']}; expected one")
    cells = {(w["dp_rank"], w["stage"]) for w in workers}
    expected = {(d, s) for d in range(meta["dp_size"]) for s in range(meta["pp_size"])}
    if cells != expected:
        raise ReferenceFormatError(f"job {job_id}: trace workers do not match dp {meta['dp_size']} x pp "
                                   f"{meta['pp_size']}: missing {sorted(expected - cells)[:5]}, "
                                   f"unexpected {sorted(cells - expected)[:5]}")
    from transforms.ingest.common import build_manifest

    return build_manifest(job_id, date, trace, dp_size=meta["dp_size"], pp_size=meta["pp_size"], tp_size=meta["tp_size"],
                          cp_size=meta["dsp_size"], vpp_size=meta["vpp_size"], world_size=meta["world_size"],
                          worker_rank={(w["dp_rank"], w["stage"]): w["rank_min"] for w in workers})


@dataclasses.dataclass
class ImportOptions:
    trace: str
    meta: str
    lake: str
    job_id: str
    date: dt.date

    def __post_init__(self):
        from schemas.lake import safe_job_id

        safe_job_id(self.job_id)   # it names a lake folder and file


def import_reference(options: ImportOptions) -> LakeJob:
    """Write a published trace + meta yaml into the lake as job `options.job_id`."""
    fs, inner = filesystem(options.trace)
    try:
        with fs.open(inner, "rb") as handle:
            published = pq.read_table(handle)
    except (OSError, pa.ArrowException) as error:
        raise ReferenceFormatError(f"trace {options.trace}: cannot be read as parquet ({error})") from None
    meta = _read_meta(options.meta)
    trace = lake_trace_from_published(published, options.job_id, options.trace)
    manifest = manifest_from_published(trace, meta, options.job_id, options.date)
    return write_job(options.lake, options.date, options.job_id, trace, manifest,
                     manifest_metadata={REFERENCE_META_KEY: json.dumps(meta)})


# ---------------------------------------------------------------------------
# Export


def _fitting_int(values: pa.ChunkedArray, preferred: pa.DataType) -> pa.DataType:
    """`preferred`, or the next wider signed integer type when the values do not fit it."""
    low, high = (v.as_py() for v in pc.min_max(values).values())
    for candidate in (pa.int8(), pa.int16(), pa.int32(), pa.int64()):
        if candidate.bit_width < preferred.bit_width:
            continue
        info = np.iinfo(candidate.to_pandas_dtype())
        if low is None or (info.min <= low and high <= info.max):
            return candidate
    return pa.int64()


def published_trace_from_lake(trace: pa.Table) -> tuple[pa.Table, list[str]]:
    """TRACE_SCHEMA table -> published columns and dtypes; returns (table, notes on widened columns)."""
    notes = []
    columns = {}
    step = trace["step"]
    for name, dtype in PUBLISHED_COLUMNS.items():
        column = trace[name]
        if name == "optype":
            names = pc.cast(column, pa.string())
            present = sorted(set(pc.unique(names).to_pylist()) - {None})
            dictionary = present + ([FIRST_OP] if FIRST_OP not in present else [])
            codes = pc.cast(pc.index_in(names, value_set=pa.array(dictionary)), pa.int8())
            columns[name] = pa.chunked_array([pa.DictionaryArray.from_arrays(
                codes.combine_chunks(), pa.array(dictionary, pa.string()))])
        elif name == "start_ts":
            # offsets from each step's first op, like the published traces (float32 keeps
            # ~7 digits: absolute epoch seconds would lose the sub-second timing)
            first = pa.table({"step": step, "start_ts": column}).group_by("step").aggregate([("start_ts", "min")])
            order = pc.index_in(step, value_set=first["step"])
            offsets = pc.subtract(column, pc.take(first["start_ts_min"], order))
            columns[name] = pc.cast(offsets, pa.float32())
        elif pa.types.is_floating(dtype):
            columns[name] = pc.cast(column, dtype)
        else:
            fitting = _fitting_int(column, dtype)
            if fitting != dtype:
                notes.append(f"column {name} widened from {dtype} to {fitting}: its values do not fit {dtype}")
            columns[name] = pc.cast(column, fitting)
    return pa.table(columns), notes


@dataclasses.dataclass
class ExportOptions:
    lake: str
    job_id: str
    out: str
    date: dt.date | None = None


def export_reference(options: ExportOptions) -> tuple[str, str, list[str]]:
    """Write lake job `options.job_id` as trace-{trial}.parquet + meta-{trial}.yaml under `options.out`.

    Returns (trace path, meta path, notes). Raises LakeError when the job is absent or
    ambiguous, LakeReadError naming a file that breaks the contract.
    """
    job = find_job(options.lake, options.job_id, options.date)
    if job.manifest_path is None:
        raise ReferenceFormatError(f"job {job.job_id} on {job.date}: no manifest, so its parallelism "
                                   f"(meta yaml) is unknown; write manifests/date={job.date}/{job.job_id}.parquet")
    manifest_table = read_manifest_table(job.manifest_path)
    manifest = manifest_table.to_pylist()[0]
    stored = (manifest_table.schema.metadata or {}).get(REFERENCE_META_KEY.encode())
    meta = json.loads(stored) if stored else {"trial_name": job.job_id, "run_id": 0}
    meta = {"trial_name": meta.get("trial_name", job.job_id), "run_id": meta.get("run_id", 0),
            **{k: int(manifest[k]) for k in SIZE_FIELDS}}
    trace, notes = published_trace_from_lake(read_trace_files(job.trace_files))
    out = options.out.rstrip("/")
    fs, inner = filesystem(out)
    fs.makedirs(inner, exist_ok=True)
    trial = meta["trial_name"]
    trace_path, meta_path = f"{out}/trace-{trial}.parquet", f"{out}/meta-{trial}.yaml"
    with fs.open(f"{inner}/trace-{trial}.parquet", "wb") as handle:
        pq.write_table(trace, handle)
    with fs.open(f"{inner}/meta-{trial}.yaml", "w") as handle:
        yaml.safe_dump({k: meta[k] for k in META_FIELDS}, handle, sort_keys=False)
    return trace_path, meta_path, notes


# ---------------------------------------------------------------------------
# CLI


def parse_import(argv: list[str]) -> ImportOptions:
    parser = ArgumentParser(
        prog="strag import-reference",
        description="Import a published trace (parquet + meta yaml) as one lake job, losslessly.")
    parser.add_argument("trace", help="trace-*.parquet in the published format")
    parser.add_argument("meta", help="meta-*.yaml with dp_size, pp_size, tp_size, dsp_size, vpp_size, world_size")
    parser.add_argument("--lake", required=True, help="lake URL (path, file://, memory://, s3://)")
    parser.add_argument("--job-id", required=True, help="job id to give the trace in the lake")
    parser.add_argument("--date", type=date_argument, default=None,
                        help="date partition YYYY-MM-DD (default: today, UTC; the format has no wall clock)")
    args = parser.parse_args(argv)
    date = args.date or dt.datetime.now(dt.timezone.utc).date()
    try:
        return ImportOptions(args.trace, args.meta, args.lake, args.job_id, date)
    except ValueError as error:
        parser.error(f"--job-id: {error}")


def parse_export(argv: list[str]) -> ExportOptions:
    parser = ArgumentParser(
        prog="strag export-reference",
        description="Export a lake job as a published-format trace parquet + meta yaml "
                    "(input for the authors' analyzer).")
    parser.add_argument("--lake", required=True, help="lake URL (path, file://, memory://, s3://)")
    parser.add_argument("--job-id", required=True, help="the lake job to export")
    parser.add_argument("--out", required=True, help="output folder (path or fsspec URL)")
    parser.add_argument("--date", type=date_argument, default=None, help="date partition (needed when the job has several)")
    args = parser.parse_args(argv)
    return ExportOptions(args.lake, args.job_id, args.out, args.date)


def run_import_reference(argv: list[str]) -> int:
    """`strag import-reference`: returns the exit code (2 on bad input, with the reason on stderr)."""
    from transforms.io.lake import LakeError

    options = parse_import(argv)
    try:
        job = import_reference(options)
    except (ReferenceFormatError, LakeError, ValueError) as error:
        print(f"strag import-reference: {error}", file=sys.stderr)
        return 2
    print(f"imported {options.trace} as job {job.job_id} on {job.date}:\n"
          f"  traces   {', '.join(job.trace_files)}\n  manifest {job.manifest_path}")
    return 0


def run_export_reference(argv: list[str]) -> int:
    """`strag export-reference`: returns the exit code (2 on bad input, with the reason on stderr)."""
    from transforms.io.lake import LakeError

    options = parse_export(argv)
    try:
        trace_path, meta_path, notes = export_reference(options)
    except (ReferenceFormatError, LakeError, ValueError) as error:
        print(f"strag export-reference: {error}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"exported job {options.job_id}:\n  trace {trace_path}\n  meta  {meta_path}")
    return 0
