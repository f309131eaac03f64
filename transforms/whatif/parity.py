"""Field-by-field comparison of our outputs with the authors' analyzer's JSON files.

The reference writes result-*.json, mw-*.json and ms-*.json; `strag analyze --json`
writes the same result fields plus `mw` / `ms` objects holding the mw / ms fields.
Floats must agree to `TOLERANCE` relative, everything else exactly, with the same keys
and dict orders that are a valid largest-first order of the reference's values. Used by
tests/test_whatif_reference.py and benchmarks/bench_whatif.py (whole commands).
"""
from __future__ import annotations

import math

__all__ = ["TOLERANCE", "compare", "check_order", "reference_mismatches", "json_mismatches"]

TOLERANCE = 1e-6
_PARTS = ("result", "mw", "ms")


def compare(ours, theirs, path: str = "") -> list[str]:
    """Mismatches between two JSON values: keys, values (1e-6 relative) and dict order."""
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path}: expected a dict, got {type(ours).__name__}"]
        if set(ours) != set(theirs):
            return [f"{path}: keys {sorted(ours)} != {sorted(theirs)}"]
        problems = []
        for key in theirs:
            problems += compare(ours[key], theirs[key], f"{path}/{key}")
        problems += check_order(list(ours), theirs, path)
        return problems
    if isinstance(theirs, float):
        if not isinstance(ours, float) or not _close(ours, theirs):
            return [f"{path}: {ours!r} != {theirs!r}"]
        return []
    return [] if ours == theirs else [f"{path}: {ours!r} != {theirs!r}"]


def _close(ours: float, theirs: float) -> bool:
    """|ours - theirs| <= TOLERANCE * |theirs| (numpy.isclose with atol 0), NaN equal to NaN only."""
    if ours == theirs:
        return True
    if math.isnan(theirs) or math.isnan(ours):
        return False
    return abs(ours - theirs) <= TOLERANCE * abs(theirs)


def check_order(our_keys: list[str], theirs: dict, path: str) -> list[str]:
    """Our key order must list the reference's values largest first (equal within tolerance
    may swap) when the reference dict is sorted by value; otherwise it must be identical."""
    values = list(theirs.values())
    sortable = all(isinstance(v, float) for v in values)
    if sortable and all(a >= b for a, b in zip(values, values[1:])) and len(set(values)) > 1:
        ordered = [theirs[key] for key in our_keys]
        bad = [(a, b) for a, b in zip(ordered, ordered[1:]) if a < b * (1 - TOLERANCE)]
        return [f"{path}: order {our_keys} is not largest-first ({bad[0]})"] if bad else []
    if path.endswith("_per_step"):
        return []   # outer order follows the per-step slowdown, checked on that dict
    return [] if our_keys == list(theirs) else [f"{path}: key order {our_keys[:8]} != {list(theirs)[:8]}"]


def reference_mismatches(result, expected: dict) -> list[str]:
    """Mismatches of a WhatIfResult against the reference's result, mw and ms JSON (keys of `expected`)."""
    return (compare(result.to_reference_json(), expected["result"], "result")
            + compare(result.mw_json(), expected["mw"], "mw") + compare(result.ms_json(), expected["ms"], "ms"))


def json_mismatches(ours: dict, expected: dict) -> list[str]:
    """Mismatches of `strag analyze --json` output against the reference's result, mw and ms JSON."""
    problems = compare({key: ours[key] for key in expected["result"] if key in ours}, expected["result"], "result")
    for part in _PARTS[1:]:
        mine = ours.get(part)
        mine = None if mine is None else {key: value for key, value in mine.items() if key != "workers"}
        problems += compare(mine, expected[part], part)
    return problems
