"""A small batch end to end: `strag batch` on a few job windows, as a whole command (issue 12 target 4).

    .venv/bin/python benchmarks/bench_small_batch.py [--jobs 6] [--repeats 2] [--work /tmp/strag-bench]

The lake: one day of --jobs generated jobs (at most 400,000 op records each, like `strag demo`),
generated once into --work. Timed, best of --repeats, each a fresh `strag batch` process:

* the default: a run of at most 10 windows goes in-process (pipelines/batch.py `for_run`);
* the baseline, in the same run: `--running-mode multi_processing`, the default before, which
  starts a worker process per core, each importing Beam and Great Expectations.

Prints the wall seconds of both, their ratio, the target (<= 8 s), the start-up breakdown the
run summary prints, and whether both published the same tables byte for byte. The machine is
shared: the load average is printed with the figures.
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import time

from bench_whatif import load, strag_command, subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_SECONDS = 8.0
DATE = "2024-01-01"


def generate(lake: pathlib.Path, jobs: int) -> None:
    if (lake / "_truth").exists():
        print(f"lake: reusing {lake}")
        return
    shutil.rmtree(lake, ignore_errors=True)
    command = [*strag_command(), "generate", "--lake", str(lake), "--days", "1", "--jobs-per-day", str(jobs),
               "--seed", "3", "--bad-fraction", "0", "--max-records", "400000", "--start-date", DATE]
    subprocess.run(command, check=True, capture_output=True, env=subprocess_env(), cwd=ROOT)
    print(f"lake: generated {jobs} jobs into {lake}")


def timed_batch(lake: pathlib.Path, out: pathlib.Path, extra: list[str]) -> tuple[float, str]:
    """(wall seconds, stdout) of one `strag batch` over the lake's day into a fresh `out`."""
    shutil.rmtree(out, ignore_errors=True)
    command = [*strag_command(), "batch", "--lake", str(lake), "--from", DATE, "--to", DATE, "--out", str(out), *extra]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return seconds, done.stdout


def table_files(out: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.parquet"))
            if not str(p.relative_to(out)).startswith("_")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=6, help="job windows in the batch (default 6; the target is for <= 10)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", default="/tmp/strag-bench", help="folder for the lake and the outputs")
    args = parser.parse_args(argv)
    work = pathlib.Path(args.work)
    lake = work / f"lake-small-{args.jobs}"
    generate(lake, args.jobs)
    runs = {"default (in-process)": [], "baseline --running-mode multi_processing": ["--running-mode", "multi_processing"]}
    best: dict[str, tuple[float, str]] = {}
    outs = [work / f"out-small-{index}" for index in range(len(runs))]
    for _ in range(args.repeats):   # alternate, so that both see the same machine load
        for out, (name, extra) in zip(outs, runs.items()):
            seconds, stdout = timed_batch(lake, out, extra)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, stdout)
    print(f"strag batch on {args.jobs} job windows, whole command, best of {args.repeats} ({load()}):")
    for name, (seconds, stdout) in best.items():
        startup = next((line.strip() for line in stdout.splitlines() if line.strip().startswith("start-up")), "")
        print(f"  {name:<42} {seconds:6.1f} s   {startup}")
    ours, baseline = (best[name][0] for name in runs)
    print(f"  ratio {baseline / ours:.1f}x faster; target <= {TARGET_SECONDS:.0f} s: "
          f"{'met' if ours <= TARGET_SECONDS else 'MISSED'}")
    print(f"  same tables byte for byte: {table_files(outs[0]) == table_files(outs[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
