"""Alert delivery (transforms/alerting.py): notices from alert rows, payload shapes, retries, and
`strag watch --alert-webhook` end to end against a local HTTP receiver.

The receiver is a real http.server on this machine: it records every POST, answers 500 on
/fail (always) and on /flaky (the first two posts); a port nobody listens on refuses the
connection. No test asserts on time: waits poll for content with a deadline.
"""
from __future__ import annotations

import datetime as dt
import http.server
import json
import socket
import threading
import time

import pytest

from transforms.alerting import AlertDelivery, AlertRouter, Deliverer, Receiver, parse_receiver, payload
from transforms.watch_status import HEALTH, read_status

DEADLINE_SECONDS = 120


def alert_row(kind, job="job-a", session="s0", revision=1, slowdown=1.4, verdict="individual-worker",
              previous_verdict=None, when=1_700_000_000.0):
    """An alert dict as EmitLiveResults yields it (ALERT_SCHEMA fields, alert_time in epoch seconds)."""
    return {"job_id": job, "session": session, "revision": revision, "kind": kind, "slowdown": slowdown,
            "previous_slowdown": None, "threshold": 1.1, "verdict": verdict, "previous_verdict": previous_verdict,
            "message": f"job {job} session {session} r{revision}: {kind}", "alert_time": when}


class Inbox:
    """A local webhook receiver: records (path, body) of every POST."""

    def __init__(self):
        self.posts: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.flaky_left = 2
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.posts.append((self.path, body))
                    failing = self.path == "/fail" or (self.path == "/flaky" and owner.flaky_left > 0)
                    if self.path == "/flaky" and owner.flaky_left > 0:
                        owner.flaky_left -= 1
                self.send_response(500 if failing else 200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    def bodies(self, path: str) -> list:
        with self.lock:
            return [body for where, body in self.posts if where == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver():
    served = Inbox()
    yield served
    served.close()


def refused_url() -> str:
    """A local port nobody listens on: connections are refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"


def wait_for(predicate, what: str, deadline: float):
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)   # polling cadence only: assertions are on content
    raise AssertionError(f"timed out waiting for {what}")


# ----------------------------------------------------------------------- notices, no HTTP


def test_a_job_fires_once_per_session_and_cause_and_a_healthy_result_resolves_it():
    router = AlertRouter()
    above = alert_row("slowdown-above-threshold")
    [fired] = router.notices(above)
    assert (fired.status, fired.key) == ("firing", ("job-a", "s0", "individual-worker"))
    assert router.notices(dict(above)) == []                        # the same row again (a retried bundle)
    assert router.notices({**above, "revision": 2}) == []           # a later revision, same cause: still one alert
    # the cause changes while S stays above: the old cause resolves, the new one fires
    changed = alert_row("verdict-changed", session="s1", verdict="stage-imbalance", previous_verdict="individual-worker",
                        when=1_700_000_100.0)
    resolved_old, fired_new = router.notices(changed)
    assert (resolved_old.status, resolved_old.key) == ("resolved", ("job-a", "s0", "individual-worker"))
    assert (fired_new.status, fired_new.key) == ("firing", ("job-a", "s1", "stage-imbalance"))
    # a verdict change below the threshold pages nobody
    assert router.notices(alert_row("verdict-changed", session="s2", slowdown=1.02, verdict="none")) == []
    # a later healthy session resolves what is open, once
    below = alert_row("slowdown-below-threshold", session="s3", slowdown=1.01, verdict="none", when=1_700_000_300.0)
    [resolved] = router.notices(below)
    assert (resolved.status, resolved.key, resolved.ends_at) == ("resolved", ("job-a", "s1", "stage-imbalance"),
                                                                  1_700_000_300.0)
    assert resolved.starts_at == 1_700_000_100.0 and resolved.resolved_by["session"] == "s3"
    assert router.notices(below) == [] and router.open_alerts() == []
    # deduplication is by (job, session, cause): the first session's alert does not fire again
    assert router.notices(above) == []
    # other jobs are their own
    assert [n.key for n in router.notices(alert_row("slowdown-above-threshold", job="job-b"))] == [
        ("job-b", "s0", "individual-worker")]
    # S above the threshold with nothing to fix (verdict none: the job's own noise) pages nobody,
    # and a job whose cause turns into none while above has its alert resolved
    assert router.notices(alert_row("slowdown-above-threshold", job="job-c", verdict="none")) == []
    [resolved_b] = router.notices(alert_row("verdict-changed", job="job-b", session="s1", verdict="none",
                                            previous_verdict="individual-worker"))
    assert (resolved_b.status, resolved_b.key) == ("resolved", ("job-b", "s0", "individual-worker"))


def test_payload_shapes_json_alertmanager_slack():
    router = AlertRouter()
    delivery = AlertDelivery(link="http://monitor:8765", resend_seconds=60.0)
    [fired] = router.notices(alert_row("slowdown-above-threshold", job="job/a b", slowdown=1.4321))
    [resolved] = router.notices(alert_row("slowdown-below-threshold", job="job/a b", session="s1", slowdown=1.02,
                                          verdict="none", when=1_700_000_500.0))

    def when(text):
        assert text.endswith("Z")
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()

    # Alertmanager: the /api/v2/alerts body is a list of alerts
    [firing] = payload(fired, "alertmanager", delivery, now=1_700_000_010.0)
    assert set(firing) == {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}
    assert firing["labels"] == {"alertname": "StragglerSlowdown", "job_id": "job/a b", "session": "s0",
                                "cause": "individual-worker", "severity": "warning", "source": "strag"}
    assert all(isinstance(v, str) for v in {**firing["labels"], **firing["annotations"]}.values())
    assert firing["annotations"]["slowdown"] == "1.432" and "straggles" in firing["annotations"]["summary"]
    assert when(firing["startsAt"]) == 1_700_000_000.0
    assert when(firing["endsAt"]) == 1_700_000_010.0 + 4 * 60   # lapses unless posted again
    assert firing["generatorURL"] == "http://monitor:8765/job/job%2Fa%20b"
    [ended] = payload(resolved, "alertmanager", delivery)
    assert ended["labels"] == firing["labels"]                    # the same alert, now ended
    assert when(ended["endsAt"]) == 1_700_000_500.0 and when(ended["startsAt"]) == 1_700_000_000.0
    # Slack: an incoming-webhook body is {"text": ...}
    slack_firing, slack_resolved = payload(fired, "slack", delivery), payload(resolved, "slack", delivery)
    assert set(slack_firing) == {"text"} and set(slack_resolved) == {"text"}
    assert "job/a b" in slack_firing["text"] and "1.432" in slack_firing["text"] and "individual-worker" in slack_firing["text"]
    assert slack_resolved["text"].startswith(":white_check_mark: strag: resolved") and "s1" in slack_resolved["text"]
    assert "<http://monitor:8765/job/job%2Fa%20b|" in slack_firing["text"]
    # JSON: the alert's fields plus status
    body = payload(fired, "json", delivery)
    assert (body["status"], body["job_id"], body["session"], body["cause"], body["slowdown"], body["ends_at"]) == (
        "firing", "job/a b", "s0", "individual-worker", 1.4321, None)
    done = payload(resolved, "json", delivery)
    assert done["status"] == "resolved" and done["session"] == "s0" and done["resolved_by"]["session"] == "s1"
    assert when(done["ends_at"]) == 1_700_000_500.0
    json.dumps([body, done, firing, ended, slack_firing])   # all serialisable


@pytest.mark.parametrize("text, expected", [
    ("http://h:9093/api/v2/alerts", Receiver("http://h:9093/api/v2/alerts", "json")),
    ("alertmanager=http://h:9093/api/v2/alerts", Receiver("http://h:9093/api/v2/alerts", "alertmanager")),
    ("slack=https://hooks.example/services/T/B/X?a=b", Receiver("https://hooks.example/services/T/B/X?a=b", "slack")),
    ("https://h/x?token=a=b", Receiver("https://h/x?token=a=b", "json")),
])
def test_webhook_arguments(text, expected):
    assert parse_receiver(text) == expected


@pytest.mark.parametrize("text", ["ftp://h/x", "h:9093", "teams=https://h/x", "slack=", "http://"])
def test_bad_webhook_arguments_are_refused(text):
    with pytest.raises(ValueError):
        parse_receiver(text)


def test_a_slack_url_is_never_shown_whole():
    assert Receiver("https://hooks.slack.com/services/T0/B0/secret", "slack").shown == "https://hooks.slack.com/…"


# ----------------------------------------------------------------------- delivery over HTTP


def test_a_receiver_answering_500_is_retried_until_it_takes_the_alert(receiver):
    HEALTH.reset()
    deliverer = Deliverer(AlertDelivery(receivers=(Receiver(receiver.base + "/flaky"),), backoff_seconds=0.05))
    try:
        assert len(deliverer.submit(alert_row("slowdown-above-threshold"))) == 1
        deadline = time.time() + DEADLINE_SECONDS
        wait_for(lambda: HEALTH.snapshot()["deliveries"]["sent"] == 1, "the third post to be taken", deadline)
    finally:
        deliverer.close(timeout=10)
    bodies = receiver.bodies("/flaky")
    assert len(bodies) == 3 and all(body == bodies[0] for body in bodies)   # two 500s, then taken
    counts = HEALTH.snapshot()["deliveries"]
    assert (counts["sent"], counts["retried"], counts["failed"]) == (1, 2, 0)


def test_failing_receivers_are_counted_and_do_not_hold_the_others(receiver):
    """A receiver answering 500 and one refusing connections give up after their attempts (counted as
    failed); the good receiver gets every notice meanwhile, and submit never waits for any of them."""
    HEALTH.reset()
    delivery = AlertDelivery(receivers=(Receiver(receiver.base + "/fail"), Receiver(refused_url()),
                                        Receiver(receiver.base + "/good")), attempts=3, backoff_seconds=0.05)
    deliverer = Deliverer(delivery)
    try:
        for index in range(5):
            deliverer.submit(alert_row("slowdown-above-threshold", job=f"job-{index}"))
        deadline = time.time() + DEADLINE_SECONDS
        wait_for(lambda: len(receiver.bodies("/good")) == 5, "5 notices at the good receiver", deadline)
        wait_for(lambda: HEALTH.snapshot()["deliveries"]["failed"] == 10, "10 failed deliveries", deadline)
    finally:
        deliverer.close(timeout=10)
    assert len(receiver.bodies("/fail")) == 5 * 3   # every attempt reached it
    counts = HEALTH.snapshot()["deliveries"]
    assert (counts["sent"], counts["failed"], counts["retried"], counts["dropped"]) == (5, 10, 20, 0)


def test_a_full_queue_drops_and_counts_instead_of_blocking(receiver):
    HEALTH.reset()
    deliverer = Deliverer(AlertDelivery(receivers=(Receiver(refused_url()),), queue_size=2, attempts=2,
                                        backoff_seconds=5.0))
    try:
        for index in range(6):   # the worker holds at most one (backing off), the queue two: three or more dropped
            deliverer.submit(alert_row("slowdown-above-threshold", job=f"job-{index}"))
        wait_for(lambda: HEALTH.snapshot()["deliveries"]["dropped"] >= 3, "dropped notices", time.time() + DEADLINE_SECONDS)
    finally:
        left = deliverer.close(timeout=0.5)
    # the two queued are dropped at the stop, the one backing off is given up: every notice counted once
    wait_for(lambda: sum(HEALTH.snapshot()["deliveries"][k] for k in ("dropped", "failed")) >= 6, "6 counted",
             time.time() + DEADLINE_SECONDS)
    counts = HEALTH.snapshot()["deliveries"]
    assert (counts["sent"], counts["dropped"] + counts["failed"]) == (0, 6)
    assert counts["dropped"] >= 3 + left and left <= 2   # 3+ at the full queue, the rest still queued at the stop


# ----------------------------------------------------------------------- strag watch end to end


@pytest.fixture(scope="module")
def jobs():
    from transforms.synth.faults import Cause
    from transforms.synth.job import JobSpec, generate_job

    shape = dict(dp=2, pp=2, microbatches=4, steps=4, sessions=1)
    slowed = generate_job(JobSpec(job_id="flaky", seed=4, **shape,
                                  causes=(Cause("slow_worker", {"dp_rank": 1, "stage": 0, "factor": 1.6}),)))
    healed = generate_job(JobSpec(job_id="flaky", seed=5, **shape))
    clean = generate_job(JobSpec(job_id="clean", seed=3, **shape))
    return slowed, healed, clean


@pytest.mark.slow
def test_watch_posts_the_alert_of_a_slowed_session_and_resolves_it(tmp_path, receiver, jobs):
    """A real watcher with five receivers: json, alertmanager and slack ones that work, one that
    answers 500, one that refuses connections. A clean job raises nothing; a slowed session of job
    'flaky' fires once at each working receiver; a later healthy session of 'flaky' resolves it.
    The failing receivers are counted in the watcher's status, which `strag serve` /metrics shows,
    and the watcher analyses every session and exits 0."""
    from pipelines import streaming
    from pipelines.serve import metrics_text
    from prometheus_client.parser import text_string_to_metric_families
    from transforms.landing import land_generated_session
    from transforms.live_tables import read_live_table

    slowed, healed, clean = jobs
    lake, out = str(tmp_path / "lake"), str(tmp_path / "out")
    (tmp_path / "lake" / "landing").mkdir(parents=True)
    argv = ["--lake", lake, "--out", out, "--session-timeout", "5", "--poll-interval", "0.2",
            "--stop-after-sessions", "3", "--max-runtime", str(DEADLINE_SECONDS),
            "--alert-webhook", receiver.base + "/json",
            "--alert-webhook", f"alertmanager={receiver.base}/api/v2/alerts",
            "--alert-webhook", f"slack={receiver.base}/slack",
            "--alert-webhook", receiver.base + "/fail",
            "--alert-webhook", refused_url(),
            "--alert-link", "http://127.0.0.1:8765"]
    codes = []
    watcher = threading.Thread(target=lambda: codes.append(streaming.run(argv)), daemon=True)
    watcher.start()
    deadline = time.time() + DEADLINE_SECONDS

    land_generated_session(lake, clean, 0, "s0")
    land_generated_session(lake, slowed, 0, "s0")
    fired = wait_for(lambda: receiver.bodies("/json"), "the alert of flaky/s0", deadline)
    land_generated_session(lake, healed, 0, "s1")
    wait_for(lambda: len(receiver.bodies("/json")) >= 2, "the resolved notice", deadline)
    watcher.join(timeout=max(1.0, deadline - time.time()))
    assert not watcher.is_alive() and codes == [0]

    statuses = {(row["job_id"], row["session"]): row["slowdown"] for row in read_live_table(out).to_pylist()}
    assert statuses[("clean", "s0")] < 1.1 and statuses[("flaky", "s0")] >= 1.1 and statuses[("flaky", "s1")] < 1.1

    as_json = receiver.bodies("/json")
    assert [(b["status"], b["job_id"], b["session"], b["cause"]) for b in as_json] == [
        ("firing", "flaky", "s0", "individual-worker"), ("resolved", "flaky", "s0", "individual-worker")]
    assert fired[0]["slowdown"] == pytest.approx(statuses[("flaky", "s0")])
    assert as_json[1]["resolved_by"]["session"] == "s1" and as_json[1]["ends_at"] is not None

    alertmanager = receiver.bodies("/api/v2/alerts")
    assert all(isinstance(body, list) for body in alertmanager)
    alerts = [alert for body in alertmanager for alert in body]
    assert {alert["labels"]["job_id"] for alert in alerts} == {"flaky"}
    assert alerts[0]["labels"]["cause"] == "individual-worker" and alerts[0]["labels"]["session"] == "s0"
    assert alerts[-1]["endsAt"] == as_json[1]["ends_at"]                          # resolved: ended then
    assert alerts[0]["generatorURL"] == "http://127.0.0.1:8765/job/flaky"

    slack = receiver.bodies("/slack")
    assert len(slack) == 2 and set(slack[0]) == {"text"} and "flaky" in slack[0]["text"]
    assert slack[1]["text"].startswith(":white_check_mark:")

    status = read_status(out)
    assert status["running"] is False and status["results"] == 3
    assert status["alerts"] == read_live_table(out, "alerts").num_rows >= 2
    deliveries = status["deliveries"]
    # 2 notices x 3 working receivers sent; 2 notices x 2 failing receivers each failed or left at the stop
    assert deliveries["sent"] >= 6 and deliveries["failed"] + deliveries["dropped"] == 4 and deliveries["failed"] >= 1
    assert len(receiver.bodies("/fail")) >= 1

    metrics = {sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
               for family in text_string_to_metric_families(metrics_text(out).decode()) for sample in family.samples}
    assert metrics['strag_watcher_alert_deliveries_total{"outcome": "failed"}'] == deliveries["failed"]
    assert metrics['strag_watcher_sessions_analysed_total{}'] == 3 and metrics["strag_watcher_running{}"] == 0
    assert metrics['strag_job_straggling{"job_id": "flaky"}'] == 0.0   # its latest session is healthy
    assert metrics['strag_job_alerts_total{"job_id": "flaky", "kind": "slowdown-above-threshold"}'] == 1
