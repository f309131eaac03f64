"""Bad input: each kind of broken trace raises its typed error naming job, step, worker and op.
Traces are the published ST trace (dp 2 x pp 4, 32 steps) with one mutation each."""
from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from transforms.whatif import (
    MIN_STEPS,
    CycleError,
    DisconnectedGraphError,
    JobMeta,
    MissingOpError,
    MissingPeerError,
    TooFewStepsError,
    TraceStructureError,
    TraceValueError,
    UnknownOptypeError,
    WhatIfError,
    analyze_job,
    compile_job,
)

JOB = "ST-mutated"


@pytest.fixture(scope="module")
def st(reference_dir):
    frame = pq.read_table(reference_dir / "trace-ST.parquet").to_pandas()
    frame["optype"] = frame["optype"].astype(str)
    meta = JobMeta.from_mapping(yaml.safe_load((reference_dir / "meta-ST.yaml").read_text()))
    return frame, meta


def table(frame: pd.DataFrame) -> pa.Table:
    return pa.Table.from_pandas(frame.reset_index(drop=True), preserve_index=False)


def raises(cls, frame, meta) -> WhatIfError:
    with pytest.raises(cls) as caught:
        compile_job(table(frame), meta, JOB)
    error = caught.value
    assert error.job_id == JOB and JOB in str(error)
    return error


def test_the_unmutated_trace_compiles(st):
    frame, meta = st
    assert compile_job(table(frame), meta, JOB).n_ops == 106


def test_op_missing_in_a_later_step(st):
    frame, meta = st
    victim = frame[(frame.step == 264) & (frame.dp_rank == 1) & (frame.stage == 2) & (frame.optype == "backward-compute") & (frame.seq_id == 3)]
    error = raises(TraceStructureError, frame.drop(victim.index), meta)
    assert (error.step, error.dp_rank, error.stage, error.op) == (264, 1, 2, "backward-compute_3_2")
    assert "missing" in error.message


def test_extra_op_on_one_dp_rank(st):
    frame, meta = st
    extra = frame[(frame.dp_rank == 1) & (frame.step == 33) & (frame.stage == 1) & (frame.optype == "forward-compute") & (frame.seq_id == 3)].copy()
    extra["seq_id"] = 4
    error = raises(TraceStructureError, pd.concat([frame, extra]), meta)
    assert (error.step, error.dp_rank, error.stage, error.op) == (33, 1, 1, "forward-compute_4_1")
    assert "template" in error.message


def test_duplicated_op(st):
    frame, meta = st
    twice = frame[(frame.step == 1048) & (frame.dp_rank == 0) & (frame.stage == 3) & (frame.optype == "optimizer")]
    error = raises(TraceStructureError, pd.concat([frame, twice]), meta)
    assert (error.step, error.dp_rank, error.stage, error.op) == (1048, 0, 3, "optimizer_0_3")
    assert "2 times" in error.message


def test_missing_dp_rank_of_a_step(st):
    frame, meta = st
    error = raises(TraceStructureError, frame[~((frame.step == 25) & (frame.dp_rank == 1))], meta)
    assert (error.step, error.dp_rank) == (25, 1)


def test_missing_p2p_peer(st):
    frame, meta = st
    # The last stage loses every forward-recv: allowed at a pipeline end, so stage 2's sends have no peer.
    error = raises(MissingPeerError, frame[~((frame.stage == 3) & (frame.optype == "forward-recv"))], meta)
    assert error.stage == 2 and error.op.startswith("forward-send_")
    assert "forward-recv" in error.message and "stage 3" in error.message


def test_cycle(st):
    frame, meta = st
    # In the template (first step, dp_rank 0) stage 0's first backward is moved before all its
    # forwards: the compute chain then needs the backward before the forward that feeds it.
    first_step = frame.step.min()
    target = (frame.step == first_step) & (frame.dp_rank == 0) & (frame.stage == 0) & (frame.optype == "backward-compute") & (frame.seq_id == 0)
    mutated = frame.copy()
    mutated.loc[target, "start_ts"] = -1.0
    error = raises(CycleError, mutated, meta)
    assert error.step == first_step and error.dp_rank == 0
    assert "backward-compute_0_0" in error.message and "->" in error.message


def test_missing_optimizer(st):
    frame, meta = st
    error = raises(MissingOpError, frame[~((frame.optype == "optimizer") & (frame.stage == 2))], meta)
    assert (error.stage, error.op) == (2, "optimizer_0_2")


@pytest.mark.parametrize("optype", ["gc", "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "optimizer-clip-main-grad"])
def test_tail_op_missing_on_one_stage(st, optype):
    """A job that records a tail op type must record it on every stage (on both ends for embedding)."""
    frame, meta = st
    error = raises(MissingOpError, frame[~((frame.optype == optype) & (frame.stage == 3))], meta)
    assert (error.stage, error.op) == (3, f"{optype}_0_3")


def test_tail_op_types_a_job_does_not_record_are_left_out(st):
    """Converted profiler traces have no gc, layernorm, embedding or clip ops: the tail is then
    last compute -> grads-reduce-scatter -> optimizer, and the replay still reproduces the trace."""
    frame, meta = st
    tail = ["gc", "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "optimizer-clip-main-grad"]
    trimmed = frame[~frame.optype.isin(tail)]
    model = compile_job(table(trimmed), meta, JOB)
    assert model.n_ops == 106 - 4 * 3 - 2
    result = analyze_job(table(trimmed), meta, JOB)
    full = analyze_job(table(frame), meta, JOB)
    # the gc ops last 0 s and the other tail ops are short on ST: S moves, but only a little
    assert result.slowdown == pytest.approx(full.slowdown, rel=0.1)
    assert result.launch_slowdown == pytest.approx(full.launch_slowdown, rel=0.05)


def test_unknown_optype(st):
    frame, meta = st
    mutated = frame.copy()
    row = mutated.index[(mutated.step == 36) & (mutated.dp_rank == 1) & (mutated.optype == "gc")][0]
    mutated.loc[row, "optype"] = "garbage-collect"
    error = raises(UnknownOptypeError, mutated, meta)
    assert error.op == "garbage-collect" and "forward-compute" in error.message


def test_too_few_steps(st):
    """One complete step is enough (a profiler schedule with active=1); no step at all is not."""
    frame, meta = st
    assert MIN_STEPS == 1
    model = compile_job(table(frame[frame.step == 23]), meta, JOB)
    assert model.n_steps == 1
    with pytest.raises(TooFewStepsError) as caught:
        compile_job(table(frame.iloc[:0]), meta, JOB)
    assert f"at least {MIN_STEPS}" in caught.value.message


def test_disconnected_op(st):
    frame, meta = st
    # A second gc op on stage 1 of every step and DP rank: the model gives it no place.
    extra = frame[(frame.optype == "gc") & (frame.stage == 1)].copy()
    extra["seq_id"] = 1
    error = raises(DisconnectedGraphError, pd.concat([frame, extra]), meta)
    assert (error.stage, error.op) == (1, "gc_1_1") and error.dp_rank == 0


def test_dp_comm_in_a_job_without_dp(st):
    frame, meta = st
    one_rank = frame[frame.dp_rank == 0]
    error = raises(DisconnectedGraphError, one_rank, JobMeta(dp_size=1, pp_size=4))
    assert error.op.startswith(("params-all-gather", "grads-reduce-scatter"))


def test_rank_outside_the_meta(st):
    frame, meta = st
    error = raises(TraceValueError, frame, JobMeta(dp_size=1, pp_size=4))
    assert error.dp_rank == 1 and "dp_size=1" in error.message


def test_a_worker_recorded_under_two_global_ranks(st):
    """One worker's rows name another rank in one later step (a run of rows of its own): the check
    that reads one row per run still finds it and names the worker and both ranks."""
    frame, meta = st
    mutated = frame.copy()
    worker = (mutated.dp_rank == 1) & (mutated.stage == 2)
    usual = int(mutated.loc[worker, "rank"].iloc[0])
    mutated.loc[worker & (mutated.step == 514), "rank"] = usual + 40
    error = raises(TraceStructureError, mutated, meta)
    assert (error.dp_rank, error.stage) == (1, 2)
    assert f"{usual}..{usual + 40}" in error.message


def test_float64_times_are_float32_only_when_every_value_is():
    """Published-format times widened to float64 keep the reference's float32 arithmetic; a column
    is float32 only when every value is, however far into it the first wide one sits."""
    import numpy as np

    from transforms.whatif.model import _float32_exact

    narrow = np.arange(10_000, dtype=np.float32).astype(np.float64) * np.float32(0.001)
    assert _float32_exact(narrow.astype(np.float32).astype(np.float64))
    late = narrow.astype(np.float32).astype(np.float64)
    late[9_000] += 1e-12                                   # past the sample of the first values
    early = narrow.astype(np.float32).astype(np.float64)
    early[3] += 1e-12
    assert not _float32_exact(late) and not _float32_exact(early)


def test_negative_duration(st):
    frame, meta = st
    mutated = frame.copy()
    row = mutated.index[(mutated.step == 514) & (mutated.dp_rank == 0) & (mutated.stage == 1) & (mutated.optype == "forward-compute") & (mutated.seq_id == 2)][0]
    mutated.loc[row, "duration"] = -0.5
    error = raises(TraceValueError, mutated, meta)
    assert (error.step, error.dp_rank, error.stage, error.op) == (514, 0, 1, "forward-compute_2_1")


def test_missing_column(st):
    frame, meta = st
    error = raises(TraceValueError, frame.drop(columns=["gmc"]), meta)
    assert "gmc" in error.message


def test_errors_are_value_errors_with_a_reason(st):
    frame, meta = st
    with pytest.raises(ValueError) as caught:
        analyze_job(table(frame.iloc[:0]), meta, JOB)
    assert caught.value.reason == "too_few_steps"
