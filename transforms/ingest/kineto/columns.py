"""A run of trace events as columns: what the event pass reads of them, grouped by category.

`columns_of(json_array, lean)` decodes a run of events (`[...]` bytes) with msgspec into structs of a
union tagged by `cat`: each category decodes only the fields the converter reads of it (a CUDA launch
its ts, dur, tid and `args.correlation`; a kernel its name too; a flow its ph and ts; ac2g flows,
instant events and the like nothing once a complete event set the time origin: `lean`), then turns
the groups into numpy columns, a few C-level passes per field, never a Python loop per event. The
typed fields are strict (ts and dur numbers, correlation an int64, args an object): a run whose
events stray from that (a `cat` outside the union or missing, a null ts, a string correlation) is
decoded again with the reader's general `TraceEvent` structs (`general_columns`), which give the
same columns the slow way; dicts of a whole document go the same way. So every run gives the same
`EventColumns` whatever the decoder that read it (tests/test_ingest_columns.py holds them equal).

Only complete events (ph X with ts and dur) of the read categories are kept, as the event pass
used them; each keeps its position in the run (`index`) so that the few events whose names or
args matter are still visited in file order (`rare`).
"""
from __future__ import annotations

import operator
from typing import Annotated, Any, Union

import msgspec
import numpy as np

__all__ = ["EventColumns", "Group", "ArgsKeys", "EventArgs", "columns_of", "general_columns", "CATEGORIES", "BadEvent"]


class BadEvent(ValueError):
    """An event the converter reads whose name is no string or whose ts / dur is no number (a
    document decoded whole into dicts; the typed decoders refuse it before): what it is and where."""

_NAN = float("nan")
_UNSET = msgspec.UNSET
# a correlation of the fast structs is an int64 other than this sentinel (absent); any other
# value (a float, a string, null, an int out of range) fails the decode: the general structs take the run
_NO_CORRELATION = -(2 ** 63)
_Correlation = Annotated[int, msgspec.Meta(ge=_NO_CORRELATION + 1, le=2 ** 63 - 1)]

# the categories the event pass reads, and their codes
LAUNCH, KERNEL, COPY, GPU_LABEL, CPU_OP, ANNOTATION, FLOW = range(1, 8)
CATEGORIES = {"cuda_runtime": LAUNCH, "cuda_driver": LAUNCH, "kernel": KERNEL, "gpu_memcpy": COPY, "gpu_memset": COPY,
              "gpu_user_annotation": GPU_LABEL, "cpu_op": CPU_OP, "user_annotation": ANNOTATION, "fwdbwd": FLOW}
# categories torch.profiler writes that the pass never reads (their complete events only set the origin)
_SKIPPED = ("ac2g", "async_cpu_to_gpu", "cpu_instant_event", "Trace", "python_function", "cuda_profiler_range",
            "overhead", "gpu_op", "Kernel", "Memcpy", "Memset", "Runtime", "cuda_sync")


class _LaunchArgs(msgspec.Struct, frozen=True, gc=False):
    correlation: _Correlation = _NO_CORRELATION


class ArgsKeys(msgspec.Struct, frozen=True, gc=False):
    """The `args` keys the converter reads besides `correlation` (UNSET: absent), shared by the
    tagged structs' `FastArgs` and the reader's general `EventArgs`, which differ in correlation."""

    collective: Any = msgspec.field(default=_UNSET, name="Collective name")
    group: Any = msgspec.field(default=_UNSET, name="Process Group Name")
    dst: Any = msgspec.field(default=_UNSET, name="Dst Rank")
    src: Any = msgspec.field(default=_UNSET, name="Src Rank")
    inputs: Any = msgspec.field(default=_UNSET, name="Concrete Inputs")
    seq: Any = msgspec.field(default=_UNSET, name="Seq")
    group_desc: Any = msgspec.field(default=_UNSET, name="Process Group Description")
    group_ranks: Any = msgspec.field(default=_UNSET, name="Process Group Ranks")
    # record_shapes' input shapes of every op: kept as raw bytes (no decoding cost per op), decoded
    # for the few ops whose args are read (aten::embedding: the tokens of a batch)
    dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input Dims")

    def _keyed(self, out: dict[str, Any]) -> dict[str, Any]:
        """`out` with the keys the file had, as they were spelled."""
        for key, value in (("Collective name", self.collective), ("Process Group Name", self.group),
                           ("Dst Rank", self.dst), ("Src Rank", self.src), ("Concrete Inputs", self.inputs),
                           ("Seq", self.seq), ("Process Group Description", self.group_desc),
                           ("Process Group Ranks", self.group_ranks)):
            if value is not _UNSET:
                out[key] = value
        if len(self.dims):
            out["Input Dims"] = msgspec.json.decode(self.dims)
        return out


class FastArgs(ArgsKeys, frozen=True, gc=False):
    """The args keys the converter reads, correlation typed (an int64; the sentinel: absent)."""

    correlation: _Correlation = _NO_CORRELATION

    def as_dict(self) -> dict[str, Any]:
        """The keys the file had, as they were spelled (as `EventArgs.as_dict`)."""
        return self._keyed({} if self.correlation == _NO_CORRELATION else {"correlation": self.correlation})


_NO_ARGS = FastArgs()
_NO_LAUNCH_ARGS = _LaunchArgs()


class _Timed(msgspec.Struct, gc=False, tag_field="cat"):
    ph: str = ""
    ts: float = _NAN
    dur: float = _NAN


class _Launch(_Timed):
    tid: Any = None
    args: _LaunchArgs = _NO_LAUNCH_ARGS


class _Named(_Timed):
    name: str = ""
    tid: Any = None
    args: FastArgs = _NO_ARGS


class _Nothing(msgspec.Struct, gc=False, tag_field="cat"):
    pass


def _tagged(base: type, tag: str) -> type:
    return msgspec.defstruct(f"_{tag}", [], bases=(base,), tag=tag, gc=False)


_CLASSES = {tag: _tagged(_Launch if code == LAUNCH else _Timed if code == FLOW else _Named, tag)
            for tag, code in CATEGORIES.items()}
_SKIPPED_TIMED = {tag: _tagged(_Timed, tag) for tag in _SKIPPED}      # until the origin is known
_SKIPPED_BARE = {tag: _tagged(_Nothing, tag) for tag in _SKIPPED}     # after: nothing read
_DECODERS = {lean: msgspec.json.Decoder(list[Union[(*_CLASSES.values(), *(_SKIPPED_BARE if lean else _SKIPPED_TIMED).values())]])
             for lean in (False, True)}
_CODE_OF_TYPE = {cls: CATEGORIES[tag] for tag, cls in _CLASSES.items()}
_CODE_OF_TYPE.update({cls: 0 for cls in (*_SKIPPED_TIMED.values(), *_SKIPPED_BARE.values())})
_CATEGORY_OF_TYPE = {cls: tag for tag, cls in (*_CLASSES.items(), *_SKIPPED_TIMED.items(), *_SKIPPED_BARE.items())}

_PH, _TS, _DUR, _NAME, _TID = (operator.attrgetter(f) for f in ("ph", "ts", "dur", "name", "tid"))
_ARGS = operator.attrgetter("args")
_CORRELATION = operator.attrgetter("args.correlation")


class Group:
    """Complete events of some categories, in file order: position in the run, ts, dur, their
    category codes, and the structs (or dicts) themselves for the fields read of a few."""

    __slots__ = ("index", "ts", "dur", "code", "events")

    def __init__(self, index: np.ndarray, ts: np.ndarray, dur: np.ndarray, code: np.ndarray, events: list):
        self.index, self.ts, self.dur, self.code, self.events = index, ts, dur, code, events

    def __len__(self) -> int:
        return len(self.index)


class EventColumns:
    """One run's events as the event pass reads them.

    n: events in the run; first_complete: ts of its first complete event of any category (None:
    none; only exact while the origin is unknown: a lean decode reads no other category's times);
    flow_starts / flow_ends: ts of the fwdbwd flows (ph s / f); launch, gpu (kernels, copies,
    memsets), gpu_label, cpu (cpu ops and user annotations): the complete events of those categories.
    `names(group)`, `tids(group)`, `correlations(group)` read one field of a group's events (a
    correlation column with `has` telling where one was given; `name_ids`, `tid_ids` the names and
    tids as ids into a table); `args_of(group, i)` the args of
    one as a dict; `category_of(group, i)` its cat."""

    __slots__ = ("n", "first_complete", "flow_starts", "flow_ends", "launch", "gpu", "gpu_label", "cpu", "_structs")

    def __init__(self, n, first_complete, flow_starts, flow_ends, groups: dict[str, Group], structs: bool):
        self.n, self.first_complete = n, first_complete
        self.flow_starts, self.flow_ends = flow_starts, flow_ends
        self.launch, self.gpu, self.gpu_label, self.cpu = (groups[k] for k in ("launch", "gpu", "gpu_label", "cpu"))
        self._structs = structs

    def __len__(self) -> int:
        return self.n

    def names(self, group: Group) -> list:
        if self._structs:
            return list(map(_NAME, group.events))
        return [e.get("name", "") for e in group.events]

    def tids(self, group: Group) -> list:
        if self._structs:
            return list(map(_TID, group.events))
        return [e.get("tid") for e in group.events]

    def name_ids(self, group: Group) -> tuple[np.ndarray, list]:
        """(ids, table): the names of a group's events as positions in `table`. Here the table is
        the names themselves; the scanner's columns give ids into the file's names, each once."""
        names = self.names(group)
        return np.arange(len(names)), names

    def tid_ids(self, group: Group) -> tuple[np.ndarray, list]:
        """(ids, table) of the tids, as `name_ids`."""
        tids = self.tids(group)
        return np.arange(len(tids)), tids

    def correlations(self, group: Group) -> tuple[np.ndarray, np.ndarray]:
        """(correlation as int64, whether given) of a group's events."""
        if self._structs is _FAST:
            values = np.fromiter(map(_CORRELATION, group.events), np.int64, len(group.events))
            return values, values != _NO_CORRELATION
        if self._structs:
            given = [a.correlation if a is not None else None for a in map(_ARGS, group.events)]
        else:
            given = [(e.get("args") or {}).get("correlation") for e in group.events]
        has = np.fromiter((c is not None for c in given), bool, len(given))
        values = np.array([c for c in given if c is not None], dtype=np.int64).reshape(-1)
        out = np.zeros(len(given), dtype=np.int64)
        out[has] = values
        return out, has

    def args_of(self, group: Group, i: int) -> dict:
        event = group.events[i]
        if self._structs:
            return event.args.as_dict() if event.args is not None else {}
        return event.get("args") or {}

    def args_many(self, group: Group, positions) -> list[dict]:
        """`args_of` of several of a group's events."""
        return [self.args_of(group, i) for i in positions]

    def args_holding(self, group: Group, positions, key: str) -> list[bool]:
        """Whether the args of each of these events hold `key` (a key `args_of` gives)."""
        return [key in self.args_of(group, i) for i in positions]

    def category_of(self, group: Group, i: int) -> str:
        event = group.events[i]
        if self._structs is _FAST:
            return _CATEGORY_OF_TYPE[type(event)]
        return event.cat if self._structs else event.get("cat", "")


_FAST = "fast"   # EventColumns._structs of the tagged union's structs (truthy: structs)
_GROUPS = {"launch": (LAUNCH,), "gpu": (KERNEL, COPY), "gpu_label": (GPU_LABEL,), "cpu": (CPU_OP, ANNOTATION)}


def columns_of(array: bytes, lean: bool) -> EventColumns:
    """The columns of the JSON array `array` decoded by the tagged union (msgspec.ValidationError
    when its events stray from the fast structs: decode them with `general_columns` then; a
    msgspec.DecodeError when the bytes are no JSON array)."""
    events = _DECODERS[lean].decode(array)
    n = len(events)
    code = np.fromiter(map(_CODE_OF_TYPE.__getitem__, map(type, events)), np.int8, n)
    first_complete = None
    if not lean:   # the origin: the first complete event, of any category
        first_complete = _first_complete(events)
    flows = np.flatnonzero(code == FLOW)
    flow_starts, flow_ends = _flows(_take(events, flows)) if len(flows) else (np.zeros(0), np.zeros(0))
    groups = {}
    for key, codes in _GROUPS.items():
        rows = np.flatnonzero(code == codes[0]) if len(codes) == 1 else np.flatnonzero((code >= codes[0]) & (code <= codes[-1]))
        members = _take(events, rows)
        ts = np.fromiter(map(_TS, members), np.float64, len(members))
        dur = np.fromiter(map(_DUR, members), np.float64, len(members))
        complete = (np.array(list(map(_PH, members)), dtype=object) == "X") & ~np.isnan(ts) & ~np.isnan(dur)
        if not complete.all():
            keep = np.flatnonzero(complete)
            rows, ts, dur, members = rows[keep], ts[keep], dur[keep], _take(members, keep)
        groups[key] = Group(rows, ts, dur, code[rows], members)
    return EventColumns(n, first_complete, flow_starts, flow_ends, groups, _FAST)


def _take(items, rows: np.ndarray) -> list:
    """items[rows] of a list (C-level gather)."""
    if len(rows) > 1:
        return list(operator.itemgetter(*rows.tolist())(items))
    return [items[int(rows[0])]] if len(rows) else []


def _first_complete(timed: list) -> float | None:
    for event in timed:
        if event.ph == "X" and event.ts == event.ts and event.dur == event.dur:   # (NaN != NaN)
            return event.ts
    return None


def _flows(flows: list) -> tuple[np.ndarray, np.ndarray]:
    ts = np.fromiter(map(_TS, flows), np.float64, len(flows))
    ph = np.array(list(map(_PH, flows)), dtype=object)
    given = ~np.isnan(ts)
    return ts[given & (ph == "s")], ts[given & (ph == "f")]


def _times(values: list, events: list, field: str) -> np.ndarray:
    """A time field as float64 (None: NaN); BadEvent naming the first event whose value is no number."""
    try:
        return np.array(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        for event, value in zip(events, values):
            try:
                float(value if value is not None else "nan")
            except (TypeError, ValueError):
                cat = event.cat if hasattr(event, "cat") else event.get("cat")
                raise BadEvent(f"a {cat!r} event has the {field} {value!r}, not a number") from None
        raise


def general_columns(events: list, structs: bool) -> EventColumns:
    """The same columns of events decoded otherwise: the reader's general `TraceEvent` structs
    (`structs`; None where a field is absent or null) or dicts of a whole document (a missing name
    or cat is "")."""
    n = len(events)
    if structs:
        cat, ph = [e.cat for e in events], [e.ph for e in events]
        ts = [e.ts for e in events]
        dur = [e.dur for e in events]
    else:
        cat, ph = [e.get("cat", "") for e in events], [e.get("ph", "") for e in events]
        ts, dur = [e.get("ts") for e in events], [e.get("dur") for e in events]
    code = np.fromiter(map(CATEGORIES.get, cat, [0] * n), np.int8, n)
    ts, dur = _times(ts, events, "ts"), _times(dur, events, "dur")   # None -> NaN
    phase = np.array(ph, dtype=object).reshape(-1)
    has_ts = ~np.isnan(ts)
    is_flow = (code == FLOW) & has_ts
    flow_starts, flow_ends = ts[is_flow & (phase == "s")], ts[is_flow & (phase == "f")]
    complete = (phase == "X") & has_ts & ~np.isnan(dur)
    first = np.flatnonzero(complete)
    first_complete = float(ts[first[0]]) if len(first) else None
    groups = {}
    for key, codes in _GROUPS.items():
        rows = np.flatnonzero(complete & np.isin(code, codes))
        groups[key] = Group(rows, ts[rows], dur[rows], code[rows], _take(events, rows))
        if not structs and key != "launch":   # (a struct's name is a str by its type)
            for event in groups[key].events:
                if not isinstance(event.get("name", ""), str):
                    raise BadEvent(f"a {event.get('cat')!r} event at ts {event.get('ts')} has the name "
                                   f"{event.get('name')!r}, not a string")
    return EventColumns(n, first_complete, flow_starts, flow_ends, groups, structs)


class EventArgs(ArgsKeys, frozen=True, gc=False):
    """The `args` of an event, only the keys the converter reads (UNSET: absent; correlation None)."""

    correlation: Any = None

    def as_dict(self) -> dict[str, Any]:
        """The keys the file had, as they were spelled."""
        return self._keyed({} if self.correlation is None else {"correlation": self.correlation})
