"""From a session's last file landing to its alert at a webhook: `strag watch --alert-webhook` latency.

    .venv/bin/python benchmarks/bench_live.py [--sizes 8:50,64:20,1024:6] [--poll-interval 1.0]

For each size (workers:sessions) a real `strag watch` process (the CLI, FnApiRunner) watches a
fresh local lake and posts JSON alerts to a local HTTP receiver (http.server in this process).
Sessions are parquet live sessions of a generated job (transforms/synth; dp x pp = workers, 8
microbatches, 8 steps) landed under one job id, alternately with a slow worker (S well above
1.1: a firing alert) and clean (S below: the resolved notice), so every session posts one
notice. Per session the manifest and all worker files but one land first; the clock starts when
the last file has been renamed into place and stops when the receiver has the session's notice.
The first session of each size (the watcher's imports and engine warm-up) is not measured.

The watcher's RSS (/proc) is sampled every second; "flat" compares the median of the second
fifth of the run with the last fifth (< 10% or < 32 MiB apart). Prints p50/p90/max per size
against the targets (p90 <= 5 s at 8 workers, <= 30 s at 1,024). Figures only, not a test.
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transforms.landing import session_trace, split_workers  # noqa: E402
from transforms.synth.faults import Cause  # noqa: E402
from transforms.synth.job import JobSpec, generate_job  # noqa: E402

SHAPES = {8: (4, 2), 64: (16, 4), 1024: (128, 8)}   # workers -> (dp, pp)
TARGETS = {8: 5.0, 1024: 30.0}                       # p90 seconds (issue 23)


class Inbox:
    """The local webhook: the arrival time of each session's notice (firing: its session; resolved:
    the session whose healthy result resolved it)."""

    def __init__(self):
        self.arrived: dict[str, float] = {}
        self.event = threading.Condition()
        inbox = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                now = time.time()
                session = body["session"] if body["status"] == "firing" else body["resolved_by"]["session"]
                with inbox.event:
                    inbox.arrived.setdefault(session, now)
                    inbox.event.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"

    def wait(self, session: str, deadline: float) -> float:
        with self.event:
            while session not in self.arrived:
                if not self.event.wait(timeout=max(0.0, deadline - time.time())):
                    raise TimeoutError(f"no alert for session {session}")
            return self.arrived[session]


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_size(workers: int, sessions: int, poll: float) -> dict:
    dp, pp = SHAPES[workers]
    spec = dict(job_id="bench", dp=dp, pp=pp, microbatches=8, steps=8, sessions=1, seed=11)
    slow = generate_job(JobSpec(**spec, causes=(Cause("slow_worker", {"dp_rank": dp - 1, "stage": pp - 1, "factor": 1.8}),)))
    clean = generate_job(JobSpec(**spec))
    # each job's files, split once: landing then only writes parquet
    pieces = {name: (split_workers(session_trace(job, 0)), job.manifest) for name, job in (("slow", slow), ("clean", clean))}
    inbox = Inbox()
    latencies: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        lake, out = f"{folder}/lake", f"{folder}/out"
        os.makedirs(f"{lake}/landing")
        watcher = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "watch", "--lake", lake, "--out", out, "--poll-interval", str(poll),
             "--session-timeout", "300", "--retain", "10", "--status-interval", "3600", "--alert-webhook", inbox.url],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rss: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample():
            while not stop.wait(1.0):
                rss.append((time.time(), _rss_mib(watcher.pid)))

        threading.Thread(target=sample, daemon=True).start()
        started = time.time()
        try:
            for index in range(sessions + 1):
                kind = "slow" if index % 2 == 0 else "clean"
                per_worker, manifest = pieces[kind]
                name = f"s{index:04d}"
                order = sorted(per_worker)
                land_pieces(lake, name, per_worker, manifest, order[:-1], with_manifest=True)
                land_pieces(lake, name, per_worker, manifest, order[-1:], with_manifest=False)
                landed = time.time()
                arrived = inbox.wait(name, landed + 600)
                if index:
                    latencies.append(arrived - landed)
                print(f"  {workers} workers, session {name} ({kind}): alert {arrived - landed:.2f} s after its last file"
                      + ("  (warm-up, not measured)" if not index else ""), flush=True)
        finally:
            stop.set()
            watcher.send_signal(signal.SIGINT)
            try:
                watcher.wait(timeout=120)
            except subprocess.TimeoutExpired:
                watcher.kill()
            inbox.server.shutdown()
            inbox.server.server_close()
    elapsed = time.time() - started
    values = [value for _, value in rss]
    fifth = max(1, len(values) // 5)
    early, late = statistics.median(values[fifth:2 * fifth] or values), statistics.median(values[-fifth:])
    return {"workers": workers, "sessions": len(latencies), "p50": statistics.median(latencies),
            "p90": _percentile(latencies, 0.9), "max": max(latencies), "elapsed": elapsed,
            "rss_early": early, "rss_late": late, "rss_max": max(values),
            "flat": late - early < 32 or late < early * 1.10}


def land_pieces(lake: str, session: str, per_worker: dict, manifest, workers: list, with_manifest: bool) -> None:
    """land_session for files already split per worker (the split is the bench's cost, not the watcher's)."""
    from transforms.landing import landing_manifest_path, landing_worker_path
    from transforms.lake import manifest_table, write_parquet

    if with_manifest:
        write_parquet(landing_manifest_path(lake, "bench", session), manifest_table(manifest))
    for worker in workers:
        write_parquet(landing_worker_path(lake, "bench", session, *worker), per_worker[worker])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8:50,64:20,1024:6", help="workers:sessions,... (workers: 8, 64, 1024)")
    parser.add_argument("--poll-interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    sizes = [tuple(int(x) for x in item.split(":")) for item in args.sizes.split(",")]
    rows = []
    for workers, sessions in sizes:
        if workers not in SHAPES:
            parser.error(f"--sizes: {workers} workers: use one of {sorted(SHAPES)}")
        print(f"{workers} workers ({SHAPES[workers][0]} dp x {SHAPES[workers][1]} pp), {sessions} sessions:", flush=True)
        rows.append(run_size(workers, sessions, args.poll_interval))
    print(f"\nstrag watch -> webhook latency (last file landed -> alert posted), poll interval {args.poll_interval:g} s")
    print(f"{'workers':>8} {'sessions':>9} {'p50 s':>7} {'p90 s':>7} {'max s':>7} {'target':>8} "
          f"{'RSS early':>10} {'RSS late':>9} {'RSS max':>8}  memory")
    for row in rows:
        target = TARGETS.get(row["workers"])
        verdict = "" if target is None else (f"<= {target:g}" + (" ok" if row["p90"] <= target else " MISSED"))
        print(f"{row['workers']:>8} {row['sessions']:>9} {row['p50']:>7.2f} {row['p90']:>7.2f} {row['max']:>7.2f} "
              f"{verdict:>8} {row['rss_early']:>9.0f}M {row['rss_late']:>8.0f}M {row['rss_max']:>7.0f}M  "
              f"{'flat' if row['flat'] else 'GROWS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
