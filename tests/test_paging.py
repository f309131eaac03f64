"""What pages and when it resolves (transforms/live/paging.py): decisions of the alert book on live rows,
its state in the output folder across watcher restarts, and resolution by a job's silence."""
from __future__ import annotations

import json

import pytest

from live_rows import live_row, slow_rank
from transforms.live.paging import AlertBook, fingerprint, page_of

T0 = 1_700_000_000.0


def row(session, slowdown=1.4, verdict="individual-worker", blamed=None, status="analysed", revision=1, first=None,
        job="j"):
    blamed = [slow_rank()] if blamed is None and verdict == "individual-worker" else blamed
    return live_row(job, session, revision, slowdown, verdict, status=status, blamed=blamed, confidence=0.99, saving=0.25,
                    first=T0 + 600 * int(session.lstrip("s")) if first is None else first)


def kinds(book, rows, now=T0):
    return [[(a["kind"], a["ranks"]) for a in book.apply(r, now)] for r in rows]


def test_what_pages():
    assert page_of(row("s1"), 1.1).ranks == [3]
    assert page_of(row("s1"), 1.1).fingerprint == fingerprint("j", "individual-worker", [3])
    # nothing to fix, nobody to blame, or the trace cannot decide: never a page, whatever S
    for verdict in ("none", "unexplained", "insufficient-evidence"):
        assert page_of(row("s1", 1.9, verdict, blamed=[]), 1.1) is None
    # a job-wide cause below the watcher's threshold does not page, a worker measured slow does; a
    # failed session never pages
    assert page_of(row("s1", 1.15, "stage-imbalance", blamed=[]), 1.2) is None
    assert page_of(row("s1", 1.05), 1.2).ranks == [3] and page_of(row("s1", status="failed"), 1.1) is None
    # a discarded window (S not trustworthy) pages only workers named from measurements, whatever S
    assert page_of(row("s1", 1.01, status="discarded"), 1.1).ranks == [3]
    paused = dict(slow_rank(), ratio=None, steps=None)
    assert page_of(row("s1", 2.0, "python-gc", blamed=[paused], status="discarded"), 1.1).ranks == [3]
    assert page_of(row("s1", 2.0, "stage-imbalance", blamed=[], status="discarded"), 1.1) is None   # a replay's finding
    assert page_of(row("s1", 2.0, "individual-worker", blamed=[], status="discarded"), 1.1) is None
    assert page_of(row("s1", 1.3, "untraced-cpu", blamed=[paused]), 1.1).ranks == [3]
    assert page_of(row("s1", 1.3, "stage-imbalance", blamed=[]), 1.1).ranks == []
    # a cause read from the replay and named short of the stated confidence (its signature half held,
    # as on a busy CPU host's collectives) is no page, and no healthy session either while S is over
    # the threshold; a worker the worker test decided pages whatever the listing's confidence
    from transforms.live.paging import healthy

    unsure = dict(row("s1", 1.3, "communication", blamed=[slow_rank()]), verdict_confidence=0.52)
    assert page_of(unsure, 1.1) is None and not healthy(unsure, 1.1) and healthy(dict(unsure, slowdown=1.05), 1.1)
    assert page_of(dict(unsure, verdict_confidence=0.99), 1.1).ranks == [3]   # 1 - the 1% false-alarm rate
    assert page_of(dict(row("s1"), verdict_confidence=0.84), 1.1).ranks == [3]


def test_one_alert_per_job_cause_and_ranks_until_a_healthy_session(tmp_path):
    book = AlertBook(str(tmp_path), 1.1)
    two = [slow_rank(), slow_rank(rank=1, dp_rank=0, stage=1)]
    assert kinds(book, [row("s1"), row("s1"), row("s2"), row("s3", 1.5, "insufficient-evidence", blamed=[]),
                        row("s4", blamed=two), row("s5", 1.04, "none")]) == [
        [("firing", [3])],
        [],                                           # the same session again (a retried bundle)
        [],                                           # a later session naming the same rank continues the alert
        [],                                           # undecided: neither pages nor resolves
        [("resolved", [3]), ("firing", [1, 3])],      # another worker set: a new alert
        [("resolved", [1, 3])],                       # healthy
    ]
    assert book.open_alerts() == []
    # a later revision of a session counts; an earlier one is superseded
    assert kinds(book, [row("s6", revision=2), row("s6", revision=1, verdict="none")]) == [[("firing", [3])], []]


def test_a_discarded_session_resolves_only_when_its_worker_test_cleared_every_worker(tmp_path):
    book = AlertBook(str(tmp_path), 1.1)
    book.apply(row("s1"), T0)
    undecided = dict(row("s2", 1.3, "none", blamed=[], status="discarded"), undecided_workers=1)
    assert book.apply(undecided, T0) == [] and len(book.open_alerts()) == 1
    cleared = dict(row("s3", 1.3, "none", blamed=[], status="discarded"), undecided_workers=0)
    assert [a["kind"] for a in book.apply(cleared, T0)] == ["resolved"]


def test_a_restarted_watcher_pages_nothing_twice_and_keeps_its_open_alerts(tmp_path):
    first = AlertBook(str(tmp_path), 1.1)
    [fired] = first.apply(row("s1"), T0)
    again = AlertBook(str(tmp_path), 1.1)        # a new process: only the output folder is shared
    assert again.apply(row("s1"), T0 + 5) == [] and again.apply(row("s2"), T0 + 5) == []
    [open_now] = again.open_alerts()
    assert open_now["fingerprint"] == fired["fingerprint"] and open_now["last_session"] == "s2"
    state = json.loads((tmp_path / "alert_state" / "j.json").read_text())
    assert set(state["revisions"]) == {"s1", "s2"}
    [resolved] = again.apply(row("s3", 1.02, "none"), T0 + 9)
    assert resolved["resolved_reason"].startswith("session s3 is healthy") and resolved["resolved_by_session"] == "s3"
    assert resolved["starts_at"] == fired["starts_at"] and resolved["ends_at"] == T0 + 9


def test_a_silent_job_resolves_after_three_profiling_intervals_and_not_before_archiving(tmp_path):
    book = AlertBook(str(tmp_path), 1.1, archived_after=630.0)
    for index in (1, 2, 3):                      # a session every 600 s
        book.apply(row(f"s{index}"), T0 + 600 * index)
    last = T0 + 1800
    assert book.silence([T0 + 600, T0 + 1200, last]) == 1800.0
    assert book.expire(last + 1799) == []
    [resolved] = book.expire(last + 1801)
    assert resolved["kind"] == "resolved" and "no session of the job landed for 1801 s" in resolved["resolved_reason"]
    assert book.open_alerts() == [] and book.expire(last + 5000) == []
    # one session only: no cadence yet, so the alert lasts until the session is archived
    lone = AlertBook(str(tmp_path / "lone"), 1.1, archived_after=630.0)
    lone.apply(row("s1", first=T0), T0)
    assert lone.expire(T0 + 600) == [] and len(lone.expire(T0 + 631)) == 1
    # --resolve-after overrides the cadence
    fixed = AlertBook(str(tmp_path / "fixed"), 1.1, resolve_after=60.0, archived_after=630.0)
    fixed.apply(row("s1", first=T0), T0)
    assert fixed.expire(T0 + 59) == [] and len(fixed.expire(T0 + 61)) == 1


@pytest.mark.parametrize("verdict", ["none", "insufficient-evidence", "unexplained"])
def test_undecided_and_clean_sessions_write_no_alert_row(tmp_path, verdict):
    from live_rows import fire_alert
    from transforms.live.tables import read_live_table

    assert fire_alert(str(tmp_path), row("s1", 1.6, verdict, blamed=[])) == []
    assert read_live_table(str(tmp_path), "alerts").num_rows == 0


def test_a_long_running_jobs_state_stays_bounded(tmp_path, monkeypatch):
    """A job profiled every few minutes for weeks: its state keeps the revisions of its most recent
    sessions only (those a restarted watcher can still see in landing/), never all of them."""
    import transforms.live.paging as paging

    monkeypatch.setattr(paging, "REMEMBERED_SESSIONS", 5)
    book = AlertBook(str(tmp_path), 1.1)
    for index in range(1, 13):
        book.apply(row(f"s{index}", 1.02, "none", blamed=[]), T0)
    state = json.loads((tmp_path / "alert_state" / "j.json").read_text())
    assert list(state["revisions"]) == [f"s{i}" for i in range(8, 13)]
    assert book.apply(row("s12", 1.02, "none", blamed=[]), T0) == []     # still a repeat


def test_a_page_names_a_pipeline_stage_s_rank_found_by_its_balance():
    """A pipeline without DP peers: the stage the balance test blames is paged with its global rank,
    its slow kind of work and the ratio found (not as an unmeasured implicated worker)."""
    import types

    import pyarrow as pa

    from transforms.live.analyze_sessions import blamed_workers

    trace = pa.table({"dp_rank": [0, 0, 0, 0], "stage": [0, 0, 1, 1], "rank": [0, 0, 1, 1]})
    verdict = types.SimpleNamespace(implicated_workers=[(0, 1)], evidence={"balance_workers": [
        {"dp_rank": 0, "stage": 1, "kind": "backward", "ratio": 2.7, "steps": 3, "step_indices": [0, 1, 2], "confidence": 0.99}]})
    result = types.SimpleNamespace(steps=[4, 5, 6])
    assert blamed_workers(verdict, result, trace, [0]) == [
        {"rank": 1, "dp_rank": 0, "stage": 1, "host": None, "ratio": 2.7, "work": "backward", "steps": [4, 5, 6]}]
