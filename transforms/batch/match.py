"""MatchJobs: find every job window of a date range in the lake, with its validated manifest.

In: the pipeline root. Out: PCollection[WindowGroup]: every (date, job_id) that has trace
files or a manifest in [date_from, date_to] (incomplete windows included: the validator
quarantines them with the reason) as a MatchedJob, dealt into `groups` groups of about
equal size and bytes (a worker validates a group with one GX screen run).

The listing and the manifests (one small file per window) are read once, when the graph
is built, on the machine that submits the run; the manifests are validated together in
one Great Expectations run; the windows become a `Create`. Why here and not in DoFns:
- on the DaskRunner the partitions of a Create are the run's parallelism (a DoFn expanding
  one listing element would keep every job in one partition);
- a GX run costs ~0.25 s whatever its row count: one run for all manifests instead of
  one per window saves that much per window, a third of the validation time of a fleet.
Workers then open each window's trace files themselves by URL and validate them.

A group holds all its windows' op rows at once (read, screened together, then analysed one by
one), so its size is bounded by bytes as well as by count: the windows are dealt into more groups
when the planned ones would carry more than GROUP_BYTES of trace files on average (a window larger
than that is a group of its own).
"""
from __future__ import annotations

import datetime as dt
import time

import apache_beam as beam
import fsspec

from transforms.batch.elements import MatchedJob, WindowGroup
from transforms.io.lake import LakeJob, list_jobs, read_manifests

__all__ = ["MatchJobs", "GROUP_BYTES", "date_range", "match_windows", "group_windows", "trace_bytes", "balanced_bins",
           "balanced_order"]

# Trace-file bytes a window group carries at most on average: parquet holds an op row in ~18 bytes
# and Arrow in ~70, so a group then holds about 1 GiB of op rows in a worker.
GROUP_BYTES = 256 * 2**20


def date_range(date_from: str, date_to: str) -> tuple[str, ...]:
    """ISO dates from date_from to date_to inclusive; ValueError naming the option (--from, --to)
    when one is malformed or the range is reversed."""
    dates = []
    for option, text in (("--from", date_from), ("--to", date_to)):
        try:
            dates.append(dt.date.fromisoformat(text))
        except ValueError as error:
            raise ValueError(f"{option} {text}: not a date YYYY-MM-DD ({error})") from None
    first, last = dates
    if last < first:
        raise ValueError(f"--from {date_from} is after --to {date_to}: the date range is reversed")
    return tuple((first + dt.timedelta(days=i)).isoformat() for i in range((last - first).days + 1))


def match_windows(jobs: list[LakeJob], validator=None) -> list[MatchedJob]:
    """Attach to each window its manifest, read and validated with all the others in one GX run.

    validator: a transforms.validation.Validator (built here when None: GX import ~3 s).
    """
    paths = [job.manifest_path for job in jobs if job.manifest_path is not None]
    if validator is None and paths:
        from transforms.validation import Validator

        validator = Validator()  # set-up, like a worker's: not counted as validation time
    started = time.perf_counter()
    manifests = read_manifests(paths, validator) if paths else {}
    share = (time.perf_counter() - started) / max(1, len(jobs))
    out = []
    for job in jobs:
        manifest, problems = manifests.get(job.manifest_path, (None, [])) if job.manifest_path else (None, [])
        out.append(MatchedJob(job, manifest, tuple(problems), share))
    return out


def trace_bytes(jobs: list[LakeJob]) -> list[int]:
    """Bytes of each window's trace files, from one detailed listing per date folder (the
    cost of a window's analysis grows with its op rows, hence with its bytes)."""
    sizes: dict[str, int] = {}
    folders = sorted({path.rsplit("/", 2)[0] for job in jobs for path in job.trace_files})
    fs = None
    for folder in folders:
        fs, root = fsspec.core.url_to_fs(folder)
        sizes.update({path: int(info.get("size") or 0) for path, info in fs.find(root, detail=True).items()})
    return [sum(sizes.get(fs._strip_protocol(path), 0) for path in job.trace_files) if fs else 0 for job in jobs]


def balanced_bins(weights: list[int], capacities: list[int]) -> list[list[int]]:
    """Indices dealt into bins of the given sizes so that the bins' total weights are near
    equal: largest first, each to the lightest bin that has room (ties by index)."""
    bins: list[list[int]] = [[] for _ in capacities]
    totals = [0] * len(capacities)
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        target = min((b for b in range(len(bins)) if len(bins[b]) < capacities[b]), key=lambda b: (totals[b], b))
        bins[target].append(index)
        totals[target] += weights[index]
    return bins


def balanced_order(weights: list[int], chunk: int) -> list[int]:
    """Indices ordering items so that consecutive chunks of `chunk` items have near-equal total weight.

    Chunks have exactly the sizes a `chunk`-sized split of the sequence gives. Deterministic.
    """
    n = len(weights)
    if chunk < 1 or n <= chunk:
        return list(range(n))
    capacities = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    return [index for members in balanced_bins(weights, capacities) for index in members]


def group_windows(windows: list[MatchedJob], weights: list[int], groups: int, chunk: int | None = None) -> list[WindowGroup]:
    """Deal windows into `groups` groups of near-equal size (counts differ by at most one)
    and near-equal weight. Listing order is kept when all weights are equal.

    chunk: when the runner splits the groups into consecutive chunks of this many (the
    DaskRunner's partitions), order the groups so every chunk carries about the same weight.
    """
    if groups < 1:
        raise ValueError(f"group_windows: need at least 1 group, got {groups}")
    groups = min(groups, len(windows)) or 1
    size, extra = divmod(len(windows), groups)
    bins = balanced_bins(weights, [size + (1 if b < extra else 0) for b in range(groups)])
    if chunk is not None:
        bins = [bins[i] for i in balanced_order([sum(weights[i] for i in members) for members in bins], chunk)]
    return [WindowGroup(tuple(windows[i] for i in members)) for members in bins if members]


class MatchJobs(beam.PTransform):
    """PBegin -> PCollection[WindowGroup] of the lake's job windows dated date_from..date_to.

    jobs: an already made listing (the CLI lists once to print what it found); None lists now.
    groups: how many groups to deal the windows into (None: one per window). chunk: when
    the runner splits the groups into consecutive chunks of this many (the DaskRunner's
    partitions), order them so every chunk carries about the same bytes.
    """

    def __init__(self, lake: str, date_from: str, date_to: str, jobs: list[LakeJob] | None = None,
                 chunk: int | None = None, groups: int | None = None):
        super().__init__()
        date_range(date_from, date_to)  # fail at graph build, not on a worker
        if chunk is not None and chunk < 1:
            raise ValueError(f"MatchJobs: chunk must be >= 1, got {chunk}")
        if groups is not None and groups < 1:
            raise ValueError(f"MatchJobs: groups must be >= 1, got {groups}")
        self._lake, self._date_from, self._date_to = lake, date_from, date_to
        self._jobs, self._chunk, self._groups = jobs, chunk, groups

    def expand(self, root):
        jobs = self._jobs if self._jobs is not None else list_jobs(self._lake, self._date_from, self._date_to)
        outside = [j for j in jobs if not self._date_from <= j.date <= self._date_to]
        if outside:
            raise ValueError(f"MatchJobs: job windows outside {self._date_from}..{self._date_to}: {[(j.date, j.job_id) for j in outside[:3]]}")
        jobs = list(jobs)
        if not jobs:   # an empty range (or every window converted elsewhere): an empty run, not an error
            return root | "ListJobWindows" >> beam.Create([]).with_output_types(WindowGroup)
        count = len(jobs) if self._groups is None else self._groups
        weighed = count < len(jobs) or self._chunk is not None
        weights = trace_bytes(jobs) if weighed else [0] * len(jobs)
        count = max(count, min(len(jobs), -(-sum(weights) // GROUP_BYTES)))   # at most GROUP_BYTES a group on average
        groups = group_windows(match_windows(jobs), weights, count, self._chunk)
        return root | "ListJobWindows" >> beam.Create(groups).with_output_types(WindowGroup)
