"""Read the published tables a report needs, and nothing else.

In: the batch pipeline's output URL (any fsspec URL). Out: pandas frames of the per-job
tables (schemas/tables.py, job_cause), of the fleet rollup tables `fleet_<name>_rollup`
(periods week, month and all; every batch commit rebuilds them from every date's
`fleet_state`, schemas/fleet.py) and of the daily `fleet_summary` partitions. Nothing is
recomputed: a report shows exactly what the batch published.
"""
from __future__ import annotations

import dataclasses
import datetime as dt

import pandas as pd

from schemas.fleet import FLEET_TABLES, JOB_CAUSE_TABLE, rollup_table
from schemas.tables import BATCH_TABLES, read_table, table_exists
from transforms.io.lake import LAKE_PARTS

__all__ = ["ReportData", "ReportDataError", "load_report_data"]


class ReportDataError(RuntimeError):
    """The output URL holds no tables a report can be built from."""


@dataclasses.dataclass
class ReportData:
    """Frames of one output URL. Per-job frames carry a `date` column (datetime.date)."""

    out: str
    jobs: dict[str, pd.DataFrame]            # batch tables + job_cause
    fleet: dict[str, pd.DataFrame]           # fleet table name -> its rollup rows (periods week, month, all)
    daily_summary: pd.DataFrame              # fleet_summary, period "day", one row per date

    def fleet_period(self, table: str, period: str = "all") -> pd.DataFrame:
        frame = self.fleet[table]
        return frame[frame["period"] == period].reset_index(drop=True)

    def job(self, table: str, date: dt.date, job_id: str) -> pd.DataFrame:
        frame = self.jobs[table]
        if frame.empty:
            return frame
        return frame[(frame["date"] == date) & (frame["job_id"] == job_id)].reset_index(drop=True)


def load_report_data(out: str, storage_options: dict | None = None) -> ReportData:
    """Read every table a report needs from `out` (see module docstring)."""
    if not any(table_exists(out, name, storage_options=storage_options) for name in ("coverage", "job_summary")):
        if any(table_exists(out, part, storage_options=storage_options) for part in LAKE_PARTS):
            raise ReportDataError(f"{out} is a lake, not the tables of `strag batch`: give --tables the --out of "
                                  f"`strag batch --lake {out} --from D --to D --out TABLES`")
        raise ReportDataError(f"no coverage or job_summary table under {out}: give --tables the --out of `strag batch` "
                              "(run it first if there is none)")
    missing = [rollup_table(name) for name in FLEET_TABLES if not table_exists(out, rollup_table(name), storage_options=storage_options)]
    if missing:
        raise ReportDataError(f"no {', '.join(missing)} under {out}: these tables were published before the fleet rollups "
                              f"existed; run `strag batch --out {out}` again over their dates")
    jobs = {name: read_table(out, name, storage_options=storage_options).to_pandas() for name in (*BATCH_TABLES, JOB_CAUSE_TABLE)}
    fleet = {name: read_table(out, rollup_table(name), storage_options=storage_options).to_pandas() for name in FLEET_TABLES}
    daily = read_table(out, "fleet_summary", storage_options=storage_options).to_pandas()
    daily = daily[daily["period"] == "day"].sort_values("period_start").reset_index(drop=True)
    return ReportData(out, jobs, fleet, daily)
