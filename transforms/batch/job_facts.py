"""What the fleet statistics read from one job window (METHOD.md section 6's inputs): `JobFacts`,
made from the window's per-job tables (a batch JobOutcome's, or the tables read back from an
output folder, cut into windows). Arrow and numpy only; fleet_stats.py accumulates them."""
from __future__ import annotations

import dataclasses
import datetime as dt
import math
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.fleet import CAUSES
from transforms.whatif.result import STRAGGLING_THRESHOLD, discrepancy_discards

__all__ = ["JobFacts", "STATUSES", "job_facts_from_tables", "window_facts", "as_facts"]


STATUSES = ("analysed", "discarded", "quarantined")


@dataclasses.dataclass(frozen=True)
class JobFacts:
    """What the fleet statistics need from one job window.

    status: "analysed" (kept for statistics), "discarded" (replay off by more than 5% either way) or
    "quarantined" (bad input, failed analysis); `reason` says why for the latter two.
    gpu_hours: GPUs x wall-clock hours of the window. slowdown: S (NaN unless analysed);
    slowdown_method, kept_by: METHOD.md's S beside it, and which rule kept the window.
    step_slowdown: S_s per sampled step. optype_slowdown: S_t per attributed optype (empty
    when S < 1.03). Worker arrays are aligned, one entry per (dp_rank, stage) worker;
    worker_slowdown is S_w (NaN when not attributed). cause/causes/implicated_hosts come
    from the root-cause verdict; savings_gpu_hours from the replay of its fix.
    """

    job_id: str
    date: dt.date
    status: str
    reason: str = ""
    gpus: int = 0
    gpu_hours: float = 0.0
    slowdown: float = math.nan
    step_slowdown: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    optype_slowdown: Mapping[str, float] = dataclasses.field(default_factory=dict)
    pp_size: int = 1
    worker_dp_rank: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    worker_stage: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    worker_host: tuple[str, ...] = ()
    worker_slowdown: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    cause: str = "none"
    causes: tuple[str, ...] = ()
    implicated_hosts: tuple[str, ...] = ()
    savings_gpu_hours: float = 0.0
    source_format: str = "lake"     # schemas/raw.py SOURCE_FORMATS
    slowdown_method: float = math.nan   # METHOD.md's S (no untraced time modelled); NaN: not recorded
    kept_by: str = ""                   # analysed: schemas.tables.KEPT_BY, which rule kept the window

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"job {self.job_id!r} on {self.date}: status {self.status!r} is not one of {STATUSES}")
        if self.status == "analysed" and not (math.isfinite(self.slowdown) and self.slowdown > 0):
            raise ValueError(f"job {self.job_id!r} on {self.date}: analysed window needs a finite slowdown > 0, got {self.slowdown!r}")
        if self.cause not in CAUSES or any(c not in CAUSES for c in self.causes):
            raise ValueError(f"job {self.job_id!r} on {self.date}: unknown cause in {self.cause!r} / {self.causes!r}; known: {CAUSES}")
        sizes = {len(self.worker_dp_rank), len(self.worker_stage), len(self.worker_host), len(self.worker_slowdown)}
        if len(sizes) != 1:
            raise ValueError(f"job {self.job_id!r} on {self.date}: worker arrays differ in length {sorted(sizes)}")

    @property
    def analysed(self) -> bool:
        return self.status == "analysed"

    @property
    def straggling(self) -> bool:
        return self.analysed and self.slowdown >= STRAGGLING_THRESHOLD

    @property
    def waste(self) -> float:
        """1 - 1/S: the fraction of the window's GPU time lost to stragglers."""
        return 1.0 - 1.0 / self.slowdown

    @property
    def wasted_gpu_hours(self) -> float:
        return self.gpu_hours * self.waste


def _windows(tables: Mapping[str, pa.Table], date: str | None) -> dict[tuple[str, str], dict[str, pa.Table]]:
    """Per-job tables cut into one {table: rows} per (ISO date, job_id), without their `date` column."""
    windows: dict[tuple[str, str], dict[str, pa.Table]] = {}
    for name, table in tables.items():
        if table is None or table.num_rows == 0:
            continue
        if "date" in table.column_names:
            dates = [d.isoformat() if isinstance(d, dt.date) else str(d) for d in table["date"].to_pylist()]
            table = table.drop_columns(["date"])
        elif date is not None:
            dates = [date] * table.num_rows
        else:
            raise ValueError(f"table {name} has no date column and no date was given")
        rows: dict[tuple[str, str], list[int]] = {}
        for index, key in enumerate(zip(dates, table["job_id"].to_pylist())):
            rows.setdefault(key, []).append(index)
        for key, indices in rows.items():
            windows.setdefault(key, {})[name] = table.take(indices)
    return windows


def job_facts_from_tables(tables: Mapping[str, pa.Table], date: str | dt.date | None = None) -> list[JobFacts]:
    """JobFacts of every job window in per-job tables (schemas/tables.py + job_cause).

    tables: table name -> rows, either as read from the output URL (with a `date` column)
    or as one window's JobOutcome tables (no `date` column: pass `date`). Windows are the
    ones `coverage` or job_summary name (a window only in job_summary gets its status from
    `discarded`); each is read by window_facts. Out: JobFacts sorted by (date, job_id).
    """
    iso = date.isoformat() if isinstance(date, dt.date) else date
    out = []
    for (window_date, job_id), window in sorted(_windows(tables, iso).items()):
        if "coverage" not in window:
            if "job_summary" not in window:
                continue
            discarded = bool(window["job_summary"]["discarded"][0].as_py())
            window["coverage"] = pa.Table.from_pylist([{"job_id": job_id, "status": "discarded" if discarded else "analysed"}])
        out.append(window_facts(window, window_date))
    return out


def window_facts(tables: Mapping[str, pa.Table], date: str) -> JobFacts | None:
    """JobFacts of ONE job window's tables (a batch JobOutcome's, or one window cut out by
    job_facts_from_tables), read with Arrow alone; None when `coverage` does not hold
    exactly one row (use job_facts_from_tables)."""
    coverage = tables.get("coverage")
    if coverage is None or coverage.num_rows != 1:
        return None
    row = coverage.to_pylist()[0]
    job_id = row["job_id"]
    facts: dict[str, Any] = {"job_id": job_id, "date": dt.date.fromisoformat(date), "status": row["status"],
                             "reason": row.get("reason_code") or "", "source_format": row.get("source_format") or "lake"}
    if row.get("gpus") is not None:
        facts["gpus"] = int(row["gpus"])
    if row.get("gpu_hours") is not None and math.isfinite(row["gpu_hours"]):
        facts["gpu_hours"] = float(row["gpu_hours"])

    def rows(name: str) -> pa.Table | None:
        table = tables.get(name)
        if table is None or table.num_rows == 0:
            return None
        if set(pc.unique(table["job_id"]).to_pylist()) != {job_id}:
            raise ValueError(f"window {date} {job_id}: table {name} holds rows of other jobs")
        return table

    summary = rows("job_summary")
    if summary is not None:
        head = summary.slice(0, 1).to_pylist()[0]
        facts.update(gpus=int(head["gpus"]), gpu_hours=float(head["gpu_hours"]), pp_size=int(head["pp_size"]))
        if facts["status"] == "analysed":
            facts["slowdown"] = float(head["slowdown"])
            if head.get("slowdown_method") is not None:
                facts["slowdown_method"] = float(head["slowdown_method"])
            # files written before kept_by existed: METHOD's own rule on the recorded discrepancy
            facts["kept_by"] = head.get("kept_by") or ("untraced-model" if discrepancy_discards(float(head["launch_slowdown"]))
                                                       else "method")
    if facts["status"] == "analysed":
        steps = rows("step_slowdown")
        if steps is not None:
            steps = steps.take(pc.sort_indices(steps, [("step", "ascending")]))
            facts["step_slowdown"] = steps["slowdown"].to_numpy().astype(np.float64)
        optypes = rows("optype_attribution")
        if optypes is not None:
            optypes = optypes.filter(pc.is_null(optypes["step"]))
            if optypes.num_rows:
                names = pc.cast(optypes["optype"], pa.string()).to_pylist()
                facts["optype_slowdown"] = dict(zip(names, (float(v) for v in optypes["slowdown"].to_pylist())))
        workers = rows("worker_attribution")
        if workers is not None:
            workers = workers.take(pc.sort_indices(workers, [("dp_rank", "ascending"), ("stage", "ascending")]))
            facts["worker_dp_rank"] = workers["dp_rank"].to_numpy().astype(np.int64)
            facts["worker_stage"] = workers["stage"].to_numpy().astype(np.int64)
            facts["worker_host"] = tuple("" if h is None else str(h) for h in workers["host"].to_pylist())
            facts["worker_slowdown"] = pc.fill_null(pc.cast(workers["slowdown_worker"], pa.float64()), math.nan).to_numpy()
        causes = rows("job_cause")
        if causes is not None:
            verdict = causes.slice(0, 1).to_pylist()[0]
            savings = verdict["savings_gpu_hours"]
            facts.update(cause=verdict["cause"], causes=tuple(verdict["causes"]),
                         implicated_hosts=tuple(verdict["implicated_hosts"]),
                         savings_gpu_hours=float(savings) if savings is not None and savings == savings else 0.0)
    return JobFacts(**facts)


def as_facts(element) -> Iterable[JobFacts]:
    """JobFacts as they are, or the facts of a batch JobOutcome (its per-job tables and date)."""
    if isinstance(element, JobFacts):
        yield element
        return
    facts = window_facts(element.tables, element.date)
    if facts is not None:
        yield facts
    else:
        yield from job_facts_from_tables(element.tables, element.date)
