"""A live result row (schemas/live.py LIVE_RESULT_SCHEMA fields) for tests of the live tables and pages."""
from __future__ import annotations


def live_row(job, session, revision, slowdown, verdict=None, status="analysed", first=1_700_000_000.0, blamed=None,
             confidence=None, saving=None):
    """One analysed 2 x 2 session with three steps at S = slowdown; times are epoch seconds.
    blamed: the verdict's workers (dicts of schemas.live.BLAMED_WORKER fields)."""
    return {"job_id": job, "session": session, "revision": revision, "reason": "complete", "status": status,
            "error": None, "complete": True, "workers_expected": 4, "workers_present": 4, "missing_workers": [],
            "dp_ranks_analysed": 2, "duplicate_deliveries": 0, "dp_size": 2, "pp_size": 2, "n_steps": 3,
            "slowdown": slowdown, "waste": 1 - 1 / slowdown, "launch_slowdown": 1.0, "straggling": slowdown >= 1.1,
            "m_w": None, "m_s": None, "verdict": verdict, "verdict_confidence": confidence, "steps": [1, 2, 3],
            "blamed": blamed, "verdict_saving": saving,
            "step_slowdown": [slowdown] * 3, "worker_slowdown": [1.0, 1.0, 1.0, slowdown],
            "first_arrival": first, "assembled": first + 1, "analysed": first + 2}


def land_row(out: str, row: dict) -> str:
    """Write one live result row where `strag watch` would; returns the file's URL."""
    from schemas.live import LIVE_RESULT_SCHEMA
    from transforms.io.lake import write_parquet
    from transforms.live.results import result_path, rows_table

    path = result_path(out, row)
    write_parquet(path, rows_table([row], LIVE_RESULT_SCHEMA))
    return path


def slow_rank(rank=3, dp_rank=1, stage=1, ratio=1.6, steps=(1, 2, 3), host="node-b"):
    """A worker the verdict blames, measured against its DP peers (a live row's `blamed` entry)."""
    return {"rank": rank, "dp_rank": dp_rank, "stage": stage, "host": host, "ratio": ratio, "work": "forward",
            "steps": list(steps)}


def fire_alert(out: str, row: dict, now: float | None = None) -> list[dict]:
    """Decide `row` as the watcher does (transforms/live/paging.py) and write the alert events it raises."""
    from transforms.live.results import AlertConfig, record_alert

    events = AlertConfig(out=out).book().apply(row, row["first_arrival"] + 3 if now is None else now)
    for alert in events:
        list(record_alert(out, alert))
    return events
