"""What `strag watch --alert-webhook` pages, and how fast: pages on real runs, then latency at scale.

    .venv/bin/python benchmarks/bench_live.py --corpus DIR [--corpus DIR ...]   # the pages
    .venv/bin/python benchmarks/bench_live.py [--sizes 8:50,64:20,1024:6] [--poll-interval 1.0]

Pages (--corpus): every run of the folders (real torch.profiler runs with truth.json, e.g.
tests/data/real_runs, tests/data/real_stacks, a corpus of tools/real_stacks/gen_stacks.py) lands,
one after the other, as a live session of a job of its own (`strag land --live`), while one real
`strag watch` process posts JSON alerts to a local HTTP receiver. Printed: recall on the sessions
with a measurable slow worker (a rank slowed in forward or backward whose slowed work the trace shows
at least 1.3x the other ranks' in its median step: right when the job's pages name every such rank,
and no rank without an injection), false pages on the clean sessions (any
page), what paged for the other injections (GC, data loading, stage split), the latency from the
session's last file to its page (p50/p90), and duplicates over a restart: a second watcher on the
same lake and output re-analyses every session still in landing/ and must page nothing.

Latency at scale (no --corpus):

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
import collections
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

from transforms.live.landing import session_trace, split_workers  # noqa: E402
from transforms.synth.faults import Cause  # noqa: E402
from transforms.synth.job import JobSpec, generate_job  # noqa: E402

SHAPES = {8: (4, 2), 64: (16, 4), 1024: (128, 8)}   # workers -> (dp, pp)
TARGETS = {8: 5.0, 1024: 30.0}                       # p90 seconds (issue 23)


class Inbox:
    """The local webhook: every JSON body posted, with its arrival time."""

    def __init__(self):
        self.bodies: list[tuple[float, dict]] = []
        self.event = threading.Condition()
        inbox = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with inbox.event:
                    inbox.bodies.append((time.time(), body))
                    inbox.event.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"

    def firing(self, job: str | None = None) -> list[tuple[float, dict]]:
        with self.event:
            return [(t, b) for t, b in self.bodies if b["status"] == "firing" and (job is None or b["job_id"] == job)]

    def wait(self, session: str, deadline: float) -> float:
        """Arrival of the first notice a session caused (firing: its session; resolved: the session
        whose healthy result resolved it)."""
        def seen():
            return next((t for t, b in self.bodies
                         if (b["session"] if b["status"] == "firing" else b.get("resolved_by_session")) == session), None)

        with self.event:
            while seen() is None:
                if not self.event.wait(timeout=max(0.0, deadline - time.time())):
                    raise TimeoutError(f"no alert for session {session}")
            return seen()


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
    from transforms.live.landing import landing_manifest_path, landing_worker_path
    from transforms.io.lake import manifest_table, write_parquet

    if with_manifest:
        write_parquet(landing_manifest_path(lake, "bench", session), manifest_table(manifest))
    for worker in workers:
        write_parquet(landing_worker_path(lake, "bench", session, *worker), per_worker[worker])


MEASURABLE = 1.3   # a slowed rank whose slowed work is at least this many times the other ranks' is measurably slow


def _watcher(lake: str, out: str, url: str, poll: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "watch", "--lake", lake, "--out", out, "--poll-interval", str(poll),
         "--session-timeout", "120", "--retain", "100000", "--status-interval", "3600", "--alert-webhook", url],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(watcher: subprocess.Popen) -> None:
    watcher.send_signal(signal.SIGINT)
    try:
        watcher.wait(timeout=300)
    except subprocess.TimeoutExpired:
        watcher.kill()


def _truth(run: pathlib.Path) -> dict:
    """What was injected, and which slowed ranks the trace shows as measurably slow: the injected kind of
    work (forward, backward) of the rank, summed per profiled step, at least MEASURABLE x the median of
    the other ranks' in most steps (the injection slows some blocks; what it does to the rank's whole
    forward or backward depends on the model, so the trace decides)."""
    import numpy as np

    truth = json.loads((run / "truth.json").read_text())
    slowdowns = truth.get("slowdowns") or []
    slowed = {(s["rank"], s["kind"]) for s in slowdowns if s.get("kind") in ("fwd", "bwd") and s.get("amount", 0) > 1.0}
    measured = _measured_ratios(run, slowed) if slowed else {}
    ratios = {key: float(np.median(values)) for key, values in measured.items()}
    # most steps: more than half of them (a worker slowed in half the steps is intermittent)
    measurable = sorted({rank for (rank, _), values in measured.items() if (values >= MEASURABLE).mean() > 0.5})
    injected = sorted({s["rank"] for s in slowdowns if s.get("rank") is not None and s.get("rank", -1) >= 0})
    kinds = sorted({s.get("kind") for s in slowdowns})
    return {"measurable": measurable, "injected": injected, "kinds": kinds, "clean": not slowdowns,
            "ratios": {f"{rank}:{kind}": round(ratio, 2) for (rank, kind), ratio in ratios.items()}}


def _measured_ratios(run: pathlib.Path, slowed: set) -> dict:
    """(rank, kind) -> per profiled step, the rank's work of that kind over the other ranks' median."""
    import numpy as np

    from transforms.ingest import convert_window

    trace = convert_window("kineto", sorted(str(p) for p in run.glob("rank-*.json*")), run.name, "2026-01-01").trace
    rank = trace.column("rank").to_numpy()
    step = trace.column("step").to_numpy()
    optype = np.asarray(trace.column("optype").cast("string").to_pylist())
    duration = trace.column("duration").to_numpy()
    out = {}
    for victim, kind in slowed:
        mask = optype == ("forward-compute" if kind == "fwd" else "backward-compute")
        steps, ranks = np.unique(step[mask]), np.unique(rank[mask])
        if victim not in ranks or len(ranks) < 2:
            continue
        per = {(s, r): duration[mask & (step == s) & (rank == r)].sum() for s in steps for r in ranks}
        ratio = [per[s, victim] / np.median([per[s, r] for r in ranks if r != victim]) for s in steps]
        out[victim, kind] = np.asarray(ratio, dtype=float)
    return out


def run_pages(corpora: list[pathlib.Path], poll: float) -> int:
    """The pages bench (see the module docstring)."""
    import datetime as dt

    from pipelines.land import LandOptions, land
    from transforms.live.tables import read_live_table
    from transforms.live.status import read_status

    runs = sorted((run for corpus in corpora for run in corpus.iterdir() if (run / "truth.json").exists()),
                  key=lambda run: run.name)
    shared = {name for name, n in collections.Counter(run.name for run in runs).items() if n > 1}
    inbox = Inbox()
    rows, latencies = [], []
    with tempfile.TemporaryDirectory() as folder:
        lake, out = f"{folder}/lake", f"{folder}/out"
        os.makedirs(f"{lake}/landing")
        watcher = _watcher(lake, out, inbox.url, poll)
        try:
            for run in runs:
                # a run name two corpora share is two jobs (one job id would make them one window)
                job = f"{run.parent.name}-{run.name}" if run.name in shared else run.name
                try:
                    land(LandOptions(folder=run, lake=lake, job_id=job, date=dt.date.today(), session="w0"))
                except ValueError as error:   # e.g. several profiling cycles per rank: not one live session
                    print(f"  {job:44s} not landed as a live session: {error}", flush=True)
                    continue
                landed = time.time()
                deadline = landed + 600
                row = None
                while row is None and time.time() < deadline:
                    time.sleep(0.1)
                    table = read_live_table(out)
                    mine = [r for r in table.to_pylist() if r["job_id"] == job]
                    row = mine[-1] if mine else None
                if row is None:
                    raise TimeoutError(f"no result for {job}")
                time.sleep(1.0)   # the page is posted right after the row: give the receiver a moment
                pages = inbox.firing(job)
                if pages:
                    latencies.append(pages[0][0] - landed)
                truth = _truth(run)
                named = sorted({r for _, body in pages for r in body["ranks"]})
                rows.append({"run": job, **truth, "named": named, "causes": sorted({b["cause"] for _, b in pages}),
                             "status": row["status"], "verdict": row["verdict"], "S": row["slowdown"]})
                print(f"  {job:44s} {row['status']:9s} {str(row['verdict']):22s} pages {len(pages)} ranks {named} "
                      f"(injected {truth['injected'] or '-'} {','.join(truth['kinds']) or 'clean'}"
                      f"{'; measured ' + str(truth['ratios']) if truth['ratios'] else ''})", flush=True)
        finally:
            _stop(watcher)
        before = len(inbox.firing())
        restarted = _watcher(lake, out, inbox.url, poll)   # the same lake and output: every session again
        try:
            deadline = time.time() + 1200
            while time.time() < deadline:
                status = read_status(out) or {}
                if status.get("running") and status.get("results", 0) >= len(rows):
                    break
                time.sleep(0.5)
            time.sleep(2.0)
        finally:
            _stop(restarted)
        duplicates = len(inbox.firing()) - before
    inbox.server.shutdown()
    _report_pages(rows, latencies, duplicates)
    return 0


def _report_pages(rows: list[dict], latencies: list[float], duplicates: int) -> None:
    slowed = [r for r in rows if r["measurable"]]
    right = [r for r in slowed if set(r["measurable"]) <= set(r["named"]) <= set(r["injected"])]
    found = [r for r in slowed if set(r["measurable"]) <= set(r["named"])]
    clean = [r for r in rows if r["clean"]]
    false = [r for r in clean if r["named"] or r["causes"]]
    other = [r for r in rows if not r["clean"] and not r["measurable"]]   # incl. slowed work the trace shows < 1.3x
    print(f"\n{len(rows)} sessions: {len(slowed)} with a measurable slow worker (slowed work >= {MEASURABLE}x the other ranks'), "
          f"{len(clean)} clean, {len(other)} other injections")
    print(f"  slowed sessions paged naming every slowed rank and no rank without an injection {len(right)} / {len(slowed)}"
          f" ({100 * len(right) / max(1, len(slowed)):.0f}%; naming them among others {len(found)}), target >= 95%")
    for r in slowed:
        if r not in right:
            print(f"    missed or off: {r['run']}: slowed {r['measurable']}, paged {r['named'] or 'nothing'} "
                  f"({r['status']}, {r['verdict']}, S {r['S'] if r['S'] is None else round(r['S'], 3)})")
    print(f"  clean sessions paged {len(false)} / {len(clean)} ({100 * len(false) / max(1, len(clean)):.0f}%), target <= 5%"
          + "".join(f"\n    false page: {r['run']}: {r['causes']} ranks {r['named']}" for r in false))
    for r in other:
        print(f"  other injection {r['run']}: injected {r['injected']} ({','.join(r['kinds'])}"
              f"{'; measured ' + str(r['ratios']) if r['ratios'] else ''}), paged {r['causes'] or 'nothing'} ranks {r['named']}")
    print(f"  duplicate pages over a watcher restart: {duplicates} (target 0)")
    if latencies:
        print(f"  last file landed -> page: p50 {statistics.median(latencies):.2f} s, p90 {_percentile(latencies, 0.9):.2f} s "
              f"over {len(latencies)} pages (target p90 <= 5 s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", action="append", default=[], type=pathlib.Path,
                        help="folder of real runs (each with truth.json): measure the pages (repeatable)")
    parser.add_argument("--sizes", default="8:50,64:20,1024:6", help="workers:sessions,... (workers: 8, 64, 1024)")
    parser.add_argument("--poll-interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.corpus:
        return run_pages(args.corpus, args.poll_interval)
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
