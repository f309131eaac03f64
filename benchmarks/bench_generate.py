"""Speed of the synthetic fleet generator (prints figures; not a timed test).

    .venv/bin/python benchmarks/bench_generate.py            # single big job + 30-day fleet
    .venv/bin/python benchmarks/bench_generate.py --job-only # just the 4,096-GPU job

1. One 4,096-GPU job (dp 64 x pp 8 x tp 8, 32 microbatches, 40 sampled steps in 4
   sessions), generated and serialised to parquet in this process (one core):
   target < 30 s.
2. A 30-day fleet of 20 jobs a day (600 jobs, sample_fleet defaults: jobs capped at
   2,000,000 op records) written to a local lake with all CPU cores: target < 10 min.
"""
from __future__ import annotations

import argparse
import io
import os
import pathlib
import shutil
import sys
import tempfile
import time

import pyarrow.parquet as pq

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from transforms.synth import JobSpec, generate_job, sample_fleet, write_fleet  # noqa: E402


def bench_job() -> float:
    spec = JobSpec(job_id="bench-4096", dp=64, pp=8, tp=8, microbatches=32, steps=40, sessions=4, seed=1)
    started = time.perf_counter()
    job = generate_job(spec)
    generated = time.perf_counter() - started
    size = 0
    for _, table in job.files():
        buffer = io.BytesIO()
        pq.write_table(table, buffer, compression="zstd", write_page_checksum=True)
        size += buffer.tell()
    total = time.perf_counter() - started
    rows = job.trace.num_rows
    print(f"4,096-GPU job (dp 64, pp 8, tp 8, 32 microbatches, 40 steps): {rows:,} ops")
    print(f"  generate {generated:.2f} s ({rows / generated:,.0f} ops/s); + parquet {total - generated:.2f} s "
          f"({size / 1e6:.0f} MB); total {total:.2f} s (target < 30 s): {'OK' if total < 30 else 'TOO SLOW'}")
    return total


def bench_fleet(days: int, jobs_per_day: int, processes: int | None, keep: str | None) -> float:
    specs = sample_fleet(days, jobs_per_day, seed=2024)
    root = keep or tempfile.mkdtemp(prefix="strag-bench-fleet-")
    lake = str(pathlib.Path(root) / "lake")
    print(f"fleet: {len(specs)} jobs, {sum(s.world_size for s in specs):,} GPUs, "
          f"{processes or os.cpu_count()} processes, lake {lake}")
    try:
        summary = write_fleet(lake, specs, bad_fraction=0.05, seed=2024, processes=processes)
        size = sum(p.stat().st_size for p in pathlib.Path(lake).rglob("*.parquet"))
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"  {summary.jobs} jobs ({summary.bad_jobs} bad), {summary.records:,} ops, {size / 1e9:.2f} GB, "
          f"{summary.seconds:.0f} s ({summary.records / summary.seconds:,.0f} ops/s) "
          f"(target < 600 s): {'OK' if summary.seconds < 600 else 'TOO SLOW'}")
    return summary.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job-only", action="store_true", help="only the 4,096-GPU job")
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--jobs-per-day", type=int, default=20)
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--keep", default=None, help="write the fleet lake under this folder and keep it")
    opts = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    bench_job()
    if not opts.job_only:
        bench_fleet(opts.days, opts.jobs_per_day, opts.processes, opts.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
