"""Where straggling sits: whether it stands out on one DP rank, stage or step (`localised`), whether
slow transfers gather on one link rather than spread over the job (`comm_localised`), and whether
a worker's slow transfers are its link's and not its host's (`link_not_host`). Each test reads
the job's own spread at the stated false-alarm rate."""
from __future__ import annotations

import math

import numpy as np

from transforms.whatif.causes.sequences import BACKWARD, FORWARD
from transforms.whatif.causes.signals import peer_median
from transforms.whatif.causes.workers import t_sf
from transforms.whatif.model import JobModel, median
from transforms.whatif.result import STRAGGLING_THRESHOLD, WhatIfResult

__all__ = ["localised", "comm_localised", "link_not_host", "stands_out", "transfers_stand_out"]


def stands_out(values, factor: float = 2.0) -> bool:
    """The largest excess is at least `factor` times the next one (and positive)."""
    excess = sorted((max(float(v), 0.0) for v in values), reverse=True)
    return len(excess) >= 2 and excess[0] > 0 and excess[0] >= factor * excess[1]


def comm_localised(model: JobModel, evidence: dict, alpha: float, factor: float = 2.0, floor: float = STRAGGLING_THRESHOLD) -> bool:
    """Whether the transfers beyond their own typical time (the median of the same op over steps
    and DP ranks) gather on one DP rank, stage or step (a bad link, a flapping switch), rather
    than spread over all of them (a busy machine's noise, collectives that vary by nature). A
    step, DP rank or stage counts only when its transfers slowed beyond its compute by `floor` (the
    straggling threshold; `link_not_host`): a slow link slows transfers, not the compute around
    them; where both slow alike it is the host's (contention, a busy rank), not the network's. Recorded in evidence["comm_localised"]."""
    comm = np.flatnonzero(model.op_is_comm)
    if not len(comm):
        return False
    cost = model.original_cost[comm]
    excess = np.maximum(cost - median(cost, axis=1, keepdims=True), 0.0)
    _, step_index = np.unique(model.lane_step, return_inverse=True)
    per_lane = excess.sum(axis=0)
    per_step = np.bincount(step_index, per_lane)

    def beyond_compute() -> bool:
        """The hottest step's transfers beyond the other steps' spread (t against them, n_steps - 2
        degrees of freedom, Bonferroni over the steps, at alpha; three steps at least) and slowed
        beyond its compute by `floor`."""
        hot = int(np.argmax(per_step))
        compute = np.bincount(step_index, model.original_cost[np.isin(model.op_optype, (FORWARD, BACKWARD))].sum(axis=0))
        transfers = np.bincount(step_index, cost.sum(axis=0))
        others = np.delete(transfers, hot)
        if len(others) < 2:
            return False
        with np.errstate(divide="ignore", invalid="ignore"):
            slowed = (transfers[hot] / median(transfers)) / (compute[hot] / median(compute))
            spread = others.std(ddof=1) * math.sqrt(1.0 + 1.0 / len(others))
            p_value = min(1.0, len(transfers) * t_sf(float((transfers[hot] - others.mean()) / spread), len(others) - 1)) \
                if spread > 0 else float(transfers[hot] <= others.mean())
        return (not np.isfinite(slowed) or slowed >= floor) and p_value <= alpha

    per_dp = np.bincount(model.lane_dp, per_lane)
    per_stage = np.bincount(model.op_stage[comm], excess.sum(axis=1), minlength=model.pp_size)
    hot_dp, hot_stage = int(np.argmax(per_dp)), int(np.argmax(per_stage))
    found = (stands_out(per_dp, factor) and link_not_host(model, [(hot_dp, p) for p in range(model.pp_size)], floor, alpha, "dp")) \
        or (stands_out(per_step, factor) and beyond_compute()) \
        or (model.pp_size > 1 and stands_out(per_stage, factor)
            and link_not_host(model, [(d, hot_stage) for d in range(model.dp_size)], floor, alpha, "stage"))
    evidence["comm_localised"] = bool(found)
    return bool(found)


def link_not_host(model: JobModel, workers, floor: float, alpha: float, unit: str = "worker") -> bool:
    """Whether the workers' transfers are slow beyond the job's own spread and beyond their
    compute: a slow link or NIC slows a worker's transfers, not its compute.
    - significant: step by step, the transfer time of what is blamed over its peers' median (log
      ratio; seconds where some are not positive), beyond the job's own spread, in most steps or in
      named ones (`transfers_stand_out`); on CPU ranks a few ms of gloo transfers vary by their
      size between ranks and steps. `unit` says what is blamed: "worker" (each against its stage's
      DP peers, running the same ops; the other stages without DP peers), "dp" (the DP rank's
      transfers over every stage against the other DP ranks') or "stage" (the stage's over every DP
      rank against the other stages');
    - not the host's: each worker's transfers slowed beyond its compute by `floor` (the straggling
      threshold), both against the median worker's; a worker whose compute is as much slower is
      a busy or slow host, whose collectives (CPU work on CPU ranks, late launches on GPUs) slow with it."""
    if not workers or model.n_steps < 2 or model.dp_size * model.pp_size < 2:
        return False
    comm = model.op_is_comm
    compute = np.isin(model.op_optype, (FORWARD, BACKWARD))
    shape = (model.n_steps, model.dp_size)

    def per_worker_step(ops) -> np.ndarray:   # [step, dp, pp] seconds
        out = np.zeros((model.n_steps, model.dp_size, model.pp_size))
        for p in range(model.pp_size):
            mine = ops & (model.op_stage == p)
            out[:, :, p] = model.original_cost[mine].sum(axis=0).reshape(shape)
        return out

    steps = per_worker_step(comm)
    transfers, work = steps.sum(axis=0), per_worker_step(compute).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        slowed = [(transfers[d, p] / median(transfers)) / (work[d, p] / median(work)) for d, p in workers]
    if not all(not np.isfinite(x) or x >= floor for x in slowed):
        return False
    if unit == "dp":
        groups, tested = steps.sum(axis=2)[:, None, :], sorted({d for d, _ in workers})            # [step, 1, dp]
    elif unit == "stage":
        groups, tested = steps.sum(axis=1)[:, None, :], sorted({p for _, p in workers})            # [step, 1, stage]
    elif model.dp_size > 1:
        groups, tested = np.swapaxes(steps, 1, 2), [p * model.dp_size + d for d, p in workers]     # [step, stage, dp]
    else:
        groups, tested = steps.reshape(model.n_steps, 1, -1), [p for _, p in workers]              # [step, 1, stage]
    if groups.shape[2] < 2:
        return False
    if (groups > 0).all():    # durations vary by factors: the log of each over its peers' median
        excess = np.log(groups) - np.log(peer_median(groups))
    else:                     # transfer times near zero, some negative (clock skew): seconds over it
        excess = groups - peer_median(groups)
    excess = excess.reshape(model.n_steps, -1)
    return all(transfers_stand_out(excess, i, alpha) for i in tested)


def transfers_stand_out(excess: np.ndarray, worker: int, alpha: float) -> bool:
    """Whether one worker's transfer excess ([step, worker], over its peers' median) is
    beyond the job's spread, as the worker test asks of compute: persistent (its mean over the
    steps against its own step-to-step spread, one-sided t, Bonferroni over the workers) or
    intermittent (a flapping link: one of its steps against the other workers' excesses over every
    step, Bonferroni over workers x steps), at `alpha`."""
    n_steps, n_workers = excess.shape
    mine = excess[:, worker]
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = mine.std(ddof=1) / math.sqrt(n_steps)
        if spread > 0 and n_workers * t_sf(float(mine.mean() / spread), n_steps - 1) <= alpha:
            return True
        others = np.delete(excess, worker, axis=1).ravel()
        if len(others) < 2:
            return False
        scale = others.std(ddof=1) * math.sqrt(1.0 + 1.0 / len(others))
        if not scale > 0:
            return bool((mine > others.max()).any())
        t = float((mine.max() - others.mean()) / scale)
    return n_workers * n_steps * t_sf(t, len(others) - 1) <= alpha


def localised(result: WhatIfResult, evidence: dict, factor: float = 2.0) -> bool:
    """Whether the straggling stands out somewhere: the hottest DP rank, stage or step holds at
    least `factor` times the excess (S_g - 1) of the next one. Recorded in evidence["localised"]."""
    def hottest_stands_out(slowdowns) -> bool:
        return stands_out([float(v) - 1.0 for v in slowdowns], factor)

    found = any(hottest_stands_out(group.values()) for group in (result.by_dp_rank or {}, result.by_stage or {})) \
        or hottest_stands_out(result.step_slowdown.tolist())
    evidence["localised"] = found
    return found
