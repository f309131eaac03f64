"""A CPU rank's late arrival at a step, carried from its previous step (JobModel.carried_arrivals),
and the physics that tells a slow link from a busy host (causes.localise.link_not_host); on real
runs of real stacks (tests/data/real_stacks)."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

STACKS = pathlib.Path(__file__).parent / "data" / "real_stacks"


def _job(name: str):
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif import compile_job

    truth = json.loads((STACKS / name / "truth.json").read_text())
    converted = convert_kineto([str(STACKS / name / f) for f in truth["trace_files"]], name, "2026-11-28", {})
    return converted, compile_job(converted.trace, converted.job_meta(), name)


def _carry(model, name: str) -> np.ndarray:
    """[n_steps, dp] how much later each rank ended the previous step than the first of its
    peers (absolute clock); where the previous step was not profiled, how much later it entered
    this one: its ProfilerStep's start in its own file (on the clock of baseTimeNanoseconds).
    Recomputed here, from the model and from the raw traces."""
    import gzip

    end = model.observed_end.max(axis=0).reshape(model.n_steps, model.dp_size) + model.step_start[:, None]
    carry = np.zeros_like(end)
    truth = json.loads((STACKS / name / "truth.json").read_text())
    entered = {}
    for file in truth["trace_files"]:
        document = json.loads(gzip.decompress((STACKS / name / file).read_bytes()))
        base = document["baseTimeNanoseconds"] / 1000.0
        for event in document["traceEvents"]:
            if str(event.get("name", "")).startswith("ProfilerStep#"):
                step = int(event["name"].split("#")[1])
                entered[(document["distributedInfo"]["rank"], step)] = (base + event["ts"]) * 1e-6
    for k in range(model.n_steps):
        if k and model.steps[k] == model.steps[k - 1] + 1:
            carry[k] = end[k - 1] - end[k - 1].min()
        else:
            began = np.array([entered[(int(rank), int(model.steps[k]))] for rank in model.worker_rank.reshape(-1)])
            carry[k] = began - began.min()
    return carry


def test_a_rank_finishing_its_previous_step_late_arrives_late_and_the_replay_is_given_that():
    """Lightning DDP, clean: no barrier after the optimizer, so the rank that ended step k-1 later
    starts step k later, and its peer waits for it at the step's first collective. METHOD's replay
    starts both ranks together and is 6.7% short of what ran; given each rank's arrival up to its
    carried tail, it is within 5%: the window is kept ("arrivals-model") and S stays METHOD's."""
    from transforms.whatif import analyze_model

    _, model = _job("lightning-clean-mlp-callback-s0-gcrec")
    arrivals = model.carried_arrivals()
    assert arrivals is not None
    opening = model.pred_index[model.pred_ptr[:-1]] == model.n_ops
    assert not arrivals[~opening].any()                      # only the ops that open a worker's step
    carry = _carry(model, "lightning-clean-mlp-callback-s0-gcrec").reshape(-1)
    assert (arrivals[opening] <= carry[None, :] + 1e-9).all()
    assert (arrivals[opening] <= np.maximum(model.launch_delay[opening], 0.0) + 1e-12).all()
    assert arrivals[:, : model.dp_size].max() > 0.001        # the first step: the ProfilerStep a rank entered late
    assert arrivals.max() > 0.005                            # a late rank, by milliseconds

    result = analyze_model(model)
    assert result.discarded_method and result.launch_slowdown > 1.05
    assert result.replay_discrepancy == pytest.approx(result.step_t_base.mean() / result.step_t_arrivals.mean())
    assert 1.0 < result.replay_discrepancy < 1.05
    assert not result.discarded and result.kept_by == "arrivals-model"
    assert result.model_slowdown == result.slowdown         # the tail is in the previous step's replay already
    assert result.headline()["kept_by"] == "arrivals-model"


def test_a_rank_late_beyond_its_tail_keeps_the_rest_as_untraced_time():
    """Accelerate, rank 1's Dataset sleeps 300 ms per batch before each step: it arrives far later
    than its previous step's tail, and what is beyond the tail is not given: the replay with
    arrivals is still far short of what ran (the data stall stays the untraced time it is)."""
    from transforms.whatif import analyze_model

    _, model = _job("accelerate-data-r1-gpt2-padded")
    result = analyze_model(model)
    assert result.step_t_base.mean() / result.step_t_arrivals.mean() > 2.0


def test_nothing_is_carried_without_a_thread_per_rank_or_peers():
    _, model = _job("lightning-clean-mlp-callback-s0-gcrec")
    gpu = dataclasses.replace(model, meta=dataclasses.replace(model.meta, host_compute=False))
    assert gpu.carried_arrivals() is None                    # GPU ranks: the CPU runs ahead of the streams
    _, pipeline = _job("pipe-clean-1f1b-pp2-s0")
    assert pipeline.carried_arrivals() is None               # no DP peers to be late against


def test_a_worker_whose_transfers_slow_with_its_compute_is_a_busy_host_not_a_slow_link():
    """A slow link slows a worker's transfers steadily, beyond their spread and beyond its compute."""
    from schemas.trace import OPTYPES
    from transforms.whatif.causes.localise import link_not_host

    _, model = _job("lightning-clean-mlp-callback-s0-gcrec")
    comm = model.op_is_comm[:, None]
    compute = np.isin(model.op_optype, [OPTYPES.index("forward-compute"), OPTYPES.index("backward-compute")])[:, None]
    rank1 = (model.lane_dp == 1)[None, :]
    base = np.abs(model.original_cost) + 1e-3                # every transfer and compute a positive time

    def worker(cost) -> bool:
        return link_not_host(dataclasses.replace(model, original_cost=cost), [(1, 0)], 1.1, 0.01)

    assert worker(np.where(comm & rank1, base * 4, base))                              # its transfers alone: a link
    assert not worker(np.where((comm | compute) & rank1, base * 4, base))               # everything alike: its host
    assert not worker(base)
    # its transfers 3x, 0.4x and 2.5x its peer's in the three steps: twice as long in all, yet no
    # steady excess beyond their own spread (t = 0.6 on 2 degrees of freedom): no link at 1%
    by_step = np.ones(model.n_lanes)
    by_step[model.lane_dp == 1] = [3.0, 0.4, 2.5]
    noisy = np.where(comm & rank1, base * by_step[None, :], base)
    assert noisy[model.op_is_comm][:, model.lane_dp == 1].sum() > 1.5 * noisy[model.op_is_comm][:, model.lane_dp == 0].sum()
    assert not worker(noisy)


def test_a_cpu_rank_blocked_in_a_collective_computes_after_it_whatever_python_ran_between():
    """Lightning DDP opens each step with a collective on the rank's only thread; the forward starts
    ~3 ms after it returns (Python between the two). On CPU ranks the forward waited for it (the
    thread was in the call); on GPU ranks only a compute starting as it ends is known to have."""
    from schemas.trace import OPTYPES
    from transforms.whatif import compile_job

    converted, model = _job("lightning-clean-mlp-callback-s0-gcrec")
    meta = converted.job_meta()
    gpu = compile_job(converted.trace, dataclasses.replace(meta, host_compute=False), "gpu")

    def first_forward_preds(m) -> set[str]:
        forward = np.flatnonzero(m.op_optype == OPTYPES.index("forward-compute"))
        first = forward[np.argmin(m.observed_start[forward, 0])]
        preds = m.pred_index[m.pred_ptr[first]:m.pred_ptr[first + 1]]
        return {OPTYPES[m.op_optype[p]] if p < m.n_ops else "step start" for p in preds}

    assert first_forward_preds(model) == {"group-collective"}
    assert first_forward_preds(gpu) == {"step start"}


def test_strag_analyze_says_why_a_window_method_would_discard_is_kept(tmp_path, capsys):
    from pipelines.analyze import run

    folder = tmp_path / "lightning"
    folder.mkdir()
    for name in ("rank-0.json.gz", "rank-1.json.gz"):
        (folder / name).symlink_to(STACKS / "lightning-clean-mlp-callback-s0-gcrec" / name)
    out = tmp_path / "result.json"
    assert run(["--format", "kineto", str(folder), "--json", str(out)]) in (0, None)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("replay discrepancy"))
    result = json.loads(out.read_text())
    arrivals, nodelay = result["carried_arrivals"]["step_t"], result["step_t_nodelay"]
    assert result["kept_by"] == "arrivals-model" and result["launch_slowdown"] > 1.05
    assert list(arrivals) == list(nodelay)
    first, *later = sorted(arrivals, key=int)
    assert arrivals[first] > nodelay[first]   # the first step: a rank entered it late (its ProfilerStep)
    assert all(arrivals[s] >= nodelay[s] - 1e-12 for s in later) and any(arrivals[s] > nodelay[s] for s in later)
    assert line.startswith("replay discrepancy 1.0") and ": ok (within" in line
    assert "starts each rank when it arrived" in line and "off by 1.06" in line and "S is METHOD's" in line


def test_a_carried_tail_is_the_previous_step_s_work_not_untraced_time_of_this_one():
    """The untraced time between a worker's ops leaves out its arrival carried from its previous
    step: per rank and step it is the time without that carry less the carry given to its opening
    ops (never below 0)."""
    from transforms.whatif.causes.pauses import untraced_time

    _, model = _job("lightning-clean-mlp-callback-s0-gcrec")
    carried = model.carried_arrivals()
    assert carried is not None and carried.any()
    with_carry = np.stack([untraced_time(model, d, 0) for d in range(model.dp_size)])
    plain = dataclasses.replace(model)
    plain.__dict__["_carried_arrivals"] = (plain.launch_delay, None)     # as if nothing were carried
    without = np.stack([untraced_time(plain, d, 0) for d in range(model.dp_size)])
    given = carried.sum(axis=0).reshape(model.n_steps, model.dp_size).T  # [dp, step] carry of the opening ops
    assert (with_carry <= without + 1e-12).all()
    assert (without - with_carry <= given + 1e-9).all() and (without - with_carry).sum() > 0
    assert (without - with_carry)[:, 0].sum() > 0    # the first step too: carried from where each rank entered it
