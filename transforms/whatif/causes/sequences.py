"""Sequence-length imbalance: microbatch workloads from recorded document lengths, and the two
fixes of it the classifier replays (an even spread of each step's work, greedy repacking).

The workload of a microbatch is the sum of squared document lengths (attention cost); the
WLB-LLM imbalance degree of a step is max / mean workload over its microbatches. Repacking
runs vectorised over steps (see `_assign_rounds`): it costs a few percent of the analysis.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.trace import OPTYPES
from transforms.whatif.model import JobModel

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


def _assign_rounds(lengths: np.ndarray, capacity: np.ndarray, bins: int) -> np.ndarray:
    """Greedy repacking of many steps at once: bin index of every document.

    lengths: [steps, documents] each row sorted longest first (0 = padding); capacity:
    [steps] tokens a microbatch may hold. Longest first, each document goes to the lightest
    bin (sum of squared lengths) with room for it, or to the lightest bin when none has
    room. Vectorised in rounds, one sort of the bins each: a round hands the next documents
    of a step to its bins lightest first (bins without room for the round's first document
    last), the i-th document to the i-th bin, for as long as that is what one-at-a-time
    greedy would do: the i-th bin is still no heavier than any bin the round already filled,
    and the document fits. A round that this would cut below bins / 8 documents (nearly full
    microbatches) deals one document to each of the first bins / 8 bins instead: the
    documents left then are the shorter ones, a microbatch may exceed the capacity by one of
    them, and the rounds stay few (at most about 8 x documents per microbatch).
    """
    steps, n_docs = lengths.shape
    loads = np.zeros((steps, bins))
    tokens = np.zeros((steps, bins))
    target = np.zeros((steps, n_docs), dtype=np.int64)
    offsets = np.arange(bins)[None, :]
    n_real = (lengths > 0).sum(axis=1)
    pointer = np.zeros(steps, dtype=np.int64)
    while (pointer < n_real).any():
        position = pointer[:, None] + offsets
        real = position < n_real[:, None]
        block = np.where(real, np.take_along_axis(lengths, np.minimum(position, n_docs - 1), axis=1), 0.0)
        crowded = tokens + block[:, :1] > capacity[:, None] + 1e-9
        overflow = crowded.all(axis=1, keepdims=True)     # room nowhere: the lightest bins take it
        order = np.argsort(np.where(crowded, loads + loads.max() + 1.0, loads), axis=1)
        light = np.take_along_axis(loads, order, axis=1)
        room = capacity[:, None] - np.take_along_axis(tokens, order, axis=1)
        filled = np.minimum.accumulate(light + block ** 2, axis=1)
        lightest_filled = np.concatenate([np.full((steps, 1), np.inf), filled[:, :-1]], axis=1)
        greedy = light <= lightest_filled * (1 + 1e-12)
        taken = np.cumprod(greedy & ((block <= room + 1e-9) | overflow), axis=1).astype(bool) & real
        # a round cut short (nearly full microbatches) deals one document to each of the bins//8 first bins
        least = max(1, bins // 8)
        short = taken.sum(axis=1) < np.minimum(n_real - pointer, least)
        taken[short] = real[short] & (offsets < least)
        r, j = np.nonzero(taken)
        target[r, pointer[r] + j] = order[r, j]
        loads[r, order[r, j]] += block[r, j] ** 2          # a bin takes one document per round at most
        tokens[r, order[r, j]] += block[r, j]
        pointer += taken.sum(axis=1)
    return target


def greedy_rebalance(documents: Sequence[np.ndarray], capacity: float | None = None) -> list[np.ndarray]:
    """Repack the documents of len(documents) microbatches (see `_assign_rounds`); returns the
    new documents of each microbatch. capacity: tokens per microbatch (default: the largest given)."""
    bins = len(documents)
    every = np.concatenate([np.asarray(d, dtype=np.float64) for d in documents]) if bins else np.zeros(0)
    capacity = float(max((np.sum(d) for d in documents), default=0.0)) if capacity is None else float(capacity)
    ordered = np.sort(every)[::-1]
    target = _assign_rounds(ordered[None, :], np.array([capacity]), bins)[0]
    return [ordered[target == b] for b in range(bins)]


def _repacked_workload(model: JobModel, workload: SequenceWorkload) -> tuple[np.ndarray, dict]:
    """[steps, dp, microbatches] workloads after repacking each step's documents over all its
    microbatches (every DP rank), the heaviest new microbatch where the heaviest old one was
    (keeps the schedule's order of work); and the imbalance degrees before and after."""
    old = workload.slot_workload.reshape(model.n_steps, -1)
    slot_tokens = np.zeros(old.size)
    np.add.at(slot_tokens, workload.doc_slot, workload.doc_length)
    capacity = slot_tokens.reshape(old.shape).max(axis=1)
    step_of_doc = workload.doc_slot // old.shape[1]
    new = np.full_like(old, np.nan)
    for bins in np.unique(np.isfinite(old).sum(axis=1)):
        steps = np.flatnonzero(np.isfinite(old).sum(axis=1) == bins)
        if bins == 0:
            continue
        in_group = np.isin(step_of_doc, steps)
        row = np.searchsorted(steps, step_of_doc[in_group])
        length = workload.doc_length[in_group]
        order = np.argsort(row * (2.0 * length.max() + 1.0) - length, kind="stable")   # by step, longest first
        row, length = row[order], length[order]
        rank = np.arange(len(row)) - np.searchsorted(row, row)          # position within its step
        padded = np.zeros((len(steps), int(rank.max()) + 1 if len(rank) else 1))
        padded[row, rank] = length
        target = _assign_rounds(padded, capacity[steps], int(bins))
        loads = np.zeros((len(steps), int(bins)))
        np.add.at(loads, (np.arange(len(steps))[:, None], target), padded * padded)
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
    return cost, evidence


def even_sequences(model: JobModel) -> np.ndarray:
    """Compute cost with each step's work spread evenly over microbatches and DP ranks of a chunk,
    keeping each worker's persistent speed (no seq_lens: an upper bound of rebalancing)."""
    cost = model.original_cost.copy()
    step_of_lane = np.searchsorted(model.steps, model.lane_step)
    for code in (FORWARD, BACKWARD):
        ops = np.flatnonzero(model.op_optype == code)
        for g in np.unique(model.op_gmc[ops]):
            rows = ops[model.op_gmc[ops] == g]
            block = cost[rows]                                       # [mb, lane]
            per_dp = np.bincount(model.lane_dp, weights=block.sum(axis=0), minlength=model.dp_size)
            worker = per_dp / per_dp.mean()                          # persistent speed of each DP rank here
            normalised = block / worker[model.lane_dp][None, :]
            step_mean = np.bincount(step_of_lane, weights=normalised.sum(axis=0), minlength=model.n_steps)
            step_mean /= block.shape[0] * model.dp_size
            cost[rows] = step_mean[step_of_lane][None, :] * worker[model.lane_dp][None, :]
    return cost
