"""What a published table is: its name, Arrow schema, sort order and partitioning (TableSpec), and
the Hive partition key. The per-job tables (schemas/tables.py) and the fleet tables
(schemas/fleet.py) are both lists of TableSpecs; this module imports neither."""
from __future__ import annotations

import dataclasses

import pyarrow as pa

__all__ = ["PARTITION_KEY", "TableSpec"]

# The Hive partition key of every partitioned table: it lives in the path (date=YYYY-MM-DD), not in the files.
PARTITION_KEY = "date"


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """A table the commit step can publish.

    name: folder under the output URL (may be nested, e.g. "fleet_rollup/fleet_summary"); schema: Arrow schema of the files (without the
    partition key); sort_keys: columns that order the rows of a file (with every column
    appended as a tie-break, so the order is total); partitioned: Hive-partitioned by
    `date` (False: one file for the whole table, replaced by every run).
    """

    name: str
    schema: pa.Schema
    sort_keys: tuple[str, ...]
    partitioned: bool = True

    def __post_init__(self):
        segments = self.name.split("/")
        if not all(segments) or any(s.startswith(("_", ".")) or "=" in s for s in segments):
            raise ValueError(f"table name {self.name!r}: folder names must be non-empty, without '=' and not start with '_' or '.'")
        missing = [k for k in self.sort_keys if k not in self.schema.names]
        if missing:
            raise ValueError(f"table {self.name}: sort keys {missing} are not columns of its schema")
        if PARTITION_KEY in self.schema.names and self.partitioned:
            raise ValueError(f"table {self.name}: '{PARTITION_KEY}' is the partition key, it lives in the path, not in the file")
