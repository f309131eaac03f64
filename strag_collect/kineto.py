"""torch.profiler traces -> `{lake}/raw/kineto/date=D/job_id=J/` (schemas/raw.py), written from the trainer.

`kineto_handler(lake, job_id=...)` is an `on_trace_ready` callback. Each time the profiler
closes a window, every rank exports its Chrome trace to a local temporary file and a
background thread writes it, gzipped, as

    {lake}/raw/kineto/date=D/job_id=J/rank-{rank}.0.json.gz       window 0
    {lake}/raw/kineto/date=D/job_id=J@{n}/rank-{rank}.{n}.json.gz  window n >= 1 (a schedule with repeat)
    .../job.yaml                                                   rank 0: what the trainer knows

One folder is one analysable window: the converter takes a folder's files as the ranks of
one run, so a second window of the same ranks beside the first would be refused
(`raw_duplicate_rank`); later windows are their own job windows, `J@n`. Every rank counts
its windows the same way (the profiler's schedule), so they agree on the folder without
talking to each other. D is the UTC date when the window closed (or the `date` given).

With `live=True` each window also lands, first, as a live session that `strag watch` analyses
as soon as every rank is in (transforms/live/landing.py reads this layout)::

    {lake}/landing/J/{session}/job.yaml                    rank 0, before its trace
    {lake}/landing/J/{session}/rank-{rank}-of-{world}.json.gz

The session is `w{n}` for window n, after the run's id when torchrun gives one
(TORCHELASTIC_RUN_ID, plus `-restart{k}` after an elastic restart): `{run}-w{n}`, so a rerun of
the same job id does not land in the sessions of the run before. `session_prefix` replaces it.
The world size in the name tells the watcher when the session is complete.

Writes are atomic: a hidden temporary name in the target folder (readers skip names
starting with '.'), fsynced on local disk, then renamed (fsspec `mv`; copy + delete on
object stores, where a reader still sees the whole file or nothing).

Failure policy: the training loop never sees an exception and never waits on storage.
Export errors, a trace above `max_bytes` and writes still failing after `retries` retries
(exponential backoff, full jitter) each give one `CollectorWarning` naming the file and the
error; that window's trace is lost, training goes on. At most two windows upload at once; a
third is skipped with a warning rather than queued behind a stalled store. The upload threads run
at a lower CPU priority than training (`yield_cpu`, Linux): their gzip and writes overlap the next
steps, which the next window may be measuring.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import gzip
import io
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from typing import IO, Any

import fsspec

from strag_collect.gcrecord import GC_KEY, GcRecorder, append_top_level
from strag_collect.hostrecord import HOST_KEY, host_record

__all__ = ["kineto_handler", "KinetoHandler", "CollectorWarning", "land_file", "window_dir", "job_yaml_fields",
           "live_dir", "live_trace_name", "live_session", "check_lake", "cadence", "run_id", "JOB_YAML", "DIM_TOKENS",
           "LANDING", "DEFAULT_EVERY"]

# Copies of the lake contract, here because importing `schemas` loads pyarrow (tests/test_collect.py
# checks they equal schemas.lake._JOB_ID, schemas.raw.raw_dir and the converter's dim names).
JOB_YAML = "job.yaml"
LANDING = "landing"   # schemas.lake.LANDING: live sessions
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+@:-]{0,199}")
# Mesh dim name tokens -> the layout dim they name, as transforms/ingest/kineto/spans.py reads process-group descriptions.
DIM_TOKENS = {
    "pp": {"pp", "pipe", "pipeline"},
    "dp": {"dp", "data", "ddp", "fsdp", "replicate", "shard"},
    "tp": {"tp", "tensor"},
    "cp": {"cp", "context"},
    "ep": {"ep", "expert", "moe"},
}
_LAYOUT_DIMS = ("tp", "cp", "dp", "pp")   # schemas.raw.LAYOUT_DIMS
MAX_PENDING_WINDOWS = 2
_CHUNK = 1 << 20
# The live default: a window of 3 profiled steps every 200 steps. A few seconds of steps of a large job
# every few minutes: the profiler's cost (a window's steps run ~5-10% slower, the export takes about as
# long as the window) is well under 1% of the run, and a straggler is paged minutes after it starts.
DEFAULT_EVERY = 200


def cadence(every: int = DEFAULT_EVERY, active: int = 3, warmup: int = 1) -> dict[str, int]:
    """torch.profiler.schedule's arguments for live monitoring: `active` profiled steps (after `warmup`)
    in every `every` steps, for the whole run (repeat=0), each window a session of the same job:

        torch.profiler.schedule(**cadence(every=200))

    Three steps are what the worker test needs at the least to tell a slow worker from jitter."""
    if not (active >= 1 and warmup >= 0 and every >= active + warmup + 1):
        raise ValueError(f"cadence(every={every}, active={active}, warmup={warmup}): every must exceed active + warmup "
                         "(one step at least between windows), active >= 1")
    return {"wait": every - active - warmup, "warmup": warmup, "active": active, "repeat": 0}


def run_id() -> str:
    """The run's id, the same on every rank of one run and different for the next run of the job: torchrun's
    TORCHELASTIC_RUN_ID (`-restart{k}` after an elastic restart), else the rendezvous address and port the
    launcher chose (MASTER_ADDR, MASTER_PORT: Lightning and mp.spawn launchers pick a free port per run),
    else '' (give run_id= to kineto_handler)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    run = "" if run.lower() in ("", "none") else run
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if run and restart.isdigit() and int(restart) > 0:
        run = f"{run}-restart{int(restart)}"
    if not run and os.environ.get("MASTER_PORT", "").isdigit():
        run = f"{os.environ.get('MASTER_ADDR', 'localhost')}-{os.environ['MASTER_PORT']}"
    return re.sub(r"[^A-Za-z0-9._+@:-]+", "-", run).strip("-.")[:100]


def check_lake(lake_url: str) -> None:
    """Raise one clear error now, before training starts, when the lake cannot take the traces: an
    unknown URL scheme, a filesystem whose package is not installed (s3:// needs s3fs), or a lake
    the process cannot write (a probe file is written and removed). ValueError for the URL, OSError
    for the storage."""
    protocol = fsspec.core.split_protocol(lake_url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(f"lake {lake_url}: unknown URL scheme {protocol!r} (fsspec knows "
                         f"{', '.join(sorted(p for p in fsspec.available_protocols() if len(p) <= 6)[:12])}, ...)") from None
    except ImportError as error:
        raise ValueError(f"lake {lake_url}: the {protocol}:// filesystem's package is not installed ({error}); "
                         f"install it in the training environment (s3:// needs s3fs, gs:// gcsfs, abfs:// adlfs)") from None
    probe = f"{lake_url.rstrip('/')}/.strag-probe-{uuid.uuid4().hex}"   # hidden: readers skip it if it stays
    try:
        land_file(b"", probe, compress=False, retries=1, backoff=0.2)
        fs, path = fsspec.core.url_to_fs(probe)
        fs.rm(path)
    except Exception as error:
        raise OSError(f"lake {lake_url}: cannot write there ({type(error).__name__}: {error}); check the URL, "
                      "credentials and permissions before training") from error



class CollectorWarning(RuntimeWarning):
    """A trace the collector could not land (the training goes on); filter it like any warning."""


def _safe_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id) or ".." in job_id:
        raise ValueError(f"job id {job_id!r}: use 1-200 letters, digits and . _ + @ : - starting with a letter or "
                         "digit (no '/', '=', '..'; a leading '.' or '_' would hide it)")
    return job_id


def window_dir(lake: str, date: str, job_id: str, window: int = 0) -> str:
    """Folder of profiling window `window` of a job: the job's raw kineto window for window 0, `{job_id}@{window}` after."""
    name = _safe_job_id(job_id if window == 0 else f"{job_id}@{window}")
    return "/".join([lake.rstrip("/"), "raw", "kineto", f"date={date}", f"job_id={name}"])


def live_dir(lake: str, job_id: str, session: str) -> str:
    """Folder of a live session (schemas.lake.landing_dir): {lake}/landing/{job_id}/{session}."""
    return "/".join([lake.rstrip("/"), LANDING, _safe_job_id(job_id), _safe_job_id(session)])


def live_trace_name(rank: int, world: int, compress: bool = True) -> str:
    """One rank's trace in a live session (transforms.live.landing.kineto_trace_name): rank-{rank}-of-{world}.json[.gz]."""
    if not 0 <= int(rank) < int(world):
        raise ValueError(f"rank {rank} of world {world}: a rank is 0..world-1")
    return f"rank-{int(rank)}-of-{int(world)}.json" + (".gz" if compress else "")


def live_session(window: int, prefix: str | None = None) -> str:
    """The live session name of profiling window `window`: `{prefix}-w{window}`, or `w{window}` without a
    prefix. prefix None: the run's id (`run_id`), the same on every rank of the run."""
    if prefix is None:
        prefix = run_id()
    return _safe_job_id(f"{prefix}-w{int(window)}" if prefix else f"w{int(window)}")


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def _write_atomic(url: str, source: IO[bytes], compress: bool) -> None:
    """Stream `source` (gzipped on the way when `compress`) to a hidden name beside `url`, then rename it to `url`."""
    fs, path = fsspec.core.url_to_fs(url)
    folder, name = path.rsplit("/", 1)
    temporary = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"
    fs.makedirs(folder, exist_ok=True)
    try:
        with fs.open(temporary, "wb") as out:
            if compress:
                # filename "" and mtime 0: the same trace gives the same bytes (no temporary name in the header)
                with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as packed:
                    shutil.copyfileobj(source, packed, _CHUNK)
            else:
                shutil.copyfileobj(source, out, _CHUNK)
            if _is_local(fs):   # durable before it becomes visible
                out.flush()
                os.fsync(out.fileno())
        fs.mv(temporary, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(temporary)
        raise


def land_file(source: str | bytes, url: str, *, compress: bool, retries: int = 3, backoff: float = 0.5,
              backoff_max: float = 8.0) -> None:
    """Write a local file (path) or bytes to the file URL `url` atomically, gzipped when `compress`.

    Retries `retries` times after the first attempt, sleeping a random 0..backoff * 2**i seconds
    (at most backoff_max) before retry i; raises the last error when every attempt failed."""
    for attempt in range(retries + 1):
        try:
            with (open(source, "rb") if isinstance(source, str) else io.BytesIO(source)) as data:
                _write_atomic(url, data, compress)
            return
        except Exception:
            if attempt == retries:
                raise
            time.sleep(random.uniform(0.0, min(backoff_max, backoff * 2 ** attempt)))


def _dim_of(name: str) -> str | None:
    tokens = set(re.split(r"[^a-z]+", str(name).lower()))
    kinds = [dim for dim, names in DIM_TOKENS.items() if tokens & names]
    return kinds[0] if len(kinds) == 1 else None


def _mesh_dims(mesh: Any) -> list[tuple[str, int]] | None:
    """[(dim name, size)] outermost first, from a dict or a torch DeviceMesh whose ranks are in row-major
    order (what init_device_mesh builds); None when the mesh does not say (no names, another rank order)."""
    if isinstance(mesh, Mapping):
        return [(str(name), int(size)) for name, size in mesh.items()]
    names = getattr(mesh, "mesh_dim_names", None)
    ranks = getattr(mesh, "mesh", None)
    if not names or ranks is None:
        return None
    shape = [int(size) for size in ranks.shape]
    order = ranks.flatten().tolist()
    if len(shape) != len(names) or order != list(range(len(order))):
        return None
    return list(zip(map(str, names), shape))


def job_yaml_fields(mesh: Any, world: int | None) -> dict[str, Any]:
    """job.yaml's dp_size, pp_size, tp_size, cp_size and layout (schemas/raw.py JOB_YAML_KEYS) from a mesh.

    Dims are named as the converter names process groups (`dp`, `data_parallel`, `dp_shard`, `pp`,
    `pipe`, `tp`, `cp`, ...); neighbouring dims of one kind merge (HSDP's dp_replicate x dp_shard).
    {} whenever the mesh cannot say for sure (a dim of another kind with size > 1, a kind split by
    another dim, sizes whose product is not the world size): sizes in job.yaml override what the
    trace's own process groups say, so a guess there would be worse than nothing."""
    dims = _mesh_dims(mesh) if mesh is not None else None
    if not dims:
        return {}
    merged: list[list] = []
    for name, size in dims:
        kind = _dim_of(name)
        if kind not in _LAYOUT_DIMS:   # none, or one job.yaml has no size for (ep)
            kind = None
        if kind is None:
            if size != 1:
                return {}
        elif merged and merged[-1][0] == kind:
            merged[-1][1] *= size
        elif any(kind == seen for seen, _ in merged):
            return {}
        else:
            merged.append([kind, size])
    sizes = {dim: 1 for dim in _LAYOUT_DIMS} | {kind: size for kind, size in merged}
    product = sizes["dp"] * sizes["pp"] * sizes["tp"] * sizes["cp"]
    if product < 1 or (world is not None and product != world):
        return {}
    fastest = [kind for kind, _ in reversed(merged)] + [dim for dim in _LAYOUT_DIMS if dim not in dict(merged)]
    return {"dp_size": sizes["dp"], "pp_size": sizes["pp"], "tp_size": sizes["tp"], "cp_size": sizes["cp"],
            "layout": "-".join(fastest)}


def _one_line(value: Any) -> str:
    return " ".join(str(value).split())


def _job_yaml(mesh: Any, world: int | None, schedule: Any, microbatches: int | None) -> str:
    """job.yaml text: the layout keys when the mesh gives them; the rest as comments (strag derives
    world, schedule and microbatches from the traces; the comments are for people browsing the lake)."""
    if microbatches is None and isinstance(getattr(schedule, "_n_microbatches", None), int):
        microbatches = schedule._n_microbatches   # torch.distributed.pipelining schedules keep it there
    if schedule is not None and not isinstance(schedule, str):
        schedule = type(schedule).__name__
    lines = ["# written by strag_collect on rank 0; keys: schemas/raw.py JOB_YAML_KEYS"]
    for label, value in (("world_size", world), ("schedule", schedule), ("microbatches", microbatches)):
        if value is not None:
            lines.append(f"# {label}: {_one_line(value)}")
    dims = _mesh_dims(mesh) if mesh is not None else None
    if dims:
        lines.append("# mesh: " + ", ".join(f"{_one_line(name)}={size}" for name, size in dims))
    fields = job_yaml_fields(mesh, world)
    if dims and not fields:
        lines.append("# the mesh does not fix the layout here: strag reads it from the traces' process groups")
    lines += [f"{key}: {value}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def _rank_and_world(rank: int | None, world: int | None) -> tuple[int, int | None]:
    """The given values, else torch.distributed's (when the trainer initialised it; torch is never
    imported here), else RANK / WORLD_SIZE from the environment (torchrun), else rank 0."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world = dist.get_world_size() if world is None else world
    except Exception:   # a half-initialised process group: fall back to the environment
        pass
    for name in ("RANK", "WORLD_SIZE"):
        text = os.environ.get(name, "")
        if text.isdigit():
            if name == "RANK" and rank is None:
                rank = int(text)
            elif name == "WORLD_SIZE" and world is None:
                world = int(text)
    return (0 if rank is None else int(rank)), (None if world is None else int(world))


def _warn(message: str) -> None:
    warnings.warn(f"strag_collect: {message}; training goes on without it", CollectorWarning, stacklevel=3)


class KinetoHandler:
    """The `on_trace_ready` callable `kineto_handler` returns; `flush()` waits for uploads in flight,
    `landed` lists the URLs written so far. Uploads are not daemon threads: a process ending right
    after its last window still lands it (waiting at most the retries' bounded time)."""

    def __init__(self, lake_url: str, job_id: str, *, date: str | dt.date | None = None, rank: int | None = None,
                 world: int | None = None, mesh: Any = None, schedule: Any = None, microbatches: int | None = None,
                 compress: bool = True, max_bytes: int = 1 << 30, retries: int = 3, backoff: float = 0.5,
                 live: bool = False, session_prefix: str | None = None, check: bool = True, record_gc: bool = True,
                 record_host: bool = True):
        if not lake_url:
            raise ValueError("lake_url: give the lake's URL (a folder, s3://bucket/lake, ...)")
        if date is not None:
            date = dt.date.fromisoformat(str(date)).isoformat()
        if retries < 0 or backoff < 0 or max_bytes <= 0:
            raise ValueError("retries and backoff must be >= 0, max_bytes > 0")
        self.lake = lake_url.rstrip("/")
        self.job_id = _safe_job_id(job_id)
        self.date, self.rank, self.world = date, rank, world
        self.mesh, self.schedule, self.microbatches = mesh, schedule, microbatches
        self.compress, self.max_bytes, self.retries, self.backoff = compress, max_bytes, retries, backoff
        self.live, self.session_prefix = bool(live), session_prefix
        if live:
            live_session(0, session_prefix)   # a bad prefix fails here, at set-up
        if check:   # last: every argument is right before anything is written
            check_lake(lake_url)
        self.landed: list[str] = []
        # Python's collections, recorded from now on and written into each window's trace (gcrecord.py)
        self.gc = GcRecorder().start() if record_gc else None
        self.record_host = bool(record_host)   # how crowded the host is, per window (hostrecord.py)
        self._windows = 0
        self._uploads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __call__(self, prof: Any) -> None:
        """Export this window's trace and start its upload; never raises (see the module's failure policy)."""
        window, self._windows = self._windows, self._windows + 1
        try:
            self._start(prof, window)
        except Exception as error:   # the policy: a lost trace is a warning, never a crash of the training step
            _warn(f"profiling window {window} of job {self.job_id} not landed ({type(error).__name__}: {error})")

    def _start(self, prof: Any, window: int) -> None:
        rank, world = _rank_and_world(self.rank, self.world)
        date = self.date or dt.datetime.now(dt.timezone.utc).date().isoformat()
        folder = window_dir(self.lake, date, self.job_id, window)
        target = f"{folder}/rank-{rank}.{window}.json" + (".gz" if self.compress else "")
        with self._lock:
            self._uploads = [thread for thread in self._uploads if thread.is_alive()]
            if len(self._uploads) >= MAX_PENDING_WINDOWS:
                _warn(f"{target} skipped: {len(self._uploads)} earlier windows are still uploading")
                return
        handle, local = tempfile.mkstemp(prefix=f"strag-{self.job_id}-rank{rank}-", suffix=".json")
        os.close(handle)
        try:
            prof.export_chrome_trace(local)
            records = [(HOST_KEY, host_record(), "host record")] if self.record_host else []
            if self.gc is not None:
                records.append((GC_KEY, {"clock": "unix_ns", "pauses": self.gc.take()}, "Python GC record"))
            for key, value, what in records:
                try:
                    append_top_level(local, key, value)
                except (OSError, ValueError) as error:   # the trace lands without the record
                    _warn(f"{target}: {what} not added ({error})")
            size = os.path.getsize(local)
            if size > self.max_bytes:
                _warn(f"{target} skipped: the trace is {size:,} bytes, above max_bytes={self.max_bytes:,} "
                      "(profile fewer steps, or raise max_bytes)")
                os.remove(local)
                return
            job_yaml = _job_yaml(self.mesh, world, self.schedule, self.microbatches).encode() if rank == 0 else None
            files: list[tuple[str | bytes, str, bool]] = []
            source, compress = local, self.compress
            if self.live:
                if self.compress:   # gzip once, land the same bytes twice
                    source, compress = local + ".gz", False
                files += self._live_files(window, rank, world, source, job_yaml)
            if job_yaml is not None:
                files.append((job_yaml, f"{folder}/{JOB_YAML}", False))
            files.append((source, target, compress))
            upload = threading.Thread(target=self._upload, args=(files, local), name=f"strag-collect-{window}")
            with self._lock:
                self._uploads.append(upload)
            upload.start()
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(local)
            raise

    def _live_files(self, window: int, rank: int, world: int | None, source: str,
                    job_yaml: bytes | None) -> list[tuple[str | bytes, str, bool]]:
        """The live session's files of this rank (job.yaml first on rank 0, so the session is whole when the
        last rank's trace lands); [] with a warning when the world size is unknown (no torch.distributed,
        no WORLD_SIZE) on a rank other than 0: the watcher could not tell when the session is complete."""
        if world is None and rank != 0:
            _warn(f"window {window} of job {self.job_id} not landed as a live session: rank {rank} of an unknown "
                  "world size (pass world=, or initialise torch.distributed first); its raw window still lands")
            return []
        try:
            folder = live_dir(self.lake, self.job_id, live_session(window, self.session_prefix))
            name = live_trace_name(rank, world or 1, self.compress)
        except ValueError as error:   # e.g. rank >= world: a misconfigured rank or world
            _warn(f"window {window} of job {self.job_id} not landed as a live session ({error}); its raw window still lands")
            return []
        files: list[tuple[str | bytes, str, bool]] = []
        if job_yaml is not None:
            files.append((job_yaml, f"{folder}/{JOB_YAML}", False))
        files.append((source, f"{folder}/{name}", False))
        return files

    def _upload(self, files: list[tuple[str | bytes, str, bool]], local: str) -> None:
        yield_cpu()
        try:
            if any(source == local + ".gz" for source, _, _ in files):
                try:
                    _gzip_file(local, local + ".gz")
                except Exception as error:
                    _warn(f"{files[-1][1]} and its live copy not written: gzip of the exported trace failed "
                          f"({type(error).__name__}: {error})")
                    return
            for source, url, compress in files:
                try:
                    land_file(source, url, compress=compress, retries=self.retries, backoff=self.backoff)
                except Exception as error:
                    _warn(f"{url} not written after {self.retries + 1} attempt(s) ({type(error).__name__}: {error})")
                    continue
                with self._lock:
                    self.landed.append(url)
        finally:
            for name in (local, local + ".gz"):
                with contextlib.suppress(OSError):
                    os.remove(name)

    def close(self, timeout: float | None = None) -> bool:
        """At the end of profiling: stop recording Python's collections, then `flush`."""
        if self.gc is not None:
            self.gc.stop()
        return self.flush(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the uploads in flight (at most `timeout` seconds in all); True when none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            uploads = list(self._uploads)
        for upload in uploads:
            upload.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(upload.is_alive() for upload in uploads)


UPLOAD_NICENESS = 10   # how much lower than training the upload thread runs (Linux nice increment)


def yield_cpu() -> None:
    """Lower the calling thread's CPU priority (Linux: threads have their own nice value) by
    UPLOAD_NICENESS: gzip and the writes of a window's trace run beside the next steps' training, on
    the same cores; at lower priority they take the cycles training leaves, so the profiler's own
    work does not slow the steps the next window measures. Elsewhere, and where the system refuses,
    nothing changes (a thread id is no process id there: never renice by it)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(os.getpriority(os.PRIO_PROCESS, thread) + UPLOAD_NICENESS, 19))


def _gzip_file(source: str, target: str) -> None:
    """gzip a local file (as _write_atomic does on the way: no name, mtime 0, so the bytes are the same)."""
    with open(source, "rb") as data, open(target, "wb") as out:
        with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as packed:
            shutil.copyfileobj(data, packed, _CHUNK)


def kineto_handler(lake_url: str, *, job_id: str, date: str | dt.date | None = None, rank: int | None = None,
                   world: int | None = None, mesh: Any = None, schedule: Any = None, microbatches: int | None = None,
                   compress: bool = True, max_bytes: int = 1 << 30, retries: int = 3,
                   backoff: float = 0.5, live: bool = False, session_prefix: str | None = None,
                   check: bool = True, record_gc: bool = True, record_host: bool = True) -> KinetoHandler:
    """An `on_trace_ready` callback for torch.profiler.profile that lands each window in the lake.

    lake_url: any fsspec URL (credentials from the environment, as for the rest of strag);
    job_id: the lake's job id (letters, digits and . _ + @ : -); date: YYYY-MM-DD partition
    (default: the UTC date when each window closes); rank / world: default torch.distributed's,
    else RANK / WORLD_SIZE, else 0 / unknown; mesh: a DeviceMesh or {dim name: size} outermost
    first, for job.yaml's sizes and layout; schedule (a pipelining schedule or its name) and
    microbatches: recorded in job.yaml for people; compress: gzip (.json.gz); max_bytes: largest
    exported trace (uncompressed bytes) to land; retries, backoff (seconds, doubling): per file;
    live: also land each window, first, as a live session `strag watch` analyses at once
    ({lake}/landing/{job_id}/{session}/, see the module docstring); session_prefix: the sessions'
    name before `-w{n}` (default: the run's id, `run_id`: a rerun of the job id lands in sessions of
    its own); check: write a probe to the lake now (`check_lake`); record_gc: record Python's garbage
    collections (gc.callbacks) and add them to each window's trace (`strag_collect.gcrecord`);
    record_host: add the host's cores, torch threads and local ranks to each window's trace
    (`strag_collect.hostrecord`: untraced time its host's crowding can explain is then blamed on no rank).
    Raises here, at set-up, never once training runs: ValueError for a bad job id, date, limit, prefix
    or lake URL (unknown scheme, its filesystem package missing), OSError when the lake cannot be written."""
    return KinetoHandler(lake_url, job_id, date=date, rank=rank, world=world, mesh=mesh, schedule=schedule,
                         microbatches=microbatches, compress=compress, max_bytes=max_bytes, retries=retries,
                         backoff=backoff, live=live, session_prefix=session_prefix, check=check, record_gc=record_gc,
                         record_host=record_host)
