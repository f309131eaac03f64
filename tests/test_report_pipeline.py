"""End to end on a small generated lake: `strag batch --timelines` writes verdicts and fleet
tables that agree with its per-job tables and the timeline of every straggling kept window (the
analysis's own ideal replay), reruns replace them, and `strag report` links them."""
from __future__ import annotations

import gzip
import html
import json
import re
import shutil

import pyarrow.compute as pc
import pytest

from batch_lake import DATES, write_batch_lake
from pipelines import batch, report
from schemas.fleet import rollup_table
from schemas.tables import TIMELINES_DIR, read_table, timeline_path

pytestmark = pytest.mark.slow


def run_batch(lake: str, out, *extra: str) -> None:
    opts = batch.parse(["--lake", lake, "--from", DATES[0], "--to", DATES[-1], "--out", str(out), "--running-mode", "in_memory",
                        "--workers", "1", "--quiet", *extra])
    p = batch.make_pipeline(opts)
    batch.build(p, opts)
    p.run().wait_until_finish()


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    lake, out = str(root / "lake"), root / "out"
    write_batch_lake(lake)
    run_batch(lake, out, "--timelines")
    return lake, out


def _straggling_windows(out) -> set[tuple[str, str]]:
    rows = read_table(str(out), "job_summary").to_pylist()
    return {(str(r["date"]), r["job_id"]) for r in rows if r["straggling"] and not r["discarded"]}


def _timeline_files(out) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / TIMELINES_DIR).rglob("*")) if p.is_file()}


def test_every_kept_window_has_a_verdict_consistent_with_its_summary(tables):
    _, out = tables
    summary = {(r["date"], r["job_id"]): r for r in read_table(str(out), "job_summary").to_pylist()}
    causes = {(r["date"], r["job_id"]): r for r in read_table(str(out), "job_cause").to_pylist()}
    kept = {key for key, row in summary.items() if not row["discarded"]}
    assert set(causes) == set(summary) and kept   # discarded windows carry their measured verdict, flagged
    for key, verdict in causes.items():
        assert verdict["discarded"] == summary[key]["discarded"]
        assert verdict["slowdown"] == summary[key]["slowdown"]
        if key in kept:
            assert (verdict["cause"] != "none") == summary[key]["straggling"], key
        assert verdict["causes"] == [] or verdict["causes"][0] == verdict["cause"]


def test_fleet_rollups_agree_with_the_per_job_tables(tables):
    _, out = tables
    coverage = read_table(str(out), "coverage").to_pylist()
    summary = [r for r in read_table(str(out), rollup_table("fleet_summary")).to_pylist() if r["period"] == "all"][0]
    assert summary["jobs"] == len(coverage)
    assert summary["jobs_quarantined"] == sum(r["status"] == "quarantined" for r in coverage)
    kept = [r for r in read_table(str(out), "job_summary").to_pylist() if not r["discarded"]]
    assert summary["jobs_analysed"] == len(kept)
    assert summary["gpu_hours"] == pytest.approx(sum(r["gpu_hours"] for r in kept), rel=1e-6)
    assert summary["wasted_gpu_hours"] == pytest.approx(sum(r["wasted_gpu_hours"] for r in kept), rel=1e-5)
    rolled = {(r["status"], r["reason"]): r["jobs"] for r in read_table(str(out), rollup_table("fleet_coverage")).to_pylist() if r["period"] == "all"}
    expected: dict = {}
    for row in coverage:
        key = (row["status"], "" if row["status"] == "analysed" else (row["reason_code"] or ""))
        expected[key] = expected.get(key, 0) + 1
    assert rolled == expected
    daily = read_table(str(out), "fleet_summary")
    assert sorted(str(d) for d in daily["date"].to_pylist()) == list(DATES)


def test_timelines_are_the_straggling_windows_ideal_replay(tables):
    from transforms.io.lake import find_job, read_manifest, read_validated_job
    from transforms.validation import Validator
    from transforms.whatif import JobMeta, compile_job
    from transforms.whatif.timeline import chrome_trace_bytes, first_steps, ideal_timeline

    lake, out = tables
    straggling = _straggling_windows(out)
    files = _timeline_files(out)
    assert straggling and set(files) == {timeline_path(date, job_id) for date, job_id in straggling}
    validator = Validator()
    for date, job_id in sorted(straggling):
        # the same rows replayed again, the ideal only: the same bytes as the batch's own replay wrote
        job = find_job(lake, job_id, date)
        model = compile_job(read_validated_job(job, validator).valid, JobMeta.from_mapping(read_manifest(job.manifest_path)), job_id)
        timeline = ideal_timeline(model)
        assert files[timeline_path(date, job_id)] == chrome_trace_bytes(timeline, first_steps(timeline)), (date, job_id)


def test_reruns_replace_the_timelines_of_their_dates(tables, tmp_path):
    lake, out = tables
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    stale = copy / timeline_path(DATES[0], "no-such-job")
    stale.write_bytes(b"left by an older run")
    run_batch(lake, copy, "--timelines")
    assert _timeline_files(copy) == _timeline_files(out), "a rerun writes the same bytes and drops the stale file"
    run_batch(lake, copy)
    assert not (copy / TIMELINES_DIR).exists() or not _timeline_files(copy), "a run without --timelines leaves none of its dates"


def test_report_links_each_straggling_job_page_to_its_perfetto_timeline(tables, tmp_path):
    _, out = tables
    target = tmp_path / "report"
    assert report.run(["--tables", str(out), "--out", str(target), "--jobs", "all", "--images", "none"]) == 0
    pages = sorted((target / "jobs").glob("*.html"))
    straggling = _straggling_windows(out)
    assert len(pages) > len(straggling)
    steps_table = read_table(str(out), "step_slowdown")
    linked = set()
    for page in pages:
        text = page.read_text()
        link = re.search(r'href="(\.\./timelines/[^"]+\.json\.gz)"', text)
        if link is None:
            assert "strag batch --timelines" in text, page.name
            continue
        trace = json.loads(gzip.decompress((page.parent / link.group(1)).read_bytes()))
        assert trace["traceEvents"] and {e["ph"] for e in trace["traceEvents"]} >= {"X", "M"}
        # the timeline's ideal step times are the batch's (step_slowdown table)
        job_id = trace["otherData"]["job_id"]
        linked.add(job_id)
        ideal = {e["args"]["step"]: e["args"]["step_time_s"] for e in trace["traceEvents"]
                 if e.get("cat") == "step" and e["args"]["version"] == "ideal"}
        steps = steps_table.filter(pc.equal(steps_table["job_id"], job_id)).to_pylist()
        assert ideal and {row["step"]: row["step_time_ideal"] for row in steps if row["step"] in ideal} == pytest.approx(ideal, rel=1e-12)
    assert linked == {job_id for _, job_id in straggling}


def test_windows_cut_by_max_jobs_are_counted_as_such(tables, tmp_path, capsys):
    """--max-jobs cuts the straggling windows' pages: the command says those windows have no page
    because of the cut, not only because they are not straggling or discarded."""
    from pipelines import cli

    _, out = tables
    straggling = _straggling_windows(out)
    assert len(straggling) >= 2
    assert cli.main(["report", "--tables", str(out), "--out", str(tmp_path / "r"), "--images", "none", "--max-jobs", "1"]) == 0
    said = capsys.readouterr().out
    assert "job pages:    1 under" in said and ", or beyond --max-jobs 1) have no page" in said
    assert cli.main(["report", "--tables", str(out), "--out", str(tmp_path / "all"), "--images", "none"]) == 0
    assert "beyond --max-jobs" not in capsys.readouterr().out


def test_a_cpu_ddp_fleet_is_reported_in_rank_hours_with_ddps_all_reduce_by_its_name(tmp_path, capsys):
    """Real torch.profiler runs on CPU ranks (gloo), landed and analysed as a user would: the report
    counted their ranks as GPUs ("0 of 0 GPU-hours") and called DDP's all-reduce grads-reduce-scatter.
    The tables keep the reference analyzer's op type and record what the trace showed."""
    import pathlib

    from pipelines import cli

    runs = pathlib.Path(__file__).parent / "data" / "real_runs"
    lake, out, pages = tmp_path / "lake", tmp_path / "tables", tmp_path / "report"
    for job in ("allreduce-r1-dp4-ddp-mlp-cpu", "split-gpipe-pp4-mlp-sleep"):
        assert cli.main(["land", str(runs / job), "--lake", str(lake), "--job-id", job, "--date", "2026-11-20"]) == 0
    assert cli.main(["batch", "--lake", str(lake), "--from", "2026-11-20", "--to", "2026-11-20", "--out", str(out),
                     "--quiet"]) == 0
    assert cli.main(["report", "--tables", str(out), "--out", str(pages), "--images", "none"]) == 0
    capsys.readouterr()
    rows = {r["job_id"]: r for r in read_table(str(out), "job_summary").to_pylist()}
    assert {job: (r["device"], r["grads_collective"]) for job, r in rows.items()} == {
        "allreduce-r1-dp4-ddp-mlp-cpu": ("cpu", "all_reduce"), "split-gpipe-pp4-mlp-sleep": ("cpu", None)}
    optypes = read_table(str(out), "optype_attribution").to_pylist()
    assert any(r["optype"] == "grads-reduce-scatter" for r in optypes if r["job_id"].startswith("allreduce"))

    def text(path) -> str:
        return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", path.read_text()))

    fleet = text(pages / "index.html")
    assert "CPU rank-hours wasted" in fleet and "GPU-hours" not in fleet and " 0 of 0 " not in fleet
    assert re.search(r"0\.\d+ of 0\.\d+ CPU rank-hours", fleet)
    ddp = pages / "jobs" / "2026-11-20_allreduce-r1-dp4-ddp-mlp-cpu.html"
    page = ddp.read_text()
    assert "4 CPU ranks" in text(ddp) and "GPU-h" not in text(ddp)
    specs = json.loads(re.search(r"const stragSpecs = (\{.*?\});\n", page, re.S).group(1).replace("<\\/", "</"))
    names = {row.get("optype") for spec in specs.values() for rows in spec.get("datasets", {}).values() for row in rows}
    assert "grads-all-reduce" in names and "grads-reduce-scatter" not in names
    assert "grads-all-reduce: DDP's gradient all-reduce (op type grads-reduce-scatter in the tables" in html.unescape(page)


def _land_batch_report(run_name: str, job_id: str, tmp_path, capsys):
    """A committed real-stack run landed as job_id on 2026-11-20, through `strag batch` and
    `strag report`, as a user runs them: (tables folder, report folder)."""
    import pathlib

    from pipelines import cli

    run = pathlib.Path(__file__).parent / "data" / "real_stacks" / run_name
    lake, out, pages = tmp_path / "lake", tmp_path / "tables", tmp_path / "report"
    assert cli.main(["land", str(run), "--lake", str(lake), "--job-id", job_id, "--date", "2026-11-20"]) == 0
    assert cli.main(["batch", "--lake", str(lake), "--from", "2026-11-20", "--to", "2026-11-20", "--out", str(out),
                     "--quiet"]) == 0
    assert cli.main(["report", "--tables", str(out), "--out", str(pages), "--images", "none"]) == 0
    capsys.readouterr()
    return out, pages


def test_a_lake_whose_only_window_is_discarded_still_gets_its_report(tmp_path, capsys):
    """A real FSDP2 pipeline run whose replay is 10% off (discarded): `strag report` failed with
    "min() arg is an empty sequence" (no kept window: the trend chart had no share to draw). It now
    draws the report, says the trend has no analysed window, says why the window got no page and
    how to get one; --jobs all gives it its page."""
    from pipelines import cli

    out, pages = _land_batch_report("pipe-clean-izb-pp2dp2-fsdp2-s0", "only-discarded", tmp_path, capsys)
    [row] = read_table(str(out), "job_summary").to_pylist()
    assert row["discarded"]
    index = html.unescape((pages / "index.html").read_text())
    assert "no job window was analysed and kept: every one was discarded or quarantined" in index
    assert "no window analysed and kept; paper" in index and " 0 of 0 " not in index
    assert "Jobs: no window was analysed and kept, and none has a page" in index
    assert cli.main(["report", "--tables", str(out), "--out", str(tmp_path / "again"), "--images", "none"]) == 0
    said = capsys.readouterr().out
    assert "job pages:    0 under" in said and "1 other window(s) (not straggling, or discarded" in said and "--jobs all" in said
    assert cli.main(["report", "--tables", str(out), "--out", str(tmp_path / "all"), "--images", "none", "--jobs", "all"]) == 0
    assert "other window" not in capsys.readouterr().out
    assert (tmp_path / "all" / "jobs" / "2026-11-20_only-discarded.html").exists()
    linked = html.unescape((tmp_path / "all" / "index.html").read_text())   # the page is reachable from the report
    assert 'href="jobs/2026-11-20_only-discarded.html"' in linked and f"{row['slowdown']:.3f} (discarded)" in linked
    [verdict] = read_table(str(out), "job_cause").to_pylist()   # what the trace measured, on its page
    assert verdict["discarded"] and verdict["fixed_slowdown"] is None
    page = html.unescape((tmp_path / "all" / "jobs" / "2026-11-20_only-discarded.html").read_text())
    assert "no verdict (discarded window)" not in page and "The replay does not match the trace" in page
    assert "from a replay off by more than 5%: not trustworthy" in page and "S >= 1.1: straggling" not in page


def test_methods_figures_stand_beside_the_models(tmp_path, capsys):
    """A real Accelerate run whose rank 1 waits ~300 ms per batch on its DataLoader: METHOD.md section 3
    replays it without that untraced time and would discard it (its no-delay replay is far off); the
    model gives rank 1's untraced time back and keeps it. The tables carry both S and which rule kept
    the window; the fleet coverage counts it; the report and the job page show both figures."""
    from transforms.whatif.result import discrepancy_discards

    out, pages = _land_batch_report("accelerate-data-r1-gpt2-padded", "data-wait", tmp_path, capsys)
    [row] = read_table(str(out), "job_summary").to_pylist()
    assert discrepancy_discards(row["launch_slowdown"]) and not row["discarded"]
    assert (row["discarded_method"], row["kept_by"]) == (True, "untraced-model")
    assert row["slowdown_method"] != pytest.approx(row["slowdown"], rel=1e-3)
    [coverage] = read_table(str(out), "coverage").to_pylist()
    assert (coverage["status"], coverage["kept_by"]) == ("analysed", "untraced-model")
    fleet = [r for r in read_table(str(out), "fleet_coverage").to_pylist() if r["status"] == "analysed"]
    assert sum(r["kept_by_model"] for r in fleet) == 1
    assert fleet[0]["slowdown_mean"] == pytest.approx(row["slowdown"], rel=1e-6)
    assert fleet[0]["slowdown_method_mean"] == pytest.approx(row["slowdown_method"], rel=1e-6)
    index = html.unescape((pages / "index.html").read_text())
    assert "1 of the 1 analysed windows are kept by the model (named workers" in index
    assert f"METHOD.md's {row['slowdown_method']:.3f}" in index
    job = html.unescape((pages / "jobs" / "2026-11-20_data-wait.html").read_text())
    assert f"METHOD.md's S (no untraced time modelled) {row['slowdown_method']:.3f}" in job
    assert "METHOD.md would discard this window" in job


def test_a_window_kept_by_carried_arrivals_says_so_in_the_tables(tmp_path, capsys):
    """A clean Lightning DDP run on CPU ranks: METHOD's replay is 6.7% short of what ran (ranks end
    a step apart and METHOD starts them together), the replay with each rank's carried arrival is
    within 5%. job_summary and coverage say which rule kept it, S is METHOD's, the fleet coverage
    counts it among the windows only the model keeps."""
    out, pages = _land_batch_report("lightning-clean-mlp-callback-s0-gcrec", "arrivals", tmp_path, capsys)
    [row] = read_table(str(out), "job_summary").to_pylist()
    assert row["launch_slowdown"] > 1.05 and 1.0 < row["replay_discrepancy"] < 1.05 and not row["discarded"]
    assert (row["discarded_method"], row["kept_by"]) == (True, "arrivals-model")
    assert row["slowdown_method"] == pytest.approx(row["slowdown"], rel=1e-9)
    [coverage] = read_table(str(out), "coverage").to_pylist()
    assert (coverage["status"], coverage["kept_by"]) == ("analysed", "arrivals-model")
    fleet = [r for r in read_table(str(out), "fleet_coverage").to_pylist() if r["status"] == "analysed"]
    assert sum(r["kept_by_model"] for r in fleet) == 1
    index = html.unescape((pages / "index.html").read_text())
    assert "1 of the 1 analysed windows are kept by the model" in index and "previous step" in index
    # S 1.05, no job page of its own: the page's evidence line for such a row
    import types

    from dashboards.job_page import _discrepancy_number

    name, value, note = _discrepancy_number(types.SimpleNamespace(**row))
    assert value == f"{100 * (row['replay_discrepancy'] - 1):.1f}%" and note.startswith("within 5%: kept")
    assert "each rank starts a step as late as it finished the previous one" in note
    assert f"METHOD.md's replay starts them together: {100 * (row['launch_slowdown'] - 1):.1f}%" in note
