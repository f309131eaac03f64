"""classify: signals -> one batched replay of every fix -> detectors -> the listing rule -> ranked verdict."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np
import pyarrow as pa

import transforms.whatif.causes.explain as explain
from transforms.whatif.causes.fixes import (at_balance, at_others_speed, at_peer_speed, compose, planned_gc_seconds, rebalanced_stages, typical_transfers,
                                           without_pauses)
from transforms.whatif.causes.localise import comm_localised, link_not_host, localised
from transforms.whatif.causes.measured import (crowded_untraced, jitter_evidence, measured_verdict, sequence_undecided,
                                               unattributed_worker, undecided, undecided_confidence)
from transforms.whatif.causes.paired import (PairSignals, gc_paused, gc_signature, intermittent_steps, pair_signals,
                                             samples_to_decide, sequence_p, sequence_tests, workload_fit)
from transforms.whatif.causes.pauses import CAUSE_SHARE
from transforms.whatif.causes.sequences import (BACKWARD, FORWARD, SequenceWorkload, balanced_sequences, even_sequences,
                                                repacked_sequences, sequence_workload)
from transforms.whatif.causes.signals import (ChunkBalance, ChunkWork, GcStalls, PeerComparison, chunk_work, margin, pearson, slow_stages,
                                              take, usual_work_slower)
from transforms.whatif.causes.verdict import CauseError, CauseRules, Fix, Verdict
from transforms.whatif.causes.untraced import data_loading, model_untraced, pause_cause, untraced_cause, untraced_workers
from transforms.whatif.causes.workers import WorkerTests
from transforms.whatif.metrics import analyze_model, worker_set_mask
from transforms.whatif.model import JobModel, compile_job, distinct
from transforms.whatif.replay import Mix, Scenario, replay, replay_thread_count
from transforms.whatif.result import JobMeta, WhatIfResult
from schemas.causes import FIX_NAMES
from schemas.trace import COMPUTE_OPTYPES

__all__ = ["classify", "analyze_and_classify", "COMPUTE_GROUPS"]

# Attribution groups that are not communication (WhatIfResult.by_optype keys).
COMPUTE_GROUPS = frozenset({*COMPUTE_OPTYPES, "optimizer", "gc"})


@dataclasses.dataclass
class _Signals:
    """What the detectors read (see signals.py); forward/backward: the [k, lane] op pairs."""

    mw: float
    ms: float
    comm_share: float
    comm_excess: float
    forward: np.ndarray
    backward: np.ndarray
    r_norm: float
    uniformity: float
    gc: GcStalls | None
    peers: PeerComparison | None
    chunks: ChunkBalance | None
    workers: WorkerTests
    r_norm_df: int = 0
    workload_r: float = math.nan     # compute against the recorded workload of its microbatch (workload_fit)
    workload_df: int = 0

    @property
    def sequence_tests(self) -> list[tuple[float, int]]:
        return sequence_tests(self.r_norm, self.r_norm_df, self.workload_r, self.workload_df)

    @property
    def sequence_p(self) -> float:
        return sequence_p(self.sequence_tests)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """A cause whose signature holds: the replay measuring its share, the confidence of the
    signature, the share needed to list it (`needed`) and the share where confidence is full."""

    cause: str
    scenario: str
    signature: float
    needed: float
    clear: float
    implicated: tuple[tuple[int, int], ...] = ()
    fix_scenario: str | None = None      # the fix reported, when it is not the measuring replay
    # a measured cause's METHOD attribution: the idealisation that gives it the straggling time
    # (a heavier partition's stage, as M_W does), so that it is named whatever its fix saves
    attribution: str | None = None


def _signals(model: JobModel, result: WhatIfResult, rules: CauseRules, evidence: dict,
             paired: PairSignals | None, workload: SequenceWorkload | None) -> _Signals:
    mw, ms = float(result.mw.rem), float(result.ms.rem) if result.ms is not None else 0.0
    excess = {name: max(value - 1.0, 0.0) for name, value in result.by_optype.items()}
    total = sum(excess.values())
    comm_excess = sum(v for k, v in excess.items() if k not in COMPUTE_GROUPS)
    top_comm = max((k for k in excess if k not in COMPUTE_GROUPS), key=lambda k: excess[k], default=None)
    row = result.worker_slowdown[:, model.pp_size - 1] - 1.0
    uniformity = float(row.min() / row.max()) if model.dp_size > 1 and row.max() > 0 else 1.0
    evidence.update(m_w=mw, m_s=ms, m_w_workers=[list(w) for w in result.mw.workers],
                    comm_share=comm_excess / total if total > 0 else 0.0, comm_excess=comm_excess,
                    top_comm_optype=top_comm, last_stage_uniformity=uniformity)
    paired = pair_signals(model, rules, workload) if paired is None else paired
    evidence.update(paired.evidence)
    fit = (paired.workload_r, paired.workload_df) if paired.workload is workload else \
        workload_fit(model, paired.forward, paired.backward, paired.gc, workload)
    return _Signals(mw, ms, evidence["comm_share"], comm_excess, paired.forward, paired.backward, paired.r_norm,
                    uniformity, paired.gc, paired.peers, paired.chunks, paired.workers, paired.r_norm_df, *fit)


def _dense(cost) -> np.ndarray:
    """A fix cost as a full [op, lane] array (a Mix resolved)."""
    return np.where(cost.where, cost.alt, cost.base) if isinstance(cost, Mix) else cost


def _fix_costs(model: JobModel, result: WhatIfResult, signals: _Signals, workload: SequenceWorkload | None,
               rules: CauseRules, evidence: dict, timings: dict) -> dict[str, object]:
    """Scenario name -> cost of every fix (arrays or Mix), all replayed in one batch.

    worker-peer: blamed workers at peer speed (worker-balance without DP peers: their slow kind of
    work at the other stages' balance, fixes.at_balance); worker-compute / worker-comm: the M_W set's
    compute / transfers at ideal (what M_W measures); worker-others (one DP rank): the M_W set's
    compute at the mean of the other workers' (fixes.at_others_speed: the fix reported for a worker
    M_W names); stage: rebalanced chunks; communication: every transfer at its own typical time
    (fixes.typical_transfers); sequence: with recorded lengths, every microbatch of a step at the
    step's mean workload under the cost model (sequences.balanced_sequences), else an even spread
    keeping each worker's pace (sequences.even_sequences); sequence-repacked: greedy document
    repacking (with seq_lens, when the sequence signature holds); gc: pauses removed."""
    original = model.original_cost
    ideal = model.ideal_cost()[:, None]
    mw_mask = worker_set_mask(model, result.mw.workers)
    compute = np.isin(model.op_optype, (FORWARD, BACKWARD))[:, None]
    costs: dict[str, object] = {
        "worker-compute": Mix(original, ideal, mw_mask & compute),
        "worker-comm": Mix(original, ideal, mw_mask & model.op_is_comm[:, None]),
        "stage": rebalanced_stages(model),
        "communication": typical_transfers(model),
    }
    if model.dp_size == 1:   # M_W's workers at the other workers' speed (their own ops out of the ideal)
        costs["worker-others"] = at_others_speed(model, mw_mask)
    blamed = signals.workers.workers()
    if blamed and signals.peers is None:   # one DP rank per stage: the slow kind back at the others' balance
        costs["worker-balance"] = at_balance(model, signals.workers.slow)
    elif blamed:
        costs["worker-peer"] = at_peer_speed(model, blamed, signals.peers, gc_paused(model, signals.forward, signals.gc),
                                             intermittent_steps(signals.workers))
    if len(signals.forward):
        holds = workload is not None and signals.sequence_p <= rules.false_alarm   # compute follows the recorded lengths
        # with recorded lengths, perfect balancing under the cost model; without, METHOD's even spread
        costs["sequence"] = balanced_sequences(model, workload) if workload is not None else even_sequences(model)
        costs["gc"] = without_pauses(model, signals.forward, signals.gc, rules.gc_min_stall)
        if holds:    # only the sequence cause's fix needs it
            started = time.perf_counter()
            costs["sequence-repacked"], sequence_evidence = repacked_sequences(model, workload)
            timings["sequence"] = time.perf_counter() - started
            evidence.update(sequence_evidence)
            evidence["workload_forward_r"] = pearson(take(workload.op_workload, signals.forward), take(original, signals.forward))
    return costs


def _hot_half(result: WhatIfResult) -> tuple[tuple[int, int], ...]:
    """The M_W workers at least half as hot (in S_w - 1) as the hottest: the machines M_W blames."""
    hottest = max(result.worker_slowdown[d, p] for d, p in result.mw.workers) - 1.0
    return tuple((int(d), int(p)) for d, p in result.mw.workers if result.worker_slowdown[d, p] - 1.0 >= 0.5 * hottest)


def _work_or_speed(model: JobModel, result: WhatIfResult, signals: _Signals, work: ChunkWork,
                   out: list[_Candidate], rules: CauseRules, evidence: dict) -> list[_Candidate]:
    """One DP rank: a hot pipeline stage is a slow machine or a heavy partition, and its time alone
    cannot tell. The operations autograd recorded can: a partition with more layers runs more of
    them (work ratio >= rules.more_work against the median chunk) at the usual pace; a slow machine
    runs the same ones slower (pace >= rules.slower_pace, forward or backward: operations compared by
    identity where the converter did, ingest/kineto/pace.py, so a vocabulary-sized LM head is work,
    not pace; else seconds per operation). The cause the work contradicts is dropped, the one it
    shows is proposed. A hot chunk whose pace is beyond the threshold's 10% and at least its work
    ratio is as much a slower machine as a heavier partition: stage imbalance is dropped (time is
    work x pace; the partition explains no more of it than the machine), evidence chunk_undecided."""
    more, slower = rules.more_work, rules.slower_pace
    causes = {c.cause: c for c in out}
    hot_stages = {p for _, p in result.mw.workers} if result.mw is not None else set()
    if signals.chunks is not None:
        hot_stages.add(int(signals.chunks.heaviest_stage))
    if not hot_stages:
        return out
    hot = distinct(model.op_gmc[np.isin(model.op_stage, list(hot_stages)) & np.isin(model.op_optype, (FORWARD, BACKWARD))])
    ratio, speed = work.of(hot.tolist())
    evidence.update(chunk_work_ratio=ratio, chunk_speed_ratio=speed)
    if ratio >= more and speed < slower and "individual-worker" in causes:
        # METHOD's M_W gives the hot stage the straggling time and its recorded work shows a heavier
        # partition at the usual pace: the partition is measured, as a slow machine is against its
        # peers, so it is named with that attribution even where evening the layers saves little
        # (the stages that would take them on lie on the critical path too); its fix says how little
        worker = causes["individual-worker"]
        attribution = "worker-compute" if worker.scenario == "worker-compute" and signals.chunks is not None \
            and int(signals.chunks.heaviest_stage) in {p for _, p in worker.implicated} else None
        out = [dataclasses.replace(c, attribution=attribution) if c.cause == "stage-imbalance" else c
               for c in out if c.cause != "individual-worker"]
        if "stage-imbalance" not in causes:
            out.append(_Candidate("stage-imbalance", "stage", margin(ratio, more, 1.5), rules.stage_min_explained, 0.4,
                                  attribution=attribution))
    elif speed >= slower and (ratio < more or usual_work_slower(hot, work, more, slower)):
        # every stage that runs its usual work slowly is a slow machine (two can be); with several
        # chunks per stage, one of them doing the usual work at the slow pace is enough: a heavier
        # partition is more work at the usual pace (the last chunk's loss head adds operations)
        workers = tuple((0, p) for p in slow_stages(model, work, more, slower)) or tuple((0, int(p)) for p in sorted(hot_stages))
        out = [c for c in out if c.cause not in ("stage-imbalance", "individual-worker")]
        out.append(_Candidate("individual-worker", "worker-compute", margin(speed, slower, 2.0), rules.min_explained, 0.6,
                              workers, fix_scenario="worker-others"))
    elif "stage-imbalance" in causes and speed >= max(ratio, rules.straggling):
        # the hot chunk's excess is as much a slower pace (beyond the threshold's 10%) as more work:
        # neither its partition nor its machine is shown at fault (no DP replica to compare with)
        out = [c for c in out if c.cause != "stage-imbalance"]
        evidence["chunk_undecided"] = True
    return out


def _candidates(model: JobModel, result: WhatIfResult, signals: _Signals, share, rules: CauseRules,
                evidence: dict, work: ChunkWork | None = None, persists=lambda scenario: True) -> list[_Candidate]:
    """Every cause whose signature holds (package docstring), with the replay that measures it.
    persists(scenario): whether its fix saves time in more than one step (a slow or flapping link
    recurs; one transfer held up once, a preempted rank, is the job's own variation)."""
    out: list[_Candidate] = []
    blamed = signals.workers.workers()
    # CPU ranks on one host: their transfers are that host's CPU and memory work (gloo over loopback
    # or shared memory), no link or switch between them to be slow; slow transfers there are the
    # host's contention, never the network's
    network = not evidence.get("transfers_on_one_cpu_host")
    located_comm = network and signals.mw > rules.worker_mw and share("worker-comm") > share("worker-compute") \
        and persists("worker-comm") and link_not_host(model, _hot_half(result), rules.straggling, rules.false_alarm)
    if blamed:
        confidence = max(f.confidence for f in signals.workers.of(blamed[0]))
        out.append(_Candidate("individual-worker", "worker-peer" if model.dp_size > 1 else "worker-balance", confidence,
                              rules.min_explained, 0.5, tuple(blamed)))
    elif model.dp_size == 1 and signals.mw > rules.worker_mw and not located_comm:
        # M_W measures the worker's share; its fix is the other workers' speed
        out.append(_Candidate("individual-worker", "worker-compute", margin(signals.mw, rules.worker_mw, 0.9),
                              rules.min_explained, 0.6, _hot_half(result), fix_scenario="worker-others"))
    if located_comm:
        out.append(_Candidate("communication", "worker-comm", margin(signals.mw, rules.worker_mw, 0.9), rules.min_explained, 0.6,
                              _hot_half(result)))
    elif network and (signals.comm_share >= rules.comm_share or signals.comm_excess >= rules.comm_excess) \
            and comm_localised(model, evidence, rules.false_alarm, floor=rules.straggling) \
            and persists("communication"):
        signature = max(margin(signals.comm_share, rules.comm_share, 0.9), margin(signals.comm_excess, rules.comm_excess, 4 * rules.comm_excess))
        out.append(_Candidate("communication", "communication", signature, rules.min_explained, 0.6))
    # without DP peers, a stage the balance test blames runs its own layers slowly: the compute its
    # chunks lead by is its machine's, no partition's
    slow_stages = {p for _, p in blamed} if model.dp_size == 1 else set()
    if model.pp_size > 1 and not (slow_stages and (signals.chunks is None or signals.chunks.heaviest_stage in slow_stages)):
        by_ms = min(margin(signals.ms, rules.stage_ms, 0.8), margin(signals.uniformity, rules.stage_row_uniformity, 0.8)) \
            if signals.ms >= rules.stage_ms and signals.uniformity >= rules.stage_row_uniformity else 0.0
        by_chunk = margin(signals.chunks.ratio, rules.stage_chunk_ratio, 1.4) \
            if signals.chunks is not None and signals.chunks.ratio >= rules.stage_chunk_ratio else 0.0
        if by_ms or by_chunk:
            out.append(_Candidate("stage-imbalance", "stage", max(by_ms, by_chunk), rules.stage_min_explained, 0.4))
    if len(signals.forward) and signals.sequence_p <= rules.false_alarm:
        out.append(_Candidate("sequence-imbalance", "sequence", 1.0 - signals.sequence_p,
                              rules.sequence_min_explained, 0.5))
    if signals.gc is not None and gc_signature(evidence, rules):
        out.append(_Candidate("python-gc", "gc", margin(float(evidence["gc_workers"]), 2, 4), rules.gc_min_explained, 0.4))
    causes = {c.cause: c for c in out}
    if model.dp_size == 1 and work is not None:
        out = _work_or_speed(model, result, signals, work, out, rules, evidence)
        causes = {c.cause: c for c in out}
    if model.dp_size == 1 and "individual-worker" in causes and "stage-imbalance" in causes \
            and all(p == model.pp_size - 1 for _, p in result.mw.workers):
        # one DP rank: the M_W set is the last stage itself; the far more common stage cause wins
        out.remove(causes["individual-worker"])
        evidence["worker_set_is_last_stage"] = True
    return out


def _reported_fix(candidate: _Candidate, costs: dict) -> str:
    """The fix named to people: repacking when lengths are recorded, the candidate's own fix where it
    has one (`fix_scenario`), else the measuring replay."""
    if candidate.cause == "sequence-imbalance" and "sequence-repacked" in costs:
        return "sequence-repacked"
    return candidate.fix_scenario if candidate.fix_scenario in costs else candidate.scenario


def _combined_times(model: JobModel, costs: dict, sets: list[tuple[str, ...]], planned_gc: float,
                    known: dict[str, float]) -> dict[tuple[str, ...], float]:
    """Mean step time with every fix of each set applied together (sets of one are looked up in `known`)."""
    times, scenarios = {}, []
    for fixes in sets:
        if len(fixes) == 1:
            times[fixes] = known[fixes[0]] + (planned_gc if fixes[0] == "gc" else 0.0)
        elif fixes:
            scenarios.append(Scenario("+".join(fixes), compose(model, [_dense(costs[f]) for f in fixes])))
    if scenarios:
        replayed = replay(model, scenarios)
        for fixes in sets:
            if len(fixes) > 1:
                times[fixes] = float(replayed.span("+".join(fixes)).mean()) + (planned_gc if "gc" in fixes else 0.0)
    return times


def _fix_scenario(fix: Fix, reported: dict[str, str], costs: dict) -> str:
    """The replayed scenario behind a cause's fix."""
    return reported.get(fix.cause) or _default_scenario(fix.cause, costs)


def _default_scenario(cause: str, costs: dict) -> str | None:
    """The fix replayed for a cause that no signature proposed (shown for comparison)."""
    return {"individual-worker": next((s for s in ("worker-peer", "worker-balance", "worker-others") if s in costs),
                                      "worker-compute"),
            "stage-imbalance": "stage", "communication": "communication",
            "sequence-imbalance": "sequence-repacked" if "sequence-repacked" in costs else "sequence",
            "python-gc": "gc"}[cause] if cause != "sequence-imbalance" or "sequence" in costs else None


def classify(model: JobModel, result: WhatIfResult, *, workload: SequenceWorkload | None = None,
             rules: CauseRules = CauseRules(), paired: PairSignals | None = None, work: ChunkWork | None = None,
             one_host: bool = False) -> Verdict:
    """Root-cause verdict of one analysed job (see the package docstring).

    model: the compiled job (transforms.whatif.compile_job); result: analyze_model(model)
    (attribution needed when S >= 1.03); workload: sequence_workload(trace, model) or None;
    paired: pair_signals(model, rules, workload) when the caller has it already; one_host: the trace names
    one host for every rank (`ran_on_one_host`): CPU ranks' transfers then never left it.
    Jobs with S below rules.straggling get cause "none" (evidence and fixes still computed
    when attribution exists). Raises CauseError when model and result are of different jobs.
    """
    if result.job_id != model.job_id or len(result.steps) != model.n_steps:
        raise CauseError(f"job {model.job_id!r}: result of job {result.job_id!r} with {len(result.steps)} steps "
                         f"does not belong to this model ({model.n_steps} steps)")
    slowdown = float(result.slowdown)
    straggling = slowdown >= rules.straggling
    evidence: dict[str, object] = {"slowdown": slowdown, "launch_slowdown": float(result.launch_slowdown)}
    untraced = model_untraced(model, result)
    if result.untraced is not None:   # S with the named workers' untraced time; METHOD's beside it
        evidence.update(slowdown=result.model_slowdown, slowdown_traced=slowdown)
    if result.discarded or result.untraced is not None:
        return measured_verdict(model, result, rules, evidence, paired or pair_signals(model, rules, workload), work, untraced)
    tori, tideal = float(result.step_t_nodelay.mean()), float(result.step_t_noblk.mean())
    gap = tori - tideal
    if result.by_optype is None or result.mw is None or gap <= 0:
        evidence["attributed"] = False
        if not straggling:
            measured = unattributed_worker(model, result, rules, evidence, paired or pair_signals(model, rules, workload))
            if measured is not None:
                return measured
        cause = "unexplained" if straggling else "none"
        return Verdict(model.job_id, slowdown, cause, [], 1.0, {}, evidence, [], {},
                       {cause: explain.verdict_sentence(cause, slowdown, rules.straggling, None)})

    timings: dict[str, float] = {}
    if one_host and model.meta.host_compute:
        evidence["transfers_on_one_cpu_host"] = True
    signals = _signals(model, result, rules, evidence, paired, workload)
    if math.isfinite(signals.workload_r):
        evidence["workload_compute_r"] = signals.workload_r
    evidence["sequence_p"] = signals.sequence_p
    needed = samples_to_decide(signals.workload_r, signals.workload_df, rules.false_alarm, len(signals.sequence_tests))
    if needed is not None and signals.sequence_p > rules.false_alarm:
        evidence["sequence_samples_needed"] = needed
    costs = _fix_costs(model, result, signals, workload, rules, evidence, timings)
    fixed = replay(model, [Scenario(name, cost) for name, cost in costs.items()])
    step_time = {name: float(fixed.span(name).mean()) for name in fixed.names}
    planned_gc = planned_gc_seconds(model, signals.forward, signals.gc) if evidence["gc_pauses"] else 0.0

    def share(scenario: str) -> float:
        return (tori - step_time[scenario]) / gap

    def make_fix(cause: str, scenario: str, given: float | None = None, t: float | None = None) -> Fix:
        steps = None
        if t is None:
            paid = planned_gc if scenario == "gc" else 0.0
            t = step_time[scenario] + paid
            steps = tuple((np.asarray(result.step_t_nodelay, dtype=np.float64) - fixed.span(scenario) - paid).tolist())
        return Fix(cause, t, slowdown * t / tori, (tori - t) / gap, 1.0 - t / tori, FIX_NAMES[scenario], given,
                   step_savings=steps)

    _record_shares(evidence, share)

    def persists(scenario: str) -> bool:
        """Whether its fix saves at least half its largest per-step saving in two steps or more (a
        flapping link recurs; one transfer held up once does not), or in the only one. A fix that
        saves nothing in any step shows no transient: True (the other rules judge it)."""
        saving = np.asarray(result.step_t_nodelay, dtype=np.float64) - fixed.span(scenario)
        top = float(saving.max())
        return top <= 0 or int((saving >= 0.5 * top).sum()) >= min(2, len(saving))

    candidates = _candidates(model, result, signals, share, rules, evidence, work, persists)
    reported = {c.cause: _reported_fix(c, costs) for c in candidates}
    worth = (1.0 + 0.5 * (rules.straggling - 1.0)) * tideal        # a remaining S of 1.05 by default
    given, joint = _given_others(model, costs, reported, planned_gc, step_time, tideal, worth)
    listed = {}
    for c in candidates:
        attributed = -math.inf
        if c.attribution:
            attributed = evidence["stage_idealised_explained"] = share(c.attribution)
        best = max(share(c.scenario), given.get(c.cause, -math.inf), attributed)
        saves = (tori - step_time[c.scenario]) / tori
        masked = given.get(c.cause, -math.inf) >= c.needed      # it matters once the other causes are fixed
        measured = c.cause == "individual-worker" or c.attribution is not None   # a fact of the job, whatever its fix saves
        if best >= c.needed and (saves >= rules.min_savings or masked or measured):
            listed[c.cause] = min(c.signature, margin(best, c.needed, c.clear))
        elif best >= c.needed:   # its signature holds and explains enough, but the fix is not worth a change
            evidence.setdefault("below_min_savings", []).append({"cause": c.cause, "saves": float(saves)})
    fixes = {cause: make_fix(cause, scenario) for cause in explain.CAUSE_ORDER
             if (scenario := _default_scenario(cause, costs)) is not None}
    fixes.update({c: make_fix(c, reported[c], given.get(c)) for c in reported})
    if given:
        evidence["explained_given_others"] = given
    evidence["sequence_fix_explained"] = fixes["sequence-imbalance"].explained if "sequence-imbalance" in fixes else None
    if evidence["sequence_fix_explained"] is None:
        del evidence["sequence_fix_explained"]

    ranked = sorted(listed, key=lambda c: (-fixes[c].savings_fraction, -(fixes[c].explained_given_others or 0.0), c))
    joint_fix = None
    if len(ranked) >= 2:
        if set(ranked) != set(reported):
            _, joint = _given_others(model, costs, {c: reported[c] for c in ranked}, planned_gc, step_time, tideal, worth)
        joint_fix = make_fix("all", "all", t=joint)
        evidence["joint_fix_explained"] = joint_fix.explained
    by_cause = {c.cause: c for c in candidates}
    # a worker the test decides is slower than its peers (at the job's false-alarm rate) is named
    # even below S 1.1: the pipeline hides it for now, the machine is still bad
    measured_worker = "individual-worker" in listed and by_cause["individual-worker"].scenario in ("worker-peer", "worker-balance")
    if not straggling and measured_worker:
        primary, ranked, confidence = "individual-worker", ["individual-worker"], listed["individual-worker"]
    elif not straggling:
        primary, ranked, confidence = "none", [], 1.0
    elif ranked:
        primary, confidence = ranked[0], listed[ranked[0]]
    elif not localised(result, evidence) or ((evidence.get("comm_localised") is False or evidence.get("transfers_on_one_cpu_host"))
                                               and share("communication") >= 0.5):
        # straggling by S, yet no DP rank, stage or step stands out, or most of it is transfer time
        # beyond its own typical spread over every DP rank and step: the job's own variation (noise,
        # ops of one type that differ by design), not a straggler anyone could fix
        evidence["localised"] = False
        primary, confidence = "none", 1.0
    elif fixes and not persists(_fix_scenario(max(fixes.values(), key=lambda f: f.explained), reported, costs)):
        # straggling by S, yet what its best fix removes sits in one step: one transfer held up once,
        # a rank preempted for a moment; the job's own variation, not a straggler to fix
        evidence["transient"] = True
        primary, confidence = "none", 1.0
    elif (null := jitter_evidence(model, result, signals.workers, rules, evidence)) is not None and null.within(rules.false_alarm):
        # straggling by S, nothing listed, and an S the job's own jitter reaches (jitter.py): the
        # cost of ranks taking turns at being slow, not a straggler to fix
        primary, confidence = "none", 1.0
    else:
        primary = "unexplained"
        confidence = float(np.clip(1.0 - max((f.explained for f in fixes.values()), default=0.0), 0.0, 1.0))
    if straggling and not ranked and (undecided(signals.workers) or sequence_undecided(evidence, rules)
                                      or evidence.get("chunk_undecided")):
        # straggling, nothing listed, and a worker measures slower than its peers, or compute follows
        # the batches' tokens and evening them would remove the straggling, that the job's own
        # jitter cannot confirm, or a hot stage is as much slower as heavier: say so and what would
        # settle it, never a confident "none"
        primary, confidence = "insufficient-evidence", undecided_confidence(signals.workers, evidence)
    implicated = list(dict.fromkeys(w for c in ranked for w in by_cause[c].implicated))
    # untraced CPU work the replay leaves out (it is within 5% here) can still be one worker's,
    # large beside its peers' and hidden behind a slower worker: a cause of its own once it
    # costs a share of the step worth a cause (half the straggling threshold)
    untraced = [u for u in untraced_workers(model, result, rules)
                if max(u[1] or 0.0, u[2]) >= CAUSE_SHARE * (rules.straggling - 1.0)]
    if untraced and (primary != "none" or (straggling and evidence.get("localised") is False)):
        # straggling yet spread (collectives that wait for the paused worker stretch over every
        # rank) or unexplained: the worker whose untraced time the others wait for is the cause
        _, workers = untraced_cause(result, untraced, evidence, fixes)
        listed["untraced-cpu"] = untraced[0][3]
        ranked = [*ranked, "untraced-cpu"] if ranked else ["untraced-cpu"]
        if primary in ("unexplained", "none", "insufficient-evidence"):
            primary, confidence = "untraced-cpu", untraced[0][3]
            evidence.pop("localised", None)
        implicated = list(dict.fromkeys([*implicated, *workers]))
    elif crowded_untraced(model, result, rules, evidence, CAUSE_SHARE * (rules.straggling - 1.0)) and \
            (primary != "none" or (straggling and evidence.get("localised") is False)) and \
            primary in ("unexplained", "none", "insufficient-evidence"):
        # where untraced-cpu would be named, on a host with more threads than cores: nobody can tell
        # that worker's own work from its wait for a core
        primary, confidence = "insufficient-evidence", undecided_confidence(signals.workers, evidence)
        evidence.pop("localised", None)
    paused = pause_cause(model, result, rules, evidence, fixes, untraced)
    if paused is not None and (straggling or ranked):
        clear, workers = paused
        listed["python-gc"] = clear
        if _worker_is_its_pauses(by_cause.get("individual-worker"), ranked, workers, fixes["python-gc"],
                                 float(evidence.get("planned_gc_seconds", 0.0)), gap, rules):
            # METHOD's M_W named the worker (no test did) and its pauses alone take out M_W's share of
            # the straggling time: they ran inside its compute ops, which the replay counts as its
            # compute; the collector is the cause, not its machine
            ranked.remove("individual-worker")
            evidence["worker_is_its_pauses"] = True
            implicated = list(dict.fromkeys(w for c in ranked if c in by_cause for w in by_cause[c].implicated))
            if primary == "individual-worker":
                primary = "none"
        if "untraced-cpu" in ranked and evidence.get("untraced_is_pauses"):
            ranked.remove("untraced-cpu")
            if primary == "untraced-cpu":
                primary = "none"
        if "python-gc" not in ranked:
            ranked.append("python-gc")
        if primary in ("unexplained", "none", "insufficient-evidence") or \
                fixes["python-gc"].savings_fraction > fixes[primary].savings_fraction:
            ranked.remove("python-gc")
            ranked.insert(0, "python-gc")
            primary, confidence = "python-gc", clear
            evidence.pop("localised", None)
            evidence.pop("transient", None)
        implicated = list(dict.fromkeys([*implicated, *workers]))
    evidence = {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in evidence.items()}
    explanations = {c: explain.cause_sentence(c, evidence, fixes[c], by_cause[c].implicated, model.pp_size,
                                              rules.min_savings)
                    for c in ranked if c in by_cause}
    if untraced and "untraced-cpu" in ranked:
        explanations["untraced-cpu"] = explain.untraced_sentence(untraced, float(result.launch_slowdown), fixes["untraced-cpu"],
                                                                 data_loading(model, untraced, evidence, fixes))
    if "python-gc" in ranked and "python-gc" not in by_cause:
        explanations["python-gc"] = explain.pause_sentence(evidence, fixes["python-gc"], model.worker_rank)
    if primary == "insufficient-evidence":
        explanations[primary] = explain.insufficient_sentence(slowdown, evidence.get("worker_test", {}), evidence)
    if primary in ("none", "unexplained"):
        best = max(fixes.values(), key=lambda f: f.explained, default=None)
        within = evidence.get("jitter_null") if primary == "none" and straggling else None
        explanations[primary] = explain.verdict_sentence(primary, slowdown, rules.straggling, best,
                                                         spread=evidence.get("localised") is False,
                                                         transient=bool(evidence.get("transient")), jitter=within,
                                                         small=evidence.get("below_min_savings"),
                                                         min_savings=rules.min_savings)
    return Verdict(model.job_id, slowdown, primary, ranked, float(confidence),
                   {c: float(listed[c]) for c in ranked}, evidence, implicated, fixes, explanations, joint_fix,
                   timings)


def _worker_is_its_pauses(worker: _Candidate | None, ranked: list[str], paused_workers, gc_fix: Fix, planned: float,
                          gap: float, rules: CauseRules) -> bool:
    """Whether the individual-worker cause is only what METHOD's M_W measured (worker-compute: no test
    decided the worker) on workers the collector paused, whose pauses alone make at least M_W's own
    share (`rules.worker_mw`) of the straggling time `gap` (seconds per step): the pauses taken out
    of the steps as they ran, planned GC not paid back (`gc_fix.step_savings` are net of it)."""
    if worker is None or worker.scenario != "worker-compute" or "individual-worker" not in ranked \
            or not set(worker.implicated) <= set(paused_workers) or not gc_fix.step_savings or gap <= 0:
        return False
    taken_out = float(np.mean(gc_fix.step_savings)) + planned
    return taken_out >= rules.worker_mw * gap


def _record_shares(evidence: dict, share) -> None:
    """Share of T - T_ideal each replayed fix removes alone, under its evidence name."""
    names = {"worker-peer": "worker_fix_explained", "worker-balance": "worker_fix_explained", "worker-compute": "worker_compute_explained",
             "worker-comm": "worker_comm_explained", "stage": "stage_fix_explained",
             "communication": "communication_fix_explained", "sequence": "sequence_even_explained", "gc": "gc_fix_explained"}
    for scenario, name in names.items():
        try:
            evidence[name] = share(scenario)
        except KeyError:
            continue


def _given_others(model: JobModel, costs: dict, reported: dict[str, str], planned_gc: float,
                  step_time: dict[str, float], tideal: float, worth: float) -> tuple[dict[str, float], float | None]:
    """Per cause, the share of what remains of the straggling time once every other cause's fix
    is applied (T_others - T_floor, T_floor the lower of T_ideal and T with every fix) that
    its own fix removes, when what remains is still a slowdown (T_others / T_floor) of at
    least worth / T_ideal; and the step time with every fix (None with fewer than two causes)."""
    if len(reported) < 2:
        return {}, None
    every = tuple(sorted(reported.values()))
    without = {c: tuple(sorted(f for o, f in reported.items() if o != c)) for c in reported}
    times = _combined_times(model, costs, [every, *without.values()], planned_gc, step_time)
    floor = min(tideal, times[every])       # fixing a slow worker can beat the ideal, whose means include it
    return {c: (times[without[c]] - times[every]) / (times[without[c]] - floor)
            for c in reported if times[without[c]] >= worth * floor / tideal}, times[every]


def ran_on_one_host(trace: pa.Table) -> bool:
    """Whether the trace names one host for every row (its `host` column: torch >= 2.13 writes the
    host's name per rank, the collector passes it); False where any row names none."""
    if "host" not in trace.column_names or trace["host"].null_count:
        return False
    import pyarrow.compute as pc

    return len(pc.unique(trace["host"])) == 1


def analyze_and_classify(trace: pa.Table, meta: JobMeta, job_id: str = "", *, rules: CauseRules = CauseRules(),
                         timeline: bool = False) -> tuple[WhatIfResult, Verdict]:
    """What-if analysis and root-cause verdict of one trace window, compiling the job once.

    The same WhatIfResult as transforms.whatif.analyze_job, plus the Verdict; raises the
    engine's WhatIfError subclasses on traces it cannot analyse.
    """
    started = time.perf_counter()
    model = compile_job(trace, meta, job_id)
    compiled = time.perf_counter()
    workload = sequence_workload(trace, model)   # the batches' recorded lengths: a cause's signal, counted as one
    lengths = time.perf_counter() - compiled
    with contextlib.ExitStack() as stack:
        paired = None
        if replay_thread_count() > 1:   # threads to spare: the trace signals are computed while the analysis replays
            from concurrent.futures import ThreadPoolExecutor   # here: a one-job command's path only

            paired = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="strag-signals")).submit(
                pair_signals, model, rules, workload)
        result = analyze_model(model, timeline=timeline)
        replayed = time.perf_counter()
        verdict = classify(model, result, workload=workload, rules=rules,
                           paired=None if paired is None else paired.result(), work=chunk_work(trace, model),
                           one_host=bool(meta.host_compute) and ran_on_one_host(trace))
    # where the seconds went (Verdict.timings): the graph compiled, METHOD's replays, the causes
    # (their signals, batched fix replays and tests; a signal thread's overlap with the replays is not counted twice)
    verdict.timings.update(compile=compiled - started, replay=replayed - compiled - lengths,
                           causes=time.perf_counter() - replayed + lengths)
    tests = model.__dict__.get("_worker_tests")
    verdict.worker_summary = None if tests is None else tests.summary()
    return result, verdict
