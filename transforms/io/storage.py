"""Every call to object storage (reads, listings, writes, moves, deletes): retried with backoff,
failures that are not bad data.

Two kinds of error, never turned into each other (ARCHITECTURE.md, "Errors"):
- bad data: the bytes arrived and are wrong (corrupt parquet, broken JSON, wrong schema). The
  callers decode after `read_bytes` returns and quarantine the file or window with a reason.
- failing infrastructure: the bytes did not arrive (connection reset, timeout, throttling, a 5xx
  left after the client's own retries, permission denied, a listed file gone). `read_bytes`
  retries with exponential backoff and full jitter, then raises `StorageError`, which no
  quarantine path catches: the run fails, publishes nothing, and its failure record names the
  window and the file.

Attempts and delays: STRAG_IO_ATTEMPTS (default 4), STRAG_IO_BACKOFF_S (first delay, default 0.2 s,
doubling, at most STRAG_IO_BACKOFF_MAX_S = 5 s), read from the environment at each call so a
worker process sees what its launcher set.

`retry(action, url, call)` runs any other storage call the same way (listings in transforms/io/lake.py,
every step of the publish in transforms/batch/commit.py); `absent` names exceptions that are an answer,
not a failure (a listing of a folder that does not exist, a delete of a file already gone), which
are raised to the caller at once.
"""
from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import Callable, TypeVar

import fsspec

__all__ = ["StorageError", "RetryPolicy", "read_bytes", "retry", "exists", "find", "INFRASTRUCTURE_ERRORS"]


class StorageError(OSError):
    """Object storage failed to deliver a file after every retry: infrastructure, not bad data.

    path: the URL; attempts: how many calls were tried; cause: the last error, as text; action: what
    was tried (reading, listing, writing, publishing, ...)."""

    def __init__(self, path: str, attempts: int, cause: BaseException | str, action: str = "reading"):
        cause = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"storage error {action} {path}: {cause} (after {attempts} attempt{'s' if attempts != 1 else ''}); "
                         "nothing was quarantined: fix the storage or credentials and rerun")
        self.path, self.attempts, self.cause, self.action = path, attempts, cause, action

    def __reduce__(self):   # crosses Beam workers intact
        return (StorageError, (self.path, self.attempts, self.cause, self.action))


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Bounded attempts with exponential backoff and full jitter (seconds)."""

    attempts: int = 4
    backoff: float = 0.2
    backoff_max: float = 5.0

    @classmethod
    def from_env(cls) -> "RetryPolicy":
        def number(name: str, default: float, kind=float):
            text = os.environ.get(name)
            if text is None:
                return default
            try:
                value = kind(text)
            except ValueError:
                raise ValueError(f"{name}={text!r}: expected a number") from None
            if value < (1 if kind is int else 0):
                raise ValueError(f"{name}={text!r}: must be >= {1 if kind is int else 0}")
            return value

        return cls(number("STRAG_IO_ATTEMPTS", cls.attempts, int), number("STRAG_IO_BACKOFF_S", cls.backoff),
                   number("STRAG_IO_BACKOFF_MAX_S", cls.backoff_max))

    def delay(self, attempt: int) -> float:
        """Sleep before retry number `attempt` (1 = the first retry): uniform in [0, backoff * 2^(attempt-1)]."""
        return random.uniform(0.0, min(self.backoff_max, self.backoff * 2 ** (attempt - 1)))


def read_bytes(url: str, policy: RetryPolicy | None = None) -> bytes:
    """The whole content of the file at `url` (any fsspec URL). Any error while fetching is
    retried per `policy` (default: RetryPolicy.from_env()), then raised as StorageError."""
    def fetch() -> bytes:   # only the fetch is in here: whatever fails is the storage
        fs, path = fsspec.core.url_to_fs(url)
        with fs.open(path, "rb") as handle:
            return handle.read()

    return retry("reading", url, fetch, policy)


T = TypeVar("T")


def retry(action: str, url: str, call: Callable[[], T], policy: RetryPolicy | None = None, *,
          absent: tuple[type[BaseException], ...] = (), failures: tuple[type[BaseException], ...] = (Exception,)) -> T:
    """`call()` retried per `policy` (default: RetryPolicy.from_env()) on any error, then StorageError
    naming `action` and `url`. Errors of the `absent` types are answers (e.g. FileNotFoundError of a
    listing): raised at once. A StorageError from a nested retry is not retried again. failures: the
    errors that are the storage's (default: any; (OSError,) for a call that also runs code of ours)."""
    policy = policy or RetryPolicy.from_env()
    last: BaseException | None = None
    for attempt in range(1, policy.attempts + 1):
        if attempt > 1:
            time.sleep(policy.delay(attempt - 1))
        try:
            return call()
        except absent:
            raise
        except StorageError:
            raise
        except failures as error:   # the call is the storage's: whatever fails is the storage
            last = error
    raise StorageError(url, policy.attempts, last, action)


def exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether `path` exists; unlike fsspec's `exists`, which answers False to any error, a failing
    call raises (so `retry` retries it, and a publish never takes "storage down" for "already moved")."""
    try:
        fs.info(path)
    except FileNotFoundError:
        return False
    return True


def find(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """fs.find(path): every file below `path`, sorted, except that a folder the storage fails to list
    raises instead of being left out (fsspec's generic find walks with on_error="omit", and does not
    pass on_error="raise" down to subfolders: a storage blip would drop files silently). Filesystems
    with a find of their own (s3fs: one recursive listing) raise by themselves."""
    if type(fs).find is not fsspec.AbstractFileSystem.find:
        return sorted(fs.find(path))
    root = fs._strip_protocol(path).rstrip("/")
    files, folders = [], [root]
    while folders:
        folder = folders.pop()
        for info in fs.ls(folder, detail=True):
            name = info["name"].rstrip("/")
            if info["type"] == "directory" and name != folder:
                folders.append(name)
            elif info["type"] != "directory":
                files.append(name)
    return sorted(files)


# What escapes the quarantine paths: failing infrastructure (OSError covers connection errors,
# timeouts, permissions and StorageError). Decoding errors of bytes that did arrive are data errors.
INFRASTRUCTURE_ERRORS = (OSError,)

