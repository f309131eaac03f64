"""Real torch.profiler output of real training runs (tests/data/real_traces/, made by
tools/real_traces/ with torch 2.13 on CPU: 4 processes, gloo, 2 pipeline stages x 2 DP replicas
with torch.distributed.pipelining, and DP-only DDP) converted and analysed as a user would:
`strag analyze --format kineto DIR`.

The expected numbers are properties of the runs, not values copied from our output: the clean
run replays within 5% and straggles little; the run whose rank 1 (dp 1, stage 0) sleeps 40 ms in
every forward has that worker on top of every attribution and in the verdict.
"""
from __future__ import annotations

import gzip
import json
import pathlib
import re
import shutil

import numpy as np
import pytest

from pipelines import analyze as analyze_cli
from transforms.ingest import RawInputError, convert_window
from transforms.whatif import analyze_job
from transforms.whatif.causes import analyze_and_classify

DATA = pathlib.Path(__file__).parent / "data" / "real_traces"
DATE = "2026-11-23"


def rank_files(run: str) -> list[str]:
    return sorted(str(p) for p in (DATA / run).glob("rank-*.json.gz"))


def provenance(run: str) -> dict:
    return json.loads((DATA / run / "PROVENANCE.json").read_text())


@pytest.fixture(scope="module")
def analysed():
    """run -> (ConvertedJob, WhatIfResult, Verdict), converted and analysed once per module."""
    cache = {}

    def get(run: str):
        if run not in cache:
            converted = convert_window("kineto", rank_files(run), run, DATE)
            meta = converted.job_meta()
            result, verdict = analyze_and_classify(converted.trace, meta, run)
            cache[run] = converted, result, verdict
        return cache[run]

    return get


def test_every_committed_run_says_how_it_was_made():
    runs = sorted(p.name for p in DATA.iterdir() if p.is_dir())
    assert {"pp2dp2-1f1b", "pp2dp2-1f1b-slow", "pp2dp2-1f1b-slow-sleep", "dp4-ddp"} <= set(runs)
    for run in runs:
        made = provenance(run)
        assert made["torch_version"].startswith("2.") and "torchrun" in made["command"] and "seed" in made
        assert len(rank_files(run)) == made["world_size"] == 4


@pytest.mark.parametrize("run", ["pp2dp2-1f1b", "pp2dp2-1f1b-slow", "pp2dp2-1f1b-slow-sleep", "pp2dp2-gpipe"])
def test_pipeline_runs_convert_to_the_mesh_they_ran_on(analysed, run):
    converted, result, _ = analysed(run)
    manifest, source = converted.manifest, converted.source
    assert (manifest["dp_size"], manifest["pp_size"], manifest["tp_size"], manifest["vpp_size"]) == (2, 2, 1, 1)
    # DeviceMesh ("pp", "dp"): global rank = pp * 2 + dp
    assert {(w["dp_rank"], w["stage"]): w["rank"] for w in manifest["workers"]} == {(0, 0): 0, (1, 0): 1, (0, 1): 2, (1, 1): 3}
    assert source["layout"].startswith("process-group descriptions")
    assert source["steps"] == provenance(run)["steps_profiled"] and not source["steps_dropped"]
    assert source["device"] == "cpu" and source["backend"] == "gloo" and source["clocks"] == 1
    assert {w["host"] for w in manifest["workers"]} == {"vm"}   # the traces' host_name
    table = converted.trace.to_pandas()
    counts = table.groupby(["step", "dp_rank", "stage"]).optype.value_counts().unstack(fill_value=0)
    microbatches = provenance(run)["microbatches"]
    assert (counts["forward-compute"] == microbatches).all() and (counts["backward-compute"] == microbatches).all()
    assert (counts["optimizer"] == 1).all() and (counts["grads-reduce-scatter"] > 0).all()
    first, last = table[table.stage == 0], table[table.stage == 1]
    assert set(first.optype.astype(str)) >= {"forward-send", "backward-recv"} and "forward-recv" not in set(first.optype.astype(str))
    assert set(last.optype.astype(str)) >= {"forward-recv", "backward-send"} and "forward-send" not in set(last.optype.astype(str))
    assert len(result.steps) == 4


def test_clean_run_replays_within_five_percent_and_straggles_little(analysed):
    _, result, verdict = analysed("pp2dp2-1f1b")
    assert result.launch_slowdown < 1.05 and not result.discarded
    # 4 processes share 2 cores: run-to-run noise, but no worker or stage stands out
    assert abs(result.slowdown - 1.0) < 0.1   # mean durations as the ideal can even replay a little slower
    assert verdict.cause not in ("individual-worker", "stage-imbalance")


@pytest.mark.parametrize("run", ["pp2dp2-1f1b-slow", "pp2dp2-1f1b-slow-sleep"])
def test_slowed_worker_is_found_everywhere(analysed, run):
    """Rank 1 (dp 1, stage 0) runs its forward matmuls 6x (compute) or sleeps 40 ms in each
    forward: S > 1.1, dp 1 and stage 0 top the attributions, the M_W set is that worker, and the
    verdict blames its rank. Extra matmuls are a slow worker; a stretch with no op at all in every
    forward is no slower compute (the worker test measures the ops, which run at its peers' pace)
    but a pause at its forwards, which without a GC record the collector rule calls python-gc
    (its sentence says the OS preempting it looks the same)."""
    made = provenance(run)
    slow = (made["slow_rank_coords"]["dp"], made["slow_rank_coords"]["pp"])
    assert slow == (1, 0) and made["slow_rank"] == 1
    converted, result, verdict = analysed(run)
    assert result.launch_slowdown < 1.05
    assert result.slowdown > 1.1
    assert max(result.by_dp_rank, key=result.by_dp_rank.get) == slow[0]
    assert max(result.by_stage, key=result.by_stage.get) == slow[1]
    assert max(result.by_optype, key=result.by_optype.get) == "forward-compute"
    assert result.mw.workers == [slow] and result.mw.rem > 0.5
    cause = "python-gc" if run.endswith("-sleep") else "individual-worker"
    assert verdict.cause == cause and verdict.implicated_workers == [slow]
    assert int(result.worker_rank[slow]) == made["slow_rank"]
    fix = verdict.fixes[cause]
    if cause == "individual-worker":
        assert fix.fixed_slowdown < result.slowdown and fix.explained > 0.5
    else:   # measured against what ran: the pauses taken out of every step
        assert fix.measured and fix.savings_fraction > 0.1
        assert "individual-worker" not in verdict.causes


def test_extra_compute_on_one_rank_shows_in_its_forward(analysed):
    """The compute-mode straggler also steals CPU from the other ranks on 2 cores; its own forward
    is still far the slowest of its stage."""
    made = provenance("pp2dp2-1f1b-slow")
    converted, _, _ = analysed("pp2dp2-1f1b-slow")
    table = converted.trace.to_pandas()
    forward = table[table.optype.astype(str) == "forward-compute"].groupby(["dp_rank", "stage"]).duration.mean()
    slow = (made["slow_rank_coords"]["dp"], made["slow_rank_coords"]["pp"])
    assert forward[slow] > 2 * forward[(1 - slow[0], slow[1])]


def test_ddp_run_is_data_parallel_only(analysed):
    converted, result, _ = analysed("dp4-ddp")
    manifest = converted.manifest
    assert (manifest["dp_size"], manifest["pp_size"]) == (4, 1)
    table = converted.trace.to_pandas()
    names = set(table.optype.astype(str))
    assert names >= {"forward-compute", "backward-compute", "grads-reduce-scatter", "optimizer"}
    assert not names & {"forward-send", "forward-recv", "backward-send", "backward-recv"}
    assert result.ms.rem == 0.0 and 1.0 <= result.slowdown < 1.3


def test_interleaved_schedule_is_analysed():
    """torch.distributed.pipelining's interleaved schedule issues its p2p ops asynchronously, ahead
    of the compute they serve: their direction comes from the `PP:sSEND_Fm` / `PP:sRECV_Bm` labels,
    pairs wrap from the last stage to the first, the first and last chunk get no-op p2p, and a recv
    posted ahead waits only from the end of the compute before it."""
    converted = convert_window("kineto", rank_files("pp2dp2-interleaved"), "interleaved", DATE)
    assert (converted.manifest["pp_size"], converted.manifest["vpp_size"]) == (2, 2)
    table = converted.trace.to_pandas()
    per_step = table[table.step == table.step.min()].groupby(["stage", table.optype.astype(str)]).size()
    for stage in (0, 1):   # one recv / send per compute of each direction (no-ops at the pipeline's ends)
        for compute, p2p in (("forward-compute", ("forward-recv", "forward-send")), ("backward-compute", ("backward-recv", "backward-send"))):
            assert all(per_step[(stage, kind)] == per_step[(stage, compute)] for kind in p2p)
    result = analyze_job(converted.trace, converted.job_meta(), "interleaved")
    assert 0.9 < result.launch_slowdown < 1.1 and result.slowdown < 1.1   # a clean run


def test_one_host_clock_moved_changes_nothing(tmp_path):
    """Ranks 2 and 3 on another host whose clock is 3.7 s ahead give exactly the result of the
    same two hosts with synchronised clocks: the analysis depends on durations and order."""
    results = []
    for name, shift_us in (("synced", 0.0), ("shifted", 3.7e6)):
        folder = tmp_path / name
        folder.mkdir()
        for path in rank_files("pp2dp2-1f1b-slow-sleep"):
            document = json.loads(gzip.decompress(pathlib.Path(path).read_bytes()))
            if document["distributedInfo"]["rank"] >= 2:
                document["host_name"] = "other-host"
                for event in document["traceEvents"]:
                    if "ts" in event:
                        event["ts"] = event["ts"] + shift_us
            (folder / pathlib.Path(path).name).write_bytes(gzip.compress(json.dumps(document).encode()))
        converted = convert_window("kineto", sorted(str(p) for p in folder.iterdir()), "clock", DATE)
        assert converted.source["clocks"] == 2
        results.append(analyze_job(converted.trace, converted.job_meta(), "clock"))
    synced, shifted = results
    assert shifted.slowdown == pytest.approx(synced.slowdown, rel=1e-9)
    assert shifted.launch_slowdown == pytest.approx(synced.launch_slowdown, rel=1e-9)
    np.testing.assert_allclose(shifted.step_slowdown, synced.step_slowdown, rtol=1e-9)
    assert shifted.by_dp_rank == pytest.approx(synced.by_dp_rank, rel=1e-9)


def test_analyze_command_on_a_folder_of_rank_traces(tmp_path, capsys):
    """What a user types: the folder as torch.profiler left it (nothing else in it)."""
    folder = tmp_path / "run"
    folder.mkdir()
    for path in rank_files("pp2dp2-1f1b-slow-sleep"):
        shutil.copy(path, folder)
    out_json = tmp_path / "result.json"
    assert analyze_cli.run(["--format", "kineto", str(folder), "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "source: " in printed and "torch.profiler" in printed and "4 ranks on cpu" in printed
    assert "verdict: python-gc" in printed and "dp 1 / stage 0 (rank 1)" in printed   # its forwards' pauses
    written = json.loads(out_json.read_text())
    assert written["blocking_slowdown"] > 1.1 and written["verdict"]["cause"] == "python-gc"
    assert written["source"]["format"] == "kineto"


@pytest.mark.parametrize("run", ["pp2dp2-1f1b-slow-sleep"])
def test_analyze_tells_the_format_from_the_file_names(run, tmp_path, capsys):
    """`strag analyze DIR` without --format on torch.profiler output: read as kineto, as with --format
    (PROVENANCE.json beside the traces is set aside, not taken for a trace format of its own)."""
    assert analyze_cli.run([str(DATA / run), "--json", str(tmp_path / "told.json")]) == 0
    told = capsys.readouterr().out
    assert "source: " in told and "torch.profiler" in told and "verdict: python-gc" in told
    assert analyze_cli.run(["--format", "kineto", str(DATA / run), "--json", str(tmp_path / "given.json")]) == 0
    capsys.readouterr()
    assert (tmp_path / "told.json").read_text() == (tmp_path / "given.json").read_text()
    assert analyze_cli.parse([str(DATA / run / "rank-0.json.gz")]).fmt == "kineto"   # a single rank file too
    nd = tmp_path / "nd"
    nd.mkdir()
    (nd / "ndtimeline-x.jsonl.gz").write_bytes(b"")
    assert analyze_cli.parse([str(nd)]).fmt == "ndtimeline"


def test_a_missing_rank_is_refused_by_name(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    for path in rank_files("pp2dp2-1f1b")[:3]:
        shutil.copy(path, folder)
    with pytest.raises(RawInputError) as caught:
        convert_window("kineto", sorted(str(p) for p in folder.iterdir()), "three-of-four", DATE)
    assert caught.value.reason_code == "raw_missing_rank" and "three-of-four" in str(caught.value)
    assert "ranks 3" in str(caught.value)
    assert analyze_cli.run(["--format", "kineto", str(folder)]) == 2
    assert "[raw_missing_rank]" in capsys.readouterr().err


def test_import_writes_a_lake_job_that_analyses_the_same(tmp_path, capsys):
    """`strag import` then `strag analyze --lake`: the same S as the folder itself, and the lake
    job remembers where it came from (manifest metadata -> source_format in the batch tables)."""
    from pipelines import ingest
    from transforms.io.lake import find_job, read_manifests
    from transforms.validation import Validator

    lake = str(tmp_path / "lake")
    folder = tmp_path / "run"
    folder.mkdir()
    for path in rank_files("pp2dp2-1f1b-slow-sleep"):
        shutil.copy(path, folder)
    assert ingest.run(["--format", "kineto", str(folder), "--lake", lake, "--job-id", "imported", "--date", DATE]) == 0
    printed = capsys.readouterr().out
    assert "imported job imported on 2026-11-23" in printed and "dp 2 x pp 2" in printed and "torch.profiler" in printed
    job = find_job(lake, "imported")
    (manifest, problems), = read_manifests([job.manifest_path], Validator()).values()
    assert not problems and manifest["source"]["format"] == "kineto" and manifest["source"]["ranks"] == 4
    out_lake, out_folder = tmp_path / "lake.json", tmp_path / "folder.json"
    assert analyze_cli.run(["--lake", lake, "--job-id", "imported", "--json", str(out_lake)]) == 0
    assert analyze_cli.run(["--format", "kineto", str(folder), "--json", str(out_folder)]) == 0
    from_lake, from_folder = (json.loads(p.read_text()) for p in (out_lake, out_folder))
    assert from_lake["blocking_slowdown"] == pytest.approx(from_folder["blocking_slowdown"], rel=1e-12)
    assert from_lake["launch_slowdown"] == pytest.approx(from_folder["launch_slowdown"], rel=1e-12)


def test_import_refuses_bad_input_with_the_reason(tmp_path, capsys):
    from pipelines import ingest

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "rank-0.json").write_text("{ not json")
    code = ingest.run(["--format", "kineto", str(folder), "--lake", str(tmp_path / "lake"), "--job-id", "bad"])
    assert code == 2
    cause, consequence = capsys.readouterr().err.splitlines()   # the cause first, then what it left
    assert cause.startswith("strag import: job bad, file ") and cause.endswith("[raw_unreadable]")
    assert consequence == "  so: job bad: no readable rank trace in the window (1 file(s)) [raw_missing_rank]"
    with pytest.raises(SystemExit):
        ingest.run(["--format", "kineto", str(folder), "--lake", str(tmp_path / "lake"), "--job-id", "../escape"])
    assert "--job-id" in capsys.readouterr().err


def test_a_rank_alone_whose_groups_cannot_place_the_others(tmp_path, capsys):
    """One readable rank file (its pg_config lists only its own groups) and one broken one: the
    missing ranks are named, and the broken file is shown as set aside with its reason."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "rank-0.json").write_text("{ not json")
    shutil.copy(rank_files("pp2dp2-1f1b")[1], folder)
    assert analyze_cli.run(["--format", "kineto", str(folder)]) == 2
    cause, consequence = capsys.readouterr().err.splitlines()   # the cause first, then what it left
    assert cause.startswith("strag analyze: cannot read the job: job run, file ") and "rank-0.json" in cause
    assert "not a complete JSON document" in cause and cause.endswith("[raw_unreadable]")
    assert consequence.startswith("  so: job run: ") and "have no trace: ranks 0, 2, 3" in consequence
    assert consequence.endswith("[raw_missing_rank]")


def _copy(run: str, folder: pathlib.Path, ranks=(0, 1, 2, 3)) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        shutil.copy(DATA / run / f"rank-{rank}.json.gz", folder)


def test_ranks_of_two_runs_in_one_folder_are_refused(tmp_path):
    """Same script, same mesh, different runs: only the time on the shared host clock tells them apart."""
    _copy("pp2dp2-1f1b", tmp_path / "mixed", ranks=(0,))
    _copy("pp2dp2-gpipe", tmp_path / "mixed", ranks=(1, 2, 3))
    with pytest.raises(RawInputError) as caught:
        convert_window("kineto", sorted(str(p) for p in (tmp_path / "mixed").iterdir()), "mixed", DATE)
    assert caught.value.reason_code == "raw_mixed_jobs" and caught.value.path.endswith("rank-0.json.gz")
    assert "another run" in str(caught.value) and "job mixed" in str(caught.value)


def test_steps_that_do_not_line_up_are_refused(tmp_path):
    folder = tmp_path / "misaligned"
    _copy("pp2dp2-1f1b", folder)
    path = folder / "rank-2.json.gz"
    document = json.loads(gzip.decompress(path.read_bytes()))
    for event in document["traceEvents"]:
        if event.get("name", "").startswith("ProfilerStep#"):
            event["name"] = f"ProfilerStep#{int(event['name'].split('#')[1]) + 100}"
    path.write_bytes(gzip.compress(json.dumps(document).encode()))
    with pytest.raises(RawInputError) as caught:
        convert_window("kineto", sorted(str(p) for p in folder.iterdir()), "misaligned", DATE)
    assert caught.value.reason_code == "raw_steps_misaligned"
    assert "2: '102..105'" in str(caught.value) and "0: '2..5'" in str(caught.value)


def _edited(run: str, folder: pathlib.Path, rank: int, keep) -> list[str]:
    """The run's rank files in `folder`, rank `rank`'s events filtered by keep(event)."""
    _copy(run, folder)
    path = folder / f"rank-{rank}.json.gz"
    document = json.loads(gzip.decompress(path.read_bytes()))
    document["traceEvents"] = [event for event in document["traceEvents"] if keep(event)]
    path.write_bytes(gzip.compress(json.dumps(document).encode()))
    return sorted(str(p) for p in folder.iterdir())


def test_collectives_that_do_not_pair_up_are_refused(tmp_path):
    """Rank 1 records one gradient all-reduce per step fewer than its DP peer rank 0 (its second
    gloo runloop thread is missing). A step that differs from a rank's other steps is dropped
    instead (source.steps_dropped); a rank that differs from its peers in every step is refused."""
    runloop = []

    def keep(event):
        if event.get("name") == "gloo:all_reduce":
            if not runloop:
                runloop.append(event["tid"])
            return event["tid"] != runloop[0]
        return True

    paths = _edited("pp2dp2-1f1b", tmp_path / "run", 1, keep)
    with pytest.raises(RawInputError) as caught:
        convert_window("kineto", paths, "unpaired", DATE)
    assert caught.value.reason_code == "raw_unmatched_comm" and "grads-reduce-scatter" in str(caught.value)
    assert "rank 0: 2" in str(caught.value) and "rank 1: 1" in str(caught.value)


def test_a_rank_without_backward_compute_is_refused(tmp_path):
    paths = _edited("pp2dp2-1f1b", tmp_path / "run", 0,
                    lambda event: not str(event.get("name", "")).startswith("autograd::engine::evaluate_function"))
    with pytest.raises(RawInputError) as caught:
        convert_window("kineto", paths, "no-backward", DATE)
    assert caught.value.reason_code == "raw_no_microbatches" and "rank 0" in str(caught.value)
    assert "backward_label" in str(caught.value)


def test_analyze_words_for_runs_that_do_not_straggle_or_beat_the_ideal(capsys):
    """CPU ranks are not called GPUs; a job that does not straggle shows no M_W / M_S shares nor a
    negative waste; shares beyond 100% or below 0 and a faster backward are said in words."""
    assert analyze_cli.run([str(DATA / "pp2dp2-1f1b")]) == 0   # S < 1: no straggling at all
    clean = capsys.readouterr().out
    assert "GPU" not in clean and "4 CPU ranks" in clean
    assert "no CPU rank time lost (S < 1" in clean and "waste -" not in clean
    assert "M_S =" not in clean and "M_W =" not in clean and "M_W, M_S: not shown" in clean
    assert analyze_cli.run([str(DATA / "pp2dp2-1f1b-slow")]) == 0
    slow = capsys.readouterr().out
    assert "GPU" not in slow and "of the CPU rank-hours" in slow
    # a faster direction is said as faster, not as "0.7x slower" (the factors are measured: forward ~4x)
    assert re.search(r"forward [4-5]\.\dx slower and backward 1\.\dx faster than the other DP ranks", slow)
    assert "0.7x slower" not in slow
    # the slow worker's M_W share is above 100% and the last stage's below 0 (the shares themselves
    # are the engine's, checked against the reference elsewhere): said as "all (N%)" / "none (-N%)"
    assert re.search(r"removes all \(1\d\d%\) of the straggling time", slow)
    assert re.search(r"removes none \(-\d+%\) of the straggling time", slow)
    assert re.search(r"all \(1\d\d%\) of the straggling time removed \(S < 1 after it", slow)
    assert "above 100%: with only these idealised" in slow


def test_shares_and_speeds_in_words():
    from transforms.whatif.causes.explain import share_words, times_words

    assert [share_words(x) for x in (0.42, 1.0, 1.004, 1.42, -0.004, -0.12)] == ["42%", "100%", "100%", "all (142%)", "0%", "none (-12%)"]
    assert times_words(1.6, "forward") == "forward 1.6x slower" and times_words(0.5, "backward") == "backward 2.0x faster"
