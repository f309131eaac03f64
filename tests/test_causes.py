"""Root-cause verdicts on small generated jobs, one per injected cause, and the fix replays.

The generator's truth is read here (evaluation), never by transforms/whatif/causes.py.
"""
from __future__ import annotations

import dataclasses
import json
import re
import warnings

import numpy as np
import pyarrow as pa
import pytest

from schemas.fleet import JOB_CAUSE_SCHEMA
from transforms.synth import Cause, JobSpec, generate_job
from transforms.whatif import analyze_model, compile_job
from transforms.whatif.model import distinct, median
from schemas.causes import EVIDENCE_LABELS, FIX_NAMES
from transforms.whatif.causes import CauseError, classify, sequence_workload, verdict_json, verdict_row
from transforms.whatif.causes.signals import nanmedian, peer_median

STAGE = Cause("last_stage_imbalance", {"forward_extra": 0.6, "backward_extra": 0.25})
GC = Cause("gc_pauses", {"period": 3, "pause": 0.4})
CASES = {
    "clean": ((), 4096, False),
    "slow-worker": ((Cause("slow_worker", {"dp_rank": 1, "stage": 2, "factor": 1.6}),), 4096, False),
    "last-stage": ((STAGE,), 4096, False),
    "sequence": ((Cause("seq_len_imbalance", {}),), 32768, True),
    "sequence-unrecorded": ((Cause("seq_len_imbalance", {}),), 32768, False),
    "gc": ((GC,), 4096, False),
    "flapping-link": ((Cause("comm_flapping", {"dp_rank": 2, "stage": 1, "factor": 12, "steps_fraction": 0.4}),), 4096, False),
    # one step of 16 with the link 200x slow: the job straggles by S, all of it in that one step
    "one-held-step": ((Cause("comm_flapping", {"dp_rank": 2, "stage": 1, "factor": 200, "steps_fraction": 0.0625}),), 4096, False),
    "stage-and-gc": ((STAGE, GC), 4096, False),
    # the hard case: a 1.6x slower worker on stage 1 hides the heavy last stage from M_W and M_S
    "worker-and-stage": ((Cause("slow_worker", {"dp_rank": 1, "stage": 1, "factor": 1.6}), STAGE), 4096, False),
    "gc-and-worker": ((Cause("slow_worker", {"dp_rank": 3, "stage": 0, "factor": 2.0}), GC), 4096, False),
}


def _analyse(name: str):
    causes, context, record = CASES[name]
    spec = JobSpec(job_id=name, dp=4, pp=4, microbatches=8, steps=16, sessions=2, causes=causes, seed=3,
                   context_length=context, record_seq_lens=record)
    job = generate_job(spec)
    # the generator always records lengths with a sequence cause: hide them to test the fallback
    trace = job.trace if record or not name.endswith("unrecorded") else job.trace.drop_columns(["seq_lens"])
    model = compile_job(trace, job.meta, name)
    result = analyze_model(model)
    workload = sequence_workload(trace, model)
    return job, model, result, classify(model, result, workload=workload), workload


@pytest.fixture(scope="module")
def analysed():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _analyse(name)
        return cache[name]

    return get


@pytest.mark.parametrize("name, expected", [
    ("clean", "none"),
    ("slow-worker", "individual-worker"),
    ("last-stage", "stage-imbalance"),
    ("sequence", "sequence-imbalance"),
    ("sequence-unrecorded", "sequence-imbalance"),
    ("gc", "python-gc"),
    ("flapping-link", "communication"),
])
def test_each_injected_cause_is_the_primary_verdict(analysed, name, expected):
    job, _, result, verdict, _ = analysed(name)
    assert verdict.cause == expected, (verdict.cause, verdict.evidence)
    if expected == "none":
        assert result.slowdown < 1.1 and verdict.causes == []
    else:
        assert verdict.causes[0] == expected and 0.5 <= verdict.confidence <= 1.0
        assert verdict.causes == [expected], "no second cause in a single-cause job"


def test_slow_worker_is_located_and_its_fix_recovers_the_true_slowdown(analysed):
    job, _, result, verdict, _ = analysed("slow-worker")
    assert verdict.implicated_workers == [(1, 2)]
    assert verdict.evidence["m_w"] == pytest.approx(result.mw.rem)
    fix = verdict.primary_fix
    # replacing the machine should remove the slowdown the generator injected
    assert fix.fixed_slowdown < 1.05
    injected = json.loads(job.truth["cause_slowdowns"])["slow_worker"]
    assert fix.savings_fraction == pytest.approx(1 - 1 / injected, abs=0.05)


def test_stage_fix_moves_work_off_the_last_stage(analysed):
    _, _, result, verdict, _ = analysed("last-stage")
    assert verdict.evidence["m_s"] == pytest.approx(result.ms.rem) and result.ms.rem >= 0.5
    fix = verdict.fixes["stage-imbalance"]
    assert fix.explained > 0.7 and 1.0 <= fix.fixed_slowdown < result.slowdown


def test_gc_detector_sees_rotating_forward_only_pauses(analysed):
    job, _, result, verdict, _ = analysed("gc")
    evidence = verdict.evidence
    truth = json.loads(job.truth["cause_params"])["gc_pauses"]
    assert evidence["gc_workers"] >= 8 and evidence["gc_max_worker_share"] < 0.3
    assert evidence["gc_backward_outliers"] == 0
    assert evidence["gc_mean_pause"] == pytest.approx(truth["pause"], rel=0.3)
    assert abs(evidence["gc_pauses"] - truth["pauses"]) <= 0.2 * truth["pauses"]
    assert verdict.implicated_workers == []  # GC rotates: no machine to blame
    # planned GC still pays the collection, so it saves less than deleting the pauses would
    fix = verdict.primary_fix
    assert 0 < fix.savings_fraction < 1 - 1 / result.slowdown + 1e-9
    assert fix.explained > 0.8


def test_sequence_evidence_with_recorded_lengths(analysed):
    _, _, _, verdict, workload = analysed("sequence")
    evidence = verdict.evidence
    assert workload is not None
    assert evidence["forward_backward_r_normalised"] >= 0.9 and evidence["workload_forward_r"] >= 0.9
    assert evidence["imbalance_degree"] > 1.2
    assert evidence["imbalance_degree_rebalanced"] <= evidence["imbalance_degree"]
    assert "imbalance_degree" not in analysed("sequence-unrecorded")[3].evidence


def test_a_mixture_reports_both_causes_strongest_first(analysed):
    _, _, _, verdict, _ = analysed("stage-and-gc")
    assert set(verdict.causes) == {"stage-imbalance", "python-gc"}
    strengths = [verdict.fixes[c].explained for c in verdict.causes]
    assert strengths == sorted(strengths, reverse=True)


def test_a_slow_worker_does_not_hide_the_stage_imbalance_it_masks(analysed):
    job, _, result, verdict, _ = analysed("worker-and-stage")
    assert result.mw.workers == [(1, 1)] and result.ms.rem < 0.5, "the case M_W / M_S alone misread"
    assert verdict.causes == ["individual-worker", "stage-imbalance"] and verdict.implicated_workers == [(1, 1)]
    peers = verdict.evidence["peer_workers"]
    assert [(w["dp_rank"], w["stage"]) for w in peers] == [(1, 1)] and peers[0]["ratio"] == pytest.approx(1.6, rel=0.05)
    stage = verdict.fixes["stage-imbalance"]
    # alone, rebalancing the stages barely helps (the slow worker stays the bottleneck); after it, it removes most of the rest
    assert stage.explained < 0.1 <= stage.explained_given_others
    joint = verdict.joint_fix
    assert joint.fixed_slowdown < min(f.fixed_slowdown for c, f in verdict.fixes.items() if c in verdict.causes)
    assert joint.fixed_slowdown < 1.05
    assert "dp 1 / stage 1" in verdict.explanations["individual-worker"] and "1.6x" in verdict.explanations["individual-worker"]


def test_gc_pauses_beside_a_slow_worker_are_listed_too(analysed):
    _, _, _, verdict, _ = analysed("gc-and-worker")
    assert verdict.cause == "individual-worker" and set(verdict.causes) == {"individual-worker", "python-gc"}
    assert verdict.implicated_workers == [(3, 0)], "GC rotates: only the slow machine is blamed"


@pytest.mark.parametrize("name", ["slow-worker", "last-stage", "sequence", "gc", "flapping-link", "worker-and-stage", "clean"])
def test_every_verdict_has_a_sentence_and_readable_evidence(analysed, name):
    _, _, _, verdict, _ = analysed(name)
    assert verdict.explanation and set(verdict.explanations) >= set(verdict.causes or [verdict.cause])
    for cause in verdict.causes:
        sentence = verdict.explanations[cause]
        assert sentence.endswith(".") and not re.search(r"[a-z]+_[a-z]+", sentence), sentence   # words, not metric names
        assert f"{100 * verdict.fixes[cause].savings_fraction:.0f}% faster" in sentence
        assert verdict.fixes[cause].description in FIX_NAMES.values()
    assert set(verdict.evidence) <= set(EVIDENCE_LABELS), set(verdict.evidence) - set(EVIDENCE_LABELS)
    ranked = [verdict.fixes[c].savings_fraction for c in verdict.causes]
    assert ranked == sorted(ranked, reverse=True), "listed by GPU-hours saved"


def test_peer_median_leaves_each_element_out():
    pairs = np.array([[1.0, 2.0], [5.0, 1.0], [3.0, 9.0]])             # two DP ranks: each one's peer is the other
    np.testing.assert_allclose(peer_median(pairs), [[2.0, 1.0], [1.0, 5.0], [9.0, 3.0]])
    row = np.array([4.0, 1.0, 7.0, 2.0])
    expected = [np.median(np.delete(row, i)) for i in range(len(row))]
    np.testing.assert_allclose(peer_median(row), expected)
    rng = np.random.default_rng(5)
    for n in range(2, 9):                                               # ties, odd and even peer counts
        rows = rng.integers(0, 4, size=(200, n)).astype(np.float64)
        brute = [[np.median(np.delete(r, i)) for i in range(n)] for r in rows]
        assert np.array_equal(peer_median(rows), brute)


def test_median_helpers_equal_numpy_bit_for_bit():
    """nanmedian, median and distinct (which spare the one-job path numpy.ma's import) against
    numpy: small arrays (numpy's masked-array path), NaN-heavy and all-NaN slices, infinities,
    ties, every axis."""
    rng = np.random.default_rng(3)
    for _ in range(500):
        shape = tuple(rng.integers(1, 7, size=rng.integers(1, 4)))
        values = np.round(rng.lognormal(size=shape), 1)                  # ties
        values[rng.random(shape) < rng.random()] = np.nan
        values[rng.random(shape) < 0.05] = np.inf
        axis = int(rng.integers(0, len(shape)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)          # numpy warns on all-NaN slices
            expected, whole = np.nanmedian(values, axis=axis), np.median(values)
        assert np.array_equal(nanmedian(values, axis), expected, equal_nan=True), (values, axis)
        assert np.array_equal(median(values), whole, equal_nan=True), values
        integers = rng.integers(-3, 4, size=shape)
        assert np.array_equal(distinct(integers), np.unique(integers))


def test_verdict_row_fits_the_job_cause_schema(analysed):
    job, model, _, verdict, _ = analysed("slow-worker")
    hosts = {(1, 2): "node-bad"}
    row = verdict_row(verdict, gpu_hours=100.0, hosts=hosts)
    table = pa.Table.from_pylist([row], schema=JOB_CAUSE_SCHEMA)
    assert table.num_rows == 1
    assert row["implicated_hosts"] == ["node-bad"] and row["cause"] == "individual-worker"
    assert row["savings_gpu_hours"] == pytest.approx(100.0 * verdict.primary_fix.savings_fraction)
    assert json.loads(row["evidence_json"])["m_w"] == pytest.approx(verdict.evidence["m_w"])
    savings = json.loads(row["savings_json"])
    assert set(savings) >= {"individual-worker", "stage-imbalance", "communication"}
    assert row["explanation"] == verdict.explanation and savings["individual-worker"]["explanation"] in row["explanation"]
    assert savings["individual-worker"]["fix"] == verdict.primary_fix.description


def test_classify_refuses_a_result_of_another_job(analysed):
    _, model, _, _, _ = analysed("clean")
    _, _, other, _, _ = analysed("gc")
    with pytest.raises(CauseError, match="'clean'"):
        classify(model, other)


def test_analyze_and_classify_is_analyze_job_plus_the_verdict(analysed):
    from transforms.whatif import analyze_job
    from transforms.whatif.causes import analyze_and_classify, job_cause_table

    job, _, _, verdict, _ = analysed("slow-worker")
    result, again = analyze_and_classify(job.trace, job.meta, "slow-worker")
    assert result.to_reference_json() == analyze_job(job.trace, job.meta, "slow-worker").to_reference_json()
    assert again.cause == verdict.cause and again.evidence == verdict.evidence
    workers = [{"dp_rank": d, "stage": p, "host": f"node-{d}-{p}"} for d in range(4) for p in range(4)]
    table = job_cause_table(again, 50.0, workers)
    assert table.column("implicated_hosts").to_pylist() == [["node-1-2"]]


@pytest.mark.parametrize("name", ["worker-and-stage", "gc-and-worker", "sequence"])
def test_signals_computed_beside_the_analysis_give_the_same_verdict(name, analysed):
    """With replay threads, analyze_and_classify computes the pair signals in a thread of their
    own while the analysis replays; the verdict is the same, evidence order included."""
    from transforms.whatif.causes import analyze_and_classify
    from transforms.whatif.replay import replay_threads

    job, _, _, verdict, _ = analysed(name)
    trace = job.trace
    with replay_threads(2):
        _, threaded = analyze_and_classify(trace, job.meta, name)
    assert json.dumps(verdict_json(threaded, None), default=float) == json.dumps(verdict_json(verdict, None), default=float)
    assert list(threaded.evidence) == list(verdict.evidence)


def test_sums_of_pieces_of_the_original_cost_are_computed_once_per_job_and_read_only():
    """The signals ask for the same forward sums several times: the second answer is the first
    (read-only, equal to a fresh sum); sums over another cost are computed each time."""
    from transforms.whatif.causes.signals import FORWARD, _pieces_sum, pairs, pieces_sum, whole_forward

    job = generate_job(JobSpec(job_id="memo", dp=2, pp=2, microbatches=4, steps=6, sessions=1, seed=5))
    model = compile_job(job.trace, job.meta, "memo")
    forward, _ = pairs(model)
    first = whole_forward(model, forward)
    assert whole_forward(model, forward) is first and not first.flags.writeable
    np.testing.assert_array_equal(first, _pieces_sum(model, forward, (FORWARD,), model.original_cost))
    doubled = 2 * model.original_cost
    other = pieces_sum(model, forward, (FORWARD,), doubled)
    assert other is not pieces_sum(model, forward, (FORWARD,), doubled) and other.flags.writeable
    np.testing.assert_allclose(other, 2 * first)
    again, _ = pairs(model)                     # new rows: a sum of their own
    assert whole_forward(model, again) is not first


def test_a_stall_in_one_microbatch_every_step_blames_its_worker_and_its_fix_removes_it():
    """A worker that stalls in one backward every step (a pause in a gradient hook) is as slow as its
    step's whole compute says, though its typical microbatch is not: the peer comparison takes the
    step's compute against its peers' when that is higher, and the repaired worker has no compute
    above its peers' median of the same compute, except where a GC pause is python-gc's to remove."""
    from transforms.whatif.causes.paired import pair_signals
    from transforms.whatif.causes.fixes import at_peer_speed
    from transforms.whatif.causes.signals import BACKWARD

    job = generate_job(JobSpec(job_id="stall", dp=4, pp=4, microbatches=8, steps=16, sessions=2, seed=3))
    model = compile_job(job.trace, job.meta, "stall")
    worker = (1, 2)
    lanes = np.flatnonzero(model.lane_dp == worker[0])
    stalled = np.flatnonzero((model.op_optype == BACKWARD) & (model.op_stage == worker[1]))[-1]
    typical = float(np.median(model.original_cost[stalled]))
    model.original_cost[stalled, lanes] += 8 * typical       # one backward per step, 9x its usual time
    paired = pair_signals(model)
    peers = paired.peers
    assert paired.workers.workers() == [worker]
    fixed = at_peer_speed(model, [worker], peers)
    others = np.delete(model.original_cost[stalled].reshape(model.n_steps, model.dp_size), worker[0], axis=1)
    assert np.allclose(fixed[stalled, lanes], np.median(others, axis=1))   # at its peers' median, step by step
    keep = np.zeros(model.original_cost.shape, dtype=bool)
    keep[stalled, lanes] = True
    kept = at_peer_speed(model, [worker], peers, keep)
    assert np.allclose(kept[stalled, lanes], model.original_cost[stalled, lanes] / peers.backward[worker])


def test_time_covered_by_busy_spans_counts_overlapping_spans_once():
    from transforms.intervals import covered as _covered

    # busy: [0, 4] and [2, 6] overlap (one blocked recv inside a compute), [8, 9] apart
    busy_start, busy_end = np.array([2.0, 0.0, 8.0]), np.array([6.0, 4.0, 9.0])
    gaps = _covered(np.array([1.0, 5.0, 6.5, 0.0]), np.array([3.0, 8.5, 7.5, 10.0]), busy_start, busy_end)
    assert gaps.tolist() == [2.0, 1.5, 0.0, 7.0]
    assert _covered(np.array([0.0]), np.array([1.0]), np.zeros(0), np.zeros(0)).tolist() == [0.0]


def test_one_slow_chunk_at_the_usual_work_makes_a_stage_a_slow_machine():
    """One DP rank, two chunks per stage: the last stage's chunks 3 and 7 are slow in forward (a GC
    pause at every chunk forward on that rank). Chunk 7 also holds the loss head (more operations),
    so the stage as a whole looks both heavier and slower; chunk 3 runs the usual operations at over
    twice the pace, which only a slow machine does. An uneven split (chunk 0 with 3x the layers, 3x
    the operations at the usual pace) stays a heavy partition. Per-chunk means as measured on a real
    interleaved pp4 run (forward / backward ms, operations)."""
    import numpy as np

    from transforms.whatif.causes.signals import usual_work_slower
    from transforms.whatif.causes.signals import ChunkWork
    from transforms.whatif.causes.verdict import CauseRules

    MORE_WORK, SLOWER_PACE = CauseRules.more_work, CauseRules.slower_pace

    chunks = np.arange(8)
    ops = np.array([10, 8, 8, 8, 8, 8, 8, 13], dtype=float)
    backward = np.array([8.27, 7.91, 8.10, 7.89, 7.92, 8.11, 8.08, 7.85]) * 1e-3
    gc_paused = ChunkWork(chunks, ops, ops, np.array([4.70, 4.28, 4.35, 14.35, 4.47, 4.48, 4.31, 17.32]) * 1e-3, backward)
    ratio, speed = gc_paused.of([3, 7])
    assert ratio >= MORE_WORK and speed >= SLOWER_PACE   # the stage alone cannot tell
    assert usual_work_slower(np.array([3, 7]), gc_paused, MORE_WORK, SLOWER_PACE)
    split_ops = ops.copy()
    split_ops[0] = 30
    uneven = ChunkWork(chunks, split_ops, split_ops, np.array([14.1, 4.28, 4.35, 4.4, 4.47, 4.48, 4.31, 6.9]) * 1e-3,
                       backward * split_ops / ops)
    assert not usual_work_slower(np.array([0, 4]), uneven, MORE_WORK, SLOWER_PACE)


@pytest.mark.parametrize("pace, dropped", [((0.8, 1.2), True), ((0.95, 1.05), False), ((0.9, 1.12), False)])
def test_a_hot_stage_as_much_slower_as_heavier_is_no_heavier_partition(pace, dropped):
    """One DP rank per stage: the hot stage's chunk does 1.13x the median chunk's work (its loss
    head's operations). At 1.2x the pace as well (beyond the threshold's 10%, and as large as the
    work's share), the partition is not shown at fault: stage imbalance is dropped (METHOD's M_W
    worker, if its signature holds, stays) and the job says so where nothing else is named. At the
    usual pace, or a pace below the work's excess, it stays a heavier partition."""
    import types

    import numpy as np

    from transforms.whatif.causes import explain
    from transforms.whatif.causes.detect import BACKWARD, FORWARD, _Candidate, _work_or_speed
    from transforms.whatif.causes.signals import ChunkWork
    from transforms.whatif.causes.verdict import CauseRules

    model = types.SimpleNamespace(op_gmc=np.array([0, 0, 1, 1]), op_stage=np.array([0, 0, 1, 1]),
                                  op_optype=np.array([FORWARD, BACKWARD, FORWARD, BACKWARD]))
    result = types.SimpleNamespace(mw=types.SimpleNamespace(workers=[(0, 1)]))
    signals = types.SimpleNamespace(chunks=types.SimpleNamespace(heaviest_stage=1))
    ops, seconds = np.array([100.0, 130.0]), np.array([0.01, 0.015])
    work = ChunkWork(np.arange(2), ops, ops, seconds, 2 * seconds, (np.array(pace), np.array([1.0, 1.0])))
    out = [_Candidate("stage-imbalance", "stage", 1.0, 0.1, 0.4),
           _Candidate("individual-worker", "worker-compute", 0.9, 0.1, 0.6, ((0, 1),))]
    evidence = {}
    kept = _work_or_speed(model, result, signals, work, out, CauseRules(), evidence)
    assert [c.cause for c in kept] == (["individual-worker"] if dropped else ["stage-imbalance", "individual-worker"])
    assert evidence.get("chunk_undecided", False) is dropped
    assert evidence["chunk_work_ratio"] == pytest.approx(130 / 115)
    if dropped:
        evidence["heaviest_chunk"] = [1, 1]
        sentence = explain.insufficient_sentence(1.3, {"alpha": 0.01}, evidence)
        assert "stage 1's chunk does 1.13x the median chunk's recorded work at 1.20x its pace" in sentence
        assert "DP replicas of the stages" in sentence


def test_a_heavier_partition_that_m_w_blames_is_named_whatever_evening_it_saves():
    """One DP rank per stage, stage 0's chunk records 3x the median chunk's operations at the usual
    pace (an uneven split, as measured on a real 4-stage 1F1B run: 2.88x at 0.98x), and METHOD's M_W
    set is that stage's worker: the worker candidate becomes stage imbalance carrying M_W's
    idealisation as its attribution, so the verdict names it even where evening the layers saves
    nothing (the stages that would take them on lie on the critical path). Where the heavy chunk is
    not in the M_W set, no attribution: its own fix must explain the straggling."""
    import types

    import numpy as np

    from transforms.whatif.causes.detect import BACKWARD, FORWARD, _Candidate, _work_or_speed
    from transforms.whatif.causes.signals import ChunkWork
    from transforms.whatif.causes.verdict import CauseRules

    model = types.SimpleNamespace(op_gmc=np.repeat(np.arange(4), 2), op_stage=np.repeat(np.arange(4), 2),
                                  op_optype=np.tile([FORWARD, BACKWARD], 4))
    ops = np.array([30.0, 10.0, 10.0, 10.0])
    seconds = 1e-3 * ops * np.array([0.98, 1.0, 1.0, 1.02])
    work = ChunkWork(np.arange(4), ops, ops, seconds, 2 * seconds)
    for mw_stage, attribution in ((0, "worker-compute"), (1, None)):
        result = types.SimpleNamespace(mw=types.SimpleNamespace(workers=[(0, mw_stage)]))
        signals = types.SimpleNamespace(chunks=types.SimpleNamespace(heaviest_stage=0))
        out = [_Candidate("individual-worker", "worker-compute", 0.9, 0.1, 0.6, ((0, mw_stage),))]
        evidence = {}
        kept = _work_or_speed(model, result, signals, work, out, CauseRules(), evidence)
        assert [(c.cause, c.scenario, c.attribution) for c in kept] == [("stage-imbalance", "stage", attribution)]
        assert evidence["chunk_work_ratio"] >= CauseRules.more_work > 1 > evidence["chunk_speed_ratio"] - 0.05


def test_straggling_held_in_one_step_is_the_jobs_own_variation(analysed):
    """S >= 1.1, yet what the best fix (transfers at their typical time) removes sits in one step of
    16: a transfer held up once is no straggler to fix ("none", evidence `transient`); the same link
    slow in 40% of the steps is a flapping link ("communication", test above)."""
    job, _, result, verdict, _ = analysed("one-held-step")
    per_step = result.step_t_nodelay / result.step_t_noblk
    assert result.slowdown >= 1.1 and (per_step > 1.5).sum() == 1, per_step   # one step holds it
    assert verdict.cause == "none" and verdict.causes == [] and verdict.evidence.get("transient") is True
    assert "transient" in verdict.explanation and "one step" in verdict.explanation


def test_untraced_time_must_stand_out_of_the_job_not_only_of_its_dp_peers(monkeypatch):
    """A worker is named for untraced CPU work when its time between ops is twice its DP peers' and
    twice the job's other workers' in most steps. Per-step untraced ms as measured on two real runs
    (2 x 2, CPU ranks): a clean CPU-bound run, where worker (1, 0) has 6-60 ms against its peer's
    3-4 ms but the pipeline's other stage has 10-34 ms (the job's noise: nobody named), and a run
    with rank 0 paused before every send (270 ms against 5-26 ms: named)."""
    import types

    import numpy as np

    from transforms.whatif.causes import untraced

    def names(per_step_ms):
        model = types.SimpleNamespace(dp_size=2, pp_size=2, meta=types.SimpleNamespace(host_compute=True), worker_load=None)
        result = types.SimpleNamespace(launch_by_dp_rank={0: 1.007, 1: 1.047}, launch_by_stage={0: 1.035, 1: 1.016},
                                       launch_slowdown=1.0508, step_t_nodelay=np.array([0.47, 0.47, 0.47]),
                                       discarded=False, slowdown=1.2)
        monkeypatch.setattr(untraced, "p2p_partner", lambda model: None)
        monkeypatch.setattr(untraced, "untraced_time", lambda model, d, p, partner=None: np.array(per_step_ms[(d, p)]) / 1e3)
        return [w for w, *_ in untraced.untraced_workers(model, result)]

    clean = {(0, 0): [3.9, 3.4, 4.4], (0, 1): [25.1, 10.4, 17.9], (1, 0): [14.1, 5.7, 60.1], (1, 1): [34.4, 21.3, 12.2]}
    assert names(clean) == []
    paused = {(0, 0): [269.2, 270.6, 290.8], (0, 1): [16.1, 16.0, 15.3], (1, 0): [5.6, 14.3, 16.2], (1, 1): [19.0, 26.4, 16.0]}
    assert names(paused) == [(0, 0)]


def test_a_step_whose_transfers_and_compute_slowed_alike_is_the_host_s_not_the_network_s():
    """Communication localised to a step needs its transfers slowed beyond its compute: one step of
    a clean job with every transfer 3x is a flapping link; the same step with its compute 3x too is
    the host's contention (CPU ranks, gloo transfers are CPU work), not the network's."""
    from transforms.whatif.causes.localise import comm_localised
    from transforms.whatif.causes.sequences import BACKWARD, FORWARD

    job = generate_job(JobSpec(job_id="cl", dp=4, pp=2, microbatches=4, steps=6, sessions=1, seed=5))
    model = compile_job(job.trace, job.meta, "cl")
    hot = model.lane_step == model.steps[2]
    compute = np.isin(model.op_optype, (FORWARD, BACKWARD))

    def scaled(rows):
        out = type(model).__new__(type(model))
        out.__dict__.update(model.__dict__)
        cost = model.original_cost.copy()
        cost[np.ix_(np.flatnonzero(rows), np.flatnonzero(hot))] *= 3.0
        out.original_cost = cost
        return out

    link, host = scaled(model.op_is_comm), scaled(model.op_is_comm | compute)
    assert comm_localised(link, {}, 0.01, floor=1.1)
    evidence = {}
    assert not comm_localised(host, evidence, 0.01, floor=1.1) and evidence["comm_localised"] is False


def test_the_sequence_signature_is_a_test_at_the_false_alarm_rate_not_a_fixed_r():
    """t = r sqrt(df / (1 - r^2)) against Student's t, its tail integrated numerically here: r 0.9
    with 4 degrees of freedom decides at 1%, 0.7 with 4 does not, 0.5 with 30 does; a perfect
    correlation is p 0, none or no degrees of freedom p 1."""
    import math

    from transforms.whatif.causes.paired import correlation_p

    def t_tail(t: float, df: int) -> float:   # midpoint rule over Student's t density, to 50
        c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
        n, hi = 200_000, 50.0
        h = (hi - t) / n
        return sum(c * (1 + ((t + (i + 0.5) * h) ** 2) / df) ** (-(df + 1) / 2) for i in range(n)) * h

    for r, df in [(0.9, 4), (0.7, 4), (0.5, 30)]:
        t = r * math.sqrt(df / (1 - r * r))
        assert correlation_p(r, df) == pytest.approx(t_tail(t, df), abs=2e-4)
    assert correlation_p(0.9, 4) < 0.01 < correlation_p(0.7, 4)
    assert correlation_p(0.5, 30) < 0.01
    assert correlation_p(1.0, 3) == 0.0 and correlation_p(math.nan, 10) == 1.0 and correlation_p(0.9, 0) == 1.0


def test_the_sequence_sentence_states_the_correlation_that_was_measured():
    """One microbatch per worker and step has no forward / backward pairs (that r is NaN): the
    sentence states compute against the recorded tokens, never "r = nan"; with both, both."""
    from transforms.whatif.causes import Fix
    from transforms.whatif.causes.explain import cause_sentence

    fix = Fix("sequence-imbalance", step_time=0.1, fixed_slowdown=1.12, explained=0.26, savings_fraction=0.037)
    base = {"imbalance_degree": 1.07, "sequence_even_explained": 0.36}
    tokens_only = cause_sentence("sequence-imbalance", {**base, "forward_backward_r_normalised": float("nan"),
                                                        "workload_compute_r": 0.77}, fix, [], 1)
    assert "nan" not in tokens_only and "recorded tokens (r = 0.77)" in tokens_only
    assert "forward and backward" not in tokens_only
    both = cause_sentence("sequence-imbalance", {**base, "forward_backward_r_normalised": 0.95,
                                                 "workload_compute_r": 0.8}, fix, [], 1)
    assert "slow together (r = 0.95)" in both and "recorded tokens (r = 0.80)" in both


def test_the_stage_sentence_of_a_heavier_partition_states_its_work_and_what_evening_it_gains():
    """A heavier partition the trace measured (recorded operations at the usual pace) is told by its
    work and by the share its stage's idealisation explains, not by M_S (it is not the last stage);
    where evening the layers saves under the floor, the sentence says why it gains little. A last
    stage's imbalance without that measurement keeps M_S."""
    from transforms.whatif.causes import Fix
    from transforms.whatif.causes.explain import cause_sentence
    from transforms.whatif.causes.verdict import CauseRules

    base = {"heaviest_chunk": [0, 0], "chunk_ratio": 2.21, "m_s": 0.03}
    measured = {**base, "chunk_work_ratio": 2.88, "chunk_speed_ratio": 0.98, "stage_idealised_explained": 1.32}
    little = Fix("stage-imbalance", step_time=0.22, fixed_slowdown=1.14, explained=-0.08, savings_fraction=0.0)
    text = cause_sentence("stage-imbalance", measured, little, [], 4)
    assert "2.88x its recorded operations at 0.98x their pace (a heavier partition" in text
    assert "M_S" not in text and "the job would be 0% faster: the stages that would take on its layers" in text
    pays = Fix("stage-imbalance", step_time=0.15, fixed_slowdown=1.02, explained=0.89,
               savings_fraction=2 * CauseRules.min_savings)
    assert "gains little" not in cause_sentence("stage-imbalance", measured, pays, [], 4)
    last = cause_sentence("stage-imbalance", {**base, "heaviest_chunk": [3, 3], "m_s": 0.62}, pays, [], 4)
    assert "the last stage explains 62% of the straggling time (M_S)" in last and "recorded operations" not in last


def test_cpu_ranks_on_one_host_have_no_network_to_blame():
    """A flapping link (one worker's transfers 12x in 40% of the steps) is communication, also
    between CPU ranks; between CPU ranks that all ran on one host (the trace's `host` column) the
    transfers never left it: their time is the host's CPU and memory work, and no communication
    cause is proposed. Where the ranks are GPUs, one host keeps its links (NVLink, PCIe)."""
    from transforms.whatif.causes.detect import ran_on_one_host

    causes, context, record = CASES["flapping-link"]
    job = generate_job(JobSpec(job_id="fl", dp=4, pp=4, microbatches=8, steps=16, sessions=2, causes=causes, seed=3,
                               context_length=context, record_seq_lens=record))
    cpu = dataclasses.replace(job.meta, host_compute=True)
    model = compile_job(job.trace, cpu, "fl")
    result = analyze_model(model)
    assert classify(model, result).cause == "communication"
    alone = classify(model, result, one_host=True)
    assert "communication" not in alone.causes and alone.evidence["transfers_on_one_cpu_host"]
    gpu = compile_job(job.trace, job.meta, "fl")
    assert classify(gpu, analyze_model(gpu), one_host=True).cause == "communication"
    one = job.trace.set_column(job.trace.schema.get_field_index("host"), "host", pa.array(["vm"] * job.trace.num_rows))
    assert ran_on_one_host(one) and not ran_on_one_host(job.trace)
    assert not ran_on_one_host(job.trace.drop_columns(["host"]))


def test_below_method_s_attribution_threshold_a_measured_slow_worker_is_still_named(analysed):
    """METHOD.md attributes nothing below S 1.03; the worker test is a measurement against DP
    peers, not an attribution, so a worker it decides is slow is named there too (its fix replayed:
    the worker at its peers' pace), as between 1.03 and 1.1. The slow-worker job's result stripped of
    attribution stands for such a window; the clean job's stays "none"."""
    _, model, result, verdict, _ = analysed("slow-worker")
    assert verdict.cause == "individual-worker"
    hidden = dataclasses.replace(result, slowdown=1.02, by_optype=None, mw=None)
    below = classify(model, hidden)
    assert below.cause == "individual-worker" and below.implicated_workers == verdict.implicated_workers
    assert below.evidence["attributed"] is False and below.confidence >= 0.99
    fix = below.fixes["individual-worker"]
    assert fix.savings_fraction == pytest.approx(verdict.fixes["individual-worker"].savings_fraction, rel=1e-9)
    assert "peer" in below.explanations["individual-worker"]
    _, clean_model, clean_result, _, _ = analysed("clean")
    clean = classify(clean_model, dataclasses.replace(clean_result, slowdown=1.02, by_optype=None, mw=None))
    assert clean.cause == "none" and not clean.causes


def test_an_unexplained_slowdown_a_fix_removes_says_so_without_only():
    """An unexplained verdict whose best replayed fix removes most of the straggling time says that
    fix would remove it, yet the trace shows no such cause; one whose best fix removes little says
    'only'. Never 'would remove only all (115%)'."""
    from transforms.whatif.causes.explain import verdict_sentence
    from transforms.whatif.causes.verdict import Fix

    big = Fix("individual-worker", 0.35, 1.02, 1.15, 0.07, "the slow stage's slow kind of work at the others' balance")
    small = dataclasses.replace(big, explained=0.2)
    sentence = verdict_sentence("unexplained", 1.106, 1.1, big)
    assert "only" not in sentence and "all (115%)" in sentence and "nothing in the trace shows that cause" in sentence
    assert "would remove only 20%" in verdict_sentence("unexplained", 1.106, 1.1, small)


def test_a_discarded_window_with_a_worker_its_jitter_cannot_decide_is_insufficient_evidence_not_none():
    """A real FSDP2 pipeline run whose replay is 10% off (discarded) and whose worker test leaves
    workers 1.4-1.7x their peers undecided at its 56% jitter: the verdict said "none, confidence
    1.00" beside those findings. Its S comes from the replay that does not match, so the measured
    compute decides: insufficient evidence, led by the mismatch, saying what would decide; never a
    blame. The same window with its undecided findings taken away is "none"."""
    import pathlib

    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif.causes import CauseRules, analyze_and_classify
    from transforms.whatif.causes.measured import measured_verdict
    from transforms.whatif.causes.paired import pair_signals

    run = pathlib.Path(__file__).parent / "data" / "real_stacks" / "pipe-clean-izb-pp2dp2-fsdp2-s0"
    job = convert_kineto(sorted(str(p) for p in run.glob("rank-*.json.gz")), "izb", "2026-11-27", {})
    result, verdict = analyze_and_classify(job.trace, job.job_meta(), "izb")
    assert result.discarded and verdict.worker_summary is not None
    assert verdict.cause == "insufficient-evidence" and verdict.implicated_workers == [] and verdict.confidence < 0.99
    sentence = verdict.explanations["insufficient-evidence"]
    assert sentence.startswith("The replay does not match the trace") and "would decide" in sentence
    model = compile_job(job.trace, job.job_meta(), "izb")
    paired = pair_signals(model)
    assert paired.workers.undecided
    decided = dataclasses.replace(paired, workers=dataclasses.replace(paired.workers, undecided=(), limits=()))
    assert measured_verdict(model, result, CauseRules(), {}, decided).cause == "none"


def test_a_cause_whose_fix_saves_less_than_the_floor_is_named_in_the_sentence_not_denied(analysed):
    """The generated sequence-imbalance job: listed at the default rules. With a savings floor
    above what any fix saves, the cause is not listed, the evidence says which signature was held
    back and what its fix saves (below_min_savings), and the sentence names it instead of saying
    that no cause's signature holds."""
    from transforms.whatif.causes import CauseRules

    job, model, result, verdict, workload = analysed("sequence")
    assert verdict.cause == "sequence-imbalance" and "below_min_savings" not in verdict.evidence
    held = classify(model, result, workload=workload, rules=CauseRules(min_savings=0.9))   # no fix saves 90%
    assert held.cause in ("none", "unexplained") and "sequence-imbalance" not in held.causes
    (small,) = [c for c in held.evidence["below_min_savings"] if c["cause"] == "sequence-imbalance"]
    assert 0 < small["saves"] < 0.9
    sentence = held.explanations[held.cause]
    assert "sequence-length imbalance's signature holds, but its fix would save only" in sentence
    assert f"{100 * small['saves']:.1f}% of the step" in sentence and "no cause's signature holds" not in sentence


def test_a_worker_without_peers_is_fixed_at_the_other_workers_speed_as_its_clean_twin_runs():
    """One DP rank per stage, stage 1's compute 2x (every op): METHOD's ideal is each op type's mean
    over every worker, the slow one's own ops in it, so idealising the slow worker keeps half its
    excess. The individual-worker fix brings it to the other workers' mean (fixes.at_others_speed)
    and predicts the clean twin (the same job, same seed, no slowdown) within 5%, where the fix at
    METHOD's ideal (the evidence's worker_compute_explained) stays over 20% above it."""
    from transforms.whatif.causes import analyze_and_classify

    spec = dict(job_id="tw", dp=1, pp=2, microbatches=8, steps=6, sessions=1, seed=3)
    slowed = generate_job(JobSpec(**spec, causes=(Cause("slow_worker", {"dp_rank": 0, "stage": 1, "factor": 2.0}),)))
    twin = generate_job(JobSpec(**spec))
    result, verdict = analyze_and_classify(slowed.trace, slowed.meta, "tw")
    twin_result, _ = analyze_and_classify(twin.trace, twin.meta, "tw")
    measured = float(twin_result.step_t_nodelay.mean())
    fix = verdict.fixes["individual-worker"]
    assert fix.description == FIX_NAMES["worker-others"]
    assert abs(fix.step_time / measured - 1.0) <= 0.05
    ran, ideal = float(result.step_t_nodelay.mean()), float(result.step_t_noblk.mean())
    at_method_ideal = ran - verdict.evidence["worker_compute_explained"] * (ran - ideal)
    assert at_method_ideal / measured - 1.0 > 0.2


def test_a_worker_m_w_alone_names_is_its_collections_where_they_take_out_m_w_s_share():
    """Without DP peers a worker METHOD's M_W names (no test decided it) on a rank the collector
    paused: where taking the pauses out saves at least M_W's own share (0.5) of the straggling time,
    the worker is its pauses; a worker a test decided, a worker the collector did not pause, or
    pauses worth less stay a slow worker."""
    from transforms.whatif.causes.detect import _Candidate, _worker_is_its_pauses
    from transforms.whatif.causes import CauseRules, Fix

    rules = CauseRules()
    named = _Candidate("individual-worker", "worker-compute", 1.0, 0.1, 0.6, ((0, 1),))
    gc_fix = Fix("python-gc", 0.1, 1.1, 0.5, 0.1, "", measured=True, step_savings=(0.010, 0.012, 0.011))
    planned = 0.003                                   # the pauses take out 0.014 s a step; the straggling time is 0.025 s
    assert _worker_is_its_pauses(named, ["individual-worker", "python-gc"], [(0, 1)], gc_fix, planned, 0.025, rules)
    assert not _worker_is_its_pauses(named, ["individual-worker"], [(0, 1)], gc_fix, planned, 0.030, rules)   # 0.014 < 0.015
    assert not _worker_is_its_pauses(named, ["individual-worker"], [(0, 0)], gc_fix, planned, 0.025, rules)
    tested = dataclasses.replace(named, scenario="worker-balance")
    assert not _worker_is_its_pauses(tested, ["individual-worker"], [(0, 1)], gc_fix, planned, 0.025, rules)
