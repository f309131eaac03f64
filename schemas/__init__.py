"""The lake contract: Arrow schemas (trace), layout (lake), validation rules (expectations).

Importing this package (or `schemas.trace`) is cheap: the validation names are loaded
from `schemas.expectations` on first use (PEP 562), so the one-job path of
`strag analyze` never pays for the validation module, and Great Expectations itself is
imported only when a suite is built. The runtime that applies the rules (`Validator`,
`conform_trace`) is `transforms.validation`.
"""
import importlib

from schemas.lake import LAKE_MARKER, landing_dir, manifest_path, parse_partition, trace_dir
from schemas.trace import *  # noqa: F403 - re-exported as the package's own names
from schemas.trace import __all__ as _TRACE_NAMES

# name -> module that defines it, imported when the name is first read
_LAZY = {name: "schemas.expectations" for name in (
    "REASONS", "Problem", "ValidationReport", "TraceContractError", "PROBLEM_SCHEMA",
    "INVALID_ROW_SCHEMA", "trace_suite", "trace_suite_without_manifest", "manifest_suite",
)}

__all__ = [*_TRACE_NAMES, "LAKE_MARKER", "trace_dir", "manifest_path", "landing_dir", "parse_partition", *_LAZY]


def __getattr__(name: str):
    """Load a validation name from its module on first access (then cache it here)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'schemas' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
