"""`strag serve`: the live job page renders in headless Chromium from the live table and
follows it (its version endpoint changes when a corrected revision lands)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.request

import pytest

from dashboards import browser
from live_rows import fire_alert, land_row, live_row, slow_rank
from pipelines.serve import ServeOptions, parse, serve_in_thread

pytestmark = pytest.mark.slow


@pytest.fixture()
def served(tmp_path):
    out = str(tmp_path / "out")
    land_row(out, live_row("job-a", "s1", 1, 1.04, first=1_700_000_000.0))
    hot = live_row("job-a", "s2", 1, 1.32, first=1_700_000_100.0, verdict="individual-worker", blamed=[slow_rank()],
                   confidence=0.99, saving=0.2)
    land_row(out, hot)
    assert [a["kind"] for a in fire_alert(out, hot)] == ["firing"]
    server, thread = serve_in_thread(ServeOptions(tables=out, port=0))
    yield out, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def get(url):
    with urllib.request.urlopen(url, timeout=30) as reply:
        return reply.status, reply.read().decode()


def test_serve_binds_to_localhost_by_default(tmp_path):
    x = str(tmp_path)
    assert parse(["--tables", x]).host == "127.0.0.1"
    assert parse(["--tables", x, "--host", "::1"]).host == "::1"


def test_a_remote_host_needs_allow_remote_and_warns(capsys, tmp_path):
    x = str(tmp_path)
    with pytest.raises(SystemExit):
        parse(["--tables", x, "--host", "0.0.0.0"])
    assert "--allow-remote" in capsys.readouterr().err
    assert parse(["--tables", x, "--host", "0.0.0.0", "--allow-remote"]).allow_remote
    assert "WARNING" in capsys.readouterr().err


def test_page_and_version_follow_the_live_table(served):
    out, base = served
    status, page = get(f"{base}/job/job-a")
    assert status == 200 and "<title>Live: job-a</title>" in page and "1.320" in page and "firing" in page and "rank 3 (dp 1 / stage 1, host node-b)" in page
    _, before = get(f"{base}/api/job/job-a/version")
    land_row(out, live_row("job-a", "s2", 2, 1.05, first=1_700_000_100.0))  # a late file corrected s2
    _, after = get(f"{base}/api/job/job-a/version")
    assert json.loads(before)["version"] != json.loads(after)["version"]
    _, page = get(f"{base}/job/job-a")
    assert "1.050" in page and "1.320" not in page.split("Sessions")[0]
    _, index = get(f"{base}/")
    assert 'href="/job/job-a"' in index


def test_an_open_alert_beside_a_session_verdict_that_does_not_give_it_is_explained(served):
    """A later session whose own verdict pages nothing (undecided) while the alert fired earlier (or by
    the job's windows together) stays open: the page says the verdict is that session's alone and
    shows the open alert's message beside it."""
    out, base = served
    land_row(out, live_row("job-a", "s3", 1, 1.2, first=1_700_000_200.0, verdict="insufficient-evidence", confidence=0.9))
    _, page = get(f"{base}/job/job-a")
    assert "this session alone" in page
    assert "Open alert, not this session&#x27;s verdict (fired by session s2)" in page or \
        "Open alert, not this session's verdict (fired by session s2)" in page
    assert page.count("Open alert, not this session") == 1


def test_a_pooled_alert_of_the_latest_session_is_shown_beside_its_own_verdict():
    """A page the job's windows decided together fires with the newest session, whose own verdict
    (undecided) gives none: the page shows it beside that verdict; a superseded revision's alert is not."""
    from dashboards.live_page import live_job_page
    from schemas.live import ALERT_SCHEMA, LIVE_RESULT_SCHEMA
    from transforms.live.paging import Page, _alert_row, fingerprint
    from transforms.live.results import rows_table

    row = live_row("job-p", "w3", 1, 1.2, first=1_700_000_300.0, verdict="insufficient-evidence", confidence=0.9)
    page = Page("individual-worker", (slow_rank(),), fingerprint("job-p", "individual-worker", [3]),
                pooled="decided by 4 profiling windows together (p = 0.001)", confidence=0.999)
    alert = _alert_row(row, page, now=1_700_000_304.0, threshold=1.1)
    html = live_job_page("job-p", rows_table([row], LIVE_RESULT_SCHEMA), rows_table([alert], ALERT_SCHEMA),
                         threshold=1.1, version_href="/v", bundle_href="/b.js")
    assert "this session alone" in html and "fired by session w3" in html and "4 profiling windows together" in html
    corrected = dict(row, revision=2)
    html = live_job_page("job-p", rows_table([row, corrected], LIVE_RESULT_SCHEMA), rows_table([alert], ALERT_SCHEMA),
                         threshold=1.1, version_href="/v", bundle_href="/b.js")
    assert "this session alone" not in html and "Open alert, not this session" not in html


def _chromium_or_skip() -> None:
    """Skip without Chromium, except in CI, where `make test` installs it: its absence fails there."""
    try:
        browser.find_chromium()
    except browser.BrowserError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))


def test_live_page_renders_in_headless_chromium(served):
    _chromium_or_skip()
    _, base = served
    # The page is served over http from this machine: requests to the server are local.
    check = asyncio.run(asyncio.wait_for(browser._visit(f"{base}/job/job-a", False), 90))
    external = [url for url in check.external_requests if not url.startswith(base)]
    assert check.chart_slots == 3 and check.charts_drawn == 3 and check.marks > 0
    assert check.console_errors == [] and check.exceptions == [] and external == []


def test_an_error_answers_500_without_the_exception_text(served, monkeypatch, capsys):
    import urllib.error

    import dashboards.live_page as live_page

    def broken(*args, **kwargs):
        raise RuntimeError("secret path /etc/strag/credentials")

    monkeypatch.setattr(live_page, "live_index_page", broken)
    _, base = served
    with pytest.raises(urllib.error.HTTPError) as caught:
        get(f"{base}/")
    with caught.value as reply:
        body = reply.read().decode()
    assert caught.value.code == 500 and "internal error" in body and "secret" not in body and "RuntimeError" not in body
    assert "secret path" in capsys.readouterr().err


def test_serve_and_the_live_pages_do_not_import_beam():
    """`strag serve` only reads the live tables: loading it must not pay for Apache Beam."""
    import pathlib
    import subprocess
    import sys

    code = "import sys, pipelines.serve, dashboards.live_page; print(sorted(m for m in sys.modules if m.startswith('apache_beam'))[:3])"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                           cwd=pathlib.Path(__file__).parents[1])
    assert shown.stdout.strip() == "[]"


def test_an_unknown_job_answers_404_with_a_message_and_the_known_jobs(served):
    import urllib.error

    _, base = served
    with pytest.raises(urllib.error.HTTPError) as caught:
        get(f"{base}/job/unknown")
    with caught.value as reply:
        body = reply.read().decode()
    assert caught.value.code == 404 and caught.value.headers["Content-Type"].startswith("text/html")
    assert "No job &#x27;unknown&#x27; in the live tables" in body and 'href="/job/job-a"' in body
    assert "<style>" in body and 'http-equiv="refresh"' in body and "vega-bundle" not in body


def test_the_index_is_a_styled_page_listing_each_job(served):
    _, base = served
    status, index = get(f"{base}/")
    assert status == 200 and "<style>" in index and 'class="data"' in index and 'http-equiv="refresh"' in index
    assert 'href="/job/job-a"' in index and "1.320" in index and "vega-bundle" not in index   # no charts, no bundle
    assert re.search(r"<td>job-a</td>|>job-a</a></td><td>s2</td><td>2</td>", index)   # latest session s2 of 2


def test_sessions_are_numbered_in_landing_order_not_on_a_millisecond_time_axis(served):
    _, base = served
    _, page = get(f"{base}/job/job-a")
    specs = json.loads(re.search(r"const stragSpecs = (\{.*?\});\n", page, re.S).group(1).replace("<\\/", "</"))
    x = specs["chart-sessions"]["layer"][0]["encoding"]["x"]
    assert x["type"] == "quantitative" and x["field"] == "order" and x["axis"]["format"] == "d" and x["axis"]["tickMinStep"] == 1
    rows = [r for values in specs["chart-sessions"]["datasets"].values() for r in values if "order" in r]
    assert sorted((r["order"], r["session"]) for r in rows) == [(1, "s1"), (2, "s2")]


def test_live_index_and_404_pages_render_in_headless_chromium(served, tmp_path):
    """The pages without charts render too (styled, no console error); screenshots for the eye."""
    _chromium_or_skip()
    _, base = served
    for path in ("/", "/job/unknown"):
        check = asyncio.run(asyncio.wait_for(browser._visit(f"{base}{path}", True), 90))
        assert check.chart_slots == 0 and check.exceptions == [] and check.screenshot[:4] == b"\x89PNG"
        external = [url for url in check.external_requests if not url.startswith(base)]
        assert external == []
        # the 404 itself is logged by Chromium as a failed resource load: the only console error allowed
        assert all("404" in e for e in check.console_errors), check.console_errors
