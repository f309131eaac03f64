"""Root causes injected into a simulated job, with their ground truth.

A :class:`Cause` is a kind plus JSON-able parameters. :func:`apply_cause` changes the
fault-free :class:`~transforms.synth.execution.StepArrays` of a job in place (compute
durations, p2p/collective transfers or untraced launch gaps) and returns what it did
(the truth: parameters actually used, affected workers, steps). :func:`sample_causes`
draws the causes of one fleet job with prevalences close to the paper's fleet.

Kinds and parameters (defaults in brackets; worker coordinates are drawn when absent):

``slow_worker``            persistent hardware slowness of one worker: every compute op
                           of (dp_rank, stage) takes ``factor`` [1.6] times longer; with
                           ``steps`` (sampled step indices) only in those (intermittent).
``last_stage_imbalance``   the loss layer on the last model chunk: its forward computes
                           take ``1 + forward_extra`` [0.6], backward ``1 + backward_extra``
                           [0.25] times longer (pp > 1 only).
``seq_len_imbalance``      naive packing of documents into microbatches: document lengths
                           lognormal(median ``doc_median`` [context/8] tokens, sigma
                           ``doc_sigma`` [1.4]); compute cost of a microbatch (forward and
                           backward, every stage) = 1 - a + a * sumsq / mean(sumsq) with
                           a = ``attention_fraction`` [from the context length].
``gc_pauses``              Python GC: each worker pauses about once every ``period`` [8]
                           steps for ~``pause`` [0.3] s inside one forward compute.
``comm_flapping``          a flapping link at (dp_rank, stage): for a contiguous
                           ``steps_fraction`` [0.3] of the sampled steps its p2p transfers
                           and its stage's DP collectives take ``factor`` [8] times longer.
``untraced_cpu``           untraced CPU work before forward computes (``scope`` "all" or
                           "first_stage" ["first_stage"]) adding about ``fraction`` [0.15] of
                           the fault-free step time: the replay cannot see it (discrepancy).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from transforms.synth.execution import StepArrays
from transforms.synth.program import Program, UnitKind

__all__ = [
    "CAUSE_KINDS",
    "Cause",
    "FaultContext",
    "apply_cause",
    "draw_documents",
    "document_lengths",
    "sequence_cost",
    "attention_fraction",
    "sample_causes",
]

CAUSE_KINDS: tuple[str, ...] = (
    "slow_worker",
    "last_stage_imbalance",
    "seq_len_imbalance",
    "gc_pauses",
    "comm_flapping",
    "untraced_cpu",
)

_PARAMS: dict[str, set[str]] = {
    "slow_worker": {"dp_rank", "stage", "factor", "steps"},
    "last_stage_imbalance": {"forward_extra", "backward_extra"},
    "seq_len_imbalance": {"doc_median", "doc_sigma", "attention_fraction"},
    "gc_pauses": {"period", "pause"},
    "comm_flapping": {"dp_rank", "stage", "factor", "steps_fraction"},
    "untraced_cpu": {"fraction", "scope"},
}


@dataclasses.dataclass(frozen=True)
class Cause:
    """One injected root cause: ``kind`` in CAUSE_KINDS and its parameters (see module doc)."""

    kind: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in CAUSE_KINDS:
            raise ValueError(f"unknown cause kind {self.kind!r}; expected one of {CAUSE_KINDS}")
        unknown = set(self.params) - _PARAMS[self.kind]
        if unknown:
            raise ValueError(f"cause {self.kind!r} got unknown parameters {sorted(unknown)}; "
                             f"allowed: {sorted(_PARAMS[self.kind])}")
        object.__setattr__(self, "params", dict(self.params))
        json.dumps(self.params)  # parameters must be JSON-able: they go to the truth table

    def get(self, name: str, default=None):
        return self.params.get(name, default)


@dataclasses.dataclass(frozen=True)
class FaultContext:
    """What a cause needs to know about the job being generated."""

    program: Program
    dp: int
    steps: np.ndarray                 # int64 [S] sampled step ids
    context_length: int
    fault_free_step_time: float       # mean, seconds
    hosts: np.ndarray                 # str [dp, pp]


def attention_fraction(context_length: int) -> float:
    """Share of a microbatch's compute that grows with the sum of squared document lengths."""
    # Attention FLOPs / total FLOPs of a decoder layer ~ L / (L + 6 h) with h ~ 8k hidden.
    return float(context_length / (context_length + 6 * 8192))


def draw_documents(rng: np.random.Generator, n_microbatches: int, context_length: int,
                   doc_median: float, doc_sigma: float) -> tuple[pa.ListArray, np.ndarray]:
    """Pack lognormal document lengths greedily into microbatches of context_length tokens.

    Returns the per-microbatch lengths (list<int32>, one list per microbatch) and the
    sum of squared lengths per microbatch (float64 [n_microbatches], tokens^2).
    """
    mean_len = doc_median * math.exp(doc_sigma ** 2 / 2)
    k = int(min(4096, max(4, math.ceil(3 * context_length / max(1.0, mean_len)) + 8)))
    lengths = np.exp(rng.standard_normal((n_microbatches, k)) * doc_sigma) * doc_median
    lengths = np.clip(np.rint(lengths), 1, context_length).astype(np.int64)
    ends = np.cumsum(lengths, axis=1)
    begins = ends - lengths
    keep = begins < context_length
    lengths = np.where(keep, np.minimum(lengths, context_length - begins), 0)
    counts = keep.sum(axis=1)
    values = lengths[keep].astype(np.int32)  # row-major: microbatch by microbatch, in order
    offsets = np.zeros(n_microbatches + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    sumsq = (lengths.astype(np.float64) ** 2).sum(axis=1)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32())), sumsq


def document_lengths(cause: Cause | None, context_length: int) -> tuple[float, float]:
    """(median tokens, lognormal sigma) of document lengths: naive packing for the
    seq_len_imbalance cause, else the balanced packing of a well-tuned loader (many
    short documents of similar length)."""
    if cause is None:
        return context_length / 16, 0.3
    return float(cause.get("doc_median", context_length / 8)), float(cause.get("doc_sigma", 1.4))


def sequence_cost(sumsq: np.ndarray, fraction: float) -> np.ndarray:
    """Relative compute cost per microbatch (mean 1): linear part + attention part ~ sum of squares."""
    return (1.0 - fraction) + fraction * sumsq / sumsq.mean()


def apply_sequence_cost(program: Program, arrays: StepArrays, cost: np.ndarray) -> None:
    """Scale every compute op by the cost of its microbatch; cost is [S, dp, microbatches]."""
    units = np.flatnonzero((program.unit_kind == UnitKind.FORWARD) | (program.unit_kind == UnitKind.BACKWARD))
    arrays.duration[units] *= np.moveaxis(cost[:, :, program.unit_microbatch[units]], 2, 0)


def _worker(cause: Cause, ctx: FaultContext, rng: np.random.Generator) -> tuple[int, int]:
    pp = ctx.program.pp
    dp_rank = cause.get("dp_rank")
    stage = cause.get("stage")
    dp_rank = int(rng.integers(ctx.dp)) if dp_rank is None else int(dp_rank)
    stage = int(rng.integers(pp)) if stage is None else int(stage)
    if not (0 <= dp_rank < ctx.dp and 0 <= stage < pp):
        raise ValueError(f"cause {cause.kind!r}: worker (dp_rank={dp_rank}, stage={stage}) outside the job "
                         f"(dp={ctx.dp}, pp={pp})")
    return dp_rank, stage


def apply_cause(cause: Cause, ctx: FaultContext, arrays: StepArrays, rng: np.random.Generator,
                seq_sumsq: np.ndarray | None = None) -> dict:
    """Inject one cause into ``arrays`` (in place); return its truth record.

    The record has ``kind``, ``params`` (every parameter actually used),
    ``workers`` (list of [dp_rank, stage] it touched) and, when the cause is
    intermittent, ``steps`` (step ids it touched). ``seq_sumsq`` ([S, dp, microbatches]
    tokens^2) is required for seq_len_imbalance.
    """
    program, kinds = ctx.program, ctx.program.unit_kind
    pp, n_steps = program.pp, len(ctx.steps)
    compute = (kinds == UnitKind.FORWARD) | (kinds == UnitKind.BACKWARD)
    params: dict[str, Any] = {}
    workers: list[list[int]] = []
    steps: list[int] | None = None

    if cause.kind == "slow_worker":
        d, p = _worker(cause, ctx, rng)
        factor = float(cause.get("factor", 1.6))
        units = np.flatnonzero(compute & (program.unit_stage == p))
        only = cause.get("steps")
        if only is None:
            arrays.duration[units, :, d] *= factor
        else:   # intermittent: slow in the given sampled steps (indices) only
            touched = sorted({int(s) for s in only})
            if not touched or touched[0] < 0 or touched[-1] >= n_steps:
                raise ValueError(f"cause 'slow_worker' steps must be sampled step indices in 0..{n_steps - 1}, got {list(only)!r}")
            arrays.duration[np.ix_(units, touched, [d])] *= factor
            steps = [int(ctx.steps[i]) for i in touched]
        params = {"dp_rank": d, "stage": p, "factor": factor, "host": str(ctx.hosts[d, p]),
                  **({} if only is None else {"steps": touched})}
        workers = [[d, p]]
    elif cause.kind == "last_stage_imbalance":
        if pp < 2:
            raise ValueError("cause 'last_stage_imbalance' needs pp >= 2")
        fe = float(cause.get("forward_extra", 0.6))
        be = float(cause.get("backward_extra", 0.25))
        last = (program.unit_stage == pp - 1) & (program.unit_chunk == program.vpp - 1)
        arrays.duration[np.flatnonzero(last & (kinds == UnitKind.FORWARD))] *= 1.0 + fe
        arrays.duration[np.flatnonzero(last & (kinds == UnitKind.BACKWARD))] *= 1.0 + be
        params = {"forward_extra": fe, "backward_extra": be}
        workers = [[d, pp - 1] for d in range(ctx.dp)]
    elif cause.kind == "seq_len_imbalance":
        if seq_sumsq is None:
            raise ValueError("cause 'seq_len_imbalance' needs the sampled document lengths (seq_sumsq)")
        fraction = float(cause.get("attention_fraction", attention_fraction(ctx.context_length)))
        cost = sequence_cost(seq_sumsq, fraction)
        apply_sequence_cost(program, arrays, cost)
        per_step = cost.reshape(n_steps, -1)
        median, sigma = document_lengths(cause, ctx.context_length)
        params = {"doc_median": median, "doc_sigma": sigma, "attention_fraction": fraction,
                  "imbalance_degree": float((per_step.max(axis=1) / per_step.mean(axis=1)).mean())}
    elif cause.kind == "gc_pauses":
        period = float(cause.get("period", 8.0))
        pause = float(cause.get("pause", 0.3))
        if period < 1 or pause <= 0:
            raise ValueError(f"cause 'gc_pauses' needs period >= 1 step and pause > 0 s, got {period}, {pause}")
        hits = rng.random((pp, n_steps, ctx.dp)) < 1.0 / period
        for p in range(pp):
            forwards = np.flatnonzero((kinds == UnitKind.FORWARD) & (program.unit_stage == p))
            s_idx, d_idx = np.nonzero(hits[p])
            which = forwards[rng.integers(len(forwards), size=len(s_idx))]
            arrays.duration[which, s_idx, d_idx] += pause * np.exp(rng.standard_normal(len(s_idx)) * 0.3)
        p_idx, s_idx, d_idx = np.nonzero(hits)
        workers = sorted({(int(d), int(p)) for p, d in zip(p_idx, d_idx)})
        workers = [list(w) for w in workers]
        steps = sorted({int(ctx.steps[s]) for s in s_idx}) if len(s_idx) else []
        params = {"period": period, "pause": pause, "pauses": int(hits.sum())}
    elif cause.kind == "comm_flapping":
        d, p = _worker(cause, ctx, rng)
        factor = float(cause.get("factor", 8.0))
        fraction = float(cause.get("steps_fraction", 0.3))
        width = max(1, min(n_steps, int(round(fraction * n_steps))))
        first = int(rng.integers(0, n_steps - width + 1))
        block = slice(first, first + width)
        pairs = program.transfer_units
        touches = (program.unit_stage[pairs[:, 0]] == p) | (program.unit_stage[pairs[:, 1]] == p)
        sel = np.flatnonzero(touches)
        arrays.transfer[sel, block, d] *= factor
        collectives = np.flatnonzero(np.isin(kinds, UnitKind.DP_COLLECTIVES) & (program.unit_stage == p))
        arrays.duration[collectives, block, :] *= factor
        params = {"dp_rank": d, "stage": p, "factor": factor, "steps_fraction": fraction,
                  "host": str(ctx.hosts[d, p])}
        workers = [[d, p]]
        steps = [int(s) for s in ctx.steps[block]]
    elif cause.kind == "untraced_cpu":
        fraction = float(cause.get("fraction", 0.15))
        scope = str(cause.get("scope", "first_stage"))
        if scope not in ("all", "first_stage"):
            raise ValueError(f"cause 'untraced_cpu' scope must be 'all' or 'first_stage', got {scope!r}")
        forwards = kinds == UnitKind.FORWARD
        if scope == "first_stage":
            forwards &= program.unit_stage == 0
        units = np.flatnonzero(forwards)
        per_op = fraction * ctx.fault_free_step_time / (program.microbatches * program.vpp)
        arrays.gap[units] += rng.exponential(per_op, (len(units), n_steps, ctx.dp))
        params = {"fraction": fraction, "scope": scope, "gap_per_forward": per_op}
        stages = [0] if scope == "first_stage" else range(pp)
        workers = [[d, p] for d in range(ctx.dp) for p in stages]
    return {"kind": cause.kind, "params": params, "workers": workers, "steps": steps}


def sample_causes(rng: np.random.Generator, *, dp: int, pp: int, context_length: int) -> tuple[Cause, ...]:
    """Draw the injected causes of one fleet job (often none; sometimes several).

    Prevalences aim at the paper's fleet (METHOD.md sections 5-6): about 40% of jobs
    straggle (S >= 1.1), stage imbalance is the most common cause, then sequence-length
    imbalance; single slow workers are rare; about 10% of jobs have untraced CPU work
    that breaks the replay (discarded as discrepancy > 5%).
    """
    causes: list[Cause] = []
    if pp > 1 and rng.random() < 0.32:
        fe = float(rng.uniform(0.25, 1.2))
        causes.append(Cause("last_stage_imbalance",
                            {"forward_extra": round(fe, 4), "backward_extra": round(fe * rng.uniform(0.3, 0.6), 4)}))
    seq_prevalence = 0.05 if context_length <= 8192 else 0.45
    if rng.random() < seq_prevalence:
        causes.append(Cause("seq_len_imbalance", {"doc_sigma": round(float(rng.uniform(1.1, 1.8)), 4),
                                                  "doc_median": int(context_length // rng.choice([4, 8, 16]))}))
    if rng.random() < 0.02:
        causes.append(Cause("slow_worker", {"dp_rank": int(rng.integers(dp)), "stage": int(rng.integers(pp)),
                                            "factor": round(float(np.exp(rng.uniform(np.log(1.3), np.log(3.5)))), 4)}))
    if rng.random() < 0.10:
        causes.append(Cause("gc_pauses", {"period": round(float(rng.uniform(1.5, 6)), 3),
                                          "pause": round(float(rng.uniform(0.2, 0.8)), 4)}))
    if rng.random() < 0.04:
        causes.append(Cause("comm_flapping", {"dp_rank": int(rng.integers(dp)), "stage": int(rng.integers(pp)),
                                              "factor": round(float(rng.uniform(5, 30)), 3),
                                              "steps_fraction": round(float(rng.uniform(0.2, 0.6)), 3)}))
    if rng.random() < 0.10:
        causes.append(Cause("untraced_cpu", {"fraction": round(float(rng.uniform(0.08, 0.35)), 4),
                                             "scope": str(rng.choice(["all", "first_stage"]))}))
    return tuple(causes)
