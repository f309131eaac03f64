"""Weekly, monthly and all-dates fleet tables rebuilt from every date's serialised accumulators
(`fleet_state`), without reading a trace: the same CombineFns as the nightly tables merge the
daily states (fleet_stats.py), so a backfill and 150 nightly runs give the same rollups."""
from __future__ import annotations

import datetime as dt
import json
from typing import Iterable, Mapping

import pyarrow as pa

from schemas.fleet import FLEET_SCHEMA_VERSION, FLEET_STATE_TABLE, FLEET_TABLES, rollup_table
from transforms.batch.fleet_stats import TABLE_FNS, Tally, period_table, require_every_table

__all__ = ["rollup_fleet", "fleet_rollup_tables", "ROLLUP_PERIODS"]


# Which periods each rollup table is rebuilt for. Spatial and distribution tables only make
# sense over the whole history; the headline, cause and coverage tables also trend.
ROLLUP_PERIODS: dict[str, tuple[str, ...]] = {
    name: (("week", "month", "all") if name in ("fleet_summary", "fleet_cause", "fleet_coverage") else ("all",)) for name in FLEET_TABLES
}


def _period_start(period: str, date: dt.date, first: dt.date) -> dt.date:
    if period == "week":
        return date - dt.timedelta(days=date.weekday())
    if period == "month":
        return date.replace(day=1)
    return first


def rollup_fleet(states: pa.Table | Iterable[Mapping]) -> dict[str, pa.Table]:
    """Merge the daily fleet_state rows into weekly, monthly and all-dates fleet tables.

    In: fleet_state rows (FLEET_STATE_SCHEMA; a table or dicts) of any set of dates; a date
    present twice is an error (two runs published the same partition). Out: {table name:
    Arrow table with period in ROLLUP_PERIODS[name]}, rows ordered by period, period_start.
    """
    rows = states.to_pylist() if isinstance(states, pa.Table) else list(states)
    by_date: dict[dt.date, dict[str, str]] = {}
    for row in rows:
        if row["state_version"] != FLEET_SCHEMA_VERSION:
            raise ValueError(f"fleet_state of {row['period_start']} has version {row['state_version']}, expected {FLEET_SCHEMA_VERSION}: rerun `strag batch` for it")
        slot = by_date.setdefault(row["period_start"], {})
        if row["table"] in slot:
            raise ValueError(f"fleet_state holds two accumulators of {row['table']} for {row['period_start']}")
        slot[row["table"]] = row["state_json"]
    for date, slot in by_date.items():
        require_every_table(slot, date)
    out: dict[str, list[pa.Table]] = {name: [] for name in FLEET_TABLES}
    if not by_date:
        return {name: pa.Table.from_pylist([], schema=schema) for name, schema in FLEET_TABLES.items()}
    first = min(by_date)
    for period in ("week", "month", "all"):
        groups: dict[dt.date, list[dt.date]] = {}
        for date in sorted(by_date):
            groups.setdefault(_period_start(period, date, first), []).append(date)
        # only the tables this period rolls up: each state parsed and merged where it is wanted
        # (the weekly and monthly trends need three small tables, not the spatial ones)
        for fn in (fn for fn in TABLE_FNS if period in ROLLUP_PERIODS[fn.table]):
            for start, dates in sorted(groups.items()):
                merged = fn.merge_accumulators(Tally.from_state(json.loads(by_date[d][fn.table])) for d in dates)
                out[fn.table].append(period_table(fn.table, fn.extract_output(merged), period, start))
    return {name: pa.concat_tables(parts) for name, parts in out.items()}


def fleet_rollup_tables(out: str) -> dict[str, pa.Table]:
    """Commit finalizer: the rollup tables rebuilt from every date's fleet_state under `out`.

    In: the batch output URL (its fleet_state partitions are already published). Out:
    {"fleet_<name>_rollup": table} for every fleet table, ready to publish unpartitioned.
    """
    from schemas.tables import read_table, table_exists

    states = read_table(out, FLEET_STATE_TABLE) if table_exists(out, FLEET_STATE_TABLE) else []
    return {rollup_table(name): table for name, table in rollup_fleet(states).items()}
