"""An HTTP proxy in front of an S3 endpoint (moto) that misbehaves on a schedule, on 127.0.0.1.

Clients (s3fs in this process, in Beam's worker processes, in Dask workers) use the proxy's URL as
AWS_ENDPOINT_URL; every request is forwarded to the real endpoint, except that a GET of an
object whose key contains a scheduled fragment first gets the fault:

    throttle  503 with S3's <Code>SlowDown</Code> body
    error     500 InternalError
    reset     the connection closed without an answer
    partial   the headers and half the body, then the connection closed
    slow      the answer after `delay` seconds

`times` faults per matching key (None: forever), or, with `rate`, each matching GET fails with
that probability (seeded). Counters say how many faults were injected.
"""
from __future__ import annotations

import dataclasses
import http.client
import http.server
import random
import socket
import threading
import urllib.parse

__all__ = ["ProxyFault", "FaultProxy"]

_THROTTLE = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")


@dataclasses.dataclass
class ProxyFault:
    kind: str = "throttle"          # throttle | error | reset | partial | slow
    times: int | None = 1           # per matching key; None = always (unless rate is set)
    rate: float | None = None       # instead of times: probability per matching GET
    delay: float = 0.0

    def __post_init__(self):
        if self.kind not in ("throttle", "error", "reset", "partial", "slow"):
            raise ValueError(f"unknown fault kind {self.kind!r}")


class FaultProxy:
    """Start with `FaultProxy(upstream).start()`; `.url` is the endpoint to give clients."""

    def __init__(self, upstream: str, seed: int = 0):
        parsed = urllib.parse.urlparse(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self.schedule: dict[str, ProxyFault] = {}
        self.injected: dict[str, int] = {}
        self._left: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def set(self, schedule: dict[str, ProxyFault]) -> None:
        with self._lock:
            self.schedule = dict(schedule)
            self._left.clear()
            self.injected = {}

    def _fault_for(self, method: str, path: str) -> ProxyFault | None:
        if method != "GET" or "?" in path and "list-type" in path:   # object reads only, never listings
            return None
        with self._lock:
            for fragment, fault in self.schedule.items():
                if fragment not in urllib.parse.unquote(path):
                    continue
                if fault.rate is not None:
                    hit = self._random.random() < fault.rate
                else:
                    key = (fragment, path.split("?")[0])
                    left = self._left.setdefault(key, fault.times if fault.times is not None else -1)
                    hit = left != 0
                    if left > 0:
                        self._left[key] = left - 1
                if hit:
                    self.injected[fault.kind] = self.injected.get(fault.kind, 0) + 1
                    return fault
        return None

    def start(self) -> "FaultProxy":
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy._fault_for(self.command, self.path)
                if fault is not None and fault.kind == "reset":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if fault is not None and fault.kind in ("throttle", "error"):
                    payload = _THROTTLE if fault.kind == "throttle" else _INTERNAL
                    self.send_response(503 if fault.kind == "throttle" else 500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "proxy-connection")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                if fault is not None and fault.kind == "slow":
                    threading.Event().wait(fault.delay)
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    # a HEAD answer's Content-Length is the object's size, not its (empty) body's
                    if key.lower() not in ("transfer-encoding", "connection") and (
                            key.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(key, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault is not None and fault.kind == "partial" and self.command == "GET" and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
