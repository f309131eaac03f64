"""ConvertRawRanks: big raw Kineto windows converted rank by rank on many workers.

In: the pipeline root and the raw windows to fan out (LakeJobs with raw_format "kineto" and many
rank files). Out: PCollection[WindowGroup], one window each, whose MatchedJob carries the
converted job (or the RawInputError refusing it) for AnalyzeJobs to validate and analyse.

A small raw window is converted by the worker that analyses it (transforms/batch/read_windows.py). A big
one (thousands of ranks, tens of MB of JSON each) would keep that worker parsing for minutes
while others idle, so its rank files become elements of their own:

    ListRawRanks (one element per rank file) -> ParseRank (JSON -> RankTrace: the spans that
    matter, ~1% of the JSON) -> GroupByKey(window) -> AssembleWindow (transforms/ingest/kineto.py
    `assemble`: checks, layout, clocks, op rows + manifest)

Only the compact per-rank spans are shuffled, never the JSON. A rank file that is not a trace is
set aside (quarantined with its reason) exactly as the in-worker conversion does; an OSError while
reading is not bad data and fails the element (AnalyzeJobs' dead letters, like any storage error).
"""
from __future__ import annotations

from typing import Iterator

import apache_beam as beam

from schemas.raw import JOB_YAML
from transforms.batch.elements import MatchedJob, WindowGroup
from transforms.io.lake import LakeJob

__all__ = ["ConvertRawRanks", "fan_out", "DEFAULT_FANOUT_RANKS"]

# Raw Kineto windows with at least this many rank files are parsed rank by rank across workers.
DEFAULT_FANOUT_RANKS = 16


def fan_out(job: LakeJob, min_ranks: int) -> bool:
    """Whether the raw window is big enough to parse its ranks on many workers."""
    return job.raw_format == "kineto" and sum(not p.endswith("/" + JOB_YAML) for p in job.trace_files) >= min_ranks


def _window_key(job: LakeJob) -> str:
    return f"{job.date}/{job.job_id}"


def _rank_elements(job: LakeJob) -> Iterator[tuple[str, tuple[LakeJob, str, dict | Exception]]]:
    """(window key, (job, rank file, options or the job.yaml error)) per rank file of the window."""
    from transforms.ingest import RawInputError, read_raw_file
    from transforms.ingest.common import read_job_yaml

    options: dict | Exception = {}
    for path in job.trace_files:
        if path.endswith("/" + JOB_YAML):
            try:
                options = read_job_yaml(read_raw_file(path), job_id=job.job_id, path=path)
            except RawInputError as error:
                options = error
    for path in job.trace_files:
        if not path.endswith("/" + JOB_YAML):
            yield _window_key(job), (job, path, options)


def _parse(element):
    """(key, (job, path, options)) -> (key, (job, RankTrace or RawInputError, options))."""
    from transforms.ingest import RawInputError
    from transforms.ingest.kineto.job import _parse_path

    key, (job, path, options) = element
    if isinstance(options, Exception):
        return key, (job, options, {})
    try:
        return key, (job, _parse_path(path, options), options)
    except RawInputError as error:   # job-level (e.g. a job.yaml label regex): refuses the window
        return key, (job, error, options)


def _assemble(element) -> WindowGroup:
    """(key, [(job, RankTrace or RawInputError, job.yaml options)]) -> WindowGroup of the converted window."""
    from transforms.ingest import RawInputError
    from transforms.ingest.kineto import RankTrace, assemble

    _, parsed = element
    parsed = list(parsed)
    job, options = parsed[0][0], parsed[0][2]
    items = [item for _, item, _ in parsed]
    refusal = next((item for item in items if isinstance(item, RawInputError) and item.level != "file"), None)
    rejected = sorted((item.with_job(job.job_id) for item in items if isinstance(item, RawInputError) and item.level == "file"),
                      key=lambda error: error.path or "")
    if refusal is not None:
        refusal = refusal.with_job(job.job_id)
        refusal.rejected = rejected
        return WindowGroup((MatchedJob(job, None, converted=refusal),))
    ranks = sorted((item for item in items if isinstance(item, RankTrace)), key=lambda trace: trace.path)
    try:
        converted = assemble(ranks, job.job_id, job.date, options, files=len(items))
    except RawInputError as error:
        error.rejected = rejected
        return WindowGroup((MatchedJob(job, None, converted=error),))
    converted.rejected = rejected
    if rejected:
        converted.source["files_rejected"] = {error.path: error.reason_code for error in rejected}
    converted.source["ranks_parsed_in_parallel"] = True
    return WindowGroup((MatchedJob(job, None, converted=converted),))


class ConvertRawRanks(beam.PTransform):
    """PBegin -> PCollection[WindowGroup]: the given raw Kineto windows, parsed rank by rank on
    any worker, assembled per window."""

    def __init__(self, jobs: list[LakeJob]):
        super().__init__()
        for job in jobs:
            if job.raw_format != "kineto":
                raise ValueError(f"ConvertRawRanks: {job.date} {job.job_id} is not a raw Kineto window")
        self._jobs = list(jobs)

    def expand(self, root):
        elements = [element for job in self._jobs for element in _rank_elements(job)]
        return (
            root
            | "ListRawRanks" >> beam.Create(elements)
            | "ParseRank" >> beam.Map(_parse)
            | "GroupRanksByWindow" >> beam.GroupByKey()
            | "AssembleWindow" >> beam.Map(_assemble).with_output_types(WindowGroup)
        )
