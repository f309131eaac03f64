"""Bad input for the synthetic lake: corrupt a written job in one of the ways real lakes break.

The generator (`write_fleet`) writes a clean job, then calls
`corrupt_job(fs, kind, trace_files, manifest_path, rng)` for the jobs it picked as bad;
the returned sentence is recorded in the truth table. `EXPECTED_REASON[kind]` is the
reason code (schemas.expectations.REASONS) the validator must report for that kind.

Every rewrite is atomic (transforms.io.lake.write_parquet / one put), so a reader never
sees a half-corrupted file other than the intended corruption.
"""
from __future__ import annotations

from collections.abc import Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import expectations as reasons
from transforms.io.lake import read_parquet, write_parquet

__all__ = ["BAD_KINDS", "EXPECTED_REASON", "BadInputError", "corrupt_job"]

BAD_KINDS: tuple[str, ...] = (
    "truncated_file",
    "corrupt_bytes",
    "missing_column",
    "wrong_type",
    "negative_duration",
    "duplicate_rows",
    "missing_workers",
    "missing_steps",
    "missing_manifest",
    "unknown_optype",
)
EXPECTED_REASON: dict[str, str] = {
    "truncated_file": reasons.UNREADABLE_FILE,
    "corrupt_bytes": reasons.UNREADABLE_FILE,
    "missing_column": reasons.MISSING_COLUMN,
    "wrong_type": reasons.WRONG_TYPE,
    "negative_duration": reasons.NEGATIVE_DURATION,
    "duplicate_rows": reasons.DUPLICATE_ROW,
    "missing_workers": reasons.MISSING_WORKERS,
    "missing_steps": reasons.MISSING_STEPS,
    "missing_manifest": reasons.MISSING_MANIFEST,
    "unknown_optype": reasons.UNKNOWN_OPTYPE,
}
# Columns a broken writer may drop or mistype (all required by TRACE_SCHEMA).
_DROPPABLE = ("duration", "start_ts", "optype", "step", "stage", "dp_rank", "seq_id")
_MADE_UP_OPTYPES = ("forward-compute-fused", "nccl-all-to-all", "cuda-memcpy")


class BadInputError(ValueError):
    """The job cannot be corrupted in the requested way (e.g. one worker: no step can be dropped for some only)."""


def _url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A URL for `path` that transforms.io.lake can open (paths from a lake listing already are)."""
    if "://" in path:
        return path
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def _pick(rng: np.random.Generator, items: Sequence):
    return items[int(rng.integers(len(items)))]


def _worker_keys(table: pa.Table) -> np.ndarray:
    return table["dp_rank"].to_numpy().astype(np.int64) * 100_000 + table["stage"].to_numpy().astype(np.int64)


def _largest_chunk_middle(data: bytes) -> tuple[int, int]:
    """(offset, length) inside the page data of the file's largest column chunk."""
    metadata = pq.ParquetFile(pa.BufferReader(data)).metadata
    best = max(
        (metadata.row_group(g).column(c) for g in range(metadata.num_row_groups)
         for c in range(metadata.num_columns)),
        key=lambda column: column.total_compressed_size,
    )
    start = best.dictionary_page_offset or best.data_page_offset
    size = best.total_compressed_size
    length = max(1, min(64, size // 4))
    return start + size // 2 - length // 2, length


def corrupt_job(fs: fsspec.AbstractFileSystem | None, kind: str, trace_files: Sequence[str],
                manifest_path: str | None, rng: np.random.Generator) -> str:
    """Corrupt one written lake job in place; return a sentence saying what was done.

    fs: the lake's filesystem (None: inferred from the paths); trace_files: the job's
    trace file URLs (as transforms.io.lake lists them); manifest_path: its manifest URL;
    rng: the generator's random state (the choice of file, rows and bytes).
    Raises BadInputError when the job cannot carry that kind of corruption.
    """
    if kind not in BAD_KINDS:
        raise ValueError(f"unknown bad-input kind {kind!r}; choose from {', '.join(BAD_KINDS)}")
    if kind == "missing_manifest":
        if manifest_path is None:
            raise BadInputError("the job has no manifest to remove")
        if fs is None:
            fs, _ = fsspec.core.url_to_fs(manifest_path)
        fs.rm(manifest_path)
        return f"removed manifest {manifest_path}"
    if not trace_files:
        raise BadInputError(f"{kind}: the job has no trace files")
    if fs is None:
        fs, _ = fsspec.core.url_to_fs(trace_files[0])
    files = [_url(fs, path) for path in trace_files]

    if kind in ("truncated_file", "corrupt_bytes"):
        path = _pick(rng, files)
        data = fs.cat_file(path)
        if kind == "truncated_file":
            keep = int(rng.integers(len(data) // 4, 3 * len(data) // 4))
            fs.pipe_file(path, data[:keep])
            return f"truncated {path} from {len(data)} to {keep} bytes"
        offset, length = _largest_chunk_middle(data)
        # xor with non-zero bytes: every byte of the span really changes
        noise = rng.integers(1, 256, length, dtype=np.uint8).tobytes()
        span = bytes(a ^ b for a, b in zip(data[offset:offset + length], noise))
        fs.pipe_file(path, data[:offset] + span + data[offset + length:])
        return f"overwrote {length} bytes at offset {offset} of {path} (inside a column chunk's pages)"

    if kind == "missing_workers":
        tables = {path: read_parquet(path) for path in files}
        keys = np.unique(np.concatenate([_worker_keys(t) for t in tables.values()]))
        if keys.size < 2:
            raise BadInputError("missing_workers: the job has a single worker; removing it leaves no job")
        key = int(_pick(rng, keys))
        for path, table in tables.items():
            mask = _worker_keys(table) == key
            if mask.all():
                fs.rm(path)
            elif mask.any():
                write_parquet(path, table.filter(pa.array(~mask)))
        return f"dropped every row of worker (dp {key // 100_000}, stage {key % 100_000})"

    if kind == "missing_steps":
        tables = {path: read_parquet(path) for path in files}
        everything = pa.concat_tables(list(tables.values()), promote_options="permissive")
        keys = np.unique(_worker_keys(everything))
        if keys.size < 2:
            raise BadInputError("missing_steps: one worker only; a step dropped everywhere is just not sampled")
        step = int(_pick(rng, pc.unique(everything["step"]).to_numpy()))
        victims = rng.choice(keys, size=int(rng.integers(1, keys.size)), replace=False)
        for path, table in tables.items():
            mask = np.isin(_worker_keys(table), victims) & (table["step"].to_numpy() == step)
            if mask.any():
                write_parquet(path, table.filter(pa.array(~mask)))
        workers = ", ".join(f"(dp {k // 100_000}, stage {k % 100_000})" for k in sorted(victims.tolist())[:4])
        return f"dropped step {step} of {victims.size} of {keys.size} workers: {workers}"

    path = _pick(rng, files)
    table = read_parquet(path)
    if table.num_rows == 0:
        raise BadInputError(f"{kind}: {path} has no rows")
    if kind == "missing_column":
        column = _pick(rng, [c for c in _DROPPABLE if c in table.column_names])
        write_parquet(path, table.drop_columns([column]))
        return f"removed column {column} from {path}"
    if kind == "wrong_type":
        column = _pick(rng, ("duration", "step", "dp_rank"))
        # text where numbers belong, or fractional steps: what broken writers produce
        new = (pc.cast(table[column], pa.string()) if column != "step"
               else pc.add(pc.cast(table[column], pa.float64()), 0.5))
        write_parquet(path, table.set_column(table.schema.get_field_index(column), column, new))
        return f"rewrote column {column} of {path} as {new.type}"

    count = int(min(table.num_rows, rng.integers(1, 6)))
    rows = np.sort(rng.choice(table.num_rows, size=count, replace=False))
    if kind == "negative_duration":
        duration = table["duration"].to_numpy().astype(np.float64, copy=True)
        duration[rows] = -np.abs(duration[rows]) - 1e-3
        new = pc.cast(pa.array(duration), table.schema.field("duration").type)
        write_parquet(path, table.set_column(table.schema.get_field_index("duration"), "duration", new))
        return f"made {count} duration(s) negative in {path} (rows {rows.tolist()})"
    if kind == "duplicate_rows":
        write_parquet(path, pa.concat_tables([table, table.take(pa.array(rows))]))
        return f"appended copies of {count} row(s) {rows.tolist()} to {path}"
    # unknown_optype
    names = pc.cast(table["optype"], pa.string()).to_pylist()
    made_up = _pick(rng, _MADE_UP_OPTYPES)
    for row in rows.tolist():
        names[row] = made_up
    new = pc.dictionary_encode(pa.array(names, pa.string()))
    write_parquet(path, table.set_column(table.schema.get_field_index("optype"), "optype", new))
    return f"renamed the optype of {count} row(s) {rows.tolist()} of {path} to {made_up!r}"
