"""What a `strag` user sees: one-line usage errors, and no library logs unless --verbose.

- `ArgumentParser`: every subcommand's parser. An argparse error becomes one line naming
  the option and pointing at --help (`strag watch: the following arguments are required:
  --out (see `strag watch --help`)`), exit 2, instead of a usage dump; every parser takes
  --verbose.
- `configure_logs`: one handler on the root logger that lets through strag's own log lines
  (loggers `strag.*` and our packages) and, only with --verbose, the libraries' (Apache
  Beam, Great Expectations, Dask, gRPC) warnings and errors. Beam logs some of its
  warnings on the root logger at import time ("apitools not found"), so the CLI calls it
  before importing a subcommand.
- `worker_output`: Beam's worker processes write their own log lines straight to the
  inherited stderr, next to strag's progress lines; without --verbose their log lines are
  dropped for the duration of a run, and the lines of finished windows get their count and
  an ETA (`Progress`: `[k/N, ETA 3 min 20 s]`). The local Dask cluster's workers start before a run:
  they call `configure_logs` themselves (`dask_setup`, a Dask preload).

--verbose is remembered in the environment (STRAG_VERBOSE=1) so that worker processes and
the subcommands `strag demo` runs see it too.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import threading
import time

__all__ = ["ArgumentParser", "VERBOSE_ENV", "verbose", "set_verbose", "configure_logs", "worker_output", "Progress", "dask_setup"]

VERBOSE_ENV = "STRAG_VERBOSE"
_OURS = frozenset({"strag", "pipelines", "transforms", "dashboards", "schemas", "orchestration"})
_LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def verbose() -> bool:
    """Whether library logs are shown (--verbose given to this command or to the `strag` that started it)."""
    return os.environ.get(VERBOSE_ENV) == "1"


def set_verbose() -> None:
    os.environ[VERBOSE_ENV] = "1"
    configure_logs()


class _Verbose(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False,
                         help="also show the log lines of Apache Beam and the other libraries (off by default)")

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        set_verbose()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) and a --verbose option."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--verbose", action=_Verbose)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


class _OursOrVerbose(logging.Filter):
    """Pass strag's own records; library records only with --verbose, and then from WARNING up."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".", 1)[0] in _OURS:
            return True
        return verbose() and record.levelno >= logging.WARNING


def configure_logs() -> None:
    """Install (once) the root handler that shows strag's log lines and hides the libraries' unless --verbose."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        # logging.basicConfig()'s plain stderr handler (Beam's PipelineOptions installs one when
        # nothing is configured yet) would print every library line past the filter
        if type(handler) is logging.StreamHandler and not handler.filters:
            root.removeHandler(handler)
    if not any(isinstance(f, _OursOrVerbose) for handler in root.handlers for f in handler.filters):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        handler.addFilter(_OursOrVerbose())
        root.addHandler(handler)
    root.setLevel(logging.INFO)


def dask_setup(worker=None) -> None:
    """Dask preload hook (`distributed.worker.preload: [pipelines.usage]`, set by the batch's local
    cluster): the worker process logs through `configure_logs` too. Its stderr is the one the cluster
    inherited before any run, so `worker_output` cannot filter it, and without a root handler Beam's
    import-time `logging.warning` ("apitools not found") would install Python's default one."""
    configure_logs()


# A line Python's default logging format wrote in a child process: "WARNING:root:apitools not found ..."
_CHILD_LOG_LINE = re.compile(rb"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.<>]+:")


# transforms.batch.analyze_jobs.progress_line: "  2024-03-04 job-1: analysed, S 1.023, 347,616 ops, 2.3 s"
_WINDOW_LINE = re.compile(rb"^  \d{4}-\d{2}-\d{2} \S+: ")


class Progress:
    """Numbers the per-window lines the workers print (transforms.batch.analyze_jobs.progress_line) as they
    reach this process: `  [k/N, ETA 3 min 20 s] 2024-03-04 job-1: analysed, ...`. The ETA is the
    windows left at the mean pace so far (wall time since `start`, per window done)."""

    def __init__(self, total: int | None = None):
        self.total, self.done, self._started = total, 0, time.monotonic()
        self._lock = threading.Lock()

    def start(self, total: int) -> None:
        """Count `total` windows from now on."""
        with self._lock:
            self.total, self.done, self._started = total, 0, time.monotonic()

    def __call__(self, line: bytes) -> bytes:
        if self.total is None or not _WINDOW_LINE.match(line):
            return line
        with self._lock:
            self.done += 1
            done, total = self.done, self.total
            elapsed = time.monotonic() - self._started
        left = max(total - done, 0)
        eta = f", ETA {_duration(elapsed / done * left)}" if left else ""
        return f"  [{done}/{total}{eta}]".encode() + line[1:]


def _duration(seconds: float) -> str:
    """A wall time for people: '45 s', '3 min 20 s', '2 h 05 min'."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


@contextlib.contextmanager
def worker_output(progress: Progress | None = None):
    """While the block runs, pass what this process and its children (Beam's workers, started in
    the block) write to stderr through this process: without --verbose their log lines are dropped,
    everything else (strag's progress lines) passes, the per-window lines numbered by `progress`."""
    if verbose() and progress is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    forwarder = threading.Thread(target=_forward, args=(read_end, os.dup(saved), progress or (lambda line: line),
                                                        not verbose()), name="strag-stderr", daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)      # the pipe's last writer in this process goes; children's copies end with them
        os.close(saved)
        forwarder.join(timeout=5)


def _forward(read_end: int, out: int, rewrite, drop_logs: bool) -> None:
    with os.fdopen(read_end, "rb") as lines:
        for line in lines:
            if not (drop_logs and _CHILD_LOG_LINE.match(line)):
                os.write(out, rewrite(line))
    os.close(out)
