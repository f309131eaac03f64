"""Pages on real jobs profiled window after window: what one window decides alone, what the job's
windows decide together (transforms/live/paging.py `pooled_page`). Prints figures.

    .venv/bin/python benchmarks/bench_live_windows.py [--torch-env /work/torchvenv] [--work DIR] [--steps 34]

Each job is a real training run of tools/real_stacks (transformers' Trainer or Lightning, DDP on
CPU ranks, torch from its own venv: never a dependency of strag) that lands its profiler windows
with strag_collect's one-line hook (a window of 3 active steps every 5 optimizer steps: ~7
windows, each a session of one job). Some runs slow one rank's forward or backward by a modest
factor (1.3-1.5x: on this 2-core machine within the 15-50% jitter of one window), the others are
clean. Then one real `strag watch` reads every window and the script prints, per job: its
windows, how many name the slowed rank by their own verdict, whether the job paged the slowed
rank (and from which window; "pooled" when the windows together decided), and any page naming
another rank; over the jobs: slowed jobs paged with the right rank, clean jobs paged at all.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (job, script, processes, slowed rank or None, the script's arguments)
JOBS = [
    ("hf-bwd15-r1", "hf_trainer.py", 2, 1, ["--model", "gpt2", "--batches", "packed", "--slow", "bwd:1:1.5"]),
    ("hf-fwd13-r0", "hf_trainer.py", 2, 0, ["--model", "gpt2", "--batches", "packed", "--slow", "fwd:0:1.3"]),
    ("hf-clean", "hf_trainer.py", 2, None, ["--model", "gpt2", "--batches", "packed"]),
    ("lt-bwd14-r0", "lightning_ddp.py", 2, 0, ["--model", "mlp", "--profiler", "strag", "--slow", "bwd:0:1.4"]),
    ("lt-clean", "lightning_ddp.py", 2, None, ["--model", "mlp", "--profiler", "strag"]),
    ("hf4-fwd14-r2", "hf_trainer.py", 4, 2, ["--model", "gpt2", "--batches", "packed", "--slow", "fwd:2:1.4"]),
    ("hf4-clean", "hf_trainer.py", 4, None, ["--model", "gpt2", "--batches", "packed"]),
]


def _train(torch_env: pathlib.Path, lake: pathlib.Path, out: pathlib.Path, steps: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for job, script, nproc, _, args in JOBS:
        started = time.perf_counter()
        cmd = [str(torch_env / "bin" / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), script, *args,
               "--steps", str(steps), "--prof-active", "3", "--strag-lake", str(lake), "--strag-job-id", job,
               "--strag-every", "5", "--name", job, "--out", str(out / job)]
        with open(out / f"{job}.log", "w") as log:
            code = subprocess.run(cmd, cwd=ROOT / "tools" / "real_stacks", env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"  trained {job} ({nproc} ranks) in {time.perf_counter() - started:.0f} s, exit {code}", flush=True)
        if code:
            raise SystemExit(f"{job} failed: see {out / job}.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-env", type=pathlib.Path, default=pathlib.Path("/work/torchvenv"))
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/strag-bench-windows"))
    parser.add_argument("--steps", type=int, default=34, help="optimizer steps per run (34: 7 windows)")
    parser.add_argument("--reuse", action="store_true", help="watch the lake of an earlier run again (no training)")
    opts = parser.parse_args()
    lake, out, runs = opts.work / "lake", opts.work / "watch", opts.work / "runs"
    if not opts.reuse:
        shutil.rmtree(opts.work, ignore_errors=True)
        (lake / "landing").mkdir(parents=True)
        runs.mkdir(parents=True)
        _train(opts.torch_env, lake, runs, opts.steps)
    shutil.rmtree(out, ignore_errors=True)
    sessions = sum(1 for job in (lake / "landing").iterdir() for _ in job.iterdir())
    strag = pathlib.Path(sys.executable).with_name("strag")
    started = time.perf_counter()
    subprocess.run([str(strag), "watch", "--lake", str(lake), "--out", str(out), "--stop-after-sessions", str(sessions),
                    "--max-runtime", "900", "--session-timeout", "5", "--retain", "1000000"],
                   check=True, stdout=subprocess.DEVNULL, stderr=(out.parent / "watch.log").open("w"))
    print(f"strag watch: {sessions} windows in {time.perf_counter() - started:.0f} s")

    import pyarrow.dataset as ds

    results = ds.dataset(str(out / "live_results"), format="parquet").to_table().to_pylist()
    alerts = ds.dataset(str(out / "alerts"), format="parquet").to_table().to_pylist() if (out / "alerts").exists() else []
    right = alone_right = slowed = false = clean = 0
    print(f"{'job':<14} {'slowed':>6} {'windows':>7} {'alone':>5}  {'first alone':>11}  paged")
    for job, _, _, rank, _ in JOBS:
        rows = sorted((r for r in results if r["job_id"] == job), key=lambda r: _window(r["session"]))
        order = [r["session"] for r in rows]
        named = [i for i, r in enumerate(rows) if rank is not None and any(b["rank"] == rank for b in r["blamed"] or ())]
        fired = sorted((a for a in alerts if a["job_id"] == job and a["kind"] == "firing"), key=lambda a: _window(a["session"]))
        paged = [a for a in fired if rank in (a["ranks"] or ())]
        wrong = [a for a in fired if set(a["ranks"] or ()) - {rank}]
        first = (f"rank {rank} from window {order.index(paged[0]['session']) + 1}"
                 + (" (pooled)" if "windows together" in (paged[0]["message"] or "") else "")) if paged else "-"
        print(f"{job:<14} {'-' if rank is None else rank:>6} {len(rows):>7} {len(named):>5}  "
              f"{named[0] + 1 if named else '-':>11}  {first}"
              + (f"; other ranks {sorted({r for a in wrong for r in a['ranks'] or ()})}" if wrong else ""))
        if rank is None:
            clean += 1
            false += bool(fired)
        else:
            slowed += 1
            right += bool(paged) and not wrong
            alone_right += bool(named)
    print(f"slowed jobs paged with the right rank: {right} / {slowed} (by a window alone: {alone_right} / {slowed}); "
          f"clean jobs paged: {false} / {clean}")


def _window(session: str) -> tuple:
    """A session's window number (strag_collect names them {run}-w{n}), for ordering."""
    head, _, number = session.rpartition("-w")
    return (head, int(number)) if number.isdigit() else (session, 0)


if __name__ == "__main__":
    main()
