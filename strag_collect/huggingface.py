"""Hugging Face Trainer (and Accelerate-backed runs of it): one callback profiles the run on a cadence
and lands each window in the lake.

    from strag_collect.huggingface import StragTrainerCallback
    trainer = Trainer(..., callbacks=[StragTrainerCallback("s3://lake", job_id="llama-7b-0412")])

A window of 3 optimizer steps every 200 (`every`, `active`), each a live session of the job that
`strag watch` analyses as soon as every rank's trace is in. The profiler steps in on_step_end: once
per optimizer step, gradient accumulation included.
"""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from strag_collect.kineto import DEFAULT_EVERY
from strag_collect.profiling import TrainingProfiler

__all__ = ["StragTrainerCallback"]


class StragTrainerCallback(TrainerCallback):
    """transformers TrainerCallback; arguments as `strag_collect.profiling.TrainingProfiler`."""

    def __init__(self, lake: str, job_id: str, *, every: int = DEFAULT_EVERY, active: int = 3, **options: Any):
        self.profiler = TrainingProfiler(lake, job_id, every=every, active=active, **options)

    def on_train_begin(self, args, state, control, **kwargs):
        self.profiler.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.profiler.step()

    def on_train_end(self, args, state, control, **kwargs):
        self.profiler.stop()
