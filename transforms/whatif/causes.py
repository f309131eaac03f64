"""Root causes of a straggling job (METHOD.md section 5), and what fixing each would save.

Plain numpy, no Beam. In: a compiled JobModel, its WhatIfResult (with attribution: S >=
1.03) and, when the trainer recorded them, the per-microbatch document lengths. Out: a
`Verdict`: the primary cause, every detected cause (strongest first), the evidence
(metric values), a confidence per cause, the workers blamed, and per cause the what-if
replay of its fix (step time, S after the fix, share of GPU time saved).

Every fix is a scenario of the engine's batched replay (one pass for all of them), so
"explained" below always means: the share of the gap T - T_ideal that disappears when
only that fix is applied to the no-delay trace.

Causes and their detectors
- individual-worker: M_W > 0.5 (the ceil(3%) workers with the highest S_w explain most
  of the gap; the machines blamed are those of the set at least half as hot, in S_w - 1,
  as the hottest). Fix: those workers' compute back at ideal speed (a replaced machine). When
  idealising the workers' communication explains more than their compute, the verdict
  is communication instead (a bad link on that machine, not a slow GPU).
- stage-imbalance: M_S >= 0.5 (the last stage explains the gap), the heatmap's last row is
  hot as a whole (min / max of S_w - 1 over the last stage's workers >= 0.5, so one slow
  machine in the last stage is not a stage problem) and the fix explains at least
  `stage_min_explained` (a flapping link or GC on the last stage is not fixed by moving
  layers). With one DP rank the M_W set is the last stage itself: then the stage verdict
  wins over individual-worker. Fix: *rebalanced stages*: every model chunk's forward (and
  backward) compute scaled to the mean over chunks, i.e. layers moved off the heavy (loss)
  chunk, keeping per-op variation.
- sequence-imbalance: microbatches differ in work, so the forward and backward of the
  same microbatch are slow together. Signal: Pearson r of forward vs backward duration
  of the same microbatch >= 0.9. We compute r on durations normalised within each
  (step, worker, chunk): persistent worker and stage differences then cancel, so r stays
  meaningful in jobs that also have a slow worker or a heavy last stage (the paper rules
  those out first; we report its raw r too). With `seq_lens`: the workload of a
  microbatch is the sum of squared document lengths, the WLB-LLM imbalance degree is
  max / mean workload over a step's microbatches (all DP ranks). Fix: with seq_lens,
  greedy rebalancing of the step's documents across every DP rank's microbatches
  (longest first into the lightest microbatch with room, token capacity = the largest
  observed microbatch), durations rescaled by a per-chunk linear cost model fitted on
  (workload, duration). Detected when r >= 0.9 and spreading each step's compute evenly
  over its microbatches and DP ranks (keeping each worker's persistent speed) explains at
  least `sequence_min_explained` of the gap; that even spread is also the fix estimate when no
  seq_lens exist (an upper bound: one huge document cannot be split by repacking).
- python-gc: a GC pause stalls one forward compute for hundreds of ms on whichever
  worker's collector runs, a different one each time. Detector: for every (worker, step,
  chunk, microbatch), the forward duration expected from its own backward (forward /
  backward ratio is stable per chunk, also under sequence imbalance or a slow worker:
  both move together) is `ratio_median x backward`; the stall is the observed forward
  minus that. A stall is a pause when it exceeds both `gc_min_stall` seconds and
  `gc_sigma` robust standard deviations (MAD) of all stalls of that chunk. GC when
  pauses hit at least two workers, no worker holds more than `gc_max_worker_share` of
  them (rotating, not a broken machine), the backward computes show no such outliers
  (forward-only), and removing the pauses explains at least `gc_min_explained` of the gap.
  Fix: *planned GC*: pauses removed from the replay (with their echo in batched pipeline
  transfers of the same lane, see _without_pauses), then the same collection work paid
  synchronously by every worker at once, i.e. the mean per-worker pause time per step
  added to the step time.
- communication: comm op types dominate the optype attribution: the comm groups' share of
  sum(max(S_t - 1, 0)) >= 0.5. Fix: every communication op at its ideal transfer time.
- unexplained: S >= 1.1 and none of the above detected.

Mixtures: next to a dominant cause, another cause's share of the whole gap can fall under
its threshold. Stage (M_S) and GC are therefore re-tested on the trace with the causes
already detected fixed (their fix scenarios composed), as a share of the gap that remains
(evidence m_s_given_other_fixes, gc_explained_given_other_fixes), when what remains is
still a slowdown worth a verdict (S >= 1.05 after those fixes).

Confidence: 0.5 at a detector's threshold rising linearly to 1 at a clear margin, the
minimum over the detector's conditions; "unexplained" gets 1 - the largest share any
undetected fix explains.
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import math
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa

from schemas.trace import OPTYPES
from schemas.fleet import JOB_CAUSE_SCHEMA
from transforms.whatif.metrics import analyze_model, worker_set_mask
from transforms.whatif.model import JobModel, compile_job
from transforms.whatif.replay import Mix, Scenario, replay
from transforms.whatif.result import STRAGGLING_THRESHOLD, JobMeta, WhatIfResult

__all__ = [
    "CauseRules",
    "Fix",
    "Verdict",
    "SequenceWorkload",
    "CauseError",
    "classify",
    "sequence_workload",
    "greedy_rebalance",
    "imbalance_degree",
    "verdict_row",
    "job_cause_table",
    "analyze_and_classify",
    "COMPUTE_GROUPS",
]

_FORWARD, _BACKWARD = OPTYPES.index("forward-compute"), OPTYPES.index("backward-compute")
_P2P = tuple(OPTYPES.index(name) for name in ("forward-send", "forward-recv", "backward-send", "backward-recv"))
# Attribution groups that are not communication (WhatIfResult.by_optype keys).
COMPUTE_GROUPS = frozenset({"forward-compute", "backward-compute", "optimizer", "gc"})


class CauseError(ValueError):
    """The inputs of the root-cause analysis do not fit together (names the job)."""


@dataclasses.dataclass(frozen=True)
class CauseRules:
    """Thresholds of the detectors (see module docstring); seconds where noted."""

    straggling: float = STRAGGLING_THRESHOLD
    worker_mw: float = 0.5
    stage_ms: float = 0.5
    sequence_r: float = 0.9
    comm_share: float = 0.5
    min_explained: float = 0.25          # worker, communication: share of T - T_ideal their fix must remove
    stage_min_explained: float = 0.1     # the rebalancing fix (lower: it only approximates a repartition)
    stage_row_uniformity: float = 0.5    # min / max of (S_w - 1) over the last stage's workers (dp >= 2)
    sequence_min_explained: float = 0.15
    gc_min_explained: float = 0.1        # the pause signature itself is specific; mixtures leave GC a small share
    gc_min_stall: float = 0.05          # seconds
    gc_sigma: float = 8.0
    gc_max_worker_share: float = 0.8

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CauseRules.{field.name} must be a finite number >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Fix:
    """What-if replay of one cause's fix.

    step_time: mean step time after the fix (s); fixed_slowdown: S after the fix;
    explained: share of T - T_ideal the fix removes; savings_fraction: 1 - T_fix / T, the
    share of the job's GPU-hours the fix would save.
    """

    cause: str
    step_time: float
    fixed_slowdown: float
    explained: float
    savings_fraction: float


@dataclasses.dataclass
class Verdict:
    """Root-cause verdict of one job window (see module docstring)."""

    job_id: str
    slowdown: float
    cause: str                                   # primary: schemas.fleet.CAUSES
    causes: list[str]                            # detected, strongest (most explained) first
    confidence: float
    confidences: dict[str, float]
    evidence: dict[str, object]
    implicated_workers: list[tuple[int, int]]    # (dp_rank, stage) whose machine is blamed (worker / located link)
    fixes: dict[str, Fix]

    @property
    def straggling(self) -> bool:
        return self.cause != "none"

    @property
    def primary_fix(self) -> Fix | None:
        return self.fixes.get(self.cause)

    def savings_gpu_hours(self, gpu_hours: float) -> float:
        """GPU-hours the fix of the primary cause saves on a window of `gpu_hours`."""
        fix = self.primary_fix
        return float(gpu_hours * max(fix.savings_fraction, 0.0)) if fix else 0.0


@dataclasses.dataclass(frozen=True)
class SequenceWorkload:
    """Document lengths per microbatch and the workload of every compute op.

    lengths: (step index, dp_rank, mb_id) -> document lengths (tokens);
    op_workload: [n_ops, n_lanes] sum of squared lengths of the op's microbatch
    (NaN for non-compute ops).
    """

    lengths: dict[tuple[int, int, int], np.ndarray]
    op_workload: np.ndarray


# ---------------------------------------------------------------------------
# Sequence workload


def sequence_workload(trace: pa.Table, model: JobModel) -> SequenceWorkload | None:
    """Workloads from the trace's `seq_lens` column, aligned with the model; None when absent or empty."""
    if "seq_lens" not in trace.column_names:
        return None
    # lengths are per (step, dp_rank, microbatch): one stage's forward rows of one chunk carry them all
    forward = pa.compute.equal(pa.compute.cast(trace["optype"], pa.string()), "forward-compute")
    first = pa.compute.and_(pa.compute.equal(trace["stage"], 0), pa.compute.equal(trace["mc"], 0))
    compute = trace.filter(pa.compute.and_(pa.compute.and_(forward, first), pa.compute.is_valid(trace["seq_lens"])))
    if compute.num_rows == 0:
        compute = trace.filter(pa.compute.is_valid(trace["seq_lens"]))
    if compute.num_rows == 0:
        return None
    steps = compute["step"].to_numpy()
    dp = compute["dp_rank"].to_numpy().astype(np.int64)
    mb = compute["mb_id"].to_numpy().astype(np.int64)
    step_index = np.searchsorted(model.steps, steps)
    known = (step_index < len(model.steps)) & (model.steps[np.minimum(step_index, len(model.steps) - 1)] == steps)
    lengths: dict[tuple[int, int, int], np.ndarray] = {}
    lists = compute["seq_lens"].to_pylist()
    for row in np.flatnonzero(known):
        key = (int(step_index[row]), int(dp[row]), int(mb[row]))
        if key not in lengths:
            lengths[key] = np.asarray(lists[row], dtype=np.float64)
    if not lengths:
        return None
    n_mb = int(max(k[2] for k in lengths)) + 1
    table = np.full((model.n_steps, model.dp_size, n_mb), np.nan)
    for (s, d, m), values in lengths.items():
        table[s, d, m] = float(np.sum(values * values))
    lane_step_index = np.searchsorted(model.steps, model.lane_step)
    mb_ids = model.mb_id
    valid = (mb_ids >= 0) & (mb_ids < n_mb)
    op_workload = np.full(mb_ids.shape, np.nan)
    lanes = np.broadcast_to(np.arange(model.n_lanes)[None, :], mb_ids.shape)
    op_workload[valid] = table[lane_step_index[lanes[valid]], model.lane_dp[lanes[valid]], mb_ids[valid]]
    return SequenceWorkload(lengths, op_workload)


def imbalance_degree(workloads: np.ndarray) -> float:
    """WLB-LLM imbalance degree: max / mean workload over one step's microbatches (1.0 = balanced)."""
    workloads = np.asarray(workloads, dtype=np.float64)
    workloads = workloads[np.isfinite(workloads)]
    return float(workloads.max() / workloads.mean()) if len(workloads) and workloads.mean() > 0 else math.nan


def greedy_rebalance(documents: Sequence[np.ndarray], capacity: float | None = None) -> list[np.ndarray]:
    """Repack the documents of len(documents) microbatches: longest first into the microbatch
    with the smallest sum of squared lengths that still has `capacity` tokens of room (the
    lightest overall when none has). Returns the new documents of each microbatch.

    capacity: tokens per microbatch (default: the largest microbatch given)."""
    bins = len(documents)
    every = np.concatenate([np.asarray(d, dtype=np.float64) for d in documents]) if bins else np.zeros(0)
    capacity = float(max((np.sum(d) for d in documents), default=0.0)) if capacity is None else float(capacity)
    loads = [0.0] * bins
    tokens = [0.0] * bins
    by_load = [(0.0, b) for b in range(bins)]       # lightest on top; an entry is stale once its bin changed
    by_room = [(-capacity, b) for b in range(bins)]  # most room on top (key tokens - capacity), stale likewise
    out: list[list[float]] = [[] for _ in range(bins)]
    limit = capacity + 1e-9
    pop, push = heapq.heappop, heapq.heappush
    for length in np.sort(every)[::-1].tolist():
        target = -1
        tried = []
        # the lightest few bins first; then the roomiest; with room nowhere, the lightest
        while len(tried) < 8 and by_load:
            key, b = pop(by_load)
            if key != loads[b]:
                continue
            tried.append((key, b))
            if tokens[b] + length <= limit:
                target = b
                break
        if target < 0:
            while by_room:
                key, b = by_room[0]
                if key == tokens[b] - capacity:
                    if tokens[b] + length <= limit:
                        target = b
                    break
                pop(by_room)
        if target < 0:
            target = tried[0][1]
        for entry in tried:
            if entry[1] != target:
                push(by_load, entry)
        out[target].append(length)
        tokens[target] += length
        loads[target] += length * length
        push(by_load, (loads[target], target))
        push(by_room, (tokens[target] - capacity, target))
    return [np.asarray(b) for b in out]


# ---------------------------------------------------------------------------
# Signals


def _pairs(model: JobModel) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward op indices of the same (stage, chunk, microbatch), per lane.

    Returns two [n_pairs, n_lanes] op-index arrays (row k of both = one microbatch).
    """
    forward = np.flatnonzero(model.op_optype == _FORWARD)
    backward = np.flatnonzero(model.op_optype == _BACKWARD)
    if len(forward) != len(backward) or not len(forward):
        return np.zeros((0, model.n_lanes), np.int64), np.zeros((0, model.n_lanes), np.int64)
    chunks = int(model.op_gmc.max()) + 2

    def keyed(ops):
        key = (model.op_stage[ops, None].astype(np.int64) * chunks + model.op_gmc[ops, None]) * (1 << 20) + model.mb_id[ops]
        order = np.argsort(key, axis=0, kind="stable")
        return ops[order], np.take_along_axis(key, order, axis=0)

    f_ops, f_key = keyed(forward)
    b_ops, b_key = keyed(backward)
    if not np.array_equal(f_key, b_key):
        return np.zeros((0, model.n_lanes), np.int64), np.zeros((0, model.n_lanes), np.int64)
    return f_ops, b_ops


def _take(values: np.ndarray, ops: np.ndarray) -> np.ndarray:
    """values[op, lane] gathered at ops[k, lane]."""
    return np.take_along_axis(values, ops, axis=0)


def _within_group_normalised(values: np.ndarray, group: np.ndarray) -> np.ndarray:
    """values / mean of values with the same group id in the same lane ([k, lane] arrays)."""
    out = np.empty_like(values)
    for g in np.unique(group[:, 0]):
        rows = group[:, 0] == g
        block = values[rows]
        out[rows] = block / block.mean(axis=0, keepdims=True)
    return out


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def _margin(value: float, threshold: float, clear: float) -> float:
    """Confidence 0.5 at the threshold, 1.0 at `clear`, linear between (clipped)."""
    if not math.isfinite(value):
        return 0.0
    if clear == threshold:
        return 1.0 if value >= threshold else 0.0
    return float(np.clip(0.5 + 0.5 * (value - threshold) / (clear - threshold), 0.0, 1.0))


def _gc_stalls(model: JobModel, forward: np.ndarray, backward: np.ndarray, rules: CauseRules):
    """(stall seconds [k, lane], pause mask [k, lane], expected forward [k, lane], backward outliers) of each pair."""
    f = _take(model.original_cost, forward)
    b = _take(model.original_cost, backward)
    chunk = model.op_stage[forward] * (int(model.op_gmc.max()) + 2) + model.op_gmc[forward]
    expected = np.empty_like(f)
    pauses = np.zeros(f.shape, dtype=bool)
    stall = np.empty_like(f)
    backward_outliers = 0
    for g in np.unique(chunk[:, 0]):
        rows = chunk[:, 0] == g
        ratio = np.median(f[rows] / b[rows])
        expected[rows] = ratio * b[rows]
        stall[rows] = f[rows] - expected[rows]
        sigma = 1.4826 * np.median(np.abs(stall[rows] - np.median(stall[rows])))
        limit = max(rules.gc_min_stall, rules.gc_sigma * sigma)
        pauses[rows] = stall[rows] > limit
        # the mirror test on backward: a stall there would not be GC's forward-only signature
        backward_outliers += int(((b[rows] - f[rows] / ratio) > limit).sum())
    return stall, pauses, expected, backward_outliers


# ---------------------------------------------------------------------------
# Fix scenarios


def _without_pauses(model: JobModel, forward: np.ndarray, pauses: np.ndarray, expected: np.ndarray,
                    rules: CauseRules) -> np.ndarray:
    """Cost with every detected pause removed, and its echo in pipeline transfers.

    With batched send+recv (interleaved schedules), a record waits for its partner's peer,
    so a stalled forward also inflates transfer times along the pipeline of that lane; in
    lanes with a pause, p2p transfers longer than their type's median by more than
    gc_min_stall go back to the median."""
    cost = model.original_cost.copy()
    rows, lanes = np.nonzero(pauses)
    cost[forward[rows, lanes], lanes] = expected[rows, lanes]
    paused_lanes = np.unique(lanes)
    for code in _P2P:
        ops = np.flatnonzero(model.op_optype == code)
        if not len(ops) or not len(paused_lanes):
            continue
        median = float(np.median(cost[ops]))
        block = cost[np.ix_(ops, paused_lanes)]
        cost[np.ix_(ops, paused_lanes)] = np.where(block > median + rules.gc_min_stall, median, block)
    return cost


def _compose(base: np.ndarray, fixes: Sequence[np.ndarray], reference: np.ndarray | None = None) -> np.ndarray:
    """base with every cost a fix changed (relative to `reference`, default base) taken from that fix;
    where two fixes change the same op, the later one wins."""
    reference = base if reference is None else reference
    out = base.copy()
    for cost in fixes:
        changed = cost != reference
        out[changed] = cost[changed]
    return out


def _rebalanced_stages(model: JobModel) -> np.ndarray:
    """Compute cost with every chunk's mean forward (backward) duration set to the mean over chunks."""
    cost = model.original_cost.copy()
    for code in (_FORWARD, _BACKWARD):
        ops = np.flatnonzero(model.op_optype == code)
        chunks = model.op_gmc[ops]
        means = {int(g): cost[ops[chunks == g]].mean() for g in np.unique(chunks)}
        target = float(np.mean(list(means.values())))
        for g, mean in means.items():
            if mean > 0:
                cost[ops[chunks == g]] *= target / mean
    return cost


def _even_sequences(model: JobModel) -> np.ndarray:
    """Compute cost with each step's work spread evenly over microbatches and DP ranks of a chunk,
    keeping each worker's persistent speed (no seq_lens: an upper bound of rebalancing)."""
    cost = model.original_cost.copy()
    step_of_lane = np.searchsorted(model.steps, model.lane_step)
    for code in (_FORWARD, _BACKWARD):
        ops = np.flatnonzero(model.op_optype == code)
        for g in np.unique(model.op_gmc[ops]):
            rows = ops[model.op_gmc[ops] == g]
            block = cost[rows]                                       # [mb, lane]
            per_dp = np.array([block[:, model.lane_dp == d].mean() for d in range(model.dp_size)])
            worker = per_dp / per_dp.mean()                          # persistent speed of each DP rank here
            normalised = block / worker[model.lane_dp][None, :]
            step_mean = np.zeros(model.n_steps)
            np.add.at(step_mean, step_of_lane, normalised.sum(axis=0))
            step_mean /= block.shape[0] * model.dp_size
            cost[rows] = step_mean[step_of_lane][None, :] * worker[model.lane_dp][None, :]
    return cost


def _greedy_sequences(model: JobModel, workload: SequenceWorkload) -> tuple[np.ndarray, dict]:
    """Compute cost after greedy document rebalancing across DP ranks, with the fitted cost model."""
    cost = model.original_cost.copy()
    new_workload = np.full_like(workload.op_workload, np.nan)
    by_step: dict[int, list[tuple[int, int]]] = {}
    for (s, d, m) in workload.lengths:
        by_step.setdefault(s, []).append((d, m))
    before, after = [], []
    n_mb = int(max(m for _, _, m in workload.lengths)) + 1
    table_new = np.full((model.n_steps, model.dp_size, n_mb), np.nan)
    for s, slots in sorted(by_step.items()):
        slots.sort()
        documents = [workload.lengths[(s, d, m)] for d, m in slots]
        old = np.array([x @ x for x in documents])
        packed = greedy_rebalance(documents)
        new = np.sort(np.array([x @ x for x in packed]))[::-1]
        # heaviest new microbatch where the heaviest old one was: keeps the schedule's order of work
        placed = np.empty_like(new)
        placed[np.argsort(-old, kind="stable")] = new
        before.append(imbalance_degree(old))
        after.append(imbalance_degree(placed))
        for (d, m), value in zip(slots, placed):
            table_new[s, d, m] = value
    lane_step_index = np.searchsorted(model.steps, model.lane_step)
    compute = np.isin(model.op_optype, (_FORWARD, _BACKWARD))
    ops, lanes = np.nonzero(compute[:, None] & np.isfinite(workload.op_workload))
    new_workload[ops, lanes] = table_new[lane_step_index[lanes], model.lane_dp[lanes], model.mb_id[ops, lanes]]
    fits = {}
    for code in (_FORWARD, _BACKWARD):
        for g in np.unique(model.op_gmc[model.op_optype == code]):
            rows = np.flatnonzero((model.op_optype == code) & (model.op_gmc == g))
            w, y = workload.op_workload[rows].ravel(), cost[rows].ravel()
            keep = np.isfinite(w)
            if keep.sum() < 3 or np.ptp(w[keep]) == 0:
                continue
            slope, intercept = np.polyfit(w[keep], y[keep], 1)
            old_model = intercept + slope * workload.op_workload[rows]
            new_model = intercept + slope * new_workload[rows]
            factor = np.where(np.isfinite(new_model) & (old_model > 0), new_model / old_model, 1.0)
            cost[rows] *= np.clip(factor, 0.05, 20.0)
            fits[f"{OPTYPES[code]}:{int(g)}"] = (float(slope), float(intercept))
    evidence = {"imbalance_degree": float(np.nanmean(before)), "imbalance_degree_rebalanced": float(np.nanmean(after))}
    return cost, evidence


# ---------------------------------------------------------------------------
# The verdict


def classify(model: JobModel, result: WhatIfResult, *, workload: SequenceWorkload | None = None,
             rules: CauseRules = CauseRules()) -> Verdict:
    """Root-cause verdict of one analysed job (see module docstring).

    model: the compiled job (transforms.whatif.compile_job); result: analyze_model(model)
    (attribution needed when S >= 1.03); workload: sequence_workload(trace, model) or None.
    Jobs with S below rules.straggling get cause "none" (evidence and fixes still computed
    when attribution exists). Raises CauseError when model and result are of different jobs.
    """
    if result.job_id != model.job_id or len(result.steps) != model.n_steps:
        raise CauseError(f"job {model.job_id!r}: result of job {result.job_id!r} with {len(result.steps)} steps "
                         f"does not belong to this model ({model.n_steps} steps)")
    evidence: dict[str, object] = {"slowdown": float(result.slowdown), "launch_slowdown": float(result.launch_slowdown)}
    tori, tideal = float(result.step_t_nodelay.mean()), float(result.step_t_noblk.mean())
    gap = tori - tideal
    attributed = result.by_optype is not None and result.mw is not None
    if not attributed or gap <= 0:
        evidence["attributed"] = False
        return Verdict(model.job_id, float(result.slowdown), "none" if result.slowdown < rules.straggling else "unexplained",
                       [], 1.0, {}, evidence, [], {})

    ideal = model.ideal_cost()[:, None]
    original = model.original_cost
    compute_ops = np.isin(model.op_optype, (_FORWARD, _BACKWARD))
    w_mask = worker_set_mask(model, result.mw.workers)
    forward, backward = _pairs(model)

    # signals -----------------------------------------------------------------
    mw, ms = float(result.mw.rem), float(result.ms.rem) if result.ms is not None else 0.0
    evidence.update(m_w=mw, m_s=ms, m_w_workers=[list(w) for w in result.mw.workers])
    excess = {name: max(value - 1.0, 0.0) for name, value in result.by_optype.items()}
    total_excess = sum(excess.values())
    comm_excess = sum(v for k, v in excess.items() if k not in COMPUTE_GROUPS)
    comm_share = comm_excess / total_excess if total_excess > 0 else 0.0
    top_comm = max((k for k in excess if k not in COMPUTE_GROUPS), key=lambda k: excess[k], default=None)
    evidence.update(comm_share=comm_share, top_comm_optype=top_comm)

    r_raw = r_norm = math.nan
    stall = pauses = expected = None
    if len(forward):
        f = _take(original, forward)
        b = _take(original, backward)
        r_raw = _pearson(f, b)
        chunk = model.op_stage[forward] * (int(model.op_gmc.max()) + 2) + model.op_gmc[forward]
        stall, pauses, expected, backward_outliers = _gc_stalls(model, forward, backward, rules)
        keep = ~pauses
        r_norm = _pearson(_within_group_normalised(f, chunk)[keep], _within_group_normalised(b, chunk)[keep]) \
            if forward.shape[0] > model.pp_size * max(model.vpp_size, 1) else math.nan
        evidence.update(forward_backward_r=r_raw, forward_backward_r_normalised=r_norm)
    sequence_evidence = {}

    # fix scenarios -------------------------------------------------------------
    fix_costs = {   # full cost arrays of each cause's fix, to compose them for mixtures below
        "individual-worker": np.where(w_mask & compute_ops[:, None], ideal, original),
        "stage-imbalance": _rebalanced_stages(model),
        "communication": np.where(model.op_is_comm[:, None], ideal, original),
    }
    scenarios = [
        Scenario("worker-compute", fix_costs["individual-worker"]),
        Scenario("worker-comm", Mix(original, ideal, w_mask & model.op_is_comm[:, None])),
        Scenario("stage", fix_costs["stage-imbalance"]),
        Scenario("communication", fix_costs["communication"]),
    ]
    if len(forward):
        # even spread: how much of the gap microbatch imbalance causes (detection);
        # greedy repacking of the real documents: what a data-loader fix would save
        fix_costs["sequence-imbalance"] = _even_sequences(model)
        scenarios.append(Scenario("sequence", fix_costs["sequence-imbalance"]))
        if workload is not None:
            greedy_cost, sequence_evidence = _greedy_sequences(model, workload)
            evidence.update(sequence_evidence)
            w = _take(workload.op_workload, forward)
            evidence["workload_forward_r"] = _pearson(w, _take(original, forward))
            scenarios.append(Scenario("sequence-greedy", greedy_cost))
        fix_costs["python-gc"] = _without_pauses(model, forward, pauses, expected, rules)
        scenarios.append(Scenario("gc", fix_costs["python-gc"]))
    fixed = replay(model, scenarios)
    step_time = {name: float(fixed.span(name).mean()) for name in fixed.names}

    # planned GC pays each worker's collection time once per step, all workers together
    if pauses is not None and pauses.any():
        worker_key = model.lane_dp[None, :] * model.pp_size + model.op_stage[forward]
        pause_time = np.where(pauses, stall, 0.0)
        per_worker = np.bincount(worker_key.ravel(), weights=pause_time.ravel(), minlength=model.dp_size * model.pp_size)
        planned = float(per_worker.mean() / model.n_steps)
        step_time["gc-planned"] = step_time["gc"] + planned
        flagged_workers = worker_key[pauses]
        counts = np.bincount(flagged_workers, minlength=model.dp_size * model.pp_size)
        steps_hit = np.unique(model.lane_step[np.nonzero(pauses)[1]])
        evidence.update(gc_pauses=int(pauses.sum()), gc_workers=int((counts > 0).sum()),
                        gc_max_worker_share=float(counts.max() / counts.sum()), gc_steps=int(len(steps_hit)),
                        gc_mean_pause=float(stall[pauses].mean()), gc_backward_outliers=int(backward_outliers))
    else:
        evidence.update(gc_pauses=0)

    def explained(name: str) -> float:
        return (tori - step_time[name]) / gap

    def make_fix(cause: str, scenario: str, paid: str | None = None) -> Fix:
        t = step_time[paid or scenario]
        return Fix(cause, t, float(result.slowdown) * t / tori, explained(scenario), 1.0 - t / tori)

    # detectors ---------------------------------------------------------------
    detected: dict[str, float] = {}     # cause -> confidence
    fixes: dict[str, Fix] = {}
    implicated: list[tuple[int, int]] = []
    rules_min = rules.min_explained

    worker_compute, worker_comm = explained("worker-compute"), explained("worker-comm")
    evidence.update(worker_compute_explained=worker_compute, worker_comm_explained=worker_comm)
    if mw > rules.worker_mw:
        # the M_W set has ceil(3%) members; blame only those as hot as half the hottest
        hottest = max(result.worker_slowdown[d, p] for d, p in result.mw.workers) - 1.0
        blamed = [(d, p) for d, p in result.mw.workers if result.worker_slowdown[d, p] - 1.0 >= 0.5 * hottest]
        if worker_compute >= worker_comm:
            fixes["individual-worker"] = make_fix("individual-worker", "worker-compute")
            detected["individual-worker"] = min(_margin(mw, rules.worker_mw, 0.9), _margin(worker_compute, rules_min, 0.6))
        else:
            fixes["communication"] = make_fix("communication", "worker-comm")
            detected["communication"] = min(_margin(mw, rules.worker_mw, 0.9), _margin(worker_comm, rules_min, 0.6))
        implicated = blamed
    fixes.setdefault("individual-worker", make_fix("individual-worker", "worker-compute"))

    stage_fix = make_fix("stage-imbalance", "stage")
    fixes["stage-imbalance"] = stage_fix
    evidence["stage_fix_explained"] = stage_fix.explained
    # a hot last-stage *row*: every DP rank's last-stage worker slow, not one machine in it
    row = result.worker_slowdown[:, model.pp_size - 1] - 1.0
    uniformity = float(row.min() / row.max()) if model.dp_size > 1 and row.max() > 0 else 1.0
    evidence["last_stage_uniformity"] = uniformity
    if model.pp_size > 1 and ms >= rules.stage_ms and stage_fix.explained >= rules.stage_min_explained \
            and uniformity >= rules.stage_row_uniformity:
        detected["stage-imbalance"] = min(_margin(ms, rules.stage_ms, 0.8), _margin(uniformity, rules.stage_row_uniformity, 0.8))
        if model.dp_size == 1 and "individual-worker" in detected and all(p == model.pp_size - 1 for _, p in result.mw.workers):
            # one DP rank: the M_W set is the last stage itself; the far more common stage cause wins
            del detected["individual-worker"]
            implicated = []
            evidence["worker_set_is_last_stage"] = True

    comm_fix = make_fix("communication", "communication")
    evidence["communication_fix_explained"] = comm_fix.explained
    if "communication" not in detected:
        fixes["communication"] = comm_fix
        if comm_share >= rules.comm_share and comm_fix.explained >= rules_min:
            detected["communication"] = min(_margin(comm_share, rules.comm_share, 0.9), _margin(comm_fix.explained, rules_min, 0.6))

    if "sequence" in step_time:
        even = explained("sequence")
        seq_fix = make_fix("sequence-imbalance", "sequence-greedy" if "sequence-greedy" in step_time else "sequence")
        fixes["sequence-imbalance"] = seq_fix
        evidence["sequence_even_explained"] = even
        evidence["sequence_fix_explained"] = seq_fix.explained
        if r_norm >= rules.sequence_r and even >= rules.sequence_min_explained:
            detected["sequence-imbalance"] = min(_margin(r_norm, rules.sequence_r, 0.97), _margin(even, rules.sequence_min_explained, 0.5))
    if "gc" in step_time:
        gc_fix = make_fix("python-gc", "gc", "gc-planned" if "gc-planned" in step_time else None)
        fixes["python-gc"] = gc_fix
        evidence["gc_fix_explained"] = gc_fix.explained
        gc_signature = evidence["gc_pauses"] >= 2 and evidence["gc_workers"] >= 2 \
            and evidence["gc_max_worker_share"] <= rules.gc_max_worker_share \
            and evidence["gc_backward_outliers"] <= evidence["gc_pauses"] // 4
        if gc_signature and gc_fix.explained >= rules.gc_min_explained:
            detected["python-gc"] = min(_margin(float(evidence["gc_workers"]), 2, 4),
                                        _margin(gc_fix.explained, rules.gc_min_explained, 0.4))

    # Mixtures: next to a dominant cause, another one's share of the whole gap can fall under
    # its threshold. Re-test stage (M_S) and GC (removed pauses) on the trace with the causes
    # already found fixed, i.e. as a share of the gap that remains.
    pending = []
    if model.pp_size > 1 and "stage-imbalance" not in detected and uniformity >= rules.stage_row_uniformity \
            and stage_fix.explained >= rules.stage_min_explained:
        pending.append("stage-imbalance")
    if "python-gc" in fix_costs and "python-gc" not in detected and gc_signature:
        pending.append("python-gc")
    if detected and pending:
        base = _compose(original, [fix_costs[c] for c in sorted(detected) if c in fix_costs])
        extra = [Scenario("base", base)]
        if "stage-imbalance" in pending:
            last_stage = worker_set_mask(model, [(d, model.pp_size - 1) for d in range(model.dp_size)])
            extra.append(Scenario("base-stage", Mix(base, ideal, last_stage)))
        if "python-gc" in pending:
            extra.append(Scenario("base-gc", _compose(base, [fix_costs["python-gc"]], reference=original)))
        again = replay(model, extra)
        remaining = float(again.span("base").mean()) - tideal
        # only a remaining slowdown worth a verdict: half the straggling margin (S 1.05 by default)
        remaining_slowdown = float(result.slowdown) * float(again.span("base").mean()) / tori
        evidence["slowdown_given_other_fixes"] = remaining_slowdown
        if remaining_slowdown < 1.0 + 0.5 * (rules.straggling - 1.0):
            remaining = 0.0
        if remaining > 0 and "stage-imbalance" in pending:
            conditional = (float(again.span("base").mean()) - float(again.span("base-stage").mean())) / remaining
            evidence["m_s_given_other_fixes"] = conditional
            if conditional >= rules.stage_ms:
                detected["stage-imbalance"] = min(_margin(conditional, rules.stage_ms, 0.8), _margin(uniformity, rules.stage_row_uniformity, 0.8))
        if remaining > 0 and "python-gc" in pending:
            conditional = (float(again.span("base").mean()) - float(again.span("base-gc").mean())) / remaining
            evidence["gc_explained_given_other_fixes"] = conditional
            if conditional >= rules.gc_min_explained:
                detected["python-gc"] = min(_margin(float(evidence["gc_workers"]), 2, 4), _margin(conditional, rules.gc_min_explained, 0.4))

    # strongest first: the share of the gap each cause's own fix removes (sequence: its even spread)
    strength = {c: (evidence["sequence_even_explained"] if c == "sequence-imbalance" else fixes[c].explained) for c in detected}
    ranked = sorted(detected, key=lambda c: (-strength[c], c))
    straggling = result.slowdown >= rules.straggling
    if not straggling:
        primary, causes, confidence = "none", [], 1.0
        implicated = []
    elif ranked:
        primary, causes, confidence = ranked[0], ranked, detected[ranked[0]]
    else:
        best = max((fix.explained for fix in fixes.values()), default=0.0)
        primary, causes, confidence = "unexplained", [], float(np.clip(1.0 - best, 0.0, 1.0))
    evidence = {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in evidence.items()}
    return Verdict(model.job_id, float(result.slowdown), primary, causes, float(confidence),
                   {c: float(v) for c, v in detected.items()}, evidence, [(int(d), int(p)) for d, p in implicated], fixes)


def verdict_row(verdict: Verdict, gpu_hours: float, hosts: Mapping[tuple[int, int], str] | None = None) -> dict:
    """One JOB_CAUSE_SCHEMA row (schemas/fleet.py) of a verdict; hosts: (dp_rank, stage) -> host."""
    hosts = hosts or {}
    fix = verdict.primary_fix
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
        "savings_json": json.dumps({c: {"fixed_slowdown": f.fixed_slowdown, "explained": f.explained, "savings_fraction": f.savings_fraction}
                                    for c, f in sorted(verdict.fixes.items())}, sort_keys=True),
    }


def job_cause_table(verdict: Verdict, gpu_hours: float, workers: Sequence[Mapping] = ()) -> pa.Table:
    """The job_cause rows (JOB_CAUSE_SCHEMA, without `date`) of one job window.

    gpu_hours: the window's GPU-hours; workers: the manifest's worker entries (dp_rank,
    stage, host) to name the hosts of blamed workers. Callers write it for windows kept
    in fleet statistics (not discarded).
    """
    hosts = {(int(w["dp_rank"]), int(w["stage"])): w.get("host") for w in workers}
    return pa.Table.from_pylist([verdict_row(verdict, gpu_hours, hosts)], schema=JOB_CAUSE_SCHEMA)


def analyze_and_classify(trace: pa.Table, meta: JobMeta, job_id: str = "", *, rules: CauseRules = CauseRules(),
                         timeline: bool = False) -> tuple[WhatIfResult, Verdict]:
    """What-if analysis and root-cause verdict of one trace window, compiling the job once.

    The same WhatIfResult as transforms.whatif.analyze_job, plus the Verdict; raises the
    engine's WhatIfError subclasses on traces it cannot analyse.
    """
    model = compile_job(trace, meta, job_id)
    result = analyze_model(model, timeline=timeline)
    return result, classify(model, result, workload=sequence_workload(trace, model), rules=rules)
