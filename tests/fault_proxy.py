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

`ops` widens a fault from object reads to every kind of request (OPS: read = GET of an object,
list = a bucket listing, info = HEAD, write = PUT, copy = PUT with x-amz-copy-source, delete =
DELETE or a batch delete POST, other = the rest, e.g. multipart); the fragment is then matched
against the path and query (a listing names its prefix there) and a batch delete's body (which
names its keys). `skip` lets that many matching requests through first, counted over all keys:
`skip=k, times=None` is storage down for good from the k-th request, `skip=k, times=1,
per_key=False` fails only that one. `calls` lists every matching request.
"""
from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import random
import socket
import threading
import urllib.parse

__all__ = ["ProxyFault", "FaultProxy", "OPS"]
OPS = ("read", "list", "info", "write", "copy", "delete", "other")

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
    ops: tuple[str, ...] = ("read",)
    skip: int = 0
    per_key: bool = True            # times counts per key; False: over all matching requests

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
        self.calls: list[tuple[str, str]] = []
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
            self.calls = []

    @staticmethod
    def _op(method: str, path: str, headers) -> str:
        query = urllib.parse.urlparse(path).query
        if method == "GET":
            bucket_level = urllib.parse.urlparse(path).path.strip("/").count("/") == 0
            return "list" if "list-type" in query or bucket_level else "read"
        if method == "HEAD":
            return "info"
        if method == "PUT":
            return "copy" if headers.get("x-amz-copy-source") else "write"
        if method == "DELETE" or method == "POST" and "delete" in urllib.parse.parse_qs(query, keep_blank_values=True):
            return "delete"
        return "other"

    def _fault_for(self, method: str, path: str, headers=None, body: bytes | None = None) -> ProxyFault | None:
        op = self._op(method, path, headers or {})
        where = urllib.parse.unquote(path) + (body.decode("utf-8", "replace") if op == "delete" and body else "")
        with self._lock:
            for fragment, fault in self.schedule.items():
                if op not in fault.ops or fragment not in where:
                    continue
                self.calls.append((op, path))
                if fault.skip > 0:
                    fault.skip -= 1
                    continue
                if fault.rate is not None:
                    hit = self._random.random() < fault.rate
                else:
                    key = (fragment, path.split("?")[0]) if fault.per_key else (fragment,)
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
                fault = proxy._fault_for(self.command, self.path, self.headers, body)
                if fault is not None and fault.kind == "reset":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if fault is not None and fault.kind in ("throttle", "error"):
                    payload = _THROTTLE if fault.kind == "throttle" else _INTERNAL
                    self.send_response(503 if fault.kind == "throttle" else 500)
                    self.send_header("Content-Type", "application/xml")
                    if self.command == "HEAD":   # an answer to HEAD has no body
                        payload = b""
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


@contextlib.contextmanager
def proxied(moto_s3):
    """moto's S3 reached through a FaultProxy for the block: every client, in this process or a
    worker process, talks to the proxy (AWS_ENDPOINT_URL), and botocore does not retry (the IO
    layer's retries are under test). Yields the proxy."""
    import pytest
    from s3fs import S3FileSystem

    proxy = FaultProxy(moto_s3.endpoint).start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AWS_ENDPOINT_URL", proxy.url)
            patch.setenv("AWS_MAX_ATTEMPTS", "1")
            S3FileSystem.clear_instance_cache()
            yield proxy
            S3FileSystem.clear_instance_cache()
    finally:
        proxy.stop()
