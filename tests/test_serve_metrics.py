"""`strag serve` /metrics: the live tables and the watcher's status in Prometheus text format,
parsed back with prometheus_client's own parser."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_rows import fire_alert, land_row, live_row, slow_rank
from pipelines.serve import ServeOptions, metrics_text, serve_in_thread
from transforms.live.status import HEALTH, StatusWriter, read_status


def samples(text: bytes) -> dict[str, float]:
    return {sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
            for family in text_string_to_metric_families(text.decode()) for sample in family.samples}


@pytest.fixture()
def tables(tmp_path):
    out = str(tmp_path / "out")
    land_row(out, live_row("job-a", "s1", 1, 1.32, first=1_700_000_000.0, verdict="individual-worker", blamed=[slow_rank()]))
    land_row(out, live_row("job-a", "s2", 1, 1.50, first=1_700_000_100.0))
    land_row(out, live_row("job-a", "s2", 2, 1.05, first=1_700_000_100.0))   # a late file corrected s2
    land_row(out, live_row("job-b", "s1", 1, 1.20, first=1_700_000_000.0))
    land_row(out, live_row("job-b", "s2", 1, 1.0, status="failed", first=1_700_000_200.0))
    land_row(out, live_row("job-c", "s1", 1, 1.7, status="discarded", verdict="insufficient-evidence",
                           first=1_700_000_000.0))
    fire_alert(out, live_row("job-a", "s1", 1, 1.32, first=1_700_000_000.0, verdict="individual-worker", blamed=[slow_rank()]))
    return out


def test_per_job_metrics_follow_the_current_results(tables):
    values = samples(metrics_text(tables))
    assert values['strag_job_slowdown{"job_id": "job-a", "status": "analysed"}'] == pytest.approx(1.05)   # s2's current revision
    assert values['strag_job_waste{"job_id": "job-a"}'] == pytest.approx(1 - 1 / 1.05)
    assert values['strag_job_straggling{"job_id": "job-a"}'] == 0.0
    # job-b's latest session failed: S stays the last analysed one, the session is counted as failed
    assert values['strag_job_slowdown{"job_id": "job-b", "status": "analysed"}'] == pytest.approx(1.20)
    assert values['strag_job_straggling{"job_id": "job-b"}'] == 1.0
    assert values['strag_job_last_session_timestamp_seconds{"job_id": "job-b"}'] == 1_700_000_200.0
    assert values['strag_job_sessions{"job_id": "job-a", "status": "analysed"}'] == 2
    assert values['strag_job_sessions{"job_id": "job-b", "status": "failed"}'] == 1
    assert values['strag_job_alerts_total{"job_id": "job-a", "kind": "firing"}'] == 1
    assert not any(key.startswith("strag_job_alerts_total") and "job-b" in key for key in values)
    # a discarded session's S is shown with its flag, not dropped; its verdict says the trace cannot decide
    assert values['strag_job_slowdown{"job_id": "job-c", "status": "discarded"}'] == pytest.approx(1.7)
    assert 'strag_job_straggling{"job_id": "job-c"}' not in values
    assert values['strag_job_verdict{"job_id": "job-c", "status": "discarded", "verdict": "insufficient-evidence"}'] == 1.0
    assert values['strag_job_verdict{"job_id": "job-b", "status": "failed", "verdict": "no-verdict"}'] == 1.0
    assert values["strag_watcher_status_present{}"] == 0.0   # no watcher has written a status here
    assert "strag_watcher_last_poll_age_seconds{}" not in values


def test_watcher_health_comes_from_its_status_file(tables):
    HEALTH.reset()
    HEALTH.note_poll(time.time() - 30)
    for _ in range(4):
        HEALTH.note_result()
    HEALTH.note_alert()
    HEALTH.note_delivery("sent", 2, receiver="#1 alertmanager http://a:1", kind="alert")
    HEALTH.note_delivery("sent", 5, receiver="#1 alertmanager http://a:1", kind="keepalive")
    HEALTH.note_delivery("failed", receiver="#2 json http://b:2")
    writer = StatusWriter(tables, extra=lambda: {"pending_deliveries": 3}, every=3600).start()
    try:
        assert read_status(tables)["running"] is True
        values = samples(metrics_text(tables))
    finally:
        writer.stop()
    assert values["strag_watcher_status_present{}"] == 1.0 and values["strag_watcher_running{}"] == 1.0
    assert 30 <= values["strag_watcher_last_poll_age_seconds{}"] < 3600
    assert 0 <= values["strag_watcher_heartbeat_age_seconds{}"] < 3600
    assert values["strag_watcher_polls_total{}"] == 1 and values["strag_watcher_sessions_analysed_total{}"] == 4
    assert values["strag_watcher_alerts_total{}"] == 1 and values["strag_watcher_alert_deliveries_pending{}"] == 3
    assert values['strag_watcher_alert_deliveries_total{"outcome": "sent"}'] == 2   # keep-alives apart
    assert values['strag_watcher_receiver_posts_total{"kind": "keepalive", "outcome": "sent", "receiver": "#1 alertmanager http://a:1"}'] == 5
    assert values['strag_watcher_receiver_posts_total{"kind": "alert", "outcome": "failed", "receiver": "#2 json http://b:2"}'] == 1
    assert values['strag_watcher_alert_deliveries_total{"outcome": "failed"}'] == 1
    assert samples(metrics_text(tables))["strag_watcher_running{}"] == 0.0   # stop() wrote running: false


def test_the_metrics_route_answers_in_prometheus_text_format(tables):
    server, thread = serve_in_thread(ServeOptions(tables=tables, port=0))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=30) as reply:
            kind, body = reply.headers["Content-Type"], reply.read()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert kind.startswith("text/plain") and "version=" in kind
    assert samples(body)['strag_job_slowdown{"job_id": "job-a", "status": "analysed"}'] == pytest.approx(1.05)
