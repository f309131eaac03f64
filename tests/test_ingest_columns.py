"""The columnar extractor (transforms/ingest/kineto/columns.py): a run decoded by the category-tagged
structs gives exactly the columns of the same bytes decoded by the reader's general structs and of
the same events as dicts; runs that stray from the tagged structs fall back to the general ones in
the reader and still parse as the reference pass does; the reader's gunzip (64 KB of input a call)
gives the file's bytes across gzip members and still tells a truncated file."""
from __future__ import annotations

import gzip
import itertools

import msgspec
import numpy as np
import orjson
import pytest

from transforms.ingest.kineto import reader as kineto_reader
from transforms.ingest.kineto.columns import columns_of, general_columns

from test_ingest_reader import HTA, _document_bytes, _gpu_document, assert_same, reference, streamed


def _columns_equal(got, expected) -> None:
    assert got.n == expected.n
    assert got.first_complete == expected.first_complete or (
        got.first_complete is not None and np.isnan(got.first_complete) and np.isnan(expected.first_complete))
    assert got.flow_starts.tolist() == expected.flow_starts.tolist()
    assert got.flow_ends.tolist() == expected.flow_ends.tolist()
    for key in ("launch", "gpu", "gpu_label", "cpu"):
        a, b = getattr(got, key), getattr(expected, key)
        assert a.index.tolist() == b.index.tolist(), key
        assert a.ts.tolist() == b.ts.tolist() and a.dur.tolist() == b.dur.tolist(), key
        assert a.code.tolist() == b.code.tolist(), key
        assert got.tids(a) == expected.tids(b), key
        values, given = got.correlations(a)
        values_expected, given_expected = expected.correlations(b)
        assert given.tolist() == given_expected.tolist(), key
        assert values[given].tolist() == values_expected[given_expected].tolist(), key
        if key != "launch":
            assert got.names(a) == expected.names(b), key
            assert [_read(got.args_of(a, i)) for i in range(len(a))] == \
                [_read(expected.args_of(b, i)) for i in range(len(b))], key
            assert [got.category_of(a, i) for i in range(len(a))] == [expected.category_of(b, i) for i in range(len(b))]
            everyone = list(range(len(a)))
            for held in ("Collective name", "Seq", "correlation"):
                assert got.args_holding(a, everyone, held) == expected.args_holding(b, everyone, held), (key, held)


_READ_KEYS = ("correlation", "Collective name", "Process Group Name", "Dst Rank", "Src Rank", "Concrete Inputs", "Seq",
              "Process Group Description", "Process Group Ranks")


def _read(args: dict) -> dict:
    """The args keys the converter reads (a dict of a whole document holds them all)."""
    return {key: args[key] for key in _READ_KEYS if key in args and not (key == "correlation" and args[key] is None)}


def _all_ways(array: bytes, lean: bool = False) -> None:
    """The tagged decode of `array` against the general structs and dicts of the same bytes."""
    fast = columns_of(array, lean)
    structs = general_columns(kineto_reader._DECODE_EVENTS.decode(array), structs=True)
    dicts = general_columns(orjson.loads(array), structs=False)
    if lean:   # a lean decode reads no times of skipped categories: the origin is not its to say
        structs.first_complete = dicts.first_complete = None
    _columns_equal(fast, structs)
    _columns_equal(fast, dicts)


def _events_array(events: list) -> bytes:
    return orjson.dumps(events, option=orjson.OPT_INDENT_2)


def _tagged_events(events: list) -> list:
    """The events the tagged union takes whole (metadata without a cat, null fields dropped)."""
    return [e for e in events if isinstance(e.get("cat"), str) and e.get("ts") is not None]


@pytest.mark.parametrize("path", [p for p in HTA if p.name in ("nccl_data.json.gz", "ddp2_rank1.json.gz")],
                         ids=lambda p: p.name)
def test_real_gpu_runs_give_the_columns_of_the_general_decode(path):
    events = _tagged_events(orjson.loads(gzip.decompress(path.read_bytes()))["traceEvents"])
    for at in range(0, len(events), 20000):
        _all_ways(_events_array(events[at:at + 20000]), lean=at > 0)


def test_escaped_strings_unicode_names_and_every_field_shape():
    names = ['a "[{" b', "x}, {\"ph\": \"X\"", "back\\\\slash", "ünïcödé ✓ 𝔘", "nccl:all_reduce", "ncclKernel_é",
             "ProfilerStep#7", "record_param_comms", "c10d::send", "gloo:recv", "PP:0F1", "Tab\there\nnewline"]
    events = [{"ph": "X", "cat": "Trace", "name": "trace", "ts": 5e9, "dur": 1.5}]
    for i, name in enumerate(names * 3):
        ts = 5e9 + 10 * i
        events += [
            {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": 3, "tid": i % 3,
             "args": {"Concrete Inputs": ["", "", str(i % 2)], "External id": i, "Collective name": name}},
            {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts + 0.5, "dur": 2.25, "tid": "thread ü"},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts + 1, "dur": 1, "tid": 7,
             "args": {"correlation": 1000 + i, "cbid": 211}},
            {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": ts + 1, "dur": 1, "tid": 7, "args": {}},
            {"ph": "X", "cat": "kernel", "name": name, "ts": ts + 2, "dur": 4, "tid": 9,
             "args": {"correlation": 1000 + i, "Process Group Name": "0", "Seq": i, "grid": [1, 2, 3]}},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": ts + 3, "dur": 1, "tid": 9},
            {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts + 2, "dur": 5, "tid": 9},
            {"ph": "s" if i % 2 else "f", "cat": "fwdbwd", "name": "fwdbwd", "id": i, "ts": ts + 4, "tid": 1},
            {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": i, "ts": ts + 4, "bp": "e"},
            {"ph": "i", "cat": "cpu_instant_event", "name": name, "ts": ts, "s": "t"},
            {"ph": "B", "cat": "cpu_op", "name": name, "ts": ts, "tid": 1},           # not complete
            {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "tid": 1},           # no dur
        ]
    array = _events_array(events)
    assert "ü".encode() in array and b'\\"' in array and b"\\n" in array
    _all_ways(array)
    _all_ways(array, lean=True)
    _all_ways(orjson.dumps(events))   # compact


@pytest.mark.parametrize("stray", [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},      # no cat
    {"ph": "X", "cat": "a category of its own", "name": "x", "ts": 1, "dur": 1},
    {"ph": "X", "cat": "cpu_op", "name": "x", "ts": None, "dur": 1},
    {"ph": "X", "cat": "kernel", "name": "x", "ts": 1, "dur": 1, "args": {"correlation": "12"}},
    {"ph": "X", "cat": "kernel", "name": "x", "ts": 1, "dur": 1, "args": {"correlation": -(2 ** 63)}},
    {"ph": "X", "cat": "cuda_runtime", "name": "x", "ts": 1, "dur": 1, "args": None},
])
def test_events_the_tagged_structs_refuse_fall_back_to_the_general_ones(stray):
    with pytest.raises(msgspec.ValidationError):
        columns_of(_events_array([stray]), lean=False)
    # in the reader: that run decoded by the general structs, the others by the tagged ones
    document = _gpu_document()
    events = document["traceEvents"]
    document = dict(document, traceEvents=events[:len(events) // 2] + [stray] + events[len(events) // 2:])
    data = _document_bytes(document)
    expected = reference("stray.json", data)
    assert not isinstance(expected, str)
    for chunk_bytes in (1 << 22, 3000):
        assert_same(streamed("stray.json", data, chunk_bytes=chunk_bytes), expected)
        assert_same(streamed("stray.json", gzip.compress(data, 6), chunk_bytes=chunk_bytes), expected)


def test_the_origin_of_a_trace_whose_first_complete_event_is_of_a_skipped_category():
    document = _gpu_document()
    events = document["traceEvents"]
    first = min(e["ts"] for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e)
    early = [{"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "ts": first - 2 ** 33, "bp": "e"},
             {"ph": "X", "cat": "python_function", "name": "f", "ts": first - 2 ** 33, "dur": 1, "tid": 1}]
    data = _document_bytes(dict(document, traceEvents=early + events))
    expected = reference("early.json", data)
    got = streamed("early.json", data, chunk_bytes=2000)
    assert_same(got, expected)
    assert got.origin_ns != streamed("plain.json", _document_bytes(document)).origin_ns


def _consume(text, steps) -> bytes:
    """Everything `text` reads, taken `next(steps)` bytes at a time (each step asks for that many)."""
    out = bytearray()
    while text.more(next(steps)):
        out += text.buf[text.pos:text.end]
        text.pos = text.end
    return bytes(out)


def test_gunzip_in_place_across_members_and_truncation(monkeypatch):
    monkeypatch.setattr(kineto_reader, "_BUFFER_BYTES", 1 << 20)   # less than the text: the unread rest moves
    plain = np.random.default_rng(0).integers(32, 127, 3 << 20, dtype=np.uint8).tobytes()
    two = gzip.compress(plain[:1 << 20], 6) + gzip.compress(plain[1 << 20:], 1)
    sizes = np.random.default_rng(1).integers(1, 1 << 18, 1000).tolist()
    assert _consume(kineto_reader._Text(two), iter(sizes)) == plain
    # a `wanted` beyond the buffer (an event longer than it) grows the buffer; the unread bytes move along
    text = kineto_reader._Text(two)
    assert text.more(100) and text.end - text.pos >= 100
    text.pos += 37
    capacity = len(text.buf)
    assert text.more(capacity + 5) and len(text.buf) > capacity and text.end - text.pos >= capacity + 5
    assert bytes(text.buf[text.pos:text.end]) == plain[37:text.end - text.pos + 37]
    assert text.pos == 0 and not text.eof
    truncated = kineto_reader._Text(two[:len(two) // 2])
    with pytest.raises(kineto_reader.TraceUnreadable, match="EOFError: .*ended before"):
        _consume(truncated, itertools.repeat(1 << 16))
    broken = bytearray(two)   # a corrupt block or checksum (isal raises its own error, not zlib's)
    broken[len(two) // 3:len(two) // 3 + 64] = bytes(64)
    with pytest.raises(kineto_reader.TraceUnreadable):
        _consume(kineto_reader._Text(bytes(broken)), itertools.repeat(1 << 16))
    with pytest.raises(kineto_reader.TraceUnreadable, match="BadGzipFile"):   # garbage after the last member
        _consume(kineto_reader._Text(two + b"not gzip at all"), itertools.repeat(1 << 16))
    assert _consume(kineto_reader._Text(two + bytes(9)), itertools.repeat(1 << 16)) == plain   # zero padding


def test_a_real_trace_streamed_in_gzip_runs_cut_anywhere():
    path = next((p for p in HTA if p.name == "nccl_data.json.gz"), None)
    if path is None:
        pytest.skip("public HTA trace not found")
    data = path.read_bytes()
    expected = reference(str(path), data)
    for chunk_bytes in (777, 1 << 16):
        assert_same(streamed(str(path), data, chunk_bytes=chunk_bytes), expected)


def test_gunzip_without_isal_reads_the_same(monkeypatch):
    monkeypatch.setattr(kineto_reader, "_IsalGzipReader", None)   # the standard library's gzip reader
    monkeypatch.setattr(kineto_reader, "_BUFFER_BYTES", 1 << 16)
    plain = np.random.default_rng(2).integers(32, 127, 1 << 20, dtype=np.uint8).tobytes()
    two = gzip.compress(plain[:1 << 19]) + gzip.compress(plain[1 << 19:])
    assert _consume(kineto_reader._Text(two), itertools.repeat(5000)) == plain
    with pytest.raises(kineto_reader.TraceUnreadable, match="EOFError"):
        _consume(kineto_reader._Text(two[:len(two) // 2]), itertools.repeat(5000))


def test_a_small_gzip_file_gets_a_small_buffer():
    text = kineto_reader._Text(gzip.compress(b'{"traceEvents": []}' * 5000))   # 95 KB of JSON
    assert len(text.buf) == 95_001   # its size (gzip's trailer) and one byte: the end is found without growing
    assert _consume(text, itertools.repeat(kineto_reader.CHUNK_BYTES)) == b'{"traceEvents": []}' * 5000
    assert len(text.buf) == 95_001
