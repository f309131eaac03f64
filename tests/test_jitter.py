"""The jitter null (transforms/whatif/causes/jitter.py): is a straggling job's S more than its own
step-to-step jitter makes? Checked for calibration on jobs whose only variation is known jitter,
for power on a job with a persistent slow rank, and end to end on real runs."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from schemas.trace import OPTYPES
from transforms.synth import JobSpec, generate_job
from transforms.whatif import compile_job
from transforms.whatif.causes.jitter import DRAWS, jitter_null
from transforms.whatif.causes.signals import BACKWARD, FORWARD, pairs
from transforms.whatif.causes.workers import worker_tests
from transforms.whatif.metrics import analyze_model

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base():
    """A DDP job (4 DP ranks, one stage, 2 microbatches per step, 6 steps) compiled once."""
    job = generate_job(JobSpec(job_id="jn", dp=4, pp=1, microbatches=2, steps=6, sessions=1, seed=11))
    model = compile_job(job.trace, job.meta, "jn")
    return model, *pairs(model)


def _with_rank_steps(model, factor: np.ndarray):
    """A copy of the model with every op at its median over lanes and each rank's compute in each
    step multiplied by factor[step, dp]: identical work on every rank, variation of known kind."""
    out = type(model).__new__(type(model))
    out.__dict__.update(model.__dict__)
    out.__dict__.pop("_ideal_cost", None)
    cost = np.broadcast_to(np.median(model.original_cost, axis=1, keepdims=True), model.original_cost.shape).copy()
    step = np.arange(model.n_lanes) // model.dp_size
    compute = np.isin(model.op_optype, (FORWARD, BACKWARD))
    cost[compute] *= factor[step, model.lane_dp][None, :]
    out.original_cost = cost
    return out


def test_jitter_alone_is_within_the_null_at_the_stated_rate(base):
    """60 jobs whose ranks take turns being slow (independent 15% jitter per rank and step, no
    persistent effect): the null's p-value is about uniform (mean near 0.5) and at alpha = 1%
    at most 3 jobs fall beyond it (expected 0.6; P(X >= 4 | 60, 1%) < 0.5%)."""
    model, forward, backward = base
    p_values = []
    for seed in range(60):
        rng = np.random.default_rng(seed)
        job = _with_rank_steps(model, np.exp(rng.normal(0.0, 0.15, (model.n_steps, model.dp_size))))
        result = analyze_model(job)
        null = jitter_null(job, result, worker_tests(job, forward, backward, alpha=0.01), 0.01)
        assert null.draws == DRAWS and null.slowdown == pytest.approx(result.slowdown)
        p_values.append(null.p_value)
    p_values = np.array(p_values)
    assert (p_values <= 0.01).sum() <= 3
    assert 0.3 <= p_values.mean() <= 0.7


def test_jitter_of_the_optimizer_is_within_the_null_too(base):
    """30 jobs whose compute jitters a little (5%) and whose optimizer step jitters a lot (60% per
    rank and step, independent: CPU ranks sharing cores are contended in every kind of op). The
    null puts the optimizer's variation back too (each op's times, lanes shuffled), so its p-values
    stay about uniform; held at its mean, the optimizer made 24 of these 30 jobs "unexplained"
    structure at the 1% rate."""
    model, forward, backward = base
    optimizer = np.isin(model.op_optype, [OPTYPES.index("optimizer")])
    assert optimizer.any()
    step = np.arange(model.n_lanes) // model.dp_size
    p_values = []
    for seed in range(30):
        rng = np.random.default_rng(100 + seed)
        job = _with_rank_steps(model, np.exp(rng.normal(0.0, 0.05, (model.n_steps, model.dp_size))))
        jitter = np.exp(rng.normal(0.0, 0.6, (model.n_steps, model.dp_size)))
        job.original_cost[optimizer] *= jitter[step, model.lane_dp][None, :]
        result = analyze_model(job)
        null = jitter_null(job, result, worker_tests(job, forward, backward, alpha=0.01), 0.01)
        p_values.append(null.p_value)
    p_values = np.array(p_values)
    assert (p_values <= 0.01).sum() <= 2
    assert 0.25 <= p_values.mean() <= 0.75


def test_a_persistent_slow_rank_is_beyond_its_jitter(base):
    """One rank 1.3x in every step over 2% jitter: S far beyond what the jitter (and no
    persistent offset) makes, p at its least, 1 / (DRAWS + 1)."""
    model, forward, backward = base
    rng = np.random.default_rng(3)
    factor = np.exp(rng.normal(0.0, 0.02, (model.n_steps, model.dp_size)))
    factor[:, 2] *= 1.3
    job = _with_rank_steps(model, factor)
    result = analyze_model(job)
    tests = dataclasses.replace(worker_tests(job, forward, backward, alpha=0.01), tau=0.0)
    null = jitter_null(job, result, tests, 0.01)
    assert result.slowdown > 1.1 and null.p_value == pytest.approx(1.0 / (DRAWS + 1))
    assert not null.within(0.01) and null.quantile < result.slowdown


def test_without_jitter_the_null_is_the_ideal_replay_and_reruns_agree(base):
    """sigma = tau = 0: every draw is the ideal job itself, so S_null is the ideal replay's span over
    its time (computed here from the result); the same call twice gives the same null (seeded)."""
    model, forward, backward = base
    rng = np.random.default_rng(8)
    job = _with_rank_steps(model, np.exp(rng.normal(0.0, 0.1, (model.n_steps, model.dp_size))))
    result = analyze_model(job)
    tests = worker_tests(job, forward, backward, alpha=0.01)
    still = jitter_null(job, result, dataclasses.replace(tests, sigma=0.0, tau=0.0), 0.01)
    ideal_time = result.step_t_nodelay.mean() / result.slowdown
    assert still.median == pytest.approx(result.step_t_noblk.mean() / ideal_time, rel=1e-9)
    assert still.quantile == pytest.approx(still.median, rel=1e-9)
    assert jitter_null(job, result, tests, 0.01) == jitter_null(job, result, tests, 0.01)


def test_no_peers_no_null():
    """One DP rank per stage: the worker test measured no jitter, so there is no null to build."""
    job = generate_job(JobSpec(job_id="pp", dp=1, pp=2, microbatches=4, steps=3, sessions=1, seed=2))
    model = compile_job(job.trace, job.meta, "pp")
    forward, backward = pairs(model)
    assert jitter_null(model, analyze_model(model), worker_tests(model, forward, backward), 0.01) is None


def test_a_clean_run_straggling_by_its_jitter_reads_none_and_says_why(tmp_path):
    """A real clean 2-process FSDP2 run (3 steps, 18% jitter per step between the two ranks): S 1.13,
    no cause's signature. Once "unexplained"; the job's jitter reaches that S, so the verdict is
    none ("no straggler to fix", not "not straggling"), its sentence gives the null's figures and
    the evidence carries them."""
    run = ROOT / "tests" / "data" / "real_stacks" / "fsdp2-clean-llama-packed-ga2-s1"
    out = tmp_path / "job.json"
    done = subprocess.run([sys.executable, "-c", "import sys; from pipelines.cli import main; sys.exit(main(sys.argv[1:]))",
                           "analyze", str(run), "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    verdict = json.loads(out.read_text())["verdict"]
    null = verdict["evidence"]["jitter_null"]
    assert verdict["cause"] == "none" and verdict["evidence"]["slowdown"] >= 1.1
    assert null["p_value"] > 0.01 and null["quantile"] >= verdict["evidence"]["slowdown"]
    assert "verdict: none (no straggler to fix)" in done.stdout
    assert f"{null['draws']} replays reach S {null['median']:.3f} typically" in done.stdout
