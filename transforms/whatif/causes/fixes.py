"""Cost arrays ([op, lane] seconds) of each cause's fix, replayed by the engine like any scenario."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from transforms.whatif.causes.sequences import BACKWARD, FORWARD
from transforms.whatif.causes.signals import GcStalls, PeerComparison, counted_pieces, peer_median, piece_rows
from transforms.whatif.model import WGT, JobModel, distinct, median
from transforms.whatif.replay import Mix
from schemas.trace import OPTYPES

__all__ = ["at_peer_speed", "at_others_speed", "at_balance", "rebalanced_stages", "without_pauses", "planned_gc_seconds", "compose"]

_P2P = tuple(OPTYPES.index(name) for name in ("forward-send", "forward-recv", "backward-send", "backward-recv"))


def at_others_speed(model: JobModel, mask: np.ndarray, kinds: Sequence[int] = (FORWARD, BACKWARD)) -> Mix:
    """Cost with the masked entries ([op, lane]) of these compute types at the mean of the same
    type's other entries: METHOD's ideal (one mean per type, model.ideal_cost) without the workers
    being fixed. Without DP peers M_W's workers are fixed at ideal speed, and the ideal mean counts
    their own slow ops: with two stages a forward twice as slow raises the ideal forward by half,
    so its fix keeps half the slowdown (a clean twin measured 1.86x where METHOD's S says 1.17).
    A fix is the others' speed, as a DP rank's is its peers'. A type whose every entry is masked
    keeps METHOD's ideal."""
    ideal = model.ideal_cost().copy()
    cost, classes = model.original_cost, model.ideal_classes()
    for code in kinds:
        for cls in distinct(classes[model.op_optype == code]):
            rows = np.flatnonzero((model.op_optype == code) & (classes == cls))
            hidden = mask[rows]
            n_hidden = int(hidden.sum())
            total = hidden.size
            if n_hidden == 0 or n_hidden == total:
                continue
            others = (float(ideal[rows[0]]) * total - float(cost[rows][hidden].sum())) / (total - n_hidden)
            ideal[rows] = others
    return Mix(cost, ideal[:, None], mask & np.isin(model.op_optype, kinds)[:, None])


def at_peer_speed(model: JobModel, workers: Sequence[tuple[int, int]], peers: PeerComparison,
                  keep: np.ndarray | None = None, only: Mapping[tuple[int, int, str], Sequence[int]] | None = None
                  ) -> np.ndarray:
    """Cost with each given worker's forward (backward) computes divided by its forward (backward)
    ratio to its DP peers, and none above its DP peers' median of the same compute in the same
    step: the machine repaired (its pace, and any stall it alone has in one microbatch), its own
    microbatch variation kept. `keep` ([op, lane]): ops whose excess another cause's fix removes
    (GC pauses) stay at the pace-corrected cost. `only` ((dp, stage, kind) -> step indices): a
    worker slow in some steps only (intermittent) has just those kinds in those steps brought to
    its peers' median; its other steps, at its usual pace, are no cause to fix."""
    cost = model.original_cost.copy()
    shape = (model.n_steps, model.dp_size)                        # lanes are step-major, dp minor
    for code, kind, ratios in ((FORWARD, "forward", peers.forward), (BACKWARD, "backward", peers.backward)):
        for d, p in workers:
            ops = np.flatnonzero((model.op_optype == code) & (model.op_stage == p))
            lanes = np.flatnonzero(model.lane_dp == d)
            intermittent = only is not None and any((d, p) == key[:2] for key in only)
            if intermittent:
                steps = np.asarray(sorted(only.get((d, p, kind), ())), dtype=np.int64)
                if not len(steps):
                    continue
                others = peer_median(model.original_cost[ops].reshape(len(ops), *shape))[:, steps, d]
                lanes = lanes[steps]
                cost[np.ix_(ops, lanes)] = np.minimum(cost[np.ix_(ops, lanes)], others)
                continue
            if np.isfinite(ratios[d, p]) and ratios[d, p] > 0:
                cost[np.ix_(ops, lanes)] /= ratios[d, p]
            if model.dp_size > 1:
                others = peer_median(model.original_cost[ops].reshape(len(ops), *shape))[:, :, d]
                capped = np.minimum(cost[np.ix_(ops, lanes)], others)
                cost[np.ix_(ops, lanes)] = capped if keep is None else \
                    np.where(keep[np.ix_(ops, lanes)], cost[np.ix_(ops, lanes)], capped)
    return cost


def at_balance(model: JobModel, findings) -> np.ndarray:
    """Cost with each finding's slow kind of work (workers.balance_tests: forward, or backward with
    its weight gradients) on its stage divided by its ratio: back at the balance of backward to
    forward the other stages keep (a pipeline without DP peers); an intermittent finding's in its
    named steps only."""
    cost = model.original_cost.copy()
    for finding in findings:
        codes = (FORWARD,) if finding.kind == "forward" else (BACKWARD, WGT)
        ops = np.flatnonzero(np.isin(model.op_optype, codes) & (model.op_stage == finding.worker[1]))
        if finding.persistent:
            cost[ops] /= finding.ratio
        else:
            lanes = np.flatnonzero(np.isin(model.lane_step, model.steps[list(finding.steps)]))
            cost[np.ix_(ops, lanes)] /= finding.ratio
    return cost


def typical_transfers(model: JobModel) -> Mix:
    """Cost with every transfer at its own typical time: the median of that op (same type, stage,
    chunk and place in the step) over the steps and DP ranks. A flapping or slow link is fixed;
    transfers that differ by design (DDP buckets of different sizes, the exposed tail of the last
    bucket) are not counted as slow communication. A Mix of the original cost and one typical time
    per op (no copy of the [op, lane] cost)."""
    comm = model.op_is_comm
    typical = np.zeros((model.n_ops, 1))
    if comm.any():
        typical[comm] = median(model.original_cost[comm], axis=1, keepdims=True)
    return Mix(model.original_cost, typical, comm[:, None])


def rebalanced_stages(model: JobModel) -> np.ndarray:
    """Compute cost with every chunk's mean forward (backward) duration set to the mean over chunks."""
    cost = model.original_cost.copy()
    for code in (FORWARD, BACKWARD):
        ops = np.flatnonzero(model.op_optype == code)
        chunks = model.op_gmc[ops]
        means = {int(g): cost[ops[chunks == g]].mean() for g in distinct(chunks)}
        target = float(np.mean(list(means.values())))
        for g, mean in means.items():
            if mean > 0:
                cost[ops[chunks == g]] *= target / mean
    return cost


def without_pauses(model: JobModel, forward: np.ndarray, gc: GcStalls, min_stall: float) -> np.ndarray:
    """Cost with every detected pause removed, and its echo in pipeline transfers.

    A paused forward takes its expected cost (gc.expected); one whose pieces count
    (signals.counted_pieces: GPU ranks) has each piece brought down to that piece's median over the
    lanes, so the stall comes out of the piece that held it. With batched send+recv (interleaved
    schedules), a record waits for its partner's peer, so a stalled forward also inflates transfer
    times along the pipeline of that lane; in lanes with a pause, p2p transfers longer than their
    type's median by more than min_stall seconds go back to the median. Without a pause, the model's
    own cost array (read-only, as every fix's: no copy of [op, lane] seconds for nothing)."""
    rows, lanes = np.nonzero(gc.pauses)
    if not len(rows):
        return model.original_cost
    cost = model.original_cost.copy()
    pieces = _forward_pieces(model, forward) if counted_pieces(model, FORWARD) else None
    if pieces is None:
        cost[forward[rows, lanes], lanes] = gc.expected[rows, lanes]
    else:   # a forward cut into pieces that count (GPU ranks): each piece of a paused forward at most at its usual cost
        ops, row_of = pieces
        typical = median(cost[ops], axis=1)
        for k, lane in zip(rows.tolist(), lanes.tolist()):
            mine = ops[row_of[:, lane] == k]
            cost[mine, lane] = np.minimum(cost[mine, lane], typical[row_of[:, lane] == k])
    paused_lanes = distinct(lanes)
    for code in _P2P:
        ops = np.flatnonzero(model.op_optype == code)
        if not len(ops) or not len(paused_lanes):
            continue
        typical = median(cost[ops])
        block = cost[np.ix_(ops, paused_lanes)]
        cost[np.ix_(ops, paused_lanes)] = np.where(block > typical + min_stall, typical, block)
    return cost


def _forward_pieces(model: JobModel, forward: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Every forward op and, per lane, the row of `forward` (signals.pairs) whose microbatch it is a
    piece of (-1: none; signals.piece_rows); None where every forward is one op (no collective cuts it)."""
    ops = np.flatnonzero(model.op_optype == FORWARD)
    if len(ops) == len(forward):
        return None
    return ops, piece_rows(model, forward, ops)[0]


def planned_gc_seconds(model: JobModel, forward: np.ndarray, gc: GcStalls) -> float:
    """Step time planned GC adds back: the mean per-worker pause time per step, paid by all at once."""
    worker_key = model.lane_dp[None, :] * model.pp_size + model.op_stage[forward]
    pause_time = np.where(gc.pauses, gc.stall, 0.0)
    per_worker = np.bincount(worker_key.ravel(), weights=pause_time.ravel(), minlength=model.dp_size * model.pp_size)
    return float(per_worker.mean() / model.n_steps)


def compose(model: JobModel, fixes: Sequence[np.ndarray]) -> np.ndarray:
    """Several fixes at once: compute ops take the product of the fixes' speed-ups (a repaired
    worker on a rebalanced stage gets both), other ops the lowest cost any fix gives."""
    original = model.original_cost
    compute = np.isin(model.op_optype, (FORWARD, BACKWARD))[:, None]
    factor = np.ones_like(original)
    lowest = original.copy()
    for cost in fixes:
        np.multiply(factor, np.divide(cost, original, out=np.ones_like(original), where=original > 0), out=factor)
        np.minimum(lowest, cost, out=lowest)
    return np.where(compute, original * factor, lowest)
