"""The verdict of one job window: dataclasses, thresholds, and its job_cause row."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Mapping, Sequence

import pyarrow as pa

from schemas.fleet import JOB_CAUSE_SCHEMA
from transforms.whatif.result import STRAGGLING_THRESHOLD

__all__ = ["CauseError", "CauseRules", "Fix", "Verdict", "fix_fields", "verdict_json", "verdict_row", "job_cause_table"]


class CauseError(ValueError):
    """The inputs of the root-cause analysis do not fit together (names the job)."""


@dataclasses.dataclass(frozen=True)
class CauseRules:
    """Every threshold of the verdicts, stated once, each with where it comes from.

    METHOD.md (the paper's analysis): `straggling` (section 4: a job straggles at S >= 1.1),
    `worker_mw` (section 5: an individual worker when M_W > 0.5), `stage_ms` (M_S >= 0.5),
    `stage_row_uniformity` (the "hot last-stage row" signature: the whole row hot, its coolest worker
    at least half as hot as its hottest, not one hot cell), `comm_share` (communication "dominant":
    more than half of the slowdown by op type). The 5% replay discrepancy is METHOD's too
    (result.DISCREPANCY_LIMIT).

    Statistics: `false_alarm`, the rate per job at which the worker, untraced-time, pause and
    sequence tests may blame a healthy job (a stated choice; Bonferroni over each job's tests);
    `peer_offset`, the null's persistent offset healthy DP peers keep, measured (RMS of the per-run
    mean log ratio) on the 22 clean 2-rank runs of the real-stack corpus (tools/real_stacks, CPU,
    2 processes on 2 cores): a measurement of healthy jobs, never fitted to slowed ones. It is the
    prior: a job of three or more DP ranks (or two over three or more stages, workers.reads_offset)
    reads its own offset and, where its peers bound it below the prior at `false_alarm` (many quiet
    GPU ranks), is tested against that bound instead (workers._healthy_offset; a healthy job is then
    blamed at most at twice `false_alarm`: the bound or the test errs).

    Shares of the straggling threshold (what a cause must be worth to explain a straggling step):
    `min_explained`, `stage_min_explained`, `gc_min_explained` (a fix removes at least 10% of the
    straggling time T - T_ideal, i.e. the threshold's own share of it) and `sequence_min_explained`
    (15%: its fix is a repacking the job may already be near); `comm_excess` (half the threshold's
    margin, 0.05, summed over the transfer types: what a listed cause's time must cost,
    pauses.CAUSE_SHARE); `stage_chunk_ratio` (one chunk's compute per microbatch at the threshold's
    1.1x its median chunk's: the slowest stage paces a pipeline, so that chunk alone makes it
    straggle); `min_savings` (3%: a fix must save that much of the step's GPU-hours, a stated floor
    below which a cause is not worth a change; a measured slow worker is named whatever it saves).

    Untraced time (untraced.untraced_workers): a worker's untraced time per step is its own at
    `untraced_factor` (2x) its DP peers' median in most steps and in its median step (a stated
    margin: one noisy step of a peer cannot make it); the replay names it when its launch delays
    are at least `untraced_each` (35%) of the discrepancy and the named workers' together a majority
    of it (`untraced_share`, 50%). `host_load` (1 thread per core, physics): on a host whose job
    threads outnumber its cores (the collector's record, the trace's `host_load`), a rank's untraced
    time includes its wait for a core; untraced-cpu is never blamed there.

    Physics, with stated margins (no replay confirms these): `more_work` / `slower_pace` (one DP
    rank per stage: a chunk running 1.15x the median chunk's recorded operations is a heavier
    partition, the threshold's 10% plus the loss head's extra operations; one running the usual
    operations 1.3x slower each, the same operations compared by identity, is a slow machine), `stage_alarm_ratio` / `worker_alarm_ratio` (in a
    window the replay cannot confirm, a chunk 1.3x the median's compute, or a stage running its
    usual work 1.5x slower: three and five times the threshold's margin, as nothing else checks
    them), GPU-rank GC stalls: `gc_min_stall` (50 ms, below the paper's "hundreds of ms"),
    `gc_sigma` (a stretched forward's robust z, 8: beyond every ordinary forward of the job by far,
    its median absolute deviation being per-op jitter) and `gc_max_worker_share` (rotating: no
    worker holds more than 80% of the stalls, else it is that worker's).

    A `*_min_explained` is the share of the straggling time T - T_ideal a cause's fix must
    remove, alone or after every other detected cause is fixed, for the cause to be listed.
    """

    straggling: float = STRAGGLING_THRESHOLD
    false_alarm: float = 0.01
    peer_offset: float = 0.085
    worker_mw: float = 0.5
    stage_ms: float = 0.5
    stage_row_uniformity: float = 0.5
    comm_share: float = 0.5
    comm_excess: float = 0.05
    min_explained: float = 0.1
    stage_min_explained: float = 0.1
    gc_min_explained: float = 0.1
    sequence_min_explained: float = 0.15
    stage_chunk_ratio: float = 1.1
    min_savings: float = 0.03
    more_work: float = 1.15
    slower_pace: float = 1.3
    stage_alarm_ratio: float = 1.3
    worker_alarm_ratio: float = 1.5
    gc_min_stall: float = 0.05           # seconds
    gc_sigma: float = 8.0
    gc_max_worker_share: float = 0.8
    untraced_factor: float = 2.0
    untraced_each: float = 0.35
    untraced_share: float = 0.5
    host_load: float = 1.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CauseRules.{field.name} must be a finite number >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Fix:
    """What-if replay of one cause's fix.

    step_time: mean step time after the fix (s); fixed_slowdown: S after the fix;
    explained: share of T - T_ideal the fix removes alone; savings_fraction: 1 - T_fix / T,
    the share of the job's GPU-hours it would save; description: the fix in words;
    explained_given_others: once every other candidate cause is fixed, the share of what
    remains of the straggling time that this fix removes (None with no other candidate, or
    when what remains is below S 1.05); measured: the saving is measured against what ran
    (untraced time taken out of the steps as they ran), not replayed against the ideal, and
    fixed_slowdown is S as is; step_savings: seconds the fix saves in each profiled step (None
    where only the mean is known), so an intermittent cause shows where its saving lies.
    """

    cause: str
    step_time: float
    fixed_slowdown: float
    explained: float
    savings_fraction: float
    description: str = ""
    explained_given_others: float | None = None
    measured: bool = False
    step_savings: tuple[float, ...] | None = None


@dataclasses.dataclass
class Verdict:
    """Root-cause verdict of one job window (see the package docstring).

    causes: every listed cause, by GPU-hours its fix saves alone (most first); cause: the
    first, or "none" / "unexplained"; explanations: cause -> one sentence for people (also
    for "none" and "unexplained"); joint_fix: every listed cause fixed at once (two or more);
    timings: seconds spent in parts of the analysis ("sequence": repacking and its cost model;
    analyze_and_classify adds "compile", "replay" (METHOD's replays) and "causes").
    """

    job_id: str
    slowdown: float
    cause: str                                   # primary: schemas.fleet.CAUSES
    causes: list[str]
    confidence: float
    confidences: dict[str, float]
    evidence: dict[str, object]
    implicated_workers: list[tuple[int, int]]    # (dp_rank, stage) whose machine is blamed (worker / located link)
    fixes: dict[str, Fix]
    explanations: dict[str, str] = dataclasses.field(default_factory=dict)
    joint_fix: Fix | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)  # seconds per part of classify
    # the worker test's per-worker means and jitter (WorkerTests.summary; analyze_and_classify sets it):
    # what the live watcher pools over a job's windows (workers.pooled_worker_tests)
    worker_summary: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def primary_fix(self) -> Fix | None:
        return self.fixes.get(self.cause)

    @property
    def explanation(self) -> str:
        """The sentences of every listed cause, strongest first (or of the verdict when none is listed)."""
        return " ".join(self.explanations[c] for c in (self.causes or [self.cause]) if c in self.explanations)

    def slow_steps(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Blamed worker (dp_rank, stage) -> the profiled steps (indices) in which the worker test
        finds it slow: every step for a persistent finding, the named ones for an intermittent one."""
        found: dict[tuple[int, int], set[int]] = {}
        blamed = {tuple(w) for w in self.implicated_workers}
        for finding in (self.evidence.get("worker_test") or {}).get("slow", []):
            worker = (int(finding["dp_rank"]), int(finding["stage"]))
            if worker in blamed:
                found.setdefault(worker, set()).update(int(s) for s in finding["steps"])
        return {w: tuple(sorted(steps)) for w, steps in sorted(found.items())}

    def savings_gpu_hours(self, gpu_hours: float, cause: str | None = None) -> float:
        """GPU-hours the fix of `cause` (default: the primary) saves on a window of `gpu_hours`."""
        fix = self.fixes.get(cause or self.cause)
        return float(gpu_hours * max(fix.savings_fraction, 0.0)) if fix else 0.0


def fix_fields(verdict: Verdict, fix: Fix, gpu_hours: float | None) -> dict:
    """A fix as JSON fields (its cause's confidence and sentence when the cause is listed);
    savings_gpu_hours is None when the window's GPU-hours are unknown."""
    fields = {"fixed_slowdown": fix.fixed_slowdown, "explained": fix.explained, "savings_fraction": fix.savings_fraction,
              "savings_gpu_hours": None if gpu_hours is None else gpu_hours * max(fix.savings_fraction, 0.0),
              "fix": fix.description, "explained_given_others": fix.explained_given_others, "measured": fix.measured,
              "step_time": fix.step_time,
              "step_savings": None if fix.step_savings is None else list(fix.step_savings)}
    if fix.cause in verdict.confidences:
        fields.update(confidence=verdict.confidences[fix.cause], explanation=verdict.explanations.get(fix.cause, ""))
    return fields


def verdict_json(verdict: Verdict, gpu_hours: float | None = None) -> dict:
    """The verdict as JSON: primary cause, the listed causes in order with confidence, sentence
    and fix, the joint fix, blamed workers, and every fix replayed (cause -> fix_fields)."""
    return {
        "cause": verdict.cause, "causes": list(verdict.causes), "confidence": float(verdict.confidence),
        "explanation": verdict.explanation,
        "verdicts": [{"cause": c, **(fix_fields(verdict, verdict.fixes[c], gpu_hours) if c in verdict.fixes else
                                     {"confidence": verdict.confidences.get(c), "explanation": verdict.explanations.get(c, ""),
                                      "measured_only": True})} for c in verdict.causes],
        "joint_fix": fix_fields(verdict, verdict.joint_fix, gpu_hours) if verdict.joint_fix else None,
        "implicated_workers": [list(w) for w in verdict.implicated_workers],
        "fixes": {c: fix_fields(verdict, f, gpu_hours) for c, f in sorted(verdict.fixes.items())},
        "gpu_hours": gpu_hours,
        "evidence": json.loads(json.dumps(verdict.evidence, sort_keys=True, allow_nan=True, default=str)),
    }


def verdict_row(verdict: Verdict, gpu_hours: float, hosts: Mapping[tuple[int, int], str] | None = None,
                discarded: bool = False) -> dict:
    """One JOB_CAUSE_SCHEMA row (schemas/fleet.py) of a verdict; hosts: (dp_rank, stage) -> host;
    discarded: the window's replay is off by more than 5% (a verdict from measurements only)."""
    hosts = hosts or {}
    fix = verdict.primary_fix
    savings = {c: fix_fields(verdict, f, gpu_hours) for c, f in sorted(verdict.fixes.items())}
    if verdict.joint_fix is not None:
        savings["all"] = fix_fields(verdict, verdict.joint_fix, gpu_hours)
    return {
        "job_id": verdict.job_id,
        "slowdown": verdict.slowdown,
        "cause": verdict.cause,
        "causes": list(verdict.causes),
        "confidence": verdict.confidence,
        "evidence_json": json.dumps(verdict.evidence, sort_keys=True, allow_nan=True, default=str),
        "implicated_dp_ranks": [d for d, _ in verdict.implicated_workers],
        "implicated_stages": [p for _, p in verdict.implicated_workers],
        "implicated_hosts": sorted({hosts[w] for w in verdict.implicated_workers if hosts.get(w)}),
        "fixed_slowdown": fix.fixed_slowdown if fix else None,
        "savings_gpu_hours": verdict.savings_gpu_hours(gpu_hours) if fix else None,
        "savings_json": json.dumps(savings, sort_keys=True),
        "explanation": verdict.explanation,
        "discarded": bool(discarded),
    }


def job_cause_table(verdict: Verdict, gpu_hours: float, workers: Sequence[Mapping] = (), discarded: bool = False) -> pa.Table:
    """The job_cause rows (JOB_CAUSE_SCHEMA, without `date`) of one job window.

    gpu_hours: the window's GPU-hours; workers: the manifest's worker entries (dp_rank,
    stage, host) to name the hosts of blamed workers; discarded: the window is left out of the
    fleet statistics (its verdict measured only), which the row says.
    """
    hosts = {(int(w["dp_rank"]), int(w["stage"])): w.get("host") for w in workers}
    return pa.Table.from_pylist([verdict_row(verdict, gpu_hours, hosts, discarded)], schema=JOB_CAUSE_SCHEMA)
