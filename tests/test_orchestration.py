"""Dagster orchestration in-process: one daily partition, a 3-day backfill, the nightly
schedule, and a failed partition that retries without leaving partial output. Every run
goes through `strag batch` / `strag report` (the same code path as the CLI); the tables
are compared byte for byte with a direct `strag batch` run."""
from __future__ import annotations

import datetime as dt
import pathlib

import dagster as dg
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from orchestration.assets import StragSettings, batch_tables, fleet_report, make_assets
from orchestration.definitions import defs
from pipelines import batch, generate
from schemas.tables import BATCH_TABLES, read_table

pytestmark = pytest.mark.slow
DAYS = ("2024-01-01", "2024-01-02", "2024-01-03")
BATCH_ARGS = ["--workers", "1", "--running-mode", "in_memory", "--quiet"]


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lake"))
    assert generate.run(["--lake", folder, "--days", "3", "--jobs-per-day", "2", "--seed", "7", "--bad-fraction", "0",
                         "--max-records", "20000", "--processes", "1"]) == 0
    return folder


def settings(lake: str, out: pathlib.Path) -> StragSettings:
    return StragSettings(lake=lake, out=str(out), reports=str(out.parent / f"{out.name}-report"), batch_args=BATCH_ARGS,
                         report_args=["--images", "none", "--max-jobs", "1"])


def published(out: pathlib.Path) -> dict[str, bytes]:
    """Every published table file (staging and run records excluded) -> bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.parquet"))
            if not p.relative_to(out).parts[0].startswith("_")}


def direct_batch(lake: str, out: pathlib.Path, first: str, last: str) -> dict[str, bytes]:
    assert batch.run(["--lake", lake, "--from", first, "--to", last, "--out", str(out), *BATCH_ARGS]) == 0
    return published(out)


def test_nightly_schedule_runs_yesterdays_partition():
    schedule = defs.resolve_schedule_def("strag_nightly")
    tick = dg.build_schedule_context(scheduled_execution_time=dt.datetime(2024, 3, 5, 2, 0, tzinfo=dt.timezone.utc),
                                     repository_def=defs.get_repository_def())
    requests = schedule.evaluate_tick(tick).run_requests
    assert [r.partition_key for r in requests] == ["2024-03-04"]
    assert schedule.cron_schedule == "0 2 * * *"


def test_one_partition_materialises_the_tables_and_report(lake, tmp_path):
    out = tmp_path / "tables"
    result = dg.materialize([batch_tables, fleet_report], partition_key=DAYS[1], resources={"strag": settings(lake, out)})
    assert result.success
    assert published(out) == direct_batch(lake, tmp_path / "direct", DAYS[1], DAYS[1])
    assert {d.isoformat() for d in read_table(str(out), "job_summary")["date"].to_pylist()} == {DAYS[1]}
    assert (tmp_path / "tables-report" / "index.html").is_file()
    materialized = {e.asset_key.path[-1] for e in result.get_asset_materialization_events()
                    for e in [e.event_specific_data.materialization]}
    assert materialized == set(BATCH_TABLES) | {"fleet_report"}


def test_three_day_backfill_is_one_batch_run_over_the_range(lake, tmp_path):
    out = tmp_path / "tables"
    tags = {ASSET_PARTITION_RANGE_START_TAG: DAYS[0], ASSET_PARTITION_RANGE_END_TAG: DAYS[-1]}
    result = dg.materialize([batch_tables, fleet_report], tags=tags, resources={"strag": settings(lake, out)})
    assert result.success
    files = published(out)
    assert files == direct_batch(lake, tmp_path / "direct", DAYS[0], DAYS[-1])
    for table in BATCH_TABLES:
        assert {f"{table}/date={day}/part-0.parquet" for day in DAYS} <= set(files), table
    assert read_table(str(out), "job_summary").num_rows == 6  # 2 jobs a day, none bad


def test_failed_partition_retries_and_never_shows_partial_output(lake, tmp_path, monkeypatch):
    """The first attempt dies inside the batch run before its publish step: nothing of the
    partition is visible after it; the retry publishes exactly what a clean run does."""
    import transforms.batch.commit as commit

    out = tmp_path / "tables"
    original, seen = commit.publish_run, []

    def failing_once(*args, **kwargs):
        seen.append(published(out))  # what readers could see when this attempt reached its publish step
        if len(seen) == 1:
            raise RuntimeError("injected failure: the worker died before publishing")
        return original(*args, **kwargs)

    monkeypatch.setattr(commit, "publish_run", failing_once)
    retried_batch, retried_report = make_assets(dg.RetryPolicy(max_retries=1))
    result = dg.materialize([retried_batch, retried_report], partition_key=DAYS[2],
                            resources={"strag": settings(lake, out)}, raise_on_error=False)
    assert result.success
    retries = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert len(retries) == 1 and len(seen) == 2
    assert seen[1] == {}, "the failed attempt left published files behind"
    monkeypatch.setattr(commit, "publish_run", original)
    assert published(out) == direct_batch(lake, tmp_path / "direct", DAYS[2], DAYS[2])
