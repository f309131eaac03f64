"""MatchJobs: find every job window of a date range in the lake.

In: the pipeline root. Out: PCollection[LakeJob], one element per (date, job_id) that has
trace files or a manifest in [date_from, date_to] (incomplete windows included: the
validator quarantines them with the reason).

The listing runs once, when the graph is built (on the machine that submits the run), and
the windows become a `Create`. Why not list inside a DoFn: on the DaskRunner the number of
partitions of a Create is the run's parallelism (a DoFn expanding one listing element would
keep every job in one partition), and a listing is a handful of LIST calls either way.
Workers then open each window's files themselves by URL.
"""
from __future__ import annotations

import datetime as dt

import apache_beam as beam

from transforms.lake import LakeJob, list_jobs

__all__ = ["MatchJobs", "date_range"]


def date_range(date_from: str, date_to: str) -> tuple[str, ...]:
    """ISO dates from date_from to date_to inclusive; ValueError when reversed or malformed."""
    first, last = dt.date.fromisoformat(date_from), dt.date.fromisoformat(date_to)
    if last < first:
        raise ValueError(f"date range {date_from}..{date_to} is reversed: --from must not be after --to")
    return tuple((first + dt.timedelta(days=i)).isoformat() for i in range((last - first).days + 1))


class MatchJobs(beam.PTransform):
    """PBegin -> PCollection[LakeJob] of the lake's job windows dated date_from..date_to.

    jobs: an already made listing (the CLI lists once to print what it found); None lists now.
    """

    def __init__(self, lake: str, date_from: str, date_to: str, jobs: list[LakeJob] | None = None):
        super().__init__()
        date_range(date_from, date_to)  # fail at graph build, not on a worker
        self._lake, self._date_from, self._date_to = lake, date_from, date_to
        self._jobs = jobs

    def expand(self, root):
        jobs = self._jobs if self._jobs is not None else list_jobs(self._lake, self._date_from, self._date_to)
        outside = [j for j in jobs if not self._date_from <= j.date <= self._date_to]
        if outside:
            raise ValueError(f"MatchJobs: job windows outside {self._date_from}..{self._date_to}: {[(j.date, j.job_id) for j in outside[:3]]}")
        return root | "ListJobWindows" >> beam.Create(list(jobs)).with_output_types(LakeJob)
