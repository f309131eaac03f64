"""The streaming Kineto reader (transforms/ingest/kineto/reader.py) and the columnar event pass
(rank.py `_EventPass`) give exactly the RankTrace of a plain event-by-event pass over the whole
document decoded into dicts (`_ReferencePass` below: the loop the converter ran before issue 22),
on real GPU traces, the committed real CPU runs, generated traces, and shapes the streaming reader
must survive (any event order, keys after traceEvents, escaped quotes and brackets in names, runs
cut anywhere, gzip members, broken bytes)."""
from __future__ import annotations

import bisect
import collections
import dataclasses
import gzip
import json
import pathlib
import re

import numpy as np
import orjson
import pytest

from transforms.ingest.common import RawInputError
from transforms.ingest.kineto import rank as kineto_rank
from transforms.ingest.kineto import events as kineto_events
from transforms.ingest.kineto import reader as kineto_reader
from transforms.ingest.kineto.compute import _BACKWARD_OP, _RUN_BREAK, _RUN_NEUTRAL, _UNMAPPED_QUIET, _inside, _step_labels
from transforms.ingest.kineto.rank import parse_rank, parse_rank_bytes
from transforms.ingest.kineto.spans import (BWD, DEFAULT_BACKWARD_LABELS, DEFAULT_FORWARD_LABELS,
                                            DEFAULT_OPTIMIZER_LABEL, FWD, WEIGHT_LABEL, WGT, _COLLECTIVES, _NCCL, _STEP)
from transforms.synth.job import generate_job
from transforms.synth.kineto_writer import write_kineto_job

ROOT = pathlib.Path(__file__).resolve().parents[1]
HTA_DIR = ROOT.parent / "shared" / "traces" / "hta"   # public HTA traces, in ../shared (not in a clone)
HTA = sorted(HTA_DIR.glob("*.json.gz"))


def hta_path(name: str | None = None) -> pathlib.Path:
    """A public HTA trace (the first when no name), or skip saying where it was looked for: a clone
    without ../shared runs the rest of the suite."""
    path = HTA_DIR / name if name else (HTA[0] if HTA else HTA_DIR / "*.json.gz")
    if not path.is_file():
        pytest.skip(f"public HTA trace {path} not found: clone the project with ../shared beside it")
    return path
REAL_RUNS = sorted((ROOT / "tests" / "data" / "real_runs").glob("*/rank-*.json.gz"))


class _ReferencePass:
    """The event pass as one loop over the decoded dicts, event by event (what rank.py did before
    the columnar pass), exposing what `_rank_of` reads."""

    def __init__(self, events: list, options=None):
        options = options or {}
        forward_labels = kineto_rank._compile_labels(options, "forward_label", DEFAULT_FORWARD_LABELS)
        backward_labels = kineto_rank._compile_labels(options, "backward_label", DEFAULT_BACKWARD_LABELS)
        optimizer_label = re.compile(options.get("optimizer_label") or DEFAULT_OPTIMIZER_LABEL)
        self.deferred = None
        self.unmapped = collections.Counter()
        self.steps, self.step_tid, self.cpu_labels = {}, None, []
        self.gpu_labels = collections.defaultdict(list)
        self.nccl, self.comm_meta, self.gloo_cpu, self.c10d_p2p, self.c10d_calls = [], [], [], [], []
        self.optimizer, self.optimizer_tids, self.p2p_labels, self.overlapped = [], [], [], []
        self._launches, self._work, self._cpu, self._annotations = [], [], [], set()
        self._launch_tid = {}
        self.kernels, self.origin = 0, None
        self._flow_starts, self._flow_ends = [], []
        self.embeddings = []
        for event in events:
            if event.get("ph") != "X":
                if event.get("cat") == "fwdbwd" and event.get("ts") is not None:
                    if event.get("ph") == "s":
                        self._flow_starts.append(float(event["ts"]))
                    elif event.get("ph") == "f":
                        self._flow_ends.append(float(event["ts"]))
                continue
            name, cat, ts, dur = event.get("name", ""), event.get("cat", ""), event.get("ts"), event.get("dur")
            if ts is None or dur is None:
                continue
            if self.origin is None:
                self.origin = float(np.floor(float(ts) / 2.0 ** 32) * 2.0 ** 32)
            ts = float(ts) - self.origin
            end = ts + float(dur)
            if cat in ("cuda_runtime", "cuda_driver"):
                correlation = (event.get("args") or {}).get("correlation")
                if correlation is not None:
                    self._launches.append((ts, int(correlation)))
                    self._launch_tid[int(correlation)] = (ts, event.get("tid"))
                continue
            if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
                self.kernels += cat == "kernel"
                args = event.get("args") or {}
                if name.startswith(_NCCL):
                    self.nccl.append((name, args, ts, end))
                elif args.get("correlation") is not None:
                    self._work.append((int(args["correlation"]), ts, end))
                continue
            if cat == "gpu_user_annotation":
                if not name.startswith("ProfilerStep#"):
                    self.gpu_labels[name].append((ts, end))
                continue
            if cat not in ("user_annotation", "cpu_op"):
                continue
            self._cpu.append((ts, end, name, event.get("tid")))
            if cat == "user_annotation":
                self._annotations.add((ts, name))
            step = _STEP.match(name)
            if step:
                self.steps[int(step.group(1))] = (ts, end)
                self.step_tid = event.get("tid")
                continue
            if name.startswith("gloo:"):
                self.gloo_cpu.append((name[5:], ts, end, event.get("tid")))
                continue
            if name.startswith("c10d::send") or name.startswith("c10d::recv"):
                inputs = (event.get("args") or {}).get("Concrete Inputs") or []
                peer = inputs[2] if len(inputs) > 2 and str(inputs[2]).lstrip("-").isdigit() else -1
                self.c10d_p2p.append(("send" if name.startswith("c10d::send") else "recv", ts, end, int(peer)))
                continue
            if name.startswith("c10d::") and _COLLECTIVES.get(name[6:].rstrip("_").lower()) is not None:
                self.c10d_calls.append((_COLLECTIVES[name[6:].rstrip("_").lower()], ts))
                continue
            if name == "record_param_comms":
                args = event.get("args") or {}
                if "Collective name" in args:
                    self.comm_meta.append(dict(args, ts=ts, tid=event.get("tid")))
                continue
            if name == "aten::embedding":
                shapes = (event.get("args") or {}).get("Input Dims") or []
                if len(shapes) >= 2 and shapes[0] and shapes[1] and all(isinstance(v, int) for v in [*shapes[0], *shapes[1]]):
                    self.embeddings.append((ts, event.get("tid"), int(shapes[0][0]), tuple(shapes[1])))
                continue
            if cat == "user_annotation":
                if optimizer_label.match(name):
                    self.optimizer.append((ts, end))
                    self.optimizer_tids.append(event.get("tid"))
                    continue
                found, kind = kineto_rank._match(forward_labels, name), FWD
                if found is None:
                    found, kind = kineto_rank._match(backward_labels, name), BWD
                if found is not None:
                    groups = found.groupdict()
                    mb = groups.get("mb")
                    chunk = groups.get("stage") if "stage" in groups else groups.get("chunk")
                    self.cpu_labels.append((kind, ts, end, int(mb) if mb is not None else -1,
                                            int(chunk) if chunk is not None else -1, name))
                elif (weight := WEIGHT_LABEL.match(name)) is not None:
                    self.cpu_labels.append((WGT, ts, end, int(weight.group("mb")), int(weight.group("stage")), name))
                elif (overlap := kineto_rank._OVERLAP_LABEL.match(name)) is not None:
                    self.overlapped.append((ts, end, overlap.group("actions"), name))
                elif (p2p := kineto_rank._P2P_LABEL.match(name)) is not None:
                    self.p2p_labels.append((ts, end, 1 if p2p.group("dir") == "F" else -1, int(p2p.group("stage"))))
                elif not _UNMAPPED_QUIET.match(name):
                    self.unmapped[f"label {kineto_rank._label_family(name)}"] += 1

    def launch_columns(self):
        return (np.array([t for t, _ in self._launches], dtype=np.float64),
                np.array([c for _, c in self._launches], dtype=np.int64))

    def launch_threads(self, wanted):
        return dict(self._launch_tid)

    @property
    def nccl_ranges(self):
        return [op for op in self._cpu if op[2].startswith("nccl:")]

    def work_columns(self):
        return tuple(np.array([w[k] for w in self._work], dtype=np.int64 if k == 0 else np.float64) for k in range(3))

    def cpu_ops(self):
        return kineto_events.CpuOps.from_tuples(self._cpu)

    def annotations(self):
        return set(self._annotations)

    def threads(self, cpu_ops, step_tid):
        return (kineto_events.CpuOps.from_tuples([op for op in cpu_ops if op[3] == step_tid]),
                kineto_events.CpuOps.from_tuples([op for op in cpu_ops if op[3] != step_tid and op[2].startswith(_BACKWARD_OP)]))

    def flows(self):
        origin = self.origin or 0.0
        return np.sort(np.array(self._flow_starts) - origin), np.sort(np.array(self._flow_ends) - origin)


def _unlabeled_loop_one(ops: list, steps: list[tuple[float, float]], optimizer: list, *, forward: bool,
                       autograd: np.ndarray | None = None) -> list:
    """compute.py's `_unlabeled_compute` as it was written first: one loop over the ops, a stack of
    open ancestors per step, finds the runs (the reference the vectorised run finding must equal);
    the labels of the runs are compute's `_step_labels`, which the vectorisation left as it was."""
    ops = sorted(ops, key=lambda op: (op[0], -op[1]))
    flows = autograd if autograd is not None and len(autograd) else None
    # where the thread waited on a p2p op: gloo's send / recv spans end when the schedule's wait on
    # them returns; a run does not go on over such a wait (the compute before it is done, what
    # follows is the next action's bookkeeping)
    waits = sorted(end for _, end, name, _ in ops if name.startswith(("gloo:send", "gloo:recv")))
    out = []
    for step_start, step_end in steps:
        runs: list[list] = []            # [kind, start, end, first recorded start]
        stack: list[float] = []          # ends of open ancestors below the step span
        current = None
        for start, end, name, _ in ops:
            if start < step_start or start > step_end or _STEP.match(name):
                continue                 # the steps bound the runs (one starting mid-iteration is no op)
            if name.startswith("gloo:"):
                # gloo's p2p spans are asynchronous: they stay open until the schedule waits on
                # them, over the compute issued meanwhile; only their start breaks a run
                if name.startswith(("gloo:send", "gloo:recv")):
                    current = None
                continue
            while stack and stack[-1] <= start:
                stack.pop()
            depth = len(stack)
            if name.startswith("Optimizer.step"):
                # an optimizer step's range holds no op (a closure's forward and backward run in it)
                current = None if not depth else current
                continue
            stack.append(end)
            if depth:
                continue                 # inside a top-level op of the step
            if name.startswith(_RUN_BREAK) or _STEP.match(name) or any(s <= start < e for s, e in optimizer):
                current = None
                continue
            if name.startswith(_RUN_NEUTRAL):
                continue
            kind = BWD if name.startswith(_BACKWARD_OP) else FWD
            recorded = flows is None or kind == BWD or \
                np.searchsorted(flows, start, side="left") < np.searchsorted(flows, end, side="right")
            if current is not None and current[0] == kind and \
                    (not waits or bisect.bisect_right(waits, current[2]) == bisect.bisect_right(waits, start)):
                current[2] = max(current[2], end)
            else:
                current = [kind, start, end, np.inf]
                runs.append(current)
            if recorded:
                current[3] = min(current[3], start)
        out += _step_labels(runs, forward, floor=flows is None)   # runs -> labels: the part the vectorised version kept
    return out


def _unlabeled_loop(ops: list, steps: list, optimizer: list, *, forward: bool, autograd=None) -> list:
    """`_unlabeled_loop_one` a step at a time, given the ops that start in the step and the optimizer
    spans that overlap it (what the converter called before the vectorised version)."""
    ordered = sorted(ops, key=lambda op: (op[0], -op[1]))
    starts = np.array([op[0] for op in ordered], dtype=np.float64)
    out = []
    for step_start, step_end in steps:
        lo, hi = np.searchsorted(starts, step_start, side="left"), np.searchsorted(starts, step_end, side="right")
        near = [span for span in optimizer if span[0] <= step_end and span[1] > step_start]
        out += _unlabeled_loop_one(ordered[lo:hi], [(step_start, step_end)], near, forward=forward, autograd=autograd)
    return out


def reference(path: str, data: bytes, options=None):
    """RankTrace (or the RawInputError) of the reference pass over the whole document."""
    try:
        document = orjson.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    except (ValueError, EOFError, OSError):
        return "raw_unreadable"
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        return "raw_not_a_trace"
    vectorised = kineto_rank._unlabeled_compute
    kineto_rank._unlabeled_compute = _unlabeled_loop   # the loop the vectorised version replaced
    try:
        kineto_rank._check_info(path, document)
        return kineto_rank._rank_of(path, document, _ReferencePass(document["traceEvents"], options), options or {})
    except RawInputError as error:
        return error.reason_code
    finally:
        kineto_rank._unlabeled_compute = vectorised


def streamed(path: str, data: bytes, options=None, **reader_options):
    original = kineto_reader.read_trace
    if reader_options:
        kineto_rank.read_trace = lambda content: original(content, **reader_options)
    try:
        return parse_rank_bytes(path, data, options)
    except RawInputError as error:
        return error.reason_code
    finally:
        kineto_rank.read_trace = original


def assert_same(got, expected) -> None:
    if isinstance(expected, str) or isinstance(got, str):
        assert got == expected
        return
    for field in dataclasses.fields(expected):
        a, b = getattr(got, field.name), getattr(expected, field.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, field.name
            assert a.tolist() == b.tolist(), field.name   # exact, floats included
        else:
            assert a == b, field.name
    assert list(got.unmapped.items()) == list(expected.unmapped.items())


@pytest.fixture(params=["c", "msgspec"])
def scan_mode(request, monkeypatch):
    """Read by the compiled scanner (scan.c), or by msgspec throughout (the path without a compiler)."""
    if request.param == "c":
        from transforms.ingest.kineto import scan

        try:
            scan._load()
        except scan.LibraryBuildError as error:
            pytest.skip(f"no C scanner here: {error}")
    monkeypatch.setenv("STRAG_SCAN", request.param)
    return request.param


def _document_bytes(document: dict, *, indent: bool = True) -> bytes:
    return orjson.dumps(document, option=orjson.OPT_INDENT_2 if indent else 0)


@pytest.mark.parametrize("path", HTA, ids=lambda p: p.name)
def test_real_gpu_traces_parse_as_the_reference_does(path, scan_mode):
    data = path.read_bytes()
    expected = reference(str(path), data)
    assert_same(streamed(str(path), data), expected)
    # small runs: cuts fall everywhere, across gzip pieces too
    plain = gzip.decompress(data)
    small = len(plain) < (8 << 20)
    assert_same(streamed(str(path), data, chunk_bytes=1 << 14 if small else 1 << 18), expected)
    assert_same(streamed(str(path), plain, chunk_bytes=3000 if small else 1 << 17), expected)
    # the dict path (an already decoded document) goes through the same pass
    assert_same(parse_rank(str(path), orjson.loads(plain)), expected)


def test_the_real_cpu_runs_are_all_there():
    assert len(REAL_RUNS) >= 40


@pytest.mark.parametrize("path", REAL_RUNS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_real_cpu_runs_parse_as_the_reference_does(path):
    data = path.read_bytes()
    expected = reference(str(path), data)
    assert not isinstance(expected, str), path
    assert_same(streamed(str(path), data), expected)
    if path.name == "rank-0.json.gz":
        assert_same(streamed(str(path), data, chunk_bytes=1 << 15), expected)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from test_ingest_kineto import spec_of

    folder = tmp_path_factory.mktemp("generated")
    paths = []
    for name in ("dp1xpp2", "dp2xpp4-slow"):
        paths += write_kineto_job(generate_job(spec_of(name)), folder / name)
    return paths


def test_generated_traces_parse_as_the_reference_does(generated, scan_mode):
    for path in generated:
        data = pathlib.Path(path).read_bytes()
        expected = reference(str(path), data)
        assert not isinstance(expected, str)
        assert_same(streamed(str(path), data), expected)
        assert_same(streamed(str(path), data, chunk_bytes=1 << 13), expected)


def _gpu_document() -> dict:
    return orjson.loads(gzip.decompress(hta_path("nccl_data.json.gz").read_bytes()))


def test_any_event_order_and_keys_after_the_events(scan_mode):
    document = _gpu_document()
    events = document["traceEvents"]
    shuffled = [events[i] for i in np.random.default_rng(3).permutation(len(events))]
    # traceEvents first, every other key after it
    late = {"traceEvents": shuffled, **{k: v for k, v in document.items() if k != "traceEvents"}}
    data = _document_bytes(late)
    assert data.index(b'"traceEvents"') < data.index(b'"distributedInfo"')
    expected = reference("late.json", data)
    assert not isinstance(expected, str)
    for chunk_bytes in (1 << 22, 5000):
        assert_same(streamed("late.json", data, chunk_bytes=chunk_bytes), expected)
        assert_same(streamed("late.json", gzip.compress(data, 1), chunk_bytes=chunk_bytes), expected)


def test_escaped_quotes_and_brackets_in_names(scan_mode):
    document = _gpu_document()
    events = document["traceEvents"]
    tricky = ['a "[{" b', 'x}, {"ph": "X"', "]}]}", 'back\\\\"slash', 'tail}\n  },\n  {', "ProfilerStep#x}"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    extra = []
    for i, name in enumerate(tricky * 40):
        base = steps[i % len(steps)]
        # user annotations (unmapped labels) and CPU ops inside steps, args with brackets too
        extra.append({"ph": "X", "cat": "user_annotation" if i % 2 else "cpu_op", "name": name,
                      "ts": base["ts"] + 1 + i, "dur": 2, "tid": base["tid"],
                      "args": {"note": name, "nested": [{"k": [name, "}]"]}]}})
    document = dict(document, traceEvents=[x for pair in zip(events, extra) for x in pair] + events[len(extra):])
    data = _document_bytes(document)
    assert b'\\"[{\\"' in data
    expected = reference("tricky.json", data)
    assert not isinstance(expected, str)
    assert sum(expected.unmapped.values()) > 0
    for chunk_bytes in (1 << 22, 2000, 300):
        assert_same(streamed("tricky.json", data, chunk_bytes=chunk_bytes), expected)
    compact = _document_bytes(document, indent=False)
    assert_same(streamed("tricky.json", compact, chunk_bytes=700), expected)


def test_gzip_members_concatenated(scan_mode):
    data = _document_bytes(_gpu_document())
    half = len(data) // 2
    two = gzip.compress(data[:half]) + gzip.compress(data[half:])
    assert_same(streamed("two.json", two, chunk_bytes=1 << 16), reference("two.json", data))


@pytest.mark.parametrize("content", [
    b"", b"   ", b"PAR1\x00\x01 this is not json", b'{"traceEvents": [', b'{"traceEvents": [{"ph": "X"}, ',
    b'{"traceEvents": [{"ph": "X"}] , "x": }', b'{"traceEvents": []} trailing', b'{"traceEvents": [}]}',
    b'{"traceEvents": [{"ph": "X"}}]}', b'{"traceEvents": [{"ph": "X" "cat": 1}]}', b'{"a": 1',
    b'{"traceEvents": [{"ph": "X"}, ]}', b'{"traceEvents": [{"ph": "X"}, {"ph": "X"},\n ]}',
])
def test_broken_json_is_unreadable(content, scan_mode):
    for data in (content, gzip.compress(content)):
        assert streamed("bad.json", data) == "raw_unreadable" == reference("bad.json", data)


@pytest.mark.parametrize("document", [
    [], {"traceEvents": {}}, {"traceEvents": []}, {"a": 1}, {"traceEvents": [], "distributedInfo": {"rank": 0}},
    {"traceEvents": [1, 2], "distributedInfo": {"rank": 0, "world_size": 1}},   # not events: decoded whole
    {"traceEvents": [{"ph": "X", "ts": "12", "dur": 1, "cat": "cpu_op", "name": "ProfilerStep#1"}],
     "distributedInfo": {"rank": 0, "world_size": 1}},
])
def test_documents_that_are_no_trace(document, scan_mode):
    data = json.dumps(document).encode()
    if isinstance(document, dict) and document.get("traceEvents") == [1, 2]:
        with pytest.raises(AttributeError):   # the old path failed so too: an event must be an object
            streamed("odd.json", data)
        return
    assert_same(streamed("odd.json", data), reference("odd.json", data))


def test_truncated_gzip_is_unreadable():
    data = hta_path("nccl_data.json.gz").read_bytes()
    for cut in (len(data) // 2, len(data) - 4, 12):
        with pytest.raises(RawInputError) as raised:
            parse_rank_bytes("cut.json.gz", data[:cut])
        assert raised.value.reason_code == "raw_unreadable" and "cut.json.gz" in str(raised.value)
        assert "not a complete JSON document" in str(raised.value)


def test_the_reader_reads_every_top_level_key():
    document = {"schemaVersion": 1, "deviceProperties": [{"name": 'a "quoted" [gpu]'}], "traceEvents": [{"ph": "M"}],
                "distributedInfo": {"rank": 3, "world_size": 4}, "baseTimeNanoseconds": 17, "trace_id": "t",
                "host_name": "h", "traceName": "x]}"}
    for data in (json.dumps(document).encode(), json.dumps(document, indent=3).encode()):
        reader = kineto_reader.read_trace(data, chunk_bytes=16)
        runs = list(reader.chunks())
        assert sum(len(r) for r in runs) == 1 and reader.events == 1
        assert reader.top == {k: v for k, v in document.items() if k != "traceEvents"}


def test_inside_spans_equals_testing_each_span():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        points = rng.integers(0, 50, rng.integers(0, 30)).astype(np.float64)
        spans = [(float(a), float(a + rng.integers(0, 10))) for a in rng.integers(0, 50, rng.integers(0, 5))]
        expected = np.zeros(len(points), dtype=bool)
        for start, end in spans:   # overlapping, nested, empty spans alike
            expected |= (start <= points) & (points < end)
        assert (_inside(points, spans) == expected).all()


def test_the_schedule_s_fsdp_and_comm_actions_are_quiet_labels_and_its_compute_is_not():
    """torch.distributed.pipelining labels every action it runs (`PP:{action}`). Its FSDP actions
    (UNSHARD / RESHARD: all-gathers read as collectives, empty without FSDP; torch 2.13 writes them
    for zero-bubble schedules even without FSDP) and comm actions lose nothing unmapped; its compute
    actions are read, never passed over as quiet."""
    for quiet in ("PP:0UNSHARD", "PP:3RESHARD", "PP:NUNSHARD", "PP:1REDUCE_GRAD", "PP:2SEND_F0", "PP:0RECV_B3"):
        assert _UNMAPPED_QUIET.match(quiet), quiet
    for read in ("PP:0F1", "PP:1B2", "PP:3W0", "PP:2I1", "PP:(0F3;3B1)OVERLAP_F_B"):
        assert not _UNMAPPED_QUIET.match(read), read
