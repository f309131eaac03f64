"""Soak test of the streaming monitor: thousands of sessions through one `strag watch`.

    .venv/bin/python benchmarks/bench_watch_soak.py [--sessions 2000] [--minutes 10] [--baseline-sessions 400]
                                                    [--strays N]

Runs the real `strag watch` as a subprocess on a local temporary lake while this process lands
sessions at a steady rate (compressed time: a 0.1 s poll, a 1 s session timeout and a 2 s
retention stand for the defaults of 1 s, 30 s and 600 s). Each session is a small generated
job window (dp 2 x pp 2): its manifest and four worker files, renamed into place. Every
--report seconds it samples the watcher's resident memory (/proc/PID/status VmRSS) and reads
its status line (sessions in play, files listed and the time of the poll's listing).

Printed: the timeline, and a verdict on flatness: RSS and listing time of the last fifth of the
run against the second fifth (the first holds start-up), sessions analysed (must equal sessions
landed), sessions left in the landing area (must be 0), archive size. The baseline is the same
watcher with retention switched off (--retain far beyond the run): nothing leaves the landing
area, so its listing grows with history; it runs for --baseline-sessions sessions at the same
rate.

--strays N: with each session, N stray files land too (alternately a loose file in landing/ and a
worker file in a folder whose name is no session id): they are quarantined, and must leave the
landing area (files left in landing/ counts them) so that the listing stays as small as the
sessions in play.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transforms.live.landing import land_session, session_trace  # noqa: E402
from transforms.live.results import count_live_sessions  # noqa: E402
from transforms.synth.job import JobSpec, generate_job  # noqa: E402

STATUS = re.compile(r"poll (\d+): (\d+) session\(s\) in play, (\d+) file\(s\) listed in ([\d.]+) ms, RSS (\d+) MiB")
POLL, TIMEOUT, RETAIN = 0.1, 1.0, 2.0


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _land(lake: str, trace, manifest, sessions: int, rate: float, landed: list[float], strays: int = 0) -> None:
    """Land `sessions` sessions at `rate` per second (each with `strays` stray files), appending each
    landing time to `landed`."""
    started = time.time()
    for index in range(sessions):
        due = started + index / rate
        time.sleep(max(0.0, due - time.time()))
        land_session(lake, "soak", f"s{index:06d}", trace, manifest)
        for stray in range(strays):
            n = index * strays + stray
            path = pathlib.Path(lake, "landing", f"notes-{n}.txt" if n % 2 == 0 else f"soak/bad session {n}/worker-0-0.parquet")
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.tmp")
            temporary.write_bytes(b"stray")
            temporary.rename(path)
        landed.append(time.time())


def soak(sessions: int, seconds: float, retain: float, report: float, trace, manifest, strays: int = 0) -> dict:
    """One watcher run; returns its timeline and end state."""
    with tempfile.TemporaryDirectory() as folder:
        lake, out = f"{folder}/lake", f"{folder}/out"
        os.makedirs(f"{lake}/landing")
        watcher = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "watch", "--lake", lake, "--out", out, "--poll-interval", str(POLL),
             "--session-timeout", str(TIMEOUT), "--retain", str(retain), "--status-interval", str(report)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        status: list[tuple[float, tuple]] = []

        def read_status():
            for line in watcher.stdout:
                match = STATUS.search(line)
                if match:
                    status.append((time.time(), tuple(float(value) for value in match.groups())))

        threading.Thread(target=read_status, daemon=True).start()
        landed: list[float] = []
        lander = threading.Thread(target=_land, args=(lake, trace, manifest, sessions, sessions / seconds, landed, strays))
        started = time.time()
        lander.start()
        rss: list[tuple[float, float]] = []
        analysed = 0
        deadline = started + seconds * 3 + 120
        while time.time() < deadline:
            time.sleep(report)
            rss.append((time.time() - started, _rss_mib(watcher.pid)))
            if not lander.is_alive():
                analysed = count_live_sessions(out)
                # done: all analysed, and (with retention) time to archive the last ones
                if analysed >= sessions and time.time() - landed[-1] > min(retain, 10.0) + 5 * POLL + 1:
                    break
        watcher.send_signal(signal.SIGINT)
        watcher.wait(timeout=60)
        analysed = count_live_sessions(out)
        left = [p for p in pathlib.Path(f"{lake}/landing").rglob("*") if p.is_file()]
        archived = sum(1 for p in pathlib.Path(f"{lake}/landing_archive").glob("*/*")
                       if p.is_dir() and not p.parent.name.startswith("_"))
        set_aside = sum(1 for p in pathlib.Path(f"{lake}/landing_archive/_strays").rglob("*") if p.is_file())
    return {"started": started, "rss": rss, "status": [(t - started, values) for t, values in status],
            "landed": landed, "analysed": analysed, "left": len(left), "archived": archived, "set_aside": set_aside,
            "elapsed": time.time() - started}


def _fifth(samples: list[tuple[float, float]], index: int, total: float) -> list[float]:
    low, high = total * index / 5, total * (index + 1) / 5
    return [value for t, value in samples if low <= t < high]


def summarise(name: str, run: dict, sessions: int) -> tuple[float, float, float, float]:
    """Print a run's timeline and return (rss early, rss late, listing ms early, listing ms late)."""
    print(f"\n{name}: {sessions} sessions landed over {run['landed'][-1] - run['started']:.0f} s, "
          f"run {run['elapsed']:.0f} s")
    print(f"  {'t (s)':>6} {'landed':>7} {'in play':>8} {'files':>6} {'listing ms':>11} {'RSS MiB':>8}")
    landed = run["landed"]
    samples = run["rss"]
    step = max(1, len(run["status"]) // 12)
    for t, (_, in_play, files, listing_ms, _) in run["status"][::step]:
        count = sum(1 for x in landed if x - run["started"] <= t)
        memory = min(samples, key=lambda sample: abs(sample[0] - t))[1] if samples else float("nan")
        print(f"  {t:6.0f} {count:7d} {in_play:8.0f} {files:6.0f} {listing_ms:11.2f} {memory:8.0f}")
    end = run["landed"][-1] - run["started"]
    listing = [(t, values[3]) for t, values in run["status"]]
    figures = (statistics.median(_fifth(run["rss"], 1, end)), statistics.median(_fifth(run["rss"], 4, end)),
               statistics.median(_fifth(listing, 1, end)), statistics.median(_fifth(listing, 4, end)))
    print(f"  RSS {figures[0]:.0f} -> {figures[1]:.0f} MiB ({figures[1] / figures[0]:.2f}x); listing "
          f"{figures[2]:.2f} -> {figures[3]:.2f} ms ({figures[3] / figures[2]:.2f}x) from the 2nd to the last fifth")
    print(f"  sessions analysed {run['analysed']} of {sessions}; files left in landing/ {run['left']}; "
          f"sessions archived {run['archived']}; stray files set aside {run['set_aside']}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--minutes", type=float, default=10.0, help="landing time of the soak run")
    parser.add_argument("--baseline-sessions", type=int, default=400,
                        help="sessions of the run without retention, at the same rate (0: skip)")
    parser.add_argument("--report", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--strays", type=int, default=0, help="stray files landed with each session (default 0)")
    args = parser.parse_args(argv)

    job = generate_job(JobSpec(job_id="soak", dp=2, pp=2, microbatches=2, steps=2, sessions=1, seed=5))
    trace = session_trace(job, 0)
    seconds = args.minutes * 60
    rate = args.sessions / seconds
    print(f"landing {args.sessions} sessions (5 files, {trace.num_rows} op rows each) at {rate:.1f}/s; "
          f"poll {POLL} s, session timeout {TIMEOUT} s, retention {RETAIN} s; load {os.getloadavg()[0]:.2f}")
    if args.strays:
        print(f"with {args.strays} stray file(s) per session")
    run = soak(args.sessions, seconds, RETAIN, args.report, trace, job.manifest, args.strays)
    rss_early, rss_late, list_early, list_late = summarise("with retention", run, args.sessions)
    ok = run["analysed"] == args.sessions and run["left"] == 0
    if args.baseline_sessions:
        base = soak(args.baseline_sessions, args.baseline_sessions / rate, 1e9, args.report, trace, job.manifest, args.strays)
        _, _, base_early, base_late = summarise("baseline: retention off", base, args.baseline_sessions)
        print(f"\nlisting time growth, last fifth / 2nd fifth: {list_late / list_early:.2f}x with retention "
              f"({args.sessions} sessions) vs {base_late / base_early:.2f}x without ({args.baseline_sessions} sessions)")
    print(f"memory growth {rss_late / rss_early:.2f}x; every session analysed and archived: {'yes' if ok else 'NO'}; "
          f"load {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
