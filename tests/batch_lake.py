"""A small generated lake for the batch pipeline tests: a few healthy and straggling jobs,
one discarded (untraced CPU work), one the engine rejects, and one job per bad-input kind.

Jobs are tiny (2-4 workers, 6 steps, one file per stage) so a pipeline run stays a few
seconds; what matters here is that every kind of window takes its path through the
pipeline. The expected outcome of each window is returned with the lake.
"""
from __future__ import annotations

import dataclasses
import datetime as dt

import numpy as np
import pyarrow as pa

from transforms.io.lake import list_jobs, write_job
from transforms.synth import badinput
from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec, generate_job

__all__ = ["DATES", "ExpectedWindow", "write_batch_lake", "add_job"]

DATES = ("2024-03-01", "2024-03-02")


@dataclasses.dataclass(frozen=True)
class ExpectedWindow:
    """What the pipeline must do with one window: status in coverage (None: analysed or
    quarantined, both fine) and the reason code that must appear in quarantine."""

    job_id: str
    date: str
    status: str | None
    reason_code: str | None = None


def _spec(job_id: str, date: str, seed: int, **overrides) -> JobSpec:
    fields = dict(dp=2, pp=2, microbatches=4, steps=6, sessions=1, seed=seed, date=dt.date.fromisoformat(date))
    fields.update(overrides)
    return JobSpec(job_id=job_id, **fields)


def add_job(lake: str, spec: JobSpec):
    """Generate and write one job; returns the LakeJob as listed."""
    job = generate_job(spec)
    return write_job(lake, spec.date, spec.job_id, dict(job.files()), job.manifest)


def write_batch_lake(lake: str) -> list[ExpectedWindow]:
    """Write the test lake at `lake` (any fsspec URL); return the expected outcome per window."""
    expected = []
    good = [
        (_spec("clean-a", DATES[0], 1), "analysed"),
        (_spec("slow-b", DATES[0], 2, causes=(Cause("slow_worker", {"dp_rank": 1, "stage": 1, "factor": 1.8}),)), "analysed"),
        (_spec("stage-c", DATES[1], 3, pp=4, microbatches=8, causes=(Cause("last_stage_imbalance"),)), "analysed"),
        (_spec("cpu-d", DATES[1], 4, causes=(Cause("untraced_cpu", {"fraction": 0.4, "scope": "all"}),)), "discarded"),
    ]
    for spec, status in good:
        add_job(lake, spec)
        expected.append(ExpectedWindow(spec.job_id, spec.date.isoformat(), status,
                                       "replay_discrepancy" if status == "discarded" else None))
    # one step is a valid trace, and enough for the engine
    short = _spec("short-e", DATES[0], 5, steps=1)
    add_job(lake, short)
    expected.append(ExpectedWindow(short.job_id, DATES[0], "analysed", None))
    # passes validation (every row is well formed) but a stage's sends have no recv to pair with:
    # a typed engine error, quarantined with its reason
    unpaired = _spec("unpaired-f", DATES[0], 6)
    job = generate_job(unpaired)
    files = {}
    for name, table in job.files():
        optype = table.column("optype").cast(pa.string()).to_numpy(zero_copy_only=False)
        files[name] = table.filter(pa.array(optype != "forward-recv"))
    write_job(lake, unpaired.date, unpaired.job_id, files, job.manifest)
    expected.append(ExpectedWindow(unpaired.job_id, DATES[0], "quarantined", "missing_peer"))

    row_level = {"negative_duration", "duplicate_rows", "unknown_optype"}
    for index, kind in enumerate(badinput.BAD_KINDS):
        date = DATES[index % 2]
        spec = _spec(f"bad-{kind.replace('_', '-')}", date, 100 + index)
        written = add_job(lake, spec)
        badinput.corrupt_job(None, kind, list(written.trace_files), written.manifest_path, np.random.default_rng(index))
        expected.append(ExpectedWindow(spec.job_id, date, None if kind in row_level else "quarantined",
                                       badinput.EXPECTED_REASON[kind]))
    listed = {(j.date, j.job_id) for j in list_jobs(lake, DATES[0], DATES[-1])}
    if listed != {(e.date, e.job_id) for e in expected}:
        raise RuntimeError(f"test lake at {lake}: the listing {sorted(listed)} differs from what was written")
    return expected
