"""Chrome-trace export: valid trace-event JSON, ideal events reproduce step_t_noblk, and the
ideal timeline of ST matches the reference analyzer's ideal-timeline-ST.json.gz event for event."""
from __future__ import annotations

import collections
import gzip
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from transforms.whatif import JobMeta, analyze_job
from transforms.whatif.timeline import write_chrome_trace

STEP_KEYS = {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"}


@pytest.fixture(scope="module")
def st(reference_dir, tmp_path_factory):
    meta = JobMeta.from_mapping(yaml.safe_load((reference_dir / "meta-ST.yaml").read_text()))
    result = analyze_job(pq.read_table(reference_dir / "trace-ST.parquet"), meta, "ST", timeline=True)
    path = write_chrome_trace(result.timeline, tmp_path_factory.mktemp("timeline") / "ST.json.gz")
    with gzip.open(path, "rt") as handle:
        trace = json.load(handle)
    return result, trace


def test_valid_trace_event_format(st):
    result, trace = st
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] in ("ms", "ns")
    pids_named = set()
    for event in trace["traceEvents"]:
        assert event["ph"] in ("X", "M")
        assert isinstance(event["pid"], int) and isinstance(event["name"], str)
        if event["ph"] == "X":
            assert set(event) == STEP_KEYS
            assert isinstance(event["tid"], int)
            assert np.isfinite(event["ts"]) and np.isfinite(event["dur"]) and event["dur"] >= 0
        else:
            assert event["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
            if event["name"] == "process_name":
                pids_named.add(event["pid"])
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} <= pids_named
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]
    model_ops = 106 * len(result.steps) * result.meta.dp_size
    assert len(ops) == 2 * model_ops


def test_step_events_reproduce_step_times(st):
    result, trace = st
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    for version, expected in (("ideal", result.step_t_noblk), ("original", result.step_t_base)):
        spans = {e["args"]["step"]: e for e in steps if e["args"]["version"] == version}
        assert sorted(spans) == result.steps.tolist()
        np.testing.assert_allclose([spans[s]["dur"] * 1e-6 for s in result.steps], expected, rtol=1e-9)


def test_ideal_op_events_span_step_t_noblk(st):
    result, trace = st
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "step" and e["args"]["version"] == "ideal"]
    first, last = collections.defaultdict(lambda: np.inf), collections.defaultdict(lambda: -np.inf)
    for e in ops:
        s = e["args"]["step"]
        first[s] = min(first[s], e["ts"])
        last[s] = max(last[s], e["ts"] + e["dur"])
    spans = np.array([(last[s] - first[s]) * 1e-6 for s in result.steps])
    np.testing.assert_allclose(spans, result.step_t_noblk, rtol=1e-9)
    # Versions are separate processes, two per DP rank.
    assert {e["pid"] for e in ops} == {2 * d + 1 for d in range(result.meta.dp_size)}


def test_ideal_timeline_matches_the_reference(st, reference_dir):
    result, trace = st
    with gzip.open(reference_dir / "ideal-timeline-ST.json.gz", "rt") as handle:
        reference = json.load(handle)

    def relative(events, pid_of):
        """(step, dp_rank, tid, name, seq_id) -> (start from the step's first event, duration), seconds."""
        xs = [e for e in events if e["ph"] == "X" and e["cat"] != "step"]
        origin = collections.defaultdict(lambda: np.inf)
        for e in xs:
            origin[e["args"]["step"]] = min(origin[e["args"]["step"]], e["ts"])
        return {(e["args"]["step"], pid_of(e["pid"]), e["tid"], e["name"], e["args"]["seq_id"]):
                ((e["ts"] - origin[e["args"]["step"]]) * 1e-6, e["dur"] * 1e-6) for e in xs}

    ours = relative([e for e in trace["traceEvents"] if e.get("args", {}).get("version") == "ideal"], lambda pid: pid // 2)
    theirs = relative(reference, lambda pid: pid)
    assert ours.keys() == theirs.keys()
    keys = sorted(theirs)
    np.testing.assert_allclose([ours[k] for k in keys], [theirs[k] for k in keys], rtol=1e-6, atol=1e-6)
    # Same thread naming as the reference.
    names = {e["args"]["name"] for e in reference if e["name"] == "thread_name"}
    assert names <= {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}


def test_max_steps_limits_the_export(st, tmp_path):
    result, _ = st
    path = write_chrome_trace(result.timeline, tmp_path / "two.json", max_steps=2)
    trace = json.loads(path.read_text())
    assert {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"} == set(result.steps[:2].tolist())
