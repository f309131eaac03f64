"""Failing storage against the batch pipeline: runs complete identically or fail loud, nothing lost.

    .venv/bin/python benchmarks/bench_faults.py [--quick] [--runs N] [--rates 0.01,0.05,0.2,0.5]

A generated fleet (the lake read through `faulty://`, tests/faulty_storage.py: every read of a
trace or manifest file fails with probability `rate`, as a connection reset, a timeout, an S3
SlowDown or a permission error, in turn) is analysed many times into an output folder that
already holds the tables of a fault-free run. Per rate it prints: faults injected, runs that
completed, runs that failed loud (exit 1, failure record), rows lost (a completed run whose tables
differ from the fault-free ones: must be 0) and good partitions overwritten (a failed run that
changed a published file: must be 0). The FnApiRunner runs in-process here so that the fault
schedule reaches every read; tests/test_storage_faults.py covers worker processes and S3 through
a fault-injecting proxy.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

KINDS = (ConnectionResetError, TimeoutError, OSError, PermissionError)


def _published(out: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.parquet"))
            if not str(p.relative_to(out)).startswith("_")}


def _run(lake: str, out: pathlib.Path, dates: tuple[str, str]) -> int:
    import contextlib
    import io

    from pipelines import batch

    quiet = io.StringIO()
    with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
        return batch.run(["--lake", f"faulty://{lake}", "--from", dates[0], "--to", dates[1], "--out", str(out),
                          "--running-mode", "in_memory", "--workers", "1", "--quiet"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller fleet and fewer runs")
    parser.add_argument("--runs", type=int, default=None, help="runs per fault rate (default 6, quick 3)")
    parser.add_argument("--rates", default="0.01,0.05,0.2,0.5", help="fault probabilities per read")
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 6)
    rates = [float(r) for r in args.rates.split(",")]
    os.environ.setdefault("STRAG_IO_ATTEMPTS", "4")
    os.environ["STRAG_IO_BACKOFF_S"] = "0.001"   # the schedule, not the clock, is under test

    import logging

    from faulty_storage import Fault, faults, injected
    from pipelines.batch import quiet_logs
    from transforms.synth.fleet import sample_fleet, write_fleet

    quiet_logs()
    logging.getLogger().setLevel(logging.ERROR)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-faults-"))
    try:
        days, per_day = (2, 4) if args.quick else (3, 6)
        specs = sample_fleet(days, per_day, seed=3, max_records=60_000)
        lake = str(work / "lake")
        write_fleet(lake, specs, processes=1)
        dates = (min(s.date for s in specs).isoformat(), max(s.date for s in specs).isoformat())
        reference = work / "reference"
        started = time.perf_counter()
        with faults({}):
            assert _run(lake, reference, dates) == 0, "the fault-free run failed"
        baseline = _published(reference)
        files = sum(1 for _ in pathlib.Path(lake).rglob("*.parquet"))
        print(f"fleet: {len(specs)} job windows over {days} days, {files} parquet files; fault-free run "
              f"{time.perf_counter() - started:.1f} s, {len(baseline)} published files; retries: "
              f"{os.environ['STRAG_IO_ATTEMPTS']} attempts per read")
        print(f"{'rate':>6} {'runs':>5} {'faults':>7} {'completed':>10} {'failed loud':>12} {'rows lost':>10} "
              f"{'good partitions overwritten':>28} {'identical when completed':>25}")
        for rate in rates:
            completed = failed = lost = overwritten = faults_injected = 0
            identical = True
            for run in range(runs):
                out = work / f"out-{rate}-{run}"
                shutil.copytree(reference, out)
                kind = KINDS[run % len(KINDS)]
                schedule = {"/traces/date=": Fault(kind, rate=rate, message="injected"),
                            "/manifests/date=": Fault(kind, rate=rate, message="injected")}
                with faults(schedule, seed=1000 * run + int(rate * 1000)):
                    code = _run(lake, out, dates)
                    faults_injected += len(injected())
                after = _published(out)
                if code == 0:
                    completed += 1
                    if after != baseline:
                        identical = False
                        lost += sum(1 for name in baseline if after.get(name) != baseline[name])
                else:
                    failed += 1
                    overwritten += sum(1 for name in baseline if after.get(name) != baseline[name])
                    if not list((out / "_runs").glob("*.failed.json")):
                        raise SystemExit(f"rate {rate} run {run}: failed without a failure record")
                shutil.rmtree(out)
            print(f"{rate:>6.2f} {runs:>5} {faults_injected:>7} {completed:>10} {failed:>12} {lost:>10} "
                  f"{overwritten:>28} {str(identical):>25}")
        print("rows lost and good partitions overwritten must be 0: a run either publishes exactly the "
              "fault-free tables or fails loud and publishes nothing")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
