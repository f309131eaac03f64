"""The public compile/replay API that other modules (root causes, streaming) build their own
what-if scenarios on."""
from __future__ import annotations

import numpy as np
import pytest

from schemas.trace import OPTYPES
from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec, generate_job
from transforms.whatif import Mix, Scenario, analyze_model, compile_job, replay


@pytest.fixture(scope="module")
def model():
    spec = JobSpec(job_id="replay-api", dp=2, pp=4, microbatches=8, steps=6, sessions=2, seed=4,
                   causes=(Cause("gc_pauses", {"period": 2.0, "pause": 0.2}),))
    job = generate_job(spec)
    return compile_job(job.trace, job.meta, spec.job_id)


def test_mix_equals_the_materialised_array(model):
    ideal = model.ideal_cost()[:, None]
    stage = model.op_stage == 2
    manual = np.where(stage[:, None], model.original_cost, ideal)
    out = replay(model, [Scenario("mix", Mix(ideal, model.original_cost, stage[:, None])), Scenario("array", manual)])
    np.testing.assert_array_equal(out.time("mix"), out.time("array"))
    np.testing.assert_array_equal(out.span("mix"), out.span("array"))


def test_a_custom_fix_scenario(model):
    """E.g. a root-cause module removing GC pauses: forward computes longer than twice their
    median get the median; the fixed job is faster, never slower, and not faster than ideal-ish."""
    forward = model.op_optype == OPTYPES.index("forward-compute")
    fixed = model.original_cost.copy()
    median = np.median(fixed[forward])
    block = fixed[forward]
    block[block > 2 * median] = median
    fixed[forward] = block
    result = analyze_model(model)
    out = replay(model, [Scenario("nodelay", model.original_cost), Scenario("no-gc", fixed)])
    np.testing.assert_allclose(out.span("nodelay"), result.step_t_nodelay, rtol=1e-12)
    assert (out.span("no-gc") <= out.span("nodelay") + 1e-12).all()
    assert out.span("no-gc").mean() < 0.97 * out.span("nodelay").mean()


def test_kept_times_are_consistent(model):
    out = replay(model, [Scenario("nodelay", model.original_cost, keep_times=True)])
    start, end = out.starts["nodelay"], out.ends["nodelay"]
    assert start.shape == end.shape == (model.n_ops, model.n_lanes)
    assert (end - start >= -1e-12).all()
    per_step = end.max(axis=0).reshape(model.n_steps, model.dp_size).max(axis=1)
    np.testing.assert_allclose(per_step, out.span("nodelay"), rtol=1e-12)
    optimizer = end[model.optimizer_ops].max(axis=0).reshape(model.n_steps, model.dp_size).max(axis=1)
    np.testing.assert_allclose(optimizer, out.time("nodelay"), rtol=1e-12)


def test_op_names_round_trip(model):
    names = model.op_names
    assert len(set(names)) == model.n_ops
    for index in (0, model.n_ops // 2, model.n_ops - 1):
        assert model.op_index(names[index]) == index
    with pytest.raises(KeyError):
        model.op_index("optimizer_7_0")


def test_scenario_names_must_be_unique(model):
    with pytest.raises(ValueError, match="unique"):
        replay(model, [Scenario("a", model.original_cost), Scenario("a", model.original_cost)])
