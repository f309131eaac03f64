"""`strag demo`: the whole product on the embedded default, in one command.

    strag demo [--lake ./demo-lake] [--out ./demo-out] [--days 7] [--jobs-per-day 5] [--seed 7]

1. generates a small fleet (a week, a few dozen jobs of mixed root causes, some bad files)
   into a local lake folder,
2. runs the batch pipeline over it on Beam's FnApiRunner (both cores), with the Perfetto
   timelines of its straggling windows (--timelines),
3. builds the fleet report and the per-job pages from the output tables,
4. prints where everything went and a short fleet summary read back from the tables.
"""
from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import shutil
import sys

import pyarrow.compute as pc
import pyarrow.dataset as ds

from pipelines.cli import date_argument
from pipelines.usage import ArgumentParser, configure_logs
from transforms.whatif.result import STRAGGLING_THRESHOLD

__all__ = ["parse", "run", "fleet_summary"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="strag demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lake", default="demo-lake", help="lake folder to (re)generate (default ./demo-lake): a new or "
                        "empty folder, or one the demo made; any other is refused, never deleted")
    parser.add_argument("--out", default="demo-out", help="folder for tables and reports (default ./demo-out)")
    parser.add_argument("--days", type=int, default=7, help="days of fleet (default 7)")
    parser.add_argument("--jobs-per-day", type=int, default=5, help="jobs starting each day (default 5)")
    parser.add_argument("--seed", type=int, default=7, help="fleet seed (default 7)")
    parser.add_argument("--start-date", type=date_argument, default=dt.date(2024, 3, 4), help="first date (default 2024-03-04)")
    parser.add_argument("--bad-fraction", type=float, default=0.1, help="share of jobs written as bad input")
    parser.add_argument("--max-records", type=int, default=400_000,
                        help="cap on op records per job, keeps the demo to a few minutes (default 400,000)")
    args = parser.parse_args(argv)
    if args.days < 1 or args.jobs_per_day < 1:
        parser.error("--days and --jobs-per-day must be >= 1")
    return args


def fleet_summary(tables: str) -> list[str]:
    """Lines summarising the fleet from the output tables alone (job_summary, coverage, quarantine)."""
    jobs, coverage = _read(tables, "job_summary"), _read(tables, "coverage")
    kept = jobs.filter(pc.invert(jobs["discarded"]))
    gpu_hours = pc.sum(kept["gpu_hours"]).as_py() or 0.0
    wasted = pc.sum(kept["wasted_gpu_hours"]).as_py() or 0.0
    straggling = pc.sum(kept["straggling"].cast("int64")).as_py() or 0
    lines = [
        f"jobs found: {coverage.num_rows}; "
        + ", ".join(f"{row['status']}: {row['count']}" for row in coverage.group_by("status").aggregate([("job_id", "count")])
                    .rename_columns(["status", "count"]).to_pylist()),
        f"straggling (S >= {STRAGGLING_THRESHOLD:g}): {straggling} of {kept.num_rows} analysed jobs",
        f"GPU-hours: {gpu_hours:,.0f}, wasted to stragglers: {wasted:,.0f} ({wasted / gpu_hours:.1%})" if gpu_hours else "",
    ]
    verdicts = _read(tables, "job_cause")
    kept_verdicts = verdicts.filter(pc.invert(pc.fill_null(verdicts["discarded"], False)))   # as the fleet statistics count
    straggling_verdicts = kept_verdicts.filter(pc.greater_equal(kept_verdicts["slowdown"], STRAGGLING_THRESHOLD))
    causes = straggling_verdicts.group_by("cause").aggregate([("job_id", "count"), ("slowdown", "mean")])
    for row in sorted(causes.to_pylist(), key=lambda r: -r["job_id_count"]):
        lines.append(f"  root cause {row['cause']:<26} {row['job_id_count']:>3} jobs, mean S {row['slowdown_mean']:.2f}")
    worst = kept.sort_by([("wasted_gpu_hours", "descending")]).slice(0, 3).to_pylist()
    for row in worst:
        lines.append(f"  worst: {row['job_id']} ({row['gpus']} GPUs) S={row['slowdown']:.3f} "
                     f"wasted {row['wasted_gpu_hours']:,.0f} GPU-h")
    return [line for line in lines if line]


def _read(tables: str, name: str):
    return ds.dataset(f"{tables}/{name}", format="parquet", partitioning="hive").to_table()


def run(argv: list[str]) -> int:
    from pipelines.owned import NotOurs, claim, record

    args = parse(argv)
    configure_logs()   # Beam's worker start-up chatter would hide the demo's own output
    lake, out = pathlib.Path(args.lake).resolve(), pathlib.Path(args.out).resolve()
    # The demo regenerates its lake from scratch so that the fleet is the one described, and writes its
    # tables: only into folders it made (pipelines/owned.py), never a real lake or tables it did not make;
    # the lake it deletes only while it holds nothing but what the demo wrote (no job imported into it since)
    try:
        claim(str(lake), "demo", exclusive=True)
        claim(str(out), "demo")
    except NotOurs as error:
        print(f"strag demo: {error}", file=sys.stderr)
        return 2
    shutil.rmtree(lake)
    claim(str(lake), "demo")
    try:
        return _steps(args, lake, out)
    finally:   # whatever the steps left in the lake is the demo's, even when one failed
        record(str(lake), "demo")


def _steps(args: argparse.Namespace, lake: pathlib.Path, out: pathlib.Path) -> int:
    """generate, batch, report, then the summary; the exit code of the first step that fails."""
    from pipelines import batch, generate, report

    start = args.start_date
    end = start + dt.timedelta(days=args.days - 1)
    steps = [
        ("generate", generate.run, ["--lake", str(lake), "--days", str(args.days), "--jobs-per-day", str(args.jobs_per_day),
                                    "--seed", str(args.seed), "--start-date", start.isoformat(),
                                    "--bad-fraction", str(args.bad_fraction), "--max-records", str(args.max_records)]),
        ("batch", batch.run, ["--lake", str(lake), "--from", start.isoformat(), "--to", end.isoformat(), "--out", str(out),
                              "--timelines"]),
        ("report", report.run, ["--tables", str(out), "--out", str(out / "_reports")]),
    ]
    for name, step, step_argv in steps:
        print(f"\n== strag {name} {' '.join(step_argv)}", flush=True)
        code = step(step_argv)
        if code:
            print(f"strag demo: `strag {name}` failed with exit code {code}", file=sys.stderr)
            return code
    print("\n== fleet summary (from the tables)")
    for line in fleet_summary(str(out)):
        print(line)
    print(f"\nlake:    {lake}\ntables:  {out}/<table>/date=YYYY-MM-DD/*.parquet\n"
          f"report:  {out / '_reports' / 'index.html'} (opens offline)\n"
          f"job pages: {out / '_reports' / 'jobs'}/")
    return 0
