"""Deliver `strag watch`'s alerts to webhooks: JSON, Prometheus Alertmanager, Slack.

The alerts table (transforms/live.py) records events: a job's S crossing the threshold
upwards or back, a verdict changing. Receivers want what an on-call engineer is paged for,
so the rows become notices (`AlertRouter`):

- firing: S crossed above the threshold (`slowdown-above-threshold`), or the verdict changed
  while S is above it; one alert per (job, session, cause), cause = the verdict;
- resolved: a later result of the job is below the threshold (`slowdown-below-threshold`:
  a later session, or a corrected revision of the same one), which resolves every open alert
  of the job; a verdict change while above resolves the job's alerts of the other causes.

A verdict change below the threshold is only recorded in the table: nothing to page for. Nor
is S above the threshold with the verdict "none" (the job's own variation, spread over every
rank and step, or noise: nobody to fix): it fires nothing and resolves what the job has open.
Deduplication: each (job, session, cause) fires at most once per watcher run and resolves at
most once, so a bundle the runner retries or a repeated row posts nothing twice.

Payloads (`payload`), one per notice:
- json: {"version", "source", "status": firing|resolved, "job_id", "session", "cause", "revision",
  "kind", "slowdown", "threshold", "verdict", "message", "starts_at", "ends_at", "resolved_by", "link"};
- alertmanager: the `POST /api/v2/alerts` body, a list of {labels, annotations, startsAt, endsAt,
  generatorURL}; labels {alertname: StragglerSlowdown, job_id, session, cause, severity, source};
  firing alerts are posted again every `resend_seconds` with endsAt 4 resends ahead (as Prometheus
  does, so Alertmanager keeps them firing and lets them lapse if the watcher dies); resolved: endsAt
  = the time of the result that resolved it;
- slack: an incoming-webhook body {"text": ...}.

Delivery never holds the pipeline: the DoFn only enqueues (`Deliverer.submit`). Each receiver has
its own thread and bounded queue; a post is retried with exponential backoff and full jitter on
connection errors, timeouts, 408, 429 and 5xx (`attempts` tries), then given up, logged and
counted; a full queue drops the notice (counted). Counts go to transforms/watch_status.py HEALTH
(hence `strag serve` /metrics). HTTP: the standard library (urllib).
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

from transforms.watch_status import HEALTH

__all__ = ["FORMATS", "Receiver", "parse_receiver", "AlertDelivery", "Notice", "AlertRouter", "payload",
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
    """Where and how alerts are posted. link: base URL of `strag serve` (the job page is {link}/job/{job})."""

    receivers: tuple[Receiver, ...] = ()
    threshold: float = 1.1
    link: str | None = None
    attempts: int = 5
    backoff_seconds: float = 0.5      # first retry after up to this, doubling, capped at max_backoff_seconds
    max_backoff_seconds: float = 30.0
    timeout_seconds: float = 5.0      # per HTTP request
    queue_size: int = 1000            # notices waiting per receiver; beyond it they are dropped (counted)
    resend_seconds: float = 60.0      # Alertmanager: firing alerts posted again this often


@dataclasses.dataclass(frozen=True)
class Notice:
    """One firing or resolved alert for (job, session, cause). alert: the alert row that raised it;
    resolved_by: the alert row whose result resolved it."""

    status: str
    job_id: str
    session: str
    cause: str
    alert: dict
    starts_at: float
    ends_at: float | None = None
    resolved_by: dict | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return self.job_id, self.session, self.cause


def _epoch(value) -> float:
    if isinstance(value, dt.datetime):
        return value.timestamp()
    return float(value) if value is not None else time.time()


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class AlertRouter:
    """Alert rows -> notices, with the open alerts per job and the deduplication (thread-safe)."""

    def __init__(self, remember: int = 100_000):
        self._lock = threading.Lock()
        self._open: dict[str, dict[tuple, Notice]] = {}
        self._seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # keys fired or resolved
        self._remember = remember

    def notices(self, alert: dict) -> list[Notice]:
        kind, job = alert["kind"], alert["job_id"]
        slowdown, threshold = alert.get("slowdown"), alert.get("threshold")
        above = slowdown is not None and threshold is not None and slowdown >= threshold
        cause = alert.get("verdict") or "unknown"
        with self._lock:
            if cause == "none" and above and kind in ("slowdown-above-threshold", "verdict-changed"):
                return self._resolve(job, alert)   # straggling by S, yet nothing to fix: nobody to page
            if kind == "slowdown-above-threshold":
                return self._fire(alert, cause)
            if kind == "verdict-changed" and above:
                return self._resolve(job, alert, keep=cause) + self._fire(alert, cause)
            if kind == "slowdown-below-threshold":
                return self._resolve(job, alert)
            return []

    def _fire(self, alert: dict, cause: str) -> list[Notice]:
        notice = Notice("firing", alert["job_id"], alert["session"], cause, alert, _epoch(alert.get("alert_time")))
        if ("firing", *notice.key) in self._seen:
            HEALTH.note_delivery("deduplicated")
            return []
        self._remember_key(("firing", *notice.key))
        self._open.setdefault(notice.job_id, {})[notice.key] = notice
        return [notice]

    def _resolve(self, job: str, alert: dict, keep: str | None = None) -> list[Notice]:
        resolved = []
        for key, notice in list(self._open.get(job, {}).items()):
            if keep is not None and notice.cause == keep:
                continue
            del self._open[job][key]
            self._remember_key(("resolved", *key))
            resolved.append(dataclasses.replace(notice, status="resolved", ends_at=_epoch(alert.get("alert_time")),
                                                resolved_by=alert))
        if job in self._open and not self._open[job]:
            del self._open[job]
        return resolved

    def _remember_key(self, key: tuple) -> None:
        self._seen[key] = None
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)

    def open_alerts(self) -> list[Notice]:
        with self._lock:
            return [notice for job in self._open.values() for notice in job.values()]


def _number(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _job_link(delivery: AlertDelivery, job_id: str) -> str | None:
    return None if not delivery.link else f"{delivery.link.rstrip('/')}/job/{urllib.parse.quote(job_id, safe='')}"


def _summary(notice: Notice) -> str:
    alert = notice.alert
    if notice.status == "firing":
        return (f"job {notice.job_id} straggles: session {notice.session} S {_number(alert.get('slowdown'))} >= "
                f"threshold {alert.get('threshold'):g}, cause {notice.cause}")
    by = notice.resolved_by or {}
    why = (f"session {by.get('session')} r{by.get('revision')} S {_number(by.get('slowdown'))} < threshold "
           f"{by.get('threshold'):g}" if by.get("kind") == "slowdown-below-threshold"
           else f"the cause is now {by.get('verdict')} (session {by.get('session')})")
    return f"resolved: job {notice.job_id} session {notice.session} cause {notice.cause}: {why}"


def payload(notice: Notice, fmt: str, delivery: AlertDelivery, now: float | None = None) -> object:
    """The body posted for one notice in format `fmt` (a JSON-serialisable object)."""
    alert, link = notice.alert, _job_link(delivery, notice.job_id)
    if fmt == "json":
        by = notice.resolved_by
        return {"version": "1", "source": "strag watch", "status": notice.status, "job_id": notice.job_id,
                "session": notice.session, "cause": notice.cause, "revision": alert.get("revision"),
                "kind": alert.get("kind"), "slowdown": alert.get("slowdown"), "threshold": alert.get("threshold"),
                "verdict": alert.get("verdict"), "message": alert.get("message"), "summary": _summary(notice),
                "starts_at": _iso(notice.starts_at), "ends_at": None if notice.ends_at is None else _iso(notice.ends_at),
                "resolved_by": None if by is None else {name: by.get(name) for name in
                                                        ("session", "revision", "kind", "slowdown", "verdict", "message")},
                "link": link}
    if fmt == "alertmanager":
        return [alertmanager_alert(notice, delivery, now)]
    if fmt == "slack":
        icon = ":rotating_light:" if notice.status == "firing" else ":white_check_mark:"
        text = f"{icon} strag: {_summary(notice)}"
        if notice.status == "firing" and alert.get("message"):
            text += f"\n{alert['message']}"
        if link:
            text += f"\n<{link}|live page of job {notice.job_id}>"
        return {"text": text}
    raise ValueError(f"unknown alert format {fmt!r}")


def alertmanager_alert(notice: Notice, delivery: AlertDelivery, now: float | None = None) -> dict:
    """One element of an Alertmanager /api/v2/alerts body. A firing alert lapses 4 resends ahead
    unless posted again; a resolved one ends when the result that resolved it was seen."""
    now = time.time() if now is None else now
    alert = notice.alert
    ends = notice.ends_at if notice.status == "resolved" else now + 4 * delivery.resend_seconds
    body = {
        "labels": {"alertname": ALERT_NAME, "job_id": notice.job_id, "session": notice.session, "cause": notice.cause,
                   "severity": "warning", "source": "strag"},
        "annotations": {"summary": _summary(notice), "description": str(alert.get("message") or ""),
                        "slowdown": _number(alert.get("slowdown")), "threshold": f"{alert.get('threshold'):g}",
                        "revision": str(alert.get("revision"))},
        "startsAt": _iso(notice.starts_at),
        "endsAt": _iso(ends),
    }
    link = _job_link(delivery, notice.job_id)
    if link:
        body["generatorURL"] = link
    return body


class _Worker:
    """One receiver: a bounded queue and a thread posting from it, with retries."""

    _STOP = object()

    def __init__(self, receiver: Receiver, delivery: AlertDelivery, router: AlertRouter):
        self.receiver, self._delivery, self._router = receiver, delivery, router
        self.queue: queue.Queue = queue.Queue(maxsize=delivery.queue_size)
        self._deadline: float | None = None   # set by close(): retries end then
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"strag-alerts-{receiver.shown}", daemon=True)
        self._thread.start()

    def offer(self, notice: Notice) -> None:
        try:
            self.queue.put_nowait(notice)
        except queue.Full:
            HEALTH.note_delivery("dropped")
            _LOG.warning("ALERT DELIVERY %s: queue full (%d waiting), dropped %s for job %s", self.receiver.shown,
                         self.queue.qsize(), notice.status, notice.job_id)

    def _loop(self) -> None:
        resend = self._delivery.resend_seconds if self.receiver.format == "alertmanager" else None
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
                self._post(payload(item, self.receiver.format, self._delivery), 1, what=f"{item.status} {item.job_id}")
            if resend is not None and time.monotonic() >= next_resend and self._deadline is None:
                next_resend = time.monotonic() + resend
                firing = self._router.open_alerts()
                if firing:
                    now = time.time()
                    self._post([alertmanager_alert(n, self._delivery, now) for n in firing], len(firing),
                               what=f"{len(firing)} firing alert(s) again")

    def _post(self, body: object, count: int, what: str) -> None:
        data = json.dumps(body).encode()
        delivery = self._delivery
        error, made = "not tried", 0
        for attempt in range(1, delivery.attempts + 1):
            if attempt > 1:
                pause = random.uniform(0, min(delivery.max_backoff_seconds, delivery.backoff_seconds * 2 ** (attempt - 2)))
                if self._deadline is not None:   # the watcher is stopping: retry only until its deadline
                    pause = min(pause, max(0.0, self._deadline - time.monotonic()))
                self._wake.wait(pause)
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    error += "; given up at the watcher's stop"
                    break
                HEALTH.note_delivery("retried")
            made = attempt
            request = urllib.request.Request(self.receiver.url, data=data, method="POST",
                                             headers={"Content-Type": "application/json", "User-Agent": "strag-watch"})
            try:
                with urllib.request.urlopen(request, timeout=delivery.timeout_seconds) as reply:
                    reply.read()
                HEALTH.note_delivery("sent", count)
                return
            except urllib.error.HTTPError as failure:
                error = f"HTTP {failure.code}"
                failure.close()
                if not (failure.code >= 500 or failure.code in _RETRY_STATUS):
                    break   # the receiver refuses this body: trying again changes nothing
            except (urllib.error.URLError, OSError, ValueError) as failure:
                reason = getattr(failure, "reason", failure)
                error = f"{type(reason).__name__}: {reason}"
        HEALTH.note_delivery("failed", count)
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
            HEALTH.note_delivery("dropped", left)
            _LOG.warning("ALERT DELIVERY %s: %d notice(s) not delivered by the watcher's stop", self.receiver.shown, left)
        return left


class Deliverer:
    """The receivers of one watcher: routes alert rows to notices and hands them to each receiver's worker."""

    def __init__(self, delivery: AlertDelivery):
        self.delivery = delivery
        self.router = AlertRouter()
        self._workers = [_Worker(receiver, delivery, self.router) for receiver in delivery.receivers]
        self.closed = False

    def submit(self, alert: dict) -> list[Notice]:
        """Never blocks: notices are queued for the receivers' threads."""
        notices = self.router.notices(alert)
        for notice in notices:
            for worker in self._workers:
                worker.offer(notice)
        return notices

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
    """Live result rows -> the watcher's result count (transforms/watch_status.py HEALTH)."""

    def expand(self, results):
        return results | "CountResult" >> beam.ParDo(_NoteResultFn())
