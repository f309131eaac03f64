"""Session assembly: the plain state machine, and AssembleSessions under TestStream
(late files, duplicate deliveries, timeouts) on the streaming DirectRunner."""
from __future__ import annotations

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.direct.direct_runner import BundleBasedDirectRunner
from apache_beam.testing import test_stream
from apache_beam.testing.util import assert_that, equal_to

from transforms.landing import LandingEvent
from transforms.sessions import AssembleSessions, AssemblyConfig, SessionState

WORKERS = ((0, 0), (0, 1), (1, 0), (1, 1))


def manifest(session, t, job="j1"):
    return LandingEvent("manifest", job, session, t, f"lake/landing/{job}/{session}/manifest.parquet", workers=WORKERS)


def worker(session, t, dp, stage, job="j1", kind="worker"):
    return LandingEvent(kind, job, session, t, f"lake/landing/{job}/{session}/worker-{dp}-{stage}.parquet", dp, stage)


def tick(session, t, job="j1", final=False):
    return LandingEvent("tick", job, session, t, final=final)


def summary(assembly):
    return (assembly.job_id, assembly.session, assembly.revision, assembly.reason,
            tuple(sorted(assembly.worker_paths)), assembly.missing, assembly.duplicate_deliveries)


def run_state(events, timeout=5.0):
    state, out = SessionState(), []
    for event in events:
        out += state.apply(event, AssemblyConfig(timeout_seconds=timeout))
    return [summary(a) for a in out]


def test_complete_session_assembles_once_when_last_worker_arrives():
    events = [worker("s", 1, 1, 1), manifest("s", 1), worker("s", 2, 0, 0), worker("s", 2, 0, 1), tick("s", 2),
              worker("s", 3, 1, 0), tick("s", 50)]
    assert run_state(events) == [("j1", "s", 1, "complete", WORKERS, (), 0)]


def test_timeout_analyses_what_arrived_and_names_the_missing_workers():
    events = [manifest("s", 10), worker("s", 10, 0, 0), worker("s", 11, 1, 0), tick("s", 14.9), tick("s", 15.0),
              tick("s", 16)]
    assert run_state(events) == [("j1", "s", 1, "timeout", ((0, 0), (1, 0)), ((0, 1), (1, 1)), 0)]


def test_late_file_after_analysis_gives_a_superseding_revision():
    events = [manifest("s", 0), worker("s", 0, 0, 0), worker("s", 0, 0, 1), worker("s", 0, 1, 0), tick("s", 6),
              worker("s", 9, 1, 1), tick("s", 20)]
    assert run_state(events) == [
        ("j1", "s", 1, "timeout", ((0, 0), (0, 1), (1, 0)), ((1, 1),), 0),
        ("j1", "s", 2, "late", WORKERS, (), 0),
    ]


def test_duplicate_deliveries_are_counted_never_added():
    events = [manifest("s", 0), worker("s", 0, 0, 0), worker("s", 1, 0, 0), worker("s", 1, 0, 0, kind="redelivery"),
              manifest("s", 1), worker("s", 2, 0, 1), worker("s", 2, 1, 0), worker("s", 2, 1, 1),
              worker("s", 3, 1, 1, kind="redelivery")]
    assert run_state(events) == [("j1", "s", 1, "complete", WORKERS, (), 3)]


def test_session_without_manifest_times_out_with_nothing_expected():
    events = [worker("s", 0, 0, 0), tick("s", 5)]
    out = run_state(events)
    assert out == [("j1", "s", 1, "timeout", ((0, 0),), (), 0)]


def test_final_tick_flushes_pending_session():
    events = [manifest("s", 0), worker("s", 0, 0, 0), tick("s", 1, final=True)]
    assert run_state(events)[0][3] == "watcher-stopped"


def test_config_rejects_nonpositive_timeout():
    with pytest.raises(ValueError, match="timeout_seconds"):
        AssemblyConfig(timeout_seconds=0)


def test_assemble_sessions_under_test_stream_late_and_duplicate_files():
    """Two sessions interleaved: s1 times out (worker 1-1 missing), then 1-1 arrives late
    and supersedes it; s2 completes with duplicate deliveries that never double-count."""
    stream = (
        test_stream.TestStream()
        .advance_watermark_to(0)
        .add_elements([manifest("s1", 100), worker("s1", 100, 0, 0), worker("s1", 100, 0, 1),
                       manifest("s2", 100), worker("s2", 100, 0, 0)])
        .advance_watermark_to(101)
        .add_elements([worker("s1", 101, 1, 0), worker("s2", 101, 0, 0, kind="redelivery"),
                       worker("s2", 101, 0, 1), worker("s2", 101, 0, 1), tick("s1", 101), tick("s2", 101)])
        .advance_watermark_to(104)
        .add_elements([tick("s1", 104), tick("s2", 104), worker("s2", 104, 1, 0), worker("s2", 104, 1, 1)])
        .advance_watermark_to(106)
        .add_elements([tick("s1", 106), tick("s2", 106)])
        .advance_watermark_to(110)
        .add_elements([worker("s1", 110, 1, 1), tick("s1", 110), tick("s2", 110),
                       worker("s1", 111, 1, 1, kind="redelivery")])
        .advance_watermark_to_infinity()
    )
    options = PipelineOptions(flags=[], streaming=True)
    with beam.Pipeline(runner=BundleBasedDirectRunner(), options=options) as pipeline:
        assemblies = (
            pipeline
            | stream
            | "Key" >> beam.Map(lambda event: (event.key, event))
            | AssembleSessions(AssemblyConfig(timeout_seconds=5.0))
        )
        assert_that(assemblies | beam.Map(summary), equal_to([
            ("j1", "s1", 1, "timeout", ((0, 0), (0, 1), (1, 0)), ((1, 1),), 0),
            ("j1", "s1", 2, "late", WORKERS, (), 0),
            ("j1", "s2", 1, "complete", WORKERS, (), 2),
        ]))


def test_landing_dedup_and_parse_under_test_stream():
    """Every poll lists every file again: only first sightings and re-deliveries (newer
    modification time) pass; a misplaced file is quarantined once; ticks pass through."""
    from transforms.landing import _DeduplicateByPathFn, _ReadLandingEventFn

    root = "/lake/landing/j1/s1"
    listing = lambda poll, files: [(f"{root}/{name}", (mtime, poll)) for name, mtime in files]  # noqa: E731
    stream = (
        test_stream.TestStream()
        .add_elements(listing(1.0, [("worker-0-0.parquet", 0.5), ("notes.txt", 0.5)]))
        .add_elements(listing(2.0, [("worker-0-0.parquet", 0.5), ("notes.txt", 0.5), ("worker-0-1.parquet", 1.5)]))
        .add_elements(listing(3.0, [("worker-0-0.parquet", 2.5), ("notes.txt", 0.5), ("worker-0-1.parquet", 1.5)])
                      + [("\x00tick:j1/s1", tick("s1", 3.0))])
        .advance_watermark_to_infinity()
    )
    with beam.Pipeline(runner=BundleBasedDirectRunner(), options=PipelineOptions(flags=[], streaming=True)) as pipeline:
        events = (
            pipeline
            | stream
            | beam.ParDo(_DeduplicateByPathFn())
            | beam.ParDo(_ReadLandingEventFn()).with_outputs("quarantine", main="events")
        )
        assert_that(events.events | beam.Map(lambda e: (e.kind, e.dp_rank, e.stage, e.poll_time)), equal_to([
            ("worker", 0, 0, 1.0), ("worker", 0, 1, 2.0), ("redelivery", 0, 0, 3.0), ("tick", -1, -1, 3.0)]),
            label="Events")
        assert_that(events.quarantine | beam.Map(lambda r: (r["source_path"].rsplit("/", 1)[-1], r["reason_code"])),
                    equal_to([("notes.txt", "landing_layout")]), label="Quarantine")
