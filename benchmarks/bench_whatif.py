"""What-if engine speed and memory (issue 3 targets), printed as figures.

    .venv/bin/python benchmarks/bench_whatif.py [--quick]

1. AR (the published 117,216-op trace): full analysis in-process (compile, S, attribution
   by DP rank / stage / optype, S_w, M_W, M_S), best of several runs, against the 5 s the
   reference analyzer needs in-process (target: <= 0.17 s, i.e. 30x), numbers checked
   against the published outputs.
2. Generated jobs of 256, 1,024, 4,096 and 8,192 GPUs (tp 16, 32 microbatches, 40 sampled
   steps; the largest is dp 32 x pp 16, ~4 million ops): full analysis time, time per
   million ops and peak memory, each in a fresh subprocess pinned to one core (targets for
   8,192 GPUs: <= 20 s and <= 4 GiB). Peak memory is the process's max RSS (it includes the
   interpreter and the loaded trace) and, separately, tracemalloc's peak of the analysis.
Everything runs on numpy alone: the replay walks topological levels, each a handful of
vectorised max/add calls over [op, scenario, lane] blocks, so Python overhead is per level
(hundreds), not per op (millions); numba is not needed to meet the targets.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "reference" / "straggler-analysis"
REFERENCE_SECONDS = 5.0   # the reference analyzer in-process on AR, incl. M_W and M_S (issue 3)
AR_TARGET = REFERENCE_SECONDS / 30
SHAPES = {256: (4, 4), 1024: (8, 8), 4096: (16, 16), 8192: (32, 16)}   # GPUs -> (dp, pp) at tp 16

_ANALYSE = r"""
import json, os, resource, sys, time, tracemalloc
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import pyarrow.parquet as pq
from transforms.whatif import JobMeta, analyze_job
path, meta_json, trace_memory = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
table = pq.read_table(path)
meta = JobMeta(**json.loads(meta_json))
if trace_memory:
    tracemalloc.start()
started = time.perf_counter()
result = analyze_job(table, meta, "bench")
seconds = time.perf_counter() - started
peak = tracemalloc.get_traced_memory()[1] if trace_memory else None
print(json.dumps({"seconds": seconds, "rows": table.num_rows, "slowdown": result.slowdown,
                  "mw": result.mw.rem if result.mw else None,
                  "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "traced_peak": peak}))
"""

_GENERATE = r"""
import json, sys
import pyarrow.parquet as pq
from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec, generate_job
dp, pp, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
spec = JobSpec(job_id="bench", dp=dp, pp=pp, tp=16, microbatches=32, steps=40, sessions=4, seed=7,
               causes=(Cause("slow_worker", {"dp_rank": dp // 2, "stage": pp // 2}),))
job = generate_job(spec)
pq.write_table(job.trace, path)
m = job.meta
print(json.dumps(dict(dp_size=m.dp_size, pp_size=m.pp_size, tp_size=m.tp_size, dsp_size=m.dsp_size,
                      vpp_size=m.vpp_size, world_size=m.world_size)))
"""


def _python(code: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(done.stderr)
    return done.stdout.strip().splitlines()[-1]


def bench_ar(repeats: int) -> None:
    import pyarrow.parquet as pq
    import yaml

    from transforms.whatif import JobMeta, analyze_job

    table = pq.read_table(REFERENCE / "trace-AR.parquet")
    meta = JobMeta.from_mapping(yaml.safe_load((REFERENCE / "meta-AR.yaml").read_text()))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = analyze_job(table, meta, "AR")
        times.append(time.perf_counter() - started)
    expected = json.loads((REFERENCE / "result-AR.json").read_text())
    mw = json.loads((REFERENCE / "mw-AR.json").read_text())
    ms = json.loads((REFERENCE / "ms-AR.json").read_text())
    same = (abs(result.slowdown / expected["blocking_slowdown"] - 1) < 1e-6
            and abs(result.mw.rem / mw["Mw"] - 1) < 1e-6 and abs(result.ms.rem / ms["Ms"] - 1) < 1e-6)
    best = min(times)
    print(f"AR ({table.num_rows:,} ops, {len(result.steps)} steps, dp {meta.dp_size} x pp {meta.pp_size}): "
          f"full analysis incl. attribution, M_W, M_S")
    print(f"  best {best:.3f} s, median {statistics.median(times):.3f} s over {repeats} runs in-process")
    print(f"  vs reference {REFERENCE_SECONDS:.1f} s: {REFERENCE_SECONDS / best:.0f}x faster "
          f"(target <= {AR_TARGET:.2f} s = 30x: {'met' if best <= AR_TARGET else 'MISSED'})")
    print(f"  S = {result.slowdown:.6f}, M_W = {result.mw.rem:.6f}, M_S = {result.ms.rem:.6f}: "
          f"{'equal to the published outputs (1e-6)' if same else 'DIFFERENT from the published outputs'}")


def bench_scaling(sizes: list[int]) -> None:
    print("generated jobs (tp 16, 32 microbatches, 40 steps, one slow worker), fresh process on one core:")
    print(f"  {'GPUs':>5} {'dp x pp':>8} {'ops':>10} {'analysis s':>10} {'s / M ops':>9} {'max RSS':>9} {'traced peak':>11}")
    with tempfile.TemporaryDirectory() as folder:
        for gpus in sizes:
            dp, pp = SHAPES[gpus]
            path = str(pathlib.Path(folder) / f"job-{gpus}.parquet")
            meta = _python(_GENERATE, str(dp), str(pp), path)
            timed = json.loads(_python(_ANALYSE, path, meta, "0"))
            traced = json.loads(_python(_ANALYSE, path, meta, "1"))
            per_million = timed["seconds"] / (timed["rows"] / 1e6)
            print(f"  {gpus:>5} {f'{dp} x {pp}':>8} {timed['rows']:>10,} {timed['seconds']:>10.2f} {per_million:>9.2f} "
                  f"{timed['max_rss'] / 2**30:>7.2f} G {traced['traced_peak'] / 2**30:>9.2f} G")
            if gpus == 8192:
                ok_time, ok_memory = timed["seconds"] <= 20, timed["max_rss"] <= 4 * 2**30
                print(f"  8,192 GPUs: {timed['seconds']:.1f} s (target <= 20 s: {'met' if ok_time else 'MISSED'}), "
                      f"peak {timed['max_rss'] / 2**30:.2f} GiB (target <= 4 GiB: {'met' if ok_memory else 'MISSED'}); "
                      f"S = {timed['slowdown']:.4f}, M_W = {timed['mw']:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="AR and the 256/1,024-GPU jobs only")
    args = parser.parse_args(argv)
    if REFERENCE.is_dir():
        bench_ar(repeats=5 if args.quick else 15)
    else:
        print(f"AR: skipped, {REFERENCE} not found")
    bench_scaling([256, 1024] if args.quick else [256, 1024, 4096, 8192])
    return 0


if __name__ == "__main__":
    sys.exit(main())
