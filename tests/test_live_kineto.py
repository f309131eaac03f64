"""Live Kineto sessions: torch.profiler traces landed by the collector (`kineto_handler(..., live=True)`)
or `strag land --live`, assembled, converted and analysed by `strag watch` like parquet sessions.

Real committed torch runs (tests/data/real_runs) go through the collector's code path; torch is not
installed here, so a stand-in profiler's `export_chrome_trace(path)` writes the committed rank trace,
which is all the handler asks of torch.profiler.profile (as in tests/test_collect.py). The end-to-end
tests run a real `strag watch` subprocess on a local lake and on a moto S3 lake, and print the time
from the last rank landing to the alert row.
"""
from __future__ import annotations

import gzip
import json
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import pyarrow.compute as pc
import pytest

from fake_profiler import FakeProfiler
from fixtures_s3 import moto_s3  # noqa: F401 - a fixture
from pipelines import cli
from schemas.lake import landing_dir
from strag_collect import kineto_handler, live_dir, live_session, live_trace_name
from transforms.live.analyze_sessions import analyze_session
from transforms.live.landing import (LandingEvent, LandingPathError, kineto_trace_name, parse_landing_name,
                                parse_landing_path)
from transforms.live.tables import read_live_table
from transforms.live.sessions import FORMAT_KINETO, AssemblyConfig, SessionState
from transforms.validation import Validator
from transforms.whatif.causes import analyze_and_classify

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "data" / "real_runs"
SLOWED = "two-fwd3-r1-bwd2-r3-gpipe-pp4-mlp-sleep"   # ranks 1 (fwd x3) and 3 (bwd x2) slowed: straggling
CLEAN = "clean-gpipe-pp4-mlp-sleep-data-s1"           # no injected slowdown
DATE = "2026-11-25"
DEADLINE_SECONDS = 240


def _truth(run: str) -> dict:
    return json.loads((RUNS / run / "truth.json").read_text())


def _rank_traces(run: str) -> dict[int, pathlib.Path]:
    return {int(name.split("-")[1].split(".")[0]): RUNS / run / name for name in _truth(run)["trace_files"]}


def _collect(run: str, lake: str, job_id: str, ranks=None, **options) -> list[str]:
    """Each rank of a committed run through its own live handler, one after the other as ranks finish a
    window; returns the URLs landed. The handler's own code path: __call__ with a profiler object."""
    traces = _rank_traces(run)
    world = len(traces)
    landed = []
    options.setdefault("record_gc", False)   # committed traces of another process: this one's collections are not theirs
    options.setdefault("record_host", False)   # ... nor this machine's cores
    for rank in sorted(traces) if ranks is None else ranks:
        handler = kineto_handler(lake, job_id=job_id, date=DATE, rank=rank, world=world, live=True, **options)
        handler(FakeProfiler(traces[rank]))
        assert handler.flush(timeout=60)
        landed += handler.landed
    return landed


# ---- the layout: collector and watcher agree -------------------------------------------------------------------


def test_the_collector_names_what_the_watcher_parses():
    for rank, world, compress in ((0, 1, True), (3, 4, True), (1023, 1024, False)):
        name = live_trace_name(rank, world, compress)
        assert name == kineto_trace_name(rank, world, compress)
        assert parse_landing_name(name, "x") == ("kineto", rank, world)
    assert live_dir("s3://b/lake/", "j", "w0") == landing_dir("s3://b/lake", "j", "w0")
    assert parse_landing_path("s3://b/lake/landing/j/w3/rank-2-of-8.json.gz") == ("j", "w3", "kineto", 2, 8)
    assert parse_landing_path("/l/landing/j/w3/job.yaml") == ("j", "w3", "job_yaml", -1, -1)
    with pytest.raises(LandingPathError, match="rank 4 is not below the world size 4"):
        parse_landing_name("rank-4-of-4.json.gz", "x")
    with pytest.raises(LandingPathError, match="rank-RANK-of-WORLD"):
        parse_landing_name("rank-0.json.gz", "x")
    with pytest.raises(ValueError):
        live_trace_name(2, 2)


def test_session_names_follow_the_run_so_a_rerun_is_a_new_session(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert live_session(0) == "w0" and live_session(2, "nightly") == "nightly-w2"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "8f0c/x y")
    assert live_session(1) == "8f0c-x-y-w1"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert live_session(1) == "8f0c-x-y-restart2-w1"
    with pytest.raises(ValueError):
        kineto_handler("lake", job_id="j", live=True, session_prefix="../up")


def test_live_handler_lands_the_session_and_the_raw_window(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    lake = str(tmp_path / "lake")
    landed = _collect(CLEAN, lake, "gpipe-live", mesh={"pp": 4})
    session = pathlib.Path(landing_dir(lake, "gpipe-live", "w0"))
    names = sorted(path.name for path in session.iterdir())   # hidden temporaries included: none may be left
    assert names == ["job.yaml", "rank-0-of-4.json.gz", "rank-1-of-4.json.gz", "rank-2-of-4.json.gz",
                     "rank-3-of-4.json.gz"]
    raw = pathlib.Path(lake) / "raw" / "kineto" / f"date={DATE}" / "job_id=gpipe-live"
    assert sorted(path.name for path in raw.iterdir()) == ["job.yaml", *(f"rank-{r}.0.json.gz" for r in range(4))]
    for rank, trace in _rank_traces(CLEAN).items():
        live = (session / f"rank-{rank}-of-4.json.gz").read_bytes()
        assert gzip.decompress(live) == gzip.decompress(trace.read_bytes())
        assert live == (raw / f"rank-{rank}.0.json.gz").read_bytes()   # gzipped once, landed twice
    # rank 0 lands the session's job.yaml before its trace: a session is whole when its last trace is in
    order = [url.rsplit("/", 2)[-2:] for url in landed if "/landing/" in url]
    assert order.index(["w0", "job.yaml"]) < order.index(["w0", "rank-0-of-4.json.gz"])


def test_a_rank_of_unknown_world_lands_its_raw_window_and_warns(tmp_path, monkeypatch):
    """Without torch.distributed, WORLD_SIZE or world=, rank 1 cannot name its live file (the watcher could
    not tell when the session is complete): one warning, the raw window still lands."""
    from strag_collect import CollectorWarning

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    lake = str(tmp_path / "lake")
    handler = kineto_handler(lake, job_id="j", date=DATE, rank=1, live=True)
    with pytest.warns(CollectorWarning, match="not landed as a live session: rank 1 of an unknown world size"):
        handler(FakeProfiler(_rank_traces(CLEAN)[1]))
    assert handler.flush(timeout=60)
    assert [url.rsplit("/", 2)[-2:] for url in handler.landed] == [["job_id=j", "rank-1.0.json.gz"]]
    assert not (tmp_path / "lake" / "landing").exists()


def test_land_live_from_a_run_folder(tmp_path, capsys):
    lake = str(tmp_path / "lake")
    assert cli.main(["land", str(RUNS / SLOWED), "--lake", lake, "--job-id", "landed", "--date", DATE, "--live",
                     "--session", "s1"]) == 0
    printed = capsys.readouterr().out
    assert "landed live session s1 of job landed (4 file(s))" in printed and "landed 4 rank traces" in printed
    session = pathlib.Path(landing_dir(lake, "landed", "s1"))
    assert sorted(path.name for path in session.iterdir()) == [f"rank-{r}-of-4.json.gz" for r in range(4)]
    # ranks come from each trace's distributedInfo, never from the file name
    for rank, trace in _rank_traces(SLOWED).items():
        document = json.loads(gzip.decompress((session / f"rank-{rank}-of-4.json.gz").read_bytes()))
        assert document["distributedInfo"]["rank"] == rank
        assert (session / f"rank-{rank}-of-4.json.gz").read_bytes() == trace.read_bytes()


def test_land_live_refuses_traces_it_cannot_place(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    trace = _rank_traces(CLEAN)[1]
    shutil.copy(trace, folder / "a.json.gz")
    shutil.copy(trace, folder / "b.json.gz")
    assert cli.main(["land", str(folder), "--lake", str(tmp_path / "lake"), "--job-id", "x", "--live"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a.json.gz and b.json.gz are both rank 1" in err[0]
    assert not (tmp_path / "lake").exists()


# ---- assembly ----------------------------------------------------------------------------------------------------


def _event(kind, t, rank=-1, world=0, name=None, session="w0"):
    path = f"lake/landing/j/{session}/" + (name or (f"rank-{rank}-of-{world}.json.gz" if kind == "kineto" else "job.yaml"))
    return LandingEvent(kind, "j", session, t, path, rank=rank, world=world)


def test_a_kineto_session_completes_when_every_rank_is_in_or_times_out():
    config = AssemblyConfig(timeout_seconds=5.0)
    state = SessionState()
    out = []
    for event in [_event("job_yaml", 0), _event("kineto", 0, 2, 4), _event("kineto", 1, 0, 4), _event("kineto", 1, 3, 4),
                  LandingEvent("tick", "j", "w0", 1), _event("kineto", 2, 1, 4)]:
        out += state.apply(event, config)
    assert len(out) == 1
    done = out[0]
    assert (done.fmt, done.reason, done.complete, done.expected, done.missing) == (FORMAT_KINETO, "complete", True,
                                                                                  (0, 1, 2, 3), ())
    assert done.options_path.endswith("/job.yaml") and sorted(done.worker_paths) == [0, 1, 2, 3]

    state, out = SessionState(), []
    for event in [_event("kineto", 0, 0, 4), _event("kineto", 0, 1, 4), LandingEvent("tick", "j", "w0", 4.9),
                  LandingEvent("tick", "j", "w0", 5.0), _event("kineto", 6, 0, 4, name="rank-0-of-4.json.gz")]:
        out += state.apply(event, config)
    assert [(a.reason, a.complete, a.missing) for a in out] == [("timeout", False, (2, 3))]
    assert state.duplicate_deliveries == 1


def test_a_session_never_mixes_formats():
    state = SessionState()
    state.apply(_event("kineto", 0, 0, 2), AssemblyConfig())
    parquet = LandingEvent("worker", "j", "w0", 1, "lake/landing/j/w0/worker-0-0.parquet", 0, 0)
    assert "worker-0-0.parquet is a parquet session file, but the session holds Kineto traces" in state.format_conflict(parquet)
    with pytest.raises(ValueError):
        state.apply(parquet, AssemblyConfig())


# ---- analysis (no Beam) ------------------------------------------------------------------------------------------


def _kineto_assembly(folder: pathlib.Path, ranks: list[int], world: int, reason: str, job_yaml: str | None = None):
    state = SessionState()
    config = AssemblyConfig(timeout_seconds=1.0)
    if job_yaml is not None:
        (folder / "job.yaml").write_text(job_yaml)
        state.apply(LandingEvent("job_yaml", "j", folder.name, 0.0, str(folder / "job.yaml")), config)
    out = []
    for rank in ranks:
        out += state.apply(LandingEvent("kineto", "j", folder.name, 0.0, str(folder / live_trace_name(rank, world)),
                                        rank=rank, world=world), config)
    stopped = reason == "watcher-stopped"
    out += state.apply(LandingEvent("tick", "j", folder.name, 0.5 if stopped else 10.0, final=stopped), config)
    assert len(out) == 1 and out[0].reason == reason
    return out[0]


def _stage(run: str, folder: pathlib.Path, ranks) -> None:
    folder.mkdir(parents=True)
    traces = _rank_traces(run)
    for rank in ranks:
        shutil.copy(traces[rank], folder / live_trace_name(rank, len(traces)))


@pytest.fixture(scope="module")
def validator():
    return Validator()


def test_a_complete_kineto_session_is_analysed_like_its_raw_window(tmp_path, validator):
    from transforms.ingest import convert_window

    folder = tmp_path / "landing" / "j" / "w0"
    _stage(SLOWED, folder, range(4))
    row, quarantine = analyze_session(_kineto_assembly(folder, [0, 1, 2, 3], 4, "complete"), validator,
                                      analyze_and_classify)
    converted = convert_window("kineto", sorted(str(p) for p in _rank_traces(SLOWED).values()), "j", DATE)
    expected, verdict = analyze_and_classify(converted.trace, converted.job_meta(), "j")
    assert row["status"] == "analysed" and row["complete"] and row["source_format"] == "kineto"
    assert row["slowdown"] == pytest.approx(expected.slowdown, rel=1e-12) and row["slowdown"] >= 1.1
    assert row["verdict"] == verdict.cause == "individual-worker"
    assert (row["dp_size"], row["pp_size"], row["workers_expected"], row["workers_present"]) == (1, 4, 4, 4)
    assert row["missing_ranks"] == [] and quarantine.num_rows == 0


def test_a_session_missing_a_rank_the_method_needs_is_quarantined_never_complete(tmp_path, validator):
    folder = tmp_path / "landing" / "j" / "w0"
    _stage(SLOWED, folder, [0, 1, 2])
    row, quarantine = analyze_session(_kineto_assembly(folder, [0, 1, 2], 4, "timeout"), validator, analyze_and_classify)
    assert row["status"] == "failed" and not row["complete"] and row.get("slowdown") is None
    assert row["missing_ranks"] == [3] and "[raw_missing_rank]" in row["error"] and "rank(s) 3 of 4 had not landed" in row["error"]
    records = quarantine.to_pylist()
    assert [r["reason_code"] for r in records] == ["raw_missing_rank"]
    assert records[0]["source_path"] == str(folder) and records[0]["job_id"] == "j"


def test_a_session_missing_a_rank_the_method_can_do_without_is_analysed_and_marked(tmp_path, validator):
    """A TP peer is collapsed onto its lowest rank by the converter: without it the session is analysed on the
    ranks present, and the row says it is not complete and which rank was missing. (The real DDP run is
    declared tp 2 x dp 2 by job.yaml, a documented override, to have TP peers among real traces.)"""
    folder = tmp_path / "landing" / "j" / "w0"
    _stage("dp4-ddp-sleep", folder, [0, 2, 3])
    layout = "dp_size: 2\ntp_size: 2\nlayout: tp-dp-cp-pp\n"
    row, quarantine = analyze_session(_kineto_assembly(folder, [0, 2, 3], 4, "watcher-stopped", layout), validator,
                                      analyze_and_classify)
    assert row["status"] == "analysed" and not row["complete"] and row["reason"] == "watcher-stopped"
    assert row["missing_ranks"] == [1] and row["workers_present"] == 3 and row["workers_expected"] == 4
    assert row["dp_ranks_analysed"] == 2 and row["slowdown"] >= 1.0 and quarantine.num_rows == 0


def test_an_unreadable_trace_is_quarantined_and_refuses_the_session_it_leaves_short(tmp_path, validator):
    folder = tmp_path / "landing" / "j" / "w0"
    _stage(CLEAN, folder, [0, 1, 2])
    (folder / live_trace_name(3, 4)).write_bytes(gzip.compress(b'{"schemaVersion": 1, "traceEvents": [{"ph": '))
    row, quarantine = analyze_session(_kineto_assembly(folder, [0, 1, 2, 3], 4, "complete"), validator,
                                      analyze_and_classify)
    assert row["status"] == "failed" and row["complete"]   # every rank landed; one of them is broken
    codes = {r["reason_code"]: r["source_path"] for r in quarantine.to_pylist()}
    assert codes == {"raw_unreadable": str(folder / "rank-3-of-4.json.gz"), "raw_missing_rank": str(folder)}


# ---- end to end: a real `strag watch` while the collector lands real traces ---------------------------------------


class Watcher:
    """`strag watch` as a subprocess (its own process, as in production); stdout drained on a thread."""

    def __init__(self, lake: str, out: str, sessions: int):
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "watch", "--lake", lake, "--out", out, "--session-timeout", "60",
             "--poll-interval", "0.25", "--status-interval", "0.25", "--stop-after-sessions", str(sessions),
             "--max-runtime", str(DEADLINE_SECONDS)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self):
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_polling(self, deadline: float) -> None:
        while not any("strag watch: poll" in line for line in self.lines):
            assert self.process.poll() is None, "".join(self.lines)
            assert time.time() < deadline, "the watcher did not start polling:\n" + "".join(self.lines)
            time.sleep(0.05)

    def close(self) -> None:
        """Kill the watcher if it still runs (a failed test), then release its pipe."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._reader.join(5)
        self.process.stdout.close()


def _rows(out: str, table: str, job_id: str) -> list[dict]:
    rows = read_live_table(out, table)
    return rows.filter(pc.equal(rows["job_id"], job_id)).to_pylist()


def _wait_for(predicate, what: str, deadline: float, watcher: Watcher):
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        assert watcher.process.poll() is None, f"the watcher ended before {what}:\n" + "".join(watcher.lines)
        time.sleep(0.02)   # the test's own polling cadence; the latency below is measured by the watcher's clock too
    raise AssertionError(f"timed out waiting for {what}:\n" + "".join(watcher.lines[-30:]))


def _watch_collected_runs(lake: str, out: str, label: str) -> None:
    """The slowed run and the clean run, each rank through the live collector, while `strag watch` runs: an
    alert for the slowed run only; prints the time from the last rank landing to the alert row."""
    watcher = Watcher(lake, out, sessions=2)
    deadline = time.time() + DEADLINE_SECONDS
    try:
        watcher.wait_polling(deadline)
        _collect(SLOWED, lake, "slowed", mesh={"pp": 4})
        last_landed = time.time()   # every rank's upload returned: the session's last file is visible
        alert = _wait_for(lambda: _rows(out, "alerts", "slowed"), "the slowed run's alert", deadline, watcher)[0]
        seen = time.time()
        _collect(CLEAN, lake, "clean", mesh={"pp": 4})
        clean_landed = time.time()
        clean = _wait_for(lambda: _rows(out, "live_results", "clean"), "the clean run's result", deadline, watcher)[0]
        clean_seen = time.time()
        code = watcher.process.wait(timeout=max(1.0, deadline - time.time()))   # --stop-after-sessions 2
    finally:
        watcher.close()
    assert code == 0, "".join(watcher.lines)
    slowed = _rows(out, "live_results", "slowed")
    assert [(r["session"], r["revision"], r["reason"], r["status"], r["complete"], r["source_format"]) for r in slowed] == [
        ("w0", 1, "complete", "analysed", True, "kineto")]
    assert slowed[0]["slowdown"] >= 1.1 and slowed[0]["verdict"] == "individual-worker"
    assert (alert["kind"], alert["session"], alert["revision"]) == ("firing", "w0", 1)
    assert alert["ranks"] == [w["rank"] for w in slowed[0]["blamed"]] and alert["ranks"]
    assert clean["status"] == "analysed" and clean["complete"] and clean["slowdown"] < 1.1 and clean["verdict"] == "none"
    assert _rows(out, "alerts", "clean") == []
    assert read_live_table(out, "live_quarantine").num_rows == 0
    alert_time = alert["alert_time"].timestamp()
    print(f"\n[{label}] last rank landed -> alert row: {alert_time - last_landed:.2f} s by the watcher's alert_time, "
          f"{seen - last_landed:.2f} s until the test read it (S {slowed[0]['slowdown']:.3f}); clean run: result "
          f"after {clean_seen - clean_landed:.2f} s, S {clean['slowdown']:.3f}, no alert")
    assert alert_time >= last_landed - 1.0   # the alert came from this landing (clocks of one machine)


@pytest.mark.slow
def test_watch_alerts_on_a_collected_slowed_run_in_a_local_lake(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    lake = tmp_path / "lake"
    (lake / "landing").mkdir(parents=True)   # the watcher refuses a --lake that is not there
    _watch_collected_runs(str(lake), str(tmp_path / "out"), "local lake")


@pytest.mark.slow
def test_watch_alerts_on_a_collected_slowed_run_in_an_s3_lake(moto_s3, monkeypatch):  # noqa: F811
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    lake, out = moto_s3.url("live-lake"), moto_s3.url("live-out")
    moto_s3.filesystem().touch(f"{lake}/_lake.json")   # the watcher refuses a --lake that is not there
    _watch_collected_runs(lake, out, "moto S3 lake")


@pytest.mark.slow
def test_watch_analyses_a_session_missing_a_rank_at_the_timeout(tmp_path, monkeypatch):
    """Rank 3 of the slowed run never lands: at the session timeout the converter refuses the session
    (raw_missing_rank); the row is failed and not complete, the quarantine names the reason, no alert."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    lake, out = tmp_path / "lake", str(tmp_path / "out")
    (lake / "landing").mkdir(parents=True)
    watcher = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "watch", "--lake", str(lake), "--out", out, "--session-timeout", "2",
         "--poll-interval", "0.25", "--stop-after-sessions", "1", "--max-runtime", str(DEADLINE_SECONDS)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _collect(SLOWED, str(lake), "short", ranks=[0, 1, 2])
        printed, _ = watcher.communicate(timeout=DEADLINE_SECONDS)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, printed
    [row] = _rows(out, "live_results", "short")
    assert (row["reason"], row["status"], row["complete"], row["missing_ranks"]) == ("timeout", "failed", False, [3])
    assert "[raw_missing_rank]" in row["error"]
    assert [r["reason_code"] for r in _rows(out, "live_quarantine", "short")] == ["raw_missing_rank"]
    assert _rows(out, "alerts", "short") == []
