"""Object storage that misbehaves on a schedule: a local folder behind the `faulty://` protocol.

    with faults({"traces/date=2024-03-01/job_id=a/": Fault(ConnectionResetError, times=2)}):
        ... read "faulty:///tmp/lake/..." ...

Every read (`open` for reading) of a path containing a scheduled fragment raises the fault's
error, `times` times (None: always), then succeeds; listings and writes pass through. Kinds:
connection reset, timeout, throttling (an OSError with S3's SlowDown text), permission denied,
a slow read (`delay` seconds before succeeding) and a partial read (the first half of the bytes,
then the connection drops: an error, as a real client raises it, never short bytes).
The pipeline must run in this process (FnApiRunner in_memory) to see the schedule.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = ["Fault", "faults", "FaultyFileSystem", "injected"]

PROTOCOL = "faulty"


@dataclasses.dataclass
class Fault:
    error: type[BaseException] = ConnectionResetError
    times: int | None = 1          # failures before reads succeed; None = every read fails
    delay: float = 0.0             # seconds to wait before the failure (or the success)
    message: str = "injected fault"
    rate: float | None = None      # instead of times: each matching read fails with this probability


_LOCK = threading.Lock()
_SCHEDULE: dict[str, Fault] = {}
_RANDOM = random.Random(0)
_INJECTED: list[tuple[str, str]] = []


def injected() -> list[tuple[str, str]]:
    """(path, error name) of every fault raised since the schedule was set."""
    with _LOCK:
        return list(_INJECTED)


class _PartialReader:
    """A file object whose read delivers half the bytes and then fails, like a dropped connection."""

    def __init__(self, handle, path: str):
        self._handle, self._path = handle, path

    def read(self, size: int = -1):
        data = self._handle.read()
        raise ConnectionResetError(f"{self._path}: connection reset after {len(data) // 2} of {len(data)} bytes")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()


class FaultyFileSystem(LocalFileSystem):
    protocol = PROTOCOL
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return LocalFileSystem._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            fault = None
            with _LOCK:
                for fragment, scheduled in _SCHEDULE.items():
                    if fragment not in path:
                        continue
                    if scheduled.rate is not None:
                        hit = _RANDOM.random() < scheduled.rate
                    else:
                        hit = scheduled.times is None or scheduled.times > 0
                        if hit and scheduled.times is not None:
                            scheduled.times -= 1
                    if hit:
                        fault = scheduled
                        _INJECTED.append((path, scheduled.error.__name__))
                        break
            if fault is not None:
                if fault.delay:
                    time.sleep(fault.delay)
                if fault.error is _PartialReader:
                    return _PartialReader(super()._open(path, mode, **kwargs), path)
                raise fault.error(f"{fault.message}: {path}")
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
PARTIAL_READ = _PartialReader   # Fault(PARTIAL_READ): half the bytes, then a reset


@contextlib.contextmanager
def faults(schedule: dict[str, Fault], seed: int = 0):
    """Install `schedule` (path fragment -> Fault) for the duration of the block; `seed` drives `rate` faults."""
    with _LOCK:
        _RANDOM.seed(seed)
        _SCHEDULE.clear()
        _SCHEDULE.update(schedule)
        _INJECTED.clear()
    try:
        yield
    finally:
        with _LOCK:
            _SCHEDULE.clear()
