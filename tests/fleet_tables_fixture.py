"""Hand-built per-job output tables (schemas/tables.py + job_cause) for fleet and report tests.

`random_outcomes` makes JobOutcome elements as the batch pipeline's analysis step would:
plausible slowdowns, per-step values, worker / stage / DP-rank / op-type attributions
whose shape follows the cause (one hot cell, a hot last stage, scattered cells), and
quarantined or discarded windows. `commit_fleet` runs AggregateFleet + CommitTables on
them, the way pipelines/batch.py wires the fleet step, so tests read real published tables.
"""
from __future__ import annotations

import datetime as dt
import json
import pathlib

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.testing.test_pipeline import TestPipeline

from schemas.fleet import FLEET_TABLE_SPECS, JOB_CAUSE_SCHEMA
from schemas.tables import BATCH_TABLES
from transforms.batch.commit import CommitConfig, CommitTables
from transforms.batch.elements import JobOutcome, JobStats
from transforms.batch.fleet_stats import AggregateFleet
from transforms.batch.rollups import fleet_rollup_tables

START = dt.date(2024, 3, 4)  # a Monday
OPTYPES = ("forward-compute", "backward-compute", "forward-pp-comm", "backward-pp-comm", "params-all-gather", "grads-reduce-scatter", "optimizer")
CAUSE_CHOICES = ("individual-worker", "stage-imbalance", "sequence-imbalance", "python-gc", "communication", "unexplained")


def _table(name: str, rows: list[dict]) -> pa.Table:
    schema = JOB_CAUSE_SCHEMA if name == "job_cause" else BATCH_TABLES[name].schema
    return pa.Table.from_pylist(rows, schema=schema)


def _outcome(rng: np.random.Generator, job_id: str, date: dt.date, hosts: list[str]) -> JobOutcome:
    roll = rng.random()
    dp, pp = int(rng.choice([2, 4, 8])), int(rng.choice([1, 2, 4]))
    gpus = dp * pp * int(rng.choice([4, 8]))
    start = dt.datetime.combine(date, dt.time(1), tzinfo=dt.timezone.utc)
    hours = float(rng.uniform(2, 20))
    gpu_hours = gpus * hours
    coverage = {"job_id": job_id, "status": "analysed", "reason_code": None, "reason": None, "has_manifest": True, "trace_files": dp * pp,
                "rows_read": 1000, "rows_quarantined": 0, "gpus": gpus, "gpu_hours": gpu_hours, "launch_slowdown": None,
                "source_format": "lake"}
    stats = JobStats(job_id, date.isoformat(), "analysed")
    if roll < 0.08:
        coverage.update(status="quarantined", reason_code="missing-manifest", reason="no manifest for the window", has_manifest=False)
        return JobOutcome(job_id, date.isoformat(), {"coverage": _table("coverage", [coverage])}, JobStats(job_id, date.isoformat(), "quarantined"))
    discarded = roll < 0.15
    straggling = rng.random() < 0.45
    slowdown = float(1.1 + rng.lognormal(-2.0, 0.7)) if straggling else float(1.0 + rng.uniform(0.0, 0.09))
    cause = str(rng.choice(CAUSE_CHOICES)) if straggling else "none"
    launch = float(rng.uniform(1.06, 1.2)) if discarded else float(rng.uniform(1.0, 1.03))
    coverage.update(launch_slowdown=launch)
    if discarded:
        coverage.update(status="discarded", reason_code="replay-discrepancy", reason="replay discrepancy above 5%")
    steps = np.arange(100, 100 + int(rng.integers(6, 14)))
    ideal = float(rng.uniform(2, 8))
    step_slowdown = np.clip(slowdown * rng.normal(1.0, 0.02, len(steps)), 1.0, None)
    attributed = slowdown >= 1.03
    worker_host = [hosts[int(i)] for i in rng.integers(0, len(hosts), dp * pp)]
    dp_rank, stage = np.divmod(np.arange(dp * pp), pp)
    by_dp = np.ones(dp) + rng.uniform(0, 0.02, dp)
    by_stage = np.ones(pp) + rng.uniform(0, 0.02, pp)
    if cause == "individual-worker":
        by_dp[int(rng.integers(dp))] = slowdown
    elif cause == "stage-imbalance" and pp > 1:
        by_stage[-1] = slowdown
    else:
        by_dp += rng.uniform(0, slowdown - 1, dp)
        by_stage += rng.uniform(0, slowdown - 1, pp)
    worker_slowdown = np.minimum(by_dp[dp_rank], by_stage[stage])
    if cause == "individual-worker":
        worker_slowdown[int(np.argmax(by_dp[dp_rank] * (stage == 0)))] = slowdown
        by_stage[0] = max(by_stage[0], slowdown)
    tables = {
        "coverage": [coverage],
        "job_summary": [{
            "job_id": job_id, "gpus": gpus, "dp_size": dp, "pp_size": pp, "tp_size": gpus // (dp * pp), "dsp_size": 1, "vpp_size": 1,
            "world_size": gpus, "parallelism": f"dp{dp}-pp{pp}", "model_family": "dense", "context_length": 4096,
            "start_time": start, "end_time": start + dt.timedelta(hours=hours), "n_steps": len(steps), "n_ops": 1000,
            "step_time_observed": ideal * slowdown * launch, "step_time": ideal * slowdown, "step_time_ideal": ideal, "slowdown": slowdown,
            "waste": 1 - 1 / slowdown, "gpu_hours": gpu_hours, "wasted_gpu_hours": gpu_hours * (1 - 1 / slowdown), "launch_slowdown": launch,
            "discarded": discarded, "discard_reason": "replay discrepancy above 5%" if discarded else None, "straggling": slowdown >= 1.1,
            "attributed": attributed, "m_w": 0.9 if cause == "individual-worker" else 0.05, "m_w_add": None,
            "m_s": 0.8 if cause == "stage-imbalance" else 0.02, "m_s_add": None, "source_format": "lake",
        }],
        "step_slowdown": [{"job_id": job_id, "step": int(s), "step_time_observed": ideal * v * launch, "step_time": ideal * v,
                           "step_time_ideal": ideal, "slowdown": float(v)} for s, v in zip(steps, step_slowdown)],
        "worker_attribution": [{"job_id": job_id, "dp_rank": int(d), "stage": int(p), "rank": int(i), "host": worker_host[i],
                                "slowdown_dp": float(by_dp[d]) if attributed else None, "slowdown_stage": float(by_stage[p]) if attributed else None,
                                "slowdown_worker": float(worker_slowdown[i]) if attributed else None, "in_mw_set": bool(i == 0) if attributed else None}
                               for i, (d, p) in enumerate(zip(dp_rank, stage))],
        "dp_attribution": [], "stage_attribution": [], "optype_attribution": [],
    }
    if attributed:
        for name, column, values in (("dp_attribution", "dp_rank", by_dp), ("stage_attribution", "stage", by_stage)):
            for index, value in enumerate(values):
                tables[name].append({"job_id": job_id, column: index, "step": None, "slowdown": float(value)})
                for s, factor in zip(steps, step_slowdown / slowdown):
                    tables[name].append({"job_id": job_id, column: index, "step": int(s), "slowdown": float(1 + (value - 1) * factor)})
        share = rng.dirichlet(np.ones(len(OPTYPES)) * 0.5) * (slowdown - 1)
        if cause == "communication":
            share = np.roll(np.sort(share), 3)
        for optype, excess in zip(OPTYPES, share):
            tables["optype_attribution"].append({"job_id": job_id, "optype": optype, "step": None, "slowdown": float(1 + excess)})
    if not discarded:
        implicated = [0] if cause == "individual-worker" else []
        tables["job_cause"] = [{
            "job_id": job_id, "slowdown": slowdown, "cause": cause, "causes": [cause] if straggling else [], "confidence": float(rng.uniform(0.6, 1.0)) if straggling else 1.0,
            "evidence_json": json.dumps({"m_w": tables["job_summary"][0]["m_w"], "m_s": tables["job_summary"][0]["m_s"]}),
            "implicated_dp_ranks": [int(dp_rank[i]) for i in implicated], "implicated_stages": [int(stage[i]) for i in implicated],
            "implicated_hosts": [worker_host[i] for i in implicated],
            "fixed_slowdown": 1.0 + (slowdown - 1) * 0.2 if straggling else None,
            "savings_gpu_hours": gpu_hours * (1 - 1.0 / slowdown) * 0.8 if straggling else None,
            "savings_json": "{}",
        }]
    return JobOutcome(job_id, date.isoformat(), {name: _table(name, rows) for name, rows in tables.items()}, stats)


def random_outcomes(seed: int, days: int, jobs_per_day: int, start: dt.date = START) -> list[JobOutcome]:
    """JobOutcome elements for `days` dates from `start`, job ids unique across dates, 30 shared hosts."""
    rng = np.random.default_rng(seed)
    hosts = [f"host-{i:03d}" for i in range(30)]
    return [
        _outcome(rng, f"job-{day:03d}-{j:02d}", start + dt.timedelta(days=day), hosts)
        for day in range(days)
        for j in range(jobs_per_day)
    ]


def commit_fleet(outcomes: list[JobOutcome], out: pathlib.Path, dates: list[str], run_id: str = "test") -> dict:
    """Publish the per-job tables, the daily fleet tables and the rollups of `outcomes` under `out`."""
    config = CommitConfig(
        out=str(out), dates=tuple(dates), run_id=run_id,
        tables={**BATCH_TABLES, **FLEET_TABLE_SPECS}, finalizers=(fleet_rollup_tables,),
    )
    with TestPipeline(runner="FnApiRunner") as p:
        jobs = p | "Jobs" >> beam.Create(outcomes, reshuffle=False)
        fleet = jobs | "AggregateFleet" >> AggregateFleet()
        (jobs, fleet) | "Commit" >> CommitTables(config)
    return {"out": str(out)}
