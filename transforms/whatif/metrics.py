"""What-if metrics of one job (METHOD.md section 4): S, waste, per-step slowdown,
attribution by DP rank / stage / optype, S_w, M_W and M_S.

All scenarios run through `transforms.whatif.replay.replay` in three batches:
1. original-with-launch-delays, no-delay (T), ideal (T_ideal), M_S remove/add;
2. when S >= 1.03: ideal-but-dp-rank-d, ideal-but-stage-p, ideal-but-optype-t
   (and, when the replay discrepancy is >= 1.03, the launch-delay attribution);
3. M_W remove/add (the worker set depends on S_w from batch 2).

Step-time conventions follow the reference analyzer: step_t_nodelay / step_t_noblk
are the replayed timeline's span (latest end - earliest start); ratios whose
denominator is a replay use the latest optimizer end of that replay.
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from schemas.trace import OPTYPES
from transforms.whatif.model import JobModel, compile_job
from transforms.whatif.replay import DEFAULT_MEMORY_LIMIT, Mix, Scenario, replay
from transforms.whatif.result import ATTRIBUTION_THRESHOLD, Decomposition, JobMeta, WhatIfResult

__all__ = [
    "analyze_job",
    "analyze_model",
    "attribution_groups",
    "worker_set_mask",
    "WORKER_SHARE",
]

WORKER_SHARE = 3   # percent of workers in the M_W set (rounded up)
_PP_COMM = {"forward-send": "forward-pp-comm", "forward-recv": "forward-pp-comm",
            "backward-send": "backward-pp-comm", "backward-recv": "backward-pp-comm"}


def analyze_job(trace: pa.Table, meta: JobMeta, job_id: str = "", *, timeline: bool = False,
                attribution: bool | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT) -> WhatIfResult:
    """Full what-if analysis of one job's trace window.

    trace: op records (lake TRACE_SCHEMA or the published reference parquet schema);
    meta: the job's parallelism. timeline=True keeps the original and ideal timelines
    (result.timeline, exportable with transforms.whatif.timeline.write_chrome_trace).
    attribution: None = the reference's rule (blocking attribution, S_w and M_W when S >= 1.03,
    launch-delay attribution when the replay discrepancy >= 1.03); True = both always;
    False = neither (S, per-step values and M_S only).
    Raises a transforms.whatif.errors.WhatIfError subclass on a trace it cannot analyse.
    """
    return analyze_model(compile_job(trace, meta, job_id), timeline=timeline, attribution=attribution,
                         memory_limit=memory_limit)


def attribution_groups(model: JobModel, merge_pp_comm: bool = True, first_op: bool = False) -> dict[str, np.ndarray]:
    """Optype groups of the attribution -> op mask [n_ops], keys sorted by name.

    merge_pp_comm folds forward send/recv into 'forward-pp-comm' and backward ones into
    'backward-pp-comm'; first_op relabels each stage's first op (forward-compute 0 on
    stage 0, forward-recv 0 elsewhere) as 'first-op', as the launch-delay attribution does."""
    names = np.array([_PP_COMM.get(name, name) if merge_pp_comm else name for name in OPTYPES], dtype=object)[model.op_optype]
    if first_op:
        code = {name: i for i, name in enumerate(OPTYPES)}
        first = (model.op_seq_id == 0) & (
            ((model.op_stage == 0) & (model.op_optype == code["forward-compute"]))
            | ((model.op_stage > 0) & (model.op_optype == code["forward-recv"]))
        )
        names = np.where(first, "first-op", names)
    return {str(name): names == name for name in sorted(set(names.tolist()))}


def worker_set_mask(model: JobModel, workers: list[tuple[int, int]]) -> np.ndarray:
    """[n_ops, n_lanes] mask of the ops of the given (dp_rank, stage) workers."""
    chosen = np.zeros((model.dp_size, model.pp_size), dtype=bool)
    for dp_rank, stage in workers:
        chosen[dp_rank, stage] = True
    return chosen[model.lane_dp][:, model.op_stage].T


def analyze_model(model: JobModel, *, timeline: bool = False, attribution: bool | None = None,
                  memory_limit: int = DEFAULT_MEMORY_LIMIT) -> WhatIfResult:
    """`analyze_job` on an already compiled model."""
    original = model.original_cost
    ideal_ops = model.ideal_cost()
    ideal = ideal_ops[:, None]
    last_stage = [(d, model.pp_size - 1) for d in range(model.dp_size)] if model.pp_size > 1 else []
    last_stage_mask = worker_set_mask(model, last_stage)

    first = [
        Scenario("original", original, model.launch_delay),
        Scenario("nodelay", original),
        Scenario("ideal", ideal, keep_times=timeline),
        *_decomposition_scenarios("ms", original, ideal, last_stage_mask),
    ]
    arrivals = model.carried_arrivals()
    if arrivals is not None:
        first.append(Scenario("arrivals", original, arrivals))
    base = model.step_times_observed()
    batch = replay(model, first, memory_limit=memory_limit)
    nodelay_time, nodelay_span = batch.time("nodelay"), batch.span("nodelay")
    ideal_time, ideal_span = batch.time("ideal"), batch.span("ideal")
    launch_slowdown = base.mean() / nodelay_time.mean()
    slowdown = nodelay_span.mean() / ideal_time.mean()

    result = WhatIfResult(
        job_id=model.job_id, meta=model.meta, steps=model.steps.copy(),
        step_t_base=base, step_t_nodelay=nodelay_span, step_t_noblk=ideal_span,
        launch_slowdown=float(launch_slowdown), slowdown=float(slowdown),
        step_slowdown=nodelay_span / ideal_time,
        launch_step_slowdown=base / nodelay_time,
        step_t_replayed=batch.span("original"),
        ideal_durations=model.ideal_by_optype(ideal_ops),
        worker_rank=model.worker_rank.copy(),
        evidence=model.evidence(),
        step_t_arrivals=None if arrivals is None else batch.span("arrivals"),
    )
    result.ms = _decomposition(batch, "ms", nodelay_span, ideal_span, last_stage)

    blocking = bool(attribution or (attribution is None and slowdown >= ATTRIBUTION_THRESHOLD))
    launch = bool(attribution or (attribution is None and launch_slowdown >= ATTRIBUTION_THRESHOLD))
    if blocking or launch:
        _attribute(model, result, original, ideal, ideal_time, nodelay_time, memory_limit, blocking, launch)
    if blocking:
        workers = _top_workers(model, result.worker_slowdown)
        mask = worker_set_mask(model, workers)
        third = replay(model, _decomposition_scenarios("mw", original, ideal, mask), memory_limit=memory_limit)
        result.mw = _decomposition(third, "mw", nodelay_span, ideal_span, workers)

    if timeline:
        from transforms.whatif.timeline import Timeline

        result.timeline = Timeline.from_replay(model, batch.starts["ideal"], batch.ends["ideal"])
    return result


def _decomposition_scenarios(prefix: str, original: np.ndarray, ideal: np.ndarray, mask: np.ndarray) -> list[Scenario]:
    """`{prefix}-rem`: the no-delay trace with the set idealised; `{prefix}-add`: the ideal with the set original."""
    return [Scenario(f"{prefix}-rem", Mix(original, ideal, mask)), Scenario(f"{prefix}-add", Mix(ideal, original, mask))]


def _decomposition(batch, prefix: str, nodelay_span: np.ndarray, ideal_span: np.ndarray, workers) -> Decomposition:
    tori, tideal = float(nodelay_span.mean()), float(ideal_span.mean())
    trem, tadd = float(batch.span(f"{prefix}-rem").mean()), float(batch.span(f"{prefix}-add").mean())
    gap = tori - tideal
    return Decomposition(
        tori=tori, tideal=tideal, trem=trem, tadd=tadd,
        rem=(tori - trem) / gap if gap else math.nan, add=(tadd - tideal) / gap if gap else math.nan,
        workers=[(int(d), int(p)) for d, p in workers],
    )


def _attribute(model: JobModel, result: WhatIfResult, original, ideal, ideal_time, nodelay_time, memory_limit,
               blocking: bool, launch: bool) -> None:
    """Blocking attribution (S_g of each DP rank, stage and optype group, overall and per step,
    and S_w) and/or launch-delay attribution (no-delay replay with one group's launch delays
    given back, over the no-delay step time), replayed in one batch."""
    dp_keys, stage_keys = list(range(model.dp_size)), list(range(model.pp_size))
    dp_masks = [(model.lane_dp == d)[None, :] for d in dp_keys]
    stage_masks = [(model.op_stage == p)[:, None] for p in stage_keys]
    optype_groups = attribution_groups(model) if blocking else {}
    launch_groups = attribution_groups(model, first_op=True) if launch else {}
    scenarios = []
    if blocking:
        scenarios += [Scenario(f"dp-{d}", Mix(ideal, original, mask)) for d, mask in zip(dp_keys, dp_masks)]
        scenarios += [Scenario(f"stage-{p}", Mix(ideal, original, mask)) for p, mask in zip(stage_keys, stage_masks)]
        scenarios += [Scenario(f"optype-{name}", Mix(ideal, original, ops[:, None])) for name, ops in optype_groups.items()]
    if launch:
        delay = model.launch_delay
        scenarios += [Scenario(f"launch-dp-{d}", original, Mix(0.0, delay, mask)) for d, mask in zip(dp_keys, dp_masks)]
        scenarios += [Scenario(f"launch-stage-{p}", original, Mix(0.0, delay, mask)) for p, mask in zip(stage_keys, stage_masks)]
        scenarios += [Scenario(f"launch-optype-{name}", original, Mix(0.0, delay, ops[:, None]))
                      for name, ops in launch_groups.items()]
    batch = replay(model, scenarios, memory_limit=memory_limit)

    def ratios(prefix: str, keys, reference: np.ndarray):
        per_step = np.stack([batch.time(f"{prefix}{key}") / reference for key in keys], axis=1)
        overall = {key: float(batch.time(f"{prefix}{key}").mean() / reference.mean()) for key in keys}
        return overall, per_step

    if blocking:
        result.by_dp_rank, result.by_dp_rank_per_step = ratios("dp-", dp_keys, ideal_time)
        result.by_stage, result.by_stage_per_step = ratios("stage-", stage_keys, ideal_time)
        result.by_optype, table = ratios("optype-", list(optype_groups), ideal_time)
        result.by_optype_per_step = {name: table[:, i] for i, name in enumerate(optype_groups)}
        result.worker_slowdown = np.minimum(
            np.array([result.by_dp_rank[d] for d in dp_keys])[:, None],
            np.array([result.by_stage[p] for p in stage_keys])[None, :],
        )
    if launch:
        result.launch_by_dp_rank, result.launch_by_dp_rank_per_step = ratios("launch-dp-", dp_keys, nodelay_time)
        result.launch_by_stage, result.launch_by_stage_per_step = ratios("launch-stage-", stage_keys, nodelay_time)
        result.launch_by_optype, table = ratios("launch-optype-", list(launch_groups), nodelay_time)
        result.launch_by_optype_per_step = {name: table[:, i] for i, name in enumerate(launch_groups)}


def _top_workers(model: JobModel, worker_slowdown: np.ndarray) -> list[tuple[int, int]]:
    """The ceil(3%) of workers with the highest S_w; ties go to the lower global rank."""
    count = -(-model.dp_size * model.pp_size * WORKER_SHARE // 100)
    dp_rank, stage = np.indices(worker_slowdown.shape)
    order = np.lexsort((model.worker_rank.ravel(), -worker_slowdown.ravel()))[:count]
    return [(int(dp_rank.ravel()[i]), int(stage.ravel()[i])) for i in order]
