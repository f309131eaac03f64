"""What one what-if analysis returns: the contract between the engine and its users.

Plain data (numpy arrays, floats, dicts); no Beam. Times are seconds.
Field names follow the reference analyzer (ByteDance-Seed/StragglerAnalysis) so that
`to_reference_json()` is a drop-in for its result-*.json, plus M_W and M_S.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["JobMeta", "Decomposition", "WhatIfResult", "DISCREPANCY_LIMIT", "ATTRIBUTION_THRESHOLD", "STRAGGLING_THRESHOLD"]

DISCREPANCY_LIMIT = 1.05      # launch_slowdown above this: discard from fleet statistics
ATTRIBUTION_THRESHOLD = 1.03  # attributions computed only when S >= this
STRAGGLING_THRESHOLD = 1.1    # a job straggles when S >= this


@dataclasses.dataclass(frozen=True)
class JobMeta:
    """Parallelism of a job (the published meta-*.yaml fields)."""

    dp_size: int
    pp_size: int
    tp_size: int = 1
    dsp_size: int = 1
    vpp_size: int = 1
    world_size: int = 0

    def __post_init__(self):
        for name in ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"JobMeta.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.world_size == 0:
            object.__setattr__(self, "world_size", self.dp_size * self.pp_size * self.tp_size * self.dsp_size)

    @property
    def workers(self) -> int:
        """Number of analysed workers (dp x pp); tp and cp peers are collapsed."""
        return self.dp_size * self.pp_size


@dataclasses.dataclass
class Decomposition:
    """M_W or M_S: mean step times with a worker set idealised (rem) or kept (add).

    tori = T (no-delay replay), tideal = T_ideal, trem = ideal only for the set,
    tadd = ideal except the set; rem = (tori - trem)/(tori - tideal); add = (tadd - tideal)/(tori - tideal).
    `workers` lists the (dp_rank, stage) pairs of the set.
    """

    tori: float
    tideal: float
    trem: float
    tadd: float
    rem: float
    add: float
    workers: list[tuple[int, int]]


@dataclasses.dataclass
class WhatIfResult:
    """Everything the engine computes for one job's trace window.

    Per-step arrays are aligned with `steps` (sorted ascending). Attribution fields
    are None when slowdown < ATTRIBUTION_THRESHOLD, like the reference.
    """

    job_id: str
    meta: JobMeta
    steps: np.ndarray                  # int64 [n_steps]
    step_t_base: np.ndarray            # observed step time
    step_t_nodelay: np.ndarray         # replay without launch delays (T per step)
    step_t_noblk: np.ndarray           # replay of the ideal (T_ideal per step)
    launch_slowdown: float             # mean(base)/mean(nodelay): replay discrepancy
    slowdown: float                    # S = mean(nodelay)/mean(noblk)
    step_slowdown: np.ndarray          # S_s
    by_dp_rank: dict[int, float] | None = None
    by_stage: dict[int, float] | None = None
    by_optype: dict[str, float] | None = None          # pp send/recv merged into {forward,backward}-pp-comm
    by_dp_rank_per_step: np.ndarray | None = None      # [n_steps, dp_size]
    by_stage_per_step: np.ndarray | None = None        # [n_steps, pp_size]
    by_optype_per_step: dict[str, np.ndarray] | None = None  # optype -> [n_steps]
    worker_slowdown: np.ndarray | None = None          # S_w [dp_size, pp_size] = min(S_dp, S_stage)
    mw: Decomposition | None = None
    ms: Decomposition | None = None

    @property
    def waste(self) -> float:
        """Fraction of GPU time lost to stragglers: 1 - 1/S."""
        return 1.0 - 1.0 / self.slowdown if self.slowdown > 0 else math.nan

    @property
    def discarded(self) -> bool:
        """True when the replay discrepancy exceeds 5%: keep out of fleet statistics."""
        return bool(self.launch_slowdown > DISCREPANCY_LIMIT)

    @property
    def straggling(self) -> bool:
        return bool(self.slowdown >= STRAGGLING_THRESHOLD)
