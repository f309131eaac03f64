"""Typed errors of the what-if engine: bad input names the job, step, worker and op.

Every error raised for a bad trace is a subclass of `WhatIfError` and carries the
location fields (any may be None when they do not apply) plus a human message
that says what is wrong and what to do. Callers such as the batch pipeline use
`error.reason` (a stable snake_case code) for the quarantine table.
"""
from __future__ import annotations

__all__ = [
    "WhatIfError",
    "TraceStructureError",
    "UnknownOptypeError",
    "MissingOpError",
    "MissingPeerError",
    "CycleError",
    "DisconnectedGraphError",
    "TooFewStepsError",
    "TraceValueError",
]


class WhatIfError(ValueError):
    """A trace the engine cannot analyse.

    Attributes: job_id, step, dp_rank, stage (the worker is (dp_rank, stage)), op (an op
    name `{optype}_{seq_id}_{stage}` or an optype), message. `str(error)` puts them together.
    """

    reason = "whatif_error"

    def __init__(
        self,
        message: str,
        *,
        job_id: str = "",
        step: int | None = None,
        dp_rank: int | None = None,
        stage: int | None = None,
        op: str | None = None,
        file: str | None = None,
    ):
        self.job_id = job_id
        self.step = None if step is None else int(step)
        self.dp_rank = None if dp_rank is None else int(dp_rank)
        self.stage = None if stage is None else int(stage)
        self.op = op
        self.file = file
        self.message = message
        super().__init__(self._render())

    def _render(self) -> str:
        where = [f"job {self.job_id!r}" if self.job_id else "job <unnamed>"]
        if self.file:
            where.append(f"file {self.file}")
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.dp_rank is not None or self.stage is not None:
            dp = "?" if self.dp_rank is None else self.dp_rank
            stage = "?" if self.stage is None else self.stage
            where.append(f"worker (dp_rank {dp}, stage {stage})")
        if self.op:
            where.append(f"op {self.op}")
        return f"{', '.join(where)}: {self.message}"

    def with_context(self, *, job_id: str | None = None, file: str | None = None) -> "WhatIfError":
        """Fill in the job id / file when the raiser did not know them; returns self."""
        if job_id and not self.job_id:
            self.job_id = job_id
        if file and not self.file:
            self.file = file
        self.args = (self._render(),)
        return self


class TraceStructureError(WhatIfError):
    """The op structure differs between steps or DP ranks, or breaks a rule of METHOD.md section 2."""

    reason = "trace_structure"


class UnknownOptypeError(WhatIfError):
    """An op type outside schemas.trace.OPTYPES."""

    reason = "unknown_optype"


class MissingOpError(WhatIfError):
    """An op the dependency model requires (optimizer, clip, gc, ...) is absent."""

    reason = "missing_op"


class MissingPeerError(WhatIfError):
    """A pipeline send/recv whose peer on the neighbouring stage is absent."""

    reason = "missing_peer"


class CycleError(WhatIfError):
    """The dependency graph (with comm groups contracted) has a cycle: replay would deadlock."""

    reason = "dependency_cycle"


class DisconnectedGraphError(WhatIfError):
    """Ops that no dependency links to the step's optimizer (and are not p2p no-ops)."""

    reason = "disconnected_graph"


class TooFewStepsError(WhatIfError):
    """Fewer complete steps than the analysis needs (see transforms.whatif.model.MIN_STEPS)."""

    reason = "too_few_steps"


class TraceValueError(WhatIfError):
    """Missing columns, NaN or negative durations, ranks outside the job's parallelism."""

    reason = "trace_values"
