"""Alert delivery (transforms/live/alerting.py): notices from alert rows, payload shapes, retries, and
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

from live_rows import fire_alert, live_row, slow_rank
from transforms.live.alerting import AlertDelivery, Deliverer, Receiver, parse_receiver, payload
from transforms.live.paging import AlertBook
from transforms.live.status import HEALTH, read_status

DEADLINE_SECONDS = 120


def alert_row(tmp_path, job="job-a", session="s0", when=1_700_000_000.0, ranks=(3,)):
    """A firing alert event as the watcher raises it (transforms/live/paging.py) for a session of `job`
    whose verdict blames `ranks`."""
    blamed = [slow_rank(rank=r, dp_rank=r % 2, stage=r // 2) for r in ranks]
    row = live_row(job, session, 1, 1.4321, "individual-worker", blamed=blamed, confidence=0.99, saving=0.3, first=when)
    row["verdict_explanation"] = "Worker dp 1 / stage 1 runs forward 1.6x slower than its DP peers."
    [alert] = AlertBook(str(tmp_path / "state"), 1.1).apply(row, when)
    return alert


def resolved_row(tmp_path, job="job-a", session="s1", when=1_700_000_500.0):
    """The resolution of `job`'s open alert by a healthy session (alert_row fired it)."""
    [alert] = AlertBook(str(tmp_path / "state"), 1.1).apply(live_row(job, session, 1, 1.02, "none", first=when), when)
    return alert


class Inbox:
    """A local webhook receiver: records (path, body) of every POST (on `port`, or a free one)."""

    def __init__(self, port: int = 0):
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

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
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


def test_payload_shapes_json_alertmanager_slack(tmp_path):
    delivery = AlertDelivery(link="http://monitor:8765", resend_seconds=60.0)
    fired = alert_row(tmp_path, job="job/a b")
    resolved = resolved_row(tmp_path, job="job/a b")

    def when(text):
        assert text.endswith("Z")
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()

    # Alertmanager: the /api/v2/alerts body is a list of alerts, one per (job, cause, ranks)
    [firing] = payload(fired, "alertmanager", delivery, now=1_700_000_010.0)
    assert set(firing) == {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}
    assert firing["labels"] == {"alertname": "StragglerSlowdown", "job_id": "job/a b", "cause": "individual-worker",
                                "ranks": "3", "fingerprint": fired["fingerprint"], "severity": "warning", "source": "strag"}
    assert all(isinstance(v, str) for v in {**firing["labels"], **firing["annotations"]}.values())
    notes = firing["annotations"]
    assert (notes["slowdown"], notes["confidence"], notes["saving"], notes["hosts"], notes["slow_steps"]) == (
        "1.432", "0.99", "0.300", "node-b", "1, 2, 3")
    assert "rank 3 (dp 1 / stage 1, host node-b): forward 1.60x its DP peers'" in notes["summary"]
    assert notes["description"].startswith("Worker dp 1 / stage 1")
    assert when(firing["startsAt"]) == 1_700_000_000.0
    assert when(firing["endsAt"]) == 1_700_000_010.0 + 4 * 60   # lapses unless posted again
    assert firing["generatorURL"] == "http://monitor:8765/job/job%2Fa%20b"
    [ended] = payload(resolved, "alertmanager", delivery)
    assert ended["labels"] == firing["labels"]                    # the same alert, now ended
    assert when(ended["endsAt"]) == 1_700_000_500.0 and when(ended["startsAt"]) == 1_700_000_000.0
    # Slack: the summary once as the notification text, then the fields a responder needs
    slack_firing, slack_resolved = payload(fired, "slack", delivery), payload(resolved, "slack", delivery)
    assert set(slack_firing) == {"text", "blocks"}
    assert "job/a b" in slack_firing["text"] and "rank 3" in slack_firing["text"] and "1.432" in slack_firing["text"]
    shown = json.dumps(slack_firing["blocks"])
    assert shown.count("forward 1.60x") == 1 and "*Ranks*\\n3" in shown and "node-b" in shown and "30% of the step" in shown
    assert "<http://monitor:8765/job/job%2Fa%20b|" in shown
    assert slack_resolved["text"].startswith(":white_check_mark: strag: resolved") and "s1 is healthy" in slack_resolved["text"]
    # JSON: who, where, how sure, what the fix saves
    body = payload(fired, "json", delivery)
    assert (body["status"], body["job_id"], body["cause"], body["ranks"], body["hosts"], body["slowdown"], body["ends_at"]) == (
        "firing", "job/a b", "individual-worker", [3], ["node-b"], 1.4321, None)
    assert body["workers"] == [slow_rank()] and (body["confidence"], body["saving"]) == (0.99, 0.3)
    done = payload(resolved, "json", delivery)
    assert done["status"] == "resolved" and done["fingerprint"] == body["fingerprint"] and done["session"] == "s0"
    assert "s1 is healthy" in done["resolved_reason"] and when(done["ends_at"]) == 1_700_000_500.0
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


def test_a_receiver_answering_500_is_retried_until_it_takes_the_alert(receiver, tmp_path):
    HEALTH.reset()
    deliverer = Deliverer(AlertDelivery(receivers=(Receiver(receiver.base + "/flaky"),), backoff_seconds=0.05))
    try:
        alert = alert_row(tmp_path)
        assert deliverer.submit(alert) and not deliverer.submit(dict(alert))   # the same event again: not re-posted
        deadline = time.time() + DEADLINE_SECONDS
        wait_for(lambda: HEALTH.snapshot()["deliveries"]["sent"] == 1, "the third post to be taken", deadline)
    finally:
        deliverer.close(timeout=10)
    bodies = receiver.bodies("/flaky")
    assert len(bodies) == 3 and all(body == bodies[0] for body in bodies)   # two 500s, then taken
    counts = HEALTH.snapshot()["deliveries"]
    assert (counts["sent"], counts["retried"], counts["failed"], counts["deduplicated"]) == (1, 2, 0, 1)


def test_a_page_outlasts_a_receiver_restart(receiver, tmp_path):
    """The receiver is down (connection refused) for longer than the old give-up time, then comes
    back on its port: the page is delivered, once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    HEALTH.reset()
    deliverer = Deliverer(AlertDelivery(receivers=(Receiver(f"http://127.0.0.1:{port}/hook"),), backoff_seconds=0.2,
                                        max_backoff_seconds=1.0, retry_seconds=60.0))
    try:
        deliverer.submit(alert_row(tmp_path))
        deadline = time.time() + DEADLINE_SECONDS
        wait_for(lambda: HEALTH.snapshot()["deliveries"]["retried"] >= 5, "retries while the receiver is down", deadline)
        back = Inbox(port=port)   # the receiver restarts
        try:
            wait_for(lambda: back.bodies("/hook"), "the page after the restart", deadline)
        finally:
            back.close()
    finally:
        deliverer.close(timeout=10)
    counts = HEALTH.snapshot()["deliveries"]
    assert (counts["sent"], counts["failed"]) == (1, 0) and counts["retried"] >= 5


def test_failing_receivers_are_counted_and_do_not_hold_the_others(receiver, tmp_path):
    """A receiver answering 500 and one refusing connections give up after their retry time (counted
    as failed, per receiver); the good receiver gets every notice meanwhile, and submit never waits."""
    HEALTH.reset()
    failing, refused = Receiver(receiver.base + "/fail"), Receiver(refused_url())
    delivery = AlertDelivery(receivers=(failing, refused, Receiver(receiver.base + "/good")), retry_seconds=0.3,
                             backoff_seconds=0.05)
    deliverer = Deliverer(delivery)
    try:
        for index in range(5):
            deliverer.submit(alert_row(tmp_path, job=f"job-{index}"))
        deadline = time.time() + DEADLINE_SECONDS
        wait_for(lambda: len(receiver.bodies("/good")) == 5, "5 notices at the good receiver", deadline)
        wait_for(lambda: HEALTH.snapshot()["deliveries"]["failed"] == 10, "10 failed deliveries", deadline)
    finally:
        deliverer.close(timeout=10)
    assert len(receiver.bodies("/fail")) >= 5 * 2   # every notice was tried again before it was given up
    counts = HEALTH.snapshot()["deliveries"]
    assert (counts["sent"], counts["failed"], counts["dropped"]) == (5, 10, 0) and counts["retried"] >= 10
    per = {(item["receiver"], item["outcome"]): item["count"] for item in HEALTH.snapshot()["receivers_deliveries"]}
    assert per[f"#1 json {failing.shown}", "failed"] == per[f"#2 json {refused.shown}", "failed"] == 5
    assert per[f"#3 json {receiver.base}/…", "sent"] == 5


def test_a_full_queue_drops_and_counts_instead_of_blocking(receiver, tmp_path):
    HEALTH.reset()
    deliverer = Deliverer(AlertDelivery(receivers=(Receiver(refused_url()),), queue_size=2, retry_seconds=30.0,
                                        backoff_seconds=5.0))
    try:
        for index in range(6):   # the worker holds at most one (backing off), the queue two: three or more dropped
            deliverer.submit(alert_row(tmp_path, job=f"job-{index}"))
        wait_for(lambda: HEALTH.snapshot()["deliveries"]["dropped"] >= 3, "dropped notices", time.time() + DEADLINE_SECONDS)
    finally:
        left = deliverer.close(timeout=0.5)
    # the two queued are dropped at the stop, the one backing off is given up: every notice counted once
    wait_for(lambda: sum(HEALTH.snapshot()["deliveries"][k] for k in ("dropped", "failed")) >= 6, "6 counted",
             time.time() + DEADLINE_SECONDS)
    counts = HEALTH.snapshot()["deliveries"]
    assert (counts["sent"], counts["dropped"] + counts["failed"]) == (0, 6)
    assert counts["dropped"] >= 3 + left and left <= 2   # 3+ at the full queue, the rest still queued at the stop


def test_alertmanager_keep_alives_come_from_the_open_alerts_and_stop_when_resolved(receiver, tmp_path):
    HEALTH.reset()
    fired = alert_row(tmp_path)
    delivery = AlertDelivery(receivers=(Receiver(receiver.base + "/am", "alertmanager"),), out=str(tmp_path / "state"),
                             resend_seconds=0.2)
    deliverer = Deliverer(delivery)
    try:
        deadline = time.time() + DEADLINE_SECONDS
        wait_for(lambda: len(receiver.bodies("/am")) >= 2, "keep-alives of the open alert", deadline)
        resolved_row(tmp_path)
        deliverer.submit(fired)
        time.sleep(0.5)   # let a keep-alive in flight land
        seen = len(receiver.bodies("/am"))
        time.sleep(1.0)   # five resend periods: nothing open, so nothing is posted
        assert len(receiver.bodies("/am")) == seen
    finally:
        deliverer.close(timeout=10)
    labels = {alert["labels"]["fingerprint"] for body in receiver.bodies("/am") for alert in body}
    assert labels == {fired["fingerprint"]}
    per = {(item["kind"], item["outcome"]): item["count"] for item in HEALTH.snapshot()["receivers_deliveries"]}
    assert per["keepalive", "sent"] >= 2 and per["alert", "sent"] == 1 and HEALTH.snapshot()["deliveries"]["sent"] == 1


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
    from transforms.live.landing import land_generated_session
    from transforms.live.tables import read_live_table

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
    [worker] = fired[0]["workers"]                       # the slowed worker, by its global rank
    assert (worker["dp_rank"], worker["stage"]) == (1, 0) and fired[0]["ranks"] == [worker["rank"]]
    assert f"rank {worker['rank']} (dp 1 / stage 0" in fired[0]["summary"] and worker["ratio"] > 1.3
    assert "session s1 is healthy" in as_json[1]["resolved_reason"] and as_json[1]["ends_at"] is not None
    assert as_json[1]["fingerprint"] == fired[0]["fingerprint"]

    alertmanager = receiver.bodies("/api/v2/alerts")
    assert all(isinstance(body, list) for body in alertmanager)
    alerts = [alert for body in alertmanager for alert in body]
    assert {alert["labels"]["job_id"] for alert in alerts} == {"flaky"}
    assert alerts[0]["labels"]["cause"] == "individual-worker" and alerts[0]["labels"]["ranks"] == str(worker["rank"])
    assert alerts[-1]["endsAt"] == as_json[1]["ends_at"]                          # resolved: ended then
    assert alerts[0]["generatorURL"] == "http://127.0.0.1:8765/job/flaky"

    slack = receiver.bodies("/slack")
    assert len(slack) == 2 and set(slack[0]) == {"text", "blocks"} and "flaky" in slack[0]["text"]
    assert slack[1]["text"].startswith(":white_check_mark:")

    status = read_status(out)
    assert status["running"] is False and status["results"] == 3
    kinds = read_live_table(out, "alerts")["kind"].to_pylist()
    assert sorted(kinds) == ["firing", "resolved"] and status["alerts"] == 1   # pages, not resolutions
    deliveries = status["deliveries"]
    # 2 notices x 3 working receivers sent; 2 notices x 2 failing receivers each failed or left at the stop
    assert deliveries["sent"] >= 6 and deliveries["failed"] + deliveries["dropped"] == 4 and deliveries["failed"] >= 1
    assert len(receiver.bodies("/fail")) >= 1

    metrics = {sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
               for family in text_string_to_metric_families(metrics_text(out).decode()) for sample in family.samples}
    assert metrics['strag_watcher_alert_deliveries_total{"outcome": "failed"}'] == deliveries["failed"]
    assert metrics['strag_watcher_sessions_analysed_total{}'] == 3 and metrics["strag_watcher_running{}"] == 0
    assert metrics['strag_job_straggling{"job_id": "flaky"}'] == 0.0   # its latest session is healthy
    assert metrics['strag_job_alerts_total{"job_id": "flaky", "kind": "firing"}'] == 1


def test_the_watchers_clock_resolves_a_silent_jobs_alert_and_posts_it(tmp_path, receiver):
    """A job paged, then landed nothing for longer than --resolve-after: the watcher's clock resolves
    its alert (a resolved row in the alerts table, the resolved notice at the webhook), once."""
    from pipelines import streaming
    from transforms.live.alerting import close_deliverers
    from transforms.live.tables import read_live_table

    lake, out = tmp_path / "lake", tmp_path / "out"
    (lake / "landing").mkdir(parents=True)
    landed = time.time() - 100
    [fired] = fire_alert(str(out), live_row("quiet", "w0", 1, 1.5, "individual-worker", first=landed,
                                            blamed=[slow_rank()]), now=landed + 1)
    options = streaming.parse(["--lake", str(lake), "--out", str(out), "--resolve-after", "30",
                               "--alert-webhook", receiver.base + "/json"])
    clock = streaming.AlertClock(options)
    try:
        [resolved] = clock.tick()
        assert clock.tick() == []                                     # resolved once
        wait_for(lambda: receiver.bodies("/json"), "the resolved notice", time.time() + DEADLINE_SECONDS)
    finally:
        close_deliverers(timeout=10)
    assert resolved["fingerprint"] == fired["fingerprint"] and "no session of the job landed for" in resolved["resolved_reason"]
    [body] = receiver.bodies("/json")
    assert (body["status"], body["ranks"], body["fingerprint"]) == ("resolved", [3], fired["fingerprint"])
    assert sorted(read_live_table(str(out), "alerts")["kind"].to_pylist()) == ["firing", "resolved"]
