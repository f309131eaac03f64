"""Read the published tables a report needs, and nothing else.

In: the batch pipeline's output URL (any fsspec URL). Out: pandas frames of the per-job
tables (schemas/tables.py, job_cause) and the fleet tables (schemas/fleet.py). Fleet
rollups (week / month / all dates) are always rebuilt from the `fleet_state` partitions
with the same CombineFns, so a report is consistent with whatever dates are published;
when `fleet_state` is missing (tables written before the fleet step existed), the fleet
statistics are computed from the per-job tables with those CombineFns instead.
"""
from __future__ import annotations

import dataclasses
import datetime as dt

import fsspec
import pandas as pd
import pyarrow as pa

from schemas.fleet import FLEET_STATE_TABLE, FLEET_TABLES, JOB_CAUSE_SCHEMA, JOB_CAUSE_TABLE
from schemas.tables import BATCH_TABLES, read_table
from transforms.fleet import FleetStatsFn, fleet_tables, job_facts_from_tables, rollup_fleet, state_rows

__all__ = ["ReportData", "ReportDataError", "load_report_data"]


class ReportDataError(RuntimeError):
    """The output URL holds no tables a report can be built from."""


@dataclasses.dataclass
class ReportData:
    """Frames of one output URL. Per-job frames carry a `date` column (datetime.date)."""

    out: str
    jobs: dict[str, pd.DataFrame]            # batch tables + job_cause
    fleet: dict[str, pd.DataFrame]           # fleet table name -> rows of every rollup period
    daily_summary: pd.DataFrame              # fleet_summary, period "day", one row per date
    fleet_source: str                        # "fleet_state" or "per-job tables"

    def fleet_period(self, table: str, period: str = "all") -> pd.DataFrame:
        frame = self.fleet[table]
        return frame[frame["period"] == period].reset_index(drop=True)

    def job(self, table: str, date: dt.date, job_id: str) -> pd.DataFrame:
        frame = self.jobs[table]
        if frame.empty:
            return frame
        return frame[(frame["date"] == date) & (frame["job_id"] == job_id)].reset_index(drop=True)


def _exists(out: str, table: str, storage_options: dict | None) -> bool:
    fs, root = fsspec.core.url_to_fs(f"{out.rstrip('/')}/{table}", **(storage_options or {}))
    return fs.exists(root)


def _read(out: str, table: str, storage_options: dict | None) -> pa.Table:
    if table == JOB_CAUSE_TABLE and not _exists(out, table, storage_options):
        return pa.schema(list(JOB_CAUSE_SCHEMA) + [pa.field("date", pa.date32())]).empty_table()
    return read_table(out, table, storage_options=storage_options)


def load_report_data(out: str, storage_options: dict | None = None) -> ReportData:
    """Read every table a report needs from `out` (see module docstring)."""
    if not _exists(out, "coverage", storage_options) and not _exists(out, "job_summary", storage_options):
        raise ReportDataError(f"no coverage or job_summary table under {out}: run `strag batch --out {out}` first")
    arrow = {name: _read(out, name, storage_options) for name in (*BATCH_TABLES, JOB_CAUSE_TABLE)}
    jobs = {name: table.to_pandas() for name, table in arrow.items()}
    if _exists(out, FLEET_STATE_TABLE, storage_options):
        states = read_table(out, FLEET_STATE_TABLE, storage_options=storage_options)
        daily = read_table(out, "fleet_summary", storage_options=storage_options).to_pandas()
        source = "fleet_state"
    else:
        states, daily = _states_from_jobs(arrow)
        source = "per-job tables"
    fleet = {name: table.to_pandas() for name, table in rollup_fleet(states).items()}
    daily = daily[daily["period"] == "day"].sort_values("period_start").reset_index(drop=True)
    return ReportData(out, jobs, fleet, daily, source)


def _states_from_jobs(arrow: dict[str, pa.Table]) -> tuple[pa.Table, pd.DataFrame]:
    """Per-date fleet states and daily summaries computed from the per-job tables."""
    fn = FleetStatsFn()
    by_date: dict[dt.date, dict] = {}
    for facts in job_facts_from_tables(arrow):
        accumulator = by_date.setdefault(facts.date, fn.create_accumulator())
        fn.add_input(accumulator, facts)
    if not by_date:
        empty = FLEET_TABLES["fleet_summary"].empty_table().to_pandas()
        return [], empty
    states = pa.concat_tables([state_rows(acc, date) for date, acc in sorted(by_date.items())])
    daily = pd.concat([fleet_tables(fn.extract_output(acc), "day", date)["fleet_summary"].to_pandas() for date, acc in sorted(by_date.items())])
    return states, daily
