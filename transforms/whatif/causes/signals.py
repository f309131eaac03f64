"""The signals root-cause detectors read from a compiled job: forward/backward pairs, peer
comparison of workers, compute per model chunk, GC stalls. Plain numpy over [op, lane] arrays."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from transforms.whatif.causes.verdict import CauseRules
from transforms.whatif.model import WGT, JobModel, column_values, distinct, median, nullable_values, optype_codes
from transforms.whatif.causes.sequences import BACKWARD, FORWARD

__all__ = ["pairs", "take", "pearson", "within_group_normalised", "margin", "peer_median", "nanmedian", "PeerComparison",
           "peer_comparison", "ChunkBalance", "chunk_balance", "GcStalls", "gc_stalls"]


def pairs(model: JobModel) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward op indices of the same (stage, chunk, microbatch), per lane.

    Returns two [n_pairs, n_lanes] op-index arrays (row k of both = one microbatch; the same
    stage and chunk in every lane); empty when forwards and backwards do not pair up.
    """
    chunks = int(model.op_gmc.max()) + 2
    forward = _main_pieces(model, np.flatnonzero(model.op_optype == FORWARD), chunks)
    backward = _main_pieces(model, np.flatnonzero(model.op_optype == BACKWARD), chunks)
    empty = np.zeros((0, model.n_lanes), np.int64)
    if len(forward) != len(backward) or not len(forward):
        return empty, empty

    def keyed(ops):
        key = _microbatch_key(model, ops, chunks)
        if (key == key[:, :1]).all():        # the usual case: microbatch ids alike in every lane, one order for all
            order = np.argsort(key[:, 0], kind="stable")
            return np.broadcast_to(ops[order, None], key.shape), key[order]
        order = np.argsort(key, axis=0, kind="stable")
        return ops[order], np.take_along_axis(key, order, axis=0)

    f_ops, f_key = keyed(forward)
    b_ops, b_key = keyed(backward)
    if not np.array_equal(f_key, b_key):
        return empty, empty
    return f_ops, b_ops


def _microbatch_key(model: JobModel, ops: np.ndarray, chunks: int) -> np.ndarray:
    """[len(ops), n_lanes] key of each op's (stage, chunk, microbatch) in each lane; `ops` one op per
    row ([k]) or one per row and lane ([k, lane], as `pairs` gives them)."""
    if ops.ndim == 2:
        return (model.op_stage[ops].astype(np.int64) * chunks + model.op_gmc[ops]) * (1 << 20) + take(model.mb_id, ops)
    return (model.op_stage[ops, None].astype(np.int64) * chunks + model.op_gmc[ops, None]) * (1 << 20) + model.mb_id[ops]


def _main_pieces(model: JobModel, ops: np.ndarray, chunks: int) -> np.ndarray:
    """One op per (stage, chunk, microbatch): a compute a collective cut into pieces (an all-to-all
    inside the forward) is represented by its longest piece (mean over lanes)."""
    key = _microbatch_key(model, ops, chunks)[:, 0]
    if len(distinct(key)) == len(ops):
        return ops
    order = np.lexsort((-model.original_cost[ops].mean(axis=1), key))
    first = np.r_[True, key[order][1:] != key[order][:-1]]
    return np.sort(ops[order][first])


def take(values: np.ndarray, ops: np.ndarray) -> np.ndarray:
    """values[op, lane] gathered at ops[k, lane]."""
    return np.take_along_axis(values, ops, axis=0)


def whole_backward(model: JobModel, backward: np.ndarray, cost: np.ndarray | None = None) -> np.ndarray:
    """[k, lane] cost of each backward of `pairs` with its weight-gradient half added where a
    zero-bubble schedule split it off (its backward-weight-compute op of the same stage, chunk and
    microbatch; chunks split differently: the first chunk's is all weight gradients). The backward's
    own cost where the job has no such op."""
    cost = model.original_cost if cost is None else cost
    out = take(cost, backward)
    weights = np.flatnonzero(model.op_optype == WGT)
    if not len(weights) or not len(backward):
        return out
    chunks = int(model.op_gmc.max()) + 2
    weights = _main_pieces(model, weights, chunks)
    key_w, key_b = _microbatch_key(model, weights, chunks), _microbatch_key(model, backward, chunks)
    for lane in range(model.n_lanes):
        order = np.argsort(key_w[:, lane], kind="stable")
        sorted_keys = key_w[order, lane]
        at = np.minimum(np.searchsorted(sorted_keys, key_b[:, lane]), len(order) - 1)
        found = sorted_keys[at] == key_b[:, lane]
        out[found, lane] += cost[weights[order[at[found]]], lane]
    return out


def within_group_normalised(values: np.ndarray, group: np.ndarray) -> np.ndarray:
    """values / mean of values with the same group id in the same lane ([k, lane] arrays)."""
    out = np.empty_like(values)
    for g in distinct(group[:, 0]):
        rows = group[:, 0] == g
        block = values[rows]
        out[rows] = block / block.mean(axis=0, keepdims=True)
    return out


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def margin(value: float, threshold: float, clear: float) -> float:
    """Confidence 0.5 at the threshold, 1.0 at `clear`, linear between (clipped)."""
    if not math.isfinite(value):
        return 0.0
    if clear == threshold:
        return 1.0 if value >= threshold else 0.0
    return float(np.clip(0.5 + 0.5 * (value - threshold) / (clear - threshold), 0.0, 1.0))


def peer_median(values: np.ndarray) -> np.ndarray:
    """Median over the last axis of every *other* element (leave-one-out), same shape as values.

    Needs at least 2 elements on the last axis, NaN-free. One sort: the j-th smallest of the
    others is sorted[j] when the element itself is above sorted[j], else sorted[j + 1] (an
    element equal to sorted[j] either sits at or below j, or sorted[j + 1] equals sorted[j])."""
    ordered = np.sort(values, axis=-1)
    others = values.shape[-1] - 1

    def kth_of_others(j: int) -> np.ndarray:
        return np.where(values > ordered[..., j:j + 1], ordered[..., j:j + 1], ordered[..., j + 1:j + 2])

    return 0.5 * (kth_of_others((others - 1) // 2) + kth_of_others(others // 2))


def nanmedian(values: np.ndarray, axis: int) -> np.ndarray:
    """np.nanmedian(values, axis), equal to it bit for bit (NaN where a slice is all NaN, without
    its warning). One sort; np.nanmedian goes through numpy.ma for small arrays, whose import
    and per-call overhead cost ~25 ms, a tenth of `strag analyze` on the AR trace."""
    ordered = np.sort(np.moveaxis(values, axis, -1), axis=-1)          # NaN sorts last
    n = (~np.isnan(ordered)).sum(axis=-1)

    def kth(k: np.ndarray) -> np.ndarray:
        return np.take_along_axis(ordered, k[..., None], axis=-1)[..., 0]

    middle = (kth(np.maximum((n - 1) // 2, 0)) + kth(np.minimum(n // 2, ordered.shape[-1] - 1))) / 2
    return np.where(n > 0, middle, np.nan)


@dataclasses.dataclass(frozen=True)
class PeerComparison:
    """Each worker's compute against the other DP ranks of its stage ([dp_size, pp_size] arrays):
    the pace its fix restores (fixes.at_peer_speed). Whether a worker is slow is the worker
    detector's question (workers.py), not this one's.

    A step ratio is the median, over the worker's microbatches and chunks of that step, of its
    compute over the leave-one-out median of the other DP ranks' same microbatch: a GC pause
    (one microbatch) or a heavy stage (all DP ranks alike) does not move it.
    ratio / forward / backward: median step ratio over steps (compute, forwards, backwards).
    """

    ratio: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    n_steps: int


def peer_comparison(model: JobModel, forward: np.ndarray, backward: np.ndarray) -> PeerComparison | None:
    """PeerComparison of every worker; None without DP peers or forward/backward pairs."""
    if model.dp_size < 2 or not len(forward):
        return None
    shape = (len(forward), model.n_steps, model.dp_size)          # lanes are step-major, dp minor
    f = take(model.original_cost, forward).reshape(shape)
    b = take(model.original_cost, backward).reshape(shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        f_ratio, b_ratio = f / peer_median(f), b / peer_median(b)
        t_ratio = (f + b) / peer_median(f + b)
    stage_of_row = model.op_stage[forward[:, 0]]
    step_ratio = np.full((model.pp_size, model.n_steps, model.dp_size), np.nan)
    step_forward, step_backward = step_ratio.copy(), step_ratio.copy()
    for p in distinct(stage_of_row):
        rows = stage_of_row == p
        # the typical microbatch's ratio, or the step's whole compute against its peers' when that
        # is higher: a stall in one microbatch every step (a pause in a hook) is the worker's too
        total = (f + b)[rows].sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            step_ratio[p] = np.fmax(nanmedian(t_ratio[rows], axis=0), total / peer_median(total))
        step_forward[p] = nanmedian(f_ratio[rows], axis=0)
        step_backward[p] = nanmedian(b_ratio[rows], axis=0)
    by_worker = lambda a: nanmedian(a, axis=1).T                # [pp, S, dp] -> [dp, pp]
    return PeerComparison(by_worker(step_ratio), by_worker(step_forward), by_worker(step_backward), model.n_steps)


@dataclasses.dataclass(frozen=True)
class ChunkBalance:
    """Compute per microbatch of each model chunk, taken on its fastest DP rank (so a slow
    machine does not make its stage look heavy). ratio: heaviest chunk over the median chunk."""

    ratio: float
    heaviest_chunk: int
    heaviest_stage: int


def chunk_balance(model: JobModel, forward: np.ndarray, backward: np.ndarray) -> ChunkBalance | None:
    """ChunkBalance of a pipeline job; None without pipeline stages or forward/backward pairs."""
    if model.pp_size < 2 or not len(forward):
        return None
    shape = (len(forward), model.n_steps, model.dp_size)
    work = (take(model.original_cost, forward) + whole_backward(model, backward)).reshape(shape)
    chunk_of_row = model.op_gmc[forward[:, 0]]
    chunks = distinct(chunk_of_row)
    per_chunk = np.array([work[chunk_of_row == g].mean(axis=(0, 1)).min() for g in chunks])
    heaviest = int(np.argmax(per_chunk))
    stage = int(model.op_stage[forward[np.flatnonzero(chunk_of_row == chunks[heaviest])[0], 0]])
    return ChunkBalance(float(per_chunk[heaviest] / median(per_chunk)), int(chunks[heaviest]), stage)


@dataclasses.dataclass(frozen=True)
class GcStalls:
    """Forward stalls of every pair ([k, lane]): seconds beyond the forward its backward predicts,
    the pause mask, that expected forward; and the count of backward stalls (GC spares them)."""

    stall: np.ndarray
    pauses: np.ndarray
    expected: np.ndarray
    backward_outliers: int


def gc_stalls(model: JobModel, forward: np.ndarray, backward: np.ndarray, rules: CauseRules) -> GcStalls:
    """Forward stalls: observed forward minus ratio_median x backward (both halves of a zero-bubble
    backward, `whole_backward`), per (stage, chunk); a pause
    exceeds both gc_min_stall seconds and gc_sigma robust standard deviations (MAD) of its chunk."""
    f = take(model.original_cost, forward)
    b = whole_backward(model, backward)
    chunk = model.op_stage[forward] * (int(model.op_gmc.max()) + 2) + model.op_gmc[forward]
    expected = np.empty_like(f)
    pauses = np.zeros(f.shape, dtype=bool)
    stall = np.empty_like(f)
    backward_outliers = 0
    for g in distinct(chunk[:, 0]):
        rows = chunk[:, 0] == g
        ratio = median(f[rows] / b[rows])
        expected[rows] = ratio * b[rows]
        stall[rows] = f[rows] - expected[rows]
        sigma = 1.4826 * median(np.abs(stall[rows] - median(stall[rows])))
        limit = max(rules.gc_min_stall, rules.gc_sigma * sigma)
        pauses[rows] = stall[rows] > limit
        # the mirror test on backward: a stall there would not be GC's forward-only signature
        backward_outliers += int(((b[rows] - f[rows] / ratio) > limit).sum())
    return GcStalls(stall, pauses, expected, backward_outliers)


@dataclasses.dataclass(frozen=True)
class ChunkWork:
    """Per model chunk (gmc), from compute ops whose trace counts the operations autograd recorded
    in them (`n_ops`): mean operations and mean seconds per microbatch, forward and backward.
    More operations is more work (a heavier partition); more seconds per operation is a slower
    machine doing the same work."""

    chunks: np.ndarray
    ops_forward: np.ndarray
    ops_backward: np.ndarray
    seconds_forward: np.ndarray
    seconds_backward: np.ndarray

    def of(self, chunks) -> tuple[float, float]:
        """(work ratio, speed ratio) of the given chunks against the median chunk: operations per
        microbatch, and the larger over forward and backward of seconds per operation."""
        mine = np.isin(self.chunks, list(chunks))
        ops = self.ops_forward + self.ops_backward
        work = float(ops[mine].mean() / median(ops))
        with np.errstate(divide="ignore", invalid="ignore"):
            pace = [s / np.maximum(o, 1) for s, o in ((self.seconds_forward, self.ops_forward),
                                                      (self.seconds_backward, self.ops_backward))]
        speed = max(float(p[mine].mean() / median(p)) for p in pace)
        return work, speed


def chunk_work(trace, model: JobModel) -> ChunkWork | None:
    """ChunkWork from the trace's `n_ops` column; None without it, or where any compute op of the
    job lacks it (a partial count would compare unlike things). Columns read by dictionary code and
    value buffers, per-chunk means by bincount: one pass over the rows."""
    if "n_ops" not in trace.column_names or model.pp_size * max(model.vpp_size, 1) < 2:
        return None
    optype = optype_codes(trace.column("optype"), model.job_id)
    compute = (optype == FORWARD) | (optype == BACKWARD) | (optype == WGT)
    if not compute.any():
        return None
    n_ops = nullable_values(trace.column("n_ops"))[compute]
    if np.isnan(n_ops).any():
        return None
    gmc = column_values(trace.column("gmc"))[compute].astype(np.int64)
    seconds = column_values(trace.column("duration"))[compute].astype(np.float64)
    kind = optype[compute]
    forward, backward = kind == FORWARD, kind != FORWARD
    chunks, index = np.unique(gmc, return_inverse=True)

    def per_microbatch(values: np.ndarray, mask: np.ndarray, counted: np.ndarray) -> np.ndarray:
        """The chunk's total over `mask` rows per microbatch (one `counted` row each)."""
        count = np.bincount(index[counted], minlength=len(chunks)).astype(np.float64)
        total = np.bincount(index[mask], weights=values[mask], minlength=len(chunks))
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(count > 0, total / count, np.nan)

    # a zero-bubble schedule splits a backward in two ops (input gradients, then weight gradients),
    # each chunk differently (the first chunk's inputs need none: all of it is weight gradients):
    # the chunk's backward per microbatch is both, one backward-compute op per microbatch
    return ChunkWork(chunks, per_microbatch(n_ops, forward, forward), per_microbatch(n_ops, backward, kind == BACKWARD),
                     per_microbatch(seconds, forward, forward), per_microbatch(seconds, backward, kind == BACKWARD))
