"""Live demo: a real torchrun job lands its profiler windows with strag_collect while `strag watch` runs.

    .venv/bin/python tools/real_traces/live_demo.py [--lake URL] [--torch-python PYTHON]

Two real training runs (train.py: GPipe over 4 pipeline ranks, an MLP, CPU/gloo, torch from its
own venv; torch is never a dependency of strag) each add the two lines a user adds:

    from strag_collect import kineto_handler
    ... profile(..., on_trace_ready=kineto_handler(LAKE, job_id=JOB, live=True))

The first run is slowed (rank 1's forwards 3x, rank 3's backwards 2x: the committed run
`two-fwd3-r1-bwd2-r3-gpipe-pp4-mlp-sleep`), the second is clean. Meanwhile a real `strag watch`
(this repo's venv) watches the lake. The demo prints, per run, the live result (S, verdict), the
alerts, and the time from the last rank's trace landing (its modification time in the lake) to
the alert row (the watcher's alert_time). Exit 0 when the slowed run raised an alert and the clean
run none; 1 otherwise (the verdicts are printed either way: a clean run whose own noise crosses the
threshold on a loaded machine is reported with verdict `none`, and the demo fails). Not a test (`make test` has no torch): run it by hand.

--lake: any fsspec URL (default: a new temporary folder); s3:// takes credentials and
AWS_ENDPOINT_URL from the environment, for the watcher and the trainers alike.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RUNS = {
    "demo-slowed": ["--slow", "fwd:1:3", "--slow", "bwd:3:2"],
    "demo-clean": [],
}
TRAIN = ["--schedule", "gpipe", "--layout", "pp4", "--groups", "mesh", "--grad-sync", "none", "--model", "mlp",
         "--noise", "sleep", "--microbatches", "6", "--seed", "0", "--prof-wait", "0", "--prof-warmup", "1",
         "--prof-active", "3"]


def _watch(lake: str, out: str, deadline_s: float, threshold: float) -> tuple[subprocess.Popen, list[str]]:
    lines: list[str] = []
    process = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "watch", "--lake", lake, "--out", out, "--session-timeout", "120",
         "--threshold", str(threshold),
         "--poll-interval", "0.25", "--status-interval", "5", "--stop-after-sessions", str(len(RUNS)),
         "--max-runtime", str(deadline_s)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def drain():
        for line in process.stdout:
            lines.append(line)
            print(f"  [watch] {line}", end="", flush=True)

    threading.Thread(target=drain, daemon=True).start()
    return process, lines


def _busy() -> float:
    """Share of the machine's CPU time used over 3 s (/proc/stat), as make_all.sh measures it."""
    def snap():
        values = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(values), values[3] + values[4]
    total0, idle0 = snap()
    time.sleep(3)
    total1, idle1 = snap()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def _wait_quiet(limit_s: float) -> None:
    """Wait (at most limit_s) until the machine is less than a quarter busy: 4 ranks on 2 cores beside a
    test suite are noisy enough for a clean run's own variation to cross the threshold."""
    deadline = time.time() + limit_s
    while True:
        busy = _busy()
        if busy < 0.25 or time.time() > deadline:
            print(f"machine busy {busy:.0%} before the run", flush=True)
            return
        time.sleep(10)


def _default_torch_python() -> str:
    """The python of the venv with torch: $TORCHENV's (as gen_corpus.py takes it), else this one
    (torch installed beside strag)."""
    torchenv = os.environ.get("TORCHENV")
    return str(pathlib.Path(torchenv) / "bin" / "python") if torchenv else sys.executable


def _train(torch_python: str, lake: str, job_id: str, extra: list[str], scratch: pathlib.Path) -> float:
    """One torchrun job landing its window live; returns when it ended (epoch seconds)."""
    torchrun = str(pathlib.Path(torch_python).with_name("torchrun"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    command = [torchrun, "--standalone", "--nproc_per_node", "4", str(ROOT / "tools" / "real_traces" / "train.py"),
               *TRAIN, *extra, "--name", job_id, "--out", str(scratch / job_id), "--strag-lake", lake,
               "--strag-job-id", job_id]
    print(f"$ {' '.join(command)}", flush=True)
    done = subprocess.run(command, cwd=ROOT, env=env, text=True, capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.time()


def _last_landing(lake: str, job_id: str, session: str) -> float:
    """Modification time of the session's last file: in the landing area, or the archive if already moved."""
    import fsspec

    from transforms.live.landing import _modification_time

    fs, root = fsspec.core.url_to_fs(lake)
    fs.invalidate_cache()
    for area in ("landing", "landing_archive"):
        folder = f"{root.rstrip('/')}/{area}/{job_id}/{session}"
        if fs.exists(folder):
            return max(_modification_time(info) for info in fs.find(folder, detail=True).values())
    raise SystemExit(f"no files of job {job_id} session {session} in {lake}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lake", default=None, help="lake URL (default: a new temporary folder)")
    parser.add_argument("--out", default=None, help="live tables URL (default: {lake}-out)")
    parser.add_argument("--torch-python", default=_default_torch_python(),
                        help="python of a venv with torch and torchrun (default: $TORCHENV/bin/python, else this python)")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds before the demo gives up")
    parser.add_argument("--quiet-wait", type=float, default=300.0,
                        help="before each run, wait at most this many seconds for the machine to be < 25%% busy")
    parser.add_argument("--threshold", type=float, default=1.1,
                        help="the watcher's --threshold (default 1.1; on a loaded 2-core machine a clean run's own "
                             "noise can reach it: its verdict then says `none`)")
    args = parser.parse_args(argv)
    if not pathlib.Path(args.torch_python).with_name("torchrun").exists():   # _train runs the torchrun beside it
        parser.error(f"--torch-python {args.torch_python}: no torchrun beside it; give the python of a venv with torch "
                     "(--torch-python or TORCHENV, see tools/real_traces/README.md)")
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="strag-live-demo-"))
    lake = args.lake or str(scratch / "lake")
    out = args.out or f"{lake.rstrip('/')}-out"
    import fsspec

    fs, root = fsspec.core.url_to_fs(lake)
    fs.makedirs(f"{root}/landing", exist_ok=True)
    if "://" in lake and not lake.startswith("file://"):
        fs.touch(f"{root}/_lake.json")   # object stores have no empty folders: the watcher needs to see a lake
    print(f"lake {lake}\nlive tables {out}", flush=True)

    watcher, lines = _watch(lake, out, args.deadline, args.threshold)
    started = time.time()
    while not any("strag watch: poll" in line for line in lines):
        if watcher.poll() is not None or time.time() - started > 120:
            raise SystemExit("the watcher did not start:\n" + "".join(lines))
        time.sleep(0.1)
    ended = {}
    for job_id, extra in RUNS.items():
        _wait_quiet(args.quiet_wait)
        ended[job_id] = _train(args.torch_python, lake, job_id, extra, scratch)
    try:
        code = watcher.wait(timeout=max(1.0, args.deadline - (time.time() - started)))
    except subprocess.TimeoutExpired:
        watcher.kill()
        raise SystemExit("the watcher did not analyse both sessions in time:\n" + "".join(lines[-40:]))

    from transforms.live.tables import read_live_table

    results = read_live_table(out).to_pylist()
    alerts = read_live_table(out, "alerts").to_pylist()
    ok = code == 0
    print()
    for job_id in RUNS:
        rows = [r for r in results if r["job_id"] == job_id]
        raised = [a for a in alerts if a["job_id"] == job_id]
        if not rows:
            print(f"{job_id}: no live result")
            ok = False
            continue
        row = rows[-1]
        landed = _last_landing(lake, job_id, row["session"])
        print(f"{job_id}: session {row['session']} r{row['revision']} {row['status']} ({row['reason']}), "
              f"S {row['slowdown']:.3f}, verdict {row['verdict']}; torchrun ended {ended[job_id] - landed:+.2f} s after "
              f"the last rank landed; result {row['analysed'].timestamp() - landed:.2f} s after it")
        for alert in raised:
            print(f"  ALERT {alert['kind']}: {alert['message']} -- {alert['alert_time'].timestamp() - landed:.2f} s "
                  "from the last rank landing to the alert row")
        expected = job_id == "demo-slowed"
        if bool(raised) != expected:
            print(f"  UNEXPECTED: {'no alert' if expected else 'an alert'} for {job_id}")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
