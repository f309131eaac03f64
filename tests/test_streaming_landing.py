"""Landing layout helpers: path parsing, per-worker split, expected workers, watch config."""
from __future__ import annotations

import pyarrow as pa
import pytest

from transforms.live.landing import (LandingPathError, WatchConfig, expected_workers, land_generated_session,
                                parse_landing_path, session_trace, split_workers)
from transforms.io.lake import read_manifest, read_trace_file
from transforms.synth.job import JobSpec, generate_job


def test_parse_landing_path():
    assert parse_landing_path("s3://b/lake/landing/j-1/s07/worker-12-3.parquet") == ("j-1", "s07", "worker", 12, 3)
    assert parse_landing_path("/x/landing/j/s/manifest.parquet") == ("j", "s", "manifest", -1, -1)
    with pytest.raises(LandingPathError, match="job j session s: file name 'worker-a-1.parquet'"):
        parse_landing_path("/x/landing/j/s/worker-a-1.parquet")
    with pytest.raises(LandingPathError, match="expected landing/JOB_ID/SESSION"):
        parse_landing_path("/x/landing/j/worker-0-0.parquet")


def test_expected_workers_from_list_or_grid():
    listed = {"dp_size": 2, "pp_size": 2, "workers": [{"dp_rank": 1, "stage": 0}, {"dp_rank": 0, "stage": 1}]}
    assert expected_workers(listed) == ((0, 1), (1, 0))
    assert expected_workers({"dp_size": 2, "pp_size": 1, "workers": []}) == ((0, 0), (1, 0))


def test_land_generated_session_round_trips(tmp_path):
    job = generate_job(JobSpec(job_id="j", dp=2, pp=2, microbatches=4, steps=4, sessions=2, seed=2))
    paths = land_generated_session(str(tmp_path), job, 1, "s1")
    assert len(paths) == 5 and paths[0].endswith("landing/j/s1/manifest.parquet")
    trace = session_trace(job, 1)
    parts = split_workers(trace)
    assert sorted(parts) == [(0, 0), (0, 1), (1, 0), (1, 1)] and sum(t.num_rows for t in parts.values()) == trace.num_rows
    back = pa.concat_tables([read_trace_file(p) for p in paths[1:]])
    assert back.num_rows == trace.num_rows and read_manifest(paths[0])["job_id"] == "j"
    with pytest.raises(ValueError, match="no session 5"):
        session_trace(job, 5)


def test_watch_config_checks_itself():
    with pytest.raises(ValueError, match="interval_seconds"):
        WatchConfig(lake="x", interval_seconds=0)
    with pytest.raises(ValueError, match="needs out"):
        WatchConfig(lake="x", stop_after_sessions=2)
    assert WatchConfig(lake="x", start_time=10.0, stop_time=12.0).should_stop(12.0)
    assert not WatchConfig(lake="x", start_time=10.0, stop_time=12.0).should_stop(11.9)
