"""Small, valid lake jobs for tests and benchmarks of the lake contract (no generator needed).

The ops follow the trace vocabulary and the lake contract (one row per step, worker,
optype, seq_id; ranks inside the parallelism); timings are plausible, not a schedule
model: the generator (transforms/synth) owns realistic traces.
"""
from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa

from schemas.trace import OPTYPES, TRACE_SCHEMA

__all__ = ["sample_job"]


def _worker_template(stage: int, pp: int, microbatches: int) -> list[tuple[str, int, int]]:
    """(optype, seq_id, mb_id) of one worker's ops in one step, in start order."""
    ops = [("params-all-gather", 0, -1)]
    for mb in range(microbatches):
        if stage > 0:
            ops.append(("forward-recv", mb, -1))
        ops.append(("forward-compute", mb, mb))
        if stage < pp - 1:
            ops.append(("forward-send", mb, -1))
    for mb in range(microbatches):
        if stage < pp - 1:
            ops.append(("backward-recv", mb, -1))
        ops.append(("backward-compute", mb, mb))
        if stage > 0:
            ops.append(("backward-send", mb, -1))
    ops += [("gc", 0, -1), ("grads-reduce-scatter", 0, -1), ("layernorm-grads-all-reduce", 0, -1)]
    if stage in (0, pp - 1):
        ops.append(("embedding-grads-all-reduce", 0, -1))
    ops += [("optimizer-clip-main-grad", 0, -1), ("optimizer", 0, -1)]
    return ops


def sample_job(job_id: str = "job-a", *, dp: int = 2, pp: int = 2, steps: int = 3, microbatches: int = 4,
               date: dt.date = dt.date(2024, 3, 1), first_step: int = 10, seed: int = 0,
               ) -> tuple[pa.Table, dict]:
    """(trace table in TRACE_SCHEMA, manifest dict) of a valid job with dp x pp workers."""
    rng = np.random.default_rng(seed)
    code = {name: i for i, name in enumerate(OPTYPES)}
    columns: dict[str, list[np.ndarray]] = {k: [] for k in
                                           ("dp_rank", "stage", "rank", "step", "optype", "seq_id", "mb_id", "mc", "gmc")}
    for stage in range(pp):
        template = _worker_template(stage, pp, microbatches)
        optype = np.array([code[o] for o, _, _ in template], dtype=np.int8)
        seq = np.array([s for _, s, _ in template], dtype=np.int32)
        mb = np.array([m for _, _, m in template], dtype=np.int32)
        compute = mb >= 0
        n = len(template)
        for dp_rank in range(dp):
            for step in range(first_step, first_step + steps):
                columns["dp_rank"].append(np.full(n, dp_rank, np.int16))
                columns["stage"].append(np.full(n, stage, np.int16))
                columns["rank"].append(np.full(n, stage * dp + dp_rank, np.int32))
                columns["step"].append(np.full(n, step, np.int64))
                columns["optype"].append(optype)
                columns["seq_id"].append(seq)
                columns["mb_id"].append(mb)
                columns["mc"].append(np.where(compute, 0, -1).astype(np.int16))
                columns["gmc"].append(np.where(compute, stage, -1).astype(np.int16))
    arrays = {k: np.concatenate(v) for k, v in columns.items()}
    rows = arrays["step"].size
    duration = rng.uniform(1e-4, 5e-3, rows)
    # start times: cumulative within each (worker, step) block, offset per step
    block = (arrays["step"] - first_step) * 1000 + arrays["dp_rank"] * 10 + arrays["stage"]
    start = np.zeros(rows)
    boundaries = np.flatnonzero(np.diff(block)) + 1
    for segment in np.split(np.arange(rows), boundaries):
        start[segment] = np.concatenate([[0.0], np.cumsum(duration[segment])[:-1]])
    start += (arrays["step"] - first_step) * 10.0
    table = pa.Table.from_arrays(
        [
            pa.array([job_id] * rows, pa.string()),
            pa.array(arrays["dp_rank"]), pa.array(arrays["stage"]), pa.array(arrays["rank"]),
            pa.array(arrays["step"]),
            pa.DictionaryArray.from_arrays(pa.array(arrays["optype"]), pa.array(OPTYPES, pa.string())),
            pa.array(start), pa.array(duration), pa.array(arrays["seq_id"]),
            pa.array(arrays["mc"]), pa.array(arrays["mb_id"]), pa.array(arrays["gmc"]),
            pa.nulls(rows, pa.string()), pa.nulls(rows, pa.list_(pa.int32())), pa.nulls(rows, pa.int32()),
            *(pa.nulls(rows, field.type) for field in list(TRACE_SCHEMA)[15:]),   # the optional measurements
        ],
        schema=TRACE_SCHEMA,
    )
    begin = dt.datetime.combine(date, dt.time(6, 0), tzinfo=dt.timezone.utc)
    manifest = {
        "job_id": job_id, "date": date,
        "submit_time": begin - dt.timedelta(minutes=5), "start_time": begin,
        "end_time": begin + dt.timedelta(hours=2),
        "gpus": dp * pp, "dp_size": dp, "pp_size": pp, "tp_size": 1, "dsp_size": 1, "vpp_size": 1,
        "world_size": dp * pp, "microbatches": microbatches, "model_family": "dense", "context_length": 4096,
        "workers": [{"dp_rank": d, "stage": s, "rank": s * dp + d, "host": f"host-{(s * dp + d) // 8:03d}"}
                    for d in range(dp) for s in range(pp)],
    }
    return table, manifest
