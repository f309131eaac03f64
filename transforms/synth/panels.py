"""Evaluation panels: jobs with chosen root causes, alone or mixed, each with its answer key.

The natural fleet (:func:`transforms.synth.fleet.sample_fleet`) draws causes at the
paper's prevalences, so rare causes and mixtures have little support. A panel draws
``per_case`` jobs for each case with random shapes and cause strengths (the ranges
:func:`transforms.synth.faults.sample_causes` uses):

- :func:`single_cause_panel`: one case per cause kind of ``PANEL_KINDS``;
- :func:`mixture_panel`: one case per pair of ``MIXTURES`` (a slow worker beside stage
  imbalance, GC beside a slow worker, sequence beside stage imbalance, a flapping link
  beside a slow worker on another machine).

Every generated job's truth (``TRUTH_SCHEMA``) lists every injected cause (``causes``)
and the slowdown each causes alone (``cause_slowdowns``): the answer key.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec

__all__ = ["PANEL_KINDS", "MIXTURES", "single_cause_panel", "mixture_panel"]

PANEL_KINDS = ("slow_worker", "last_stage_imbalance", "seq_len_imbalance", "gc_pauses", "comm_flapping")
MIXTURES = (
    ("slow_worker", "last_stage_imbalance"),
    ("gc_pauses", "slow_worker"),
    ("seq_len_imbalance", "last_stage_imbalance"),
    ("comm_flapping", "slow_worker"),
)


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(np.exp(rng.uniform(np.log(low), np.log(high))))


def _cause(kind: str, rng: np.random.Generator, dp: int, pp: int, context: int, taken: set) -> Cause:
    """One cause of `kind` with random strength; workers avoid the (dp_rank, stage) cells in `taken`."""
    if kind in ("slow_worker", "comm_flapping"):
        free = [(d, p) for d in range(dp) for p in range(pp) if (d, p) not in taken]
        d, p = free[int(rng.integers(len(free)))]
        taken.add((d, p))
        if kind == "slow_worker":
            return Cause(kind, {"dp_rank": d, "stage": p, "factor": round(_log_uniform(rng, 1.3, 3.5), 4)})
        return Cause(kind, {"dp_rank": d, "stage": p, "factor": round(float(rng.uniform(5, 30)), 3),
                            "steps_fraction": round(float(rng.uniform(0.2, 0.6)), 3)})
    if kind == "last_stage_imbalance":
        extra = float(rng.uniform(0.25, 1.2))
        return Cause(kind, {"forward_extra": round(extra, 4), "backward_extra": round(extra * float(rng.uniform(0.3, 0.6)), 4)})
    if kind == "seq_len_imbalance":
        return Cause(kind, {"doc_sigma": round(float(rng.uniform(1.1, 1.8)), 4), "doc_median": int(context // rng.choice([4, 8, 16]))})
    if kind == "gc_pauses":
        return Cause(kind, {"period": round(float(rng.uniform(1.5, 6)), 3), "pause": round(float(rng.uniform(0.2, 0.8)), 4)})
    raise ValueError(f"no panel draw for cause kind {kind!r}; expected one of {PANEL_KINDS}")


def _spec(job_id: str, kinds: tuple[str, ...], rng: np.random.Generator, max_records: int) -> JobSpec:
    """A job of random shape carrying `kinds`, bounded to about max_records op records."""
    needs_pp = "last_stage_imbalance" in kinds
    pp = int(rng.choice([2, 4, 8])) if needs_pp else int(rng.choice([1, 2, 4, 8]))
    dp = int(rng.choice([2, 4, 8, 16]))
    microbatches = max(pp, int(rng.choice([8, 16, 32])))
    context = int(rng.choice([32768, 131072])) if "seq_len_imbalance" in kinds else int(rng.choice([4096, 8192]))
    taken: set = set()
    causes = tuple(_cause(kind, rng, dp, pp, context, taken) for kind in kinds)
    spec = JobSpec(job_id=job_id, dp=dp, pp=pp, microbatches=microbatches, tp=8, steps=int(rng.integers(16, 33)),
                   sessions=2, context_length=context, causes=causes, seed=int(rng.integers(2**62)),
                   record_seq_lens=bool(rng.random() < 0.5), dp_overlap=bool(rng.random() < 0.6))
    while spec.estimated_records > max_records and spec.steps > 12:
        spec = dataclasses.replace(spec, steps=max(12, spec.steps // 2))
    return spec


def single_cause_panel(per_case: int, seed: int, max_records: int = 250_000) -> list[JobSpec]:
    """`per_case` jobs for each kind of PANEL_KINDS, one injected cause each (job ids panel-KIND-NN)."""
    rng = np.random.default_rng(seed)
    return [_spec(f"panel-{kind}-{k:02d}", (kind,), rng, max_records) for kind in PANEL_KINDS for k in range(per_case)]


def mixture_panel(per_case: int, seed: int, max_records: int = 250_000) -> list[JobSpec]:
    """`per_case` jobs for each pair of MIXTURES, both causes injected (job ids mix-A+B-NN)."""
    rng = np.random.default_rng([seed, 0x313])
    return [_spec(f"mix-{a}+{b}-{k:02d}", (a, b), rng, max_records) for a, b in MIXTURES for k in range(per_case)]
