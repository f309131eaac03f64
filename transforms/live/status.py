"""The watcher's health, as `strag serve`'s /metrics reads it: `{out}/_watcher.json`.

`strag watch` keeps a few process-wide counters (`HEALTH`: polls and the last poll's time,
result rows and alerts fired, alert deliveries sent, failed, dropped, retried,
deduplicated; per receiver, alert events apart from Alertmanager keep-alives) and a thread rewrites them, atomically, to `{out}/_watcher.json` every
STATUS_EVERY seconds and once more when it stops. The file is small and replaced whole; the
leading '_' keeps it out of every live table's listing. Readers (no Beam here) compute ages
from its times: a watcher that hangs stops moving `last_poll`, one that died stops moving
`updated`.

The counters are process-wide, like the stop flag (transforms/live/landing.py STOP_REQUESTED): the
watcher runs its pipeline on the embedded runner, in this process.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import fsspec

__all__ = ["STATUS_FILE", "STATUS_EVERY", "HEALTH", "WatcherHealth", "StatusWriter", "status_path", "read_status"]

STATUS_FILE = "_watcher.json"
STATUS_EVERY = 5.0  # seconds between rewrites of the status file
DELIVERY_OUTCOMES = ("sent", "failed", "dropped", "retried", "deduplicated")

_LOG = logging.getLogger("strag.watch")


def status_path(out: str) -> str:
    return f"{out.rstrip('/')}/{STATUS_FILE}"


class WatcherHealth:
    """Counters of one watcher run (thread-safe; reset at the start of each run)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.started = time.time()
            self.last_poll: float | None = None
            self.polls = 0
            self.results = 0
            self.alerts = 0
            self.deliveries = dict.fromkeys(DELIVERY_OUTCOMES, 0)   # alert events (keep-alives apart)
            self.by_receiver: dict[tuple[str, str, str], int] = {}    # (receiver, alert|keepalive, outcome) -> count

    def note_poll(self, now: float) -> None:
        with self._lock:
            self.polls += 1
            self.last_poll = now

    def note_result(self) -> None:
        with self._lock:
            self.results += 1

    def note_alert(self) -> None:
        with self._lock:
            self.alerts += 1

    def note_delivery(self, outcome: str, count: int = 1, receiver: str | None = None, kind: str = "alert") -> None:
        """Count `count` posts of `kind` (alert: a firing or resolved event; keepalive: Alertmanager's
        resend of open alerts) with `outcome` at `receiver` (None: before any receiver, e.g. deduplicated)."""
        with self._lock:
            if kind == "alert":
                self.deliveries[outcome] += count
            if receiver is not None:
                key = (receiver, kind, outcome)
                self.by_receiver[key] = self.by_receiver.get(key, 0) + count

    def snapshot(self) -> dict:
        with self._lock:
            return {"started": self.started, "last_poll": self.last_poll, "polls": self.polls,
                    "results": self.results, "alerts": self.alerts, "deliveries": dict(self.deliveries),
                    "receivers_deliveries": [{"receiver": r, "kind": k, "outcome": o, "count": n}
                                             for (r, k, o), n in sorted(self.by_receiver.items())]}


HEALTH = WatcherHealth()


class StatusWriter:
    """A daemon thread writing HEALTH (+ `extra()`) to {out}/_watcher.json every `every` seconds.

    A failing write is logged once per streak and retried at the next tick: the status file
    is for monitoring and never stops the watcher."""

    def __init__(self, out: str, extra: Callable[[], dict] | None = None, every: float = STATUS_EVERY):
        self._path = status_path(out)
        self._extra = extra or dict
        self._every = every
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._loop, name="strag-watch-status", daemon=True)

    def start(self) -> StatusWriter:
        self.write(running=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            self.write(running=True)

    def write(self, running: bool) -> None:
        from transforms.io.lake import filesystem, write_file_atomic

        status = {"version": 1, "pid": os.getpid(), "host": socket.gethostname(), "running": running,
                  "updated": time.time(), "status_every": self._every, **HEALTH.snapshot(), **self._extra()}
        try:
            write_file_atomic(*filesystem(self._path), json.dumps(status, sort_keys=True).encode())
            self._failing = False
        except Exception as error:  # noqa: BLE001 - monitoring must not stop the watcher
            if not self._failing:
                _LOG.warning("watcher status %s not written: %s: %s (retried every %g s)", self._path,
                             type(error).__name__, error, self._every)
            self._failing = True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.write(running=False)


def read_status(out: str) -> dict | None:
    """The status file the watcher writes under `out`, or None (no watcher has run there, or unreadable)."""
    try:
        with fsspec.open(status_path(out), "rb") as handle:
            status = json.loads(handle.read())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None
