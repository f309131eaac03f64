"""One synthetic job: its specification, and the generation of its trace, manifest and truth."""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math

import numpy as np
import pyarrow as pa

from schemas.trace import MANIFEST_SCHEMA
from transforms.synth.execution import StepArrays, Timing, TracePart, draw_arrays, emit_trace, simulate, step_times
from transforms.synth.faults import (
    Cause,
    FaultContext,
    apply_cause,
    apply_sequence_cost,
    attention_fraction,
    document_lengths,
    draw_documents,
    sequence_cost,
)
from transforms.synth.program import Program, UnitKind, build_program
from transforms.whatif.result import JobMeta

__all__ = ["JobSpec", "GeneratedJob", "generate_job", "sample_timing", "MODEL_FAMILIES", "SAMPLED_FRACTION"]

MODEL_FAMILIES = ("dense", "moe")
SAMPLED_FRACTION = 0.1  # profiling sessions cover about 10% of a job's steps
GPUS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What to generate for one job.

    Parallelism: ``dp`` x ``pp`` analysed workers, each standing for ``tp`` x ``cp`` GPUs;
    ``vpp`` > 1 selects the interleaved schedule. ``steps`` sampled steps are spread over
    ``sessions`` profiling sessions. ``dp_overlap``: ZeRO grads-reduce-scatter overlaps the
    backward pass (a separate-grads-all-reduce op appears in the tail); otherwise it runs in
    the tail. DP comm is absent when dp * cp == 1. ``hosts``: machine name of each
    8-GPU node in global-rank order (default: names derived from job_id). ``timing``:
    base durations (default: sampled from ``seed`` and the shape). ``record_noop_p2p``: the
    profiler also records the p2p calls a 1F1B pipeline skips at its ends, as no-op records
    (interleaved schedules always have them). Times are UTC.
    """

    job_id: str
    dp: int
    pp: int
    microbatches: int
    tp: int = 1
    cp: int = 1
    vpp: int = 1
    steps: int = 40
    sessions: int = 4
    model_family: str = "dense"
    context_length: int = 4096
    dp_overlap: bool = True
    causes: tuple[Cause, ...] = ()
    seed: int = 0
    date: dt.date = dt.date(2024, 1, 1)
    start_time: dt.datetime | None = None
    hosts: tuple[str, ...] | None = None
    record_seq_lens: bool = False
    record_noop_p2p: bool = False
    timing: Timing | None = None

    def __post_init__(self):
        def fail(message):
            raise ValueError(f"JobSpec {self.job_id!r}: {message}")

        if not isinstance(self.job_id, str) or not self.job_id or "/" in self.job_id or "=" in self.job_id:
            fail("job_id must be a non-empty string without '/' or '='")
        for name in ("dp", "pp", "microbatches", "tp", "cp", "vpp", "steps", "sessions", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                fail(f"{name} must be an integer >= 1, got {value!r}")
        if self.dp > 32767 or self.pp > 32767:
            fail("dp and pp must fit the trace's int16 columns")
        if self.sessions > self.steps:
            fail(f"sessions ({self.sessions}) cannot exceed sampled steps ({self.steps})")
        if self.model_family not in MODEL_FAMILIES:
            fail(f"model_family must be one of {MODEL_FAMILIES}, got {self.model_family!r}")
        if self.vpp > 1 and (self.pp < 2 or self.microbatches % self.pp or self.microbatches < 2 * self.pp):
            fail(f"vpp={self.vpp} needs pp >= 2 and microbatches a multiple of pp and >= 2 pp "
                 f"(pp={self.pp}, microbatches={self.microbatches})")
        object.__setattr__(self, "causes", tuple(self.causes))
        for cause in self.causes:
            if not isinstance(cause, Cause):
                fail(f"causes must be Cause objects, got {cause!r}")
            if cause.kind == "last_stage_imbalance" and self.pp < 2:
                fail("last_stage_imbalance needs pp >= 2")
        if len({c.kind for c in self.causes}) != len(self.causes):
            fail("each cause kind may appear once")
        if isinstance(self.date, str):
            try:
                object.__setattr__(self, "date", dt.date.fromisoformat(self.date))
            except ValueError as error:
                fail(f"date {self.date!r} is not YYYY-MM-DD ({error})")
        if not isinstance(self.date, dt.date) or isinstance(self.date, dt.datetime):
            fail(f"date must be a datetime.date or 'YYYY-MM-DD', got {self.date!r}")
        if self.start_time is not None and self.start_time.tzinfo is None:
            fail("start_time must be timezone-aware (UTC)")
        if self.hosts is not None:
            object.__setattr__(self, "hosts", tuple(self.hosts))
            if len(self.hosts) != self.n_hosts:
                fail(f"hosts must name {self.n_hosts} machines ({GPUS_PER_HOST} GPUs each), got {len(self.hosts)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def n_hosts(self) -> int:
        return math.ceil(self.world_size / GPUS_PER_HOST)

    @property
    def meta(self) -> JobMeta:
        return JobMeta(dp_size=self.dp, pp_size=self.pp, tp_size=self.tp, dsp_size=self.cp,
                       vpp_size=self.vpp, world_size=self.world_size)

    def has(self, kind: str) -> bool:
        return any(c.kind == kind for c in self.causes)

    def cause(self, kind: str) -> Cause | None:
        return next((c for c in self.causes if c.kind == kind), None)

    @property
    def estimated_records(self) -> int:
        """Number of op records of the trace, within a few per worker and step (for budgeting work)."""
        computes = 2 * self.microbatches * self.vpp
        if self.pp == 1:
            p2p = 0
        elif self.vpp == 1 and not self.record_noop_p2p:
            p2p = 4 * self.microbatches * (self.pp - 1) / self.pp   # ends of the pipeline skip half
        elif self.vpp == 1:
            p2p = 4 * self.microbatches
        else:
            p2p = 4 * self.microbatches * self.vpp + 3               # every call is recorded, no-ops too
        tail = 4 + min(2, self.pp) / self.pp                        # gc, layernorm, clip, optimizer, embedding
        if self.dp * self.cp > 1:
            tail += 2 * self.vpp + self.dp_overlap                   # ZeRO collectives
        return int(self.steps * self.dp * self.pp * (computes + p2p + tail))


@dataclasses.dataclass
class GeneratedJob:
    """A generated job: the trace (TRACE_SCHEMA), a one-row manifest, the truth and the meta.

    ``parts`` slice ``trace`` into one piece per (profiling session, stage), the unit
    written as one lake file. ``truth`` is a plain dict, one row of fleet.TRUTH_SCHEMA.
    """

    spec: JobSpec
    trace: pa.Table
    parts: list[TracePart]
    manifest: pa.Table
    truth: dict
    meta: JobMeta

    def files(self):
        """(file name, table) of every lake file of the trace: part-s{session}-p{stage}.parquet."""
        for part in self.parts:
            yield f"part-s{part.session:02d}-p{part.stage:03d}.parquet", self.trace.slice(part.offset, part.length)


def sample_timing(spec: JobSpec, rng: np.random.Generator) -> Timing:
    """Base durations of a job from its shape: bigger per-GPU token counts take longer."""
    log_uniform = lambda lo, hi: float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
    tokens = spec.context_length / spec.cp
    forward = min(1.5, log_uniform(0.04, 0.25) * (tokens / 4096) ** 0.6)
    moe = spec.model_family == "moe"
    dp_ranks = spec.dp * spec.cp
    ring = (dp_ranks - 1) / dp_ranks if dp_ranks > 1 else 0.0
    grads_reduce_scatter = log_uniform(0.02, 0.2) * ring
    return Timing(
        forward=forward,
        backward_ratio=rng.uniform(1.7, 2.2),
        compute_noise=rng.uniform(0.03, 0.05) if moe else rng.uniform(0.008, 0.02),
        worker_noise=rng.uniform(0.002, 0.006),
        step_noise=rng.uniform(0.002, 0.008),
        last_stage_extra=rng.uniform(0.0, 0.05),
        attention_fraction=attention_fraction(spec.context_length),
        p2p=log_uniform(0.0003, 0.002) * (tokens / 4096) ** 0.5,
        p2p_noise=rng.uniform(0.05, 0.25),
        params_all_gather=log_uniform(0.01, 0.12) * ring,
        grads_reduce_scatter=grads_reduce_scatter,
        separate_all_reduce=log_uniform(0.005, 0.05) * ring,
        layernorm_all_reduce=log_uniform(3e-5, 3e-3),
        embedding_all_reduce=log_uniform(0.005, 0.05),
        clip=log_uniform(0.002, 0.02),
        optimizer=log_uniform(0.015, 0.06),
        comm_noise=rng.uniform(0.03, 0.12),
        launch_gap=log_uniform(3e-6, 3e-5),
        data_gap=forward * rng.uniform(0.01, 0.05),
        tail_gap=log_uniform(3e-4, 3e-3),
        grads_copy_gap=grads_reduce_scatter * rng.uniform(0.02, 0.1),
        clock_jitter=log_uniform(5e-6, 6e-5),
    )


def _sample_steps(spec: JobSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sampled step ids (ascending) and the session of each: sessions of dozens of steps, ~10% of steps."""
    per_session = np.full(spec.sessions, spec.steps // spec.sessions)
    per_session[: spec.steps % spec.sessions] += 1
    steps, sessions = [], []
    first = int(rng.integers(5, 50))
    for k, count in enumerate(per_session):
        window = max(int(count), int(round(count * rng.uniform(2.0, 4.0))))
        chosen = np.sort(rng.choice(window, size=int(count), replace=False)) + first
        steps.append(chosen)
        sessions.append(np.full(count, k))
        # The job keeps training between sessions: the sessions cover ~SAMPLED_FRACTION of its steps.
        first += int(round(count / SAMPLED_FRACTION * rng.uniform(0.8, 1.2)))
    return np.concatenate(steps).astype(np.int64), np.concatenate(sessions)


def _ideal_arrays(program: Program, arrays: StepArrays) -> StepArrays:
    """One lane with every op at its type's mean (compute-like) or median (comm) duration."""
    kinds = program.unit_kind
    duration = np.zeros((program.n_units, 1, 1))
    for kind in np.unique(kinds):
        sel = kinds == kind
        values = arrays.duration[sel]
        comm = kind in UnitKind.DP_COLLECTIVES or kind in (UnitKind.LAYERNORM, UnitKind.EMBEDDING, UnitKind.CLIP)
        duration[sel] = np.median(values) if comm else values.mean()
    transfer = np.zeros((len(program.transfer_units), 1, 1))
    for forward in (True, False):
        sel = program.transfer_forward == forward
        if sel.any():
            transfer[sel] = np.median(arrays.transfer[sel])
    return StepArrays(duration, transfer, np.zeros_like(duration))


def _mean_step_time(program: Program, arrays: StepArrays, with_gaps: bool = True) -> tuple[float, np.ndarray]:
    start, end = simulate(program, arrays, with_gaps=with_gaps)
    times = step_times(start, end)
    return float(times.mean()), times


def generate_job(spec: JobSpec) -> GeneratedJob:
    """Simulate one job and return its trace, manifest, truth and meta (deterministic in spec)."""
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0x57A6]))
    timing = spec.timing or sample_timing(spec, rng)
    program = build_program(spec.pp, spec.vpp, spec.microbatches, spec.dp * spec.cp > 1, spec.dp_overlap,
                            spec.record_noop_p2p and spec.vpp == 1)
    steps, step_session = _sample_steps(spec, rng)
    n_steps, dp, pp = len(steps), spec.dp, spec.pp

    ranks = (spec.tp * spec.cp) * (np.arange(dp)[:, None] + dp * np.arange(pp)[None, :])
    host_names = np.array(spec.hosts if spec.hosts is not None
                          else [f"{spec.job_id}-node{i:04d}" for i in range(spec.n_hosts)], dtype=object)
    host_index = ranks // GPUS_PER_HOST
    hosts = host_names[host_index]

    base = draw_arrays(program, timing, n_steps, dp, rng)

    seq_cause = spec.cause("seq_len_imbalance")
    seq_lens = sumsq = None
    if seq_cause is not None or spec.record_seq_lens:
        median, sigma = document_lengths(seq_cause, spec.context_length)
        seq_lens, sumsq = draw_documents(rng, n_steps * dp * spec.microbatches, spec.context_length, median, sigma)
        sumsq = sumsq.reshape(n_steps, dp, spec.microbatches)
        if seq_cause is None:
            apply_sequence_cost(program, base, sequence_cost(sumsq, timing.attention_fraction))

    fault_free, fault_free_steps = _mean_step_time(program, base)
    ctx = FaultContext(program=program, dp=dp, steps=steps, context_length=spec.context_length,
                       fault_free_step_time=fault_free, hosts=hosts)
    faulty = base.copy()
    cause_truth = []
    solo_effects: dict[str, float] = {}
    for cause in spec.causes:
        cause_rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0x57A6, len(cause_truth) + 1]))
        cause_truth.append(apply_cause(cause, ctx, faulty, cause_rng, seq_sumsq=sumsq))
    if len(spec.causes) > 1:
        # Effect of each cause alone (same random draws), to name the dominant one.
        for i, cause in enumerate(spec.causes):
            alone = base.copy()
            cause_rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0x57A6, i + 1]))
            apply_cause(cause, ctx, alone, cause_rng, seq_sumsq=sumsq)
            solo_effects[cause.kind] = _mean_step_time(program, alone)[0] / fault_free

    start, end = simulate(program, faulty)
    observed_steps = step_times(start, end)
    observed = float(observed_steps.mean())
    nodelay = _mean_step_time(program, faulty, with_gaps=False)[0]
    ideal = _mean_step_time(program, _ideal_arrays(program, faulty), with_gaps=False)[0]
    if len(spec.causes) == 1:
        solo_effects[spec.causes[0].kind] = observed / fault_free

    # Profiler clocks: one offset per machine and session (GPUs of a host share a clock).
    host_offsets = rng.standard_normal((spec.sessions, spec.n_hosts)) * timing.clock_jitter
    clock_offset = host_offsets[:, host_index]
    trace, parts = emit_trace(spec.job_id, program, start, end, steps, step_session, clock_offset,
                              ranks, hosts, seq_lens=seq_lens)

    start_time = spec.start_time or (dt.datetime.combine(spec.date, dt.time(), dt.timezone.utc)
                                     + dt.timedelta(seconds=int(rng.integers(0, 20 * 3600))))
    submit_time = start_time - dt.timedelta(seconds=int(rng.integers(30, 3600)))
    end_time = start_time + dt.timedelta(seconds=float((steps[-1] + 1) * observed))
    workers = [{"dp_rank": d, "stage": p, "rank": int(ranks[d, p]), "host": str(hosts[d, p])}
               for d in range(dp) for p in range(pp)]
    manifest = pa.Table.from_pylist([{
        "job_id": spec.job_id, "date": spec.date, "submit_time": submit_time, "start_time": start_time,
        "end_time": end_time, "gpus": spec.world_size, "dp_size": dp, "pp_size": pp, "tp_size": spec.tp,
        "dsp_size": spec.cp, "vpp_size": spec.vpp, "world_size": spec.world_size,
        "microbatches": spec.microbatches, "model_family": spec.model_family,
        "context_length": spec.context_length, "workers": workers,
    }], schema=MANIFEST_SCHEMA)

    affected = sorted({tuple(w) for c in cause_truth for w in c["workers"]})
    affected_hosts = sorted({str(hosts[d, p]) for d, p in affected})
    primary = max(solo_effects, key=lambda k: (solo_effects[k], k)) if solo_effects else "clean"
    truth = {
        "job_id": spec.job_id,
        "date": spec.date,
        "seed": int(spec.seed),
        "gpus": spec.world_size,
        "dp_size": dp, "pp_size": pp, "tp_size": spec.tp, "dsp_size": spec.cp, "vpp_size": spec.vpp,
        "microbatches": spec.microbatches,
        "model_family": spec.model_family,
        "context_length": spec.context_length,
        "dp_overlap": bool(spec.dp_overlap and dp * spec.cp > 1),
        "sampled_steps": n_steps,
        "records": trace.num_rows,
        "causes": [c.kind for c in spec.causes],
        "primary_cause": primary,
        "cause_params": json.dumps({c["kind"]: c["params"] | ({"steps": c["steps"]} if c["steps"] is not None else {})
                                    for c in cause_truth}, sort_keys=True),
        "cause_slowdowns": json.dumps(solo_effects, sort_keys=True),
        "affected_workers": [{"dp_rank": int(d), "stage": int(p)} for d, p in affected],
        "affected_hosts": affected_hosts,
        "step_time": observed,
        "fault_free_step_time": fault_free,
        "true_slowdown": observed / fault_free,
        "nodelay_step_time": nodelay,
        "ideal_step_time": ideal,
        "expected_slowdown": nodelay / ideal,
        "expected_discrepancy": observed / nodelay,
        "bad_kind": None,
        "bad_detail": None,
    }
    return GeneratedJob(spec=spec, trace=trace, parts=parts, manifest=manifest, truth=truth, meta=spec.meta)
