"""Shared test fixtures: where ../shared lives, and the published reference traces."""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
REFERENCE = SHARED / "reference" / "straggler-analysis"


@pytest.fixture(scope="session")
def reference_dir() -> pathlib.Path:
    """../shared/reference/straggler-analysis, or skip (with the reason) when it is absent."""
    if not REFERENCE.is_dir():
        pytest.skip(f"reference traces not found at {REFERENCE}: clone the project with ../shared beside it")
    return REFERENCE
