"""Real torch runs with ground truth (tests/data/real_runs, issue 21): strag reads every layout,
schedule and profiler setting there, and its verdicts agree with what was injected.

The runs come from tools/real_traces/train.py (real PyTorch, gloo, torchrun); truth.json says
what each rank was and what was slowed. strag runs as a user runs it (`strag analyze --format
kineto DIR`, on the rank traces alone) through benchmarks/bench_real_runs.py.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from transforms.ingest.kineto import convert_kineto

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "data" / "real_runs"
_spec = importlib.util.spec_from_file_location("bench_real_runs", ROOT / "benchmarks" / "bench_real_runs.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

RUN_DIRS = bench.find_runs([RUNS])


def _truth(run: pathlib.Path) -> dict:
    return json.loads((run / "truth.json").read_text())


def test_the_committed_corpus_covers_the_layouts_and_schedules():
    truths = [_truth(run) for run in RUN_DIRS]
    assert {t["layout"] for t in truths} >= {"pp4", "pp2dp2-ppmajor", "pp2dp2-dpmajor", "dp4"}
    assert {t["schedule"] for t in truths} >= {"1f1b", "gpipe", "interleaved", "loopedbfs", "izb", "dualpipev", "dp"}
    assert {t["groups"] for t in truths} == {"mesh", "new_group"}
    assert {t["profiler"]["record_shapes"] for t in truths} == {True, False}
    assert {t["profiler"]["export"] for t in truths} == {"chrome", "tensorboard"}
    assert {t["grad_sync"] for t in truths} >= {"flat", "ddp", "async", "none"}
    assert {s["kind"] for t in truths for s in t["slowdowns"]} >= {"fwd", "bwd", "send", "allreduce", "gc", "data", "split"}
    assert sum(not t["expected"]["straggling"] for t in truths) >= 6
    assert any(t["profiler"].get("repeat", 1) > 1 for t in truths)   # a file per rank per profiler cycle
    assert any(not t["profiler"].get("schedule", True) for t in truths)   # no schedule, no prof.step()


@pytest.mark.parametrize("run", RUN_DIRS, ids=lambda p: p.name)
def test_every_rank_gets_its_true_coordinates(run):
    """dp rank and pipeline rank of every worker from the trace alone (no job.yaml): mesh names, plain
    dist.new_group groups, the default group only (pp-only), both mesh orders, tensorboard files."""
    truth = _truth(run)
    paths = [str(run / f) for f in truth["trace_files"]]
    converted = convert_kineto(paths, run.name, "2026-11-25", {})
    manifest = converted.manifest
    found = {int(w["rank"]): (int(w["dp_rank"]), int(w["stage"])) for w in manifest["workers"]}
    expected = {int(r): (c["dp"], c["pp"]) for r, c in truth["rank_coords"].items()}
    assert found == expected, converted.source["layout"]
    assert (manifest["dp_size"], manifest["pp_size"]) == (truth["dp"], truth["pp"])
    assert manifest["vpp_size"] == truth["virtual_stages_per_rank"]


@pytest.fixture(scope="module")
def rows():
    return {run.name: bench.analyse_run(run) for run in RUN_DIRS}


def test_no_run_is_refused(rows):
    assert {name: r["reason"] for name, r in rows.items() if r["refused"]} == {}


@pytest.mark.parametrize("name", [run.name for run in RUN_DIRS])
def test_the_verdict_matches_what_was_injected(rows, name):
    """Clean runs name no cause and blame nobody; slowed runs name an accepted cause and, when a
    rank was slowed by >= 1.5x, blame exactly the slowed ranks (several, when several were)."""
    row = rows[name]
    assert not row["refused"], row["reason"]
    if not row["straggling"]:
        assert (row["cause"], row["blamed"]) == ("none", [])
        return
    assert row["cause"] in row["accepted"]
    if row["severe"] and row["slow_ranks"]:
        assert row["blamed"] == row["slow_ranks"]


def test_discarded_windows_give_no_what_if_savings(rows, tmp_path):
    """A window whose replay is off by more than 5% says so and shows no fix savings."""
    discarded = sorted(name for name, r in rows.items() if not r["refused"] and r["discarded"])
    assert len(discarded) >= 2
    import subprocess
    import sys

    run = RUNS / discarded[0]
    folder = tmp_path / run.name
    folder.mkdir()
    for f in _truth(run)["trace_files"]:
        (folder / f).symlink_to(run / f)
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "analyze", "--format", "kineto", str(folder), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    assert "DISCARDED" in proc.stdout and "the replay does not match the trace" in proc.stdout
    verdict = json.loads(out.read_text())["verdict"]
    # measurements only; the one fix shown is untraced-cpu's, measured against what ran
    assert all(v.get("measured_only") for v in verdict["verdicts"] if v["cause"] != "untraced-cpu")
    assert set(verdict["fixes"]) <= {"untraced-cpu"}


def test_scores_count_what_the_issue_counts():
    def row(name, straggling, cause, blamed, slow, noise="sleep", refused=False, disc=1.0, severe=True, world=4):
        return {"run": name, "refused": refused, "straggling": straggling, "cause": cause, "causes": [cause],
                "blamed": blamed, "slow_ranks": slow, "accepted": ["individual-worker"] if straggling else ["none"],
                "noise": noise, "discrepancy": disc, "severe": severe, "truth": {"world": world}}
    rows = [row("a", True, "individual-worker", [1], [1]), row("b", True, "individual-worker", [1, 2], [1]),
            row("c", False, "none", [], [], world=2), row("d", False, "stage-imbalance", [], [], disc=1.08, world=2),
            row("e", True, "none", [], [2], refused=True), row("f", False, "none", [], [], noise="cpu", disc=0.97, world=2)]
    scores = bench.score(rows)
    assert scores == {"refused": (1, 6), "workers_exact": (1, 2), "false_alarms": (1, 3), "primary_cause": (2, 2),
                      "replay_within_5pct": (3, 4), "clean_2proc_replay_5pct": (2, 3)}
    assert bench.met("false_alarms", 0, 20) and not bench.met("false_alarms", 2, 20)


def test_strict_scores_hold_each_run_to_its_one_expected_cause():
    def row(name, accepted, cause, blamed=(), slow=(), s=1.3, refused=False):
        straggling = accepted != ["none"]
        return {"run": name, "refused": refused, "straggling": straggling, "cause": cause, "blamed": list(blamed),
                "slow_ranks": list(slow), "accepted": accepted, "S": s}
    gc = ["python-gc", "individual-worker", "untraced-cpu"]
    rows = [row("gc-named-worker", gc, "individual-worker", [1], [1]),     # right by the loose score, not the strict
            row("gc-right", gc, "python-gc", [1], [1]),
            row("fwd", ["individual-worker"], "individual-worker", [0], [0]),
            row("clean-quiet", ["none"], "none", s=1.04), row("clean-slow", ["none"], "none", s=1.2),
            row("refused", ["individual-worker"], "none", refused=True)]
    strict = bench.strict_scores(rows)
    assert strict["right"] == (3, 6)   # gc-right, fwd, clean-quiet
    assert strict["per_cause"]["python-gc"] == {"precision": (1, 1), "recall": (1, 2)}
    assert strict["per_cause"]["individual-worker"] == {"precision": (1, 2), "recall": (1, 2)}
    assert strict["confusion"]["python-gc"]["individual-worker"] == 1
    assert strict["confusion"]["individual-worker"]["refused"] == 1
    assert strict["clean_below_1.1"] == (1, 2)


def test_a_frozen_matrix_s_runs_get_its_first_read_printed_beside_the_current_score(tmp_path):
    """Issue 35, 4d: the committed first-read record of a frozen matrix is found for a folder holding
    exactly that matrix's runs (a subset or another corpus has none) and printed figure by figure."""
    matrix = json.loads((ROOT / "tools" / "real_stacks" / "frozen2-matrix.json").read_text())
    rows = [{"run": run["name"]} for run in matrix]
    record = bench.first_read(rows)
    assert record is not None and record["matrix"] == "frozen2-matrix.json"
    assert record["strict"][1] == len(matrix) and record["scores"]["refused"][1] == len(matrix)
    assert bench.first_read(rows[1:]) is None and bench.first_read([{"run": "elsewhere"}]) is None
    scores = {name: (value[0] + 1, value[1]) for name, value in record["scores"].items()}
    report = bench._first_read_report(record, scores, {"right": (record["strict"][0] + 2, len(matrix))})
    first, now = record["strict"][0], record["strict"][0] + 2
    assert f"first {first} / {len(matrix)}" in report and f"now {now} / {len(matrix)}" in report
    assert report.count("   now ") == 1 + len(record["scores"])
    assert bench.first_read(rows, tmp_path / "none.json") is None


def test_the_gc_counterfactual_compares_the_pause_fix_with_the_run_s_record_of_its_collections(tmp_path):
    """Measured: the longest collect of each profiled step over the job's wall time per step (each
    rank's mean profiled step, the last active step left out as it also holds the trace's export;
    the ranks' median); predicted: the fix's saving without planned GC. Rank 0 collects 100 ms at
    the end of step 2: its step 2 holds the collection, rank 1's step 3 its wait for rank 0 (both
    500 ms), so the slowest rank per step (500, 500) would count the collection twice: the job ran
    450 ms a step."""
    (tmp_path / "PROVENANCE.json").write_text(json.dumps({"ranks": {
        "0": {"step_ms": [900, 400, 500, 400, 1200], "gc_collects": [[2, 100.0], [4, 80.0]]},
        "1": {"step_ms": [900, 410, 400, 500, 1100], "gc_collects": [[3, 120.0]]}}}))
    truth = {"profiler": {"wait": 1, "warmup": 1, "active": 3}}
    fix = {"savings_fraction": 0.2, "step_time": 0.32, "measured": True, "fix": "planned GC: the pauses taken out, ..."}
    verdict = {"fixes": {"python-gc": fix}, "evidence": {"planned_gc_seconds": 0.05}}
    got = bench.gc_counterfactual(tmp_path, truth, verdict)
    assert got["measured"] == pytest.approx((100 + 120 + 80) / (3 * 450))        # steps 2, 3, 4 over 450 ms a step
    assert got["predicted"] == pytest.approx(1 - (0.32 - 0.05) / 0.4)            # ran = 0.32 / (1 - 0.2)
    assert bench.gc_counterfactual(tmp_path, truth, {"fixes": {"individual-worker": fix}}) is None


def test_the_twin_counterfactual_compares_the_fix_with_the_clean_twin_s_step_time(tmp_path):
    """Predicted: the slowed run's median profiled step (the last active step, which holds the
    export, left out) less the expected cause's saving; measured: its twin's, the same way."""
    run, twin = tmp_path / "r", tmp_path / "r-twin"
    truth = {"profiler": {"wait": 1, "warmup": 1, "active": 4},
             "expected": {"straggling": True, "primary_causes": ["individual-worker"]}}
    for folder, ms in ((run, [[900, 600, 700, 650, 680, 2000], [900, 590, 710, 640, 670, 1900]]),
                       (twin, [[800, 400, 420, 410, 430, 1500], [800, 405, 415, 430, 425, 1500]])):
        folder.mkdir()
        folder.joinpath("PROVENANCE.json").write_text(json.dumps({"ranks": {str(r): {"step_ms": m} for r, m in enumerate(ms)}}))
        folder.joinpath("truth.json").write_text(json.dumps(dict(truth, expected={"straggling": folder == run,
                                                                                   "primary_causes": ["none"]})))
    verdict = {"cause": "individual-worker", "fixes": {"individual-worker": {"savings_fraction": 0.35}}}
    got = bench.twin_counterfactual(run, truth, verdict)
    assert got["ran"] == pytest.approx(0.68) and got["measured"] == pytest.approx(0.43)   # steps 2-4, max over ranks
    assert got["predicted"] == pytest.approx(0.68 * 0.65)
    assert bench.twin_counterfactual(twin, json.loads((twin / "truth.json").read_text()), verdict) is None
    assert bench.twin_counterfactual(run, truth, {"fixes": {}}) is None


def test_the_odd_steps_counterfactual_compares_the_fix_with_the_run_s_own_even_steps(tmp_path):
    truth = {"profiler": {"wait": 1, "warmup": 1, "active": 5},
             "slowdowns": [{"kind": "fwd", "rank": 1, "amount": 2.0, "steps": "odd"}],
             "expected": {"straggling": True, "primary_causes": ["individual-worker"]}}
    (tmp_path / "PROVENANCE.json").write_text(json.dumps({"ranks": {
        "0": {"step_ms": [900, 500, 400, 800, 420, 790, 3000]}, "1": {"step_ms": [900, 500, 410, 820, 400, 800, 3000]}}}))
    verdict = {"cause": "individual-worker", "fixes": {"individual-worker": {"savings_fraction": 0.3}}}
    got = bench.odd_steps_counterfactual(tmp_path, truth, verdict)
    ran = (410 + 820 + 420 + 800) / 4 / 1000                                   # steps 2-5 (6 holds the export)
    assert got["ran"] == pytest.approx(ran) and got["measured"] == pytest.approx((410 + 420) / 2 / 1000)
    assert got["predicted"] == pytest.approx(ran * 0.7) and got["within"]
    steady = dict(truth, slowdowns=[{"kind": "fwd", "rank": 1, "amount": 2.0}])
    assert bench.odd_steps_counterfactual(tmp_path, steady, verdict) is None


def test_an_intermittent_worker_counts_only_when_named_with_exactly_its_odd_steps():
    truth = {"profiler": {"wait": 1, "warmup": 1, "active": 6},
             "slowdowns": [{"kind": "fwd", "rank": 1, "amount": 2.0, "steps": "odd"}]}
    assert bench.odd_profiled_steps(truth) == [3, 5, 7]                         # profiled steps 2..7
    row = {"refused": False, "truth": truth, "slow_ranks": [1]}
    rows = [dict(row, named_steps={1: [3, 5, 7]}), dict(row, named_steps={1: [3, 5]}), dict(row, named_steps={0: [3, 5, 7]}),
            dict(row, named_steps={}), dict(row, truth=dict(truth, slowdowns=[{"kind": "fwd", "rank": 1, "amount": 2.0}]))]
    assert bench.intermittent_named(rows) == (1, 4)                            # the steady run is not counted


def test_reliability_bins_verdicts_by_confidence_and_counts_the_right_ones():
    """Of the verdicts naming a cause, per confidence bin: how many, how many right (strict), the mean
    confidence; none and insufficient evidence claim nothing and are left out, and are no false alarm."""
    def row(name, accepted, cause, confidence, blamed=(), slow=()):
        return {"run": name, "refused": False, "straggling": accepted != ["none"], "cause": cause, "causes": [cause],
                "blamed": list(blamed), "slow_ranks": list(slow), "accepted": accepted, "S": 1.3,
                "confidence": confidence, "noise": "cpu", "discrepancy": 1.0, "severe": True}
    worker = ["individual-worker"]
    rows = [row("a", worker, "individual-worker", 0.995, [1], [1]), row("b", worker, "individual-worker", 0.999, [0], [1]),
            row("c", worker, "individual-worker", 0.85, [1], [1]), row("d", ["none"], "none", 1.0),
            row("e", ["none"], "insufficient-evidence", 1.0)]
    assert bench.reliability(rows) == [(0.8, 0.9, 1, 1, 0.85), (0.99, 1.0, 2, 1, pytest.approx(0.997))]
    assert bench.undecided(rows) == (1, 0, 5)
    assert bench.score(rows)["false_alarms"] == (0, 2)


def _convert(name: str):
    run = RUNS / name
    return convert_kineto([str(run / f) for f in _truth(run)["trace_files"]], name, "2026-11-25", {})


def test_v_shaped_schedule_places_two_chunks_per_rank_and_splits_overlapped_actions():
    """DualPipeV holds chunks s and 2pp-1-s on pipeline rank s and runs `PP:(0F3;3B1)OVERLAP_F_B`
    actions (a forward, then a backward, under one label): each such label becomes one forward and
    one backward of the chunks it names; p2p goes both ways between neighbours (one channel per
    direction and chunk); the turn of the V (chunk pp-1 -> pp, on one rank) has no-op p2p only."""
    converted = _convert("clean-dualpipev-ppmajor-flat-mlp-cpu-s0")
    truth = _truth(RUNS / "clean-dualpipev-ppmajor-flat-mlp-cpu-s0")
    table = converted.trace.to_pandas()
    table["optype"] = table.optype.astype(str)
    compute = table[table.optype.isin(["forward-compute", "backward-compute"])]
    for rank, coords in truth["rank_coords"].items():
        assert set(compute[compute["rank"] == int(rank)].gmc) == set(coords["stages"])
    step = table[table.step == table.step.min()]
    microbatches = truth["microbatches"]
    per = step[step.optype.isin(["forward-compute", "backward-compute"])].groupby(["rank", "gmc", "optype"]).size()
    assert (per == microbatches).all() and len(per) == 4 * 2 * 2   # every microbatch of both chunks, both ways
    # no-ops (zero length) are where the neighbouring chunk is absent or on the same rank: on each
    # rank one direction of each chunk's p2p; all the others are transfers
    p2p = step[step.optype.str.endswith(("-send", "-recv"))]
    noop = p2p.duration == 0
    assert noop.sum() == 4 * 2 * 2 * microbatches and (~noop).sum() == 4 * 2 * 2 * microbatches
    from transforms.whatif import analyze_job
    result = analyze_job(converted.trace, converted.job_meta(), "v")
    assert abs(result.launch_slowdown - 1) < 0.15


def test_a_chunk_on_two_stages_is_a_structure_error():
    """The engine reads each chunk's stage from the compute ops: one chunk on two stages is refused."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from transforms.whatif import analyze_job
    from transforms.whatif.errors import TraceStructureError

    converted = _convert("clean-dualpipev-ppmajor-flat-mlp-cpu-s0")
    trace = converted.trace
    moved = pc.and_(pc.equal(trace.column("gmc"), 3), pc.equal(trace.column("stage"), 0))
    gmc = pc.if_else(moved, pa.scalar(2, trace.schema.field("gmc").type), trace.column("gmc"))
    trace = trace.set_column(trace.schema.get_field_index("gmc"), "gmc", gmc)
    with pytest.raises(TraceStructureError, match="model chunk .gmc. 2 has compute on stages"):
        analyze_job(trace, converted.job_meta(), "v")


def test_zero_bubble_weight_gradient_is_compute():
    """Zero-bubble schedules split each backward: `PP:sIm` (input gradient, feeds the backward-send) is
    the backward-compute, `PP:sWm` (weight gradient, run where it fits) a backward-weight-compute of the
    same chunk and microbatch, in the stage's compute chain: the replay then matches what ran."""
    converted = _convert("clean-izb-pp4-ng-tf-sleep-s0")
    table = converted.trace.to_pandas()
    table["optype"] = table.optype.astype(str)
    key = ["step", "rank", "gmc", "mb_id"]
    backward = table[table.optype == "backward-compute"].set_index(key).sort_index()
    weight = table[table.optype == "backward-weight-compute"].set_index(key).sort_index()
    assert len(weight) and list(weight.index) == list(backward.index)
    assert (weight.start_ts >= backward.start_ts + backward.duration - 1e-6).all()   # W after its I
    from transforms.whatif import analyze_job
    result = analyze_job(converted.trace, converted.job_meta(), "zb")
    assert "backward-weight-compute" in result.by_optype


@pytest.mark.parametrize("name", ["clean-izb-pp4-ng-tf-sleep-s0", "pp4-1f1b-rs0-sleep", "n-interleaved-pp4-mesh-tf-sleep-fwd2-r2"])
def test_a_cpu_thread_issues_each_recv_after_the_compute_before_it(name):
    """On CPU ranks one thread computes and posts the recvs, in program order: a recv posted after
    other work (1F1B's steady state, interleaved and zero-bubble schedules run computes of the other
    direction or weight gradients between two of its direction) cannot start under that work. The
    job's source says device 'cpu' (host_compute); the no-delay replay, which without this edge
    started such recvs early, then matches what ran within 5%, closer than without it."""
    import dataclasses

    from transforms.whatif import analyze_job

    converted = _convert(name)
    meta = converted.job_meta()
    assert converted.source["device"] == "cpu" and meta.host_compute
    with_edge = analyze_job(converted.trace, meta, "host").launch_slowdown
    without = analyze_job(converted.trace, dataclasses.replace(meta, host_compute=False), "device").launch_slowdown
    assert abs(with_edge - 1) <= 0.05 < abs(without - 1)


def test_a_recv_waits_from_the_send_its_thread_issued_after_posting_it():
    """A rank paused before each send (the pause is untraced) posts its next recv, pauses, issues
    the send, then waits: the recv's wait starts at that send's issue, so the pause is the rank's
    launch delay (untraced CPU work, its own cause) and not a slow transfer of its link."""
    converted = _convert("send-r1-interleaved-dpmajor-async-tf-sleep")
    table = converted.trace.to_pandas()
    table["optype"] = table.optype.astype(str)
    rank = table[(table["rank"] == 1) & (table.step == table.step.min())].sort_values("start_ts")
    sends = rank[rank.optype.str.endswith("-send")].start_ts.to_numpy()
    for _, recv in rank[rank.optype.str.endswith("-recv")].iterrows():
        end = recv.start_ts + recv.duration
        issued = sends[(sends > recv.start_ts + 1e-9) & (sends < end - 1e-9)]
        assert not len(issued), f"a send issued at {issued[0]} while the recv at {recv.start_ts} waited"
    from transforms.whatif.causes import analyze_and_classify

    result, verdict = analyze_and_classify(converted.trace, converted.job_meta(), "send")
    assert verdict.cause == "untraced-cpu" and "communication" not in verdict.causes


def test_each_ddp_bucket_has_its_own_ideal_transfer():
    """DDP all-reduces its gradient buckets while the backward runs, each bucket of its own size:
    the converted job says so (distinct_dp_collectives), and each DP collective's ideal is the
    median of that same collective (stage, seq_id) over steps and DP ranks, not one median over
    buckets of different sizes. A job that all-reduces once after the backward (flat) keeps
    METHOD.md's one ideal per op type."""
    import numpy as np

    from schemas.trace import DP_COMM_OPTYPES, OPTYPES
    from transforms.whatif.model import compile_job

    converted = _convert("allreduce-r1-dp4-ddp-mlp-cpu")
    meta = converted.job_meta()
    assert converted.source["collectives_issued_during_compute"] > 0 and meta.distinct_dp_collectives
    model = compile_job(converted.trace, meta, "ddp")
    ideal = model.ideal_cost()
    codes = [OPTYPES.index(name) for name in DP_COMM_OPTYPES]
    dp_ops = np.flatnonzero(np.isin(model.op_optype, codes))
    assert len(dp_ops) >= 2
    for op in dp_ops.tolist():
        same = np.flatnonzero((model.op_optype == model.op_optype[op]) & (model.op_stage == model.op_stage[op])
                              & (model.op_seq_id == model.op_seq_id[op]))
        assert ideal[op] == pytest.approx(float(np.median(model.original_cost[same])), abs=1e-12)
    assert len({round(float(ideal[op]), 12) for op in dp_ops.tolist()}) > 1   # buckets differ

    flat = _convert("allreduce-r3-dp4-flat-mlp-sleep-ng")
    assert not flat.job_meta().distinct_dp_collectives
    model = compile_job(flat.trace, flat.job_meta(), "flat")
    rows = np.isin(model.op_optype, codes)
    assert len(set(model.ideal_cost()[rows].round(12).tolist())) == len(set(model.op_optype[rows].tolist()))


CYCLES = "c-1f1b-ppmajor-mesh-mlp-sleep-fwd2-r1-cycles2-tb"


def _cycle_files(run: pathlib.Path) -> dict[int, list[pathlib.Path]]:
    """Per rank, its files in step order (each file's first ProfilerStep), read from the files."""
    import gzip
    import re

    out: dict[int, list[tuple[int, pathlib.Path]]] = {}
    for path in sorted(run.glob("*.pt.trace.json.gz")):
        document = json.loads(gzip.decompress(path.read_bytes()))
        steps = [int(m.group(1)) for e in document["traceEvents"] if (m := re.match(r"ProfilerStep#(\d+)$", str(e.get("name"))))]
        out.setdefault(int(document["distributedInfo"]["rank"]), []).append((min(steps), path))
    return {rank: [p for _, p in sorted(files)] for rank, files in out.items()}


def test_profiler_cycles_are_one_job():
    """schedule(repeat=2) with tensorboard_trace_handler writes a file per rank per cycle: the cycles'
    steps (other ProfilerStep numbers in each) are one job, every step of both analysed, the second
    cycle's times after the first's."""
    run = RUNS / CYCLES
    files = _cycle_files(run)
    assert len(files) == 4 and all(len(f) == 2 for f in files.values())
    converted = _convert(CYCLES)
    each = [convert_kineto([str(f[c]) for f in files.values()], "cycle", "2026-11-25", {}) for c in (0, 1)]
    steps = [c.source["steps"] for c in each]
    assert not set(steps[0]) & set(steps[1])
    assert converted.source["profiler_cycles"] == 2 and converted.source["steps"] == steps[0] + steps[1]
    assert converted.trace.num_rows == sum(c.trace.num_rows for c in each)
    table = converted.trace.to_pandas()
    first, second = table[table.step.isin(steps[0])], table[table.step.isin(steps[1])]
    assert second.start_ts.min() >= (first.start_ts + first.duration).max()
    traced = sum((c.manifest["end_time"] - c.manifest["start_time"]).total_seconds() for c in each)
    assert (converted.manifest["end_time"] - converted.manifest["start_time"]).total_seconds() == pytest.approx(traced, abs=1e-6)
    from transforms.ingest import describe_source

    assert "2 profiler cycles" in describe_source(converted.source)


def test_a_profiler_cycle_a_rank_lacks_is_dropped_with_its_reason(tmp_path):
    """One rank's second-cycle file is missing (not uploaded yet): the complete cycle is analysed, the
    other's steps are listed as dropped with the reason; a file of one rank twice is still a duplicate."""
    from transforms.ingest import RawInputError

    files = _cycle_files(RUNS / CYCLES)
    paths = [str(f) for rank, pair in files.items() for f in (pair if rank != 2 else pair[:1])]
    converted = convert_kineto(paths, "cycle", "2026-11-25", {})
    first = convert_kineto([str(pair[0]) for pair in files.values()], "cycle", "2026-11-25", {})
    assert converted.source["steps"] == first.source["steps"] and converted.trace.num_rows == first.trace.num_rows
    dropped = converted.source["steps_dropped"]
    assert dropped and all("profiler cycle incomplete" in converted.source["steps_dropped_why"][str(s)] and
                           "rank" in converted.source["steps_dropped_why"][str(s)] for s in dropped)
    twice = tmp_path / "again.pt.trace.json.gz"
    twice.write_bytes(files[1][0].read_bytes())
    with pytest.raises(RawInputError, match="overlapping steps") as error:
        convert_kineto([*map(str, (f for pair in files.values() for f in pair)), str(twice)], "cycle", "2026-11-25", {})
    assert error.value.reason_code == "raw_duplicate_rank"


def test_steps_without_profilerstep_are_told_by_the_optimizer():
    """A profile around a few iterations without a schedule and without prof.step() has no
    ProfilerStep spans: each step ends with the optimizer's step, and the job is analysed (the
    source says how its steps were told); a file with neither is refused with what to do."""
    import gzip

    from transforms.ingest import RawInputError, describe_source

    run = RUNS / "d-gpipe-pp4-mesh-mlp-sleep-fwd3-r1-nosched"
    truth = _truth(run)
    assert not truth["profiler"]["schedule"]
    assert all(b"ProfilerStep" not in gzip.decompress((run / f).read_bytes()) for f in truth["trace_files"])
    converted = _convert(run.name)
    assert "Optimizer.step" in converted.source["steps_from"] and "steps told by" in describe_source(converted.source)
    assert len(converted.source["steps"]) >= 2
    table = converted.trace.to_pandas()
    # every step holds one optimizer op per rank and every microbatch's forward and backward
    per_step = table.groupby("step").optype.value_counts().unstack()
    assert (per_step["optimizer"] == truth["world"]).all()
    assert (per_step["forward-compute"] == truth["microbatches"] * truth["world"]).all()

    document = json.loads(gzip.decompress((run / truth["trace_files"][0]).read_bytes()))
    document["traceEvents"] = [e for e in document["traceEvents"] if not str(e.get("name", "")).startswith("Optimizer.")]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        bare = pathlib.Path(tmp, "rank-0.json")
        bare.write_text(json.dumps(document))
        with pytest.raises(RawInputError, match="no ProfilerStep.*no Optimizer.step span") as error:
            convert_kineto([str(bare)], "bare", "2026-11-25", {})
    assert error.value.reason_code == "raw_no_steps"


def test_a_zero_bubble_chunk_s_backward_is_both_its_halves():
    """ScheduleInterleavedZeroBubble splits each backward in two ops, input gradients then weight
    gradients, and each chunk differently: the first chunk's inputs (token ids) need no gradient, so
    its backward-compute is empty (0 recorded operations, ~0.1 ms) and all of it is weight gradients.
    A chunk's backward, for its work, pace and balance, is both halves: counted so, no chunk runs its
    work at an odd pace (with the input half alone, chunk 0's 0.1 ms over max(0, 1) operation read
    as a machine many times slower per operation than the others)."""
    from transforms.whatif import compile_job
    from transforms.whatif.causes.signals import chunk_work, pairs, take, whole_backward
    from transforms.whatif.model import WGT

    converted = _convert("clean-izb-pp4-ng-tf-sleep-s0")
    model = compile_job(converted.trace, converted.job_meta(), "izb")
    table = converted.trace.to_pandas()
    compute = table[table.optype.astype(str).str.endswith("compute")]
    ops = compute.groupby(["gmc", "optype"], observed=True).n_ops.mean().unstack()
    assert ops.loc[0, "backward-compute"] == 0 and ops.loc[0, "backward-weight-compute"] > 0
    work = chunk_work(converted.trace, model)
    halves = (ops["backward-compute"] + ops["backward-weight-compute"]).to_numpy()
    assert work.ops_backward.tolist() == pytest.approx(halves.tolist())
    for chunk in work.chunks.tolist():
        ratio, speed = work.of([chunk])
        assert speed < 1.3, (chunk, ratio, speed)    # CauseRules.slower_pace: no chunk's machine reads slow
    forward, backward = pairs(model)
    whole = whole_backward(model, backward)
    added = whole - take(model.original_cost, backward)
    assert (added > 0).all()                         # every backward found its weight half
    assert added.sum() == pytest.approx(model.original_cost[model.op_optype == WGT].sum())
