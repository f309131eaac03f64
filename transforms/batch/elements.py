"""The elements that flow through the batch pipeline, and the coder that carries them.

    MatchJobs ──WindowGroup──► AnalyzeJobs (read, validate, analyse) ──JobOutcome──► CommitTables

A `MatchedJob` names one job window's files (a `LakeJob`, transforms/io/lake.py) with its
manifest, already read and validated (tiny); a `WindowGroup` is the few windows one
worker takes in one call (one GX screen run validates them all). A `ValidatedJob` holds a
window's op rows: it lives inside the worker that read them and is never shuffled (the
job is the unit of parallelism). A `JobOutcome` holds the window's result tables (a few
KB) and is what gets shuffled to the commit step.

Why a coder: Beam estimates element sizes for its byte counters by encoding a sample of
elements, even between fused steps; for an element holding millions of op rows the
default pickle coder would serialise the whole table just to count bytes. `ArrowElementCoder`
answers the estimate from Arrow buffer sizes and encodes with pickle protocol 5 (Arrow
tables pickle as their IPC buffers) only when an element really crosses a process.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Mapping, NamedTuple

import apache_beam as beam
import pyarrow as pa

from transforms.io.lake import LakeJob

__all__ = [
    "MatchedJob",
    "WindowGroup",
    "JobProblem",
    "ValidatedJob",
    "JobStats",
    "JobOutcome",
    "TableFragment",
    "ArrowElementCoder",
    "PHASES",
    "ENGINE_PARTS",
]

# Phases timed inside the DoFns (seconds), summed into the run summary: Dask has no
# metrics, so timings travel with the elements.
PHASES = ("read", "validate", "analyze", "tables", "timeline", "stage", "publish")
# Parts of "analyze" the engine times itself (Verdict.timings), summed as "analyze.<part>".
ENGINE_PARTS = ("compile", "replay", "causes")


@dataclasses.dataclass(frozen=True)
class MatchedJob:
    """A job window as planned by MatchJobs: its files, and its manifest validated with every
    other manifest of the run in one GX run (GX costs ~0.25 s per run whatever the rows).

    manifest: the manifest row (dict of MANIFEST_SCHEMA fields) when it exists and is valid,
    else None; manifest_problems: why not (schemas.expectations.Problem); seconds: this
    window's share of the manifest validation time.
    """

    job: LakeJob
    manifest: dict[str, Any] | None
    manifest_problems: tuple = ()
    seconds: float = 0.0
    # a raw window converted already (transforms/batch/convert_raw.py: ranks parsed on many workers): its
    # transforms.ingest.ConvertedJob, or the RawInputError refusing it
    converted: Any = None


@dataclasses.dataclass(frozen=True)
class WindowGroup:
    """Job windows one worker reads, validates together (one GX screen run: GX's cost per run
    is mostly fixed) and analyses one by one. MatchJobs forms groups of about equal bytes."""

    windows: tuple[MatchedJob, ...]


@dataclasses.dataclass(frozen=True)
class JobProblem:
    """Why a whole job window is quarantined: stable code, human reason, detail, where."""

    reason_code: str
    reason: str
    detail: str | None = None
    source_path: str | None = None


@dataclasses.dataclass
class JobStats:
    """Counts and timings of one job window, for the run summary (not a table: timings vary)."""

    job_id: str
    date: str
    status: str                     # schemas.tables.JOB_STATUSES
    reason_code: str | None = None
    ops: int = 0                    # op rows analysed
    rows_read: int = 0
    rows_quarantined: int = 0
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)   # PHASES -> s
    timeline: bool = False          # its timeline was staged (strag batch --timelines)


@dataclasses.dataclass
class ValidatedJob:
    """One job window after reading and validation, on the worker that will analyse it.

    manifest: the manifest row as a dict (MANIFEST_SCHEMA names) or None; trace: the valid
    op rows (TRACE_SCHEMA) or None when the window is quarantined; quarantine: rows for the
    quarantine table (QUARANTINE_SCHEMA, without `date`); problem: set when the window is
    quarantined whole.
    """

    job: LakeJob
    manifest: dict[str, Any] | None
    trace: pa.Table | None
    quarantine: pa.Table
    problem: JobProblem | None
    stats: JobStats


@dataclasses.dataclass
class JobOutcome:
    """What one job window contributes to the output: table name -> rows (schemas/tables.py
    schemas, without `date`), plus its stats. Nothing else: it is what the runners carry
    between steps and shuffle."""

    job_id: str
    date: str
    tables: dict[str, pa.Table]
    stats: JobStats

    def fragments(self):
        """(table, date, rows) for every non-empty table of this window."""
        for name in sorted(self.tables):
            rows = self.tables[name]
            if rows.num_rows:
                yield TableFragment(name, self.date, rows)


class TableFragment(NamedTuple):
    """Rows for one table and date partition; plain (name, iso date, table) tuples work too
    (AggregateFleet emits those). date is None for unpartitioned tables."""

    table: str
    date: str | None
    rows: pa.Table


def _arrow_bytes(value: Any, depth: int = 0) -> int:
    if isinstance(value, (pa.Table, pa.RecordBatch, pa.Array, pa.ChunkedArray)):
        return value.nbytes
    if depth > 3:
        return 8
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return 64 + sum(_arrow_bytes(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    if isinstance(value, Mapping):
        return 16 + sum(_arrow_bytes(v, depth + 1) for v in value.values())
    if isinstance(value, (tuple, list)):
        return 16 + sum(_arrow_bytes(v, depth + 1) for v in value)
    if isinstance(value, (str, bytes)):
        return len(value)
    return 8


class ArrowElementCoder(beam.coders.Coder):
    """Pickle (protocol 5) coder whose size estimate reads Arrow buffer sizes instead of encoding."""

    def encode(self, value):
        return pickle.dumps(value, protocol=5)

    def decode(self, encoded):
        return pickle.loads(encoded)

    def is_deterministic(self):
        return False

    def estimate_size(self, value):
        return _arrow_bytes(value)

    def to_type_hint(self):
        return Any

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


for _element_type in (ValidatedJob, JobOutcome):
    beam.coders.registry.register_coder(_element_type, ArrowElementCoder)
