"""Fleet statistics: exact, mergeable CombineFns over per-job results (METHOD.md section 6).

In: one `JobFacts` per job window (job_facts.py: what the per-job tables say about one job on one
date: its status, S, per-step S, per-optype S_t, per-worker S_w with hosts, and the
root-cause verdict). Out: the fleet tables of schemas/fleet.py.

Why exact: the same fleet tables must come out whether a date range is processed in
one backfill or night by night and merged (5 months = 150 nightly runs). Floating-point
sums depend on the order of addition, so every accumulator here holds integers only:
sums are fixed-point (GPU-hours in micro-GPU-hours, ratios in 1e-9), distributions are
sparse integer histograms of bin width HISTOGRAM_BIN_WIDTH, and distinct jobs are sets.
Merging is then associative and commutative to the last bit, and the accumulators
serialise to deterministic JSON (`fleet_state`), from which weekly, monthly and
all-dates rollups are rebuilt without reading a single trace (rollups.py).

Where the tables are computed:
- per date, in the batch pipeline: `AggregateFleet` = CombinePerKey(date, FleetStatsFn),
  writing each daily table and the day's serialised accumulators;
- across dates, by `rollups.rollup_fleet` (called by `strag report` and after the batch commit):
  it merges the `fleet_state` rows of all dates with the same CombineFns.
"""
from __future__ import annotations

import collections
import datetime as dt
import json
import math
from typing import Iterable, Mapping

import apache_beam as beam
import numpy as np
import pyarrow as pa

from schemas.fleet import (
    CAUSES,
    FLEET_SCHEMA_VERSION,
    FLEET_STATE_SCHEMA,
    FLEET_STATE_TABLE,
    FLEET_TABLES,
    HISTOGRAM_BIN_WIDTH,
    OPTYPE_CATEGORIES,
)
from schemas.tables import KEPT_BY_MODEL
from transforms.batch.job_facts import STATUSES, JobFacts, as_facts
from transforms.whatif.result import STRAGGLING_THRESHOLD

__all__ = [
    "FleetStatsFn",
    "SummaryFn",
    "DistributionFn",
    "OptypeFn",
    "SizeFn",
    "CauseFn",
    "HostFn",
    "PositionFn",
    "CoverageFn",
    "AggregateFleet",
    "fleet_tables",
    "period_table",
    "state_rows",
    "Tally",
    "TABLE_FNS",
    "require_every_table",
]

_BINS_PER_UNIT = round(1 / HISTOGRAM_BIN_WIDTH)
_RATIO_SCALE = 10**9      # fixed-point unit of S, S_t, S_w sums: 1e-9
_HOURS_SCALE = 10**6      # fixed-point unit of GPU-hours: 1e-6 GPU-hour
_MOMENT_SCALE = 10**6     # fixed-point unit of the correlation's x = log2(GPUs) and y = S


# ---------------------------------------------------------------------------
# Exact accumulator


def _fixed(value: float, scale: int) -> int:
    """value in fixed point: round(value * scale) as an exact Python int."""
    return int(round(float(value) * scale))


def _bins(values: np.ndarray) -> np.ndarray:
    return np.floor(np.asarray(values, dtype=np.float64) * _BINS_PER_UNIT).astype(np.int64)


class Tally:
    """Integer-only accumulator: keyed sums and maxima, sparse histograms, keyed sets.

    Keys are tuples of str/int/bool. Every operation is exact, so merging tallies in any
    grouping and order gives identical contents (and identical `to_state()` JSON).
    """

    __slots__ = ("sums", "maxima", "histograms", "sets")

    def __init__(self):
        self.sums: dict[tuple, collections.Counter] = {}
        self.maxima: dict[tuple, dict[str, int]] = {}
        self.histograms: dict[tuple, dict[int, list[int]]] = {}   # key -> bin -> [count, weight]
        self.sets: dict[tuple, set[str]] = {}

    def add(self, key: tuple, **fields: int) -> None:
        self.sums.setdefault(key, collections.Counter()).update(fields)

    def maximum(self, key: tuple, **fields: int) -> None:
        slot = self.maxima.setdefault(key, {})
        for name, value in fields.items():
            slot[name] = value if name not in slot else max(slot[name], value)

    def histogram(self, key: tuple, values, weights: Iterable[int] | None = None) -> None:
        """Count `values` into bins of HISTOGRAM_BIN_WIDTH; weights are fixed-point ints (default 1 each)."""
        values = np.asarray(values, dtype=np.float64).ravel()
        keep = np.isfinite(values)
        bins = _bins(values[keep])
        weight = np.ones(len(values), dtype=object) if weights is None else np.asarray(list(weights), dtype=object)
        slot = self.histograms.setdefault(key, {})
        for index, w in zip(bins.tolist(), weight[keep].tolist()):
            cell = slot.setdefault(index, [0, 0])
            cell[0] += 1
            cell[1] += int(w)

    def members(self, key: tuple, items: Iterable[str]) -> None:
        self.sets.setdefault(key, set()).update(items)

    def merge(self, other: "Tally") -> "Tally":
        for key, fields in other.sums.items():
            self.sums.setdefault(key, collections.Counter()).update(fields)
        for key, fields in other.maxima.items():
            self.maximum(key, **fields)
        for key, bins in other.histograms.items():
            slot = self.histograms.setdefault(key, {})
            for index, (count, weight) in bins.items():
                cell = slot.setdefault(index, [0, 0])
                cell[0] += count
                cell[1] += weight
        for key, items in other.sets.items():
            self.members(key, items)
        return self

    def to_state(self) -> dict:
        """Deterministic JSON-able form: every mapping sorted by key."""
        order = lambda item: json.dumps(item[0])  # noqa: E731 - keys mix str/int/bool; sort by their JSON text
        return {
            "sums": [[list(k), dict(sorted(v.items()))] for k, v in sorted(self.sums.items(), key=order)],
            "maxima": [[list(k), dict(sorted(v.items()))] for k, v in sorted(self.maxima.items(), key=order)],
            "histograms": [[list(k), sorted([b, c, w] for b, (c, w) in v.items())] for k, v in sorted(self.histograms.items(), key=order)],
            "sets": [[list(k), sorted(v)] for k, v in sorted(self.sets.items(), key=order)],
        }

    @classmethod
    def from_state(cls, state: Mapping) -> "Tally":
        tally = cls()
        tally.sums = {tuple(k): collections.Counter(v) for k, v in state["sums"]}
        tally.maxima = {tuple(k): dict(v) for k, v in state["maxima"]}
        tally.histograms = {tuple(k): {b: [c, w] for b, c, w in v} for k, v in state["histograms"]}
        tally.sets = {tuple(k): set(v) for k, v in state["sets"]}
        return tally

    def __eq__(self, other) -> bool:
        return isinstance(other, Tally) and self.to_state() == other.to_state()


# ---------------------------------------------------------------------------
# Reading a tally back as numbers


def _mean(total: int, count: int, scale: int) -> float | None:
    return total / scale / count if count else None


def _quantile(bins: Mapping[int, list[int]] | None, q: float, weighted: bool = False) -> float | None:
    """q-quantile of a histogram, linear inside the bin where the cumulative weight reaches q."""
    if not bins:
        return None
    column = 1 if weighted else 0
    order = sorted(bins)
    total = sum(bins[b][column] for b in order)
    if total <= 0:
        return None
    target = q * total
    cumulative = 0
    for index in order:
        mass = bins[index][column]
        if mass > 0 and cumulative + mass >= target:
            return (index + (target - cumulative) / mass) / _BINS_PER_UNIT
        cumulative += mass
    return (order[-1] + 1) / _BINS_PER_UNIT


def _pearson(moments: Mapping[str, int]) -> float | None:
    """Pearson r from exact fixed-point moments n, sx, sy, sxx, syy, sxy."""
    n = moments.get("n", 0)
    if n < 3:
        return None
    cov = n * moments["sxy"] - moments["sx"] * moments["sy"]
    var_x = n * moments["sxx"] - moments["sx"] ** 2
    var_y = n * moments["syy"] - moments["sy"] ** 2
    if var_x <= 0 or var_y <= 0:
        return None
    return cov / math.sqrt(var_x) / math.sqrt(var_y)


# ---------------------------------------------------------------------------
# One CombineFn per fleet table


class _TableFn(beam.CombineFn):
    """CombineFn over JobFacts whose accumulator is a Tally and whose output is row dicts
    (the table's columns without `period`/`period_start`)."""

    table: str = ""

    def create_accumulator(self) -> Tally:
        return Tally()

    def add_input(self, accumulator: Tally, facts: JobFacts) -> Tally:
        self._add(accumulator, facts)
        return accumulator

    def merge_accumulators(self, accumulators: Iterable[Tally]) -> Tally:
        accumulators = iter(accumulators)
        merged = next(accumulators, None) or Tally()
        for other in accumulators:
            merged.merge(other)
        return merged

    def compact(self, accumulator: Tally) -> Tally:
        # A tally holds only integer cells and sets: nothing to fold further.
        return accumulator

    def extract_output(self, accumulator: Tally) -> list[dict]:
        return self._rows(accumulator)

    def _add(self, tally: Tally, facts: JobFacts) -> None:
        raise NotImplementedError

    def _rows(self, tally: Tally) -> list[dict]:
        raise NotImplementedError


def _gpu_hours_fixed(facts: JobFacts) -> int:
    return _fixed(facts.gpu_hours, _HOURS_SCALE)


def _wasted_fixed(facts: JobFacts) -> int:
    return _fixed(facts.wasted_gpu_hours, _HOURS_SCALE)


def _category_slowdowns(optype_slowdown: Mapping[str, float]) -> dict[str, float]:
    """S per category = 1 + sum of member excesses (S_t - 1): the extra time each category adds."""
    out: dict[str, float] = {}
    for optype, value in optype_slowdown.items():
        if value is None or not math.isfinite(value):
            continue
        category = OPTYPE_CATEGORIES.get(optype, "other")
        out[category] = out.get(category, 1.0) + (value - 1.0)
    return out


class SummaryFn(_TableFn):
    """fleet_summary: counts, GPU-hours, waste, quantiles of S / waste / normalised S_s, r(size, S)."""

    table = "fleet_summary"

    def _add(self, tally: Tally, facts: JobFacts) -> None:
        tally.add((), jobs=1, **{"jobs_" + facts.status: 1})
        if not facts.analysed:
            return
        gpu_hours = _gpu_hours_fixed(facts)
        tally.add(
            (),
            jobs_straggling=int(facts.straggling),
            gpu_hours=gpu_hours,
            wasted_gpu_hours=_wasted_fixed(facts),
            slowdown=_fixed(facts.slowdown, _RATIO_SCALE),
            savings_gpu_hours=_fixed(facts.savings_gpu_hours, _HOURS_SCALE),
        )
        tally.histogram(("slowdown",), [facts.slowdown])
        tally.histogram(("waste",), [facts.waste], [gpu_hours])
        steps = np.asarray(facts.step_slowdown, dtype=np.float64)
        tally.histogram(("step",), steps / facts.slowdown)
        if facts.gpus > 0:
            x = _fixed(math.log2(facts.gpus), _MOMENT_SCALE)
            y = _fixed(facts.slowdown, _MOMENT_SCALE)
            tally.add(("moments",), n=1, sx=x, sy=y, sxx=x * x, syy=y * y, sxy=x * y)

    def _rows(self, tally: Tally) -> list[dict]:
        sums = tally.sums.get((), collections.Counter())
        hist = tally.histograms
        analysed = sums["jobs_analysed"]
        gpu_hours = sums["gpu_hours"] / _HOURS_SCALE
        wasted = sums["wasted_gpu_hours"] / _HOURS_SCALE
        return [
            {
                "jobs": sums["jobs"],
                "jobs_analysed": analysed,
                "jobs_discarded": sums["jobs_discarded"],
                "jobs_quarantined": sums["jobs_quarantined"],
                "jobs_straggling": sums["jobs_straggling"],
                "straggling_share": sums["jobs_straggling"] / analysed if analysed else None,
                "gpu_hours": gpu_hours,
                "wasted_gpu_hours": wasted,
                "waste_gpu_weighted": wasted / gpu_hours if gpu_hours > 0 else None,
                "slowdown_mean": _mean(sums["slowdown"], analysed, _RATIO_SCALE),
                "slowdown_p50": _quantile(hist.get(("slowdown",)), 0.5),
                "slowdown_p90": _quantile(hist.get(("slowdown",)), 0.9),
                "slowdown_p99": _quantile(hist.get(("slowdown",)), 0.99),
                "waste_p50": _quantile(hist.get(("waste",)), 0.5),
                "waste_p90": _quantile(hist.get(("waste",)), 0.9),
                "waste_p99": _quantile(hist.get(("waste",)), 0.99),
                "waste_gpu_p50": _quantile(hist.get(("waste",)), 0.5, weighted=True),
                "waste_gpu_p90": _quantile(hist.get(("waste",)), 0.9, weighted=True),
                "step_normalised_p50": _quantile(hist.get(("step",)), 0.5),
                "step_normalised_p90": _quantile(hist.get(("step",)), 0.9),
                "size_slowdown_pearson": _pearson(tally.sums.get(("moments",), {})),
                "savings_gpu_hours": sums["savings_gpu_hours"] / _HOURS_SCALE,
            }
        ]


class DistributionFn(_TableFn):
    """fleet_distribution: the histograms behind every CDF (S, waste, normalised S_s, S_t per category)."""

    table = "fleet_distribution"

    def _add(self, tally: Tally, facts: JobFacts) -> None:
        if not facts.analysed:
            return
        gpu_hours = [_gpu_hours_fixed(facts)]
        tally.histogram(("slowdown", "job"), [facts.slowdown])
        tally.histogram(("slowdown", "gpu_hours"), [facts.slowdown], gpu_hours)
        tally.histogram(("waste", "job"), [facts.waste])
        tally.histogram(("waste", "gpu_hours"), [facts.waste], gpu_hours)
        tally.histogram(("step_slowdown_normalised", "step"), np.asarray(facts.step_slowdown, np.float64) / facts.slowdown)
        for category, value in sorted(_category_slowdowns(facts.optype_slowdown).items()):
            tally.histogram((f"optype_slowdown:{category}", "job"), [value])

    def _rows(self, tally: Tally) -> list[dict]:
        rows = []
        for (metric, weighting), bins in sorted(tally.histograms.items()):
            column = 1 if weighting == "gpu_hours" else 0
            scale = _HOURS_SCALE if weighting == "gpu_hours" else 1
            total = sum(cell[column] for cell in bins.values())
            cumulative = 0
            for index in sorted(bins):
                count, weight = bins[index]
                mass = bins[index][column]
                cumulative += mass
                rows.append(
                    {
                        "metric": metric,
                        "weighting": weighting,
                        "bin_lower": index / _BINS_PER_UNIT,
                        "bin_upper": (index + 1) / _BINS_PER_UNIT,
                        "count": count,
                        "weight": mass / scale,
                        "cumulative_share": cumulative / total if total else 0.0,
                    }
                )
        return rows


class OptypeFn(_TableFn):
    """fleet_optype: waste by op type and by category (compute / pp-comm / dp-comm / group-comm / other)."""

    table = "fleet_optype"

    def _add(self, tally: Tally, facts: JobFacts) -> None:
        if not facts.analysed or not facts.optype_slowdown:
            return
        values = {(OPTYPE_CATEGORIES.get(t, "other"), t): v for t, v in facts.optype_slowdown.items() if v is not None and math.isfinite(v)}
        values.update({(category, ""): v for category, v in _category_slowdowns(facts.optype_slowdown).items()})
        for key, value in sorted(values.items()):
            tally.add(
                key,
                jobs=1,
                slowdown=_fixed(value, _RATIO_SCALE),
                wasted_gpu_hours=_fixed(facts.gpu_hours * (1.0 - 1.0 / value), _HOURS_SCALE) if value > 0 else 0,
            )
            tally.histogram(key, [value])

    def _rows(self, tally: Tally) -> list[dict]:
        category_waste = sum(max(v["wasted_gpu_hours"], 0) for (c, t), v in tally.sums.items() if t == "")
        rows = []
        for (category, optype), sums in sorted(tally.sums.items()):
            wasted = sums["wasted_gpu_hours"] / _HOURS_SCALE
            rows.append(
                {
                    "category": category,
                    "optype": optype or None,
                    "jobs": sums["jobs"],
                    "slowdown_mean": _mean(sums["slowdown"], sums["jobs"], _RATIO_SCALE),
                    "slowdown_p90": _quantile(tally.histograms.get((category, optype)), 0.9),
                    "wasted_gpu_hours": wasted,
                    "share_of_attributed_waste": (max(wasted, 0) * _HOURS_SCALE / category_waste) if optype == "" and category_waste > 0 else None,
                }
            )
        return rows


def _size_bucket(gpus: int) -> int:
    """Lower edge of the power-of-two bucket holding `gpus` (>= 1)."""
    return 1 << (max(int(gpus), 1).bit_length() - 1)


class SizeFn(_TableFn):
    """fleet_size: S against job size in power-of-two GPU buckets."""

    table = "fleet_size"

    def _add(self, tally: Tally, facts: JobFacts) -> None:
        if not facts.analysed:
            return
        key = (_size_bucket(facts.gpus),)
        tally.add(
            key,
            jobs=1,
            jobs_straggling=int(facts.straggling),
            slowdown=_fixed(facts.slowdown, _RATIO_SCALE),
            gpu_hours=_gpu_hours_fixed(facts),
            wasted_gpu_hours=_wasted_fixed(facts),
        )
        tally.histogram(key, [facts.slowdown])

    def _rows(self, tally: Tally) -> list[dict]:
        return [
            {
                "gpus_lower": lower,
                "gpus_upper": lower * 2,
                "jobs": sums["jobs"],
                "jobs_straggling": sums["jobs_straggling"],
                "slowdown_mean": _mean(sums["slowdown"], sums["jobs"], _RATIO_SCALE),
                "slowdown_p50": _quantile(tally.histograms.get((lower,)), 0.5),
                "slowdown_p90": _quantile(tally.histograms.get((lower,)), 0.9),
                "gpu_hours": sums["gpu_hours"] / _HOURS_SCALE,
                "wasted_gpu_hours": sums["wasted_gpu_hours"] / _HOURS_SCALE,
            }
            for (lower,), sums in sorted(tally.sums.items())
        ]


class CauseFn(_TableFn):
    """fleet_cause: prevalence of each root cause among straggling windows, mean S, savings."""

    table = "fleet_cause"

    def _add(self, tally: Tally, facts: JobFacts) -> None:
        if not facts.straggling:
            return
        tally.add((), straggling=1)
        detected = set(facts.causes) | {facts.cause}
        for cause in sorted(detected):
            tally.add((cause,), jobs=1)
        tally.add(
            (facts.cause,),
            jobs_primary=1,
            slowdown=_fixed(facts.slowdown, _RATIO_SCALE),
            wasted_gpu_hours=_wasted_fixed(facts),
            savings_gpu_hours=_fixed(facts.savings_gpu_hours, _HOURS_SCALE),
        )

    def _rows(self, tally: Tally) -> list[dict]:
        straggling = tally.sums.get((), {}).get("straggling", 0)
        return [
            {
                "cause": cause,
                "jobs": sums["jobs"],
                "jobs_primary": sums["jobs_primary"],
                "share_of_straggling": sums["jobs"] / straggling if straggling else None,
                "slowdown_mean": _mean(sums["slowdown"], sums["jobs_primary"], _RATIO_SCALE),
                "wasted_gpu_hours": sums["wasted_gpu_hours"] / _HOURS_SCALE,
                "savings_gpu_hours": sums["savings_gpu_hours"] / _HOURS_SCALE,
            }
            for (cause,), sums in sorted(((k, v) for k, v in tally.sums.items() if k), key=lambda item: CAUSES.index(item[0][0]))
        ]


def _attributed_workers(facts: JobFacts):
    """(dp_rank, stage, host, S_w) of workers with a finite S_w."""
    slowdown = np.asarray(facts.worker_slowdown, dtype=np.float64)
    for index in np.flatnonzero(np.isfinite(slowdown)):
        yield int(facts.worker_dp_rank[index]), int(facts.worker_stage[index]), facts.worker_host[index], float(slowdown[index])


class HostFn(_TableFn):
    """fleet_host: per machine across jobs, and the repeat offenders (implicated in >= 2 distinct jobs)."""

    table = "fleet_host"

    def _add(self, tally: Tally, facts: JobFacts) -> None:
        if not facts.analysed:
            return
        for host in sorted(set(h for h in facts.worker_host if h)):
            tally.add((host,), job_windows=1)
        for _, _, host, value in _attributed_workers(facts):
            if not host:
                continue
            fixed = _fixed(value, _RATIO_SCALE)
            tally.add((host,), worker_windows=1, slowdown=fixed, straggling_workers=int(value >= STRAGGLING_THRESHOLD))
            tally.maximum((host,), slowdown=fixed)
        for host in set(facts.implicated_hosts):
            tally.members((host,), [facts.job_id])

    def _rows(self, tally: Tally) -> list[dict]:
        rows = []
        for key in sorted(set(tally.sums) | set(tally.sets)):
            sums = tally.sums.get(key, collections.Counter())
            jobs = sorted(tally.sets.get(key, ()))
            maximum = tally.maxima.get(key, {}).get("slowdown")
            rows.append(
                {
                    "host": key[0],
                    "job_windows": sums["job_windows"],
                    "worker_windows": sums["worker_windows"],
                    "slowdown_mean": _mean(sums["slowdown"], sums["worker_windows"], _RATIO_SCALE),
                    "slowdown_max": maximum / _RATIO_SCALE if maximum is not None else None,
                    "straggling_workers": sums["straggling_workers"],
                    "implicated_jobs": len(jobs),
                    "repeat_offender": len(jobs) >= 2,
                    "implicated_job_ids": jobs,
                }
            )
        return rows


class PositionFn(_TableFn):
    """fleet_position: S_w per (dp_rank, stage) position across jobs."""

    table = "fleet_position"

    def _add(self, tally: Tally, facts: JobFacts) -> None:
        if not facts.analysed:
            return
        for dp_rank, stage, _, value in _attributed_workers(facts):
            key = (dp_rank, stage, stage == facts.pp_size - 1)
            tally.add(key, worker_windows=1, slowdown=_fixed(value, _RATIO_SCALE), straggling=int(value >= STRAGGLING_THRESHOLD))

    def _rows(self, tally: Tally) -> list[dict]:
        return [
            {
                "dp_rank": dp_rank,
                "stage": stage,
                "last_stage": last,
                "worker_windows": sums["worker_windows"],
                "slowdown_mean": _mean(sums["slowdown"], sums["worker_windows"], _RATIO_SCALE),
                "straggling_share": sums["straggling"] / sums["worker_windows"] if sums["worker_windows"] else None,
            }
            for (dp_rank, stage, last), sums in sorted(tally.sums.items())
        ]


class CoverageFn(_TableFn):
    """fleet_coverage: job windows (and their GPU-hours) by status and reason; for the analysed ones, how
    many only the model keeps (its untraced time or carried arrivals; METHOD.md would discard them) and the mean S of the model
    and of METHOD.md."""

    table = "fleet_coverage"

    def _add(self, tally: Tally, facts: JobFacts) -> None:
        key = (facts.status, facts.reason if not facts.analysed else "", facts.source_format)
        tally.add(key, jobs=1, gpu_hours=_gpu_hours_fixed(facts))
        if facts.analysed:   # the model's S and METHOD.md's beside it, and how many METHOD alone would discard
            tally.add(key, kept_by_model=int(facts.kept_by in KEPT_BY_MODEL), slowdown=_fixed(facts.slowdown, _RATIO_SCALE))
            if math.isfinite(facts.slowdown_method):
                tally.add(key, method_windows=1, slowdown_method=_fixed(facts.slowdown_method, _RATIO_SCALE))

    def _rows(self, tally: Tally) -> list[dict]:
        order = {status: i for i, status in enumerate(STATUSES)}
        return [
            {"status": status, "reason": reason, "source_format": source, "jobs": sums["jobs"],
             "gpu_hours": sums["gpu_hours"] / _HOURS_SCALE,
             "kept_by_model": sums["kept_by_model"] if status == "analysed" else None,
             "slowdown_mean": _mean(sums["slowdown"], sums["jobs"], _RATIO_SCALE) if status == "analysed" else None,
             "slowdown_method_mean": _mean(sums["slowdown_method"], sums["method_windows"], _RATIO_SCALE)}
            for (status, reason, source), sums in sorted(tally.sums.items(),
                                                         key=lambda item: (order[item[0][0]], item[0][1], item[0][2]))
        ]


TABLE_FNS: tuple[_TableFn, ...] = (SummaryFn(), DistributionFn(), OptypeFn(), SizeFn(), CauseFn(), HostFn(), PositionFn(), CoverageFn())
if tuple(fn.table for fn in TABLE_FNS) != tuple(FLEET_TABLES):
    raise RuntimeError("transforms/batch/fleet_stats.py needs one CombineFn per table of schemas/fleet.py FLEET_TABLES, in that order")


class FleetStatsFn(beam.CombineFn):
    """Every fleet table in one pass: the accumulator is {table name: Tally}.

    extract_output gives {table name: list of row dicts} (columns without the period);
    `fleet_tables` turns it into Arrow tables for one period.
    """

    def create_accumulator(self) -> dict[str, Tally]:
        return {fn.table: fn.create_accumulator() for fn in TABLE_FNS}

    def add_input(self, accumulator: dict[str, Tally], facts: JobFacts) -> dict[str, Tally]:
        for fn in TABLE_FNS:
            fn.add_input(accumulator[fn.table], facts)
        return accumulator

    def merge_accumulators(self, accumulators: Iterable[dict[str, Tally]]) -> dict[str, Tally]:
        accumulators = list(accumulators)
        return {fn.table: fn.merge_accumulators([a[fn.table] for a in accumulators]) for fn in TABLE_FNS}

    def compact(self, accumulator: dict[str, Tally]) -> dict[str, Tally]:
        return {fn.table: fn.compact(accumulator[fn.table]) for fn in TABLE_FNS}

    def extract_output(self, accumulator: dict[str, Tally]) -> dict[str, list[dict]]:
        return {fn.table: fn.extract_output(accumulator[fn.table]) for fn in TABLE_FNS}

    @staticmethod
    def to_state(accumulator: dict[str, Tally]) -> dict[str, str]:
        """{table: deterministic JSON text of its accumulator}."""
        return {name: json.dumps(tally.to_state(), separators=(",", ":")) for name, tally in accumulator.items()}

    @staticmethod
    def from_state(state: Mapping[str, str]) -> dict[str, Tally]:
        require_every_table(state)
        return {name: Tally.from_state(json.loads(state[name])) for name in FLEET_TABLES}


# ---------------------------------------------------------------------------
# Tables and state rows


def require_every_table(state: Mapping[str, str], date: dt.date | None = None) -> None:
    """Raise ValueError when a date's fleet_state lacks the accumulator of some fleet table."""
    missing = set(FLEET_TABLES) - set(state)
    if missing:
        where = "" if date is None else f" of {date}"
        raise ValueError(f"fleet_state{where} lacks the accumulators of {sorted(missing)}: rerun `strag batch` for that date")


def fleet_tables(rows: Mapping[str, list[dict]], period: str, period_start: dt.date) -> dict[str, pa.Table]:
    """Arrow tables (schemas/fleet.py) of FleetStatsFn output for one period."""
    return {name: period_table(name, rows.get(name, []), period, period_start) for name in FLEET_TABLES}


def period_table(name: str, rows: list[dict], period: str, period_start: dt.date) -> pa.Table:
    """The Arrow table (schemas/fleet.py) of one fleet table's rows for one period."""
    return pa.Table.from_pylist([{"period": period, "period_start": period_start, **row} for row in rows],
                                schema=FLEET_TABLES[name])


def state_rows(accumulator: Mapping[str, Tally], date: dt.date) -> pa.Table:
    """The fleet_state table of one date: one row per fleet table, its accumulator as JSON."""
    state = FleetStatsFn.to_state(accumulator)
    return pa.Table.from_pylist(
        [{"period_start": date, "table": name, "state_version": FLEET_SCHEMA_VERSION, "state_json": state[name]} for name in FLEET_TABLES],
        schema=FLEET_STATE_SCHEMA,
    )


class _AccumulateFleet(FleetStatsFn):
    """FleetStatsFn whose output is the merged accumulator itself: the daily step needs
    both the tables and the serialisable state."""

    def extract_output(self, accumulator: dict[str, Tally]) -> dict[str, Tally]:
        return accumulator


def _daily_tables(item: tuple[str, dict[str, Tally]]):
    iso, accumulator = item
    date = dt.date.fromisoformat(iso)
    for name, table in fleet_tables(FleetStatsFn().extract_output(accumulator), "day", date).items():
        yield name, iso, table
    yield FLEET_STATE_TABLE, iso, state_rows(accumulator, date)


class AggregateFleet(beam.PTransform):
    """PCollection[JobFacts | JobOutcome] -> PCollection[(table name, date ISO string, pa.Table)].

    Per date: every fleet table with period "day", plus the date's fleet_state rows
    (the serialised accumulators the rollups are rebuilt from). A JobOutcome (the batch
    pipeline's per-window element) is read through job_facts_from_tables.
    """

    def expand(self, jobs):
        return (
            jobs
            | "ToJobFacts" >> beam.FlatMap(as_facts)
            # ISO text, not date objects: Beam's deterministic key coder has no date type
            | "KeyByDate" >> beam.Map(lambda facts: (facts.date.isoformat(), facts))
            | "CombinePerDate" >> beam.CombinePerKey(_AccumulateFleet())
            | "ToDailyTables" >> beam.FlatMap(_daily_tables)
        )
