"""Compiled replay kernel (numba), used for big jobs; `replay.py`'s numpy path is the reference.

The numpy path walks the levels with a few vectorised calls per level over
`[op, scenario, lane]` blocks: Python cost per level, but every value crosses memory
several times (gathers, temporaries, the scenario arrays themselves). This kernel runs
the same replay rule (replay.py's docstring) as one compiled loop per scenario, a block
of steps at a time: the block's `[op, lane]` starts and ends stay in cache, every inner
loop is a vectorised pass over the block's lanes, each scenario's cost and delay are
read straight from its `Mix` parts (no materialised `[op, lane]` arrays), and only step
times and spans come back, so memory stays at the model's own arrays.

It computes the same float64 operations as the numpy path -- max over predecessors,
`+ delay`, max over comm-group members (and over the step's DP ranks when synchronised),
`+ cost` -- so results are equal bit for bit (tests/test_whatif_replay.py checks every
schedule variant both ways). numba is optional: without it, or below `KERNEL_MIN_OP_LANES`
(where importing numba, ~0.2 s, costs more than it saves), replay uses numpy.
`STRAG_REPLAY=numpy|kernel` forces one path (tests, benchmarks).
"""
from __future__ import annotations

import os

import numpy as np

__all__ = ["KERNEL_MIN_OP_LANES", "BLOCK_LANES", "available", "wanted", "canonical", "replay_scenario", "op_layout"]

# Below this many op-lanes (n_ops x n_lanes) numpy's per-level cost is smaller than numba's import.
KERNEL_MIN_OP_LANES = 1_000_000
# Lanes replayed together (whole steps): long enough rows to vectorise, short enough for cache.
BLOCK_LANES = 256
_ENV = "STRAG_REPLAY"


def available() -> bool:
    """Whether numba can be imported (imports it: call only when the kernel would be used)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def wanted(op_lanes: int) -> bool:
    """Use the kernel for a replay of this many op-lanes? (STRAG_REPLAY=numpy|kernel forces it.)"""
    choice = os.environ.get(_ENV, "auto")
    if choice not in ("auto", "numpy", "kernel"):
        raise ValueError(f"{_ENV}={choice!r}: expected auto, numpy or kernel")
    if choice == "numpy":
        return False
    if choice == "kernel":
        if not available():
            raise RuntimeError(f"{_ENV}=kernel but numba cannot be imported: pip install numba")
        return True
    return op_lanes >= KERNEL_MIN_OP_LANES and available()


def op_layout(model) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(level bounds [n_levels + 1], group end [n_ops], synced [n_ops], optimizer [n_ops]) of a
    model: a group's members are contiguous in replay order, so each op records where its group
    ends (its own op + 1 outside groups); the first member stands for the group."""
    bounds = np.array([level.lo for level in model.levels] + [model.n_ops], dtype=np.int64)
    group = model.op_group
    group_end = np.arange(1, model.n_ops + 1, dtype=np.int64)
    members = np.flatnonzero(group >= 0)
    if len(members):
        last = np.flatnonzero(np.diff(np.append(group[members], -2)))   # last member of each group
        ends = members[last] + 1
        group_end[members] = np.repeat(ends, np.diff(np.concatenate([[-1], last])))
    synced = np.zeros(model.n_ops, dtype=np.bool_)
    synced[members] = model.group_synced[group[members]]
    optimizer = np.zeros(model.n_ops, dtype=np.bool_)
    optimizer[model.optimizer_ops] = True
    return bounds, group_end, synced, optimizer


def _kernel():
    """The compiled kernel (numba imported and the function compiled or loaded from cache on first use)."""
    global _COMPILED
    if _COMPILED is None:
        import numba
        from numba import types

        index, flag = types.Array(types.int64, 1, "C"), types.Array(types.boolean, 1, "C")
        values = types.Array(types.float64, 2, "C", readonly=True)
        mask = types.Array(types.boolean, 2, "C", readonly=True)
        out2, out1 = types.Array(types.float64, 2, "C"), types.Array(types.float64, 1, "C")
        # One explicit signature: one compilation, cached beside this file.
        signature = types.void(index, index, index, index, flag, flag, types.int64, types.int64, types.int64,
                               values, values, mask, values, values, mask, types.boolean,
                               types.boolean, out2, out2, out1, out1)
        _COMPILED = numba.njit(signature, cache=True, nogil=True, error_model="numpy")(_replay_block)
    return _COMPILED


_COMPILED = None


def canonical(values, dtype, shape: tuple[int, int]) -> np.ndarray:
    """`values` as a read-only C-contiguous 2-D array of `dtype` whose dims are 1 or `shape`'s
    (a lane-independent value stays [n_ops or 1, 1]: the kernel reads what it needs, no copy
    of a full [op, lane] array is made unless its layout demands one)."""
    array = np.asarray(values, dtype=dtype)
    if array.ndim > 2:
        raise ValueError(f"scenario values must broadcast to [n_ops, n_lanes] = {shape}, got shape {array.shape}")
    array = array.reshape((1,) * (2 - array.ndim) + array.shape)
    if any(size not in (1, full) for size, full in zip(array.shape, shape)):
        array = np.broadcast_to(array, shape)
    view = np.ascontiguousarray(array).view()
    view.flags.writeable = False
    return view


def replay_scenario(model, layout, n_steps: int, dp: int, parts, keep: bool):
    """One scenario over n_steps x dp lanes: (step_time [n_steps], step_span [n_steps], starts, ends).

    parts: (cost base, cost alt, cost where, delay base, delay alt, delay where, has delay) as
    `canonical` arrays. starts / ends are [n_ops, n_steps * dp] when keep, else None."""
    bounds, group_end, synced, optimizer = layout
    step_time = np.empty(n_steps)
    step_span = np.empty(n_steps)
    shape = (model.n_ops, n_steps * dp) if keep else (0, 0)
    starts, ends = np.empty(shape), np.empty(shape)
    block = max(1, BLOCK_LANES // dp)
    _kernel()(model.pred_ptr, model.pred_index, bounds, group_end, synced, optimizer, n_steps, dp, block,
              *parts, keep, starts, ends, step_time, step_span)
    return step_time, step_span, (starts if keep else None), (ends if keep else None)


def _replay_block(pred_ptr, pred_index, bounds, group_end, synced, optimizer, n_steps, dp, block,
                  cost_base, cost_alt, cost_where, delay_base, delay_alt, delay_where, has_delay,
                  keep, starts_out, ends_out, step_time, step_span):
    """Replay one scenario, `block` steps at a time; see the module docstring (compiled by numba).

    Rows of `starts` / `ends` hold the block's lanes (contiguous), so every inner loop is a
    vectorised pass over up to BLOCK_LANES values; the earliest start, latest end and latest
    optimizer end are kept per lane and reduced per step at the end of the block."""
    n_ops = pred_ptr.shape[0] - 1
    width_max = block * dp
    ends = np.empty((n_ops + 1, width_max))
    starts = np.empty((n_ops, width_max))
    latest = np.empty(width_max)
    low = np.empty(width_max)
    high = np.empty(width_max)
    top_opt = np.empty(width_max)
    for first_step in range(0, n_steps, block):
        nb = min(block, n_steps - first_step)
        w = nb * dp
        first_lane = first_step * dp
        ends[n_ops, :w] = 0.0
        low[:w] = np.inf
        high[:w] = -np.inf
        top_opt[:w] = -np.inf
        for level in range(bounds.shape[0] - 1):
            lo, hi = bounds[level], bounds[level + 1]
            for op in range(lo, hi):
                row = starts[op]
                src = ends[pred_index[pred_ptr[op]]]
                for j in range(w):
                    row[j] = src[j]
                for k in range(pred_ptr[op] + 1, pred_ptr[op + 1]):   # max over predecessors
                    src = ends[pred_index[k]]
                    for j in range(w):
                        v = src[j]
                        row[j] = v if v > row[j] else row[j]
                if has_delay:
                    wr = delay_where[op if delay_where.shape[0] > 1 else 0]
                    br = delay_base[op if delay_base.shape[0] > 1 else 0]
                    ar = delay_alt[op if delay_alt.shape[0] > 1 else 0]
                    bs = 1 if delay_base.shape[1] > 1 else 0
                    as_ = 1 if delay_alt.shape[1] > 1 else 0
                    ws = 1 if delay_where.shape[1] > 1 else 0
                    for j in range(w):
                        lane = first_lane + j
                        row[j] += ar[lane * as_] if wr[lane * ws] else br[lane * bs]
                for j in range(w):
                    v = row[j]
                    low[j] = v if v < low[j] else low[j]
            op = lo
            while op < hi:                                    # ends, one group (or own op) at a time
                stop = group_end[op]
                s0 = starts[op]
                for j in range(w):
                    latest[j] = s0[j]
                for member in range(op + 1, stop):
                    sm = starts[member]
                    for j in range(w):
                        v = sm[j]
                        latest[j] = v if v > latest[j] else latest[j]
                if synced[op]:                                # DP synchronisation: max over each step's ranks
                    for s in range(nb):
                        top = latest[s * dp]
                        for d in range(1, dp):
                            v = latest[s * dp + d]
                            top = v if v > top else top
                        for d in range(dp):
                            latest[s * dp + d] = top
                for member in range(op, stop):
                    out = ends[member]
                    wr = cost_where[member if cost_where.shape[0] > 1 else 0]
                    if cost_where.shape[1] == 1:              # one source for the whole row
                        source = cost_alt if wr[0] else cost_base
                        sr = source[member if source.shape[0] > 1 else 0]
                        if source.shape[1] == 1:
                            c = sr[0]
                            for j in range(w):
                                out[j] = latest[j] + c
                        else:
                            for j in range(w):
                                out[j] = latest[j] + sr[first_lane + j]
                    else:
                        br = cost_base[member if cost_base.shape[0] > 1 else 0]
                        ar = cost_alt[member if cost_alt.shape[0] > 1 else 0]
                        bs = 1 if cost_base.shape[1] > 1 else 0
                        as_ = 1 if cost_alt.shape[1] > 1 else 0
                        for j in range(w):
                            lane = first_lane + j
                            out[j] = latest[j] + (ar[lane * as_] if wr[lane] else br[lane * bs])
                    for j in range(w):
                        v = out[j]
                        high[j] = v if v > high[j] else high[j]
                    if optimizer[member]:
                        for j in range(w):
                            v = out[j]
                            top_opt[j] = v if v > top_opt[j] else top_opt[j]
                op = stop
        for s in range(nb):
            e, l, o = np.inf, -np.inf, -np.inf
            for d in range(dp):
                j = s * dp + d
                e = low[j] if low[j] < e else e
                l = high[j] if high[j] > l else l
                o = top_opt[j] if top_opt[j] > o else o
            step_time[first_step + s] = o
            step_span[first_step + s] = l - e
        if keep:
            starts_out[:, first_lane:first_lane + w] = starts[:, :w]
            ends_out[:, first_lane:first_lane + w] = ends[:n_ops, :w]
