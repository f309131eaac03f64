"""A streaming, typed reader of one Kineto (torch.profiler Chrome trace) JSON file.

`read_trace(data)` turns a rank file's bytes (JSON, optionally gzipped) into
- `reader.chunks()`: the `traceEvents` array as `EventColumns` (columns.py), one per few MB of JSON:
  numpy columns of the events the converter reads, grouped by category, in file order;
- `reader.top`: every other top-level key, decoded (distributedInfo, deviceProperties,
  baseTimeNanoseconds, schemaVersion, trace_id, host_name, ...), whether it stands before or after
  traceEvents; complete once `chunks()` is exhausted.

Memory: the file is gunzipped a few MB at a time (never the whole document) and `traceEvents` is
read a run of whole events at a time; what is held is the compressed file, one buffer of JSON (two
runs) and the columns of a run. Speed: gzip goes through ISA-L (`isal`, 3x zlib), which inflates
straight into that buffer (no bytes object per inflated piece, no copy of it: 13% of the time to
convert a trace went to those); the scanner reads the bytes where they were inflated.

Two ways to read a run, the same columns either way:
- the compiled scanner (scan.py, scan.c; the default wherever a C compiler is): one C pass over the
  bytes that checks the JSON and writes the columns, names and tids interned, no Python object per
  event. It stops at malformed JSON and at events the columns do not take (a string ts, a float
  correlation, ...): the run from there is read the second way, which says what is wrong or reads it.
- msgspec: a run is cut after the last `}` of a window that a `,` follows; decoding `[run]` proves
  the cut (a `}` inside a string leaves the string open, one inside a nested value leaves it
  unbalanced: the decode fails), and when it fails `_element_ends` finds the cut exactly (a
  vectorised byte scan that skips escaped quotes and strings and tracks nesting). The run is
  decoded into structs of a union tagged by `cat` that keep only the fields read of each category,
  then into columns (columns.py); a run the tagged structs refuse (no cat or one of its own, a null
  field, a correlation that is no int64) is decoded again into the general `TraceEvent` structs
  below, which give the same columns.

Bad bytes raise `TraceUnreadable` (the caller's raw_unreadable); a file whose shape the streaming
path does not take (top level not an object, traceEvents not an array or given twice, a field of
an unexpected JSON type) raises `NotStreamable`: decode it whole instead, the old way.
"""
from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

import transforms.ingest.kineto.scan as _scan
from transforms.ingest.kineto.columns import EventArgs, EventColumns, columns_of, general_columns

try:   # ISA-L's inflate (the same stream at about 3x zlib's speed), straight into the reader's buffer
    from isal.isal_zlib import IsalError as _IsalError, _GzipReader as _IsalGzipReader
except ImportError:   # pragma: no cover - isal is a declared dependency
    _IsalGzipReader = None
    _IsalError = zlib.error
# what a damaged stream raises: a truncated one EOFError, a bad header or checksum BadGzipFile, a bad block
# isal's IsalError (zlib.error without isal). Never an error of storage: the bytes are in memory.
_GUNZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error, _IsalError)


def _gunzip(data: bytes):
    """A reader of the gzip members in `data` with `readinto`: isal's (implemented in C; it reads
    `data` in place and inflates into the buffer given), else the standard library's."""
    if _IsalGzipReader is not None:
        return _IsalGzipReader(data)
    return gzip.GzipFile(fileobj=io.BytesIO(data))


__all__ = ["TraceEvent", "EventArgs", "TraceReader", "read_trace", "TraceUnreadable", "NotStreamable",
           "parser"]

CHUNK_BYTES = 4 << 20          # JSON per decoded run: a few MB keeps the structs of one run small
_BUFFER_BYTES = 2 * CHUNK_BYTES   # the gunzipped text's buffer: a run and the next, inflated in place
_INFLATE_MIN = 1 << 16            # inflated per call at least
_WHITESPACE = b" \t\r\n"


def parser() -> str:
    """What reads the events here (benchmarks name it)."""
    return ("compiled scanner (scan.c) -> numpy columns, streamed; msgspec where it stops" if _scan.wanted()
            else "msgspec structs tagged by category -> numpy columns, streamed")


class TraceUnreadable(ValueError):
    """The bytes are no complete JSON document (truncated or broken gzip, malformed JSON)."""


class NotStreamable(ValueError):
    """A document the streaming reader does not take: decode it whole (same results, more memory)."""


_NO_ARGS = EventArgs()   # shared by the events without args: every struct's args has the attributes


class TraceEvent(msgspec.Struct, gc=False):
    """One trace event, only the fields the converter reads. gc=False: no cycles, and the cyclic
    collector would otherwise rescan millions of them."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: float | None = None
    dur: float | None = None
    tid: Any = None
    args: EventArgs | None = _NO_ARGS   # null stays None


_DECODE_EVENTS = msgspec.json.Decoder(list[TraceEvent])


def read_trace(data: bytes, *, chunk_bytes: int = CHUNK_BYTES) -> "TraceReader":
    """A reader of one rank file's content (gzip or plain JSON bytes)."""
    return TraceReader(data, chunk_bytes=chunk_bytes)


class _Text:
    """The decompressed text in a buffer the reader owns: `buf[pos:end]` is read and not consumed
    yet (`buf` may be longer than `end`: read no further). Gzip is inflated straight into `buf`,
    whose unread rest moves to its front when it fills: no bytes object per inflated piece, no
    copy of what was inflated. The buffer holds two runs (a small file: its size, which gzip's
    trailer tells) and grows only for more unread text than it holds (an event longer than it)."""

    def __init__(self, data: bytes):
        self.pos = 0
        if data[:2] == b"\x1f\x8b":
            size = int.from_bytes(data[-4:], "little")   # the (last) member's size, mod 2^32: a hint
            self.buf = bytearray(min(_BUFFER_BYTES, max(_INFLATE_MIN, size + 1)))
            self.end = 0
            self._gunzip = _gunzip(data)
            self.eof = False
        else:   # plain JSON is already in memory: read it in place
            self.buf = data
            self.end = len(data)
            self.eof = True

    def more(self, wanted: int) -> bool:
        """Inflate until `wanted` unread bytes are buffered or the file ends; False at the end.
        Moves the unread bytes: views of the buffer must be let go of before."""
        if self.eof:
            return False
        if self.pos and self.pos + max(wanted, _INFLATE_MIN) > len(self.buf):   # room behind the unread bytes
            rest = self.end - self.pos
            view = memoryview(self.buf)
            view[:rest] = view[self.pos:self.end]   # overlapping: memoryview moves like memmove
            view.release()
            self.pos, self.end = 0, rest
        while self.end - self.pos < wanted:
            if self.end == len(self.buf):   # full: a bigger buffer, the unread bytes moved into it
                rest = self.end - self.pos
                buf = bytearray(max(2 * len(self.buf), wanted + _INFLATE_MIN))
                buf[:rest] = memoryview(self.buf)[self.pos:self.end]
                self.buf, self.pos, self.end = buf, 0, rest
            view = memoryview(self.buf)[self.end:]
            try:
                got = self._gunzip.readinto(view)
            except _GUNZIP_ERRORS as error:   # a truncated stream, a bad checksum or block, trailing garbage
                raise TraceUnreadable(f"{type(error).__name__}: {error}") from None
            finally:
                view.release()
            if not got:
                self.eof = True
                break
            self.end += got
        return True

    def skip_whitespace(self) -> int:
        """Position of the next non-whitespace byte (inflating as needed); -1 at the end of the text."""
        while True:
            buf, pos, end = self.buf, self.pos, self.end
            while pos < end and buf[pos] in _WHITESPACE:
                pos += 1
            self.pos = pos
            if pos < end:
                return pos
            if not self.more(1):
                return -1


class TraceReader:
    """See the module docstring. `chunks()` may be iterated once; `top` holds the other top-level keys."""

    def __init__(self, data: bytes, *, chunk_bytes: int = CHUNK_BYTES):
        self._text = _Text(data)
        self._chunk_bytes = chunk_bytes
        self.top: dict[str, Any] = {}
        self.events = 0
        self._lean = False

    def chunks(self) -> Iterator[EventColumns]:
        text = self._text
        at = text.skip_whitespace()
        if at < 0 or text.buf[at] != ord("{"):
            raise NotStreamable("the top level is not an object")
        text.pos += 1
        seen_events = False
        first = True
        while True:
            at = text.skip_whitespace()
            if at < 0:
                raise TraceUnreadable("JSONDecodeError: the document ends inside its top-level object")
            if text.buf[at] == ord("}") and first:
                text.pos += 1
                break
            key = self._string()
            at = text.skip_whitespace()
            if at < 0 or text.buf[at] != ord(":"):
                raise TraceUnreadable(f"JSONDecodeError: no ':' after the top-level key {key!r}")
            text.pos += 1
            at = text.skip_whitespace()
            if at < 0:
                raise TraceUnreadable(f"JSONDecodeError: no value for the top-level key {key!r}")
            if key == "traceEvents":
                if seen_events or text.buf[at] != ord("["):
                    raise NotStreamable("traceEvents twice, or not an array")
                seen_events = True
                text.pos += 1
                yield from self._array()
            else:
                self.top[key] = self._value()
            first = False
            at = text.skip_whitespace()
            if at < 0:
                raise TraceUnreadable("JSONDecodeError: the document ends inside its top-level object")
            text.pos += 1
            if text.buf[at] == ord("}"):
                break
            if text.buf[at] != ord(","):
                raise TraceUnreadable(f"JSONDecodeError: unexpected {chr(text.buf[at])!r} between top-level keys")
        if text.skip_whitespace() >= 0:
            raise TraceUnreadable("JSONDecodeError: trailing characters after the document")
        if not seen_events:
            raise NotStreamable("no traceEvents")

    # ------------------------------------------------------------------ pieces of the top level

    def _string(self) -> str:
        """The JSON string at the read position (a top-level key)."""
        text = self._text
        if text.buf[text.pos] != ord('"'):
            raise TraceUnreadable("JSONDecodeError: expected a top-level key")
        while True:
            buf, at = text.buf, text.pos + 1
            while True:   # the closing quote: one that an even run of backslashes precedes
                at = buf.find(b'"', at, text.end)
                if at < 0:
                    break
                backslashes = 0
                while buf[at - 1 - backslashes] == 92:
                    backslashes += 1
                if backslashes % 2 == 0:
                    break
                at += 1
            if at >= 0:
                break
            if not text.more(text.end - text.pos + (1 << 16)):
                raise TraceUnreadable("JSONDecodeError: the document ends inside a top-level key")
        try:
            key = msgspec.json.decode(bytes(buf[text.pos:at + 1]))
        except msgspec.DecodeError as error:
            raise TraceUnreadable(f"JSONDecodeError: {error}") from None
        text.pos = at + 1
        return key

    def _value(self) -> Any:
        """Decode the JSON value at the read position, whatever its size, and move past it."""
        text, window = self._text, 1 << 16
        while True:
            end = _value_end(text.buf, text.pos, min(text.end, text.pos + window))
            if end is not None:
                break
            if text.end - text.pos > window:
                window *= 4
            elif not text.more(window * 4):
                raise TraceUnreadable("JSONDecodeError: the document ends inside a top-level value")
        try:
            value = msgspec.json.decode(bytes(text.buf[text.pos:end]))
        except msgspec.DecodeError as error:
            raise TraceUnreadable(f"JSONDecodeError: {error}") from None
        text.pos = end
        return value

    def _array(self) -> Iterator[EventColumns]:
        """The events of traceEvents (read position just after its `[`), a run at a time: by the
        compiled scanner (scan.py) while it takes the events, else a run the msgspec way."""
        text = self._text
        at = text.skip_whitespace()
        if at < 0:
            raise TraceUnreadable("JSONDecodeError: the document ends inside traceEvents")
        if text.buf[at] == ord("]"):
            text.pos += 1
            return
        scanner = _scan.scanner()   # None: msgspec throughout (no compiler, or STRAG_SCAN=msgspec)
        size = self._chunk_bytes
        while True:
            if scanner is not None:
                text.more(size)
                buf, pos = text.buf, text.pos
                limit = min(text.end, pos + size)
                status, end, columns = scanner.scan(buf, pos, limit)
                del buf
                if columns is not None:
                    self.events += columns.n
                    text.pos = end
                    if columns.first_complete is not None:
                        self._lean = True
                    yield columns
                    columns.release()   # its view of the buffer, before the buffer moves
                    del columns
                if status == _scan.END:
                    text.pos = end
                    return
                if status == _scan.FULL or (status == _scan.MORE and end > pos):
                    continue
                if status == _scan.MORE:   # an event longer than the window, or the end of the bytes so far
                    if limit < text.end:
                        size *= 2
                    elif not text.more(text.end - pos + size):
                        raise TraceUnreadable("JSONDecodeError: the document ends inside traceEvents")
                    continue
                # BAD or STRAY at `end`: a run from there the msgspec way (its error, or the general structs)
            columns, size, done = self._msgspec_run(size)
            self.events += columns.n
            yield columns
            del columns
            if done:
                return

    def _msgspec_run(self, size: int) -> tuple[EventColumns, int, bool]:
        """One run of events decoded by msgspec from the read position (the start of an event):
        (its columns, the run size, whether traceEvents ended after it)."""
        text = self._text
        at = text.skip_whitespace()
        if at >= 0 and text.buf[at] == ord("]"):   # `[..., ]`
            raise TraceUnreadable("JSONDecodeError: a `,` with no event after it ends traceEvents")
        while True:
            text.more(size)
            buf, pos = text.buf, text.pos
            limit = min(text.end, pos + size)
            cut = _last_cut(buf, pos, limit, text.end)
            if cut is None and limit < text.end:   # an event bigger than a run: take more at once
                size *= 2
                continue
            columns = None
            if cut is not None:
                try:
                    columns = self._decode(_framed(buf, pos, cut + 1))
                except msgspec.DecodeError:
                    columns = None   # a `}` inside a string or a nested value: cut exactly
            if columns is None:
                ends = _element_ends(buf, pos, text.end)
                if ends is None:
                    if text.more(text.end - pos + size):
                        size *= 2
                        continue
                    raise TraceUnreadable("JSONDecodeError: the document ends inside traceEvents")
                cut = ends
                try:
                    columns = self._decode(_framed(buf, pos, cut))
                except msgspec.DecodeError as error:
                    raise TraceUnreadable(f"JSONDecodeError: {error}") from None
                cut -= 1
            text.pos = cut + 1
            at = text.skip_whitespace()
            if at < 0:
                raise TraceUnreadable("JSONDecodeError: the document ends inside traceEvents")
            text.pos = at + 1
            if text.buf[at] == ord("]"):
                return columns, size, True
            if text.buf[at] != ord(","):
                raise TraceUnreadable(f"JSONDecodeError: unexpected {chr(text.buf[at])!r} between events")
            return columns, size, False

    def _decode(self, array: bytes) -> EventColumns:
        """The columns of a run (`[...]`): by the category-tagged structs, else (events that stray
        from them) by the general structs; NotStreamable when those do not take them either,
        msgspec.DecodeError when the bytes are no JSON array (a cut inside an event, bad JSON)."""
        try:
            columns = columns_of(array, self._lean)
        except msgspec.ValidationError:
            try:
                events = _DECODE_EVENTS.decode(array)
            except msgspec.ValidationError as error:
                raise NotStreamable(str(error)) from None
            columns = general_columns(events, structs=True)
        if columns.first_complete is not None:
            self._lean = True   # the origin is known: skipped categories need no times any more
        return columns


def _framed(buf, start: int, stop: int) -> bytes:
    """`[` + buf[start:stop] + `]`, copied once."""
    return b"".join((b"[", memoryview(buf)[start:stop], b"]"))


def _last_cut(buf, pos: int, limit: int, stop: int) -> int | None:
    """Position of the last `}` in buf[pos:limit] that whitespace then `,` or `]` follows (a likely
    end of an event; the decode proves it), None when there is none. buf[:stop] is the text read."""
    end = limit
    for _ in range(8):
        cut = buf.rfind(b"}", pos, end)
        if cut < 0:
            return None
        after = cut + 1
        while after < stop and buf[after] in _WHITESPACE:
            after += 1
        if after < stop and buf[after] in b",]":
            return cut
        end = cut
    return None


def _structure(buf, start: int, stop: int):
    """(positions, depth after each) of the structural bytes of buf[start:stop] outside strings:
    `{ [ } ] ,`, the depth counted from 0 at `start`, which must be outside a string. Also returns
    whether the window ends inside a string. Vectorised: quotes preceded by an odd run of
    backslashes are escaped; a byte is inside a string when an odd number of real quotes precede it."""
    raw = np.frombuffer(memoryview(buf)[start:stop], dtype=np.uint8)
    quotes = np.flatnonzero(raw == 34)
    if len(quotes):
        backslash = raw == 92
        if backslash.any():
            index = np.arange(len(raw))
            last_other = np.maximum.accumulate(np.where(backslash, -1, index))
            before = quotes - 1
            run = np.where(before >= 0, before - last_other[np.maximum(before, 0)], 0)
            quotes = quotes[run % 2 == 0]
    opening = (raw == 123) | (raw == 91)
    closing = (raw == 125) | (raw == 93)
    positions = np.flatnonzero(opening | closing | (raw == 44))
    inside = np.searchsorted(quotes, positions) % 2 == 1
    positions = positions[~inside]
    step = opening[positions].astype(np.int64) - closing[positions]
    return positions + start, np.cumsum(step), len(quotes) % 2 == 1


def _element_ends(buf, start: int, stop: int) -> int | None:
    """Inside an array at `start` (an element's start): the position just past the last complete
    element of buf[start:stop], i.e. of a `,` at depth 0 or the array's closing `]`; None if none."""
    positions, depth, _ = _structure(buf, start, stop)
    is_comma = np.frombuffer(memoryview(buf), dtype=np.uint8)[positions] == 44
    closes = np.flatnonzero(depth < 0)
    if len(closes):   # the array ends in the window: everything before its `]`
        return int(positions[closes[0]])
    commas = np.flatnonzero(is_comma & (depth == 0))
    return int(positions[commas[-1]]) if len(commas) else None


def _value_end(buf, start: int, stop: int) -> int | None:
    """End (exclusive) of the JSON value at `start` inside an object: the first `,` at depth 0 or
    the `}` closing the object; None when buf[start:stop] does not hold it whole."""
    positions, depth, _ = _structure(buf, start, stop)
    raw = np.frombuffer(memoryview(buf), dtype=np.uint8)
    is_comma = raw[positions] == 44
    ends = np.flatnonzero((is_comma & (depth == 0)) | (depth < 0))
    if not len(ends):
        return None
    end = int(positions[ends[0]])
    while end > start and raw[end - 1] in _WHITESPACE:
        end -= 1
    return end
