"""PyTorch Lightning: one callback profiles the run on a cadence and lands each window in the lake.

    from strag_collect.lightning import StragProfiler
    trainer = L.Trainer(..., callbacks=[StragProfiler("s3://lake", job_id="llama-7b-0412")])

A window of 3 optimizer steps every 200 (`every`, `active`), each a live session of the job that
`strag watch` analyses as soon as every rank's trace is in. The profiler steps once per optimizer
step (with accumulate_grad_batches k, after every k-th batch), the unit strag calls a training
iteration. Use it instead of Lightning's own `profiler=` (whose steps end mid-iteration).
"""
from __future__ import annotations

from typing import Any

from strag_collect.kineto import DEFAULT_EVERY
from strag_collect.profiling import TrainingProfiler

try:
    from lightning.pytorch import Callback
except ImportError:   # the older package name
    from pytorch_lightning import Callback

__all__ = ["StragProfiler"]


class StragProfiler(Callback):
    """Lightning callback; arguments as `strag_collect.profiling.TrainingProfiler`."""

    def __init__(self, lake: str, job_id: str, *, every: int = DEFAULT_EVERY, active: int = 3, **options: Any):
        super().__init__()
        self.profiler = TrainingProfiler(lake, job_id, every=every, active=active, **options)

    def on_train_start(self, trainer, pl_module) -> None:
        self.profiler.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        if (batch_idx + 1) % accumulate == 0 or self._last_batch(trainer, batch_idx):
            self.profiler.step()

    @staticmethod
    def _last_batch(trainer, batch_idx: int) -> bool:
        total = trainer.num_training_batches
        return isinstance(total, int) and batch_idx + 1 == total

    def on_train_end(self, trainer, pl_module) -> None:
        self.profiler.stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.profiler.stop(timeout=30.0)
