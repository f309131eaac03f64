"""The signals root-cause detectors read from a compiled job: forward/backward pairs, peer
comparison of workers, compute per model chunk, GC stalls. Plain numpy over [op, lane] arrays."""
from __future__ import annotations

import dataclasses
import math
import weakref

import numpy as np

from transforms.whatif.causes.verdict import CauseRules
from transforms.whatif.model import WGT, JobModel, column_values, distinct, median, nullable_values, optype_codes
from transforms.whatif.causes.sequences import BACKWARD, FORWARD

__all__ = ["pairs", "take", "pearson", "within_group_normalised", "margin", "peer_median", "nanmedian", "PeerComparison",
           "peer_comparison", "ChunkBalance", "chunk_balance", "GcStalls", "gc_stalls", "whole_forward", "whole_backward",
           "pieces_sum", "piece_rows", "counted_pieces", "microbatch_key", "ChunkWork", "chunk_work",
           "slow_stages", "usual_work_slower"]


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
        key = microbatch_key(model, ops, chunks)
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


def microbatch_key(model: JobModel, ops: np.ndarray, chunks: int) -> np.ndarray:
    """[len(ops), n_lanes] key of each op's (stage, chunk, microbatch) in each lane; `ops` one op per
    row ([k]) or one per row and lane ([k, lane], as `pairs` gives them)."""
    if ops.ndim == 2:
        return (model.op_stage[ops].astype(np.int64) * chunks + model.op_gmc[ops]) * (1 << 20) + take(model.mb_id, ops)
    return (model.op_stage[ops, None].astype(np.int64) * chunks + model.op_gmc[ops, None]) * (1 << 20) + model.mb_id[ops]


def _main_pieces(model: JobModel, ops: np.ndarray, chunks: int) -> np.ndarray:
    """One op per (stage, chunk, microbatch): a compute a collective cut into pieces (an all-to-all
    inside the forward) is represented by its longest piece (mean over lanes)."""
    key = microbatch_key(model, ops, chunks)[:, 0]
    if len(distinct(key)) == len(ops):
        return ops
    order = np.lexsort((-model.original_cost[ops].mean(axis=1), key))
    first = np.r_[True, key[order][1:] != key[order][:-1]]
    return np.sort(ops[order][first])


def take(values: np.ndarray, ops: np.ndarray) -> np.ndarray:
    """values[op, lane] gathered at ops[k, lane]."""
    return np.take_along_axis(values, ops, axis=0)


def whole_forward(model: JobModel, forward: np.ndarray, cost: np.ndarray | None = None) -> np.ndarray:
    """[k, lane] cost of each forward of `pairs` with the pieces that count (`counted_pieces`): a
    collective inside the forward (an MoE or embedding all-to-all, FSDP's all-gathers) cuts it into
    pieces, and `pairs` keeps the longest as the microbatch's op."""
    return pieces_sum(model, forward, counted_pieces(model, FORWARD), cost)


def whole_backward(model: JobModel, backward: np.ndarray, cost: np.ndarray | None = None) -> np.ndarray:
    """[k, lane] cost of each backward of `pairs` with the pieces that count (`counted_pieces`) and its
    weight-gradient half where a zero-bubble schedule split it off (the backward-weight-compute ops
    of the same stage, chunk and microbatch; chunks split differently: the first chunk's is all
    weight gradients)."""
    return pieces_sum(model, backward, counted_pieces(model, BACKWARD) + (WGT,), cost)


def counted_pieces(model: JobModel, code: int) -> tuple[int, ...]:
    """The op types whose other pieces a compute of type `code` adds up (for `pieces_sum`): on GPU
    ranks its own, since a piece is kernel time, which a peer's lateness never enters; none on CPU
    ranks, where an op is the span of its host call and a piece after a collective holds the wait
    for the slowest peer (a slowed rank's later pieces measure faster than its peers'): the longest
    piece stands for the work there."""
    return () if model.meta.host_compute else (code,)


def pieces_sum(model: JobModel, rows: np.ndarray, codes: tuple[int, ...], cost: np.ndarray | None = None) -> np.ndarray:
    """[k, lane]: cost[rows[k, lane], lane] plus the cost of every other op of the `codes` types of
    the same (stage, chunk, microbatch) in that lane; the ops' own costs where there are none.
    Of the original cost, read-only: the signals of one job ask for the same sums several times
    (peer comparison, chunk balance, GC stalls), so each is computed once per (rows, codes) and
    kept on the model while `rows` lives (a compiled model's original cost never changes in place)."""
    if cost is not None and cost is not model.original_cost:
        return _pieces_sum(model, rows, codes, cost)
    memo = model.__dict__.setdefault("_pieces_sums", {})
    known = memo.get((id(rows), codes))
    if known is not None and known[0]() is rows and known[1] is model.original_cost:
        return known[2]
    out = _pieces_sum(model, rows, codes, model.original_cost)
    out.flags.writeable = False
    memo[(id(rows), codes)] = (weakref.ref(rows), model.original_cost, out)
    return out


def _pieces_sum(model: JobModel, rows: np.ndarray, codes: tuple[int, ...], cost: np.ndarray) -> np.ndarray:
    out = take(cost, rows)
    extra = np.flatnonzero(np.isin(model.op_optype, codes)) if codes else np.zeros(0, np.int64)
    if not len(extra) or not len(rows):
        return out
    used = np.zeros(model.n_ops, dtype=bool)   # the ops some lane's row is (a set: no sort of every row)
    used[rows] = True
    extra = extra[~used[extra]]
    if not len(extra):
        return out
    row_of, alike = piece_rows(model, rows, extra)
    if alike:   # one mapping serves every lane
        found = row_of[:, 0] >= 0
        np.add.at(out, row_of[found, 0], cost[extra[found]])
        return out
    for lane in range(model.n_lanes):
        found = row_of[:, lane] >= 0
        np.add.at(out[:, lane], row_of[found, lane], cost[extra[found], lane])
    return out


def piece_rows(model: JobModel, rows: np.ndarray, ops: np.ndarray) -> tuple[np.ndarray, bool]:
    """[len(ops), n_lanes]: per lane, the row of `rows` ([k, lane], as `pairs` gives them) of the
    same (stage, chunk, microbatch) as each op, -1 where none; and whether every lane maps alike
    (microbatch ids alike in every lane: the usual case, one mapping broadcast)."""
    chunks = int(model.op_gmc.max()) + 2
    key_r, key_o = microbatch_key(model, rows, chunks), microbatch_key(model, ops, chunks)
    alike = bool((key_r == key_r[:, :1]).all() and (key_o == key_o[:, :1]).all())
    row_of = np.full((len(ops), 1 if alike else model.n_lanes), -1, dtype=np.int64)
    for lane in range(row_of.shape[1]):
        order = np.argsort(key_r[:, lane], kind="stable")
        at = np.minimum(np.searchsorted(key_r[order, lane], key_o[:, lane]), len(order) - 1)
        row_of[:, lane] = np.where(key_r[order[at], lane] == key_o[:, lane], order[at], -1)
    return (np.broadcast_to(row_of, (len(ops), model.n_lanes)) if alike else row_of), alike


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
    if values.shape[-1] == 2:   # one other: itself (0.5 * (x + x) is x)
        return values[..., ::-1].copy()
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
    f = whole_forward(model, forward).reshape(shape)
    b = pieces_sum(model, backward, counted_pieces(model, BACKWARD)).reshape(shape)
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


def chunk_balance(model: JobModel, forward: np.ndarray, backward: np.ndarray, cost: np.ndarray | None = None
                  ) -> ChunkBalance | None:
    """ChunkBalance of a pipeline job; None without pipeline stages or forward/backward pairs. cost:
    the work measured per [op, lane] (default the model's; the collections the trainer recorded
    inside compute taken out: the collector's time is no chunk's work)."""
    if model.pp_size < 2 or not len(forward):
        return None
    shape = (len(forward), model.n_steps, model.dp_size)
    work = (whole_forward(model, forward, cost) + whole_backward(model, backward, cost)).reshape(shape)
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
    """Forward stalls: observed forward (every piece, `whole_forward`) minus the forward its backward
    predicts (both halves of a zero-bubble backward, `whole_backward`), per (stage, chunk); a pause
    exceeds both gc_min_stall seconds and gc_sigma robust standard deviations (MAD) of its chunk.
    The prediction is the backward times a forward-to-backward ratio: with DP peers, theirs in the
    same microbatch and step (the leave-one-out median: what moves every rank's forward in a step,
    a collective's wait or the batch's length, moves the ratio alike and is no stall); without, the
    chunk's median over the job."""
    f = whole_forward(model, forward)
    b = whole_backward(model, backward)
    chunk = model.op_stage[forward] * (int(model.op_gmc.max()) + 2) + model.op_gmc[forward]
    ratio = np.empty_like(f)
    for g in distinct(chunk[:, 0]):
        rows = chunk[:, 0] == g
        ratio[rows] = median(f[rows] / b[rows])
    pooled = ratio
    if model.dp_size > 1:
        shape = (len(forward), model.n_steps, model.dp_size)         # lanes are step-major, dp minor
        with np.errstate(divide="ignore", invalid="ignore"):
            own = (f / b).reshape(shape)
        usable = np.isfinite(own).all(axis=2, keepdims=True)
        peers = peer_median(np.where(usable, own, 0.0))
        ratio = np.where(usable, peers, ratio.reshape(shape)).reshape(f.shape)
    expected = ratio * b
    stall = f - expected
    pauses = np.zeros(f.shape, dtype=bool)
    backward_outliers = 0
    for g in distinct(chunk[:, 0]):
        rows = chunk[:, 0] == g
        sigma = 1.4826 * median(np.abs(stall[rows] - median(stall[rows])))
        limit = max(rules.gc_min_stall, rules.gc_sigma * sigma)
        pauses[rows] = stall[rows] > limit
        # the mirror test on backward, at the chunk's own ratio (a peer's pause in the step would
        # lower a worker's backward as its peers predict it): a stall there is not GC's forward-only signature
        backward_outliers += int(((b[rows] - f[rows] / pooled[rows]) > limit).sum())
    return GcStalls(stall, pauses, expected, backward_outliers)


@dataclasses.dataclass(frozen=True)
class ChunkWork:
    """Per model chunk (gmc), from compute ops whose trace counts the operations autograd recorded
    in them (`n_ops`): mean operations and mean seconds per microbatch, forward and backward, and
    where the converter compared operations by identity (`pace`: ingest/kineto/pace.py) the
    chunk's median pace over its forwards and over its backwards. More operations is more work (a heavier
    partition); a slower pace at the same operations is a slower machine doing the same work."""

    chunks: np.ndarray
    ops_forward: np.ndarray
    ops_backward: np.ndarray
    seconds_forward: np.ndarray
    seconds_backward: np.ndarray
    paces: tuple[np.ndarray, np.ndarray] | None = None   # median pace, forward and backward; None: not recorded

    def of(self, chunks) -> tuple[float, float]:
        """(work ratio, speed ratio) of the given chunks against the median chunk: operations per
        microbatch, and the larger over forward and backward of the pace: by operation identity
        where recorded (a heavy operation, a vocabulary-sized LM head, is no slow machine), else
        seconds per operation."""
        mine = np.isin(self.chunks, list(chunks))
        ops = self.ops_forward + self.ops_backward
        work = float(ops[mine].mean() / median(ops))
        if self.paces is not None:
            pace = list(self.paces)
        else:
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
    # each chunk's median `pace` over its forwards and over its backwards, where every one has it: a
    # pause inside some of its microbatches (the collector at a step's first forward) stretches
    # their gaps, not its machine's pace, which stretches every operation
    paces = None
    if "pace" in trace.column_names:
        pace = nullable_values(trace.column("pace"))[compute]
        medians = tuple(np.array([np.median(values) if len(values := pace[mask & np.isfinite(pace) & (index == c)]) else np.nan
                                  for c in range(len(chunks))]) for mask in (forward, backward))
        paces = None if any(np.isnan(m).any() for m in medians) else medians
    return ChunkWork(chunks, per_microbatch(n_ops, forward, forward), per_microbatch(n_ops, backward, kind == BACKWARD),
                     per_microbatch(seconds, forward, forward), per_microbatch(seconds, backward, kind == BACKWARD),
                     paces)


def usual_work_slower(chunks: np.ndarray, work: ChunkWork, more: float, slower: float) -> bool:
    """Whether one of these chunks runs its usual amount of work (< `more` the median) at >= `slower`
    the median pace."""
    return any(speed >= slower and ratio < more for ratio, speed in (work.of([int(g)]) for g in chunks.tolist()))


def slow_stages(model: JobModel, work: ChunkWork, more: float, slower: float) -> list[int]:
    """Pipeline stages whose chunks run their usual amount of work (< `more` the median) at
    >= `slower` the median pace, or one of whose chunks does: machines slower than the others
    (one DP rank: no peers)."""
    out = []
    for p in range(model.pp_size):
        chunks = distinct(model.op_gmc[(model.op_stage == p) & np.isin(model.op_optype, (FORWARD, BACKWARD))])
        ratio, speed = work.of(chunks.tolist())
        if speed >= slower and (ratio < more or usual_work_slower(chunks, work, more, slower)):
            out.append(p)
    return out
