"""The lake contract's validation, one rule at a time: GX suites (schemas.expectations) and the
runtime that applies them with the plain checks (transforms.validation)."""
from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from schemas import expectations as ex
from schemas.trace import OPTYPES, TRACE_SCHEMA
from transforms import validation as va
from lake_samples import sample_job

PATH = "memory://lake/traces/date=2024-03-01/job_id=job-a/part-00000.parquet"


@pytest.fixture(scope="module")
def validator() -> va.Validator:
    return va.Validator()


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


def test_validation_results_are_not_kept(validator, job):
    """GX stores every run's result in its context; a long-running watcher validates a session a
    second, so the Validator drops them: the store is empty after runs of every kind."""
    validator.validate_manifest(job[1], "m.parquet")
    validator.validate_manifest(job[1], "m.parquet")
    validator.validate_job("job-a", job[1], [("t.parquet", job[0])])
    assert validator._context.validation_results_store.list_keys() == []


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


# faults of the middle window (job-m: dp 3, pp 2, 4 microbatches), below and above each range
_CORRUPTIONS = [
    ("duration", -0.002), ("duration", math.inf), ("start_ts", math.nan), ("optype", "forward-compute-fused"),
    ("dp_rank", 3), ("stage", 2), ("stage", -1), ("rank", 99), ("rank", 5), ("mb_id", 4), ("mc", 3), ("gmc", -2),
    ("gmc", 9), ("step", -3),
    ("seq_id", -1), ("job_id", "job-b"), ("seq_id", None), ("duplicate", None),
]


def _windows(bad_column=None, value=None):
    """Three windows of different jobs and sizes; the middle one (job-m) corrupted at two inner rows."""
    windows = []
    for job_id, dp, pp in (("job-a", 2, 3), ("job-m", 3, 2), ("job-z", 1, 4)):
        trace, manifest = sample_job(job_id, dp=dp, pp=pp, steps=3, microbatches=4)
        if job_id == "job-m" and bad_column == "duplicate":
            trace = pa.concat_tables([trace, trace.slice(7, 1)])
        elif job_id == "job-m" and bad_column is not None:
            middle = trace.num_rows // 2   # rows that are not otherwise extremes of any column
            trace = _set(trace, bad_column, [0, 1] if bad_column == "rank" else [middle, middle + 7], value)
        path = PATH.replace("job-a", job_id)
        windows.append(ex.JobFiles(job_id, manifest, [(path, trace.slice(0, 40)), (path.replace("00000", "00001"), trace.slice(40))],
                                   f"m/{job_id}.parquet"))
    return windows


def _same_reports(left, right):
    for a, b in zip(left, right, strict=True):
        assert a.job_id == b.job_id and a.problems == b.problems
        assert a.valid.equals(b.valid) and a.invalid.schema.equals(b.invalid.schema)
        assert repr(a.invalid.to_pylist()) == repr(b.invalid.to_pylist())   # repr: NaN equals NaN


@pytest.mark.parametrize(("column", "value"), _CORRUPTIONS)
def test_screen_gives_the_row_level_verdict(validator, column, value):
    """One GX screen run over witness rows of three windows decides exactly as the row-level
    suites over every row: same valid rows, rejected rows and problems, whatever the fault."""
    windows = _windows(column, value)
    screened = validator.validate_jobs(windows)
    _same_reports(screened, validator.validate_jobs(windows, screen=False))
    assert [r.ok for r in screened] == [True, False, True]


def test_clean_windows_skip_the_row_level_suites(validator, monkeypatch):
    runs = []
    original = va.Validator._failures
    monkeypatch.setattr(va.Validator, "_failures", lambda self, name, *a: runs.append(name) or original(self, name, *a))
    monkeypatch.setattr(va.Validator, "_check_rows", lambda *a: pytest.fail("a clean window reached the row-level suites"))
    reports = validator.validate_jobs(_windows())
    assert all(r.ok for r in reports) and runs == []
    assert all(r.seconds > 0 for r in reports)
    assert reports[0].valid.num_rows == sample_job("job-a", dp=2, pp=3, steps=3, microbatches=4)[0].num_rows


def test_screen_sends_only_the_failing_window_to_the_row_level_suites(validator, monkeypatch):
    checked = []
    original = va.Validator._check_rows
    monkeypatch.setattr(va.Validator, "_check_rows", lambda self, job_id, *a: checked.append(job_id) or original(self, job_id, *a))
    reports = validator.validate_jobs(_windows("duration", -1.0))
    assert checked == ["job-m"] and [r.ok for r in reports] == [True, False, True]


def test_witness_rows_hold_each_extreme_and_every_duplicate(job):
    trace, manifest = job
    rows = set(va.witness_rows(trace, "job-a", manifest).tolist())
    for name in ("start_ts", "duration", "step", "seq_id", "mb_id"):
        values = trace[name].to_numpy()
        assert values[sorted(rows)].min() == values.min() and values[sorted(rows)].max() == values.max()
    assert {trace["optype"][i].as_py() for i in rows} == set(trace["optype"].to_pylist())
    doubled = pa.concat_tables([trace, trace.slice(11, 2)])
    rows = set(va.witness_rows(doubled, "job-a", manifest).tolist())
    assert {11, 12, trace.num_rows, trace.num_rows + 1} <= rows
    # a fault a plain check already sees sends the window to the row-level suites
    assert va.witness_rows(_set(trace, "rank", [0], 5), "job-a", manifest) is None
    assert va.witness_rows(_set(trace, "job_id", [3], "job-b"), "job-a", manifest) is None


def test_duplicate_rows_packed_and_sorted_paths_agree():
    rng = np.random.default_rng(7)
    narrow = [rng.integers(0, 5, 2000), rng.integers(0, 4, 2000), rng.integers(0, 50, 2000)]
    sparse = [narrow[0] * (1 << 40) + 46, narrow[1] * 1000, narrow[2]]   # few distinct values far apart: numbered
    expected = {i for i, key in enumerate(zip(*narrow)) if list(zip(*narrow)).count(key) > 1}
    assert set(va._duplicate_rows(narrow).tolist()) == expected
    assert set(va._duplicate_rows(sparse).tolist()) == expected
    # seven columns of many distinct values: too wide to pack into 62 bits even numbered, so sorted
    wide = [np.concatenate([column, column[:10]]) for column in (rng.integers(0, 8000, 1000) for _ in range(7))]
    rows = list(zip(*wide))
    assert set(va._duplicate_rows(wide).tolist()) == {i for i, key in enumerate(rows) if rows.count(key) > 1}
    assert set(range(10)) | set(range(1000, 1010)) <= set(va._duplicate_rows(wide).tolist())


def test_an_expectation_that_cannot_run_is_an_error_not_a_pass(validator, job):
    trace, manifest = job
    frame = va._frame_for_gx(trace, ex.TRACE_REQUIRED).drop(columns=["seq_id"])
    with pytest.raises(RuntimeError, match="could not run"):
        validator._failures("trace_values", frame, ex.trace_suite_parameters(manifest), "job job-a")


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
        va.conform_trace(_set(trace, "optype", [0], "bogus"), job_id="job-a", source_path=PATH)
    assert error.value.reason == ex.UNKNOWN_OPTYPE and PATH in str(error.value) and "bogus" in str(error.value)
    kept = va.conform_trace(_set(trace, "optype", [0], "bogus"), job_id="job-a", strict=False)
    assert kept["optype"][0].as_py() == "bogus"
    shuffled = trace.set_column(trace.schema.get_field_index("optype"), "optype",
                                pc.dictionary_encode(pc.cast(trace["optype"], pa.string())))
    assert va.conform_trace(shuffled, job_id="job-a").equals(trace)
    assert np.array_equal(va.conform_trace(shuffled)["optype"].chunk(0).indices.to_numpy(),
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
    other = va.Validator()
    reports = []
    threads = [threading.Thread(target=lambda v=v: reports.append(v.validate_job("job-a", manifest, [(PATH, trace)])))
               for v in (validator, other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not overlapped, f"GX ran concurrently in {overlapped}"
    assert len(reports) == 2 and all(report.ok for report in reports)
