"""Injected root causes leave their signature in the trace, and the truth says what was injected.

The signatures are the ones METHOD.md section 5 names (one hot worker, a hot last stage,
forward/backward correlated per microbatch with seq_lens, forward-only GC stalls on
rotating workers, slow transfers in some steps, launch delays the replay cannot see).
The what-if engine (transforms.whatif) is used as the reader that must reproduce them.
"""
from __future__ import annotations

import functools
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from transforms.synth import TRUTH_SCHEMA, Cause, JobSpec, Timing, generate_job, truth_table
from transforms.whatif.metrics import analyze_job

QUIET = Timing(compute_noise=0.005, worker_noise=0.001, step_noise=0.001, last_stage_extra=0.0, p2p_noise=0.05)


@functools.lru_cache(maxsize=None)
def job(name: str):
    shapes = {
        "clean": dict(dp=4, pp=4, microbatches=8),
        "slow_worker": dict(dp=4, pp=4, microbatches=8,
                            causes=(Cause("slow_worker", {"dp_rank": 1, "stage": 2, "factor": 2.0}),)),
        "last_stage": dict(dp=2, pp=4, microbatches=8,
                           causes=(Cause("last_stage_imbalance", {"forward_extra": 1.0, "backward_extra": 0.4}),)),
        "seq_len": dict(dp=4, pp=2, microbatches=8, context_length=32768,
                        causes=(Cause("seq_len_imbalance", {"doc_sigma": 1.5, "doc_median": 4096}),)),
        "balanced_seq_lens": dict(dp=2, pp=2, microbatches=4, context_length=8192, record_seq_lens=True),
        "gc": dict(dp=4, pp=4, microbatches=8, causes=(Cause("gc_pauses", {"period": 3, "pause": 0.4}),)),
        "flapping": dict(dp=4, pp=2, microbatches=8, steps=8,
                         causes=(Cause("comm_flapping", {"dp_rank": 2, "stage": 1, "factor": 10.0,
                                                         "steps_fraction": 0.5}),)),
        "untraced": dict(dp=2, pp=4, microbatches=8, causes=(Cause("untraced_cpu", {"fraction": 0.2}),)),
        "mixture": dict(dp=2, pp=4, microbatches=8,
                        causes=(Cause("last_stage_imbalance", {"forward_extra": 1.2, "backward_extra": 0.5}),
                                Cause("gc_pauses", {"period": 10, "pause": 0.2}))),
    }
    shape = {"steps": 6, "sessions": 2, "seed": 7, "timing": QUIET} | shapes[name]
    return generate_job(JobSpec(job_id=name, **shape))


@functools.lru_cache(maxsize=None)
def analysed(name: str):
    generated = job(name)
    return analyze_job(generated.trace, generated.meta, name, attribution=True)


def frame(name: str) -> pd.DataFrame:
    df = job(name).trace.to_pandas()
    df["optype"] = df["optype"].astype(str)
    return df


def compute_rows(df: pd.DataFrame, optype: str) -> pd.DataFrame:
    return df[df.optype == optype]


def test_clean_job_has_no_injected_cause_and_replays_faithfully():
    truth, result = job("clean").truth, analysed("clean")
    assert truth["causes"] == [] and truth["primary_cause"] == "clean"
    assert truth["true_slowdown"] == 1.0 and truth["affected_workers"] == []
    assert result.launch_slowdown < 1.05
    assert result.slowdown == pytest.approx(truth["expected_slowdown"], rel=0.01)
    assert result.slowdown < 1.05


def test_slow_worker_is_one_hot_cell_with_every_compute_op_slower():
    df = frame("slow_worker")
    stage2 = df[(df.stage == 2) & df.optype.str.endswith("compute")]
    ratio = stage2[stage2.dp_rank == 1].duration.median() / stage2[stage2.dp_rank != 1].duration.median()
    assert ratio == pytest.approx(2.0, rel=0.05)
    truth = job("slow_worker").truth
    assert truth["affected_workers"] == [{"dp_rank": 1, "stage": 2}]
    host = json.loads(truth["cause_params"])["slow_worker"]["host"]
    workers = job("slow_worker").manifest.column("workers")[0].as_py()
    assert host == next(w["host"] for w in workers if (w["dp_rank"], w["stage"]) == (1, 2))
    assert truth["affected_hosts"] == [host]
    result = analysed("slow_worker")
    assert np.unravel_index(np.argmax(result.worker_slowdown), result.worker_slowdown.shape) == (1, 2)
    assert result.slowdown == pytest.approx(truth["expected_slowdown"], rel=0.01)
    assert truth["true_slowdown"] > 1.2


def test_last_stage_imbalance_makes_the_last_stage_row_hot():
    df = frame("last_stage")
    for optype, expected in (("forward-compute", 2.0), ("backward-compute", 1.4)):
        rows = compute_rows(df, optype)
        ratio = rows[rows.stage == 3].duration.mean() / rows[rows.stage < 3].duration.mean()
        assert ratio == pytest.approx(expected, rel=0.03)
    result = analysed("last_stage")
    assert max(result.by_stage, key=result.by_stage.get) == 3
    assert result.ms.rem > 0.5
    assert {tuple(w.values()) for w in job("last_stage").truth["affected_workers"]} == {(0, 3), (1, 3)}


def test_sequence_length_imbalance_is_recorded_and_drives_compute():
    df = frame("seq_len")
    compute = df[df.optype.str.endswith("compute")]
    assert compute.seq_lens.notna().all() and df[~df.optype.str.endswith("compute")].seq_lens.isna().all()
    totals = compute.seq_lens.map(sum)
    assert (totals == 32768).all()  # documents packed into full microbatches
    squares = compute.seq_lens.map(lambda lengths: float(np.sum(np.square(np.asarray(lengths, float)))))
    key = ["step", "dp_rank", "mb_id"]
    # The same microbatch carries the same documents on every stage, forward and backward.
    assert (compute.assign(sq=squares).groupby(key).sq.nunique() == 1).all()
    stage0 = compute[compute.stage == 0].assign(sq=squares)
    forward = stage0[stage0.optype == "forward-compute"].set_index(key)
    backward = stage0[stage0.optype == "backward-compute"].set_index(key).loc[forward.index]
    assert np.corrcoef(forward.duration, backward.duration)[0, 1] >= 0.9
    assert np.corrcoef(forward.duration, forward.sq)[0, 1] >= 0.9
    params = json.loads(job("seq_len").truth["cause_params"])["seq_len_imbalance"]
    assert params["imbalance_degree"] > 1.2
    assert analysed("seq_len").slowdown > 1.05


def test_balanced_packing_records_seq_lens_without_imbalance():
    df = frame("balanced_seq_lens")
    compute = df[df.optype.str.endswith("compute")]
    assert (compute.seq_lens.map(sum) == 8192).all()
    assert job("balanced_seq_lens").truth["causes"] == []
    assert frame("clean").seq_lens.isna().all()


def test_gc_pauses_are_forward_only_sporadic_and_rotate_over_workers():
    df = frame("gc")
    params = json.loads(job("gc").truth["cause_params"])["gc_pauses"]
    stalls = []
    for optype in ("forward-compute", "backward-compute"):
        rows = compute_rows(df, optype)
        typical = rows.groupby("stage").duration.transform("median")
        stalls.append(rows[rows.duration > typical + 0.05])
    forward_stalls, backward_stalls = stalls
    assert len(backward_stalls) == 0
    assert len(forward_stalls) == params["pauses"] > 0
    per_worker_step = forward_stalls.groupby(["step", "dp_rank", "stage"]).size()
    assert per_worker_step.max() == 1                       # one pause per worker and step
    assert forward_stalls[["dp_rank", "stage"]].drop_duplicates().shape[0] > 4   # rotating workers
    steps_per_worker = forward_stalls.groupby(["dp_rank", "stage"]).step.nunique()
    assert steps_per_worker.max() < df.step.nunique()        # sporadic, not every step
    assert analysed("gc").slowdown > 1.02


def test_comm_flapping_slows_transfers_in_some_steps_only():
    df = frame("flapping")
    truth = json.loads(job("flapping").truth["cause_params"])["comm_flapping"]
    bad_steps = set(truth["steps"])
    assert len(bad_steps) == 4
    collectives = df[(df.stage == 1) & df.optype.isin(["params-all-gather", "grads-reduce-scatter"])]
    slow = collectives[collectives.step.isin(bad_steps)].duration.median()
    fast = collectives[~collectives.step.isin(bad_steps)].duration.median()
    assert slow > 5 * fast
    result = analysed("flapping")
    per_step = dict(zip(result.steps.tolist(), result.step_slowdown.tolist()))
    assert min(per_step[s] for s in bad_steps) > max(per_step[s] for s in per_step if s not in bad_steps)


def test_untraced_cpu_work_breaks_the_replay():
    truth, result = job("untraced").truth, analysed("untraced")
    assert result.launch_slowdown > 1.05 and result.discarded
    assert result.launch_slowdown == pytest.approx(truth["expected_discrepancy"], rel=0.02)
    assert truth["expected_discrepancy"] > 1.05
    assert result.slowdown < 1.05   # the straggling the replay sees is small: the time went to untraced work


def test_mixture_names_the_dominant_cause():
    truth = job("mixture").truth
    effects = json.loads(truth["cause_slowdowns"])
    assert set(effects) == {"last_stage_imbalance", "gc_pauses"}
    assert truth["primary_cause"] == max(effects, key=effects.get) == "last_stage_imbalance"
    assert truth["true_slowdown"] >= max(effects.values()) - 1e-9


@pytest.mark.parametrize("name", ["clean", "slow_worker", "untraced"])
def test_truth_times_are_consistent_with_the_trace(name):
    generated = job(name)
    df = frame(name)
    df["end_ts"] = df.start_ts + df.duration
    observed = (df.groupby("step").end_ts.max() - df.groupby("step").start_ts.min()).mean()
    truth = generated.truth
    assert observed == pytest.approx(truth["step_time"], rel=1e-3)   # up to profiler clock offsets
    assert truth["true_slowdown"] == pytest.approx(truth["step_time"] / truth["fault_free_step_time"])
    assert truth["expected_discrepancy"] == pytest.approx(truth["step_time"] / truth["nodelay_step_time"])
    assert truth["ideal_step_time"] <= truth["nodelay_step_time"] <= truth["step_time"]
    table = truth_table([truth])
    assert table.schema.equals(TRUTH_SCHEMA) and table.num_rows == 1


def test_generation_is_deterministic():
    spec = job("gc").spec
    again = generate_job(spec)
    assert again.trace.equals(job("gc").trace)
    assert again.manifest.equals(job("gc").manifest)
    assert again.truth == job("gc").truth


def test_manifest_describes_the_job():
    generated = job("slow_worker")
    row = generated.manifest.to_pylist()[0]
    assert (row["dp_size"], row["pp_size"], row["world_size"], row["microbatches"]) == (4, 4, 16, 8)
    assert len(row["workers"]) == 16
    hosts = dict(((w["dp_rank"], w["stage"]), w["host"]) for w in row["workers"])
    trace_hosts = pa.Table.from_pandas(frame("slow_worker")[["dp_rank", "stage", "host"]].drop_duplicates())
    assert all(hosts[(d, s)] == h for d, s, h in zip(*[trace_hosts[c].to_pylist() for c in ("dp_rank", "stage", "host")]))
    assert row["start_time"] < row["end_time"] and row["submit_time"] <= row["start_time"]
    assert generated.meta.world_size == 16


@pytest.mark.parametrize("bad, message", [
    (dict(dp=2, pp=4, vpp=2, microbatches=6), "vpp=2 needs"),
    (dict(dp=2, pp=1, microbatches=4, causes=(Cause("last_stage_imbalance"),)), "pp >= 2"),
    (dict(dp=0, pp=2, microbatches=4), "dp must be"),
    (dict(dp=2, pp=2, microbatches=4, hosts=("a", "b")), "hosts must name"),
    (dict(dp=2, pp=2, microbatches=4, steps=2, sessions=3), "sessions"),
    (dict(dp=2, pp=2, microbatches=4, model_family="sparse"), "model_family"),
    (dict(dp=2, pp=2, microbatches=4, date="2024-13-01"), "month"),
    (dict(dp=2, pp=2, microbatches=4, start_time=__import__("datetime").datetime(2024, 1, 1)), "timezone"),
])
def test_bad_specs_are_refused_with_the_job_named(bad, message):
    with pytest.raises(ValueError, match=message) as error:
        JobSpec(job_id="broken-job", **bad)
    assert "broken-job" in str(error.value)


def test_unknown_cause_and_parameters_are_refused():
    with pytest.raises(ValueError, match="unknown cause kind"):
        Cause("cosmic_rays")
    with pytest.raises(ValueError, match="unknown parameters"):
        Cause("slow_worker", {"speed": 2})
