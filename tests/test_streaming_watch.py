"""End to end: `strag watch` on a local folder while session files are dropped in.

The watcher runs in a thread with a bounded run (--stop-after-sessions, --max-runtime
as a safety net); the test polls the output tables with a deadline, never sleeps for
timing. Sessions: a complete one (with a duplicate delivery), one that times out with a
worker missing and is corrected when the late file lands, and a straggling job that
raises an alert.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow.compute as pc
import pytest

from pipelines import streaming
from transforms.live.landing import land_generated_session, session_trace
from transforms.live.tables import current_results, read_live_table
from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec, generate_job
from transforms.whatif import analyze_job

pytestmark = pytest.mark.slow
DEADLINE_SECONDS = 90


def wait_for(predicate, what: str, deadline: float):
    """Poll `predicate()` until it returns a truthy value or the deadline passes."""
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)  # polling cadence only: the assertion is on content, not timing
    raise AssertionError(f"timed out waiting for {what}")


def results_for(out, job_id, session, revision):
    table = read_live_table(out)
    mask = pc.and_(pc.and_(pc.equal(table["job_id"], job_id), pc.equal(table["session"], session)),
                   pc.equal(table["revision"], revision))
    rows = table.filter(mask).to_pylist()
    return rows[0] if rows else None


@pytest.fixture(scope="module")
def jobs():
    clean = generate_job(JobSpec(job_id="clean", dp=3, pp=2, microbatches=4, steps=6, sessions=2, seed=3))
    slow = generate_job(JobSpec(job_id="slow", dp=2, pp=2, microbatches=4, steps=4, sessions=1, seed=4,
                                causes=(Cause("slow_worker", {"dp_rank": 1, "stage": 0, "factor": 1.6}),)))
    return clean, slow


def test_watch_assembles_corrects_and_alerts_while_files_land(tmp_path, jobs):
    clean, slow = jobs
    lake, out = str(tmp_path / "lake"), str(tmp_path / "out")
    (tmp_path / "lake" / "landing").mkdir(parents=True)   # watch refuses a --lake that is no lake (a typo would be watched forever)
    argv = ["--lake", lake, "--out", out, "--session-timeout", "2", "--poll-interval", "0.2",
            "--stop-after-sessions", "3", "--max-runtime", str(DEADLINE_SECONDS)]
    codes = []
    watcher = threading.Thread(target=lambda: codes.append(streaming.run(argv)), daemon=True)
    watcher.start()
    deadline = time.time() + DEADLINE_SECONDS

    # 1. A complete session, one worker delivered twice.
    land_generated_session(lake, clean, 0, "s0")
    land_generated_session(lake, clean, 0, "s0", workers=[(2, 1)], with_manifest=False)
    first = wait_for(lambda: results_for(out, "clean", "s0", 1), "clean/s0 r1", deadline)
    expected = analyze_job(session_trace(clean, 0), clean.meta, "clean")
    assert first["status"] == "analysed" and first["reason"] == "complete" and first["complete"]
    assert first["slowdown"] == pytest.approx(expected.slowdown, rel=1e-12)
    assert first["step_slowdown"] == pytest.approx(np.asarray(expected.step_slowdown).tolist(), rel=1e-12)
    assert first["workers_present"] == 6 and first["missing_workers"] == []

    # 2. A session missing worker (1, 1): analysed at the timeout on DP ranks 0 and 2, then corrected.
    land_generated_session(lake, clean, 1, "s1", workers=[(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)])
    partial = wait_for(lambda: results_for(out, "clean", "s1", 1), "clean/s1 r1 (timeout)", deadline)
    assert partial["reason"] == "timeout" and not partial["complete"]
    assert partial["missing_workers"] == [{"dp_rank": 1, "stage": 1}]
    assert partial["dp_ranks_analysed"] == 2 and partial["status"] == "analysed"
    assert partial["worker_slowdown"] is None or partial["worker_slowdown"][1 * 2 + 1] is None
    land_generated_session(lake, clean, 1, "s1", workers=[(1, 1)], with_manifest=False)
    corrected = wait_for(lambda: results_for(out, "clean", "s1", 2), "clean/s1 r2 (late file)", deadline)
    assert corrected["reason"] == "late" and corrected["complete"] and corrected["dp_ranks_analysed"] == 3
    assert corrected["slowdown"] == pytest.approx(analyze_job(session_trace(clean, 1), clean.meta, "clean").slowdown,
                                                  rel=1e-12)

    # 3. A straggling job: its first result above the threshold raises one alert.
    land_generated_session(lake, slow, 0, "s0")
    watcher.join(timeout=max(1.0, deadline - time.time()))
    assert not watcher.is_alive() and codes == [0]

    current = current_results(read_live_table(out))
    assert sorted(zip(current["job_id"].to_pylist(), current["session"].to_pylist(), current["revision"].to_pylist())) == [
        ("clean", "s0", 1), ("clean", "s1", 2), ("slow", "s0", 1)]
    # The duplicate delivery was counted, never analysed twice: one row per (session, revision).
    everything = read_live_table(out)
    assert everything.num_rows == 4
    slow_row = results_for(out, "slow", "s0", 1)
    assert slow_row["slowdown"] >= 1.1 and slow_row["verdict"] == "individual-worker"
    assert first["verdict"] == "none"
    alerts = read_live_table(out, "alerts").to_pylist()
    assert [(a["job_id"], a["kind"], a["cause"]) for a in alerts] == [("slow", "firing", "individual-worker")]
    assert alerts[0]["ranks"] == [w["rank"] for w in slow_row["blamed"]] and alerts[0]["ranks"]
    assert read_live_table(out, "live_quarantine").num_rows == 0


def test_ctrl_c_stops_after_a_final_poll_that_analyses_pending_sessions(tmp_path, jobs):
    """SIGINT to a running `strag watch` process: the next poll is the last, the session still
    waiting for a worker is analysed with what arrived ('watcher-stopped'), and it exits 0."""
    import signal
    import subprocess
    import sys

    clean, _ = jobs
    lake, out = tmp_path / "lake", tmp_path / "out"
    land_generated_session(str(lake), clean, 0, "s0", workers=[(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)])
    watcher = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "watch", "--lake", str(lake), "--out", str(out),
                                "--session-timeout", "600", "--poll-interval", "0.2", "--status-interval", "0.2"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in watcher.stdout:   # polls are running once the first status line says the session is in play
            if "1 session(s) in play" in line:
                break
        watcher.send_signal(signal.SIGINT)
        rest, _ = watcher.communicate(timeout=DEADLINE_SECONDS)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, rest
    assert "SIGINT: stopping after the next poll" in rest and "strag watch: stopped after" in rest
    row = results_for(str(out), "clean", "s0", 1)
    assert row["reason"] == "watcher-stopped" and row["missing_workers"] == [{"dp_rank": 2, "stage": 1}]
    assert row["status"] == "analysed" and row["dp_ranks_analysed"] == 2
