"""Generate a corpus of real torch.profiler traces from real training stacks (stdlib only).

    python3 tools/real_stacks/gen_stacks.py --out /work/stack-corpus                  # the whole matrix
    python3 tools/real_stacks/gen_stacks.py --out DIR --only hf-clean-gpt2-padded-s0  # some runs
    python3 tools/real_stacks/gen_stacks.py --list                                    # print the matrix
    python3 tools/real_stacks/gen_stacks.py --matrix my.json --out DIR [--force] [--timeout 240]

A matrix is a JSON list of {"name": str, "script": "<file in tools/real_stacks>", "nproc": int,
"args": [str, ...] | str}; default tools/real_stacks/stacks-matrix.json.  Each run goes to
OUT/<name>/ (rank-{r}.json.gz, truth.json, PROVENANCE.json), launched from the repo root as

    OMP_NUM_THREADS=1 $TORCHENV/bin/torchrun --standalone --nproc_per_node NPROC \
        tools/real_stacks/SCRIPT ARGS --name NAME --out OUT/NAME

one at a time (never two trainings at once).  Runs whose folder already has truth.json are skipped
unless --force.  A run that takes more than --timeout seconds is killed (its whole process group).
Failures go to OUT/_failures.json (name, script, args, exit code, log tail) and their half-written
folder is removed; every log is in OUT/_logs/<name>.log.  After a run the traces are gzipped in
place (gzip -9 -n) and truth.json's trace_files updated.  torch comes from $TORCHENV (default
/work/torchvenv).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_MATRIX = os.path.join(HERE, "stacks-matrix.json")
sys.path.insert(0, os.path.join(REPO, "tools", "real_traces"))
from gen_corpus import gzip_traces, run_matrix  # noqa: E402  (the same driver loop as the hand-written corpus)


def run_one(run: dict, out: str, torchenv: str, timeout: float) -> tuple[bool, dict]:
    name = run["name"]
    args = run["args"] if isinstance(run["args"], list) else shlex.split(run["args"])
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    logs = os.path.join(out, "_logs")
    os.makedirs(logs, exist_ok=True)
    log_path = os.path.join(logs, name + ".log")
    script = os.path.join("tools", "real_stacks", run["script"])
    cmd = [os.path.join(torchenv, "bin", "torchrun"), "--standalone", "--nproc_per_node", str(run.get("nproc", 2)),
           script, *args, "--name", name, "--out", run_dir]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    secs = round(time.time() - t0, 1)
    info = {"name": name, "script": run["script"], "nproc": run.get("nproc", 2), "args": args, "seconds": secs,
            "exit_code": rc, "timed_out": timed_out}
    ok = rc == 0 and os.path.exists(os.path.join(run_dir, "truth.json"))
    if ok:
        try:
            info["trace_files"] = gzip_traces(run_dir)
        except Exception as exc:  # noqa: BLE001
            ok = False
            info["error"] = str(exc)
    if not ok:
        with open(log_path, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if not ln.startswith("USDT:")]
        info["log_tail"] = "\n".join(lines[-40:])
        shutil.rmtree(run_dir, ignore_errors=True)  # no half-written run: a rerun retries it
    return ok, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrix", default=DEFAULT_MATRIX, help="JSON matrix file")
    ap.add_argument("--out", help="output folder (one sub-folder per run)")
    ap.add_argument("--force", action="store_true", help="rerun runs that already have truth.json")
    ap.add_argument("--only", nargs="*", default=None, help="only these run names")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds before a run is killed")
    ap.add_argument("--list", action="store_true", help="print the matrix and exit")
    a = ap.parse_args()

    with open(a.matrix) as f:
        matrix = json.load(f)
    names = [r["name"] for r in matrix]
    assert len(set(names)) == len(names), "duplicate run names in the matrix"
    if a.only:
        unknown = set(a.only) - set(names)
        if unknown:
            ap.error(f"unknown runs: {sorted(unknown)}")
        matrix = [r for r in matrix if r["name"] in set(a.only)]
    if a.list:
        for r in matrix:
            args = r["args"] if isinstance(r["args"], str) else shlex.join(r["args"])
            print(f"{r['name']}: torchrun --nproc_per_node {r.get('nproc', 2)} {r['script']} {args}")
        print(f"{len(matrix)} runs", file=sys.stderr)
        return
    if not a.out:
        ap.error("--out is required")
    torchenv = os.environ.get("TORCHENV", "/work/torchvenv")
    run_matrix(matrix, a.out, a.force, lambda run: run_one(run, a.out, torchenv, a.timeout))

if __name__ == "__main__":
    main()
