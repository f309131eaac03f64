"""End to end, as a trainer author and on-call see it: the one-line hooks page the slowed rank.

    python3 tools/real_stacks/collector_hooks.py [--torchenv /work/torchvenv] [--keep DIR]

The trainer's environment ($TORCHENV: torch, Lightning, transformers) gets the collector with the
README's one command (`pip install ./collector`, from a copy of the checkout). Then, while one real
`strag watch` (this checkout's .venv) posts JSON alerts to a local HTTP receiver, real 2-process
CPU jobs train under torchrun, each with its stack's one line:
- Lightning `Trainer(strategy="ddp", callbacks=[StragProfiler(lake, job_id)])` (lightning_ddp.py
  --profiler strag), rank 1's forward slowed 2x, and a clean run;
- transformers `Trainer(..., callbacks=[StragTrainerCallback(lake, job_id)])` (hf_trainer.py
  --strag-lake), rank 1's forward slowed 2x, and a clean run.
Each profiles a window of 3 steps every 6 (two live sessions of one job). Printed per job: its
sessions' verdicts and the pages the receiver got (ranks named). Exit 0 when every slowed job paged
naming rank 1, and only rank 1, exactly once, and no clean job paged. Never part of `make test`
(torch and the stacks live in the tools venv).
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
RUNS = [  # (job id, script, args, slowed rank or None)
    ("lightning-slow", "lightning_ddp.py", ["--profiler", "strag", "--slow", "fwd:1:2"], 1),
    ("lightning-clean", "lightning_ddp.py", ["--profiler", "strag"], None),
    ("hf-slow", "hf_trainer.py", ["--slow", "fwd:1:2"], 1),
    ("hf-clean", "hf_trainer.py", [], None),
]


class Receiver:
    def __init__(self):
        self.bodies: list[dict] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                owner.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"


def install_collector(torchenv: str, scratch: pathlib.Path) -> None:
    """The README's one command, in the trainer's environment, from a copy of the checkout."""
    copy = scratch / "checkout"
    shutil.copytree(REPO / "collector", copy / "collector", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    shutil.copytree(REPO / "strag_collect", copy / "strag_collect", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([f"{torchenv}/bin/python", "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps",
                    str(copy / "collector")], check=True)


def _live_results(out: pathlib.Path) -> list[dict]:
    """The live table's rows, read with the checkout's .venv (this tool needs only the standard library)."""
    code = ("import json, sys; from transforms.live.tables import read_live_table; "
            "print(json.dumps(read_live_table(sys.argv[1]).to_pylist(), default=str))")
    shown = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", code, str(out)], cwd=REPO, check=True,
                           capture_output=True, text=True)
    return json.loads(shown.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchenv", default=os.environ.get("TORCHENV", "/work/torchvenv"))
    parser.add_argument("--keep", default=None, help="keep the lake and tables here (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (a window every 6)")
    args = parser.parse_args()
    scratch = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="strag-hooks-"))
    lake, out = scratch / "lake", scratch / "tables"
    (lake / "landing").mkdir(parents=True, exist_ok=True)
    install_collector(args.torchenv, scratch)
    receiver = Receiver()
    watcher = subprocess.Popen([str(REPO / ".venv" / "bin" / "python"), "-m", "pipelines.cli", "watch", "--lake", str(lake),
                                "--out", str(out), "--poll-interval", "0.5", "--session-timeout", "60",
                                "--alert-webhook", receiver.url], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    try:
        for job, script, extra, _ in RUNS:
            command = [f"{args.torchenv}/bin/torchrun", "--standalone", "--nproc_per_node", "2",
                       f"tools/real_stacks/{script}", "--out", str(scratch / "runs" / job), "--name", job,
                       "--steps", str(args.steps), *extra]
            command += ["--strag-lake", str(lake), "--strag-job-id", job]
            started = time.time()
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
            print(f"{job}: trained in {time.time() - started:.0f} s (exit {done.returncode})", flush=True)
            if done.returncode != 0:
                print(done.stdout[-1500:], done.stderr[-3000:])
                return 1
        time.sleep(8.0)   # the last sessions: analysed and paged within seconds
    finally:
        watcher.send_signal(signal.SIGINT)
        watcher.wait(timeout=300)
        receiver.server.shutdown()
    results = _live_results(out)
    failures = []
    for job, script, _, slowed in RUNS:
        sessions = sorted((r["session"], r["status"], r["verdict"], round(r["slowdown"] or 0, 3),
                           [w["rank"] for w in r["blamed"] or []]) for r in results if r["job_id"] == job)
        pages = [b for b in receiver.bodies if b["job_id"] == job and b["status"] == "firing"]
        print(f"{job} ({script}): sessions {sessions}")
        print(f"  pages: {[(b['cause'], b['ranks'], b['summary']) for b in pages] or 'none'}")
        if not sessions:
            failures.append(f"{job}: no session analysed")
        elif slowed is None and pages:
            failures.append(f"{job}: a clean job paged")
        elif slowed is not None and [b["ranks"] for b in pages] != [[slowed]]:
            failures.append(f"{job}: expected one page naming rank {slowed}, got {[b['ranks'] for b in pages]}")
    print("\n" + ("every slowed job paged naming its slowed rank once; no clean job paged" if not failures
                  else "FAILED:\n  " + "\n  ".join(failures)))
    print(f"lake and tables: {scratch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
