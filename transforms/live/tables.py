"""Reading the live tables `strag watch` appends to (live_results, alerts, live_quarantine), without Beam.

`strag serve` and the live pages only read: this module keeps them from importing Apache
Beam (transforms/live/results.py, the writers, does). Layout in schemas/live.py.
"""
from __future__ import annotations

import urllib.parse

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.live import ALERT_SCHEMA, ALERTS, LIVE_QUARANTINE, LIVE_RESULT_SCHEMA, LIVE_RESULTS
from schemas.tables import QUARANTINE_SCHEMA
from transforms.whatif.result import STRAGGLING_THRESHOLD

__all__ = ["DEFAULT_THRESHOLD", "name_part", "read_live_table", "current_results", "count_live_sessions"]

DEFAULT_THRESHOLD = STRAGGLING_THRESHOLD  # METHOD.md: a job straggles when S >= 1.1 (the engine's constant)


def name_part(value) -> str:
    """An id as one part of a file name, injectively: percent-encoded, '-' included, so the '--'
    that joins the parts never occurs inside one ('a--b' + 'c' and 'a' + 'b--c' stay apart)."""
    return urllib.parse.quote(str(value), safe="").replace("-", "%2D").replace(".", "%2E")


def _listing(url: str) -> dict[str, dict]:
    """{full path: fsspec info} of the parquet files under url (none when it does not exist), fresh each call."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    if not fs.exists(root):
        return {}
    protocol = url.split("://", 1)[0] + "://" if "://" in url else ""
    return {(protocol + p if protocol and not p.startswith(protocol) else p): info
            for p, info in fs.find(root, detail=True).items() if p.endswith(".parquet") and "/." not in p[len(root):]}


# path -> (listing signature, rows): live files are append-only and a rewrite changes the
# signature, so `strag serve` reads each file once instead of the whole table per request
_READ_CACHE: dict[str, tuple[tuple, pa.Table]] = {}


def _signature(info: dict) -> tuple:
    return (info.get("size"), info.get("mtime") or info.get("LastModified") or info.get("created"),
            info.get("ETag") or info.get("etag"))


def read_live_table(out: str, table: str = LIVE_RESULTS) -> pa.Table:
    """Every row of a live table (live_results, alerts or live_quarantine), all revisions.

    Each file is read once per process and kept while the listing shows it unchanged."""
    schema = {LIVE_RESULTS: LIVE_RESULT_SCHEMA, ALERTS: ALERT_SCHEMA, LIVE_QUARANTINE: QUARANTINE_SCHEMA}[table]
    listing = {path: _signature(info) for path, info in _listing(f"{out.rstrip('/')}/{table}").items()}
    parts = []
    for path in sorted(listing):
        cached = _READ_CACHE.get(path)
        if cached is None or cached[0] != listing[path]:
            with fsspec.open(path, "rb") as handle:
                cached = _READ_CACHE[path] = (listing[path], _conform(pq.read_table(handle), schema))
        parts.append(cached[1])
    return pa.concat_tables(parts) if parts else schema.empty_table()


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A file's rows in `schema`; a nullable column added since the file was written is null."""
    for field in schema:
        if field.name not in table.column_names and field.nullable:
            table = table.append_column(field.name, pa.nulls(table.num_rows, field.type))
    return table.select(schema.names).cast(schema)


def current_results(results: pa.Table) -> pa.Table:
    """The current result of each (job, session): its highest revision; sorted by job, first arrival."""
    if results.num_rows == 0:
        return results
    latest: dict[tuple[str, str], int] = {}
    keys = list(zip(results["job_id"].to_pylist(), results["session"].to_pylist()))
    for key, revision in zip(keys, results["revision"].to_pylist()):
        latest[key] = max(revision, latest.get(key, 0))
    keep = pa.array([revision == latest[key] for key, revision in zip(keys, results["revision"].to_pylist())])
    return results.filter(keep).sort_by([("job_id", "ascending"), ("first_arrival", "ascending"), ("session", "ascending")])


def count_live_sessions(out: str) -> int:
    """Distinct (job, session) with at least one result in the live table (file names only)."""
    names = {path.rsplit("/", 1)[-1].rsplit("--r", 1)[0] for path in _listing(f"{out.rstrip('/')}/{LIVE_RESULTS}")}
    return len(names)
