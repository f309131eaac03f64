"""The lake contract: Arrow schemas (trace), layout (lake), validation (expectations).

Importing this package is cheap: Great Expectations is imported only when a suite or
a Validator is built.
"""
from schemas.expectations import (
    INVALID_ROW_SCHEMA,
    PROBLEM_SCHEMA,
    REASONS,
    Problem,
    TraceContractError,
    ValidationReport,
    Validator,
    conform_trace,
    manifest_suite,
    trace_suite,
    trace_suite_without_manifest,
)
from schemas.lake import LAKE_MARKER, landing_dir, manifest_path, parse_partition, trace_dir
from schemas.trace import *  # noqa: F403 - re-exported as the package's own names
from schemas.trace import __all__ as _TRACE_NAMES

__all__ = [
    *_TRACE_NAMES,
    "LAKE_MARKER",
    "trace_dir",
    "manifest_path",
    "landing_dir",
    "parse_partition",
    "REASONS",
    "Problem",
    "ValidationReport",
    "Validator",
    "TraceContractError",
    "PROBLEM_SCHEMA",
    "INVALID_ROW_SCHEMA",
    "trace_suite",
    "trace_suite_without_manifest",
    "manifest_suite",
    "conform_trace",
]
