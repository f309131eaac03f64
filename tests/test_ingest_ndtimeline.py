"""NDTimeline raw format (transforms/ingest/ndtimeline.py, `strag export --format ndtimeline`).

The round trip published trace -> lake -> NDTimeline records -> lake -> engine reproduces the
reference analyzer's outputs to 1e-6 relative; bad input fails with a reason code naming the job
and the file, and storage errors propagate as they are.
"""
from __future__ import annotations

import datetime as dt
import gzip
import json
import pathlib

import numpy as np
import pyarrow as pa
import pytest

import transforms.ingest
from pipelines import export
from pipelines.reference import ImportOptions, import_reference
from transforms.ingest import RawInputError, convert_window
from transforms.ingest.common import read_job_yaml
from transforms.ingest.ndtimeline import METRIC_OPTYPES, convert_ndtimeline, export_ndtimeline, write_ndtimeline
from transforms.io.lake import find_job, read_manifest, read_trace_files
from transforms.whatif.parity import reference_mismatches
from transforms.synth.job import JobSpec, generate_job
from transforms.whatif import analyze_job

DATE = dt.date(2024, 3, 4)
ROW_KEY = ["step", "dp_rank", "stage", "optype", "seq_id"]


def exported(reference_dir: pathlib.Path, root: pathlib.Path, name: str) -> tuple[pathlib.Path, dict, pa.Table]:
    """Import trace-{name} into a lake under `root` and export it with `strag export`:
    (raw folder, lake manifest, lake trace)."""
    lake, raw = root / "lake", root / "raw" / "ndtimeline" / f"date={DATE}" / f"job_id={name}"
    import_reference(ImportOptions(str(reference_dir / f"trace-{name}.parquet"), str(reference_dir / f"meta-{name}.yaml"),
                                   str(lake), name, DATE))
    assert export.run(["--format", "ndtimeline", "--lake", str(lake), "--job-id", name, "--out", str(raw)]) == 0
    job = find_job(str(lake), name)
    return raw, read_manifest(job.manifest_path), read_trace_files(job.trace_files)


def sorted_rows(trace: pa.Table):
    return trace.to_pandas().sort_values(ROW_KEY).reset_index(drop=True)


def assert_same_rows(ours: pa.Table, theirs: pa.Table, columns=None) -> None:
    """The same op rows in any order; times as the same float64 values."""
    ours, theirs = sorted_rows(ours), sorted_rows(theirs)
    assert len(ours) == len(theirs)
    for column in columns or theirs.columns:   # (nulls of an integer column read back as NaN: equal here)
        assert ours[column].reset_index(drop=True).equals(theirs[column].reset_index(drop=True)) \
            or ours[column].tolist() == theirs[column].tolist(), column


@pytest.fixture(scope="module", params=["AR", "ST"])
def round_trip(request, reference_dir, tmp_path_factory):
    name = request.param
    raw, manifest, trace = exported(reference_dir, tmp_path_factory.mktemp(name), name)
    converted = convert_window("ndtimeline", [str(path) for path in sorted(raw.iterdir())], name, DATE.isoformat())
    return name, manifest, trace, converted


def test_round_trip_reproduces_every_reference_field(round_trip, reference_dir):
    name, _, _, converted = round_trip
    result = analyze_job(converted.trace, converted.job_meta(), job_id=name)
    expected = {kind: json.loads((reference_dir / f"{kind}-{name}.json").read_text()) for kind in ("result", "mw", "ms")}
    problems = reference_mismatches(result, expected)
    assert not problems, f"{name}: {len(problems)} mismatches, e.g. " + "; ".join(problems[:5])


def test_round_trip_keeps_rows_and_manifest(round_trip):
    name, manifest, trace, converted = round_trip
    assert_same_rows(converted.trace, trace)
    assert converted.manifest == manifest
    assert converted.source["format"] == "ndtimeline" and converted.source["trial"] == name
    assert converted.source["unmapped"] == {} and converted.source["steps_dropped"] == []
    assert converted.source["ranks"] == manifest["dp_size"] * manifest["pp_size"] and converted.source["files"] == 1
    # and back again: the converted job exports to the same records
    assert list(export_ndtimeline(converted.trace, converted.manifest, trial=name)) == list(
        export_ndtimeline(trace, manifest, trial=name))


def test_generated_interleaved_job_with_tp_cp_and_hosts_round_trips(tmp_path):
    job = generate_job(JobSpec("gen-a", dp=2, pp=2, vpp=2, microbatches=4, tp=2, cp=2, steps=4, sessions=2, seed=5))
    manifest = job.manifest.to_pylist()[0]
    paths = write_ndtimeline(job.trace, manifest, str(tmp_path), "gen-a")
    converted = convert_window("ndtimeline", paths, "gen-a", manifest["date"].isoformat())
    # NDTimeline has no sequence lengths and no submit time
    assert_same_rows(converted.trace, job.trace, [c for c in job.trace.column_names if c != "seq_lens"])
    assert {k: v for k, v in converted.manifest.items() if k != "submit_time"} == {
        k: v for k, v in manifest.items() if k != "submit_time"}
    assert read_job_yaml(pathlib.Path(paths[1]).read_bytes())["gpu_hours_scale"] < 1   # end_time kept through it
    ours = analyze_job(converted.trace, converted.job_meta(), job_id="gen-a")
    assert ours.slowdown == analyze_job(job.trace, job.meta, job_id="gen-a").slowdown


# ---------------------------------------------------------------------------
# Small windows written by the tests


@pytest.fixture(scope="module")
def st_records(reference_dir, tmp_path_factory) -> tuple[list[dict], dict]:
    """The ST job as NDTimeline records and its job.yaml options."""
    raw, _, _ = exported(reference_dir, tmp_path_factory.mktemp("st"), "ST")
    with gzip.open(raw / "ndtimeline-ST.jsonl.gz", "rt") as handle:
        records = [json.loads(line) for line in handle]
    return records, read_job_yaml((raw / "job.yaml").read_bytes())


def write_records(folder: pathlib.Path, records, name: str = "part-0.jsonl.gz") -> str:
    """Records (dicts, or raw lines as str) as one JSON-lines file, gzipped for *.gz."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()
    path = folder / name
    path.write_bytes(gzip.compress(lines) if name.endswith(".gz") else lines)
    return str(path)


def convert(folder: pathlib.Path, records, options=None, job_id="j1"):
    return convert_ndtimeline([write_records(folder, records)], job_id, DATE.isoformat(), options or {})


def rejected(folder, records, reason: str, options=None) -> str:
    """Convert, expect RawInputError `reason` naming job j1 and the window's file or folder; its message."""
    with pytest.raises(RawInputError) as error:
        convert(folder, records, options)
    assert error.value.reason_code == reason, str(error.value)
    message = str(error.value)
    assert "job j1" in message and str(folder) in message, message
    return message


def test_vescale_metric_names_map_to_the_published_op_types(st_records, tmp_path):
    records, options = st_records
    baseline = convert(tmp_path / "a", records, options)
    renamed = {"params-all-gather": "unshard-all-gather", "grads-reduce-scatter": "grad-reduce-scatter"}
    vescale = [{**r, "metric": renamed.get(r["metric"], r["metric"])} for r in records]
    converted = convert(tmp_path / "b", vescale, options)
    assert sorted_rows(converted.trace).equals(sorted_rows(baseline.trace))
    assert METRIC_OPTYPES["grad-all-reduce"] == ("separate-grads-all-reduce",)


def test_records_split_across_files_in_any_order(st_records, tmp_path):
    records, options = st_records
    baseline = convert(tmp_path / "a", records, options)
    shuffled = [records[i] for i in np.random.default_rng(0).permutation(len(records))]
    paths = [write_records(tmp_path / "b", shuffled[k::3], f"part-{k}.jsonl") for k in range(3)]
    converted = convert_ndtimeline(paths, "j1", DATE.isoformat(), options)
    assert sorted_rows(converted.trace).equals(sorted_rows(baseline.trace))
    assert converted.source["files"] == 3 and converted.source["records"] == len(records)


def test_line_by_line_reader_agrees_with_arrow(st_records, tmp_path):
    """A file Arrow's fixed types reject (a numeric trial) is read line by line, to the same rows."""
    records, options = st_records
    converted = convert(tmp_path / "b", [{**r, "trial": 7} for r in records], options)
    assert converted.trace.equals(convert(tmp_path / "a", records, options).trace)
    assert converted.source["trial"] == 7


def test_tp_peers_are_collapsed_and_counted(st_records, tmp_path):
    records, options = st_records
    peers = [{**r, "tp_rank": 1, "rank": r["rank"] + 100, "start_ts": [t + 1.0 for t in r["start_ts"]]} for r in records]
    converted = convert(tmp_path, records + peers, {**options, "tp_size": 2})
    assert converted.source["tp_collapsed"] == len({r["rank"] for r in peers}) == 8
    assert sorted_rows(converted.trace).equals(sorted_rows(convert(tmp_path / "a", records, options).trace))
    assert converted.manifest["tp_size"] == 2 and converted.manifest["world_size"] == 16


def one_worker_job(step_records) -> list[dict]:
    """A dp1 x pp1 window: one record per (metric, step, chunk, spans)."""
    base = {"ts": 1709540000, "rank": 0, "iteration": 0, "value": 0.0, "stage": 0, "dp_rank": 0, "tp_rank": 0,
            "ip": "10.0.0.7", "role": 0, "trial": "7", "run_id": 3}
    return [{**base, "metric": metric, "step": step, "model_chunk": chunk, "start_ts": [s for s, _ in spans],
             "duration": [d for _, d in spans]} for metric, step, chunk, spans in step_records]


def test_microbatches_chunks_batched_p2p_and_epoch_clock(tmp_path):
    t0 = 1709540000.25   # epoch seconds on NDTimeline's global clock
    records = one_worker_job([
        ("forward-compute", 5, 0, [(t0 + 0.0, 0.1), (t0 + 0.1, 0.1)]),
        ("forward-compute", 5, 1, [(t0 + 0.2, 0.1), (t0 + 0.3, 0.1)]),
        ("backward-compute", 5, 1, [(t0 + 0.4, 0.2), (t0 + 0.6, 0.2)]),
        ("backward-compute", 5, 0, [(t0 + 0.8, 0.2), (t0 + 1.0, 0.2)]),
        ("forward-send-backward-recv", 5, 0, [(t0 + 0.35, 0.01)]),
        ("unshard-all-gather", 5, 1, [(t0 - 0.1, 0.05)]),
        ("optimizer", 5, 0, [(t0 + 1.3, 0.1)]),
        ("optimizer-inner-step", 5, 0, [(t0 + 1.3, 0.05), (t0 + 1.35, 0.05)]),
    ])
    converted = convert(tmp_path, records)
    rows = converted.trace.to_pandas()
    compute = rows[rows.optype.isin(["forward-compute", "backward-compute"])]
    assert sorted(zip(compute.optype, compute.mc, compute.mb_id, compute.gmc)) == sorted(
        (optype, chunk, mb, chunk) for optype in ("forward-compute", "backward-compute") for chunk in (0, 1) for mb in (0, 1))
    p2p = rows[rows.optype.isin(["forward-send", "backward-recv"])]
    assert sorted(p2p.optype) == ["backward-recv", "forward-send"] and set(p2p.start_ts) == {t0 + 0.35}
    assert set(p2p.mc) == set(p2p.gmc) == set(p2p.mb_id) == {-1}
    gather = rows[rows.optype == "params-all-gather"]
    assert (gather.mc.tolist(), gather.gmc.tolist(), gather.mb_id.tolist()) == ([1], [-1], [-1])
    assert set(rows.host) == {"10.0.0.7"}
    manifest = converted.manifest
    assert (manifest["dp_size"], manifest["pp_size"], manifest["vpp_size"], manifest["microbatches"]) == (1, 1, 2, 2)
    assert manifest["start_time"] == dt.datetime.fromtimestamp(t0 - 0.1, dt.timezone.utc)
    assert manifest["workers"] == [{"dp_rank": 0, "stage": 0, "rank": 0, "host": "10.0.0.7"}]
    assert converted.source["clock"] == "epoch" and converted.source["unmapped"] == {"optimizer-inner-step": 2}
    assert (converted.source["trial"], converted.source["run_id"]) == ("7", 3)


def test_unmapped_metric_is_counted_never_dropped_silently(st_records, tmp_path):
    records, options = st_records
    extra = {**records[0], "metric": "tp-allreduce", "start_ts": [0.1, 0.2, 0.3], "duration": [0.01] * 3}
    converted = convert(tmp_path, records + [extra], options)
    assert converted.source["unmapped"] == {"tp-allreduce": 3}
    assert converted.trace.num_rows == sum(len(r["start_ts"]) for r in records)


def test_incomplete_last_step_is_dropped_and_noted(st_records, tmp_path):
    records, options = st_records
    last = max(r["step"] for r in records)
    cut = [r for r in records if not (r["step"] == last and r["metric"] == "optimizer" and r["stage"] == 2)]
    converted = convert(tmp_path, cut, options)
    assert converted.source["steps_dropped"] == [last]
    assert last not in set(converted.trace.column("step").to_pylist())


# ---------------------------------------------------------------------------
# Bad input


def test_truncated_gzip_is_unreadable(st_records, tmp_path):
    path = pathlib.Path(write_records(tmp_path, st_records[0]))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(RawInputError) as error:
        convert_ndtimeline([str(path)], "j1", DATE.isoformat(), {})
    assert error.value.reason_code == "raw_unreadable"
    assert "job j1" in str(error.value) and str(path) in str(error.value)


def test_non_json_line_is_unreadable_and_named(st_records, tmp_path):
    records = list(st_records[0])
    message = rejected(tmp_path, records[:5] + ["2024-03-04 12:00:01 - metric_name: forward-compute"] + records[5:],
                       "raw_unreadable")
    assert "line 6" in message


def test_empty_file_and_foreign_json_are_not_traces(tmp_path):
    rejected(tmp_path / "a", [], "raw_not_a_trace")
    message = rejected(tmp_path / "b", [{"traceEvents": []}], "raw_not_a_trace")
    assert "line 1" in message and "metric" in message


def test_record_with_a_negative_rank_or_ragged_spans_is_named(st_records, tmp_path):
    records = list(st_records[0])
    assert "line 3" in rejected(tmp_path / "a", records[:2] + [{**records[2], "dp_rank": -1}] + records[3:], "raw_not_a_trace")
    ragged = {**records[1], "duration": records[1]["duration"][:-1]}
    assert "line 2" in rejected(tmp_path / "b", records[:1] + [ragged] + records[2:], "raw_not_a_trace")
    assert "line 1" in rejected(tmp_path / "c", [{**records[0], "start_ts": ["0.5"] * len(records[0]["duration"])}],
                                "raw_not_a_trace")


def test_two_run_ids_are_mixed_jobs(st_records, tmp_path):
    records = list(st_records[0])
    records[-1] = {**records[-1], "run_id": 1}
    assert "run_id 1" in rejected(tmp_path, records, "raw_mixed_jobs")


def test_missing_worker(st_records, tmp_path):
    records, options = st_records
    message = rejected(tmp_path, [r for r in records if (r["dp_rank"], r["stage"]) != (1, 2)], "raw_missing_rank", options)
    assert "(dp 1, stage 2)" in message


def test_duplicate_record(st_records, tmp_path):
    records = list(st_records[0])
    message = rejected(tmp_path, records + [records[3]], "raw_duplicate_rank")
    assert f"line 4 and {tmp_path}/part-0.jsonl.gz line {len(records) + 1}" in message


def test_misaligned_steps(st_records, tmp_path):
    records, options = st_records
    middle = sorted({r["step"] for r in records})[5]
    message = rejected(tmp_path, [r for r in records if not (r["step"] == middle and r["rank"] == 5)],
                       "raw_steps_misaligned", options)
    assert f"step {middle}" in message


def test_unknown_dp_collective_is_an_error(st_records, tmp_path):
    records = list(st_records[0])
    records.append({**records[0], "metric": "expert-grads-all-reduce"})
    with pytest.raises(RawInputError) as error:
        convert(tmp_path, records)
    assert error.value.reason_code == "raw_unknown_collective" and error.value.op == "expert-grads-all-reduce"
    assert "job j1" in str(error.value) and f"{tmp_path}/part-0.jsonl.gz line {len(records)}" in str(error.value)


def test_job_yaml_smaller_than_the_records_is_rejected(st_records, tmp_path):
    assert "dp_size" in rejected(tmp_path, st_records[0], "raw_bad_job_yaml", {"dp_size": 1})


def test_storage_errors_propagate_unchanged(monkeypatch):
    def denied(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(transforms.ingest, "read_raw_file", denied)
    with pytest.raises(PermissionError):
        convert_ndtimeline(["s3://bucket/raw/ndtimeline/date=2024-03-04/job_id=j1/part-0.jsonl.gz"], "j1", "2024-03-04", {})


def test_export_of_an_absent_job_exits_2(tmp_path, capsys):
    from pipelines.cli import main

    (tmp_path / "traces").mkdir()   # a lake, without that job
    assert main(["export", "--format", "ndtimeline", "--lake", str(tmp_path), "--job-id", "nope", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("strag export: ") and "'nope'" in error


def test_export_records_carry_the_vescale_fields(st_records):
    records, _ = st_records
    assert set(records[0]) == {"ts", "rank", "metric", "iteration", "step", "value", "start_ts", "duration", "model_chunk",
                               "stage", "dp_rank", "tp_rank", "ip", "role", "trial", "run_id"}
    assert all(r["value"] == pytest.approx(np.mean(r["duration"])) for r in records[:50])
    assert {r["ip"] for r in records} == {"0.0.0.0"}   # unknown hosts, veScale's placeholder
