"""`strag serve`: the live monitor pages on a small local HTTP server.

    strag serve --tables URL [--host 127.0.0.1] [--port 8765] [--threshold 1.1]

Routes (every page is rendered from the live tables at request time):
    /                          jobs in the live table, latest S, verdict, alert count
    /job/{job_id}              the job's live page (dashboards/live_page.py)
    /api/job/{job_id}/version  {"version": ...}: changes when the job's rows change; the
                               page polls it and reloads
    /assets/vega-bundle.js     the charts' JavaScript (offline, from vl-convert)

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
from transforms.live_tables import DEFAULT_THRESHOLD, read_live_table

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
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="alert threshold drawn on the S chart")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a --host other than loopback: the pages have no authentication")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be 0..65535")
    if not _loopback(args.host):
        if not args.allow_remote:
            parser.error(f"--host {args.host}: other machines could read the live pages, which have no authentication; "
                         "add --allow-remote if that is intended")
        print(f"strag serve: WARNING: serving on {args.host}: anyone who can reach it reads every live job's pages",
              file=sys.stderr)
    return ServeOptions(args.tables.rstrip("/"), args.host, args.port, args.threshold, args.allow_remote)


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
        from dashboards.live_page import live_index_page, live_job_page, live_version

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
            page = live_job_page(parts[1], results, alerts, threshold=self.options.threshold,
                                 version_href=f"/api{_job_href(parts[1])}/version", bundle_href="/" + BUNDLE_PATH)
            return self._send(200, page, "text/html; charset=utf-8")
        if len(parts) == 4 and parts[:2] == ["api", "job"] and parts[3] == "version":
            results, alerts = _job_rows(tables, parts[2])
            return self._send(200, json.dumps({"version": live_version(results, alerts)}), "application/json")
        return self._send(404, f"not found: {path}", "text/plain; charset=utf-8")


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
    server = make_server(options)
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
