"""A synthetic fleet: sampling job specs like the paper's fleet, and writing them to a lake.

:func:`sample_fleet` draws ``days x jobs_per_day`` :class:`JobSpec` s: sizes from 128 to
6,144 GPUs with a heavy tail (median ~256, ~1.5% of jobs >= 4,096 GPUs), dense and
MoE-like models, 4k to 128k contexts (long contexts use context parallelism), 1F1B and
interleaved pipelines, DP overlap on and off, and injected causes
(:func:`transforms.synth.faults.sample_causes`). Work per job is bounded: a job whose
trace would exceed ``max_records`` op records (default 2,000,000, about 30 MB of
parquet) gets fewer sampled steps (down to 12), then fewer microbatches, then fewer
model chunks; its size, parallelism and causes are kept, so the fleet stays realistic
but bounded.

Machines: a pool of HOST_POOL 8-GPU hosts; jobs of the same day get distinct machines.
Slow workers are persistent hardware faults: they sit on a handful of bad machines of
the pool (BAD_HOSTS), so the same host shows up across jobs.

:func:`write_fleet` generates the jobs (in parallel processes, except for memory://
lakes whose filesystem lives in one process), writes each through
:func:`transforms.io.lake.write_job` (one file per (profiling session, stage) holding all DP
ranks of that stage, plus the manifest), corrupts a ``bad_fraction`` of the jobs with
:mod:`transforms.synth.badinput`, and writes the truth table (TRUTH_SCHEMA) to
``{lake}/_truth/truth.parquet``. Analysis code never reads the truth table; it is the
answer key for tests, benchmarks and evaluations.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from schemas.truth import TRUTH_SCHEMA
from transforms.synth.faults import sample_causes
from transforms.synth.job import GPUS_PER_HOST, JobSpec, generate_job

__all__ = [
    "TRUTH_PATH",
    "HOST_POOL",
    "BAD_HOSTS",
    "sample_fleet",
    "write_fleet",
    "write_job_files",
    "truth_table",
    "FleetSummary",
]

TRUTH_PATH = "_truth/truth.parquet"
HOST_POOL = 8192   # machines in the fleet (8 GPUs each)
BAD_HOSTS = 4      # of which persistently slow (the slow-worker cause lives there)

def truth_table(rows: Sequence[dict]) -> pa.Table:
    """TRUTH_SCHEMA table of truth rows (GeneratedJob.truth dicts), sorted by job_id."""
    rows = sorted(rows, key=lambda r: r["job_id"])
    return pa.Table.from_pylist([{f.name: r[f.name] for f in TRUTH_SCHEMA} for r in rows], schema=TRUTH_SCHEMA)


def _choice(rng: np.random.Generator, values, weights):
    weights = np.asarray(weights, dtype=float)
    return values[int(rng.choice(len(values), p=weights / weights.sum()))]


def _bounded(spec: JobSpec, max_records: int) -> JobSpec:
    """Bound a job's op records: fewer sampled steps (down to 12), then microbatches, then chunks."""
    while spec.estimated_records > max_records and spec.steps > 12:
        steps = max(12, int(spec.steps * max_records / spec.estimated_records))
        spec = dataclasses.replace(spec, steps=steps, sessions=min(spec.sessions, steps // 6))
    while spec.estimated_records > max_records:
        multiple = spec.pp if spec.vpp > 1 else 1
        floor = 2 * spec.pp if spec.vpp > 1 else spec.pp
        smaller = max(floor, (spec.microbatches * 3 // 4) // multiple * multiple)
        if smaller != spec.microbatches:
            spec = dataclasses.replace(spec, microbatches=smaller)
        elif spec.vpp > 1:
            spec = dataclasses.replace(spec, vpp=spec.vpp - 1)
        else:
            break   # at the floor: pp microbatches, no interleaving, 12 steps
    return spec


class _FreeHosts:
    """Machines not yet given to a job of the day: concurrent jobs do not share machines."""

    def __init__(self):
        self.free = np.zeros(0, dtype=np.int64)

    def new_day(self, rng: np.random.Generator) -> None:
        self.free = rng.permutation(HOST_POOL)

    def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if n > len(self.free):   # more GPUs asked in one day than the pool has: start over
            self.free = rng.permutation(HOST_POOL)
        taken, self.free = self.free[:n].copy(), self.free[n:]
        return taken


def _sample_spec(rng: np.random.Generator, job_id: str, date: dt.date, max_records: int,
                 bad_hosts: np.ndarray, free_hosts: _FreeHosts) -> JobSpec:
    # Size: 128 * 2^X GPUs, X exponential (heavy tail), capped at 6,144 GPUs.
    target = 128 * 2 ** min(rng.exponential(1.2), np.log2(6144 / 128))
    family = _choice(rng, ("dense", "moe"), (0.65, 0.35))
    context = _choice(rng, (4096, 8192, 32768, 131072), (0.45, 0.25, 0.2, 0.1))
    tp = _choice(rng, (2, 4, 8), (0.2, 0.4, 0.4)) if target < 256 else _choice(rng, (4, 8), (0.3, 0.7))
    cp = 1 if context <= 8192 else (_choice(rng, (2, 4), (0.6, 0.4)) if context == 32768
                                    else _choice(rng, (4, 8), (0.5, 0.5)))
    if target >= 1024:
        pp = _choice(rng, (1, 2, 4, 8, 16), (0.05, 0.15, 0.35, 0.35, 0.1))
    else:
        pp = _choice(rng, (1, 2, 4, 8), (0.2, 0.3, 0.35, 0.15))
    dp = max(1, int(round(target / (tp * cp * pp))))
    dp = max(dp, -(-128 // (tp * cp * pp)))  # at least 128 GPUs
    vpp = int(_choice(rng, (2, 3, 4), (0.5, 0.2, 0.3))) if pp >= 2 and rng.random() < 0.3 else 1
    if vpp > 1:
        microbatches = pp * int(rng.integers(2, 9))
    else:
        microbatches = max(pp, int(_choice(rng, (8, 16, 24, 32, 48, 64), (0.15, 0.25, 0.15, 0.25, 0.1, 0.1))))
    sessions = int(rng.integers(2, 6))
    steps = sessions * int(rng.integers(8, 15))
    dp_overlap = bool(rng.random() < 0.6)
    causes = sample_causes(rng, dp=dp, pp=pp, context_length=context)
    record_seq_lens = bool(rng.random() < 0.3)
    seed = int(rng.integers(2**62))
    record_noop_p2p = bool(rng.random() < 0.3)
    start = dt.datetime.combine(date, dt.time(), dt.timezone.utc) + dt.timedelta(seconds=int(rng.integers(0, 20 * 3600)))

    spec = JobSpec(job_id=job_id, dp=dp, pp=pp, tp=tp, cp=cp, vpp=vpp, microbatches=microbatches, steps=steps,
                   sessions=sessions, model_family=family, context_length=context, dp_overlap=dp_overlap,
                   causes=causes, seed=seed, date=date, start_time=start, record_seq_lens=record_seq_lens,
                   record_noop_p2p=record_noop_p2p)
    spec = _bounded(spec, max_records)

    hosts = free_hosts.take(spec.n_hosts, rng)
    slow = spec.cause("slow_worker")
    if slow is not None:
        # The slow worker's machine is one of the fleet's bad hosts (persistent hardware fault).
        rank = spec.tp * spec.cp * (slow.params["dp_rank"] + spec.dp * slow.params["stage"])
        bad = int(rng.choice(bad_hosts))
        hosts[hosts == bad] = hosts[rank // GPUS_PER_HOST]
        hosts[rank // GPUS_PER_HOST] = bad
    return dataclasses.replace(spec, hosts=tuple(f"node-{h:05d}" for h in hosts))


def sample_fleet(days: int, jobs_per_day: int, seed: int, start_date: dt.date | str = dt.date(2024, 1, 1),
                 *, max_records: int = 2_000_000) -> list[JobSpec]:
    """JobSpecs of a fleet: ``jobs_per_day`` jobs starting on each of ``days`` days from start_date.

    Deterministic in (days, jobs_per_day, seed, start_date, max_records). Job ids are
    ``job-YYYYMMDD-NNN``. ``max_records`` bounds the op records of one job (see module doc).
    """
    if days < 1 or jobs_per_day < 1:
        raise ValueError(f"days and jobs_per_day must be >= 1, got {days} and {jobs_per_day}")
    if max_records < 10_000:
        raise ValueError(f"max_records must be >= 10,000 op records, got {max_records}")
    start_date = dt.date.fromisoformat(start_date) if isinstance(start_date, str) else start_date
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xF1EE7]))
    bad_hosts = rng.choice(HOST_POOL, size=BAD_HOSTS, replace=False)
    specs = []
    free_hosts = _FreeHosts()
    for day in range(days):
        date = start_date + dt.timedelta(days=day)
        free_hosts.new_day(rng)
        for k in range(jobs_per_day):
            specs.append(_sample_spec(rng, f"job-{date:%Y%m%d}-{k:03d}", date, max_records, bad_hosts, free_hosts))
    return specs


def write_job_files(lake: str, job) -> list[str]:
    """Write a GeneratedJob to the lake (trace files + manifest); return the trace file URLs."""
    from transforms.io.lake import write_job

    written = write_job(lake, job.spec.date, job.spec.job_id, dict(job.files()), job.manifest)
    return list(written.trace_files)


def _generate_and_write(task: tuple) -> tuple[dict, float]:
    """Worker: generate one job, write it, corrupt it when asked; return (truth row, seconds)."""
    lake, spec, bad_kind, bad_seed = task
    started = time.perf_counter()
    job = generate_job(spec)
    files = write_job_files(lake, job)
    truth = dict(job.truth)
    if bad_kind is not None:
        truth["bad_kind"], truth["bad_detail"] = _corrupt(lake, spec, files, bad_kind, bad_seed)
    return truth, time.perf_counter() - started


def _corrupt(lake: str, spec: JobSpec, files: list[str], kind: str, seed: int) -> tuple[str, str]:
    """Apply bad-input ``kind`` (or, when the job cannot carry it, the next kind that fits)."""
    from schemas.lake import manifest_path
    from transforms.synth import badinput

    kinds = list(badinput.BAD_KINDS)
    start = kinds.index(kind)
    refusals = []
    for attempt in kinds[start:] + kinds[:start]:
        try:
            detail = badinput.corrupt_job(None, attempt, files, manifest_path(lake, spec.date, spec.job_id),
                                          np.random.default_rng(seed))
            return attempt, detail
        except badinput.BadInputError as error:
            refusals.append(f"{attempt}: {error}")
    raise RuntimeError(f"job {spec.job_id}: no bad-input kind applies ({'; '.join(refusals)})")


@dataclasses.dataclass(frozen=True)
class FleetSummary:
    """What write_fleet wrote: job count, bad jobs, op records, wall time (seconds), truth URL."""

    jobs: int
    bad_jobs: int
    records: int
    seconds: float
    truth_path: str


def write_fleet(lake_url: str, specs: Sequence[JobSpec], *, bad_fraction: float = 0.0, seed: int = 0,
                processes: int | None = None,
                progress: Callable[[int, int, dict, float], None] | None = None) -> FleetSummary:
    """Generate and write every spec to the lake, corrupt ``bad_fraction`` of the jobs, write the truth.

    Bad jobs are chosen with ``seed``; their kinds cycle through ``badinput.BAD_KINDS`` so
    each kind appears (a job that cannot carry its kind gets the next one). ``processes``: worker processes (default: CPU count; memory://
    lakes always run in this process). ``progress(done, total, truth_row, seconds)`` is
    called after each job. The result is byte-identical for the same inputs.
    """
    from transforms.io.lake import write_lake_marker, write_parquet

    if not 0.0 <= bad_fraction <= 1.0:
        raise ValueError(f"bad_fraction must be within [0, 1], got {bad_fraction}")
    ids = [s.job_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("job ids of a fleet must be unique")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xBAD]))
    n_bad = int(round(bad_fraction * len(specs)))
    kinds: list[str | None] = [None] * len(specs)
    if n_bad:
        try:
            from transforms.synth import badinput
        except ImportError as error:
            raise RuntimeError(f"bad input needs transforms/synth/badinput.py, which cannot be imported: {error}") \
                from None
        order = list(badinput.BAD_KINDS)
        for i, index in enumerate(sorted(rng.choice(len(specs), size=n_bad, replace=False))):
            kinds[int(index)] = order[i % len(order)]
    bad_seeds = rng.integers(2**62, size=len(specs))

    started = time.perf_counter()
    write_lake_marker(lake_url)
    tasks = [(lake_url, spec, kinds[i], int(bad_seeds[i])) for i, spec in enumerate(specs)]
    # Largest jobs first: keeps both processes busy until the end.
    tasks.sort(key=lambda t: -t[1].estimated_records)
    processes = processes or os.cpu_count() or 1
    in_process = processes <= 1 or len(tasks) <= 1 or lake_url.startswith("memory://")
    rows: list[dict] = []
    if in_process:
        results = map(_generate_and_write, tasks)
        pool = None
    else:
        pool = multiprocessing.get_context("spawn").Pool(min(processes, len(tasks)))
        results = pool.imap_unordered(_generate_and_write, tasks, chunksize=1)
    try:
        for row, seconds in results:
            rows.append(row)
            if progress is not None:
                progress(len(rows), len(tasks), row, seconds)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    truth_path = f"{lake_url.rstrip('/')}/{TRUTH_PATH}"
    write_parquet(truth_path, truth_table(rows))
    return FleetSummary(jobs=len(rows), bad_jobs=n_bad, records=sum(r["records"] for r in rows),
                        seconds=time.perf_counter() - started, truth_path=truth_path)
