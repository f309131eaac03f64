"""Sequence-length imbalance: microbatch workloads from recorded document lengths, and the two
fixes of it the classifier replays (an even spread of each step's work, greedy repacking).

The workload of a microbatch is the sum of squared document lengths (attention cost); the
WLB-LLM imbalance degree of a step is max / mean workload over its microbatches. Repacking is
exact one-at-a-time greedy (`greedy_repack`: longest first, each document to the lightest
microbatch with room), all steps in one call of the compiled kernel (kernel.c, strag_repack)
or, without a compiler, the same rule in Python (~20x slower). Its cost is what follows the
repacking too (the per-chunk linear cost model over [op, lane] arrays), so every part is
vectorised; benchmarks/bench_causes.py times it against the analysis (target <= 20%).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np
import pyarrow as pa

from schemas.trace import OPTYPES
from transforms.whatif import kernel
from transforms.whatif.errors import TraceValueError
from transforms.whatif.model import JobModel, distinct, optype_codes

__all__ = ["SequenceWorkload", "sequence_workload", "imbalance_degree", "greedy_repack", "greedy_rebalance",
           "even_sequences", "repacked_sequences", "at_mean_workload"]

FORWARD, BACKWARD = OPTYPES.index("forward-compute"), OPTYPES.index("backward-compute")


@dataclasses.dataclass(frozen=True)
class SequenceWorkload:
    """Document lengths per microbatch and the workload of every compute op.

    slot_workload: [n_steps, dp_size, n_microbatches] sum of squared lengths (tokens^2; NaN
    where the trace has no lengths); doc_slot, doc_length: every document's flat slot index
    into slot_workload and its length (tokens); op_workload: [n_ops, n_lanes] the workload
    of the op's microbatch (NaN for non-compute ops).
    """

    slot_workload: np.ndarray
    doc_slot: np.ndarray
    doc_length: np.ndarray
    op_workload: np.ndarray


def _rows_with_lengths(trace: pa.Table) -> np.ndarray:
    """Rows carrying seq_lens (indices, ascending): one stage's forwards of one chunk hold them all;
    else every row that has them."""
    import pyarrow.compute as pc   # here: ~60 ms to import, and only traces with seq_lens get this far

    valid = pc.is_valid(trace["seq_lens"]).to_numpy(zero_copy_only=False)
    # forwards compared by dictionary code, per chunk: casting every row's op type to a string cost
    # more than the rest of the sequence signature
    forward = optype_codes(trace["optype"]) == FORWARD
    first = (trace["stage"].to_numpy() == 0) & (trace["mc"].to_numpy() == 0)
    rows = np.flatnonzero(forward & first & valid)
    return rows if len(rows) else np.flatnonzero(valid)


def _documents(column: pa.ChunkedArray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(documents per row, every document's length as float64, NaN where null) of the given rows
    (ascending) of a list column, read from each chunk's offsets and values: no copy of the lists of
    the other rows."""
    counts, lengths = [], []
    bounds = np.cumsum([0] + [len(chunk) for chunk in column.chunks])
    for index, chunk in enumerate(column.chunks):
        local = rows[(rows >= bounds[index]) & (rows < bounds[index + 1])] - bounds[index]
        if not len(local):
            continue
        offsets = chunk.offsets.to_numpy()
        begin, count = offsets[local].astype(np.int64), (offsets[local + 1] - offsets[local]).astype(np.int64)
        # each row's documents in list order: begin of its list + 0, 1, ... count - 1
        position = np.arange(int(count.sum())) + np.repeat(begin - (np.cumsum(count) - count), count)
        counts.append(count)
        lengths.append(chunk.values.to_numpy(zero_copy_only=False)[position].astype(np.float64))
    if not counts:
        return np.zeros(0, np.int64), np.zeros(0)
    return np.concatenate(counts), np.concatenate(lengths)


def sequence_workload(trace: pa.Table, model: JobModel) -> SequenceWorkload | None:
    """Workloads from the trace's `seq_lens` column, aligned with the model; None when absent or
    empty; TraceValueError when a recorded document length is null or negative."""
    if "seq_lens" not in trace.column_names or trace["seq_lens"].null_count == trace.num_rows:
        return None
    rows = _rows_with_lengths(trace)
    if len(rows) == 0:
        return None
    steps = trace["step"].to_numpy()[rows]
    step_index = np.minimum(np.searchsorted(model.steps, steps), len(model.steps) - 1)
    known = model.steps[step_index] == steps
    dp = trace["dp_rank"].to_numpy()[rows].astype(np.int64)
    mb = trace["mb_id"].to_numpy()[rows].astype(np.int64)
    known &= (mb >= 0) & (dp < model.dp_size)
    if not known.any():
        return None
    n_mb = int(mb[known].max()) + 1
    slot = (step_index * model.dp_size + dp) * n_mb + mb
    _, first = np.unique(np.where(known, slot, -1), return_index=True)
    first = np.sort(first[known[first]])              # the first row of every slot, in row order
    counts, doc_length = _documents(trace["seq_lens"], rows[first])
    doc_slot = np.repeat(slot[first], counts)
    _check_lengths(model, doc_slot, doc_length, n_mb)
    table = np.full(model.n_steps * model.dp_size * n_mb, np.nan)
    # each slot's sum of squared document lengths, added in document order (np.add.at's order, ~20x faster)
    sums = np.bincount(doc_slot, weights=doc_length * doc_length, minlength=len(table))
    table[slot[first]] = sums[slot[first]]
    table = table.reshape(model.n_steps, model.dp_size, n_mb)
    return SequenceWorkload(table, doc_slot, doc_length, _op_values(model, table))


def _check_lengths(model: JobModel, doc_slot: np.ndarray, doc_length: np.ndarray, n_mb: int) -> None:
    """TraceValueError naming the first microbatch whose seq_lens holds a null or negative length."""
    bad = ~(doc_length >= 0)
    if bad.any():
        step, dp_rank, mb = np.unravel_index(doc_slot[bad][0], (model.n_steps, model.dp_size, n_mb))
        raise TraceValueError(f"{int(bad.sum())} document lengths in seq_lens are null or negative, the first in "
                              f"microbatch {mb}; they must be token counts >= 0", job_id=model.job_id,
                              step=int(model.steps[step]), dp_rank=int(dp_rank), op="forward-compute")


def _op_values(model: JobModel, table: np.ndarray, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """[rows, n_lanes] value of table[step, dp_rank, microbatch] at the given ops (default: all)
    where they have a microbatch, else NaN."""
    mb_ids = model.mb_id[rows]
    lane_slot = (np.searchsorted(model.steps, model.lane_step) * table.shape[1] + model.lane_dp) * table.shape[2]
    valid = (mb_ids >= 0) & (mb_ids < table.shape[2])
    values = np.take(table.reshape(-1), lane_slot + mb_ids, mode="clip")
    return np.where(valid, values, np.nan)


def imbalance_degree(workloads: np.ndarray) -> float:
    """WLB-LLM imbalance degree: max / mean workload over one step's microbatches (1.0 = balanced)."""
    workloads = np.asarray(workloads, dtype=np.float64)
    workloads = workloads[np.isfinite(workloads)]
    return float(workloads.max() / workloads.mean()) if len(workloads) and workloads.mean() > 0 else math.nan


def greedy_repack(lengths: np.ndarray, doc_ptr: np.ndarray, bins: np.ndarray, capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One-at-a-time greedy repacking of many steps' documents into their microbatches (bins).

    Step s has documents lengths[doc_ptr[s]:doc_ptr[s + 1]] (tokens, longest first), bins[s]
    bins and capacity[s] tokens per bin. In order, each document goes to the lightest bin
    (load: sum of squared lengths; ties: lowest index) whose room (capacity - tokens already
    in it) holds it; when none does, to the lightest bin overall (the bin then exceeds the
    capacity). Returns (every document's bin within its step [n_docs] int64, every step's bin
    loads one after the other [sum(bins)]). Compiled (kernel.strag_repack) when the kernel
    builds, else `_repack_python`: identical results. ValueError when a length is negative,
    not finite or longer than the one before in its step."""
    lengths = np.asarray(lengths, dtype=np.float64)
    doc_ptr, bins = np.asarray(doc_ptr, dtype=np.int64), np.asarray(bins, dtype=np.int64)
    capacity = np.asarray(capacity, dtype=np.float64)
    if (len(doc_ptr) != len(bins) + 1 or len(capacity) != len(bins) or doc_ptr[0] != 0 or doc_ptr[-1] != len(lengths)
            or (np.diff(doc_ptr) < 0).any() or (bins < 0).any()):
        raise ValueError(f"repacking: {len(bins)} steps need {len(bins)} bin counts >= 0 and capacities, and "
                         f"{len(bins) + 1} non-decreasing document offsets from 0 to the {len(lengths)} documents")
    bin_ptr = np.concatenate([[0], np.cumsum(bins)])
    if kernel.wanted():
        return kernel.repack(lengths, doc_ptr, bin_ptr, capacity)
    return _repack_python(lengths, doc_ptr, bin_ptr, capacity)


def _repack_python(lengths: np.ndarray, doc_ptr: np.ndarray, bin_ptr: np.ndarray,
                   capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """greedy_repack without the compiler, the kernel's rule with heapq: `eligible` (load,
    bin), the bins not known to lack room; `aside` (-room, bin), the bins that lacked room for
    a longer or equal document, back as soon as the current one fits (an entry whose room is
    no longer its bin's is stale: an overflow has since filled that bin); the overflow takes
    the lightest bin by a scan."""
    target, loads = np.empty(len(lengths), dtype=np.int64), np.empty(int(bin_ptr[-1]))
    every = lengths.tolist()
    for step in range(len(bin_ptr) - 1):
        bins, previous = int(bin_ptr[step + 1] - bin_ptr[step]), math.inf
        load, room = [0.0] * bins, [float(capacity[step])] * bins
        eligible, aside = [(0.0, b) for b in range(bins)], []          # equal loads in index order: a heap
        for doc in range(doc_ptr[step], doc_ptr[step + 1]):
            length = every[doc]
            if not (0.0 <= length <= previous and length < math.inf and bins):
                raise ValueError(kernel.INVALID_REPACK)
            previous = length
            while aside and -aside[0][0] >= length:
                left, b = heapq.heappop(aside)
                if -left == room[b]:
                    heapq.heappush(eligible, (load[b], b))
            while eligible and room[eligible[0][1]] < length:
                b = heapq.heappop(eligible)[1]
                heapq.heappush(aside, (-room[b], b))
            b = eligible[0][1] if eligible else min(range(bins), key=load.__getitem__)
            before = room[b]
            load[b] += length * length
            room[b] -= length
            if eligible:
                heapq.heapreplace(eligible, (load[b], b))
            elif room[b] != before:
                heapq.heappush(aside, (-room[b], b))
            target[doc] = b
        loads[bin_ptr[step]:bin_ptr[step + 1]] = load
    return target, loads


def greedy_rebalance(documents: Sequence[np.ndarray], capacity: float | None = None) -> list[np.ndarray]:
    """Repack the documents of len(documents) microbatches by `greedy_repack` (longest first,
    each to the lightest microbatch with room); returns the new documents of each microbatch.
    capacity: tokens per microbatch (default: the largest given)."""
    bins = len(documents)
    every = np.concatenate([np.asarray(d, dtype=np.float64) for d in documents]) if bins else np.zeros(0)
    capacity = float(max((np.sum(d) for d in documents), default=0.0)) if capacity is None else float(capacity)
    ordered = np.sort(every)[::-1]
    target, _ = greedy_repack(ordered, np.array([0, len(ordered)]), np.array([bins]), np.array([capacity]))
    return [ordered[target == b] for b in range(bins)]


def _by_step_longest_first(step_of_doc: np.ndarray, length: np.ndarray, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Document offsets per step [n_steps + 1] and the lengths ordered by step, longest first
    within a step: one sort of values (a composite key, exact for the int32 token counts of
    seq_lens), several times faster than an argsort. Step s's keys lie within half a span of
    s x span, so the offsets are a search for the midpoints."""
    span = 2.0 * (length.max() if len(length) else 0.0) + 1.0
    key = step_of_doc * span
    key -= length
    key.sort()                                   # in place: these arrays are as long as the documents
    doc_ptr = np.searchsorted(key, (np.arange(n_steps + 1) - 0.5) * span)
    ordered = np.repeat(np.arange(n_steps) * span, np.diff(doc_ptr))
    ordered -= key
    return doc_ptr, ordered


def _repacked_workload(model: JobModel, workload: SequenceWorkload) -> tuple[np.ndarray, dict]:
    """[steps, dp, microbatches] workloads after repacking each step's documents over all its
    microbatches (every DP rank; capacity: the step's fullest microbatch), the heaviest new
    microbatch where the heaviest old one was (keeps the schedule's order of work); and the
    imbalance degrees before and after."""
    old = workload.slot_workload.reshape(model.n_steps, -1)
    capacity = np.bincount(workload.doc_slot, weights=workload.doc_length, minlength=old.size).reshape(old.shape).max(axis=1)
    doc_ptr, length = _by_step_longest_first(workload.doc_slot // old.shape[1], workload.doc_length, model.n_steps)
    present = np.isfinite(old)
    bins = present.sum(axis=1)
    _, loads = greedy_repack(length, doc_ptr, bins, capacity)
    new_loads = np.full(old.shape, -np.inf)
    new_loads[present] = loads                                 # each step's bins, in any order
    rows, rank = np.nonzero(np.arange(old.shape[1]) < bins[:, None])    # the k-th heaviest, k < bins
    new = np.full_like(old, np.nan)
    new[rows, _heaviest_first(old, present)[rows, rank]] = -np.sort(-new_loads, axis=1)[rows, rank]
    evidence = {"imbalance_degree": _mean_degree(old, present, bins),
                "imbalance_degree_rebalanced": _mean_degree(new, present, bins)}
    return new.reshape(workload.slot_workload.shape), evidence


def _heaviest_first(values: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Column order of every row: the present values heaviest first, then the absent ones;
    equal values in column order. What a stable argsort gives, ~1.7x faster: a plain argsort
    puts ties in any order, then one of unique integer keys (run of equal values, column)
    settles them."""
    key = np.where(present, -values, np.inf)
    order = np.argsort(key, axis=1)
    ordered = np.take_along_axis(key, order, axis=1)
    settle = np.zeros(order.shape, dtype=np.int64)
    np.cumsum(ordered[:, 1:] != ordered[:, :-1], axis=1, out=settle[:, 1:])    # run of equal values
    settle *= values.shape[1]
    settle += order
    return np.take_along_axis(order, np.argsort(settle, axis=1), axis=1)


def _mean_degree(workloads: np.ndarray, present: np.ndarray, bins: np.ndarray) -> float:
    """Mean over steps of the imbalance degree (max / mean of the present workloads of a step)."""
    steps = bins > 0
    high = np.where(present, workloads, -np.inf)[steps].max(axis=1)
    mean = np.where(present, workloads, 0.0)[steps].sum(axis=1) / bins[steps]
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(np.nanmean(high / mean)) if steps.any() else math.nan


def repacked_sequences(model: JobModel, workload: SequenceWorkload) -> tuple[np.ndarray, dict]:
    """Cost after greedy document repacking across DP ranks, compute durations rescaled by a
    linear cost model per (chunk, forward or backward) fitted on (workload, duration); and
    the imbalance evidence."""
    new_table, evidence = _repacked_workload(model, workload)
    rows = np.flatnonzero((model.op_optype == FORWARD) | (model.op_optype == BACKWARD))
    return _rescaled(model, workload, rows, _op_values(model, new_table, rows)), evidence


def at_mean_workload(model: JobModel, workload: SequenceWorkload, cost: np.ndarray | None = None) -> np.ndarray:
    """`cost` (default the model's) with every forward and backward rescaled, by the linear cost
    model of `repacked_sequences`, from the workload its microbatch carries to its chunk's mean
    workload: the same work on every DP rank and step, each worker's own pace kept. What the
    worker test compares where the batches' recorded lengths explain the compute (a longer batch
    is no slower machine)."""
    rows = np.flatnonzero((model.op_optype == FORWARD) | (model.op_optype == BACKWARD))
    x = workload.op_workload[rows]
    group = model.op_gmc[rows]
    keep = np.isfinite(x)
    sums = np.bincount(group, weights=np.where(keep, x, 0.0).sum(axis=1))
    counts = np.bincount(group, weights=keep.sum(axis=1), minlength=len(sums))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = sums / counts
    return _rescaled(model, workload, rows, np.where(keep, mean[group][:, None], np.nan), cost)


def balanced_sequences(model: JobModel, workload: SequenceWorkload) -> np.ndarray:
    """Cost with every microbatch of a step given the same workload, its chunk's mean over that
    step's microbatches and DP ranks, each forward and backward rescaled by the bounded cost model
    (`_linear_fits`): perfect balancing of the recorded lengths, what any repacking can at best
    reach. Everything the lengths do not explain (jitter, a worker's pace) is kept: moving
    documents removes imbalance, not noise."""
    rows = np.flatnonzero((model.op_optype == FORWARD) | (model.op_optype == BACKWARD))
    x = workload.op_workload[rows]
    keep = np.isfinite(x)
    chunk = np.searchsorted(distinct(model.op_gmc[rows]), model.op_gmc[rows])
    cell = chunk[:, None] * model.n_steps + np.searchsorted(model.steps, model.lane_step)[None, :]
    n_cells = (int(chunk.max(initial=-1)) + 1) * model.n_steps
    sums = np.bincount(cell.ravel(), weights=np.where(keep, x, 0.0).ravel(), minlength=n_cells)
    counts = np.bincount(cell.ravel(), weights=keep.ravel(), minlength=n_cells)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = sums / counts
    return _rescaled(model, workload, rows, np.where(keep, mean[cell], np.nan))


def _rescaled(model: JobModel, workload: SequenceWorkload, rows: np.ndarray, new_x: np.ndarray,
              cost: np.ndarray | None = None) -> np.ndarray:
    """A copy of `cost` (default the model's) whose compute `rows` ([rows, lanes] workload new_x)
    take duration x (intercept + slope new_x) / (intercept + slope old_x), the line fitted per
    (chunk, forward or backward) on the recorded (workload, duration); unchanged where the line
    gives no positive cost or new_x is unknown; the factor clipped to 0.05 .. 20."""
    chunk_and_kind = model.op_gmc[rows] * 2 + (model.op_optype[rows] == BACKWARD)
    group = np.searchsorted(distinct(chunk_and_kind), chunk_and_kind)
    cost = (model.original_cost if cost is None else cost).copy()
    old_x, y = workload.op_workload[rows], cost[rows]
    intercept, slope = (fit[group, None] for fit in _linear_fits(group, old_x, model.original_cost[rows]))
    old_model = old_x * slope
    old_model += intercept
    factor = new_x * slope                         # in place from here: these arrays are [ops, lanes]
    factor += intercept
    usable = old_model > 0
    usable &= np.isfinite(factor)
    np.divide(factor, old_model, out=factor, where=usable)
    factor[~usable] = 1.0
    np.clip(factor, 0.05, 20.0, out=factor)
    factor *= y
    cost[rows] = factor
    return cost


def _linear_fits(group: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares line y = intercept + slope * x per group of rows of [rows, lanes] x and y
    (x NaN: left out), all groups at once, summed over lanes first, under the physical bounds of
    a cost model: intercept >= 0 (a microbatch's fixed cost is never negative) and slope >= 0
    (cost grows with the workload, METHOD.md section 5). Where the free fit's intercept is
    negative, the bounded least squares is on that bound: the line through the origin, cost
    proportional to workload, so a rescaling never moves a duration by more than its workload
    moves (a steeper free line is jitter that happened to follow the lengths). A group with
    fewer than 3 points, one x value, or a slope <= 0 gets 0 + 0 x (no rescaling)."""
    keep = np.isfinite(x)
    every = bool(keep.all())                      # the usual case: no masking passes
    n_groups = int(group.max(initial=-1)) + 1
    n = np.bincount(group, minlength=n_groups) * float(x.shape[1]) if every else \
        np.bincount(group, np.count_nonzero(keep, axis=1), n_groups)
    low, high = np.full(n_groups, np.inf), np.full(n_groups, -np.inf)
    np.minimum.at(low, group, (x if every else np.where(keep, x, np.inf)).min(axis=1, initial=np.inf))
    np.maximum.at(high, group, (x if every else np.where(keep, x, -np.inf)).max(axis=1, initial=-np.inf))
    fitted = (n >= 3) & (high > low)
    n = np.maximum(n, 1.0)
    x, y = (x, y) if every else (np.where(keep, x, 0.0), np.where(keep, y, 0.0))
    mean_x = np.bincount(group, x.sum(axis=1), n_groups) / n
    mean_y = np.bincount(group, y.sum(axis=1), n_groups) / n
    dx = x - mean_x[group, None]
    if not every:
        dx[~keep] = 0.0
    sxy = np.bincount(group, np.einsum("ij,ij->i", dx, y - mean_y[group, None]), n_groups)
    sxx = np.bincount(group, np.einsum("ij,ij->i", dx, dx), n_groups)
    slope = sxy / np.where(fitted, sxx, 1.0)
    intercept = mean_y - slope * mean_x
    below = fitted & (intercept < 0)
    if below.any():   # on the bound intercept = 0: slope = sum(x y) / sum(x x)
        through = np.bincount(group, np.einsum("ij,ij->i", x, y), n_groups) / \
            np.maximum(np.bincount(group, np.einsum("ij,ij->i", x, x), n_groups), np.finfo(float).tiny)
        slope, intercept = np.where(below, through, slope), np.where(below, 0.0, intercept)
    fitted &= slope > 0
    return np.where(fitted, intercept, 0.0), np.where(fitted, slope, 0.0)


def even_sequences(model: JobModel) -> np.ndarray:
    """Compute cost with each step's work spread evenly over microbatches and DP ranks of a chunk,
    keeping each worker's persistent speed, its share of the chunk's work (an upper bound of
    rebalancing where no lengths are recorded; with them, `balanced_sequences`)."""
    cost = model.original_cost.copy()
    step_of_lane = np.searchsorted(model.steps, model.lane_step)
    for code in (FORWARD, BACKWARD):
        ops = np.flatnonzero(model.op_optype == code)
        for g in distinct(model.op_gmc[ops]):
            rows = ops[model.op_gmc[ops] == g]
            block = cost[rows]                                       # [mb, lane]
            per_dp = np.bincount(model.lane_dp, weights=block.sum(axis=0), minlength=model.dp_size)
            worker = per_dp / per_dp.mean()                          # persistent speed of each DP rank here
            normalised = block / worker[model.lane_dp][None, :]
            step_mean = np.bincount(step_of_lane, weights=normalised.sum(axis=0), minlength=model.n_steps)
            step_mean /= block.shape[0] * model.dp_size
            cost[rows] = step_mean[step_of_lane][None, :] * worker[model.lane_dp][None, :]
    return cost
