"""What a compiled job's forward/backward pairs say before any fix is replayed: the worker test's
input and findings, GPU GC stalls, the peer comparison, chunk balance, and the sequence signature's
correlations with their p-values (`pair_signals`; `analyze_and_classify` computes them while the
analysis replays). Plain numpy over [op, lane] arrays."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from transforms.whatif.causes.pauses import find_pauses, idle_inside_compute, inside_compute
from transforms.whatif.causes.sequences import SequenceWorkload, at_mean_workload
from transforms.whatif.causes.signals import (ChunkBalance, GcStalls, PeerComparison, chunk_balance, gc_stalls, pairs, pearson,
                                              peer_comparison, take, within_group_normalised)
from transforms.whatif.causes.verdict import CauseRules
from transforms.whatif.causes.workers import WorkerTests, balance_tests, t_sf, worker_tests
from transforms.whatif.model import JobModel, distinct

__all__ = ["PairSignals", "pair_signals", "correlation_p", "sequence_tests", "sequence_p", "samples_to_decide", "workload_fit",
           "gc_signature", "gc_paused", "intermittent_steps"]


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
    workload_r: float = math.nan               # compute against the recorded workload (workload_fit)
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
    paused = (_untraced_inside_compute(model, rules) if model.dp_size > 1 else _recorded_inside_compute(model, rules)) \
        if model.meta.host_compute else None
    if paused is not None:   # the work a worker did, without the stretches inside its compute that ran none
        evidence["untraced_inside_compute"] = float(paused.sum())
    if len(forward):
        gc = gc_stalls(model, forward, backward, rules)
        _gc_evidence(model, forward, gc, evidence)
        if paused is None and model.dp_size > 1 and gc_signature(evidence, rules):
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
        # one DP rank per stage: a chunk's compute without the collections recorded inside it
        chunks = chunk_balance(model, forward, backward, model.original_cost - paused if model.dp_size == 1 and paused is not None
                               else None)
    else:
        evidence["gc_pauses"] = 0
    work = None if paused is None else model.original_cost - paused
    workload_r, workload_df = workload_fit(model, forward, backward, gc, workload)
    if model.dp_size > 1 and workload is not None and len(forward) and \
            sequence_p(sequence_tests(r_norm, r_norm_df, workload_r, workload_df)) <= rules.false_alarm:
        work = at_mean_workload(model, workload, work)
        evidence["worker_test_at_mean_workload"] = True
    workers = worker_tests(model, forward, backward, rules.false_alarm, rules.straggling, rules.peer_offset, work) \
        if model.dp_size > 1 else balance_tests(model, rules.false_alarm, rules.straggling, rules.peer_offset, work)
    evidence.update(workers.evidence())
    for finding in evidence["worker_test"]["undecided"]:   # the profiled steps' own numbers, as the step table shows them
        finding["step_numbers"] = [int(model.steps[i]) for i in finding["steps"]]
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


def _recorded_inside_compute(model: JobModel, rules: CauseRules) -> np.ndarray | None:
    """[op, lane] seconds of the collections the trainer recorded inside compute ops, in the
    worker-steps where they make a pause (`find_pauses`: the straggling threshold's share of a step;
    one DP rank per stage, CPU ranks): the collector's time, not the machine's, so the balance test
    and the chunks' balance measure the compute without it. Smaller collections stay, within the
    jitter the tests allow. Without the record nothing is taken out: no peer tells a stage's own
    idle stretches from a pause there, and its balance of backward to forward is read as it ran."""
    pauses = find_pauses(model, rules.false_alarm, rules.straggling)
    inside = inside_compute(model, pauses) if pauses.recorded else None
    if inside is None:
        return None
    cells = np.zeros_like(inside, dtype=bool)
    for d, p, step, _ in pauses.cells:
        cells[model.op_stage == p, step * model.dp_size + d] = True
    out = np.where(cells, inside, 0.0)
    return out if out.any() else None


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


def gc_signature(evidence: dict, rules: CauseRules) -> bool:
    """Forward-only pauses on at least two workers, none holding most of them (rotating, not a machine)."""
    return evidence["gc_pauses"] >= 2 and evidence["gc_workers"] >= 2 \
        and evidence["gc_max_worker_share"] <= rules.gc_max_worker_share \
        and evidence["gc_backward_outliers"] <= evidence["gc_pauses"] // 4


def gc_paused(model: JobModel, forward: np.ndarray, gc) -> np.ndarray | None:
    """[op, lane] mask of the forwards GC stalled (signals.gc_stalls): python-gc's to remove, not the
    worker's; None without stall signals."""
    if gc is None or not len(forward):
        return None
    out = np.zeros(model.original_cost.shape, dtype=bool)
    rows, lanes = np.nonzero(gc.pauses)
    out[forward[rows, lanes], lanes] = True
    return out


def intermittent_steps(workers: WorkerTests) -> dict[tuple[int, int, str], tuple[int, ...]]:
    """(dp, stage, kind) -> the steps of each intermittent finding, for workers with no persistent
    one: what their fix brings back to their peers' pace."""
    persistent = {f.worker for f in workers.slow if f.persistent}
    out: dict[tuple[int, int, str], set[int]] = {}
    for f in workers.slow:
        if f.worker not in persistent:
            out.setdefault((*f.worker, f.kind), set()).update(f.steps)
    return {key: tuple(sorted(steps)) for key, steps in out.items()}


def workload_fit(model: JobModel, forward: np.ndarray, backward: np.ndarray, gc: GcStalls | None,
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


def sequence_tests(r_norm: float, r_norm_df: int, workload_r: float, workload_df: int) -> list[tuple[float, int]]:
    """(r, degrees of freedom) of the sequence signature's correlations the trace supports:
    forward against backward of the same microbatch, compute against the tokens it recorded."""
    return [(r, df) for r, df in ((r_norm, r_norm_df), (workload_r, workload_df)) if math.isfinite(r) and df >= 1]


def sequence_p(tests: list[tuple[float, int]]) -> float:
    """p-value that compute follows the data: each test's one-sided p (`correlation_p`), the
    smallest times their number (Bonferroni)."""
    p_values = [correlation_p(r, df) for r, df in tests]
    return min(1.0, len(p_values) * min(p_values)) if p_values else 1.0


def samples_to_decide(r: float, df: int, alpha: float, tests: int = 1) -> int | None:
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
