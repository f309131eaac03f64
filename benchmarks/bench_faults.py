"""Failing storage against the batch pipeline: runs complete identically or fail loud, nothing lost.

    .venv/bin/python benchmarks/bench_faults.py [--quick] [--runs N] [--rates 0.01,0.05,0.2,0.5] [--storage local,s3]

A generated fleet is analysed many times into an output location that already holds the tables
of a fault-free run, while reads of trace and manifest files fail with probability `rate`:

- local: the lake read through `faulty://` (tests/faulty_storage.py), each failing read raising a
  connection reset, a timeout, an OSError or a permission error, in turn by run. The FnApiRunner
  runs in-process so that the fault schedule reaches every read.
- s3: the lake and the output on a moto S3 server reached through an HTTP proxy on 127.0.0.1
  (tests/fault_proxy.py) that answers failing GETs with S3's 503 SlowDown, a 500, a reset
  connection or half a body, in turn by run; botocore's own retries are off
  (AWS_MAX_ATTEMPTS=1) so the IO layer's are what is measured; two worker processes.

Per storage and rate it prints: faults injected, runs that completed, runs that failed loud (exit
1, failure record), rows lost (a completed run whose tables differ from the fault-free ones: must
be 0) and good partitions overwritten (a failed run that changed a published file: must be 0).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

LOCAL_KINDS = (ConnectionResetError, TimeoutError, OSError, PermissionError)
S3_KINDS = ("throttle", "error", "reset", "partial")
FAULTED = ("/traces/date=", "/manifests/date=")


def _batch(lake: str, out: str, dates: tuple[str, str], extra: list[str]) -> int:
    from pipelines import batch

    quiet = io.StringIO()
    with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
        return batch.run(["--lake", lake, "--from", dates[0], "--to", dates[1], "--out", out, "--quiet", *extra])


class LocalStorage:
    """The lake read through faulty:// in this process; outputs in a local folder."""

    name = "local"

    def __init__(self, lake: str, work: pathlib.Path):
        import faulty_storage  # noqa: F401  (registers faulty://)

        self.lake, self.work = lake, work

    @contextlib.contextmanager
    def faults(self, rate: float, run: int):
        from faulty_storage import Fault, faults, injected

        kind = LOCAL_KINDS[run % len(LOCAL_KINDS)]
        with faults({fragment: Fault(kind, rate=rate, message="injected") for fragment in FAULTED},
                    seed=1000 * run + int(rate * 1000)):
            counter = {}
            yield counter
            counter["injected"] = len(injected())

    def run(self, out: str, dates) -> int:
        return _batch(f"faulty://{self.lake}", out, dates, ["--running-mode", "in_memory", "--workers", "1"])

    def out(self, name: str) -> str:
        return str(self.work / name)

    def copy(self, source: str, target: str) -> None:
        shutil.copytree(source, target)

    def published(self, out: str) -> dict[str, bytes]:
        root = pathlib.Path(out)
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.parquet"))
                if not str(p.relative_to(root)).startswith("_")}

    def failure_records(self, out: str) -> list:
        return list(pathlib.Path(out, "_runs").glob("*.failed.json"))

    def remove(self, out: str) -> None:
        shutil.rmtree(out)

    def close(self) -> None:
        pass


class S3Storage(LocalStorage):
    """The lake and outputs on moto's S3 behind the fault proxy; worker processes see the proxy."""

    name = "s3"

    def __init__(self, lake: str, work: pathlib.Path):
        from moto.server import ThreadedMotoServer
        from s3fs import S3FileSystem

        from fault_proxy import FaultProxy

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        os.environ.update({"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
                           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
        S3FileSystem.clear_instance_cache()
        self.fs = S3FileSystem(skip_instance_cache=True)
        self.fs.mkdir("bench")
        self.fs.put(lake, "bench/lake", recursive=True)
        self.proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"]).start()
        os.environ.update({"AWS_ENDPOINT_URL": self.proxy.url, "AWS_MAX_ATTEMPTS": "1"})
        S3FileSystem.clear_instance_cache()
        self.lake = "s3://bench/lake"

    @contextlib.contextmanager
    def faults(self, rate: float, run: int):
        from fault_proxy import ProxyFault

        kind = S3_KINDS[run % len(S3_KINDS)]
        self.proxy.set({fragment: ProxyFault(kind, rate=rate) for fragment in FAULTED})
        counter = {}
        try:
            yield counter
        finally:
            counter["injected"] = sum(self.proxy.injected.values())
            self.proxy.set({})

    def run(self, out: str, dates) -> int:
        return _batch(self.lake, out, dates, ["--workers", "2"])

    def out(self, name: str) -> str:
        return f"s3://bench/{name}"

    def copy(self, source: str, target: str) -> None:
        self.fs.invalidate_cache()
        self.fs.copy(source.removeprefix("s3://"), target.removeprefix("s3://"), recursive=True)

    def published(self, out: str) -> dict[str, bytes]:
        root = out.removeprefix("s3://")
        self.fs.invalidate_cache()
        return {p[len(root) + 1:]: self.fs.cat_file(p) for p in sorted(self.fs.find(root))
                if p.endswith(".parquet") and not p[len(root) + 1:].startswith("_")}

    def failure_records(self, out: str) -> list:
        self.fs.invalidate_cache()
        return [p for p in self.fs.find(f"{out.removeprefix('s3://')}/_runs") if p.endswith(".failed.json")]

    def remove(self, out: str) -> None:
        self.fs.rm(out.removeprefix("s3://"), recursive=True)

    def close(self) -> None:
        self.proxy.stop()
        self.server.stop()


def measure(storage, dates: tuple[str, str], rates: list[float], runs: int) -> None:
    """The fault-free reference, then `runs` faulty runs per rate; prints one line per rate."""
    reference = storage.out("reference")
    started = time.perf_counter()
    assert storage.run(reference, dates) == 0, f"{storage.name}: the fault-free run failed"
    baseline = storage.published(reference)
    print(f"{storage.name}: fault-free run {time.perf_counter() - started:.1f} s, {len(baseline)} published files")
    print(f"{'storage':>8} {'rate':>6} {'runs':>5} {'faults':>7} {'completed':>10} {'failed loud':>12} "
          f"{'rows lost':>10} {'good partitions overwritten':>28} {'identical when completed':>25}")
    for rate in rates:
        completed = failed = lost = overwritten = injected = 0
        identical = True
        for run in range(runs):
            out = storage.out(f"out-{rate}-{run}")
            storage.copy(reference, out)
            with storage.faults(rate, run) as counter:
                code = storage.run(out, dates)
            injected += counter["injected"]
            after = storage.published(out)
            changed = sum(1 for name in baseline if after.get(name) != baseline[name])
            if code == 0:
                completed += 1
                identical &= after == baseline
                lost += changed
            else:
                failed += 1
                overwritten += changed
                if not storage.failure_records(out):
                    raise SystemExit(f"{storage.name} rate {rate} run {run}: failed without a failure record")
            storage.remove(out)
        print(f"{storage.name:>8} {rate:>6.2f} {runs:>5} {injected:>7} {completed:>10} {failed:>12} {lost:>10} "
              f"{overwritten:>28} {str(identical):>25}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller fleet and fewer runs")
    parser.add_argument("--runs", type=int, default=None, help="runs per fault rate (default 6, quick 3)")
    parser.add_argument("--rates", default="0.01,0.05,0.2,0.5", help="fault probabilities per read")
    parser.add_argument("--storage", default="local,s3", help="local, s3 or both")
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 6)
    rates = [float(r) for r in args.rates.split(",")]
    os.environ.setdefault("STRAG_IO_ATTEMPTS", "4")
    os.environ["STRAG_IO_BACKOFF_S"] = "0.001"   # the schedule, not the clock, is under test


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
        files = sum(1 for _ in pathlib.Path(lake).rglob("*.parquet"))
        print(f"fleet: {len(specs)} job windows over {days} days, {files} parquet files; "
              f"{os.environ['STRAG_IO_ATTEMPTS']} attempts per read; load {os.getloadavg()[0]:.2f}")
        for name in args.storage.split(","):
            storage = {"local": LocalStorage, "s3": S3Storage}[name.strip()](lake, work)
            try:
                measure(storage, dates, rates, runs)
            finally:
                storage.close()
        print("rows lost and good partitions overwritten must be 0: a run either publishes exactly the "
              "fault-free tables or fails loud and publishes nothing")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
