"""classify: signals -> one batched replay of every fix -> detectors -> the listing rule -> ranked verdict."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np
import pyarrow as pa

import transforms.whatif.causes.explain as explain
from transforms.whatif.causes.fixes import (at_balance, at_peer_speed, compose, planned_gc_seconds, rebalanced_stages, typical_transfers,
                                           without_pauses)
from transforms.whatif.causes.jitter import jitter_null
from transforms.whatif.causes.pauses import CAUSE_SHARE, find_pauses, idle_inside_compute, inside_compute
from transforms.whatif.causes.sequences import (BACKWARD, FORWARD, SequenceWorkload, at_mean_workload, balanced_sequences,
                                                even_sequences, repacked_sequences, sequence_workload)
from transforms.whatif.causes.signals import (
    ChunkBalance,
    ChunkWork,
    GcStalls,
    PeerComparison,
    chunk_balance,
    chunk_work,
    gc_stalls,
    margin,
    peer_median,
    pairs,
    pearson,
    peer_comparison,
    take,
    within_group_normalised,
)
from transforms.whatif.causes.verdict import CauseError, CauseRules, Fix, Verdict
from transforms.whatif.causes.untraced import (crowded, data_loading, model_untraced, pause_cause, untraced_cause,
                                              untraced_workers)
from transforms.whatif.causes.workers import WorkerTests, balance_tests, t_sf, worker_tests
from transforms.whatif.metrics import analyze_model, worker_set_mask
from transforms.whatif.model import JobModel, compile_job, distinct, median
from transforms.whatif.replay import Mix, Scenario, replay, replay_thread_count
from transforms.whatif.result import STRAGGLING_THRESHOLD, JobMeta, WhatIfResult
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
    workload_r: float = math.nan     # compute against the recorded workload of its microbatch (_workload_fit)
    workload_df: int = 0

    @property
    def sequence_tests(self) -> list[tuple[float, int]]:
        return _sequence_tests(self.r_norm, self.r_norm_df, self.workload_r, self.workload_df)

    @property
    def sequence_p(self) -> float:
        return _sequence_p(self.sequence_tests)


def _sequence_tests(r_norm: float, r_norm_df: int, workload_r: float, workload_df: int) -> list[tuple[float, int]]:
    """(r, degrees of freedom) of the sequence signature's correlations the trace supports:
    forward against backward of the same microbatch, compute against the tokens it recorded."""
    return [(r, df) for r, df in ((r_norm, r_norm_df), (workload_r, workload_df)) if math.isfinite(r) and df >= 1]


def _sequence_p(tests: list[tuple[float, int]]) -> float:
    """p-value that compute follows the data: each test's one-sided p (`correlation_p`), the
    smallest times their number (Bonferroni)."""
    p_values = [correlation_p(r, df) for r, df in tests]
    return min(1.0, len(p_values) * min(p_values)) if p_values else 1.0


def _samples_to_decide(r: float, df: int, alpha: float, tests: int = 1) -> int | None:
    """How many more microbatches a positive correlation r would need to be significant at `alpha`
    (the same r over more samples; Bonferroni over the `tests` sequence tests), None where it is not
    positive or already decides."""
    if not math.isfinite(r) or r <= 0 or df < 1 or tests * correlation_p(r, df) <= alpha:
        return None
    more = df
    while tests * correlation_p(r, more) > alpha and more < 100_000:
        more = more * 2
    low = more // 2
    while low + 1 < more:                      # the least df that decides, by bisection
        middle = (low + more) // 2
        low, more = (middle, more) if tests * correlation_p(r, middle) > alpha else (low, middle)
    return more - df


def correlation_p(r: float, df: int) -> float:
    """One-sided p-value of a Pearson r > 0 with `df` degrees of freedom (samples, less one per
    mean taken out and one for the slope): t = r sqrt(df / (1 - r^2)) against Student's t. The
    sequence signature is a test at the job's false-alarm rate, so many microbatches decide at a
    smaller r than a few (a fixed r would be too strict for the one and too lax for the other)."""
    if not math.isfinite(r) or df < 1:
        return 1.0
    if r >= 1.0:
        return 0.0
    return t_sf(r * math.sqrt(df / max(1.0 - r * r, 1e-300)), df)


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


@dataclasses.dataclass(frozen=True)
class PairSignals:
    """The signals read from the trace's forward/backward pairs alone, not from the analysis:
    `analyze_and_classify` computes them while the analysis replays. evidence: their entries."""

    forward: np.ndarray
    backward: np.ndarray
    r_norm: float
    gc: GcStalls | None
    peers: PeerComparison | None
    chunks: ChunkBalance | None
    evidence: dict
    workers: WorkerTests
    r_norm_df: int = 0
    workload: SequenceWorkload | None = None   # the recorded lengths the fit below was computed on
    workload_r: float = math.nan               # compute against the recorded workload (_workload_fit)
    workload_df: int = 0


def pair_signals(model: JobModel, rules: CauseRules = CauseRules(), workload: SequenceWorkload | None = None) -> PairSignals:
    """Forward/backward correlation, GC stalls, peer comparison and chunk balance of a compiled job.
    workload (sequence_workload): where the batches' recorded lengths explain the compute (the
    sequence signature at the job's false-alarm rate), the worker test compares the work at the
    chunk's mean workload (sequences.at_mean_workload): a rank given the longer batches is no
    slower machine."""
    evidence: dict[str, object] = {}
    forward, backward = pairs(model)
    r_norm, r_norm_df, gc, peers, chunks = math.nan, 0, None, None, None
    paused = _untraced_inside_compute(model, rules) if model.meta.host_compute and model.dp_size > 1 else None
    if paused is not None:   # the work a worker did, without the stretches inside its compute that ran none
        evidence["untraced_inside_compute"] = float(paused.sum())
    if len(forward):
        gc = gc_stalls(model, forward, backward, rules)
        _gc_evidence(model, forward, gc, evidence)
        if paused is None and model.dp_size > 1 and _gc_signature(evidence, rules):
            # GPU ranks: collections that rotate over the workers stretch their forwards (python-gc);
            # the stretch is the collector's time, not the machine's compute (as pauses on CPU ranks)
            paused = np.zeros_like(model.original_cost)
            rows, lanes = np.nonzero(gc.pauses)
            paused[forward[rows, lanes], lanes] = gc.stall[rows, lanes]
    if len(forward):
        f, b = take(model.original_cost, forward), take(model.original_cost, backward)
        chunk = model.op_stage[forward] * (int(model.op_gmc.max()) + 2) + model.op_gmc[forward]
        keep = ~gc.pauses
        if forward.shape[0] > model.pp_size * max(model.vpp_size, 1):
            r_norm = pearson(within_group_normalised(f, chunk)[keep], within_group_normalised(b, chunk)[keep])
            # each (chunk, lane)'s mean is taken out: one degree of freedom per group, one for the slope
            r_norm_df = int(keep.sum()) - len(distinct(chunk[:, 0])) * model.n_lanes - 1
        evidence.update(forward_backward_r=pearson(f, b), forward_backward_r_normalised=r_norm)
        peers = peer_comparison(model, forward, backward)
        chunks = chunk_balance(model, forward, backward)
    else:
        evidence["gc_pauses"] = 0
    work = None if paused is None else model.original_cost - paused
    workload_r, workload_df = _workload_fit(model, forward, backward, gc, workload)
    if model.dp_size > 1 and workload is not None and len(forward) and \
            _sequence_p(_sequence_tests(r_norm, r_norm_df, workload_r, workload_df)) <= rules.false_alarm:
        work = at_mean_workload(model, workload, work)
        evidence["worker_test_at_mean_workload"] = True
    workers = worker_tests(model, forward, backward, rules.false_alarm, rules.straggling, rules.peer_offset, work) \
        if model.dp_size > 1 else balance_tests(model, rules.false_alarm, rules.straggling, rules.peer_offset)
    evidence.update(workers.evidence())
    if peers is not None:
        evidence["peer_ratio_max"] = float(np.nanmax(peers.ratio))
        evidence["peer_workers"] = [_peer_entry(model, workers, peers, d, p) for d, p in workers.workers()]
    if model.dp_size == 1 and workers.slow:
        evidence["balance_workers"] = [{"dp_rank": f.worker[0], "stage": f.worker[1], "kind": f.kind, "ratio": f.ratio,
                                        "steps": model.n_steps, "step_indices": list(f.steps),
                                        "step_numbers": [int(model.steps[s]) for s in f.steps],
                                        "persistent": f.persistent, "slow_steps": len(f.steps),
                                        "confidence": f.confidence} for f in workers.slow]
    if chunks is not None:
        evidence.update(chunk_ratio=chunks.ratio, heaviest_chunk=[chunks.heaviest_chunk, chunks.heaviest_stage])
    signals = PairSignals(forward, backward, r_norm, gc, peers, chunks, evidence, workers, r_norm_df,
                          workload, workload_r, workload_df)
    model.__dict__["_worker_tests"] = workers   # the verdict's summary for tests over several windows
    return signals


def _untraced_inside_compute(model: JobModel, rules: CauseRules) -> np.ndarray | None:
    """[op, lane] seconds inside compute ops in which the worker's thread ran none of its work (CPU
    ranks): the collections the trainer recorded there, else the longest stretch without a traced
    op (`idle_within`). A slow machine runs its ops slower; a stretch with no op running is Python
    stopped (the collector, one or many times a step) or the OS, never slower compute, so the worker
    test measures the compute without it. None without either record."""
    pauses = find_pauses(model, rules.false_alarm, rules.straggling)
    idle = idle_inside_compute(model)
    if pauses.recorded or idle is None:
        return inside_compute(model, pauses)
    return idle if idle.any() else None


def _peer_entry(model: JobModel, workers: WorkerTests, peers: PeerComparison, d: int, p: int) -> dict:
    """A blamed worker's evidence entry: its ratios against its DP peers (an intermittent worker's:
    in the steps it is slow, kind by kind where the test found it), the steps (indices and the
    profiled step numbers) and its confidence."""
    findings = workers.of((d, p))
    persistent = any(f.persistent for f in findings)
    ratios = {"forward": float(peers.forward[d, p]), "backward": float(peers.backward[d, p])}
    if not persistent:
        ratios.update({f.kind: float(f.ratio) for f in findings})
    slow = _slow_steps(workers, (d, p))
    return {"dp_rank": d, "stage": p, "ratio": float(peers.ratio[d, p]), **ratios,
            "slow_steps": len(slow), "steps": peers.n_steps, "step_indices": slow,
            "step_numbers": [int(model.steps[i]) for i in slow], "persistent": persistent,
            "confidence": max(f.confidence for f in findings)}


def _slow_steps(workers: WorkerTests, worker: tuple[int, int]) -> list[int]:
    """The profiled steps (indices) where the worker's decided findings are slow."""
    return sorted({s for f in workers.of(worker) for s in f.steps})


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
        _workload_fit(model, paired.forward, paired.backward, paired.gc, workload)
    return _Signals(mw, ms, evidence["comm_share"], comm_excess, paired.forward, paired.backward, paired.r_norm,
                    uniformity, paired.gc, paired.peers, paired.chunks, paired.workers, paired.r_norm_df, *fit)


def _gc_evidence(model: JobModel, forward: np.ndarray, gc: GcStalls, evidence: dict) -> None:
    """Counts of the GC signature: pauses, workers hit, the largest share on one worker, steps."""
    evidence["gc_pauses"] = int(gc.pauses.sum())
    if not gc.pauses.any():
        return
    rows, lanes = np.nonzero(gc.pauses)
    worker = model.lane_dp[lanes] * model.pp_size + model.op_stage[forward[rows, lanes]]
    counts = np.bincount(worker, minlength=model.dp_size * model.pp_size)
    evidence.update(gc_workers=int((counts > 0).sum()), gc_max_worker_share=float(counts.max() / counts.sum()),
                    gc_steps=int(len(distinct(model.lane_step[lanes]))), gc_mean_pause=float(gc.stall[gc.pauses].mean()),
                    gc_backward_outliers=int(gc.backward_outliers))


def _dense(cost) -> np.ndarray:
    """A fix cost as a full [op, lane] array (a Mix resolved)."""
    return np.where(cost.where, cost.alt, cost.base) if isinstance(cost, Mix) else cost


def _fix_costs(model: JobModel, result: WhatIfResult, signals: _Signals, workload: SequenceWorkload | None,
               rules: CauseRules, evidence: dict, timings: dict) -> dict[str, object]:
    """Scenario name -> cost of every fix (arrays or Mix), all replayed in one batch.

    worker-peer: blamed workers at peer speed (worker-balance without DP peers: their slow kind of
    work at the other stages' balance, fixes.at_balance); worker-compute / worker-comm: the M_W set's
    compute / transfers at ideal; stage: rebalanced chunks; communication: every transfer
    at its own typical time (fixes.typical_transfers); sequence: with recorded lengths, every microbatch
    of a step at the step's mean workload under the cost model (sequences.balanced_sequences), else an even
    spread keeping each worker's pace (sequences.even_sequences); sequence-repacked: greedy document repacking (with
    seq_lens, when the sequence signature holds); gc: pauses removed."""
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
    blamed = signals.workers.workers()
    if blamed and signals.peers is None:   # one DP rank per stage: the slow kind back at the others' balance
        costs["worker-balance"] = at_balance(model, signals.workers.slow)
    elif blamed:
        costs["worker-peer"] = at_peer_speed(model, blamed, signals.peers, _gc_paused(model, signals.forward, signals.gc),
                                             _intermittent_steps(signals.workers))
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


def _gc_paused(model: JobModel, forward: np.ndarray, gc) -> np.ndarray | None:
    """[op, lane] mask of the forwards GC stalled (signals.gc_stalls): python-gc's to remove, not the
    worker's; None without stall signals."""
    if gc is None or not len(forward):
        return None
    out = np.zeros(model.original_cost.shape, dtype=bool)
    rows, lanes = np.nonzero(gc.pauses)
    out[forward[rows, lanes], lanes] = True
    return out


def _intermittent_steps(workers: WorkerTests) -> dict[tuple[int, int, str], tuple[int, ...]]:
    """(dp, stage, kind) -> the steps of each intermittent finding, for workers with no persistent
    one: what their fix brings back to their peers' pace."""
    persistent = {f.worker for f in workers.slow if f.persistent}
    out: dict[tuple[int, int, str], set[int]] = {}
    for f in workers.slow:
        if f.worker not in persistent:
            out.setdefault((*f.worker, f.kind), set()).update(f.steps)
    return {key: tuple(sorted(steps)) for key, steps in out.items()}


def _workload_fit(model: JobModel, forward: np.ndarray, backward: np.ndarray, gc: GcStalls | None,
                  workload: SequenceWorkload | None) -> tuple[float, int]:
    """Pearson r between each microbatch's compute (forward + backward) and the workload its
    recorded sequences carry, both over the (stage, chunk)'s mean across every step and DP rank
    (stage and chunk sizes cancel, steps and ranks stay: the data moves between them); GC pauses
    left out. The sequence signature where a worker runs one microbatch per step
    (forward against backward needs several): compute that follows the batch's tokens, moving
    between ranks and steps. With its degrees of freedom (samples less one per (stage, chunk) mean
    and one for the slope). (NaN, 0) without recorded lengths or pairs."""
    if workload is None or not len(forward):
        return math.nan, 0
    compute = take(model.original_cost, forward) + take(model.original_cost, backward)
    load = take(workload.op_workload, forward)
    chunk = model.op_stage[forward] * (int(model.op_gmc.max()) + 2) + model.op_gmc[forward]
    keep = np.isfinite(load) & (load > 0)
    if gc is not None:
        keep &= ~gc.pauses
    if keep.sum() < 3:
        return math.nan, 0
    compute, load = compute[keep], load[keep]
    groups, group = np.unique(chunk[keep], return_inverse=True)
    mean = lambda values: (np.bincount(group, weights=values) / np.bincount(group))[group]
    return pearson(compute / mean(compute), load / mean(load)), int(keep.sum()) - len(groups) - 1


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
        out = [c for c in out if c.cause != "individual-worker"]
        if "stage-imbalance" not in causes:
            out.append(_Candidate("stage-imbalance", "stage", margin(ratio, more, 1.5), rules.stage_min_explained, 0.4))
    elif speed >= slower and (ratio < more or _usual_work_slower(hot, work, more, slower)):
        # every stage that runs its usual work slowly is a slow machine (two can be); with several
        # chunks per stage, one of them doing the usual work at the slow pace is enough: a heavier
        # partition is more work at the usual pace (the last chunk's loss head adds operations)
        workers = tuple((0, p) for p in _slow_stages(model, work, more, slower)) or tuple((0, int(p)) for p in sorted(hot_stages))
        out = [c for c in out if c.cause not in ("stage-imbalance", "individual-worker")]
        out.append(_Candidate("individual-worker", "worker-compute", margin(speed, slower, 2.0), rules.min_explained, 0.6,
                              workers))
    elif "stage-imbalance" in causes and speed >= max(ratio, rules.straggling):
        # the hot chunk's excess is as much a slower pace (beyond the threshold's 10%) as more work:
        # neither its partition nor its machine is shown at fault (no DP replica to compare with)
        out = [c for c in out if c.cause != "stage-imbalance"]
        evidence["chunk_undecided"] = True
    return out


def _usual_work_slower(chunks: np.ndarray, work: ChunkWork, more: float, slower: float) -> bool:
    """Whether one of these chunks runs its usual amount of work (< `more` the median) at >= `slower`
    the median pace."""
    return any(speed >= slower and ratio < more for ratio, speed in (work.of([int(g)]) for g in chunks.tolist()))


def _slow_stages(model: JobModel, work: ChunkWork, more: float, slower: float) -> list[int]:
    """Pipeline stages whose chunks run their usual amount of work (< `more` the median) at
    >= `slower` the median pace, or one of whose chunks does: machines slower than the others
    (one DP rank: no peers)."""
    out = []
    for p in range(model.pp_size):
        chunks = distinct(model.op_gmc[(model.op_stage == p) & np.isin(model.op_optype, (FORWARD, BACKWARD))])
        ratio, speed = work.of(chunks.tolist())
        if speed >= slower and (ratio < more or _usual_work_slower(chunks, work, more, slower)):
            out.append(p)
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
        and persists("worker-comm") and _link_not_host(model, _hot_half(result), rules.straggling, rules.false_alarm)
    if blamed:
        confidence = max(f.confidence for f in signals.workers.of(blamed[0]))
        out.append(_Candidate("individual-worker", "worker-peer" if model.dp_size > 1 else "worker-balance", confidence,
                              rules.min_explained, 0.5, tuple(blamed)))
    elif model.dp_size == 1 and signals.mw > rules.worker_mw and not located_comm:
        out.append(_Candidate("individual-worker", "worker-compute", margin(signals.mw, rules.worker_mw, 0.9),
                              rules.min_explained, 0.6, _hot_half(result)))
    if located_comm:
        out.append(_Candidate("communication", "worker-comm", margin(signals.mw, rules.worker_mw, 0.9), rules.min_explained, 0.6,
                              _hot_half(result)))
    elif network and (signals.comm_share >= rules.comm_share or signals.comm_excess >= rules.comm_excess) \
            and _comm_localised(model, evidence, rules.false_alarm, floor=rules.straggling) \
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
    if signals.gc is not None and _gc_signature(evidence, rules):
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


def _gc_signature(evidence: dict, rules: CauseRules) -> bool:
    """Forward-only pauses on at least two workers, none holding most of them (rotating, not a machine)."""
    return evidence["gc_pauses"] >= 2 and evidence["gc_workers"] >= 2 \
        and evidence["gc_max_worker_share"] <= rules.gc_max_worker_share \
        and evidence["gc_backward_outliers"] <= evidence["gc_pauses"] // 4


def _reported_fix(candidate: _Candidate, costs: dict) -> str:
    """The fix named to people: repacking when lengths are recorded, planned GC, else the measuring replay."""
    if candidate.cause == "sequence-imbalance" and "sequence-repacked" in costs:
        return "sequence-repacked"
    return candidate.scenario


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
    return {"individual-worker": next((s for s in ("worker-peer", "worker-balance") if s in costs), "worker-compute"),
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
        return _measured_verdict(model, result, rules, evidence, paired or pair_signals(model, rules, workload), work, untraced)
    tori, tideal = float(result.step_t_nodelay.mean()), float(result.step_t_noblk.mean())
    gap = tori - tideal
    if result.by_optype is None or result.mw is None or gap <= 0:
        evidence["attributed"] = False
        if not straggling:
            measured = _unattributed_worker(model, result, rules, evidence, paired or pair_signals(model, rules, workload))
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
    needed = _samples_to_decide(signals.workload_r, signals.workload_df, rules.false_alarm, len(signals.sequence_tests))
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
        best = max(share(c.scenario), given.get(c.cause, -math.inf))
        saves = (tori - step_time[c.scenario]) / tori
        masked = given.get(c.cause, -math.inf) >= c.needed      # it matters once the other causes are fixed
        if best >= c.needed and (saves >= rules.min_savings or masked or c.cause == "individual-worker"):
            listed[c.cause] = min(c.signature, margin(best, c.needed, c.clear))
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
    elif not _localised(result, evidence) or ((evidence.get("comm_localised") is False or evidence.get("transfers_on_one_cpu_host"))
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
    elif (null := _jitter(model, result, signals.workers, rules, evidence)) is not None and null.within(rules.false_alarm):
        # straggling by S, nothing listed, and an S the job's own jitter reaches (jitter.py): the
        # cost of ranks taking turns at being slow, not a straggler to fix
        primary, confidence = "none", 1.0
    else:
        primary = "unexplained"
        confidence = float(np.clip(1.0 - max((f.explained for f in fixes.values()), default=0.0), 0.0, 1.0))
    if straggling and not ranked and (_undecided(signals.workers) or _sequence_undecided(evidence, rules)
                                      or evidence.get("chunk_undecided")):
        # straggling, nothing listed, and a worker measures slower than its peers, or compute follows
        # the batches' tokens and evening them would remove the straggling, that the job's own
        # jitter cannot confirm, or a hot stage is as much slower as heavier: say so and what would
        # settle it, never a confident "none"
        primary, confidence = "insufficient-evidence", _undecided_confidence(signals.workers, evidence)
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
    elif _crowded_untraced(model, result, rules, evidence, CAUSE_SHARE * (rules.straggling - 1.0)) and \
            (primary != "none" or (straggling and evidence.get("localised") is False)) and \
            primary in ("unexplained", "none", "insufficient-evidence"):
        # where untraced-cpu would be named, on a host with more threads than cores: nobody can tell
        # that worker's own work from its wait for a core
        primary, confidence = "insufficient-evidence", _undecided_confidence(signals.workers, evidence)
        evidence.pop("localised", None)
    paused = pause_cause(model, result, rules, evidence, fixes, untraced)
    if paused is not None and (straggling or ranked):
        clear, workers = paused
        listed["python-gc"] = clear
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
    explanations = {c: explain.cause_sentence(c, evidence, fixes[c], by_cause[c].implicated, model.pp_size)
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
                                                         transient=bool(evidence.get("transient")), jitter=within)
    return Verdict(model.job_id, slowdown, primary, ranked, float(confidence),
                   {c: float(listed[c]) for c in ranked}, evidence, implicated, fixes, explanations, joint_fix,
                   timings)


def _unattributed_worker(model: JobModel, result: WhatIfResult, rules: CauseRules, evidence: dict,
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
        cost, scenario = at_peer_speed(model, blamed, paired.peers, _gc_paused(model, paired.forward, paired.gc),
                                       _intermittent_steps(paired.workers)), "worker-peer"
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


def _measured_verdict(model: JobModel, result: WhatIfResult, rules: CauseRules, evidence: dict,
                      paired: PairSignals, work: ChunkWork | None = None, untraced: list | None = None) -> Verdict:
    """The verdict of a window whose replay does not match its trace (discrepancy beyond 5% either
    way), or matches it only with named workers' untraced time modelled (`model_untraced`): no
    what-if fix of traced ops, only causes the trace measures, ranked by how clearly:
    a worker the worker test decides is slow, a model chunk >= stage_alarm_ratio the median
    chunk's compute (one DP rank: a stage running its usual work at >= worker_alarm_ratio the
    median pace), untraced-cpu: one worker's untraced CPU time making the discrepancy (its fix:
    that time removed, against what ran), python-gc from pauses. Nothing measured: "none", since
    S itself comes from the replay that does not match (a kept window whose worker test cannot
    decide: "insufficient-evidence"). untraced: `untraced.untraced_workers`'
    answer when the caller has it."""
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
        slow = _slow_stages(model, work, rules.more_work, rules.slower_pace) if work is not None and model.dp_size == 1 else []
        if slow:   # one DP rank: the heavy chunk runs the usual work, slowly: its machine
            measured["individual-worker"], implicated["individual-worker"] = float(paired.chunks.ratio), [(0, p) for p in slow]
        else:
            measured["stage-imbalance"], implicated["stage-imbalance"] = float(paired.chunks.ratio), []
    elif paired.chunks is not None and work is not None and model.dp_size == 1 and "individual-worker" not in measured:
        # one DP rank, no chunk much heavier overall, yet a stage runs its usual work (forward or
        # backward) at a worker alarm's pace: a slow machine the chunk totals dilute
        slow = _slow_stages(model, work, rules.more_work, rules.worker_alarm_ratio)
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
    # a discarded window's S comes from the replay that does not match: it shows no straggling to
    # be undecided about; a kept one (untraced time modelled) does. A worker whose untraced time
    # would make the discrepancy, on a host with more threads than cores, cannot be decided either
    on_crowded_host = not ranked and bool(_crowded_untraced(model, result, rules, evidence))
    undecided = on_crowded_host or (not result.discarded and slowdown >= rules.straggling and _undecided(paired.workers))
    primary = ranked[0] if ranked else "insufficient-evidence" if undecided else "none"
    workers = list(dict.fromkeys(w for c in ranked for w in implicated[c]))
    evidence = {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in evidence.items()}
    explanations = {c: explain.discarded_sentence(c, evidence, implicated.get(c, []), launch, modelled=not result.discarded)
                    for c in (ranked or [primary]) if c != "insufficient-evidence"}
    if primary == "insufficient-evidence":
        explanations[primary] = explain.insufficient_sentence(slowdown, evidence.get("worker_test", {}), evidence)
    if untraced and "untraced-cpu" in ranked:
        explanations["untraced-cpu"] = explain.untraced_sentence(untraced, launch, fixes["untraced-cpu"],
                                                                 data_loading(model, untraced, evidence, fixes))
    if paused is not None:
        explanations["python-gc"] = explain.pause_sentence(evidence, fixes["python-gc"], model.worker_rank)
    confidences = {c: (paused[0] if c == "python-gc" else untraced[0][3] if c == "untraced-cpu" else 1.0) for c in ranked}
    confidence = _undecided_confidence(paired.workers, evidence) if primary == "insufficient-evidence" else \
        confidences.get(primary, 1.0)
    return Verdict(model.job_id, slowdown, primary, ranked, confidence, confidences, evidence, workers,
                   fixes, explanations)


def _crowded_untraced(model: JobModel, result: WhatIfResult, rules: CauseRules, evidence: dict,
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


def _jitter(model: JobModel, result: WhatIfResult, workers: WorkerTests, rules: CauseRules, evidence: dict):
    """The jitter null of a job about to be "unexplained" (jitter.py), recorded in evidence["jitter_null"]."""
    null = jitter_null(model, result, workers, rules.false_alarm)
    if null is not None:
        evidence["jitter_null"] = null.as_json()
    return null


def _undecided_confidence(workers: WorkerTests, evidence: dict) -> float:
    """The confidence an insufficient-evidence verdict states: that of its strongest undecided
    finding (1 - its Bonferroni-adjusted p, a worker's or the sequence signature's), below
    1 - the false-alarm rate by construction; 0 where no test could be made (one step, no peers).
    Never 1.0: the verdict is that nothing can be decided, not a certainty about a cause."""
    found = [f.confidence for f in workers.undecided]
    if evidence.get("sequence_samples_needed"):
        found.append(1.0 - float(evidence["sequence_p"]))
    return float(max(found, default=0.0))


def _sequence_undecided(evidence: dict, rules: CauseRules) -> bool:
    """A sequence signature short of significance (evidence sequence_samples_needed) whose fix would
    remove the share of the straggling time a sequence cause needs: the job cannot decide it."""
    explained = max(float(evidence.get("sequence_fix_explained") or 0.0), float(evidence.get("sequence_even_explained") or 0.0))
    return bool(evidence.get("sequence_samples_needed")) and explained >= rules.sequence_min_explained


def _undecided(workers: WorkerTests) -> bool:
    """Whether the worker test could not decide: an effect above the threshold within the job's
    jitter, or no test possible where peers exist but samples do not (one step, one microbatch)."""
    return not workers.decided


def _stands_out(values, factor: float = 2.0) -> bool:
    """The largest excess is at least `factor` times the next one (and positive)."""
    excess = sorted((max(float(v), 0.0) for v in values), reverse=True)
    return len(excess) >= 2 and excess[0] > 0 and excess[0] >= factor * excess[1]


def _comm_localised(model: JobModel, evidence: dict, alpha: float, factor: float = 2.0, floor: float = STRAGGLING_THRESHOLD) -> bool:
    """Whether the transfers beyond their own typical time (the median of the same op over steps
    and DP ranks) gather on one DP rank, stage or step (a bad link, a flapping switch), rather
    than spread over all of them (a busy machine's noise, collectives that vary by nature). A
    step, DP rank or stage counts only when its transfers slowed beyond its compute by `floor` (the
    straggling threshold; `_link_not_host`): a slow link slows transfers, not the compute around
    them; where both slow alike it is the host's (contention, a busy rank), not the network's. Recorded in evidence["comm_localised"]."""
    comm = np.flatnonzero(model.op_is_comm)
    if not len(comm):
        return False
    cost = model.original_cost[comm]
    excess = np.maximum(cost - median(cost, axis=1, keepdims=True), 0.0)
    _, step_index = np.unique(model.lane_step, return_inverse=True)
    per_lane = excess.sum(axis=0)
    per_step = np.bincount(step_index, per_lane)

    def beyond_compute() -> bool:
        """The hottest step's transfers beyond the other steps' spread (t against them, n_steps - 2
        degrees of freedom, Bonferroni over the steps, at alpha; three steps at least) and slowed
        beyond its compute by `floor`."""
        hot = int(np.argmax(per_step))
        compute = np.bincount(step_index, model.original_cost[np.isin(model.op_optype, (FORWARD, BACKWARD))].sum(axis=0))
        transfers = np.bincount(step_index, cost.sum(axis=0))
        others = np.delete(transfers, hot)
        if len(others) < 2:
            return False
        with np.errstate(divide="ignore", invalid="ignore"):
            slowed = (transfers[hot] / median(transfers)) / (compute[hot] / median(compute))
            spread = others.std(ddof=1) * math.sqrt(1.0 + 1.0 / len(others))
            p_value = min(1.0, len(transfers) * t_sf(float((transfers[hot] - others.mean()) / spread), len(others) - 1)) \
                if spread > 0 else float(transfers[hot] <= others.mean())
        return (not np.isfinite(slowed) or slowed >= floor) and p_value <= alpha

    per_dp = np.bincount(model.lane_dp, per_lane)
    per_stage = np.bincount(model.op_stage[comm], excess.sum(axis=1), minlength=model.pp_size)
    hot_dp, hot_stage = int(np.argmax(per_dp)), int(np.argmax(per_stage))
    found = (_stands_out(per_dp, factor) and _link_not_host(model, [(hot_dp, p) for p in range(model.pp_size)], floor, alpha, "dp")) \
        or (_stands_out(per_step, factor) and beyond_compute()) \
        or (model.pp_size > 1 and _stands_out(per_stage, factor)
            and _link_not_host(model, [(d, hot_stage) for d in range(model.dp_size)], floor, alpha, "stage"))
    evidence["comm_localised"] = bool(found)
    return bool(found)


def _link_not_host(model: JobModel, workers, floor: float, alpha: float, unit: str = "worker") -> bool:
    """Whether the workers' transfers are slow beyond the job's own spread and beyond their
    compute: a slow link or NIC slows a worker's transfers, not its compute.
    - significant: step by step, the transfer time of what is blamed over its peers' median (log
      ratio; seconds where some are not positive), beyond the job's own spread, in most steps or in
      named ones (`_transfers_stand_out`); on CPU ranks a few ms of gloo transfers vary by their
      size between ranks and steps. `unit` says what is blamed: "worker" (each against its stage's
      DP peers, running the same ops; the other stages without DP peers), "dp" (the DP rank's
      transfers over every stage against the other DP ranks') or "stage" (the stage's over every DP
      rank against the other stages');
    - not the host's: each worker's transfers slowed beyond its compute by `floor` (the straggling
      threshold), both against the median worker's; a worker whose compute is as much slower is
      a busy or slow host, whose collectives (CPU work on CPU ranks, late launches on GPUs) slow with it."""
    if not workers or model.n_steps < 2 or model.dp_size * model.pp_size < 2:
        return False
    comm = model.op_is_comm
    compute = np.isin(model.op_optype, (FORWARD, BACKWARD))
    shape = (model.n_steps, model.dp_size)

    def per_worker_step(ops) -> np.ndarray:   # [step, dp, pp] seconds
        out = np.zeros((model.n_steps, model.dp_size, model.pp_size))
        for p in range(model.pp_size):
            mine = ops & (model.op_stage == p)
            out[:, :, p] = model.original_cost[mine].sum(axis=0).reshape(shape)
        return out

    steps = per_worker_step(comm)
    transfers, work = steps.sum(axis=0), per_worker_step(compute).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        slowed = [(transfers[d, p] / median(transfers)) / (work[d, p] / median(work)) for d, p in workers]
    if not all(not np.isfinite(x) or x >= floor for x in slowed):
        return False
    if unit == "dp":
        groups, tested = steps.sum(axis=2)[:, None, :], sorted({d for d, _ in workers})            # [step, 1, dp]
    elif unit == "stage":
        groups, tested = steps.sum(axis=1)[:, None, :], sorted({p for _, p in workers})            # [step, 1, stage]
    elif model.dp_size > 1:
        groups, tested = np.swapaxes(steps, 1, 2), [p * model.dp_size + d for d, p in workers]     # [step, stage, dp]
    else:
        groups, tested = steps.reshape(model.n_steps, 1, -1), [p for _, p in workers]              # [step, 1, stage]
    if groups.shape[2] < 2:
        return False
    if (groups > 0).all():    # durations vary by factors: the log of each over its peers' median
        excess = np.log(groups) - np.log(peer_median(groups))
    else:                     # transfer times near zero, some negative (clock skew): seconds over it
        excess = groups - peer_median(groups)
    excess = excess.reshape(model.n_steps, -1)
    return all(_transfers_stand_out(excess, i, alpha) for i in tested)


def _transfers_stand_out(excess: np.ndarray, worker: int, alpha: float) -> bool:
    """Whether one worker's transfer excess ([step, worker], over its peers' median) is
    beyond the job's spread, as the worker test asks of compute: persistent (its mean over the
    steps against its own step-to-step spread, one-sided t, Bonferroni over the workers) or
    intermittent (a flapping link: one of its steps against the other workers' excesses over every
    step, Bonferroni over workers x steps), at `alpha`."""
    n_steps, n_workers = excess.shape
    mine = excess[:, worker]
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = mine.std(ddof=1) / math.sqrt(n_steps)
        if spread > 0 and n_workers * t_sf(float(mine.mean() / spread), n_steps - 1) <= alpha:
            return True
        others = np.delete(excess, worker, axis=1).ravel()
        if len(others) < 2:
            return False
        scale = others.std(ddof=1) * math.sqrt(1.0 + 1.0 / len(others))
        if not scale > 0:
            return bool((mine > others.max()).any())
        t = float((mine.max() - others.mean()) / scale)
    return n_workers * n_steps * t_sf(t, len(others) - 1) <= alpha


def _localised(result: WhatIfResult, evidence: dict, factor: float = 2.0) -> bool:
    """Whether the straggling stands out somewhere: the hottest DP rank, stage or step holds at
    least `factor` times the excess (S_g - 1) of the next one. Recorded in evidence["localised"]."""
    def stands_out(values) -> bool:
        return _stands_out([float(v) - 1.0 for v in values], factor)

    found = any(stands_out(group.values()) for group in (result.by_dp_rank or {}, result.by_stage or {})) \
        or stands_out(result.step_slowdown.tolist())
    evidence["localised"] = found
    return found


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
