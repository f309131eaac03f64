"""Fleet CombineFns without a pipeline: add / merge / compact agree, states round-trip,
daily partitions roll up to exactly the one-pass tables, and the numbers are right."""
from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.fleet import CAUSES, FLEET_TABLES, HISTOGRAM_BIN_WIDTH
from transforms.batch.fleet_stats import CauseFn, CoverageFn, FleetStatsFn, HostFn, SummaryFn, fleet_tables, state_rows
from transforms.batch.job_facts import JobFacts, job_facts_from_tables, window_facts
from transforms.batch.rollups import rollup_fleet
from fleet_tables_fixture import random_outcomes

START = dt.date(2024, 1, 1)


def random_facts(rng: np.random.Generator, job_index: int, date: dt.date) -> JobFacts:
    """A plausible job window: mostly analysed, some discarded / quarantined, hosts shared across jobs."""
    roll = rng.random()
    job_id = f"job-{job_index:04d}"
    gpus = int(2 ** rng.integers(7, 13))
    gpu_hours = float(gpus * rng.uniform(0.5, 30.0))
    if roll < 0.08:
        return JobFacts(job_id, date, "quarantined", reason=str(rng.choice(["missing-manifest", "corrupt-parquet"])), gpus=gpus, gpu_hours=gpu_hours)
    if roll < 0.15:
        return JobFacts(job_id, date, "discarded", reason="replay-discrepancy", gpus=gpus, gpu_hours=gpu_hours)
    slowdown = float(1.0 + rng.lognormal(-2.5, 1.0))
    dp, pp = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    dp_rank, stage = np.divmod(np.arange(dp * pp), pp)
    hosts = tuple(f"host-{int(h):03d}" for h in rng.integers(0, 40, dp * pp))
    attributed = slowdown >= 1.03
    worker_slowdown = 1.0 + rng.exponential(slowdown - 1.0, dp * pp) if attributed else np.full(dp * pp, np.nan)
    optypes = {"forward-compute": 1 + rng.exponential(0.1), "backward-compute": 1 + rng.exponential(0.1),
               "forward-pp-comm": 1 + rng.exponential(0.02), "params-all-gather": 1 + rng.exponential(0.02),
               "optimizer": 1.0} if attributed else {}
    straggling = slowdown >= 1.1
    cause = str(rng.choice(CAUSES[:-1])) if straggling else "none"
    implicated = (hosts[int(np.argmax(worker_slowdown))],) if cause == "individual-worker" else ()
    return JobFacts(
        job_id, date, "analysed", gpus=gpus, gpu_hours=gpu_hours, slowdown=slowdown,
        step_slowdown=slowdown * rng.normal(1.0, 0.03, int(rng.integers(5, 40))),
        optype_slowdown=optypes, pp_size=pp, worker_dp_rank=dp_rank, worker_stage=stage,
        worker_host=hosts, worker_slowdown=worker_slowdown, cause=cause,
        causes=(cause,) if straggling else (), implicated_hosts=implicated,
        savings_gpu_hours=float(gpu_hours * (1 - 1 / slowdown) * rng.uniform(0, 1)) if straggling else 0.0,
    )


def random_fleet(seed: int, days: int, jobs_per_day: int) -> list[JobFacts]:
    rng = np.random.default_rng(seed)
    return [random_facts(rng, day * jobs_per_day + j, START + dt.timedelta(days=day)) for day in range(days) for j in range(jobs_per_day)]


def one_pass(fn, facts):
    accumulator = fn.create_accumulator()
    for item in facts:
        accumulator = fn.add_input(accumulator, item)
    return accumulator


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


@pytest.fixture(scope="module")
def fleet():
    return random_fleet(seed=7, days=21, jobs_per_day=12)


def test_add_merge_compact_agree_in_any_grouping(fleet):
    fn = FleetStatsFn()
    whole = fn.compact(one_pass(fn, fleet))
    rng = np.random.default_rng(3)
    for _ in range(3):
        order = rng.permutation(len(fleet))
        cuts = np.sort(rng.choice(np.arange(1, len(fleet)), size=6, replace=False))
        parts = [fn.compact(one_pass(fn, [fleet[i] for i in chunk])) for chunk in np.split(order, cuts)]
        # merge in two levels, like a runner combining bundles then workers
        merged = fn.merge_accumulators([fn.merge_accumulators(parts[:3]), fn.merge_accumulators(parts[3:])])
        assert fn.to_state(merged) == fn.to_state(whole)
        assert fn.extract_output(merged) == fn.extract_output(whole)


def test_state_round_trips_through_json(fleet):
    fn = FleetStatsFn()
    accumulator = one_pass(fn, fleet)
    state = fn.to_state(accumulator)
    assert fn.to_state(fn.from_state(json.loads(json.dumps(state)))) == state


def test_nightly_runs_roll_up_to_the_backfill_byte_for_byte(fleet):
    """150 nightly runs vs one backfill: per-date states merged == one pass over every window."""
    fn = FleetStatsFn()
    dates = sorted({f.date for f in fleet})
    nightly = pa.concat_tables([state_rows(one_pass(fn, [f for f in fleet if f.date == d]), d) for d in dates])
    # the states go through parquet, as they do between runs
    nightly = pq.read_table(io.BytesIO(parquet_bytes(nightly)))
    rollups = rollup_fleet(nightly)
    backfill = fleet_tables(fn.extract_output(one_pass(fn, fleet)), "all", dates[0])
    for name in FLEET_TABLES:
        all_rows = rollups[name].filter(pa.compute.equal(rollups[name]["period"], "all"))
        assert parquet_bytes(all_rows) == parquet_bytes(backfill[name]), name
    # a weekly rollup equals a one-pass over that week's windows
    week = [f for f in fleet if START <= f.date < START + dt.timedelta(days=7)]
    summary = rollups["fleet_summary"].to_pylist()
    first_week = [r for r in summary if r["period"] == "week" and r["period_start"] == START]
    assert first_week == fleet_tables(fn.extract_output(one_pass(fn, week)), "week", START)["fleet_summary"].to_pylist()
    assert sorted({r["period"] for r in summary}) == ["all", "month", "week"]


def test_rollup_rejects_a_date_published_twice(fleet):
    fn = FleetStatsFn()
    day = state_rows(one_pass(fn, fleet[:5]), START)
    with pytest.raises(ValueError, match="two accumulators"):
        rollup_fleet(pa.concat_tables([day, day]))


def test_rollup_rejects_a_date_missing_an_accumulator(fleet):
    """Each period parses only the tables it rolls up (the weekly trend never reads the host or
    position states); a date whose state lacks any table is still refused, naming the date."""
    fn = FleetStatsFn()
    day = state_rows(one_pass(fn, fleet[:5]), START)
    partial = day.filter(pa.compute.not_equal(day["table"], "fleet_host"))
    with pytest.raises(ValueError, match=rf"fleet_state of {START} lacks the accumulators of \['fleet_host'\]"):
        rollup_fleet(partial)


def test_summary_numbers_match_a_direct_computation(fleet):
    row = SummaryFn().extract_output(one_pass(SummaryFn(), fleet))[0]
    analysed = [f for f in fleet if f.status == "analysed"]
    slowdown = np.array([f.slowdown for f in analysed])
    gpu_hours = np.array([f.gpu_hours for f in analysed])
    assert row["jobs"] == len(fleet)
    assert row["jobs_analysed"] == len(analysed)
    assert row["jobs_discarded"] == sum(f.status == "discarded" for f in fleet)
    assert row["jobs_straggling"] == int((slowdown >= 1.1).sum())
    assert row["waste_gpu_weighted"] == pytest.approx((gpu_hours * (1 - 1 / slowdown)).sum() / gpu_hours.sum(), rel=1e-6)
    assert row["slowdown_mean"] == pytest.approx(slowdown.mean(), rel=1e-9)
    for q in (0.5, 0.9):
        assert abs(row[f"slowdown_p{int(q * 100)}"] - np.quantile(slowdown, q)) <= 2 * HISTOGRAM_BIN_WIDTH
    steps = np.concatenate([f.step_slowdown / f.slowdown for f in analysed])
    assert abs(row["step_normalised_p90"] - np.quantile(steps, 0.9)) <= 2 * HISTOGRAM_BIN_WIDTH
    r = np.corrcoef(np.log2([f.gpus for f in analysed]), slowdown)[0, 1]
    assert row["size_slowdown_pearson"] == pytest.approx(r, abs=1e-5)


def test_distribution_cdf_ends_at_one_and_is_monotone(fleet):
    table = fleet_tables(FleetStatsFn().extract_output(one_pass(FleetStatsFn(), fleet)), "all", START)["fleet_distribution"]
    for (metric, weighting), group in table.to_pandas().groupby(["metric", "weighting"]):
        share = group.sort_values("bin_lower")["cumulative_share"].to_numpy()
        assert np.all(np.diff(share) >= 0), metric
        assert share[-1] == pytest.approx(1.0), metric
    metrics = set(table["metric"].to_pylist())
    assert {"slowdown", "waste", "step_slowdown_normalised", "optype_slowdown:compute"} <= metrics


def test_coverage_counts_every_window_once(fleet):
    rows = CoverageFn().extract_output(one_pass(CoverageFn(), fleet))
    assert sum(r["jobs"] for r in rows) == len(fleet)
    quarantined = {r["reason"]: r["jobs"] for r in rows if r["status"] == "quarantined"}
    expected = {}
    for f in fleet:
        if f.status == "quarantined":
            expected[f.reason] = expected.get(f.reason, 0) + 1
    assert quarantined == expected


def _worker_job(job_id, date, hosts, slowdowns, implicated=()):
    n = len(hosts)
    return JobFacts(
        job_id, date, "analysed", gpus=64, gpu_hours=64.0, slowdown=max(slowdowns), step_slowdown=np.array([max(slowdowns)]),
        pp_size=1, worker_dp_rank=np.arange(n), worker_stage=np.zeros(n, int), worker_host=tuple(hosts),
        worker_slowdown=np.array(slowdowns), cause="individual-worker" if implicated else "none",
        causes=("individual-worker",) if implicated else (), implicated_hosts=tuple(implicated),
    )


def test_repeat_offender_needs_two_distinct_jobs():
    day2 = START + dt.timedelta(days=1)
    facts = [
        _worker_job("a", START, ["h1", "h2"], [1.6, 1.0], implicated=["h1"]),
        _worker_job("a", day2, ["h1", "h2"], [1.5, 1.0], implicated=["h1"]),   # same job, next day
        _worker_job("b", day2, ["h2", "h3"], [1.7, 1.0], implicated=["h2"]),
        _worker_job("c", day2, ["h3", "h2"], [1.0, 1.4], implicated=["h2"]),
    ]
    rows = {r["host"]: r for r in HostFn().extract_output(one_pass(HostFn(), facts))}
    assert rows["h1"]["implicated_jobs"] == 1 and not rows["h1"]["repeat_offender"]
    assert rows["h2"]["implicated_job_ids"] == ["b", "c"] and rows["h2"]["repeat_offender"]
    assert rows["h2"]["job_windows"] == 4 and rows["h2"]["straggling_workers"] == 2
    assert rows["h1"]["slowdown_max"] == pytest.approx(1.6)
    assert not rows["h3"]["repeat_offender"]


def test_cause_prevalence_counts_detected_and_primary():
    base = _worker_job("x", START, ["h"], [1.3])
    facts = [
        JobFacts(**{**base.__dict__, "job_id": "s1", "slowdown": 1.3, "cause": "stage-imbalance", "causes": ("stage-imbalance", "python-gc")}),
        JobFacts(**{**base.__dict__, "job_id": "s2", "slowdown": 1.5, "cause": "stage-imbalance", "causes": ("stage-imbalance",)}),
        JobFacts(**{**base.__dict__, "job_id": "g1", "slowdown": 1.2, "cause": "python-gc", "causes": ("python-gc",)}),
        JobFacts(**{**base.__dict__, "job_id": "ok", "slowdown": 1.05, "cause": "none", "causes": ()}),
    ]
    rows = {r["cause"]: r for r in CauseFn().extract_output(one_pass(CauseFn(), facts))}
    assert rows["stage-imbalance"]["jobs"] == 2 and rows["stage-imbalance"]["slowdown_mean"] == pytest.approx(1.4)
    assert rows["python-gc"]["jobs"] == 2 and rows["python-gc"]["jobs_primary"] == 1
    assert rows["python-gc"]["share_of_straggling"] == pytest.approx(2 / 3)
    assert "none" not in rows


def test_job_facts_reject_bad_input_with_the_job_named():
    with pytest.raises(ValueError, match="job 'j9'.*status"):
        JobFacts("j9", START, "finished")
    with pytest.raises(ValueError, match="job 'j9'.*slowdown"):
        JobFacts("j9", START, "analysed", slowdown=math.nan)
    with pytest.raises(ValueError, match="job 'j9'.*unknown cause"):
        JobFacts("j9", START, "analysed", slowdown=1.2, cause="cosmic-rays")


def test_aggregate_fleet_in_a_pipeline_gives_the_daily_tables(fleet):
    import apache_beam as beam
    from apache_beam.testing.test_pipeline import TestPipeline
    from apache_beam.testing.util import assert_that

    from transforms.batch.fleet_stats import AggregateFleet

    small = [f for f in fleet if f.date < START + dt.timedelta(days=2)]
    fn = FleetStatsFn()
    expected = {}
    for date in sorted({f.date for f in small}):
        accumulator = one_pass(fn, [f for f in small if f.date == date])
        for name, table in fleet_tables(fn.extract_output(accumulator), "day", date).items():
            expected[(name, date.isoformat())] = table.to_pylist()
        expected[("fleet_state", date.isoformat())] = state_rows(accumulator, date).to_pylist()

    def check(outputs):
        got = {(name, date): table.to_pylist() for name, date, table in outputs}
        assert got == expected

    with TestPipeline(runner="FnApiRunner") as p:
        assert_that(p | beam.Create(small, reshuffle=False) | AggregateFleet(), check)


def _same_facts(left: JobFacts, right: JobFacts) -> None:
    for field in dataclasses.fields(JobFacts):
        a, b = getattr(left, field.name), getattr(right, field.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), field.name
        elif isinstance(a, float) and math.isnan(a):
            assert math.isnan(b), field.name
        else:
            assert a == b and type(a) is type(b), (field.name, a, b)


def test_facts_of_published_tables_equal_the_facts_of_each_window():
    """Tables of many windows with a `date` column (as read back from the output URL) give, per
    window, the facts the batch took from that window's own tables."""
    outcomes = random_outcomes(seed=5, days=4, jobs_per_day=15)
    assert {o.tables["coverage"]["status"][0].as_py() for o in outcomes} == {"analysed", "discarded", "quarantined"}
    published = {}
    for name in {name for o in outcomes for name in o.tables}:
        parts = [o.tables[name].append_column("date", pa.array([dt.date.fromisoformat(o.date)] * o.tables[name].num_rows, pa.date32()))
                 for o in outcomes if name in o.tables and o.tables[name].num_rows]
        published[name] = pa.concat_tables(parts, promote_options="default")
    read_back = job_facts_from_tables(published)
    expected = sorted((window_facts(o.tables, o.date) for o in outcomes), key=lambda f: (f.date, f.job_id))
    assert [(f.date, f.job_id) for f in read_back] == [(f.date, f.job_id) for f in expected]
    for got, want in zip(read_back, expected):
        _same_facts(got, want)
    assert window_facts({}, "2024-03-04") is None
