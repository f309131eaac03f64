"""Assemble profiling sessions from their landing events.

Each (job, session) is assembled once its manifest and every worker it lists have
arrived (a Kineto session: once ranks 0..world-1 have, the world size being in the rank
files' names), or once `timeout_seconds` of poll time have passed since its first file
(then it is analysed with what it has, and the assembly says what is missing). A session
holds one format (`FORMAT_LAKE` parquet, `FORMAT_KINETO` traces or `FORMAT_NDTIMELINE` records), set by its first file;
a file of the other format is quarantined (`landing_layout`), never mixed in. A
worker file that arrives after the session was assembled produces a new assembly
with the next revision number: its result supersedes the earlier one. A second
delivery of a worker never adds it twice; it is only counted.

The state machine is plain Python (`SessionState.apply`), tested without a
pipeline; `AssembleSessions` keeps one `SessionState` per session key in Beam
state, fed one `SessionListing` per poll: files not seen before (or re-delivered
with a newer modification time) become events, and the poll itself is the tick.
The clock is the poll time carried by the listings, so the timeout behaves the
same on every runner and under TestStream.

State is bounded: a session that was analysed and has not changed for
`retain_seconds` of poll time is retired: its files move to the landing archive
(transforms.live.landing.LandingArchive) and its state is cleared, so neither the state
nor the next listing grows with the watcher's history.
"""
from __future__ import annotations

import dataclasses
import logging

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

from transforms.io.lake import LakeReadError, read_manifest
from transforms.live.landing import (LANDING_LAYOUT, SESSION_CLOSED, LandingArchive, LandingEvent, LandingPathError,
                                SessionListing, expected_workers, parse_landing_name, quarantine_row)

__all__ = [
    "REASON_COMPLETE",
    "REASON_TIMEOUT",
    "REASON_LATE",
    "REASON_STOPPED",
    "FORMAT_LAKE",
    "FORMAT_KINETO",
    "FORMAT_NDTIMELINE",
    "RAW_FORMATS",
    "AssemblyConfig",
    "Assembly",
    "SessionState",
    "AssembleSessions",
]

REASON_COMPLETE = "complete"      # manifest and all listed workers arrived
REASON_TIMEOUT = "timeout"        # timeout passed first: analysed with what arrived
REASON_LATE = "late"              # a file arrived after an earlier revision: corrected result
REASON_STOPPED = "watcher-stopped"  # the watcher ended before the session completed

FORMAT_LAKE = "lake"      # strag's parquet: manifest.parquet + worker-DP-STAGE.parquet
FORMAT_KINETO = "kineto"  # torch.profiler traces: rank-R-of-W.json[.gz] (+ job.yaml)
FORMAT_NDTIMELINE = "ndtimeline"  # veScale NDTimeline records: rank-R-of-W.jsonl[.gz] (+ job.yaml)
RAW_FORMATS = (FORMAT_KINETO, FORMAT_NDTIMELINE)   # per-rank raw profiles, converted like a raw lake window
_FORMAT_OF = {"worker": FORMAT_LAKE, "manifest": FORMAT_LAKE, "kineto": FORMAT_KINETO, "ndtimeline": FORMAT_NDTIMELINE}
_NAMES = {FORMAT_LAKE: ("parquet", "parquet worker files"), FORMAT_KINETO: ("Kineto", "Kineto traces"),
          FORMAT_NDTIMELINE: ("NDTimeline", "NDTimeline records")}

_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AssemblyConfig:
    """timeout_seconds: poll-time seconds from a session's first file to analysing it incomplete.

    retain_seconds: poll-time seconds a session stays after its last analysis and its last
    new file before it is retired into the archive of lake `archive` (None: sessions are never
    retired, for pipelines fed listings of no real lake)."""

    timeout_seconds: float = 30.0
    retain_seconds: float = 600.0
    archive: str | None = None

    def __post_init__(self):
        if not (self.timeout_seconds > 0):
            raise ValueError(f"AssemblyConfig.timeout_seconds must be > 0, got {self.timeout_seconds!r}")
        if not (self.retain_seconds > 0):
            raise ValueError(f"AssemblyConfig.retain_seconds must be > 0, got {self.retain_seconds!r}")


@dataclasses.dataclass(frozen=True)
class Assembly:
    """One (job, session) ready for analysis.

    worker_paths: {(dp_rank, stage): path} of the workers present; manifest_path is ''
    when no manifest arrived. expected: the workers the manifest lists (empty without
    manifest); missing: expected minus present. A Kineto session (fmt "kineto") counts
    global ranks instead of workers: worker_paths {rank: path}, expected 0..world-1,
    options_path its job.yaml ('' without one). revision counts assemblies of this
    session from 1; the highest supersedes the others. first_arrival / assembled: poll
    times (epoch seconds) of the session's first file and of this assembly.
    duplicate_deliveries: files delivered again so far (never analysed twice).
    """

    job_id: str
    session: str
    revision: int
    reason: str
    manifest_path: str
    worker_paths: dict
    expected: tuple
    missing: tuple
    first_arrival: float
    assembled: float
    duplicate_deliveries: int
    fmt: str = FORMAT_LAKE
    options_path: str = ""

    @property
    def complete(self) -> bool:
        if self.fmt in RAW_FORMATS:
            return bool(self.expected) and not self.missing
        return bool(self.manifest_path) and not self.missing


@dataclasses.dataclass
class SessionState:
    """What is known of one session between events (kept in Beam state)."""

    job_id: str = ""
    session: str = ""
    manifest_path: str = ""
    expected: tuple = ()
    worker_paths: dict = dataclasses.field(default_factory=dict)
    first_arrival: float | None = None
    revision: int = 0
    duplicate_deliveries: int = 0
    seen: dict = dataclasses.field(default_factory=dict)  # url -> modification time of every file listed
    last_activity: float | None = None  # poll time of the last new file, re-delivery or assembly
    fmt: str = ""          # FORMAT_LAKE or one of RAW_FORMATS once a file said so
    options_path: str = ""  # a Kineto session's job.yaml
    world: int = 0          # a Kineto session: the largest world size its rank files name

    def observe(self, listing: SessionListing) -> tuple[list[str], list[str]]:
        """Record one poll's files: (urls never seen, urls re-delivered with a newer modification time)."""
        new, redelivered = [], []
        for url, modified in listing.files:
            before = self.seen.get(url)
            if before is None:
                new.append(url)
            elif modified > before:
                redelivered.append(url)
            else:
                continue
            self.seen[url] = modified
            self.last_activity = listing.poll_time
        return new, redelivered

    def retirable(self, now: float, config: AssemblyConfig) -> bool:
        """Done (analysed, or holding only files that were quarantined) and nothing new for
        retain_seconds: the session can leave the landing area and the state."""
        done = self.revision > 0 or self.first_arrival is None
        return done and self.last_activity is not None and now - self.last_activity >= config.retain_seconds

    def format_conflict(self, event: LandingEvent) -> str | None:
        """Why `event`'s file cannot join this session (its format differs from the session's), else None."""
        fmt = _FORMAT_OF.get(event.kind)
        if event.kind == "job_yaml" and self.fmt == FORMAT_LAKE:
            fmt = FORMAT_KINETO   # options of a raw session: no parquet session has them
        if fmt is None or not self.fmt or fmt == self.fmt:
            return None
        return (f"job {event.job_id} session {event.session}: {event.path.rsplit('/', 1)[-1]} is a "
                f"{_NAMES[fmt][0]} session file, but the session holds {_NAMES[self.fmt][1]}; land each format "
                "in a session of its own")

    def apply(self, event: LandingEvent, config: AssemblyConfig) -> list[Assembly]:
        """Update with one event; return the assemblies it triggers (zero or one)."""
        self.job_id, self.session = event.job_id, event.session
        if event.kind == "tick":
            return self._on_tick(event, config)
        if self.first_arrival is None:
            self.first_arrival = event.poll_time
        if event.kind == "redelivery":
            self.duplicate_deliveries += 1
            return []
        if self.format_conflict(event):
            raise ValueError(self.format_conflict(event))
        self.fmt = self.fmt or _FORMAT_OF.get(event.kind, "")
        if event.kind == "manifest":
            if self.manifest_path:
                self.duplicate_deliveries += 1
                return []
            self.manifest_path, self.expected = event.path, tuple(event.workers)
        elif event.kind == "worker":
            worker = (event.dp_rank, event.stage)
            if worker in self.worker_paths:
                self.duplicate_deliveries += 1
                return []
            self.worker_paths[worker] = event.path
        elif event.kind in RAW_FORMATS:
            if event.rank in self.worker_paths:
                self.duplicate_deliveries += 1
                return []
            self.worker_paths[event.rank] = event.path
            # Every rank names the same world; should they differ, the largest is waited for and
            # the converter refuses the mix (raw_mixed_jobs) from the traces themselves.
            self.world = max(self.world, int(event.world))
            self.expected = tuple(range(self.world))
        elif event.kind == "job_yaml":
            if self.options_path:
                self.duplicate_deliveries += 1
                return []
            self.options_path = event.path
        else:
            raise ValueError(f"job {event.job_id} session {event.session}: unknown landing event kind {event.kind!r}")
        if self.revision == 0:
            return [self._assemble(REASON_COMPLETE, event.poll_time)] if self._complete() else []
        # Already analysed: anything new corrects the published result.
        return [self._assemble(REASON_LATE, event.poll_time)]

    def _on_tick(self, event: LandingEvent, config: AssemblyConfig) -> list[Assembly]:
        if self.revision or self.first_arrival is None:
            return []
        if event.poll_time - self.first_arrival >= config.timeout_seconds:
            return [self._assemble(REASON_TIMEOUT, event.poll_time)]
        if event.final:
            return [self._assemble(REASON_STOPPED, event.poll_time)]
        return []

    def _complete(self) -> bool:
        if self.fmt in RAW_FORMATS:
            return bool(self.expected) and all(rank in self.worker_paths for rank in self.expected)
        return bool(self.manifest_path) and all(worker in self.worker_paths for worker in self.expected)

    def _assemble(self, reason: str, now: float) -> Assembly:
        self.revision += 1
        self.last_activity = now
        missing = tuple(worker for worker in self.expected if worker not in self.worker_paths)
        return Assembly(
            job_id=self.job_id,
            session=self.session,
            revision=self.revision,
            reason=reason,
            manifest_path=self.manifest_path,
            worker_paths=dict(sorted(self.worker_paths.items())),
            expected=tuple(self.expected),
            missing=missing,
            first_arrival=float(self.first_arrival),
            assembled=float(now),
            duplicate_deliveries=self.duplicate_deliveries,
            fmt=self.fmt or FORMAT_LAKE,
            options_path=self.options_path,
        )


class _AssembleSessionFn(beam.DoFn):
    """(session key, SessionListing) -> Assembly; quarantine rows (dicts) on 'quarantine'."""

    STATE = ReadModifyWriteStateSpec("session", PickleCoder())

    def __init__(self, config: AssemblyConfig):
        self._config = config

    def setup(self):
        self._counters = {reason: Metrics.counter("sessions", f"assembled_{reason}")
                          for reason in (REASON_COMPLETE, REASON_TIMEOUT, REASON_LATE, REASON_STOPPED)}
        self._retired = Metrics.counter("sessions", "retired")
        self._archive = LandingArchive(self._config.archive) if self._config.archive else None

    def process(self, element, state=beam.DoFn.StateParam(STATE)):
        _, listing = element
        session = state.read()
        if session is None:
            if self._archive is not None and self._archive.holds(listing.job_id, listing.session):
                yield from self._set_aside(listing)
                return
            session = SessionState()
        new, redelivered = session.observe(listing)
        assemblies = []
        for url in redelivered:
            assemblies += session.apply(LandingEvent("redelivery", listing.job_id, listing.session, listing.poll_time, url),
                                        self._config)
        for url in new:
            event = _file_event(listing, url)
            conflict = None if isinstance(event, dict) else session.format_conflict(event)
            if conflict:
                event = quarantine_row(url, listing.job_id, listing.session, LANDING_LAYOUT, conflict, listing.poll_time)
            if isinstance(event, dict):
                yield beam.pvalue.TaggedOutput("quarantine", event)
                continue
            assemblies += session.apply(event, self._config)
        assemblies += session.apply(LandingEvent("tick", listing.job_id, listing.session, listing.poll_time,
                                                 final=listing.final), self._config)
        if self._archive is not None and not listing.final and session.retirable(listing.poll_time, self._config):
            self._retire(session, listing, state)
        elif new or redelivered or assemblies:
            state.write(session)
        for assembly in assemblies:
            self._counters[assembly.reason].inc()
            yield assembly

    def _retire(self, session: SessionState, listing: SessionListing, state) -> None:
        try:
            self._archive.retire(listing.job_id, listing.session, session.seen)
        except OSError as error:  # storage trouble: keep the session and try again at the next poll
            _LOG.warning("job %s session %s: could not archive yet (%s); retrying at the next poll",
                         listing.job_id, listing.session, error)
            return
        state.clear()
        self._retired.inc()

    def _set_aside(self, listing: SessionListing):
        """Files that landed in a session already archived: moved beside it and quarantined."""
        urls = [url for url, _ in listing.files]
        for url, target in self._archive.set_aside(listing.job_id, listing.session, urls, listing.poll_time):
            detail = (f"job {listing.job_id} session {listing.session}: {url.rsplit('/', 1)[-1]} landed after the "
                      f"session was analysed and archived; moved to {target}")
            yield beam.pvalue.TaggedOutput("quarantine", quarantine_row(url, listing.job_id, listing.session,
                                                                        SESSION_CLOSED, detail, listing.poll_time))


def _file_event(listing: SessionListing, url: str) -> LandingEvent | dict:
    """A newly listed file of a session -> its LandingEvent, or a quarantine row (a name of no
    session file, or a manifest that cannot be read). Kineto traces and job.yaml are read at
    analysis, by the converter."""
    name = url.rsplit("/", 1)[-1]
    where = f"job {listing.job_id} session {listing.session}: {url}"
    try:
        kind, dp_rank, stage = parse_landing_name(name, where)
    except LandingPathError as error:
        return quarantine_row(url, listing.job_id, listing.session, LANDING_LAYOUT, str(error), listing.poll_time)
    if kind == "worker":
        return LandingEvent("worker", listing.job_id, listing.session, listing.poll_time, url, dp_rank, stage)
    if kind in RAW_FORMATS:
        return LandingEvent(kind, listing.job_id, listing.session, listing.poll_time, url, rank=dp_rank, world=stage)
    if kind == "job_yaml":
        return LandingEvent("job_yaml", listing.job_id, listing.session, listing.poll_time, url)
    try:
        workers = expected_workers(read_manifest(url))
    except LakeReadError as error:
        return quarantine_row(url, listing.job_id, listing.session, error.reason,
                              f"job {listing.job_id} session {listing.session}: {error}", listing.poll_time)
    return LandingEvent("manifest", listing.job_id, listing.session, listing.poll_time, url, workers=workers)


class AssembleSessions(beam.PTransform):
    """(session key, SessionListing) per poll -> {'assemblies': Assembly, one per (job, session,
    revision); 'quarantine': QUARANTINE_SCHEMA dicts (+ session, seen_time) for files that break
    the landing layout, unreadable manifests and files landing in archived sessions}."""

    def __init__(self, config: AssemblyConfig):
        super().__init__()
        self._config = config

    def expand(self, listings):
        out = listings | "AssembleSession" >> beam.ParDo(_AssembleSessionFn(self._config)).with_output_types(
            Assembly, quarantine=dict).with_outputs("quarantine", main="assemblies")
        return {"assemblies": out.assemblies, "quarantine": out.quarantine}
