"""Original and simulated-ideal timelines: Chrome trace-event JSON (Perfetto) and trace tables.

`write_chrome_trace(timeline, path)` writes one gzip'd JSON that Perfetto
(ui.perfetto.dev) and chrome://tracing open, with the original and the ideal
timeline side by side:

* one process per (DP rank, timeline): pid 2*d = "DP rank d - original",
  pid 2*d + 1 = "DP rank d - ideal", so each DP rank's two versions are adjacent;
* inside, the reference analyzer's thread layout: tid = rank * 5 + category,
  categories compute / pp-comm / tp-comm / dp-comm / misc, named
  "PP rank p, TP rank 0, <category>";
* op events ("ph": "X", microseconds rounded to the nanosecond) named by optype, with args step,
  model_chunk, mb_id, seq_id; a comm op is drawn as its transfer only (its wait
  for the group is the gap before it), like the reference;
* steps laid out one after another (a step's slot is 1.1 x the longer of its two
  versions), plus a "steps" process whose events span each step of each version.
"""
from __future__ import annotations

import dataclasses
import gc
import gzip
import pathlib

import numpy as np
import pyarrow as pa

from schemas.trace import OPTYPES, trace_table

__all__ = ["Timeline", "ideal_timeline", "chrome_trace_events", "chrome_trace_bytes", "write_chrome_trace",
           "first_steps", "EVENT_LIMIT", "simulated_trace"]

_CATEGORIES = ("compute", "pp-comm", "tp-comm", "dp-comm", "misc")
_CATEGORY_OF = {
    "forward-compute": 0, "backward-compute": 0, "backward-weight-compute": 0, "optimizer": 0, "gc": 0,
    "forward-send": 1, "forward-recv": 1, "backward-send": 1, "backward-recv": 1,
    "params-all-gather": 3, "grads-reduce-scatter": 3, "separate-grads-all-reduce": 3,
    "layernorm-grads-all-reduce": 3, "embedding-grads-all-reduce": 3, "optimizer-clip-main-grad": 3,
    "all-to-all": 3, "group-collective": 3,
}
_SLOT = 1.1   # a step's slot on the time axis, as a multiple of its longest version
# Op events per version a timeline export keeps by default (its first steps up to this many):
# Perfetto and the JSON writer stay responsive; AR fits whole.
EVENT_LIMIT = 500_000


@dataclasses.dataclass
class Timeline:
    """Both timelines of a job as [op, lane] arrays (seconds from each step's start).

    `versions` maps "original" / "ideal" to (start, end, drawn_start): drawn_start is
    where an op is drawn (end - transfer for comm-group members, start otherwise).
    """

    job_id: str
    steps: np.ndarray
    dp_size: int
    pp_size: int
    worker_rank: np.ndarray
    op_optype: np.ndarray
    op_seq_id: np.ndarray
    op_stage: np.ndarray
    op_mc: np.ndarray
    mb_id: np.ndarray
    lane_dp: np.ndarray
    versions: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]

    @classmethod
    def from_replay(cls, model, ideal_start: np.ndarray, ideal_end: np.ndarray) -> "Timeline":
        """Observed timeline of the model plus a replayed one (starts/ends [n_ops, n_lanes])."""
        comm = (model.op_group >= 0)[:, None]
        ideal_cost = model.ideal_cost()[:, None]
        original = (model.observed_start, model.observed_end,
                    np.where(comm, model.observed_end - model.original_cost, model.observed_start))
        ideal = (ideal_start, ideal_end, np.where(comm, ideal_end - ideal_cost, ideal_start))
        return cls(
            job_id=model.job_id, steps=model.steps, dp_size=model.dp_size, pp_size=model.pp_size,
            worker_rank=model.worker_rank, op_optype=model.op_optype, op_seq_id=model.op_seq_id,
            op_stage=model.op_stage, op_mc=model.op_mc, mb_id=model.mb_id, lane_dp=model.lane_dp,
            versions={"original": original, "ideal": ideal},
        )

    def step_spans(self, version: str) -> np.ndarray:
        """[n_steps] latest end minus earliest start of each step in one version (seconds)."""
        start, end, _ = self.versions[version]
        shape = (len(self.steps), self.dp_size)
        return end.max(axis=0).reshape(shape).max(axis=1) - start.min(axis=0).reshape(shape).min(axis=1)

    def step_offsets(self) -> np.ndarray:
        """[n_steps] where each step starts on the drawn time axis (seconds)."""
        longest = np.max([self.step_spans(version) for version in self.versions], axis=0)
        return np.concatenate([[0.0], np.cumsum(longest * _SLOT)[:-1]])


def chrome_trace_events(timeline: Timeline, max_steps: int | None = None) -> dict:
    """The trace-event JSON object ({"traceEvents": [...], ...}) of both timelines.
    max_steps keeps only the first steps (large jobs make very large files)."""
    # A million small acyclic dicts: the cyclic garbage collector would scan them again and
    # again as they are made (70% of the time); nothing here can form a cycle.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _trace_events(timeline, max_steps)
    finally:
        if enabled:
            gc.enable()


def _trace_events(timeline: Timeline, max_steps: int | None) -> dict:
    n_steps = len(timeline.steps) if max_steps is None else min(max_steps, len(timeline.steps))
    offsets = timeline.step_offsets()
    lanes = np.flatnonzero(np.repeat(np.arange(len(timeline.steps)), timeline.dp_size) < n_steps)
    op_names = [OPTYPES[code] for code in timeline.op_optype]
    category = np.array([_CATEGORY_OF.get(name, 4) for name in op_names])
    rank_of_op_lane = timeline.worker_rank[timeline.lane_dp[lanes]][:, timeline.op_stage].T   # [op, lane]
    tid = rank_of_op_lane * len(_CATEGORIES) + category[:, None]
    step_of_lane = lanes // timeline.dp_size
    step_numbers = timeline.steps[step_of_lane].tolist()
    mb_ids = [[mb if mb >= 0 else None for mb in row] for row in timeline.mb_id[:, lanes].tolist()]
    tids = tid.tolist()
    events: list[dict] = []
    for version_index, (version, (start, end, drawn)) in enumerate(timeline.versions.items()):
        # numpy once per version, then plain Python values: one dict per event is the only per-event work
        pids = (2 * timeline.lane_dp[lanes] + version_index).tolist()
        ts = np.round((drawn[:, lanes] + offsets[step_of_lane][None, :]) * 1e6, 3).tolist()
        dur = np.round((end[:, lanes] - drawn[:, lanes]) * 1e6, 3).tolist()
        for op, name in enumerate(op_names):
            seq_id, chunk = int(timeline.op_seq_id[op]), int(timeline.op_mc[op])
            chunk = chunk if chunk >= 0 else None
            events += [
                {"name": name, "cat": name, "ph": "X", "pid": pid, "tid": op_tid, "ts": op_ts, "dur": op_dur,
                 "args": {"step": step, "model_chunk": chunk, "mb_id": mb, "seq_id": seq_id, "version": version}}
                for pid, op_tid, op_ts, op_dur, step, mb in zip(pids, tids[op], ts[op], dur[op], step_numbers, mb_ids[op])
            ]
    events += _metadata_events(timeline)
    steps_pid = 2 * timeline.dp_size
    for version_index, version in enumerate(timeline.versions):
        spans = timeline.step_spans(version)
        starts = timeline.versions[version][0].min(axis=0).reshape(len(timeline.steps), timeline.dp_size).min(axis=1)
        for s in range(n_steps):
            events.append({
                "name": f"step {int(timeline.steps[s])}", "cat": "step", "ph": "X", "pid": steps_pid, "tid": version_index,
                "ts": float((offsets[s] + starts[s]) * 1e6), "dur": float(spans[s] * 1e6),
                "args": {"step": int(timeline.steps[s]), "version": version, "step_time_s": float(spans[s])},
            })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"job_id": timeline.job_id, "versions": list(timeline.versions), "steps": [int(s) for s in timeline.steps[:n_steps]]},
    }


def _metadata_events(timeline: Timeline) -> list[dict]:
    events = []
    for d in range(timeline.dp_size):
        for version_index, version in enumerate(timeline.versions):
            pid = 2 * d + version_index
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"DP rank {d} - {version}"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            for stage in range(timeline.pp_size):
                rank = int(timeline.worker_rank[d, stage])
                for i, category in enumerate(_CATEGORIES):
                    tid = rank * len(_CATEGORIES) + i
                    events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                   "args": {"name": f"PP rank {stage}, TP rank 0, {category}"}})
                    events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    steps_pid = 2 * timeline.dp_size
    events.append({"name": "process_name", "ph": "M", "pid": steps_pid, "args": {"name": "steps"}})
    events.append({"name": "process_sort_index", "ph": "M", "pid": steps_pid, "args": {"sort_index": -1}})
    for version_index, version in enumerate(timeline.versions):
        events.append({"name": "thread_name", "ph": "M", "pid": steps_pid, "tid": version_index, "args": {"name": version}})
    return events


def first_steps(timeline: Timeline, event_limit: int = EVENT_LIMIT) -> int | None:
    """How many first steps keep a version's op events within `event_limit` (at least one);
    None when every step fits."""
    per_step = len(timeline.op_optype) * timeline.dp_size
    return max(1, event_limit // per_step) if per_step * len(timeline.steps) > event_limit else None


def chrome_trace_bytes(timeline: Timeline, max_steps: int | None = None, *, gz: bool = True) -> bytes:
    """Both timelines as trace-event JSON, gzip'd when `gz` (no name or time in the gzip
    header: the same timeline gives the same bytes)."""
    import orjson   # ~10x json.dumps on a million events; the same text

    payload = orjson.dumps(chrome_trace_events(timeline, max_steps))
    return gzip.compress(payload, compresslevel=1, mtime=0) if gz else payload


def write_chrome_trace(timeline: Timeline, path: str | pathlib.Path, max_steps: int | None = None) -> pathlib.Path:
    """Write both timelines as trace-event JSON (gzip'd when the name ends in .gz)."""
    path = pathlib.Path(path)
    path.write_bytes(chrome_trace_bytes(timeline, max_steps, gz=path.suffix == ".gz"))
    return path


def ideal_timeline(model) -> Timeline:
    """The original and ideal timelines of a compiled model: one replay (the ideal), no what-if
    analysis -- what a timeline export needs, and all it needs."""
    from transforms.whatif.replay import Scenario, replay

    out = replay(model, [Scenario("ideal", model.ideal_cost()[:, None], keep_times=True)])
    return Timeline.from_replay(model, out.starts["ideal"], out.ends["ideal"])


def simulated_trace(model, starts: np.ndarray, ends: np.ndarray, job_id: str | None = None) -> pa.Table:
    """A replayed timeline as a trace table in the lake TRACE_SCHEMA (times relative to each
    step's start of the original trace, plus that start), e.g. to analyse it again."""
    n_ops, n_lanes = starts.shape
    lane_step = np.repeat(model.steps, model.dp_size)
    step_start = np.repeat(model.step_start, model.dp_size)
    op = np.repeat(np.arange(n_ops), n_lanes)
    lane = np.tile(np.arange(n_lanes), n_ops)
    dp_rank = model.lane_dp[lane]
    stage = model.op_stage[op]
    optype = pa.DictionaryArray.from_arrays(pa.array(model.op_optype[op].astype(np.int8)), pa.array(list(OPTYPES)))
    columns = {
        "job_id": pa.array(np.full(len(op), job_id or model.job_id, dtype=object), pa.string()),
        "dp_rank": pa.array(dp_rank.astype(np.int16)),
        "stage": pa.array(stage.astype(np.int16)),
        "rank": pa.array(model.worker_rank[dp_rank, stage].astype(np.int32)),
        "step": pa.array(lane_step[lane].astype(np.int64)),
        "optype": optype,
        "start_ts": pa.array((starts.ravel() + step_start[lane]).astype(np.float64)),
        "duration": pa.array((ends - starts).ravel().astype(np.float64)),
        "seq_id": pa.array(model.op_seq_id[op].astype(np.int32)),
        "mc": pa.array(model.op_mc[op].astype(np.int16)),
        "mb_id": pa.array(model.mb_id.ravel().astype(np.int32)),
        "gmc": pa.array(model.op_gmc[op].astype(np.int16)),
    }
    return trace_table(columns, len(op))
