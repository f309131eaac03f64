"""The public compile/replay API that other modules (root causes, streaming) build their own
what-if scenarios on."""
from __future__ import annotations

import json

import numpy as np
import pytest

from schemas.trace import OPTYPES
from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec, generate_job
from transforms.whatif import Mix, Scenario, analyze_model, compile_job, replay
from test_whatif_properties import VARIANTS


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


def test_lane_plans_give_the_materialised_answer():
    """Scenarios replayed on fewer lanes (one DP rank original, the ideal everywhere, the worker
    set of M_W, one DP rank's launch delays) equal, bit for bit, the same values materialised
    into full [op, lane] arrays, which are replayed on every lane."""
    from transforms.whatif.metrics import worker_set_mask
    from transforms.whatif.replay import ALL_LANES, LanePlan, lane_plan

    generated = generate_job(JobSpec(job_id="lanes", dp=4, pp=2, microbatches=4, steps=3, sessions=1, seed=5,
                                     causes=(Cause("slow_worker", {"dp_rank": 1, "stage": 1}),)))
    model = compile_job(generated.trace, generated.meta, "lanes")
    ideal = model.ideal_cost()[:, None]
    rank1 = (model.lane_dp == 1)[None, :]
    reduced = [
        Scenario("dp-1", Mix(ideal, model.original_cost, rank1)),
        Scenario("ideal", ideal),
        Scenario("mw-add", Mix(ideal, model.original_cost, worker_set_mask(model, [(1, 1)]))),
        Scenario("delay-dp-1", ideal, Mix(0.0, model.launch_delay, rank1)),
    ]
    assert [lane_plan(model, s) for s in reduced] == [LanePlan((0, 1)), LanePlan((0,), every_step=False),
                                                      LanePlan((0, 1)), LanePlan((0, 1))]

    def full(values):
        if isinstance(values, Mix):
            return np.where(np.broadcast_to(values.where, model.original_cost.shape), values.alt, values.base)
        return np.broadcast_to(values, model.original_cost.shape).copy()

    materialised = [Scenario(f"full-{s.name}", full(s.cost), None if s.delay is None else full(s.delay)) for s in reduced]
    assert all(lane_plan(model, scenario) == ALL_LANES for scenario in materialised)
    out = replay(model, reduced + materialised)
    for scenario in reduced:
        np.testing.assert_array_equal(out.time(scenario.name), out.time(f"full-{scenario.name}"))
        np.testing.assert_array_equal(out.span(scenario.name), out.span(f"full-{scenario.name}"))


@pytest.mark.parametrize("variant", ["1f1b-dp-overlapped", "interleaved-dp-not-overlapped", "no-dp-context-parallel", "pp1"])
def test_compiled_kernel_equals_numpy(variant, monkeypatch):
    """The compiled kernel (one scenario at a time, or several in threads) and the numpy replay
    give identical results (every field, bit for bit), with attribution, launch delays,
    M_W / M_S and kept timelines, and on custom scenarios with negative costs and per-[op,
    lane] masks."""
    from transforms.whatif import kernel
    from transforms.whatif.metrics import worker_set_mask
    from transforms.whatif.replay import replay_threads

    if not kernel.available():
        pytest.skip("no C compiler: the replay kernel cannot be built (numpy replay only)")

    generated = generate_job(JobSpec(job_id=variant, steps=5, sessions=2, seed=2, **VARIANTS[variant],
                                     causes=(Cause("slow_worker", {"dp_rank": 0, "stage": 0}),)))
    model = compile_job(generated.trace, generated.meta, variant)
    ideal = model.ideal_cost()[:, None]
    negative = model.original_cost - 0.5 * model.original_cost.mean()
    scenarios = [
        Scenario("negative", negative, Mix(model.launch_delay, -0.001, worker_set_mask(model, [(0, 0)]))),
        Scenario("kept", Mix(ideal, model.original_cost, (model.op_stage == 0)[:, None]), keep_times=True),
    ]
    results = {}
    for backend, threads in (("numpy", 1), ("kernel", 1), ("kernel", 3)):
        monkeypatch.setenv("STRAG_REPLAY", backend)
        with replay_threads(threads):
            analysed_ = analyze_model(model, timeline=True, attribution=True)
            out = replay(model, scenarios)
        results[backend, threads] = (json.dumps(analysed_.to_json()), analysed_.timeline.versions["ideal"][1].tobytes(),
                                     out.step_time.tobytes(), out.step_span.tobytes(), out.starts["kept"].tobytes(),
                                     out.ends["kept"].tobytes())
    assert results["numpy", 1] == results["kernel", 1] == results["kernel", 3]


def test_replay_backend_choice(monkeypatch, tmp_path):
    """STRAG_REPLAY picks the backend; a kernel that cannot be built is an error only when forced."""
    from transforms.whatif import kernel

    monkeypatch.setenv("STRAG_REPLAY", "numpy")
    assert not kernel.wanted()
    monkeypatch.setenv("STRAG_REPLAY", "fast")
    with pytest.raises(ValueError, match="STRAG_REPLAY='fast'"):
        kernel.wanted()
    monkeypatch.setattr(kernel.HELPER, "library", None)
    monkeypatch.setattr(kernel.HELPER, "build_error", None)
    monkeypatch.setenv("STRAG_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("STRAG_REPLAY", "auto")
    assert not kernel.wanted()
    monkeypatch.setenv("STRAG_REPLAY", "kernel")
    with pytest.raises(kernel.KernelBuildError, match="no-such-compiler"):
        kernel.wanted()


def test_replay_threads_spreads_scenarios_over_threads(model, monkeypatch):
    """Inside replay_threads(n) the kernel calls run on n pool threads; outside, on the caller's."""
    import threading

    from transforms.whatif import kernel
    from transforms.whatif.replay import replay_threads

    if not kernel.available():
        pytest.skip("no C compiler: the replay kernel cannot be built (numpy replay only)")
    monkeypatch.setenv("STRAG_REPLAY", "kernel")
    seen, real = [], kernel.replay_scenario

    def spy(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "replay_scenario", spy)
    scenarios = [Scenario(f"scaled-{k}", model.original_cost * (1 + k / 10)) for k in range(6)]
    replay(model, scenarios)
    assert set(seen) == {threading.current_thread().name}
    seen.clear()
    with replay_threads(2):
        threaded = replay(model, scenarios)
    assert len(seen) == 6 and {name.rsplit("_", 1)[0] for name in seen} == {"strag-replay"}
    np.testing.assert_array_equal(threaded.step_time, replay(model, scenarios).step_time)
