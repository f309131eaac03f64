"""Import of the published traces into the lake and export back, losslessly."""
from __future__ import annotations

import datetime as dt
import json
import pathlib
import uuid

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from lake_samples import sample_job
from pipelines import reference as ref
from pipelines.cli import main as strag
from schemas.trace import PUBLISHED_COLUMNS, TRACE_SCHEMA
from transforms.io import lake as lk

TRIALS = ("AR", "ST")


@pytest.fixture
def memory_lake():
    root = f"memory://reference-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _import(reference_dir, lake, trial, date=dt.date(2024, 5, 6)):
    return ref.import_reference(ref.ImportOptions(str(reference_dir / f"trace-{trial}.parquet"),
                                                  str(reference_dir / f"meta-{trial}.yaml"), lake, f"ref-{trial}", date))


@pytest.mark.parametrize("trial", TRIALS)
def test_import_reads_back_equal(reference_dir, memory_lake, trial):
    job = _import(reference_dir, memory_lake, trial)
    original = pq.read_table(reference_dir / f"trace-{trial}.parquet")
    back = lk.read_trace_files(job.trace_files)
    assert back.schema.equals(TRACE_SCHEMA)
    assert back.num_rows == original.num_rows
    for name in PUBLISHED_COLUMNS:
        if name == "optype":
            assert pc.cast(back[name], pa.string()).equals(pc.cast(original[name], pa.string()))
        else:  # widening is exact: compare in the original's type
            assert pc.cast(back[name], original.schema.field(name).type).equals(original[name]), name
            assert pc.cast(original[name], back.schema.field(name).type).equals(back[name]), name
    assert set(back["job_id"].to_pylist()) == {f"ref-{trial}"}
    assert back["host"].null_count == back.num_rows


@pytest.mark.parametrize("trial", TRIALS)
def test_import_builds_a_valid_documented_manifest(reference_dir, memory_lake, trial):
    from transforms.validation import Validator

    job = _import(reference_dir, memory_lake, trial)
    meta = yaml.safe_load((reference_dir / f"meta-{trial}.yaml").read_text())
    table = lk.read_manifest_table(job.manifest_path)
    manifest = table.to_pylist()[0]
    for key in ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size", "world_size"):
        assert manifest[key] == meta[key]
    assert manifest["gpus"] == meta["world_size"]
    assert len(manifest["workers"]) == meta["dp_size"] * meta["pp_size"]
    assert all(w["host"] == f"unknown:ref-{trial}:rank{w['rank']}" for w in manifest["workers"])
    original = pq.read_table(reference_dir / f"trace-{trial}.parquet")
    assert manifest["microbatches"] == pc.max(original["mb_id"]).as_py() + 1
    assert manifest["start_time"] == dt.datetime(2024, 5, 6, tzinfo=dt.timezone.utc)
    assert manifest["end_time"] > manifest["start_time"]
    assert json.loads(table.schema.metadata[ref.REFERENCE_META_KEY.encode()]) == meta
    report = lk.read_validated_job(job, Validator())
    assert report.ok, report.summary()


@pytest.mark.parametrize("trial", TRIALS)
def test_export_reproduces_the_published_files(reference_dir, memory_lake, tmp_path, trial):
    _import(reference_dir, memory_lake, trial)
    trace_path, meta_path, notes = ref.export_reference(ref.ExportOptions(memory_lake, f"ref-{trial}", str(tmp_path)))
    assert notes == []
    assert trace_path == f"{tmp_path}/trace-{trial}.parquet"
    original = pq.read_table(reference_dir / f"trace-{trial}.parquet")
    exported = pq.read_table(trace_path)
    # same column types (dictionary order included) and the same values, row by row
    assert exported.schema.equals(original.schema.remove_metadata())
    assert exported.equals(original.replace_schema_metadata(None))
    assert (yaml.safe_load(pathlib.Path(meta_path).read_text()) == yaml.safe_load((reference_dir / f"meta-{trial}.yaml").read_text()))
    assert list(yaml.safe_load(pathlib.Path(meta_path).read_text())) == list(ref.META_FIELDS)


def test_cli_round_trip(reference_dir, tmp_path, capsys):
    lake, out = str(tmp_path / "lake"), str(tmp_path / "out")
    code = strag(["import-reference", str(reference_dir / "trace-ST.parquet"), str(reference_dir / "meta-ST.yaml"),
                  "--lake", lake, "--job-id", "st", "--date", "2024-01-02"])
    assert code == 0 and "imported" in capsys.readouterr().out
    assert [j.job_id for j in lk.list_jobs(lake, "2024-01-02", "2024-01-02")] == ["st"]
    assert strag(["export-reference", "--lake", lake, "--job-id", "st", "--out", out]) == 0
    assert pq.read_table(f"{out}/trace-ST.parquet").equals(
        pq.read_table(reference_dir / "trace-ST.parquet").replace_schema_metadata(None))


def test_cli_reports_bad_input_without_traceback(reference_dir, tmp_path, capsys):
    bad_meta = tmp_path / "meta.yaml"
    bad_meta.write_text("trial_name: X\ndp_size: 2\npp_size: 4\ntp_size: 1\ndsp_size: 1\nvpp_size: 1\nworld_size: 9\n")
    code = strag(["import-reference", str(reference_dir / "trace-ST.parquet"), str(bad_meta),
                  "--lake", str(tmp_path / "lake"), "--job-id", "st", "--date", "2024-01-02"])
    assert code == 2
    assert "world_size 9" in capsys.readouterr().err
    mismatched = tmp_path / "meta2.yaml"
    mismatched.write_text("trial_name: X\ndp_size: 4\npp_size: 2\ntp_size: 1\ndsp_size: 1\nvpp_size: 1\nworld_size: 8\n")
    assert strag(["import-reference", str(reference_dir / "trace-ST.parquet"), str(mismatched),
                  "--lake", str(tmp_path / "lake"), "--job-id", "st", "--date", "2024-01-02"]) == 2
    assert "do not match dp 4 x pp 2" in capsys.readouterr().err
    assert strag(["export-reference", "--lake", str(tmp_path / "lake"), "--job-id", "nope", "--out", "x"]) == 2
    assert "no lake there" in capsys.readouterr().err   # both imports failed: the lake was never made


def test_export_of_a_generated_job_uses_published_dtypes(memory_lake, tmp_path):
    trace, manifest = sample_job("gen-1", dp=2, pp=2, steps=3, microbatches=4)
    shifted = trace.set_column(trace.schema.get_field_index("start_ts"), "start_ts",
                               pc.add(trace["start_ts"], 1.7e9))  # absolute epoch seconds
    lk.write_job(memory_lake, "2024-03-01", "gen-1", shifted, manifest)
    trace_path, meta_path, notes = ref.export_reference(ref.ExportOptions(memory_lake, "gen-1", str(tmp_path)))
    exported = pq.read_table(trace_path)
    assert notes == []
    assert {f.name: f.type for f in exported.schema} == PUBLISHED_COLUMNS
    assert exported["optype"].chunk(0).dictionary.to_pylist()[-1] == "first-op"
    # start_ts becomes an offset from the step's first op; float32 keeps it to ~1 us
    steps = trace["step"].to_numpy()
    start = trace["start_ts"].to_numpy()
    expected = start - (steps - 10) * 10.0  # sample_job puts each step's first op at (step-10)*10 s
    assert abs(exported["start_ts"].to_numpy().astype(float) - expected).max() < 1e-6
    meta = yaml.safe_load(pathlib.Path(meta_path).read_text())
    assert meta == {"trial_name": "gen-1", "run_id": 0, "dp_size": 2, "dsp_size": 1, "pp_size": 2,
                    "tp_size": 1, "vpp_size": 1, "world_size": 4}


def test_export_widens_only_columns_that_do_not_fit(memory_lake, tmp_path):
    trace, manifest = sample_job("wide", dp=130, pp=1, steps=1, microbatches=1)
    lk.write_job(memory_lake, "2024-03-01", "wide", trace, manifest)
    trace_path, _, notes = ref.export_reference(ref.ExportOptions(memory_lake, "wide", str(tmp_path)))
    exported = pq.read_table(trace_path)
    assert exported.schema.field("dp_rank").type == pa.int16()
    assert exported.schema.field("stage").type == pa.int8()
    assert exported["dp_rank"].to_pylist() == trace["dp_rank"].to_pylist()
    assert len(notes) == 1 and "dp_rank" in notes[0]
