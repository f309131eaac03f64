"""What one what-if analysis returns: the contract between the engine and its users.

Plain data (numpy arrays, floats, dicts); no Beam. Times are seconds.
Field names follow the reference analyzer (ByteDance-Seed/StragglerAnalysis) so that
`to_reference_json()` is a drop-in for its result-*.json, plus M_W and M_S.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

__all__ = ["discrepancy_discards", "discrepancy_reason", "JobMeta", "Decomposition", "Evidence", "UntracedWork", "WhatIfResult", "DISCREPANCY_LIMIT", "ATTRIBUTION_THRESHOLD", "STRAGGLING_THRESHOLD"]

DISCREPANCY_LIMIT = 1.05      # observed / replayed step time above this, or below its inverse: discard
ATTRIBUTION_THRESHOLD = 1.03  # attributions computed only when S >= this
STRAGGLING_THRESHOLD = 1.1    # a job straggles when S >= this



def discrepancy_discards(launch_slowdown: float) -> bool:
    """The replay is off by more than 5% either way (observed / replayed outside [1/1.05, 1.05])."""
    return bool(launch_slowdown > DISCREPANCY_LIMIT or launch_slowdown * DISCREPANCY_LIMIT < 1.0)


def discrepancy_reason(launch_slowdown: float) -> str:
    """Why a window with this discrepancy is discarded, in words (both sides)."""
    if launch_slowdown > DISCREPANCY_LIMIT:
        return (f"replay discrepancy {launch_slowdown:.4f} > {DISCREPANCY_LIMIT}: what ran took "
                f"{100 * (launch_slowdown - 1):.1f}% longer than the replay of its ops (untraced CPU work or "
                "clock problems the model does not see)")
    return (f"replay discrepancy {launch_slowdown:.4f} < 1/{DISCREPANCY_LIMIT}: the replay takes "
            f"{100 * (1 / launch_slowdown - 1):.1f}% longer than what ran (the dependency model serialises "
            "work that overlapped)")

@dataclasses.dataclass(frozen=True)
class JobMeta:
    """Parallelism of a job (the published meta-*.yaml fields), and where its compute ran.

    host_compute: the compute ran on the host CPU thread that also issues the job's send/recv
    (CPU training, e.g. torch on gloo; a converted trace whose source says device 'cpu'). That
    thread does one thing at a time, in program order, so a recv issued after the compute op
    before the one it serves waits for that op (graph._p2p_dependencies). False (GPU jobs, the
    published traces): compute runs on a device stream and a recv may start under it.

    distinct_dp_collectives: the DP collectives were issued while the backward ran, one per
    gradient bucket or parameter (DDP, per-parameter async all-reduce, FSDP; a converted trace
    whose source counts collectives_issued_during_compute): each reduces its own tensor, of its
    own size, so each collective of a step (stage, seq_id) has its own ideal transfer, the median
    of that same collective over steps and DP ranks (model.ideal_cost). False (METHOD.md, the
    published traces): one ideal per op type, as for Megatron's equal buckets."""

    dp_size: int
    pp_size: int
    tp_size: int = 1
    dsp_size: int = 1
    vpp_size: int = 1
    world_size: int = 0
    host_compute: bool = False
    distinct_dp_collectives: bool = False

    def __post_init__(self):
        for name in ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"JobMeta.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.world_size == 0:
            object.__setattr__(self, "world_size", self.dp_size * self.pp_size * self.tp_size * self.dsp_size)

    @classmethod
    def from_mapping(cls, fields) -> "JobMeta":
        """From a published meta yaml (trial_name and run_id ignored) or a manifest row; with the
        row's `source` (a converted raw job's, lake.py keeps it beside the manifest), device 'cpu'
        sets host_compute, DP collectives issued during the compute distinct_dp_collectives."""
        names = ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size", "world_size")
        source = fields.get("source")
        host = bool(fields.get("host_compute")) or (isinstance(source, dict) and source.get("device") == "cpu")
        distinct = bool(fields.get("distinct_dp_collectives")) or (
            isinstance(source, dict) and int(source.get("collectives_issued_during_compute") or 0) > 0)
        return cls(**{name: int(fields[name]) for name in names if fields.get(name) is not None}, host_compute=host,
                   distinct_dp_collectives=distinct)

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

    def parts(self) -> dict[str, float]:
        """The reference's key order: trem, tadd, tori, tideal, rem, add."""
        return {name: float(getattr(self, name)) for name in ("trem", "tadd", "tori", "tideal", "rem", "add")}


@dataclasses.dataclass(frozen=True)
class Evidence:
    """How much a result stands on: the profiled steps analysed, the microbatches each worker ran per
    step, the DP peers each worker has (the other DP ranks of its stage) and the pipeline stages.

    The analysis compares a worker with its DP peers and with its own other steps, and a step with the
    other steps: with one step, one worker per stage or one rank, some of those comparisons do not
    exist, and `limits` says which (and what would settle them), for the verdicts to use."""

    steps: int
    microbatches: int
    dp_peers: int
    stages: int

    @property
    def limits(self) -> list[str]:
        """What this trace cannot show, each with the setting that would let it."""
        out = []
        if self.dp_peers == 0 and self.stages == 1:
            out.append("one rank: nothing waits for it and there are no peers, so no worker can straggle behind "
                       "another; S measures only how its op durations spread around their means (profile every rank "
                       "of a multi-rank job to find stragglers)")
        elif self.dp_peers == 0:
            out.append("no data-parallel peers: a worker is compared only with its own other steps and the other "
                       "stages, never with a replica of its own work (run with DP >= 2 to compare replicas)")
        if self.steps == 1:
            out.append("one profiled step: a slow step cannot be told from a slow worker, nor a pause from a "
                       "persistent slowdown (profile more active steps: the profiler schedule's `active`)")
        return out

    def to_json(self) -> dict:
        return {"steps": self.steps, "microbatches": self.microbatches, "dp_peers": self.dp_peers,
                "stages": self.stages, "limits": self.limits}

    def describe(self) -> str:
        """One line: what the result stands on."""
        peers = f"{self.dp_peers} DP peer{'s' if self.dp_peers != 1 else ''} per worker"
        return (f"{self.steps} profiled step{'s' if self.steps != 1 else ''} x {self.microbatches} "
                f"microbatch{'es' if self.microbatches != 1 else ''} per worker, {peers}, "
                f"{self.stages} pipeline stage{'s' if self.stages != 1 else ''}")


@dataclasses.dataclass(frozen=True)
class UntracedWork:
    """Named workers' untraced CPU time, modelled: the no-delay replay with only their launch delays
    given back (every other launch delay 0). METHOD.md section 3 replays without launch delays, so
    a worker that stalls the job between its ops (a GC pause, a slow data loader, a pause before a
    send or the gradient all-reduce) makes what ran longer than the replay and the window would be
    discarded. Once the root-cause analysis names the worker(s) whose untraced time that is
    (causes.detect: measured beyond their peers and the job, and confirmed by the replay), their
    untraced time is part of the model, like a traced op of its own whose ideal is 0: the replay
    with it is T, and what ran is compared against that (`WhatIfResult.replay_discrepancy`).

    workers: (dp_rank, stage) pairs; step_t: the replay's step span per step (seconds)."""

    workers: tuple[tuple[int, int], ...]
    step_t: np.ndarray


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
    # Engine extensions (not in the reference layout).
    launch_step_slowdown: np.ndarray | None = None     # base / nodelay per step (replay discrepancy per step)
    step_t_replayed: np.ndarray | None = None          # replay of the original with launch delays (= base when exact)
    ideal_durations: dict[str, float] | None = None    # optype -> ideal cost (s): mean duration or median transfer
    # Launch-delay attribution, only when launch_slowdown >= ATTRIBUTION_THRESHOLD (like the reference):
    # no-delay replay with one group's launch delays given back, over the no-delay step time.
    launch_by_dp_rank: dict[int, float] | None = None
    launch_by_stage: dict[int, float] | None = None
    launch_by_optype: dict[str, float] | None = None   # pp comm merged; 'first-op' = each stage's first op
    launch_by_dp_rank_per_step: np.ndarray | None = None
    launch_by_stage_per_step: np.ndarray | None = None
    launch_by_optype_per_step: dict[str, np.ndarray] | None = None
    worker_rank: np.ndarray | None = None              # [dp_size, pp_size] global rank of each worker
    timeline: Any = None                               # transforms.whatif.timeline.Timeline when asked for
    # Set by the root-cause analysis (causes.classify) when it names the workers whose untraced CPU
    # time makes what ran longer than the no-delay replay: their untraced time modelled.
    untraced: UntracedWork | None = None
    # CPU ranks: T per step with each rank's late arrival from its previous step given
    # (JobModel.carried_arrivals); None where nothing is carried.
    step_t_arrivals: np.ndarray | None = None
    evidence: Evidence | None = None                   # what the result stands on (steps, microbatches, peers)

    @property
    def model_step_t(self) -> np.ndarray:
        """T per step as the model replays it: the no-delay replay, with the named workers'
        untraced CPU time given back when `untraced` is set."""
        return self.step_t_nodelay if self.untraced is None else self.untraced.step_t

    @property
    def model_slowdown(self) -> float:
        """S of the model: `slowdown` (METHOD.md), times T with the named workers' untraced time
        over T without it when `untraced` is set (their untraced time's ideal is 0)."""
        if self.untraced is None:
            return float(self.slowdown)
        return float(self.slowdown * self.untraced.step_t.mean() / self.step_t_nodelay.mean())

    @property
    def model_step_slowdown(self) -> np.ndarray:
        """S_s of the model (the same rule per step)."""
        if self.untraced is None:
            return self.step_slowdown
        return self.step_slowdown * self.untraced.step_t / self.step_t_nodelay

    @property
    def replay_discrepancy(self) -> float:
        """What ran over the model's replay (mean step times): `launch_slowdown` (METHOD.md), or
        against the replay with the named workers' untraced time when `untraced` is set, or with
        the ranks' carried arrivals (`step_t_arrivals`) when what ran is more than 5% longer than
        METHOD's replay. S stays METHOD's for arrivals: a rank's tail of step k-1 is in that
        step's replay already."""
        if self.untraced is None:
            if self.step_t_arrivals is not None and self.launch_slowdown > DISCREPANCY_LIMIT:
                return float(self.step_t_base.mean() / self.step_t_arrivals.mean())
            return float(self.launch_slowdown)
        return float(self.step_t_base.mean() / self.untraced.step_t.mean())

    @property
    def waste(self) -> float:
        """Fraction of GPU time lost to stragglers: 1 - 1/S (the model's S)."""
        slowdown = self.model_slowdown
        return 1.0 - 1.0 / slowdown if slowdown > 0 else math.nan

    @property
    def discarded(self) -> bool:
        """True when the model's replay is more than 5% slower or faster than what ran (observed
        over replayed step time above 1.05 or below 1/1.05): keep out of fleet statistics. Slower
        than the trace: untraced CPU work the no-delay replay drops (unless the root-cause analysis
        named whose it is: `untraced`); faster: the dependency model serialises work that
        overlapped (or clocks disagree)."""
        return discrepancy_discards(self.replay_discrepancy)

    @property
    def discarded_method(self) -> bool:
        """METHOD.md section 3's rule alone: the no-delay replay is off by more than 5% (launch_slowdown)."""
        return discrepancy_discards(float(self.launch_slowdown))

    @property
    def kept_by(self) -> str | None:
        """Which rule keeps the window (schemas.tables.KEPT_BY), None when it is discarded."""
        if self.discarded:
            return None
        if not self.discarded_method:
            return "method"
        return "untraced-model" if self.untraced is not None else "arrivals-model"

    @property
    def straggling(self) -> bool:
        """S of the model at least the straggling threshold."""
        return bool(self.model_slowdown >= STRAGGLING_THRESHOLD)

    def headline(self) -> dict[str, Any]:
        """The figures of the window every table of it shows, under their column names (the batch's
        job_summary and the live result row take them from here): the model's S, waste and per-step
        S, METHOD.md's discrepancy and S beside them, which rule kept the window, M_W and M_S (rem
        form; None when not computed or not finite)."""
        def finite(value) -> float | None:
            return None if value is None or not math.isfinite(float(value)) else float(value)

        return {
            "slowdown": float(self.model_slowdown), "waste": float(self.waste), "straggling": self.straggling,
            "launch_slowdown": float(self.launch_slowdown), "replay_discrepancy": float(self.replay_discrepancy),
            "discarded": self.discarded, "slowdown_method": float(self.slowdown),
            "discarded_method": self.discarded_method, "kept_by": self.kept_by,
            "m_w": finite(self.mw.rem) if self.mw is not None else None,
            "m_s": finite(self.ms.rem) if self.ms is not None else None,
            "steps": np.asarray(self.steps, dtype=np.int64).tolist(),
            "step_slowdown": np.asarray(self.model_step_slowdown, dtype=np.float64).tolist(),
        }

    # ------------------------------------------------------------------ JSON

    def to_reference_json(self) -> dict:
        """The reference analyzer's result-*.json, key for key and in its order: per-step
        dicts keyed by the step as a string in ascending step order, slowdown dicts sorted
        by value (largest first, ties in key order), per-step attributions ordered like the
        per-step slowdown. Attribution fields are None when S < 1.03."""
        steps = [str(int(step)) for step in self.steps]
        blocking_order = _descending(steps, self.step_slowdown)
        launch = self.launch_step_slowdown if self.launch_step_slowdown is not None else np.full(len(steps), np.nan)
        launch_order = _descending(steps, launch)
        dp_keys = [str(d) for d in range(self.meta.dp_size)]
        stage_keys = [str(p) for p in range(self.meta.pp_size)]

        def overall(values: dict | None) -> dict | None:
            if values is None:
                return None
            keys = [str(k) for k in values]
            return dict(_sorted_by_value(keys, list(values.values())))

        def per_step(table, keys, order) -> dict | None:
            if table is None:
                return None
            if isinstance(table, dict):
                keys = list(table)
                table = np.stack([table[k] for k in keys], axis=1)
            index = {step: i for i, step in enumerate(steps)}
            return {step: dict(_sorted_by_value(keys, table[index[step]].tolist())) for step in order}

        return {
            "job_meta": {
                "trial_name": self.job_id, "run_id": 0,
                "dp_size": self.meta.dp_size, "pp_size": self.meta.pp_size, "tp_size": self.meta.tp_size,
                "dsp_size": self.meta.dsp_size, "vpp_size": self.meta.vpp_size, "world_size": self.meta.world_size,
            },
            "step_t_base": dict(zip(steps, map(float, self.step_t_base))),
            "step_t_nodelay": dict(zip(steps, map(float, self.step_t_nodelay))),
            "step_t_noblk": dict(zip(steps, map(float, self.step_t_noblk))),
            "launch_slowdown": float(self.launch_slowdown),
            "blocking_slowdown": float(self.slowdown),
            "blocking_step_slowdown": {step: float(value) for step, value in _sorted_by_value(steps, self.step_slowdown.tolist())},
            "launch_step_slowdown": {step: float(value) for step, value in _sorted_by_value(steps, launch.tolist())},
            "blocking_decompose_by_dp_rank": overall(self.by_dp_rank),
            "launch_decompose_by_dp_rank": overall(self.launch_by_dp_rank),
            "blocking_decompose_by_stage": overall(self.by_stage),
            "launch_decompose_by_stage": overall(self.launch_by_stage),
            "blocking_decompose_by_optype": overall(self.by_optype),
            "launch_decompose_by_optype": overall(self.launch_by_optype),
            "blocking_decompose_by_dp_rank_per_step": per_step(self.by_dp_rank_per_step, dp_keys, blocking_order),
            "launch_decompose_by_dp_rank_per_step": per_step(self.launch_by_dp_rank_per_step, dp_keys, launch_order),
            "blocking_decompose_by_stage_per_step": per_step(self.by_stage_per_step, stage_keys, blocking_order),
            "launch_decompose_by_stage_per_step": per_step(self.launch_by_stage_per_step, stage_keys, launch_order),
            "blocking_decompose_by_optype_per_step": per_step(self.by_optype_per_step, None, blocking_order),
            "launch_decompose_by_optype_per_step": per_step(self.launch_by_optype_per_step, None, launch_order),
        }

    def mw_json(self) -> dict | None:
        """mw-*.json of the reference: trem, tadd, tori, tideal, rem, add, Mw (None without attribution)."""
        return None if self.mw is None else {**self.mw.parts(), "Mw": float(self.mw.rem)}

    def ms_json(self) -> dict | None:
        """ms-*.json of the reference: trem, tadd, tori, tideal, rem, add, Ms."""
        return None if self.ms is None else {**self.ms.parts(), "Ms": float(self.ms.rem)}

    def to_json(self) -> dict:
        """The reference layout plus M_W, M_S with their parts and the engine's verdict fields."""
        out = self.to_reference_json()
        out["M_W"] = None if self.mw is None else float(self.mw.rem)
        out["M_S"] = None if self.ms is None else float(self.ms.rem)
        out["mw"] = None if self.mw is None else {**self.mw_json(), "workers": [list(w) for w in self.mw.workers]}
        out["ms"] = None if self.ms is None else {**self.ms_json(), "workers": [list(w) for w in self.ms.workers]}
        out["waste"] = float(self.waste)
        out["straggling"] = self.straggling
        out["discarded"] = self.discarded
        out["discard_reason"] = (
            discrepancy_reason(self.replay_discrepancy) if self.discarded else None
        )
        out["replay_discrepancy"] = self.replay_discrepancy
        # METHOD.md's own figures beside the model's: blocking_slowdown is METHOD's S (reference key)
        out["discarded_method"] = self.discarded_method
        out["kept_by"] = self.kept_by
        out["untraced_work"] = None if self.untraced is None else {
            "workers": [list(w) for w in self.untraced.workers],
            "step_t": dict(zip((str(int(s)) for s in self.steps), map(float, self.untraced.step_t))),
            "slowdown": self.model_slowdown,
        }
        # CPU ranks: the replay with each rank's arrival carried from its previous step (what the
        # discrepancy compares with when METHOD's replay is more than 5% short)
        out["carried_arrivals"] = None if self.step_t_arrivals is None else {
            "step_t": dict(zip((str(int(s)) for s in self.steps), map(float, self.step_t_arrivals))),
        }
        out["evidence"] = None if self.evidence is None else self.evidence.to_json()
        out["worker_slowdown"] = None if self.worker_slowdown is None else self.worker_slowdown.tolist()
        out["ideal_durations"] = self.ideal_durations
        return out


def _sorted_by_value(keys: list[str], values) -> list[tuple[str, float]]:
    """(key, value) pairs, largest value first; equal values keep the key order."""
    return sorted(((key, float(value)) for key, value in zip(keys, values)), key=lambda item: -item[1])


def _descending(keys: list[str], values) -> list[str]:
    return [key for key, _ in _sorted_by_value(keys, list(values))]
