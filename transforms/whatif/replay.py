"""Batched replay: many what-if scenarios of one compiled job in one pass over its levels.

A scenario gives every op of every lane a *cost* (seconds: the duration of an op
outside comm groups, the transfer time of a comm-group member) and optionally a
*launch delay* (seconds, default 0). Replay rule (METHOD.md section 3), per lane
= (step, dp_rank), times relative to the step start:

    start(op) = max(end of its predecessors, or 0 without any) + delay(op)
    end(op)   = start(op) + cost(op)                          outside comm groups
    end(op)   = max(start over its group [and over the step's DP ranks when the
                group is DP-synchronised]) + cost(op)          comm-group members

Arrays are op-major, `[op, lane]` per scenario, `[op, scenario, lane]` inside a
chunk: a level is a contiguous slice of the op axis, so gathering predecessors
copies whole contiguous `[scenario, lane]` rows, and DP synchronisation is a max
over the last axis reshaped to `(step, dp_rank)`. Scenarios are replayed in chunks
sized to `memory_limit` bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import numpy as np

from transforms.whatif.model import JobModel

__all__ = ["Mix", "Scenario", "ReplayResult", "replay", "DEFAULT_MEMORY_LIMIT"]

DEFAULT_MEMORY_LIMIT = 1 << 30   # bytes of replay arrays per chunk of scenarios


@dataclasses.dataclass(frozen=True)
class Mix:
    """`alt` where `where` is true, else `base`; each broadcastable to [n_ops, n_lanes].

    E.g. ideal everywhere but stage 3 original: Mix(ideal[:, None], model.original_cost,
    (model.op_stage == 3)[:, None]); DP rank 1 original: where = (model.lane_dp == 1)[None, :].
    """

    base: np.ndarray | float
    alt: np.ndarray | float
    where: np.ndarray


Values = Union[np.ndarray, float, Mix]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One what-if: per-op costs and launch delays (None = no delays), both [n_ops, n_lanes]
    after broadcasting (or a Mix). keep_times=True keeps its start/end arrays in the result."""

    name: str
    cost: Values
    delay: Values | None = None
    keep_times: bool = False


@dataclasses.dataclass
class ReplayResult:
    """Step times of each replayed scenario (rows in the order given), seconds.

    step_time [n_scenarios, n_steps]: latest optimizer end of the step (all DP ranks).
    step_span [n_scenarios, n_steps]: latest end minus earliest start of any op of the step.
    starts / ends: scenario name -> [n_ops, n_lanes] for scenarios with keep_times.
    """

    names: list[str]
    step_time: np.ndarray
    step_span: np.ndarray
    starts: dict[str, np.ndarray]
    ends: dict[str, np.ndarray]

    def index(self, name: str) -> int:
        return self.names.index(name)

    def time(self, name: str) -> np.ndarray:
        return self.step_time[self.index(name)]

    def span(self, name: str) -> np.ndarray:
        return self.step_span[self.index(name)]


def replay(model: JobModel, scenarios: Sequence[Scenario], *, memory_limit: int = DEFAULT_MEMORY_LIMIT) -> ReplayResult:
    """Replay every scenario over the compiled model; see the module docstring."""
    names = [scenario.name for scenario in scenarios]
    if len(set(names)) != len(names):
        raise ValueError(f"scenario names must be unique: {names}")
    n_scenarios = len(scenarios)
    step_time = np.empty((n_scenarios, model.n_steps))
    step_span = np.empty((n_scenarios, model.n_steps))
    starts: dict[str, np.ndarray] = {}
    ends: dict[str, np.ndarray] = {}
    per_scenario = (model.n_ops + 2) * model.n_lanes * 8 * 3
    chunk = max(1, int(memory_limit // per_scenario))
    for first in range(0, n_scenarios, chunk):
        members = list(range(first, min(first + chunk, n_scenarios)))
        times, spans, kept = _replay_chunk(model, [scenarios[i] for i in members])
        step_time[members] = times
        step_span[members] = spans
        for name, (start, end) in kept.items():
            starts[name], ends[name] = start, end
    return ReplayResult(names, step_time, step_span, starts, ends)


def _fill(out: np.ndarray, values: Values) -> None:
    """Write a scenario's [n_ops, n_lanes] values into `out` (a strided view of the chunk)."""
    if not isinstance(values, Mix):
        np.copyto(out, values)
        return
    np.copyto(out, values.base)
    where = np.asarray(values.where)
    alt = np.broadcast_to(values.alt, out.shape)
    if where.ndim == 2 and where.shape[1] == 1:          # whole ops: copy rows
        rows = np.flatnonzero(where[:, 0])
        out[rows] = alt[rows]
    elif where.ndim == 2 and where.shape[0] == 1:        # whole lanes: copy columns
        columns = np.flatnonzero(where[0])
        out[:, columns] = alt[:, columns]
    else:
        np.copyto(out, alt, where=np.broadcast_to(where, out.shape))


def _replay_chunk(model: JobModel, batch: list[Scenario]):
    n_ops, n_lanes, n_steps, dp = model.n_ops, model.n_lanes, model.n_steps, model.dp_size
    size = len(batch)
    cost = np.empty((n_ops, size, n_lanes))
    with_delay = any(scenario.delay is not None for scenario in batch)
    delay = np.empty((n_ops, size, n_lanes)) if with_delay else None
    for s, scenario in enumerate(batch):
        _fill(cost[:, s, :], scenario.cost)
        if with_delay:
            _fill(delay[:, s, :], 0.0 if scenario.delay is None else scenario.delay)
    keep = any(scenario.keep_times for scenario in batch)
    ends, starts, earliest = _run_levels(model, cost, delay, keep)
    ends = ends[:n_ops]

    shape = (size, n_steps, dp)
    step_time = ends[model.optimizer_ops].max(axis=0).reshape(shape).max(axis=2)
    latest = ends.max(axis=0).reshape(shape).max(axis=2)
    step_span = latest - earliest.reshape(shape).min(axis=2)
    kept = {}
    for s, scenario in enumerate(batch):
        if scenario.keep_times:
            kept[scenario.name] = (starts[:, s, :].copy(), ends[:, s, :].copy())
    return step_time, step_span, kept


def _run_levels(model: JobModel, cost: np.ndarray, delay: np.ndarray | None, keep: bool):
    """Walk the levels once: ends [n_ops + 2, S, L] (row n_ops = step start 0, row n_ops + 1 =
    -inf padding), starts if kept, and the earliest start per [S, L]."""
    n_ops, size, n_lanes = cost.shape
    n_steps, dp = model.n_steps, model.dp_size
    ends = np.empty((n_ops + 2, size, n_lanes))
    ends[n_ops] = 0.0
    ends[n_ops + 1] = -np.inf
    starts = np.empty((n_ops, size, n_lanes)) if keep else None
    # With no negative cost or delay every start is >= the earliest source start, so the
    # earliest start need not be tracked level by level.
    track_earliest = not (cost.min() >= 0 and (delay is None or delay.min() >= 0))
    if track_earliest:
        earliest = np.full((size, n_lanes), np.inf)
    elif delay is None:
        earliest = np.zeros((size, n_lanes))
    else:
        earliest = delay[model.source_ops].min(axis=0)
    for level in model.levels:
        lo, hi, multi_lo, synced_lo = level.lo, level.hi, level.multi_lo, level.synced_lo
        columns = level.pred_columns
        start = ends[columns[0]]
        for column in columns[1:]:
            np.maximum(start, ends[column], out=start)
        if delay is not None:
            start += delay[lo:hi]
        if track_earliest:
            np.minimum(earliest, start.min(axis=0), out=earliest)
        if keep:
            starts[lo:hi] = start
        if multi_lo > lo:
            np.add(start[: multi_lo - lo], cost[lo:multi_lo], out=ends[lo:multi_lo])
        for first, groups, members in level.multi_runs:
            shape = (groups, members, size, n_lanes)
            latest = _group_max(start[first - lo : first - lo + groups * members].reshape(shape))
            span = slice(first, first + groups * members)
            np.add(latest[:, None], cost[span].reshape(shape), out=ends[span].reshape(shape))
        for first, groups, members in level.synced_runs:
            shape = (groups, members, size, n_steps, dp)
            latest = _group_max(start[first - lo : first - lo + groups * members].reshape(shape))
            latest = latest.max(axis=3, keepdims=True)   # DP synchronisation: max over the step's ranks
            span = slice(first, first + groups * members)
            np.add(latest[:, None], cost[span].reshape(shape), out=ends[span].reshape(shape))
    return ends, starts, earliest


def _group_max(members: np.ndarray) -> np.ndarray:
    """Max over axis 1 (the members of each group) by pairwise maximum."""
    latest = members[:, 0].copy()
    for j in range(1, members.shape[1]):
        np.maximum(latest, members[:, j], out=latest)
    return latest
