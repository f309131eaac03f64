"""transforms.io.lake: fsspec IO of the trace lake on a local folder, file:// and memory://."""
from __future__ import annotations

import datetime as dt
import json
import pathlib
import uuid

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from transforms.io.storage import StorageError

from lake_samples import sample_job
from schemas.lake import manifest_path, trace_dir
from schemas.trace import MANIFEST_SCHEMA, SCHEMA_VERSION, TRACE_SCHEMA
from transforms.io import lake as lk


@pytest.fixture(params=["local", "file-url", "memory"])
def lake(request, tmp_path):
    """A fresh lake URL in each supported style; memory lakes are removed afterwards."""
    if request.param == "local":
        yield str(tmp_path / "lake")
    elif request.param == "file-url":
        yield f"file://{tmp_path}/lake"
    else:
        root = f"memory://lake-{uuid.uuid4().hex}"
        yield root
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)


def _files(lake: str) -> list[str]:
    fs, root = lk.filesystem(lake)
    return sorted(p[len(root.rstrip("/")) + 1:] for p in fs.find(root))


def test_write_then_list_and_read_back_equal(lake):
    trace, manifest = sample_job("job-a", dp=2, pp=2)
    halves = {"w0.parquet": trace.slice(0, 100), "w1.parquet": trace.slice(100)}
    written = lk.write_job(lake, "2024-03-01", "job-a", halves, manifest)
    assert written.trace_files == (f"{trace_dir(lake, '2024-03-01', 'job-a')}/w0.parquet",
                                   f"{trace_dir(lake, '2024-03-01', 'job-a')}/w1.parquet")
    assert written.manifest_path == manifest_path(lake, "2024-03-01", "job-a")
    assert lk.list_jobs(lake) == [written]
    back = lk.read_trace_files(written.trace_files)
    assert back.schema.equals(TRACE_SCHEMA) and back.equals(trace)
    row = lk.read_manifest(written.manifest_path)
    assert row["job_id"] == "job-a" and row["date"] == dt.date(2024, 3, 1)
    assert row["workers"] == manifest["workers"] and row["end_time"] == manifest["end_time"]
    # layout on storage: Hive partitions + the schema-version marker, no temporary leftovers
    assert _files(lake) == [
        "_lake.json",
        "manifests/date=2024-03-01/job-a.parquet",
        "traces/date=2024-03-01/job_id=job-a/w0.parquet",
        "traces/date=2024-03-01/job_id=job-a/w1.parquet",
    ]
    assert lk.read_lake_marker(lake)["schema_version"] == SCHEMA_VERSION


def test_paths_keep_the_callers_url_style(lake):
    trace, manifest = sample_job("job-a", dp=1, pp=1, steps=1)
    job = lk.write_job(lake, dt.date(2024, 3, 1), "job-a", trace, manifest)
    for path in (*job.trace_files, job.manifest_path):
        assert path.startswith(lake + "/")
        with fsspec.open(path, "rb") as handle:   # any process can open it by URL alone
            assert handle.read(4) == b"PAR1"


def test_list_jobs_filters_dates_and_reports_incomplete_jobs(lake):
    for day, job_id in [(1, "a"), (2, "b"), (3, "c")]:
        trace, manifest = sample_job(job_id, dp=1, pp=1, steps=1, date=dt.date(2024, 3, day))
        lk.write_job(lake, dt.date(2024, 3, day), job_id, trace, manifest)
    assert [j.job_id for j in lk.list_jobs(lake, "2024-03-02", "2024-03-03")] == ["b", "c"]
    assert [j.job_id for j in lk.list_jobs(lake, date_to=dt.date(2024, 3, 1))] == ["a"]
    fs, _ = lk.filesystem(lake)
    fs.rm(manifest_path(lake, "2024-03-02", "b"))
    fs.rm(trace_dir(lake, "2024-03-03", "c"), recursive=True)
    jobs = {j.job_id: j for j in lk.list_jobs(lake)}
    assert jobs["b"].manifest_path is None and jobs["b"].trace_files
    assert jobs["c"].trace_files == () and jobs["c"].manifest_path is not None


def test_listing_ignores_hidden_and_foreign_entries(lake):
    trace, manifest = sample_job("job-a", dp=1, pp=1, steps=1)
    job = lk.write_job(lake, "2024-03-01", "job-a", trace, manifest)
    folder = trace_dir(lake, "2024-03-01", "job-a")
    fs, _ = lk.filesystem(lake)
    for junk in (f"{folder}/.part.parquet.123.tmp", f"{folder}/_SUCCESS", f"{lake}/traces/date=garbage/x.parquet",
                 f"{lake}/traces/README.txt"):
        inner = lk.filesystem(junk)[1]
        fs.makedirs(inner.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(inner, b"x")
    assert lk.list_jobs(lake) == [job]


def test_schema_version_mismatch_is_refused(lake):
    trace, manifest = sample_job("job-a", dp=1, pp=1, steps=1)
    lk.write_job(lake, "2024-03-01", "job-a", trace, manifest)
    fs, path = lk.filesystem(f"{lake}/_lake.json")
    fs.pipe_file(path, json.dumps({"schema_version": "999"}).encode())
    with pytest.raises(lk.LakeError, match="schema version 999"):
        lk.list_jobs(lake)
    with pytest.raises(lk.LakeError, match="schema version 999"):
        lk.write_job(lake, "2024-03-01", "job-a", trace, manifest)


def test_a_lake_without_marker_reads_as_current_version(lake):
    assert lk.read_lake_marker(lake) is None
    assert lk.list_jobs(lake) == []


def test_write_job_refuses_contract_breaks(lake):
    trace, manifest = sample_job("job-a", dp=1, pp=1, steps=1)
    with pytest.raises(ValueError, match="job 'job-b'"):
        lk.write_job(lake, "2024-03-01", "job-b", trace, manifest)
    with pytest.raises(ValueError, match="lacks field"):
        lk.write_job(lake, "2024-03-01", "job-a", trace, {"job_id": "job-a"})
    broken = trace.drop_columns(["duration"])
    with pytest.raises(Exception, match="duration"):
        lk.write_job(lake, "2024-03-01", "job-a", broken, manifest)
    with pytest.raises(ValueError, match="plain"):
        lk.write_job(lake, "2024-03-01", "job-a", {"../x.parquet": trace}, manifest)


def test_read_errors_name_the_file_and_reason(lake, monkeypatch):
    trace, manifest = sample_job("job-a", dp=1, pp=1, steps=1)
    job = lk.write_job(lake, "2024-03-01", "job-a", trace, manifest)
    path = job.trace_files[0]
    fs, inner = lk.filesystem(path)
    data = fs.cat_file(inner)
    fs.pipe_file(inner, data[: len(data) // 2])
    with pytest.raises(lk.LakeReadError) as error:
        lk.read_trace_files(job.trace_files)
    assert error.value.path == path and error.value.reason == "unreadable_file" and path in str(error.value)
    lk.write_parquet(path, trace.drop_columns(["step"]))
    with pytest.raises(lk.LakeReadError) as error:
        lk.read_trace_file(path)
    assert error.value.reason == "missing_column" and "step" in str(error.value) and path in str(error.value)
    # a file that is not there is not bad data: storage did not deliver it (retried, then StorageError)
    monkeypatch.setenv("STRAG_IO_BACKOFF_S", "0.001")
    with pytest.raises(StorageError, match="after 4 attempts") as error:
        lk.read_manifest(f"{lake}/manifests/date=2024-03-01/nope.parquet")
    assert "nope.parquet" in str(error.value) and isinstance(error.value, OSError)


def test_manifest_metadata_is_kept(lake):
    trace, manifest = sample_job("job-a", dp=1, pp=1, steps=1)
    job = lk.write_job(lake, "2024-03-01", "job-a", trace, manifest, manifest_metadata={"x.origin": "test"})
    table = lk.read_manifest_table(job.manifest_path)
    assert table.schema.metadata[b"x.origin"] == b"test"
    assert table.schema.remove_metadata().equals(MANIFEST_SCHEMA.remove_metadata())


def test_find_job_needs_a_date_when_ambiguous(lake):
    for day in (1, 2):
        trace, manifest = sample_job("job-a", dp=1, pp=1, steps=1, date=dt.date(2024, 3, day))
        lk.write_job(lake, dt.date(2024, 3, day), "job-a", trace, manifest)
    with pytest.raises(lk.LakeError, match="pass a date"):
        lk.find_job(lake, "job-a")
    assert lk.find_job(lake, "job-a", "2024-03-02").date == "2024-03-02"
    with pytest.raises(lk.LakeError, match="no job 'zzz'"):
        lk.find_job(lake, "zzz")


def test_optype_dictionary_is_normalised_on_write(lake):
    trace, manifest = sample_job("job-a", dp=1, pp=2, steps=1)
    reordered = trace.set_column(trace.schema.get_field_index("optype"), "optype",
                                 pc.dictionary_encode(pc.cast(trace["optype"], pa.string())))
    job = lk.write_job(lake, "2024-03-01", "job-a", reordered, manifest)
    assert lk.read_trace_files(job.trace_files).equals(trace)


def test_read_validated_job_end_to_end(lake):
    from transforms.validation import Validator

    trace, manifest = sample_job("job-a", dp=2, pp=2, steps=2)
    job = lk.write_job(lake, "2024-03-01", "job-a", [trace.slice(0, 50), trace.slice(50)], manifest)
    validator = Validator()
    report = lk.read_validated_job(job, validator)
    assert report.ok, report.summary()
    assert report.valid.equals(trace)
    manifests = lk.read_manifests([job.manifest_path], validator)
    assert manifests[job.manifest_path][1] == []
    assert lk.read_validated_job(job, validator, manifests).ok


def test_a_column_the_footer_pins_is_made_from_it_and_equals_the_file(tmp_path):
    """read_parquet makes the columns whose footer statistics pin every value without decoding
    them: a string column of one value (a trace file's job_id) and a flat column no row fills (an
    optional column the writer had nothing for). The table equals pyarrow's own read, schema and
    metadata included. Read as usual: a column with several values, a null or a value too long for
    exact statistics; a partly null column; a list column of nulls (its leaf statistics count
    empty lists as nulls too, so they cannot tell the two apart)."""
    import pyarrow.parquet as pq

    n = 5000
    long_id = "j" * 80
    table = pa.table({"job_id": pa.array(["job-7"] * n), "host": pa.array([f"h{i % 3}" for i in range(n)]),
                      "long": pa.array([long_id] * n), "maybe": pa.array(["x"] * (n - 1) + [None]),
                      "step": pa.array(range(n), pa.int64()), "gc_wait": pa.nulls(n, pa.float64()),
                      "n_ops": pa.array([None] * (n - 1) + [3], pa.int32()),
                      "seq_lens": pa.nulls(n, pa.list_(pa.int32())), "lens_empty": pa.array([[]] * n, pa.list_(pa.int32()))},
                     schema=pa.schema([pa.field("job_id", pa.string(), nullable=False), ("host", pa.string()),
                                       ("long", pa.string()), ("maybe", pa.string()), ("step", pa.int64()),
                                       ("gc_wait", pa.float64()), ("n_ops", pa.int32()), ("seq_lens", pa.list_(pa.int32())),
                                       ("lens_empty", pa.list_(pa.int32()))],
                                      metadata={"strag.table": "trace"}))
    path = tmp_path / "part.parquet"
    pq.write_table(table, path, row_group_size=2000)
    assert sorted(lk._footer_columns(pq.ParquetFile(path))) == ["gc_wait", "job_id"]
    got = lk.read_parquet(str(path))
    assert got.equals(pq.read_table(path), check_metadata=True) and got.equals(table)
    assert got["lens_empty"].to_pylist() == [[]] * n and got["seq_lens"].null_count == n
    # the host read dictionary-encoded, as the trace files' reader asks: the same values
    coded = lk.read_parquet(str(path), dictionary=("host",))
    assert pa.types.is_dictionary(coded.schema.field("host").type)
    assert coded["host"].cast(pa.string()).equals(table["host"]) and coded.drop_columns(["host"]).equals(table.drop_columns(["host"]))


@pytest.mark.parametrize("chosen", [None, "mimalloc"])
def test_analysis_workers_use_the_system_allocator_and_one_arrow_thread_unless_the_user_chose(chosen):
    """The batch DoFn's setup makes glibc's malloc Arrow's pool (mimalloc re-faults every
    window's buffers) and gives Arrow one thread (a worker per core already); a pool the user
    chose with ARROW_DEFAULT_MEMORY_POOL is kept."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if chosen:
        env["ARROW_DEFAULT_MEMORY_POOL"] = chosen
    setup = ("from transforms.batch.analyze_jobs import _AnalyzeJobFn; _AnalyzeJobFn().setup()" if chosen is None
             else "from transforms import resources; resources.prepare_batch_worker()")   # the DoFn once (its GX set-up costs seconds), then the rule itself
    code = f"import pyarrow as pa\n{setup}\nprint(pa.default_memory_pool().backend_name, pa.cpu_count())\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=str(pathlib.Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == [chosen or "system", "1"]


def test_keep_freed_memory_sets_glibcs_thresholds_unless_the_user_did():
    """On glibc, mallopt accepts both settings (True); a threshold the user set in the environment
    (read by glibc at start) is left alone (False, nothing called)."""
    import os
    import platform
    import subprocess
    import sys

    code = "from transforms.resources import keep_freed_memory; print(keep_freed_memory())"
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(platform.libc_ver()[0] == "glibc")
    out = subprocess.run([sys.executable, "-c", code], env={**env, "MALLOC_TRIM_THRESHOLD_": "1000000"},
                         capture_output=True, text=True, timeout=60, cwd=root)
    assert out.stdout.split()[-1] == "False"


def test_footer_columns_count_a_struct_or_map_as_the_leaves_it_spans(tmp_path):
    """_footer_columns finds each top-level field's parquet column by counting the leaves before it:
    a struct or a map before the flat columns spans several, and the null and constant columns
    after them are still the ones made from the footer (the table equals pyarrow's read)."""
    import pyarrow.parquet as pq

    n = 3
    table = pa.table({"s": pa.array([{"a": 1, "b": None}] * n, pa.struct([("a", pa.int32()), ("b", pa.string())])),
                      "m": pa.array([[("k", 1)]] * n, pa.map_(pa.string(), pa.int32())),
                      "j": pa.array(["x"] * n), "gone": pa.nulls(n, pa.float64()), "some": pa.array([1, None, 2], pa.int64())})
    path = tmp_path / "nested.parquet"
    pq.write_table(table, path)
    assert pq.ParquetFile(path).metadata.num_columns == 7     # s.a, s.b, m.key, m.value, j, gone, some
    assert sorted(lk._footer_columns(pq.ParquetFile(path))) == ["gone", "j"]
    assert lk.read_parquet(str(path)).equals(pq.read_table(path))
