"""Generate a corpus of real 4-process torch runs with ground truth (stdlib only).

    python3 tools/real_traces/gen_corpus.py --matrix smoke --out /work/corpus-smoke
    python3 tools/real_traces/gen_corpus.py --matrix full  --out /work/corpus
    python3 tools/real_traces/gen_corpus.py --matrix my-matrix.json --out DIR [--force] [--only NAME ...]
    python3 tools/real_traces/gen_corpus.py --matrix full --list          # print the matrix

A matrix file is a JSON list of {"name": str, "args": [str, ...] | str} (train.py arguments, without
--out / --name).  Each run goes to OUT/<name>/ (traces, truth.json, PROVENANCE.json); runs whose
folder already has truth.json are skipped unless --force.  Runs are sequential (never two torchrun
jobs at once); a run that takes more than --timeout seconds (240) is killed (its process group).
Failures go to OUT/_failures.json (name, args, exit code, stderr tail); logs to OUT/_logs/<name>.log.
After a run, the traces are gzipped in place (gzip -9 -n): rank-{r}.json.gz (chrome export) or
<worker>.<timestamp>.pt.trace.json.gz (tensorboard export), and truth.json's trace_files are updated.

torch comes from $TORCHENV (default /work/torchvenv): $TORCHENV/bin/torchrun.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# ------------------------------------------------------------------------------------------------
# built-in matrices

# base configurations: (schedule, layout, groups, grad_sync, model, noise, microbatches, extra args)
# mlp on cpu uses 32-row microbatches (a 4-block stage forward ~11 ms on one thread); the transformer
# uses 2 sequences of 64 tokens (~15 ms); --noise sleep sleeps 3 ms per block forward, 6 ms backward.


def _run(name: str, schedule: str, layout: str, groups: str, grad: str, model: str, noise: str, mb: int,
         rs: int, prof: str = "1/1/4", export: str = "chrome", data: int = 0, stack: int = 0,
         seed: int = 0, slow: tuple = ()) -> dict:
    w, wu, a = prof.split("/")
    args = ["--schedule", schedule, "--layout", layout, "--groups", groups, "--grad-sync", grad,
            "--model", model, "--noise", noise, "--microbatches", str(mb), "--seed", str(seed),
            "--record-shapes", str(rs), "--with-stack", str(stack),
            "--prof-wait", w, "--prof-warmup", wu, "--prof-active", a, "--export", export,
            "--data-in-step", str(data)]
    if model == "mlp" and noise == "cpu":
        args += ["--microbatch-size", "32"]
    for s in slow:
        args += ["--slow", s]
    return {"name": name, "args": args}


def full_matrix() -> list[dict]:
    R = _run
    runs: list[dict] = []
    # ---- clean runs: 11 configurations, 1-3 seeds each (19 runs)
    for seed in (0, 1, 2):
        runs.append(R(f"clean-1f1b-ppmajor-flat-mlp-cpu-s{seed}", "1f1b", "pp2dp2-ppmajor", "mesh", "flat",
                      "mlp", "cpu", 8, 1, "1/1/4", seed=seed))
    for seed in (0, 1):
        runs.append(R(f"clean-interleaved-dpmajor-ng-async-tf-sleep-s{seed}", "interleaved", "pp2dp2-dpmajor",
                      "new_group", "async", "transformer", "sleep", 8, 0, "0/1/3", "tensorboard", seed=seed))
    for seed in (0, 1, 2):
        runs.append(R(f"clean-gpipe-pp4-mlp-sleep-data-s{seed}", "gpipe", "pp4", "mesh", "none", "mlp", "sleep",
                      6, 1, "2/1/2", data=1, seed=seed))
    for seed in (0, 1):
        runs.append(R(f"clean-dp4-ddp-tf-cpu-data-s{seed}", "dp", "dp4", "mesh", "ddp", "transformer", "cpu",
                      4, 0, "1/1/4", data=1, seed=seed))
    for seed in (0, 1):
        runs.append(R(f"clean-zbv-ppmajor-ng-flat-tf-cpu-s{seed}", "zbv", "pp2dp2-ppmajor", "new_group", "flat",
                      "transformer", "cpu", 8, 1, "0/1/3", "tensorboard", seed=seed))
    for seed in (0, 1):
        runs.append(R(f"clean-1f1b-dpmajor-ddp-mlp-sleep-stack-s{seed}", "1f1b", "pp2dp2-dpmajor", "mesh", "ddp",
                      "mlp", "sleep", 12, 0, "1/1/4", stack=1, seed=seed))
    runs.append(R("clean-izb-pp4-ng-tf-sleep-s0", "izb", "pp4", "new_group", "none", "transformer", "sleep",
                  8, 0, "2/1/2"))
    runs.append(R("clean-dualpipev-ppmajor-flat-mlp-cpu-s0", "dualpipev", "pp2dp2-ppmajor", "mesh", "flat",
                  "mlp", "cpu", 8, 0, "1/1/4"))
    runs.append(R("clean-loopedbfs-dpmajor-flat-mlp-sleep-s0", "loopedbfs", "pp2dp2-dpmajor", "mesh", "flat",
                  "mlp", "sleep", 4, 1, "0/1/3", "tensorboard"))
    runs.append(R("clean-dp4-fsdp2-mlp-cpu-s0", "dp", "dp4", "mesh", "fsdp2", "mlp", "cpu", 4, 0, "0/1/3"))
    runs.append(R("clean-dp4-async-mlp-sleep-ng-s0", "dp", "dp4", "new_group", "async", "mlp", "sleep", 6, 1,
                  "1/1/4", data=1))

    # ---- forward 2x / 3x
    runs.append(R("fwd2-r1-1f1b-ppmajor-flat-mlp-cpu", "1f1b", "pp2dp2-ppmajor", "mesh", "flat", "mlp", "cpu",
                  8, 1, slow=("fwd:1:2",)))
    runs.append(R("fwd3-r2-interleaved-dpmajor-ng-async-tf-sleep", "interleaved", "pp2dp2-dpmajor", "new_group",
                  "async", "transformer", "sleep", 8, 0, "0/1/3", "tensorboard", slow=("fwd:2:3",)))
    runs.append(R("fwd2-r3-gpipe-pp4-mlp-sleep", "gpipe", "pp4", "mesh", "none", "mlp", "sleep", 6, 1, "2/1/2",
                  slow=("fwd:3:2",)))
    runs.append(R("fwd3-r0-dp4-ddp-tf-cpu", "dp", "dp4", "mesh", "ddp", "transformer", "cpu", 4, 0, "1/1/4",
                  data=1, slow=("fwd:0:3",)))
    runs.append(R("fwd2-r0-zbv-ppmajor-flat-tf-cpu", "zbv", "pp2dp2-ppmajor", "mesh", "flat", "transformer",
                  "cpu", 8, 1, "0/1/3", slow=("fwd:0:2",)))
    runs.append(R("fwd3-r2-dualpipev-ppmajor-ng-flat-mlp-sleep", "dualpipev", "pp2dp2-ppmajor", "new_group",
                  "flat", "mlp", "sleep", 8, 0, "1/1/4", "tensorboard", slow=("fwd:2:3",)))
    runs.append(R("fwd3-r1-dp4-fsdp2-mlp-cpu", "dp", "dp4", "mesh", "fsdp2", "mlp", "cpu", 4, 1, "0/1/3",
                  slow=("fwd:1:3",)))
    # ---- backward 2x
    runs.append(R("bwd2-r3-1f1b-dpmajor-ddp-mlp-sleep", "1f1b", "pp2dp2-dpmajor", "mesh", "ddp", "mlp", "sleep",
                  8, 1, "1/1/4", slow=("bwd:3:2",)))
    runs.append(R("bwd2-r1-izb-ppmajor-flat-mlp-cpu", "izb", "pp2dp2-ppmajor", "mesh", "flat", "mlp", "cpu",
                  8, 0, "0/1/3", slow=("bwd:1:2",)))
    runs.append(R("bwd2-r2-dp4-async-tf-sleep", "dp", "dp4", "mesh", "async", "transformer", "sleep", 6, 0,
                  "2/1/2", "tensorboard", slow=("bwd:2:2",)))
    runs.append(R("bwd2-r2-loopedbfs-pp4-ng-mlp-cpu", "loopedbfs", "pp4", "new_group", "none", "mlp", "cpu",
                  8, 1, "1/1/4", slow=("bwd:2:2",)))
    # ---- CPU pause before every pipeline send (~2.5x the rank's per-microbatch compute per step)
    runs.append(R("send-r0-1f1b-ppmajor-flat-mlp-cpu", "1f1b", "pp2dp2-ppmajor", "mesh", "flat", "mlp", "cpu",
                  8, 0, "1/1/4", slow=("send:0:30",)))
    runs.append(R("send-r1-interleaved-dpmajor-async-tf-sleep", "interleaved", "pp2dp2-dpmajor", "mesh", "async",
                  "transformer", "sleep", 8, 1, "0/1/3", slow=("send:1:5",)))
    runs.append(R("send-r2-gpipe-pp4-ng-mlp-sleep", "gpipe", "pp4", "new_group", "none", "mlp", "sleep", 6, 0,
                  "2/1/2", "tensorboard", slow=("send:2:6",)))
    runs.append(R("send-r3-zbv-ppmajor-flat-mlp-cpu", "zbv", "pp2dp2-ppmajor", "mesh", "flat", "mlp", "cpu",
                  8, 1, "1/1/4", slow=("send:3:18",)))
    # ---- CPU pause before the gradient all-reduce
    runs.append(R("allreduce-r2-1f1b-ppmajor-flat-mlp-cpu", "1f1b", "pp2dp2-ppmajor", "mesh", "flat", "mlp",
                  "cpu", 8, 1, "1/1/4", slow=("allreduce:2:250",)))
    runs.append(R("allreduce-r1-dp4-ddp-mlp-cpu", "dp", "dp4", "mesh", "ddp", "mlp", "cpu", 4, 0, "0/1/3",
                  slow=("allreduce:1:450",)))
    runs.append(R("allreduce-r0-interleaved-ppmajor-async-tf-sleep", "interleaved", "pp2dp2-ppmajor", "mesh",
                  "async", "transformer", "sleep", 8, 0, "1/1/4", "tensorboard", slow=("allreduce:0:140",)))
    runs.append(R("allreduce-r3-dp4-flat-mlp-sleep-ng", "dp", "dp4", "new_group", "flat", "mlp", "sleep", 4, 1,
                  "2/1/2", slow=("allreduce:3:250",)))
    # ---- gc.collect() over a big live heap once per microbatch forward
    runs.append(R("gc-r1-1f1b-ppmajor-flat-mlp-cpu-stack", "1f1b", "pp2dp2-ppmajor", "mesh", "flat", "mlp", "cpu",
                  8, 0, "1/1/4", stack=1, slow=("gc:1:150",)))
    runs.append(R("gc-r2-dp4-ddp-tf-sleep", "dp", "dp4", "mesh", "ddp", "transformer", "sleep", 6, 1, "0/1/3",
                  slow=("gc:2:200",)))
    runs.append(R("gc-r0-izb-dpmajor-flat-mlp-sleep", "izb", "pp2dp2-dpmajor", "mesh", "flat", "mlp", "sleep",
                  8, 0, "1/1/4", slow=("gc:0:50",)))
    # ---- slow data loader (DataLoader iterated inside the step)
    runs.append(R("data-r3-1f1b-ppmajor-flat-mlp-cpu", "1f1b", "pp2dp2-ppmajor", "mesh", "flat", "mlp", "cpu",
                  8, 1, "1/1/4", data=1, slow=("data:3:250",)))
    runs.append(R("data-r1-dp4-async-mlp-sleep", "dp", "dp4", "mesh", "async", "mlp", "sleep", 4, 0, "0/1/3",
                  data=1, slow=("data:1:180",)))
    runs.append(R("data-r0-interleaved-pp4-ng-tf-sleep", "interleaved", "pp4", "new_group", "none",
                  "transformer", "sleep", 8, 0, "2/1/2", "tensorboard", data=1, slow=("data:0:60",)))
    # ---- two slow ranks in different stages
    runs.append(R("two-fwd3-r0-r3-1f1b-ppmajor-flat-mlp-cpu", "1f1b", "pp2dp2-ppmajor", "mesh", "flat", "mlp",
                  "cpu", 8, 0, "1/1/4", slow=("fwd:0:3", "fwd:3:3")))
    runs.append(R("two-fwd3-r1-bwd2-r3-gpipe-pp4-mlp-sleep", "gpipe", "pp4", "mesh", "none", "mlp", "sleep", 6,
                  1, "0/1/3", slow=("fwd:1:3", "bwd:3:2")))
    runs.append(R("two-send-r0-gc-r3-interleaved-dpmajor-flat-tf-sleep", "interleaved", "pp2dp2-dpmajor",
                  "new_group", "flat", "transformer", "sleep", 8, 0, "1/1/4", slow=("send:0:5", "gc:3:50")))
    # ---- uneven stage split (stage 0 gets 3x the blocks)
    runs.append(R("split-1f1b-ppmajor-flat-mlp-cpu", "1f1b", "pp2dp2-ppmajor", "mesh", "flat", "mlp", "cpu", 8,
                  1, "1/1/4", slow=("split:uneven",)))
    runs.append(R("split-gpipe-pp4-mlp-sleep", "gpipe", "pp4", "mesh", "none", "mlp", "sleep", 6, 0, "2/1/2",
                  slow=("split:uneven",)))
    runs.append(R("split-interleaved-dpmajor-ng-async-tf-sleep", "interleaved", "pp2dp2-dpmajor", "new_group",
                  "async", "transformer", "sleep", 8, 0, "0/1/3", "tensorboard", slow=("split:uneven",)))
    runs.append(R("split-zbv-ppmajor-flat-tf-cpu", "zbv", "pp2dp2-ppmajor", "mesh", "flat", "transformer", "cpu",
                  4, 1, "1/1/4", slow=("split:uneven",)))
    runs.append(R("split-1f1b-dpmajor-ddp-mlp-sleep-mb12", "1f1b", "pp2dp2-dpmajor", "mesh", "ddp", "mlp",
                  "sleep", 12, 0, "1/1/4", data=1, slow=("split:uneven",)))
    return runs


def smoke_matrix() -> list[dict]:
    R = _run
    return [
        R("smoke-clean-1f1b-ppmajor-flat-mlp-cpu", "1f1b", "pp2dp2-ppmajor", "mesh", "flat", "mlp", "cpu", 4, 1,
          "0/1/2"),
        R("smoke-send-r1-interleaved-dpmajor-ng-async-tf-sleep", "interleaved", "pp2dp2-dpmajor", "new_group",
          "async", "transformer", "sleep", 4, 0, "0/1/2", "tensorboard", data=1, slow=("send:1:10",)),
        R("smoke-fwd2-r2-dp4-ddp-mlp-sleep", "dp", "dp4", "mesh", "ddp", "mlp", "sleep", 4, 0, "0/1/2",
          data=1, slow=("fwd:2:2", "data:1:100")),
        R("smoke-split-gpipe-pp4-tf-cpu", "gpipe", "pp4", "new_group", "none", "transformer", "cpu", 4, 1, "0/1/2",
          slow=("split:uneven",)),
    ]


# ------------------------------------------------------------------------------------------------


def gzip_traces(run_dir: str) -> list[str]:
    truth_path = os.path.join(run_dir, "truth.json")
    with open(truth_path) as f:
        truth = json.load(f)
    new = []
    for name in truth["trace_files"]:
        if name is None:
            raise RuntimeError("a rank wrote no trace")
        p = os.path.join(run_dir, name)
        if not name.endswith(".gz"):
            if not os.path.exists(p):
                raise RuntimeError(f"missing trace {name}")
            subprocess.run(["gzip", "-9", "-n", "-f", p], check=True)
            name += ".gz"
        if not os.path.exists(os.path.join(run_dir, name)):
            raise RuntimeError(f"missing trace {name}")
        new.append(name)
    truth["trace_files"] = new
    with open(truth_path, "w") as f:
        json.dump(truth, f, indent=2)
        f.write("\n")
    return new


def _processes(args: list[str]) -> int:
    """Processes a run needs: pp x dp of its --layout (ppPdpD-order, ppN, dpN; train.py's default: 4)."""
    layout = args[args.index("--layout") + 1] if "--layout" in args else "pp2dp2"
    return math.prod(int(n) for n in re.findall(r"\d+", layout))


def run_one(run: dict, out: str, torchrun: str, timeout: float) -> tuple[bool, dict]:
    args = run["args"] if isinstance(run["args"], list) else shlex.split(run["args"])
    run_dir = os.path.join(out, run["name"])
    cmd = [torchrun, "--standalone", "--nproc_per_node", str(_processes(args)), os.path.join(HERE, "train.py"), *args,
           "--name", run["name"], "--out", run_dir]
    ok, info = launch(run["name"], cmd, out, timeout)
    if "log_tail" in info:
        info["stderr_tail"] = info.pop("log_tail")
    return ok, {"name": run["name"], "args": args, **info}


def launch(name: str, cmd: list[str], out: str, timeout: float, env: dict | None = None) -> tuple[bool, dict]:
    """Run one training `cmd` (writing OUT/<name>, its log in OUT/_logs/<name>.log) in a process group
    killed after `timeout` s; gzip its traces. (ok, {seconds, exit_code, timed_out, trace_files | error,
    log_tail}); a failed run's folder is removed, so a rerun retries it."""
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    logs = os.path.join(out, "_logs")
    os.makedirs(logs, exist_ok=True)
    log_path = os.path.join(logs, name + ".log")
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
    info = {"seconds": round(time.time() - t0, 1), "exit_code": rc, "timed_out": timed_out}
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
    ap.add_argument("--matrix", default="full", help="full | smoke | path to a JSON matrix file")
    ap.add_argument("--out", help="output folder (one sub-folder per run)")
    ap.add_argument("--force", action="store_true", help="rerun runs that already have truth.json")
    ap.add_argument("--only", nargs="*", default=None, help="only these run names")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds before a run is killed")
    ap.add_argument("--list", action="store_true", help="print the matrix and exit")
    a = ap.parse_args()

    if a.matrix == "full":
        matrix = full_matrix()
    elif a.matrix == "smoke":
        matrix = smoke_matrix()
    else:
        with open(a.matrix) as f:
            matrix = json.load(f)
    names = [r["name"] for r in matrix]
    assert len(set(names)) == len(names), "duplicate run names in the matrix"
    if a.only:
        matrix = [r for r in matrix if r["name"] in set(a.only)]
    if a.list:
        for r in matrix:
            args = r["args"] if isinstance(r["args"], str) else shlex.join(r["args"])
            print(f"{r['name']}: {args}")
        print(f"{len(matrix)} runs", file=sys.stderr)
        return
    if not a.out:
        ap.error("--out is required")
    torchrun = os.path.join(os.environ.get("TORCHENV", "/work/torchvenv"), "bin", "torchrun")
    run_matrix(matrix, a.out, a.force, lambda run: run_one(run, a.out, torchrun, a.timeout))


def run_matrix(matrix: list[dict], out: str, force: bool, run_one) -> None:
    """Run each of the matrix's runs (one at a time) into OUT/<name>, skipping those already done
    (truth.json) unless `force`; failures kept in OUT/_failures.json. `run_one(run)` -> (ok, info)."""
    os.makedirs(out, exist_ok=True)
    fail_path = os.path.join(out, "_failures.json")
    failures = {}
    if os.path.exists(fail_path):
        with open(fail_path) as f:
            failures = {x["name"]: x for x in json.load(f)}
    n_ok = n_skip = 0
    t_all = time.time()
    for i, run in enumerate(matrix, 1):
        if not force and os.path.exists(os.path.join(out, run["name"], "truth.json")):
            n_skip += 1
            failures.pop(run["name"], None)
            continue
        ok, info = run_one(run)
        status = "ok" if ok else ("TIMEOUT" if info["timed_out"] else f"FAILED rc={info['exit_code']}")
        print(f"[{i}/{len(matrix)}] {run['name']}: {status} in {info['seconds']} s", flush=True)
        if ok:
            n_ok += 1
            failures.pop(run["name"], None)
        else:
            failures[run["name"]] = info
        with open(fail_path, "w") as f:
            json.dump(list(failures.values()), f, indent=2)
            f.write("\n")
    print(f"done in {time.time() - t_all:.0f} s: {n_ok} ran, {n_skip} skipped, {len(failures)} failed "
          f"(see {fail_path})", flush=True)

if __name__ == "__main__":
    main()
