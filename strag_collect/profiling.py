"""A torch.profiler that profiles a window every N training steps and lands each in the lake: the
part the framework hooks (strag_collect.lightning, strag_collect.huggingface) share.

torch is imported when profiling starts, never at import: the hooks are imported by trainers that
have it, the rest of strag_collect stays standard library + fsspec.
"""
from __future__ import annotations

from typing import Any

from strag_collect.kineto import DEFAULT_EVERY, KinetoHandler, cadence, kineto_handler

__all__ = ["TrainingProfiler"]


class TrainingProfiler:
    """start() at the beginning of training, step() after each optimizer step, stop() at the end.

    lake / job_id / handler options: `kineto_handler`'s (live=True by default: each window is a
    session `strag watch` analyses at once; the lake is checked here, before training starts);
    every / active / warmup: the profiling cadence (`cadence`); record_shapes: the batch's shapes
    (sequence lengths for the sequence-imbalance verdict), on by default."""

    def __init__(self, lake: str, job_id: str, *, every: int = DEFAULT_EVERY, active: int = 3, warmup: int = 1,
                 record_shapes: bool = True, live: bool = True, **handler_options: Any):
        self.schedule = cadence(every, active, warmup)
        self.record_shapes = record_shapes
        self.handler: KinetoHandler = kineto_handler(lake, job_id=job_id, live=live, **handler_options)
        self.prof = None

    def start(self) -> None:
        import torch

        if self.prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, schedule=torch.profiler.schedule(**self.schedule),
                                           on_trace_ready=self.handler, record_shapes=self.record_shapes)
        self.prof.start()

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def stop(self, timeout: float | None = 120.0) -> bool:
        """Stop profiling (a window still open is closed and landed) and wait up to `timeout` seconds
        for the uploads; True when every upload finished."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
        return self.handler.close(timeout)
