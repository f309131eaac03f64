"""The worker test over several profiling windows of one job (workers.pooled_worker_tests) and the
pages it gives the live watcher (paging.pooled_page, AlertBook): a slow worker that no window of
three steps can tell from the job's jitter is decided by its windows together, at the same stated
false-alarm rate."""
from __future__ import annotations

import json

import numpy as np
import pytest

from transforms.live.paging import POOLED_WINDOWS, AlertBook, fingerprint, pooled_page
from transforms.synth import JobSpec, generate_job
from transforms.whatif import compile_job
from transforms.whatif.causes.signals import BACKWARD, pairs
from transforms.whatif.causes.workers import pooled_worker_tests, worker_tests

from test_worker_detector import _jittered, _slow


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def window(request):
    """A clean DDP job of 3 profiled steps (one microbatch each), compiled once: one window."""
    dp = request.param
    job = generate_job(JobSpec(job_id=f"pw{dp}", dp=dp, pp=1, microbatches=1, steps=3, sessions=1, seed=3))
    model = compile_job(job.trace, job.meta, f"pw{dp}")
    return model, *pairs(model)


def _windows(window, rng, sigma: float, factor: float, n: int = 4):
    """n windows of the job, jittered (sigma per op, log), the last DP rank's backward `factor`x:
    each window's WorkerTests."""
    model, forward, backward = window
    out = []
    for _ in range(n):
        jittered = _jittered(model, rng, sigma)
        if factor != 1.0:
            jittered = _slow(jittered, model.dp_size - 1, BACKWARD, factor)
        out.append(worker_tests(jittered, forward, backward))
    return out


def test_clean_windows_pooled_raise_at_most_the_stated_false_alarm_rate(window):
    """300 clean jobs of 4 windows (30% jitter per op): a job with a pooled finding is a false alarm;
    at alpha = 1% the count stays near 3 (at most 9: P(X >= 10 | 300, 1%) < 0.1%)."""
    rng = np.random.default_rng(7)
    alarms = sum(bool(pooled_worker_tests([t.summary() for t in _windows(window, rng, 0.30, 1.0)])) for _ in range(300))
    assert alarms <= 9


def test_a_slow_worker_no_window_decides_is_decided_by_its_windows_together(window):
    """The last DP rank's backward 1.3x at 15% jitter per op: most windows alone leave it within the
    jitter; four together name it, with its kind and ratio, in most jobs (measured here: about 4 in
    5 jobs with two DP ranks, 1 in 2 with four, against about 1 window in 15 alone)."""
    model = window[0]
    rng = np.random.default_rng(3)
    alone = pooled = other = 0
    for _ in range(60):
        tests = _windows(window, rng, 0.15, 1.3)
        alone += sum(bool(t.slow) for t in tests)
        found = pooled_worker_tests([t.summary() for t in tests])
        if found:
            assert (found[0]["dp_rank"], found[0]["stage"], found[0]["kind"]) == (model.dp_size - 1, 0, "backward")
            assert found[0]["ratio"] == pytest.approx(1.3, rel=0.2)
            assert found[0]["windows"] == 4 and found[0]["samples"] == 12 and found[0]["p_value"] <= 0.01
            pooled += 1
            other += len(found) > 1   # a healthy worker's kind named too: the stated 1% per job, not more
    assert alone <= 0.15 * 240
    assert pooled >= 24   # >= 40% of the jobs
    assert other <= 3


def test_one_window_a_worker_not_slow_now_or_another_layout_pools_nothing(window):
    rng = np.random.default_rng(11)
    slow = [t.summary() for t in _windows(window, rng, 0.02, 1.5)]   # decided in every window
    assert pooled_worker_tests(slow[-1:]) == []                       # one window: its own test speaks
    assert pooled_worker_tests(slow)                                  # four: decided together too
    repaired = [t.summary() for t in _windows(window, rng, 0.02, 1.0, n=1)]
    assert pooled_worker_tests(slow + repaired) == []                 # not slow in the newest window
    other = dict(slow[0], stages=[1])                                 # a window of another layout
    assert pooled_worker_tests([other, slow[-1]]) == []
    assert pooled_worker_tests([*slow, None]) == []                   # the newest window had no test


def _row(job: str, session: str, summary: dict | None, where, **fields) -> dict:
    return {"job_id": job, "session": session, "revision": 1, "status": "analysed", "verdict": "insufficient-evidence",
            "verdict_confidence": 0.9, "slowdown": 1.2, "blamed": [], "undecided_workers": 1, "first_arrival": 0.0,
            "worker_summary": None if summary is None else json.dumps({**summary, "where": where}), **fields}


def test_the_watcher_pages_the_worker_its_windows_decide_once_and_resolves_when_it_is_repaired(window, tmp_path):
    """Windows whose own verdicts are undecided page individual-worker with the worker's rank and
    host once their steps together decide (one alert, the fingerprint a one-window page of that
    worker has), say so, claim no fix saving; a window with the worker at its peers' pace resolves it."""
    model = window[0]
    rng = np.random.default_rng(5)
    while True:   # four windows, none deciding alone, together deciding
        tests = _windows(window, rng, 0.15, 1.3)
        if not any(t.slow for t in tests) and pooled_worker_tests([t.summary() for t in tests]):
            break
    where = [[d, 0, 10 + d, f"host-{d}"] for d in range(model.dp_size)]
    book = AlertBook(str(tmp_path), threshold=1.1)
    events = []
    for i, t in enumerate(tests):
        events += book.apply(_row("j", f"s{i}", t.summary(), where), now=float(i))
    assert len(events) == 1 and events[0]["kind"] == "firing"
    alert = events[0]
    slow_rank = 10 + model.dp_size - 1
    assert alert["cause"] == "individual-worker" and alert["ranks"] == [slow_rank]
    assert alert["fingerprint"] == fingerprint("j", "individual-worker", [slow_rank])
    assert alert["workers"][0]["host"] == f"host-{model.dp_size - 1}" and alert["workers"][0]["work"] == "backward"
    assert "profiling windows together" in alert["message"] and alert["saving"] is None
    assert alert["confidence"] >= 0.99
    # the same windows again (a watcher restart re-reads landing/): nothing pages twice
    assert book.apply(_row("j", "s3", tests[-1].summary(), where), now=9.0) == []
    # the worker repaired: a healthy window (S below the threshold, nobody slow) resolves the alert
    repaired = _windows(window, rng, 0.02, 1.0, n=1)[0]
    healthy = _row("j", "s9", repaired.summary(), where, verdict="none", verdict_confidence=1.0, slowdown=1.01,
                   undecided_workers=0)
    resolved = book.apply(healthy, now=10.0)
    assert [e["kind"] for e in resolved] == ["resolved"] and resolved[0]["fingerprint"] == alert["fingerprint"]
    state = json.loads((tmp_path / "alert_state" / "j.json").read_text())
    assert len(state["windows"]) == 5 <= POOLED_WINDOWS


def test_a_window_that_pages_nothing_but_still_measures_the_worker_slow_does_not_resolve_its_alert(window, tmp_path):
    """A worker paged by one window, then a window whose verdict is none (S under the threshold, the
    worker within that window's jitter) while it still measures the worker's backward 1.3x its peers':
    not a repair, the alert stays open; a window measuring it at its peers' pace resolves it. Alerts
    of other causes, and windows without a peer test, resolve on the verdict as before."""
    from transforms.live.paging import still_slow

    model = window[0]
    rng = np.random.default_rng(11)
    slow_dp = model.dp_size - 1
    where = [[d, 0, 10 + d, f"host-{d}"] for d in range(model.dp_size)]
    worker = {"rank": 10 + slow_dp, "dp_rank": slow_dp, "stage": 0, "host": f"host-{slow_dp}", "ratio": 1.5,
              "work": "backward", "steps": [1, 2, 3]}
    book = AlertBook(str(tmp_path), threshold=1.1)
    paged = book.apply(_row("j", "s0", _windows(window, rng, 0.02, 1.5, n=1)[0].summary(), where,
                            verdict="individual-worker", verdict_confidence=1.0, blamed=[worker]), now=0.0)
    assert [e["kind"] for e in paged] == ["firing"]
    still = _windows(window, rng, 0.02, 1.3, n=1)[0].summary()
    assert still_slow(paged[0], still) == [paged[0]["workers"][0]]
    quiet = dict(verdict="none", verdict_confidence=1.0, slowdown=1.05, undecided_workers=0)
    assert book.apply(_row("j", "s1", still, where, **quiet), now=1.0) == []
    assert json.loads((tmp_path / "alert_state" / "j.json").read_text())["open"][paged[0]["fingerprint"]]["last_session"] == "s1"
    repaired = _windows(window, rng, 0.02, 1.0, n=1)[0].summary()
    assert still_slow(paged[0], repaired) == []
    resolved = book.apply(_row("j", "s2", repaired, where, **quiet), now=2.0)
    assert [e["kind"] for e in resolved] == ["resolved"]
    # other causes and windows without a peer test: the verdict decides, as before
    assert still_slow(dict(paged[0], cause="python-gc"), still) == [] and still_slow(paged[0], None) == []
    # the worker slow in the other kind of work than the alert named is not this alert's worker
    forward_only = dict(paged[0], workers=[dict(worker, work="forward")])
    assert still_slow(forward_only, still) == []


def test_a_pooled_page_needs_the_newest_window_s_own_test():
    assert pooled_page("j", []) is None
    assert pooled_page("j", [None]) is None
