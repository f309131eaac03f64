"""Real GPU torch.profiler traces (issue 22): compute is the GPU work a range launched, on any thread.

`../shared/traces/hta/nccl_data.json.gz` is rank 0 of a real 2-GPU DDP job (A100, NCCL). Its backward
runs on the autograd engine's thread, its labels are the user's own (`## forward ##`), and its kernels
run on CUDA streams, linked to the CPU calls that launched them by `correlation`. Written out as both
ranks of a 2-rank job, it must convert and analyse; each op's time must be GPU time, checked against
an independent reading of the same file (by thread and stream, not by time window).
"""
from __future__ import annotations

import collections
import gzip
import json
import pathlib
import tempfile

import numpy as np
import pytest

from transforms.ingest.kineto import convert_kineto
from transforms.whatif import analyze_job

HTA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "hta"
DATE = "2026-11-25"


@pytest.fixture(scope="module")
def document():
    path = HTA / "nccl_data.json.gz"
    if not path.is_file():
        pytest.skip(f"public HTA trace {path} not found")
    return json.loads(gzip.decompress(path.read_bytes()))


@pytest.fixture(scope="module")
def converted(document, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-ddp")
    for rank in (0, 1):
        copy = dict(document, distributedInfo=dict(document["distributedInfo"], rank=rank))
        (folder / f"rank-{rank}.json.gz").write_bytes(gzip.compress(json.dumps(copy).encode()))
    return convert_kineto(sorted(str(p) for p in folder.iterdir()), "gpu-ddp", DATE)


def _independent(document) -> dict[int, dict[str, tuple[float, float]]]:
    """Per step, from the raw events: the GPU span of the non-NCCL work launched by the main
    thread from the step's first op autograd recorded (a `fwdbwd` flow start: DDP's buffer
    broadcast and copies before it are no model compute) to its first autograd-thread launch
    (forward), by the autograd thread inside its `evaluate_function` ops (backward: DDP's copies of
    reduced buckets into the grads, launched there after the last of them, are grad sync), and by
    the main thread inside `Optimizer.step` (optimizer); µs on the trace clock."""
    events = [e for e in document["traceEvents"] if e.get("ph") == "X"]
    steps = {int(e["name"].split("#")[1]): e for e in events if e["name"].startswith("ProfilerStep#")}
    main = next(iter(steps.values()))["tid"]
    work = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and not e["name"].startswith("nccl"):
            work[e["args"]["correlation"]].append((e["ts"], e["ts"] + e["dur"]))
    launches = sorted((e["ts"], e["tid"], e["args"]["correlation"]) for e in events
                      if e.get("cat") == "cuda_runtime" and e["args"].get("correlation") in work)
    optimizer = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("Optimizer.step#")]
    evaluate = [(e["ts"], e["ts"] + e["dur"], e["tid"]) for e in events
                if e["name"].startswith("autograd::engine::evaluate_function:") and e["tid"] != main]
    recorded = sorted(e["ts"] for e in document["traceEvents"] if e.get("cat") == "fwdbwd" and e.get("ph") == "s")
    out = {}
    for number, step in steps.items():
        start, end = step["ts"], step["ts"] + step["dur"]
        mine = [(t, tid, c) for t, tid, c in launches if start <= t <= end]
        first_backward = min(t for t, tid, _ in mine if tid != main)
        first_recorded = min(t for t in recorded if start <= t <= end)
        picks = {
            "forward-compute": [c for t, tid, c in mine if tid == main and first_recorded <= t < first_backward],
            "backward-compute": [c for t, tid, c in mine if tid != main
                                 and any(s <= t <= e and tid == on for s, e, on in evaluate)],
            "optimizer": [c for t, tid, c in mine if tid == main and any(s <= t <= e for s, e in optimizer)],
        }
        out[number] = {kind: (min(s for c in chosen for s, _ in work[c]), max(e for c in chosen for _, e in work[c]))
                       for kind, chosen in picks.items()}
    return out


def test_a_gpu_ddp_job_with_its_backward_on_the_autograd_thread_converts(converted):
    table = converted.trace.to_pandas()
    table["optype"] = table.optype.astype(str)
    per_step = table[table["rank"] == 0].groupby(["step", "optype"]).size().unstack()
    assert (per_step["forward-compute"] == 1).all() and (per_step["backward-compute"] == 1).all()
    assert (per_step["grads-reduce-scatter"] == 5).all()   # DDP's five bucket all-reduces per step
    assert converted.source["device"] != "cpu"


def test_compute_and_optimizer_are_the_gpu_work_they_launched(converted, document):
    """Durations agree with the independent reading within 1% (they are the same spans: the
    reading differs only in how it finds them)."""
    expected = _independent(document)
    table = converted.trace.to_pandas()
    table["optype"] = table.optype.astype(str)
    rank0 = table[table["rank"] == 0]
    for step, kinds in expected.items():
        for kind, (start, end) in kinds.items():
            (duration,) = rank0[(rank0.step == step) & (rank0.optype == kind)].duration
            assert duration == pytest.approx((end - start) * 1e-6, rel=0.01), (step, kind)
    forward = rank0[rank0.optype == "forward-compute"].duration.mean()
    backward = rank0[rank0.optype == "backward-compute"].duration.mean()
    assert 0.5 < backward / forward < 3   # backward is GPU work too, not the 0.6 ms its annotation spans


def test_the_two_identical_ranks_do_not_straggle(converted):
    result = analyze_job(converted.trace, converted.job_meta(), "gpu-ddp")
    assert result.slowdown < 1.05


# --- multi-rank GPU jobs with a known answer, built from one real rank (tests/gpu_jobs.py) --------

SOURCES = ["nccl_data.json.gz", "ddp2_rank1.json.gz"]


def _real_rank(name: str) -> pathlib.Path:
    path = HTA / name
    if not path.is_file():
        pytest.skip(f"public HTA trace {path} not found")
    return path


@pytest.mark.parametrize("name", SOURCES)
def test_a_clean_gpu_job_on_two_hosts_finds_their_clock_offset_and_no_straggler(name, tmp_path):
    from gpu_jobs import build_job
    from transforms.whatif.causes import analyze_and_classify

    paths = build_job(_real_rank(name), tmp_path / "job", world=4, per_host=2, host_offset_us=50_000.0)
    job = convert_kineto([str(p) for p in paths], "gpu-clean", DATE)
    offsets = job.source["clock_offsets_s"]
    assert job.source["clocks"] == 2 and len(offsets) == 1
    assert abs(next(iter(offsets.values()))) == pytest.approx(0.050, abs=5e-4)   # host 1 reads 50 ms later
    result, verdict = analyze_and_classify(job.trace, job.job_meta(), "gpu-clean")
    assert result.slowdown < 1.05 and verdict.cause == "none" and not verdict.implicated_workers


@pytest.mark.parametrize("name", SOURCES)
def test_a_slower_gpu_machine_is_the_worker_blamed(name, tmp_path):
    """Rank 2 runs 1.5x slower (CPU and GPU). Its DP peers wait for it every step: the job runs at
    its pace, T = 1.5 D, while the ideal takes each op's mean over the 4 DP ranks, (3 + 1.5) / 4 D:
    S = 1.5 / 1.125 where compute sets the step. Whether or not the replay matches the trace
    (nccl_data's CPU launches lag its kernels, 13% of its step), the worker blamed is rank 2."""
    from gpu_jobs import build_job
    from transforms.whatif.causes import analyze_and_classify

    paths = build_job(_real_rank(name), tmp_path / "job", world=4, slow={2: 1.5}, per_host=4)
    job = convert_kineto([str(p) for p in paths], "gpu-slow", DATE)
    result, verdict = analyze_and_classify(job.trace, job.job_meta(), "gpu-slow")
    assert verdict.cause == "individual-worker"
    assert verdict.implicated_workers == [(2, 0)]
    assert max(result.by_dp_rank, key=result.by_dp_rank.get) == 2
    if not result.discarded:
        assert result.slowdown == pytest.approx(1.5 / 1.125, rel=0.03)
    else:
        assert result.launch_slowdown > 1.05


@pytest.mark.parametrize("name, at", [("ddp2_rank1.json.gz", 0.1), ("world2_rank1.json.gz", 0.4)])
def test_collections_that_rotate_over_gpu_ranks_are_python_gc(name, at):
    """Ranks 1, 2 and 3 each stop 100 ms for the garbage collector mid-forward, in steps 1, 2 and 3
    (a real rank's steps: world2_rank1's forward is cut into pieces by its embedding all-to-all,
    and its forwards vary by 2x from step to step on every rank alike). The stretched forwards are
    measured against the DP peers' in the same step, every piece counted: python-gc, 3 pauses of
    0.1 s, no worker blamed. The same pauses all on rank 2 are that worker's (the forward-only stall
    of one machine cannot be told from its slower forward without the trainer's GC record)."""
    from gpu_jobs import build_gc_job
    from transforms.whatif.causes import analyze_and_classify

    for pauses, cause, blamed in (({1: (1, 0.1), 2: (2, 0.1), 3: (3, 0.1)}, "python-gc", []),
                                  ({1: (2, 0.1), 2: (2, 0.1), 3: (2, 0.1)}, "individual-worker", [(2, 0)])):
        with tempfile.TemporaryDirectory() as folder:
            paths = build_gc_job(_real_rank(name), pathlib.Path(folder) / "job", 4, pauses, at=at)
            job = convert_kineto([str(p) for p in paths], "gpu-gc", DATE)
        result, verdict = analyze_and_classify(job.trace, job.job_meta(), "gpu-gc")
        assert not result.discarded and result.slowdown >= 1.1
        assert (verdict.cause, verdict.implicated_workers) == (cause, blamed)
        assert verdict.evidence["gc_pauses"] == 3 and verdict.evidence["gc_mean_pause"] == pytest.approx(0.1, rel=0.05)


def test_sendrecv_kernels_of_an_older_trace_are_named_by_the_c10d_range_that_launched_them():
    """world2_rank1 (a 2-GPU recommendation model, old torch: NCCL kernels carry no collective name)
    runs its embedding all-to-all as `ncclKernel_SendRecv` kernels, launched inside `nccl:all_to_all`
    ranges. Counted independently: kernels whose launch (same correlation) lies in such a range on
    the launching thread."""
    from transforms.ingest.kineto.rank import parse_rank_bytes
    from transforms.ingest.kineto.spans import COLL

    path = _real_rank("world2_rank1.json.gz")
    events = [e for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    launch = {e["args"]["correlation"]: (e["ts"], e["tid"]) for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = [(e["ts"], e["ts"] + e["dur"], e["tid"]) for e in events if e["name"] == "nccl:all_to_all"]
    launched = [launch.get(e["args"].get("correlation")) for e in events if e.get("cat") == "kernel" and "SendRecv" in e["name"]]
    expected = sum(1 for at in launched if at is not None and any(s <= at[0] <= t and tid == at[1] for s, t, tid in ranges))
    trace = parse_rank_bytes(str(path), path.read_bytes())
    named = int(((trace.kind == COLL) & (trace.coll == "all_to_all")).sum())
    assert expected > 0 and named == expected
    # the rest (launched before the trace began: no launch recorded) keep the kernel's own name
    assert int(((trace.kind == COLL) & (trace.coll == "sendrecv")).sum()) == len(launched) - expected
    assert not any(key.startswith("label nccl:") for key in trace.unmapped)   # c10d's ranges are known labels


# --- a recommendation model: DDP + embedding all-to-all (world8_rank3, 8 A100s, old torch) ------------

A2A_SOURCE = "world8_rank3.json.gz"
# world2_rank1: the same trainer on 2 V100s, its GPU running most of a step behind its CPU (the spans
# of a step are those issued in its CPU span)
A2A_SOURCES = [A2A_SOURCE, "world2_rank1.json.gz"]


def _a2a_issued_per_step(path: pathlib.Path) -> dict[int, int]:
    """Independently: per profiled step, the `nccl:all_to_all` ranges opened on the CPU inside the
    step's span (one per all-to-all the step issues, on any thread)."""
    events = [e for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    steps = {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in events
             if e["name"].startswith("ProfilerStep#")}
    ranges = [e["ts"] for e in events if e["name"] == "nccl:all_to_all"]
    return {n: sum(s <= t <= e for t in ranges) for n, (s, e) in steps.items()}


@pytest.fixture(scope="module")
def a2a_clean(tmp_path_factory):
    from gpu_jobs import build_job

    paths = build_job(_real_rank(A2A_SOURCE), tmp_path_factory.mktemp("a2a-clean"), world=4, per_host=4)
    return convert_kineto([str(p) for p in paths], "gpu-a2a", DATE)


def test_embedding_all_to_all_is_an_op_of_its_own_on_every_rank(a2a_clean):
    table = a2a_clean.trace.to_pandas()
    assert not any("all_to_all" in key for key in a2a_clean.source["unmapped"])
    issued = _a2a_issued_per_step(_real_rank(A2A_SOURCE))
    a2a = table[table.optype == "all-to-all"].groupby(["rank", "step"]).size()
    assert set(a2a.index.get_level_values(0)) == {0, 1, 2, 3}
    for (rank, step), n in a2a.items():
        assert n == issued[step], (rank, step)
    # the forward that issued the embedding all-to-all is cut there: its pieces share its microbatch
    forward = table[(table.optype == "forward-compute") & (table["rank"] == 0)]
    assert (forward.groupby("step").size() > 1).all() and (forward.mb_id == 0).all()


@pytest.mark.parametrize("name", A2A_SOURCES)
def test_a_clean_ddp_and_all_to_all_job_names_no_straggler(name, tmp_path):
    from gpu_jobs import build_job
    from transforms.whatif.causes import analyze_and_classify

    paths = build_job(_real_rank(name), tmp_path / "job", world=4, per_host=4)
    job = convert_kineto([str(p) for p in paths], "gpu-a2a", DATE)
    # (a pipelined trainer's first profiled step lacks the work the step before it issued)
    assert len(job.source["steps"]) >= 3 and set(job.source["steps_dropped"]) <= {min(job.source["steps"]) - 1}
    result, verdict = analyze_and_classify(job.trace, job.job_meta(), "gpu-a2a")
    assert not result.discarded and abs(result.launch_slowdown - 1) < 0.05
    assert result.slowdown < 1.1 and verdict.cause == "none" and not verdict.implicated_workers


@pytest.mark.parametrize("name", A2A_SOURCES)
def test_a_slower_machine_in_a_ddp_and_all_to_all_job_is_the_worker_blamed(name, tmp_path):
    """Rank 2 runs 1.5x slower (tests/gpu_jobs.py: its kernels, NCCL ones included; the others'
    steps start when its steps do): it is the worker blamed, not the all-to-all it takes longer in."""
    from gpu_jobs import build_job
    from transforms.whatif.causes import analyze_and_classify

    paths = build_job(_real_rank(name), tmp_path / "job", world=4, slow={2: 1.5}, per_host=4)
    job = convert_kineto([str(p) for p in paths], "gpu-a2a-slow", DATE)
    result, verdict = analyze_and_classify(job.trace, job.job_meta(), "gpu-a2a-slow")
    assert not result.discarded
    assert verdict.cause == "individual-worker" and verdict.implicated_workers == [(2, 0)]
    assert max(result.by_dp_rank, key=result.by_dp_rank.get) == 2
    assert result.slowdown > 1.3


def test_a_trace_with_one_profiled_step_is_analysed(document, tmp_path):
    """A profiler schedule with active=1 records one ProfilerStep: enough (each step replays alone)."""
    steps = sorted(e["name"] for e in document["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#"))
    keep = steps[1]
    events = [e for e in document["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep#") or e["name"] == keep]
    for rank in (0, 1):
        copy = dict(document, traceEvents=events, distributedInfo=dict(document["distributedInfo"], rank=rank))
        (tmp_path / f"rank-{rank}.json.gz").write_bytes(gzip.compress(json.dumps(copy).encode()))
    job = convert_kineto(sorted(str(p) for p in tmp_path.iterdir()), "gpu-one-step", DATE)
    assert job.source["steps"] == [int(keep.split("#")[1])]
    result = analyze_job(job.trace, job.job_meta(), "gpu-one-step")
    assert len(result.steps) == 1 and result.slowdown < 1.05


# --- every public GPU rank parses, checked against independent sums over the same file ---------------

HTA_FILES = ["nccl_data.json.gz", "ddp2_rank1.json.gz", "world2_rank1.json.gz", "world8_rank3.json.gz",
             "world16_rank0.json.gz", "world1_rank0.json.gz", "sampled_rank-0.json.gz", "sampled_rank-1.json.gz"]


@pytest.mark.parametrize("name", HTA_FILES)
def test_each_public_gpu_rank_parses_to_what_its_file_holds(name):
    """Per rank, from the raw events alone: the ProfilerStep spans (exact), the NCCL kernels (count
    and summed time within 1%: each is one communication span of the rank), and the GPU work the
    converter attributes to CUDA launches (non-NCCL kernels, copies and memsets with a correlation)."""
    from transforms.ingest.kineto.rank import parse_rank_bytes
    from transforms.ingest.kineto.spans import COLL, RECV, SEND

    path = _real_rank(name)
    events = [e for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((int(e["name"].split("#")[1]), float(e["ts"]), float(e["dur"])) for e in events
                   if e.get("name", "").startswith("ProfilerStep#"))
    nccl = [float(e["dur"]) for e in events if e.get("cat") == "kernel" and e["name"].startswith(("ncclKernel_", "ncclDevKernel_"))]
    work = sum(1 for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and not e["name"].startswith(("ncclKernel_", "ncclDevKernel_")) and "correlation" in (e.get("args") or {}))

    trace = parse_rank_bytes(str(path), path.read_bytes())
    assert trace.steps.tolist() == [n for n, _, _ in steps]
    assert np.allclose(trace.step_end - trace.step_start, [d for _, _, d in steps], rtol=0, atol=1e-6)
    assert np.allclose(np.diff(trace.step_start), np.diff([t for _, t, _ in steps]), rtol=0, atol=1e-6)
    comm = np.isin(trace.kind, (COLL, SEND, RECV))
    assert int(comm.sum()) == len(nccl)
    assert float((trace.end - trace.start)[comm].sum()) == pytest.approx(sum(nccl), rel=0.01)
    assert trace.gpu_work == work and trace.device != "cpu"


def test_groups_come_from_the_kernels_args_when_pg_config_is_absent(document, converted, tmp_path):
    """A trace whose distributedInfo lists no pg_config (older torch) still names its groups: each NCCL
    kernel carries `Process Group Name / Description / Ranks`. The same job as with pg_config."""
    from transforms.ingest.kineto.rank import parse_rank

    info = {k: v for k, v in document["distributedInfo"].items() if k not in ("pg_config", "pg_count")}
    trace = parse_rank("rank-0.json", dict(document, distributedInfo=info))
    assert {name: (g.desc, g.ranks) for name, g in trace.groups.items()} == {"0": ("default_pg", (0, 1))}
    for rank in (0, 1):
        copy = dict(document, distributedInfo=dict(info, rank=rank))
        (tmp_path / f"rank-{rank}.json.gz").write_bytes(gzip.compress(json.dumps(copy).encode()))
    job = convert_kineto(sorted(str(p) for p in tmp_path.iterdir()), "gpu-ddp", DATE)
    assert job.trace.equals(converted.trace)


def test_unnamed_nccl_kernels_take_the_innermost_open_range_of_their_launch_thread():
    from transforms.ingest.kineto.rank import _name_from_launch
    from transforms.ingest.kineto.spans import COLL, SEND

    def kernel(kind, collective):   # (kind, start, end, peer, collective, group, local peer, Seq)
        return (kind, 0.0, 1.0, -1, collective, "0", -1, -1)

    comm = [kernel(COLL, "sendrecv"), kernel(COLL, "sendrecv"), kernel(COLL, "sendrecv"), kernel(SEND, "send"),
            kernel(COLL, "all_reduce"), kernel(COLL, "sendrecv")]
    ranges = [(10.0, 100.0, "nccl:all_to_all", 7),   # an outer range ...
              (20.0, 30.0, "nccl:all_reduce", 7),    # ... a nested one, ended by 40
              (50.0, 60.0, "nccl:broadcast", 7), (0.0, 5.0, "nccl:all_gather", 8)]
    launches = {1: (25.0, 7),    # inside the nested range: all_reduce
                2: (40.0, 7),    # after the nested range ended: walked back to the outer one
                3: (55.0, 7),    # broadcast
                4: (55.0, 7),    # a send kernel keeps what it is
                5: (26.0, 7),    # already all_reduce
                6: (7.0, 8)}     # the range on its thread ended before it: unnamed
    _name_from_launch(comm, [(i, i + 1) for i in range(len(comm))], launches, ranges)
    assert [entry[4] for entry in comm] == ["all_reduce", "all_to_all", "broadcast", "send", "all_reduce", "sendrecv"]
