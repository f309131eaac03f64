"""AnalyzeSessions: the what-if engine on each assembled profiling session.

In: `Assembly` (transforms/live/sessions.py). Out: one live result row per assembly (a dict
shaped like schemas.live.LIVE_RESULT_SCHEMA, times as epoch seconds), and on the
'quarantine' output QUARANTINE_SCHEMA rows (plus `seen_time`) for everything rejected.

A session is read and validated like a batch job window (the same Validator), then:
- complete: analysed as is;
- incomplete (timeout, or the watcher stopped): the DP ranks that have every stage are
  analysed, renumbered 0..k-1 as a job of dp_size k (a missing worker breaks its DP
  rank's pipeline, but the other ranks replay correctly); the row says which workers
  were missing and how many DP ranks were analysed; values are mapped back to the
  original DP ranks (the heatmap leaves missing workers empty);
- no manifest, no complete DP rank, or a trace the engine rejects: a `failed` row whose
  `error` says why, and quarantine rows naming the job, the file and the op.

A Kineto session (torch.profiler traces, one per rank, and an optional job.yaml) is first
converted as a raw window is (transforms.ingest.convert_window, the batch's converter),
then validated and analysed like the rest. Its row counts ranks (`workers_expected` = the
world size, `missing_ranks`). Ranks missing at the timeout are analysed around only when
the method allows it (a TP/CP peer, collapsed onto its lowest rank anyway): the row is
analysed but not `complete`. Otherwise the converter refuses the session
(`raw_missing_rank`, or any raw reason code): a `failed` row, and quarantine rows with that
reason; a trace the converter sets aside (`raw_unreadable`) is quarantined too.
"""
from __future__ import annotations

import dataclasses
import json
import time
import traceback
from typing import Any, Callable

import apache_beam as beam
import numpy as np
from apache_beam.utils.windowed_value import WindowedValue
import pyarrow as pa

from schemas.expectations import MISSING_MANIFEST, MISSING_WORKERS, JobFiles, Problem
from schemas.lake import LANDING
from schemas.tables import QUARANTINE_SCHEMA
from transforms.io.lake import LakeJob, LakeReadError, read_job_files, read_manifest
from transforms.resources import keep_freed_memory, use_system_allocator
from transforms.live.sessions import RAW_FORMATS, Assembly
from transforms.whatif.causes import CauseError, analyze_and_classify
from transforms.whatif.errors import WhatIfError
from transforms.whatif.result import JobMeta, WhatIfResult

__all__ = ["AnalyzeSessions", "analyze_session", "analyze_sessions", "complete_dp_ranks", "NO_COMPLETE_DP_RANK", "ENGINE_ERROR"]

NO_COMPLETE_DP_RANK = "no_complete_dp_rank"
ENGINE_ERROR = "engine_error"
UNEXPECTED_ERROR = "unexpected_error"
_REASONS = {
    UNEXPECTED_ERROR: "an unexpected error stopped the analysis of this session (a bug or a storage failure); "
                      "see detail; the watcher went on",
    NO_COMPLETE_DP_RANK: "no DP rank of the session has all its stages (or, with DP comm, fewer than two do); "
                         "wait for the missing worker files or check the profiler on those workers",
    ENGINE_ERROR: "the what-if engine cannot analyse this session's trace; fix the trace writer",
}


def complete_dp_ranks(present: set[tuple[int, int]], dp_size: int, pp_size: int) -> list[int]:
    """DP ranks whose every stage is present, ascending."""
    return [dp for dp in range(dp_size) if all((dp, stage) in present for stage in range(pp_size))]


def _lake_of(path: str) -> str:
    marker = f"/{LANDING}/"
    return path[: path.rindex(marker)] if marker in path else path.rsplit("/", 4)[0]


def _base_row(assembly: Assembly) -> dict[str, Any]:
    kineto = assembly.fmt in RAW_FORMATS   # counted in ranks
    return {
        "job_id": assembly.job_id,
        "session": assembly.session,
        "revision": assembly.revision,
        "reason": assembly.reason,
        "status": "failed",
        "error": None,
        "complete": assembly.complete,
        "workers_expected": len(assembly.expected),
        "workers_present": len(assembly.worker_paths),
        "missing_workers": [] if kineto else [{"dp_rank": dp, "stage": stage} for dp, stage in assembly.missing],
        "missing_ranks": list(assembly.missing) if kineto else None,
        "source_format": assembly.fmt,
        "dp_ranks_analysed": 0,
        "duplicate_deliveries": assembly.duplicate_deliveries,
        "first_arrival": assembly.first_arrival,
        "assembled": assembly.assembled,
    }


def _quarantine(job: LakeJob, problems: list[Problem], invalid: pa.Table | None = None) -> pa.Table:
    from transforms.batch.read_windows import quarantine_rows

    return quarantine_rows(job, problems, invalid)


def _job_record(job_id: str, path: str, code: str, detail: str, rows: int) -> pa.Table:
    """One job-level quarantine row for a session the streaming monitor cannot analyse."""
    return pa.Table.from_pylist([{"job_id": job_id, "source_path": path, "level": "job", "reason_code": code,
                                  "reason": _REASONS[code], "detail": detail, "row_index": None, "rows": rows}],
                                schema=QUARANTINE_SCHEMA)


def _remap_dp_ranks(trace: pa.Table, kept: list[int]) -> pa.Table:
    """Keep rows of the `kept` DP ranks and renumber them 0..len(kept)-1."""
    lookup = np.full(max(kept) + 1, -1, dtype=np.int16)
    lookup[kept] = np.arange(len(kept), dtype=np.int16)
    dp = trace.column("dp_rank").to_numpy()
    mask = np.isin(dp, kept)
    trace = trace.filter(pa.array(mask))
    renumbered = lookup[trace.column("dp_rank").to_numpy()]
    position = trace.schema.get_field_index("dp_rank")
    return trace.set_column(position, trace.schema.field(position), pa.array(renumbered, pa.int16()))


def _engine_meta(manifest: dict, dp_size: int) -> JobMeta:
    """The job's JobMeta with dp_size set to the number of DP ranks analysed."""
    meta = JobMeta.from_mapping(manifest)
    if dp_size == meta.dp_size:
        return meta
    return dataclasses.replace(meta, dp_size=dp_size, world_size=dp_size * meta.pp_size * meta.tp_size * meta.dsp_size)


def _result_fields(result: WhatIfResult, kept: list[int], dp_size: int, pp_size: int) -> dict[str, Any]:
    heatmap = [None] * (dp_size * pp_size)
    if result.worker_slowdown is not None:
        values = np.asarray(result.worker_slowdown, dtype=np.float64)
        for compact, dp in enumerate(kept):
            for stage in range(pp_size):
                heatmap[dp * pp_size + stage] = float(values[compact, stage])
    return {"status": "discarded" if result.discarded else "analysed", "n_steps": int(len(result.steps)),
            "worker_slowdown": heatmap, **result.headline()}


@dataclasses.dataclass
class _Opened:
    """A session whose manifest was read (or made by the converter): waiting for validation with the
    others of its bundle. folder: the session's landing folder; quarantine: rows already found
    (raw files the converter set aside)."""

    assembly: Assembly
    row: dict[str, Any]
    job: LakeJob
    manifest: dict[str, Any]
    files: list
    folder: str = ""
    quarantine: pa.Table | None = None

    @property
    def manifest_path(self) -> str:
        """What validation names as the manifest: its file, or the folder of a converted session."""
        return self.assembly.manifest_path or self.folder


def _session_folder(assembly: Assembly) -> str:
    """The landing folder of a session, from any of its files."""
    for path in (assembly.manifest_path, assembly.options_path, *assembly.worker_paths.values()):
        if path:
            return path.rsplit("/", 1)[0]
    return f"{LANDING}/{assembly.job_id}/{assembly.session}"


def _raw_rows(job_id: str, folder: str, errors) -> pa.Table:
    """Quarantine rows (QUARANTINE_SCHEMA) of raw input errors: one per trace set aside or session refused."""
    from schemas.expectations import REASONS

    return pa.Table.from_pylist(
        [{"job_id": job_id, "source_path": error.path or folder, "level": error.level, "reason_code": error.reason_code,
          "reason": REASONS[error.reason_code][1], "detail": str(error.with_job(job_id)), "row_index": None,
          "rows": None} for error in errors], schema=QUARANTINE_SCHEMA)


def _open_raw(assembly: Assembly) -> _Opened | tuple[dict[str, Any], pa.Table]:
    """Convert a raw session's rank files, Kineto traces or NDTimeline records (the batch's converter); (row,
    quarantine) at once when it refuses them."""
    from transforms.ingest import RawInputError, convert_window

    row = _base_row(assembly)
    folder = _session_folder(assembly)
    day = time.strftime("%Y-%m-%d", time.gmtime(assembly.first_arrival))
    traces = [assembly.worker_paths[rank] for rank in sorted(assembly.worker_paths)]
    paths = traces + ([assembly.options_path] if assembly.options_path else [])
    try:
        converted = convert_window(assembly.fmt, paths, assembly.job_id, day)
    except RawInputError as error:
        missing = (f"; rank(s) {', '.join(map(str, assembly.missing))} of {len(assembly.expected)} had not landed "
                   f"({assembly.reason})" if assembly.missing else "")
        row["error"] = f"session {assembly.session}: {error} [{error.reason_code}]{missing}"
        return row, _raw_rows(assembly.job_id, folder, [*error.rejected, error])
    lake = _lake_of(folder + "/x")
    job = LakeJob(lake, day, assembly.job_id, tuple(paths), None)
    row.update(dp_size=int(converted.manifest["dp_size"]), pp_size=int(converted.manifest["pp_size"]))
    rejected = _raw_rows(assembly.job_id, folder, converted.rejected) if converted.rejected else None
    return _Opened(assembly, row, job, {**converted.manifest, "source": converted.source}, [(folder, converted.trace)], folder, rejected)


def _open(assembly: Assembly, validator) -> _Opened | tuple[dict[str, Any], pa.Table]:
    """Read a session's manifest and files; (row, quarantine) at once when there is no usable manifest."""
    if assembly.fmt in RAW_FORMATS:
        return _open_raw(assembly)
    row = _base_row(assembly)
    paths = tuple(assembly.worker_paths[w] for w in sorted(assembly.worker_paths))
    day = time.strftime("%Y-%m-%d", time.gmtime(assembly.first_arrival))
    if not assembly.manifest_path:
        lake = _lake_of(paths[0]) if paths else ""
        row["error"] = (f"job {assembly.job_id} session {assembly.session}: no manifest.parquet arrived "
                        f"({assembly.reason}); the parallelism (dp, pp) is unknown, so it cannot be analysed")
        folder = paths[0].rsplit("/", 1)[0] if paths else f"{LANDING}/{assembly.job_id}/{assembly.session}"
        problem = Problem(MISSING_MANIFEST, assembly.job_id, folder, row["error"], 0)
        return row, _quarantine(LakeJob(lake, day, assembly.job_id, paths, None), [problem])
    lake = _lake_of(assembly.manifest_path)
    try:
        manifest = read_manifest(assembly.manifest_path)
    except LakeReadError as error:
        row["error"] = str(error)
        job = LakeJob(lake, day, assembly.job_id, paths, assembly.manifest_path)
        return row, _quarantine(job, validator.unreadable(assembly.manifest_path, error, assembly.job_id, manifest=True).problems)
    job = LakeJob(lake, manifest["date"].isoformat(), assembly.job_id, paths, assembly.manifest_path)
    row.update(dp_size=int(manifest["dp_size"]), pp_size=int(manifest["pp_size"]))
    return _Opened(assembly, row, job, manifest, read_job_files(job))


def analyze_sessions(
    assemblies: list[Assembly],
    validator,
    engine: Callable[[pa.Table, Any, str], tuple[WhatIfResult, Any]],
) -> list[tuple[dict[str, Any], pa.Table]]:
    """Assembled sessions -> one (live result row, quarantine rows) each, in order.

    The sessions are validated together (one GX run for their manifests, one screen run for
    their traces), as the batch validates a window group: GX's cost is per run, not per row,
    so a watcher that falls behind catches up with bigger bundles. validator: a
    transforms.validation.Validator; engine: (trace, meta, job_id) -> (WhatIfResult, root-cause
    Verdict or None), e.g. `analyze_and_classify`.
    """
    opened = [_open(assembly, validator) for assembly in assemblies]
    waiting = [item for item in opened if isinstance(item, _Opened)]
    # The session manifest is not named after the job (the batch layout's rule), so the path
    # is given only for reporting.
    manifest_issues = [[dataclasses.replace(p, source_path=item.manifest_path) for p in issues]
                       for item, issues in zip(waiting, validator.validate_manifests([(None, w.manifest) for w in waiting]))]
    reports = validator.validate_jobs([
        JobFiles(item.assembly.job_id, None if issues else item.manifest, tuple(item.files),
                 item.manifest_path, tuple(issues))
        for item, issues in zip(waiting, manifest_issues)])
    finished = {id(item): _analyse(item, report, engine) for item, report in zip(waiting, reports)}
    return [finished[id(item)] if isinstance(item, _Opened) else item for item in opened]


def analyze_session(assembly: Assembly, validator, engine) -> tuple[dict[str, Any], pa.Table]:
    """One assembled session -> (live result row, quarantine rows); see `analyze_sessions`."""
    return analyze_sessions([assembly], validator, engine)[0]


def _analyse(item: _Opened, report, engine) -> tuple[dict[str, Any], pa.Table]:
    """A validated session -> its row: analysed on its complete DP ranks, or failed with the reason."""
    assembly, row, job, manifest = item.assembly, item.row, item.job, item.manifest
    dp_size, pp_size = int(manifest["dp_size"]), int(manifest["pp_size"])
    # Missing workers are expected in an incomplete session: reported in the row, analysed around.
    problems = [p for p in report.problems if p.reason != MISSING_WORKERS]
    quarantine = _quarantine(job, problems, report.invalid)
    if item.quarantine is not None:
        quarantine = pa.concat_tables([item.quarantine, quarantine])
    folder = item.folder or assembly.manifest_path.rsplit("/", 1)[0]
    blocking = [p for p in problems if p.level == "job"]
    if blocking:
        row["error"] = "; ".join(p.detail for p in blocking)
        return row, quarantine
    valid = report.valid
    present = set(zip(valid.column("dp_rank").to_pylist(), valid.column("stage").to_pylist())) if valid.num_rows else set()
    kept = complete_dp_ranks(present, dp_size, pp_size)
    dsp_size = int(manifest["dsp_size"])
    if kept and len(kept) * dsp_size == 1 and dp_size * dsp_size > 1:
        # The engine models DP collectives only when dp x cp > 1; a single DP rank of a
        # data-parallel job would leave its DP comm ops without a place in the graph.
        kept = []
    if not kept:
        row["error"] = (f"job {assembly.job_id} session {assembly.session}: too few DP ranks have valid rows for all "
                        f"{pp_size} stages to analyse ({len(present)} of {dp_size * pp_size} workers present; "
                        f"{len(complete_dp_ranks(present, dp_size, pp_size))} complete DP rank(s), at least "
                        f"{1 if dp_size * dsp_size == 1 else 2} needed)")
        extra = _job_record(assembly.job_id, folder, NO_COMPLETE_DP_RANK, row["error"], valid.num_rows)
        return row, pa.concat_tables([quarantine, extra])
    trace = valid if len(kept) == dp_size else _remap_dp_ranks(valid, kept)
    row["dp_ranks_analysed"] = len(kept)
    try:
        result, verdict = engine(trace, _engine_meta(manifest, len(kept)), assembly.job_id)
    except (WhatIfError, CauseError) as error:
        row["error"] = f"session {assembly.session}: {error}"
        extra = _job_record(assembly.job_id, getattr(error, "file", None) or folder, ENGINE_ERROR, row["error"],
                            trace.num_rows)
        return row, pa.concat_tables([quarantine, extra])
    row.update(_result_fields(result, kept, dp_size, pp_size))
    if verdict is not None:
        row["verdict"], row["verdict_confidence"] = verdict.cause, float(verdict.confidence)
        row["verdict_explanation"] = verdict.explanation
        row["blamed"] = blamed_workers(verdict, result, trace, kept)
        fix = verdict.primary_fix
        row["verdict_saving"] = None if fix is None else float(max(fix.savings_fraction, 0.0))
        row["undecided_workers"] = len((verdict.evidence.get("worker_test") or {}).get("undecided") or ())
        if verdict.worker_summary is not None and len(kept) == dp_size:   # windows pool only whole layouts
            row["worker_summary"] = json.dumps({**verdict.worker_summary, "where": worker_places(trace)})
    return row, quarantine


def worker_places(trace: pa.Table) -> list[list]:
    """[dp_rank, stage, global rank, host] of every worker of a trace (host None when not recorded)."""
    dp = trace.column("dp_rank").to_numpy()
    stage = trace.column("stage").to_numpy()
    _, first = np.unique(dp.astype(np.int64) * 65536 + stage, return_index=True)
    ranks = trace.column("rank").take(pa.array(first)).to_pylist()
    hosts = (trace.column("host").take(pa.array(first)).to_pylist() if "host" in trace.column_names
             else [None] * len(first))
    return [[int(dp[i]), int(stage[i]), rank, host] for i, rank, host in zip(first, ranks, hosts)]


def blamed_workers(verdict, result: WhatIfResult, trace: pa.Table, kept: list[int]) -> list[dict]:
    """The verdict's workers as the pages name them: global rank, DP rank (the job's numbering, not
    the analysed ranks'), stage, host, its slower kind of work (forward, backward) over its DP peers' and the steps it was
    slow in (the worker
    test's findings), then any other implicated worker (no ratio: not measured against peers)."""
    where = {(d, p): (rank, host) for d, p, rank, host in worker_places(trace)}
    steps = np.asarray(result.steps).tolist()
    implicated = [(int(d), int(p)) for d, p in verdict.implicated_workers]
    out, seen = [], set()
    measured = [*(verdict.evidence.get("peer_workers") or ()),     # against DP peers (workers.worker_tests)
                *({**f, f["kind"]: f["ratio"]} for f in verdict.evidence.get("balance_workers") or ())]   # balance_tests
    for finding in measured:
        worker = (int(finding["dp_rank"]), int(finding["stage"]))
        if worker not in implicated or worker in seen:
            continue
        rank, host = where.get(worker, (None, None))
        kinds = {kind: float(finding[kind]) for kind in ("forward", "backward") if finding.get(kind) is not None}
        work = max(kinds, key=kinds.get) if kinds else None
        out.append({"rank": rank, "dp_rank": kept[worker[0]], "stage": worker[1], "host": host,
                    "ratio": kinds[work] if work else float(finding["ratio"]), "work": work,
                    "steps": [steps[i] for i in finding.get("step_indices") or () if i < len(steps)]})
        seen.add(worker)
    for worker in implicated:
        if worker not in seen:
            seen.add(worker)
            rank, host = where.get(worker, (None, None))
            out.append({"rank": rank, "dp_rank": kept[worker[0]], "stage": worker[1], "host": host, "ratio": None, "work": None,
                        "steps": None})
    return out


class _AnalyzeSessionFn(beam.DoFn):
    """Assemblies -> live rows, analysed per bundle (`analyze_sessions`); quarantine rows (dicts
    with seen_time) on 'quarantine'; a session whose analysis raised a bug's exception -> one
    row on 'unexpected' (the watcher goes on). Storage failures (OSError, after the IO layer's
    retries) are not bad data: they stop the watcher loud, and its sessions are still in the
    landing area when it restarts."""

    def setup(self):
        from transforms.validation import Validator

        use_system_allocator()
        keep_freed_memory()
        self._validator = Validator()

    def start_bundle(self):
        self._pending: list[tuple[Assembly, Any, Any]] = []

    def process(self, assembly: Assembly, timestamp=beam.DoFn.TimestampParam, window=beam.DoFn.WindowParam):
        self._pending.append((assembly, timestamp, window))

    def finish_bundle(self):
        pending, self._pending = self._pending, []
        if not pending:
            return
        assemblies = [assembly for assembly, _, _ in pending]
        try:
            outcomes = [_tagged(assembly, *result) for assembly, result in
                        zip(assemblies, analyze_sessions(assemblies, self._validator, analyze_and_classify))]
        except OSError:
            raise
        except Exception:  # a bug in one session must not stop the others: analyse them one by one
            outcomes = [self._alone(assembly) for assembly in assemblies]
        for (assembly, timestamp, window), outcome in zip(pending, outcomes):
            for tag, value in outcome:
                out = WindowedValue(value, timestamp, [window])
                yield out if tag is None else beam.pvalue.TaggedOutput(tag, out)

    def _alone(self, assembly: Assembly) -> list[tuple[str | None, dict]]:
        try:
            return _tagged(assembly, *analyze_session(assembly, self._validator, analyze_and_classify))
        except OSError:
            raise
        except Exception as error:
            return [("unexpected", _unexpected_record(assembly, error))]


def _tagged(assembly: Assembly, row: dict[str, Any], quarantine: pa.Table) -> list[tuple[str | None, dict]]:
    """(output tag, value) pairs of one analysed session: its quarantine rows, then its live row."""
    row["analysed"] = time.time()
    beam.metrics.Metrics.counter("strag.sessions", row["status"]).inc()
    records = quarantine.to_pylist()
    for record in records:
        record["seen_time"] = assembly.assembled
        record["session"] = assembly.session
    return [*(("quarantine", record) for record in records), (None, row)]


def _unexpected_record(assembly: Assembly, error: BaseException) -> dict:
    """One job-level quarantine row for a session whose analysis raised an unexpected error."""
    trace_text = "".join(traceback.format_exception(error))
    detail = f"session {assembly.session} r{assembly.revision}: {type(error).__name__}: {error}; {trace_text[-600:]}"
    folder = _session_folder(assembly) if (assembly.manifest_path or assembly.worker_paths) else ""
    record = _job_record(assembly.job_id, folder, UNEXPECTED_ERROR, detail, 0).to_pylist()[0]
    record.update(seen_time=assembly.assembled, session=assembly.session)
    return record


class AnalyzeSessions(beam.PTransform):
    """PCollection[Assembly] -> {'results': live result rows, 'quarantine': quarantine rows
    (dicts + session, seen_time), 'unexpected': quarantine rows of sessions whose analysis
    raised an unexpected error (the watcher goes on)}."""

    def expand(self, assemblies):
        analysed = assemblies | "AnalyzeSession" >> beam.ParDo(_AnalyzeSessionFn()).with_output_types(
            dict, quarantine=dict, unexpected=dict).with_outputs("quarantine", "unexpected", main="results")
        return {"results": analysed.results, "quarantine": analysed.quarantine, "unexpected": analysed.unexpected}
