"""CommitTables without a full pipeline: conform/sort, deterministic bytes, staging and
atomic publish per date partition, crash in the middle of publishing, run summary."""
from __future__ import annotations

import datetime as dt
import json
import pathlib

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from schemas.tables import BATCH_TABLES, PART_FILE, TableSpec, read_table
from transforms.batch import commit
from transforms.batch.commit import CommitConfig, CommitError, CommitTables, conform_rows, parquet_bytes, publish_run, stage_partition, summarize_run
from transforms.batch.elements import JobOutcome, JobStats

DATES = ("2024-03-01", "2024-03-02", "2024-03-03")
SPEC = BATCH_TABLES["step_slowdown"]


def _steps(job: str, steps: list[int]) -> pa.Table:
    n = len(steps)
    return pa.table({
        "job_id": [job] * n,
        "step": steps,
        "step_time_observed": [1.5] * n,
        "step_time": [1.4 + s / 100 for s in steps],
        "step_time_ideal": [1.2] * n,
        "slowdown": [(1.4 + s / 100) / 1.2 for s in steps],
        "slow_ranks": pa.array([[1] if s % 2 else [] for s in steps], pa.list_(pa.int32())),
        "fix_cause": ["individual-worker"] * n,
        "fix_saving": [0.1 * (s % 2) for s in steps],
    })


def _files(out: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and not str(p.relative_to(out)).startswith("_")}


def test_conform_rows_sorts_casts_and_orders_columns():
    rows = _steps("b", [3, 1]).select(["slowdown", "step", "job_id", "step_time", "step_time_ideal", "step_time_observed",
                                       "fix_saving", "fix_cause", "slow_ranks"])
    rows = pa.concat_tables([rows, _steps("a", [2]).select(rows.column_names)])
    out = conform_rows(rows, SPEC)
    assert out.schema == SPEC.schema
    assert out.column("job_id").to_pylist() == ["a", "b", "b"]
    assert out.column("step").to_pylist() == [2, 1, 3]


def test_conform_rows_names_the_missing_column():
    with pytest.raises(CommitError, match=r"step_slowdown.*lack columns \['slowdown'\]"):
        conform_rows(_steps("a", [1]).drop(["slowdown"]), SPEC)


def test_conform_rows_rejects_nulls_in_required_columns():
    rows = _steps("a", [1, 2]).set_column(1, "step", pa.array([1, None], pa.int64()))
    with pytest.raises(CommitError, match="column step has 1 nulls"):
        conform_rows(rows, SPEC)


def test_parquet_bytes_do_not_depend_on_chunking_or_time():
    rows = conform_rows(_steps("a", list(range(50))), SPEC)
    chunked = pa.concat_tables([rows.slice(0, 7), rows.slice(7)])
    assert parquet_bytes(rows) == parquet_bytes(chunked) == parquet_bytes(conform_rows(chunked, SPEC))


def _run(out: pathlib.Path, run_id: str, rows_by_date: dict[str, list[pa.Table]], tables=None) -> dict:
    config = CommitConfig(str(out), DATES, run_id, tables=tables or {"step_slowdown": SPEC})
    staged = [stage_partition(config, "step_slowdown", date, parts) for date, parts in rows_by_date.items()]
    return publish_run(config, staged, [JobStats("a", DATES[0], "analysed", ops=10, seconds={"analyze": 0.5})])


def test_publish_writes_every_date_replaces_only_the_range_and_is_byte_identical(tmp_path):
    out = tmp_path / "out"
    outside = out / "step_slowdown" / "date=2024-02-28" / PART_FILE
    outside.parent.mkdir(parents=True)
    outside.write_bytes(b"not touched")
    stale = out / "step_slowdown" / "date=2024-03-01" / "part-old.parquet"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"stale")

    summary = _run(out, "2024-03-01_2024-03-03_a", {"2024-03-01": [_steps("b", [2, 1]), _steps("a", [5])]})
    first = _files(out)
    assert set(first) == {"step_slowdown/date=2024-02-28/part-0.parquet"} | {f"step_slowdown/date={d}/part-0.parquet" for d in DATES}
    assert first["step_slowdown/date=2024-02-28/part-0.parquet"] == b"not touched"
    day1 = pq.read_table(out / "step_slowdown" / "date=2024-03-01" / PART_FILE)
    assert day1.column("job_id").to_pylist() == ["a", "b", "b"] and day1.column("step").to_pylist() == [5, 1, 2]
    assert pq.read_table(out / "step_slowdown" / "date=2024-03-02" / PART_FILE).num_rows == 0
    assert not (out / "_staging").exists()
    assert json.loads((out / "_runs" / "2024-03-01_2024-03-03_a.json").read_text())["jobs"] == {"analysed": 1}
    assert summary["table_rows"] == {"step_slowdown": 3} and summary["partitions"] == 3

    # same rows, other arrival order and chunking: same bytes
    _run(out, "2024-03-01_2024-03-03_b", {"2024-03-01": [_steps("a", [5]), _steps("b", [1]), _steps("b", [2])]})
    assert _files(out) == first


def test_read_table_adds_the_partition_date(tmp_path):
    _run(tmp_path, "2024-03-01_2024-03-03_a", {"2024-03-02": [_steps("a", [1, 2])]})
    table = read_table(str(tmp_path), "step_slowdown")
    assert table.num_rows == 2
    assert set(table.column("date").to_pylist()) == {dt.date(2024, 3, 2)}
    assert read_table(str(tmp_path), "coverage").num_rows == 0  # not written: known schema, empty


def test_read_table_reads_a_column_added_later_as_null_in_older_partitions(tmp_path):
    """job_summary partitions written before replay_discrepancy / untraced_workers existed read
    those columns as null beside newer partitions, whichever file the dataset meets first."""
    from schemas.tables import JOB_SUMMARY_SCHEMA, table_path

    new_names = ("replay_discrepancy", "untraced_workers")
    old_schema = pa.schema([f for f in JOB_SUMMARY_SCHEMA if f.name not in new_names])
    root = pathlib.Path(table_path(str(tmp_path), "job_summary"))
    for date, schema in (("2024-03-01", old_schema), ("2024-03-02", JOB_SUMMARY_SCHEMA)):
        folder = root / f"date={date}"
        folder.mkdir(parents=True)
        pq.write_table(schema.empty_table(), folder / PART_FILE)
    # an old partition with a row: a row from before the columns existed
    row = {f.name: None for f in old_schema}
    table = pa.Table.from_pylist([row], schema=pa.schema([f.with_nullable(True) for f in old_schema]))
    pq.write_table(table, root / "date=2024-03-01" / PART_FILE)
    read = read_table(str(tmp_path), "job_summary")
    assert {n for n in new_names} <= set(read.column_names) and read.num_rows == 1
    assert read.column("replay_discrepancy").to_pylist() == [None]
    assert read.column("untraced_workers").to_pylist() == [None]


def test_stage_partition_rejects_dates_outside_the_range_and_unknown_tables(tmp_path):
    config = CommitConfig(str(tmp_path), DATES, "r1", tables={"step_slowdown": SPEC})
    with pytest.raises(CommitError, match="outside the run's range"):
        stage_partition(config, "step_slowdown", "2024-04-01", [_steps("a", [1])])
    with pytest.raises(CommitError, match="'nope' is not registered"):
        stage_partition(config, "nope", DATES[0], [])


def test_crash_in_the_middle_of_publishing_leaves_whole_partitions(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _run(out, "2024-03-01_2024-03-03_old", {d: [_steps("old", [1])] for d in DATES})
    old = _files(out)

    def crash(point):
        if point == "publish:2":
            raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(commit, "_crash_point", crash)
    with pytest.raises(KeyboardInterrupt):
        _run(out, "2024-03-01_2024-03-03_new", {d: [_steps("new", [1, 2])] for d in DATES})
    monkeypatch.undo()
    torn = _files(out)
    assert set(torn) == set(old)
    states = [("old" if torn[k] == old[k] else "new") for k in sorted(torn)]
    assert states == ["new", "new", "old"]
    for key in torn:  # every visible file is a whole parquet file
        assert pq.read_table(out / key).column("job_id").to_pylist()[0] in ("old", "new")
    assert (out / "_staging" / "2024-03-01_2024-03-03_new").exists()

    _run(out, "2024-03-01_2024-03-03_again", {d: [_steps("new", [1, 2])] for d in DATES})
    clean = tmp_path / "clean"
    _run(clean, "2024-03-01_2024-03-03_c", {d: [_steps("new", [1, 2])] for d in DATES})
    assert _files(out) == _files(clean)
    assert not (out / "_staging").exists()  # the crashed run's staging was cleaned by the rerun


def test_summarize_run_counts_statuses_reasons_and_phases():
    stats = [
        JobStats("a", DATES[0], "analysed", ops=100, rows_read=100, seconds={"read": 1.0, "analyze": 2.0}),
        JobStats("b", DATES[0], "quarantined", reason_code="missing_manifest", rows_read=5, rows_quarantined=5, seconds={"read": 0.5}),
        JobStats("c", DATES[1], "discarded", reason_code="replay_discrepancy", ops=7),
    ]
    summary = summarize_run(stats)
    assert summary["jobs"] == {"analysed": 1, "discarded": 1, "quarantined": 1}
    assert summary["reasons"] == {"missing_manifest": 1, "replay_discrepancy": 1}
    assert summary["ops"] == 107 and summary["rows_quarantined"] == 5
    assert summary["seconds"]["read"] == 1.5 and summary["seconds"]["analyze"] == 2.0


def test_table_spec_checks_itself():
    with pytest.raises(ValueError, match="sort keys"):
        TableSpec("x", SPEC.schema, ("nope",))
    with pytest.raises(ValueError, match="partition key"):
        TableSpec("x", pa.schema([("date", pa.date32())]), ())
    with pytest.raises(ValueError, match="folder names"):
        TableSpec("_x", SPEC.schema, ())
    with pytest.raises(ValueError, match="sorted list"):
        CommitConfig("/tmp/x", ("2024-01-02", "2024-01-01"), "r")


def _unpartitioned_rollup(out: str):
    return {"rollup/steps": read_table(out, "step_slowdown").drop(["date"])}


def test_commit_tables_in_a_pipeline_with_fragments_outcomes_and_a_finalizer(tmp_path):
    rollup = TableSpec("rollup/steps", SPEC.schema, SPEC.sort_keys, partitioned=False)
    config = CommitConfig(str(tmp_path), DATES, "2024-03-01_2024-03-03_p", tables={"step_slowdown": SPEC, "rollup/steps": rollup},
                          finalizers=(_unpartitioned_rollup,))
    outcome = JobOutcome("a", DATES[0], {"step_slowdown": _steps("a", [1, 2])}, JobStats("a", DATES[0], "analysed", ops=3))
    with beam.Pipeline(options=PipelineOptions(runner="FnApiRunner")) as p:
        outcomes = p | "Outcomes" >> beam.Create([outcome])
        extra = p | "Extra" >> beam.Create([("step_slowdown", DATES[2], _steps("z", [9]))])
        (outcomes, extra) | CommitTables(config)
    assert read_table(str(tmp_path), "step_slowdown").column("job_id").to_pylist() == ["a", "a", "z"]
    assert pq.read_table(tmp_path / "rollup" / "steps" / PART_FILE).num_rows == 3
    summary = json.loads((tmp_path / "_runs" / f"{config.run_id}.json").read_text())
    assert summary["jobs"] == {"analysed": 1} and summary["ops"] == 3


def test_commit_tables_publishes_empty_partitions_when_nothing_was_found(tmp_path):
    config = CommitConfig(str(tmp_path), DATES[:1], "2024-03-01_2024-03-01_e")
    with beam.Pipeline(options=PipelineOptions(runner="FnApiRunner")) as p:
        p | beam.Create([]).with_output_types(JobOutcome) | CommitTables(config)
    assert sorted(p.relative_to(tmp_path).parts[0] for p in tmp_path.glob("*/date=2024-03-01/part-0.parquet")) == sorted(BATCH_TABLES)
