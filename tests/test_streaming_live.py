"""Live results and alerts: the plain alert state, the live-table readers, and
EmitLiveResults under TestStream with repeated and superseded results."""
from __future__ import annotations

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.direct.direct_runner import BundleBasedDirectRunner
from apache_beam.testing import test_stream

from live_rows import live_row as result
from live_rows import slow_rank
from transforms.live.results import AlertConfig, EmitLiveResults
from transforms.live.tables import count_live_sessions, current_results, read_live_table


def test_alert_config_checks_itself():
    with pytest.raises(ValueError, match="threshold"):
        AlertConfig(out="x", threshold=0.5)
    with pytest.raises(ValueError, match="out"):
        AlertConfig(out="")


def test_emit_live_results_under_test_stream(tmp_path):
    """A duplicate result and a superseding revision: one file per (job, session, revision), one
    alert per (job, cause, ranks) however often it is repeated, resolved by a healthy session; the
    current result is the highest revision."""
    out = str(tmp_path / "out")
    slow = ("individual-worker", "analysed", 1_700_000_000.0, [slow_rank()])
    stream = (
        test_stream.TestStream()
        .advance_watermark_to(0)
        .add_elements([result("a", "s1", 1, 1.02, "none"), result("b", "s1", 1, 1.4, *slow)])
        .advance_watermark_to(10)
        .add_elements([result("b", "s1", 1, 1.4, *slow), result("a", "s1", 2, 1.2, *slow)])  # a repeat; a late correction
        .advance_watermark_to(20)
        .add_elements([result("b", "s2", 1, 1.03, "none")])
        .advance_watermark_to_infinity()
    )
    with beam.Pipeline(runner=BundleBasedDirectRunner(), options=PipelineOptions(flags=[], streaming=True)) as pipeline:
        pipeline | stream | EmitLiveResults(AlertConfig(out=out))
    everything = read_live_table(out)
    assert sorted(zip(everything["job_id"].to_pylist(), everything["session"].to_pylist(),
                      everything["revision"].to_pylist())) == [("a", "s1", 1), ("a", "s1", 2), ("b", "s1", 1), ("b", "s2", 1)]
    current = current_results(everything)
    assert list(zip(current["job_id"].to_pylist(), current["revision"].to_pylist(), current["slowdown"].to_pylist())) == [
        ("a", 2, 1.2), ("b", 1, 1.4), ("b", 1, 1.03)]
    alerts = sorted((a["job_id"], a["session"], a["kind"], a["ranks"]) for a in read_live_table(out, "alerts").to_pylist())
    assert alerts == [("a", "s1", "firing", [3]), ("b", "s1", "firing", [3]), ("b", "s1", "resolved", [3])]
    assert count_live_sessions(out) == 3


def test_quarantine_is_written_per_session_not_per_row(tmp_path, caplog):
    """A session that lands a thousand bad rows makes one file and one log line per bundle, not a
    thousand; every row is still in the table."""
    import logging
    import pathlib

    from transforms.live.results import WriteLiveQuarantine

    out = str(tmp_path / "out")
    rows = [{"job_id": "job-a", "session": "s1", "source_path": f"landing/job-a/s1/worker-0-{i % 4}.parquet",
             "level": "row", "reason_code": "negative_duration", "reason": "duration < 0", "detail": f"row {i}",
             "rows": None, "seen_time": 1_700_000_000.0} for i in range(1000)]
    rows += [{"job_id": "job-b", "session": "s9", "source_path": "landing/job-b/s9/x.parquet", "level": "file",
              "reason_code": "unreadable_file", "reason": "truncated", "detail": "x", "rows": None,
              "seen_time": 1_700_000_000.0}]
    with caplog.at_level(logging.WARNING, logger="transforms.live.results"):
        with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
            _ = p | beam.Create(rows, reshuffle=False) | WriteLiveQuarantine(out)
    files = sorted(pathlib.Path(out).rglob("*.parquet"))
    assert len(files) <= 4 and {f.name.split("--")[0] for f in files} == {"job%2Da", "job%2Db"}
    assert read_live_table(out, "live_quarantine").num_rows == 1001
    lines = [r for r in caplog.records if "QUARANTINE" in r.getMessage()]
    assert 2 <= len(lines) <= 4 and any("1000 row(s)" in r.getMessage() for r in lines)


def test_live_table_reads_each_file_once(tmp_path, monkeypatch):
    """`strag serve` answers every request from the live tables: unchanged files are not re-read,
    new and rewritten ones are."""
    import fsspec

    import transforms.live.tables as live
    from live_rows import land_row

    out = str(tmp_path / "out")
    land_row(out, result("job-a", "s1", 1, 1.04, first=1_700_000_000.0))
    land_row(out, result("job-a", "s2", 1, 1.30, first=1_700_000_100.0))
    opened = []
    real_open = fsspec.open
    monkeypatch.setattr(live.fsspec, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    assert read_live_table(out).num_rows == 2 and len(opened) == 2
    assert read_live_table(out).num_rows == 2 and len(opened) == 2
    land_row(out, result("job-a", "s2", 2, 1.05, first=1_700_000_100.0))
    table = read_live_table(out)
    assert table.num_rows == 3 and len(opened) == 3
    assert sorted(table["revision"].to_pylist()) == [1, 1, 2]
