"""Dagster assets: the batch tables and the fleet report, partitioned by day.

Every materialisation runs the same code path as the command line: `strag batch
--lake L --from D1 --to D2 --out O` (through `pipelines.cli.main`), then `strag report`.
A run covers one day (the nightly schedule) or a range of days (a backfill: the
backfill policy batches up to `MAX_DAYS_PER_RUN` consecutive days into one Beam run,
so a 5-month backfill is 5 Beam runs, not 150).

Never partial output: the batch pipeline stages every partition and publishes each
(table, date) file with one atomic replace at its end (transforms/batch/commit.py); a
failed attempt publishes nothing of what it had not finished, the retry policy reruns
the whole range, and a rerun replaces exactly those partitions with byte-identical
files. An asset is reported materialised only after the run has returned success and
every date of its range has a partition in every table.
"""
import datetime as dt
import os
from collections.abc import Sequence

import dagster as dg
from dagster import AssetExecutionContext
import fsspec

from schemas.tables import BATCH_TABLES, partition_path

__all__ = [
    "PARTITIONS_START_ENV",
    "MAX_DAYS_PER_RUN",
    "DAILY",
    "BATCH_TABLE_KEYS",
    "RETRY",
    "StragSettings",
    "make_assets",
    "batch_tables",
    "fleet_report",
    "OrchestrationError",
]

# First day of the partitions (the fleet's first day of traces); env so that an
# operator can move it without code changes.
PARTITIONS_START_ENV = "STRAG_PARTITIONS_START"
MAX_DAYS_PER_RUN = 31
GROUP = "strag"

DAILY = dg.DailyPartitionsDefinition(start_date=os.environ.get(PARTITIONS_START_ENV, "2024-01-01"))
BATCH_TABLE_KEYS: tuple[dg.AssetKey, ...] = tuple(dg.AssetKey([GROUP, name]) for name in BATCH_TABLES)
FLEET_REPORT_KEY = dg.AssetKey([GROUP, "fleet_report"])
# A failed attempt is retried twice, 30 s then 60 s later (a flaky object store, a killed
# worker); a deterministic failure (bad code) still fails after the third attempt.
RETRY = dg.RetryPolicy(max_retries=2, delay=30, backoff=dg.Backoff.EXPONENTIAL)


class OrchestrationError(RuntimeError):
    """A scheduled run did not produce what it promised (names the run's dates and table)."""


class StragSettings(dg.ConfigurableResource):
    """Where the lake, the tables and the reports live, and how the batch runs.

    lake / out / reports: fsspec URLs (credentials from the environment, never here).
    batch_args: extra `strag batch` arguments, e.g. ["--runner", "DaskRunner",
    "--dask-address", "tcp://scheduler:8786"] for a distributed Beam runner.
    report_args: extra `strag report` arguments, e.g. ["--images", "none"].
    """

    lake: str
    out: str
    reports: str = ""
    batch_args: list[str] = []
    report_args: list[str] = []

    def report_dir(self) -> str:
        return self.reports or f"{self.out.rstrip('/')}/_reports"


def _run_range(context: AssetExecutionContext) -> tuple[str, str]:
    """First and last day (ISO) of the partitions this run materialises."""
    keys = context.partition_keys
    return min(keys), max(keys)


def _strag(argv: Sequence[str]) -> None:
    """Run one `strag` subcommand in-process; a non-zero exit is a failure (retried)."""
    from pipelines.cli import main

    code = main(list(argv))
    if code != 0:
        raise dg.Failure(description=f"`strag {' '.join(argv)}` exited with status {code}", allow_retries=True)


def _dates(first: str, last: str) -> list[str]:
    start, end = dt.date.fromisoformat(first), dt.date.fromisoformat(last)
    return [(start + dt.timedelta(days=i)).isoformat() for i in range((end - start).days + 1)]


def _check_published(out: str, first: str, last: str) -> dict[str, int]:
    """Every date of the range must have a partition in every batch table; returns files per table."""
    counts = {}
    for table in BATCH_TABLES:
        found = 0
        for date in _dates(first, last):
            fs, path = fsspec.core.url_to_fs(partition_path(out, table, date))
            if not fs.exists(path) or not any(p.endswith(".parquet") for p in fs.ls(path, detail=False)):
                raise OrchestrationError(f"batch run {first}..{last}: table {table} has no partition for {date} under {out}")
            found += 1
        counts[table] = found
    return counts


def make_assets(retry_policy: dg.RetryPolicy = RETRY) -> tuple[dg.AssetsDefinition, dg.AssetsDefinition]:
    """The two asset definitions (batch tables, fleet report) with a retry policy.

    The shipped definitions use RETRY; tests pass a policy without delay.
    """

    @dg.multi_asset(
        name="batch_tables",
        specs=[
            dg.AssetSpec(key, description=f"batch table `{key.path[-1]}` (schemas/tables.py), Hive-partitioned by date",
                         group_name=GROUP)
            for key in BATCH_TABLE_KEYS
        ],
        partitions_def=DAILY,
        backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=MAX_DAYS_PER_RUN),
        retry_policy=retry_policy,
        can_subset=False,
    )
    def batch_tables(context: AssetExecutionContext, strag: StragSettings):
        """`strag batch` over this run's days: validated, analysed, partitioned tables."""
        first, last = _run_range(context)
        context.log.info(f"strag batch {first}..{last}: lake {strag.lake} -> {strag.out}")
        _strag(["batch", "--lake", strag.lake, "--from", first, "--to", last, "--out", strag.out, *strag.batch_args])
        partitions = _check_published(strag.out, first, last)
        for key in BATCH_TABLE_KEYS:
            yield dg.MaterializeResult(
                asset_key=key,
                metadata={"dates": f"{first}..{last}", "partitions": partitions[key.path[-1]], "out": strag.out},
            )

    @dg.asset(
        key=FLEET_REPORT_KEY,
        deps=list(BATCH_TABLE_KEYS),
        partitions_def=DAILY,
        backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=MAX_DAYS_PER_RUN),
        retry_policy=retry_policy,
        group_name=GROUP,
    )
    def fleet_report(context: AssetExecutionContext, strag: StragSettings) -> dg.MaterializeResult:
        """`strag report` from the tables: the fleet report and per-job pages as of this run's last day."""
        first, last = _run_range(context)
        target = strag.report_dir()
        _strag(["report", "--tables", strag.out, "--out", target, *strag.report_args])
        return dg.MaterializeResult(metadata={"as_of": last, "report": target})

    return batch_tables, fleet_report


batch_tables, fleet_report = make_assets()
