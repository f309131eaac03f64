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

from schemas.trace import TRACE_SCHEMA
from transforms.whatif import JobMeta, analyze_job

TOLERANCE = 1e-6
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
    columns["host"] = pa.nulls(table.num_rows, pa.string())
    columns["seq_lens"] = pa.nulls(table.num_rows, pa.list_(pa.int32()))
    return pa.Table.from_pydict(columns, schema=TRACE_SCHEMA)


@pytest.fixture(scope="module", params=TRACES)
def case(request, reference_dir):
    name = request.param
    table = pq.read_table(reference_dir / f"trace-{name}.parquet")
    meta = load_meta(reference_dir / f"meta-{name}.yaml")
    expected = {kind: json.loads((reference_dir / f"{kind}-{name}.json").read_text()) for kind in ("result", "mw", "ms")}
    return name, table, meta, expected


def compare(ours, theirs, path: str = "") -> list[str]:
    """Mismatches between two JSON values: keys, values (1e-6 relative) and dict order."""
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path}: expected a dict, got {type(ours).__name__}"]
        if set(ours) != set(theirs):
            return [f"{path}: keys {sorted(ours)} != {sorted(theirs)}"]
        problems = []
        for key in theirs:
            problems += compare(ours[key], theirs[key], f"{path}/{key}")
        problems += check_order(list(ours), theirs, path)
        return problems
    if isinstance(theirs, float):
        if not isinstance(ours, float) or not np.isclose(ours, theirs, rtol=TOLERANCE, atol=0.0):
            return [f"{path}: {ours!r} != {theirs!r}"]
        return []
    return [] if ours == theirs else [f"{path}: {ours!r} != {theirs!r}"]


def reference_mismatches(result, expected: dict) -> list[str]:
    """Mismatches of a WhatIfResult against the reference's result, mw and ms JSON (keys of `expected`)."""
    return (compare(result.to_reference_json(), expected["result"], "result")
            + compare(result.mw_json(), expected["mw"], "mw") + compare(result.ms_json(), expected["ms"], "ms"))


def check_order(our_keys: list[str], theirs: dict, path: str) -> list[str]:
    """Our key order must list the reference's values largest first (equal within tolerance
    may swap) when the reference dict is sorted by value; otherwise it must be identical."""
    values = list(theirs.values())
    sortable = all(isinstance(v, float) for v in values)
    if sortable and all(a >= b for a, b in zip(values, values[1:])) and len(set(values)) > 1:
        ordered = [theirs[key] for key in our_keys]
        bad = [(a, b) for a, b in zip(ordered, ordered[1:]) if a < b * (1 - TOLERANCE)]
        return [f"{path}: order {our_keys} is not largest-first ({bad[0]})"] if bad else []
    if path.endswith("_per_step"):
        return []   # outer order follows the per-step slowdown, checked on that dict
    return [] if our_keys == list(theirs) else [f"{path}: key order {our_keys[:8]} != {list(theirs)[:8]}"]


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
