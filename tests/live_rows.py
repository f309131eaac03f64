"""A live result row (schemas/live.py LIVE_RESULT_SCHEMA fields) for tests of the live tables and pages."""
from __future__ import annotations


def live_row(job, session, revision, slowdown, verdict=None, status="analysed", first=1_700_000_000.0):
    """One analysed 2 x 2 session with three steps at S = slowdown; times are epoch seconds."""
    return {"job_id": job, "session": session, "revision": revision, "reason": "complete", "status": status,
            "error": None, "complete": True, "workers_expected": 4, "workers_present": 4, "missing_workers": [],
            "dp_ranks_analysed": 2, "duplicate_deliveries": 0, "dp_size": 2, "pp_size": 2, "n_steps": 3,
            "slowdown": slowdown, "waste": 1 - 1 / slowdown, "launch_slowdown": 1.0, "straggling": slowdown >= 1.1,
            "m_w": None, "m_s": None, "verdict": verdict, "verdict_confidence": None, "steps": [1, 2, 3],
            "step_slowdown": [slowdown] * 3, "worker_slowdown": [1.0, 1.0, 1.0, slowdown],
            "first_arrival": first, "assembled": first + 1, "analysed": first + 2}


def land_row(out: str, row: dict) -> str:
    """Write one live result row where `strag watch` would; returns the file's URL."""
    from schemas.live import LIVE_RESULT_SCHEMA
    from transforms.lake import write_parquet
    from transforms.live import result_path, rows_table

    path = result_path(out, row)
    write_parquet(path, rows_table([row], LIVE_RESULT_SCHEMA))
    return path
