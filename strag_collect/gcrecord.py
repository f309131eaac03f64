"""Python's garbage collections, recorded where they happen and carried in the trace they fall in.

The profiler sees a collection only as a gap between ops: on a CPU rank the collector runs on the
thread that runs the model, between two ops. `GcRecorder` hooks `gc.callbacks` (the interpreter
calls it at the start and stop of every collection) and keeps each collection's wall-clock start
and stop (time.time_ns(): the clock Kineto's `baseTimeNanoseconds` counts from) and generation:
two calls of ~1 µs per collection, a bounded memory. When a profiling window is exported, the
collections since the previous export go into the trace file as one top-level key,

    "strag_gc": {"clock": "unix_ns", "pauses": [[start_ns, stop_ns, generation], ...]}

which the converter reads (transforms/ingest/kineto: the trace's `gc_wait` column: the part of
the gap before each op the collector ran in), so the verdict names python-gc from what ran,
not from the gap's size.
"""
from __future__ import annotations

import collections
import gc
import json
import os
import threading
import time

__all__ = ["GcRecorder", "append_top_level", "GC_KEY"]

GC_KEY = "strag_gc"
MAX_PAUSES = 100_000   # kept between two exports (the oldest dropped first): ~5 MB at most


class GcRecorder:
    """Records every collection of this process from `start()` until `stop()`; `take()` returns the
    ones recorded since the last take (and forgets them)."""

    def __init__(self, limit: int = MAX_PAUSES):
        self._pauses: collections.deque = collections.deque(maxlen=limit)
        self._started: int | None = None
        self._lock = threading.Lock()
        self._on = False

    def _callback(self, phase: str, info: dict) -> None:
        now = time.time_ns()
        if phase == "start":
            self._started = now
        elif self._started is not None:
            self._pauses.append((self._started, now, int(info.get("generation", -1))))
            self._started = None

    def start(self) -> "GcRecorder":
        with self._lock:
            if not self._on:
                gc.callbacks.append(self._callback)
                self._on = True
        return self

    def stop(self) -> None:
        with self._lock:
            if self._on:
                gc.callbacks.remove(self._callback)
                self._on = False

    def take(self) -> list[tuple[int, int, int]]:
        with self._lock:
            out = list(self._pauses)
            self._pauses.clear()
        return out


def append_top_level(path: str, key: str, value) -> None:
    """Add `"key": value` to the JSON object in the file at `path` (an exported trace), in place: the
    object's closing brace is found at the end of the file and the key written before it, so a trace
    of gigabytes is never read whole. ValueError when the file does not end with a non-empty object."""
    tail_size = 4096
    with open(path, "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - tail_size))
        tail = handle.read()
        stripped = tail.rstrip()
        if not stripped.endswith(b"}"):
            raise ValueError(f"{path}: does not end with a JSON object")
        brace = max(0, size - tail_size) + len(stripped) - 1
        before = stripped[:-1].rstrip()
        if before.endswith(b"{") or not before:
            raise ValueError(f"{path}: an empty JSON object")
        handle.seek(brace)
        handle.write(b", " + json.dumps(key).encode() + b": " + json.dumps(value, separators=(",", ":")).encode() + b"}\n")
        handle.truncate()
