"""End to end on a small generated lake: `strag batch` writes verdicts and fleet tables that
agree with its per-job tables, and `strag report --lake` links each job page to its timeline."""
from __future__ import annotations

import gzip
import json
import re

import pyarrow.compute as pc
import pytest

from batch_lake import DATES, write_batch_lake
from pipelines import batch, report
from schemas.fleet import rollup_table
from schemas.tables import read_table

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    lake, out = str(root / "lake"), root / "out"
    write_batch_lake(lake)
    opts = batch.parse(["--lake", lake, "--from", DATES[0], "--to", DATES[-1], "--out", str(out), "--running-mode", "in_memory",
                        "--workers", "1", "--quiet"])
    p = batch.make_pipeline(opts)
    batch.build(p, opts)
    p.run().wait_until_finish()
    return lake, out


def test_every_kept_window_has_a_verdict_consistent_with_its_summary(tables):
    _, out = tables
    summary = {(r["date"], r["job_id"]): r for r in read_table(str(out), "job_summary").to_pylist()}
    causes = {(r["date"], r["job_id"]): r for r in read_table(str(out), "job_cause").to_pylist()}
    kept = {key for key, row in summary.items() if not row["discarded"]}
    assert set(causes) == kept and kept
    for key, verdict in causes.items():
        assert verdict["slowdown"] == summary[key]["slowdown"]
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


def test_report_links_each_job_page_to_its_perfetto_timeline(tables, tmp_path):
    lake, out = tables
    target = tmp_path / "report"
    assert report.run(["--tables", str(out), "--out", str(target), "--jobs", "all", "--images", "none", "--lake", lake]) == 0
    pages = sorted((target / "jobs").glob("*.html"))
    assert pages
    steps_table = read_table(str(out), "step_slowdown")
    for page in pages:
        link = re.search(r'href="(\.\./timelines/[^"]+\.json\.gz)"', page.read_text())
        assert link, page.name
        trace = json.loads(gzip.decompress((page.parent / link.group(1)).read_bytes()))
        assert trace["traceEvents"] and {e["ph"] for e in trace["traceEvents"]} >= {"X", "M"}
        # the report's one ideal replay reproduces the batch's ideal step times (step_slowdown table)
        job_id = trace["otherData"]["job_id"]
        ideal = {e["args"]["step"]: e["args"]["step_time_s"] for e in trace["traceEvents"]
                 if e.get("cat") == "step" and e["args"]["version"] == "ideal"}
        steps = steps_table.filter(pc.equal(steps_table["job_id"], job_id)).to_pylist()
        assert ideal and {row["step"]: row["step_time_ideal"] for row in steps if row["step"] in ideal} == pytest.approx(ideal, rel=1e-12)
