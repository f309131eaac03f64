"""`strag demo` end to end on a tiny fleet: what `make demo` runs, with the same code path."""
from __future__ import annotations

import pyarrow.dataset as ds

from pipelines import demo


def test_demo_generates_analyses_reports_and_summarises(tmp_path, capsys):
    lake, out = tmp_path / "lake", tmp_path / "out"
    code = demo.run(["--lake", str(lake), "--out", str(out), "--days", "2", "--jobs-per-day", "3",
                     "--seed", "11", "--max-records", "40000", "--bad-fraction", "0.2"])
    assert code == 0
    printed = capsys.readouterr().out
    coverage = ds.dataset(out / "coverage", format="parquet", partitioning="hive").to_table()
    assert coverage.num_rows == 6   # every generated job is accounted for, bad ones included
    assert f"jobs found: {coverage.num_rows}" in printed
    assert (out / "_reports" / "index.html").is_file()
    assert str(out / "_reports" / "index.html") in printed
    statuses = set(coverage.column("status").to_pylist())
    assert "quarantined" in statuses and "analysed" in statuses
    # the batch wrote the straggling windows' timelines; the report linked them without reading traces
    summary = ds.dataset(out / "job_summary", format="parquet", partitioning="hive").to_table().to_pylist()
    straggling = sum(row["straggling"] and not row["discarded"] for row in summary)
    assert straggling, "the tiny fleet has straggling windows"
    assert len(list((out / "_timelines").rglob("*.json.gz"))) == straggling
    assert len(list((out / "_reports" / "timelines").glob("*.json.gz"))) == straggling
    assert f"timelines:    {straggling} of the {straggling} pages link a Perfetto timeline" in printed
    # root causes as the fleet statistics count them: kept straggling windows (job_cause also holds the
    # discarded windows' measured verdicts, flagged)
    import re

    counted = sum(int(n) for n in re.findall(r"root cause \S+ +(\d+) jobs", printed))
    assert counted == straggling
    # every job page says what its result stands on (steps x microbatches x DP peers)
    page = next((out / "_reports" / "jobs").glob("*.html")).read_text()
    assert "steps x microbatches per worker x DP peers per worker" in page
