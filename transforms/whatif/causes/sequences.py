"""Sequence-length imbalance: microbatch workloads from recorded document lengths, and the two
fixes of it the classifier replays (an even spread of each step's work, greedy repacking).

The workload of a microbatch is the sum of squared document lengths (attention cost); the
WLB-LLM imbalance degree of a step is max / mean workload over its microbatches. Repacking
runs vectorised over steps in rounds (see `_assign_rounds`); benchmarks/bench_causes.py times
it against the analysis.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import pyarrow as pa

from schemas.trace import OPTYPES
from transforms.whatif.model import JobModel, distinct

__all__ = ["SequenceWorkload", "sequence_workload", "imbalance_degree", "greedy_rebalance", "even_sequences",
           "repacked_sequences"]

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


def _rows_with_lengths(trace: pa.Table) -> pa.Table:
    """Rows carrying seq_lens: one stage's forwards of one chunk hold them all; else every row that has them."""
    import pyarrow.compute as pc   # here: ~60 ms to import, and only traces with seq_lens get this far

    forward = pc.equal(pc.cast(trace["optype"], pa.string()), "forward-compute")
    first = pc.and_(pc.equal(trace["stage"], 0), pc.equal(trace["mc"], 0))
    valid = pc.is_valid(trace["seq_lens"])
    rows = trace.filter(pc.and_(pc.and_(forward, first), valid))
    return rows if rows.num_rows else trace.filter(valid)


def sequence_workload(trace: pa.Table, model: JobModel) -> SequenceWorkload | None:
    """Workloads from the trace's `seq_lens` column, aligned with the model; None when absent or empty."""
    if "seq_lens" not in trace.column_names:
        return None
    rows = _rows_with_lengths(trace)
    if rows.num_rows == 0:
        return None
    steps = rows["step"].to_numpy()
    step_index = np.minimum(np.searchsorted(model.steps, steps), len(model.steps) - 1)
    known = model.steps[step_index] == steps
    dp = rows["dp_rank"].to_numpy().astype(np.int64)
    mb = rows["mb_id"].to_numpy().astype(np.int64)
    known &= (mb >= 0) & (dp < model.dp_size)
    if not known.any():
        return None
    n_mb = int(mb[known].max()) + 1
    slot = (step_index * model.dp_size + dp) * n_mb + mb
    _, first = np.unique(np.where(known, slot, -1), return_index=True)
    first = first[known[first]]                       # the first row of every slot
    import pyarrow.compute as pc

    lists = rows["seq_lens"].combine_chunks()
    counts = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.float64)
    row_of_doc = np.repeat(np.arange(rows.num_rows), counts)
    chosen = np.zeros(rows.num_rows, dtype=bool)
    chosen[first] = True
    keep = chosen[row_of_doc]
    doc_slot, doc_length = slot[row_of_doc[keep]], lengths[keep]
    table = np.full(model.n_steps * model.dp_size * n_mb, np.nan)
    table[slot[first]] = 0.0
    np.add.at(table, doc_slot, doc_length * doc_length)
    table = table.reshape(model.n_steps, model.dp_size, n_mb)
    return SequenceWorkload(table, doc_slot, doc_length, _op_values(model, table))


def _op_values(model: JobModel, table: np.ndarray) -> np.ndarray:
    """[n_ops, n_lanes] value of table[step, dp_rank, microbatch] at every op with a microbatch (else NaN)."""
    mb_ids = model.mb_id
    valid = (mb_ids >= 0) & (mb_ids < table.shape[2])
    out = np.full(mb_ids.shape, np.nan)
    lanes = np.broadcast_to(np.arange(model.n_lanes)[None, :], mb_ids.shape)[valid]
    lane_step_index = np.searchsorted(model.steps, model.lane_step)
    out[valid] = table[lane_step_index[lanes], model.lane_dp[lanes], mb_ids[valid]]
    return out


def imbalance_degree(workloads: np.ndarray) -> float:
    """WLB-LLM imbalance degree: max / mean workload over one step's microbatches (1.0 = balanced)."""
    workloads = np.asarray(workloads, dtype=np.float64)
    workloads = workloads[np.isfinite(workloads)]
    return float(workloads.max() / workloads.mean()) if len(workloads) and workloads.mean() > 0 else math.nan


def _along(values: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """values[i, columns[i, j]] (take_along_axis on axis 1, without its per-call overhead)."""
    return values[np.arange(len(values))[:, None], columns]


def _next_documents(docs: np.ndarray, pointer: np.ndarray, n_real: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The next `width` documents of every row (0 past its last) and which of them are real."""
    position = pointer[:, None] + np.arange(width)
    real = position < n_real[:, None]
    return np.where(real, _along(docs, np.minimum(position, docs.shape[1] - 1)), 0.0), real


def _greedy_prefix(loads: np.ndarray, room: np.ndarray, block: np.ndarray, order: np.ndarray,
                   overflow: np.ndarray, real: np.ndarray) -> np.ndarray:
    """[rows, width] which of the round's next documents (block) go to bins order[:, j] as
    one-at-a-time greedy would send them: the bin is no heavier than any bin the round already
    filled, and the document fits (or fits nowhere); a prefix of each row."""
    at = order + (np.arange(len(order)) * loads.shape[1])[:, None]     # flat positions of the bins
    light = loads.reshape(-1)[at]
    filled = np.minimum.accumulate(light + block ** 2, axis=1)
    ok = (block <= room.reshape(-1)[at] + 1e-9) | overflow
    ok[:, 1:] &= light[:, 1:] <= filled[:, :-1] * (1 + 1e-12)
    return np.logical_and.accumulate(ok, axis=1) & real


def _rows(mask: np.ndarray) -> np.ndarray | slice:
    """The rows where mask holds: a slice (views, no copies) when that is every row."""
    return slice(None) if mask.all() else np.flatnonzero(mask)


def _lightest(key: np.ndarray, width: int) -> np.ndarray:
    """[rows, width] column indices of the `width` smallest keys of each row, smallest first."""
    if width >= key.shape[1]:
        return np.argsort(key, axis=1)
    part = np.argpartition(key, width - 1, axis=1)[:, :width]
    return _along(part, np.argsort(_along(key, part), axis=1))


def _assign_rounds(lengths: np.ndarray, capacity: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy repacking of many steps at once: bin index of every document, and the bins' loads.

    lengths: [steps, documents] each row sorted longest first (0 = padding); capacity:
    [steps] tokens a microbatch may hold. Longest first, each document goes to the lightest
    bin (sum of squared lengths) with room for it, or to the lightest bin when none has
    room. Vectorised in rounds, one ordering of the bins each: a round hands the next documents
    of a step to its bins lightest first (bins without room for the round's first document
    last), the i-th document to the i-th bin, for as long as that is what one-at-a-time
    greedy would do: the i-th bin is still no heavier than any bin the round already filled,
    and the document fits. A round that this would cut below bins / 8 documents (nearly full
    microbatches) deals one document to each of the first bins / 8 bins instead: the
    documents left then are the shorter ones, a microbatch may exceed the capacity by one of
    them, and the rounds stay few (at most about 8 x documents per microbatch).

    Cost: a round first orders only the bins / 8 lightest bins of each step (a partial sort),
    all of them only for the steps whose round goes past those; finished steps drop out.
    Equally loaded bins are taken in no particular order (as by any unstable sort).
    """
    steps, n_docs = lengths.shape
    target, final = np.zeros((steps, n_docs), dtype=np.int64), np.zeros((steps, bins))
    n_real = (lengths > 0).sum(axis=1)
    live = np.flatnonzero(n_real > 0)                      # steps still placing documents
    docs, n_real, pointer = lengths[live], n_real[live], np.zeros(len(live), dtype=np.int64)
    loads, room = np.zeros((len(live), bins)), np.repeat(capacity[live, None].astype(np.float64), bins, axis=1)
    heavy = float((lengths ** 2).sum(axis=1).max(initial=0.0)) + 1.0   # above any load: crowded bins sort last
    least = max(1, bins // 8)
    wide = np.full(len(live), least < bins)                # rows whose round may go past the least first bins
    while len(live):
        block, real = _next_documents(docs, pointer, n_real, least)
        crowded = block[:, :1] > room + 1e-9
        overflow = crowded.all(axis=1, keepdims=True)     # room nowhere: the lightest bins take it
        key = loads + heavy * crowded
        order, taken = np.zeros((len(live), least), dtype=np.int64), np.zeros((len(live), least), dtype=bool)
        if not wide.all():
            narrow = _rows(~wide)
            order[narrow] = _lightest(key[narrow], least)
            taken[narrow] = _greedy_prefix(loads[narrow], room[narrow], block[narrow], order[narrow], overflow[narrow], real[narrow])
            wide[narrow] = taken[narrow, -1] & (pointer[narrow] + least < n_real[narrow]) & (least < bins)
        if wide.any():
            further = _rows(wide)
            order = np.concatenate([order, np.zeros((len(live), bins - least), dtype=np.int64)], axis=1)
            taken = np.concatenate([taken, np.zeros((len(live), bins - least), dtype=bool)], axis=1)
            order[further] = np.argsort(key[further], axis=1)
            wide_block, wide_real = _next_documents(docs[further], pointer[further], n_real[further], bins)
            taken[further] = _greedy_prefix(loads[further], room[further], wide_block, order[further], overflow[further], wide_real)
        short = taken.sum(axis=1) < np.minimum(n_real - pointer, least)
        taken[short, :least] = real[short]  # a round cut short deals one document to each of the least first bins
        r, j = np.nonzero(taken)
        bin_, position = order[r, j], pointer[r] + j
        length, flat = docs[r, position], r * bins + bin_
        target[live[r], position] = bin_
        loads.reshape(-1)[flat] += length ** 2              # a bin takes one document per round at most
        room.reshape(-1)[flat] -= length
        pointer += taken.sum(axis=1)
        wide = taken.sum(axis=1) > least          # a long round: the next one likely is too
        if (done := pointer >= n_real).any():
            final[live[done]] = loads[done]
            keep = ~done
            live, docs, n_real, pointer, loads, room, wide = (a[keep] for a in (live, docs, n_real, pointer, loads, room, wide))
    return target, final


def greedy_rebalance(documents: Sequence[np.ndarray], capacity: float | None = None) -> list[np.ndarray]:
    """Repack the documents of len(documents) microbatches (see `_assign_rounds`); returns the
    new documents of each microbatch. capacity: tokens per microbatch (default: the largest given)."""
    bins = len(documents)
    every = np.concatenate([np.asarray(d, dtype=np.float64) for d in documents]) if bins else np.zeros(0)
    capacity = float(max((np.sum(d) for d in documents), default=0.0)) if capacity is None else float(capacity)
    ordered = np.sort(every)[::-1]
    target = _assign_rounds(ordered[None, :], np.array([capacity]), bins)[0][0]
    return [ordered[target == b] for b in range(bins)]


def _by_step_longest_first(step_of_doc: np.ndarray, length: np.ndarray, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents ordered by step, longest first within a step: one sort of values (a composite
    key, exact for the integer token counts of seq_lens), several times faster than an argsort."""
    span = 2.0 * (length.max() if len(length) else 0.0) + 1.0
    key = np.sort(step_of_doc * span - length)
    step = np.repeat(np.arange(n_steps), np.bincount(step_of_doc, minlength=n_steps))
    return step, step * span - key


def _repacked_workload(model: JobModel, workload: SequenceWorkload) -> tuple[np.ndarray, dict]:
    """[steps, dp, microbatches] workloads after repacking each step's documents over all its
    microbatches (every DP rank), the heaviest new microbatch where the heaviest old one was
    (keeps the schedule's order of work); and the imbalance degrees before and after."""
    old = workload.slot_workload.reshape(model.n_steps, -1)
    capacity = np.bincount(workload.doc_slot, weights=workload.doc_length, minlength=old.size).reshape(old.shape).max(axis=1)
    step_of_doc, length = _by_step_longest_first(workload.doc_slot // old.shape[1], workload.doc_length, model.n_steps)
    n_bins = np.isfinite(old).sum(axis=1)
    new = np.full_like(old, np.nan)
    for bins in np.unique(n_bins[n_bins > 0]):
        steps = np.flatnonzero(n_bins == bins)
        in_group = (n_bins == bins)[step_of_doc]
        local = np.zeros(model.n_steps, dtype=np.int64)
        local[steps] = np.arange(len(steps))
        row = local[step_of_doc[in_group]]
        counts = np.bincount(row, minlength=len(steps))
        rank = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)   # position within its step
        padded = np.zeros((len(steps), max(1, int(counts.max()))))
        padded[row, rank] = length[in_group]
        _, loads = _assign_rounds(padded, capacity[steps], int(bins))
        block = old[steps]
        present = np.isfinite(block)
        heaviest_first = np.argsort(np.where(present, -block, np.inf), axis=1, kind="stable")[:, :bins]
        placed = np.full_like(block, np.nan)
        np.put_along_axis(placed, heaviest_first, -np.sort(-loads, axis=1), axis=1)
        new[steps] = placed
    degree = lambda w: float(np.nanmean(np.nanmax(w, axis=1) / np.nanmean(w, axis=1)))
    evidence = {"imbalance_degree": degree(old), "imbalance_degree_rebalanced": degree(new)}
    return new.reshape(workload.slot_workload.shape), evidence


def repacked_sequences(model: JobModel, workload: SequenceWorkload) -> tuple[np.ndarray, dict]:
    """Cost after greedy document repacking across DP ranks, durations rescaled by a per-chunk
    linear cost model fitted on (workload, duration); and the imbalance evidence."""
    new_table, evidence = _repacked_workload(model, workload)
    new_workload = _op_values(model, new_table)
    cost = model.original_cost.copy()
    for code in (FORWARD, BACKWARD):
        ops = np.flatnonzero(model.op_optype == code)
        _, chunk = np.unique(model.op_gmc[ops], return_inverse=True)
        intercept, slope = _linear_fits(chunk, workload.op_workload[ops], cost[ops])
        old_model = intercept[chunk, None] + slope[chunk, None] * workload.op_workload[ops]
        new_model = intercept[chunk, None] + slope[chunk, None] * new_workload[ops]
        factor = np.where(np.isfinite(new_model) & (old_model > 0), new_model / old_model, 1.0)
        cost[ops] *= np.clip(factor, 0.05, 20.0)
    return cost, evidence


def _linear_fits(group: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares line y = intercept + slope * x per group of rows (x NaN: left out), all groups
    at once; a group with fewer than 3 points or one x value gets the line 0 + 0 x (no rescaling)."""
    keep = np.isfinite(x)
    g = np.broadcast_to(group[:, None], x.shape)[keep]
    x, y = x[keep], y[keep]
    n = np.bincount(g, minlength=group.max(initial=-1) + 1).astype(np.float64)
    member = np.zeros(len(n))
    member[g] = x                                          # one x of each group: all equal to it, or not
    fitted = (n >= 3) & (np.bincount(g, np.abs(x - member[g]), len(n)) > 0)
    n = np.maximum(n, 1.0)
    mean_x, mean_y = np.bincount(g, x, len(n)) / n, np.bincount(g, y, len(n)) / n
    dx = x - mean_x[g]
    slope = np.bincount(g, dx * (y - mean_y[g]), len(n)) / np.where(fitted, np.bincount(g, dx * dx, len(n)), 1.0)
    intercept = mean_y - slope * mean_x
    return np.where(fitted, intercept, 0.0), np.where(fitted, slope, 0.0)


def even_sequences(model: JobModel) -> np.ndarray:
    """Compute cost with each step's work spread evenly over microbatches and DP ranks of a chunk,
    keeping each worker's persistent speed (no seq_lens: an upper bound of rebalancing)."""
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
