"""Is a straggling job's S more than its own jitter makes? The null behind "unexplained".

S >= 1.1 with no cause listed has two readings. Either something structured slows the job and
no fix of ours names it ("unexplained"), or S is what the job's own step-to-step jitter costs:
each step waits for its slowest DP rank, so ranks that take turns being a little slow make S
above 1 with no straggler anyone could fix ("none"). The replay tells them apart.

The null is the job itself with its computes at their METHOD.md ideal and the variation it shows
put back. Its transfers take the times they ran, each draw with the lanes (steps and DP ranks)
shuffled: how much they vary is the job's, where the slow ones fall is chance (a structured
transfer problem, a slow link, is the communication cause's to name before this null is asked).
So do the other ops a worker runs on its own (the optimizer, gradient clipping, traced GC), each
op with its own shuffle: held at their means they would vary less than the job shows (on CPU ranks
sharing cores the optimizer is as contended as the compute), and the null would call the job's
own variation structure.
Its compute takes the jitter the worker test measured: each worker's compute (forward and
backward) in each sample (a profiled step; a microbatch when the worker test's unit is one)
multiplied by exp(s z + t u), z per sample and u per worker standard normal, s the per-worker jitter and t the persistent offset healthy
peers keep (the worker test's sigma and tau compare a worker with the median of its peers, so
both are divided by sqrt(1 + var(that median))). Each draw takes its own sigma from the
estimate's scaled inverse chi-square (its degrees of freedom: few steps, a wide null), and its
factors are scaled to mean 1 (the op types' means, the ideal, stay where they are). `DRAWS`
replays of the null, batched, give S_null; the Monte Carlo p-value of the observed S is
(1 + #{S_null >= S}) / (DRAWS + 1). At the job's false-alarm rate an S the null reaches is the
job's jitter ("none"), one beyond every draw is structure nobody explains ("unexplained").
Seeded, so reruns give the same verdict.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from schemas.trace import OPTYPES
from transforms.whatif.causes.workers import WorkerTests, median_variance
from transforms.whatif.model import JobModel, median
from transforms.whatif.replay import Scenario, replay
from transforms.whatif.result import WhatIfResult

__all__ = ["DRAWS", "JitterNull", "jitter_null"]

DRAWS = 99                      # the least that can reach p = 0.01: (1 + 0) / (99 + 1)
_BATCH_BYTES = 256 * 2 ** 20    # cost arrays replayed at once
_COMPUTE = tuple(OPTYPES.index(t) for t in ("forward-compute", "backward-compute", "backward-weight-compute"))


@dataclasses.dataclass(frozen=True)
class JitterNull:
    """S under the job's own jitter. p_value: Monte Carlo, of the observed S; quantile: S the
    null reaches at 1 - alpha; median: its typical S; jitter / offset: per-worker log jitter per
    sample and persistent offset put back; draws: replays of the null."""

    slowdown: float
    p_value: float
    quantile: float
    median: float
    jitter: float
    offset: float
    draws: int
    unit: str

    def within(self, alpha: float) -> bool:
        """Whether the observed S is one the job's jitter makes at false-alarm rate alpha."""
        return self.p_value > alpha

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def jitter_null(model: JobModel, result: WhatIfResult, tests: WorkerTests, alpha: float,
                draws: int = DRAWS, seed: int = 0) -> JitterNull | None:
    """The null of module docstring for a job whose worker test measured its jitter (DP peers,
    a finite sigma); None otherwise (nothing to build the null from)."""
    if not tests.peers or not math.isfinite(tests.sigma) or tests.df < 1 or model.dp_size < 2:
        return None
    compute = np.flatnonzero(np.isin(model.op_optype, _COMPUTE))
    if not len(compute) or result.slowdown <= 0:
        return None
    scale = math.sqrt(1.0 + median_variance(model.dp_size - 1))
    jitter, offset = tests.sigma / scale, tests.tau / scale
    cells, shape = _sample_cells(model, compute, tests.unit)          # [compute op, lane] -> sample cell
    rng = np.random.default_rng(seed)
    ideal = np.asarray(model.ideal_cost(), dtype=np.float64)
    transfers = np.flatnonzero(model.op_is_comm)
    observed = model.original_cost[transfers]
    local = np.setdiff1d(np.arange(model.n_ops), np.union1d(compute, transfers))   # optimizer, clipping, GC
    local_observed = model.original_cost[local]
    per_draw = max(1, _BATCH_BYTES // max(1, model.n_ops * model.n_lanes * 8))
    ideal_time = float(result.step_t_nodelay.mean()) / float(result.slowdown)
    spans = []
    for first in range(0, draws, per_draw):
        scenarios = []
        for k in range(first, min(draws, first + per_draw)):
            s = jitter * math.sqrt(tests.df / rng.chisquare(tests.df))
            z = rng.standard_normal(shape)                                # [stage, sample, dp]
            u = rng.standard_normal((shape[0], 1, shape[2]))              # [stage, 1, dp]
            factor = np.exp(s * z + offset * u)
            factor /= factor.mean()
            cost = np.broadcast_to(ideal[:, None], (model.n_ops, model.n_lanes)).copy()
            cost[compute] *= factor.reshape(-1)[cells]
            cost[transfers] = observed[:, rng.permutation(model.n_lanes)]
            cost[local] = rng.permuted(local_observed, axis=1)          # each op's lanes shuffled on their own
            scenarios.append(Scenario(f"null{k}", cost))
        replayed = replay(model, scenarios)
        spans.extend(float(replayed.span(s.name).mean()) for s in scenarios)
    null = np.asarray(spans) / ideal_time
    observed = float(result.slowdown)
    p_value = (1.0 + float((null >= observed).sum())) / (len(null) + 1.0)
    return JitterNull(observed, p_value, float(np.quantile(null, 1.0 - alpha)), float(median(null)),
                      jitter, offset, len(null), tests.unit)


def _sample_cells(model: JobModel, compute: np.ndarray, unit: str) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Per [compute op, lane], the flat index of its (stage, sample, dp) cell, and the cells' shape.
    Lanes are step-major, dp minor; a sample is a step, or (step, microbatch) when the unit is
    "microbatch" (the op's microbatch id; ops without one share the step's)."""
    step = (np.arange(model.n_lanes) // model.dp_size)[None, :]
    dp = model.lane_dp[None, :]
    stage = model.op_stage[compute][:, None]
    if unit == "microbatch" and model.mb_id is not None and model.mb_id.shape == (model.n_ops, model.n_lanes):
        mb = np.maximum(model.mb_id[compute], 0)
        _, mb = np.unique(mb, return_inverse=True)
        mb = mb.reshape(len(compute), model.n_lanes)
        per_step = int(mb.max()) + 1
        sample = step * per_step + mb
        n_samples = model.n_steps * per_step
    else:
        sample, n_samples = np.broadcast_to(step, (len(compute), model.n_lanes)), model.n_steps
    shape = (model.pp_size, n_samples, model.dp_size)
    return np.ravel_multi_index((np.broadcast_to(stage, sample.shape), sample, np.broadcast_to(dp, sample.shape)), shape), shape
