"""Generated traces have exactly the dependency structure of METHOD.md section 2, per schedule variant.

`structure_problems` is an independent checker (written from METHOD.md and Megatron's
schedules, not from the generator's code): it rebuilds what an analyzer rebuilds from
the trace (compute order, p2p matching by order with no-ops, DP comm, tail order) and
lists every violation. The last tests corrupt a valid trace and check the checker sees it.
"""
from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from transforms.synth import JobSpec, Timing, generate_job

EPS = 5e-5          # the analyzer's tolerance for no-op detection (0.05 ms)
CLOCK = 30e-6       # profiler clock jitter (sigma) of the test jobs

VARIANTS = {
    "1f1b-dp-not-overlapped": dict(dp=2, pp=4, microbatches=6, dp_overlap=False),
    "1f1b-dp-overlapped": dict(dp=3, pp=4, microbatches=8, dp_overlap=True),
    "1f1b-fewer-microbatches-than-stages": dict(dp=2, pp=4, microbatches=2),
    "interleaved-dp-overlapped": dict(dp=2, pp=4, vpp=2, microbatches=8),
    "interleaved-dp-not-overlapped": dict(dp=2, pp=2, vpp=3, microbatches=4, dp_overlap=False),
    "1f1b-noop-records-at-the-ends": dict(dp=2, pp=3, microbatches=5, record_noop_p2p=True),
    "dp-absent": dict(dp=1, pp=4, microbatches=5),
    "interleaved-dp-absent": dict(dp=1, pp=2, vpp=2, microbatches=4),
    "pp1": dict(dp=4, pp=1, microbatches=4),
    "pp1-dp-absent": dict(dp=1, pp=1, microbatches=3),
}


@functools.lru_cache(maxsize=None)
def generated(variant: str, seed: int = 0):
    timing = Timing(clock_jitter=CLOCK)
    return generate_job(JobSpec(job_id=variant, steps=4, sessions=2, seed=seed, timing=timing, **VARIANTS[variant]))


def frame(trace: pa.Table) -> pd.DataFrame:
    df = trace.drop_columns(["host", "seq_lens"]).to_pandas()
    df["optype"] = df["optype"].astype(str)
    df["end_ts"] = df["start_ts"] + df["duration"]
    return df


def megatron_compute_order(stage: int, pp: int, vpp: int, microbatches: int) -> list[tuple[str, int, int]]:
    """(F|B, model chunk, microbatch) in execution order on a stage, per Megatron-LM."""
    if vpp == 1:
        warmup = min(pp - stage - 1, microbatches)
        order = [("F", 0, i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            order += [("F", 0, warmup + i), ("B", 0, i)]
        return order + [("B", 0, i) for i in range(microbatches - warmup, microbatches)]
    total = microbatches * vpp
    group = pp * vpp

    def chunk(k, forward):
        c = (k % group) // pp
        return c if forward else vpp - 1 - c

    def mb(k):
        return (k // group) * pp + k % pp

    warmup = min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)
    order = [("F", chunk(k, True), mb(k)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", chunk(warmup + k, True), mb(warmup + k)), ("B", chunk(k, False), mb(k))]
    return order + [("B", chunk(k, False), mb(k)) for k in range(total - warmup, total)]


def _valid_p2p(worker: pd.DataFrame, pp: int, vpp: int, stage: int, problems: list, where: str) -> dict:
    """Per p2p optype: valid records (type-1 and type-2 no-ops removed) in order, each with its compute."""
    compute = worker[worker.optype.str.endswith("compute")].sort_values(["start_ts", "seq_id"])
    out = {}
    for direction in ("forward", "backward"):
        comps = compute[compute.optype == f"{direction}-compute"]
        for kind in ("send", "recv"):
            optype = f"{direction}-{kind}"
            records = worker[worker.optype == optype].sort_values(["start_ts", "seq_id"])
            if kind == "recv":
                records = records[records.start_ts <= comps.start_ts.max() + EPS]
            else:
                records = records[records.end_ts >= comps.end_ts.min() - EPS]
            served = comps
            if len(records) != len(comps):
                ends_ok = stage in (0, pp - 1) and (len(records) == 0 or len(records) + 1 == len(comps))
                if not ends_ok:
                    problems.append(f"{where}: {len(records)} {optype} records for {len(comps)} computes")
                    continue
                if kind == "recv" and len(records) + 1 == len(comps):
                    served = comps.iloc[1:]
                elif len(records) == 0:
                    out[optype] = []
                    continue
            valid = []
            for (_, record), (_, comp) in zip(records.iterrows(), served.iterrows()):
                peer_gmc = comp.gmc + {"forward-send": 1, "forward-recv": -1,
                                       "backward-send": -1, "backward-recv": 1}[optype]
                if 0 <= peer_gmc < pp * vpp:       # otherwise a no-op at the model's ends
                    valid.append((record, comp))
            out[optype] = valid
    return out


def structure_problems(trace: pa.Table, pp: int, vpp: int, microbatches: int, use_dp: bool, overlap: bool,
                       noop_ends: bool = False, sync_tolerance: float = 1e-3) -> list[str]:
    """Every way the trace departs from the dependency structure an analyzer expects."""
    df = frame(trace)
    problems: list[str] = []
    key = ["step", "dp_rank", "stage", "optype", "seq_id"]
    if df.duplicated(key).any():
        problems.append(f"duplicate (step, worker, optype, seq_id): {df[df.duplicated(key)][key].head(3).values}")
    if (df.groupby("step").start_ts.min().abs() > 1e-12).any():
        problems.append("start_ts are not per-step offsets (some step does not start at 0)")
    if (df.duration < 0).any():
        problems.append("negative durations")

    for (step, dp_rank, stage), worker in df.groupby(["step", "dp_rank", "stage"]):
        where = f"step {step} worker ({dp_rank}, {stage})"
        ordered = worker.sort_values(["start_ts", "seq_id"])
        for optype, rows in ordered.groupby("optype"):
            if list(rows.seq_id) != list(range(len(rows))):
                problems.append(f"{where}: {optype} seq_id not 0..n-1 in start order")
        compute = ordered[ordered.optype.str.endswith("compute")]
        seen = [("F" if o.startswith("forward") else "B", mc, mb) for o, mc, mb in
                zip(compute.optype, compute.mc, compute.mb_id)]
        if seen != megatron_compute_order(stage, pp, vpp, microbatches):
            problems.append(f"{where}: compute order differs from the Megatron schedule")
        if (compute.gmc != compute.mc * pp + stage).any():
            problems.append(f"{where}: gmc != mc * pp + stage on compute ops")
        if (compute.end_ts.to_numpy()[:-1] > compute.start_ts.to_numpy()[1:] + 1e-12).any():
            problems.append(f"{where}: compute ops overlap on the compute stream")
        p2p = ordered[ordered.optype.str.endswith(("send", "recv"))]
        if pp == 1 and len(p2p):
            problems.append(f"{where}: p2p ops without pipeline parallelism")
        if vpp == 1 and pp > 1:
            skipped = (["forward-recv", "backward-send"] if stage == 0 else []) + \
                      (["forward-send", "backward-recv"] if stage == pp - 1 else [])
            for optype in skipped:
                n = (p2p.optype == optype).sum()
                if n != (microbatches if noop_ends else 0):
                    problems.append(f"{where}: {n} {optype} records at the pipeline end "
                                    f"({'no-op records expected' if noop_ends else 'Megatron skips these'})")
        if vpp == 1:   # 1F1B calls are batched; interleaved sends/recvs are separate async ops
            for _, batch in p2p.groupby("start_ts"):
                if batch.duration.nunique() != 1:
                    problems.append(f"{where}: records of one batched p2p call differ in duration")
        by = {o: rows for o, rows in ordered.groupby("optype")}

        def one(optype):
            rows = by.get(optype)
            return None if rows is None else rows.iloc[-1]

        counts = {o: len(r) for o, r in by.items()}
        expect = {"gc": 1, "layernorm-grads-all-reduce": 1, "optimizer-clip-main-grad": 1, "optimizer": 1,
                  "embedding-grads-all-reduce": 1 if stage in (0, pp - 1) else 0,
                  "params-all-gather": vpp if use_dp else 0, "grads-reduce-scatter": vpp if use_dp else 0,
                  "separate-grads-all-reduce": 1 if use_dp and overlap else 0,
                  "forward-compute": microbatches * vpp, "backward-compute": microbatches * vpp}
        for optype, n in expect.items():
            if counts.get(optype, 0) != n:
                problems.append(f"{where}: {counts.get(optype, 0)} {optype} ops, expected {n}")
        if problems and problems[-1].startswith(where):
            continue
        # ZeRO: a chunk's params are gathered before its first forward.
        if use_dp:
            for _, ag in by["params-all-gather"].iterrows():
                first = compute[(compute.optype == "forward-compute") & (compute.mc == ag.mc)].start_ts.min()
                if ag.end_ts > first + 1e-12:
                    problems.append(f"{where}: params-all-gather of chunk {ag.mc} ends after its first forward")
            if overlap:
                for _, rs in by["grads-reduce-scatter"].iterrows():
                    last = compute[(compute.optype == "backward-compute") & (compute.mc == rs.mc)].end_ts.max()
                    if rs.start_ts < last - 1e-12:
                        problems.append(f"{where}: grads-reduce-scatter of chunk {rs.mc} before its last backward")
        # The step tail, in order on this worker's clock.
        tail = [one("gc"), one("layernorm-grads-all-reduce")]
        tail += [one("embedding-grads-all-reduce")] if stage in (0, pp - 1) else []
        if use_dp and overlap:
            tail += [one("separate-grads-all-reduce")]
        elif use_dp:
            tail += list(by["grads-reduce-scatter"].sort_values("seq_id").itertuples(index=False))
        tail += [one("optimizer-clip-main-grad"), one("optimizer")]
        if tail[0].start_ts < compute.end_ts.max() - 1e-12:
            problems.append(f"{where}: gc before the last compute ends")
        for before, after in zip(tail[:-1], tail[1:]):
            if after.start_ts < before.end_ts - 1e-12:
                problems.append(f"{where}: {after.optype} starts before {before.optype} ends")
        if use_dp and overlap and tail[1].start_ts < by["grads-reduce-scatter"].end_ts.max() - 1e-12:
            problems.append(f"{where}: tail starts before the last grads-reduce-scatter ends")
        if ordered.end_ts.max() > tail[-1].end_ts + 1e-12:
            problems.append(f"{where}: an op ends after the optimizer")

    # p2p pairing: the k-th valid send of stage p meets the k-th valid recv of stage p +- 1.
    for (step, dp_rank), lane in df.groupby(["step", "dp_rank"]):
        valid = {stage: _valid_p2p(worker, pp, vpp, stage, problems, f"step {step} dp {dp_rank} stage {stage}")
                 for stage, worker in lane.groupby("stage")}
        for stage in range(pp):
            for direction, delta in (("forward", 1), ("backward", -1)):
                if pp == 1:
                    continue
                peer = (stage + delta) % pp
                sends = valid.get(stage, {}).get(f"{direction}-send", [])
                recvs = valid.get(peer, {}).get(f"{direction}-recv", [])
                if len(sends) != len(recvs):
                    problems.append(f"step {step} dp {dp_rank}: {len(sends)} valid {direction}-sends on stage "
                                    f"{stage} but {len(recvs)} valid {direction}-recvs on stage {peer}")
                    continue
                for (send, sent_by), (recv, feeds) in zip(sends, recvs):
                    if (sent_by.mb_id, sent_by.gmc + delta) != (feeds.mb_id, feeds.gmc):
                        problems.append(f"step {step} dp {dp_rank}: {direction}-send {send.seq_id} of stage {stage} "
                                        f"does not carry the microbatch its peer recv {recv.seq_id} feeds")
                    if recv.end_ts < send.start_ts - 10 * CLOCK or send.end_ts < recv.start_ts - 10 * CLOCK:
                        problems.append(f"step {step} dp {dp_rank}: {direction}-send {send.seq_id} of stage "
                                        f"{stage} and its recv do not overlap in time")

    # Collectives end together (up to clock jitter and per-rank skew).
    groups = {"params-all-gather": ["step", "stage", "seq_id"], "grads-reduce-scatter": ["step", "stage", "seq_id"],
              "separate-grads-all-reduce": ["step", "stage"], "optimizer-clip-main-grad": ["step"],
              "embedding-grads-all-reduce": ["step", "dp_rank"]}
    for optype, keys in groups.items():
        rows = df[df.optype == optype]
        spread = rows.groupby(keys).end_ts.agg(lambda s: s.max() - s.min())
        if len(spread) and spread.max() > sync_tolerance:
            problems.append(f"{optype}: members end {spread.max() * 1e3:.2f} ms apart")
    return problems


def layout(variant: str):
    shape = VARIANTS[variant]
    dp, pp = shape["dp"], shape["pp"]
    return dict(pp=pp, vpp=shape.get("vpp", 1), microbatches=shape["microbatches"],
                use_dp=dp * shape.get("cp", 1) > 1, overlap=shape.get("dp_overlap", True),
                noop_ends=shape.get("record_noop_p2p", False))


@pytest.mark.parametrize("variant", VARIANTS)
def test_trace_has_the_dependency_structure(variant):
    assert structure_problems(generated(variant).trace, **layout(variant)) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_replay_reproduces_the_generated_job(variant):
    """What an analyzer rebuilds from the trace replays it: small discrepancy, S as the generator predicts."""
    from transforms.whatif.metrics import analyze_job

    job = generated(variant)
    result = analyze_job(job.trace, job.meta, variant)
    assert result.launch_slowdown < 1.05
    assert result.launch_slowdown == pytest.approx(job.truth["expected_discrepancy"], abs=0.02)
    assert result.slowdown == pytest.approx(job.truth["expected_slowdown"], rel=0.01)


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_row_per_op_and_every_worker_and_step(variant):
    job = generated(variant)
    df = frame(job.trace)
    shape = VARIANTS[variant]
    workers = df.groupby("step")[["dp_rank", "stage"]].apply(lambda g: len(g.drop_duplicates()))
    assert (workers == shape["dp"] * shape["pp"]).all()
    assert df.step.nunique() == job.spec.steps
    assert (df.job_id == variant).all()
    assert df.optype.isin(["separate-grads-all-reduce"]).any() == (layout(variant)["use_dp"]
                                                                    and layout(variant)["overlap"])


@pytest.mark.parametrize("variant", ["interleaved-dp-overlapped", "interleaved-dp-not-overlapped"])
def test_interleaving_records_noops_at_the_model_ends(variant):
    """Under vpp > 1 every loop call leaves a record, so the first/last global chunk has no-op transfers."""
    df = frame(generated(variant).trace)
    pp = VARIANTS[variant]["pp"]
    last_stage = df[(df.stage == pp - 1)]
    assert (last_stage.optype == "forward-send").sum() > 0
    assert (df[df.stage == 0].optype == "backward-send").sum() > 0


def _mutated(variant: str, mutate) -> list[str]:
    df = generated(variant).trace.to_pandas()
    changed = mutate(df)
    df = df if changed is None else changed
    table = pa.Table.from_pandas(df, schema=generated(variant).trace.schema, preserve_index=False)
    return structure_problems(table, **layout(variant))


def test_checker_sees_a_swapped_compute_order():
    def swap(df):
        rows = df[(df.stage == 1) & (df.optype == "forward-compute") & (df.step == df.step.min())
                  & (df.dp_rank == 0)].index[:2]
        df.loc[rows, "mb_id"] = df.loc[rows[::-1], "mb_id"].to_numpy()
    assert any("compute order" in p for p in _mutated("1f1b-dp-overlapped", swap))


def test_checker_sees_a_missing_recv():
    def drop(df):
        row = df[(df.stage == 2) & (df.optype == "forward-recv")].index[3]
        return df.drop(index=row)
    assert any("forward-recv" in p for p in _mutated("1f1b-dp-overlapped", drop))


def test_checker_sees_an_optimizer_before_the_clip():
    def early(df):
        rows = df[(df.optype == "optimizer") & (df.stage == 0)].index
        df.loc[rows, "start_ts"] -= 0.5
    assert any("optimizer starts before" in p for p in _mutated("1f1b-dp-not-overlapped", early))


def test_checker_sees_an_unsynchronised_collective():
    def late(df):
        row = df[(df.optype == "params-all-gather") & (df.dp_rank == 1)].index[0]
        df.loc[row, "duration"] += 0.05
    assert any("params-all-gather" in p for p in _mutated("1f1b-dp-overlapped", late))


def test_one_f_one_b_batches_send_and_recv_into_two_records():
    df = frame(generated("1f1b-dp-overlapped").trace)
    middle = df[(df.stage == 1) & df.optype.str.endswith(("send", "recv"))]
    batches = middle.groupby(["step", "dp_rank", "start_ts"]).optype.agg(tuple)
    assert set(batches) >= {("forward-send", "backward-recv"), ("backward-send", "forward-recv")}


def test_checker_sees_missing_noop_records():
    def drop(df):
        rows = df[(df.stage == 0) & (df.optype == "forward-recv")].index[:1]
        return df.drop(index=rows)
    assert any("no-op records expected" in p for p in _mutated("1f1b-noop-records-at-the-ends", drop))


def test_checker_sees_a_send_paired_with_the_wrong_microbatch():
    def shift(df):
        rows = df[(df.optype == "forward-compute") & (df.stage == 1) & (df.dp_rank == 0)].index
        df.loc[rows, "mb_id"] = (df.loc[rows, "mb_id"] + 1) % 8
    problems = _mutated("1f1b-dp-overlapped", shift)
    assert any("does not carry the microbatch" in p for p in problems)


@pytest.mark.parametrize("variant", VARIANTS)
def test_record_estimate_is_close(variant):
    job = generated(variant)
    assert job.spec.estimated_records == pytest.approx(job.trace.num_rows, rel=0.15)


def test_program_ops_per_worker_match_the_trace():
    """The static program says how many records a worker writes per step; the trace agrees."""
    from transforms.synth.program import build_program

    job = generated("interleaved-dp-overlapped")
    program = build_program(4, 2, 8, True, True)
    per_step = job.trace.num_rows / job.spec.steps / job.spec.dp
    assert per_step == program.n_records
    assert sorted(program.events.tolist()) == list(range(2 * program.n_units))   # every start and end once
    position = np.empty(2 * program.n_units, dtype=int)
    position[program.events] = np.arange(2 * program.n_units)
    assert (position[0::2] < position[1::2]).all()                               # a unit starts before it ends
