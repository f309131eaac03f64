"""`strag watch`: the streaming monitor of the lake's landing area.

    strag watch --lake URL --out URL [--threshold 1.1] [--session-timeout S] [--retain S]
                [--poll-interval S] [--status-interval S] [--max-runtime S] [--stop-after-sessions N]
                [--alert-webhook [FORMAT=]URL ...] [--alert-format json|alertmanager|slack] [--alert-link URL]
                [--resolve-after S]

Wiring only (each step is one composite from transforms/):

    WatchLanding -> AssembleSessions -> AnalyzeSessions -> EmitLiveResults (results, alerts) -> DeliverAlerts (webhooks)
         |                |                   |
         +----------------+-------------------+-> WriteLiveQuarantine (bad files, rejected rows, unexpected errors)

Sessions done for --retain seconds move to {lake}/landing_archive/ and leave the state,
so a watcher that runs for months lists and remembers only the sessions in play.

Runs until stopped (Ctrl-C or SIGTERM), or for --max-runtime seconds, or until the live
table holds results for --stop-after-sessions sessions; every stop makes one final poll
and analyses every pending session with what it has. Tables: schemas/live.py.

Runner: Beam's FnApiRunner in-process, named explicitly. In this Beam version the
DirectRunner resolves to it for this pipeline anyway (after failing to download a
Prism binary offline); the legacy streaming DirectRunner cannot run the
self-deferring poll source. The monitor therefore keeps its own clock (poll ticks)
instead of relying on timers, see transforms/live/landing.py.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.usage import ArgumentParser
from schemas.lake import LANDING
from transforms.live.alerting import (FORMATS, AlertDelivery, DeliverAlerts, NoteResults, close_deliverers, get_deliverer,
                                 parse_receiver, pending_notices)
from transforms.live.analyze_sessions import AnalyzeSessions
from transforms.live.landing import STOP_REQUESTED, WatchConfig, WatchLanding
from transforms.io.lake import LAKE_PARTS, LakeError, check_lake
from transforms.live.results import (DEFAULT_THRESHOLD, AlertConfig, EmitLiveResults, WriteLiveQuarantine, count_live_sessions,
                             record_alert)
from transforms.live.sessions import AssembleSessions, AssemblyConfig
from transforms.live.status import HEALTH, StatusWriter

__all__ = ["WatchOptions", "parse", "build", "run"]

_LOG = logging.getLogger("strag.watch")


@dataclasses.dataclass(frozen=True)
class WatchOptions:
    """Parsed `strag watch` arguments (seconds for every duration)."""

    lake: str
    out: str
    threshold: float = DEFAULT_THRESHOLD
    session_timeout: float = 30.0
    retain: float = 600.0
    poll_interval: float = 1.0
    status_interval: float = 60.0
    max_runtime: float | None = None
    stop_after_sessions: int | None = None
    alert_webhooks: tuple = ()        # transforms.live.alerting.Receiver per --alert-webhook
    alert_link: str | None = None     # base URL of `strag serve`, linked from the alerts
    resolve_after: float | None = None  # None: derived from each job's profiling cadence (transforms/live/paging.py)

    def alert_delivery(self) -> AlertDelivery:
        return AlertDelivery(receivers=tuple(self.alert_webhooks), link=self.alert_link, out=self.out)

    def alert_config(self) -> AlertConfig:
        return AlertConfig(out=self.out, threshold=self.threshold, resolve_after=self.resolve_after,
                           archived_after=self.retain + self.session_timeout)

    def watch_config(self, start_time: float) -> WatchConfig:
        return _HealthWatchConfig(
            lake=self.lake,
            interval_seconds=self.poll_interval,
            start_time=start_time,
            stop_time=None if self.max_runtime is None else start_time + self.max_runtime,
            stop_after_sessions=self.stop_after_sessions,
            out=self.out,
            status_every=max(1, round(self.status_interval / self.poll_interval)),
        )

    def assembly_config(self) -> AssemblyConfig:
        return AssemblyConfig(timeout_seconds=self.session_timeout, retain_seconds=self.retain, archive=self.lake)


@dataclasses.dataclass(frozen=True)
class _HealthWatchConfig(WatchConfig):
    """WatchConfig whose per-poll stop check also notes the poll (the watcher health's last poll time)."""

    def should_stop(self, now: float) -> bool:
        HEALTH.note_poll(now)
        return super().should_stop(now)


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="strag watch",
        description="Streaming monitor: assemble profiling sessions as they land in {lake}/landing/ (the lake "
                    "must have that folder: `strag land` and the collector write there), analyse each, append results "
                    "to the live table and page when a verdict names slow workers or a cause to fix; the alert "
                    "resolves when the job turns healthy or stops landing sessions.",
    )
    parser.add_argument("--lake", required=True, help="lake URL (local folder, file://, s3://); watches {lake}/landing/, "
                        "which must exist (mkdir LAKE/landing for a new lake)")
    parser.add_argument("--out", required=True, help="output URL: live_results/, alerts/, live_quarantine/ go under it")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"page for a job-wide cause (stage, sequence, communication) only when the kept window's "
                             f"S is at least this slowdown; workers measured slow page whatever S (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--resolve-after", type=float, default=None, metavar="S",
                        help="resolve a job's open alerts when it has landed no session for this many seconds (default: "
                             "3 of the job's profiling intervals, and not before its sessions are archived: --retain)")
    parser.add_argument("--session-timeout", type=float, default=30.0, metavar="S",
                        help="analyse a session this many seconds after its first file even if workers are missing (default 30)")
    parser.add_argument("--retain", type=float, default=600.0, metavar="S",
                        help="move a session to {lake}/landing_archive/ once analysed and unchanged for this many "
                             "seconds; a file landing in it later is quarantined (default 600)")
    parser.add_argument("--poll-interval", type=float, default=1.0, metavar="S", help="seconds between polls of the landing area (default 1)")
    parser.add_argument("--status-interval", type=float, default=60.0, metavar="S",
                        help="print a status line (sessions in play, listing time, memory) this often (default 60)")
    parser.add_argument("--max-runtime", type=float, default=None, metavar="S", help="stop after this many seconds (default: run until stopped)")
    parser.add_argument("--stop-after-sessions", type=int, default=None, metavar="N",
                        help="stop once the live table holds results for N sessions")
    parser.add_argument("--alert-webhook", action="append", default=[], metavar="[FORMAT=]URL",
                        help="POST each alert (and its resolution) to this URL; repeat for several receivers; "
                             "FORMAT= (json, alertmanager, slack) overrides --alert-format for this URL")
    parser.add_argument("--alert-format", choices=FORMATS, default="json",
                        help="payload of the --alert-webhook URLs without a FORMAT=: json (default), alertmanager "
                             "(the /api/v2/alerts body), slack (an incoming-webhook {\"text\": ...})")
    parser.add_argument("--alert-link", default=None, metavar="URL",
                        help="base URL of `strag serve`: alerts link to {URL}/job/{job_id} (Alertmanager generatorURL)")
    return parser


def parse(argv: list[str]) -> WatchOptions:
    """Arguments -> WatchOptions; raises SystemExit with a clear message on bad values."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.threshold >= 1.0:
        parser.error(f"--threshold {args.threshold}: a slowdown threshold is >= 1.0 (1.1 = 10% slower than ideal)")
    for name in ("session_timeout", "retain", "poll_interval", "status_interval"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0 seconds")
    if args.resolve_after is not None and not args.resolve_after > 0:
        parser.error("--resolve-after must be > 0 seconds")
    if args.max_runtime is not None and not args.max_runtime > 0:
        parser.error("--max-runtime must be > 0 seconds")
    if args.stop_after_sessions is not None and args.stop_after_sessions < 1:
        parser.error("--stop-after-sessions must be >= 1")
    try:   # a mistyped --lake would otherwise be watched, silently, forever
        check_lake(args.lake.rstrip("/"), parts=(LANDING, *LAKE_PARTS))
    except LakeError as error:
        parser.error(f"{error}" + ("" if "://" in args.lake else f" (a new lake: mkdir {args.lake.rstrip('/')}/{LANDING})"))
    receivers = []
    for text in args.alert_webhook:
        try:
            receivers.append(parse_receiver(text, args.alert_format))
        except ValueError as error:
            parser.error(f"--alert-webhook {error}")
    if args.alert_link is not None and not args.alert_link.startswith(("http://", "https://")):
        parser.error(f"--alert-link {args.alert_link}: give the http(s):// URL where `strag serve` runs")
    return WatchOptions(lake=args.lake.rstrip("/"), out=args.out.rstrip("/"), threshold=args.threshold,
                        session_timeout=args.session_timeout, retain=args.retain, poll_interval=args.poll_interval,
                        status_interval=args.status_interval,
                        max_runtime=args.max_runtime, stop_after_sessions=args.stop_after_sessions,
                        alert_webhooks=tuple(receivers), alert_link=args.alert_link, resolve_after=args.resolve_after)


def build(pipeline: beam.Pipeline, options: WatchOptions, start_time: float | None = None) -> None:
    """Wire the monitor into `pipeline`. start_time: epoch seconds of the first poll (now by default)."""
    watched = pipeline | "WatchLanding" >> WatchLanding(options.watch_config(time.time() if start_time is None else start_time))
    assembled = watched["sessions"] | "AssembleSessions" >> AssembleSessions(options.assembly_config())
    analysed = assembled["assemblies"] | "AnalyzeSessions" >> AnalyzeSessions()
    alerts = analysed["results"] | "EmitLiveResults" >> EmitLiveResults(options.alert_config())
    alerts | "DeliverAlerts" >> DeliverAlerts(options.alert_delivery())   # queues only: a receiver never holds a bundle
    analysed["results"] | "NoteResults" >> NoteResults()                  # the watcher health's result count
    # One writer per input rather than a Flatten: on the FnApiRunner a Flatten in an
    # unbounded pipeline held its bundles back until the source ended.
    watched["quarantine"] | "QuarantineLanding" >> WriteLiveQuarantine(options.out)
    assembled["quarantine"] | "QuarantineFiles" >> WriteLiveQuarantine(options.out)
    analysed["quarantine"] | "QuarantineSessions" >> WriteLiveQuarantine(options.out)
    analysed["unexpected"] | "QuarantineUnexpected" >> WriteLiveQuarantine(options.out)


def bound_runner_metrics() -> None:
    """Keep the embedded runner's memory flat over a long watch.

    In this Beam version (2.77) the FnApiRunner merges each bundle's metrics into the stage's
    with a lazy generator (`consolidate_monitoring_infos(chain(new, previous))`), so every poll
    adds a generator layer holding that bundle's MonitoringInfo protos: an idle watcher grew
    by 36 MiB in 600 polls (~60 KB a poll, 5 GB a day at one poll a second). Materialising the
    merge keeps one consolidated list per stage: the same watcher stays flat (322 MiB after
    1,200 polls; benchmarks/bench_watch_soak.py measures it under load)."""
    from apache_beam.runners.portability.fn_api_runner import fn_runner

    merge = fn_runner.consolidate_monitoring_infos
    if getattr(merge, "materialised", False):
        return

    def materialised(infos):
        return list(merge(infos))

    materialised.materialised = True
    fn_runner.consolidate_monitoring_infos = materialised


@contextlib.contextmanager
def stop_on_signals():
    """Ctrl-C or SIGTERM ends the watcher at its next poll, which is a final one: sessions still
    pending are analysed with what they have, then the pipeline ends. A second signal exits at
    once (130); every output file is written atomically, so nothing is left half-written.
    Signal handlers exist only in the main thread: elsewhere (tests) only the flag is reset."""
    STOP_REQUESTED.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if STOP_REQUESTED.is_set():
            print("strag watch: stopped at once", flush=True)
            os._exit(130)
        STOP_REQUESTED.set()
        print(f"strag watch: {signal.Signals(signum).name}: stopping after the next poll (pending sessions are "
              "analysed first; again to stop at once)", flush=True)

    previous = {number: signal.signal(number, handler) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, before in previous.items():
            signal.signal(number, before)


class AlertClock:
    """Resolves the alerts of jobs gone silent (transforms/live/paging.py AlertBook.expire), every
    `every` seconds while the watcher runs: the pipeline only acts when a session lands."""

    def __init__(self, options: WatchOptions, every: float = 10.0):
        self._config, self._delivery, self._every = options.alert_config(), options.alert_delivery(), every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="strag-alert-clock", daemon=True)

    def start(self) -> "AlertClock":
        self._thread.start()
        return self

    def tick(self) -> list[dict]:
        events = self._config.book().expire(time.time())
        for alert in events:
            list(record_alert(self._config.out, alert))
            if self._delivery.receivers:
                get_deliverer(self._delivery).submit(alert)
        return events

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.tick()
            except OSError as error:   # storage trouble: the next tick tries again; the pipeline fails loud on its own
                _LOG.warning("alert expiry: %s", error)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def run(argv: list[str]) -> int:
    """`strag watch`: runs the monitor; returns 0 when it stops normally (bounded run, Ctrl-C, SIGTERM)."""
    options = parse(argv)
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    bound_runner_metrics()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    started = time.time()
    print(f"strag watch: {options.lake}/landing -> {options.out} (threshold {options.threshold:g}, "
          f"session timeout {options.session_timeout:g} s, poll every {options.poll_interval:g} s)", flush=True)
    if options.alert_webhooks:
        print(f"strag watch: alerts to {', '.join(f'{r.shown} ({r.format})' for r in options.alert_webhooks)}", flush=True)
    pipeline = beam.Pipeline(runner=FnApiRunner(), options=PipelineOptions(flags=[], streaming=True))
    build(pipeline, options, start_time=started)
    HEALTH.reset()
    status = StatusWriter(options.out, extra=lambda: {"pending_deliveries": pending_notices(),
                                                      "receivers": [r.format for r in options.alert_webhooks]}).start()
    clock = AlertClock(options).start()
    try:
        with stop_on_signals():
            pipeline.run().wait_until_finish()
    finally:
        clock.stop()
        undelivered = close_deliverers(timeout=10.0)
        status.stop()
    deliveries = HEALTH.snapshot()["deliveries"]
    if options.alert_webhooks:
        print(f"strag watch: alert deliveries: {deliveries['sent']} sent, {deliveries['failed']} failed, "
              f"{deliveries['dropped']} dropped" + (f" ({undelivered} still queued at the stop)" if undelivered else ""),
              flush=True)
    print(f"strag watch: stopped after {time.time() - started:.1f} s; {count_live_sessions(options.out)} sessions in "
          f"{options.out}/live_results, alerts in {options.out}/alerts, quarantine in {options.out}/live_quarantine",
          flush=True)
    return 0
