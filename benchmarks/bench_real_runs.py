"""Score `strag analyze` against the ground truth of real torch runs (issue 21).

    .venv/bin/python benchmarks/bench_real_runs.py [CORPUS ...] [--json OUT.json] [--only SUBSTR]

A corpus is a folder of run folders, each holding one torch.profiler trace per rank and a
`truth.json` written by tools/real_traces/train.py (what was slowed, how, on which rank, and the
accepted primary causes). Default corpus: tests/data/real_runs (the committed subset).

Every run is analysed as a user would: `strag analyze --format kineto DIR --json OUT` in a
subprocess, on a folder that holds only the rank traces (truth.json is never in reach of the
analyzer). Per run the table shows truth against strag (refused, S, replay discrepancy, verdict,
ranks blamed), a table per training stack (runs, refused, replay within 5% on the clean runs of 2
processes, verdicts right), then the scores with the issue's targets (`--strict` adds one expected
cause per injected kind, per-cause precision / recall and the confusion matrix):

- runs refused (exit != 0 or no result)                            target 0
- slowed ranks found exactly (blamed set == slowed set), runs
  slowed by >= 1.5x                                                target >= 95%
- false alarms: clean runs that name a cause or blame a rank       target <= 5%
- right primary cause (verdict in the run's accepted causes),
  slowed runs                                                      target >= 90%
- replay within 5% (|discrepancy - 1| <= 0.05), low-noise runs     target >= 90%
- replay within 5%, clean runs of 2 processes (real stacks)        target >= 90%

Counterfactuals (the fix's prediction against what a run without the slowdown measured):
- a GC run's own record of its collections (PROVENANCE.json): the pause fix's saving against the
  collections' share of the profiled steps;
- a clean twin: run folder NAME beside NAME-twin, the same command without `--slow` (same seed,
  config and profiler; tools/real_stacks/twins-matrix.json): the step time the expected cause's fix
  predicts (the slowed run's measured step times the fix's saving) against the twin's measured
  step time, each the median over the profiled steps of the trainer's own step times
  (PROVENANCE.json), as the paper's injection test compares estimated and measured slowdowns
  (estimated 1.21 / 1.42 / 1.98 against measured 1.16 / 1.40 / 2.03);
- within the run: a worker slowed on odd optimizer steps only (`--slow fwd:R:F:odd`,
  tools/real_stacks/odd-matrix.json): the fix's predicted mean step time against the mean of the
  run's own even (clean) profiled steps.

The discrepancy scored is the one that decides whether the window is kept (`replay_discrepancy`:
what ran over the model's replay, which gives back the untraced CPU time of workers the root-cause
analysis names, transforms/whatif/result.py UntracedWork); METHOD.md's own (observed over the
no-delay replay, `launch_slowdown`) is shown beside it, with the share within 5% by that rule.

A folder holding exactly the runs of a frozen matrix (tools/real_stacks/first-reads.json) gets that
matrix's first-read score printed beside the current one.
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
DEFAULT_CORPUS = ROOT / "tests" / "data" / "real_runs"
STRAG = [sys.executable, "-m", "pipelines.cli"]
SEVERE = 1.5      # "runs slowed by >= 1.5x"
PAUSE_KINDS = {"send", "allreduce", "gc", "gcin", "gcend", "sleep", "data"}   # sized by the generator to >= 1.5x the rank's compute
INSUFFICIENT = "insufficient-evidence"
FIRST_READS = ROOT / "tools" / "real_stacks" / "first-reads.json"   # frozen matrices' first-read scores (issue 35, 4d)

__all__ = ["find_runs", "analyse_run", "score", "main"]


def find_runs(corpora: list[pathlib.Path]) -> list[pathlib.Path]:
    """Every run folder (one holding truth.json) under the corpora, sorted by name."""
    runs = []
    for corpus in corpora:
        if (corpus / "truth.json").is_file():
            runs.append(corpus)
        else:
            runs.extend(p.parent for p in corpus.glob("*/truth.json"))
    return sorted(runs, key=lambda p: p.name)


def _trace_files(run: pathlib.Path, truth: dict) -> list[pathlib.Path]:
    named = [run / f for f in truth.get("trace_files", [])]
    if named and all(p.is_file() for p in named):
        return named
    return sorted(p for p in run.iterdir() if p.name.endswith((".json", ".json.gz")) and p.name != "truth.json"
                  and p.name != "PROVENANCE.json")


def _severity(slowdown: dict) -> float:
    if slowdown["kind"] in ("fwd", "bwd", "host"):   # an amount that is the factor
        return float(slowdown.get("amount") or 1.0)
    return SEVERE if slowdown["kind"] in PAUSE_KINDS else 1.0


def analyse_run(run: pathlib.Path) -> dict:
    """Truth and strag's answer for one run folder (strag in a subprocess, on the traces alone)."""
    truth = json.loads((run / "truth.json").read_text())
    expected = truth["expected"]
    row: dict = {"run": run.name, "truth": truth, "slow_ranks": sorted(expected["slow_ranks"]),
                 "straggling": bool(expected["straggling"]), "accepted": list(expected["primary_causes"]),
                 "noise": truth.get("noise", "cpu"),
                 "severe": any(_severity(s) >= SEVERE for s in truth.get("slowdowns", []))}
    with tempfile.TemporaryDirectory(prefix="strag-real-") as tmp:
        folder = pathlib.Path(tmp, run.name)
        folder.mkdir()
        for path in _trace_files(run, truth):
            os.symlink(path.resolve(), folder / path.name)
        out = pathlib.Path(tmp, "result.json")
        t0 = time.perf_counter()
        proc = subprocess.run([*STRAG, "analyze", "--format", "kineto", str(folder), "--json", str(out)],
                              cwd=ROOT, capture_output=True, text=True)
        row["seconds"] = time.perf_counter() - t0
        if proc.returncode != 0 or not out.is_file():
            message = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            row.update(refused=True, reason=message[-1] if message else f"exit {proc.returncode}")
            return row
        result = json.loads(out.read_text())
    coords = {(c["dp"], c["pp"]): int(r) for r, c in truth["rank_coords"].items()}
    verdict = result.get("verdict") or {}
    row["counterfactual"] = gc_counterfactual(run, truth, verdict)
    row["twin"] = twin_counterfactual(run, truth, verdict) or odd_steps_counterfactual(run, truth, verdict)
    blamed = sorted({coords.get((int(d), int(s)), -1) for d, s in verdict.get("implicated_workers") or []})
    row["named_steps"] = {coords.get((int(w["dp_rank"]), int(w["stage"])), -1): w.get("step_numbers")
                          for w in (verdict.get("evidence") or {}).get("peer_workers") or []
                          if not w.get("persistent", True) and [w["dp_rank"], w["stage"]] in (verdict.get("implicated_workers") or [])}
    untraced = result.get("untraced_work") or {}
    row.update(refused=False, reason="", S=untraced.get("slowdown", result["blocking_slowdown"]),
               discrepancy=result.get("replay_discrepancy", result["launch_slowdown"]), launch=result["launch_slowdown"],
               discarded=bool(result.get("discarded")), cause=verdict.get("cause") or "none",
               causes=list(verdict.get("causes") or []), blamed=blamed, confidence=verdict.get("confidence"))
    return row


def _step_seconds(run: pathlib.Path, truth: dict) -> dict[int, float]:
    """Per profiled optimizer step, its time as the run's trainer measured it (the slowest rank's:
    the job waits for it), from PROVENANCE.json; the step that ends the profiler's active window is
    left out (it also holds the trace's export). Empty without the record."""
    path = run / "PROVENANCE.json"
    if not path.is_file():
        return {}
    ranks = json.loads(path.read_text()).get("ranks") or {}
    profiler = truth.get("profiler") or {}
    first = int(profiler.get("wait", 0)) + int(profiler.get("warmup", 0))
    steps = range(first, first + max(int(profiler.get("active", 0)) - 1, 1))
    return {s: max(r["step_ms"][s] for r in ranks.values() if s < len(r.get("step_ms") or [])) / 1000.0
            for s in steps if any(s < len(r.get("step_ms") or []) for r in ranks.values())}


def odd_profiled_steps(truth: dict) -> list[int]:
    """The profiled step numbers a worker slowed on odd optimizer steps was slow in: the odd ones of
    the profiler's active window (its first step is wait + warmup)."""
    profiler = truth.get("profiler") or {}
    first = int(profiler.get("wait", 0)) + int(profiler.get("warmup", 0))
    return [s for s in range(first, first + int(profiler.get("active", 0))) if s % 2]


def intermittent_named(rows: list[dict]) -> tuple[int, int]:
    """Runs slowed on odd steps only: how many name the slowed rank as intermittent with exactly
    those steps (issue target: >= 90%)."""
    odd = [r for r in rows if not r["refused"] and r["truth"].get("slowdowns")
           and all(s.get("steps") == "odd" for s in r["truth"]["slowdowns"])]
    hits = sum(all((r.get("named_steps") or {}).get(rank) == odd_profiled_steps(r["truth"]) for rank in r["slow_ranks"])
               and bool(r["slow_ranks"]) for r in odd)
    return hits, len(odd)


def odd_steps_counterfactual(run: pathlib.Path, truth: dict, verdict: dict) -> dict | None:
    """A run whose worker was slowed on odd optimizer steps only: the expected cause's fix (the
    window's mean step time less its saving) against the mean of the run's even profiled steps."""
    slowdowns = truth.get("slowdowns") or []
    if not slowdowns or not all(s.get("steps") == "odd" for s in slowdowns):
        return None
    cause = truth["expected"]["primary_causes"][0]
    fix = (verdict.get("fixes") or {}).get(cause)
    times = _step_seconds(run, truth)
    even = [t for s, t in times.items() if s % 2 == 0]
    if fix is None or not even or len(even) == len(times):
        return None
    ran = sum(times.values()) / len(times)
    return {"cause": cause, "named": verdict.get("cause") or "none", "ran": ran, "measured": sum(even) / len(even),
            "predicted": ran * (1.0 - float(fix["savings_fraction"])), "within": True}


def _profiled_step_seconds(run: pathlib.Path, truth: dict) -> float | None:
    """The median over the profiled steps of a run's step time as its trainer measured it (per
    step, the slowest rank's: the job waits for it), from PROVENANCE.json; the step that ends the
    profiler's active window is left out (it also holds the trace's export). None without it."""
    times = sorted(_step_seconds(run, truth).values())
    return times[len(times) // 2] if times else None


def twin_counterfactual(run: pathlib.Path, truth: dict, verdict: dict) -> dict | None:
    """The expected cause's fix against the run's clean twin (folder NAME-twin beside it): predicted,
    the slowed run's measured step time less the fix's saving; measured, the twin's step time.
    None without a twin, or when strag gives no fix for that cause."""
    twin = run.parent / f"{run.name}-twin"
    if not truth["expected"]["straggling"] or not (twin / "truth.json").is_file():
        return None
    cause = truth["expected"]["primary_causes"][0]
    fix = (verdict.get("fixes") or {}).get(cause)
    ran = _profiled_step_seconds(run, truth)
    clean = _profiled_step_seconds(twin, json.loads((twin / "truth.json").read_text()))
    if fix is None or ran is None or clean is None:
        return None
    return {"cause": cause, "named": verdict.get("cause") or "none", "ran": ran, "measured": clean,
            "predicted": ran * (1.0 - float(fix["savings_fraction"]))}


def gc_counterfactual(run: pathlib.Path, truth: dict, verdict: dict) -> dict | None:
    """The GC pauses' fix against the run's own record of its collections (PROVENANCE.json of
    tools/real_stacks: per rank, the ms of each step and of each gc.collect()). Measured: over the
    profiled steps (the schedule's active ones), the longest collection of each step (the job waits
    for the slowest rank) over the job's wall time per step: each rank's mean step time, the ranks'
    median (every rank runs the same steps in the same wall time; a rank's step holds its own
    collection or its wait for a peer's, so the slowest rank per step would count a collection at a
    step's end twice, once in each rank's step). Predicted: the fix's saving with the pauses
    taken out and no planned GC paid back (what dropping the collections measures). None without
    a record or a pause fix."""
    path = run / "PROVENANCE.json"
    fix = next((f for c, f in (verdict.get("fixes") or {}).items() if c in ("python-gc", "untraced-cpu")
                and f.get("measured") and "pauses" in str(f.get("fix"))), None)
    if fix is None or not path.is_file():
        return None
    ranks = json.loads(path.read_text()).get("ranks") or {}
    if not any(r.get("gc_collects") for r in ranks.values()):
        return None
    profiler = truth.get("profiler") or {}
    first = int(profiler.get("wait", 0)) + int(profiler.get("warmup", 0))
    steps = range(first, first + int(profiler.get("active", 0)))
    collect = {s: max([ms for r in ranks.values() for step, ms in r.get("gc_collects") or [] if step == s], default=0.0)
               for s in steps}
    # the step that ends the profiler's active window also holds the trace's export (on_trace_ready
    # runs inside the trainer's timed step), seconds the training never spent: left out
    timed = [s for s in steps[:-1] if all(s < len(r["step_ms"]) for r in ranks.values())] or list(steps[:1])
    typical = statistics.median(statistics.fmean(r["step_ms"][s] for s in timed) for r in ranks.values())
    measured = sum(collect.values()) / (len(steps) * typical)
    saved, step_time = float(fix["savings_fraction"]), float(fix["step_time"])
    ran = step_time / (1.0 - saved) if saved < 1.0 else float("nan")
    planned = float((verdict.get("evidence") or {}).get("planned_gc_seconds") or 0.0) if "planned" in str(fix["fix"]) else 0.0
    return {"predicted": 1.0 - (step_time - planned) / ran, "measured": measured}


def score(rows: list[dict]) -> dict:
    """The issue's scores over analysed rows: (hits, total) per score."""
    ok = [r for r in rows if not r["refused"]]
    clean = [r for r in ok if not r["straggling"]]
    slowed = [r for r in ok if r["straggling"]]
    severe = [r for r in slowed if r["severe"] and r["slow_ranks"]]
    quiet = [r for r in ok if r["noise"] == "sleep"]
    clean2 = [r for r in clean if r.get("truth", {}).get("world") == 2]   # issue 34: the real stacks' clean 2-process runs
    # a false alarm blames: a cause or a rank named on a clean run ("insufficient evidence" names
    # neither and says what would decide; counted apart, see undecided())
    alarm = [r for r in clean if r["cause"] not in ("none", INSUFFICIENT) or r["blamed"]
             or [c for c in r["causes"] if c not in ("none", INSUFFICIENT)]]
    return {
        "refused": (sum(r["refused"] for r in rows), len(rows)),
        "workers_exact": (sum(r["blamed"] == r["slow_ranks"] for r in severe), len(severe)),
        "false_alarms": (len(alarm), len(clean)),
        "primary_cause": (sum(r["cause"] in r["accepted"] for r in slowed), len(slowed)),
        "replay_within_5pct": (sum(abs(r["discrepancy"] - 1) <= 0.05 for r in quiet), len(quiet)),
        "clean_2proc_replay_5pct": (sum(abs(r["discrepancy"] - 1) <= 0.05 for r in clean2), len(clean2)),
    }


TARGETS = {  # score -> (comparison, bound as a fraction of the total)
    "refused": ("<=", 0.0),
    "workers_exact": (">=", 0.95),
    "false_alarms": ("<=", 0.05),
    "primary_cause": (">=", 0.90),
    "replay_within_5pct": (">=", 0.90),
    "clean_2proc_replay_5pct": (">=", 0.90),
}


def met(name: str, hits: int, total: int) -> bool:
    op, bound = TARGETS[name]
    if total == 0:
        return True
    share = hits / total
    return share <= bound + 1e-12 if op == "<=" else share >= bound - 1e-12


def verdict_right(r: dict) -> bool:
    """A clean run names no cause and blames no rank; a slowed one names an accepted cause and, when
    slowed by >= 1.5x, blames exactly the slowed ranks."""
    if r["refused"]:
        return False
    if not r["straggling"]:
        return r["cause"] == "none" and not r["blamed"]
    return r["cause"] in r["accepted"] and (r["blamed"] == r["slow_ranks"] or not r["severe"])


def stack_of(r: dict) -> str:
    """The training stack a run was made with (tools/real_stacks writes `stack`; tools/real_traces'
    hand-written pipelining and DDP loops do not)."""
    return r["truth"].get("stack") or "hand-written"


def _stack_table(rows: list[dict]) -> str:
    """Per stack: runs, refused, replay within 5% on the clean runs of 2 processes, verdicts right."""
    head = f"{'stack':<14} {'runs':>4} {'refused':>7} {'clean 2-proc replay <=5%':>25} {'verdicts right':>15}"
    lines = [head, "-" * len(head)]
    for stack in sorted({stack_of(r) for r in rows}):
        mine = [r for r in rows if stack_of(r) == stack]
        clean = [r for r in mine if not r["refused"] and not r["straggling"] and r["truth"].get("world") == 2]
        within = sum(abs(r["discrepancy"] - 1) <= 0.05 for r in clean)
        right = sum(verdict_right(r) for r in mine)
        lines.append(f"{stack:<14} {len(mine):>4} {sum(r['refused'] for r in mine):>7} "
                     f"{f'{within} / {len(clean)}':>25} {f'{right} / {len(mine)}':>15}")
    return "\n".join(lines)


def expected_cause(r: dict) -> str:
    """The one cause a run's injection should be named as (strict scoring): a clean run's is none, a
    GC run's python-gc, a data-loader or send pause's untraced-cpu, a slowed forward or backward's
    individual-worker (the first of truth.json's accepted causes)."""
    return r["accepted"][0] if r["straggling"] else "none"


RELIABILITY_BINS = (0.0, 0.5, 0.8, 0.9, 0.99, 1.0 + 1e-9)


def undecided(rows: list[dict]) -> tuple[int, int, int]:
    """(clean runs, slowed runs, all analysed runs) whose verdict is insufficient evidence."""
    ok = [r for r in rows if not r["refused"]]
    return (sum(r["cause"] == INSUFFICIENT for r in ok if not r["straggling"]),
            sum(r["cause"] == INSUFFICIENT for r in ok if r["straggling"]), len(ok))


def reliability(rows: list[dict]) -> list[tuple[float, float, int, int, float]]:
    """Calibration of the verdicts' confidence: per confidence bin [lo, hi), (lo, hi, verdicts, right
    by the strict rule, mean confidence), over analysed runs whose verdict names a cause (not none
    nor insufficient evidence: those claim nothing to be right about)."""
    named = [r for r in rows if not r["refused"] and r["cause"] not in ("none", INSUFFICIENT)
             and r.get("confidence") is not None]
    out = []
    for lo, hi in zip(RELIABILITY_BINS[:-1], RELIABILITY_BINS[1:]):
        inside = [r for r in named if lo <= float(r["confidence"]) < hi]
        if inside:
            right = sum(strict_right(r) for r in inside)
            out.append((lo, min(hi, 1.0), len(inside), right, sum(float(r["confidence"]) for r in inside) / len(inside)))
    return out


def strict_right(r: dict) -> bool:
    """The strict rule for one run: clean: none, no rank blamed, S < 1.1; slowed: the expected cause
    and (when ranks were slowed) exactly those ranks."""
    if r["refused"]:
        return False
    if not r["straggling"]:
        return r["cause"] == "none" and not r["blamed"] and r["S"] < 1.1
    return r["cause"] == expected_cause(r) and (r["blamed"] == r["slow_ranks"] or not r["slow_ranks"])


def strict_scores(rows: list[dict]) -> dict:
    """Strict scores: the verdict's one cause against the expected one (a clean run is right only
    with no cause, no rank blamed and S < 1.1); per cause precision and recall; the confusion matrix
    (expected -> named, refused runs as 'refused')."""
    named = {r["run"]: ("refused" if r["refused"] else r["cause"]) for r in rows}
    causes = sorted({expected_cause(r) for r in rows} | set(named.values()))
    confusion = {e: {n: 0 for n in causes} for e in causes}
    right = 0
    for r in rows:
        confusion[expected_cause(r)][named[r["run"]]] += 1
        right += strict_right(r)
    per_cause = {}
    for cause in causes:
        if cause == "refused":
            continue
        tp = confusion.get(cause, {}).get(cause, 0)
        said = sum(confusion[e][cause] for e in causes)
        expected = sum(confusion.get(cause, {}).values())
        per_cause[cause] = {"precision": (tp, said), "recall": (tp, expected)}
    clean = [r for r in rows if not r["straggling"] and not r["refused"]]
    return {"right": (right, len(rows)), "per_cause": per_cause, "confusion": confusion,
            "clean_below_1.1": (sum(r["S"] < 1.1 for r in clean), len(clean))}


def _strict_report(strict: dict) -> str:
    lines = [f"strict: right cause (one per injected kind; clean: none, no rank, S < 1.1) "
             f"{strict['right'][0]} / {strict['right'][1]}",
             f"  clean runs with S < 1.1: {strict['clean_below_1.1'][0]} / {strict['clean_below_1.1'][1]}"]
    for cause, score in strict["per_cause"].items():
        (tp, said), (_, expected) = score["precision"], score["recall"]
        lines.append(f"  {cause:<20} precision {tp} / {said:<3} recall {tp} / {expected}")
    causes = list(strict["confusion"])
    lines.append("  confusion (rows expected, columns named): " + " | ".join(causes))
    for e in causes:
        if sum(strict["confusion"][e].values()):
            lines.append(f"    {e:<20} " + " ".join(f"{strict['confusion'][e][n]:>3}" for n in causes))
    return "\n".join(lines)


def first_read(rows: list[dict], record_file: pathlib.Path = FIRST_READS) -> dict | None:
    """The first-read record (first-reads.json) of the frozen matrix whose runs are exactly the
    scored ones, None when they are not one frozen matrix's runs."""
    if not record_file.exists():
        return None
    scored = {r["run"] for r in rows}
    for record in json.loads(record_file.read_text())["reads"]:
        matrix = json.loads((record_file.parent / record["matrix"]).read_text())
        if scored == {run["name"] for run in matrix}:
            return record
    return None


def _first_read_report(record: dict, scores: dict, strict: dict) -> str:
    """The frozen matrix's first read beside the current score, figure by figure."""
    def pair(value) -> str:
        return f"{value[0]} / {value[1]}"

    lines = [f"frozen corpus {record['matrix']}: first read {record['date']} (code {record['code']}) beside now"]
    lines.append(f"  {'strict':<20} first {pair(record['strict']):<8}   now {pair(strict['right'])}")
    for name, first in record["scores"].items():
        lines.append(f"  {name:<20} first {pair(first):<8}   now {pair(scores[name])}")
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    head = f"{'run':<44} {'truth':<28} {'S':>6} {'disc':>6} {'verdict':<24} {'blamed':<10} ok"
    lines = [head, "-" * len(head)]
    for r in rows:
        t = r["truth"]
        what = ",".join(f"{s['kind']}@{s['rank'] if s.get('rank') is not None else '-'}" for s in t.get("slowdowns", [])) or "clean"
        truth = f"{what} -> {'/'.join(r['accepted'])}"[:28]
        if r["refused"]:
            lines.append(f"{r['run']:<44} {truth:<28} REFUSED: ...{r['reason'][-110:]}")
            continue
        good = verdict_right(r)
        verdict = r["cause"] + (" (disc.)" if r["discarded"] else "")
        lines.append(f"{r['run']:<44} {truth:<28} {r['S']:>6.3f} {r['discrepancy']:>6.3f} {verdict:<24} "
                     f"{','.join(map(str, r['blamed'])) or '-':<10} {'yes' if good else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", nargs="*", type=pathlib.Path, default=[DEFAULT_CORPUS])
    ap.add_argument("--json", type=pathlib.Path, help="write every row and the scores here")
    ap.add_argument("--only", help="runs whose name contains this")
    ap.add_argument("--strict", action="store_true", help="also print strict scores: one expected cause per "
                    "injected kind, per-cause precision and recall, the confusion matrix")
    args = ap.parse_args(argv)
    runs = [r for r in find_runs(args.corpus) if not args.only or args.only in r.name]
    if not runs:
        print(f"no run folders (with truth.json) under {', '.join(map(str, args.corpus))}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = [analyse_run(run) for run in runs]
    print(_table(rows))
    print()
    print(_stack_table(rows))
    scores = score(rows)
    print(f"\n{len(rows)} runs in {time.perf_counter() - t0:.1f} s "
          f"({sum(not r['straggling'] for r in rows)} clean, {sum(r['noise'] == 'sleep' for r in rows)} low-noise)")
    for name, (hits, total) in scores.items():
        op, bound = TARGETS[name]
        share = f"{hits / total:6.1%}" if total else "   n/a"
        print(f"  {name:<20} {hits:>3} / {total:<3} {share}   target {op} {bound:.0%}   "
              f"{'met' if met(name, hits, total) else 'NOT met'}")
    quiet = [r for r in rows if not r["refused"] and r["noise"] == "sleep"
             and not {s["kind"] for s in r["truth"].get("slowdowns", [])} & PAUSE_KINDS]
    if quiet:   # information: untraced pauses are launch delay by the method, so they move the replay by design
        inside = sum(abs(r["discrepancy"] - 1) <= 0.05 for r in quiet)
        print(f"  (replay within 5% on the low-noise runs without an injected untraced pause: {inside} / {len(quiet)} "
              f"{inside / len(quiet):.1%})")
    low = [r for r in rows if not r["refused"] and r["noise"] == "sleep"]
    if low:     # information: METHOD.md's discrepancy, without the named workers' untraced time
        inside = sum(abs(r["launch"] - 1) <= 0.05 for r in low)
        print(f"  (METHOD.md's no-delay discrepancy within 5% on the low-noise runs: {inside} / {len(low)} "
              f"{inside / len(low):.1%})")
    twins = [(r["run"], r["counterfactual"]) for r in rows if r.get("counterfactual")]
    if twins:
        print("  GC pauses' fix against the runs' own record of their collections (saving of the profiled steps):")
        for name, c in twins:
            print(f"    {name:<44} predicted {c['predicted']:6.1%}  measured {c['measured']:6.1%}  "
                  f"error {c['predicted'] - c['measured']:+6.1%}")
        errors = sorted(abs(c["predicted"] - c["measured"]) for _, c in twins)
        print(f"    median |error| {errors[len(errors) // 2]:.1%} over {len(errors)} runs (target <= 5%)")
    compared = [(r["run"], r["twin"]) for r in rows if r.get("twin")]
    if compared:
        print("  fixes against clean twins (same command without the slowdown; step times, median of the profiled "
              "steps) and, marked *, against a run's own clean even steps (slowed on odd steps; means):")
        for name, c in compared:
            label = name + (" *" if c.get("within") else "")
            print(f"    {label:<40} {c['cause']:<18} named {c['named']:<22} ran {c['ran'] * 1e3:7.1f} ms  "
                  f"predicted {c['predicted'] * 1e3:7.1f} ms  twin {c['measured'] * 1e3:7.1f} ms  "
                  f"error {c['predicted'] / c['measured'] - 1:+6.1%}  slowdown est. {c['ran'] / c['predicted']:.2f} "
                  f"measured {c['ran'] / c['measured']:.2f}")
        errors = sorted(abs(c["predicted"] / c["measured"] - 1) for _, c in compared)
        print(f"    median |error| {errors[len(errors) // 2]:.1%} over {len(errors)} runs (target <= 5%; the paper's "
              "injection test: estimated 1.21 / 1.42 / 1.98, measured 1.16 / 1.40 / 2.03)")
    hits, total = intermittent_named(rows)
    if total:
        print(f"  intermittent workers named with their steps (slowed on odd steps only): {hits} / {total} "
              f"{hits / total:.0%} (target >= 90%)")
    clean_undecided, slowed_undecided, analysed = undecided(rows)
    print(f"  insufficient evidence (no blame; the verdict says what would decide): {clean_undecided} clean, "
          f"{slowed_undecided} slowed, of {analysed} analysed runs")
    strict = strict_scores(rows)
    if args.strict:
        print(_strict_report(strict))
        table = reliability(rows)
        if table:
            print("  reliability (verdicts naming a cause, by confidence; right by the strict rule):")
            for lo, hi, n, right, mean in table:
                print(f"    [{lo:.2f}, {hi:.2f}{']' if hi >= 1.0 else ')'}  {n:>3} verdicts, mean confidence {mean:.2f}, "
                      f"right {right} / {n} = {right / n:.0%}")
    record = first_read(rows)
    if record is not None:
        print(_first_read_report(record, scores, strict))
    if args.json:
        args.json.write_text(json.dumps({"rows": [{k: v for k, v in r.items() if k != 'truth'} for r in rows],
                                         "scores": scores, "strict": strict, "reliability": reliability(rows),
                                         "undecided": undecided(rows), "intermittent_named": intermittent_named(rows)},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
