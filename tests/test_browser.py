"""The reports render in a real browser: headless Debian Chromium draws every chart, with no
console error and no request leaving the machine. Chromium comes from `make browser`
(a prerequisite of `make test`); outside CI a missing Chromium skips with that advice."""
from __future__ import annotations

import datetime as dt
import os
import shutil

import pytest

from dashboards.browser import BrowserError, check_page, find_chromium
from fleet_tables_fixture import START, commit_fleet, random_outcomes
from pipelines import report

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chromium():
    try:
        return find_chromium()
    except BrowserError as error:
        if os.environ.get("CI"):
            raise  # CI runs `make test`, which installs Chromium first: its absence is a failure there
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory, chromium):
    tables = tmp_path_factory.mktemp("tables")
    commit_fleet(random_outcomes(seed=5, days=3, jobs_per_day=8), tables, [(START + dt.timedelta(days=d)).isoformat() for d in range(3)])
    out = tmp_path_factory.mktemp("report")
    assert report.run(["--tables", str(tables), "--out", str(out), "--images", "none", "--max-jobs", "2"]) == 0
    return out


def test_fleet_report_renders_offline(report_dir):
    check = check_page(report_dir / "index.html")
    assert check.problems == []
    assert check.chart_slots == 11 and check.charts_drawn == 11
    assert check.ready == "11"
    assert check.marks > 200


def test_job_page_renders_with_the_shared_bundle(report_dir):
    page = sorted((report_dir / "jobs").glob("*.html"))[0]
    check = check_page(page, screenshot=report_dir / "job.png")
    assert check.problems == []
    assert check.charts_drawn == check.chart_slots == 6
    assert (report_dir / "job.png").read_bytes()[:4] == b"\x89PNG"


def test_a_broken_page_is_caught(report_dir, tmp_path):
    """The harness must fail a page whose chart errors, whose bundle is missing, or that calls out."""
    page = sorted((report_dir / "jobs").glob("*.html"))[0]
    broken = tmp_path / "jobs" / page.name
    broken.parent.mkdir()
    broken.write_text(page.read_text())  # ../assets/vega-bundle.js does not exist beside this copy
    check = check_page(broken)
    assert check.charts_drawn == 0 and any("stragReady" in p or "vegaEmbed" in p for p in check.problems)
    with pytest.raises(BrowserError, match="did not render cleanly"):
        check.raise_for_problems()

    shutil.copytree(report_dir / "assets", tmp_path / "assets")
    bad_spec = broken.read_text().replace('"mark":{"type":"rect"', '"mark":{"type":"no-such-mark"', 1)
    assert bad_spec != broken.read_text()
    broken.write_text(bad_spec.replace("</body>", '<img src="http://127.0.0.1:9/pixel.png"></body>'))
    check = check_page(broken)
    assert check.charts_drawn < check.chart_slots
    assert any("chart failed" in e for e in check.console_errors)
    assert check.external_requests == ["http://127.0.0.1:9/pixel.png"]
