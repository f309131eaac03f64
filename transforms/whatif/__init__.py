"""The what-if engine (METHOD.md sections 2-4): plain Python + numpy, no Beam.

One job, one call::

    from transforms.whatif import analyze_job, JobMeta
    result = analyze_job(trace_table, JobMeta(dp_size=4, pp_size=4, tp_size=4), job_id="AR")
    result.slowdown, result.waste, result.by_stage, result.mw.rem, result.ms.rem
    result.to_reference_json()      # == the reference analyzer's result-*.json
    result.mw_json(), result.ms_json()

`trace_table` is a pyarrow Table in the lake TRACE_SCHEMA (schemas/trace.py) or in
the published reference parquet schema (float32 times, int8 ranks). Bad input
raises a `WhatIfError` subclass naming job, step, worker and op (errors.py).

Own what-if scenarios (root causes, fix estimates, streaming) go through the same
compiled model and batched replay:

    from transforms.whatif import compile_job, replay, Scenario, Mix
    model = compile_job(trace_table, meta, job_id)         # once per job
    ideal = model.ideal_cost()[:, None]                    # [n_ops, 1] seconds
    no_gc = model.original_cost.copy()                     # [n_ops, n_lanes]
    no_gc[model.op_optype == OPTYPES.index("gc")] = ...    # e.g. remove GC pauses
    out = replay(model, [Scenario("nodelay", model.original_cost),
                         Scenario("no-gc", no_gc),
                         Scenario("ideal-but-stage-3", Mix(ideal, model.original_cost, (model.op_stage == 3)[:, None]))])
    out.time("no-gc")   # [n_steps] latest optimizer end per step (seconds)
    out.span("no-gc")   # [n_steps] latest end - earliest start per step (seconds)

Model arrays are op-major `[op, lane]`; ops are in replay order (`model.op_names`,
`model.op_optype` / `op_stage` / `op_seq_id` / `op_mc` give each op's identity and
`model.op_index(name)` finds one); a lane is one (step, dp_rank):
`model.lane_step`, `model.lane_dp`, lane = step_index * dp_size + dp_rank.
`model.original_cost` holds durations of ops outside comm groups and transfer times
of comm-group members, `model.launch_delay` the untraced gaps, `model.duration` /
`observed_start` / `observed_end` the trace itself (seconds from the step start).
A scenario's cost (and optional launch delay) is any array broadcastable to
`[n_ops, n_lanes]` or a `Mix(base, alt, where)`; S = mean(nodelay span) /
mean(ideal optimizer time), like `metrics.analyze_model`.
"""
from transforms.whatif.errors import (
    CycleError,
    DisconnectedGraphError,
    MissingOpError,
    MissingPeerError,
    TooFewStepsError,
    TraceStructureError,
    TraceValueError,
    UnknownOptypeError,
    WhatIfError,
)
from transforms.whatif.metrics import analyze_job, analyze_model, attribution_groups, worker_set_mask
from transforms.whatif.model import MIN_STEPS, JobModel, compile_job, read_trace_columns
from transforms.whatif.replay import Mix, ReplayResult, Scenario, replay
from transforms.whatif.result import Decomposition, JobMeta, WhatIfResult

__all__ = [
    "analyze_job",
    "analyze_model",
    "attribution_groups",
    "worker_set_mask",
    "compile_job",
    "read_trace_columns",
    "replay",
    "Scenario",
    "Mix",
    "ReplayResult",
    "JobModel",
    "JobMeta",
    "WhatIfResult",
    "Decomposition",
    "MIN_STEPS",
    "WhatIfError",
    "TraceStructureError",
    "UnknownOptypeError",
    "MissingOpError",
    "MissingPeerError",
    "CycleError",
    "DisconnectedGraphError",
    "TooFewStepsError",
    "TraceValueError",
]
