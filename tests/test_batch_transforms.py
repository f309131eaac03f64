"""Validation / AnalyzeJobs as plain functions and small composites: quarantine rows,
whole-window decisions, engine errors, unexpected errors, result tables against the schemas."""
from __future__ import annotations

import datetime as dt

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to

from schemas.expectations import Problem
from schemas.tables import BATCH_TABLES
from transforms.batch.analyze_jobs import AnalyzeJobs, analyze_group, analyze_matched_window, analyze_window
from transforms.batch.commit import conform_rows
from transforms.batch.elements import ArrowElementCoder, JobOutcome, JobStats, MatchedJob, ValidatedJob, WindowGroup
from transforms.io.lake import LakeJob, list_jobs, write_job
from transforms.batch.match import MatchJobs, balanced_order, date_range, group_windows, match_windows
from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec, generate_job
from transforms.batch.outcomes import UNEXPECTED_ERROR, dead_letters, quarantine_on_error
from transforms.batch.read_windows import quarantine_rows, validate_job_window
from transforms.validation import Validator
from transforms.whatif import TraceStructureError, analyze_job

DATE = "2024-05-01"


@pytest.fixture(scope="module")
def validator() -> Validator:
    return Validator()


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> str:
    """Two small generated jobs: one straggling (slow worker), one clean; plus a manifest-only window."""
    root = str(tmp_path_factory.mktemp("transforms") / "lake")
    for job_id, seed, causes in (("slow", 1, (Cause("slow_worker", {"dp_rank": 0, "stage": 1, "factor": 1.7}),)), ("clean", 2, ())):
        spec = JobSpec(job_id=job_id, dp=2, pp=2, microbatches=4, steps=4, sessions=1, seed=seed,
                       date=dt.date.fromisoformat(DATE), causes=causes)
        job = generate_job(spec)
        write_job(root, spec.date, job_id, dict(job.files()), job.manifest)
    return root


def _job(lake: str, job_id: str) -> LakeJob:
    return next(j for j in list_jobs(lake, DATE, DATE) if j.job_id == job_id)


def _window(lake: str, job_id: str, validator=None) -> MatchedJob:
    return match_windows([_job(lake, job_id)], validator)[0]


def test_quarantine_rows_list_each_rejected_row_and_each_unlisted_problem(lake):
    job = _job(lake, "slow")
    invalid = pa.table({"job_id": ["slow", "slow"], "source_path": ["f1.parquet", "f1.parquet"],
                        "reason": ["negative_duration", "negative_duration"], "detail": ["row a", "row b"]})
    problems = [
        Problem("negative_duration", "slow", "f1.parquet", "2 rows", 2),           # listed row by row above
        Problem("duplicate_row", "slow", None, "3 ops in two files", 3),            # not listed: kept as one row
        Problem("unreadable_file", "slow", "f2.parquet", "cannot be read", 0),
    ]
    rows = quarantine_rows(job, problems, invalid).to_pylist()
    assert [(r["level"], r["reason_code"], r["detail"]) for r in rows] == [
        ("row", "negative_duration", "row a"), ("row", "negative_duration", "row b"),
        ("job", "duplicate_row", "3 ops in two files"), ("file", "unreadable_file", "cannot be read")]
    assert rows[2]["source_path"].endswith(f"traces/date={DATE}/job_id=slow") and rows[2]["rows"] == 3
    assert all(r["reason"] for r in rows)


def test_validate_job_window_passes_a_valid_window_and_times_both_phases(lake, validator):
    validated = validate_job_window(_window(lake, "clean", validator), validator)
    assert validated.problem is None and validated.quarantine.num_rows == 0
    assert validated.trace.num_rows == validated.stats.rows_read > 0
    assert validated.manifest["job_id"] == "clean" and validated.manifest["dp_size"] == 2
    assert validated.stats.seconds["validate"] > 0 and validated.stats.seconds["read"] > 0


def test_a_window_without_manifest_is_quarantined_whole(lake, validator):
    job = _job(lake, "clean")
    orphan = LakeJob(job.lake, job.date, "clean", job.trace_files, None)
    validated = validate_job_window(match_windows([orphan], validator)[0], validator)
    assert validated.problem.reason_code == "missing_manifest" and validated.trace is None
    assert "missing_manifest" in validated.quarantine.column("reason_code").to_pylist()


def test_analyze_window_fills_every_table_that_conforms_to_its_schema(lake, validator):
    validated = validate_job_window(_window(lake, "slow", validator), validator)
    outcome = analyze_window(validated, analyze_job)
    assert outcome.stats.status == "analysed" and outcome.stats.ops == validated.trace.num_rows
    assert set(outcome.tables) == set(BATCH_TABLES)
    for name, rows in outcome.tables.items():
        conform_rows(rows, BATCH_TABLES[name])  # raises on a missing column, a wrong type or a null
    summary = outcome.tables["job_summary"].to_pylist()[0]
    assert summary["attributed"] and summary["m_w"] is not None
    assert outcome.tables["worker_attribution"].num_rows == 4
    dp = outcome.tables["dp_attribution"]
    assert dp.num_rows == 2 * (1 + summary["n_steps"])  # one overall + one per step, for each DP rank
    assert outcome.tables["coverage"].to_pylist()[0]["status"] == "analysed"


def test_an_engine_error_quarantines_the_window_with_its_reason(lake, validator):
    validated = validate_job_window(_window(lake, "clean", validator), validator)

    def broken_engine(trace, meta, job_id):
        raise TraceStructureError("step 3 differs from step 1", job_id=job_id, step=3, dp_rank=1, stage=0, op="gc_0_0")

    outcome = analyze_window(validated, broken_engine)
    assert outcome.stats.status == "quarantined" and outcome.stats.reason_code == "trace_structure"
    record = outcome.tables["quarantine"].to_pylist()[-1]
    assert record["level"] == "job" and record["reason_code"] == "trace_structure"
    assert "job 'clean'" in record["detail"] and "step 3" in record["detail"] and "gc_0_0" in record["detail"]
    assert outcome.tables["coverage"].to_pylist()[0]["reason_code"] == "trace_structure"
    assert "job_summary" not in outcome.tables


def test_balanced_order_deals_equal_bytes_into_each_chunk():
    weights = [100, 1, 1, 1, 50, 50, 2, 3, 90, 10, 40, 60]
    order = balanced_order(weights, 4)
    assert sorted(order) == list(range(len(weights)))
    totals = [sum(weights[i] for i in order[k:k + 4]) for k in range(0, len(weights), 4)]
    naive = [sum(weights[k:k + 4]) for k in range(0, len(weights), 4)]  # [103, 105, 200]
    assert max(totals) - min(totals) < 0.2 * sum(weights) / 3 < max(naive) - min(naive), totals
    assert balanced_order([5, 1], 4) == [0, 1]


def test_group_windows_deals_equal_sizes_and_bytes_into_each_group():
    rng = np.random.default_rng(3)
    weights = [int(w) for w in rng.pareto(3.0, 60) * 100 + 10]   # long-tailed, like a fleet's job sizes
    windows = [MatchedJob(LakeJob("l", DATE, f"j{i}", (), None), None) for i in range(60)]
    groups = group_windows(windows, weights, 8)
    assert sorted(len(g.windows) for g in groups) == [7, 7, 7, 7, 8, 8, 8, 8]
    assert sorted(m.job.job_id for g in groups for m in g.windows) == sorted(m.job.job_id for m in windows)
    weight = {f"j{i}": w for i, w in enumerate(weights)}
    totals = [sum(weight[m.job.job_id] for m in g.windows) for g in groups]
    in_order = [sum(weights[i:i + 8]) for i in range(0, 60, 8)]
    assert max(totals) - min(totals) < 0.15 * sum(weights) / 8 < max(in_order) - min(in_order), (totals, in_order)
    assert [g.windows for g in group_windows(windows[:10], [0] * 10, 3)] == [tuple(windows[:4]), tuple(windows[4:7]), tuple(windows[7:10])]
    assert len(group_windows(windows[:10], weights[:10], 50)) == 10   # never an empty group
    with pytest.raises(ValueError, match="group"):
        group_windows(windows, weights, 0)


def test_a_group_is_validated_in_one_screen_and_analysed_window_by_window(lake, validator, monkeypatch):
    calls = []
    original = Validator.validate_jobs
    monkeypatch.setattr(Validator, "validate_jobs", lambda self, jobs, **k: calls.append(len(jobs)) or original(self, jobs, **k))
    group = WindowGroup(tuple(match_windows([_job(lake, "slow"), _job(lake, "clean")], validator)))
    outcomes = list(analyze_group(group, validator, analyze_job))
    assert calls == [2]
    assert [(o.job_id, o.stats.status) for o in outcomes] == [("slow", "analysed"), ("clean", "analysed")]
    alone = [analyze_matched_window(m, validator, analyze_job) for m in group.windows]
    for together, single in zip(outcomes, alone):
        assert together.tables["job_summary"].equals(single.tables["job_summary"])
        assert set(together.stats.seconds) >= {"read", "validate", "analyze"}


def test_an_unexpected_error_in_a_group_quarantines_only_its_window(lake, validator, monkeypatch):
    group = WindowGroup(tuple(match_windows([_job(lake, "slow"), _job(lake, "clean")], validator)))

    def engine(trace, meta, job_id):
        if job_id == "clean":
            raise RuntimeError("disk on fire")
        return analyze_job(trace, meta, job_id)

    outcomes = {o.job_id: o for o in analyze_group(group, validator, engine)}
    assert outcomes["slow"].stats.status == "analysed"
    assert outcomes["clean"].stats.reason_code == UNEXPECTED_ERROR
    assert "disk on fire" in outcomes["clean"].tables["quarantine"].column("detail")[0].as_py()
    # validating the group together fails: each window is validated alone, and only the culprit is quarantined
    original = Validator.validate_jobs

    def fragile(self, jobs, **kwargs):
        if any(job.job_id == "clean" for job in jobs):
            raise ValueError("validator meets a value it never saw")
        return original(self, jobs, **kwargs)

    monkeypatch.setattr(Validator, "validate_jobs", fragile)
    outcomes = {o.job_id: o for o in analyze_group(group, validator, analyze_job)}
    assert outcomes["slow"].stats.status == "analysed"
    assert outcomes["clean"].stats.reason_code == UNEXPECTED_ERROR
    assert "never saw" in outcomes["clean"].tables["quarantine"].column("detail")[0].as_py()

    # failing storage is not bad data: it is not quarantined, it fails the run
    def unreachable(self, jobs, **kwargs):
        raise ConnectionResetError("bucket unreachable")

    monkeypatch.setattr(Validator, "validate_jobs", unreachable)
    with pytest.raises(ConnectionResetError):
        list(analyze_group(group, validator, analyze_job))
    # a dead letter of a whole group quarantines each of its windows
    letters = list(dead_letters((group, (RuntimeError, "RuntimeError('boom')", ["trace"]))))
    assert [(o.job_id, o.stats.reason_code) for o in letters] == [("slow", UNEXPECTED_ERROR), ("clean", UNEXPECTED_ERROR)]


def test_an_error_escaping_a_group_quarantines_its_windows_in_the_one_analysis_step(lake, validator, monkeypatch):
    group = WindowGroup(tuple(match_windows([_job(lake, "slow"), _job(lake, "clean")], validator)))

    def half_done(group, validator, engine):   # the first window's outcome, then a bug in the bookkeeping
        yield from analyze_group(WindowGroup(group.windows[:1]), validator, engine)
        raise KeyError("bookkeeping")

    outcomes = quarantine_on_error(group, half_done(group, validator, analyze_job))
    assert [(o.job_id, o.stats.status, o.stats.reason_code) for o in outcomes] == [
        ("slow", "quarantined", UNEXPECTED_ERROR), ("clean", "quarantined", UNEXPECTED_ERROR)]
    assert "KeyError: 'bookkeeping'" in outcomes[0].tables["quarantine"].column("detail")[0].as_py()
    assert quarantine_on_error(group, iter(outcomes)) == outcomes

    def unreachable():   # failing storage is not bad data: it fails the run
        raise ConnectionResetError("bucket unreachable")
        yield

    with pytest.raises(ConnectionResetError):
        quarantine_on_error(group, unreachable())
    # in the pipeline: AnalyzeJobs is one step (no dead-letter branch to flatten back in) that quarantines the group
    monkeypatch.setattr("transforms.batch.analyze_jobs.analyze_group", half_done)
    with beam.Pipeline(options=PipelineOptions(runner="FnApiRunner")) as p:
        analysed = p | beam.Create([group]) | AnalyzeJobs()
        assert_that(analysed | beam.Map(lambda o: (o.job_id, o.stats.reason_code)),
                    equal_to([("slow", UNEXPECTED_ERROR), ("clean", UNEXPECTED_ERROR)]))
    assert [t.full_label for t in _leaf_transforms(p) if "AnalyzeJobs" in t.full_label] == ["AnalyzeJobs/AnalyzeJob"]


def _leaf_transforms(p: beam.Pipeline) -> list:
    leaves = []

    class Visitor(beam.pipeline.PipelineVisitor):
        def visit_transform(self, node):
            leaves.append(node)

    p.visit(Visitor())
    return leaves


def test_match_jobs_lists_each_window_once(lake):
    with beam.Pipeline(options=PipelineOptions(runner="FnApiRunner")) as p:
        groups = p | MatchJobs(lake, DATE, DATE)
        ids = groups | beam.FlatMap(lambda g: [(m.job.date, m.job.job_id, m.manifest["job_id"]) for m in g.windows])
        assert_that(ids, equal_to([(DATE, "clean", "clean"), (DATE, "slow", "slow")]))
        assert_that(groups | "Sizes" >> beam.Map(lambda g: len(g.windows)), equal_to([1, 1]), label="OnePerGroup")
    with beam.Pipeline(options=PipelineOptions(runner="FnApiRunner")) as p:
        sizes = p | MatchJobs(lake, DATE, DATE, groups=1) | beam.Map(lambda g: sorted(m.job.job_id for m in g.windows))
        assert_that(sizes, equal_to([["clean", "slow"]]))
    assert date_range("2024-02-28", "2024-03-01") == ("2024-02-28", "2024-02-29", "2024-03-01")
    with pytest.raises(ValueError, match="reversed"):
        MatchJobs(lake, "2024-03-02", "2024-03-01")


def test_match_jobs_bounds_a_group_by_its_trace_bytes(lake, monkeypatch):
    """One group asked for, but the two windows' trace files exceed GROUP_BYTES together: each
    window becomes a group of its own (a group holds all its windows' op rows in a worker)."""
    from transforms.batch import match

    sizes = match.trace_bytes(list_jobs(lake, DATE, DATE))
    assert all(size > 0 for size in sizes)
    for bound, expected in ((sum(sizes), [["clean", "slow"]]), (max(sizes), [["clean"], ["slow"]])):
        monkeypatch.setattr(match, "GROUP_BYTES", bound)
        with beam.Pipeline(options=PipelineOptions(runner="FnApiRunner")) as p:
            groups = p | MatchJobs(lake, DATE, DATE, groups=1) | beam.Map(lambda g: sorted(m.job.job_id for m in g.windows))
            assert_that(groups, equal_to(expected))


def test_arrow_coder_estimates_size_without_encoding(monkeypatch):
    coder = ArrowElementCoder()
    table = pa.table({"x": np.arange(100_000)})
    element = ValidatedJob(LakeJob("l", DATE, "j", (), None), None, table, pa.table({}), None, JobStats("j", DATE, "analysed"))
    monkeypatch.setattr("pickle.dumps", lambda *a, **k: pytest.fail("estimate_size must not serialise"))
    assert coder.estimate_size(element) >= table.nbytes
    monkeypatch.undo()
    outcome = JobOutcome("j", DATE, {"x": table}, JobStats("j", DATE, "analysed"))
    assert coder.decode(coder.encode(outcome)).tables["x"].equals(table)


def test_a_window_that_lost_a_file_is_not_analysed_on_the_rest(tmp_path, validator):
    """Partial input: a job written as one file per sampled step, one of them corrupt. Every
    worker still has rows and the steps left line up, but the window is quarantined whole
    (incomplete_window), as `strag analyze --lake` refuses it."""
    from pipelines import analyze as analyze_cli
    from schemas.expectations import INCOMPLETE_WINDOW
    from transforms.io.lake import list_jobs, write_job
    from transforms.synth.job import JobSpec, generate_job

    lake = str(tmp_path / "lake")
    job = generate_job(JobSpec("per-step", dp=2, pp=2, microbatches=4, steps=4, sessions=1, seed=5))
    steps = sorted(set(job.trace.column("step").to_pylist()))
    files = {f"step-{s}.parquet": job.trace.filter(pc.equal(job.trace["step"], s)) for s in steps}
    written = write_job(lake, job.spec.date, "per-step", files, job.manifest)
    victim = written.trace_files[1]
    with open(victim, "r+b") as handle:
        handle.truncate(300)
    (listed,) = list_jobs(lake)
    group = WindowGroup(tuple(match_windows([listed], validator)))
    (outcome,) = analyze_group(group, validator, analyze_job)
    assert outcome.stats.status == "quarantined" and outcome.stats.reason_code == INCOMPLETE_WINDOW
    rows = outcome.tables["quarantine"].to_pylist()
    assert [r["reason_code"] for r in rows] == ["unreadable_file", INCOMPLETE_WINDOW]
    assert victim in rows[1]["detail"] and rows[1]["level"] == "job"
    assert "job_summary" not in outcome.tables
    assert analyze_cli.run(["--lake", lake, "--job-id", "per-step"]) == 2


def test_an_empty_range_is_an_empty_run_not_an_error(lake):
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        groups = p | MatchJobs(lake, "2030-01-01", "2030-01-02", jobs=[])
        assert_that(groups, equal_to([]))


def test_a_mistyped_batch_option_is_refused_with_a_suggestion(lake):
    from pipelines import batch

    with pytest.raises(batch.BatchUsageError, match=r"--wokers \(did you mean --workers\?\)"):
        batch.parse(["--lake", lake, "--from", DATE, "--to", DATE, "--out", "/tmp/never", "--wokers", "2"])
    opts = batch.parse(["--lake", lake, "--from", DATE, "--to", DATE, "--out", "/tmp/never", "--flink_master=x:1"])
    assert opts.beam_args == ("--flink_master=x:1",)


def test_strag_without_a_command_is_a_usage_error(capsys):
    from pipelines.cli import main

    assert main([]) == 2 and "give a command" in capsys.readouterr().err
    assert main(["--help"]) == 0
