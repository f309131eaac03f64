"""Raw profiler output -> lake rows: converters as plain functions (no Beam).

    from transforms.ingest import convert_window
    converted = convert_window("kineto", ["/runs/j1/rank-0.json.gz", ...], job_id="j1", date="2026-11-23")
    converted.trace      # pyarrow Table, TRACE_SCHEMA
    converted.manifest   # dict, MANIFEST_SCHEMA fields
    converted.source     # format, profiler version, ranks, clock offsets, unmapped event counts

Formats (schemas/raw.py): `kineto` (transforms/ingest/kineto.py: torch.profiler Chrome-trace
JSON, one file per rank) and `ndtimeline` (transforms/ingest/ndtimeline.py: veScale NDTimeline
JSON-lines records). Bad input raises `RawInputError` with a reason code of
schemas.raw.RAW_REASONS; an `OSError` while reading (storage, network, permissions) is not
bad data and propagates as it is.
"""
from __future__ import annotations

from collections.abc import Sequence

from schemas.raw import JOB_YAML, RAW_FORMATS
from transforms.ingest.common import SOURCE_KEY, ConvertedJob, RawInputError, describe_source, read_job_yaml

__all__ = ["convert_window", "read_raw_file", "describe_source", "ConvertedJob", "RawInputError", "SOURCE_KEY", "RAW_FORMATS"]


def read_raw_file(path: str) -> bytes:
    """The bytes of one raw file by URL, read with retries; StorageError (an OSError: infrastructure)
    when storage does not deliver them."""
    from transforms.io.storage import read_bytes

    return read_bytes(path)


def convert_window(fmt: str, paths: Sequence[str], job_id: str, date: str, *, job_yaml: dict | None = None,
                   workers: int = 1) -> ConvertedJob:
    """Convert one raw job window: its files (URLs; a `job.yaml` among them is read as options,
    `job_yaml` overrides its keys) -> ConvertedJob. Raises RawInputError on bad input.
    workers: processes parsing kineto rank files (1: in this process)."""
    if fmt not in RAW_FORMATS:
        raise ValueError(f"raw format {fmt!r}: expected one of {', '.join(RAW_FORMATS)}")
    options: dict = {}
    traces = []
    for path in sorted(paths):
        if path.rstrip("/").rsplit("/", 1)[-1] == JOB_YAML:
            options.update(read_job_yaml(read_raw_file(path), job_id=job_id, path=path))
        else:
            traces.append(path)
    options.update(job_yaml or {})
    if fmt == "kineto":
        from transforms.ingest.kineto import convert_kineto

        return convert_kineto(traces, job_id, date, options, workers=workers)
    from transforms.ingest.ndtimeline import convert_ndtimeline

    return convert_ndtimeline(traces, job_id, date, options)
