"""The batch pipeline end to end on a small generated lake (tests/batch_lake.py).

One FnApiRunner run (multi-process, two workers) is shared by the content checks; the
other runs check that the same lake gives byte-identical tables on a rerun, on the
DaskRunner (LocalCluster of 2 worker processes), on S3 (moto server on loopback) and in
memory://, and that a run killed in the middle of publishing leaves whole partitions only
and converges on rerun.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch_lake import DATES, ExpectedWindow, write_batch_lake
from fixtures_s3 import moto_s3  # noqa: F401  (fixture)
from pipelines import batch
from schemas.fleet import FLEET_TABLE_SPECS
from schemas.tables import BATCH_TABLES, PART_FILE, TIMELINES_DIR, read_table
from transforms.batch.analyze_jobs import job_meta
from transforms.batch.commit import CRASH_ENV, parquet_bytes
from transforms.io.lake import list_jobs, read_manifest, read_trace_files
from transforms.whatif import analyze_job

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _argv(lake: str, out: str, *extra: str) -> list[str]:
    return ["--lake", lake, "--from", DATES[0], "--to", DATES[-1], "--out", out, *extra]


def _run(argv: list[str]) -> tuple[dict, dict]:
    """Run the pipeline in this process; return (run summary, Beam counters)."""
    return batch.execute(batch.parse(argv))


def _table_files(root: pathlib.Path) -> dict[str, bytes]:
    """Every published table file (relative path -> bytes); runs and staging excluded."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.parquet"))
            if not str(p.relative_to(root)).startswith("_")}


def _timeline_files(root: pathlib.Path) -> dict[str, bytes]:
    """Every published timeline (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / TIMELINES_DIR).rglob("*.json.gz"))}


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> tuple[str, list[ExpectedWindow]]:
    path = tmp_path_factory.mktemp("batch") / "lake"
    return str(path), write_batch_lake(str(path))


@pytest.fixture(scope="module")
def fnapi_run(lake, tmp_path_factory):
    """The reference run: FnApiRunner, two worker processes, local folders, with timelines."""
    out = tmp_path_factory.mktemp("batch") / "out"
    summary, counters = _run(_argv(lake[0], str(out), "--workers", "2", "--running-mode", "multi_processing", "--timelines"))
    assert summary["running_mode"] == "multi_processing"
    assert summary["timelines"] == len(_timeline_files(out)) > 0
    return out, summary, counters


def test_a_small_run_goes_in_process_with_identical_tables(lake, fnapi_run, tmp_path):
    """Without --running-mode, a run of at most SMALL_RUN windows (here: the first date's) runs
    in this process, in as few window groups as MAX_GROUP allows, and publishes that date's
    partitions byte for byte like the multi-process run; its summary says where the start-up went."""
    argv = ["--lake", lake[0], "--from", DATES[0], "--to", DATES[0], "--out", str(tmp_path / "out"), "--workers", "2"]
    windows = len(list_jobs(lake[0], DATES[0], DATES[0]))
    assert 1 < windows <= batch.SMALL_RUN
    opts = batch.parse(argv)
    small = batch.for_run(opts, windows)
    assert (small.running_mode, small.workers) == ("in_memory", 1)
    assert batch.window_groups(small, windows) == -(-windows // batch.MAX_GROUP)
    assert batch.for_run(opts, batch.SMALL_RUN + 1) == opts
    given = batch.parse([*argv, "--running-mode", "multi_processing"])
    assert batch.for_run(given, windows) == given
    summary, _ = _run(argv)
    assert summary["running_mode"] == "in_memory"
    assert set(summary["startup"]) == {"lake listing", "Great Expectations import", "graph build + manifest checks", "pipeline"}
    assert all(value >= 0 for value in summary["startup"].values())
    partition = f"/date={DATES[0]}/"
    ours = {path: data for path, data in _table_files(tmp_path / "out").items() if partition in path}
    assert ours and ours == {path: data for path, data in _table_files(fnapi_run[0]).items() if partition in path}


def _same_tables_elsewhere(published: dict[str, bytes], reference: pathlib.Path, lake_url: str, reference_lake: str) -> None:
    """Tables written from a copy of the lake at another URL equal the reference run: byte
    for byte, except quarantine, which names the source files (compared with the lake URL
    swapped back)."""
    expected = _table_files(reference)
    assert set(published) == set(expected)
    for path, data in published.items():
        if not path.startswith("quarantine/"):
            assert data == expected[path], path
            continue
        rows = pq.read_table(pa.BufferReader(data)).to_pylist()
        for row in rows:
            row["source_path"] = row["source_path"].replace(lake_url, reference_lake)
            row["detail"] = row["detail"] and row["detail"].replace(lake_url, reference_lake)
        reference_rows = pq.read_table(reference / path).to_pylist()
        assert sorted(map(repr, rows)) == sorted(map(repr, reference_rows)), path


def _by_job(table) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for row in table.to_pylist():
        rows.setdefault(row["job_id"], []).append(row)
    return rows


def test_every_window_is_covered_once_with_its_expected_outcome(lake, fnapi_run):
    out, summary, _ = fnapi_run
    coverage = read_table(str(out), "coverage")
    keys = [(row["date"].isoformat(), row["job_id"]) for row in coverage.to_pylist()]
    assert sorted(keys) == sorted((e.date, e.job_id) for e in lake[1])
    status = {row["job_id"]: row for row in coverage.to_pylist()}
    quarantine = _by_job(read_table(str(out), "quarantine"))
    for window in lake[1]:
        row = status[window.job_id]
        if window.status is not None:
            assert row["status"] == window.status, (window, row)
        if window.reason_code is not None and window.status != "discarded":
            codes = {q["reason_code"] for q in quarantine.get(window.job_id, [])}
            assert window.reason_code in codes, (window, codes)
        if row["status"] == "quarantined":
            assert row["reason_code"] and row["reason"], row
            assert window.job_id in quarantine, f"quarantined {window.job_id} has no quarantine rows"
    assert summary["jobs"] == {s: sum(1 for r in status.values() if r["status"] == s) for s in ("analysed", "discarded", "quarantined")}


def test_row_level_rejections_keep_the_rows_visible(lake, fnapi_run):
    out = fnapi_run[0]
    quarantine = read_table(str(out), "quarantine").to_pylist()
    negative = [q for q in quarantine if q["job_id"] == "bad-negative-duration" and q["reason_code"] == "negative_duration"]
    assert negative and all(q["level"] == "row" and q["source_path"].endswith(".parquet") for q in negative)
    coverage = {r["job_id"]: r for r in read_table(str(out), "coverage").to_pylist()}
    assert coverage["bad-negative-duration"]["rows_quarantined"] == len(negative)


def test_job_summary_equals_the_engine_on_the_same_files(lake, fnapi_run):
    out = fnapi_run[0]
    summary = {r["job_id"]: r for r in read_table(str(out), "job_summary").to_pylist()}
    analysed = {e.job_id for e in lake[1] if e.status in ("analysed", "discarded")}
    assert analysed <= set(summary)
    for job in list_jobs(lake[0], DATES[0], DATES[-1]):
        if job.job_id not in analysed:
            continue
        manifest = read_manifest(job.manifest_path)
        result = analyze_job(read_trace_files(job.trace_files), job_meta(manifest), job.job_id)
        row = summary[job.job_id]
        assert row["slowdown"] == result.slowdown and row["launch_slowdown"] == result.launch_slowdown
        assert row["discarded"] == result.discarded and row["n_steps"] == len(result.steps)
        hours = manifest["gpus"] * (manifest["end_time"] - manifest["start_time"]).total_seconds() / 3600
        assert row["gpu_hours"] == pytest.approx(hours, rel=1e-12)
        assert row["wasted_gpu_hours"] == pytest.approx(hours * (1 - 1 / result.slowdown), rel=1e-12)
    assert summary["cpu-d"]["discarded"] and "discrepancy" in summary["cpu-d"]["discard_reason"]


def test_straggling_job_has_attribution_rows_with_hosts(fnapi_run):
    out = fnapi_run[0]
    summary = {r["job_id"]: r for r in read_table(str(out), "job_summary").to_pylist()}
    assert summary["slow-b"]["attributed"] and summary["slow-b"]["slowdown"] > 1.03
    workers = [w for w in read_table(str(out), "worker_attribution").to_pylist() if w["job_id"] == "slow-b"]
    assert len(workers) == 4 and all(w["host"] for w in workers)
    worst = max(workers, key=lambda w: w["slowdown_worker"])
    assert (worst["dp_rank"], worst["stage"]) == (1, 1) and worst["in_mw_set"]
    stages = [r for r in read_table(str(out), "stage_attribution").to_pylist() if r["job_id"] == "slow-b"]
    assert {r["step"] is None for r in stages} == {True, False}  # overall rows and per-step rows
    steps = [r for r in read_table(str(out), "step_slowdown").to_pylist() if r["job_id"] == "slow-b"]
    assert len(steps) == summary["slow-b"]["n_steps"]


def test_job_summary_carries_the_verdict_of_the_job_cause_table(fnapi_run):
    out = fnapi_run[0]
    summary = {r["job_id"]: r for r in read_table(str(out), "job_summary").to_pylist()}
    causes = {r["job_id"]: r for r in read_table(str(out), "job_cause").to_pylist()}
    kept = {job for job, row in summary.items() if not row["discarded"]}
    assert set(causes) == set(summary) and kept < set(summary)   # every analysed window, discarded ones too
    assert {job: row["discarded"] for job, row in causes.items()} == {job: row["discarded"] for job, row in summary.items()}
    for job in kept:
        assert (summary[job]["cause"], summary[job]["causes"], summary[job]["cause_confidence"]) == \
            (causes[job]["cause"], causes[job]["causes"], causes[job]["confidence"])
    assert summary["slow-b"]["cause"] == "individual-worker"
    # discarded: job_summary and the fleet statistics carry no verdict; job_cause carries what the
    # trace measured, with no what-if saving of traced ops
    assert summary["cpu-d"]["cause"] is None
    measured = json.loads(causes["cpu-d"]["savings_json"])
    assert all(fix.get("measured") for fix in measured.values()) and causes["cpu-d"]["discarded"]


def test_step_slowdown_carries_the_verdict_step_by_step(fnapi_run, lake):
    """Per step: the global ranks of the blamed workers found slow in it and what the primary fix
    saves there, recomputed here from the job's own verdict (analyze_and_classify on its files)."""
    from transforms.whatif.causes import analyze_and_classify

    out = fnapi_run[0]
    job = next(j for j in list_jobs(lake[0], DATES[0], DATES[-1]) if j.job_id == "slow-b")
    manifest = read_manifest(job.manifest_path)
    _, verdict = analyze_and_classify(read_trace_files(job.trace_files), job_meta(manifest), job.job_id)
    rank = {(w["dp_rank"], w["stage"]): w["rank"] for w in manifest["workers"]}
    steps = sorted((r for r in read_table(str(out), "step_slowdown").to_pylist() if r["job_id"] == "slow-b"),
                   key=lambda r: r["step"])
    slow = verdict.slow_steps()
    assert slow and all(w in verdict.implicated_workers for w in slow)
    assert [r["slow_ranks"] for r in steps] == [sorted(rank[w] for w, s in slow.items() if i in s) for i in range(len(steps))]
    fix = verdict.primary_fix
    assert {r["fix_cause"] for r in steps} == {verdict.cause} and fix.step_savings is not None
    assert [r["fix_saving"] for r in steps] == pytest.approx(list(fix.step_savings), rel=1e-12)
    assert sum(fix.step_savings) / len(steps) == pytest.approx(
        sum(r["step_time"] for r in steps) / len(steps) - fix.step_time, rel=1e-9)   # the mean saving is the fix's
    quiet = [r for r in read_table(str(out), "step_slowdown").to_pylist() if r["job_id"] == "cpu-d"]
    assert quiet and all(r["fix_saving"] is None for r in quiet)   # discarded: no replayed fix


def test_the_run_summary_times_the_engine_s_parts_within_its_analyze_phase(fnapi_run):
    """Where the engine's seconds went (compile, METHOD's replays, causes), summed over the windows as
    the phases are: each part positive, together within "analyze" (which also holds the verdict's
    hand-over and any window the engine refused)."""
    summary = fnapi_run[1]
    seconds = summary["seconds"]
    parts = [seconds[f"analyze.{part}"] for part in ("compile", "replay", "causes")]
    assert all(part > 0 for part in parts) and sum(parts) <= seconds["analyze"]


def test_counters_match_the_quarantine_table(fnapi_run):
    out, summary, counters = fnapi_run
    quarantine = read_table(str(out), "quarantine").to_pylist()
    expected = {}
    for row in quarantine:
        expected[f"strag.quarantine/{row['reason_code']}"] = expected.get(f"strag.quarantine/{row['reason_code']}", 0) + 1
    assert {k: v for k, v in counters.items() if k.startswith("strag.quarantine/")} == expected
    assert counters["strag.jobs/quarantined"] == summary["jobs"]["quarantined"]


def test_every_date_has_a_partition_in_every_table(fnapi_run):
    out = fnapi_run[0]
    for table in BATCH_TABLES:
        assert sorted(p.parent.name for p in (out / table).glob(f"date=*/{PART_FILE}")) == [f"date={d}" for d in DATES]
    assert not (out / "_staging").exists()


def test_dask_runner_gives_identical_tables(lake, fnapi_run, tmp_path):
    distributed = pytest.importorskip("distributed")
    out = tmp_path / "out"
    with batch.local_dask_cluster(2) as cluster:   # the cluster strag batch starts without --dask-address
        with distributed.Client(cluster) as client:   # its workers keep glibc's dynamic mmap threshold, no profiler
            assert set(client.run(os.environ.get, "MALLOC_TRIM_THRESHOLD_").values()) == {None}
            assert set(client.run(_dask_profiler_enabled).values()) == {False}
        summary, counters = _run(_argv(lake[0], str(out), "--runner", "DaskRunner", "--dask-address", cluster.scheduler_address,
                                       "--timelines"))
    assert counters == {}  # the Dask runner has no metrics: the summary travels in the elements
    assert summary["jobs"] == fnapi_run[1]["jobs"] and summary["ops"] == fnapi_run[1]["ops"]
    assert _table_files(out) == _table_files(fnapi_run[0])
    assert _timeline_files(out) == _timeline_files(fnapi_run[0])


def _dask_profiler_enabled() -> bool:
    import dask

    return dask.config.get("distributed.worker.profile.enabled")


def test_s3_lake_and_output_give_identical_tables(lake, fnapi_run, moto_s3):
    fs = moto_s3.filesystem()
    fs.put(lake[0], f"{moto_s3.bucket}/lake", recursive=True)
    out = moto_s3.url("out")
    summary, _ = _run(_argv(moto_s3.url("lake"), out, "--workers", "2", "--timelines"))
    assert summary["jobs"] == fnapi_run[1]["jobs"]
    root = f"{moto_s3.bucket}/out"
    published = {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(root) if p.endswith(".parquet") and "/_" not in p[len(root):]}
    _same_tables_elsewhere(published, fnapi_run[0], moto_s3.url("lake"), lake[0])
    assert read_table(out, "job_summary").num_rows == read_table(str(fnapi_run[0]), "job_summary").num_rows
    timelines = {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(f"{root}/{TIMELINES_DIR}")}
    assert timelines == _timeline_files(fnapi_run[0])
    # a rerun without --timelines takes the range's timelines away on the object store too
    _run(_argv(moto_s3.url("lake"), out, "--workers", "2"))
    fs.invalidate_cache()
    assert fs.find(f"{root}/{TIMELINES_DIR}") == []


def test_memory_urls_run_in_process_and_give_identical_tables(lake, fnapi_run):
    import fsspec

    memory = fsspec.filesystem("memory")
    lake_url, out_url = "memory://batch-test/lake", "memory://batch-test/out"
    memory.put(lake[0], "/batch-test/lake", recursive=True)
    try:
        opts = batch.parse(_argv(lake_url, out_url))
        assert opts.running_mode == "in_memory"
        _run(_argv(lake_url, out_url))
        published = {p[len("/batch-test/out/"):]: memory.cat_file(p) for p in memory.find("/batch-test/out")
                     if p.endswith(".parquet") and "/_" not in p}
        _same_tables_elsewhere(published, fnapi_run[0], lake_url, lake[0])
    finally:
        memory.rm("/batch-test", recursive=True)


def test_kill_during_publish_leaves_whole_partitions_and_a_rerun_is_byte_identical(lake, fnapi_run, tmp_path):
    """The output starts with other, whole content in every partition (an earlier run's
    tables, here empty ones); a run is killed (SIGKILL to its process group) after it
    published 3 partitions; every visible file is then wholly old or wholly new; a rerun
    converges to exactly the bytes of the first run (so reruns are byte-identical)."""
    out = tmp_path / "out"
    new = _table_files(fnapi_run[0])
    for path in new:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        spec = {**BATCH_TABLES, **FLEET_TABLE_SPECS}[path.split("/")[0]]
        (out / path).write_bytes(parquet_bytes(spec.schema.empty_table()))
    old = _table_files(out)

    env = dict(os.environ, **{CRASH_ENV: "publish:3"})
    command = [sys.executable, "-m", "pipelines.cli", "batch", *_argv(lake[0], str(out), "--workers", "2", "--quiet")]
    process = subprocess.run(command, cwd=ROOT, env=env, start_new_session=True, capture_output=True, timeout=600)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-2000:]

    torn = _table_files(out)
    assert set(torn) == set(new)
    state = {path: ("old" if data == old[path] else "new" if data == new[path] else "torn") for path, data in torn.items()}
    # partitions are published in (table, date) order: the first 3 are new, the rest still old
    changed = sorted(path for path in new if new[path] != old[path])
    assert changed[:3] == sorted(new)[:3], "the first published partitions must hold rows for this check"
    assert [state[path] for path in changed] == ["new"] * 3 + ["old"] * (len(changed) - 3), state
    for path in torn:
        pq.read_table(out / path)  # whole, readable files
    assert any((out / "_staging").iterdir())  # the killed run's staging is left behind, unpublished

    _run(_argv(lake[0], str(out), "--running-mode", "in_memory", "--workers", "1"))
    assert _table_files(out) == new
    assert not (out / "_staging").exists()


def test_parse_refuses_what_cannot_work(lake, tmp_path):
    with pytest.raises(batch.BatchUsageError, match="reversed"):
        batch.parse(["--lake", lake[0], "--from", DATES[1], "--to", DATES[0], "--out", str(tmp_path)])
    with pytest.raises(batch.BatchUsageError, match="no lake there"):
        batch.parse(_argv(str(tmp_path / "typo"), str(tmp_path / "out")))
    with pytest.raises(batch.BatchUsageError, match="memory:// lives inside one process"):
        batch.parse(_argv("memory://x/lake", str(tmp_path / "out"), "--runner", "DaskRunner"))
    with pytest.raises(batch.BatchUsageError, match="--running-mode in_memory"):
        batch.parse(_argv(lake[0], "memory://x/out", "--running-mode", "multi_processing"))
    with pytest.raises(batch.BatchUsageError, match="Prism"):
        batch.parse(_argv(lake[0], str(tmp_path / "out"), "--runner", "DirectRunner"))


def test_window_groups_and_dask_partitions_follow_the_workers(lake, tmp_path):
    opts = batch.parse(_argv(lake[0], str(tmp_path / "out"), "--workers", "2"))
    # up to MAX_GROUP windows a group, a multiple of the workers, at least 4 groups each
    assert [batch.window_groups(opts, n) for n in (0, 5, 20, 600)] == [0, 5, 8, 38]
    assert batch.window_groups(batch.parse(_argv(lake[0], str(tmp_path / "out"), "--group", "10")), 600) == 60
    dask = batch.parse(_argv(lake[0], str(tmp_path / "out"), "--runner", "DaskRunner", "--workers", "2"))
    assert dask.dask_partitions == 8 and batch.dask_chunk(opts, 38) is None
    # on Dask a multiple of the partitions, so every partition takes as many groups (of equal bytes)
    assert [batch.window_groups(dask, n) for n in (5, 20, 100, 600)] == [5, 8, 8, 40]
    assert batch.dask_chunk(dask, 80) == 10 and batch.dask_chunk(dask, 16) == 2
    with pytest.raises(batch.BatchUsageError, match="--group 0"):
        batch.parse(_argv(lake[0], str(tmp_path / "out"), "--group", "0"))


def test_a_second_terminal_step_is_refused(lake, tmp_path):
    opts = batch.parse(_argv(lake[0], str(tmp_path / "out")))
    p = beam.Pipeline()
    batch.build(p, opts)  # one terminal step: fine
    _ = p | "StraySink" >> beam.Create([1]) | "Print" >> beam.Map(print)
    with pytest.raises(ValueError, match="terminal steps"):
        batch.check_single_terminal_step(p)
