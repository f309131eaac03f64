"""`strag analyze` against the authors' analyzer, whole command against whole commands (issue 12).

    .venv/bin/python benchmarks/bench_whatif.py [--quick] [--keep DIR]

For each trace -- the published AR trace (117,216 ops) and generated 1,024- and 8,192-GPU
jobs (tp 16, 32 microbatches, 40 steps, one slow worker; ~0.47 M and ~3.9 M ops) written in
the published format (`--quick`: AR and 1,024 GPUs):

* the reference: `../shared/reference/run-reference TRACE META OUT` -- its three commands
  (wia, compute_ms, compute_mw), total wall seconds and max RSS as it reports them, best of
  as many runs as ours. Its first use builds a private venv; that happens once, untimed,
  before the figures;
* ours: `strag analyze TRACE --meta META --json OUT.json` in a fresh process (default
  --threads: the CPUs it may use): wall seconds (best of a few runs), that process's max
  RSS, and the engine seconds the summary prints. Our modules are compiled to bytecode first,
  as on any command's second run (this machine sets PYTHONDONTWRITEBYTECODE);
* the ratio reference / ours, against the targets (AR >= 15x; 8,192 GPUs >= 40x and
  <= 1 GiB peak RSS), and parity: every field of the reference's result, mw and ms JSON
  equal to ours to 1e-6 relative (transforms/whatif/parity.py).

Then the import cost of the one-job path from `python -X importtime`: the total, the largest
top-level imports, and which heavy modules it loads (pandas, pyarrow.dataset, pyarrow.compute,
numpy.ma, fsspec, apache_beam, great_expectations; target: none). The machine is shared: every figure is
printed with the load average at the time, and ratios are measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "reference"
PUBLISHED = REFERENCE / "straggler-analysis"
RUN_REFERENCE = REFERENCE / "run-reference"
SHAPES = {1024: (8, 8), 8192: (32, 16)}   # GPUs -> (dp, pp) at tp 16
AR_TARGET, BIG_TARGET, BIG_MEMORY = 15.0, 40.0, 2**30
HEAVY_MODULES = ("pandas", "pyarrow.dataset", "pyarrow.compute", "numpy.ma", "fsspec", "apache_beam", "great_expectations")

# Writes a generated job as trace-{trial}.parquet + meta-{trial}.yaml in the published format.
_GENERATE = r"""
import sys, yaml, pyarrow.parquet as pq
from pipelines.reference import META_FIELDS, published_trace_from_lake
from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec, generate_job
dp, pp, folder, trial = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
spec = JobSpec(job_id=trial, dp=dp, pp=pp, tp=16, microbatches=32, steps=40, sessions=4, seed=7,
               causes=(Cause("slow_worker", {"dp_rank": dp // 2, "stage": pp // 2}),))
job = generate_job(spec)
table, notes = published_trace_from_lake(job.trace)
assert not notes, notes
pq.write_table(table, f"{folder}/trace-{trial}.parquet")
m = job.meta
meta = dict(trial_name=trial, run_id=0, dp_size=m.dp_size, dsp_size=m.dsp_size, pp_size=m.pp_size,
            tp_size=m.tp_size, vpp_size=m.vpp_size, world_size=m.world_size)
with open(f"{folder}/meta-{trial}.yaml", "w") as handle:
    yaml.safe_dump({k: meta[k] for k in META_FIELDS}, handle, sort_keys=False)
print(table.num_rows)
"""


def load() -> str:
    """The 1-minute load average and the number of cores, for the figures' context."""
    return f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def subprocess_env() -> dict[str, str]:
    """This checkout first on the path, one thread per numeric library (the machine is shared)."""
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def strag_command() -> list[str]:
    """The installed `strag` console script beside this interpreter (what users run), else `-m`."""
    script = pathlib.Path(sys.executable).with_name("strag")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pipelines.cli"]


def timed(command: list[str], log: pathlib.Path) -> tuple[float, int]:
    """Run a whole command (output to `log`); (wall seconds, its max RSS in bytes). Fails loud."""
    with log.open("w") as out:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(), cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {process.returncode}:\n{log.read_text()[-2000:]}")
    return seconds, usage.ru_maxrss * 1024


def run_reference(trace: pathlib.Path, meta: pathlib.Path, out: pathlib.Path) -> dict:
    """The authors' analyzer on one trace: its JSON line (wia_s, ms_s, mw_s, total_s, max_rss_mb)."""
    done = subprocess.run([str(RUN_REFERENCE), str(trace), str(meta), str(out)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"run-reference failed on {trace}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_ours(trace: pathlib.Path, meta: pathlib.Path, out: pathlib.Path, repeats: int) -> dict:
    """`strag analyze` as a whole command, best of `repeats`: wall s, max RSS, engine s, the JSON."""
    json_out, log = out / "strag.json", out / "strag.log"
    best = None
    for _ in range(repeats):
        seconds, rss = timed([*strag_command(), "analyze", str(trace), "--meta", str(meta), "--json", str(json_out)], log)
        found = re.search(r"analysed in ([0-9.]+) s \(compile ([0-9.]+), replay ([0-9.]+), causes ([0-9.]+)\)", log.read_text())
        engine, *parts = (float(x) for x in found.groups())
        if best is None or seconds < best["seconds"]:
            best = {"seconds": seconds, "max_rss": rss, "engine": engine, "parts": dict(zip(("compile", "replay", "causes"), parts))}
    best["json"] = json.loads(json_out.read_text())
    return best


def parity(ours: dict, reference_out: pathlib.Path, trial: str) -> str:
    from transforms.whatif.parity import json_mismatches

    expected = {part: json.loads((reference_out / f"{part}-{trial}.json").read_text()) for part in ("result", "mw", "ms")}
    problems = json_mismatches(ours, expected)
    fields = sum(_count_values(expected[part]) for part in expected)
    if problems:
        return f"DIFFERENT from the reference: {len(problems)} of {fields} values, e.g. " + "; ".join(problems[:3])
    return f"all {fields:,} values of result/mw/ms equal to the reference's to 1e-6"


def _count_values(value) -> int:
    if isinstance(value, dict):
        return sum(_count_values(v) for v in value.values())
    if isinstance(value, list):
        return sum(_count_values(v) for v in value)
    return 1


def side_by_side(name: str, trace: pathlib.Path, meta: pathlib.Path, trial: str, work: pathlib.Path, repeats: int,
                 ops: int) -> dict:
    """Reference and ours on one trace, printed; returns the figures."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    before = load()
    theirs = min((run_reference(trace, meta, out / "reference") for _ in range(repeats)), key=lambda r: r["total_s"])
    ours = run_ours(trace, meta, out, repeats)
    ratio = theirs["total_s"] / ours["seconds"]
    print(f"{name} ({ops:,} ops; {before} before, {load()} after):")
    print(f"  reference  {theirs['total_s']:7.2f} s  (best of {repeats}; wia {theirs['wia_s']:.2f} + ms {theirs['ms_s']:.2f} + "
          f"mw {theirs['mw_s']:.2f}), max RSS {theirs['max_rss_mb'] / 1024:.2f} GiB")
    parts = ours["parts"]
    print(f"  strag      {ours['seconds']:7.2f} s  (best of {repeats}; engine {ours['engine']:.2f} s = compile "
          f"{parts['compile']:.2f} + replay {parts['replay']:.2f} + causes {parts['causes']:.2f}; "
          f"{ours['seconds'] / ops * 1e6:.2f} s per M ops), max RSS {ours['max_rss'] / 2**30:.2f} GiB")
    print(f"  causes / the replay they explain: {parts['causes'] / max(parts['replay'], 1e-9):.2f}x (target <= 1)")
    print(f"  ratio      {ratio:7.1f}x faster; {parity(ours['json'], out / 'reference', trial)}")
    return {"ratio": ratio, "max_rss": ours["max_rss"], "seconds": ours["seconds"]}


def import_cost(trace: pathlib.Path, meta: pathlib.Path) -> None:
    """`python -X importtime` of the one-job path: total, biggest top-level imports, heavy modules."""
    code = "import sys; from pipelines.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code, "analyze", str(trace), "--meta", str(meta)],
                          capture_output=True, text=True, env=subprocess_env(), cwd=ROOT)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    rows = []
    for line in done.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( +)(\S+)", line)
        if match:
            rows.append((int(match.group(2)), len(match.group(3)), match.group(4)))
    top = [(micros, module) for micros, depth, module in rows if depth == 1]
    loaded = {module for _, _, module in rows}
    heavy = [module for module in HEAVY_MODULES if module in loaded]
    print(f"import cost of `strag analyze` on AR (python -X importtime; {load()}):")
    print(f"  {sum(m for m, _ in top) / 1e6:.3f} s in {len(rows)} modules; largest top-level: "
          + ", ".join(f"{module} {micros / 1e3:.0f} ms" for micros, module in sorted(top, reverse=True)[:6]))
    print(f"  heavy modules loaded: {', '.join(heavy) if heavy else 'none'} "
          f"(of {', '.join(HEAVY_MODULES)}; target none: {'met' if not heavy else 'MISSED'})")


def generate(gpus: int, folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, str, int]:
    """A generated job in the published format (trace, meta, trial name, ops)."""
    dp, pp = SHAPES[gpus]
    trial = f"gen{gpus}"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _GENERATE, str(dp), str(pp), str(folder), trial],
                          capture_output=True, text=True, env=subprocess_env(), cwd=ROOT)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    ops = int(done.stdout.strip().splitlines()[-1])
    print(f"generated {trial}: dp {dp} x pp {pp} x tp 16, {ops:,} ops in {time.perf_counter() - started:.1f} s")
    return folder / f"trace-{trial}.parquet", folder / f"meta-{trial}.yaml", trial, ops


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def compile_bytecode() -> None:
    """Compile this checkout's modules to bytecode first, as Python does on a command's first run:
    a machine with PYTHONDONTWRITEBYTECODE set (this one) would otherwise recompile every module
    in every timed run (~30 ms of `strag analyze`), which no user's second run pays."""
    packages = [str(ROOT / name) for name in ("pipelines", "transforms", "schemas")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], check=True, stdout=subprocess.DEVNULL)
    print(f"bytecode of {', '.join(p.rsplit('/', 1)[-1] for p in packages)} compiled before the timings "
          f"(PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', 'unset')})\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="AR and the 1,024-GPU job only")
    parser.add_argument("--keep", type=pathlib.Path, help="keep traces and outputs in this folder")
    args = parser.parse_args(argv)
    if not RUN_REFERENCE.exists():
        print(f"skipped: {RUN_REFERENCE} not found (clone the project with ../shared beside it)")
        return 0
    work = args.keep or pathlib.Path(tempfile.mkdtemp(prefix="bench-whatif-"))
    work.mkdir(parents=True, exist_ok=True)
    ar_trace, ar_meta = PUBLISHED / "trace-AR.parquet", PUBLISHED / "meta-AR.yaml"
    started = time.perf_counter()
    run_reference(ar_trace, ar_meta, work / "warm-up")   # builds the reference's venv on first use
    print(f"reference warm-up (venv build on first use): {time.perf_counter() - started:.1f} s\n")

    compile_bytecode()
    import_cost(ar_trace, ar_meta)
    print()
    ar = side_by_side("AR", ar_trace, ar_meta, "AR", work, repeats=5, ops=117_216)
    print(f"  target AR >= {AR_TARGET:.0f}x: {verdict(ar['ratio'] >= AR_TARGET)}\n")
    for gpus in ([1024] if args.quick else [1024, 8192]):
        trace, meta, trial, ops = generate(gpus, work)
        figures = side_by_side(f"{gpus:,} GPUs", trace, meta, trial, work, repeats=3 if gpus < 8192 else 2, ops=ops)
        if gpus == 8192:
            print(f"  target 8,192 GPUs >= {BIG_TARGET:.0f}x: {verdict(figures['ratio'] >= BIG_TARGET)}; "
                  f"<= 1 GiB peak RSS: {verdict(figures['max_rss'] <= BIG_MEMORY)}")
        print()
    if args.keep is None:
        import shutil

        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
