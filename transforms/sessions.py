"""Assemble profiling sessions from their landing events.

Each (job, session) is assembled once its manifest and every worker it lists have
arrived, or once `timeout_seconds` of poll time have passed since its first file
(then it is analysed with what it has, and the assembly says what is missing). A
worker file that arrives after the session was assembled produces a new assembly
with the next revision number: its result supersedes the earlier one. A second
delivery of a worker never adds it twice; it is only counted.

The state machine is plain Python (`SessionState.apply`), tested without a
pipeline; `AssembleSessions` keeps one `SessionState` per session key in Beam
state. The clock is the poll time carried by the events (ticks), so the timeout
behaves the same on every runner and under TestStream.
"""
from __future__ import annotations

import dataclasses

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

from transforms.landing import LandingEvent

__all__ = [
    "REASON_COMPLETE",
    "REASON_TIMEOUT",
    "REASON_LATE",
    "REASON_STOPPED",
    "AssemblyConfig",
    "Assembly",
    "SessionState",
    "AssembleSessions",
]

REASON_COMPLETE = "complete"      # manifest and all listed workers arrived
REASON_TIMEOUT = "timeout"        # timeout passed first: analysed with what arrived
REASON_LATE = "late"              # a file arrived after an earlier revision: corrected result
REASON_STOPPED = "watcher-stopped"  # the watcher ended before the session completed


@dataclasses.dataclass(frozen=True)
class AssemblyConfig:
    """timeout_seconds: poll-time seconds from a session's first file to analysing it incomplete."""

    timeout_seconds: float = 30.0

    def __post_init__(self):
        if not (self.timeout_seconds > 0):
            raise ValueError(f"AssemblyConfig.timeout_seconds must be > 0, got {self.timeout_seconds!r}")


@dataclasses.dataclass(frozen=True)
class Assembly:
    """One (job, session) ready for analysis.

    worker_paths: {(dp_rank, stage): path} of the workers present; manifest_path is ''
    when no manifest arrived. expected: the workers the manifest lists (empty without
    manifest); missing: expected minus present. revision counts assemblies of this
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

    @property
    def complete(self) -> bool:
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
    changed_since_assembly: bool = False

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
        else:
            raise ValueError(f"job {event.job_id} session {event.session}: unknown landing event kind {event.kind!r}")
        self.changed_since_assembly = True
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
        return bool(self.manifest_path) and all(worker in self.worker_paths for worker in self.expected)

    def _assemble(self, reason: str, now: float) -> Assembly:
        self.revision += 1
        self.changed_since_assembly = False
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
        )


class _AssembleSessionFn(beam.DoFn):
    STATE = ReadModifyWriteStateSpec("session", PickleCoder())

    def __init__(self, config: AssemblyConfig):
        self._config = config
        self._counters = {}

    def setup(self):
        for reason in (REASON_COMPLETE, REASON_TIMEOUT, REASON_LATE, REASON_STOPPED):
            self._counters[reason] = Metrics.counter("sessions", f"assembled_{reason}")

    def process(self, element, state=beam.DoFn.StateParam(STATE)):
        _, event = element
        session = state.read() or SessionState()
        assemblies = session.apply(event, self._config)
        if event.kind != "tick" or assemblies:
            state.write(session)
        for assembly in assemblies:
            self._counters[assembly.reason].inc()
            yield assembly


class AssembleSessions(beam.PTransform):
    """(session key, LandingEvent) -> Assembly, one per (job, session, revision)."""

    def __init__(self, config: AssemblyConfig):
        super().__init__()
        self._config = config

    def expand(self, events):
        return events | "AssembleSession" >> beam.ParDo(_AssembleSessionFn(self._config)).with_input_types(
            tuple[str, LandingEvent])
