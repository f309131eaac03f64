"""strag's trainer-side collector: profiler output -> the lake's raw landing, from inside a training process.

    from strag_collect import kineto_handler
    with torch.profiler.profile(schedule=torch.profiler.schedule(wait=5, warmup=1, active=3),
                                on_trace_ready=kineto_handler("s3://lake", job_id="llama-7b-0412", live=True)) as prof:
        ...   # prof.step() every training step

Light enough to import in a trainer: the standard library and fsspec only (no Apache Beam,
pyarrow, numpy, yaml; torch is never imported, only the objects passed in are used). The rest
of strag reads what it writes (schemas/raw.py); `kineto.py` says where, how and what happens
when storage fails.
"""
from strag_collect.kineto import (DEFAULT_EVERY, CollectorWarning, KinetoHandler, cadence, check_lake, kineto_handler,
                                  land_file, live_dir, live_session, live_trace_name, run_id, window_dir)

__all__ = ["kineto_handler", "KinetoHandler", "CollectorWarning", "cadence", "check_lake", "run_id", "DEFAULT_EVERY",
           "land_file", "window_dir", "live_dir", "live_session", "live_trace_name"]
