"""The Dagster code location: `dagster dev -m orchestration.definitions`.

Settings come from the environment so one definition serves every deployment:
STRAG_LAKE, STRAG_OUT (required at run time), STRAG_REPORTS (optional),
STRAG_PARTITIONS_START (first partition, default 2024-01-01).

- job `strag_daily`: the batch tables and the fleet report for a day or a range of days;
- schedule `strag_nightly`: at 02:00 UTC, yesterday's partition (the last complete day);
- backfills: select a partition range of `strag_daily` (UI, or `dagster job backfill`).
"""
from __future__ import annotations

import datetime as dt

import dagster as dg

from orchestration.assets import StragSettings, batch_tables, fleet_report

__all__ = ["daily_job", "nightly_schedule", "defs", "NIGHTLY_HOUR_UTC"]

NIGHTLY_HOUR_UTC = 2

# Partitioned like its assets (DAILY): Dagster infers it from the selection.
daily_job = dg.define_asset_job(
    "strag_daily",
    selection=dg.AssetSelection.assets(batch_tables, fleet_report),
    description="strag batch + strag report for the selected day(s)",
)


@dg.schedule(job=daily_job, cron_schedule=f"0 {NIGHTLY_HOUR_UTC} * * *", execution_timezone="UTC", name="strag_nightly",
             description="nightly: yesterday's partition of the batch tables, then the fleet report")
def nightly_schedule(context: dg.ScheduleEvaluationContext) -> dg.RunRequest:
    """The tick at 02:00 UTC on day D runs partition D-1, the last complete day."""
    day = context.scheduled_execution_time.astimezone(dt.timezone.utc).date() - dt.timedelta(days=1)
    return dg.RunRequest(partition_key=day.isoformat())   # DAILY's keys are YYYY-MM-DD


defs = dg.Definitions(
    assets=[batch_tables, fleet_report],
    jobs=[daily_job],
    schedules=[nightly_schedule],
    resources={
        "strag": StragSettings(
            lake=dg.EnvVar("STRAG_LAKE"),
            out=dg.EnvVar("STRAG_OUT"),
            reports=dg.EnvVar("STRAG_REPORTS").get_value(default=""),
        )
    },
)
