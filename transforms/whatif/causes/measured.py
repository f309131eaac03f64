"""Verdicts from measurements alone, where no what-if fix of traced ops can be replayed: windows whose
replay does not match the trace (METHOD.md: beyond 5%) or matches it only with untraced time
modelled (`measured_verdict`), windows too close to ideal for METHOD's attribution in which a worker
still measures slow (`unattributed_worker`), and the "insufficient evidence" verdict's tests and
confidence."""
from __future__ import annotations

import numpy as np

import transforms.whatif.causes.explain as explain
from transforms.whatif.causes.fixes import at_balance, at_peer_speed
from transforms.whatif.causes.jitter import jitter_null
from transforms.whatif.causes.paired import PairSignals, gc_paused, intermittent_steps
from transforms.whatif.causes.sequences import BACKWARD, FORWARD
from transforms.whatif.causes.signals import ChunkWork, slow_stages
from transforms.whatif.causes.untraced import crowded, data_loading, pause_cause, untraced_cause, untraced_workers
from transforms.whatif.causes.verdict import CauseRules, Fix, Verdict
from transforms.whatif.causes.workers import WorkerTests
from transforms.whatif.model import JobModel, distinct
from transforms.whatif.replay import Scenario, replay
from transforms.whatif.result import WhatIfResult
from schemas.causes import FIX_NAMES

__all__ = ["measured_verdict", "unattributed_worker", "crowded_untraced", "jitter_evidence", "undecided", "undecided_confidence",
           "sequence_undecided"]


def unattributed_worker(model: JobModel, result: WhatIfResult, rules: CauseRules, evidence: dict,
                         paired: PairSignals) -> Verdict | None:
    """A window too close to its ideal for METHOD's attribution (S < 1.03) in which the worker test
    still decides a worker is slower than its peers (or, without peers, its stage's balance departs):
    the machine is bad though the pipeline or the all-reduce hides it for now, as above 1.03. Its fix
    is replayed (the worker at its peers' pace, or its slow kind at the others' balance); None when
    no worker is blamed."""
    blamed = paired.workers.workers()
    if not blamed:
        return None
    evidence.update(paired.evidence)
    if paired.peers is None:
        cost, scenario = at_balance(model, paired.workers.slow), "worker-balance"
    else:
        cost, scenario = at_peer_speed(model, blamed, paired.peers, gc_paused(model, paired.forward, paired.gc),
                                       intermittent_steps(paired.workers)), "worker-peer"
    fixed = replay(model, [Scenario(scenario, cost)]).span(scenario)
    tori, slowdown = float(result.step_t_nodelay.mean()), float(result.slowdown)
    t = float(fixed.mean())
    gap = tori - float(result.step_t_noblk.mean())
    fix = Fix("individual-worker", t, slowdown * t / tori, float(np.clip((tori - t) / gap, 0.0, 1.0)) if gap > 0 else 0.0,
              1.0 - t / tori, FIX_NAMES[scenario],
              step_savings=tuple((np.asarray(result.step_t_nodelay, dtype=np.float64) - fixed).tolist()))
    confidence = max(f.confidence for f in paired.workers.of(blamed[0]))
    evidence = {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in evidence.items()}
    sentence = explain.cause_sentence("individual-worker", evidence, fix, blamed, model.pp_size)
    return Verdict(model.job_id, slowdown, "individual-worker", ["individual-worker"], float(confidence),
                   {"individual-worker": float(confidence)}, evidence, list(blamed), {"individual-worker": fix},
                   {"individual-worker": sentence})


def measured_verdict(model: JobModel, result: WhatIfResult, rules: CauseRules, evidence: dict,
                      paired: PairSignals, work: ChunkWork | None = None, untraced: list | None = None) -> Verdict:
    """The verdict of a window whose replay does not match its trace (discrepancy beyond 5% either
    way), or matches it only with named workers' untraced time modelled (`model_untraced`): no
    what-if fix of traced ops, only causes the trace measures, ranked by how clearly:
    a worker the worker test decides is slow, a model chunk >= stage_alarm_ratio the median
    chunk's compute (one DP rank: a stage running its usual work at >= worker_alarm_ratio the
    median pace), untraced-cpu: one worker's untraced CPU time making the discrepancy (its fix:
    that time removed, against what ran), python-gc from pauses. Nothing measured: "none", since
    S itself comes from the replay that does not match, unless the worker test cannot decide a
    worker whose compute could make the job straggle ("insufficient-evidence"; a kept window's once
    S straggles). untraced: `untraced.untraced_workers`' answer when the caller has it."""
    slowdown, launch = float(result.model_slowdown), float(result.launch_slowdown)
    evidence.update(paired.evidence)
    measured: dict[str, float] = {}                  # cause -> how clearly it measures (a ratio)
    implicated: dict[str, list[tuple[int, int]]] = {}
    fixes: dict[str, Fix] = {}
    untraced = untraced_workers(model, result, rules) if untraced is None else untraced
    if untraced:
        measured["untraced-cpu"], implicated["untraced-cpu"] = untraced_cause(result, untraced, evidence, fixes)
    blamed = paired.workers.workers()
    if blamed:
        measured["individual-worker"] = max(f.ratio for f in paired.workers.of(blamed[0]))
        implicated["individual-worker"] = blamed
    if blamed and model.dp_size == 1:
        pass   # the stages' balance named the slow machine (workers.balance_tests)
    elif paired.chunks is not None and paired.chunks.ratio >= rules.stage_alarm_ratio:
        slow = slow_stages(model, work, rules.more_work, rules.slower_pace) if work is not None and model.dp_size == 1 else []
        if slow:   # one DP rank: the heavy chunk runs the usual work, slowly: its machine
            measured["individual-worker"], implicated["individual-worker"] = float(paired.chunks.ratio), [(0, p) for p in slow]
        else:
            measured["stage-imbalance"], implicated["stage-imbalance"] = float(paired.chunks.ratio), []
    elif paired.chunks is not None and work is not None and model.dp_size == 1 and "individual-worker" not in measured:
        # one DP rank, no chunk much heavier overall, yet a stage runs its usual work (forward or
        # backward) at a worker alarm's pace: a slow machine the chunk totals dilute
        slow = slow_stages(model, work, rules.more_work, rules.worker_alarm_ratio)
        if slow:
            pace = max(work.of(distinct(model.op_gmc[(model.op_stage == p) & np.isin(model.op_optype, (FORWARD, BACKWARD))])
                               .tolist())[1] for p in slow)
            measured["individual-worker"], implicated["individual-worker"] = pace, [(0, p) for p in slow]
    paused = pause_cause(model, result, rules, evidence, fixes, untraced)
    if paused is not None:
        measured["python-gc"] = 1.0 + fixes["python-gc"].savings_fraction + 1e-9   # before untraced-cpu of the same time
        implicated["python-gc"] = paused[1]
        if evidence.get("untraced_is_pauses"):
            measured.pop("untraced-cpu", None)
    ranked = sorted(measured, key=lambda c: (-measured[c], c))
    if {"untraced-cpu", "individual-worker"} <= set(ranked) and \
            set(implicated["untraced-cpu"]) <= set(implicated["individual-worker"]):
        # the machine that computes slowly also spends more CPU time between its ops: one slow
        # machine, whose compute is the clearer measurement
        ranked.remove("individual-worker")
        ranked.insert(0, "individual-worker")
    # a worker the test cannot decide (an effect that could make the job straggle, within its
    # jitter; or no test where peers exist) leaves the job undecided: in a kept window (untraced
    # time modelled) once S straggles; in a discarded one whatever its S, which comes from the
    # replay that does not match: the worker's measured compute is the evidence, and "none" would
    # claim what it cannot show. A worker whose untraced time would make the discrepancy, on a
    # host with more threads than cores, cannot be decided either
    on_crowded_host = not ranked and bool(crowded_untraced(model, result, rules, evidence))
    cannot_decide = on_crowded_host or ((result.discarded or slowdown >= rules.straggling) and undecided(paired.workers))
    primary = ranked[0] if ranked else "insufficient-evidence" if cannot_decide else "none"
    workers = list(dict.fromkeys(w for c in ranked for w in implicated[c]))
    evidence = {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in evidence.items()}
    explanations = {c: explain.discarded_sentence(c, evidence, implicated.get(c, []), launch, modelled=not result.discarded)
                    for c in (ranked or [primary]) if c != "insufficient-evidence"}
    if primary == "insufficient-evidence":
        explanations[primary] = explain.insufficient_sentence(slowdown, evidence.get("worker_test", {}), evidence,
                                                              discarded_launch=launch if result.discarded else None)
    if untraced and "untraced-cpu" in ranked:
        explanations["untraced-cpu"] = explain.untraced_sentence(untraced, launch, fixes["untraced-cpu"],
                                                                 data_loading(model, untraced, evidence, fixes))
    if paused is not None:
        explanations["python-gc"] = explain.pause_sentence(evidence, fixes["python-gc"], model.worker_rank)
    confidences = {c: (paused[0] if c == "python-gc" else untraced[0][3] if c == "untraced-cpu" else 1.0) for c in ranked}
    confidence = undecided_confidence(paired.workers, evidence) if primary == "insufficient-evidence" else \
        confidences.get(primary, 1.0)
    return Verdict(model.job_id, slowdown, primary, ranked, confidence, confidences, evidence, workers,
                   fixes, explanations)


def crowded_untraced(model: JobModel, result: WhatIfResult, rules: CauseRules, evidence: dict,
                      least: float = 0.0) -> list:
    """The workers untraced-cpu would name but for their oversubscribed host (`untraced.crowded`), whose
    untraced time costs at least `least` of a step; recorded in evidence["untraced_crowded"] (rank, host
    threads per core, untraced time beyond its peers' as a share of the step) for the sentence."""
    hosts = crowded(model, rules)
    if not hosts:
        return []
    found = [u for u in untraced_workers(model, result, rules, on_crowded_hosts=True) if max(u[1] or 0.0, u[2]) >= least]
    if found:
        evidence["untraced_crowded"] = [{"dp_rank": d, "stage": p, "rank": int(model.worker_rank[d, p]),
                                         "host_load": hosts[(d, p)], "excess": float(max(e or 0.0, f))}
                                        for (d, p), e, f, _ in found]
    return found


def jitter_evidence(model: JobModel, result: WhatIfResult, workers: WorkerTests, rules: CauseRules, evidence: dict):
    """The jitter null of a job about to be "unexplained" (jitter.py), recorded in evidence["jitter_null"]."""
    null = jitter_null(model, result, workers, rules.false_alarm)
    if null is not None:
        evidence["jitter_null"] = null.as_json()
    return null


def undecided_confidence(workers: WorkerTests, evidence: dict) -> float:
    """The confidence an insufficient-evidence verdict states: that of its strongest undecided
    finding (1 - its Bonferroni-adjusted p, a worker's or the sequence signature's), below
    1 - the false-alarm rate by construction; 0 where no test could be made (one step, no peers).
    Never 1.0: the verdict is that nothing can be decided, not a certainty about a cause."""
    found = [f.confidence for f in workers.undecided]
    if evidence.get("sequence_samples_needed"):
        found.append(1.0 - float(evidence["sequence_p"]))
    return float(max(found, default=0.0))


def sequence_undecided(evidence: dict, rules: CauseRules) -> bool:
    """A sequence signature short of significance (evidence sequence_samples_needed) whose fix would
    remove the share of the straggling time a sequence cause needs: the job cannot decide it."""
    explained = max(float(evidence.get("sequence_fix_explained") or 0.0), float(evidence.get("sequence_even_explained") or 0.0))
    return bool(evidence.get("sequence_samples_needed")) and explained >= rules.sequence_min_explained


def undecided(workers: WorkerTests) -> bool:
    """Whether the worker test could not decide: an effect above the threshold within the job's
    jitter, or no test possible where peers exist but samples do not (one step, one microbatch)."""
    return not workers.decided
