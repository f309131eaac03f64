"""The compiled event scanner (scan.c): a run of `traceEvents` straight from the JSON bytes into
`EventColumns`, no Python object per event.

`Scanner.scan(buf, pos, limit)` reads the whole events of buf[pos:limit] in one C pass that checks
the JSON as it goes and keeps, per event, its category, ph, ts, dur, tid, name, args.correlation
and where its args object lies. Names and tids are interned in C (each distinct one is a Python
object once per file, not once per event); the args of the few events whose args are read are
decoded with msgspec from the bytes of the run, which the columns view until `release()`. The
columns equal those of the msgspec structs (columns.py) on every run (tests/test_ingest_scan.py);
the scanner stops, and the reader decodes the rest of the run the msgspec way, at malformed JSON
(whose message is then msgspec's) and at events the columns do not take (see scan.c).

Built like the replay kernel (transforms/native.py); without a C compiler the reader keeps the
msgspec path (same results, ~3x slower to convert a trace) and one line on stderr says so, once
per process. `STRAG_SCAN=msgspec|c` forces one path (tests, benchmarks).
"""
from __future__ import annotations

import ctypes
import operator
import pathlib

import msgspec
import numpy as np

from transforms.ingest.kineto.columns import (ANNOTATION, EventArgs, COPY, CPU_OP, FLOW, GPU_LABEL, KERNEL, LAUNCH, EventColumns,
                                              Group, _GROUPS)
from transforms.native import CompiledHelper, LibraryBuildError

__all__ = ["Scanner", "scanner", "wanted", "HELPER", "LibraryBuildError", "CATEGORY_CODES", "MORE", "END", "FULL",
           "BAD", "STRAY"]

SOURCE = pathlib.Path(__file__).with_name("scan.c")
FLAGS = ("-O3", "-std=c99", "-fPIC", "-shared")
# scan.c's category codes 1..9, in this order (0: any other category, or none)
CATEGORY_CODES = ("cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "cpu_op",
                  "user_annotation", "fwdbwd")
_COARSE = np.array([0, LAUNCH, LAUNCH, KERNEL, COPY, COPY, GPU_LABEL, CPU_OP, ANNOTATION, FLOW], dtype=np.int8)
MORE, END, FULL, BAD, STRAY, NOMEM = 0, 1, 2, -1, -2, -3
_NO_CORRELATION = -(2 ** 63)
_ENV = "STRAG_SCAN"
_PH_X, _PH_S, _PH_F = 1, 2, 3


def _declare(library) -> None:
    library.strag_scan_new.restype = ctypes.c_void_p
    library.strag_scan_new.argtypes = []
    library.strag_scan_free.restype = None
    library.strag_scan_free.argtypes = [ctypes.c_void_p]
    library.strag_scan_count.restype = ctypes.c_int64
    library.strag_scan_count.argtypes = [ctypes.c_void_p, ctypes.c_int]
    library.strag_scan_bytes.restype = ctypes.c_int64
    library.strag_scan_bytes.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    library.strag_scan_entries.restype = ctypes.c_int64
    library.strag_scan_entries.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_int64, ctypes.c_void_p]
    library.strag_scan.restype = None
    library.strag_scan.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64] \
        + [ctypes.c_void_p] * 10


HELPER = CompiledHelper(SOURCE, FLAGS, _declare, env=_ENV, off="msgspec", on="c",
                        fallback="strag: C trace scanner not used ({reason}); reading traces with msgspec (same "
                                 "results, ~3x slower)")


def _load() -> ctypes.CDLL:
    return HELPER.load()


def wanted() -> bool:
    """Scan with C? STRAG_SCAN=msgspec|c forces the choice; by default whenever it builds (else one
    line on stderr, once per process, says why)."""
    return HELPER.wanted()


def scanner() -> "Scanner | None":
    """A scanner for one file, None when the msgspec path is to read it."""
    return Scanner() if wanted() else None


class Scanner:
    """The scanner of one file: its interned names and tids live as long as it does."""

    def __init__(self, capacity: int = 1 << 16):
        self._library = _load()
        self._state = self._library.strag_scan_new()
        if not self._state:
            raise MemoryError("trace scanner: cannot allocate its state")
        self._capacity = capacity
        self._out = _Outputs(capacity)
        self.names: list[str] = [""]     # id + 1 -> name ("" when absent)
        self.tids: list = [None]         # id + 1 -> tid (None when absent)
        self._result = np.zeros(3, dtype=np.int64)

    def __del__(self):
        state, self._state = getattr(self, "_state", None), None
        if state:
            self._library.strag_scan_free(state)

    def scan(self, buf, pos: int, limit: int) -> tuple[int, int, "ScannedColumns | None"]:
        """(status, position to go on from, the columns of the events read, None when none)."""
        out = self._out
        view = np.frombuffer(buf, dtype=np.uint8)
        try:
            self._library.strag_scan(self._state, view.ctypes.data, limit, pos, self._capacity, *out.pointers,
                                     self._result.ctypes.data)
        finally:
            del view   # the buffer is a bytearray the reader resizes: let go of it
        n, end, status = (int(x) for x in self._result)
        if status == NOMEM:
            raise MemoryError("trace scanner: out of memory interning names")
        if not n:
            return status, end, None
        self._grow_tables()
        # the run's bytes, for the args read: a view (no copy), released once the run is read
        return status, end, ScannedColumns(self, out.take(n), memoryview(buf)[pos:end], pos)

    def _grow_tables(self) -> None:
        for which, table, decode in ((0, self.names, _decode_name), (1, self.tids, _decode_tid)):
            first = len(table) - 1
            count = self._library.strag_scan_count(self._state, which)
            if count == first:
                continue
            size = self._library.strag_scan_bytes(self._state, which, first)
            data = ctypes.create_string_buffer(max(size, 1))
            lengths = np.empty(count - first, dtype=np.int32)
            self._library.strag_scan_entries(self._state, which, first, data, size, lengths.ctypes.data)
            raw = data.raw
            at = 0
            for length in lengths.tolist():
                table.append(decode(raw[at:at + length]))
                at += length


def _decode_name(raw: bytes) -> str:
    """A name's JSON string content: its escapes decoded (UnicodeDecodeError when it is no UTF-8)."""
    return msgspec.json.decode(b'"' + raw + b'"') if b"\\" in raw else raw.decode()


def _decode_tid(raw: bytes):
    return msgspec.json.decode(raw)


class _Outputs:
    """The scanner's output columns, reused from run to run (a run's are copied out)."""

    FIELDS = (("code", np.int8), ("ph", np.int8), ("ts", np.float64), ("dur", np.float64), ("tid", np.int32),
              ("name", np.int32), ("correlation", np.int64), ("args_lo", np.int32), ("args_hi", np.int32))

    def __init__(self, capacity: int):
        self.arrays = [np.empty(capacity, dtype=dtype) for _, dtype in self.FIELDS]
        self.pointers = [a.ctypes.data for a in self.arrays]

    def take(self, n: int) -> dict[str, np.ndarray]:
        return {field: array[:n].copy() for (field, _), array in zip(self.FIELDS, self.arrays)}


_DECODE_ARGS = None


def _args_decoder():
    global _DECODE_ARGS
    if _DECODE_ARGS is None:

        _DECODE_ARGS = msgspec.json.Decoder(list[EventArgs])
    return _DECODE_ARGS


class ScannedColumns(EventColumns):
    """`EventColumns` of a scanned run: the groups hold the run's row numbers (`index`), the
    fields are gathered from the run's columns when asked."""

    __slots__ = ("_scanner", "_rows", "_raw", "_base", "_fine")

    def __init__(self, scanner: Scanner, rows: dict[str, np.ndarray], raw: memoryview, base: int):
        fine = rows["code"]
        code = _COARSE[fine]
        ts, dur, ph = rows["ts"], rows["dur"], rows["ph"]
        has_ts = ~np.isnan(ts)
        complete = (ph == _PH_X) & has_ts & ~np.isnan(dur)
        first = np.flatnonzero(complete)
        first_complete = float(ts[first[0]]) if len(first) else None
        is_flow = (code == FLOW) & has_ts
        flow_starts, flow_ends = ts[is_flow & (ph == _PH_S)], ts[is_flow & (ph == _PH_F)]
        groups = {}
        for key, codes in _GROUPS.items():
            member = complete & ((code == codes[0]) if len(codes) == 1 else (code >= codes[0]) & (code <= codes[-1]))
            at = np.flatnonzero(member)
            groups[key] = Group(at, ts[at], dur[at], code[at], at)
        super().__init__(len(fine), first_complete, flow_starts, flow_ends, groups, _SCANNED)
        self._scanner, self._rows, self._raw, self._base, self._fine = scanner, rows, raw, base, fine

    def release(self) -> None:
        """Let go of the run's bytes (the reader's buffer, which it then resizes): the args can no
        longer be read."""
        self._raw.release()

    def names(self, group: Group) -> list:
        return _gather(self._scanner.names, self._rows["name"][group.index] + 1)

    def tids(self, group: Group) -> list:
        return _gather(self._scanner.tids, self._rows["tid"][group.index] + 1)

    def name_ids(self, group: Group) -> tuple[np.ndarray, list]:
        """Ids into the scanner's names, the file's (it only grows): each name is one str per file."""
        return self._rows["name"][group.index] + 1, self._scanner.names

    def tid_ids(self, group: Group) -> tuple[np.ndarray, list]:
        return self._rows["tid"][group.index] + 1, self._scanner.tids

    def correlations(self, group: Group) -> tuple[np.ndarray, np.ndarray]:
        values = self._rows["correlation"][group.index]
        return values, values != _NO_CORRELATION

    def args_of(self, group: Group, i: int) -> dict:
        return self.args_many(group, [i])[0]

    def args_many(self, group: Group, positions) -> list[dict]:
        """The args of several events, decoded in one call (the keys read, as `args_of` gives them)."""
        rows = group.index[np.asarray(positions, dtype=np.int64)]
        lo, hi = self._rows["args_lo"][rows].tolist(), self._rows["args_hi"][rows].tolist()
        raw = self._raw
        array = b"[" + b",".join([raw[a:b] if a >= 0 else b"{}" for a, b in zip(lo, hi)]) + b"]"
        return [args.as_dict() for args in _args_decoder().decode(array)]

    def args_holding(self, group: Group, positions, key: str) -> list[bool]:
        """Whether the args of each of these events hold `key`, from their bytes, none decoded: a
        key of the args is spelled without escapes in a scanned run (a run with one is msgspec's),
        so the quoted key is absent from the bytes exactly when the args do not hold it, else
        (it may stand in a nested object) the args are decoded to tell."""
        needle = b'"' + key.encode() + b'"'
        rows = group.index[np.asarray(positions, dtype=np.int64)]
        lo, hi = self._rows["args_lo"][rows], self._rows["args_hi"][rows]
        given = lo >= 0
        if not given.any():
            return [False] * len(rows)
        # where the quoted key stands in the run's bytes (found in place: `obj` is the reader's buffer)
        buf, first, last = self._raw.obj, self._base + int(lo[given].min()), self._base + int(hi[given].max())
        hits, at = [], buf.find(needle, first, last)
        while at >= 0:
            hits.append(at - self._base)
            at = buf.find(needle, at + 1, last)
        hits = np.array(hits, dtype=np.int64)
        maybe = (given & (np.searchsorted(hits, lo) < np.searchsorted(hits, hi - len(needle) + 1))).tolist()
        if any(maybe):
            candidates = [i for i, found in zip(positions, maybe) if found]
            held = {i for i, args in zip(candidates, self.args_many(group, candidates)) if key in args}
            maybe = [i in held for i in positions]
        return maybe

    def category_of(self, group: Group, i: int) -> str:
        return CATEGORY_CODES[int(self._fine[group.index[i]]) - 1]


_SCANNED = "scanned"


def _gather(table: list, ids: np.ndarray) -> list:
    if len(ids) > 1:
        return list(operator.itemgetter(*ids.tolist())(table))
    return [table[int(ids[0])]] if len(ids) else []
