"""CommitTables: stage every output partition, then publish the whole run in one terminal step.

In: one or more PCollections of `JobOutcome` (per-job tables + stats) and/or
`TableFragment` / `(table, iso_date, pa.Table)` tuples (any extra named table, e.g. the
fleet aggregates). Out: a one-element PCollection with the run summary (a dict); the
tables land under the output URL (layout in schemas/tables.py).

How a run becomes visible, and why it is safe to kill at any moment:
1. `StagePartitions` (parallel): rows of one (table, date) are conformed to the table's
   schema, sorted by its sort keys (total order), and written as one parquet file under
   `{out}/_staging/{run_id}/` with deterministic settings (no timestamps), so equal rows
   give equal bytes.
2. `PublishTables` (one element, the pipeline's single terminal step): first it completes any
   publish an earlier run left unfinished (below); every (table, date) of the run's range that
   got no rows is staged as an empty file; then the run writes its commit record
   `{out}/_commits/{run_id}.json` (every (table, date) partition and timeline it publishes, its
   finalizers and summary): from that write on, the run is published whatever happens. Each
   partition is then published by one atomic replace of its single file `part-0.parquet` (a
   rename on a local disk, one server-side object copy on S3), stale files in the partition are
   removed; the run's timelines (`strag batch --timelines`) move in beside the partitions and
   every other timeline of its dates is removed; `finalizers` rebuild the unpartitioned tables
   (rollups) from the published partitions, published the same way; `{out}/_runs/{run_id}.json`
   says what was published; the staging folder goes, and the commit record last.
Every storage call is retried (transforms/io/storage.py) and every step is idempotent (a staged
file already gone whose target exists was published), so a publish that fails for good or is
killed is completed from its record by the next run before it does anything else, or by
`strag batch --resume-publish --out URL` (`complete_pending`). A crash before the record
publishes nothing (the next run over those dates removes the staging); after it, each partition
is wholly old or wholly new, never half-written, until the completion makes all of them new;
rerunning the range converges to the same bytes. The single terminal step is also what makes
the DaskRunner (which only runs the last leaf of the graph) execute the whole pipeline.

Test hook: env STRAG_BATCH_CRASH_AT=after-staging | publish:N kills the run's process
group (SIGKILL) at that point of step 2 (after staging, before the record / after N partitions
published).
"""
from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import io
import json
import logging
import os
import signal
import time
from typing import Any, Callable, Iterable, Mapping

import apache_beam as beam
import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.tables import (BATCH_TABLES, PART_FILE, PARTITION_KEY, RUNS_DIR, STAGING_DIR, TIMELINES_DIR, TableSpec,
                            partition_path, timeline_path)
from transforms.batch.elements import PHASES, JobOutcome, JobStats
from transforms.io.lake import is_local, write_file_atomic
from transforms.io.storage import exists, retry

__all__ = [
    "CommitConfig",
    "StagedPartition",
    "CommitTables",
    "CommitError",
    "conform_rows",
    "parquet_bytes",
    "stage_partition",
    "publish_run",
    "summarize_run",
    "CRASH_ENV",
    "COMMITS_DIR",
    "commit_path",
    "commit_pending",
    "complete_pending",
    "complete_commit",
    "read_run_record",
]

CRASH_ENV = "STRAG_BATCH_CRASH_AT"
COMMITS_DIR = "_commits"   # {out}/_commits/{run_id}.json: a run's commit record while it publishes
_RUN_START = "strag:run-start"  # marker element: the publish step runs even when no job was found
# The windows' JobStats ride the partitions' GroupByKey under this key to the publish step: a
# branch of their own would be one more Flatten input, and on the DaskRunner every Flatten input
# adds its partitions to the last shuffle, whose tasks grow with the square of the partitions.
_STATS_KEY = ("strag:job-stats", None)
_PARQUET_OPTIONS = dict(
    compression="zstd",
    compression_level=3,
    use_dictionary=True,
    write_statistics=True,
    version="2.6",
    data_page_version="1.0",
    row_group_size=1 << 20,
    store_schema=True,
)


class CommitError(RuntimeError):
    """The commit step cannot stage or publish (unknown table, wrong columns, storage error)."""


# A finalizer runs after the date partitions are published: f(out_url) -> {table: rows} of
# unpartitioned tables to publish (e.g. fleet rollups rebuilt from every date's state).
Finalizer = Callable[[str], Mapping[str, pa.Table]]


@dataclasses.dataclass(frozen=True)
class CommitConfig:
    """Where and what the commit step publishes.

    out: output URL; dates: ISO dates of the run's range (every one gets a partition in
    every partitioned table); run_id: names the staging folder and the run record;
    tables: name -> TableSpec of every table the run may write; finalizers: callables run
    after publishing (module-level functions, they travel to the worker).
    """

    out: str
    dates: tuple[str, ...]
    run_id: str
    tables: Mapping[str, TableSpec] = dataclasses.field(default_factory=lambda: dict(BATCH_TABLES))
    finalizers: tuple[Finalizer, ...] = ()

    def __post_init__(self):
        if not self.out:
            raise ValueError("CommitConfig.out: an output URL is required")
        if not self.run_id or "/" in self.run_id:
            raise ValueError(f"CommitConfig.run_id {self.run_id!r}: a non-empty name without '/' is required")
        dates = tuple(dt.date.fromisoformat(d).isoformat() for d in self.dates)
        if not dates or list(dates) != sorted(set(dates)):
            raise ValueError(f"CommitConfig.dates must be a non-empty sorted list of distinct ISO dates, got {self.dates!r}")
        object.__setattr__(self, "dates", dates)
        object.__setattr__(self, "out", self.out.rstrip("/"))
        for name, spec in self.tables.items():
            if name != spec.name:
                raise ValueError(f"CommitConfig.tables: key {name!r} names table spec {spec.name!r}")

    @property
    def staging(self) -> str:
        return f"{self.out}/{STAGING_DIR}/{self.run_id}"

    def spec(self, table: str) -> TableSpec:
        try:
            return self.tables[table]
        except KeyError:
            raise CommitError(
                f"table {table!r} is not registered with the commit step (known: {sorted(self.tables)}); "
                "add its TableSpec to CommitConfig.tables"
            ) from None


@dataclasses.dataclass(frozen=True)
class StagedPartition:
    """One partition written to staging: table, ISO date (None: unpartitioned), rows, seconds spent."""

    table: str
    date: str | None
    rows: int
    seconds: float


# ---------------------------------------------------------------------------
# Plain functions (no Beam): conform, serialise, stage, publish


def conform_rows(rows: pa.Table | pa.RecordBatch, spec: TableSpec, where: str = "", *, sort: bool = True) -> pa.Table:
    """Select and cast `rows` to the spec's schema and sort them by its keys (then every column;
    sort=False keeps their order).

    Raises CommitError naming the table and the missing or uncastable column.
    """
    table = pa.Table.from_batches([rows]) if isinstance(rows, pa.RecordBatch) else rows
    missing = [f.name for f in spec.schema if f.name not in table.column_names]
    if missing:
        raise CommitError(f"table {spec.name}{where}: rows lack columns {missing}")
    columns = []
    for field in spec.schema:
        column = table.column(field.name)
        if column.type != field.type:
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise CommitError(f"table {spec.name}{where}: column {field.name} of type {column.type} does not cast to {field.type}: {error}") from error
        if not field.nullable and column.null_count:
            raise CommitError(f"table {spec.name}{where}: column {field.name} has {column.null_count} nulls but is not nullable")
        columns.append(column)
    table = pa.Table.from_arrays(columns, schema=spec.schema)
    if sort and table.num_rows > 1:
        keys = list(spec.sort_keys) + [n for n in spec.schema.names if n not in spec.sort_keys and _sortable(spec.schema.field(n).type)]
        order = pc.sort_indices(table, sort_keys=[(k, "ascending", "at_start") for k in keys])
        table = table.take(order)
    return table.combine_chunks()


def _sortable(type_: pa.DataType) -> bool:
    return not (pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_struct(type_) or pa.types.is_map(type_))


def parquet_bytes(table: pa.Table) -> bytes:
    """Parquet file bytes with fixed settings: equal tables give equal bytes (no timestamps inside)."""
    sink = io.BytesIO()
    pq.write_table(table, sink, **_PARQUET_OPTIONS)
    return sink.getvalue()


def _move_file(fs: fsspec.AbstractFileSystem, source: str, target: str) -> bool:
    """Replace `target` by `source` in one atomic step (local rename / server-side object copy), retried.

    Idempotent, so an interrupted publish can be completed: a source already gone whose target
    exists was moved before (by an earlier attempt or run). Returns whether this call moved it."""
    def move() -> bool:
        if not exists(fs, source):
            if exists(fs, target):
                return False
            raise FileNotFoundError(f"staged file {source} is gone and {target} was never published")
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if is_local(fs):
            fs.mv(source, target)
        else:
            fs.copy(source, target)
            fs.rm(source)
        return True

    return retry("publishing", target, move)


def _remove(fs: fsspec.AbstractFileSystem, path: str, recursive: bool = False) -> None:
    """Delete `path`, retried; a path already gone is done."""
    try:
        retry("removing", path, lambda: fs.rm(path, recursive=recursive), absent=(FileNotFoundError,))
    except FileNotFoundError:
        pass


def _list(fs: fsspec.AbstractFileSystem, path: str, detail: bool = False) -> list:
    """Listing of the folder `path` (fresh, retried); [] when it does not exist."""
    def listing():
        fs.invalidate_cache(path)
        return fs.ls(path, detail=detail)

    try:
        return retry("listing", path, listing, absent=(FileNotFoundError,))
    except FileNotFoundError:
        return []


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def _relative(table: str, date: str | None) -> str:
    return partition_path("", table, date).lstrip("/")


def stage_partition(config: CommitConfig, table: str, date: str | None, parts: Iterable[pa.Table]) -> StagedPartition:
    """Concatenate, conform and sort the rows of one (table, date) and write them to staging."""
    started = time.perf_counter()
    spec = config.spec(table)
    if spec.partitioned and date not in config.dates:
        raise CommitError(f"table {table}: rows for date {date!r} outside the run's range {config.dates[0]}..{config.dates[-1]}")
    if not spec.partitioned and date is not None:
        raise CommitError(f"table {table} is unpartitioned but got rows for date {date}")
    where = f" date={date}" if date else ""
    parts = [conform_rows(p, spec, where, sort=False) for p in parts]   # one schema, so they concatenate
    rows = conform_rows(pa.concat_tables(parts) if parts else spec.schema.empty_table(), spec, where)
    fs, root = _fs(config.staging)
    write_file_atomic(fs, f"{root}/{_relative(table, date)}/{PART_FILE}", parquet_bytes(rows))
    return StagedPartition(table, date, rows.num_rows, time.perf_counter() - started)


def _crash_point(point: str) -> None:
    """Test hook: kill this run's whole process group at a named point of the publish step."""
    wanted = os.environ.get(CRASH_ENV)
    if wanted and wanted == point:
        os.killpg(os.getpgid(0), signal.SIGKILL)


def publish_run(config: CommitConfig, staged: Iterable[StagedPartition], stats: Iterable[JobStats]) -> dict[str, Any]:
    """Publish a staged run: every (table, date) of the range, atomically per partition, as a
    journalled commit (module docstring). Interrupted publishes of earlier runs are completed first.

    Returns the run summary (also written to {out}/_runs/{run_id}.json).
    """
    started = time.perf_counter()
    staged = list(staged)
    fs, root = _fs(config.out)
    _, staging = _fs(config.staging)
    completed = complete_pending(config.out, by=config.run_id)
    if config.run_id in completed:   # a retried publish step whose first attempt recorded its commit
        return read_run_record(config.out, config.run_id)
    have = {(s.table, s.date) for s in staged}
    if len(have) != len(staged):
        raise CommitError(f"run {config.run_id}: a partition was staged twice")
    partitioned = sorted(n for n, spec in config.tables.items() if spec.partitioned)
    for table in partitioned:
        for date in config.dates:
            if (table, date) not in have:
                staged.append(stage_partition(config, table, date, []))
    _crash_point("after-staging")

    stats = list(stats)
    summary = summarize_run(stats, staged)
    summary.update(run_id=config.run_id, out=config.out, dates=[config.dates[0], config.dates[-1]])
    summary["seconds"]["publish"] = time.perf_counter() - started
    record = {
        "run_id": config.run_id,
        "written": time.time(),
        "dates": list(config.dates),
        "partitions": sorted([s.table, s.date] for s in staged if s.date is not None),
        "timelines": sorted({timeline_path(item.date, item.job_id) for item in stats if item.timeline}),
        "finalizers": [f"{f.__module__}:{f.__qualname__}" for f in config.finalizers],
        "tables": {name: _spec_json(spec) for name, spec in sorted(config.tables.items()) if not spec.partitioned},
        "summary": summary,
        "completed_before": completed,
    }
    # The journal: from here on the run is published, whatever happens to this process.
    write_file_atomic(fs, f"{root}/{COMMITS_DIR}/{config.run_id}.json", json.dumps(record, indent=1, sort_keys=True).encode())
    summary = complete_commit(config.out, record, config)
    _tidy(lambda: _remove_stale_staging(fs, root, config))
    return summary


def commit_path(out: str, run_id: str) -> str:
    """URL of a run's commit record (present from the start of its publish until it is complete)."""
    return f"{out.rstrip('/')}/{COMMITS_DIR}/{run_id}.json"


def commit_pending(out: str, run_id: str) -> bool:
    """Whether run `run_id` recorded its commit and its publish is not complete."""
    fs, path = _fs(commit_path(out, run_id))
    return retry("listing", commit_path(out, run_id), lambda: exists(fs, path))


def read_run_record(out: str, run_id: str) -> dict[str, Any]:
    url = f"{out.rstrip('/')}/{RUNS_DIR}/{run_id}.json"
    fs, path = _fs(url)
    return json.loads(retry("reading", url, lambda: fs.cat_file(path)))


def complete_pending(out: str, by: str | None = None) -> list[str]:
    """Complete every publish recorded under {out}/_commits/ and not finished (a run killed or failed
    for good while publishing), oldest first. by: the run (or None: `strag batch --resume-publish`)
    doing it, noted in their run records. Returns their run ids."""
    fs, root = _fs(out)
    records = []
    for path in _list(fs, f"{root}/{COMMITS_DIR}"):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(".") or not name.endswith(".json"):
            continue
        text = retry("reading", path, lambda path=path: fs.cat_file(path))
        try:
            records.append(json.loads(text))
        except ValueError as error:
            raise CommitError(f"commit record {path} is not JSON ({error}); it was written atomically, so the "
                              "output was changed by hand: restore or remove it") from None
    done = []
    for record in sorted(records, key=lambda r: (r["written"], r["run_id"])):
        complete_commit(out, record, completed_by=by if by != record["run_id"] else None)
        done.append(record["run_id"])
    base = f"{root}/{STAGING_DIR}"
    if done and is_local(fs):   # an empty staging folder left behind (object stores have none)
        _tidy(lambda: not _list(fs, base) and retry("listing", base, lambda: exists(fs, base)) and _remove(fs, base, recursive=True))
    return done


def complete_commit(out: str, record: Mapping[str, Any], config: CommitConfig | None = None, *,
                    completed_by: str | None = None) -> dict[str, Any]:
    """Publish what a commit record lists; idempotent, so it completes an interrupted publish.

    Partitions move in from staging (one already moved is left as published), their stale files
    go; the run's timelines move in and every other timeline of its dates goes; the finalizers
    rebuild the unpartitioned tables; then the run record, then staging and the commit record go.
    config: the running run's (None: rebuilt from the record). Returns the run summary."""
    started = time.perf_counter()
    run_id = record["run_id"]
    if config is None:
        config = CommitConfig(out, tuple(record["dates"]), run_id, tables={
            name: _spec_from_json(name, value) for name, value in record["tables"].items()},
            finalizers=tuple(_import(name) for name in record["finalizers"]))
    fs, root = _fs(config.out)
    _, staging = _fs(config.staging)
    fs.invalidate_cache()
    published = []
    for table, date in record["partitions"]:
        _publish_one(fs, f"{staging}/{_relative(table, date)}", f"{root}/{_relative(table, date)}")
        published.append(f"{_relative(table, date)}")
        _crash_point(f"publish:{len(published)}")
    _publish_timelines(fs, staging, root, config.dates, set(record["timelines"]))
    summary = json.loads(json.dumps(record["summary"]))
    for finalizer in config.finalizers:   # reads the published partitions: retried like any read
        rebuilt = retry("reading", f"{config.out} (to rebuild the tables of {finalizer.__qualname__})",
                        lambda: finalizer(config.out), failures=(OSError,))
        for table, rows in sorted(rebuilt.items()):
            item = stage_partition(config, table, None, [rows])
            _publish_one(fs, f"{staging}/{_relative(table, None)}", f"{root}/{_relative(table, None)}")
            published.append(table)
            summary["table_rows"][table] = summary["table_rows"].get(table, 0) + item.rows
            summary["seconds"]["stage"] += item.seconds
            summary["partitions"] += 1
    summary["table_rows"] = dict(sorted(summary["table_rows"].items()))
    summary["timelines"] = len(record["timelines"])
    summary["published"] = {"partitions": published, "timelines": list(record["timelines"]),
                            "completed_runs": list(record.get("completed_before", []))}
    if completed_by is not None:
        summary["published"]["completed_by"] = completed_by
    summary["seconds"]["publish"] += time.perf_counter() - started
    write_file_atomic(fs, f"{root}/{RUNS_DIR}/{run_id}.json", json.dumps(summary, indent=1, sort_keys=True).encode())
    _remove(fs, staging, recursive=True)
    _remove(fs, f"{root}/{COMMITS_DIR}/{run_id}.json")   # the publish is complete
    _tidy(lambda: is_local(fs) and not _list(fs, f"{root}/{COMMITS_DIR}") and _remove(
        fs, f"{root}/{COMMITS_DIR}", recursive=True))   # object stores have no empty folders
    return summary


def _tidy(call: Callable[[], Any]) -> None:
    """Tidying after a complete publish (empty folders, other runs' stale staging): a storage failure
    here changes nothing published and the next run tidies again, so it is logged, not raised."""
    try:
        call()
    except OSError as error:
        logging.getLogger(__name__).warning("tidying the output after the publish: %s", error)


def _spec_json(spec: TableSpec) -> dict[str, Any]:
    return {"schema": base64.b64encode(spec.schema.serialize().to_pybytes()).decode(), "sort_keys": list(spec.sort_keys)}


def _spec_from_json(name: str, value: Mapping[str, Any]) -> TableSpec:
    schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(value["schema"])))
    return TableSpec(name, schema, tuple(value["sort_keys"]), partitioned=False)


def _import(name: str) -> Finalizer:
    import importlib

    module, _, qualname = name.partition(":")
    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def _publish_timelines(fs: fsspec.AbstractFileSystem, staging: str, root: str, dates: Iterable[str],
                       wanted: set[str]) -> None:
    """Move the run's staged timelines in, then remove every other timeline of its dates."""
    for relative in sorted(wanted):
        _move_file(fs, f"{staging}/{relative}", f"{root}/{relative}")
    for date in dates:
        folder = f"{TIMELINES_DIR}/{PARTITION_KEY}={date}"
        listed = [path.rstrip("/") for path in _list(fs, f"{root}/{folder}")]
        if not listed:
            continue
        stale = [path for path in listed if f"{folder}/{path.rsplit('/', 1)[-1]}" not in wanted]
        for path in stale:
            _remove(fs, path, recursive=True)
        if len(stale) == len(listed) and is_local(fs):   # object stores have no empty folders to leave
            _remove(fs, f"{root}/{folder}", recursive=True)


def _publish_one(fs: fsspec.AbstractFileSystem, staged_dir: str, live_dir: str) -> None:
    """Swap one partition's single file in, then remove anything else left in the partition."""
    _move_file(fs, f"{staged_dir}/{PART_FILE}", f"{live_dir}/{PART_FILE}")
    for entry in _list(fs, live_dir, detail=True):
        path = entry["name"].rstrip("/")
        if path.rsplit("/", 1)[-1] != PART_FILE and entry.get("type") != "directory":
            _remove(fs, path)


def _remove_stale_staging(fs: fsspec.AbstractFileSystem, root: str, config: CommitConfig) -> None:
    """Remove the staging of crashed runs over overlapping dates that never recorded a commit
    (their partitions are superseded by this run; a recorded one is completed, never dropped)."""
    base = f"{root}/{STAGING_DIR}"
    listed = _list(fs, base)
    if not listed:
        if is_local(fs) and retry("listing", base, lambda: exists(fs, base)):
            _remove(fs, base, recursive=True)
        return
    pending = {path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json") for path in _list(fs, f"{root}/{COMMITS_DIR}")}
    first, last = config.dates[0], config.dates[-1]
    for path in listed:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        parts = name.split("_")
        overlaps = len(parts) >= 2 and parts[0] <= last and parts[1] >= first
        if (name == config.run_id or overlaps) and name not in pending:
            _remove(fs, path, recursive=True)
    if is_local(fs) and not _list(fs, base):
        _remove(fs, base, recursive=True)


def summarize_run(stats: Iterable[JobStats], staged: Iterable[StagedPartition] = ()) -> dict[str, Any]:
    """Totals of a run: job windows by status and reason, rows and ops, seconds per phase, table rows."""
    jobs: dict[str, int] = {}
    reasons: dict[str, int] = {}
    seconds = {phase: 0.0 for phase in PHASES}
    totals = {"ops": 0, "rows_read": 0, "rows_quarantined": 0}
    for item in stats:
        jobs[item.status] = jobs.get(item.status, 0) + 1
        if item.reason_code:
            reasons[item.reason_code] = reasons.get(item.reason_code, 0) + 1
        totals["ops"] += item.ops
        totals["rows_read"] += item.rows_read
        totals["rows_quarantined"] += item.rows_quarantined
        for phase, value in item.seconds.items():
            seconds[phase] = seconds.get(phase, 0.0) + value
    table_rows: dict[str, int] = {}
    partitions = 0
    for item in staged:
        table_rows[item.table] = table_rows.get(item.table, 0) + item.rows
        seconds["stage"] += item.seconds
        partitions += 1
    return {"jobs": dict(sorted(jobs.items())), "reasons": dict(sorted(reasons.items())), **totals,
            "seconds": seconds, "table_rows": dict(sorted(table_rows.items())), "partitions": partitions}


# ---------------------------------------------------------------------------
# Beam wiring


def _split_fragments(item):
    """JobOutcome / TableFragment / (table, date, rows) -> ((table, date), rows); a JobOutcome's
    stats go under _STATS_KEY."""
    if isinstance(item, JobOutcome):
        for table, date, rows in item.fragments():
            yield (table, date), rows
        yield _STATS_KEY, item.stats
    elif isinstance(item, tuple) and len(item) == 3 and isinstance(item[2], (pa.Table, pa.RecordBatch)):
        table, date, rows = item
        yield (table, date), rows
    else:
        raise CommitError(f"CommitTables got {type(item).__name__}; expected JobOutcome or (table, iso_date, pa.Table)")


class _StagePartitionFn(beam.DoFn):
    """((table, date), rows) -> StagedPartition; the JobStats grouped under _STATS_KEY pass through."""

    def __init__(self, config: CommitConfig):
        self._config = config

    def process(self, element):
        key, parts = element
        if key == _STATS_KEY:
            yield from parts
            return
        table, date = key
        staged = stage_partition(self._config, table, date, list(parts))
        beam.metrics.Metrics.counter("strag.tables", f"rows.{table}").inc(staged.rows)
        yield staged


class _PublishFn(beam.DoFn):
    def __init__(self, config: CommitConfig):
        self._config = config

    def process(self, element):
        _, items = element
        items = list(items)
        if _RUN_START not in items:
            raise CommitError(f"run {self._config.run_id}: the run-start marker did not reach the publish step")
        staged = [i for i in items if isinstance(i, StagedPartition)]
        stats = [i for i in items if isinstance(i, JobStats)]
        yield publish_run(self._config, staged, stats)


class CommitTables(beam.PTransform):
    """PCollection(s) of JobOutcome / (table, iso_date, pa.Table) -> the run summary, after publishing.

    Must be the last step of the pipeline (see module docstring). Extra tables plug in by
    flattening more (table, date, rows) PCollections into the input and adding their
    TableSpec to `config.tables`; unpartitioned derived tables through `config.finalizers`.
    """

    def __init__(self, config: CommitConfig):
        super().__init__()
        if not isinstance(config, CommitConfig):
            raise TypeError(f"CommitTables needs a CommitConfig, got {type(config).__name__}")
        self._config = config

    def expand(self, inputs):
        pcolls = [inputs] if isinstance(inputs, beam.PCollection) else list(inputs)
        items = pcolls[0] if len(pcolls) == 1 else tuple(pcolls) | "MergeInputs" >> beam.Flatten()
        run_id = self._config.run_id
        staged = (
            items
            | "SplitTables" >> beam.FlatMap(_split_fragments)
            | "GroupByPartition" >> beam.GroupByKey()
            | "StagePartitions" >> beam.ParDo(_StagePartitionFn(self._config))
        )
        start = items.pipeline | "StartRun" >> beam.Create([_RUN_START])
        return (
            (start, staged)
            | "GatherRun" >> beam.Flatten()
            | "KeyByRun" >> beam.Map(lambda item: (run_id, item))
            | "GroupByRun" >> beam.GroupByKey()
            | "PublishTables" >> beam.ParDo(_PublishFn(self._config))
        )
