"""Object storage that misbehaves on a schedule: a local folder behind the `faulty://` protocol.

    with faults({"traces/date=2024-03-01/job_id=a/": Fault(ConnectionResetError, times=2)}):
        ... read "faulty:///tmp/lake/..." ...

Every read (`open` for reading) of a path containing a scheduled fragment raises the fault's
error, `times` times (None: always), then succeeds; listings and writes pass through unless the
fault names them in `ops` (read, list, info, write, move, copy, delete, mkdir: every storage
call a publish makes), and `skip` lets that many matching calls through first, so a schedule
can fail "the k-th call from now on" (`skip=k, times=None`: storage down for good from call k)
or only that one (`skip=k, times=1`). `calls()` lists every matching call. Kinds:
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

__all__ = ["Fault", "faults", "FaultyFileSystem", "injected", "calls", "OPS"]

PROTOCOL = "faulty"


@dataclasses.dataclass
class Fault:
    error: type[BaseException] = ConnectionResetError
    times: int | None = 1          # failures before reads succeed; None = every read fails
    delay: float = 0.0             # seconds to wait before the failure (or the success)
    message: str = "injected fault"
    rate: float | None = None      # instead of times: each matching read fails with this probability
    ops: tuple[str, ...] = ("read",)   # which calls it hits (OPS)
    skip: int = 0                  # matching calls let through before the first failure


OPS = ("read", "list", "info", "write", "move", "copy", "delete", "mkdir")


_LOCK = threading.Lock()
_SCHEDULE: dict[str, Fault] = {}
_RANDOM = random.Random(0)
_INJECTED: list[tuple[str, str]] = []
_CALLS: list[tuple[str, str]] = []


def injected() -> list[tuple[str, str]]:
    """(path, error name) of every fault raised since the schedule was set."""
    with _LOCK:
        return list(_INJECTED)


def calls() -> list[tuple[str, str]]:
    """(op, path) of every call that matched a scheduled fragment and op since the schedule was set."""
    with _LOCK:
        return list(_CALLS)


def _fault_for(op: str, path: str) -> Fault | None:
    """The fault this call gets (counted), or None."""
    path = str(path)
    with _LOCK:
        for fragment, scheduled in _SCHEDULE.items():
            if fragment not in path or op not in scheduled.ops:
                continue
            _CALLS.append((op, path))
            if scheduled.skip > 0:
                scheduled.skip -= 1
                continue
            if scheduled.rate is not None:
                hit = _RANDOM.random() < scheduled.rate
            else:
                hit = scheduled.times is None or scheduled.times > 0
                if hit and scheduled.times is not None:
                    scheduled.times -= 1
            if hit:
                _INJECTED.append((path, scheduled.error.__name__))
                return scheduled
    return None


def _raise_for(op: str, path) -> None:
    fault = _fault_for(op, path)
    if fault is not None:
        if fault.delay:
            time.sleep(fault.delay)
        raise fault.error(f"{fault.message} ({op}): {path}")


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
        fault = _fault_for("read" if "r" in mode else "write", path)
        if fault is not None:
            if fault.delay:
                time.sleep(fault.delay)
            if fault.error is _PartialReader:
                return _PartialReader(super()._open(path, mode, **kwargs), path)
            raise fault.error(f"{fault.message}: {path}")
        return super()._open(path, mode, **kwargs)

    # every other storage call a listing or a publish makes
    def ls(self, path, detail=False, **kwargs):
        _raise_for("list", path)
        return super().ls(path, detail=detail, **kwargs)

    def info(self, path, **kwargs):
        _raise_for("info", path)
        return super().info(path, **kwargs)

    def mv(self, path1, path2, recursive: bool = True, **kwargs):
        _raise_for("move", f"{path1} -> {path2}")
        return super().mv(path1, path2, recursive=recursive, **kwargs)

    def cp_file(self, path1, path2, **kwargs):
        _raise_for("copy", f"{path1} -> {path2}")
        return super().cp_file(path1, path2, **kwargs)

    def rm(self, path, recursive=False, maxdepth=None):
        _raise_for("delete", path)
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def makedirs(self, path, exist_ok=False):
        _raise_for("mkdir", path)
        return super().makedirs(path, exist_ok=exist_ok)


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
        _CALLS.clear()
    try:
        yield
    finally:
        with _LOCK:
            _SCHEDULE.clear()
