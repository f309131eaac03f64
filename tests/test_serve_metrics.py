"""`strag serve` /metrics: the live tables and the watcher's status in Prometheus text format,
parsed back with prometheus_client's own parser."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_rows import land_row, live_row
from pipelines.serve import ServeOptions, metrics_text, serve_in_thread
from schemas.live import ALERT_SCHEMA
from transforms.lake import write_parquet
from transforms.live import alert_path, rows_table
from transforms.watch_status import HEALTH, StatusWriter, read_status


def samples(text: bytes) -> dict[str, float]:
    return {sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
            for family in text_string_to_metric_families(text.decode()) for sample in family.samples}


@pytest.fixture()
def tables(tmp_path):
    out = str(tmp_path / "out")
    land_row(out, live_row("job-a", "s1", 1, 1.32, first=1_700_000_000.0))
    land_row(out, live_row("job-a", "s2", 1, 1.50, first=1_700_000_100.0))
    land_row(out, live_row("job-a", "s2", 2, 1.05, first=1_700_000_100.0))   # a late file corrected s2
    land_row(out, live_row("job-b", "s1", 1, 1.20, first=1_700_000_000.0))
    land_row(out, live_row("job-b", "s2", 1, 1.0, status="failed", first=1_700_000_200.0))
    alert = {"job_id": "job-a", "session": "s1", "revision": 1, "kind": "slowdown-above-threshold", "slowdown": 1.32,
             "previous_slowdown": None, "threshold": 1.1, "verdict": None, "previous_verdict": None,
             "message": "job job-a session s1 r1: S 1.320 >= threshold 1.1", "alert_time": 1_700_000_003.0}
    write_parquet(alert_path(out, alert, 1_700_000_000.0), rows_table([alert], ALERT_SCHEMA))
    return out


def test_per_job_metrics_follow_the_current_results(tables):
    values = samples(metrics_text(tables))
    assert values['strag_job_slowdown{"job_id": "job-a"}'] == pytest.approx(1.05)   # s2's current revision
    assert values['strag_job_waste{"job_id": "job-a"}'] == pytest.approx(1 - 1 / 1.05)
    assert values['strag_job_straggling{"job_id": "job-a"}'] == 0.0
    # job-b's latest session failed: S stays the last analysed one, the session is counted as failed
    assert values['strag_job_slowdown{"job_id": "job-b"}'] == pytest.approx(1.20)
    assert values['strag_job_straggling{"job_id": "job-b"}'] == 1.0
    assert values['strag_job_last_session_timestamp_seconds{"job_id": "job-b"}'] == 1_700_000_200.0
    assert values['strag_job_sessions{"job_id": "job-a", "status": "analysed"}'] == 2
    assert values['strag_job_sessions{"job_id": "job-b", "status": "failed"}'] == 1
    assert values['strag_job_alerts_total{"job_id": "job-a", "kind": "slowdown-above-threshold"}'] == 1
    assert not any(key.startswith("strag_job_alerts_total") and "job-b" in key for key in values)
    assert values["strag_watcher_status_present{}"] == 0.0   # no watcher has written a status here
    assert "strag_watcher_last_poll_age_seconds{}" not in values


def test_watcher_health_comes_from_its_status_file(tables):
    HEALTH.reset()
    HEALTH.note_poll(time.time() - 30)
    for _ in range(4):
        HEALTH.note_result()
    HEALTH.note_alert()
    HEALTH.note_delivery("sent", 2)
    HEALTH.note_delivery("failed")
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
    assert values['strag_watcher_alert_deliveries_total{"outcome": "sent"}'] == 2
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
    assert samples(body)['strag_job_slowdown{"job_id": "job-a"}'] == pytest.approx(1.05)
