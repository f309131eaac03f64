"""The worker detector (transforms/whatif/causes/workers.py): a test per worker and kind of work
against its DP peers, with the job's own jitter as the null, at a stated false-alarm rate."""
from __future__ import annotations

import math

import numpy as np
import pytest

from transforms.synth import JobSpec, generate_job
from transforms.whatif import compile_job
from transforms.whatif.causes.signals import BACKWARD, FORWARD, pairs
from transforms.whatif.causes import workers as worker_module
from transforms.whatif.causes.workers import balance_tests, t_sf, worker_tests


def _ddp(job_id: str, dp: int, seed: int):
    """A clean DDP job (one stage, 2 microbatches per step, 8 steps) compiled, with its op pairs."""
    job = generate_job(JobSpec(job_id=job_id, dp=dp, pp=1, microbatches=2, steps=8, sessions=1, seed=seed))
    model = compile_job(job.trace, job.meta, job_id)
    return model, *pairs(model)


@pytest.fixture(scope="module")
def base():
    """A clean DDP job of 4 DP ranks compiled once."""
    return _ddp("wt", 4, 11)


def _jittered(model, rng, sigma: float):
    """A copy of the model whose every compute op is its median over lanes times exp(N(0, sigma)):
    identical work on every DP rank, independent jitter of known size."""
    out = type(model).__new__(type(model))
    out.__dict__.update(model.__dict__)
    typical = np.median(model.original_cost, axis=1, keepdims=True)
    out.original_cost = typical * np.exp(rng.normal(0.0, sigma, model.original_cost.shape))
    return out


def _slow(model, worker_dp: int, code: int, factor: float, steps=None):
    cost = model.original_cost.copy()
    lanes = np.flatnonzero(model.lane_dp == worker_dp)
    if steps is not None:
        lanes = lanes[list(steps)]
    ops = np.flatnonzero(model.op_optype == code)
    cost[np.ix_(ops, lanes)] *= factor
    model.original_cost = cost
    return model


def test_t_tail_matches_the_closed_forms():
    assert t_sf(1.0, 1) == pytest.approx(0.25)                       # Cauchy
    assert t_sf(0.0, 7) == pytest.approx(0.5)
    assert t_sf(2.228138851986274, 10) == pytest.approx(0.025, rel=1e-9)   # t_{0.975, 10}
    assert t_sf(-2.0, 2) == pytest.approx(1.0 - t_sf(2.0, 2))
    assert t_sf(2.0, 2) == pytest.approx(0.5 * (1.0 - 2.0 / math.sqrt(6.0)))  # df 2: (1 - t / sqrt(2 + t^2)) / 2


def test_clean_jobs_raise_at_most_the_stated_false_alarm_rate(base):
    """300 clean jobs (jitter 10% per op, no slow worker): a job with any finding is a false alarm;
    at alpha = 1% the count stays near 3 (at most 9: P(X >= 10 | 300, 1%) < 0.1%)."""
    model, forward, backward = base
    rng = np.random.default_rng(5)
    alarms = sum(bool(worker_tests(_jittered(model, rng, 0.10), forward, backward, alpha=0.01).slow) for _ in range(300))
    assert alarms <= 9


def test_a_persistently_slow_worker_is_found_with_its_ratio(base):
    model, forward, backward = base
    rng = np.random.default_rng(1)
    slowed = _slow(_jittered(model, rng, 0.03), 2, FORWARD, 1.3)
    tests = worker_tests(slowed, forward, backward)
    assert tests.workers() == [(2, 0)]
    finding = tests.of((2, 0))[0]
    assert finding.persistent and finding.kind == "forward"
    assert finding.ratio == pytest.approx(1.3, rel=0.05)
    assert finding.steps == tuple(range(model.n_steps))
    assert finding.confidence >= 0.99


def test_a_worker_slow_in_two_steps_is_named_with_those_steps(base):
    """Slow 2x in steps 2 and 5 of 8: not averaged away, not persistent, named with its steps."""
    model, forward, backward = base
    rng = np.random.default_rng(2)
    slowed = _slow(_jittered(model, rng, 0.03), 1, BACKWARD, 2.0, steps=(2, 5))
    tests = worker_tests(slowed, forward, backward)
    assert tests.workers() == [(1, 0)]
    finding = tests.of((1, 0))[0]
    assert not finding.persistent and finding.steps == (2, 5) and finding.kind == "backward"


@pytest.mark.parametrize("seed", [0, 7])
def test_a_worker_slow_in_three_steps_of_eight_is_named_with_all_three(base, seed, monkeypatch):
    """Forward 1.6x in steps 1, 4 and 6 of 8 with 15% jitter per op: the slow level over three steps
    names all three, where single-step spikes alone reach only some of them."""
    model, forward, backward = base
    slowed = _slow(_jittered(model, np.random.default_rng(seed), 0.15), 1, FORWARD, 1.6, steps=(1, 4, 6))
    finding = worker_tests(slowed, forward, backward).of((1, 0))[0]
    assert not finding.persistent and finding.kind == "forward" and finding.steps == (1, 4, 6)
    assert finding.ratio == pytest.approx(1.6, rel=0.15)
    monkeypatch.setattr(worker_module, "_level_shift", lambda *args: None)
    spikes = worker_tests(slowed, forward, backward).of((1, 0))
    assert spikes and set(spikes[0].steps) < {1, 4, 6}


def test_a_worker_slow_in_every_other_step_is_named_with_those_steps_not_as_persistent(base):
    """Forward 1.8x on odd steps (4 of 8) with 10% jitter per op, 20 jobs: the persistent test
    blames the worker (half the steps slow lifts its mean and median), and the finding names the
    slow level's steps as an intermittent one, not the steps a noisy sample lifts past the
    threshold: exactly the odd steps in at least 17 of 20 (19 measured; where the levels do not
    separate it stays persistent). Slowed in every step it stays persistent with every step."""
    model, forward, backward = base
    odd = (1, 3, 5, 7)
    exact = 0
    for seed in range(20):
        slowed = _slow(_jittered(model, np.random.default_rng(seed), 0.10), 2, FORWARD, 1.8, steps=odd)
        tests = worker_tests(slowed, forward, backward)
        assert tests.workers() == [(2, 0)]
        finding = tests.of((2, 0))[0]
        if not finding.persistent and finding.steps == odd:
            exact += 1
            assert finding.ratio == pytest.approx(1.8, rel=0.15)
    assert exact >= 17
    always = _slow(_jittered(model, np.random.default_rng(0), 0.10), 2, FORWARD, 1.8)
    finding = worker_tests(always, forward, backward).of((2, 0))[0]
    assert finding.persistent and finding.steps == tuple(range(model.n_steps))


def test_an_intermittent_worker_s_fix_restores_only_its_slow_steps():
    """A worker 2x in steps 2 and 5 of 8 (the generator's own injection): named with those steps,
    and its fix (peer pace in those steps only) saves time there and nothing in the others, where
    it already ran at its usual pace."""
    from transforms.synth import Cause, JobSpec, generate_job
    from transforms.whatif.causes import analyze_and_classify

    spec = JobSpec(job_id="flaky", dp=4, pp=1, microbatches=2, steps=8, sessions=1, seed=11,
                   causes=(Cause("slow_worker", {"dp_rank": 2, "stage": 0, "factor": 2.0, "steps": [2, 5]}),))
    job = generate_job(spec)
    _, verdict = analyze_and_classify(job.trace, job.meta, "flaky")
    assert verdict.cause == "individual-worker" and verdict.slow_steps() == {(2, 0): (2, 5)}
    saved = np.array(verdict.primary_fix.step_savings)
    assert saved[[2, 5]].min() > 0
    assert np.abs(np.delete(saved, [2, 5])).max() <= 1e-9 * saved.max()
    # the fix's cost: the worker's lanes of the other steps untouched (its usual pace, jitter and all),
    # its slow steps at no more than its peers' median op by op
    from transforms.whatif import compile_job
    from transforms.whatif.causes.fixes import at_peer_speed
    from transforms.whatif.causes.signals import peer_comparison

    model = compile_job(job.trace, job.meta, "flaky")
    forward, backward = pairs(model)
    only = {(2, 0, "forward"): (2, 5), (2, 0, "backward"): (2, 5)}
    cost = at_peer_speed(model, [(2, 0)], peer_comparison(model, forward, backward), only=only)
    lanes = np.flatnonzero(model.lane_dp == 2)
    usual = np.setdiff1d(np.arange(model.n_lanes), lanes[[2, 5]])
    assert np.array_equal(cost[:, usual], model.original_cost[:, usual])
    compute = np.flatnonzero(np.isin(model.op_optype, (FORWARD, BACKWARD)))
    peers = np.median(model.original_cost[compute][:, lanes[[2, 5]][:, None] + np.array([-2, -1, 1])], axis=2)
    assert np.allclose(cost[compute][:, lanes[[2, 5]]], np.minimum(model.original_cost[compute][:, lanes[[2, 5]]], peers))


@pytest.mark.parametrize("n, rest_df, exact", [(6, 4, True), (6, 5, True), (8, 24, True), (8, 48, False)])
def test_the_slow_level_test_holds_its_false_alarm_rate_on_normal_jitter(n, rest_df, exact):
    """The largest split t over every split has no closed form; its simulated null must give a
    p <= alpha in an alpha share of jobs without a slow level (3,000 normal cells at alpha 5%:
    150 expected, the binomial's 99.9% band 110..195), and the other comparisons' spread is part
    of the pooled variance. Up to 32 degrees of freedom the null is simulated at the job's own
    (few steps, where every one counts); beyond, at the power of two below them: a wider null,
    fewer alarms (conservative), never more."""
    rng = np.random.default_rng(3)
    alarms = 0
    for _ in range(3000):
        effects = rng.normal(0.0, 0.2, n)
        rest_ss = 0.04 * rng.chisquare(rest_df)
        alarms += worker_module._level_shift(effects, rest_ss, rest_df, 1, 0.05, -math.inf) is not None
    assert (110 if exact else 0) <= alarms <= 195


def test_a_job_of_few_steps_is_tested_against_the_null_of_its_own_degrees_of_freedom():
    """Rounding 5 degrees of freedom down to 4 widened a 6-sample job's null (99.75th percentile
    ~6.7 -> ~7.1): a job of few steps lost power for a cache. Its own are simulated now; large
    ones still share a power of two."""
    assert [worker_module._null_df(df) for df in (0, 1, 5, 11, 32, 33, 100)] == [0, 1, 5, 11, 32, 32, 64]
    null = {df: worker_module._level_shift_null(6, df, 20_000) for df in (4, 5)}
    assert null[5][int(0.9975 * 20_000)] < null[4][int(0.9975 * 20_000)]


def test_the_slow_level_is_at_least_the_threshold_over_its_peers():
    """A clear split whose slow level is within the straggling threshold of the peers names nothing."""
    effects = np.array([0.05, 0.06, 0.05, -0.2, -0.21, -0.2])
    assert worker_module._level_shift(effects, 0.0005, 20, 1, 0.01, math.log(1.1)) is None
    hit, p_value = worker_module._level_shift(effects + 0.2, 0.0005, 20, 1, 0.01, math.log(1.1))
    assert hit.tolist() == [True, True, True, False, False, False] and p_value <= 0.01


PRIOR = 0.085   # the healthy offset a job is measured against without the peers to bound its own (CauseRules.peer_offset)


@pytest.fixture(scope="module")
def wide():
    """A clean DDP job of 16 DP ranks compiled once."""
    return _ddp("wide", 16, 12)


def _offset(model, rng, tau: float):
    """The model with a persistent healthy offset per worker and kind of work: each DP rank's
    forward (backward) ops all times exp(N(0, tau)), one draw per rank and kind."""
    cost = model.original_cost.copy()
    for code in (FORWARD, BACKWARD):
        ops = np.flatnonzero(model.op_optype == code)
        cost[ops] *= np.exp(rng.normal(0.0, tau, model.dp_size))[model.lane_dp][None, :]
    model.original_cost = cost
    return model


def test_many_quiet_peers_measure_a_worker_against_their_own_offset_not_the_prior(wide):
    """GPU-like ranks: 1% jitter per op, healthy workers 1% apart. 16 DP ranks bound their own offset
    far below the prior measured on shared CPU cores, so a 1.15x worker is found; two of them cannot
    bound theirs, and the same worker (slow in all its compute) is left to the prior: undecided, more
    peers would decide."""
    model, forward, backward = wide
    rng = np.random.default_rng(3)
    slowed = _slow(_offset(_jittered(model, rng, 0.01), rng, 0.01), 5, FORWARD, 1.15)
    tests = worker_tests(slowed, forward, backward, offset=PRIOR)
    assert tests.tau < PRIOR / 2 and tests.tau_prior == PRIOR
    assert tests.workers() == [(5, 0)] and tests.of((5, 0))[0].ratio == pytest.approx(1.15, rel=0.03)
    two, *two_pairs = _ddp("two", 2, 12)
    pair = _slow(_slow(_jittered(two, rng, 0.01), 1, FORWARD, 1.15), 1, BACKWARD, 1.15)
    tests = worker_tests(pair, *two_pairs, offset=PRIOR)
    assert tests.tau == PRIOR and not tests.slow
    assert {f.kind: f.samples_needed for f in tests.undecided if f.worker == (1, 0)} == {"forward": None, "backward": None}


def test_a_mild_slow_worker_among_eight_quiet_gpu_ranks_is_the_verdict(tmp_path):
    """The generator's GPU job (8 DP ranks, ~1% jitter per op) with one worker 1.2x slower: S 1.15.
    Measured against the prior offset of shared CPU cores, the worker was left undecided
    (insufficient-evidence); the job's own bound names it."""
    from transforms.synth.faults import Cause
    from transforms.whatif.causes import analyze_and_classify

    job = generate_job(JobSpec(job_id="mild", dp=8, pp=1, microbatches=8, steps=8, sessions=1, seed=1,
                               causes=(Cause("slow_worker", {"dp_rank": 2, "stage": 0, "factor": 1.2}),)))
    result, verdict = analyze_and_classify(job.trace, job.meta, "mild")
    assert result.slowdown >= 1.1
    assert verdict.cause == "individual-worker" and verdict.implicated_workers == [(2, 0)]
    assert verdict.evidence["worker_test"]["tau"] < PRIOR / 2


def test_two_dp_ranks_over_several_stages_bound_their_own_offset():
    """Two DP ranks mirror each other in a stage, so one stage cannot tell a slow worker from the
    healthy offset; over four stages the other three comparisons can. A 1.3x worker in a 2 x 4
    pipeline of quiet ranks is found against the job's own bound; 2 x 2 keeps the prior."""
    from transforms.synth.faults import Cause
    from transforms.whatif.causes.workers import reads_offset

    assert (reads_offset(2, 1), reads_offset(2, 2), reads_offset(2, 3), reads_offset(3, 1)) == (False, False, True, True)
    slow = (Cause("slow_worker", {"dp_rank": 1, "stage": 1, "factor": 1.3}),)
    for pp, prior_kept in ((4, False), (2, True)):
        job = generate_job(JobSpec(job_id="pp", dp=2, pp=pp, microbatches=8, steps=8, sessions=1, seed=2, causes=slow))
        model = compile_job(job.trace, job.meta, "pp")
        tests = worker_tests(model, *pairs(model), offset=PRIOR)
        assert (tests.tau == PRIOR) == prior_kept
        if not prior_kept:
            assert tests.tau < PRIOR and tests.workers() == [(1, 1)]


def test_a_rank_given_the_longer_batches_is_no_slower_machine():
    """Two DP ranks, one microbatch each per step, batches of recorded lengths whose attention sets
    the compute: over 8 steps rank 1 drew the longer ones more often and measures 1.47x its peer.
    Compute follows the recorded workload (the sequence signature), so the worker test compares
    the work at the chunk's mean workload: no worker is slow or left undecided (before: undecided,
    and the verdict insufficient-evidence); the verdict is sequence-imbalance."""
    from transforms.synth.faults import Cause
    from transforms.whatif.causes import analyze_and_classify

    job = generate_job(JobSpec(job_id="seq", dp=2, pp=1, microbatches=1, steps=8, sessions=1, seed=1,
                               causes=(Cause("seq_len_imbalance", {"attention_fraction": 0.9}),)))
    _, verdict = analyze_and_classify(job.trace, job.meta, "seq")
    evidence = verdict.evidence
    assert evidence["sequence_p"] <= 0.01 and evidence["worker_test_at_mean_workload"] is True
    assert not evidence["worker_test"]["slow"] and not evidence["worker_test"]["undecided"]
    assert verdict.cause == "sequence-imbalance" and not verdict.implicated_workers
    # the even spread keeps each worker's pace read at equal batches: it removes nearly all of the
    # straggling time (read from raw work, rank 1's draw of long batches passed for its pace: 18%)
    assert evidence["sequence_even_explained"] > 0.9


def test_a_job_s_own_offset_bound_holds_the_false_alarm_rate(wide):
    """300 clean 16-rank jobs whose healthy workers keep persistent offsets of 4% (half the prior)
    beside 2% jitter per op: the job's own bound may not fall below their offset so often that
    healthy workers are blamed. Where the job bounds the offset, the rate is at most twice the
    stated one (the bound or the test errs): at 2% the count stays near 6 (at most 15:
    P(X >= 16 | 300, 2%) < 0.1%)."""
    model, forward, backward = wide
    rng = np.random.default_rng(8)
    alarms = 0
    for _ in range(300):
        clean = _offset(_jittered(model, rng, 0.02), rng, 0.04)
        alarms += bool(worker_tests(clean, forward, backward, offset=PRIOR).slow)
    assert alarms <= 15


def test_noise_above_the_effect_is_undecided_and_says_how_many_steps_would_decide(base):
    """1.2x in forward with 35% jitter per op over 8 steps: the job cannot confirm it; the finding
    is undecided with a number of steps larger than profiled."""
    model, forward, backward = base
    rng = np.random.default_rng(4)
    slowed = _slow(_jittered(model, rng, 0.35), 3, FORWARD, 1.2)
    tests = worker_tests(slowed, forward, backward)
    assert not tests.slow and not tests.decided
    undecided = [f for f in tests.undecided if f.worker == (3, 0)]
    assert undecided and (undecided[0].samples_needed is None or undecided[0].samples_needed > model.n_steps)


def test_an_undecided_worker_says_in_which_steps_its_effect_lies():
    """Two DP ranks, rank 1's forward 1.8x in steps 1, 3, 5 and 7 of 8 within 25% jitter per op: the
    job cannot decide it, and the undecided finding names the slow steps with both levels' ratio
    ranges (a description, not a test) instead of one ratio averaged over every step; the verdict's
    words carry them."""
    from transforms.whatif.causes.explain import where_undecided

    model, forward, backward = _ddp("wt2", 2, 11)
    slowed = _slow(_jittered(model, np.random.default_rng(5), 0.25), 1, FORWARD, 1.8, steps=(1, 3, 5, 7))
    tests = worker_tests(slowed, forward, backward)
    assert not tests.slow
    finding = next(f for f in tests.undecided if f.worker == (1, 0) and f.kind == "forward")
    assert finding.steps == (1, 3, 5, 7)
    slow_low, slow_high, usual_low, usual_high = finding.levels
    assert slow_low / usual_high >= 1.1 and slow_low >= 1.1 > usual_low
    words = where_undecided(finding.as_json())
    assert "in steps 1, 3, 5 and 7" in words and f"{slow_low:.1f}-{slow_high:.1f}x" in words
    assert where_undecided({"steps": [], "levels": None}) == ""


def test_an_effect_that_could_not_make_the_job_straggle_leaves_nothing_undecided(base):
    """Forward 1.3x its peers' within 35% jitter, backward 0.85x: its whole compute stays within the
    straggling threshold of its peers', so alone it could not make the job straggle; the job is not
    left undecided over it (with its backward as theirs, the same forward is)."""
    model, forward, backward = base
    rng = np.random.default_rng(4)
    jittered = _jittered(model, rng, 0.35)
    both = _slow(_slow(_copy(jittered), 3, FORWARD, 1.3), 3, BACKWARD, 0.85)
    f_ratio, whole_ratio = _ratios(both, 3)
    assert f_ratio >= 1.1 and whole_ratio < 1.1
    assert (3, 0) not in {f.worker for f in worker_tests(both, forward, backward).undecided}
    alone = _slow(_copy(jittered), 3, FORWARD, 1.3)
    assert _ratios(alone, 3)[1] >= 1.1
    assert (3, 0) in {f.worker for f in worker_tests(alone, forward, backward).undecided}


def _copy(model):
    out = type(model).__new__(type(model))
    out.__dict__.update(model.__dict__)
    return out


def _ratios(model, dp: int) -> tuple[float, float]:
    """Median over steps of the worker's forward and whole compute over its peers' median."""
    lanes = model.lane_dp
    fwd = model.original_cost[model.op_optype == FORWARD].sum(axis=0)
    whole = fwd + model.original_cost[model.op_optype == BACKWARD].sum(axis=0)
    def ratio(x):
        per_step = np.stack([x[lanes == d] for d in range(model.dp_size)], axis=1)   # [step, dp]
        peers = np.median(np.delete(per_step, dp, axis=1), axis=1)
        return float(np.median(per_step[:, dp] / peers))
    return ratio(fwd), ratio(whole)


def test_a_worker_that_finishes_its_compute_first_is_not_blamed(base):
    """Backward 1.2x its peers' but forward 0.4x: its whole compute ends before theirs, so it holds
    no one up at the all-reduce (interference from a slowed peer, not a straggler)."""
    model, forward, backward = base
    rng = np.random.default_rng(4)
    slowed = _slow(_slow(_jittered(model, rng, 0.02), 0, BACKWARD, 1.2), 0, FORWARD, 0.4)
    assert (0, 0) not in worker_tests(slowed, forward, backward).workers()


def test_without_peers_or_samples_the_detector_says_why():
    job = generate_job(JobSpec(job_id="pp", dp=1, pp=2, microbatches=4, steps=4, sessions=1, seed=1))
    model = compile_job(job.trace, job.meta, "pp")
    tests = worker_tests(model, *pairs(model))
    assert not tests.peers and tests.decided and "one DP rank" in tests.limits[0]
    job = generate_job(JobSpec(job_id="one", dp=2, pp=1, microbatches=1, steps=1, sessions=1, seed=1))
    model = compile_job(job.trace, job.meta, "one")
    tests = worker_tests(model, *pairs(model))
    assert tests.peers and not tests.decided and "one profiled step" in tests.limits[0]


@pytest.fixture(scope="module")
def pipeline():
    """A clean pipeline without DP peers (4 stages, one DP rank each, 4 microbatches, 6 steps)."""
    job = generate_job(JobSpec(job_id="bt", dp=1, pp=4, microbatches=4, steps=6, sessions=1, seed=3))
    return compile_job(job.trace, job.meta, "bt")


def _stage_slowed(model, stage: int, codes, factor: float):
    out = _copy(model)
    cost = model.original_cost.copy()
    cost[np.isin(model.op_optype, codes) & (model.op_stage == stage)] *= factor
    out.original_cost = cost
    return out


def test_without_peers_a_stage_slow_in_one_kind_of_work_is_found_by_its_balance(pipeline):
    """No DP peers: stage 2's forward at 2x moves its balance of backward to forward away from the
    other stages' (more layers would lengthen both alike): found, forward, about 2x; its backward
    at 2x: found, backward."""
    rng = np.random.default_rng(1)
    jittered = _jittered(pipeline, rng, 0.03)
    for codes, kind in (((FORWARD,), "forward"), ((BACKWARD,), "backward")):
        tests = balance_tests(_stage_slowed(jittered, 2, codes, 2.0), 0.01, 1.1, 0.085)
        assert tests.workers() == [(0, 2)], tests
        assert tests.slow[0].kind == kind and tests.slow[0].ratio == pytest.approx(2.0, rel=0.15)
        assert 0.99 <= tests.slow[0].confidence <= 1.0


def test_without_peers_a_stage_slow_in_some_steps_is_named_with_them():
    """No DP peers, 12 steps, 8% jitter per op: stage 1's forward at 1.8x on odd steps only (its
    other steps at the usual pace) is an intermittent finding naming those steps, in 18 or more of
    20 jobs (20 measured), never another stage; the same jobs clean give no finding in 19 or more.
    Its fix restores the forward in the named steps only. A heavier stage (both kinds 2x in every
    step) is no intermittent finding: its level does not move between steps."""
    from transforms.whatif.causes.fixes import at_balance

    job = generate_job(JobSpec(job_id="bi", dp=1, pp=4, microbatches=4, steps=12, sessions=1, seed=3))
    model = compile_job(job.trace, job.meta, "bi")
    odd = tuple(range(1, 12, 2))
    named = quiet = 0
    for seed in range(20):
        jittered = _jittered(model, np.random.default_rng(seed), 0.08)
        quiet += not balance_tests(jittered, 0.01, 1.1, 0.085).slow
        cost = jittered.original_cost.copy()
        lanes = np.flatnonzero(np.isin(model.lane_step, model.steps[list(odd)]))
        rows = np.flatnonzero((model.op_optype == FORWARD) & (model.op_stage == 1))
        cost[np.ix_(rows, lanes)] *= 1.8
        slowed = _copy(jittered)
        slowed.original_cost = cost
        tests = balance_tests(slowed, 0.01, 1.1, 0.085)
        assert set(tests.workers()) <= {(0, 1)}
        if tests.slow and not tests.slow[0].persistent and tests.slow[0].steps == odd:
            named += 1
            finding = tests.slow[0]
            assert finding.kind == "forward" and finding.ratio == pytest.approx(1.8, rel=0.15)
            fixed = at_balance(slowed, [finding])
            other = np.setdiff1d(np.arange(model.n_lanes), lanes)
            assert np.array_equal(fixed[:, other], cost[:, other])
            assert np.allclose(fixed[np.ix_(rows, lanes)], cost[np.ix_(rows, lanes)] / finding.ratio)
    assert named >= 18 and quiet >= 19
    heavy = _stage_slowed(_jittered(model, np.random.default_rng(0), 0.08), 2, (FORWARD, BACKWARD), 2.0)
    assert not [f for f in balance_tests(heavy, 0.01, 1.1, 0.085).slow if not f.persistent]


def test_without_peers_a_heavier_stage_is_not_a_slow_worker(pipeline):
    """Stage 1 with twice the layers (forward and backward both 2x) keeps its balance: no worker is
    blamed, and the test says a stage slow in both kinds cannot be told from a heavier one; a clean
    pipeline blames no one."""
    rng = np.random.default_rng(2)
    jittered = _jittered(pipeline, rng, 0.03)
    heavy = balance_tests(_stage_slowed(jittered, 1, (FORWARD, BACKWARD), 2.0), 0.01, 1.1, 0.085)
    assert not heavy.slow and not heavy.undecided and "heavier" in heavy.limits[0]
    assert not balance_tests(jittered, 0.01, 1.1, 0.085).slow


def test_a_pipeline_s_slow_stage_is_the_verdict_s_worker_and_its_fix_restores_its_balance(pipeline):
    """Through classify: the slowed stage's worker is named (individual-worker), not a stage
    imbalance (its cost scaled here without its times, the window is discarded: a measurement); its
    fix (fixes.at_balance) divides the slow kind on that stage by the ratio found, and nothing else."""
    from transforms.whatif.causes import classify
    from transforms.whatif.causes.fixes import at_balance
    from transforms.whatif.metrics import analyze_model

    rng = np.random.default_rng(1)
    slowed = _stage_slowed(_jittered(pipeline, rng, 0.03), 3, (BACKWARD,), 2.0)
    verdict = classify(slowed, analyze_model(slowed))
    assert verdict.cause == "individual-worker" and verdict.implicated_workers == [(0, 3)], verdict.explanations
    assert "stage-imbalance" not in verdict.causes
    assert "balance of backward to forward" in verdict.explanations["individual-worker"]
    found = balance_tests(slowed, 0.01, 1.1, 0.085).slow
    fixed = at_balance(slowed, found)
    changed = np.isin(slowed.op_optype, (BACKWARD,)) & (slowed.op_stage == 3)
    assert np.allclose(fixed[changed], slowed.original_cost[changed] / found[0].ratio)
    assert np.array_equal(fixed[~changed], slowed.original_cost[~changed])


def test_the_split_t_of_every_row_equals_the_split_by_split_definition():
    """_split_t (every split of a block of rows at once) against its definition computed one row and
    one split at a time in plain floats: the largest pooled two-sample t of the top k over the rest
    (2 <= k <= n - 2), its smallest k; -inf and 0 where no split has a t (n < 4, no spread).
    Rows past one block (the simulated null's case) and ties between splits included."""
    rng = np.random.default_rng(5)

    def reference(row, rest_ss, rest_df):
        n, best, best_k = len(row), -math.inf, 0
        for k in range(2, n - 1):
            top, rest = row[:k], row[k:]
            within = sum((x - top.mean()) ** 2 for x in top) + sum((x - rest.mean()) ** 2 for x in rest)
            variance = max(within + rest_ss, 0.0) / (n - 2 + rest_df)
            scale = math.sqrt(variance * (1.0 / k + 1.0 / (n - k)))
            t = (top.mean() - rest.mean()) / scale if scale > 0 else (math.inf if top.mean() > rest.mean() else -math.inf)
            if t > best:
                best, best_k = t, k
        return best, best_k

    for n, rows in ((3, 4), (4, 6), (7, 40), (12, 3000)):
        values = -np.sort(-rng.standard_normal((rows, n)).round(1), axis=1)
        values[0] = 1.0                                       # no spread at all: no t
        rest_ss = rng.chisquare(8, rows)
        rest_ss[0] = 0.0
        best, best_k = worker_module._split_t(values, rest_ss, 8)
        for r in range(0, rows, max(1, rows // 50)):
            t, k = reference(values[r], float(rest_ss[r]), 8)
            assert best_k[r] == k and (best[r] == t or math.isclose(best[r], t, rel_tol=1e-9)), (n, r)
