"""The compiled event scanner (transforms/ingest/kineto/scan.c, scan.py): a run scanned from the
JSON bytes gives exactly the columns of the same bytes decoded by msgspec's general structs and of
the same events as dicts, on real traces and on events made to stray (every JSON number form,
escapes, odd tids, args that are null or absent, correlations that are no int64); where it stops
(malformed JSON, events the columns do not take) the reader goes on the msgspec way and parses as
the reference does; without a compiler the msgspec path runs and one line says so."""
from __future__ import annotations

import gzip
import json
import math
import pathlib
import random
import re
import struct

import numpy as np
import orjson
import pytest

from transforms.ingest.common import RawInputError
from transforms.ingest.kineto import reader as kineto_reader
from transforms.ingest.kineto import scan
from transforms.ingest.kineto.columns import general_columns
from transforms.ingest.kineto.rank import parse_rank_bytes

from test_ingest_columns import _columns_equal
from test_ingest_reader import HTA, REAL_RUNS, assert_same, hta_path, reference, streamed

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _compiled():
    try:
        scan._load()
    except scan.LibraryBuildError as error:
        pytest.skip(f"no C scanner here: {error}")


def _scanned(array_body: bytes, capacity: int = 1 << 16):
    """(status, end, columns) of one scan of `[` + array_body + `]` from just after the `[`."""
    data = b"[" + array_body + b"]"
    scanner = scan.Scanner(capacity)
    return scanner.scan(bytearray(data), 1, len(data))


def _equal_to_msgspec(events: list[dict] | bytes) -> None:
    body = events if isinstance(events, bytes) else b",".join(orjson.dumps(e) for e in events)
    status, end, columns = _scanned(body)
    assert status == scan.END and end == len(body) + 2
    array = b"[" + body + b"]"
    _columns_equal(columns, general_columns(kineto_reader._DECODE_EVENTS.decode(array), structs=True))
    _columns_equal(columns, general_columns(orjson.loads(array), structs=False))


@pytest.mark.parametrize("path", HTA, ids=lambda p: p.name)
def test_real_gpu_trace_events_scan_as_msgspec_decodes_them(path):
    document = orjson.loads(gzip.decompress(path.read_bytes()))
    events = document["traceEvents"][:20000]
    _equal_to_msgspec(events)
    # as torch.profiler writes them (indented), and compact
    _equal_to_msgspec(orjson.dumps(events, option=orjson.OPT_INDENT_2)[1:-1])


def test_real_cpu_run_events_scan_as_msgspec_decodes_them():
    for path in REAL_RUNS[:6]:
        _equal_to_msgspec(orjson.loads(gzip.decompress(path.read_bytes()))["traceEvents"])


def _number_texts(rng: random.Random) -> list[str]:
    """JSON spellings of numbers: integers of every length, decimals, exponents, subnormals,
    values past the fast path's reach (more than 17 digits, powers of ten beyond 22). (One out
    of a double's range, 1e400, is a stray event: msgspec refuses it.)"""
    out = ["0", "-0", "0.0", "1", "-1", "1e0", "1E+2", "1e-2", "2.5e-3", "123456789012345678", "9007199254740993",
           "9007199254740992.5", "1.7976931348623157e308", "4.9e-324", "2.2250738585072014e-308", "1e23", "1e-23",
           "0.1", "0.30000000000000004", "1669783687389324", "1669783687389324.123", "4458676522709.059",
           "123456789012345678901234567890", "0.000000000000000000000000001", "1e-400"]
    for _ in range(300):
        bits = rng.getrandbits(64)
        value = struct.unpack("<d", struct.pack("<Q", bits))[0]
        if math.isfinite(value):
            out += [repr(value), f"{value:.17g}", f"{value:.6e}"]
        out.append(str(rng.randrange(-10 ** rng.randrange(1, 19), 10 ** rng.randrange(1, 19))))
        out.append(f"{rng.randrange(10 ** 12, 10 ** 16)}.{rng.randrange(1000):03d}")
    return out


def test_every_number_spelling_reads_as_msgspec_reads_it():
    texts = _number_texts(random.Random(7))
    body = ",".join(f'{{"ph": "X", "cat": "cpu_op", "name": "n", "ts": {t}, "dur": {t}, "tid": 1}}' for t in texts)
    status, _, columns = _scanned(body.encode())
    assert status == scan.END
    assert columns.cpu.ts.tolist() == columns.cpu.dur.tolist() == [float(t) for t in texts]
    _equal_to_msgspec(body.encode())
    # in args, where numbers are only checked and skipped (an integer the quick way, the rest the long
    # one); a positive exponent over 300 there is a stray event (test_the_scanner_stops_...)
    skipped = [t for t in texts if not (power := re.search(r"[eE]\+?(\d+)", t)) or int(power.group(1)) <= 300]
    assert len(skipped) > len(texts) * 0.8
    _equal_to_msgspec(",".join(f'{{"ph": "X", "cat": "kernel", "name": "n", "ts": 1, "dur": 1, "tid": 1, '
                               f'"args": {{"a": {t}, "b": [{t}], "correlation": 5, "c": {t}}}}}'
                               for t in skipped).encode())


def test_names_tids_and_args_of_every_shape():
    events = [
        {"ph": "X", "cat": "cpu_op", "name": 'quote " brace } bracket ] \\ back', "ts": 1, "dur": 2, "tid": 7},
        {"ph": "X", "cat": "cpu_op", "name": "unicode µs ✓ \u0001", "ts": 2, "dur": 2, "tid": "stream 7"},
        {"ph": "X", "cat": "kernel", "name": "ncclKernel_AllReduce", "ts": 3, "dur": 2, "tid": 7.0,
         "args": {"correlation": 12, "Collective name": "allreduce", "Seq": 3, "Process Group Ranks": [0, 1],
                  "nested": {"a": [1, {"b": None}], "c": "}]"}}},
        {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 3, "dur": 1, "tid": 7,   # the key nested,
         "args": {"nested": {"Collective name": "x"}, "quoted": "\"Collective name\"", "Seq": 1}},   # or quoted: not held
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 4, "dur": 2, "tid": None, "args": None},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 1, "tid": 7,
         "args": {"correlation": None}},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 6, "dur": 1, "tid": True,
         "args": {"correlation": -5}},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 7, "dur": 1},
        {"ph": "X", "cat": "gpu_memset", "name": "", "ts": None, "dur": 1},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#3", "ts": 8, "dur": 9, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "## forward ##", "ts": 9, "dur": None, "tid": 1},
        {"ph": "s", "cat": "fwdbwd", "ts": 10, "id": 1}, {"ph": "f", "cat": "fwdbwd", "ts": 11, "id": 1, "bp": "e"},
        {"ph": "s", "cat": "fwdbwd", "ts": None}, {"ph": "i", "cat": "cpu_instant_event", "ts": 12, "s": "t"},
        {"ph": "X", "cat": "Trace", "ts": 0, "dur": 100}, {"ph": "M", "name": "process_name", "args": {"name": "x"}},
        {}, {"cat": "ac2g", "ph": "f", "ts": 1, "id": 3}, {"ph": "XX", "cat": "cpu_op", "ts": 1, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "dup", "ts": 1, "ts2": [1, 2, {"x": []}], "dur": 1, "tid": 7,
         "extra": {"deep": [[[[[]]]]]}},
    ]
    _equal_to_msgspec(events * 3)
    # the same events with every key order reversed, as some writers put ts first
    _equal_to_msgspec([dict(reversed(list(e.items()))) for e in events])


@pytest.mark.parametrize("event", [
    b'{"ph": "X", "cat": "cpu_op", "ts": "12", "dur": 1}',                 # ts a string
    b'{"ph": "X", "cat": "cpu_op", "ts": 1, "dur": 1, "args": [1]}',      # args no object
    b'{"ph": "X", "cat": "cpu_op", "ts": 1e400, "dur": 1}',              # msgspec: out of range
    b'{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "args": {"Seq": 2e999}}',   # ... in args too
    b'{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "args": {"correlation": 1.5}}',
    b'{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "args": {"correlation": "7"}}',
    b'{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "args": {"correlation": 12345678901234567890}}',
    b'{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "tid": [1]}',
    b'{"p\\u0068": "X", "cat": "cpu_op", "ts": 1, "dur": 1}',             # a key spelled with an escape
    b'{"ph": "X", "cat": null, "ts": 1, "dur": 1}',
    b'{"ph": "X", "cat": "cpu_op", "name": 5, "ts": 1, "dur": 1}',
    b'7',                                                                     # not an object
])
def test_the_scanner_stops_at_events_it_does_not_take(event):
    good = b'{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": 1, "tid": 1}'
    status, end, columns = _scanned(good + b", " + event + b", " + good)
    assert status == scan.STRAY and columns.n == 1
    assert end == 1 + len(good) + 1   # at the stray event, just after the `,` before it


@pytest.mark.parametrize("body", [
    b'{"ph": "X",}', b'{"ph" "X"}', b'{"ph": X}', b'{"ph": "X"}}', b'{"ph": tru}', b'{"ts": 01}', b'{"ts": 1.}',
    b'{"ts": -}', b'{"ts": 1e}', b'{"name": "a\\x"}', b'{"name": "a\\u12g4"}', b'{"name": "tab\there"}',
    b'{"ph": "X"}, ', b'{"ph": "X"} {"ph": "X"}', b'{"a": [1, 2,]}', b'{"a": [1 2]}', b'{"a": {"b": 1,}}',
    b'{"args": {"a": 01}}', b'{"args": {"a": 00, "b": 1}}', b'{"args": {"a": 12.}}', b'{"args": {"a": 12x}}',
    b'{"args": {"a": 7 8}}', b'{"args": {"a": 1e, "b": 2}}', b'{"args": {"a": 3}, }',
])
def test_malformed_json_is_bad_and_the_reader_says_so_as_before(body):
    status, end, columns = _scanned(body)
    assert status == scan.BAD and columns is None and end == 1
    document = b'{"traceEvents": [' + body + b'], "distributedInfo": {"rank": 0, "world_size": 1}}'
    assert streamed("bad.json", document) == "raw_unreadable" == reference("bad.json", document)


def test_runs_stop_where_the_bytes_do_and_go_on_from_there():
    events = orjson.loads(gzip.decompress(hta_path().read_bytes()))["traceEvents"][:3000]
    text = orjson.dumps(events, option=orjson.OPT_INDENT_2)
    scanner = scan.Scanner(capacity=97)   # runs end at FULL too
    buffer = bytearray(text)
    pos, runs, limit = 1, [], 1
    rng = random.Random(5)
    while True:
        limit = min(len(buffer), limit + rng.randrange(1, 40000))
        status, end, columns = scanner.scan(buffer, pos, limit)
        assert status in (scan.MORE, scan.FULL, scan.END)
        if columns is not None:
            runs.append(columns)
        pos = end
        if status == scan.END:
            break
    assert end == len(buffer)
    names = [name for run in runs for name in run.names(run.cpu)]
    expected = general_columns(events, structs=False)
    assert names == expected.names(expected.cpu)
    assert np.concatenate([run.cpu.ts for run in runs]).tolist() == expected.cpu.ts.tolist()
    assert sum(run.n for run in runs) == len(events)


@pytest.mark.parametrize("mode", ["c", "msgspec"])
def test_a_name_that_is_no_utf8_is_unreadable_with_the_bytes_named(mode, monkeypatch):
    monkeypatch.setenv("STRAG_SCAN", mode)
    document = (b'{"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": [{"ph": "X", "cat": "cpu_op", '
                b'"name": "aten::mm\xff", "ts": 1, "dur": 1, "tid": 1}]}')
    with pytest.raises(RawInputError) as raised:
        parse_rank_bytes("latin.json", document)
    assert raised.value.reason_code == "raw_unreadable" == reference("latin.json", document)
    assert "latin.json" in str(raised.value) and "not UTF-8" in str(raised.value) and "\\xff" in str(raised.value)


@pytest.mark.parametrize("mode", ["c", "msgspec"])
@pytest.mark.parametrize("fields, says", [(b'"name": 17, "ts": 5, "dur": 1', "'cpu_op' event at ts 5 has the name 17"),
                                          (b'"name": "a", "ts": 5, "dur": {"x": 1}', "'cpu_op' event has the dur {'x': 1}")])
def test_an_event_with_a_field_of_another_type_is_no_trace_with_the_event_named(mode, fields, says, monkeypatch):
    monkeypatch.setenv("STRAG_SCAN", mode)
    document = (b'{"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": [{"ph": "X", "cat": "cpu_op", '
                + fields + b', "tid": 1}]}')
    with pytest.raises(RawInputError) as raised:
        parse_rank_bytes("odd.json", document)
    assert raised.value.reason_code == "raw_not_a_trace"
    assert "odd.json" in str(raised.value) and says in str(raised.value)


@pytest.mark.parametrize("mode", ["c", "msgspec"])
def test_a_category_that_is_no_utf8_is_unreadable(mode, monkeypatch):
    monkeypatch.setenv("STRAG_SCAN", mode)
    document = (b'{"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": [{"ph": "X", "cat": "cpu\xffop", '
                b'"name": "x", "ts": 5, "dur": 1, "tid": 1}]}')
    assert streamed("cat.json", document) == "raw_unreadable" == reference("cat.json", document)


def test_a_trace_with_stray_events_parses_as_the_reference_does():
    document = orjson.loads(gzip.decompress(hta_path("nccl_data.json.gz").read_bytes()))
    events = document["traceEvents"]
    for i in range(0, len(events), 997):   # string correlations and float tids here and there
        event = events[i]
        if isinstance(event.get("args"), dict) and "correlation" in event["args"]:
            event["args"]["correlation"] = str(event["args"]["correlation"])
        elif "tid" in event:
            event["tid"] = [event["tid"]]
    data = json.dumps(document, indent=1).encode()
    expected = reference("stray.json", data)
    for chunk_bytes in (1 << 22, 50000):
        assert_same(streamed("stray.json", data, chunk_bytes=chunk_bytes), expected)


def test_without_a_compiler_the_msgspec_path_reads_and_one_line_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(scan.HELPER, "library", None)
    monkeypatch.setattr(scan.HELPER, "build_error", None)
    monkeypatch.setattr(scan.HELPER, "reported", False)
    monkeypatch.setenv("STRAG_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("STRAG_SCAN", "auto")
    path = hta_path()
    data = path.read_bytes()
    assert scan.scanner() is None and scan.scanner() is None
    lines = [line for line in capsys.readouterr().err.splitlines() if "C trace scanner" in line]
    assert len(lines) == 1 and "no-such-compiler" in lines[0] and "msgspec" in lines[0]
    assert_same(streamed(str(path), data), reference(str(path), data))
    monkeypatch.setenv("STRAG_SCAN", "c")
    with pytest.raises(scan.LibraryBuildError, match="no-such-compiler"):
        scan.scanner()
    monkeypatch.setenv("STRAG_SCAN", "fast")
    with pytest.raises(ValueError, match="STRAG_SCAN"):
        scan.scanner()


def test_mutated_bytes_read_the_same_by_both_paths_and_never_crash(monkeypatch):
    """Random damage to a real trace (bytes replaced, dropped, doubled; cuts): the scanner must not
    crash and must reach what the msgspec path reaches, a RankTrace or the same reason code."""
    document = orjson.loads(gzip.decompress(hta_path().read_bytes()))
    steps = [e for e in document["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")][:2]
    events = [e for e in document["traceEvents"] if steps[0]["ts"] <= e.get("ts", 0) <= steps[-1]["ts"] + steps[-1]["dur"]]
    kept = events[:1500] + [e for e in events[1500:] if str(e.get("name", "")).startswith("ProfilerStep#")]
    text = orjson.dumps(dict(document, traceEvents=kept), option=orjson.OPT_INDENT_2)
    assert not isinstance(streamed("whole.json", text), str)
    rng = random.Random(2)
    read = 0
    alphabet = b'{}[]",:\\ \n0123456789.eE-+tfnulrsaX\x00\x1f\xff'
    for trial in range(150):
        data = bytearray(text)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data))
            action = rng.randrange(4)
            if action == 0:
                data[at] = rng.choice(alphabet)
            elif action == 1:
                del data[at:at + rng.randrange(1, 30)]
            elif action == 2:
                data[at:at] = data[at:at + rng.randrange(1, 30)]
            else:
                del data[at:]
                break
        outcomes = []
        for mode in ("c", "msgspec"):
            monkeypatch.setenv("STRAG_SCAN", mode)
            outcomes.append(streamed("mutated.json", bytes(data), chunk_bytes=rng.choice([1 << 12, 1 << 20])))
        if isinstance(outcomes[1], str):
            assert outcomes[0] == outcomes[1], (trial, outcomes)
        else:
            assert_same(outcomes[0], outcomes[1])
            read += 1
    assert 5 <= read < 150   # some damage leaves a readable trace, most does not
