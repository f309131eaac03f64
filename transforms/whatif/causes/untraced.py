"""The causes of untraced time (CPU ranks): which workers' untraced time the others wait for
(untraced-cpu), the pauses in it that are Python's collector (python-gc), and the data loading in
it. Measurements from pauses.py, confirmed where possible by the replay of their launch delays;
their fixes are measured against what ran (`Fix.measured`): the replay holds no untraced time."""
from __future__ import annotations

import dataclasses

import numpy as np

from schemas.causes import FIX_NAMES
from transforms.whatif.causes.pauses import (CAUSE_SHARE, collector, find_pauses, p2p_partner, pause_confidence, pause_fix, recurring,
                                            untraced_gaps, untraced_time)
from transforms.whatif.causes.verdict import CauseRules, Fix
from transforms.whatif.causes.workers import t_sf
from transforms.whatif.metrics import worker_set_mask
from transforms.whatif.model import JobModel, median
from transforms.whatif.replay import Mix, Scenario, replay
from transforms.whatif.result import DISCREPANCY_LIMIT, STRAGGLING_THRESHOLD, UntracedWork, WhatIfResult, discrepancy_discards

__all__ = ["model_untraced", "untraced_workers", "crowded", "untraced_cause", "pause_cause", "data_loading"]


def model_untraced(model: JobModel, result: WhatIfResult) -> list | None:
    """Set `result.untraced` when what ran is more than 5% longer than the no-delay replay, the
    workers whose untraced CPU time makes it are named (`untraced_workers`: measured beyond their
    peers' and the job's, and confirmed by the replay; else the workers whose pauses are Python's
    collector, `pauses.collector`), and the replay with only their launch delays given back is
    within 5% of what ran: the model then explains the trace, with their untraced time as work of
    its own (result.UntracedWork), and the window is kept. Returns `untraced_workers`' answer when
    it was asked (None: not asked)."""
    if result.untraced is not None or not result.launch_slowdown > DISCREPANCY_LIMIT:
        return None
    untraced = untraced_workers(model, result)
    named = [worker for worker, *_ in untraced]
    if not named and model.meta.host_compute:
        pauses = find_pauses(model)
        named = pauses.workers() if collector(model, pauses) else []
    if named:
        mask = worker_set_mask(model, named)
        spans = replay(model, [Scenario("untraced", model.original_cost, Mix(0.0, model.launch_delay, mask))]).span("untraced")
        if not discrepancy_discards(float(result.step_t_base.mean() / spans.mean())):
            result.untraced = UntracedWork(tuple(named), spans)
    return untraced


def crowded(model: JobModel, rules: CauseRules = CauseRules()) -> dict[tuple[int, int], float]:
    """{worker: its host's threads per core} for the workers whose host ran more of the job's threads
    than it has cores (the trace's `host_load`, as strag_collect recorded it, above rules.host_load);
    {} where nothing was recorded."""
    if model.worker_load is None:
        return {}
    over = np.argwhere(model.worker_load > rules.host_load)
    return {(int(d), int(p)): float(model.worker_load[d, p]) for d, p in over}


def untraced_workers(model: JobModel, result: WhatIfResult, rules: CauseRules = CauseRules(), *,
                     on_crowded_hosts: bool = False) -> list[tuple[tuple[int, int], float, float, float]]:
    """The workers whose untraced CPU time (launch delays: METHOD.md section 3) makes the replay
    discrepancy, as [(worker, excess or None where the replay attributes no launch delays, hidden
    excess, confidence)] (largest first) or []. Workers of an oversubscribed host (`crowded`) whose
    untraced time that host's crowding can explain are left out: it includes their wait for a core,
    which no trace tells apart from their own work (on_crowded_hosts=True: only those, the ones that
    would be named otherwise).
    A measurement, a test and a replay must agree:
    - measured (pauses.untraced_time): the worker's untraced time per step is at least `factor`
      (rules.untraced_factor) times its DP peers' median in most steps, and in its median step (persistent, not one preempted
      step; not cleared by one noisy step of a peer), and as much beyond the job's other workers'
      (a few ms that stand out only against peers with even fewer are the job's noise). Without
      DP peers, against the other stages, and only the one far ahead of the rest (`factor` times
      the next): a stage waiting on a paused neighbour shows untraced time too;
    - tested (`_untraced_test`): its untraced time beyond its baseline's, step by step, is
      significant against the job's own spread of that excess at the false-alarm rate per
      job (one-sided t, Bonferroni over the workers); confidence is 1 - the adjusted p-value. Two
      steps that disagree by as much as they exceed, or one step, cannot name anyone;
    - replayed: the no-delay replay with only its delays given back is min(launch S of its DP rank,
      of its stage) times as long, an excess of at least `each` (rules.untraced_each) of the whole
      discrepancy's, and the named workers' excesses add up to at least `share`
      (rules.untraced_share) of it (else: spread, nobody to name);
      a slower worker elsewhere can hide it from the replay now: a worker whose untraced time is
      `factor` times its DP peers' in every step (2 x `factor` the other stages' without DP peers)
      counts with that time's share of the step instead, also where the replay has no launch
      attribution (a discrepancy within 5%; then only with DP peers and no pipeline)."""
    share, factor, each, alpha = rules.untraced_share, rules.untraced_factor, rules.untraced_each, rules.false_alarm
    workers = [(d, p) for d in range(model.dp_size) for p in range(model.pp_size)]
    attributed = result.launch_by_dp_rank is not None and result.launch_by_stage is not None
    alone = model.dp_size == 1
    if len(workers) < 2 or (not attributed and (alone or (model.pp_size > 1 and not model.meta.host_compute))):
        # no replay to confirm it: only without pipeline neighbours (whose waits for each other
        # look like gaps too), or where the recvs start when the thread begins to wait
        # (host_compute), is a worker's gap before its ops surely its own time
        return []
    partner = p2p_partner(model)
    per_step = {w: untraced_time(model, *w, partner=partner) for w in workers}

    def persistent(worker, others, times: float = factor, steps: float | None = None) -> bool:
        """`times` the others' median in `steps` of the steps (default: more than half of them,
        and its median step `times` theirs: one noisy step of a peer does not clear a worker)."""
        baseline = median(np.stack([per_step[w] for w in others]), axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = (per_step[worker] / baseline >= times).mean()
            if steps is not None:
                return bool(share >= steps)
            return bool(share > 0.5 and median(per_step[worker]) >= times * median(baseline))

    step_time = float(result.step_t_nodelay.mean())

    def measured(worker, others) -> float:
        """Its median untraced time beyond the others' median, as a share of the step."""
        baseline = median(np.stack([per_step[w] for w in others]), axis=0)
        return float(median(per_step[worker] - baseline)) / step_time

    # the size a worker's untraced time must have (twice a few ms is no cause): in a window kept and
    # straggling, the share of a step a listed cause needs (half the straggling threshold's); else
    # the threshold's whole share (METHOD.md: time that alone makes a job straggle), since neither
    # a discarded window's S nor one below the threshold shows straggling for it to explain
    kept_straggling = not result.discarded and float(result.slowdown) >= STRAGGLING_THRESHOLD
    least = (CAUSE_SHARE if kept_straggling else 1.0) * (STRAGGLING_THRESHOLD - 1.0)

    def sizeable(worker, others) -> bool:
        return measured(worker, others) >= least

    if model.dp_size > 1:
        peer_set = {w: [(d, w[1]) for d in range(model.dp_size) if d != w[0]] for w in workers}
        # beyond its DP peers, and beyond the job's own untraced time: a worker whose few ms between
        # ops stand out only against peers with even fewer is the job's noise, not a paused worker
        named = [w for w in workers if persistent(w, peer_set[w]) and persistent(w, [o for o in workers if o != w])
                 and sizeable(w, peer_set[w])]
    else:
        ranked = sorted(workers, key=lambda w: (-float(median(per_step[w])), w))
        top = ranked[0]
        peer_set = {top: ranked[1:]}
        ahead = float(median(per_step[top])) >= factor * float(median(per_step[ranked[1]]))
        named = [top] if ahead and persistent(top, ranked[1:]) else []
    confidence = _untraced_test(per_step, peer_set, workers, alpha)
    named = [w for w in named if confidence.get(w, 0.0) >= 1.0 - alpha]
    total = max(float(result.launch_slowdown) - 1.0, 0.0)
    # what the replay attributes to its launch delays, at most its untraced time beyond its peers'
    # (a launch delay also holds time the worker was busy or blocked; removing its untraced time
    # cannot save more than that time)
    excess = {(d, p): min(float(result.launch_by_dp_rank.get(d, 1.0)), float(result.launch_by_stage.get(p, 1.0)),
                          1.0 + max(measured((d, p), peer_set[(d, p)]), 0.0)) - 1.0
              if attributed else None for d, p in named}
    # a worker whose untraced time is beyond its peers' in every step is named even when the replay
    # cannot see its cost now (a slower worker elsewhere sets the step, or collectives that wait for
    # it are what the replay stretches): its size is what it measures per step (without DP peers
    # the other stages are no like-for-like baseline, so there it takes 2 x `factor`)
    hidden = {w: float(median(per_step[w])) / step_time
              if persistent(w, peer_set[w], factor * (2.0 if alone else 1.0), 1.0) else 0.0 for w in named}
    counted = {w: max(excess[w] or 0.0, hidden[w]) for w in named}
    named = sorted((w for w in named if counted[w] > 0.0 and counted[w] >= each * total), key=lambda w: (-counted[w], w))
    if not named or sum(counted[w] for w in named) < share * total:
        return []
    hosts = crowded(model, rules)

    def crowding_explains(worker) -> bool:
        """On a host of L threads per core a rank runs at least 1/L of the time it is runnable (the
        scheduler's fair share): waiting for a core stretches its untraced time by at most L times, and
        cannot shrink its peers'. Untraced time within L times its peers' may be that wait; beyond it,
        it is the worker's own."""
        if worker not in hosts:
            return False
        baseline = median(np.stack([per_step[w] for w in peer_set[worker]]), axis=0)
        return float(median(per_step[worker])) <= hosts[worker] * float(median(baseline))

    return [(w, excess[w], hidden[w], confidence[w]) for w in named if crowding_explains(w) == on_crowded_hosts]


def _untraced_test(per_step: dict, baselines: dict, workers: list, alpha: float) -> dict[tuple[int, int], float]:
    """Confidence (1 - Bonferroni-adjusted p) that each worker in `baselines` spends more untraced
    time per step than its baseline workers' median: the per-step excesses of every worker against
    its own baseline, their spread around each worker's mean pooled over the job (two workers'
    excesses mirror each other and count once) as the null, a one-sided t on the tested worker's
    mean excess. With DP peers the null is the excesses against the same baselines (each worker
    against its stage's DP peers; two DP ranks mirror each other, one per stage counts), else
    against every other worker. {} when the job gives no spread to test against (one step)."""
    excess = {w: per_step[w] - median(np.stack([per_step[o] for o in others]), axis=0)
              for w, others in baselines.items()}
    peers = set(baselines) == set(workers) and all(o[1] == w[1] for w, others in baselines.items() for o in others)
    if peers:
        dp_size = len({d for d, _ in workers})
        families = [e for (d, _), e in excess.items() if d == 0] if dp_size == 2 else list(excess.values())
    else:
        every = {w: per_step[w] - median(np.stack([per_step[o] for o in workers if o != w]), axis=0) for w in workers}
        families = list(every.values())[:1] if len(workers) == 2 else list(every.values())
    n = len(next(iter(per_step.values())))
    df = sum(len(e) - 1 for e in families)
    if n < 2 or df < 1:
        return {}
    sigma = float(np.sqrt(sum(float(((e - e.mean()) ** 2).sum()) for e in families) / df))
    out = {}
    for w, e in excess.items():
        mean = float(e.mean())
        t = mean / (sigma / np.sqrt(n)) if sigma > 0 else (np.inf if mean > 0 else 0.0)
        out[w] = 1.0 - min(1.0, len(workers) * t_sf(t, df))
    return out


def untraced_cause(result: WhatIfResult, untraced: list, evidence: dict, fixes: dict) -> tuple[float, list]:
    """Record the untraced-cpu cause of `untraced_workers`' answer (evidence and its fix: the
    blamed workers' untraced time removed, against what ran); returns (how clearly it measures:
    1 + the share of what ran it costs, the workers)."""
    launch, slowdown = float(result.launch_slowdown), float(result.slowdown)
    (_, excess, free, _) = untraced[0]
    if result.untraced is not None and {w for w, *_ in untraced} == set(result.untraced.workers):
        # their untraced time is modelled: what the replay with it takes beyond the one without
        excess = float(result.untraced.step_t.mean() / result.step_t_nodelay.mean()) - 1.0
    if excess is None:   # no launch attribution: what it measures is the estimate, against what ran
        saved, explained = free, min(1.0, free / max(1.0 - 1.0 / slowdown, 1e-9))
    else:
        saved = max(excess, 0.0) / launch
        explained = min(1.0, max(excess, 0.0) / (launch - 1.0)) if launch > 1.0 else 0.0
    evidence["untraced_workers"] = [{"dp_rank": d, "stage": p, "launch_slowdown": None if e is None else 1.0 + e,
                                     "hidden_slowdown": 1.0 + f, "confidence": c} for (d, p), e, f, c in untraced]
    fixes["untraced-cpu"] = Fix("untraced-cpu", float(result.step_t_base.mean()) * (1.0 - saved), slowdown,
                                explained, saved, FIX_NAMES["untraced"], measured=True)
    return 1.0 + max(saved, free / launch), [w for w, *_ in untraced]


def pause_cause(model: JobModel, result: WhatIfResult, rules: CauseRules, evidence: dict, fixes: dict,
                 untraced: list | None) -> tuple[float, list] | None:
    """python-gc from untraced pauses on CPU ranks (pauses.py): single gaps outside data loading,
    far beyond the job's usual largest gap, that are the collector's (`collector`: recorded, or all
    at forwards or between two of a worker's steps). Records its
    evidence and fix (the pauses taken out of the steps as they ran, planned GC paid back:
    pauses.pause_fix) when the fix saves rules.min_savings of the step; `untraced_is_pauses` when the untraced-cpu
    workers are the paused ones and their pauses make at least half their untraced time. Returns
    (confidence, paused workers) or None. A pause on one worker in every step inside its step, away
    from its forwards, is that worker's untraced-cpu: its fix then takes out the pauses alone, its
    ordinary time between ops kept."""
    if not model.meta.host_compute:
        return None
    pauses = find_pauses(model, rules.false_alarm, rules.straggling)
    if not recurring(pauses):
        return None
    ran, fixed, planned, share, taken_out = pause_fix(model, pauses, result.step_t_nodelay)
    saved = 1.0 - fixed / ran if ran > 0 else 0.0
    workers = pauses.workers()
    named = {w for w, *_ in untraced or []}
    slowdown = float(evidence.get("slowdown", result.slowdown))
    evidence.update(pauses.evidence(model.steps), pause_fix_saves=saved)
    if not collector(model, pauses):
        if named and "untraced-cpu" in fixes and set(workers) <= named:
            unplanned = 1.0 - (fixed - planned) / ran if ran > 0 else 0.0
            fixes["untraced-cpu"] = Fix("untraced-cpu", fixed - planned, slowdown, share, unplanned, FIX_NAMES["pauses"],
                                        measured=True, step_savings=tuple(taken_out.tolist()))
        return None
    if saved < rules.min_savings:
        return None
    evidence["planned_gc_seconds"] = planned
    fixes["python-gc"] = Fix("python-gc", fixed, slowdown, share, saved, FIX_NAMES["gc-pauses"], measured=True,
                             step_savings=tuple((taken_out - planned).tolist()))
    if named and named <= set(workers):
        untraced_seconds = sum(float(pauses.untraced[p, :, d].sum() + pauses.data[p, :, d].sum()) for d, p in named)
        paused_seconds = sum(float(pauses.excess_of(w).sum()) for w in named)
        evidence["untraced_is_pauses"] = paused_seconds >= 0.5 * untraced_seconds
    return pause_confidence(pauses, rules.false_alarm), workers


def data_loading(model: JobModel, untraced: list, evidence: dict, fixes: dict) -> float | None:
    """The share of the first untraced-cpu worker's untraced time spent inside DataLoader fetches
    (None when the trace records no fetches); recorded per worker in evidence["untraced_workers"],
    and at half or more the fix is the data loader's."""
    if model.data_wait is None:
        return None
    partner = p2p_partner(model)
    shares = {}
    for (d, p), *_ in untraced:
        _, gaps, data, _ = untraced_gaps(model, d, p, partner)
        shares[(d, p)] = float(data.sum() / gaps.sum()) if gaps.sum() > 0 else 0.0
    for entry in evidence.get("untraced_workers", []):
        entry["data_loading_share"] = shares.get((entry["dp_rank"], entry["stage"]))
    first = shares[untraced[0][0]]
    if first >= 0.5 and "untraced-cpu" in fixes and fixes["untraced-cpu"].description == FIX_NAMES["untraced"]:
        fixes["untraced-cpu"] = dataclasses.replace(fixes["untraced-cpu"], description=FIX_NAMES["data"])
    return first
