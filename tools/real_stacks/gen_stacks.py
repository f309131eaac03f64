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
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_MATRIX = os.path.join(HERE, "stacks-matrix.json")
sys.path.insert(0, os.path.join(REPO, "tools", "real_traces"))
from gen_corpus import launch, run_matrix  # noqa: E402  (the same driver loop as the hand-written corpus)


def run_one(run: dict, out: str, torchenv: str, timeout: float) -> tuple[bool, dict]:
    name = run["name"]
    args = run["args"] if isinstance(run["args"], list) else shlex.split(run["args"])
    script = os.path.join("tools", "real_stacks", run["script"])
    cmd = [os.path.join(torchenv, "bin", "torchrun"), "--standalone", "--nproc_per_node", str(run.get("nproc", 2)),
           script, *args, "--name", name, "--out", os.path.join(out, name)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    ok, info = launch(name, cmd, out, timeout, env)
    return ok, {"name": name, "script": run["script"], "nproc": run.get("nproc", 2), "args": args, **info}


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
