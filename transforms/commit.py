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
2. `PublishTables` (one element, the pipeline's single terminal step): every (table, date)
   of the run's range that got no rows is staged as an empty file; then each partition is
   published by one atomic replace of its single file `part-0.parquet` (a rename on a
   local disk, one server-side object copy on S3), stale files in the partition are
   removed, tables from `finalizers` (unpartitioned rollups) are staged and published the
   same way, the staging folder is removed and `{out}/_runs/{run_id}.json` is written.
   Timelines the workers staged (`strag batch --timelines`) move in beside the partitions,
   and every other timeline of the run's dates is removed: they describe the published tables.
A crash before step 2 publishes nothing; a crash inside step 2 leaves each partition
either wholly old or wholly new, never half-written; rerunning the range converges to the
same bytes. The single terminal step is also what makes the DaskRunner (which only runs
the last leaf of the graph) execute the whole pipeline.

Test hook: env STRAG_BATCH_CRASH_AT=after-staging | publish:N kills the run's process
group (SIGKILL) at that point of step 2 (after staging / after N partitions published).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
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
from transforms.elements import PHASES, JobOutcome, JobStats
from transforms.lake import is_local, write_file_atomic

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
]

CRASH_ENV = "STRAG_BATCH_CRASH_AT"
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


def _move_file(fs: fsspec.AbstractFileSystem, source: str, target: str) -> None:
    """Replace `target` by `source` in one atomic step (local rename / server-side object copy)."""
    fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    if is_local(fs):
        os.replace(source, target)
    else:
        fs.copy(source, target)
        fs.rm(source)


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
    """Publish a staged run: every (table, date) of the range, atomically per partition.

    Returns the run summary (also written to {out}/_runs/{run_id}.json).
    """
    started = time.perf_counter()
    staged = list(staged)
    fs, root = _fs(config.out)
    _, staging = _fs(config.staging)
    have = {(s.table, s.date) for s in staged}
    if len(have) != len(staged):
        raise CommitError(f"run {config.run_id}: a partition was staged twice")
    partitioned = sorted(n for n, spec in config.tables.items() if spec.partitioned)
    for table in partitioned:
        for date in config.dates:
            if (table, date) not in have:
                staged.append(stage_partition(config, table, date, []))
    _crash_point("after-staging")

    published = 0
    for item in sorted((s for s in staged if s.date is not None), key=lambda s: (s.table, s.date)):
        _publish_one(fs, f"{staging}/{_relative(item.table, item.date)}", f"{root}/{_relative(item.table, item.date)}")
        published += 1
        _crash_point(f"publish:{published}")

    stats = list(stats)
    timelines = _publish_timelines(fs, staging, root, config, stats)

    for finalizer in config.finalizers:
        for table, rows in sorted(finalizer(config.out).items()):
            item = stage_partition(config, table, None, [rows])
            staged.append(item)
            _publish_one(fs, f"{staging}/{_relative(table, None)}", f"{root}/{_relative(table, None)}")

    _remove_stale_staging(fs, root, config)
    summary = summarize_run(stats, staged)
    summary.update(run_id=config.run_id, out=config.out, dates=[config.dates[0], config.dates[-1]], timelines=timelines)
    summary["seconds"]["publish"] = time.perf_counter() - started
    write_file_atomic(fs, f"{root}/{RUNS_DIR}/{config.run_id}.json", json.dumps(summary, indent=1, sort_keys=True).encode())
    return summary


def _publish_timelines(fs: fsspec.AbstractFileSystem, staging: str, root: str, config: CommitConfig,
                       stats: list[JobStats]) -> int:
    """Move the run's staged timelines in, then remove every other timeline of its dates.
    Returns how many were published."""
    wanted = {timeline_path(item.date, item.job_id) for item in stats if item.timeline}
    for relative in sorted(wanted):
        _move_file(fs, f"{staging}/{relative}", f"{root}/{relative}")
    for date in config.dates:
        folder = f"{TIMELINES_DIR}/{PARTITION_KEY}={date}"
        try:
            listed = [path.rstrip("/") for path in fs.ls(f"{root}/{folder}", detail=False)]
        except FileNotFoundError:
            continue
        stale = [path for path in listed if f"{folder}/{path.rsplit('/', 1)[-1]}" not in wanted]
        for path in stale:
            fs.rm(path, recursive=True)
        if len(stale) == len(listed) and is_local(fs):   # object stores have no empty folders to leave
            fs.rm(f"{root}/{folder}", recursive=True)
    return len(wanted)


def _publish_one(fs: fsspec.AbstractFileSystem, staged_dir: str, live_dir: str) -> None:
    """Swap one partition's single file in, then remove anything else left in the partition."""
    target = f"{live_dir}/{PART_FILE}"
    _move_file(fs, f"{staged_dir}/{PART_FILE}", target)
    for path in fs.ls(live_dir, detail=False):
        path = path.rstrip("/")
        if path.rsplit("/", 1)[-1] != PART_FILE and not fs.isdir(path):
            fs.rm(path)


def _remove_stale_staging(fs: fsspec.AbstractFileSystem, root: str, config: CommitConfig) -> None:
    """Remove this run's staging and that of crashed runs over overlapping dates (their
    partitions are superseded by this run)."""
    base = f"{root}/{STAGING_DIR}"
    if not fs.exists(base):
        return
    first, last = config.dates[0], config.dates[-1]
    for path in fs.ls(base, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        parts = name.split("_")
        overlaps = len(parts) >= 2 and parts[0] <= last and parts[1] >= first
        if name == config.run_id or overlaps:
            fs.rm(path, recursive=True)
    if not fs.ls(base, detail=False):
        fs.rm(base, recursive=True)


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
