"""`strag serve`: the live monitor pages on a small local HTTP server.

    strag serve --tables URL [--host 127.0.0.1] [--port 8765] [--threshold 1.1]

Routes (every page is rendered from the live tables at request time):
    /                          jobs in the live table, latest S, verdict, alert count
    /job/{job_id}              the job's live page (dashboards/live_page.py)
    /api/job/{job_id}/version  {"version": ...}: changes when the job's rows change; the
                               page polls it and reloads
    /assets/vega-bundle.js     the charts' JavaScript (offline, from vl-convert)
    /metrics                   Prometheus text format (prometheus_client): per job S, waste, sessions,
                               alerts; the watcher's health from {tables}/_watcher.json (`metrics_text`)

Bound to 127.0.0.1 by default: the pages are for the operator's machine; put a reverse
proxy with authentication in front to share them.
"""
from __future__ import annotations

import dataclasses
import http.server
import json
import sys
import threading
import urllib.parse
import uuid

import pyarrow.compute as pc

from pipelines.usage import ArgumentParser
from schemas.live import ALERTS, LIVE_RESULTS
from transforms.live.tables import DEFAULT_THRESHOLD, read_live_table

__all__ = ["ServeOptions", "parse", "make_server", "serve_in_thread", "run"]


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    tables: str
    host: str = "127.0.0.1"
    port: int = 8765
    threshold: float = DEFAULT_THRESHOLD
    allow_remote: bool = False


def parse(argv: list[str]) -> ServeOptions:
    parser = ArgumentParser(prog="strag serve", description="Serve the live per-job monitor pages (from `strag watch` tables).")
    parser.add_argument("--tables", required=True, help="the `strag watch --out` URL (live_results/, alerts/ under it)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 = any free port)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help=f"S drawn as the alert threshold on the S chart and counted as straggling in /metrics "
                        f"(default {DEFAULT_THRESHOLD:g}; give the `strag watch --threshold` the watcher alerts at)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a --host other than loopback: the pages have no authentication")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be 0..65535")
    problem = _tables_problem(args.tables.rstrip("/"))
    if problem:
        parser.error(f"--tables {args.tables}: {problem}")
    if not _loopback(args.host):
        if not args.allow_remote:
            parser.error(f"--host {args.host}: other machines could read the live pages, which have no authentication; "
                         "add --allow-remote if that is intended")
        print(f"strag serve: WARNING: serving on {args.host}: anyone who can reach it reads every live job's pages",
              file=sys.stderr)
    return ServeOptions(args.tables.rstrip("/"), args.host, args.port, args.threshold, args.allow_remote)


def _tables_problem(tables: str) -> str | None:
    """Why `tables` cannot be served (None when it can): a folder must be there (`strag watch`
    creates its --out as it starts); a batch lake or batch tables are named as such."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(tables)
        if not fs.exists(root):
            return "no folder there; give the --out of a running or past `strag watch` (it creates the folder as it starts)"
    except (OSError, ValueError, ImportError) as error:
        return f"cannot be opened ({type(error).__name__}: {error})"
    return None


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _job_rows(tables: str, job_id: str):
    results, alerts = read_live_table(tables, LIVE_RESULTS), read_live_table(tables, ALERTS)
    return (results.filter(pc.equal(results["job_id"], job_id)), alerts.filter(pc.equal(alerts["job_id"], job_id)))


def _job_href(job_id: str) -> str:
    return "/job/" + urllib.parse.quote(job_id, safe="")


class _Handler(http.server.BaseHTTPRequestHandler):
    options: ServeOptions  # set on the subclass made by make_server

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # one line per request is noise for a monitor that polls every 2 s

    def _send(self, status: int, body: str | bytes, content_type: str) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's name
        try:
            self._route()
        except Exception as error:  # answer 500 instead of dropping the connection; the reason goes to the log only
            incident = uuid.uuid4().hex[:8]
            print(f"strag serve: error {incident} on {self.path}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            self._send(500, f"strag serve: internal error {incident} (the server's log has the details)",
                       "text/plain; charset=utf-8")
            raise

    def _route(self):
        from dashboards.html import BUNDLE_PATH
        from dashboards.live_page import live_index_page, live_job_page, live_unknown_job_page, live_version

        path = urllib.parse.urlparse(self.path).path
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
        tables = self.options.tables
        if path == "/":
            results, alerts = read_live_table(tables, LIVE_RESULTS), read_live_table(tables, ALERTS)
            return self._send(200, live_index_page(results, alerts, _job_href), "text/html; charset=utf-8")
        if path == "/" + BUNDLE_PATH:
            return self._send(200, _bundle(), "application/javascript")
        if len(parts) == 2 and parts[0] == "job":
            results, alerts = _job_rows(tables, parts[1])
            if results.num_rows == 0 and alerts.num_rows == 0:
                known = read_live_table(tables, LIVE_RESULTS)["job_id"].unique().to_pylist()
                return self._send(404, live_unknown_job_page(parts[1], sorted(known), _job_href), "text/html; charset=utf-8")
            page = live_job_page(parts[1], results, alerts, threshold=self.options.threshold,
                                 version_href=f"/api{_job_href(parts[1])}/version", bundle_href="/" + BUNDLE_PATH)
            return self._send(200, page, "text/html; charset=utf-8")
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST

            return self._send(200, metrics_text(tables, self.options.threshold), CONTENT_TYPE_LATEST)
        if len(parts) == 4 and parts[:2] == ["api", "job"] and parts[3] == "version":
            results, alerts = _job_rows(tables, parts[2])
            return self._send(200, json.dumps({"version": live_version(results, alerts)}), "application/json")
        return self._send(404, f"not found: {path}", "text/plain; charset=utf-8")


class _LiveCollector:
    """prometheus_client collector reading the live tables and the watcher's status file at scrape time."""

    def __init__(self, tables: str, threshold: float):
        self.tables, self.threshold = tables, threshold

    def collect(self):
        import time

        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from transforms.live.tables import current_results
        from transforms.live.status import read_status

        now = time.time()
        current = current_results(read_live_table(self.tables, LIVE_RESULTS)).to_pylist()
        alerts = read_live_table(self.tables, ALERTS)
        slowdown = GaugeMetricFamily("strag_job_slowdown", "S of the job's latest session with an S (1.0 = no loss); "
                                     "status discarded: the replay is off by more than 5%, S is not trustworthy",
                                     labels=["job_id", "status"])
        waste = GaugeMetricFamily("strag_job_waste", "Waste 1 - 1/S of the job's latest analysed session", labels=["job_id"])
        straggling = GaugeMetricFamily("strag_job_straggling", "1 when the latest analysed session's S is at or above "
                                       f"the threshold ({self.threshold:g})", labels=["job_id"])
        last = GaugeMetricFamily("strag_job_last_session_timestamp_seconds",
                                 "When the job's latest session began landing (its first file)", labels=["job_id"])
        sessions = GaugeMetricFamily("strag_job_sessions", "Sessions in the live table, by the status of their current "
                                     "revision (analysed, discarded, failed)", labels=["job_id", "status"])
        verdicts = GaugeMetricFamily("strag_job_verdict", "1 for the verdict of the job's latest session (none, a cause, "
                                     "insufficient-evidence: the trace cannot decide) and its status", labels=["job_id", "verdict", "status"])
        raised = CounterMetricFamily("strag_job_alerts", "Alert events in the live table (firing: a page; resolved)",
                                     labels=["job_id", "kind"])
        latest: dict[str, dict] = {}            # job -> its latest session's current row
        latest_analysed: dict[str, dict] = {}   # job -> its latest session analysed with an S
        counts: dict[tuple[str, str], int] = {}
        for row in current:   # sorted by job, then first arrival: the last row of a job is its latest
            counts[row["job_id"], row["status"]] = counts.get((row["job_id"], row["status"]), 0) + 1
            latest[row["job_id"]] = row
            if row["status"] in ("analysed", "discarded") and row["slowdown"] is not None:
                latest_analysed[row["job_id"]] = row
        for job in sorted(latest):
            last.add_metric([job], latest[job]["first_arrival"].timestamp())
            verdicts.add_metric([job, latest[job]["verdict"] or "no-verdict", latest[job]["status"]], 1.0)
            analysed = latest_analysed.get(job)
            if analysed is not None:
                slowdown.add_metric([job, analysed["status"]], analysed["slowdown"])
                if analysed["status"] == "analysed":
                    waste.add_metric([job], analysed["waste"] if analysed["waste"] is not None else 1 - 1 / analysed["slowdown"])
                    straggling.add_metric([job], float(analysed["slowdown"] >= self.threshold))
        for (job, status), count in sorted(counts.items()):
            sessions.add_metric([job, status], count)
        alert_counts: dict[tuple[str, str], int] = {}
        for job, kind in zip(alerts["job_id"].to_pylist(), alerts["kind"].to_pylist()):
            alert_counts[job, kind] = alert_counts.get((job, kind), 0) + 1
        for (job, kind), count in sorted(alert_counts.items()):
            raised.add_metric([job, kind], count)
        yield from (slowdown, waste, straggling, last, sessions, verdicts, raised)
        yield from _watcher_metrics(read_status(self.tables), now)


def _watcher_metrics(status: dict | None, now: float):
    """The watcher's health from its status file: ages, then its counters (of its current run)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    present = GaugeMetricFamily("strag_watcher_status_present", "1 when a `strag watch` status file is under --tables")
    present.add_metric([], 0.0 if status is None else 1.0)
    yield present
    if status is None:
        return

    def gauge(name, text, value):
        metric = GaugeMetricFamily(name, text)
        metric.add_metric([], float("nan") if value is None else float(value))
        return metric

    def counter(name, text, value):
        metric = CounterMetricFamily(name, text)
        metric.add_metric([], float(value or 0))
        return metric

    last_poll = status.get("last_poll")
    yield gauge("strag_watcher_running", "1 while the watcher runs (0 once it stopped; a killed one stays 1: "
                "watch the heartbeat age)", 1.0 if status.get("running") else 0.0)
    yield gauge("strag_watcher_heartbeat_age_seconds", "Seconds since the watcher last wrote its status file",
                now - status["updated"] if status.get("updated") else None)
    yield gauge("strag_watcher_last_poll_age_seconds", "Seconds since the watcher's last poll of the landing area",
                None if last_poll is None else now - last_poll)
    yield gauge("strag_watcher_start_time_seconds", "When the watcher's current run started", status.get("started"))
    yield gauge("strag_watcher_alert_deliveries_pending", "Alert notices queued for the webhooks",
                status.get("pending_deliveries"))
    yield counter("strag_watcher_polls", "Polls of the landing area in the watcher's current run", status.get("polls"))
    yield counter("strag_watcher_sessions_analysed", "Live result rows (session revisions) the watcher wrote in its "
                  "current run", status.get("results"))
    yield counter("strag_watcher_alerts", "Alerts the watcher fired in its current run (pages; resolutions and "
                  "keep-alives not counted)", status.get("alerts"))
    deliveries = CounterMetricFamily("strag_watcher_alert_deliveries", "Alert events (firing, resolved) by outcome, "
                                     "summed over receivers: sent, failed (given up after retries), dropped (queue "
                                     "full or left at the stop), retried (attempts after a failure), deduplicated "
                                     "(not sent again)", labels=["outcome"])
    for outcome, count in sorted((status.get("deliveries") or {}).items()):
        deliveries.add_metric([outcome], float(count))
    yield deliveries
    per_receiver = CounterMetricFamily("strag_watcher_receiver_posts", "Posts per receiver (URL without its path), kind "
                                       "(alert: a firing or resolved event; keepalive: Alertmanager's resend of open "
                                       "alerts) and outcome", labels=["receiver", "kind", "outcome"])
    for item in status.get("receivers_deliveries") or ():
        per_receiver.add_metric([item["receiver"], item["kind"], item["outcome"]], float(item["count"]))
    yield per_receiver


def metrics_text(tables: str, threshold: float = DEFAULT_THRESHOLD) -> bytes:
    """/metrics: the live tables and the watcher's health in Prometheus text format."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LiveCollector(tables, threshold))
    return generate_latest(registry)


_BUNDLE: list[bytes] = []


def _bundle() -> bytes:
    if not _BUNDLE:
        import vl_convert

        _BUNDLE.append(vl_convert.javascript_bundle().encode())
    return _BUNDLE[0]


def make_server(options: ServeOptions) -> http.server.ThreadingHTTPServer:
    """A server bound to options.host:options.port (not started); `.server_address` has the real port."""
    handler = type("LiveHandler", (_Handler,), {"options": options})
    return http.server.ThreadingHTTPServer((options.host, options.port), handler)


def run(argv: list[str]) -> int:
    """`strag serve`: serve until interrupted."""
    options = parse(argv)
    try:
        server = make_server(options)
    except OSError as error:   # the port is taken (another `strag serve`?) or the host is not this machine's
        print(f"strag serve: cannot listen on {options.host}:{options.port}: {error.strerror or error}; "
              "give another --port (or stop what listens there)", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"strag serve: live pages from {options.tables} at http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def serve_in_thread(options: ServeOptions) -> tuple[http.server.ThreadingHTTPServer, threading.Thread]:
    """Start a server on a daemon thread (tests, notebooks); stop it with server.shutdown()."""
    server = make_server(options)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread
