"""`strag batch`: the Beam batch job, lake -> validated, analysed, date-partitioned tables.

    strag batch --lake URL --from YYYY-MM-DD --to YYYY-MM-DD --out URL
                [--runner FnApiRunner|DaskRunner|PortableRunner|FlinkRunner|SparkRunner|DataflowRunner]
                [--workers N] [--group N] [--dask-address HOST:PORT] [--dask-partitions N] [--timelines]
                [beam pipeline options ...]

--timelines: each straggling kept window's original and ideal timelines (Chrome-trace JSON for
Perfetto, from the analysis's own replay) go to {out}/_timelines/, published with the tables;
`strag report` links them from the job pages. ~0.5-1.5 s per large straggling window (JSON and
gzip of up to a million events), so off by default.

Wiring only (each step is one composite PTransform from transforms/):

    MatchJobs ─────┬► AnalyzeJobs ─┬────────────────────► CommitTables (single terminal step)
    (listing,      │  (per group of └─► AggregateFleet ──┘  (+ fleet rollups as a finalizer)
     manifests,    │   windows: read or convert, validate
     groups)       │   with one GX screen run, engine per window)
    ConvertRawRanks┘ (big raw Kineto windows: ranks parsed on all workers, assembled per window)

Runners:
- FnApiRunner (default): Beam's embedded runner, named explicitly (the plain DirectRunner of
  this Beam version first tries to download a Prism binary, which fails offline), in
  multi-process mode with --workers processes (default: the machine's cores). A small run
  (at most SMALL_RUN job windows) without --running-mode runs in this process instead: each
  worker process would import Beam, pyarrow and Great Expectations (seconds) for a
  second or two of analysis; in-process, GX is imported once, for the manifests and the
  windows alike. The run summary prints where the start-up time went.
- DaskRunner: the same graph on a dask.distributed cluster (--dask-address; without it a
  local cluster of --workers processes is started, whose workers keep glibc's default
  malloc and run no profiler: `local_dask_cluster`). The Dask runner executes only the last
  leaf of the graph, has no metrics, and Beam's parquet IO does not work on it; this
  pipeline ends in one terminal step (the commit), does its own IO with pyarrow + fsspec in
  DoFns, and carries its counts and timings in its elements. `build` refuses a graph with a
  second terminal step. Its GroupByKey is a task shuffle whose cost grows with the square
  of the partitions, so window groups are dealt into --dask-partitions (default 4 x
  --workers) partitions of equal bytes rather than one partition each. Every Flatten input
  adds its partitions to the shuffles after it, so the graph flattens little: AnalyzeJobs
  quarantines a failing group inside its one ParDo, and the windows' stats reach the commit
  through its partitions' GroupByKey.

Window groups (--group N: about N windows each; default up to 16, in a multiple of --workers
groups, at least 4 per worker; on Dask a multiple of its partitions; more groups where they would
carry over 256 MiB of trace files each, MatchJobs' GROUP_BYTES): a worker validates a group's windows with one Great
Expectations screen run, since GX's cost per run is mostly fixed. Groups carry about equal
bytes, and the FnApiRunner deals them to its workers in turn, so each worker gets as many.
- Portable runners (Flink, Spark, Dataflow): pass their options through (see README).

URLs: local folders, file://, s3:// (credentials only from the environment or fsspec
configuration, never printed), memory:// (in-process only: it forces the in-memory
FnApiRunner and is refused on other runners, whose workers are other processes).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time
import traceback
import uuid

import apache_beam as beam
import fsspec
import pyarrow as pa
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.usage import ArgumentParser, Progress, configure_logs, worker_output
from schemas.fleet import FLEET_TABLE_SPECS
from schemas.expectations import BAD_PARTITION, REASONS
from schemas.tables import BATCH_TABLES, QUARANTINE_SCHEMA, RUNS_DIR, STAGING_DIR, TIMELINES_DIR
from transforms.batch.analyze_jobs import AnalyzeJobs
from transforms.batch.commit import CommitConfig, CommitTables, commit_pending, complete_pending
from transforms.batch.convert_raw import DEFAULT_FANOUT_RANKS, ConvertRawRanks, fan_out
from transforms.batch.elements import TableFragment
from transforms.batch.fleet_stats import AggregateFleet
from transforms.batch.rollups import fleet_rollup_tables
from transforms.io.lake import LakeError, check_lake, list_jobs
from transforms.batch.match import MatchJobs, date_range

__all__ = ["BatchOptions", "BatchUsageError", "parse", "pipeline_options", "dask_chunk", "window_groups", "MAX_GROUP",
           "SMALL_RUN", "for_run", "make_pipeline", "list_lake", "build", "execute", "run", "quiet_logs",
           "check_single_terminal_step", "read_run_summary", "beam_counters", "local_dask_cluster", "RUNNERS"]

DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
RUNNERS = ("FnApiRunner", "DaskRunner", "PortableRunner", "FlinkRunner", "SparkRunner", "DataflowRunner")
_RUNNING_MODES = ("multi_processing", "in_memory", "multi_threading")


class BatchUsageError(ValueError):
    """The command line asks for something the batch job cannot do; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """A validated `strag batch` command line.

    dates: every ISO date of the range; run_id names the staging folder and the run record
    (`{from}_{to}_{random}`); beam_args: the remaining arguments, given to Beam unchanged.
    """

    lake: str
    date_from: str
    date_to: str
    out: str
    runner: str = "FnApiRunner"
    workers: int = 2
    running_mode: str = "multi_processing"
    dask_address: str | None = None
    dask_partitions: int = 0
    group: int | None = None
    fanout_ranks: int = 16
    run_id: str = ""
    beam_args: tuple[str, ...] = ()
    quiet: bool = False
    running_mode_given: bool = False   # --running-mode (or a memory:// URL) chose the mode: keep it
    timelines: bool = False            # --timelines

    @property
    def dates(self) -> tuple[str, ...]:
        return date_range(self.date_from, self.date_to)


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="strag batch",
        description="Validate and analyse every job window of a date range; write Hive-partitioned parquet tables "
                    f"({', '.join(BATCH_TABLES)}, job_cause and the fleet_* tables) under --out, replacing exactly "
                    "the range's date partitions.",
        epilog="Any other --option is passed to Apache Beam (e.g. --flink_master, --environment_type, --setup_file). "
               "`strag batch --resume-publish --out URL` completes a publish a run left unfinished (any run does first).",
    )
    parser.add_argument("--lake", required=True, help="lake URL: folder, file://, s3://bucket/prefix (memory:// in-process only)")
    parser.add_argument("--from", dest="date_from", required=True, metavar="YYYY-MM-DD", help="first date (inclusive)")
    parser.add_argument("--to", dest="date_to", required=True, metavar="YYYY-MM-DD", help="last date (inclusive)")
    parser.add_argument("--out", required=True, help="output URL for the tables (folder, file://, s3://...)")
    parser.add_argument("--runner", default="FnApiRunner", help=f"Beam runner: {', '.join(RUNNERS)} (default FnApiRunner)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="worker processes: FnApiRunner processes, or the local Dask cluster's; with --dask-address "
                             "the cluster's worker count, to size its partitions (default: cores)")
    parser.add_argument("--running-mode", choices=_RUNNING_MODES, default=None,
                        help="FnApiRunner mode (default multi_processing; memory:// URLs need in_memory)")
    parser.add_argument("--group", type=int, default=None,
                        help=f"about this many job windows per group a worker validates with one GX run (default: up "
                             f"to {MAX_GROUP}, at least 4 groups per worker)")
    parser.add_argument("--fanout-ranks", type=int, default=DEFAULT_FANOUT_RANKS,
                        help=f"raw Kineto windows with at least this many rank files are parsed rank by rank on all "
                             f"workers before their analysis (default {DEFAULT_FANOUT_RANKS}); smaller ones by the worker "
                             "that analyses them")
    parser.add_argument("--dask-address", default=None, help="dask.distributed scheduler address (DaskRunner); default: start a local cluster")
    parser.add_argument("--dask-partitions", type=int, default=None,
                        help="DaskRunner: deal the window groups into this many partitions of equal bytes (default 4 x --workers)")
    parser.add_argument("--quiet", action="store_true", help="no line per job window; only the final summary line")
    parser.add_argument("--timelines", action="store_true",
                        help="also write each straggling kept window's original + ideal timeline (Chrome-trace JSON for "
                             "Perfetto) under OUT/_timelines/, for the job pages of `strag report` (~1 s per large window)")
    return parser


def _unknown_options(beam_args: list[str]) -> list[str]:
    """The --options of `beam_args` that no Apache Beam PipelineOptions class declares."""
    from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser

    try:   # the Dask runner declares its options (--dask_npartitions, ...) in its own module
        import apache_beam.runners.dask.dask_runner  # noqa: F401
    except ImportError:
        pass
    class Parser(_BeamArgumentParser):
        def error(self, message):   # a usage error of ours, not a usage dump and an exit
            raise BatchUsageError(f"Apache Beam options: {message}")

    parser = Parser(allow_abbrev=False)
    for cls in {str(c): c for c in PipelineOptions.__subclasses__()}.values():
        cls._add_argparse_args(parser)
    _, unknown = parser.parse_known_args(beam_args)
    return [arg for arg in unknown if arg.startswith("--")]


def _memory(url: str) -> bool:
    return url.startswith("memory://")


def parse(argv: list[str]) -> BatchOptions:
    """Validate a `strag batch` command line. Raises BatchUsageError (or exits for --help)."""
    parser = _parser()
    args, beam_args = parser.parse_known_args(argv)
    unknown = _unknown_options(beam_args)
    if unknown:   # a typo (--wokers) would otherwise reach Beam and be ignored
        import difflib

        ours = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
        close = {name: difflib.get_close_matches(name.split("=", 1)[0], ours, n=1) for name in unknown}
        raise BatchUsageError("unknown option(s) " + ", ".join(
            name + (f" (did you mean {close[name][0]}?)" if close[name] else "") for name in unknown)
            + ": neither strag batch's nor an Apache Beam pipeline option")
    try:
        date_range(args.date_from, args.date_to)
    except ValueError as error:
        raise BatchUsageError(str(error)) from None   # it names the option
    runner = args.runner
    if runner == "DirectRunner":
        raise BatchUsageError("--runner DirectRunner tries to download a Prism binary in this Beam version; use FnApiRunner")
    if runner not in RUNNERS and "." not in runner:
        raise BatchUsageError(f"--runner {runner!r}: use one of {', '.join(RUNNERS)} or a runner's full class path")
    if args.workers < 1:
        raise BatchUsageError(f"--workers {args.workers}: need at least 1")
    in_memory = [url for url in (args.lake, args.out) if _memory(url)]
    running_mode = args.running_mode or "multi_processing"
    if in_memory:
        if runner != "FnApiRunner":
            raise BatchUsageError(f"{in_memory[0]}: memory:// lives inside one process, but {runner} runs workers in other "
                                  "processes; use a folder or s3:// URL")
        if args.running_mode not in (None, "in_memory"):
            raise BatchUsageError(f"{in_memory[0]}: memory:// lives inside one process; --running-mode {args.running_mode} "
                                  "starts worker processes that cannot see it; use --running-mode in_memory or a folder")
        running_mode = "in_memory"
    if (args.dask_address or args.dask_partitions is not None) and runner != "DaskRunner":
        raise BatchUsageError("--dask-address and --dask-partitions only apply to --runner DaskRunner")
    if args.dask_partitions is not None and args.dask_partitions < 1:
        raise BatchUsageError(f"--dask-partitions {args.dask_partitions}: need at least 1")
    if args.group is not None and args.group < 1:
        raise BatchUsageError(f"--group {args.group}: need at least 1")
    if args.fanout_ranks < 1:
        raise BatchUsageError(f"--fanout-ranks {args.fanout_ranks}: need at least 1")
    lake, out = args.lake.rstrip("/"), args.out.rstrip("/")
    _check_lake(lake)
    if out == lake:
        raise BatchUsageError(f"--out {out} is the lake itself; write the tables to their own folder or prefix")
    run_id = f"{args.date_from}_{args.date_to}_{uuid.uuid4().hex[:12]}"
    return BatchOptions(lake, args.date_from, args.date_to, out, runner, args.workers, running_mode, args.dask_address,
                        args.dask_partitions or 4 * args.workers, args.group, args.fanout_ranks, run_id, tuple(beam_args),
                        args.quiet, running_mode_given=args.running_mode is not None or bool(in_memory),
                        timelines=args.timelines)


def _check_lake(lake: str) -> None:
    """A mistyped --lake must not publish empty partitions over real tables: the lake must exist."""
    try:
        check_lake(lake)
    except LakeError as error:
        raise BatchUsageError(str(error)) from None


MAX_GROUP = 16   # windows a group at most: one GX screen run per group (~0.35 s, most of it fixed)
SMALL_RUN = 10   # job windows: a run of at most this many goes in-process (see the module docstring)


def for_run(opts: BatchOptions, windows: int) -> BatchOptions:
    """The options a run of `windows` job windows uses: on the FnApiRunner, with no
    --running-mode given, a small run goes in-process (in_memory, one worker)."""
    if opts.runner != "FnApiRunner" or opts.running_mode_given or windows > SMALL_RUN:
        return opts
    return dataclasses.replace(opts, running_mode="in_memory", workers=1)


def window_groups(opts: BatchOptions, windows: int) -> int:
    """How many groups to deal the windows into: ceil(windows / --group); in-process, as few
    as keeps groups to MAX_GROUP windows (one GX screen run each, nothing runs in parallel);
    else rounded up to a multiple of the workers and at least 4 per worker (so the last
    groups do not leave a worker idle for long), and on the DaskRunner to a multiple of its
    partitions: equal chunks of groups make partitions of equal bytes (a short last chunk
    ends light, having taken big groups while the others still had room)."""
    if windows == 0:
        return 0
    if opts.group is not None:
        return math.ceil(windows / opts.group)
    if opts.running_mode == "in_memory":
        return math.ceil(windows / MAX_GROUP)
    per_worker = max(4, math.ceil(windows / (MAX_GROUP * opts.workers)))
    groups = per_worker * opts.workers
    if dask_chunk(opts, groups) is not None:
        groups = math.ceil(groups / opts.dask_partitions) * opts.dask_partitions
    return min(windows, groups)


def dask_chunk(opts: BatchOptions, groups: int) -> int | None:
    """Window groups per Dask partition (None: not the DaskRunner, or the user set Beam's own
    --dask_npartitions / --dask_partition_size)."""
    if opts.runner != "DaskRunner" or any(a.startswith(("--dask_npartitions", "--dask_partition_size")) for a in opts.beam_args):
        return None
    return max(1, math.ceil(groups / opts.dask_partitions))


def pipeline_options(opts: BatchOptions, windows: int = 0) -> PipelineOptions:
    """Beam PipelineOptions for the chosen runner, plus the pass-through arguments.

    windows: how many job windows the run has (sizes the DaskRunner's partitions).
    """
    groups = window_groups(opts, windows)
    args = list(opts.beam_args)
    if not any(a.startswith("--default_sdk_harness_log_level") for a in args):
        args.append("--default_sdk_harness_log_level=WARNING")  # workers' INFO lines drown the progress output
    if opts.runner == "FnApiRunner":
        args += ["--runner=FnApiRunner", f"--direct_num_workers={opts.workers}", f"--direct_running_mode={opts.running_mode}"]
    elif opts.runner == "DaskRunner":
        args += [f"--runner={DASK_RUNNER}"]
        if opts.dask_address:
            args.append(f"--dask_client_address={opts.dask_address}")
        chunk = dask_chunk(opts, groups)
        if chunk is not None:
            args.append(f"--dask_partition_size={chunk}")
    else:
        args.append(f"--runner={opts.runner}")
    return PipelineOptions(args)


def make_pipeline(opts: BatchOptions, windows: int = 0) -> beam.Pipeline:
    """A Beam Pipeline for `opts` (windows: the run's job windows, see pipeline_options). For
    the FnApiRunner the runner object is made here, so its worker processes get the harness
    log level (by name, they would start with no options and log every gRPC step at INFO)."""
    options = pipeline_options(opts, windows)
    if opts.runner != "FnApiRunner":
        return beam.Pipeline(options=options)
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.runners.portability.fn_api_runner.fn_runner import ExtendedProvisionInfo
    from google.protobuf import struct_pb2

    worker_options = struct_pb2.Struct()
    worker_options.update({"default_sdk_harness_log_level": options.get_all_options()["default_sdk_harness_log_level"]})
    runner = FnApiRunner(provision_info=ExtendedProvisionInfo(beam_provision_api_pb2.ProvisionInfo(pipeline_options=worker_options)))
    return beam.Pipeline(runner=runner, options=options)


def list_lake(opts: BatchOptions) -> tuple[list, list]:
    """The run's one listing of the lake: (job windows of the date range, StrayEntries of the files it could not place)."""
    strays: list = []
    return list_jobs(opts.lake, opts.date_from, opts.date_to, strays=strays), strays


def build(p: beam.Pipeline, opts: BatchOptions, jobs=None, strays=None):
    """Wire the batch pipeline on `p`; returns the PCollection of the run summary (one dict).

    jobs: an already made lake listing for the range (None: listed here); strays: the
    StrayEntries of that listing (files it did not pick up), quarantined with their dates.
    """
    if jobs is None:
        jobs, strays = list_lake(opts)
    big = [job for job in jobs if fan_out(job, opts.fanout_ranks)]
    jobs = [job for job in jobs if not fan_out(job, opts.fanout_ranks)]
    count = window_groups(opts, len(jobs))
    groups = p | "MatchJobs" >> MatchJobs(opts.lake, opts.date_from, opts.date_to, jobs,
                                          chunk=dask_chunk(opts, count), groups=count or None)
    if big:   # big raw windows: their rank files parsed on every worker, then analysed like the rest
        converted = p | "ConvertRawRanks" >> ConvertRawRanks(big)
        groups = (groups, converted) | "WithConvertedWindows" >> beam.Flatten()
    config = CommitConfig(opts.out, opts.dates, opts.run_id, tables={**BATCH_TABLES, **FLEET_TABLE_SPECS},
                          finalizers=(fleet_rollup_tables,))
    outcomes = groups | "AnalyzeJobs" >> AnalyzeJobs(progress=not opts.quiet,
                                                     timelines=config.staging if opts.timelines else None)
    # daily fleet tables + their CombineFn states; the commit rebuilds the rollups from every date's state
    fleet = outcomes | "AggregateFleet" >> AggregateFleet()
    inputs = (outcomes, fleet)
    stray_rows = stray_quarantine(strays or [], opts.dates)
    if stray_rows:   # files the listing could not place: quarantined, never skipped in silence
        inputs += (p | "ListStrayFiles" >> beam.Create(stray_rows),)
    summary = inputs | "CommitTables" >> CommitTables(config)
    check_single_terminal_step(p)
    return summary


def stray_quarantine(strays, dates) -> list[TableFragment]:
    """Quarantine rows of the stray entries, one fragment per date of `dates` that has some.

    A stray without a date (a partition folder whose name is no date, e.g. `date=2026-13-45`) belongs
    to no partition of the quarantine table, yet it hides its files from every date: it is quarantined
    in every date of the run, so whichever date a reader looks at says so, and the partitions a run
    publishes do not depend on how a backfill cut its range into runs."""
    by_date: dict[str, list] = {}
    for entry in strays:
        for date in (dates if entry.date is None else [entry.date] if entry.date in dates else []):
            by_date.setdefault(date, []).append(entry)
    out = []
    for date, entries in sorted(by_date.items()):
        rows = pa.Table.from_pylist(
            [{"job_id": None, "source_path": e.path, "level": REASONS[e.reason][0], "reason_code": e.reason,
              "reason": REASONS[e.reason][1], "detail": e.detail, "rows": None} for e in entries],
            schema=QUARANTINE_SCHEMA)
        out.append(TableFragment("quarantine", date, rows))
    return out


def check_single_terminal_step(p: beam.Pipeline) -> None:
    """Refuse a graph with more than one terminal step: the DaskRunner would silently skip all but the last."""
    consumed, leaves = set(), []

    class _Visitor(beam.pipeline.PipelineVisitor):
        def visit_transform(self, node):
            leaves.append(node)
            consumed.update(id(pcoll) for pcoll in node.inputs)
            consumed.update(id(side.pvalue) for side in node.side_inputs)

    p.visit(_Visitor())
    terminal = [n.full_label for n in leaves if not any(id(o) in consumed for o in n.outputs.values())]
    if len(terminal) > 1:
        raise ValueError(f"the batch graph has {len(terminal)} terminal steps {terminal}: the DaskRunner executes only the "
                         "last one; route every output into CommitTables")


def quiet_logs() -> None:
    """Keep Beam's, GX's and Dask's log lines out of the progress output (unless --verbose)."""
    configure_logs()


def local_dask_cluster(workers: int):
    """A local dask.distributed cluster for the batch: `workers` processes of one thread each
    (the analysis holds the GIL), no dashboard.

    Its workers keep glibc's default malloc tuning. Dask's nannies set MALLOC_TRIM_THRESHOLD_
    in their workers' environment, and setting any malloc threshold turns off glibc's dynamic
    mmap threshold: every array over 128 KiB then becomes a fresh mmap, page-faulted in and
    unmapped again (5x the page faults, the engine ~40% slower: benchmarks/bench_batch.py).
    Nor do they run Dask's statistical profiler, which samples the running task's stack every
    10 ms for a dashboard this cluster does not have (~7% of the workers' CPU).
    """
    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                          "distributed.worker.profile.enabled": False,
                          "distributed.worker.preload": ["pipelines.usage"]}):   # library logs only with --verbose
        return LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)


def read_run_summary(opts: BatchOptions) -> dict:
    fs, root = fsspec.core.url_to_fs(f"{opts.out}/{RUNS_DIR}/{opts.run_id}.json")
    return json.loads(fs.cat_file(root))


def beam_counters(result) -> dict[str, int]:
    """Beam counters when the runner has metrics (not on Dask)."""
    try:
        queried = result.metrics().query()
    except (NotImplementedError, AttributeError):
        return {}
    totals: dict[str, int] = {}
    for counter in queried["counters"]:  # one result per step: the same counter bumped in several steps adds up
        if counter.key.metric.namespace.startswith("strag"):
            name = f"{counter.key.metric.namespace}/{counter.key.metric.name}"
            totals[name] = totals.get(name, 0) + counter.committed
    return totals


def _print_summary(opts: BatchOptions, summary: dict, counters: dict[str, int], seconds: float) -> None:
    jobs = summary["jobs"]
    total = sum(jobs.values())
    print(f"strag batch {opts.date_from}..{opts.date_to} on {opts.runner}: {total} job windows in {seconds:.1f} s "
          f"({', '.join(f'{n} {s}' for s, n in jobs.items()) or 'none found'}); {summary['ops']:,} ops analysed")
    if opts.quiet:
        return
    if summary["reasons"]:
        print(_wrapped("  reasons (job windows discarded or quarantined, by the reason of each):",
                       [f"{code} {n}" for code, n in summary["reasons"].items()]))
    if summary["rows_quarantined"]:
        print(f"  op rows quarantined: {summary['rows_quarantined']:,} of {summary['rows_read']:,} read")
    where = "in this process" if summary.get("running_mode") == "in_memory" else None
    print("  start-up and run (wall s): " + ", ".join(f"{name} {value:.1f}" for name, value in summary["startup"].items())
          + (f" ({where})" if where else ""))
    print("  seconds in workers: " + ", ".join(f"{k} {v:.1f}" for k, v in summary["seconds"].items() if v))
    shown = {k: v for k, v in sorted(counters.items()) if not k.startswith("strag.tables/")}   # the tables line says those
    if shown:
        print(_wrapped("  counters (jobs/* count job windows, ops/* op records, quarantine/* quarantine rows):",
                       [f"{k.removeprefix('strag.')}={v:,}" for k, v in shown.items()]))
    print(_wrapped(f"  tables under {opts.out}/ (rows):", [f"{t} {n:,}" for t, n in summary["table_rows"].items()]))
    if opts.timelines:
        print(f"  timelines: {summary['timelines']} (straggling kept windows) under {opts.out}/{TIMELINES_DIR}/")
    print(f"  run record: {opts.out}/{RUNS_DIR}/{opts.run_id}.json")


def _wrapped(head: str, items: list[str], width: int = 100) -> str:
    """`head`, then the items comma-separated on lines of at most `width` characters, indented."""
    import textwrap

    return head + "\n" + textwrap.fill(", ".join(items), width, initial_indent="    ", subsequent_indent="    ",
                                       break_on_hyphens=False)


def execute(opts: BatchOptions, jobs=None, strays=None, progress: Progress | None = None) -> tuple[dict, dict[str, int]]:
    """Build and run the pipeline for parsed options; wait for it. Returns (run summary, Beam
    counters: empty on runners without metrics). jobs, strays: a lake listing already made, or None.
    progress: numbers the per-window lines (k/N, ETA) from the pipeline's start.

    The summary also holds `startup`: wall seconds of this process's steps before and around
    the pipeline (listing, Great Expectations import, graph build with the manifest checks,
    the pipeline itself), and `running_mode` (a small run goes in-process: `for_run`)."""
    startup: dict[str, float] = {}
    clock = time.perf_counter()
    if jobs is None:
        jobs, strays = list_lake(opts)
        startup["lake listing"] = time.perf_counter() - clock
    opts = for_run(opts, len(jobs))
    clock = time.perf_counter()
    import great_expectations  # noqa: F401 - here, to time it: the manifest checks of the graph build need it

    startup["Great Expectations import"] = time.perf_counter() - clock
    clock = time.perf_counter()
    p = make_pipeline(opts, len(jobs))
    build(p, opts, jobs, strays)
    startup["graph build + manifest checks"] = time.perf_counter() - clock
    clock = time.perf_counter()
    with worker_output(progress):
        if progress is not None:
            progress.start(len(jobs))
        result = p.run()
        try:
            result.wait_until_finish()
        finally:
            client = getattr(result, "client", None)  # the Dask runner's client: close before its cluster goes
            if client is not None:
                client.close()
    startup["pipeline"] = time.perf_counter() - clock
    summary = read_run_summary(opts)
    summary.update(startup=startup, running_mode=opts.running_mode if opts.runner == "FnApiRunner" else None)
    return summary, beam_counters(result)


def _seconds_since_process_start() -> float | None:
    """Wall seconds since this process started: Python and the imports before `run` (Linux; None elsewhere)."""
    try:
        fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def run(argv: list[str]) -> int:
    """Parse, build and run; print a summary. Returns 0 on success, 2 on a usage error."""
    if "--resume-publish" in argv:
        return resume_publish(argv)
    try:
        opts = parse(argv)
    except BatchUsageError as error:
        print(f"strag batch: {error}", file=sys.stderr)
        return 2
    quiet_logs()
    progress = None if opts.quiet else Progress()
    workers_output = contextlib.ExitStack()
    cluster = None
    if opts.runner == "DaskRunner" and not opts.dask_address:
        # its workers write to the stderr they start with: their log lines dropped, window lines numbered
        workers_output.enter_context(worker_output(progress))
        cluster = local_dask_cluster(opts.workers)
        opts = dataclasses.replace(opts, dask_address=cluster.scheduler_address)
    imports = _seconds_since_process_start()
    started = time.perf_counter()
    try:
        try:   # a publish an earlier run left unfinished is completed before anything else
            completed = complete_pending(opts.out, by=opts.run_id)
            jobs, strays = list_lake(opts)
        except OSError as error:   # storage failed for good (transforms/io/storage.py): this run published nothing
            return _report_failure(opts, error)
        for run_id in completed:
            print(f"strag batch: completed the publish of run {run_id}, interrupted earlier "
                  f"(its record: {opts.out}/{RUNS_DIR}/{run_id}.json)", file=sys.stderr)
        listing = time.perf_counter() - started
        opts = for_run(opts, len(jobs))
        undated = [entry for entry in strays if entry.date is None]
        if undated:   # no date partition to quarantine them in: said here, every run
            print(f"strag batch: {len(undated)} folder(s) of the lake are not date partitions and are not read "
                  f"(quarantined as {BAD_PARTITION} in each date of the run): "
                  + "; ".join(entry.detail for entry in undated[:5]) + (" ..." if len(undated) > 5 else ""),
                  file=sys.stderr)
        if not jobs:   # a range the lake has nothing for: say what it has (every run, --quiet too)
            print(f"strag batch: no job windows in {opts.lake} for {opts.date_from}..{opts.date_to}; "
                  f"{_dates_held(opts.lake)}; publishing empty partitions for the range", flush=True)
        elif not opts.quiet:
            mode = "" if opts.runner != "FnApiRunner" else (
                " in this process" + ("" if opts.running_mode_given else f" (a small run: at most {SMALL_RUN} windows)")
                if opts.running_mode == "in_memory" else f", {opts.workers} {opts.running_mode.replace('_', '-')} workers")
            print(f"strag batch: {len(jobs)} job windows in {opts.lake} for {opts.date_from}..{opts.date_to}; "
                  f"running on {opts.runner}{mode}", flush=True)
        try:
            summary, counters = execute(opts, jobs, strays, progress)
        except Exception as error:   # the run failed: say why, record it, publish nothing
            return _report_failure(opts, error)
        summary["startup"] = {**({"Python + imports": imports} if imports is not None else {}), "lake listing": listing,
                              **summary["startup"]}
        _print_summary(opts, summary, counters, time.perf_counter() - started)
    finally:
        if cluster is not None:
            cluster.close()
        workers_output.close()
    return 0


def _dates_held(lake: str) -> str:
    """What dates the lake holds, in a few words (for a range that found no job windows)."""
    from transforms.io.lake import lake_dates

    dates = lake_dates(lake)
    if not dates:
        return "the lake holds no date partition yet"
    if len(dates) <= 4:
        return f"the lake has data on {', '.join(dates)}"
    return f"the lake has data on {len(dates)} dates from {dates[0]} to {dates[-1]}"


def _report_failure(opts: BatchOptions, error: BaseException) -> int:
    """Record a failed run, say on stderr why and what was published; exit code 1."""
    record = record_failure(opts, error)
    if record.get("publish") == "recorded":
        what = ("FAILED while publishing; its commit is recorded and the next strag batch on this --out completes it "
                f"(or now: strag batch --resume-publish --out {opts.out})")
    elif record.get("publish") == "unknown":   # the storage failed even to say
        what = ("FAILED; storage failing, so whether its publish began is unknown: if it did, the next strag batch "
                f"on this --out (or strag batch --resume-publish --out {opts.out}) completes it")
    else:
        what = "FAILED, nothing published (the tables are as before)"
    print(f"strag batch {opts.date_from}..{opts.date_to}: {what}: "
          f"{record['reason']}\n  failure record: {opts.out}/{RUNS_DIR}/{opts.run_id}.failed.json", file=sys.stderr)
    return 1


def resume_publish(argv: list[str]) -> int:
    """`strag batch --resume-publish --out URL`: complete the publishes that runs left unfinished
    (killed, or storage failing for good, after their commit record); analyse nothing."""
    parser = ArgumentParser(prog="strag batch --resume-publish",
                            description="Complete every publish under --out that a run left unfinished.")
    parser.add_argument("--resume-publish", action="store_true", required=True)
    parser.add_argument("--out", required=True, help="output URL of the tables")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    out = args.out.rstrip("/")
    quiet_logs()
    try:
        completed = complete_pending(out)
    except OSError as error:
        print(f"strag batch --resume-publish: FAILED: {error}", file=sys.stderr)
        return 1
    if not completed:
        print(f"strag batch --resume-publish: nothing to complete under {out}")
    for run_id in completed:
        print(f"strag batch --resume-publish: completed the publish of run {run_id} (its record: {out}/{RUNS_DIR}/{run_id}.json)")
    return 0


_STORAGE_ERROR = re.compile(r"storage error \w+ [^\n]*?(?= nothing was quarantined|$)", re.MULTILINE)


def record_failure(opts: BatchOptions, error: BaseException) -> dict:
    """Write `{out}/_runs/{run_id}.failed.json` (what failed and why), drop the run's staging folder
    unless the run recorded its commit (then `publish` is "recorded": the staging is what the next run
    or --resume-publish completes the publish from), and return the record. A storage error
    (transforms/io/storage.py) is named by its file."""
    text = "".join(traceback.format_exception(error))
    storage = [match.group(0).rstrip(" ;") for match in _STORAGE_ERROR.finditer(text)]
    reason = storage[0] if storage else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    record = {"run_id": opts.run_id, "status": "failed", "dates": list(opts.dates), "lake": opts.lake,
              "reason": reason, "storage_errors": sorted(set(storage)), "error": text[-4000:], "publish": "unknown"}
    try:
        fs, root = fsspec.core.url_to_fs(f"{opts.out}/{RUNS_DIR}/{opts.run_id}.failed.json")
        fs.makedirs(root.rsplit("/", 1)[0], exist_ok=True)
        record["publish"] = "recorded" if commit_pending(opts.out, opts.run_id) else "none"
        fs.pipe_file(root, json.dumps(record, indent=2).encode())
        staging, staging_root = fsspec.core.url_to_fs(f"{opts.out}/{STAGING_DIR}/{opts.run_id}")
        if record["publish"] == "none" and staging.exists(staging_root):
            staging.rm(staging_root, recursive=True)
    except OSError as write_error:   # the storage may be what failed: the message on stderr still says why
        record["record_not_written"] = f"{type(write_error).__name__}: {write_error}"
    return record
