"""AnalyzeJobs: read, validate and analyse each job window on one worker; emit its result tables.

In: PCollection[WindowGroup] (MatchJobs: windows' files and their validated manifests). Out:
PCollection[JobOutcome]: per window, Arrow tables for job_summary, step_slowdown,
worker_attribution, dp/stage/optype_attribution, job_cause, coverage and quarantine
(schemas/tables.py and schemas/fleet.py, without the `date` partition key).

- The job window is the unit of parallelism: the worker that gets a window reads its
  trace files itself, validates them (transforms/batch/read_windows.py: GX suites + structural
  checks) and runs the engine; only the small result tables are shuffled afterwards.
- Validation problems quarantine rows, files or the whole window (see validate.py).
- A typed engine error (transforms/whatif/errors.py: bad structure, missing peer, cycle,
  too few steps, ...) quarantines that window with the error's reason code; an unexpected
  exception (a bug meeting odd data) quarantines it as `unexpected_error` (caught per window,
  and per group in the DoFn: `quarantine_on_error`). Neither stops the run. A storage failure
  (OSError after the IO layer's retries, transforms/io/storage.py) does: it is not bad data, and
  nothing is published.
- A window whose replay discrepancy (launch_slowdown) is off by more than 5% either way is `discarded`: its rows
  are written (flagged in job_summary) and coverage records the reason, but fleet
  statistics leave it out.
- With timelines on (`strag batch --timelines`), each straggling kept window's original and
  ideal timelines (the analysis's own ideal replay, its first steps up to
  transforms.whatif.timeline.EVENT_LIMIT events) are written to the run's staging folder as
  Chrome-trace JSON; the commit step publishes them with the tables (schemas/tables.py).
"""
from __future__ import annotations

import functools
import math
import sys
import time
from typing import Any, Iterator

import apache_beam as beam
import numpy as np
import pyarrow as pa

from schemas.tables import (
    DP_ATTRIBUTION_SCHEMA,
    JOB_SUMMARY_SCHEMA,
    OPTYPE_ATTRIBUTION_SCHEMA,
    QUARANTINE_SCHEMA,
    STAGE_ATTRIBUTION_SCHEMA,
    STEP_SLOWDOWN_SCHEMA,
    WORKER_ATTRIBUTION_SCHEMA,
    timeline_path,
)
from transforms.ingest.common import describe_source
from transforms.batch.elements import ENGINE_PARTS, JobOutcome, JobProblem, MatchedJob, ValidatedJob, WindowGroup
from transforms.batch.outcomes import (
    QUARANTINED_ERRORS,
    count_quarantine_error,
    coverage_row,
    error_details,
    gpu_hours,
    quarantine_on_error,
    quarantined_outcome,
    source_format,
    unexpected_error_outcome,
)
from transforms.resources import prepare_batch_worker
from transforms.batch.read_windows import count_quarantine, validate_job_window, validate_job_windows, worker_validator
from transforms.whatif.causes import analyze_and_classify, job_cause_table   # the batch's one way into the engine
from transforms.whatif.errors import WhatIfError
from transforms.whatif.result import JobMeta, WhatIfResult, discrepancy_reason

__all__ = [
    "AnalyzeJobs",
    "analyze_window",
    "analyze_matched_window",
    "analyze_group",
    "progress_line",
    "job_meta",
    "gpu_hours",
    "result_tables",
    "DISCREPANCY_REASON_CODE",
]

DISCREPANCY_REASON_CODE = "replay_discrepancy"


def job_meta(manifest: dict[str, Any]) -> JobMeta:
    """The engine's JobMeta from a manifest row (with its `source`, when a converted raw job has one)."""
    return JobMeta.from_mapping(manifest)


def _discard_reason(result: WhatIfResult) -> str | None:
    if not result.discarded:
        return None
    return f"{discrepancy_reason(result.replay_discrepancy)}; kept out of fleet statistics"


def _optional(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _attribution(schema: pa.Schema, group: str, job_id: str, steps: np.ndarray,
                 overall: dict | None, per_step: np.ndarray | dict | None, keys: list) -> pa.Table:
    """Long table: one row per group (step null) then one per (group, step)."""
    if overall is None:
        return schema.empty_table()
    groups, step_column, values = [], [], []
    for position, key in enumerate(keys):
        groups.append(key)
        step_column.append(None)
        values.append(float(overall[key]))
        if per_step is not None:
            column = per_step[key] if isinstance(per_step, dict) else per_step[:, position]
            groups += [key] * len(steps)
            step_column += steps.tolist()
            values += np.asarray(column, dtype=np.float64).tolist()
    return pa.table({"job_id": [job_id] * len(groups), group: groups, "step": pa.array(step_column, pa.int64()), "slowdown": values},
                    schema=schema)


def _recorded_setup(source) -> dict:
    """job_summary's device and grads_collective, as converted profiler output recorded them (None
    elsewhere): what the pages need to say rank-hours of CPU ranks, and DDP's all-reduce by its name."""
    source = source if isinstance(source, dict) else {}
    return {"device": source.get("device"), "grads_collective": source.get("grads_collective")}


def _step_verdict(verdict, manifest: dict, n_steps: int, kept: bool) -> dict[str, list]:
    """step_slowdown's verdict columns: per profiled step, the global ranks of the blamed workers
    found slow in it, the primary cause and the seconds its fix saves there (a discarded window's
    fixes replay nothing: its slow ranks only)."""
    if verdict is None:
        return {"slow_ranks": [None] * n_steps, "fix_cause": [None] * n_steps, "fix_saving": [None] * n_steps}
    rank = {(int(w["dp_rank"]), int(w["stage"])): int(w["rank"]) for w in manifest["workers"]}
    ranks: list[list[int]] = [[] for _ in range(n_steps)]
    for worker, steps in verdict.slow_steps().items():
        for step in steps:
            if 0 <= step < n_steps and worker in rank:
                ranks[step].append(rank[worker])
    fix = verdict.primary_fix if kept else None
    savings = fix.step_savings if fix is not None and fix.step_savings is not None and len(fix.step_savings) == n_steps else None
    return {"slow_ranks": [sorted(set(r)) for r in ranks],
            "fix_cause": [fix.cause if savings is not None else None] * n_steps,
            "fix_saving": list(savings) if savings is not None else [None] * n_steps}


def result_tables(validated: ValidatedJob, result: WhatIfResult, verdict=None) -> dict[str, pa.Table]:
    """The per-window rows of every per-job table from one engine result (schemas/tables.py).

    verdict: the root-cause Verdict (transforms/whatif/causes.py) or None; it fills the
    verdict columns of job_summary for windows that are not discarded.
    """
    job, manifest, stats = validated.job, validated.manifest, validated.stats
    meta = result.meta
    hours = gpu_hours(manifest)
    attributed = result.by_dp_rank is not None
    steps = np.asarray(result.steps, dtype=np.int64)
    summary = {
        "job_id": job.job_id,
        "gpus": int(manifest["gpus"]),
        "dp_size": meta.dp_size, "pp_size": meta.pp_size, "tp_size": meta.tp_size,
        "dsp_size": meta.dsp_size, "vpp_size": meta.vpp_size, "world_size": meta.world_size,
        "parallelism": f"dp{meta.dp_size}-pp{meta.pp_size}-tp{meta.tp_size}-cp{meta.dsp_size}-vpp{meta.vpp_size}",
        "model_family": manifest["model_family"],
        "context_length": int(manifest["context_length"]),
        "start_time": manifest["start_time"],
        "end_time": manifest["end_time"],
        "n_steps": int(steps.size),
        "n_ops": stats.ops,
        "n_microbatches": None if result.evidence is None else result.evidence.microbatches,
        "dp_peers": None if result.evidence is None else result.evidence.dp_peers,
        "evidence_limits": None if result.evidence is None else result.evidence.limits,
        "step_time_observed": float(np.mean(result.step_t_base)),
        "step_time": float(np.mean(result.model_step_t)),
        "step_time_ideal": float(np.mean(result.step_t_noblk)),
        "gpu_hours": hours,
        "wasted_gpu_hours": hours * float(result.waste),
        "untraced_workers": None if result.untraced is None else [
            {"dp_rank": int(d), "stage": int(p)} for d, p in result.untraced.workers],
        "discard_reason": _discard_reason(result),
        "attributed": attributed,
        "m_w_add": _optional(result.mw.add) if result.mw else None,
        "m_s_add": _optional(result.ms.add) if result.ms else None,
        "cause": None, "causes": None, "cause_confidence": None, "savings_gpu_hours": None,
        "source_format": source_format(job, manifest),
        "source": describe_source(manifest["source"]) if isinstance(manifest.get("source"), dict) else None,
        **_recorded_setup(manifest.get("source")),
        **{name: value for name, value in result.headline().items() if name not in ("steps", "step_slowdown")},
    }
    if verdict is not None and not result.discarded:
        summary.update(cause=verdict.cause, causes=list(verdict.causes), cause_confidence=float(verdict.confidence),
                       savings_gpu_hours=float(verdict.savings_gpu_hours(hours)))
    step_slowdown = pa.table(
        {
            "job_id": [job.job_id] * steps.size,
            "step": steps,
            "step_time_observed": np.asarray(result.step_t_base, np.float64),
            "step_time": np.asarray(result.model_step_t, np.float64),
            "step_time_ideal": np.asarray(result.step_t_noblk, np.float64),
            "slowdown": np.asarray(result.model_step_slowdown, np.float64),
            **_step_verdict(verdict, manifest, steps.size, kept=not result.discarded),
        },
        schema=STEP_SLOWDOWN_SCHEMA,
    )

    workers = sorted(manifest["workers"], key=lambda w: (w["dp_rank"], w["stage"]))
    mw_set = {tuple(w) for w in result.mw.workers} if result.mw else set()
    worker_rows = []
    for worker in workers:
        dp, stage = int(worker["dp_rank"]), int(worker["stage"])
        row = {"job_id": job.job_id, "dp_rank": dp, "stage": stage, "rank": worker["rank"], "host": worker["host"],
               "slowdown_dp": None, "slowdown_stage": None, "slowdown_worker": None, "in_mw_set": None}
        if attributed:
            row.update(slowdown_dp=float(result.by_dp_rank[dp]), slowdown_stage=float(result.by_stage[stage]),
                       slowdown_worker=float(result.worker_slowdown[dp, stage]), in_mw_set=(dp, stage) in mw_set)
        worker_rows.append(row)

    tables = {
        "job_summary": pa.Table.from_pylist([summary], schema=JOB_SUMMARY_SCHEMA),
        "step_slowdown": step_slowdown,
        "worker_attribution": pa.Table.from_pylist(worker_rows, schema=WORKER_ATTRIBUTION_SCHEMA),
        "dp_attribution": _attribution(DP_ATTRIBUTION_SCHEMA, "dp_rank", job.job_id, steps, result.by_dp_rank,
                                       result.by_dp_rank_per_step, sorted(result.by_dp_rank or ())),
        "stage_attribution": _attribution(STAGE_ATTRIBUTION_SCHEMA, "stage", job.job_id, steps, result.by_stage,
                                          result.by_stage_per_step, sorted(result.by_stage or ())),
        "optype_attribution": _attribution(OPTYPE_ATTRIBUTION_SCHEMA, "optype", job.job_id, steps, result.by_optype,
                                           result.by_optype_per_step, sorted(result.by_optype or ())),
        "quarantine": validated.quarantine,
    }
    status = "discarded" if result.discarded else "analysed"
    tables["coverage"] = coverage_row(job, status, stats, reason_code=DISCREPANCY_REASON_CODE if result.discarded else None,
                                      reason=summary["discard_reason"], manifest=manifest, launch_slowdown=summary["launch_slowdown"],
                                      kept_by=result.kept_by)
    return tables


def analyze_window(validated: ValidatedJob, engine, timelines: str | None = None) -> JobOutcome:
    """Analyse one validated window with `engine(trace, meta, job_id) -> WhatIfResult` (plain function),
    or `-> (WhatIfResult, Verdict)`: then the window also gets its `job_cause` row (a discarded one's
    verdict measured only, the row saying it is discarded).

    timelines: a folder URL (the run's staging); when set, the engine must keep the timeline
    (`timeline=True`), and a straggling kept window's timeline is written under it
    (schemas.tables.timeline_path; stats.timeline says so). Typed engine errors quarantine
    the window (reason code = the error's `reason`).
    """
    job, stats = validated.job, validated.stats
    if validated.problem is not None or validated.trace is None:
        raise ValueError(f"job {job.job_id} on {job.date}: analyze_window got a quarantined window ({validated.problem})")
    stats.ops = validated.trace.num_rows
    started = time.perf_counter()
    try:
        result = engine(validated.trace, job_meta(validated.manifest), job.job_id)
        # an engine may return (result, root-cause verdict): transforms.whatif.causes.analyze_and_classify
        result, verdict = result if isinstance(result, tuple) else (result, None)
    except WhatIfError as error:
        stats.seconds["analyze"] = time.perf_counter() - started
        error.with_context(job_id=job.job_id)
        path = error.file or f"{job.lake.rstrip('/')}/traces/date={job.date}/job_id={job.job_id}"
        reason = (type(error).__doc__ or error.reason).strip().splitlines()[0] + " The what-if engine cannot analyse this window"
        if stats.rows_quarantined:
            codes = sorted(set(validated.quarantine.column("reason_code").to_pylist()))
            reason += f" after validation rejected {stats.rows_quarantined} of its op rows ({', '.join(codes)}), which likely broke it"
        reason += "; fix the trace writer."
        record = pa.Table.from_pylist(
            [{"job_id": job.job_id, "source_path": path, "level": "job", "reason_code": error.reason, "reason": reason,
              "detail": str(error), "rows": stats.ops}],
            schema=QUARANTINE_SCHEMA,
        )
        count_quarantine(record)
        problem = JobProblem(error.reason, reason, str(error), path)
        return quarantined_outcome(job, problem, pa.concat_tables([validated.quarantine, record]), stats, validated.manifest)
    analysed = time.perf_counter()
    stats.seconds["analyze"] = analysed - started
    if verdict is not None:   # the engine's own parts of "analyze" (ENGINE_PARTS)
        stats.seconds.update({f"analyze.{part}": verdict.timings[part] for part in ENGINE_PARTS if part in verdict.timings})
    tables = result_tables(validated, result, verdict)
    if verdict is not None:
        tables["job_cause"] = job_cause_table(verdict, gpu_hours(validated.manifest), validated.manifest["workers"],
                                              discarded=result.discarded)
    stats.status = "discarded" if result.discarded else "analysed"
    stats.reason_code = DISCREPANCY_REASON_CODE if result.discarded else None
    tabled = time.perf_counter()
    stats.seconds["tables"] = tabled - analysed
    if timelines is not None and result.straggling and not result.discarded:
        _write_timeline(timelines, job.date, job.job_id, result)
        stats.timeline = True
        stats.seconds["timeline"] = time.perf_counter() - tabled
    return JobOutcome(job.job_id, job.date, tables, stats)


def _write_timeline(folder: str, date: str, job_id: str, result: WhatIfResult) -> None:
    """The window's timelines as gzip'd Chrome-trace JSON under `folder` (a storage error is
    an OSError: it fails the run, as any other write of its outputs)."""
    import fsspec

    from transforms.io.lake import write_file_atomic
    from transforms.whatif.timeline import chrome_trace_bytes, first_steps

    if result.timeline is None:
        raise ValueError(f"job {job_id} on {date}: timelines asked for, but the engine kept none (timeline=True)")
    fs, root = fsspec.core.url_to_fs(folder)
    payload = chrome_trace_bytes(result.timeline, first_steps(result.timeline))
    write_file_atomic(fs, f"{root.rstrip('/')}/{timeline_path(date, job_id)}", payload)


def analyze_matched_window(matched: MatchedJob, validator, engine, timelines: str | None = None) -> JobOutcome:
    """One job window from files to outcome on this worker (analyze_group of one window)."""
    return next(analyze_group(WindowGroup((matched,)), validator, engine, timelines))


def analyze_group(group: WindowGroup, validator, engine, timelines: str | None = None) -> Iterator[JobOutcome]:
    """A group of windows from files to outcomes on this worker: read and validate them all
    (transforms/batch/read_windows.py: one GX screen run for the group), then run the engine on each
    window validation did not quarantine whole. Yields one JobOutcome per window, in order.
    timelines: as analyze_window's.

    An unexpected exception quarantines only its window (reason unexpected_error): when
    validating the group together raises, each window is validated alone to find which.
    """
    try:
        validated = validate_job_windows(group.windows, validator)
    except QUARANTINED_ERRORS:
        validated = [_or_error(matched, lambda m=matched: validate_job_window(m, validator)) for matched in group.windows]
    for item in validated:
        if isinstance(item, JobOutcome):
            yield item
            continue
        count_quarantine(item.quarantine)
        if item.problem is not None:
            yield quarantined_outcome(item.job, item.problem, item.quarantine, item.stats, item.manifest)
            continue
        yield _or_error(item, lambda v=item: analyze_window(v, engine, timelines))
        item.trace = None   # the op rows are done with: free them before the next window


def _or_error(element, work):
    """work(), or the quarantined outcome of `element` when it raises unexpectedly."""
    try:
        return work()
    except QUARANTINED_ERRORS as error:   # storage errors (OSError) are not bad data: they fail the run
        count_quarantine_error()
        return unexpected_error_outcome(element, error_details(error))


class _AnalyzeJobFn(beam.DoFn):
    """WindowGroup -> JobOutcome per window: read, validate and analyse in one call.

    One DoFn rather than two fused steps: the DaskRunner materialises each ParDo's whole
    output per partition before the next step runs, so a separate validation step would
    hold the op rows of every window of a partition in memory at once. An unexpected error
    escaping a group quarantines its windows here (quarantine_on_error), not through
    with_exception_handling: on the DaskRunner its second output, flattened back in, would
    double the partitions every later shuffle runs over (their tasks grow with the square).
    """

    def __init__(self, progress: bool = False, timelines: str | None = None):
        super().__init__()
        self._progress = progress
        self._timelines = timelines

    def setup(self):
        # the what-if analysis plus the root-cause verdict (job_cause table), one compile per job
        prepare_batch_worker()   # allocators that reuse freed memory, one Arrow thread per process
        self._validator = worker_validator()
        self._engine = functools.partial(analyze_and_classify, timeline=self._timelines is not None)  # THE ENGINE

    def process(self, group: WindowGroup) -> Iterator[JobOutcome]:
        yield from quarantine_on_error(group, self._outcomes(group))

    def _outcomes(self, group: WindowGroup) -> Iterator[JobOutcome]:
        for outcome in analyze_group(group, self._validator, self._engine, self._timelines):
            beam.metrics.Metrics.counter("strag.jobs", outcome.stats.status).inc()
            beam.metrics.Metrics.counter("strag.ops", "analysed").inc(outcome.stats.ops)
            if self._progress:
                print(progress_line(outcome), file=sys.stderr, flush=True)
            yield outcome


def progress_line(outcome: JobOutcome) -> str:
    """One line per finished window for people watching a long run (worker stderr)."""
    stats = outcome.stats
    summary = outcome.tables.get("job_summary")
    slowdown = f", S {summary.column('slowdown')[0].as_py():.3f}" if summary is not None and summary.num_rows else ""
    reason = f" ({stats.reason_code})" if stats.reason_code else ""
    return (f"  {outcome.date} {outcome.job_id}: {stats.status}{reason}{slowdown}, {stats.ops:,} ops, "
            f"{sum(stats.seconds.values()):.1f} s")


class AnalyzeJobs(beam.PTransform):
    """PCollection[WindowGroup] -> PCollection[JobOutcome] (analysed, discarded or quarantined), one per window.

    progress: print one line per finished window on the worker's stderr; timelines: the run's
    staging URL to write straggling kept windows' timelines under (None: no timelines).
    """

    def __init__(self, progress: bool = False, timelines: str | None = None):
        super().__init__()
        self._progress = progress
        self._timelines = timelines

    def expand(self, matched):
        return matched | "AnalyzeJob" >> beam.ParDo(_AnalyzeJobFn(self._progress, self._timelines)).with_output_types(JobOutcome)
