"""The cost model behind the sequence cause's fixes: bounded by physics, and balancing that moves
work, never noise."""
from __future__ import annotations

import numpy as np
import pytest

from transforms.synth import Cause, JobSpec, generate_job
from transforms.whatif import compile_job
from transforms.whatif.causes import sequence_workload
from transforms.whatif.causes.sequences import BACKWARD, FORWARD, _linear_fits, balanced_sequences


def fit(x, y):
    x, y = np.asarray(x, float)[:, None], np.asarray(y, float)[:, None]
    intercept, slope = _linear_fits(np.zeros(len(x), dtype=np.int64), x, y)
    return float(intercept[0]), float(slope[0])


def test_a_fit_with_a_positive_intercept_is_the_least_squares_line():
    x, y = [1.0, 2.0, 3.0, 4.0], [3.1, 4.9, 7.2, 8.8]
    slope, intercept = np.polyfit(x, y, 1)
    assert intercept > 0
    assert fit(x, y) == pytest.approx((intercept, slope))


def test_a_negative_intercept_is_bounded_to_the_line_through_the_origin():
    """Jitter that happens to follow the lengths: a 10% longer batch measured 2x slower. The free line
    would give a negative fixed cost and rescale durations by more than the workload moves."""
    x, y = [13456.0, 13456.0, 16384.0, 16384.0], [16.8, 16.7, 27.8, 35.5]
    free_slope, free_intercept = np.polyfit(x, y, 1)
    assert free_intercept < 0, "the case needs a free fit below the bound"
    through, *_ = np.linalg.lstsq(np.asarray(x)[:, None], np.asarray(y), rcond=None)
    assert fit(x, y) == pytest.approx((0.0, through[0]))


def test_a_cost_that_falls_with_the_workload_rescales_nothing():
    assert fit([1.0, 2.0, 3.0], [9.0, 6.0, 3.5]) == (0.0, 0.0)


@pytest.fixture(scope="module")
def sequence_job():
    spec = JobSpec(job_id="seq-model", dp=4, pp=1, microbatches=2, steps=6, sessions=1, seed=3, context_length=4096,
                   causes=(Cause("seq_len_imbalance", {}),), record_seq_lens=True)
    job = generate_job(spec)
    model = compile_job(job.trace, job.meta, spec.job_id)
    return model, sequence_workload(job.trace, model)


def _compute_rows(model):
    return np.flatnonzero((model.op_optype == FORWARD) | (model.op_optype == BACKWARD))


def test_balancing_gives_every_microbatch_of_a_step_the_same_compute(sequence_job):
    """With the cost proportional to the workload, perfect balancing sets every forward (backward)
    of a chunk in a step to the cost of the step's mean workload; other ops keep theirs."""
    model, workload = sequence_job
    rows = _compute_rows(model)
    x = workload.op_workload[rows]
    assert np.isfinite(x).all() and x.std() > 0
    model.original_cost[rows] = 1e-6 * x
    cost = balanced_sequences(model, workload)
    step = np.searchsorted(model.steps, model.lane_step)
    for g in np.unique(model.op_gmc[rows]):
        in_chunk = model.op_gmc[rows] == g
        for s in range(model.n_steps):
            lanes = step == s
            np.testing.assert_allclose(cost[rows][in_chunk][:, lanes], 1e-6 * x[in_chunk][:, lanes].mean(), rtol=1e-9)
    other = np.setdiff1d(np.arange(model.n_ops), rows)
    np.testing.assert_array_equal(cost[other], model.original_cost[other])


def test_balancing_never_moves_a_duration_further_than_its_workload(sequence_job):
    """Durations of pure jitter around a weak dependence on the lengths: whatever the fitted line, the
    rescaling factor lies between 1 and the workload's own ratio (new / old)."""
    model, workload = sequence_job
    rows = _compute_rows(model)
    x = workload.op_workload[rows]
    rng = np.random.default_rng(1)
    model.original_cost[rows] = 1e-3 * rng.lognormal(0.0, 0.4, x.shape) * (x / x.mean()) ** 3
    cost = balanced_sequences(model, workload)
    factor = cost[rows] / model.original_cost[rows]
    step = np.searchsorted(model.steps, model.lane_step)
    chunk = np.searchsorted(np.unique(model.op_gmc[rows]), model.op_gmc[rows])
    cell = chunk[:, None] * model.n_steps + step[None, :]
    mean = np.bincount(cell.ravel(), x.ravel()) / np.bincount(cell.ravel())
    ratio = mean[cell] / x
    low, high = np.minimum(ratio, 1.0), np.maximum(ratio, 1.0)
    assert (factor >= low * (1 - 1e-12)).all() and (factor <= high * (1 + 1e-12)).all()
