"""Synthetic fleet: Megatron-style training jobs simulated op by op, with known root causes.

Public API (stable; other modules and tests depend on it):

``JobSpec(job_id, dp, pp, microbatches, tp=1, cp=1, vpp=1, steps=40, sessions=4,
model_family="dense"|"moe", context_length=4096, dp_overlap=True, causes=(), seed=0,
date=2024-01-01, start_time=None, hosts=None, record_seq_lens=False, record_noop_p2p=False,
timing=None)``
    What to generate. ``steps`` sampled steps in ``sessions`` profiling sessions (~10%
    of the job's steps); ``vpp`` > 1 = interleaved 1F1B; ``dp_overlap`` = ZeRO
    reduce-scatter overlapped with backward (separate-grads-all-reduce in the tail);
    DP comm is absent when dp * cp == 1. ``causes``: :class:`Cause` objects.
    ``record_noop_p2p``: a 1F1B trace also has no-op records for the p2p calls skipped
    at the pipeline ends (the published traces do not; interleaved traces always do).

``Cause(kind, params)``
    One root cause; kinds in ``CAUSE_KINDS``: slow_worker, last_stage_imbalance,
    seq_len_imbalance, gc_pauses, comm_flapping, untraced_cpu (parameters in
    :mod:`transforms.synth.faults`).

``generate_job(spec) -> GeneratedJob``
    ``.trace``: pyarrow Table in schemas.trace.TRACE_SCHEMA (job_id, host per worker,
    seq_lens on compute rows when recorded; start_ts are per-step offsets, seconds);
    ``.parts``/``.files()``: one slice per (session, stage) = one lake file;
    ``.manifest``: one-row MANIFEST_SCHEMA table; ``.truth``: dict, one row of
    ``TRUTH_SCHEMA`` (causes, parameters, affected workers, fault-free and ideal step
    times, true and expected slowdown); ``.meta``: transforms.whatif.result.JobMeta.
    Deterministic: the same spec gives the same tables.

``sample_fleet(days, jobs_per_day, seed, start_date=2024-01-01, *, max_records=2e6) -> list[JobSpec]``
    A fleet like the paper's (128 to 6,144 GPUs, heavy-tailed; dense/MoE; 4k-128k
    context; ~40% of jobs straggling); jobs are capped at ``max_records`` op records.

``write_fleet(lake_url, specs, *, bad_fraction=0.0, seed=0, processes=None, progress=None) -> FleetSummary``
    Writes traces/date=D/job_id=J/part-sSS-pPPP.parquet (one file per session and
    stage, all DP ranks of that stage) and manifests/date=D/J.parquet, corrupts
    ``bad_fraction`` of the jobs (:mod:`transforms.synth.badinput`), and writes the
    answer key ``{lake}/_truth/truth.parquet`` (``TRUTH_SCHEMA``; never read by analysis).

How it works: :mod:`~transforms.synth.program` builds the step program of a job shape
(1F1B or interleaved schedule with blocking batched p2p, ZeRO collectives, the step
tail); :mod:`~transforms.synth.execution` simulates it vectorised over (step, dp_rank);
:mod:`~transforms.synth.faults` injects causes; :mod:`~transforms.synth.job` and
:mod:`~transforms.synth.fleet` assemble jobs and fleets.
"""
from __future__ import annotations

from schemas.truth import TRUTH_SCHEMA
from transforms.synth.execution import Timing
from transforms.synth.faults import CAUSE_KINDS, Cause
from transforms.synth.fleet import TRUTH_PATH, FleetSummary, sample_fleet, truth_table, write_fleet
from transforms.synth.job import GeneratedJob, JobSpec, generate_job

__all__ = [
    "JobSpec",
    "Cause",
    "CAUSE_KINDS",
    "Timing",
    "GeneratedJob",
    "generate_job",
    "sample_fleet",
    "write_fleet",
    "FleetSummary",
    "TRUTH_SCHEMA",
    "TRUTH_PATH",
    "truth_table",
]
