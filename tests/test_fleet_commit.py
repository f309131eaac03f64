"""Fleet tables through the batch commit step: nightly runs and one backfill publish the same bytes."""
from __future__ import annotations

import datetime as dt
import pathlib

import pyarrow.parquet as pq

from fleet_tables_fixture import START, commit_fleet, random_outcomes
from schemas.fleet import FLEET_TABLE_SPECS, FLEET_TABLES, rollup_table
from schemas.tables import read_table

DAYS = 4


def _fleet_files(out: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*.parquet"))
        if p.relative_to(out).parts[0] in FLEET_TABLE_SPECS
    }


def test_nightly_runs_and_a_backfill_publish_identical_fleet_tables(tmp_path):
    outcomes = random_outcomes(seed=23, days=DAYS, jobs_per_day=6)
    dates = [(START + dt.timedelta(days=d)).isoformat() for d in range(DAYS)]
    backfill, nightly = tmp_path / "backfill", tmp_path / "nightly"
    commit_fleet(outcomes, backfill, dates, run_id="backfill")
    for date in dates:  # one run per night, each publishing its date and rebuilding the rollups
        commit_fleet([o for o in outcomes if o.date == date], nightly, [date], run_id=f"night-{date}")
    files = _fleet_files(backfill)
    assert files == _fleet_files(nightly)
    # every daily table has one partition per date, every rollup one file
    for name in FLEET_TABLES:
        assert all(f"{name}/date={d}/part-0.parquet" in files for d in dates), name
        assert f"{rollup_table(name)}/part-0.parquet" in files, name
    # the rollups cover every date: the all-dates summary counts every window once
    summary = read_table(str(backfill), rollup_table("fleet_summary")).to_pylist()
    everything = [r for r in summary if r["period"] == "all"]
    assert len(everything) == 1 and everything[0]["jobs"] == len(outcomes)
    assert sum(r["jobs"] for r in summary if r["period"] == "week") == len(outcomes)


def test_daily_partitions_are_readable_as_one_hive_table(tmp_path):
    outcomes = random_outcomes(seed=29, days=2, jobs_per_day=5)
    dates = [(START + dt.timedelta(days=d)).isoformat() for d in range(2)]
    commit_fleet(outcomes, tmp_path, dates)
    daily = read_table(str(tmp_path), "fleet_summary").to_pandas()
    assert sorted(str(d) for d in daily["date"]) == dates
    assert (daily["period"] == "day").all() and list(daily["jobs"]) == [5, 5]
    schema = pq.read_schema(tmp_path / "fleet_host" / f"date={dates[0]}" / "part-0.parquet")
    assert schema.names == FLEET_TABLES["fleet_host"].names
