"""Exactness against the authors' analyzer: every field of result-*.json, mw-*.json and
ms-*.json of both published traces, to 1e-6 relative, same keys, same step sets, and
dict orders that are a valid largest-first order of the reference's values."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from schemas.trace import TRACE_SCHEMA, trace_table
from transforms.whatif import JobMeta, analyze_job
from transforms.whatif.parity import TOLERANCE, compare, json_mismatches, reference_mismatches

TRACES = ("AR", "ST")


def load_meta(path) -> JobMeta:
    return JobMeta.from_mapping(yaml.safe_load(path.read_text()))


def as_lake_table(table: pa.Table, job_id: str) -> pa.Table:
    """The published table in the lake's TRACE_SCHEMA (float64 times, wider ints)."""
    columns = {"job_id": pa.array([job_id] * table.num_rows, pa.string())}
    for field in TRACE_SCHEMA:
        if field.name in table.column_names:
            column = table.column(field.name)
            if pa.types.is_dictionary(field.type):
                column = column.cast(pa.string()).combine_chunks().dictionary_encode()
                column = pa.DictionaryArray.from_arrays(column.indices.cast(pa.int8()), column.dictionary)
            else:
                column = column.cast(field.type)
            columns[field.name] = column
    return trace_table(columns, table.num_rows)


@pytest.fixture(scope="module", params=TRACES)
def case(request, reference_dir):
    name = request.param
    table = pq.read_table(reference_dir / f"trace-{name}.parquet")
    meta = load_meta(reference_dir / f"meta-{name}.yaml")
    expected = {kind: json.loads((reference_dir / f"{kind}-{name}.json").read_text()) for kind in ("result", "mw", "ms")}
    return name, table, meta, expected


@pytest.mark.parametrize("form", ["published", "lake"])
def test_every_reference_field_is_reproduced(case, form):
    name, table, meta, expected = case
    trace = table if form == "published" else as_lake_table(table, name)
    result = analyze_job(trace, meta, job_id=name)
    problems = reference_mismatches(result, expected)
    assert not problems, f"{name} ({form}): {len(problems)} mismatches, e.g. " + "; ".join(problems[:5])


def test_per_step_dicts_follow_the_per_step_slowdown(case):
    name, table, meta, expected = case
    ours = analyze_job(table, meta, job_id=name).to_reference_json()
    slowdown = expected["result"]["blocking_step_slowdown"]
    for field in ("blocking_decompose_by_dp_rank_per_step", "blocking_decompose_by_stage_per_step",
                  "blocking_decompose_by_optype_per_step"):
        assert set(ours[field]) == set(expected["result"][field])
        ordered = [slowdown[step] for step in ours[field]]
        assert all(a >= b * (1 - TOLERANCE) for a, b in zip(ordered, ordered[1:])), field


def test_extended_json_carries_mw_ms_and_verdict(case):
    name, table, meta, expected = case
    result = analyze_job(table, meta, job_id=name)
    out = json.loads(json.dumps(result.to_json()))   # must be plain JSON
    assert out["M_W"] == pytest.approx(expected["mw"]["Mw"], rel=TOLERANCE)
    assert out["M_S"] == pytest.approx(expected["ms"]["Ms"], rel=TOLERANCE)
    assert out["ms"]["workers"] == [[d, meta.pp_size - 1] for d in range(meta.dp_size)]
    assert len(out["mw"]["workers"]) == -(-meta.dp_size * meta.pp_size * 3 // 100)
    assert out["waste"] == pytest.approx(1 - 1 / expected["result"]["blocking_slowdown"], rel=TOLERANCE)
    assert out["discarded"] is (expected["result"]["launch_slowdown"] > 1.05)
    # S_w = min(S_dp, S_stage) from the reference's own attribution.
    by_dp = expected["result"]["blocking_decompose_by_dp_rank"]
    by_stage = expected["result"]["blocking_decompose_by_stage"]
    worker = np.array(out["worker_slowdown"])
    for d in range(meta.dp_size):
        for p in range(meta.pp_size):
            assert worker[d, p] == pytest.approx(min(by_dp[str(d)], by_stage[str(p)]), rel=TOLERANCE)


def test_ar_slow_worker_is_rank_zero(reference_dir):
    """The AR trace's injected slow worker (global rank 0) is the M_W worker."""
    table = pq.read_table(reference_dir / "trace-AR.parquet")
    result = analyze_job(table, load_meta(reference_dir / "meta-AR.yaml"), job_id="AR")
    assert result.mw.workers == [(0, 0)]
    assert result.worker_rank[0, 0] == 0


def test_replay_with_launch_delays_reproduces_observed_steps(case):
    name, table, meta, _ = case
    result = analyze_job(table, meta, job_id=name)
    np.testing.assert_allclose(result.step_t_replayed, result.step_t_base, rtol=1e-6)


def test_cli_json_layout_is_compared_field_by_field(case):
    """`strag analyze --json` output (what bench_whatif.py compares) matches the reference,
    and the comparison catches a value 2e-6 off, a missing key and a wrong order."""
    name, table, meta, expected = case
    ours = json.loads(json.dumps(analyze_job(table, meta, job_id=name).to_json()))
    assert json_mismatches(ours, expected) == []
    off = json.loads(json.dumps(ours))
    off["mw"]["trem"] *= 1 + 2 * TOLERANCE
    assert json_mismatches(off, expected) == [f"mw/trem: {off['mw']['trem']!r} != {expected['mw']['trem']!r}"]
    near = json.loads(json.dumps(ours))
    near["blocking_slowdown"] *= 1 + TOLERANCE / 2
    assert json_mismatches(near, expected) == []
    del off["launch_slowdown"]
    assert any(p.startswith("result: keys") for p in json_mismatches(off, expected))


def test_compare_checks_largest_first_order():
    theirs = {"a": 3.0, "b": 2.0, "c": 1.0}
    assert compare({"a": 3.0, "b": 2.0, "c": 1.0}, theirs) == []
    assert compare({"b": 2.0, "a": 3.0, "c": 1.0}, theirs, "x") != []
    assert compare({"a": 1.0, "b": 1.0 + 1e-7}, {"a": 1.0, "b": 1.0}) == []   # equal within tolerance: any order
    assert compare(float("nan"), 1.0) != [] and compare(float("inf"), float("inf")) == []
