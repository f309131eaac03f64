"""The lake contract's validation: GX suites and plain checks, one rule at a time."""
from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from schemas import expectations as ex
from schemas.trace import OPTYPES, TRACE_SCHEMA
from lake_samples import sample_job

PATH = "memory://lake/traces/date=2024-03-01/job_id=job-a/part-00000.parquet"


@pytest.fixture(scope="module")
def validator() -> ex.Validator:
    return ex.Validator()


@pytest.fixture(scope="module")
def job():
    return sample_job("job-a", dp=2, pp=3, steps=3, microbatches=4)


def _set(table: pa.Table, name: str, rows: list[int], value) -> pa.Table:
    """Copy of `table` with column `name` set to `value` at `rows` (type kept when possible)."""
    values = table[name].to_pylist()
    for row in rows:
        values[row] = value
    field = table.schema.field(name)
    try:
        array = pa.array(values, field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        array = pa.array(values)
    return table.set_column(table.schema.get_field_index(name), name, array)


def test_reason_vocabulary_is_fixed_and_levelled():
    assert set(ex.FILE_REASONS) | set(ex.ROW_REASONS) | set(ex.JOB_REASONS) == set(ex.REASONS)
    assert ex.NEGATIVE_DURATION in ex.ROW_REASONS and ex.UNREADABLE_FILE in ex.FILE_REASONS
    assert ex.MISSING_MANIFEST in ex.JOB_REASONS
    for code, (level, meaning) in ex.REASONS.items():
        assert code == code.lower() and " " not in code and level in ("file", "row", "job") and meaning


def test_trace_suite_binds_manifest_or_keeps_parameters(job):
    _, manifest = job
    bound = ex.trace_suite(manifest)
    by_column = {(e.column if hasattr(e, "column") else None, e.meta["reason"]): e for e in bound.expectations
                 if hasattr(e, "column")}
    assert by_column[("dp_rank", ex.RANK_OUT_OF_RANGE)].max_value == 1
    assert by_column[("stage", ex.RANK_OUT_OF_RANGE)].max_value == 2
    assert by_column[("mb_id", ex.INDEX_OUT_OF_RANGE)].max_value == 3
    parameterised = ex.trace_suite()
    dp = [e for e in parameterised.expectations if getattr(e, "column", None) == "dp_rank"
          and e.meta["reason"] == ex.RANK_OUT_OF_RANGE][0]
    assert dp.max_value == {"$PARAMETER": "dp_rank_max"}
    assert {e.meta["reason"] for e in bound.expectations} >= {
        ex.NULL_VALUE, ex.NON_FINITE_TIME, ex.NEGATIVE_DURATION, ex.UNKNOWN_OPTYPE, ex.RANK_OUT_OF_RANGE,
        ex.DUPLICATE_ROW, ex.JOB_ID_MISMATCH, ex.INDEX_OUT_OF_RANGE}
    unique = [e for e in bound.expectations if e.meta["reason"] == ex.DUPLICATE_ROW][0]
    assert unique.column_list == ["job_id", "step", "dp_rank", "stage", "optype", "seq_id"]


def test_clean_job_passes(validator, job):
    trace, manifest = job
    report = validator.validate_job("job-a", manifest, [(PATH, trace)], manifest_path="m.parquet")
    assert report.ok, report.summary()
    assert report.valid.equals(trace)
    assert report.invalid.num_rows == 0


def test_clean_manifest_passes(validator, job):
    assert validator.validate_manifest(job[1], "memory://lake/manifests/date=2024-03-01/job-a.parquet") == []


@pytest.mark.parametrize(
    ("column", "value", "reason"),
    [
        ("duration", -0.002, ex.NEGATIVE_DURATION),
        ("duration", math.inf, ex.NON_FINITE_TIME),
        ("start_ts", math.nan, ex.NON_FINITE_TIME),
        ("optype", "forward-compute-fused", ex.UNKNOWN_OPTYPE),
        ("dp_rank", 2, ex.RANK_OUT_OF_RANGE),       # dp_size is 2
        ("stage", -1, ex.RANK_OUT_OF_RANGE),
        ("rank", 99, ex.RANK_OUT_OF_RANGE),         # world_size is 6
        ("rank", 5, ex.RANK_MISMATCH),              # in range, but not the worker's rank
        ("mb_id", 4, ex.INDEX_OUT_OF_RANGE),        # 4 microbatches
        ("step", -3, ex.INDEX_OUT_OF_RANGE),
        ("job_id", "job-b", ex.JOB_ID_MISMATCH),
        ("seq_id", None, ex.NULL_VALUE),
    ],
)
def test_row_rule_rejects_only_the_bad_rows(validator, job, column, value, reason):
    trace, manifest = job
    rows = [3, 17]
    if column == "rank":
        rows = [0, 1]  # worker (dp 0, stage 0), whose rank is 0
    bad = _set(trace, column, rows, value)
    report = validator.validate_file(bad, manifest, PATH)
    assert not report.ok
    assert reason in report.reasons
    assert report.invalid.num_rows == len(rows)
    assert report.valid.num_rows == trace.num_rows - len(rows)
    assert set(report.invalid["reason"].to_pylist()) == {reason}
    assert set(report.invalid["source_path"].to_pylist()) == {PATH}
    problem = [p for p in report.problems if p.reason == reason][0]
    assert problem.rows == len(rows) and problem.source_path == PATH
    assert "job job-a" in problem.detail and PATH in problem.detail and "op " in problem.detail
    first = report.invalid["detail"][0].as_py()
    assert first.startswith("op ") and reason in first
    # the valid rows keep the contract's types and the plain optype dictionary
    assert report.valid.schema.equals(TRACE_SCHEMA)
    assert report.valid["optype"].chunk(0).dictionary.to_pylist() == list(OPTYPES)


def test_duplicate_rows_within_and_across_files(validator, job):
    trace, manifest = job
    doubled = pa.concat_tables([trace, trace.slice(5, 2)])
    report = validator.validate_file(doubled, manifest, PATH)
    assert ex.DUPLICATE_ROW in report.reasons
    assert report.invalid.num_rows == 4  # both copies of each duplicated op
    other = PATH.replace("part-00000", "part-00001")
    report = validator.validate_job("job-a", manifest, [(PATH, trace), (other, trace.slice(0, 3))],
                                    manifest_path="m.parquet")
    assert ex.DUPLICATE_ROW in report.reasons
    assert {p.source_path for p in report.problems if p.reason == ex.DUPLICATE_ROW} == {PATH, other}


def test_first_failing_rule_names_the_row(validator, job):
    trace, manifest = job
    bad = _set(_set(trace, "duration", [4], -1.0), "dp_rank", [4], 7)
    report = validator.validate_file(bad, manifest, PATH)
    assert report.invalid["reason"].to_pylist() == [ex.NEGATIVE_DURATION]
    assert {ex.NEGATIVE_DURATION, ex.RANK_OUT_OF_RANGE} <= report.reasons


def test_missing_column_and_wrong_type_reject_the_file(validator, job):
    trace, manifest = job
    report = validator.validate_file(trace.drop_columns(["duration"]), manifest, PATH)
    assert report.reasons == {ex.MISSING_COLUMN} and report.valid.num_rows == 0
    assert report.problems[0].rows == trace.num_rows and "duration" in report.problems[0].detail
    text = trace.set_column(trace.schema.get_field_index("duration"), "duration",
                            pc.cast(trace["duration"], pa.string()))
    report = validator.validate_file(text, manifest, PATH)
    assert report.reasons == {ex.WRONG_TYPE} and "duration" in report.problems[0].detail
    floats = trace.set_column(trace.schema.get_field_index("step"), "step", pc.cast(trace["step"], pa.float64()))
    assert validator.validate_file(floats, manifest, PATH).reasons == {ex.WRONG_TYPE}


def test_compatible_types_are_accepted(validator, job):
    trace, manifest = job
    wide = trace.drop_columns(["job_id", "host", "seq_lens"])  # job_id comes from the path
    for name in ("dp_rank", "stage", "mc", "gmc"):
        wide = wide.set_column(wide.schema.get_field_index(name), name, pc.cast(wide[name], pa.int64()))
    wide = wide.set_column(wide.schema.get_field_index("duration"), "duration",
                           pc.cast(wide["duration"], pa.float32()))
    wide = wide.set_column(wide.schema.get_field_index("optype"), "optype", pc.cast(wide["optype"], pa.string()))
    report = validator.validate_file(wide, manifest, PATH)
    assert report.ok, report.summary()
    assert report.valid.schema.equals(TRACE_SCHEMA)
    assert report.valid["job_id"].to_pylist() == ["job-a"] * trace.num_rows
    # an integer that does not fit the lake's type is a wrong type, not a silent wrap-around
    huge = wide.set_column(wide.schema.get_field_index("stage"), "stage", pa.array([70_000] * wide.num_rows))
    assert validator.validate_file(huge, manifest, PATH).reasons == {ex.WRONG_TYPE}


def test_without_manifest_only_manifest_free_rules_run(validator, job):
    trace, manifest = job
    bad = _set(_set(trace, "dp_rank", [2], 40), "duration", [3], -1.0)
    report = validator.validate_file(bad, None, PATH)
    assert report.reasons == {ex.NEGATIVE_DURATION}  # dp_rank 40 cannot be judged without the manifest
    report = validator.validate_job("job-a", None, [(PATH, trace)])
    assert report.reasons == {ex.MISSING_MANIFEST}
    assert "job-a" in report.problems[0].detail


def test_job_level_missing_workers_and_steps(validator, job):
    trace, manifest = job
    keep = pc.invert(pc.and_(pc.equal(trace["dp_rank"], 1), pc.equal(trace["stage"], 2)))
    report = validator.validate_job("job-a", manifest, [(PATH, trace.filter(keep))], manifest_path="m.parquet")
    assert report.reasons == {ex.MISSING_WORKERS}
    assert "(1, 2)" in report.problems[0].detail
    gap = pc.invert(pc.and_(pc.equal(trace["step"], 11), pc.equal(trace["stage"], 0)))
    report = validator.validate_job("job-a", manifest, [(PATH, trace.filter(gap))], manifest_path="m.parquet")
    assert report.reasons == {ex.MISSING_STEPS}
    assert "lacks step 11" in report.problems[0].detail


def test_unreadable_files_and_empty_jobs(validator, job):
    _, manifest = job
    report = validator.validate_job("job-a", manifest, [(PATH, OSError("Parquet magic bytes not found"))],
                                    manifest_path="m.parquet")
    assert {ex.UNREADABLE_FILE, ex.MISSING_WORKERS} == report.reasons
    assert PATH in [p for p in report.problems if p.reason == ex.UNREADABLE_FILE][0].detail
    assert validator.validate_job("job-a", manifest, [], manifest_path="m.parquet").reasons == {ex.NO_TRACE_FILES}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"world_size": 5}, "world_size"),
        ({"end_time": dt.datetime(2024, 3, 1, 5, tzinfo=dt.timezone.utc)}, "end_time"),
        ({"dp_size": 0}, "dp_size"),
        ({"microbatches": None}, "microbatches"),
        ({"workers": []}, "workers"),
    ],
)
def test_invalid_manifests(validator, job, change, needle):
    manifest = {**job[1], **change}
    problems = validator.validate_manifest(manifest, "memory://lake/manifests/date=2024-03-01/job-a.parquet")
    assert problems and {p.reason for p in problems} == {ex.INVALID_MANIFEST}
    assert any(needle in p.detail for p in problems), [p.detail for p in problems]


def test_manifests_validate_in_bulk(validator, job):
    _, manifest = job
    items = [(f"m{i}.parquet", {**manifest, "job_id": f"m{i}"}) for i in range(5)]
    items[3] = ("m3.parquet", {**manifest, "job_id": "m3", "gpus": 0})
    results = validator.validate_manifests(items)
    assert [bool(r) for r in results] == [False, False, False, True, False]
    assert "gpus" in results[3][0].detail


def test_problems_table_has_quarantine_shape(validator, job):
    trace, manifest = job
    report = validator.validate_file(_set(trace, "duration", [1], -5.0), manifest, PATH)
    table = report.problems_table()
    assert table.schema.equals(ex.PROBLEM_SCHEMA)
    assert table.to_pylist()[0]["reason"] == ex.NEGATIVE_DURATION
    assert report.invalid.schema.equals(ex.INVALID_ROW_SCHEMA)


def test_conform_trace_raises_typed_errors():
    trace, _ = sample_job("job-a", dp=1, pp=1, steps=1, microbatches=1)
    with pytest.raises(ex.TraceContractError) as error:
        ex.conform_trace(_set(trace, "optype", [0], "bogus"), job_id="job-a", source_path=PATH)
    assert error.value.reason == ex.UNKNOWN_OPTYPE and PATH in str(error.value) and "bogus" in str(error.value)
    kept = ex.conform_trace(_set(trace, "optype", [0], "bogus"), job_id="job-a", strict=False)
    assert kept["optype"][0].as_py() == "bogus"
    shuffled = trace.set_column(trace.schema.get_field_index("optype"), "optype",
                                pc.dictionary_encode(pc.cast(trace["optype"], pa.string())))
    assert ex.conform_trace(shuffled, job_id="job-a").equals(trace)
    assert np.array_equal(ex.conform_trace(shuffled)["optype"].chunk(0).indices.to_numpy(),
                          trace["optype"].chunk(0).indices.to_numpy())


def test_suite_json_files_match_the_code():
    import json
    import pathlib

    folder = pathlib.Path(ex.__file__).parent
    for name, document in ex.suite_documents().items():
        assert json.loads((folder / name).read_text()) == json.loads(json.dumps(document)), (
            f"schemas/{name} is stale: run .venv/bin/python -c 'from schemas.expectations import write_suite_files; write_suite_files()'")


def test_gx_runs_never_overlap_across_threads(validator, job, monkeypatch):
    """Beam runs bundles on several threads of a worker; GX must never run twice at once
    (its parameter grammar is corrupted for the whole process when two threads first parse together)."""
    import threading

    import great_expectations as gx

    trace, manifest = job
    inside, overlapped = threading.Semaphore(0), []
    held_open = threading.Event()   # never set: keeps each run open 0.5 s so an unserialised second thread would enter
    original = gx.ValidationDefinition.run

    def watched_run(self, *args, **kwargs):
        if inside.acquire(blocking=False):   # another thread is inside right now
            overlapped.append(threading.current_thread().name)
            inside.release()
        inside.release()
        held_open.wait(timeout=0.5)
        try:
            return original(self, *args, **kwargs)
        finally:
            inside.acquire()

    monkeypatch.setattr(gx.ValidationDefinition, "run", watched_run)
    other = ex.Validator()
    reports = []
    threads = [threading.Thread(target=lambda v=v: reports.append(v.validate_job("job-a", manifest, [(PATH, trace)])))
               for v in (validator, other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not overlapped, f"GX ran concurrently in {overlapped}"
    assert len(reports) == 2 and all(report.ok for report in reports)
