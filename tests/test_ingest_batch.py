"""`strag batch` over a lake that holds only raw profiler uploads (schemas/raw.py).

The lake: the real torch.profiler runs (tests/data/real_traces/) as kineto windows, the published
ST trace as an NDTimeline window (exported here), and bad uploads: a truncated rank file, a
window missing a rank, a non-trace JSON file. One FnApiRunner run; the tables must hold the same
numbers as the plain converter + engine on the same files, every bad window must be quarantined
with its raw_* reason naming the file, and coverage must count raw windows by format.
"""
from __future__ import annotations

import pathlib
import shutil

import pyarrow.parquet as pq
import pytest

from pipelines import batch
from pipelines.reference import lake_trace_from_published, manifest_from_published
from schemas.raw import raw_dir
from schemas.tables import read_table
from transforms.ingest import convert_window
from transforms.ingest.ndtimeline import write_ndtimeline
from transforms.io.lake import list_jobs
from transforms.whatif.causes import analyze_and_classify

pytestmark = pytest.mark.slow
DATA = pathlib.Path(__file__).parent / "data" / "real_traces"
RUNS = pathlib.Path(__file__).parent / "data" / "real_runs"
DATE = "2026-11-20"


def _copy_ranks(run: str, folder: str, keep=None, data: pathlib.Path = DATA) -> list[pathlib.Path]:
    target = pathlib.Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted((data / run).glob("rank-*.json.gz")):
        if keep is None or keep(path):
            copied.append(pathlib.Path(shutil.copy(path, target)))
    return copied


@pytest.fixture(scope="module")
def raw_lake(tmp_path_factory, reference_dir):
    lake = str(tmp_path_factory.mktemp("raw") / "lake")
    _copy_ranks("pp2dp2-1f1b", raw_dir(lake, "kineto", DATE, "clean"))
    _copy_ranks("pp2dp2-1f1b-slow-sleep", raw_dir(lake, "kineto", DATE, "slowed"))
    _copy_ranks("dp4-ddp", raw_dir(lake, "kineto", DATE, "ddp"))
    broken = _copy_ranks("pp2dp2-1f1b", raw_dir(lake, "kineto", DATE, "truncated"))
    broken[2].write_bytes(broken[2].read_bytes()[:50_000])
    _copy_ranks("pp2dp2-1f1b", raw_dir(lake, "kineto", DATE, "three-ranks"), keep=lambda p: "rank-3" not in p.name)
    stray = _copy_ranks("pp2dp2-1f1b", raw_dir(lake, "kineto", DATE, "stray-json"))
    # rank 3 sleeps before each gradient all-reduce: untraced CPU time (truth.json)
    _copy_ranks("allreduce-r3-dp4-flat-mlp-sleep-ng", raw_dir(lake, "kineto", DATE, "paused"), data=RUNS)
    (stray[0].parent / "PROVENANCE.json").write_text('{"not": "a trace"}')
    published = pq.read_table(reference_dir / "trace-ST.parquet")
    import yaml

    meta = yaml.safe_load((reference_dir / "meta-ST.yaml").read_text())
    trace = lake_trace_from_published(published, "st")
    import datetime as dt

    write_ndtimeline(trace, manifest_from_published(trace, meta, "st", dt.date.fromisoformat(DATE)),
                     raw_dir(lake, "ndtimeline", DATE, "st"), "st")
    return lake


@pytest.fixture(scope="module")
def raw_run(raw_lake, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("raw-out") / "tables")
    summary, _ = batch.execute(batch.parse(["--lake", raw_lake, "--from", DATE, "--to", DATE, "--out", out,
                                            "--workers", "2", "--quiet"]))
    return out, summary


def test_raw_windows_are_listed_with_their_format(raw_lake):
    jobs = {job.job_id: job for job in list_jobs(raw_lake, DATE, DATE)}
    assert set(jobs) == {"clean", "slowed", "ddp", "truncated", "three-ranks", "stray-json", "paused", "st"}
    assert jobs["clean"].raw_format == "kineto" and len(jobs["clean"].trace_files) == 4
    assert jobs["st"].raw_format == "ndtimeline" and any(p.endswith("/job.yaml") for p in jobs["st"].trace_files)
    assert all(job.manifest_path is None for job in jobs.values())


def test_coverage_counts_every_raw_window(raw_run):
    out, summary = raw_run
    coverage = {row["job_id"]: row for row in read_table(out, "coverage").to_pylist()}
    kineto = ("clean", "slowed", "ddp", "truncated", "three-ranks", "stray-json", "paused")
    assert set(coverage) == {*kineto, "st"}
    assert {job: row["source_format"] for job, row in coverage.items()} == {**{job: "kineto" for job in kineto}, "st": "ndtimeline"}
    assert coverage["truncated"]["status"] == "quarantined" and coverage["truncated"]["reason_code"] == "raw_unreadable"
    assert coverage["three-ranks"]["reason_code"] == "raw_missing_rank"
    assert {coverage[j]["status"] for j in ("clean", "slowed", "ddp", "st", "stray-json", "paused")} <= {"analysed", "discarded"}
    fleet = read_table(out, "fleet_coverage").to_pandas()
    daily = fleet[fleet.period == "day"]
    assert daily.groupby("source_format").jobs.sum().to_dict() == {"kineto": 7, "ndtimeline": 1}
    quarantined = daily[daily.status == "quarantined"].set_index("reason").jobs.to_dict()
    assert quarantined == {"raw_missing_rank": 1, "raw_unreadable": 1}


def test_quarantine_names_the_bad_file(raw_run, raw_lake):
    out, _ = raw_run
    table = read_table(out, "quarantine").to_pylist()
    rows = {row["job_id"]: row for row in table if row["job_id"] != "truncated" or row["level"] == "file"}
    truncated = rows["truncated"]
    assert truncated["source_path"].endswith("job_id=truncated/rank-2.json.gz") and truncated["level"] == "file"
    assert "truncated" in truncated["detail"] and "rank-2.json.gz" in truncated["detail"]
    assert "ranks 3" in rows["three-ranks"]["detail"] and rows["three-ranks"]["level"] == "job"
    # a stray file is set aside (quarantined on its own) and the window goes on without it
    assert rows["stray-json"]["source_path"].endswith("PROVENANCE.json") and rows["stray-json"]["level"] == "file"
    assert rows["stray-json"]["reason_code"] == "raw_not_a_trace"
    # the truncated rank's window: the file, then the rank it leaves missing
    assert sorted(r["reason_code"] for r in table if r["job_id"] == "truncated") == ["raw_missing_rank", "raw_unreadable"]


def test_tables_equal_the_converter_and_engine_on_the_same_files(raw_run, raw_lake):
    out, _ = raw_run
    summary = {row["job_id"]: row for row in read_table(out, "job_summary").to_pylist()}
    for job in list_jobs(raw_lake, DATE, DATE):
        if job.job_id not in ("clean", "slowed", "ddp", "st", "paused"):
            continue
        converted = convert_window(job.raw_format, job.trace_files, job.job_id, DATE)
        result, verdict = analyze_and_classify(converted.trace, converted.job_meta(), job.job_id)
        row = summary[job.job_id]
        assert row["slowdown"] == pytest.approx(result.model_slowdown, rel=1e-12)
        assert row["launch_slowdown"] == pytest.approx(result.launch_slowdown, rel=1e-12)
        assert row["replay_discrepancy"] == pytest.approx(result.replay_discrepancy, rel=1e-12)
        assert row["n_ops"] == converted.trace.num_rows
        assert row["source_format"] == job.raw_format
        assert row["source"] and ("torch.profiler" in row["source"] or "NDTimeline" in row["source"])
    assert summary["slowed"]["cause"] == "python-gc"   # rank 1 sleeps in every forward: pauses, not slower ops
    workers = read_table(out, "worker_attribution").to_pandas()
    slowed = workers[workers.job_id == "slowed"].set_index(["dp_rank", "stage"])
    assert slowed.loc[(1, 0), "rank"] == 1 and bool(slowed.loc[(1, 0), "in_mw_set"])
    assert set(slowed.host) == {"vm"}


def test_a_paused_workers_untraced_time_is_modelled_and_the_window_kept(raw_run, raw_lake):
    """Rank 3 sleeps before each all-reduce: METHOD.md's no-delay replay leaves that out (what ran is
    ~60% longer, so the window would be discarded); the root-cause analysis names the worker, and
    with only its launch delays given back the replay matches what ran: the window is kept, its S
    includes the pause, and the cause is untraced-cpu on that worker."""
    out, _ = raw_run
    row = {r["job_id"]: r for r in read_table(out, "job_summary").to_pylist()}["paused"]
    assert row["launch_slowdown"] > 1.05 and abs(row["replay_discrepancy"] - 1.0) <= 0.05
    assert not row["discarded"] and row["discard_reason"] is None
    assert row["untraced_workers"] == [{"dp_rank": 3, "stage": 0}]
    assert row["cause"] == "untraced-cpu" and row["straggling"]
    # S includes the pause: T (the replay with it) over T_ideal, and more than the traced ops' S
    assert row["slowdown"] == pytest.approx(row["step_time"] / row["step_time_ideal"], rel=0.02)
    assert row["step_time"] == pytest.approx(row["step_time_observed"], rel=0.05)
    steps = read_table(out, "step_slowdown").to_pandas()
    paused = steps[steps.job_id == "paused"]
    assert (paused.step_time / paused.step_time_observed).between(1 / 1.05, 1.05).all()
    coverage = {r["job_id"]: r for r in read_table(out, "coverage").to_pylist()}
    assert coverage["paused"]["status"] == "analysed"
    # the clean and slowed windows model nobody's untraced time
    assert row["untraced_workers"] and all(row_["untraced_workers"] is None for job, row_ in
                                          {r["job_id"]: r for r in read_table(out, "job_summary").to_pylist()}.items()
                                          if job in ("clean", "slowed", "ddp", "st"))


def test_the_job_page_of_a_modelled_pause_says_whose_untraced_time_it_is(raw_run, tmp_path):
    """The report's page of the paused window: the replay discrepancy card names the worker whose
    untraced time the replay includes (and METHOD's figure without it), the evidence lists its
    untraced time in words, and the empty attribution charts say they are of the traced ops."""
    import datetime as dt

    from dashboards.data import load_report_data
    from dashboards.job_page import build_job_page

    out, _ = raw_run
    page = build_job_page(load_report_data(out), dt.date.fromisoformat(DATE), "paused", tmp_path).read_text()
    assert "the replay includes the untraced CPU time of dp 3 / stage 0 (without it: 6" in page
    assert "dp 3 / stage 0: untraced time" in page and "of the step, the replay with it" in page
    assert "the traced ops' S &lt; 1.03: no attribution computed (the slowdown is untraced CPU time)" in page \
        or "the traced ops' S < 1.03: no attribution computed (the slowdown is untraced CPU time)" in page


def test_ndtimeline_window_in_the_batch_equals_the_published_result(raw_run, reference_dir):
    import json

    out, _ = raw_run
    row = next(r for r in read_table(out, "job_summary").to_pylist() if r["job_id"] == "st")
    expected = json.loads((reference_dir / "result-ST.json").read_text())
    assert row["slowdown"] == pytest.approx(expected["blocking_slowdown"], rel=1e-6)
    assert row["launch_slowdown"] == pytest.approx(expected["launch_slowdown"], rel=1e-6)


def test_big_windows_parsed_rank_by_rank_give_the_same_tables(raw_run, raw_lake, tmp_path):
    """--fanout-ranks 4: every kineto window's ranks are parsed as elements of their own on any
    worker, grouped by window and assembled (transforms/batch/convert_raw.py); the tables must not change."""
    out, _ = raw_run
    fanned = str(tmp_path / "fanned")
    summary, _ = batch.execute(batch.parse(["--lake", raw_lake, "--from", DATE, "--to", DATE, "--out", fanned,
                                            "--workers", "2", "--quiet", "--fanout-ranks", "4"]))
    assert sum(summary["jobs"].values()) == 8
    for table in ("job_summary", "coverage", "quarantine", "worker_attribution", "step_slowdown", "fleet_coverage"):
        ours = read_table(fanned, table).to_pylist()
        theirs = read_table(out, table).to_pylist()
        assert ours == theirs, table
