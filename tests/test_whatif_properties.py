"""Properties of the engine on generated traces, for every schedule variant the generator makes:
1F1B and interleaved (vpp 2), DP overlapped / non-overlapped / absent (dp 1, also with cp 2), pp 1."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from transforms.synth.execution import Timing
from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec, generate_job
from transforms.whatif import Scenario, analyze_job, analyze_model, compile_job, replay
from transforms.whatif.timeline import simulated_trace

VARIANTS = {
    "1f1b-dp-overlapped": dict(dp=4, pp=4, microbatches=8),
    "1f1b-dp-not-overlapped": dict(dp=4, pp=4, microbatches=8, dp_overlap=False),
    "interleaved-dp-overlapped": dict(dp=4, pp=4, microbatches=8, vpp=2),
    "interleaved-dp-not-overlapped": dict(dp=4, pp=4, microbatches=8, vpp=2, dp_overlap=False),
    "no-dp": dict(dp=1, pp=4, microbatches=8),
    "no-dp-context-parallel": dict(dp=1, cp=2, pp=4, microbatches=8),
    "pp1": dict(dp=8, pp=1, microbatches=4),
}
INTERLEAVED = {name for name, shape in VARIANTS.items() if shape.get("vpp", 1) > 1}
# A clean, balanced job: no injected cause, no loss-layer extra on the last stage, and
# per-op noise of a few tenths of a percent.
QUIET = Timing(compute_noise=0.003, worker_noise=0.001, step_noise=0.001, p2p_noise=0.05, comm_noise=0.02,
               last_stage_extra=0.0)


@functools.lru_cache(maxsize=None)
def job(variant: str, kind: str, seed: int = 1):
    shape = VARIANTS[variant]
    causes, timing = (), None
    if kind == "slow":
        causes = (Cause("slow_worker", {"dp_rank": shape["dp"] - 1, "stage": shape["pp"] // 2}),)
    elif kind == "last-stage":
        causes = (Cause("last_stage_imbalance"),)
    elif kind == "untraced-cpu":
        causes = (Cause("untraced_cpu", {"fraction": 0.3, "scope": "first_stage"}),)
    elif kind == "quiet":
        timing = QUIET
    spec = JobSpec(job_id=f"{variant}-{kind}", steps=6, sessions=2, seed=seed, causes=causes, timing=timing, **shape)
    return generate_job(spec)


@functools.lru_cache(maxsize=None)
def analysed(variant: str, kind: str):
    generated = job(variant, kind)
    model = compile_job(generated.trace, generated.meta, generated.spec.job_id)
    return generated, model, analyze_model(model, timeline=True, attribution=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_clean_balanced_job_has_no_slowdown(variant):
    _, _, result = analysed(variant, "quiet")
    assert abs(result.slowdown - 1) < 0.01


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["clean", "slow"])
def test_slowdown_agrees_with_the_generators_execution_model(variant, kind):
    """The generator computes its own no-delay / ideal step times from its execution model."""
    generated, _, result = analysed(variant, kind)
    assert result.slowdown == pytest.approx(generated.truth["expected_slowdown"], rel=0.01)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["clean", "slow"])
def test_replay_with_launch_delays_reproduces_the_trace(variant, kind):
    _, _, result = analysed(variant, kind)
    np.testing.assert_allclose(result.step_t_replayed, result.step_t_base, rtol=1e-9, atol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_idealising_twice_changes_nothing(variant):
    """The simulated ideal timeline, analysed again (same dependency graph), is its own ideal."""
    generated, model, first = analysed(variant, "slow")
    ideal = replay(model, [Scenario("ideal", model.ideal_cost()[:, None], keep_times=True)])
    again = compile_job(simulated_trace(model, ideal.starts["ideal"], ideal.ends["ideal"]), generated.meta,
                        "again", structure_from=model)
    np.testing.assert_allclose(again.ideal_cost(), model.ideal_cost(), rtol=1e-9, atol=1e-12)
    second = analyze_model(again)
    assert second.slowdown == pytest.approx(1.0, abs=1e-9)
    np.testing.assert_allclose(second.step_t_nodelay, first.step_t_noblk, rtol=1e-9)
    np.testing.assert_allclose(second.step_t_noblk, first.step_t_noblk, rtol=1e-9)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if VARIANTS[v]["dp"] * VARIANTS[v]["pp"] > 1])
def test_worker_slowdown_ranks_the_injected_worker_first(variant):
    generated, _, result = analysed(variant, "slow")
    injected = tuple(generated.truth["affected_workers"][0].values())
    ranking = np.argsort(-result.worker_slowdown, axis=None)
    assert np.unravel_index(ranking[0], result.worker_slowdown.shape) == injected
    assert result.mw.workers == [injected]   # 3% of <= 32 workers: the M_W set is one worker


@pytest.mark.parametrize("variant", [v for v in VARIANTS if VARIANTS[v]["dp"] * VARIANTS[v]["pp"] > 1])
def test_idealising_the_mw_set_removes_the_slowdown(variant):
    """Idealising the injected worker (its own M_W set) brings the job back to T_ideal (or below:
    T_ideal averages the slow worker in). Interleaved schedules record batched send/recv pairs
    with a shared end, so part of the worker's delay sits in its neighbours' p2p transfers (as in
    the reference's model); there, keeping only that worker original inside the ideal (M_W's add
    form) reproduces the whole slowdown instead."""
    _, _, result = analysed(variant, "slow")
    assert result.slowdown > 1.1
    if variant in INTERLEAVED:
        assert result.mw.add == pytest.approx(1.0, abs=0.05)
        assert result.mw.rem > 0.3
    else:
        assert result.mw.trem <= 1.01 * result.mw.tideal
        assert result.mw.rem > 0.95


@pytest.mark.parametrize("variant", [v for v in VARIANTS if VARIANTS[v]["pp"] > 1])
def test_last_stage_imbalance_gives_a_high_ms(variant):
    _, _, result = analysed(variant, "last-stage")
    assert max(result.by_stage, key=result.by_stage.get) == result.meta.pp_size - 1
    assert result.ms.rem >= 0.5 and result.ms.workers == [(d, result.meta.pp_size - 1) for d in range(result.meta.dp_size)]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if VARIANTS[v]["pp"] > 1])
def test_untraced_cpu_work_is_a_discrepancy_attributed_to_its_stage(variant):
    """Untraced gaps before stage 0's forwards make the replay miss time: the job is discarded and
    the launch-delay attribution points at stage 0. (Interleaved: batched p2p records absorb part of
    the gaps into transfers, so the measured discrepancy is lower than the generator's.)"""
    generated, _, result = analysed(variant, "untraced-cpu")
    assert result.discarded and result.to_json()["discard_reason"].startswith("replay discrepancy")
    if variant not in INTERLEAVED:
        assert result.launch_slowdown == pytest.approx(generated.truth["expected_discrepancy"], rel=0.01)
    assert max(result.launch_by_stage, key=result.launch_by_stage.get) == 0
    out = result.to_reference_json()
    assert "first-op" in out["launch_decompose_by_optype"]
    assert set(out["launch_decompose_by_stage_per_step"]) == {str(s) for s in result.steps}


@pytest.mark.parametrize("variant", ["1f1b-dp-overlapped", "interleaved-dp-overlapped", "pp1"])
def test_published_and_lake_precision_give_the_same_answer(variant):
    """A float64 trace rounded to float32 (the published format) moves S by float32 noise only."""
    import pyarrow as pa

    generated, _, result = analysed(variant, "slow")
    trace = generated.trace
    for name in ("start_ts", "duration"):
        column = trace.column(name).cast(pa.float32())
        trace = trace.set_column(trace.schema.get_field_index(name), name, column)
    rounded = analyze_job(trace, generated.meta, "rounded")
    assert rounded.slowdown == pytest.approx(result.slowdown, rel=1e-5)


def test_memory_limit_only_changes_chunking():
    """Replaying one scenario per chunk gives the same numbers as one big chunk."""
    _, model, result = analysed("1f1b-dp-overlapped", "slow")
    small = analyze_model(model, attribution=True, memory_limit=1)
    assert small.slowdown == result.slowdown
    assert small.by_stage == result.by_stage and small.mw.rem == result.mw.rem


@pytest.mark.parametrize("size", [1, 2, 7, 8, 1001])
def test_median_equals_numpy_median_bit_for_bit(size):
    from transforms.whatif.model import median

    values = np.random.default_rng(size).lognormal(size=(size, 3))
    assert median(values) == np.median(values)
    assert median(values[:, 0]) == np.median(values[:, 0])


@pytest.mark.parametrize("shape", [(5,), (4, 3), (3, 6, 2), (1, 4)])
def test_median_along_an_axis_equals_numpy_median_bit_for_bit(shape):
    """The causes take medians along an axis without np.median's numpy.ma import: the same
    values bit for bit, keepdims kept, NaN where a slice holds one."""
    from transforms.whatif.model import median

    values = np.random.default_rng(len(shape)).lognormal(size=shape)
    for axis in range(len(shape)):
        for keepdims in (False, True):
            got, want = median(values, axis=axis, keepdims=keepdims), np.median(values, axis=axis, keepdims=keepdims)
            assert got.shape == want.shape and np.array_equal(got, want)
    values.flat[0] = np.nan
    assert np.array_equal(median(values, axis=0), np.median(values, axis=0), equal_nan=True)
