"""`strag generate`: write a synthetic fleet with ground truth into a lake.

    strag generate --lake URL --days D --jobs-per-day N --seed S
                   [--start-date YYYY-MM-DD] [--bad-fraction F] [--processes P] [--max-records R]

Jobs come from transforms.synth (Megatron-style execution model with injected root
causes); the answer key goes to {lake}/_truth/truth.parquet.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys

from pipelines.cli import date_argument
from pipelines.usage import ArgumentParser

__all__ = ["parse", "run"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {value}")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse and validate the command line (raises SystemExit with a message on bad arguments)."""
    parser = ArgumentParser(
        prog="strag generate",
        description="Write a synthetic fleet (traces, manifests, truth table) into a lake. "
                    "Jobs have 128 to 6,144 GPUs; a job's trace is capped at --max-records op records "
                    "(fewer sampled steps, then fewer microbatches) so the fleet stays bounded.")
    parser.add_argument("--lake", required=True, help="lake URL: folder, file://, memory:// or s3://")
    parser.add_argument("--days", type=_positive, required=True, help="number of days (date partitions)")
    parser.add_argument("--jobs-per-day", type=_positive, required=True, help="jobs starting each day")
    parser.add_argument("--seed", type=int, required=True, help="fleet seed (same seed: byte-identical lake)")
    parser.add_argument("--start-date", type=date_argument, default=dt.date(2024, 1, 1),
                        help="first date, YYYY-MM-DD (default 2024-01-01)")
    parser.add_argument("--bad-fraction", type=_fraction, default=0.05,
                        help="fraction of jobs written as bad input (default 0.05)")
    parser.add_argument("--processes", type=_positive, default=None,
                        help="worker processes (default: CPU count; memory:// lakes use one)")
    parser.add_argument("--max-records", type=_positive, default=2_000_000,
                        help="cap on op records per job (default 2,000,000)")
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    """Sample the fleet, generate and write it; print progress and a summary."""
    opts = parse(argv)
    from pipelines.owned import NotOurs, claim, record

    try:   # a synthetic fleet goes only into a lake of its own, never mixed into a real one
        claim(opts.lake, "generate", exclusive=True)
    except NotOurs as error:
        print(f"strag generate: {error}", file=sys.stderr)
        return 2
    try:
        return _generate(opts)
    finally:   # what it wrote, even when it failed part-way, is generate's: a rerun may write there again
        record(opts.lake, "generate")


def _generate(opts: argparse.Namespace) -> int:
    from transforms.synth.fleet import sample_fleet, write_fleet

    specs = sample_fleet(opts.days, opts.jobs_per_day, opts.seed, opts.start_date, max_records=opts.max_records)
    total_gpus = sum(s.world_size for s in specs)
    print(f"strag generate: {len(specs)} jobs ({total_gpus:,} GPUs) over {opts.days} day(s) into {opts.lake}",
          flush=True)
    step = max(1, len(specs) // 20)

    def progress(done: int, total: int, row: dict, seconds: float) -> None:
        if done % step == 0 or done == total:
            bad = f", bad: {row['bad_kind']}" if row["bad_kind"] else ""
            print(f"  {done}/{total} {row['job_id']} ({row['gpus']} GPUs, {row['records']:,} ops, "
                  f"{seconds:.1f}s{bad})", flush=True)

    summary = write_fleet(opts.lake, specs, bad_fraction=opts.bad_fraction, seed=opts.seed,
                          processes=opts.processes, progress=progress)
    print(f"wrote {summary.jobs} jobs ({summary.bad_jobs} bad), {summary.records:,} op records in "
          f"{summary.seconds:.1f}s ({summary.records / max(summary.seconds, 1e-9):,.0f} ops/s)\n"
          f"  traces:    {opts.lake.rstrip('/')}/traces/date=*/job_id=*/part-*.parquet\n"
          f"  manifests: {opts.lake.rstrip('/')}/manifests/date=*/*.parquet\n"
          f"  truth:     {summary.truth_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
