"""`strag watch` analyses live NDTimeline sessions as it does Kineto ones (issue 23 item 2).

A session folder holds one `rank-R-of-W.jsonl[.gz]` of veScale NDTimeline records per global rank
(and an optional job.yaml): complete when every rank is in, converted like a raw lake window.
The records here are a generated job's (a slow worker), exported per rank by the NDTimeline writer.
"""
from __future__ import annotations

import collections
import gzip
import pathlib

import orjson
import pytest

from transforms.live.analyze_sessions import analyze_session
from transforms.ingest import convert_window
from transforms.ingest.ndtimeline import export_ndtimeline
from transforms.live.landing import LandingEvent, parse_landing_name
from transforms.live.sessions import FORMAT_NDTIMELINE, AssemblyConfig, SessionState
from transforms.synth import Cause, JobSpec, generate_job
from transforms.validation import Validator
from transforms.whatif.causes import analyze_and_classify

DATE = "2026-11-25"
JOB_YAML = "dp_size: 2\npp_size: 2\ntp_size: 1\ncp_size: 1\nvpp_size: 1\n"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, bytes]:
    """Global rank -> its gzipped NDTimeline records, of a dp 2 x pp 2 job whose (dp 1, stage 0) runs 2x slower."""
    job = generate_job(JobSpec(job_id="nd", dp=2, pp=2, microbatches=4, steps=4, sessions=1, seed=5,
                               causes=(Cause("slow_worker", {"dp_rank": 1, "stage": 0, "factor": 2.0}),)))
    manifest = job.manifest.to_pylist()[0]
    by_rank: dict[int, list[bytes]] = collections.defaultdict(list)
    for record in export_ndtimeline(job.trace, manifest):
        by_rank[int(record["rank"])].append(orjson.dumps(record))
    return {rank: gzip.compress(b"\n".join(lines) + b"\n", mtime=0) for rank, lines in sorted(by_rank.items())}


def _session(folder: pathlib.Path, ranks: dict[int, bytes], present, reason: str):
    folder.mkdir(parents=True)
    (folder / "job.yaml").write_text(JOB_YAML)
    state, config, out = SessionState(), AssemblyConfig(timeout_seconds=1.0), []
    out += state.apply(LandingEvent("job_yaml", "nd", folder.name, 0.0, str(folder / "job.yaml")), config)
    for rank in present:
        name = f"rank-{rank}-of-{len(ranks)}.jsonl.gz"
        (folder / name).write_bytes(ranks[rank])
        kind, r, world = parse_landing_name(name, "test")
        out += state.apply(LandingEvent(kind, "nd", folder.name, 0.0, str(folder / name), rank=r, world=world), config)
    out += state.apply(LandingEvent("tick", "nd", folder.name, 10.0), config)
    assert len(out) == 1 and out[0].reason == reason and out[0].fmt == FORMAT_NDTIMELINE
    return out[0]


def test_a_complete_ndtimeline_session_is_analysed_like_its_raw_window(ranks, tmp_path):
    folder = tmp_path / "landing" / "nd" / "w0"
    assembly = _session(folder, ranks, sorted(ranks), "complete")
    row, quarantine = analyze_session(assembly, Validator(), analyze_and_classify)
    files = sorted(str(p) for p in folder.iterdir())
    converted = convert_window("ndtimeline", files, "nd", DATE)
    expected, verdict = analyze_and_classify(converted.trace, converted.job_meta(), "nd")
    assert row["status"] == "analysed" and row["complete"] and row["source_format"] == "ndtimeline"
    assert row["slowdown"] == pytest.approx(expected.slowdown, rel=1e-12) and row["slowdown"] >= 1.1
    assert row["verdict"] == verdict.cause == "individual-worker"
    assert (row["dp_size"], row["pp_size"], row["workers_expected"], row["workers_present"]) == (2, 2, 4, 4)
    assert quarantine.num_rows == 0


def test_an_ndtimeline_session_missing_a_rank_is_refused_never_complete(ranks, tmp_path):
    folder = tmp_path / "landing" / "nd" / "w0"
    assembly = _session(folder, ranks, [0, 1, 2], "timeout")
    row, quarantine = analyze_session(assembly, Validator(), analyze_and_classify)
    assert row["status"] == "failed" and not row["complete"] and row.get("slowdown") is None
    assert row["missing_ranks"] == [3] and "rank(s) 3 of 4 had not landed" in row["error"]
    assert quarantine.num_rows >= 1 and quarantine.column("reason_code").to_pylist()[-1].startswith("raw_")


def test_a_session_holds_one_raw_format():
    state = SessionState()
    state.apply(LandingEvent("ndtimeline", "nd", "w0", 0.0, "l/landing/nd/w0/rank-0-of-2.jsonl.gz", rank=0, world=2),
                AssemblyConfig())
    kineto = LandingEvent("kineto", "nd", "w0", 1.0, "l/landing/nd/w0/rank-1-of-2.json.gz", rank=1, world=2)
    assert "is a Kineto session file, but the session holds NDTimeline records" in state.format_conflict(kineto)
