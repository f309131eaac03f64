"""Session assembly: the plain state machine, and AssembleSessions under TestStream
(late files, duplicate deliveries, timeouts) on the streaming DirectRunner."""
from __future__ import annotations

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.direct.direct_runner import BundleBasedDirectRunner
from apache_beam.testing import test_stream
from apache_beam.testing.util import assert_that, equal_to

from transforms.io.lake import manifest_table, write_parquet
from transforms.live.landing import LandingEvent, SessionListing, landing_manifest_path
from transforms.live.sessions import AssembleSessions, AssemblyConfig, SessionState

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


def test_config_rejects_nonpositive_timeout_and_retention():
    with pytest.raises(ValueError, match="timeout_seconds"):
        AssemblyConfig(timeout_seconds=0)
    with pytest.raises(ValueError, match="retain_seconds"):
        AssemblyConfig(retain_seconds=-1)


@pytest.fixture(scope="module")
def small_job():
    from transforms.synth.job import JobSpec, generate_job

    return generate_job(JobSpec(job_id="j1", dp=2, pp=2, microbatches=2, steps=2, sessions=1, seed=1))


def land_manifest(lake, job, session):
    path = landing_manifest_path(lake, "j1", session)
    write_parquet(path, manifest_table(job.manifest))
    return path


def listing(lake, session, t, names, final=False, mtime=None):
    """A poll's SessionListing of landing/j1/{session}/ holding `names` (modification time 0, or mtime[name])."""
    files = tuple(sorted((f"{lake}/landing/j1/{session}/{name}", (mtime or {}).get(name, 0.0)) for name in names))
    return SessionListing("j1", session, t, files, final)


def run_listings(listings, config, assemblies=(), quarantine=()):
    """AssembleSessions over TestStream polls (one bundle per poll); asserts the assembly summaries
    and the quarantine rows' (file name, reason code, session)."""
    stream = test_stream.TestStream()
    for poll in listings:
        stream = stream.advance_watermark_to(poll[0].poll_time).add_elements([(item.key, item) for item in poll])
    stream = stream.advance_watermark_to_infinity()
    with beam.Pipeline(runner=BundleBasedDirectRunner(), options=PipelineOptions(flags=[], streaming=True)) as pipeline:
        out = pipeline | stream | AssembleSessions(config)
        assert_that(out["assemblies"] | beam.Map(summary), equal_to(list(assemblies)), label="Assemblies")
        assert_that(out["quarantine"] | beam.Map(lambda r: (r["source_path"].rsplit("/", 1)[-1], r["reason_code"],
                                                            r["session"])),
                    equal_to(list(quarantine)), label="Quarantine")


W = [f"worker-{dp}-{stage}.parquet" for dp, stage in WORKERS]


def test_assemble_sessions_under_test_stream_late_and_duplicate_files(tmp_path, small_job):
    """Two sessions polled together: s1 times out (worker 1-1 missing), then 1-1 arrives late
    and supersedes it; s2 completes, its re-delivered worker counted, never added twice;
    the manifest is read once although every poll lists it."""
    lake = str(tmp_path / "lake")
    for session in ("s1", "s2"):
        land_manifest(lake, small_job, session)
    m = "manifest.parquet"
    polls = [
        [listing(lake, "s1", 100, [m, W[0], W[1]]), listing(lake, "s2", 100, [m, W[0]])],
        [listing(lake, "s1", 101, [m, W[0], W[1], W[2]]), listing(lake, "s2", 101, [m, W[0], W[1]], mtime={W[0]: 1.0})],
        [listing(lake, "s1", 104, [m, *W[:3]]), listing(lake, "s2", 104, [m, *W], mtime={W[0]: 1.0})],
        [listing(lake, "s1", 106, [m, *W[:3]]), listing(lake, "s2", 106, [m, *W], mtime={W[0]: 1.0})],
        [listing(lake, "s1", 110, [m, *W]), listing(lake, "s2", 110, [m, *W], mtime={W[0]: 1.0})],
        [listing(lake, "s1", 111, [m, *W], mtime={W[3]: 5.0})],
    ]
    run_listings(polls, AssemblyConfig(timeout_seconds=5.0), assemblies=[
        ("j1", "s1", 1, "timeout", ((0, 0), (0, 1), (1, 0)), ((1, 1),), 0),
        ("j1", "s1", 2, "late", WORKERS, (), 0),
        ("j1", "s2", 1, "complete", WORKERS, (), 1),
    ])


def test_done_sessions_retire_into_the_archive_and_late_files_are_set_aside(tmp_path, small_job):
    """With an archive: a session analysed and quiet for retain_seconds moves to
    landing_archive/ (state cleared, landing folder gone); a file landing in it afterwards is
    moved beside it and quarantined as session_closed; a stray name is quarantined once."""
    lake = str(tmp_path / "lake")
    land_manifest(lake, small_job, "s1")
    for name in [*W, "notes.txt"]:
        (tmp_path / "lake/landing/j1/s1" / name).write_bytes(b"x")
    names = ["manifest.parquet", *W, "notes.txt"]
    polls = [[listing(lake, "s1", 0, names)], [listing(lake, "s1", 5, names)], [listing(lake, "s1", 20, names)]]
    config = AssemblyConfig(timeout_seconds=5.0, retain_seconds=10.0, archive=lake)
    run_listings(polls, config, assemblies=[("j1", "s1", 1, "complete", WORKERS, (), 0)],
                 quarantine=[("notes.txt", "landing_layout", "s1")])
    assert not (tmp_path / "lake/landing/j1").exists()
    assert sorted(p.name for p in (tmp_path / "lake/landing_archive/j1/s1").iterdir()) == sorted(names)

    (tmp_path / "lake/landing/j1/s1").mkdir(parents=True)
    (tmp_path / "lake/landing/j1/s1" / W[3]).write_bytes(b"late")
    run_listings([[listing(lake, "s1", 30, [W[3]])]], config, quarantine=[(W[3], "session_closed", "s1")])
    late = list((tmp_path / "lake/landing_archive/j1/s1/_late").iterdir())
    assert [p.read_bytes() for p in late] == [b"late"] and late[0].name.endswith(W[3])
    assert not (tmp_path / "lake/landing/j1").exists()


def test_observe_and_retirable():
    state, config = SessionState(), AssemblyConfig(timeout_seconds=5.0, retain_seconds=10.0)
    first = listing("lake", "s", 0, ["a", "b"])
    assert state.observe(first) == (["lake/landing/j1/s/a", "lake/landing/j1/s/b"], [])
    assert state.observe(listing("lake", "s", 1, ["a", "b"])) == ([], [])
    assert state.observe(listing("lake", "s", 2, ["a", "b"], mtime={"b": 3.0})) == ([], ["lake/landing/j1/s/b"])
    state.apply(worker("s", 2, 0, 0), config)
    assert not state.retirable(50, config)  # a worker file, never analysed: waits for its timeout
    state.apply(tick("s", 8), config)  # timeout: analysed at 8
    assert state.revision == 1
    assert not state.retirable(17.9, config) and state.retirable(18, config)
    garbage = SessionState()
    garbage.observe(listing("lake", "s", 0, ["notes.txt"]))  # only files that were quarantined
    assert garbage.retirable(10, config) and not garbage.retirable(9, config)


def test_list_landing_groups_sessions_and_passes_strays_on(tmp_path):
    """One poll: files grouped per session folder; temporaries skipped; files outside a session
    folder or in folders whose names cannot be ids go to 'strays'."""
    from transforms.live.landing import _ListLandingFn

    landing = tmp_path / "lake" / "landing"
    for relative in ["j1/s1/worker-0-0.parquet", "j1/s1/.worker-0-1.parquet.tmp", "j1/s2/manifest.parquet",
                     "loose.parquet", "j1/s1/deep/worker-0-0.parquet", "_j/s1/worker-0-0.parquet",
                     "j1/bad session/worker-0-0.parquet"]:
        (landing / relative).parent.mkdir(parents=True, exist_ok=True)
        (landing / relative).write_bytes(b"x")
    fn = _ListLandingFn(str(landing))
    fn.setup()
    out = list(fn.process((0, 7.0, False)))
    sessions = [value for value in out if not isinstance(value, beam.pvalue.TaggedOutput)]
    strays = sorted(value.value[0][len(str(landing)) + 1:] for value in out if isinstance(value, beam.pvalue.TaggedOutput))
    assert [(key, [url.rsplit("/", 1)[-1] for url, _ in item.files], item.poll_time) for key, item in sessions] == [
        ("j1/s1", ["worker-0-0.parquet"], 7.0), ("j1/s2", ["manifest.parquet"], 7.0)]
    assert strays == ["_j/s1/worker-0-0.parquet", "j1/bad session/worker-0-0.parquet", "j1/s1/deep/worker-0-0.parquet",
                      "loose.parquet"]


def test_strays_are_quarantined_once_and_moved_out_under_test_stream(tmp_path):
    """A stray is quarantined and moved out of the landing area (so no poll lists it again and no
    state is kept for it); one landing again under the same name is a new file: quarantined again."""
    from apache_beam.transforms.userstate import get_dofn_specs

    from transforms.live.landing import _QuarantineStrayFn

    lake = tmp_path / "lake"
    loose, hidden = lake / "landing" / "loose.parquet", lake / "landing" / "_j" / "s" / "worker-0-0.parquet"
    for path in (loose, hidden):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"first")
    assert get_dofn_specs(_QuarantineStrayFn(str(lake))) == (set(), set())   # no per-path state

    class Land(beam.DoFn):   # the second delivery of loose.parquet: landed again after the first was moved
        def process(self, element):
            if element[1][1] == 3.0:
                loose.write_bytes(b"second")
            yield element

    stream = (
        test_stream.TestStream()
        .add_elements([(str(loose), (0.5, 1.0)), (str(hidden), (0.5, 1.0))])
        .add_elements([(str(loose), (2.5, 3.0))])
        .advance_watermark_to_infinity()
    )
    with beam.Pipeline(runner=BundleBasedDirectRunner(), options=PipelineOptions(flags=[], streaming=True)) as pipeline:
        rows = pipeline | stream | beam.ParDo(Land()) | beam.ParDo(_QuarantineStrayFn(str(lake)))
        assert_that(rows | beam.Map(lambda r: (r["source_path"].rsplit("/landing/", 1)[-1], r["reason_code"], r["seen_time"],
                                               ("job id '_j'" in r["detail"] or "expected landing/" in r["detail"])
                                               and "landing_archive/_strays/" in r["detail"])),
                    equal_to([("loose.parquet", "landing_layout", 1.0, True),
                              ("_j/s/worker-0-0.parquet", "landing_layout", 1.0, True),
                              ("loose.parquet", "landing_layout", 3.0, True)]))
    strays = lake / "landing_archive" / "_strays"
    assert sorted(str(p.relative_to(strays)) for p in strays.rglob("*") if p.is_file()) == [
        "2500/loose.parquet", "500/_j/s/worker-0-0.parquet", "500/loose.parquet"]
    assert (strays / "2500/loose.parquet").read_bytes() == b"second"
    assert list((lake / "landing").rglob("*")) == []   # nothing left to list, empty folders dropped


def test_runner_metrics_merge_is_materialised():
    """The watcher's fix for the FnApiRunner's per-bundle metrics chain (pipelines/streaming.py):
    the merge returns a list with the same metrics, and applying it twice wraps once."""
    from apache_beam.metrics import monitoring_infos
    from apache_beam.runners.portability.fn_api_runner import fn_runner

    from pipelines.streaming import bound_runner_metrics

    bound_runner_metrics()
    bound_runner_metrics()
    merge = fn_runner.consolidate_monitoring_infos
    assert getattr(merge, "materialised", False)
    infos = [monitoring_infos.int64_user_counter("ns", "n", 2, ptransform="t"),
             monitoring_infos.int64_user_counter("ns", "n", 3, ptransform="t")]
    merged = merge(infos)
    assert isinstance(merged, list) and merged == list(monitoring_infos.consolidate(infos))
    assert len(merged) == 1 and monitoring_infos.extract_counter_value(merged[0]) == 5


def _assembly(lake, job, session):
    from transforms.live.landing import land_generated_session
    from transforms.live.sessions import Assembly

    paths = land_generated_session(lake, job, 0, session)
    workers = {(int(p.rsplit("-", 2)[1]), int(p.rsplit("-", 1)[1].split(".")[0])): p for p in paths[1:]}
    return Assembly(job.spec.job_id, session, 1, "complete", paths[0], workers, tuple(sorted(workers)), (), 1.0, 2.0, 0)


def test_analysis_per_bundle_isolates_a_bug_and_stops_on_storage_failure(tmp_path, small_job, monkeypatch):
    """Sessions of one bundle are validated together; an unexpected error in one session's analysis
    becomes that session's 'unexpected' row while the other is analysed; a storage failure
    (OSError) is not bad data: it propagates and stops the watcher."""
    from transforms.live import analyze_sessions as module

    from transforms.synth.job import JobSpec, generate_job

    lake = str(tmp_path / "lake")
    other = generate_job(JobSpec(job_id="j2", dp=2, pp=2, microbatches=2, steps=2, sessions=1, seed=2))
    good, bad = _assembly(lake, small_job, "good"), _assembly(lake, other, "bad")
    real = module.analyze_and_classify

    def engine(trace, meta, job_id):
        if job_id == "j2":
            raise KeyError("a bug")
        return real(trace, meta, job_id)

    monkeypatch.setattr(module, "analyze_and_classify", engine)
    fn = module._AnalyzeSessionFn()
    fn.setup()
    fn.start_bundle()
    for assembly in (good, bad):
        fn.process(assembly, 0, beam.transforms.window.GlobalWindow())
    out = list(fn.finish_bundle())
    tags = [(value.tag, value.value.value) if isinstance(value, beam.pvalue.TaggedOutput) else (None, value.value)
            for value in out]
    results = [value for tag, value in tags if tag is None]
    unexpected = [value for tag, value in tags if tag == "unexpected"]
    assert [(row["session"], row["status"]) for row in results] == [("good", "analysed")]
    assert [(row["session"], row["reason_code"]) for row in unexpected] == [("bad", "unexpected_error")]
    assert "KeyError" in unexpected[0]["detail"]

    def storage_down(trace, meta, job_id):
        raise ConnectionResetError("injected")

    monkeypatch.setattr(module, "analyze_and_classify", storage_down)
    fn.start_bundle()
    fn.process(good, 0, beam.transforms.window.GlobalWindow())
    with pytest.raises(ConnectionResetError):
        list(fn.finish_bundle())


def test_strays_arriving_every_poll_keep_the_listing_bounded(tmp_path):
    """Ten polls, two strays landing before each: every poll lists only the strays that arrived since
    the last (the earlier ones left the landing area), each is quarantined once, nothing stays."""
    from transforms.live.landing import _ListLandingFn, _QuarantineStrayFn

    lake = tmp_path / "lake"
    landing = lake / "landing"
    landing.mkdir(parents=True)
    lister, quarantine = _ListLandingFn(str(landing)), _QuarantineStrayFn(str(lake))
    lister.setup()
    listed, rows = [], []
    for poll in range(10):
        for name in (f"notes-{poll}.txt", f"j1/bad session {poll}/worker-0-0.parquet"):
            (landing / name).parent.mkdir(parents=True, exist_ok=True)
            (landing / name).write_bytes(b"stray")
        strays = [value.value for value in lister.process((poll, float(poll), False))
                  if isinstance(value, beam.pvalue.TaggedOutput)]
        listed.append(len(strays))
        for stray in strays:
            rows += list(quarantine.process(stray))
    assert listed == [2] * 10
    assert len(rows) == 20 and len({row["source_path"] for row in rows}) == 20
    assert not [p for p in landing.rglob("*")]
