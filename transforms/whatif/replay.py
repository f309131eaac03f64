"""Batched replay: many what-if scenarios of one compiled job in one pass over its levels.

A scenario gives every op of every lane a *cost* (seconds: the duration of an op
outside comm groups, the transfer time of a comm-group member) and optionally a
*launch delay* (seconds, default 0). Replay rule (METHOD.md section 3), per lane
= (step, dp_rank), times relative to the step start:

    start(op) = max(end of its predecessors, or 0 without any) + delay(op)
    end(op)   = start(op) + cost(op)                          outside comm groups
    end(op)   = max(start over its group [and over the step's DP ranks when the
                group is DP-synchronised]) + cost(op)          comm-group members

Only the lanes that can differ are replayed (`lane_plan`): where a scenario's lanes take
the same lane-independent values (the ideal cost everywhere but in DP rank d, say), one
of them stands for all, which is exact because identical inputs give identical timelines.

Two backends give equal results bit for bit. numpy (the reference): arrays are op-major,
`[op, lane]` per scenario, `[op, scenario, lane]` inside a chunk: a level is a contiguous
slice of the op axis, so gathering predecessors copies whole contiguous
`[scenario, lane]` rows, and DP synchronisation is a max over the last axis reshaped to
`(step, dp_rank)`; scenarios are replayed in chunks sized to `memory_limit` bytes. The
compiled kernel (kernel.py, C) runs the same operations scenario by scenario whenever it
can be built, several scenarios at once on threads inside `replay_threads(n)`;
`STRAG_REPLAY=numpy|kernel` forces one.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from typing import Iterator, Sequence, Union

import numpy as np

import transforms.whatif.kernel as kernel
from transforms.whatif.model import JobModel

__all__ = ["Mix", "Scenario", "ReplayResult", "replay", "replay_threads", "replay_thread_count", "DEFAULT_MEMORY_LIMIT"]

DEFAULT_MEMORY_LIMIT = 1 << 30   # bytes of replay arrays per chunk of scenarios
_POOL = contextvars.ContextVar("strag_replay_pool", default=(1, None))   # (threads, their executor)


@contextlib.contextmanager
def replay_threads(threads: int) -> Iterator[None]:
    """Within the block, `replay` runs up to `threads` scenarios at once (compiled kernel only),
    on one pool of threads that every replay of the block shares.

    For a one-job command, which has the machine's cores to itself: the analysis and the
    classifier replay through several layers of calls, which need not pass it along. Beam
    workers keep the default of 1: their processes already share the cores."""
    threads = max(1, int(threads))
    with contextlib.ExitStack() as stack:
        pool = None
        if threads > 1:
            from concurrent.futures import ThreadPoolExecutor   # here: a one-job command's path only

            pool = stack.enter_context(ThreadPoolExecutor(threads, thread_name_prefix="strag-replay"))
        token = _POOL.set((threads, pool))
        try:
            yield
        finally:
            _POOL.reset(token)


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


def replay_thread_count() -> int:
    """The threads `replay` uses here (`replay_threads`' setting, else 1)."""
    return _POOL.get()[0]


def replay(model: JobModel, scenarios: Sequence[Scenario], *, memory_limit: int = DEFAULT_MEMORY_LIMIT) -> ReplayResult:
    """Replay every scenario over the compiled model; see the module docstring. Inside
    `replay_threads(n)` the compiled kernel replays n scenarios at once (it runs without the GIL)."""
    names = [scenario.name for scenario in scenarios]
    if len(set(names)) != len(names):
        raise ValueError(f"scenario names must be unique: {names}")
    step_time = np.empty((len(scenarios), model.n_steps))
    step_span = np.empty((len(scenarios), model.n_steps))
    starts: dict[str, np.ndarray] = {}
    ends: dict[str, np.ndarray] = {}
    plans: dict[LanePlan, list[int]] = {}
    for index, scenario in enumerate(scenarios):
        plans.setdefault(lane_plan(model, scenario), []).append(index)
    groups = []
    for plan, members in plans.items():
        lanes, taken = plan.lanes(model), {}
        batch = [scenarios[i] if lanes is None else _on_lanes(scenarios[i], lanes, taken) for i in members]
        groups.append(_Group(members, plan.n_steps(model), plan.dp(model), batch,
                             [_nonnegative(model, scenarios[i]) for i in members]))
    if kernel.wanted():
        outcomes = _replay_compiled(model, groups, _POOL.get()[1])
    else:
        outcomes = [_replay_numpy(model, group.n_steps, group.dp, group.scenarios, memory_limit) for group in groups]
    for group, (times, spans, kept) in zip(groups, outcomes):
        step_time[group.members] = times   # [members, 1] broadcasts when one lane stands for every step
        step_span[group.members] = spans
        for name, (start, end) in kept.items():
            starts[name], ends[name] = start, end
    return ReplayResult(names, step_time, step_span, starts, ends)


@dataclasses.dataclass(frozen=True)
class _Group:
    """Scenarios of one lane plan, restricted to its lanes: `members` are their indices in the batch."""

    members: list[int]
    n_steps: int
    dp: int
    scenarios: list[Scenario]
    nonnegative: list[bool]   # per scenario: no cost or delay below 0 (nor NaN), see _nonnegative


@dataclasses.dataclass(frozen=True)
class LanePlan:
    """Which lanes a scenario needs replayed. Lanes whose every cost and delay comes from the
    same lane-independent source (e.g. the ideal cost in all lanes but DP rank d's) have equal
    timelines, so one of them stands for all: `ranks` are the DP ranks replayed in every step
    (all of them, or the others plus one per such class), or with `every_step=False` a single
    lane stands for every lane of every step (a scenario with no lane-dependent value)."""

    ranks: tuple[int, ...] | None = None   # None: all DP ranks
    every_step: bool = True

    def n_steps(self, model: JobModel) -> int:
        return model.n_steps if self.every_step else 1

    def dp(self, model: JobModel) -> int:
        return model.dp_size if self.ranks is None else len(self.ranks)

    def lanes(self, model: JobModel) -> np.ndarray | None:
        """Lane indices replayed (None: all lanes, in order)."""
        if self.ranks is None:
            return None
        steps = np.arange(self.n_steps(model))[:, None] * model.dp_size
        return (steps + np.array(self.ranks)[None, :]).ravel()


ALL_LANES = LanePlan()


def lane_plan(model: JobModel, scenario: Scenario) -> LanePlan:
    """The fewest lanes that give `scenario`'s step times exactly (see LanePlan)."""
    if scenario.keep_times:
        return ALL_LANES
    cost = _lane_sources(scenario.cost, model.n_lanes)
    delay = _lane_sources(0.0 if scenario.delay is None else scenario.delay, model.n_lanes)
    classes = np.where((cost < 0) | (delay < 0), -1, cost * 2 + delay).reshape(model.n_steps, model.dp_size)
    row = classes[0]
    if (classes != row).any():
        return ALL_LANES
    if (row >= 0).all() and (row == row[0]).all():
        return LanePlan((0,), every_step=False)
    kept = sorted({*np.flatnonzero(row < 0).tolist(), *(int(np.argmax(row == c)) for c in set(row.tolist()) - {-1})})
    return ALL_LANES if len(kept) == model.dp_size else LanePlan(tuple(kept))


def _lane_free(values) -> bool:
    """Whether an array (or scalar) broadcast to [n_ops, n_lanes] is the same in every lane."""
    shape = np.shape(values)
    return not shape or shape[-1] == 1


def _lane_sources(values: Values, n_lanes: int) -> np.ndarray:
    """Per lane: 0 (1) when every op of the lane takes the base (alt) and that is lane-independent, else -1."""
    if not isinstance(values, Mix):
        return np.full(n_lanes, 0 if _lane_free(values) else -1)
    where = np.asarray(values.where, dtype=bool)
    where = where.reshape((1,) * (2 - where.ndim) + where.shape)
    sources = np.full(n_lanes, -1)
    if _lane_free(values.base):
        sources[np.broadcast_to(~where.any(axis=0), (n_lanes,))] = 0
    if _lane_free(values.alt):
        sources[np.broadcast_to(where.all(axis=0), (n_lanes,))] = 1
    return sources


def _on_lanes(scenario: Scenario, lanes: np.ndarray, taken: dict[int, np.ndarray]) -> Scenario:
    """The scenario restricted to the given lanes (lane-independent values are kept as they are;
    `taken` memoises restrictions by array identity: scenarios of a batch share their arrays)."""
    def take(values):
        if isinstance(values, Mix):
            return Mix(take(values.base), take(values.alt), take(values.where))
        if _lane_free(values):
            return values
        if id(values) not in taken:
            taken[id(values)] = np.take(values, lanes, axis=-1)   # faster than [..., lanes]
        return taken[id(values)]

    delay = None if scenario.delay is None else take(scenario.delay)
    return dataclasses.replace(scenario, cost=take(scenario.cost), delay=delay)


def _replay_numpy(model: JobModel, n_steps: int, dp: int, scenarios: Sequence[Scenario], memory_limit: int):
    """Numpy backend: scenarios in chunks of `memory_limit` bytes, each chunk one pass over the levels."""
    times, spans, kept = [], [], {}
    per_scenario = (model.n_ops + 2) * n_steps * dp * 8 * 3
    chunk = max(1, int(memory_limit // per_scenario))
    for first in range(0, len(scenarios), chunk):
        step_time, step_span, chunk_kept = _replay_chunk(model, n_steps, dp, scenarios[first:first + chunk])
        times.append(step_time)
        spans.append(step_span)
        kept.update(chunk_kept)
    return np.concatenate(times), np.concatenate(spans), kept


def _replay_compiled(model: JobModel, groups: Sequence[_Group], pool) -> list[tuple]:
    """Compiled backend (kernel.py): one kernel call per scenario, no chunk arrays; with a
    pool (an Executor) as many at once as it has threads, the widest first (they take
    longest). Per group: (step_time, step_span, kept) as _replay_numpy returns them."""
    layout = kernel.op_layout(model)
    tasks = [(g, s) for g, group in enumerate(groups) for s in range(len(group.scenarios))]
    tasks.sort(key=lambda task: -groups[task[0]].n_steps * groups[task[0]].dp)

    def run(task: tuple[int, int]):
        group = groups[task[0]]
        scenario, shape = group.scenarios[task[1]], (model.n_ops, group.n_steps * group.dp)
        delay = _parts(0.0 if scenario.delay is None else scenario.delay, shape)
        parts = (*_parts(scenario.cost, shape), *delay, scenario.delay is not None)
        return kernel.replay_scenario(model, layout, group.n_steps, group.dp, parts, scenario.keep_times,
                                      group.nonnegative[task[1]])

    if pool is not None and len(tasks) > 1:
        replayed = dict(zip(tasks, pool.map(run, tasks)))
    else:
        replayed = {task: run(task) for task in tasks}
    outcomes = []
    for g, group in enumerate(groups):
        rows = [replayed[g, s] for s in range(len(group.scenarios))]
        kept = {scenario.name: (start, end) for scenario, (_, _, start, end) in zip(group.scenarios, rows)
                if scenario.keep_times}
        outcomes.append((np.array([row[0] for row in rows]), np.array([row[1] for row in rows]), kept))
    return outcomes


def _nonnegative(model: JobModel, scenario: Scenario) -> bool:
    """No value a scenario's cost or delay can take (a Mix's base or alt) is below 0, nor NaN: the
    kernel then tracks a step's earliest start and latest end on its sources and sinks alone
    (kernel.op_layout). The least value of each array is computed once per model (scenarios share
    the model's cost and delay arrays), remembered while the array lives."""
    lowest = model.__dict__.setdefault("_lowest_values", {})

    def least(values) -> float:
        if isinstance(values, Mix):
            return float(np.minimum(least(values.base), least(values.alt)))   # NaN stays NaN
        if not isinstance(values, np.ndarray):
            return float(np.min(values))
        known = lowest.get(id(values))
        if known is None or known[0]() is not values:
            known = lowest[id(values)] = (weakref.ref(values), float(values.min()) if values.size else 0.0)
        return known[1]

    return least(scenario.cost) >= 0.0 and (scenario.delay is None or least(scenario.delay) >= 0.0)   # NaN: False


def _parts(values: Values, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(base, alt, where) of a scenario's values as the kernel's canonical arrays (float64,
    float64, bool): the kernel takes alt where `where`, else base."""
    if isinstance(values, Mix):
        return (kernel.canonical(values.base, np.float64, shape), kernel.canonical(values.alt, np.float64, shape),
                kernel.canonical(values.where, np.bool_, shape))
    base = kernel.canonical(values, np.float64, shape)
    return base, base, kernel.canonical(False, np.bool_, shape)


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


def _replay_chunk(model: JobModel, n_steps: int, dp: int, batch: Sequence[Scenario]):
    n_ops, n_lanes = model.n_ops, n_steps * dp
    size = len(batch)
    cost = np.empty((n_ops, size, n_lanes))
    with_delay = any(scenario.delay is not None for scenario in batch)
    delay = np.empty((n_ops, size, n_lanes)) if with_delay else None
    for s, scenario in enumerate(batch):
        _fill(cost[:, s, :], scenario.cost)
        if with_delay:
            _fill(delay[:, s, :], 0.0 if scenario.delay is None else scenario.delay)
    keep = any(scenario.keep_times for scenario in batch)
    ends, starts, earliest = _run_levels(model, n_steps, dp, cost, delay, keep)
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


def _run_levels(model: JobModel, n_steps: int, dp: int, cost: np.ndarray, delay: np.ndarray | None, keep: bool):
    """Walk the levels once: ends [n_ops + 2, S, L] (row n_ops = step start 0, row n_ops + 1 =
    -inf padding), starts if kept, and the earliest start per [S, L]."""
    n_ops, size, n_lanes = cost.shape
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
        lo, hi, multi_lo = level.lo, level.hi, level.multi_lo
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
