"""What pages on-call, and the alerts' state: which sessions page, one alert per (job, cause, workers).

A session pages when its verdict names something to fix (`page_of`): a cause other than none,
unexplained and insufficient-evidence (the verdict already decided at the worker test's stated
false-alarm rate, transforms/whatif/causes, so jitter does not page), and
- workers named from measurements that need no replay: a worker slower than its DP peers or than
  the other stages at the same recorded work (individual-worker), pauses (python-gc), a worker's
  untraced time beyond its peers' (untraced-cpu). These page whatever S, and in a window whose
  replay is off by more than 5% (discarded) too: a worker measured 1.5x its peers is slow even
  where the job hides it or the replay cannot say what it costs;
- or any other cause (stage, sequence, communication: read from the replay) in a window kept, with
  S at or above the watcher's threshold and the verdict's confidence at least 1 - the stated
  false-alarm rate (a signature that holds only partly, confidence 0.5, is no page; the measured
  causes above were decided by their own tests at that rate).

The stated rate is per window: every window of a job is a new test, so a clean job profiled W times
is paged by jitter with a chance of up to about W x 1% (a page per ~100 windows of clean jobs; one
alert per fingerprint, resolved by the next healthy window). Bounding it per job instead (Bonferroni
over a horizon of windows) would hold back the pages of real 1.3-1.5x workers whose one window
decides at p just under 1% (measured on real HF Trainer jobs, benchmarks/bench_live_windows.py).

A session whose own verdict pages nothing may still page for a worker its job's recent windows
decide together (`pooled_page`): the worker test over the last POOLED_WINDOWS windows' samples
(workers.pooled_worker_tests, at the same stated false-alarm rate), for a worker slow in most of
them and in this one. A window of three steps often leaves a 1.3-1.5x slow worker within a noisy
job's jitter; four windows of it decide. The page says so and claims no fix saving.

An alert is identified by its fingerprint: a digest of (job, cause, blamed global ranks). The
sessions of a job that keep naming the same workers continue one alert (a job profiled every
few minutes pages once, not per window); a different cause or worker set resolves the old
alert and fires a new one. An alert resolves when a later session of the job is healthy (kept
and nothing to page, or discarded with every worker cleared by the worker test) and, for a worker,
measures it below the straggling ratio against its peers (`still_slow`: a window too short to
decide a 1.4x worker pages nothing, yet repairs nothing either), or when the job has landed
nothing for `resolve_after` seconds (`AlertBook.expire`: by default three of the job's
profiling intervals, and never before its sessions are archived).

State (`AlertBook`): one small JSON file per job under `{out}/alert_state/` (open alerts, the
sessions' revisions, arrival times, the recent windows' worker summaries), written atomically
after every change and read before every decision. So a watcher that restarts, and re-analyses
the sessions still in the landing area, pages nothing twice (the sessions' revisions are
recorded), keeps its open alerts firing (Alertmanager resends) and still resolves them.
Decisions for one job are serialised by the keyed step that calls `apply` (and a lock here).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import threading

import fsspec

from transforms.io.lake import filesystem, write_file_atomic
from transforms.live.tables import name_part
from transforms.whatif.causes.explain import counted
from transforms.whatif.causes.verdict import CauseRules
from transforms.whatif.causes.workers import pooled_worker_tests

__all__ = ["NOT_PAGED", "MEASURED", "ALERT_STATE", "POOLED_WINDOWS", "Page", "page_of", "pooled_page", "fingerprint", "AlertBook",
           "workers_text", "still_slow"]

NOT_PAGED = ("none", "unexplained", "insufficient-evidence")   # nothing to fix, nobody to blame, or undecided
MEASURED = ("individual-worker", "python-gc", "untraced-cpu")     # named from measurements, not from the replay
ALERT_STATE = "alert_state"
INTERVALS = 3            # a job silent for this many of its profiling intervals has stopped (or been fixed)
REMEMBERED_ARRIVALS = 8  # recent sessions' arrival times kept per job (its profiling cadence)
REMEMBERED_SESSIONS = 1000   # sessions whose revisions a job's state keeps: far more than can still be in landing/
# a job's recent windows whose worker tests pool (pooled_page): a worker slow for this long is
# decided by their steps together, one repaired leaves the pool within as many windows
POOLED_WINDOWS = 8
DECIDED = 1.0 - CauseRules.false_alarm - 1e-9   # the least verdict confidence that pages: decided at the stated rate


@dataclasses.dataclass(frozen=True)
class Page:
    """What one session pages for: its cause, the workers it blames (dicts: rank, dp_rank, stage,
    host, ratio, steps) and the alert's fingerprint; `pooled`: the sentence saying the job's recent
    windows decided together (`pooled_page`), None when the session's own verdict pages."""

    cause: str
    workers: tuple[dict, ...]
    fingerprint: str
    pooled: str | None = None
    confidence: float | None = None   # a pooled page's: 1 - its Bonferroni-adjusted p-value

    @property
    def ranks(self) -> list[int]:
        return _ranks(self.workers)


def _ranks(workers) -> list[int]:
    return sorted({int(w["rank"]) for w in workers if w.get("rank") is not None})


def fingerprint(job_id: str, cause: str, ranks: list[int]) -> str:
    """Stable id of an alert: the same job, cause and blamed ranks give the same 16 hex digits."""
    key = json.dumps([job_id, cause, sorted(ranks)])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def page_of(row: dict, threshold: float) -> Page | None:
    """The page a live result row calls for, or None (see the module docstring)."""
    cause = row.get("verdict")
    if row.get("status") not in ("analysed", "discarded") or cause is None or cause in NOT_PAGED:
        return None
    workers = tuple(row.get("blamed") or ())
    measured = cause in MEASURED and bool(workers)
    if not measured and (row["status"] != "analysed" or row.get("slowdown") is None or float(row["slowdown"]) < threshold
                         or not _decided(row)):
        return None
    return Page(cause, workers, fingerprint(row["job_id"], cause, _ranks(workers)))


def pooled_page(job_id: str, summaries: list[dict | None]) -> Page | None:
    """A page from the job's recent windows together (oldest first, the session's own last), where
    its own verdict pages nothing: workers the worker test over those windows
    (workers.pooled_worker_tests, at the stated false-alarm rate) finds slow in most of them and in
    this one. A window of a few steps can leave a slow worker within the job's jitter; the same
    worker slow window after window is decided by their steps together. individual-worker, the
    workers named by rank and host, each with its slowest kind of work."""
    if not summaries or summaries[-1] is None:
        return None
    findings = pooled_worker_tests(summaries, CauseRules.false_alarm, CauseRules.straggling)
    if not findings:
        return None
    where = {(int(d), int(p)): (rank, host) for d, p, rank, host in summaries[-1].get("where") or ()}
    workers: dict[tuple[int, int], dict] = {}
    for f in findings:   # strongest first: a worker's first finding is its slowest kind of work
        worker = (f["dp_rank"], f["stage"])
        if worker not in workers:
            rank, host = where.get(worker, (None, None))
            workers[worker] = {"rank": rank, "dp_rank": worker[0], "stage": worker[1], "host": host,
                               "ratio": f["ratio"], "work": f["kind"], "steps": None}
    first, p_value = findings[0], max(f["p_value"] for f in findings)
    samples = counted(first["samples"], summaries[-1].get("unit") or "step")
    note = (f"decided over the job's last {first['windows']} profiling windows together ({samples}, p {p_value:.2g} "
            f"at a {CauseRules.false_alarm:.0%} false-alarm rate); this window alone could not tell it from the job's jitter")
    chosen = tuple(workers.values())
    return Page("individual-worker", chosen, fingerprint(job_id, "individual-worker", _ranks(chosen)), note, 1.0 - p_value)


def _decided(row: dict) -> bool:
    confidence = row.get("verdict_confidence")
    return confidence is None or float(confidence) >= DECIDED


def healthy(row: dict, threshold: float) -> bool:
    """A result that resolves the job's open alerts: kept with nothing to page (and neither undecided
    nor a cause named short of the stated confidence above the threshold), or discarded with the
    worker test clearing every worker (verdict none and no worker left undecided: a discarded
    window's S says nothing, its measurements do)."""
    if page_of(row, threshold) is not None:
        return False
    if row.get("status") == "analysed":
        unsure = row.get("verdict") == "insufficient-evidence" or (row.get("verdict") not in MEASURED and not _decided(row))
        return not unsure or float(row.get("slowdown") or 0.0) < threshold
    return row.get("status") == "discarded" and row.get("verdict") == "none" and row.get("undecided_workers") == 0


def still_slow(alert: dict, summary: dict | None, floor: float = CauseRules.straggling) -> list[dict]:
    """The workers an open individual-worker alert names that a window's worker test (its summary,
    `WorkerTests.summary`) still measures at least `floor` times their DP peers in the kind of work
    the alert named (any kind where it named none): a window that pages nothing, because one window
    cannot tell the worker from the job's jitter, is no repair; the pooled test asks the same of the
    newest window. [] for other causes or where the window made no peer test (its verdict decides)."""
    if alert.get("cause") != "individual-worker" or not summary:
        return []
    stages, kinds, limit = list(summary["stages"]), list(summary["kinds"]), math.log(floor)
    out = []
    for worker in alert.get("workers") or ():
        stage, dp = int(worker["stage"]), int(worker["dp_rank"])
        if stage not in stages or dp >= int(summary["dp"]):
            continue
        p = stages.index(stage)
        for k, kind in enumerate(kinds):
            if worker.get("work") in (None, kind) and summary["counts"][k][p][dp] > 0 \
                    and summary["levels"][k][p][dp] >= limit:
                out.append(worker)
                break
    return out


def workers_text(workers) -> str:
    """'rank 1 (dp 1 / stage 0, host a): forward 1.69x its DP peers', steps 3, 4' per blamed worker."""
    parts = []
    for w in workers:
        where = f"dp {w.get('dp_rank')} / stage {w.get('stage')}" + (f", host {w['host']}" if w.get("host") else "")
        text = f"rank {w.get('rank')} ({where})"
        if w.get("ratio") is not None:
            text += f": {w.get('work') or 'work'} {float(w['ratio']):.2f}x its DP peers'"
        if w.get("steps"):
            text += f", step{'s' if len(w['steps']) > 1 else ''} {', '.join(str(s) for s in w['steps'])}"
        parts.append(text)
    return "; ".join(parts)


class AlertBook:
    """The alerts of the jobs watched into one output folder (see the module docstring)."""

    _LOCKS: dict[str, threading.Lock] = {}

    def __init__(self, out: str, threshold: float, resolve_after: float | None = None, archived_after: float = 0.0):
        self.out, self.threshold = out.rstrip("/"), threshold
        self.resolve_after, self.archived_after = resolve_after, archived_after
        self._lock = self._LOCKS.setdefault(self.out, threading.Lock())

    # ------------------------------------------------------------------ state files

    def _path(self, job_id: str) -> str:
        return f"{self.out}/{ALERT_STATE}/{name_part(job_id)}.json"

    def _load(self, job_id: str) -> dict:
        fs, path = filesystem(self._path(job_id))
        if not fs.exists(path):
            return {"job_id": job_id, "revisions": {}, "open": {}, "arrivals": []}
        with fs.open(path, "rb") as handle:
            return json.loads(handle.read())

    def _save(self, state: dict) -> None:
        # insertion order kept (not sorted): "revisions" lists the sessions in the order last seen
        write_file_atomic(*filesystem(self._path(state["job_id"])), json.dumps(state).encode())

    def states(self) -> list[dict]:
        """Every job's state (for resends and expiry)."""
        fs, root = fsspec.core.url_to_fs(f"{self.out}/{ALERT_STATE}")
        fs.invalidate_cache()
        if not fs.exists(root):
            return []
        out = []
        for path in sorted(fs.find(root)):
            if path.endswith(".json") and not path.rsplit("/", 1)[-1].startswith("."):
                with fs.open(path, "rb") as handle:
                    out.append(json.loads(handle.read()))
        return out

    def open_alerts(self) -> list[dict]:
        """The alert rows (kind 'firing') of every alert open now."""
        return [alert for state in self.states() for alert in state["open"].values()]

    # ------------------------------------------------------------------ decisions

    def apply(self, row: dict, now: float) -> list[dict]:
        """Alert rows (ALERT_SCHEMA dicts, times epoch seconds) one live result row raises; the job's
        state is saved before they are returned."""
        with self._lock:
            state = self._load(row["job_id"])
            session, revision = str(row["session"]), int(row["revision"])
            if revision <= state["revisions"].get(session, 0):
                return []   # a repeat (retry, watcher restart) or an already superseded revision
            state["revisions"].pop(session, None)   # insertion order = the order sessions were last seen
            state["revisions"][session] = revision
            for old in list(state["revisions"])[:-REMEMBERED_SESSIONS]:   # a job of weeks keeps a bounded state
                del state["revisions"][old]
            arrival = float(row.get("first_arrival") or now)
            if arrival not in state["arrivals"]:
                state["arrivals"] = sorted([*state["arrivals"], arrival])[-REMEMBERED_ARRIVALS:]
            events = []
            page = page_of(row, self.threshold)
            if page is None and row.get("status") in ("analysed", "discarded"):
                page = pooled_page(row["job_id"], self._windows(state, session, row.get("worker_summary")))
            if page is not None:
                stale = [fp for fp in state["open"] if fp != page.fingerprint]
                events += [self._resolved(state, fp, now, f"session {session} names {page.cause} "
                                          f"{workers_text(page.workers) or ''}".rstrip(), row) for fp in stale]
                if page.fingerprint in state["open"]:
                    state["open"][page.fingerprint].update(last_session=session, last_revision=revision)
                else:
                    alert = _alert_row(row, page, now, self.threshold)
                    state["open"][page.fingerprint] = alert
                    events.append(alert)
            elif healthy(row, self.threshold):
                why = (f"session {session} is healthy (S {_s(row.get('slowdown'))}, verdict {row.get('verdict')}"
                       f"{', replay discarded' if row.get('status') == 'discarded' else ''})")
                windows = state.get("windows") or []
                newest = windows[-1]["summary"] if windows and windows[-1]["session"] == session else None
                for fp in list(state["open"]):
                    if still_slow(state["open"][fp], newest):   # healthy by its verdict, not repaired
                        state["open"][fp].update(last_session=session, last_revision=revision)
                    else:
                        events.append(self._resolved(state, fp, now, why, row))
            self._save(state)
            return events

    @staticmethod
    def _windows(state: dict, session: str, summary: str | None) -> list[dict | None]:
        """The job's recent windows' worker summaries, oldest first, this session's (its latest
        revision) last; the state keeps the last POOLED_WINDOWS."""
        windows = [w for w in state.setdefault("windows", []) if w["session"] != session]
        windows.append({"session": session, "summary": None if summary is None else json.loads(summary)})
        state["windows"] = windows[-POOLED_WINDOWS:]
        return [w["summary"] for w in state["windows"]]

    def expire(self, now: float) -> list[dict]:
        """Resolve the open alerts of jobs that landed nothing for their `silence` (see `silence`)."""
        events = []
        with self._lock:
            for state in self.states():
                if not state["open"] or not state["arrivals"]:
                    continue
                waited = now - max(state["arrivals"])
                limit = self.silence(state["arrivals"])
                if waited < limit:
                    continue
                why = f"no session of the job landed for {waited:.0f} s (limit {limit:.0f} s)"
                events += [self._resolved(state, fp, now, why, None) for fp in list(state["open"])]
                self._save(state)
        return events

    def silence(self, arrivals: list[float]) -> float:
        """Seconds without a new session after which a job's alerts resolve: `resolve_after` when
        set; else INTERVALS times its median profiling interval, and never before its sessions are
        archived (`archived_after`)."""
        if self.resolve_after is not None:
            return self.resolve_after
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > a]
        return max(self.archived_after, INTERVALS * statistics.median(gaps) if gaps else 0.0)

    def _resolved(self, state: dict, fp: str, now: float, why: str, row: dict | None) -> dict:
        alert = dict(state["open"].pop(fp))
        alert.update(kind="resolved", alert_time=now, ends_at=now, resolved_reason=why,
                     message=f"resolved: {alert['message']}: {why}")
        if row is not None:
            alert.update(resolved_by_session=str(row["session"]), resolved_by_revision=int(row["revision"]))
        return alert


def _s(value) -> str:
    return "n/a" if value is None else f"{float(value):.3f}"


def _alert_row(row: dict, page: Page, now: float, threshold: float) -> dict:
    """A firing alert's row (ALERT_SCHEMA fields). A pooled page (decided over the job's windows)
    states that, its own confidence, and no fix saving: the window's verdict claimed none."""
    discarded = row.get("status") == "discarded"
    who = workers_text(page.workers)
    saving = None if page.pooled else row.get("verdict_saving")
    confidence = page.confidence if page.pooled else row.get("verdict_confidence")
    message = (f"job {row['job_id']}: {page.cause}" + (f": {who}" if who else "")
               + f"; S {_s(row.get('slowdown'))}" + (" (replay off by more than 5%: S not trustworthy)" if discarded else "")
               + (f", confidence {float(confidence):.2f}" if confidence is not None else "")
               + (f", the fix saves {100 * float(saving):.0f}% of the step" if saving is not None and not discarded else "")
               + (f"; {page.pooled}" if page.pooled else ""))
    return {
        "job_id": row["job_id"], "session": str(row["session"]), "revision": int(row["revision"]), "kind": "firing",
        "fingerprint": page.fingerprint, "cause": page.cause, "workers": [dict(w) for w in page.workers],
        "ranks": page.ranks, "slowdown": row.get("slowdown"), "discarded": discarded,
        "confidence": confidence, "saving": None if discarded else saving,
        "threshold": threshold, "verdict": page.cause if page.pooled else row.get("verdict"),
        "explanation": f"{page.cause} ({who}): {page.pooled}." if page.pooled else row.get("verdict_explanation"),
        "message": message, "alert_time": now, "starts_at": now, "ends_at": None, "resolved_reason": None,
        "last_session": str(row["session"]), "last_revision": int(row["revision"]),
        "resolved_by_session": None, "resolved_by_revision": None,
    }
