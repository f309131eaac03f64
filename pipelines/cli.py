"""`strag`: one console script, one subcommand per module.

Each subcommand module exposes ``run(argv: list[str]) -> int`` and parses its own
arguments (``--help`` on each). Modules are imported lazily so that, for example,
``strag analyze`` never imports Apache Beam.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datetime as dt

# Process settings numpy reads at import (OPENBLAS_NUM_THREADS, NUMPY_MADVISE_HUGEPAGE) are set by
# the `pipelines` package, imported before this module.

__all__ = ["main", "console", "COMMANDS", "date_argument"]

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("pipelines.generate", "write a synthetic fleet with ground truth into a lake"),
    "import-reference": ("pipelines.reference", "import a published trace (parquet + meta yaml) as a lake job"),
    "export-reference": ("pipelines.reference", "export a lake job in the published format"),
    "import": ("pipelines.ingest", "convert one job's raw profiler output (kineto, ndtimeline) into a lake job"),
    "land": ("pipelines.land", "copy torch.profiler traces on disk into the lake's raw landing (raw/kineto)"),
    "export": ("pipelines.export", "export a lake job as raw profiler output (--format ndtimeline)"),
    "analyze": ("pipelines.analyze", "what-if analysis of one job (no Beam)"),
    "batch": ("pipelines.batch", "Beam batch job: lake -> validated, analysed, partitioned tables"),
    "report": ("pipelines.report", "fleet report and per-job pages from the tables"),
    "watch": ("pipelines.streaming", "streaming monitor of the lake's landing area"),
    "serve": ("pipelines.serve", "serve the live per-job monitor pages on localhost"),
    "demo": ("pipelines.demo", "generate a small fleet, run the batch job and the report"),
}
# Commands whose process has nothing left to do once their output is flushed: no worker
# processes, servers, temporary files or atexit work. The `strag` script ends them with
# os._exit instead of the interpreter's teardown, which frees every module numpy and pyarrow
# loaded (~40 ms of the ~0.35 s `strag analyze` takes on the published AR trace).
QUICK_EXIT = frozenset({"analyze"})


def date_argument(text: str) -> dt.date:
    """argparse type of every YYYY-MM-DD option of the subcommands."""
    import datetime as dt   # here: `strag analyze` on a file never needs it

    try:
        return dt.date.fromisoformat(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date YYYY-MM-DD ({error})") from None


def _version() -> str:
    """The installed strag's version (its package metadata), or 'unknown' when run from a bare checkout."""
    from importlib import metadata

    try:
        return metadata.version("strag")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: strag COMMAND [--help] [--verbose] [ARGS...]", "       strag --version", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "--verbose (any command): also show the log lines of Apache Beam and the other libraries"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"strag {_version()}")
        return 0
    if not argv:   # a command is required: say which there are, and fail like any usage error
        print(f"strag: give a command\n\n{_usage()}", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"strag: unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    from pipelines.usage import configure_logs, set_verbose

    if "--verbose" in rest:   # before the import: Beam logs warnings as it is imported
        set_verbose()
    configure_logs()
    module = importlib.import_module(COMMANDS[name][0])
    run = getattr(module, "run_" + name.replace("-", "_"), None) or module.run
    try:
        return int(run(rest) or 0)
    except BrokenPipeError:   # `strag analyze ... | head`: the reader is gone, nothing to report to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # Python's flush at exit would fail again
        return 141                                                     # what a shell reports for SIGPIPE


def console() -> None:
    """The `strag` script: `main` on sys.argv, then exit with its code (without the
    interpreter's teardown for the QUICK_EXIT commands, once stdout and stderr are flushed)."""
    code = main()
    if sys.argv[1:2] and sys.argv[1] in QUICK_EXIT:
        try:
            sys.stdout.flush()
        except BrokenPipeError:   # the reader left after the last write
            code = 141
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
