"""veScale NDTimeline records <-> lake rows: plain functions, no Beam.

    converted = convert_ndtimeline(["s3://lake/raw/ndtimeline/date=D/job_id=J/part-0.jsonl.gz"], "J", "2024-03-04", {})
    paths = write_ndtimeline(trace, manifest, "s3://lake/raw/ndtimeline/date=D/job_id=J", "J")

A record (veScale `vescale/ndtimeline/handlers/parser_handler.py`, DeviceTimerStreamRecord.to_dict)
is one JSON object per line holding every span of one metric on one global rank in one step:

    ts           int, wall-clock second the record was flushed (epoch seconds; for partitioning, not an op time)
    rank         global rank;  dp_rank, tp_rank: rank in its DP / TP group;  stage: the pipeline (PP) rank
    metric       what was timed (METRIC_OPTYPES);  step: global training step
    start_ts[]   span starts, seconds on NDTimeline's calibrated global clock (epoch seconds: a reference
                 CUDA event plus the wall clock of the last calibration);  duration[]: span lengths, seconds
    value        mean span duration (seconds; redundant, not read)
    model_chunk  virtual-pipeline chunk, from 0;  ip: host;  trial (string), run_id, role: which job
    iteration    legacy field without meaning (written, not read)

Conversion (METHOD.md section 1), with the published traces' conventions: TP peers are collapsed to
their tp_rank 0 representative (counted in `source["tp_collapsed"]`, in ranks); mb_id = the span's
index in its record on compute ops (microbatch i) and on gc (0, as the profiler writes it), -1
elsewhere; mc = model_chunk on compute ops and the per-chunk DP ops (params-all-gather,
grads-reduce-scatter), -1 elsewhere; gmc = mc * pp_size + stage on compute ops, -1 elsewhere. A metric
that fits no op type is counted in `source["unmapped"]` (metric -> spans), an unknown metric that
looks like a DP collective is an error.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import gzip
import io
import math
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from schemas.trace import COMPUTE_OPTYPES, DP_COMM_OPTYPES, OPTYPES
from transforms.ingest.common import ConvertedJob, RawInputError, build_manifest, build_trace

__all__ = [
    "NDTIMELINE",
    "METRIC_OPTYPES",
    "convert_ndtimeline",
    "export_ndtimeline",
    "write_ndtimeline",
]

NDTIMELINE = "ndtimeline"
PROFILER = "NDTimeline"

# metric -> the op types its spans are. Every op type maps from its own name (the metric names
# of ByteDance's Megatron integration, which veScale's timeline handler lists as well); veScale's
# own predefined DP metrics (predefined.py) and the non-overlapped DP variants its handler knows
# map to the published names; a batched p2p span (one NCCL group of a send and a recv) becomes one
# op of each type with the same start and duration, as the published traces record it.
METRIC_OPTYPES: dict[str, tuple[str, ...]] = {name: (name,) for name in OPTYPES}
METRIC_OPTYPES.update({
    "unshard-all-gather": ("params-all-gather",),
    "grad-reduce-scatter": ("grads-reduce-scatter",),
    "grad-all-reduce": ("separate-grads-all-reduce",),
    "params-all-gather-nonoverlapping": ("params-all-gather",),
    "grads-reduce-scatter-nonoverlapping": ("grads-reduce-scatter",),
    "forward-send-backward-recv": ("forward-send", "backward-recv"),
    "backward-send-forward-recv": ("backward-send", "forward-recv"),
    "forward-send-forward-recv": ("forward-send", "forward-recv"),
    "backward-send-backward-recv": ("backward-send", "backward-recv"),
    "forward-backward-send-forward-backward-recv": ("forward-send", "backward-send", "forward-recv", "backward-recv"),
})
# Other metrics veScale emits are not ops of the dependency model and are counted as unmapped:
# optimizer-inner-step / -copy-to-main-grad / -copy-main-to-model-params (inside `optimizer`),
# tp-allreduce / tp-allgather / tp-reducescatter (inside compute), cross-mesh-send / -recv (no
# direction), "special" (the flush marker). An unknown metric naming gradients or parameters and a
# collective would leave a DP synchronisation out of the replay: that is an error instead.
_DP_COLLECTIVE = re.compile(r"(?=.*(grad|param))(?=.*(all-?gather|reduce-?scatter|all-?reduce))")

_REQUIRED = ("metric", "step", "rank", "stage", "dp_rank", "start_ts", "duration")
_RANKS = ("rank", "stage", "dp_rank", "tp_rank", "model_chunk")   # non-negative integers (tp_rank, model_chunk default 0)
# A clock reads as epoch seconds between 2001-09-09 and 2096-10-02; anything else is relative time.
_EPOCH_SECONDS = (1e9, 4e9)
_UNKNOWN_IPS = ("", "0.0.0.0")   # veScale's default ip when the host is not known
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNKED = ("params-all-gather", "grads-reduce-scatter")   # DP ops of one model chunk (METHOD.md section 2)


# ---------------------------------------------------------------------------
# Reading


# veScale's field types; a file Arrow cannot read with them goes through the line-by-line reader
_ARROW_SCHEMA = pa.schema([
    ("metric", pa.string()), ("step", pa.int64()), ("rank", pa.int64()), ("stage", pa.int64()),
    ("dp_rank", pa.int64()), ("tp_rank", pa.int64()), ("model_chunk", pa.int64()),
    ("start_ts", pa.list_(pa.float64())), ("duration", pa.list_(pa.float64())), ("ts", pa.float64()),
    ("ip", pa.string()), ("trial", pa.string()), ("run_id", pa.int64()), ("role", pa.int64()),
])
_ARROW_BLOCK = 16 << 20   # bytes of JSON per parse block (a record must fit in one)


@dataclasses.dataclass
class _Part:
    """One file's records as columns (one entry per record; spans flattened in record order)."""

    metrics: list[str]        # metric names; `metric` indexes them
    metric: np.ndarray
    step: np.ndarray
    rank: np.ndarray
    stage: np.ndarray
    dp_rank: np.ndarray
    tp_rank: np.ndarray
    chunk: np.ndarray         # model_chunk
    ts: np.ndarray            # float64 epoch seconds, nan when absent
    ip: list[str | None]      # None when unknown
    job: list[tuple[Any, ...]]   # (trial, run_id, role) as recorded
    line: np.ndarray          # 1-based line number, -1 when read by Arrow (found again on demand)
    span_count: np.ndarray
    span_start: np.ndarray    # seconds
    span_duration: np.ndarray  # seconds


@dataclasses.dataclass
class _Records(_Part):
    """Every record of a window: the files' parts concatenated, `file` indexing `paths`."""

    paths: list[str] = dataclasses.field(default_factory=list)
    file: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    row: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))   # record index in its file
    _lines: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)

    @classmethod
    def concat(cls, paths: Sequence[str], parts: Sequence[_Part]) -> _Records:
        names: dict[str, int] = {}
        metric = [np.asarray([names.setdefault(name, len(names)) for name in part.metrics] or [0], np.int64)[part.metric]
                  for part in parts]
        columns = {field.name: np.concatenate([getattr(part, field.name) for part in parts])
                   for field in dataclasses.fields(_Part) if field.name not in ("metrics", "metric", "ip", "job")}
        return cls(metrics=list(names), metric=np.concatenate(metric), ip=[v for part in parts for v in part.ip],
                   job=[v for part in parts for v in part.job], paths=list(paths),
                   file=np.repeat(np.arange(len(parts)), [len(part.step) for part in parts]),
                   row=np.concatenate([np.arange(len(part.step)) for part in parts]), **columns)

    def where(self, index: int) -> str:
        """'F line N' of record `index` (a file Arrow read is scanned again for its line numbers)."""
        line = int(self.line[index])
        if line < 0:
            file = int(self.file[index])
            if file not in self._lines:
                from transforms.ingest import read_raw_file

                data = read_raw_file(self.paths[file])
                self._lines[file] = np.asarray([n for n, text in _numbered_lines(data, None, self.paths[file])
                                                if text.strip()], dtype=np.int64)
            line = int(self._lines[file][self.row[index]])
        return f"{self.paths[self.file[index]]} line {line}"

    @property
    def span_offset(self) -> np.ndarray:
        return np.cumsum(self.span_count) - self.span_count


def _numbered_lines(data: bytes, job_id: str | None, path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a raw file, gunzipped on the fly when it starts with the gzip magic.

    Streams: a big file is never held decompressed. A broken gzip stream -> raw_unreadable.
    """
    stream = gzip.GzipFile(fileobj=io.BytesIO(data)) if data[:2] == _GZIP_MAGIC else io.BytesIO(data)
    number = 0
    while True:
        try:
            line = stream.readline()
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            # BadGzipFile is an OSError but comes from the bytes already read, not from storage
            raise RawInputError("raw_unreadable", f"the gzip stream breaks after line {number} ({error}); re-upload the file",
                                job_id=job_id, path=path) from None
        if not line:
            return
        number += 1
        yield number, line


def _bad_record(number: int, problem: str, job_id: str, path: str) -> RawInputError:
    return RawInputError("raw_not_a_trace", f"line {number} is not an NDTimeline record: {problem} (expected one JSON "
                         f"object per line with {', '.join(_REQUIRED)})", job_id=job_id, path=path)


def _read_records(paths: Sequence[str], job_id: str) -> _Records:
    """Parse every file of the window. OSError from storage propagates; bad content -> RawInputError.

    Each file goes through Arrow's streaming JSON reader first (C++, 3-4x faster); a file it
    cannot take as clean veScale records is read again line by line, which names the bad line
    or accepts what Arrow's fixed types did not (say a numeric trial).
    """
    from transforms.ingest import read_raw_file

    parts = []
    for path in paths:
        data = read_raw_file(path)
        part = _arrow_part(data) or _python_part(data, job_id, path)
        if not len(part.step):
            raise RawInputError("raw_not_a_trace", "holds no NDTimeline records (one JSON object per line with "
                                f"{', '.join(_REQUIRED)})", job_id=job_id, path=path)
        parts.append(part)
    return _Records.concat(paths, parts)


def _arrow_part(data: bytes) -> _Part | None:
    """The file's records read by Arrow with veScale's types; None when it holds anything else
    (a parse or type error, a missing field, a negative rank, spans of unequal length)."""
    import pyarrow.compute as pc
    import pyarrow.json as pa_json

    try:
        stream = pa.input_stream(pa.BufferReader(data), compression="gzip" if data[:2] == _GZIP_MAGIC else None)
        table = pa_json.open_json(stream, read_options=pa_json.ReadOptions(block_size=_ARROW_BLOCK),
                                  parse_options=pa_json.ParseOptions(explicit_schema=_ARROW_SCHEMA,
                                                                     unexpected_field_behavior="ignore")).read_all()
    except (pa.ArrowException, OSError):   # the bytes are in memory already: an error here is in the content
        return None
    if not table.num_rows or any(table.column(name).null_count for name in _REQUIRED):
        return None
    ints = {name: pc.fill_null(table.column(name), 0).to_numpy() for name in ("step", *_RANKS)}
    if any((ints[name] < 0).any() for name in _RANKS):
        return None
    starts, durations = (table.column(name).combine_chunks() for name in ("start_ts", "duration"))
    span_count = pc.list_value_length(starts).to_numpy()
    if not np.array_equal(span_count, pc.list_value_length(durations).to_numpy()):
        return None
    span_start, span_duration = starts.flatten(), durations.flatten()
    if span_start.null_count or span_duration.null_count:
        return None
    span_start, span_duration = span_start.to_numpy(), span_duration.to_numpy()
    if not (np.isfinite(span_start).all() and np.isfinite(span_duration).all()):
        return None
    metric = table.column("metric").combine_chunks().dictionary_encode()
    ip = [host if host not in _UNKNOWN_IPS else None for host in table.column("ip").to_pylist()]
    job = list(zip(*(table.column(name).to_pylist() for name in ("trial", "run_id", "role"))))
    return _Part(metrics=metric.dictionary.to_pylist(), metric=metric.indices.to_numpy().astype(np.int64),
                 step=ints["step"], rank=ints["rank"], stage=ints["stage"], dp_rank=ints["dp_rank"],
                 tp_rank=ints["tp_rank"], chunk=ints["model_chunk"],
                 ts=pc.fill_null(table.column("ts"), np.nan).to_numpy(), ip=ip, job=job,
                 line=np.full(table.num_rows, -1, np.int64), span_count=span_count.astype(np.int64),
                 span_start=span_start, span_duration=span_duration)


def _python_part(data: bytes, job_id: str, path: str) -> _Part:
    """The file's records parsed line by line; RawInputError naming the first bad line."""
    ints: dict[str, list[int]] = {name: [] for name in ("line", "step", *_RANKS, "span_count")}
    metrics: dict[str, int] = {}
    metric, ts, ip, job = [], [], [], []
    starts: list = []
    durations: list = []
    for number, line in _numbered_lines(data, job_id, path):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            raise RawInputError("raw_unreadable", f"line {number} is not JSON ({error}); re-upload the file",
                                job_id=job_id, path=path) from None
        if not isinstance(record, dict):
            raise _bad_record(number, f"a JSON {type(record).__name__}", job_id, path)
        missing = [name for name in _REQUIRED if record.get(name) is None]
        if missing:
            raise _bad_record(number, f"no {', '.join(missing)}", job_id, path)
        for name in ("step", *_RANKS):
            value = record.get(name)
            value = 0 if value is None else value
            if type(value) is not int or (value < 0 and name != "step"):
                raise _bad_record(number, f"{name} {value!r} is not a{' non-negative' if name != 'step' else 'n'} integer",
                                  job_id, path)
            ints[name].append(value)
        span_start, span_duration = record["start_ts"], record["duration"]
        if type(span_start) is not list or type(span_duration) is not list or len(span_start) != len(span_duration):
            raise _bad_record(number, "start_ts and duration must be lists of equal length", job_id, path)
        for name, spans in (("start_ts", span_start), ("duration", span_duration)):
            bad = [v for v in spans if type(v) not in (int, float) or not math.isfinite(v)]
            if bad:
                raise _bad_record(number, f"{name} holds {bad[0]!r}, not a finite number of seconds", job_id, path)
        name = record["metric"]
        if type(name) is not str:
            raise _bad_record(number, f"metric {name!r} is not a string", job_id, path)
        metric.append(metrics.setdefault(name, len(metrics)))
        stamp = record.get("ts")
        ts.append(float(stamp) if type(stamp) in (int, float) else np.nan)
        host = record.get("ip")
        ip.append(host if isinstance(host, str) and host not in _UNKNOWN_IPS else None)
        job.append(tuple(_identity(record.get(key)) for key in ("trial", "run_id", "role")))
        ints["line"].append(number)
        ints["span_count"].append(len(span_start))
        starts.extend(span_start)
        durations.extend(span_duration)
    columns = {name: np.asarray(values, dtype=np.int64) for name, values in ints.items()}
    return _Part(metrics=list(metrics), metric=np.asarray(metric, dtype=np.int64), step=columns["step"],
                 rank=columns["rank"], stage=columns["stage"], dp_rank=columns["dp_rank"], tp_rank=columns["tp_rank"],
                 chunk=columns["model_chunk"], ts=np.asarray(ts, dtype=np.float64), ip=ip, job=job, line=columns["line"],
                 span_count=columns["span_count"], span_start=np.asarray(starts, dtype=np.float64),
                 span_duration=np.asarray(durations, dtype=np.float64))


def _identity(value: Any) -> Any:
    """A trial / run_id / role value as recorded when it is a JSON scalar, else its text (hashable)."""
    return value if value is None or isinstance(value, (str, int, float)) else str(value)


# ---------------------------------------------------------------------------
# Job checks


def _folder(paths: Sequence[str]) -> str:
    """The window's folder (the common parent of its files), for job-level messages."""
    parents = {path.rstrip("/").rsplit("/", 1)[0] for path in paths}
    return parents.pop() if len(parents) == 1 else ", ".join(sorted(parents))


def _check_one_job(records: _Records, job_id: str) -> tuple[Any, ...]:
    """The window's (trial, run_id, role); raw_mixed_jobs when records of several are in it."""
    first: dict[tuple[Any, ...], int] = {}
    for index, identity in enumerate(records.job):
        if identity not in first:
            first[identity] = index
            if len(first) > 1:
                (a, i), (b, j) = list(first.items())[:2]
                raise RawInputError(
                    "raw_mixed_jobs", f"records of two runs in one window: trial {a[0]} run_id {a[1]} role {a[2]} "
                    f"({records.where(i)}) and trial {b[0]} run_id {b[1]} role {b[2]} ({records.where(j)}); "
                    "upload one run per job folder", job_id=job_id, path=records.paths[records.file[j]])
    return next(iter(first))


def _map_metrics(records: _Records, job_id: str) -> tuple[dict[int, tuple[int, ...]], list[int]]:
    """(metric index -> OPTYPES codes, unmapped metric indexes); raw_unknown_collective for an
    unknown metric that names gradients or parameters and a collective."""
    mapped, unmapped = {}, []
    for index, name in enumerate(records.metrics):
        if name in METRIC_OPTYPES:
            mapped[index] = tuple(OPTYPES.index(optype) for optype in METRIC_OPTYPES[name])
        elif _DP_COLLECTIVE.search(name):
            first = int(np.flatnonzero(records.metric == index)[0])
            raise RawInputError(
                "raw_unknown_collective", f"metric {name!r} ({records.where(first)}) looks like a data-parallel "
                "collective but maps to no op type (known: unshard-all-gather, grad-reduce-scatter, grad-all-reduce, "
                f"{', '.join(DP_COMM_OPTYPES)}); rename it in the profiler or extend METRIC_OPTYPES",
                job_id=job_id, path=records.paths[records.file[first]], op=name)
        else:
            unmapped.append(index)
    return mapped, unmapped


def _check_unique_records(records: _Records, job_id: str) -> None:
    """raw_duplicate_rank when one (metric, step, rank, model_chunk) has two records (an upload or
    flush repeated), and raw_mixed_jobs when one global rank reports two positions in the layout."""
    key = (records.chunk, records.rank, records.step, records.metric)
    order = np.lexsort(key)
    same = np.ones(len(order) - 1, dtype=bool) if len(order) > 1 else np.zeros(0, dtype=bool)
    for column in key:
        same &= column[order][1:] == column[order][:-1]
    if same.any():
        k = int(np.flatnonzero(same)[0])
        i, j = sorted((int(order[k]), int(order[k + 1])))
        raise RawInputError(
            "raw_duplicate_rank", f"rank {records.rank[i]} has two records of metric {records.metrics[records.metric[i]]!r} "
            f"step {records.step[i]} model_chunk {records.chunk[i]}: {records.where(i)} and {records.where(j)}; "
            "upload each rank's records once", job_id=job_id, path=records.paths[records.file[j]])
    position = np.stack([records.dp_rank, records.stage, records.tp_rank])
    order = np.lexsort((*position, records.rank))
    moved = (records.rank[order][1:] == records.rank[order][:-1]) & (position[:, order][:, 1:] != position[:, order][:, :-1]).any(axis=0)
    if moved.any():
        k = int(np.flatnonzero(moved)[0])
        i, j = int(order[k]), int(order[k + 1])
        raise RawInputError(
            "raw_mixed_jobs", f"rank {records.rank[i]} reports (dp {records.dp_rank[i]}, stage {records.stage[i]}, tp "
            f"{records.tp_rank[i]}) at {records.where(i)} but (dp {records.dp_rank[j]}, stage {records.stage[j]}, tp "
            f"{records.tp_rank[j]}) at {records.where(j)}; upload one job per folder",
            job_id=job_id, path=records.paths[records.file[j]])


@dataclasses.dataclass(frozen=True)
class _Sizes:
    dp: int
    pp: int
    tp: int
    cp: int
    vpp: int

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp * self.cp


def _sizes(records: _Records, mapped: Mapping[int, tuple[int, ...]], options: Mapping[str, Any], job_id: str,
           folder: str) -> _Sizes:
    """dp/pp/tp/vpp: job.yaml's value, else the largest rank in the records + 1; cp: job.yaml, else 1."""
    chunked = [m for m, codes in mapped.items() if any(OPTYPES[c] in COMPUTE_OPTYPES + _CHUNKED for c in codes)]
    chunks = records.chunk[np.isin(records.metric, chunked)]

    def size(key: str, values: np.ndarray, field: str) -> int:
        largest = int(values.max()) if len(values) else 0
        given = options.get(key)
        if given is None:
            return largest + 1
        if largest >= given:
            raise RawInputError("raw_bad_job_yaml", f"job.yaml {key} is {given} but the records have {field} "
                                f"{largest}; correct {key} or leave it out", job_id=job_id, path=f"{folder}/job.yaml")
        return int(given)

    return _Sizes(dp=size("dp_size", records.dp_rank, "dp_rank"), pp=size("pp_size", records.stage, "stage"),
                  tp=size("tp_size", records.tp_rank, "tp_rank"), cp=int(options.get("cp_size") or 1),
                  vpp=size("vpp_size", chunks, "model_chunk"))


def _representatives(records: _Records, sizes: _Sizes, job_id: str, folder: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(per record: is it its worker's representative, per worker: representative global rank, cp peer ranks).

    A worker is (dp_rank, stage); its representative is its tp_rank 0 rank (the lowest of them when
    cp_size > 1: context-parallel peers carry no cp rank). raw_missing_rank when a worker has none.
    """
    worker = records.dp_rank * sizes.pp + records.stage
    leads = records.tp_rank == 0
    representative = np.full(sizes.dp * sizes.pp, np.iinfo(np.int64).max)
    np.minimum.at(representative, worker[leads], records.rank[leads])
    missing = np.flatnonzero(representative == np.iinfo(np.int64).max)
    if len(missing):
        cells = ", ".join(f"(dp {w // sizes.pp}, stage {w % sizes.pp})" for w in missing[:8])
        raise RawInputError(
            "raw_missing_rank", f"{len(missing)} of {sizes.dp * sizes.pp} workers (dp {sizes.dp} x pp {sizes.pp}) have no "
            f"tp_rank 0 records: {cells}{' ...' if len(missing) > 8 else ''}; upload every rank's records",
            job_id=job_id, path=folder)
    chosen = leads & (records.rank == representative[worker])
    peers = leads & ~chosen
    if peers.any() and sizes.cp == 1:
        i = int(np.flatnonzero(peers)[0])
        raise RawInputError(
            "raw_duplicate_rank", f"ranks {representative[worker[i]]} and {records.rank[i]} both report worker (dp "
            f"{records.dp_rank[i]}, stage {records.stage[i]}) with tp_rank 0 ({records.where(i)}); set cp_size in "
            "job.yaml for context parallelism, else upload one job per folder", job_id=job_id,
            path=records.paths[records.file[i]])
    return chosen, representative, int(len(np.unique(records.rank[peers])))


def _align_steps(records: _Records, use: np.ndarray, mapped: Mapping[int, tuple[int, ...]], sizes: _Sizes,
                 job_id: str) -> list[int]:
    """Steps to drop: [] when every worker has the same steps; [last] when the only difference is an
    incomplete last step (absent on some workers, or missing metrics a worker records in other steps).
    Otherwise raw_steps_misaligned naming a worker that lacks a step another has."""
    worker = records.dp_rank * sizes.pp + records.stage
    steps, step_index = np.unique(records.step[use], return_inverse=True)
    n_workers = sizes.dp * sizes.pp
    present = np.zeros((n_workers, len(steps)), dtype=bool)
    present[worker[use], step_index] = True
    mapped_use = use & np.isin(records.metric, list(mapped))
    metrics = np.zeros((n_workers, len(steps), len(records.metrics)), dtype=bool)
    metrics[worker[mapped_use], np.searchsorted(steps, records.step[mapped_use]), records.metric[mapped_use]] = True
    complete = present.all(axis=0)
    if len(steps) > 1:
        earlier = metrics[:, :-1].any(axis=1)
        complete[-1] &= not (earlier & ~metrics[:, -1]).any()
    if complete.all():
        return []
    if complete[:-1].all():
        return [int(steps[-1])]
    # only the last step can be incomplete by its metrics alone, so some earlier step is absent on a worker
    column = int(np.flatnonzero(~present.all(axis=0))[0])
    lacking = int(np.flatnonzero(~present[:, column])[0])
    having = int(np.flatnonzero(present[:, column])[0])
    where_lacking = np.flatnonzero(use & (worker == lacking))
    where_having = np.flatnonzero(use & (worker == having) & (records.step == steps[column]))
    theirs = steps[present[lacking]]
    raise RawInputError(
        "raw_steps_misaligned", f"step {steps[column]} is on worker (dp {having // sizes.pp}, stage {having % sizes.pp}) "
        f"({records.where(int(where_having[0]))}) but not on worker (dp {lacking // sizes.pp}, stage "
        f"{lacking % sizes.pp}), whose steps are {theirs[:12].tolist()}{' ...' if len(theirs) > 12 else ''}; "
        "profile the same steps on every rank (only an incomplete last step is dropped)", job_id=job_id,
        path=records.paths[records.file[where_lacking[0]]])


def _window_start(start: np.ndarray, ts: np.ndarray, options: Mapping[str, Any], job_id: str,
                  folder: str) -> tuple[dt.datetime | None, str]:
    """(wall-clock start of the window or None for date 00:00 UTC, clock): job.yaml's start_time;
    else the earliest span start when the spans read as epoch seconds (clock "epoch"); else the
    earliest record ts when that does (clock "relative": spans are offsets)."""
    low, high = _EPOCH_SECONDS
    clock = "epoch" if len(start) and low <= float(start.min()) < high else "relative"
    given = options.get("start_time")
    if given is not None:
        try:
            began = given if isinstance(given, dt.datetime) else dt.datetime.fromisoformat(str(given))
        except ValueError:
            raise RawInputError("raw_bad_job_yaml", f"start_time {given!r} is not an ISO timestamp", job_id=job_id,
                                path=f"{folder}/job.yaml") from None
        return (began if began.tzinfo else began.replace(tzinfo=dt.timezone.utc)), clock
    if clock == "epoch":
        return dt.datetime.fromtimestamp(float(start.min()), dt.timezone.utc), clock
    stamps = ts[np.isfinite(ts)]
    if len(stamps) and low <= float(stamps.min()) < high:
        return dt.datetime.fromtimestamp(float(stamps.min()), dt.timezone.utc), clock
    return None, clock


# ---------------------------------------------------------------------------
# Conversion


def convert_ndtimeline(paths: Sequence[str], job_id: str, date: str, options: Mapping[str, Any]) -> ConvertedJob:
    """One raw NDTimeline window (its *.jsonl[.gz] URLs, records split across them in any way) -> ConvertedJob.

    options: job.yaml keys (schemas/raw.py JOB_YAML_KEYS): dp/pp/tp/cp/vpp sizes, hosts (per global
    rank), start_time, model_family, context_length, gpu_hours_scale. Times stay in seconds as
    recorded (float64, exact). Raises RawInputError with a schemas.raw.RAW_REASONS code naming the
    job and file; an OSError from storage propagates unchanged.
    """
    options = dict(options or {})
    paths = list(paths)
    if not paths:
        raise RawInputError("raw_not_a_trace", "no NDTimeline files (*.jsonl[.gz]) in the window", job_id=job_id)
    folder = _folder(paths)
    records = _read_records(paths, job_id)
    trial, run_id, role = _check_one_job(records, job_id)
    mapped, unmapped = _map_metrics(records, job_id)
    _check_unique_records(records, job_id)
    sizes = _sizes(records, mapped, options, job_id, folder)
    chosen, representative, cp_collapsed = _representatives(records, sizes, job_id, folder)
    dropped = _align_steps(records, chosen, mapped, sizes, job_id)
    use = chosen & ~np.isin(records.step, dropped)
    if not use.any():
        raise RawInputError("raw_no_steps", f"no complete step left after dropping {dropped}", job_id=job_id, path=folder)

    # one row per (record, op type) pair, then per span
    pairs = [(np.flatnonzero(use & (records.metric == metric)), code)
             for metric, codes in mapped.items() for code in codes]
    pair_record = np.concatenate([ids for ids, _ in pairs] or [np.zeros(0, np.int64)])
    pair_optype = np.concatenate([np.full(len(ids), code) for ids, code in pairs] or [np.zeros(0, np.int64)])
    counts = records.span_count[pair_record]
    row = np.repeat(pair_record, counts)
    optype = np.repeat(pair_optype, counts)
    position = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)   # span order within its record
    span = records.span_offset[row] + position
    compute = np.isin(optype, [OPTYPES.index(name) for name in COMPUTE_OPTYPES])
    if not compute.any():
        raise RawInputError("raw_no_microbatches", "no forward-compute / backward-compute spans in the records "
                            f"(metrics: {', '.join(records.metrics)})", job_id=job_id, path=folder)
    chunked = compute | np.isin(optype, [OPTYPES.index(name) for name in _CHUNKED])
    numbered = compute | (optype == OPTYPES.index("gc"))
    dp_rank, stage, chunk = records.dp_rank[row], records.stage[row], records.chunk[row]
    worker = dp_rank * sizes.pp + stage
    start = records.span_start[span]

    hosts = options.get("hosts") or []
    known = np.flatnonzero(use & np.array([ip is not None for ip in records.ip], dtype=bool))
    cells, first = np.unique(records.dp_rank[known] * sizes.pp + records.stage[known], return_index=True)
    worker_host = {(int(w) // sizes.pp, int(w) % sizes.pp): records.ip[known[i]] for w, i in zip(cells, first)}
    for w, rank in enumerate(representative):
        if rank < len(hosts) and hosts[rank]:
            worker_host[(w // sizes.pp, w % sizes.pp)] = str(hosts[rank])
    host = [worker_host.get((w // sizes.pp, w % sizes.pp)) for w in range(sizes.dp * sizes.pp)]

    trace = build_trace(
        job_id, dp_rank=dp_rank, stage=stage, rank=representative[worker], step=records.step[row], optype=optype,
        start_ts=start, duration=records.span_duration[span], mb_id=np.where(numbered, position, -1),
        mc=np.where(chunked, chunk, -1), gmc=np.where(compute, chunk * sizes.pp + stage, -1),
        host=np.asarray(host, dtype=object)[worker] if worker_host else None)
    began, clock = _window_start(start, records.ts[use], options, job_id, folder)
    manifest = build_manifest(
        job_id, date, trace, dp_size=sizes.dp, pp_size=sizes.pp, tp_size=sizes.tp, cp_size=sizes.cp,
        vpp_size=sizes.vpp, world_size=sizes.world,
        worker_rank={(w // sizes.pp, w % sizes.pp): int(r) for w, r in enumerate(representative)},
        worker_host=worker_host, start_time=began, model_family=str(options.get("model_family") or "unknown"),
        context_length=int(options.get("context_length") or 0),
        gpu_hours_scale=float(options.get("gpu_hours_scale") or 1.0))
    skipped = chosen & np.isin(records.metric, unmapped) & ~np.isin(records.step, dropped)
    unmapped_spans = np.bincount(records.metric[skipped], weights=records.span_count[skipped],
                                 minlength=len(records.metrics))
    source = {
        "format": NDTIMELINE,
        "profiler": PROFILER,
        "version": None,   # NDTimeline records carry no profiler version
        "trial": trial, "run_id": run_id, "role": role,
        "clock": clock,
        "ranks": int(len(np.unique(records.rank))),
        "files": len(paths),
        "records": int(len(records.step)),
        "tp_collapsed": int(len(np.unique(records.rank[records.tp_rank != 0]))),   # TP peer ranks
        "cp_collapsed": cp_collapsed,
        "unmapped": {records.metrics[m]: int(unmapped_spans[m]) for m in sorted(unmapped, key=records.metrics.__getitem__)
                     if unmapped_spans[m] > 0},
        "steps": np.unique(records.step[use]).tolist(),
        "steps_dropped": dropped,
    }
    return ConvertedJob(job_id, trace, manifest, source)


# ---------------------------------------------------------------------------
# Export


def _host_ip(host: str | None) -> str:
    """A manifest host as an NDTimeline ip: the documented unknown placeholders become veScale's 0.0.0.0."""
    return "0.0.0.0" if not host or host.startswith("unknown:") else host


def export_ndtimeline(trace: pa.Table, manifest: Mapping[str, Any], *, trial: str | None = None,
                      run_id: int = 0) -> Iterator[dict[str, Any]]:
    """A lake job (TRACE_SCHEMA rows + its manifest) as NDTimeline records, one per (step, rank,
    op type, model chunk), in step, worker, metric order.

    Metrics are the op type names; compute spans are in microbatch order (so span order gives
    mb_id back), other spans in start order. Times are the lake's float64 seconds, written with
    their shortest exact repr (lossless). ts is the window's start_time in whole epoch seconds,
    ip the worker's host (0.0.0.0 when unknown), tp_rank 0 (the lake holds TP representatives),
    trial the given one (default the job id).
    """
    if not trace.num_rows:
        return
    columns = {name: trace.column(name).to_numpy() for name in
               ("dp_rank", "stage", "rank", "step", "start_ts", "duration", "seq_id", "mc", "mb_id")}
    optypes = trace.column("optype").combine_chunks()
    if not pa.types.is_dictionary(optypes.type):
        optypes = optypes.dictionary_encode()
    codes = np.asarray([OPTYPES.index(name) for name in optypes.dictionary.to_pylist()] or [0], dtype=np.int64)
    optype = codes[optypes.indices.to_numpy(zero_copy_only=False).astype(np.int64)]
    step, dp_rank, stage = (columns[name].astype(np.int64) for name in ("step", "dp_rank", "stage"))
    compute = np.isin(optype, [OPTYPES.index(name) for name in COMPUTE_OPTYPES])
    chunk = np.maximum(columns["mc"].astype(np.int64), 0)
    span_order = np.where(compute, columns["mb_id"], 0)
    order = np.lexsort((columns["seq_id"], columns["start_ts"], span_order, chunk, optype, stage, dp_rank, step))
    key = np.stack([step, dp_rank, stage, optype, chunk])[:, order]
    boundary = np.flatnonzero(np.r_[True, (key[:, 1:] != key[:, :-1]).any(axis=0), True])
    start, duration, rank = columns["start_ts"][order], columns["duration"][order], columns["rank"][order]
    began = manifest.get("start_time")
    ts = int(began.timestamp()) if isinstance(began, dt.datetime) else 0
    hosts = {(w["dp_rank"], w["stage"]): w["host"] for w in manifest.get("workers") or []}
    trial = str(trial if trial is not None else manifest["job_id"])
    for low, high in zip(boundary[:-1].tolist(), boundary[1:].tolist()):
        step_, dp_, stage_, optype_, chunk_ = (int(v) for v in key[:, low])
        durations = duration[low:high].tolist()
        yield {
            "ts": ts,
            "rank": int(rank[low]),
            "metric": OPTYPES[optype_],
            "iteration": 0,
            "step": step_,
            "value": sum(durations) / len(durations),
            "start_ts": start[low:high].tolist(),
            "duration": durations,
            "model_chunk": chunk_,
            "stage": stage_,
            "dp_rank": dp_,
            "tp_rank": 0,
            "ip": _host_ip(hosts.get((dp_, stage_))),
            "role": 0,
            "trial": trial,
            "run_id": run_id,
        }


def _traced_seconds(trace: pa.Table) -> float:
    """Sum over steps of (latest end - earliest start), seconds: what build_manifest counts as traced."""
    step = trace.column("step").to_numpy()
    start = trace.column("start_ts").to_numpy()
    end = start + trace.column("duration").to_numpy()
    steps, index = np.unique(step, return_inverse=True)
    first, last = np.full(len(steps), np.inf), np.full(len(steps), -np.inf)
    np.minimum.at(first, index, start)
    np.maximum.at(last, index, end)
    return float(np.sum(last - first))


def write_ndtimeline(trace: pa.Table, manifest: Mapping[str, Any], out_url: str, job_id: str, *,
                     trial: str | None = None, run_id: int = 0) -> list[str]:
    """Write a lake job as `{out}/ndtimeline-{job_id}.jsonl.gz` (export_ndtimeline's records) and
    `{out}/job.yaml`: the sizes, plus what records cannot carry when the manifest has it:
    model_family, context_length, start_time when not a whole second (ts is), and gpu_hours_scale
    when the window spans more than its traced steps (end_time is then start_time + traced / scale).
    Returns the two URLs.

    `{out}` = `{lake}/raw/ndtimeline/date=D/job_id=J` lands the job for `strag import`.
    """
    import fsspec
    import yaml

    out = out_url.rstrip("/")
    fs, inner = fsspec.core.url_to_fs(out)
    fs.makedirs(inner, exist_ok=True)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as handle:   # mtime 0: the same job gives the same bytes
        for record in export_ndtimeline(trace, manifest, trial=trial, run_id=run_id):
            handle.write(orjson.dumps(record) + b"\n")
    job_yaml: dict[str, Any] = {"dp_size": int(manifest["dp_size"]), "pp_size": int(manifest["pp_size"]),
                                "tp_size": int(manifest["tp_size"]), "cp_size": int(manifest["dsp_size"]),
                                "vpp_size": int(manifest["vpp_size"])}
    if manifest.get("model_family") not in (None, "unknown"):
        job_yaml["model_family"] = str(manifest["model_family"])
    if manifest.get("context_length"):
        job_yaml["context_length"] = int(manifest["context_length"])
    began = manifest.get("start_time")
    if isinstance(began, dt.datetime) and began.microsecond:
        job_yaml["start_time"] = began.isoformat()
    ended = manifest.get("end_time")
    if isinstance(began, dt.datetime) and isinstance(ended, dt.datetime) and trace.num_rows:
        scale = _traced_seconds(trace) / (ended - began).total_seconds() if ended > began else 1.0
        if 0 < scale < 1:
            job_yaml["gpu_hours_scale"] = scale
    records_path, yaml_path = f"{out}/ndtimeline-{job_id}.jsonl.gz", f"{out}/job.yaml"
    fs.pipe_file(f"{inner}/ndtimeline-{job_id}.jsonl.gz", buffer.getvalue())
    fs.pipe_file(f"{inner}/job.yaml", yaml.safe_dump(job_yaml, sort_keys=False).encode())
    return [records_path, yaml_path]
