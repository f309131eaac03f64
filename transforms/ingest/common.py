"""What every raw-format converter shares: errors, the converted job, job.yaml, trace and manifest building.

Plain functions, no Beam. A converter turns one raw job window (its files) into a
`ConvertedJob`: op rows in TRACE_SCHEMA, a manifest row (MANIFEST_SCHEMA fields) and a
`source` record saying where they came from and what was left out.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import gzip
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.raw import JOB_YAML_KEYS, RAW_REASONS, SOURCE_KEY
from schemas.trace import OPTYPES, TRACE_SCHEMA, trace_table

__all__ = [
    "RawInputError",
    "ConvertedJob",
    "read_job_yaml",
    "open_bytes",
    "seq_ids",
    "build_trace",
    "build_manifest",
    "SOURCE_KEY",
    "describe_source",
]



class RawInputError(ValueError):
    """Raw input that cannot become an analysable job window: names the job, file and op.

    reason_code: a code of schemas.raw.RAW_REASONS (the quarantine table's reason_code).
    """

    def __init__(self, reason_code: str, message: str, *, job_id: str | None = None, path: str | None = None,
                 op: str | None = None):
        if reason_code not in RAW_REASONS:
            raise ValueError(f"unknown raw reason code {reason_code!r}")
        where = ", ".join(part for part in (f"job {job_id}" if job_id else "", f"file {path}" if path else "",
                                             f"op {op}" if op else "") if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.reason_code, self.job_id, self.path, self.op = reason_code, job_id, path, op
        self._message = message
        self.rejected: list[RawInputError] = []   # files set aside before this job-level error

    @property
    def message(self) -> str:
        """What is wrong, without the job / file prefix."""
        return self._message

    def __reduce__(self):   # crosses process pools and Beam workers intact
        return (_raw_input_error, (self.reason_code, self._message, self.job_id, self.path, self.op, self.rejected))

    def with_job(self, job_id: str) -> "RawInputError":
        """The same error naming `job_id` (errors raised while parsing one file know no job)."""
        return self if self.job_id else RawInputError(self.reason_code, self._message, job_id=job_id, path=self.path, op=self.op)

    @property
    def level(self) -> str:
        return RAW_REASONS[self.reason_code][0]

    def lines(self) -> list[str]:
        """This error for people, cause first: the files set aside before it (the first is why the
        window failed, each with its reason code), then this error as their consequence ("so: ...")."""
        this = f"{self} [{self.reason_code}]"
        if not self.rejected:
            return [this]
        first, *others = self.rejected
        return [f"{first} [{first.reason_code}]", *(f"  also set aside: {error} [{error.reason_code}]" for error in others),
                f"  so: {this}"]


def _raw_input_error(reason_code, message, job_id, path, op, rejected=()) -> RawInputError:
    error = RawInputError(reason_code, message, job_id=job_id, path=path, op=op)
    error.rejected = list(rejected)
    return error


@dataclasses.dataclass
class ConvertedJob:
    """One raw job window converted: `trace` (TRACE_SCHEMA), `manifest` (MANIFEST_SCHEMA fields
    as a dict) and `source`: format, profiler and version, ranks, files, the clock offsets applied
    per clock (seconds; kineto), steps dropped, and `unmapped` (event name -> count of events that fit
    no op type: counted, never dropped silently)."""

    job_id: str
    trace: pa.Table
    manifest: dict[str, Any]
    source: dict[str, Any]
    rejected: list[RawInputError] = dataclasses.field(default_factory=list)   # files set aside (file-level errors)

    def job_meta(self):
        """The engine's JobMeta: the manifest's parallelism and, from `source`, where the compute
        ran (device 'cpu': host_compute), as the batch reads it back from the lake."""
        from transforms.whatif.result import JobMeta

        return JobMeta.from_mapping({**self.manifest, "source": self.source})

    def source_json(self) -> str:
        return json.dumps(self.source, sort_keys=True, default=str)


def open_bytes(data: bytes) -> bytes:
    """The content of a raw file: gunzipped when it starts with the gzip magic."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    return data


def read_job_yaml(data: bytes | str | None, *, job_id: str | None = None, path: str | None = None) -> dict[str, Any]:
    """job.yaml as a dict of the documented keys (schemas/raw.py JOB_YAML_KEYS); {} when absent."""
    if data is None:
        return {}
    from transforms.io.meta_yaml import MetaYamlError, read_yaml_mapping

    try:
        content = read_yaml_mapping(data, "a YAML mapping", detail=True)
    except MetaYamlError as error:
        raise RawInputError("raw_bad_job_yaml", str(error), job_id=job_id, path=path) from None
    unknown = sorted(set(content) - set(JOB_YAML_KEYS))
    if unknown:
        raise RawInputError("raw_bad_job_yaml", f"unknown key(s) {', '.join(map(str, unknown))}; known: {', '.join(JOB_YAML_KEYS)}",
                            job_id=job_id, path=path)
    for key in ("dp_size", "pp_size", "tp_size", "cp_size", "vpp_size", "context_length"):
        if key in content and (not isinstance(content[key], int) or isinstance(content[key], bool) or content[key] < (0 if key == "context_length" else 1)):
            raise RawInputError("raw_bad_job_yaml", f"{key} must be a positive integer, got {content[key]!r}", job_id=job_id, path=path)
    if "clock" in content and content["clock"] not in ("auto", "align", "trust"):
        raise RawInputError("raw_bad_job_yaml", f"clock must be auto, align or trust, got {content['clock']!r}", job_id=job_id, path=path)
    if "gpu_hours_scale" in content:
        scale = content["gpu_hours_scale"]
        if not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise RawInputError("raw_bad_job_yaml", f"gpu_hours_scale must be in (0, 1], got {scale!r}", job_id=job_id, path=path)
    return dict(content)


def seq_ids(step: np.ndarray, worker: np.ndarray, optype: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Index of each op among ops of the same (step, worker, optype), by start time (METHOD.md seq_id)."""
    n = len(step)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    order = np.lexsort((start, optype, worker, step))
    key = np.stack([step[order], worker[order], optype[order]])
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = (key[:, 1:] != key[:, :-1]).any(axis=0)
    position = np.arange(n)
    group_start = np.maximum.accumulate(np.where(new_group, position, 0))
    out = np.empty(n, dtype=np.int32)
    out[order] = position - group_start
    return out


def build_trace(job_id: str, *, dp_rank, stage, rank, step, optype, start_ts, duration, mb_id, mc, gmc,
                host=None, n_ops=None, seq_lens=None, **seconds) -> pa.Table:
    """A TRACE_SCHEMA table from per-row numpy columns (optype as OPTYPES codes; seq_id derived),
    sorted by (step, dp_rank, stage, start_ts); n_ops: per row, < 0 for none; seq_lens: per row a
    list of sequence lengths or None; seconds: the optional float columns by name (data_wait,
    gc_wait, idle_within, gc_within, step_entered, step_left, gc_tail, host_load: schemas/trace.py), per row; those not
    given (None: the trace records no such thing) are null."""
    dp_rank, stage, step, optype = (np.asarray(a, dtype=np.int64) for a in (dp_rank, stage, step, optype))
    start_ts, duration = np.asarray(start_ts, dtype=np.float64), np.asarray(duration, dtype=np.float64)
    worker = dp_rank * (int(stage.max()) + 1 if len(stage) else 1) + stage
    seq = seq_ids(step, worker, optype, start_ts)
    order = np.lexsort((seq, optype, start_ts, stage, dp_rank, step))
    n = len(order)
    columns = {
        "job_id": pa.array([job_id] * n, pa.string()),
        "dp_rank": pa.array(dp_rank[order], pa.int16()),
        "stage": pa.array(stage[order], pa.int16()),
        "rank": pa.array(np.asarray(rank, dtype=np.int64)[order], pa.int32()),
        "step": pa.array(step[order], pa.int64()),
        "optype": pa.DictionaryArray.from_arrays(pa.array(optype[order], pa.int8()), pa.array(OPTYPES, pa.string())),
        "start_ts": pa.array(start_ts[order], pa.float64()),
        "duration": pa.array(duration[order], pa.float64()),
        "seq_id": pa.array(seq[order], pa.int32()),
        "mc": pa.array(np.asarray(mc, dtype=np.int64)[order], pa.int16()),
        "mb_id": pa.array(np.asarray(mb_id, dtype=np.int64)[order], pa.int32()),
        "gmc": pa.array(np.asarray(gmc, dtype=np.int64)[order], pa.int16()),
    }
    if host is not None:
        columns["host"] = pa.array(np.asarray(host, dtype=object)[order], pa.string())
    if seq_lens is not None:
        columns["seq_lens"] = pa.array(np.asarray(seq_lens, dtype=object)[order].tolist(), pa.list_(pa.int32()))
    if n_ops is not None:
        columns["n_ops"] = pa.array(np.asarray(n_ops, dtype=np.int64)[order], pa.int32(), mask=np.asarray(n_ops)[order] < 0)
    for name, values in seconds.items():
        if TRACE_SCHEMA.field(name).type != pa.float64():
            raise TypeError(f"build_trace: {name} is not an optional seconds column of TRACE_SCHEMA")
        if values is not None:
            columns[name] = pa.array(np.asarray(values, dtype=np.float64)[order], pa.float64())
    return trace_table(columns, n)


def build_manifest(job_id: str, date: dt.date | str, trace: pa.Table, *, dp_size: int, pp_size: int, tp_size: int = 1,
                   cp_size: int = 1, vpp_size: int = 1, world_size: int | None = None, worker_rank: Mapping[tuple[int, int], int],
                   worker_host: Mapping[tuple[int, int], str] | None = None, start_time: dt.datetime | None = None,
                   model_family: str = "unknown", context_length: int = 0, gpu_hours_scale: float = 1.0) -> dict[str, Any]:
    """The manifest row of a converted window.

    start_time: wall-clock start of the first traced step (default: date 00:00 UTC);
    end_time = start_time + traced time / gpu_hours_scale, the traced time being the sum over
    steps of (latest end - earliest start): GPU-hours cover what the profile stands for.
    """
    date = date if isinstance(date, dt.date) else dt.date.fromisoformat(date)
    step = trace.column("step").to_numpy()
    start = trace.column("start_ts").to_numpy()
    end = start + trace.column("duration").to_numpy()
    steps, index = np.unique(step, return_inverse=True)
    first = np.full(len(steps), np.inf)
    last = np.full(len(steps), -np.inf)
    np.minimum.at(first, index, start)
    np.maximum.at(last, index, end)
    traced = float(np.sum(last - first)) / gpu_hours_scale
    began = start_time or dt.datetime.combine(date, dt.time(0, 0), tzinfo=dt.timezone.utc)
    world = world_size or dp_size * pp_size * tp_size * cp_size
    workers = [{"dp_rank": d, "stage": s, "rank": int(worker_rank[(d, s)]),
                "host": (worker_host or {}).get((d, s)) or f"unknown:{job_id}:rank{int(worker_rank[(d, s)])}"}
               for d in range(dp_size) for s in range(pp_size)]
    mb = trace.column("mb_id").to_numpy()
    return {
        "job_id": job_id,
        "date": date,
        "submit_time": began,
        "start_time": began,
        "end_time": began + dt.timedelta(microseconds=round(traced * 1e6)),
        "gpus": world,
        "dp_size": dp_size,
        "pp_size": pp_size,
        "tp_size": tp_size,
        "dsp_size": cp_size,
        "vpp_size": vpp_size,
        "world_size": world,
        "microbatches": int(mb.max()) + 1 if len(mb) else 0,
        "model_family": model_family,
        "context_length": context_length,
        "workers": workers,
    }


def describe_source(source: dict) -> str:
    """One line for people: where the job came from."""
    version = source.get("version") or {}
    parts = [source.get("profiler", source.get("format", "?"))]
    if isinstance(version, dict) and version:
        parts.append(", ".join(f"{k} {v}" for k, v in version.items() if k in ("schemaVersion", "backend", "nccl_version", "torch")))
    elif version:
        parts.append(str(version))
    device = source.get("device")
    parts.append(f"{source.get('ranks', '?')} ranks" + (f" on {device}" if device else ""))
    collapsed = source.get("tp_cp_collapsed") or (source.get("tp_collapsed") or 0) + (source.get("cp_collapsed") or 0)
    if collapsed:
        parts.append(f"{collapsed} TP/CP ranks collapsed")
    if source.get("steps_from"):
        parts.append(f"steps told by {source['steps_from']}")
    if (source.get("profiler_cycles") or 1) > 1:
        parts.append(f"{source['profiler_cycles']} profiler cycles (a file per rank each), steps {source.get('steps')}")
    if source.get("steps_dropped"):
        why = source.get("steps_dropped_why") or {}
        parts.append(f"steps dropped {source['steps_dropped']}" + "".join(f" (step {s}: {r})" for s, r in why.items()))
    if source.get("clock_offset_max_s"):
        parts.append(f"clock offsets up to {1e3 * source['clock_offset_max_s']:.2f} ms aligned")
    unmapped = source.get("unmapped") or {}
    if unmapped:
        parts.append(f"{sum(unmapped.values())} events fit no op type")
    rejected = source.get("files_rejected") or {}
    if rejected:
        names = ", ".join(f"{str(path).rsplit('/', 1)[-1]} ({code})" for path, code in sorted(rejected.items()))
        parts.append(f"set aside: {names}")
    return "; ".join(p for p in parts if p)
