"""What the lake contract's validation checks: reason codes, result types and GX suites.

This module only declares. Row rules (types of values, non-null, known optypes,
duration >= 0, ranks inside the job's parallelism, one row per (job, step, worker,
optype, seq_id), finite times) are Great Expectations suites built by `trace_suite`,
`trace_suite_without_manifest`, `trace_screen_suite` and `manifest_suite`; every
rejection carries a reason code from `REASONS` (a fixed vocabulary) and is reported as a
`Problem`, the rows as a `ValidationReport` (quarantine tables: `PROBLEM_SCHEMA`,
`INVALID_ROW_SCHEMA`).

The runtime that applies them lives in `transforms/validation.py`: the `Validator` (GX
context, the screen over witness rows, the row-level runs), the checks GX cannot express
(unreadable files, missing columns, wrong column types, ranks disagreeing with the
manifest, missing workers or steps, a job with no manifest) and `conform_trace`.

Units: times and durations are seconds.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.raw import RAW_REASONS
from schemas.trace import MANIFEST_SCHEMA, OPTYPES, TRACE_REQUIRED, TRACE_SCHEMA

__all__ = [
    "REASONS",
    "FILE_REASONS",
    "ROW_REASONS",
    "JOB_REASONS",
    "UNREADABLE_FILE",
    "MISSING_COLUMN",
    "WRONG_TYPE",
    "NULL_VALUE",
    "NON_FINITE_TIME",
    "NEGATIVE_DURATION",
    "UNKNOWN_OPTYPE",
    "RANK_OUT_OF_RANGE",
    "INDEX_OUT_OF_RANGE",
    "RANK_MISMATCH",
    "JOB_ID_MISMATCH",
    "DUPLICATE_ROW",
    "MISSING_MANIFEST",
    "UNREADABLE_MANIFEST",
    "INVALID_MANIFEST",
    "NO_TRACE_FILES",
    "MISSING_WORKERS",
    "MISSING_STEPS",
    "INCOMPLETE_WINDOW",
    "MISPLACED_FILE",
    "BAD_PARTITION",
    "UNSAFE_JOB_ID",
    "Problem",
    "ValidationReport",
    "TraceContractError",
    "PROBLEM_SCHEMA",
    "INVALID_ROW_SCHEMA",
    "FLOAT_COLUMNS",
    "WINDOW",
    "WINDOW_JOB_ID",
    "null_expectations",
    "value_expectations",
    "trace_suite",
    "trace_suite_parameters",
    "trace_suite_without_manifest",
    "trace_screen_suite",
    "manifest_suite",
    "JobFiles",
    "SUITE_FILES",
    "suite_documents",
    "write_suite_files",
]

# ---------------------------------------------------------------------------
# Reason codes: a fixed vocabulary. Each code -> (level, meaning and what to do).
# level "file": the whole file is rejected; "row": only the offending rows;
# "job": the job as a whole cannot be analysed as it stands.
UNREADABLE_FILE = "unreadable_file"
MISSING_COLUMN = "missing_column"
WRONG_TYPE = "wrong_type"
NULL_VALUE = "null_value"
NON_FINITE_TIME = "non_finite_time"
NEGATIVE_DURATION = "negative_duration"
UNKNOWN_OPTYPE = "unknown_optype"
RANK_OUT_OF_RANGE = "rank_out_of_range"
INDEX_OUT_OF_RANGE = "index_out_of_range"
RANK_MISMATCH = "rank_mismatch"
JOB_ID_MISMATCH = "job_id_mismatch"
DUPLICATE_ROW = "duplicate_row"
MISSING_MANIFEST = "missing_manifest"
UNREADABLE_MANIFEST = "unreadable_manifest"
INVALID_MANIFEST = "invalid_manifest"
NO_TRACE_FILES = "no_trace_files"
MISSING_WORKERS = "missing_workers"
MISSING_STEPS = "missing_steps"
INCOMPLETE_WINDOW = "incomplete_window"
MISPLACED_FILE = "misplaced_file"
BAD_PARTITION = "bad_partition"
UNSAFE_JOB_ID = "unsafe_job_id"

REASONS: dict[str, tuple[str, str]] = {
    UNREADABLE_FILE: ("file", "the parquet file cannot be read (truncated, corrupt bytes, checksum mismatch); re-upload it"),
    MISSING_COLUMN: ("file", "a required trace column is absent; the writer must emit every TRACE_SCHEMA column"),
    WRONG_TYPE: ("file", "a column's type cannot be cast losslessly to TRACE_SCHEMA (e.g. text durations, float steps)"),
    NULL_VALUE: ("row", "a required value is null"),
    NON_FINITE_TIME: ("row", "start_ts or duration is NaN or infinite"),
    NEGATIVE_DURATION: ("row", "duration < 0 s: the profiler's clocks are broken for this op"),
    UNKNOWN_OPTYPE: ("row", "optype is not in the vocabulary schemas.trace.OPTYPES"),
    RANK_OUT_OF_RANGE: ("row", "dp_rank, stage or rank lies outside the job's parallelism (manifest)"),
    INDEX_OUT_OF_RANGE: ("row", "step, seq_id, mc, gmc or mb_id lies outside its valid range"),
    RANK_MISMATCH: ("row", "the row's rank differs from the rank the manifest gives its worker (dp_rank, stage)"),
    JOB_ID_MISMATCH: ("row", "the row's job_id differs from the job of its partition/manifest"),
    DUPLICATE_ROW: ("row", "more than one row for the same (job, step, worker, optype, seq_id)"),
    MISSING_MANIFEST: ("job", "trace files without a manifest for the same date; the job's parallelism is unknown"),
    UNREADABLE_MANIFEST: ("job", "the manifest file cannot be read"),
    INVALID_MANIFEST: ("job", "the manifest breaks the manifest contract (sizes, times, workers)"),
    NO_TRACE_FILES: ("job", "a manifest without any trace file for the same date"),
    MISSING_WORKERS: ("job", "workers of the manifest have no valid rows"),
    MISSING_STEPS: ("job", "some workers lack steps that other workers of the job have"),
    MISPLACED_FILE: ("file", "a file where the lake layout has no place for it (schemas/lake.py, schemas/raw.py): not read; "
                             "move it or delete it"),
    BAD_PARTITION: ("file", "a partition folder whose name is not date=YYYY-MM-DD: its files are not read; rename it"),
    UNSAFE_JOB_ID: ("job", "a job id outside the lake's alphabet (schemas.lake.safe_job_id: no '/', '=', '..', leading "
                           "'.' or '_'): its files are not read; rename the job"),
    INCOMPLETE_WINDOW: ("job", "a file of the window was rejected (its own quarantine row says why): the rest is partial "
                               "input and is not analysed; re-upload the file and rerun the date"),
}
# Raw profiler uploads that cannot be converted (schemas/raw.py): after the lake's own reasons.
REASONS.update(RAW_REASONS)
FILE_REASONS = tuple(code for code, (level, _) in REASONS.items() if level == "file")
ROW_REASONS = tuple(code for code, (level, _) in REASONS.items() if level == "row")
JOB_REASONS = tuple(code for code, (level, _) in REASONS.items() if level == "job")

PROBLEM_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string()),
        pa.field("source_path", pa.string()),
        pa.field("level", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("detail", pa.string(), nullable=False),
    ],
    metadata={"strag.table": "validation_problem"},
)
INVALID_ROW_SCHEMA = pa.schema(
    list(TRACE_SCHEMA)
    + [
        pa.field("source_path", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string(), nullable=False),
    ],
    metadata={"strag.table": "invalid_trace_row"},
)

_FLOAT_MAX = float(np.finfo(np.float64).max)
FLOAT_COLUMNS = ("start_ts", "duration")
_UNIQUE_KEY = ["job_id", "step", "dp_rank", "stage", "optype", "seq_id"]


class TraceContractError(ValueError):
    """A trace table breaks the lake contract in a way that rejects the whole file.

    `reason` is a code of REASONS; the message names the job, the file and the column.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Problem:
    """One rejected file, job or group of rows: what the quarantine table records."""

    reason: str           # a code of REASONS
    job_id: str | None
    source_path: str | None
    detail: str           # human sentence naming job, file and op/row
    rows: int = 0         # rows affected (0 when unknown, e.g. an unreadable file)

    @property
    def level(self) -> str:
        return REASONS[self.reason][0]


@dataclasses.dataclass
class ValidationReport:
    """Outcome of validating one file or one job.

    valid: rows that passed (TRACE_SCHEMA); invalid: rejected rows (INVALID_ROW_SCHEMA:
    the row, its source_path, reason code and detail); problems: file, job and
    per-reason row summaries. `ok` is True only when nothing at all was rejected.
    """

    job_id: str | None
    valid: pa.Table
    invalid: pa.Table
    problems: list[Problem]
    seconds: float = 0.0   # validation time spent on it (validate_jobs)

    @property
    def ok(self) -> bool:
        return not self.problems and self.invalid.num_rows == 0

    @property
    def reasons(self) -> set[str]:
        """Codes of every problem found."""
        return {problem.reason for problem in self.problems}

    def problems_table(self) -> pa.Table:
        """Problems as a PROBLEM_SCHEMA table (the quarantine table's rows)."""
        return pa.Table.from_pylist(
            [
                {"job_id": p.job_id, "source_path": p.source_path, "level": p.level,
                 "reason": p.reason, "rows": p.rows, "detail": p.detail}
                for p in self.problems
            ],
            schema=PROBLEM_SCHEMA,
        )

    def summary(self) -> str:
        """One line per problem, for logs and CLI output."""
        if self.ok:
            return f"job {self.job_id}: valid ({self.valid.num_rows} rows)"
        return "\n".join(f"[{p.reason}] {p.detail}" for p in self.problems)


@dataclasses.dataclass(frozen=True)
class JobFiles:
    """One job window to validate (transforms.validation.Validator.validate_jobs).

    files: (source path, table as read) per trace file, or (path, exception) for a file
    that could not be read. manifest: the window's valid manifest row or None;
    manifest_path: where it is (None = the window has none); manifest_issues: problems
    already found with it.
    """

    job_id: str
    manifest: Mapping[str, Any] | None
    files: Sequence[tuple[str, pa.Table | BaseException]]
    manifest_path: str | None = None
    manifest_issues: Sequence[Problem] = ()


# ---------------------------------------------------------------------------
# Great Expectations suites


def null_expectations():
    """The trace suites' non-null rules (a null time counts as non-finite); the Validator runs them
    on their own, only when Arrow reports a null."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnValuesToNotBeNull(
            column=column, meta={"reason": NON_FINITE_TIME if column in FLOAT_COLUMNS else NULL_VALUE})
        for column in TRACE_REQUIRED
    ]


WINDOW_JOB_ID = "window_job_id"   # witness frame: the job the row's window belongs to
WINDOW = "window"                 # witness frame: index of the row's window in the screened group


def value_expectations(with_manifest: bool, parameters: Mapping[str, Any] | None, *, bound_columns: bool = False):
    """Value rules in priority order (a row failing several gets the first one's reason).

    With `parameters` None, manifest-dependent bounds are GX runtime parameters
    ({"$PARAMETER": name}); otherwise they are the given values. With bound_columns the
    bounds are columns of the frame instead (the screen's form, where rows of windows of
    different jobs meet in one run): `x <= bound` becomes a pair expectation
    bound >= x, `job_id in job_ids` becomes job_id == window_job_id, and the uniqueness
    key gains the window.
    """
    import great_expectations.expectations as gxe

    def bound(name: str):
        return {"$PARAMETER": name} if parameters is None else parameters[name]

    def between(column: str, reason: str, low, high=None):
        if bound_columns and isinstance(high, dict):   # a manifest bound: the frame's column of that name
            return [gxe.ExpectColumnValuesToBeBetween(column=column, min_value=low, meta={"reason": reason}),
                    gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A=high["$PARAMETER"], column_B=column,
                                                                or_equal=True, meta={"reason": reason})]
        return [gxe.ExpectColumnValuesToBeBetween(column=column, min_value=low, max_value=high, meta={"reason": reason})]

    if bound_columns:
        same_job = gxe.ExpectColumnPairValuesToBeEqual(column_A="job_id", column_B=WINDOW_JOB_ID,
                                                       meta={"reason": JOB_ID_MISMATCH})
    else:
        same_job = gxe.ExpectColumnValuesToBeInSet(column="job_id", value_set=bound("job_ids"),
                                                   meta={"reason": JOB_ID_MISMATCH})
    items = [
        *between("start_ts", NON_FINITE_TIME, -_FLOAT_MAX, _FLOAT_MAX),
        *between("duration", NON_FINITE_TIME, -_FLOAT_MAX, _FLOAT_MAX),
        *between("duration", NEGATIVE_DURATION, 0),
        gxe.ExpectColumnValuesToBeInSet(column="optype", value_set=list(OPTYPES), meta={"reason": UNKNOWN_OPTYPE}),
        same_job,
    ]
    if with_manifest:
        items += [
            *between("dp_rank", RANK_OUT_OF_RANGE, 0, bound("dp_rank_max")),
            *between("stage", RANK_OUT_OF_RANGE, 0, bound("stage_max")),
            *between("rank", RANK_OUT_OF_RANGE, 0, bound("rank_max")),
            *between("mc", INDEX_OUT_OF_RANGE, -1, bound("mc_max")),
            *between("gmc", INDEX_OUT_OF_RANGE, -1, bound("gmc_max")),
            *between("mb_id", INDEX_OUT_OF_RANGE, -1, bound("mb_id_max")),
        ]
    else:
        items += [item for column in ("dp_rank", "stage", "rank") for item in between(column, RANK_OUT_OF_RANGE, 0)]
        items += [item for column in ("mc", "gmc", "mb_id") for item in between(column, INDEX_OUT_OF_RANGE, -1)]
    key = [WINDOW, *_UNIQUE_KEY] if bound_columns else list(_UNIQUE_KEY)
    items += [
        *between("step", INDEX_OUT_OF_RANGE, 0),
        *between("seq_id", INDEX_OUT_OF_RANGE, 0),
        gxe.ExpectCompoundColumnsToBeUnique(column_list=key, meta={"reason": DUPLICATE_ROW}),
    ]
    return items


def trace_suite_parameters(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Runtime values of the trace suite's manifest-dependent bounds (inclusive maxima)."""
    return {
        "job_ids": [manifest["job_id"]],
        "dp_rank_max": int(manifest["dp_size"]) - 1,
        "stage_max": int(manifest["pp_size"]) - 1,
        "rank_max": int(manifest["world_size"]) - 1,
        "mc_max": int(manifest["vpp_size"]) - 1,
        "gmc_max": int(manifest["pp_size"]) * int(manifest["vpp_size"]) - 1,
        "mb_id_max": int(manifest["microbatches"]) - 1,
    }


def trace_suite(manifest: Mapping[str, Any] | None = None, *, name: str = "trace"):
    """GX ExpectationSuite for the op records of a job.

    manifest: a MANIFEST_SCHEMA row (dict) whose parallelism is bound into the suite,
    or None for the parameterised suite (bounds as {"$PARAMETER": ...}, supplied at run
    time from `trace_suite_parameters(manifest)`). Each expectation's meta["reason"] is
    the reason code its failures get.
    """
    import great_expectations as gx

    parameters = None if manifest is None else trace_suite_parameters(manifest)
    return gx.ExpectationSuite(name=name, expectations=null_expectations() + value_expectations(True, parameters))


def trace_suite_without_manifest(name: str = "trace_without_manifest"):
    """GX ExpectationSuite for op records of a job whose manifest is missing or invalid.

    Bounds that need the parallelism become lower bounds only; job_ids is a runtime
    parameter (the job of the partition path).
    """
    import great_expectations as gx

    return gx.ExpectationSuite(name=name, expectations=null_expectations() + value_expectations(False, None))


def trace_screen_suite(name: str = "trace_screen"):
    """GX ExpectationSuite the screen runs over witness rows of several job windows at once.

    The trace suite's value rules with the manifest's bounds as columns of the frame
    (`<column>_max`, `window_job_id`) and the window index in the uniqueness key, so one
    run checks windows of different jobs. Nulls are not in it: Arrow counts them exactly,
    and a window holding any goes to the row-level suites.
    """
    import great_expectations as gx

    return gx.ExpectationSuite(name=name, expectations=value_expectations(True, None, bound_columns=True))


def manifest_suite(name: str = "manifest"):
    """GX ExpectationSuite for manifest rows: non-null fields, positive sizes, ordered times."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    meta = {"reason": INVALID_MANIFEST}
    # workers (a list of structs) is checked by transforms.validation.manifest_problems: GX has no list expectations
    items = [gxe.ExpectColumnValuesToNotBeNull(column=f.name, meta=meta) for f in MANIFEST_SCHEMA
             if f.name != "workers"]
    items += [
        gxe.ExpectColumnValuesToBeBetween(column=column, min_value=1, meta=meta)
        for column in ("gpus", "dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size", "world_size", "microbatches")
    ]
    items += [
        gxe.ExpectColumnValuesToBeBetween(column="context_length", min_value=0, meta=meta),
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="start_time", column_B="submit_time",
                                                    or_equal=True, meta=meta),
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="end_time", column_B="start_time",
                                                    or_equal=True, meta=meta),
    ]
    return gx.ExpectationSuite(name=name, expectations=items)




# ---------------------------------------------------------------------------
# The suites as GX JSON beside the Arrow schemas (for readers and other GX tools).
# Regenerate after changing a rule:
#   .venv/bin/python -c 'from schemas.expectations import write_suite_files; write_suite_files()'
# (a test keeps them in sync).

SUITE_FILES = ("trace_suite.json", "trace_suite_without_manifest.json", "trace_screen_suite.json", "manifest_suite.json")


def suite_documents() -> dict[str, dict]:
    """File name -> GX JSON of each suite (the trace suite in its parameterised form)."""
    suites = (trace_suite(), trace_suite_without_manifest(), trace_screen_suite(), manifest_suite())
    return {name: suite.to_json_dict() for name, suite in zip(SUITE_FILES, suites)}


def write_suite_files(folder: str | None = None) -> list[str]:
    """Write the suites' JSON into `folder` (default: this package); returns the paths."""
    import json
    import pathlib

    root = pathlib.Path(folder) if folder else pathlib.Path(__file__).parent
    paths = []
    for name, document in suite_documents().items():
        path = root / name
        path.write_text(json.dumps(document, indent=2) + "\n")
        paths.append(str(path))
    return paths
