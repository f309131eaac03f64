"""Watch the lake's landing area: profiling-session files as they arrive.

A profiling session lands in one of two formats, its files in any order, some late,
some twice. strag's own parquet (one file per worker plus the job's manifest)::

    {lake}/landing/{job_id}/{session}/manifest.parquet             one row, MANIFEST_SCHEMA
    {lake}/landing/{job_id}/{session}/worker-{dp}-{stage}.parquet  that worker's op rows, TRACE_SCHEMA

or torch.profiler's own output (a Kineto session: what strag_collect's `kineto_handler(...,
live=True)` and `strag land --live` write), converted by the watcher like a raw window::

    {lake}/landing/{job_id}/{session}/rank-{rank}-of-{world}.json.gz  one rank's Chrome trace (.json too)
    {lake}/landing/{job_id}/{session}/job.yaml                        optional: schemas/raw.py JOB_YAML_KEYS

A Kineto file's name says its global rank and the job's world size, so the watcher knows
the session is complete (ranks 0..world-1 landed) without opening a trace; the converter
still places each rank from the trace's own distributedInfo. A session holds one format:
a file of the other format landing in it is quarantined (`landing_layout`).

Writers land a file atomically (write a hidden ``.name.tmp``, then rename); names
starting with ``.`` or ``_`` are never read. The manifest sits in the session folder
(not under ``manifests/date=...``) so that a session is self-contained: the watcher
needs no date to find it, and the manifest's own ``date`` names the partition (a Kineto
session's date is the UTC day of its first file).

`WatchLanding` turns each poll of the landing area into one `SessionListing` per
session folder, keyed by ``"{job_id}/{session}"``: the folder's files with their
modification times and the poll time. The listings are the clock of the session
timeout downstream (transforms/live/sessions.py), which makes the timeout independent of
the runner's timer and watermark support (see ARCHITECTURE.md, streaming). Files that
are not in a session folder (strays) are quarantined (`landing_layout`) and moved out of
the landing area at once, to ``{lake}/landing_archive/_strays/{modification ms}/{path}``:
no per-path state is kept for them, and no poll lists them again.

History does not accumulate: once a session has been analysed and nothing has
changed for the retention period, its files move to
``{lake}/landing_archive/{job_id}/{session}/`` (`LandingArchive`) and its state is
dropped, so a poll lists only the sessions still in play. A file that lands in a
session already archived is set aside beside it (``_late/``) and quarantined
(`session_closed`).

Plain helpers here also land a generated job as per-worker session files
(`land_session`), for tests, the benchmark and demos.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import threading
import time
import typing
from collections.abc import Iterable, Iterator

import apache_beam as beam
import fsspec
import numpy as np
import pyarrow as pa
from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.metrics import Metrics
from apache_beam.utils.timestamp import Timestamp

from schemas.lake import LANDING, LANDING_ARCHIVE, landing_dir, safe_job_id
from transforms.io.lake import manifest_table, write_parquet

__all__ = [
    "LANDING_MANIFEST",
    "LANDING_LAYOUT",
    "LandingEvent",
    "SessionListing",
    "LandingArchive",
    "LandingPathError",
    "WatchConfig",
    "WatchLanding",
    "STOP_REQUESTED",
    "parse_landing_path",
    "parse_landing_name",
    "landing_worker_path",
    "landing_manifest_path",
    "kineto_trace_name",
    "LANDING_JOB_YAML",
    "expected_workers",
    "split_workers",
    "land_session",
    "session_trace",
    "land_generated_session",
]

_LOG = logging.getLogger(__name__)

LANDING_MANIFEST = "manifest.parquet"
LANDING_LAYOUT = "landing_layout"  # quarantine reason code of a misplaced landing file
SESSION_CLOSED = "session_closed"  # quarantine reason code of a file landing in an archived session
LATE_FOLDER = "_late"  # beside an archived session: files that landed after it was archived
STRAYS_FOLDER = "_strays"  # in the archive: files that landed outside every session folder
LANDING_JOB_YAML = "job.yaml"  # a Kineto session's options (schemas.raw.JOB_YAML)
_WORKER_FILE = re.compile(r"^worker-(\d+)-(\d+)\.parquet$")
# a rank's raw profile: torch.profiler's trace (.json, strag_collect.kineto.live_trace_name writes it) or
# veScale NDTimeline's records (.jsonl)
_RANK_FILE = re.compile(r"^rank-(\d+)-of-(\d+)\.(json|jsonl)(?:\.gz)?$")


class LandingPathError(ValueError):
    """A file in the landing area that does not follow the landing layout."""


@dataclasses.dataclass(frozen=True)
class LandingEvent:
    """One thing that happened to a session, as seen by one poll (the input of
    transforms.live.sessions.SessionState, derived from the poll's SessionListing).

    kind: ``worker`` (a worker file, first sighting), ``manifest`` (the session
    manifest, with `workers` = the (dp_rank, stage) pairs it expects), ``kineto`` (a
    rank's torch.profiler trace: `rank` of `world`), ``ndtimeline`` (a rank's NDTimeline
    records, likewise), ``job_yaml`` (a raw session's options), ``redelivery`` (a path seen before, delivered again with a new modification
    time), or ``tick`` (the session folder exists at `poll_time`; `final` on the
    watcher's last poll). poll_time is wall-clock seconds since the epoch.
    """

    kind: str
    job_id: str
    session: str
    poll_time: float
    path: str = ""
    dp_rank: int = -1
    stage: int = -1
    workers: tuple[tuple[int, int], ...] = ()
    final: bool = False
    rank: int = -1
    world: int = 0

    @property
    def key(self) -> str:
        return session_key(self.job_id, self.session)


def session_key(job_id: str, session: str) -> str:
    """State key of one profiling session: '{job_id}/{session}'."""
    return f"{job_id}/{session}"


@dataclasses.dataclass(frozen=True)
class SessionListing:
    """One poll's view of one session folder: its files as ((url, modification time), ...)
    sorted by url, the poll time (epoch seconds) and whether this is the watcher's last poll."""

    job_id: str
    session: str
    poll_time: float
    files: tuple[tuple[str, float], ...] = ()
    final: bool = False

    @property
    def key(self) -> str:
        return session_key(self.job_id, self.session)


def landing_worker_path(lake: str, job_id: str, session: str | int, dp_rank: int, stage: int) -> str:
    """Where worker (dp_rank, stage) of a session lands."""
    return f"{landing_dir(lake, job_id, session)}/worker-{int(dp_rank)}-{int(stage)}.parquet"


def landing_manifest_path(lake: str, job_id: str, session: str | int) -> str:
    """Where a session's manifest (one MANIFEST_SCHEMA row) lands."""
    return f"{landing_dir(lake, job_id, session)}/{LANDING_MANIFEST}"


def kineto_trace_name(rank: int, world: int, compress: bool = True) -> str:
    """Name of one rank's torch.profiler trace in a live session: rank-{rank}-of-{world}.json[.gz]."""
    if not 0 <= int(rank) < int(world):
        raise ValueError(f"rank {rank} of world {world}: a rank is 0..world-1")
    return f"rank-{int(rank)}-of-{int(world)}.json" + (".gz" if compress else "")


def parse_landing_path(path: str) -> tuple[str, str, str, int, int]:
    """'.../landing/J/S/worker-3-1.parquet' -> (J, S, 'worker', 3, 1); manifest -> (J, S, 'manifest', -1, -1);
    '.../rank-2-of-8.json.gz' -> (J, S, 'kineto', 2, 8); job.yaml -> (J, S, 'job_yaml', -1, -1).

    Raises LandingPathError naming the file and the expected layout.
    """
    parts = path.rstrip("/").split("/")
    try:
        root = len(parts) - 1 - parts[::-1].index(LANDING)
    except ValueError:
        raise LandingPathError(f"{path}: not under a '{LANDING}/' folder") from None
    rest = parts[root + 1:]
    if len(rest) != 3 or not rest[0] or not rest[1]:
        raise LandingPathError(
            f"{path}: expected {LANDING}/JOB_ID/SESSION/worker-DP-STAGE.parquet or .../{LANDING_MANIFEST} "
            f"(parquet sessions), or .../rank-RANK-of-WORLD.json.gz and .../{LANDING_JOB_YAML} (Kineto sessions)"
        )
    job_id, session, name = rest
    return (job_id, session, *parse_landing_name(name, f"{path}: job {job_id} session {session}"))


def parse_landing_name(name: str, where: str) -> tuple[str, int, int]:
    """A file name in a session folder -> ('worker', dp, stage), ('manifest', -1, -1), ('kineto', rank,
    world), ('ndtimeline', rank, world) or ('job_yaml', -1, -1).

    where: how to name the file in the LandingPathError raised for any other name."""
    if name == LANDING_MANIFEST:
        return "manifest", -1, -1
    if name == LANDING_JOB_YAML:
        return "job_yaml", -1, -1
    match = _WORKER_FILE.match(name)
    if match:
        return "worker", int(match.group(1)), int(match.group(2))
    match = _RANK_FILE.match(name)
    if match:
        rank, world = int(match.group(1)), int(match.group(2))
        if rank >= world:
            raise LandingPathError(f"{where}: file name {name!r}: rank {rank} is not below the world size {world}")
        return ("kineto" if match.group(3) == "json" else "ndtimeline"), rank, world
    raise LandingPathError(f"{where}: file name {name!r} is none of worker-DP-STAGE.parquet, {LANDING_MANIFEST} "
                           f"(parquet sessions), rank-RANK-of-WORLD.json[.gz], {LANDING_JOB_YAML} (Kineto sessions), "
                           "rank-RANK-of-WORLD.jsonl[.gz] (NDTimeline sessions)")


def expected_workers(row: dict) -> tuple[tuple[int, int], ...]:
    """The (dp_rank, stage) pairs a session must deliver, from its manifest row (dict):
    the manifest's worker list, or the full dp_size x pp_size grid when that list is empty."""
    listed = row.get("workers") or []
    if listed:
        return tuple(sorted({(int(w["dp_rank"]), int(w["stage"])) for w in listed}))
    return tuple((dp, stage) for dp in range(int(row["dp_size"])) for stage in range(int(row["pp_size"])))


# ---------------------------------------------------------------- landing files (writers)


def split_workers(trace: pa.Table) -> dict[tuple[int, int], pa.Table]:
    """Split a job's op table into one table per worker (dp_rank, stage), rows in original order."""
    dp = trace.column("dp_rank").to_numpy().astype(np.int64)
    stage = trace.column("stage").to_numpy().astype(np.int64)
    code = dp * (int(stage.max(initial=0)) + 1) + stage
    order = np.argsort(code, kind="stable")
    sorted_code = code[order]
    bounds = np.flatnonzero(np.diff(sorted_code)) + 1
    out = {}
    for chunk in np.split(order, bounds):
        if len(chunk):
            first = chunk[0]
            out[(int(dp[first]), int(stage[first]))] = trace.take(pa.array(chunk))
    return out


def land_session(
    lake: str,
    job_id: str,
    session: str | int,
    trace: pa.Table,
    manifest: pa.Table | dict,
    *,
    workers: Iterable[tuple[int, int]] | None = None,
    with_manifest: bool = True,
) -> list[str]:
    """Land a job's trace as one session: its manifest and one file per worker.

    trace: TRACE_SCHEMA rows of the job (e.g. a generated job); manifest: its
    MANIFEST_SCHEMA row (one-row table or dict). Files are written atomically
    (transforms.io.lake.write_parquet). `workers` restricts (and orders) which worker files are
    written now, so tests can land a session in pieces. Returns the paths written.
    """
    written = []
    if with_manifest:
        path = landing_manifest_path(lake, job_id, session)
        write_parquet(path, manifest_table(manifest))
        written.append(path)
    per_worker = split_workers(trace)
    for worker in (per_worker if workers is None else workers):
        path = landing_worker_path(lake, job_id, session, *worker)
        write_parquet(path, per_worker[tuple(worker)])
        written.append(path)
    return written


def session_trace(job, session: int) -> pa.Table:
    """Rows of one profiling session of a generated job (transforms.synth GeneratedJob:
    its `parts` slice the trace per (session, stage))."""
    pieces = [job.trace.slice(part.offset, part.length) for part in job.parts if part.session == session]
    if not pieces:
        sessions = sorted({part.session for part in job.parts})
        raise ValueError(f"job {job.spec.job_id}: no session {session} (sessions {sessions})")
    return pa.concat_tables(pieces)


def land_generated_session(lake: str, job, session: int, name: str | None = None, **options) -> list[str]:
    """Land session `session` of a generated job as landing/{job_id}/{name}/ (name defaults
    to 's{session}'); options as for `land_session`. Returns the paths written."""
    return land_session(lake, job.spec.job_id, name or f"s{session}", session_trace(job, session), job.manifest, **options)


# ---------------------------------------------------------------- the watcher


@dataclasses.dataclass(frozen=True)
class WatchConfig:
    """How the landing area is watched.

    lake: fsspec URL of the lake. interval_seconds: time between polls.
    start_time: wall-clock seconds of the first poll (pass it explicitly: a
    default evaluated at import time would be stale). stop_time: wall-clock
    seconds after which the watcher makes one final poll and ends (None: never).
    stop_after_sessions / out: end once the live table under output URL `out` holds
    results for this many sessions (None: never). status_every: print a status line
    every this many polls (0: never).
    """

    lake: str
    interval_seconds: float = 1.0
    start_time: float = 0.0
    stop_time: float | None = None
    stop_after_sessions: int | None = None
    out: str | None = None
    status_every: int = 0

    def __post_init__(self):
        if not self.lake:
            raise ValueError("WatchConfig.lake: give the lake URL")
        if not (self.interval_seconds > 0):
            raise ValueError(f"WatchConfig.interval_seconds must be > 0, got {self.interval_seconds!r}")
        if self.stop_time is not None and self.stop_time < self.start_time:
            raise ValueError("WatchConfig.stop_time precedes start_time")
        if self.stop_after_sessions is not None:
            if self.stop_after_sessions < 1:
                raise ValueError("WatchConfig.stop_after_sessions must be >= 1")
            if not self.out:
                raise ValueError("WatchConfig.stop_after_sessions needs out (the output URL of the live table)")

    @property
    def landing(self) -> str:
        return f"{self.lake.rstrip('/')}/{LANDING}"

    def should_stop(self, now: float) -> bool:
        """True when the watcher must end after this poll."""
        if STOP_REQUESTED.is_set():
            return True
        if self.stop_time is not None and now >= self.stop_time:
            return True
        if self.stop_after_sessions is not None:
            # Imported here: transforms.live.results imports this module.
            from transforms.live.results import count_live_sessions

            return count_live_sessions(self.out) >= self.stop_after_sessions
        return False


# Set (e.g. by `strag watch`'s Ctrl-C handler) to end the watcher at its next poll: that poll is
# the final one, so pending sessions are analysed with what they have before the pipeline ends.
# A process-wide flag: it reaches the poll clock when the runner runs it in this process (the
# embedded default); on a distributed runner, stop the job with the runner's drain instead.
STOP_REQUESTED = threading.Event()


class _PollRestrictionProvider(beam.transforms.core.RestrictionProvider):
    """Poll index range [0, max polls): unbounded in practice."""

    def initial_restriction(self, config: WatchConfig) -> OffsetRange:
        return OffsetRange(0, 2**62)

    def create_tracker(self, restriction: OffsetRange) -> OffsetRestrictionTracker:
        return OffsetRestrictionTracker(restriction)

    def restriction_size(self, config, restriction) -> int:
        return 8

    def truncate(self, config, restriction):
        return None  # on drain: stop polling at once


class _PollClockFn(beam.DoFn):
    """Emits (poll index, poll_time, final) at `interval_seconds` from `start_time`, timestamped
    with the poll time, until the config's stop condition holds; the last poll has
    final=True. Between polls it defers its remainder (runners that honour the resume
    time wait without a thread), after waiting out at most one interval itself."""

    @beam.DoFn.unbounded_per_element()
    def process(
        self,
        config: WatchConfig,
        tracker=beam.DoFn.RestrictionParam(_PollRestrictionProvider()),
        watermark=beam.DoFn.WatermarkEstimatorParam(ManualWatermarkEstimator.default_provider()),
    ) -> Iterator[tuple[int, float, bool]]:
        # One poll per bundle, so its files go downstream at once; a poll that fell behind
        # (a slow poll) runs immediately on re-entry.
        index = tracker.current_restriction().start
        due = config.start_time + index * config.interval_seconds
        now = time.time()
        if 0 < due - now <= config.interval_seconds:
            # The FnApiRunner resumes a deferred restriction at once, whatever its resume
            # time: deferring alone spun a core at ~35% while idle. Its stages run in turn,
            # so by now downstream work of the previous poll is done; waiting out the rest
            # of one interval here costs no latency.
            STOP_REQUESTED.wait(due - now)
            now = time.time()
        if due > now:
            _advance(watermark, Timestamp.of(due))
            tracker.defer_remainder(Timestamp.of(due))
            return
        if not tracker.try_claim(index):
            return
        final = config.should_stop(now)
        _advance(watermark, Timestamp.of(now))
        yield beam.window.TimestampedValue((index, now, final), now)
        if final:
            # Claiming past the end marks the restriction done: the source ends.
            tracker.try_claim(tracker.current_restriction().stop)
            return
        next_due = config.start_time + (index + 1) * config.interval_seconds
        tracker.defer_remainder(Timestamp.of(max(next_due, now)))


def _advance(watermark: ManualWatermarkEstimator, to: Timestamp) -> None:
    current = watermark.current_watermark()
    if current is None or to > current:
        watermark.set_watermark(to)


class _ListLandingFn(beam.DoFn):
    """One poll: a (session key, SessionListing) per session folder on the main output, and
    (path, (modification time, poll time)) on 'strays' for files outside any session folder.

    Every `status_every` polls it prints one status line (poll number, sessions and files
    listed, listing time, process RSS): what an on-call engineer checks to see that the
    watcher keeps up, and what benchmarks/bench_watch_soak.py reads."""

    def __init__(self, landing: str, status_every: int = 0):
        self._landing = landing
        self._status_every = status_every

    def setup(self):
        self._fs, self._root = fsspec.core.url_to_fs(self._landing)
        self._protocol = self._landing.split("://", 1)[0] + "://" if "://" in self._landing else ""

    def process(self, poll: tuple[int, float, bool]):
        index, poll_time, final = poll
        started = time.perf_counter()
        self._fs.invalidate_cache()
        try:
            found = self._fs.find(self._root, detail=True)
        except FileNotFoundError:
            found = {}
        listed = time.perf_counter() - started
        sessions: dict[tuple[str, str], list[tuple[str, float]]] = {}
        root = self._root.rstrip("/")
        for path, info in found.items():
            relative = path[len(root):].lstrip("/").split("/")
            if relative[-1].startswith((".", "_")) or not relative[-1] or info.get("type") == "directory":
                continue  # in-flight temporaries and markers; an object store's folder markers (the landing root's too)
            url = self._protocol + path if self._protocol and not path.startswith(self._protocol) else path
            if len(relative) == 3 and _id_problem(relative[0], relative[1]) is None:
                sessions.setdefault((relative[0], relative[1]), []).append((url, _modification_time(info)))
            else:
                yield beam.pvalue.TaggedOutput("strays", (url, (_modification_time(info), poll_time)))
        for (job_id, session), files in sorted(sessions.items()):
            listing = SessionListing(job_id, session, poll_time, tuple(sorted(files)), final)
            yield listing.key, listing
        if self._status_every and ((index + 1) % self._status_every == 0 or final):
            print(f"strag watch: poll {index + 1}: {len(sessions)} session(s) in play, {len(found)} file(s) listed "
                  f"in {listed * 1e3:.1f} ms, RSS {_rss_mib():.0f} MiB", flush=True)


def _id_problem(job_id: str, session: str) -> str | None:
    """Why a job id / session pair cannot name a session folder; None when both can."""
    try:
        safe_job_id(job_id)
        safe_job_id(session, "session")
    except ValueError as error:
        return str(error)
    return None


def _rss_mib() -> float:
    """Resident memory of this process in MiB (Linux /proc; nan elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return math.nan


def _modification_time(info: dict) -> float:
    for name in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(name)
        if value is None:
            continue
        return value.timestamp() if hasattr(value, "timestamp") else float(value)
    return math.nan


class _QuarantineStrayFn(beam.DoFn):
    """For files outside any session folder: moves each out of the landing area (LandingArchive.
    set_aside_stray), then quarantines it, so it is quarantined once, no poll lists it again and
    no state is kept per path (a stray landing again under the same name is a new file, quarantined
    again). A move that fails (after the IO layer's retries) is logged and tried at the next poll,
    which lists the file again; it is quarantined when it has moved."""

    def __init__(self, lake: str):
        self._archive = LandingArchive(lake)
        self._quarantined = Metrics.counter("landing", "quarantined_files")
        self._failed = Metrics.counter("landing", "stray_move_failures")

    def process(self, element):
        from transforms.io.storage import retry

        path, (modified, poll_time) = element
        try:
            target = retry("moving", path, lambda: self._archive.set_aside_stray(path, modified))
        except OSError as error:
            self._failed.inc()
            _LOG.warning("stray file %s stays in the landing area until the next poll: %s", path, error)
            return
        self._quarantined.inc()
        yield quarantine_row(path, None, "", LANDING_LAYOUT, f"{_stray_detail(path)}; moved to {target}", poll_time)


def _stray_detail(path: str) -> str:
    """Why a file of the landing area is outside every session folder."""
    try:
        job_id, session, *_ = parse_landing_path(path)
    except LandingPathError as error:
        return str(error)
    problem = _id_problem(job_id, session)
    return f"{path}: {problem}" if problem else f"{path}: not in a session folder under {LANDING}/"


def quarantine_row(path: str, job_id: str | None, session: str, reason_code: str, detail: str, poll_time: float) -> dict:
    """A QUARANTINE_SCHEMA row (file level) plus the session and the poll time that saw it."""
    reasons = {LANDING_LAYOUT: "the file does not follow the landing layout; rename or remove it",
               SESSION_CLOSED: "the file landed after its session was analysed and archived; its result stands "
                               "without it: land the session again under a new name, or raise --retain",
               "unreadable_manifest": "the session manifest cannot be read; re-upload it",
               "invalid_manifest": "the session manifest breaks the manifest contract; fix the writer"}
    return {"job_id": job_id, "session": session, "source_path": path, "level": "file", "reason_code": reason_code,
            "reason": reasons.get(reason_code, reason_code), "detail": detail, "row_index": None, "rows": None,
            "seen_time": poll_time}


class LandingArchive:
    """Where sessions go once they are done: {lake}/landing_archive/{job_id}/{session}/.

    Moving them out of the landing area keeps each poll's listing as small as the sessions
    still in play, however long the watcher runs. Moves go through fsspec (a rename on a
    local disk, copy + delete on object storage); a failure raises OSError and the caller
    keeps the session to try again at the next poll."""

    def __init__(self, lake: str):
        self.lake = lake.rstrip("/")
        self._fs = None

    def _filesystem(self):
        if self._fs is None:
            self._fs, root = fsspec.core.url_to_fs(self.lake)
            self._landing = f"{root.rstrip('/')}/{LANDING}"
            self._archive = f"{root.rstrip('/')}/{LANDING_ARCHIVE}"
        return self._fs

    def __getstate__(self):  # a filesystem handle does not travel to workers
        return {"lake": self.lake, "_fs": None}

    def session_dir(self, job_id: str, session: str) -> str:
        self._filesystem()
        return f"{self._archive}/{job_id}/{session}"

    def holds(self, job_id: str, session: str) -> bool:
        """True when this session was archived earlier."""
        return self._filesystem().exists(self.session_dir(job_id, session))

    def retire(self, job_id: str, session: str, urls: Iterable[str]) -> None:
        """Move a session's files (manifest last) into the archive; drop its empty folders."""
        target = self.session_dir(job_id, session)
        for url in sorted(urls, key=lambda url: url.endswith(f"/{LANDING_MANIFEST}")):
            self._move(url, f"{target}/{url.rsplit('/', 1)[-1]}")
        self._drop_landing_folders(job_id, session)
        _LOG.debug("archived job %s session %s into %s", job_id, session, target)

    def set_aside(self, job_id: str, session: str, urls: Iterable[str], poll_time: float) -> list[tuple[str, str]]:
        """Move files that landed in an archived session beside it (_late/, named by poll time);
        returns (url, where it went) per file."""
        moved = []
        stamp = f"{int(poll_time * 1000)}"
        for url in sorted(urls):
            target = f"{self.session_dir(job_id, session)}/{LATE_FOLDER}/{stamp}-{url.rsplit('/', 1)[-1]}"
            self._move(url, target)
            moved.append((url, target))
        self._drop_landing_folders(job_id, session)
        return moved

    def set_aside_stray(self, url: str, modified: float) -> str:
        """Move a file outside every session folder to {archive}/_strays/{modification ms}/{its path
        under landing/}, drop the landing folders it leaves empty; returns where it went. Idempotent
        (a retried bundle finds it moved)."""
        fs = self._filesystem()
        _, source = fsspec.core.url_to_fs(url)
        relative = source[len(self._landing):].lstrip("/")
        stamp = int(modified * 1000) if math.isfinite(modified) else 0
        target = f"{self._archive}/{STRAYS_FOLDER}/{stamp}/{relative}"
        from transforms.io.storage import exists

        if not exists(fs, source) and exists(fs, target):
            return target
        self._move(url, target)
        folder = source.rsplit("/", 1)[0]
        while folder.startswith(self._landing + "/"):   # empty folders left behind (local disks)
            try:
                if not (fs.isdir(folder) and not fs.ls(folder)):
                    break
                fs.rmdir(folder)
            except OSError:
                break   # a file landed meanwhile: the folder stays
            folder = folder.rsplit("/", 1)[0]
        return target

    def _move(self, url: str, target: str) -> None:
        fs = self._filesystem()
        _, source = fsspec.core.url_to_fs(url)
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.mv(source, target)

    def _drop_landing_folders(self, job_id: str, session: str) -> None:
        """Remove the session's landing folder and then its job's, each if left empty (local
        disks; object stores have no folders)."""
        fs = self._filesystem()
        for folder in (f"{self._landing}/{job_id}/{session}", f"{self._landing}/{job_id}"):
            try:
                if fs.isdir(folder) and not fs.ls(folder):
                    fs.rmdir(folder)
            except OSError:
                pass  # a file landed meanwhile: the folder stays, the next poll sees the file


class WatchLanding(beam.PTransform):
    """PBegin -> {'sessions': (session key, SessionListing) per session folder per poll,
    'quarantine': QUARANTINE_SCHEMA dicts (+ session, seen_time) for files outside any
    session folder, once each}."""

    def __init__(self, config: WatchConfig):
        super().__init__()
        self._config = config

    def expand(self, pbegin):
        listed = (
            pbegin
            | "Start" >> beam.Create([self._config])
            | "PollEvery" >> beam.ParDo(_PollClockFn())
            | "ListLanding" >> beam.ParDo(_ListLandingFn(self._config.landing, self._config.status_every))
            .with_output_types(tuple[str, SessionListing], strays=tuple[str, typing.Any])
            .with_outputs("strays", main="sessions")
        )
        quarantine = listed.strays | "QuarantineStrays" >> beam.ParDo(_QuarantineStrayFn(self._config.lake))
        return {"sessions": listed.sessions, "quarantine": quarantine}
