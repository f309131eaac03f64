"""Deliver `strag watch`'s alerts to webhooks: JSON, Prometheus Alertmanager, Slack.

What pages, and when an alert resolves, is decided upstream (transforms/live/paging.py): the alerts
table receives one row per event, firing or resolved, each naming the alert's fingerprint
(job, cause, blamed ranks), its workers (global rank, dp / stage, host, slower work over DP
peers', slow steps), S, confidence and the fix's saving. Here each row becomes one post per
receiver.

Payloads (`payload`), one per event:
- json: {"version": "2", "source", "status": firing|resolved, "fingerprint", "job_id", "cause",
  "ranks", "workers", "hosts", "slowdown", "discarded", "confidence", "saving", "threshold",
  "session", "revision", "summary", "explanation", "starts_at", "ends_at", "resolved_reason",
  "resolved_by_session", "link"};
- alertmanager: the `POST /api/v2/alerts` body, a list of {labels, annotations, startsAt, endsAt,
  generatorURL}; labels {alertname: StragglerSlowdown, job_id, cause, ranks, fingerprint,
  severity, source} (one alert per fingerprint: the job's later sessions naming the same workers
  continue it); firing alerts are posted again every `resend_seconds` with endsAt 4 resends
  ahead (as Prometheus does, so Alertmanager keeps them firing and lets them lapse if the
  watcher dies), from the open alerts recorded in the output folder (so a restarted watcher
  goes on), and no longer once resolved;
- slack: an incoming-webhook body: {"text": the one-line summary (the notification), "blocks":
  the summary, then the fields (ranks, hosts, S, confidence, saving, steps) and the link}.

Delivery never holds the pipeline: the DoFn only enqueues (`Deliverer.submit`). Each receiver has
its own thread and bounded queue; a post is retried with exponential backoff (capped) and full
jitter on connection errors, timeouts, 408, 429 and 5xx for `retry_seconds` (default 300 s: a
receiver restarting for a minute or two gets the page), then given up, logged and counted; a
full queue drops the notice (counted). An event delivered once is not posted again by the same
watcher (a bundle the runner retries). Counts, per receiver and for alerts apart from
Alertmanager keep-alives, go to transforms/live/status.py HEALTH (hence `strag serve` /metrics).
HTTP: the standard library (urllib).
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import logging
import queue
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import apache_beam as beam

from transforms.live.status import HEALTH

__all__ = ["FORMATS", "Receiver", "parse_receiver", "AlertDelivery", "payload", "summary", "alertmanager_alert",
           "Deliverer", "get_deliverer", "close_deliverers", "pending_notices", "DeliverAlerts", "NoteResults"]

FORMATS = ("json", "alertmanager", "slack")
ALERT_NAME = "StragglerSlowdown"
_RETRY_STATUS = {408, 429}
_LOG = logging.getLogger("strag.watch")


@dataclasses.dataclass(frozen=True)
class Receiver:
    url: str
    format: str = "json"

    @property
    def shown(self) -> str:
        """The URL without its path and query (a Slack webhook's path is its secret)."""
        parts = urllib.parse.urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}/…" if parts.path.strip("/") or parts.query else f"{parts.scheme}://{parts.netloc}"


def parse_receiver(text: str, default_format: str = "json") -> Receiver:
    """'[FORMAT=]URL' -> Receiver; ValueError saying what is wrong."""
    fmt, url = default_format, text.strip()
    head, sep, rest = url.partition("=")
    if sep and head in FORMATS:
        fmt, url = head, rest
    elif sep and "://" not in head:
        raise ValueError(f"{text}: unknown format {head!r}; use one of {', '.join(FORMATS)} (FORMAT=URL) or a bare URL")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{text}: not an http:// or https:// URL")
    return Receiver(url, fmt)


@dataclasses.dataclass(frozen=True)
class AlertDelivery:
    """Where and how alerts are posted. link: base URL of `strag serve` (the job page is {link}/job/{job});
    out: the watcher's output folder (its open alerts, resent to Alertmanager)."""

    receivers: tuple[Receiver, ...] = ()
    link: str | None = None
    out: str | None = None
    retry_seconds: float = 300.0      # a post is retried this long, then given up
    backoff_seconds: float = 0.5      # first retry after up to this, doubling, capped at max_backoff_seconds
    max_backoff_seconds: float = 15.0
    timeout_seconds: float = 5.0      # per HTTP request
    queue_size: int = 1000            # notices waiting per receiver; beyond it they are dropped (counted)
    resend_seconds: float = 60.0      # Alertmanager: firing alerts posted again this often


def _epoch(value) -> float:
    if isinstance(value, dt.datetime):
        return value.timestamp()
    return float(value) if value is not None else time.time()


def _iso(epoch) -> str:
    return dt.datetime.fromtimestamp(_epoch(epoch), dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _number(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _job_link(delivery: AlertDelivery, job_id: str) -> str | None:
    return None if not delivery.link else f"{delivery.link.rstrip('/')}/job/{urllib.parse.quote(job_id, safe='')}"


def _ranks(alert: dict) -> str:
    return ",".join(str(r) for r in alert.get("ranks") or ()) or "-"


def _hosts(alert: dict) -> list[str]:
    return sorted({w["host"] for w in alert.get("workers") or () if w.get("host")})


def summary(alert: dict) -> str:
    """One line an on-call engineer reads first: status, job, what is wrong and where (the alert row's
    message, which transforms/live/paging.py writes so; a resolved one starts with 'resolved: ')."""
    return alert["message"]


def _event_key(alert: dict) -> tuple:
    return alert.get("fingerprint"), alert.get("session"), alert.get("revision"), alert.get("kind")


def payload(alert: dict, fmt: str, delivery: AlertDelivery, now: float | None = None) -> object:
    """The body posted for one alert event (an ALERT_SCHEMA row) in format `fmt` (JSON-serialisable)."""
    link = _job_link(delivery, alert["job_id"])
    if fmt == "json":
        return {"version": "2", "source": "strag watch", "status": alert["kind"], "fingerprint": alert.get("fingerprint"),
                "job_id": alert["job_id"], "cause": alert.get("cause"), "ranks": list(alert.get("ranks") or ()),
                "workers": [dict(w) for w in alert.get("workers") or ()], "hosts": _hosts(alert),
                "slowdown": alert.get("slowdown"), "discarded": alert.get("discarded"),
                "confidence": alert.get("confidence"), "saving": alert.get("saving"), "threshold": alert.get("threshold"),
                "session": alert.get("session"), "revision": alert.get("revision"), "summary": summary(alert),
                "explanation": alert.get("explanation"), "starts_at": _iso(alert.get("starts_at")),
                "ends_at": None if alert.get("ends_at") is None else _iso(alert["ends_at"]),
                "resolved_reason": alert.get("resolved_reason"), "resolved_by_session": alert.get("resolved_by_session"),
                "link": link}
    if fmt == "alertmanager":
        return [alertmanager_alert(alert, delivery, now)]
    if fmt == "slack":
        return _slack(alert, link)
    raise ValueError(f"unknown alert format {fmt!r}")


def _slack(alert: dict, link: str | None) -> dict:
    firing = alert["kind"] == "firing"
    line = f"{':rotating_light:' if firing else ':white_check_mark:'} strag: {summary(alert)}"
    blocks = [{"type": "section", "text": {"type": "mrkdwn", "text": line}}]
    if firing:
        steps = sorted({s for w in alert.get("workers") or () for s in w.get("steps") or ()})
        fields = [("Ranks", _ranks(alert)), ("Hosts", ", ".join(_hosts(alert)) or "-"),
                  ("S", _number(alert.get("slowdown")) + (" (replay off: not trustworthy)" if alert.get("discarded") else "")),
                  ("Confidence", _number(alert.get("confidence"), 2)),
                  ("Fix saves", "-" if alert.get("saving") is None else f"{100 * alert['saving']:.0f}% of the step"),
                  ("Slow steps", ", ".join(map(str, steps)) or "-")]
        blocks.append({"type": "section", "fields": [{"type": "mrkdwn", "text": f"*{name}*\n{value}"} for name, value in fields]})
        if alert.get("explanation"):
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": alert["explanation"]}]})
    if link:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{link}|job page of {alert['job_id']}>"}]})
    return {"text": line, "blocks": blocks}


def alertmanager_alert(alert: dict, delivery: AlertDelivery, now: float | None = None) -> dict:
    """One element of an Alertmanager /api/v2/alerts body. A firing alert lapses 4 resends ahead
    unless posted again; a resolved one ends when it was resolved."""
    now = time.time() if now is None else now
    ends = _epoch(alert["ends_at"]) if alert["kind"] == "resolved" else now + 4 * delivery.resend_seconds
    steps = sorted({s for w in alert.get("workers") or () for s in w.get("steps") or ()})
    body = {
        "labels": {"alertname": ALERT_NAME, "job_id": alert["job_id"], "cause": str(alert.get("cause")),
                   "ranks": _ranks(alert), "fingerprint": str(alert.get("fingerprint")), "severity": "warning",
                   "source": "strag"},
        "annotations": {"summary": summary(alert), "description": str(alert.get("explanation") or ""),
                        "hosts": ", ".join(_hosts(alert)), "slow_steps": ", ".join(map(str, steps)),
                        "slowdown": _number(alert.get("slowdown")), "discarded": str(bool(alert.get("discarded"))).lower(),
                        "confidence": _number(alert.get("confidence"), 2),
                        "saving": "" if alert.get("saving") is None else f"{alert['saving']:.3f}",
                        "session": str(alert.get("session")), "revision": str(alert.get("revision"))},
        "startsAt": _iso(alert.get("starts_at")),
        "endsAt": _iso(ends),
    }
    link = _job_link(delivery, alert["job_id"])
    if link:
        body["generatorURL"] = link
    return body


class _Worker:
    """One receiver: a bounded queue and a thread posting from it, with retries."""

    _STOP = object()

    def __init__(self, receiver: Receiver, delivery: AlertDelivery, position: int = 1):
        self.receiver, self._delivery = receiver, delivery
        # the metrics' name of the receiver: its place among the --alert-webhook URLs, format and URL
        # without the path (a Slack path is its secret; two receivers may differ only by path)
        self.label = f"#{position} {receiver.format} {receiver.shown}"
        self.queue: queue.Queue = queue.Queue(maxsize=delivery.queue_size)
        self._deadline: float | None = None   # set by close(): retries end then
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"strag-alerts-{receiver.shown}", daemon=True)
        self._thread.start()

    def _note(self, outcome: str, count: int = 1, kind: str = "alert") -> None:
        HEALTH.note_delivery(outcome, count, receiver=self.label, kind=kind)

    def offer(self, alert: dict) -> None:
        try:
            self.queue.put_nowait(alert)
        except queue.Full:
            self._note("dropped")
            _LOG.warning("ALERT DELIVERY %s: queue full (%d waiting), dropped %s for job %s", self.receiver.shown,
                         self.queue.qsize(), alert["kind"], alert["job_id"])

    def _loop(self) -> None:
        resend = self._delivery.resend_seconds if self.receiver.format == "alertmanager" and self._delivery.out else None
        next_resend = time.monotonic() + (resend or 0)
        while True:
            wait = 0.5 if resend is None else max(0.0, min(0.5, next_resend - time.monotonic()))
            try:
                item = self.queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is self._STOP:
                return
            if item is not None:
                self._post(payload(item, self.receiver.format, self._delivery), 1, what=f"{item['kind']} {item['job_id']}")
            if resend is not None and time.monotonic() >= next_resend and self._deadline is None:
                next_resend = time.monotonic() + resend
                self._resend()

    def _resend(self) -> None:
        """Post every open alert again (Alertmanager keep-alive), from the state in the output folder."""
        from transforms.live.paging import AlertBook

        try:
            firing = AlertBook(self._delivery.out, 1.0).open_alerts()
        except (OSError, ValueError) as error:
            _LOG.warning("ALERT DELIVERY %s: cannot read the open alerts (%s); no keep-alive this time",
                         self.receiver.shown, error)
            return
        if firing:
            now = time.time()
            self._post([alertmanager_alert(alert, self._delivery, now) for alert in firing], len(firing),
                       what=f"{len(firing)} firing alert(s) again", kind="keepalive")

    def _post(self, body: object, count: int, what: str, kind: str = "alert") -> None:
        data = json.dumps(body).encode()
        delivery = self._delivery
        error, made, started = "not tried", 0, time.monotonic()
        while True:
            if made:
                pause = random.uniform(0, min(delivery.max_backoff_seconds, delivery.backoff_seconds * 2 ** (made - 1)))
                pause = min(pause, max(0.0, started + delivery.retry_seconds - time.monotonic()))
                if self._deadline is not None:   # the watcher is stopping: retry only until its deadline
                    pause = min(pause, max(0.0, self._deadline - time.monotonic()))
                self._wake.wait(pause)
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    error += "; given up at the watcher's stop"
                    break
                if time.monotonic() - started >= delivery.retry_seconds:
                    error += f"; given up after {delivery.retry_seconds:g} s of retries"
                    break
                self._note("retried", kind=kind)
            made += 1
            request = urllib.request.Request(self.receiver.url, data=data, method="POST",
                                             headers={"Content-Type": "application/json", "User-Agent": "strag-watch"})
            try:
                with urllib.request.urlopen(request, timeout=delivery.timeout_seconds) as reply:
                    reply.read()
                self._note("sent", count, kind=kind)
                return
            except urllib.error.HTTPError as failure:
                error = f"HTTP {failure.code}"
                failure.close()
                if not (failure.code >= 500 or failure.code in _RETRY_STATUS):
                    break   # the receiver refuses this body: trying again changes nothing
            except (urllib.error.URLError, OSError, ValueError) as failure:
                reason = getattr(failure, "reason", failure)
                error = f"{type(reason).__name__}: {reason}"
        self._note("failed", count, kind=kind)
        _LOG.warning("ALERT DELIVERY %s failed (%s): %s after %d attempt(s); the watcher goes on", self.receiver.shown,
                     what, error, made)

    def close(self, deadline: float) -> int:
        """Deliver what is queued until `deadline` (monotonic), then stop; returns the notices left undelivered."""
        self._deadline = deadline
        try:
            self.queue.put(self._STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        left = 0
        if self._thread.is_alive():
            self._wake.set()   # cut a backoff pause short: that notice is given up (failed); a post in flight ends at its timeout
            while True:        # what is still queued is dropped, and counted once
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                left += item is not self._STOP
            self.queue.put_nowait(self._STOP)
            self._thread.join(timeout=0.2)
        if left:
            self._note("dropped", left)
            _LOG.warning("ALERT DELIVERY %s: %d notice(s) not delivered by the watcher's stop", self.receiver.shown, left)
        return left


class Deliverer:
    """The receivers of one watcher: hands each alert event once to each receiver's worker."""

    def __init__(self, delivery: AlertDelivery, remember: int = 100_000):
        self.delivery = delivery
        self._workers = [_Worker(receiver, delivery, i) for i, receiver in enumerate(delivery.receivers, 1)]
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._remember = remember
        self.closed = False

    def submit(self, alert: dict) -> bool:
        """Never blocks: the event is queued for the receivers' threads (False: already submitted)."""
        key = _event_key(alert)
        with self._lock:
            if key in self._seen:
                HEALTH.note_delivery("deduplicated")
                return False
            self._seen[key] = None
            while len(self._seen) > self._remember:
                self._seen.popitem(last=False)
        for worker in self._workers:
            worker.offer(alert)
        return True

    def pending(self) -> int:
        return sum(worker.queue.qsize() for worker in self._workers)

    def close(self, timeout: float = 10.0) -> int:
        self.closed = True
        deadline = time.monotonic() + timeout
        return sum(worker.close(deadline) for worker in self._workers)


_DELIVERERS: dict[AlertDelivery, Deliverer] = {}
_REGISTRY_LOCK = threading.Lock()


def get_deliverer(delivery: AlertDelivery) -> Deliverer:
    """The process's Deliverer for `delivery` (one per watcher run, shared by the DoFn's instances)."""
    with _REGISTRY_LOCK:
        deliverer = _DELIVERERS.get(delivery)
        if deliverer is None or deliverer.closed:
            deliverer = _DELIVERERS[delivery] = Deliverer(delivery)
        return deliverer


def close_deliverers(timeout: float = 10.0) -> int:
    """At the watcher's end: deliver what is queued within `timeout` seconds; returns the notices left."""
    with _REGISTRY_LOCK:
        deliverers = list(_DELIVERERS.values())
        _DELIVERERS.clear()
    deadline = time.monotonic() + timeout
    return sum(d.close(max(0.0, deadline - time.monotonic())) for d in deliverers if not d.closed)


def pending_notices() -> int:
    with _REGISTRY_LOCK:
        return sum(d.pending() for d in _DELIVERERS.values())


class _DeliverFn(beam.DoFn):
    def __init__(self, delivery: AlertDelivery):
        self._delivery = delivery

    def setup(self):
        self._deliverer = get_deliverer(self._delivery) if self._delivery.receivers else None

    def process(self, alert: dict):
        if alert["kind"] == "firing":
            HEALTH.note_alert()
        if self._deliverer is not None:
            self._deliverer.submit(alert)
        return ()


class _NoteResultFn(beam.DoFn):
    def process(self, row: dict):
        HEALTH.note_result()
        return ()


class DeliverAlerts(beam.PTransform):
    """Alert dicts (EmitLiveResults' output) -> notices queued for the webhooks; outputs nothing."""

    def __init__(self, delivery: AlertDelivery):
        super().__init__()
        self._delivery = delivery

    def expand(self, alerts):
        return alerts | "QueueNotices" >> beam.ParDo(_DeliverFn(self._delivery))


class NoteResults(beam.PTransform):
    """Live result rows -> the watcher's result count (transforms/live/status.py HEALTH)."""

    def expand(self, results):
        return results | "CountResult" >> beam.ParDo(_NoteResultFn())
