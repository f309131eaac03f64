"""The validation runtime: applies the lake contract's suites and the checks GX cannot express.

What is checked is declared in `schemas/expectations.py` (reason codes, GX suites, result
types); this module runs it. Checks that need the Arrow types, a whole file or a whole
job (unreadable parquet, missing columns, wrong column types, a worker's rank disagreeing
with the manifest, workers or steps missing from a job, a job with no manifest) are plain
vectorised code here, and report in the same shape as the suites' failures.

Every rejection carries a reason code from `REASONS` and a human detail naming the job,
the file and the op. The batch pipeline builds one `Validator` per worker (in
`DoFn.setup()`: GX's import and context cost ~3 s once) and calls `validate_jobs` per
group of job windows.

How it stays cheap: GX costs ~6 ms per expectation per run whatever the row count, plus
pandas work per row. `validate_jobs` therefore runs GX first on witness rows only
(`witness_rows`: per range column the rows of its min and max, one row per distinct
optype, every row whose op key repeats), for all windows of the group in one run of the
screen suite (`trace_screen_suite`: the trace suite with the manifest's bounds as
columns). Each rule fails on a window iff it fails on its witnesses, so a window the
screen clears has no bad row; one it does not goes through the row-level suites over all
its rows (one GX run), which name every bad row. `validate_file` always runs the row level.

Units: times and durations are seconds.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.expectations import (
    DUPLICATE_ROW,
    FLOAT_COLUMNS,
    INDEX_OUT_OF_RANGE,
    INVALID_MANIFEST,
    INVALID_ROW_SCHEMA,
    JOB_ID_MISMATCH,
    MISSING_COLUMN,
    MISSING_MANIFEST,
    MISSING_STEPS,
    MISSING_WORKERS,
    NEGATIVE_DURATION,
    NO_TRACE_FILES,
    NON_FINITE_TIME,
    NULL_VALUE,
    RANK_MISMATCH,
    RANK_OUT_OF_RANGE,
    REASONS,
    UNKNOWN_OPTYPE,
    UNREADABLE_FILE,
    UNREADABLE_MANIFEST,
    WINDOW,
    WINDOW_JOB_ID,
    WRONG_TYPE,
    JobFiles,
    Problem,
    TraceContractError,
    ValidationReport,
    manifest_suite,
    null_expectations,
    trace_screen_suite,
    trace_suite_parameters,
    value_expectations,
)
from schemas.lake import parse_partition
from schemas.trace import MANIFEST_SCHEMA, OPTYPES, TRACE_REQUIRED, TRACE_SCHEMA

__all__ = [
    "Validator",
    "check_trace_columns",
    "conform_trace",
    "manifest_problems",
    "witness_rows",
]

_INT_COLUMNS = ("dp_rank", "stage", "rank", "step", "seq_id", "mc", "mb_id", "gmc")
_STRING_COLUMNS = ("job_id", "optype")
# Manifest-dependent bounds (trace_suite_parameters names): each is a column of the screen's witness frame.
_BOUNDS = ("dp_rank_max", "stage_max", "rank_max", "mc_max", "gmc_max", "mb_id_max")


# ---------------------------------------------------------------------------
# Plain checks: columns and Arrow types


def _string_like(dtype: pa.DataType) -> bool:
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype)


def _type_problem(name: str, actual: pa.DataType) -> str | None:
    """Why column `name` of type `actual` cannot be read as TRACE_SCHEMA's type, or None.

    Accepted: the same kind of value (integers of any width when the values fit,
    floats or integers for float columns, any string encoding for string columns).
    """
    target = TRACE_SCHEMA.field(name).type
    if pa.types.is_null(actual):
        return None  # an all-null column: the null checks report it if it is required
    if pa.types.is_integer(target):
        ok = pa.types.is_integer(actual)
    elif pa.types.is_floating(target):
        ok = pa.types.is_floating(actual) or pa.types.is_integer(actual)
    elif pa.types.is_dictionary(target) or pa.types.is_string(target):
        ok = _string_like(actual)
    elif pa.types.is_list(target):
        ok = (pa.types.is_list(actual) or pa.types.is_large_list(actual)) and pa.types.is_integer(actual.value_type)
    else:  # pragma: no cover - TRACE_SCHEMA has no other kinds
        ok = actual == target
    return None if ok else f"column {name!r} has type {actual}, expected {target}"


def check_trace_columns(schema: pa.Schema, job_id: str | None, source_path: str | None) -> list[Problem]:
    """File-level problems of a trace file's schema: missing required columns, wrong types."""
    problems = []
    names = set(schema.names)
    missing = [name for name in TRACE_REQUIRED if name not in names]
    # job_id may be absent: the partition path supplies it (Hive style).
    if missing == ["job_id"] and job_id is not None:
        missing = []
    if missing:
        problems.append(Problem(MISSING_COLUMN, job_id, source_path,
                                f"job {job_id}, file {source_path}: missing required column(s) {', '.join(missing)}; "
                                f"the writer must emit every TRACE_SCHEMA column"))
    wrong = [why for name in schema.names if name in TRACE_SCHEMA.names
             for why in [_type_problem(name, schema.field(name).type)] if why]
    if wrong:
        problems.append(Problem(WRONG_TYPE, job_id, source_path,
                                f"job {job_id}, file {source_path}: {'; '.join(wrong)}"))
    return problems


def _optype_codes(column: pa.ChunkedArray, strict: bool) -> tuple[pa.Array, list[str]]:
    """Optype as int8 codes into OPTYPES (+ unknown names appended when not strict)."""
    if pa.types.is_dictionary(column.type) and column.num_chunks:
        # as written: map each chunk's small dictionary, never materialise the names per row
        known = pa.array(OPTYPES)
        mappings = [pc.index_in(pc.cast(chunk.dictionary, pa.string()), value_set=known) for chunk in column.chunks]
        if all(mapping.null_count == 0 for mapping in mappings):
            codes = [pc.take(mapping, chunk.indices) for mapping, chunk in zip(mappings, column.chunks)]
            return pc.cast(pa.concat_arrays(codes), pa.int8()), list(OPTYPES)
    values = pc.cast(column, pa.string()).combine_chunks()
    dictionary = list(OPTYPES)
    codes = pc.index_in(values, value_set=pa.array(dictionary))
    unknown_mask = pc.and_(pc.is_null(codes), pc.is_valid(values))
    if pc.any(unknown_mask).as_py():
        unknown = pc.unique(pc.filter(values, unknown_mask)).to_pylist()
        if strict:
            raise TraceContractError(UNKNOWN_OPTYPE, f"unknown optype(s) {sorted(unknown)[:5]}")
        if len(dictionary) + len(unknown) > 127:
            raise TraceContractError(UNKNOWN_OPTYPE, f"{len(unknown)} unknown optypes: too many to encode")
        dictionary += sorted(unknown)
        codes = pc.index_in(values, value_set=pa.array(dictionary))
    return pc.cast(codes, pa.int8()), dictionary


def conform_trace(table: pa.Table, *, job_id: str | None = None, source_path: str | None = None,
                  strict: bool = True) -> pa.Table:
    """Cast a trace table to TRACE_SCHEMA (column order, types, OPTYPES dictionary order).

    Missing optional columns become nulls; a missing job_id column is filled with
    `job_id` (from the partition path). Integer columns are narrowed only when every
    value fits. With strict=False unknown optypes are kept (appended to the
    dictionary) so that validation can report them row by row.
    Raises TraceContractError (reason missing_column / wrong_type / unknown_optype)
    naming the job, file and column.
    """
    where = f"job {job_id}, file {source_path}"
    problems = check_trace_columns(table.schema, job_id, source_path)
    if problems:
        raise TraceContractError(problems[0].reason, problems[0].detail)
    n = table.num_rows
    columns = []
    for field in TRACE_SCHEMA:
        if field.name not in table.schema.names:
            if field.name == "job_id":
                columns.append(pa.array([job_id] * n, pa.string()) if n else pa.array([], pa.string()))
            else:
                columns.append(pa.nulls(n, field.type))
            continue
        column = table[field.name]
        if field.name == "optype":
            try:
                codes, dictionary = _optype_codes(column, strict)
            except TraceContractError as error:
                raise TraceContractError(error.reason, f"{where}: {error}") from None
            columns.append(pa.DictionaryArray.from_arrays(codes, pa.array(dictionary, pa.string())))
            continue
        if column.type == field.type:
            columns.append(column)
            continue
        if pa.types.is_dictionary(column.type):
            column = pc.cast(column, column.type.value_type)
        try:
            columns.append(pc.cast(column, field.type, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise TraceContractError(WRONG_TYPE, f"{where}: column {field.name!r} ({column.type}) "
                                                 f"does not fit {field.type}: {error}") from None
    return pa.Table.from_arrays(columns, schema=TRACE_SCHEMA)


# ---------------------------------------------------------------------------
# Plain checks: manifest


def manifest_problems(manifest: Mapping[str, Any], source_path: str | None = None) -> list[Problem]:
    """Manifest rules GX cannot express: world = dp*pp*tp*dsp, one worker entry per (dp_rank, stage)."""
    job_id = manifest.get("job_id")
    where = f"job {job_id}, manifest {source_path}"
    out = []
    sizes = {k: manifest.get(k) for k in ("dp_size", "pp_size", "tp_size", "dsp_size", "world_size")}
    if all(isinstance(v, int) and v >= 1 for v in sizes.values()):
        product = sizes["dp_size"] * sizes["pp_size"] * sizes["tp_size"] * sizes["dsp_size"]
        if product != sizes["world_size"]:
            out.append(Problem(INVALID_MANIFEST, job_id, source_path,
                               f"{where}: world_size {sizes['world_size']} != dp*pp*tp*cp = {product}"))
        workers = manifest.get("workers") or []
        cells = [(w["dp_rank"], w["stage"]) for w in workers]
        expected = {(d, s) for d in range(sizes["dp_size"]) for s in range(sizes["pp_size"])}
        if len(cells) != len(set(cells)) or set(cells) != expected:
            missing = sorted(expected - set(cells))[:5]
            extra = sorted(set(cells) - expected)[:5]
            out.append(Problem(INVALID_MANIFEST, job_id, source_path,
                               f"{where}: workers must list each (dp_rank, stage) of dp {sizes['dp_size']} x "
                               f"pp {sizes['pp_size']} once; {len(cells)} entries, missing {missing}, "
                               f"unexpected {extra}"))
        bad_ranks = [w for w in workers if not 0 <= int(w["rank"]) < sizes["world_size"]]
        if bad_ranks:
            out.append(Problem(INVALID_MANIFEST, job_id, source_path,
                               f"{where}: worker rank(s) outside world size {sizes['world_size']}: {bad_ranks[:3]}"))
    if source_path is not None:
        path_job = source_path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".parquet")
        if job_id is not None and path_job != job_id:
            out.append(Problem(INVALID_MANIFEST, job_id, source_path,
                               f"{where}: manifest file is named for job {path_job!r} but holds job {job_id!r}"))
    return out


# ---------------------------------------------------------------------------
# The validator


def _frame_for_gx(table: pa.Table, columns: Sequence[str]):
    """pandas frame of `columns` in dtypes GX checks vectorised.

    GX's between-check is vectorised only for int64/float64 columns (int16 falls back
    to a per-element Python map, ~3 s per million rows), so integers are widened.
    job_id and optype stay categorical, which keeps the uniqueness check cheap.
    """
    import pandas as pd

    data = {}
    for name in columns:
        column = table[name]
        if name == "job_id":
            column = pc.dictionary_encode(column)
        if name in _INT_COLUMNS:
            column = pc.cast(column, pa.int64() if column.null_count == 0 else pa.float64())
        data[name] = column.to_pandas()
    return pd.DataFrame(data, copy=False)


def _has_missing_values(table: pa.Table) -> bool:
    """True when a required column holds a null, or a float column a NaN (Arrow counts nulls exactly)."""
    if any(table[name].null_count for name in TRACE_REQUIRED):
        return True
    return any(pc.any(pc.is_nan(table[name])).as_py() for name in FLOAT_COLUMNS)


def _describe_rows(table: pa.Table, indices: np.ndarray, offset: int, limit: int = 3) -> str:
    rows = table.take(pa.array(indices[:limit])).select(
        ["step", "dp_rank", "stage", "optype", "seq_id", "start_ts", "duration"]).to_pylist()
    text = "; ".join(
        f"row {i - offset}: step {r['step']}, worker (dp {r['dp_rank']}, stage {r['stage']}), "
        f"op {r['optype']} #{r['seq_id']}, start_ts {r['start_ts']}, duration {r['duration']}"
        for i, r in zip(indices[:limit].tolist(), rows)
    )
    return text + ("; ..." if len(indices) > limit else "")


def _row_detail(table: pa.Table, reason: str) -> pa.Array:
    """Per-row detail strings for rows rejected with `reason`, built vectorised."""
    def text(name: str) -> pa.Array:
        return pc.fill_null(pc.cast(table[name], pa.string()), "null").combine_chunks()

    op = pc.binary_join_element_wise("op ", text("optype"), " #", text("seq_id"), " step ", text("step"),
                                     " worker (dp ", text("dp_rank"), ", stage ", text("stage"), "): ", "")
    shown = {NEGATIVE_DURATION: ("duration",), NON_FINITE_TIME: ("start_ts", "duration"),
             UNKNOWN_OPTYPE: ("optype",), JOB_ID_MISMATCH: ("job_id",), RANK_MISMATCH: ("rank",),
             RANK_OUT_OF_RANGE: ("dp_rank", "stage", "rank"), INDEX_OUT_OF_RANGE: ("step", "seq_id", "mc", "gmc", "mb_id"),
             NULL_VALUE: TRACE_REQUIRED, DUPLICATE_ROW: ("start_ts", "duration")}[reason]
    parts: list = [op, f"{reason}:"]
    for name in shown:
        parts += [f" {name}=", text(name)]
    return pc.binary_join_element_wise(*parts, "")


def _gx_exception(info) -> str | None:
    """The message of an exception GX caught while running an expectation, or None.

    GX reports it either flat ({"raised_exception": True, "exception_message": ...}) or,
    when a metric failed, nested per metric ({metric id: {... same keys ...}}).
    """
    if not isinstance(info, Mapping):
        return None
    if info.get("raised_exception"):
        return str(info.get("exception_message"))
    for value in info.values():
        if isinstance(value, Mapping) and value.get("raised_exception"):
            return str(value.get("exception_message"))
    return None


# GX is not thread-safe: its suite-parameter grammar (pyparsing) learns each parse action's
# arity on first use, and two threads doing that at once corrupt it for the rest of the
# process (every later run fails with "push_first() missing 1 required positional argument").
# Beam runs bundles on several threads of one worker process, so every GX call takes this lock.
_GX_LOCK = threading.RLock()


class Validator:
    """Validates trace files and jobs against the lake contract. Build once per worker.

    Holds an ephemeral GX context with the trace suites (with and without a manifest),
    the screen suite and the manifest suite. GX has a fixed cost per run (~6 ms per
    expectation, whatever the row count), so validate_jobs screens many windows in one
    run and validate_manifests checks many manifests in one run.
    """

    def __init__(self):
        import great_expectations as gx
        from great_expectations.data_context.types.base import (
            DataContextConfig,
            InMemoryStoreBackendDefaults,
            ProgressBarsConfig,
        )

        config = DataContextConfig(
            store_backend_defaults=InMemoryStoreBackendDefaults(),
            analytics_enabled=False,   # no network from pipeline workers
            progress_bars=ProgressBarsConfig(globally=False),
        )
        with _GX_LOCK:
            self._build(gx, config)

    def _build(self, gx, config) -> None:
        context = gx.get_context(mode="ephemeral", project_config=config)
        source = context.data_sources.add_pandas(name="lake")
        trace_batch = source.add_dataframe_asset(name="trace").add_batch_definition_whole_dataframe("job")
        witness_batch = source.add_dataframe_asset(name="witness").add_batch_definition_whole_dataframe("windows")
        manifest_batch = source.add_dataframe_asset(name="manifest").add_batch_definition_whole_dataframe("rows")
        suites = {
            # nulls are checked by GX only when Arrow reports some (null counts are exact and free)
            "trace_nulls": (trace_batch, null_expectations()),
            "trace_values": (trace_batch, value_expectations(True, None)),
            "trace_values_without_manifest": (trace_batch, value_expectations(False, None)),
            "trace_screen": (witness_batch, trace_screen_suite().expectations),
            "manifest": (manifest_batch, manifest_suite().expectations),
        }
        self._definitions = {}
        for name, (batch, expectations) in suites.items():
            suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
            self._definitions[name] = context.validation_definitions.add(
                gx.ValidationDefinition(name=name, data=batch, suite=suite))
        self._context = context

    def _run(self, definition: str, frame, result_format: Mapping[str, Any], parameters: Mapping[str, Any] | None = None):
        """One GX run of a suite over a frame; its result, which GX is not allowed to keep."""
        with _GX_LOCK:
            result = self._definitions[definition].run(batch_parameters={"dataframe": frame},
                                                       expectation_parameters=dict(parameters or {}),
                                                       result_format=dict(result_format))
            # GX keeps every run's result in the context's store (~22 KB each, in memory here): a
            # watcher validating a session a second would grow without end.
            store = self._context.validation_results_store
            for key in store.list_keys():
                store.remove_key(key)
        return result

    def _failures(self, definition: str, frame, parameters: Mapping[str, Any], where: str) -> list[tuple[str, Any, np.ndarray]]:
        """Run one suite; (reason, expectation config, failing row positions) per failed expectation."""
        result = self._run(definition, frame, {"result_format": "COMPLETE", "partial_unexpected_count": 0,
                                               "return_unexpected_index_query": False}, parameters)
        failures = []
        for item in result.results:
            error = _gx_exception(item.exception_info)
            if error is not None:
                raise RuntimeError(f"{where}: expectation {item.expectation_config.type} could not run: {error}")
            if not item.success:
                indices = np.asarray(item.result.get("unexpected_index_list") or [], dtype=np.int64)
                failures.append((item.expectation_config.meta["reason"], item.expectation_config, indices))
        return failures

    # -- manifests ---------------------------------------------------------
    def validate_manifests(self, manifests: Sequence[tuple[str | None, Mapping[str, Any]]]) -> list[list[Problem]]:
        """Problems of many manifest rows at once (one GX run): one list per (path, row) given."""
        import pandas as pd

        out: list[list[Problem]] = [[] for _ in manifests]
        complete = []
        for i, (path, manifest) in enumerate(manifests):
            missing = [f.name for f in MANIFEST_SCHEMA if f.name not in manifest]
            if missing:
                out[i].append(Problem(INVALID_MANIFEST, manifest.get("job_id"), path,
                                      f"job {manifest.get('job_id')}, manifest {path}: missing field(s) "
                                      f"{', '.join(missing)}"))
            else:
                complete.append(i)
        if complete:
            frame = pd.DataFrame({f.name: [manifests[i][1][f.name] for i in complete]
                                  for f in MANIFEST_SCHEMA if f.name != "workers"})
            for column in ("submit_time", "start_time", "end_time"):
                # naive UTC: GX reads Series.values, which drops a zone with a deprecation warning
                frame[column] = pd.to_datetime(frame[column], utc=True).dt.tz_convert(None)
            for _, config, indices in self._failures("manifest", frame, {}, f"{len(complete)} manifests"):
                for position in indices.tolist():
                    i = complete[position]
                    path, manifest = manifests[i]
                    rule = config.kwargs.get("column") or f"{config.kwargs.get('column_A')} >= {config.kwargs.get('column_B')}"
                    out[i].append(Problem(INVALID_MANIFEST, manifest.get("job_id"), path,
                                          f"job {manifest.get('job_id')}, manifest {path}: fails {config.type} "
                                          f"on {rule}"))
            for i in complete:
                out[i] += manifest_problems(manifests[i][1], manifests[i][0])
        return out

    def validate_manifest(self, manifest: Mapping[str, Any], source_path: str | None = None) -> list[Problem]:
        """Problems of one manifest row (dict of MANIFEST_SCHEMA fields); [] when valid."""
        return self.validate_manifests([(source_path, manifest)])[0]

    # -- traces ------------------------------------------------------------
    def unreadable(self, source_path: str, error: BaseException, job_id: str | None = None,
                   manifest: bool = False) -> ValidationReport:
        """Report for a file that could not be read at all (trace or manifest)."""
        job_id = job_id or parse_partition(source_path).get("job_id")
        reason = UNREADABLE_MANIFEST if manifest else UNREADABLE_FILE
        kind = "manifest" if manifest else "file"
        return _empty_report(job_id, [Problem(reason, job_id, source_path,
                                              f"job {job_id}, {kind} {source_path}: cannot be read "
                                              f"({type(error).__name__}: {error}); re-upload it")])

    def validate_file(self, table: pa.Table, manifest: Mapping[str, Any] | None,
                      source_path: str | None) -> ValidationReport:
        """Validate one trace file's table (as read from parquet: any compatible types).

        manifest: the job's valid manifest row (dict), or None (then the rules needing
        the parallelism are reduced to lower bounds). Returns valid rows (TRACE_SCHEMA),
        invalid rows with reasons, and problems (file-level rejection, or one summary per
        row reason). Always runs the row-level suites; for whole jobs prefer
        validate_job / validate_jobs.
        """
        job_id = manifest["job_id"] if manifest else parse_partition(source_path or "").get("job_id")
        problems, paths, tables = _conform_files(job_id, [(source_path, table)])
        valid, invalid, row_problems = self._check_rows(job_id, manifest, paths, tables)
        return ValidationReport(job_id, valid, invalid, problems + row_problems)

    def validate_job(self, job_id: str, manifest: Mapping[str, Any] | None,
                     files: Sequence[tuple[str, pa.Table | BaseException]], *,
                     manifest_path: str | None = None, manifest_issues: Sequence[Problem] = ()) -> ValidationReport:
        """Validate a whole job: its files' rows and the job-level rules (validate_jobs of one window)."""
        return self.validate_jobs([JobFiles(job_id, manifest, tuple(files), manifest_path, tuple(manifest_issues))])[0]

    def validate_jobs(self, jobs: Sequence[JobFiles], *, screen: bool = True) -> list[ValidationReport]:
        """Validate job windows, each against its own manifest; one report per window, in order.

        Rows: schema checks per file; then one GX screen run over witness rows of all the
        windows (see `witness_rows`); a window the screen clears has no failing row, one
        it does not goes through the row-level suites (one GX run over all its rows, which
        names every failing row). Job rules: a manifest exists, the job has trace files,
        every manifest worker has valid rows, every worker has every step another has.
        Each report's `seconds` is the time spent on its window (the screen run shared
        in proportion to rows). screen=False sends every window through the row-level suites
        (same reports, slower: the baseline of benchmarks/bench_validation.py).
        """
        conformed, spent = [], []
        for job in jobs:
            started = time.perf_counter()
            conformed.append(_conform_files(job.job_id, [(path, content) for path, content in job.files
                                                         if not isinstance(content, BaseException)]))
            spent.append(time.perf_counter() - started)
        clean, screen_seconds = self._screen(jobs, [tables for _, _, tables in conformed]) if screen else (set(), 0.0)
        rows = np.array([sum(t.num_rows for t in tables) for _, _, tables in conformed], dtype=np.float64)
        share = rows / rows.sum() if rows.sum() else np.full(len(jobs), 1.0 / max(1, len(jobs)))
        reports = []
        for index, (job, (problems, paths, tables)) in enumerate(zip(jobs, conformed)):
            window_started = time.perf_counter()
            problems = [*job.manifest_issues, *(p for path, content in job.files if isinstance(content, BaseException)
                                                for p in self.unreadable(path, content, job.job_id).problems), *problems]
            if index in clean:
                valid, invalid, row_problems = _concat(tables), INVALID_ROW_SCHEMA.empty_table(), []
            else:
                valid, invalid, row_problems = self._check_rows(job.job_id, job.manifest, paths, tables)
            report = _job_report(job, valid, invalid, problems + row_problems)
            report.seconds = spent[index] + screen_seconds * float(share[index]) + time.perf_counter() - window_started
            reports.append(report)
        return reports

    def _screen(self, jobs: Sequence[JobFiles], tables: Sequence[list[pa.Table]]) -> tuple[set[int], float]:
        """Indices of the windows proven to have no failing row, and the seconds it took.

        Screened: windows with a manifest, rows, no null or NaN, every row of their job and
        no rank disagreeing with the manifest (a window failing one of those plain facts
        goes to the row-level suites directly). One GX run of the screen suite over the
        witness rows of all of them, BOOLEAN_ONLY; when it fails, a COMPLETE run over the
        same small frame says which windows to send to the row-level suites.
        """
        import pandas as pd

        started = time.perf_counter()
        candidates, frames = [], []
        for index, (job, parts) in enumerate(zip(jobs, tables)):
            if job.manifest is None or not parts:
                continue
            trace = _concat(parts)
            rows = witness_rows(trace, job.job_id, job.manifest)
            if rows is None:
                continue
            candidates.append(index)
            frames.append(_witness_frame(trace.select(TRACE_REQUIRED).take(pa.array(rows)), len(candidates) - 1, job.job_id, job.manifest))
        if not candidates:
            return set(), time.perf_counter() - started
        frame = pd.concat(frames, ignore_index=True)
        where = f"screen of jobs {[jobs[i].job_id for i in candidates][:3]}{' ...' if len(candidates) > 3 else ''}"
        result = self._run("trace_screen", frame, {"result_format": "BOOLEAN_ONLY"})
        failed: set[int] = set()
        if not result.success:
            window = frame[WINDOW].to_numpy()
            for _, _, indices in self._failures("trace_screen", frame, {}, where):
                # a failure that names no row clears nobody: every window goes to the row level
                failed.update(window[indices].tolist() if indices.size else range(len(candidates)))
        return {candidates[c] for c in range(len(candidates)) if c not in failed}, time.perf_counter() - started

    def _check_rows(self, job_id: str | None, manifest: Mapping[str, Any] | None, paths: list[str | None],
                    tables: list[pa.Table]) -> tuple[pa.Table, pa.Table, list[Problem]]:
        """The row-level suites over all conforming files of a window at once: valid rows,
        rejected rows with their reasons, one problem per (reason, file)."""
        problems: list[Problem] = []
        if not tables:
            return TRACE_SCHEMA.empty_table(), INVALID_ROW_SCHEMA.empty_table(), problems
        trace = _concat(tables)
        offsets = np.cumsum([0] + [t.num_rows for t in tables])
        where = f"job {job_id}, files {paths[:2]}{' ...' if len(paths) > 2 else ''}"
        if manifest:
            definition, parameters = "trace_values", trace_suite_parameters(manifest)
        else:
            definition = "trace_values_without_manifest"
            parameters = {"job_ids": [job_id] if job_id else pc.unique(trace["job_id"]).to_pylist()}
        failures = []
        if _has_missing_values(trace):
            failures += self._failures("trace_nulls", _frame_for_gx(trace, TRACE_REQUIRED), {}, where)
        failures += self._failures(definition, _frame_for_gx(trace, TRACE_REQUIRED), parameters, where)
        failed: dict[str, np.ndarray] = {}
        for reason, _, indices in failures:
            failed[reason] = np.union1d(failed.get(reason, np.empty(0, np.int64)), indices)
        if manifest:
            mismatch = _rank_mismatch(trace, manifest)
            if mismatch.size:
                failed[RANK_MISMATCH] = mismatch

        order = {code: i for i, code in enumerate(REASONS)}
        row_reason = np.full(trace.num_rows, len(REASONS), dtype=np.int16)
        for reason, indices in failed.items():
            row_reason[indices] = np.minimum(row_reason[indices], order[reason])
        file_of_row = np.repeat(np.arange(len(tables)), np.diff(offsets))
        for reason in sorted(failed, key=order.get):
            indices = failed[reason]
            for file_index in np.unique(file_of_row[indices]).tolist():
                mine = indices[file_of_row[indices] == file_index]
                problems.append(Problem(
                    reason, job_id, paths[file_index],
                    f"job {job_id}, file {paths[file_index]}: {mine.size} row(s) rejected, {REASONS[reason][1]}; "
                    f"{_describe_rows(trace, mine, int(offsets[file_index]))}",
                    int(mine.size)))
        bad = row_reason < len(REASONS)
        if not bad.any():
            return trace, INVALID_ROW_SCHEMA.empty_table(), problems
        valid = _known_optypes_only(trace.filter(pa.array(~bad)))
        source = np.array(paths, dtype=object)[file_of_row]
        return valid, _invalid_rows(trace, row_reason, bad, source), problems


def _concat(tables: Sequence[pa.Table]) -> pa.Table:
    return pa.concat_tables(tables) if tables else TRACE_SCHEMA.empty_table()


def _conform_files(job_id: str | None, files: Sequence[tuple[str | None, pa.Table]]
                   ) -> tuple[list[Problem], list[str | None], list[pa.Table]]:
    """Schema checks and cast to TRACE_SCHEMA per file: (file problems, paths and tables of
    the conforming files that have rows)."""
    problems: list[Problem] = []
    paths, tables = [], []
    for path, table in files:
        issues = check_trace_columns(table.schema, job_id, path)
        if not issues:
            try:
                table = conform_trace(table, job_id=job_id, source_path=path, strict=False)
            except TraceContractError as error:
                issues = [Problem(error.reason, job_id, path, str(error))]
        if issues:
            problems += [dataclasses.replace(p, rows=table.num_rows) for p in issues]
        elif table.num_rows:
            paths.append(path)
            tables.append(table)
    return problems, paths, tables


def _job_report(job: JobFiles, valid: pa.Table, invalid: pa.Table, problems: list[Problem]) -> ValidationReport:
    """Add the job-level problems (no manifest, no files, missing workers or steps) to a window's rows."""
    job_id, where = job.job_id, f"job {job.job_id}"
    if job.manifest is None and job.manifest_path is None:
        problems.append(Problem(MISSING_MANIFEST, job_id, None,
                                f"{where}: trace files {[p for p, _ in job.files][:2]} have no manifest for "
                                f"their date; write manifests/date=.../{job_id}.parquet"))
    if not job.files:
        problems.append(Problem(NO_TRACE_FILES, job_id, job.manifest_path,
                                f"{where}: manifest {job.manifest_path} has no trace files beside it"))
        return ValidationReport(job_id, valid, invalid, problems)
    grid = _worker_step_grid(valid) if valid.num_rows else None
    if job.manifest is not None:
        expected = {(w["dp_rank"], w["stage"]) for w in job.manifest["workers"]}
        missing = sorted(expected - _workers_present(grid))
        if missing:
            problems.append(Problem(MISSING_WORKERS, job_id, job.manifest_path,
                                    f"{where}: {len(missing)} of {len(expected)} workers have no valid rows: "
                                    f"(dp_rank, stage) {missing[:8]}{' ...' if len(missing) > 8 else ''}"))
    gaps = _missing_steps(grid)
    if gaps:
        count, example = gaps
        problems.append(Problem(MISSING_STEPS, job_id, None,
                                f"{where}: {count} (worker, step) pair(s) missing although other workers "
                                f"have those steps; e.g. {example}"))
    return ValidationReport(job_id, valid, invalid, problems)


# Columns whose rules are ranges: a range rule holds on every row iff it holds on the rows of the min and max.
_RANGE_COLUMNS = ("start_ts", "duration", "dp_rank", "stage", "rank", "mc", "gmc", "mb_id", "step", "seq_id")


def witness_rows(trace: pa.Table, job_id: str, manifest: Mapping[str, Any]) -> np.ndarray | None:
    """Rows of a window (TRACE_SCHEMA) on which each value rule of the trace suite fails iff
    it fails on some row of the window; None when a plain fact already fails the window.

    The witnesses: per range column the rows of its minimum and maximum (a range rule
    holds everywhere iff it holds there), one row per distinct optype (set rule), every
    row whose (step, worker, optype, seq_id) key occurs more than once (uniqueness; found
    by one sort of packed keys). None, so the row-level suites run, when the window holds
    a null or NaN, an optype name outside OPTYPES, a job_id other than its own or a rank
    other than the manifest's: those fail for sure and need every row named.
    """
    if trace.num_rows == 0 or _has_missing_values(trace):
        return None
    optype = trace["optype"]
    if any(len(chunk.dictionary) != len(OPTYPES) for chunk in optype.chunks):
        return None   # conform_trace appends unknown names to the OPTYPES dictionary
    # each column as one numpy array, once: a window's columns have a chunk per file, which every
    # to_numpy concatenates anew (no nulls here: _has_missing_values said so)
    values = {name: trace[name].to_numpy() for name in (*_RANGE_COLUMNS, "rank")}
    if not pc.all(pc.equal(trace["job_id"], job_id)).as_py() or _rank_mismatch(trace, manifest, values).size:
        return None
    picks = [0]
    for name in _RANGE_COLUMNS:
        picks += [int(np.argmin(values[name])), int(np.argmax(values[name]))]
    codes = np.concatenate([chunk.indices.to_numpy() for chunk in optype.chunks])
    picks += [int(np.argmax(codes == code)) for code in np.flatnonzero(np.bincount(codes, minlength=len(OPTYPES)))]
    key = [values[name] for name in ("step", "dp_rank", "stage")] + [codes, values["seq_id"]]
    return np.unique(np.concatenate([np.asarray(picks, np.int64), _duplicate_rows(key)]))


def _duplicate_rows(columns: Sequence[np.ndarray]) -> np.ndarray:
    """Indices of the rows whose tuple of `columns` (integer arrays) occurs more than once."""
    n = len(columns[0])
    keys, span = np.zeros(n, np.int64), 1
    for values in columns:
        low, high = int(values.min()), int(values.max())
        width = high - low + 1
        if width > 4 * 64 and n > 4 * 64:   # sparse values (profiled steps 46, 92, ...): number the distinct ones
            distinct = np.sort(pc.unique(pa.array(values)).to_numpy(zero_copy_only=False))
            if 4 * len(distinct) < width:
                values, low, width = np.searchsorted(distinct, values), 0, len(distinct)
        if span * width >= 1 << 62:   # key space too wide to pack: sort the tuples instead
            order = np.lexsort(columns[::-1])
            same = np.ones(n - 1, dtype=bool)
            for column in columns:
                ordered = column[order]
                same &= ordered[1:] == ordered[:-1]
            repeated = np.zeros(n, dtype=bool)
            repeated[1:] |= same
            repeated[:-1] |= same
            return np.sort(order[repeated])
        keys = keys * width + (values.astype(np.int64) - low)
        span *= width
    if span <= 8 * n + 1024:   # a key space about the rows' size: count each key (no sort)
        return np.flatnonzero(np.bincount(keys, minlength=span)[keys] > 1)
    ordered = np.sort(keys)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size == 0:
        return np.empty(0, np.int64)
    return np.flatnonzero(np.isin(keys, repeated))


def _witness_frame(rows: pa.Table, window: int, job_id: str, manifest: Mapping[str, Any]):
    """pandas frame of a window's witness rows for the screen suite: the required columns
    plus the window index, its job and the manifest's bounds as columns."""
    import pandas as pd

    n = rows.num_rows
    data: dict[str, Any] = {}
    for name in TRACE_REQUIRED:
        column = rows[name]
        if name in _STRING_COLUMNS:
            data[name] = np.asarray(pc.cast(column, pa.string()).to_pylist(), dtype=object)
        else:
            data[name] = column.to_numpy().astype(np.int64 if name in _INT_COLUMNS else np.float64)
    data[WINDOW] = np.full(n, window, np.int64)
    data[WINDOW_JOB_ID] = np.full(n, job_id, dtype=object)
    parameters = trace_suite_parameters(manifest)
    for name in _BOUNDS:
        data[name] = np.full(n, parameters[name], np.int64)
    return pd.DataFrame(data)


def _empty_report(job_id: str | None, problems: list[Problem]) -> ValidationReport:
    return ValidationReport(job_id, TRACE_SCHEMA.empty_table(), INVALID_ROW_SCHEMA.empty_table(), problems)


def _rank_mismatch(trace: pa.Table, manifest: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """Row indices whose rank differs from the manifest's rank of their (dp_rank, stage); arrays:
    the null-free dp_rank, stage and rank columns as numpy arrays, where the caller has them."""
    dp_size, pp_size = int(manifest["dp_size"]), int(manifest["pp_size"])
    lookup = np.full((dp_size, pp_size), -1, dtype=np.int64)
    for worker in manifest["workers"]:
        if 0 <= worker["dp_rank"] < dp_size and 0 <= worker["stage"] < pp_size:
            lookup[worker["dp_rank"], worker["stage"]] = worker["rank"]
    def values(name: str) -> np.ndarray:   # as stored (int16 / int32): no widening copy
        if arrays is not None:
            return arrays[name]
        column = trace[name]
        return (column if column.null_count == 0 else pc.fill_null(column, -1)).to_numpy()

    dp, stage, rank = values("dp_rank"), values("stage"), values("rank")
    inside = (dp >= 0) & (dp < dp_size) & (stage >= 0) & (stage < pp_size)
    worker = np.where(inside, dp.astype(np.int64 if dp_size * pp_size >= 2**31 else np.int32) * pp_size + stage, 0)
    expected = lookup.ravel()[worker]
    return np.flatnonzero(inside & (expected >= 0) & (rank != expected))


def _invalid_rows(trace: pa.Table, row_reason: np.ndarray, bad: np.ndarray, source: np.ndarray) -> pa.Table:
    """Rejected rows grouped by reason, with source_path, reason code and detail."""
    codes = list(REASONS)
    parts = []
    for index in np.unique(row_reason[bad]).tolist():
        mask = row_reason == index
        rows = trace.filter(pa.array(mask))
        n = rows.num_rows
        parts.append(pa.Table.from_arrays(
            [*rows.columns, pa.array(source[mask], pa.string()),
             pa.array([codes[index]] * n, pa.string()), _row_detail(rows, codes[index])],
            schema=INVALID_ROW_SCHEMA))
    return pa.concat_tables(parts)


def _known_optypes_only(table: pa.Table) -> pa.Table:
    """Re-attach the plain OPTYPES dictionary once rows with unknown optypes are gone."""
    column = table["optype"]
    if all(len(chunk.dictionary) == len(OPTYPES) for chunk in column.chunks):
        return table
    dictionary = pa.array(OPTYPES, pa.string())
    chunks = [pa.DictionaryArray.from_arrays(chunk.indices, dictionary) for chunk in column.chunks]
    field = TRACE_SCHEMA.field("optype")
    return table.set_column(table.schema.get_field_index("optype"), field, pa.chunked_array(chunks, field.type))


def _dense_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct sorted values, each value's index among them), by counting when the range
    is narrow (O(n), no sort) and np.unique otherwise."""
    values = values.astype(np.int64)
    low, high = int(values.min()), int(values.max())
    if high - low > 4 * values.size + 1024:
        return np.unique(values, return_inverse=True)
    present = np.zeros(high - low + 1, dtype=bool)
    present[values - low] = True
    index_of = np.cumsum(present) - 1
    return np.flatnonzero(present) + low, index_of[values - low]


def _worker_step_grid(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(dp_rank and stage of each worker, steps, seen[worker, step]) of a non-empty table of valid rows."""
    dp = table["dp_rank"].to_numpy().astype(np.int64)
    stage = table["stage"].to_numpy().astype(np.int64)
    width = int(stage.max()) + 1   # valid rows have stage >= 0
    workers, worker_index = _dense_codes(dp * width + stage)
    steps, step_index = _dense_codes(table["step"].to_numpy())
    cells = np.bincount(worker_index * steps.size + step_index, minlength=workers.size * steps.size)
    return workers // width, workers % width, steps, (cells > 0).reshape(workers.size, steps.size)


def _workers_present(grid) -> set[tuple[int, int]]:
    if grid is None:
        return set()
    return set(zip(grid[0].tolist(), grid[1].tolist()))


def _missing_steps(grid) -> tuple[int, str] | None:
    """(count, example) of (worker, step) pairs absent while the step exists for other workers."""
    if grid is None:
        return None
    dp, stage, steps, seen = grid
    if seen.all():
        return None
    w, s = np.nonzero(~seen)
    examples = [f"worker (dp {int(dp[i])}, stage {int(stage[i])}) lacks step {int(steps[j])}"
                for i, j in zip(w[:3], s[:3])]
    return int(w.size), "; ".join(examples)
