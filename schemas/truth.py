"""Arrow schema of the synthetic fleet's answer key, `{lake}/_truth/truth.parquet`.

Written by the generator (transforms/synth/fleet.py), read only by evaluation (tests,
benchmarks): what each generated job was given (causes, parameters, affected workers) and
the step times it should show.
"""
from __future__ import annotations

import pyarrow as pa

__all__ = ["TRUTH_SCHEMA"]

_WORKER = pa.struct([pa.field("dp_rank", pa.int16()), pa.field("stage", pa.int16())])

# One row per generated job: the answer key. Times are mean step times in seconds.
TRUTH_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("date", pa.date32(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("gpus", pa.int32(), nullable=False),
        pa.field("dp_size", pa.int32(), nullable=False),
        pa.field("pp_size", pa.int32(), nullable=False),
        pa.field("tp_size", pa.int32(), nullable=False),
        pa.field("dsp_size", pa.int32(), nullable=False),
        pa.field("vpp_size", pa.int32(), nullable=False),
        pa.field("microbatches", pa.int32(), nullable=False),
        pa.field("model_family", pa.string(), nullable=False),
        pa.field("context_length", pa.int32(), nullable=False),
        pa.field("dp_overlap", pa.bool_(), nullable=False),       # overlapped ZeRO (separate-grads-all-reduce)
        pa.field("sampled_steps", pa.int32(), nullable=False),
        pa.field("records", pa.int64(), nullable=False),          # op records written (before corruption)
        pa.field("causes", pa.list_(pa.string()), nullable=False),  # injected cause kinds; [] = clean
        pa.field("primary_cause", pa.string(), nullable=False),   # cause with the largest effect alone, or "clean"
        pa.field("cause_params", pa.string(), nullable=False),    # JSON {kind: {parameter: value, "steps": [...]}}
        pa.field("cause_slowdowns", pa.string(), nullable=False),  # JSON {kind: step time with it alone / fault-free}
        pa.field("affected_workers", pa.list_(_WORKER), nullable=False),
        pa.field("affected_hosts", pa.list_(pa.string()), nullable=False),
        pa.field("step_time", pa.float64(), nullable=False),             # observed (simulated) step time
        pa.field("fault_free_step_time", pa.float64(), nullable=False),  # same draws, no injected cause
        pa.field("true_slowdown", pa.float64(), nullable=False),         # step_time / fault_free_step_time
        pa.field("nodelay_step_time", pa.float64(), nullable=False),     # step_time without untraced CPU gaps
        pa.field("ideal_step_time", pa.float64(), nullable=False),       # ops at their type's mean/median, no gaps
        pa.field("expected_slowdown", pa.float64(), nullable=False),     # nodelay / ideal: what S should be near
        pa.field("expected_discrepancy", pa.float64(), nullable=False),  # step_time / nodelay: ~ launch_slowdown
        pa.field("bad_kind", pa.string(), nullable=True),     # corruption applied (transforms.synth.badinput), or null
        pa.field("bad_detail", pa.string(), nullable=True),
    ],
    metadata={"strag.table": "synth_truth"},
)
