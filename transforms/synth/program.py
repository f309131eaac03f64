"""The static program of one Megatron-style training step, built once per job shape.

A *unit* is one thing a worker (dp_rank, stage) does in a step: a forward or backward
compute of one microbatch on one model chunk, one (possibly batched) pipeline p2p call,
a ZeRO collective, a tail op. A unit emits one trace record, except a batched p2p call,
which emits one record per direction it carries (2 or 4 records sharing start and
duration, like the profiler does). The program is identical for every DP rank and
step, so it is built once as integer arrays and simulated "SIMD" over (step, dp_rank)
by :mod:`transforms.synth.execution`.

Schedules follow Megatron-LM:

* ``pp == 1``: forward/backward per microbatch, no p2p.
* ``vpp == 1``: 1F1B (warm-up of ``pp - stage - 1`` forwards, steady one-forward-one-
  backward with batched ``send_forward_recv_backward`` / ``send_backward_recv_forward``,
  cool-down). Calls that Megatron skips at the pipeline ends (first-stage receives of
  activations, last-stage sends of activations, ...) leave no record, like the published
  traces; with ``noop_ends`` they leave no-op records instead (profilers differ).
* ``vpp > 1``: interleaved 1F1B (warm-up ``2 (pp - stage - 1) + (vpp - 1) pp``, chunk of
  forward k = ``(k mod pp vpp) // pp``) with Megatron's default p2p for this schedule
  (``overlap_p2p_comm``, not batched): after each forward a ``send_forward_recv_forward``
  call, after each backward a ``send_backward_recv_backward`` call, whose send and recv
  are separate asynchronous ops, each on the stream of its optype (in order); compute
  goes on and waits only for the receive that brings its input (we do not model a wait
  on send handles). Every call leaves a record for each op it issues, so transfers at
  the first/last global chunk appear as no-op records, the backward call issued at the
  end of the warm-up carries a no-op backward-send, and the last calls carry no-op
  receives (after the last compute). The stand-alone receive before the warm-up is not
  recorded on stage 0 (Megatron returns early there).

Blocking semantics: a worker's compute stream runs its units strictly in program
order (1F1B p2p calls sit in it: Megatron waits on every request before the next
kernel); ZeRO params-all-gather (and, with overlapped DP, grads-reduce-scatter) run on
a separate DP stream; collectives end when the last member has started plus a transfer
time. A batched (1F1B) call ends when every transfer it carries is done.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from schemas.trace import OPTYPES

__all__ = [
    "UnitKind",
    "Program",
    "build_program",
    "interleaved_chunk",
    "interleaved_microbatch",
]

_CODE = {name: code for code, name in enumerate(OPTYPES)}


class UnitKind:
    """Integer codes of unit kinds (what decides how a unit's end time is computed)."""

    FORWARD = 0          # end = start + duration
    BACKWARD = 1
    P2P = 2              # end = max over its transfers of (max start of both sides + transfer)
    PARAMS_ALL_GATHER = 3  # DP collective: end = max start over DP ranks + transfer
    GRADS_REDUCE_SCATTER = 4
    SEPARATE_ALL_REDUCE = 5
    GC = 6               # zero-duration placeholder after the last compute
    LAYERNORM = 7        # TP-group all-reduce: not a cross-worker group here
    EMBEDDING = 8        # all-reduce between stage 0 and stage pp-1 of one DP rank
    CLIP = 9             # global grad-norm all-reduce: every stage, every DP rank
    OPTIMIZER = 10       # end = start + duration

    DP_COLLECTIVES = (PARAMS_ALL_GATHER, GRADS_REDUCE_SCATTER, SEPARATE_ALL_REDUCE)
    NAMES = ("forward", "backward", "p2p", "params-all-gather", "grads-reduce-scatter",
             "separate-grads-all-reduce", "gc", "layernorm", "embedding", "clip", "optimizer")


_UNIT_OPTYPE = {
    UnitKind.FORWARD: "forward-compute",
    UnitKind.BACKWARD: "backward-compute",
    UnitKind.PARAMS_ALL_GATHER: "params-all-gather",
    UnitKind.GRADS_REDUCE_SCATTER: "grads-reduce-scatter",
    UnitKind.SEPARATE_ALL_REDUCE: "separate-grads-all-reduce",
    UnitKind.GC: "gc",
    UnitKind.LAYERNORM: "layernorm-grads-all-reduce",
    UnitKind.EMBEDDING: "embedding-grads-all-reduce",
    UnitKind.CLIP: "optimizer-clip-main-grad",
    UnitKind.OPTIMIZER: "optimizer",
}


def interleaved_chunk(k: int, pp: int, vpp: int, forward: bool) -> int:
    """Model chunk of the k-th forward (or backward) of a stage in the interleaved schedule."""
    chunk = (k % (pp * vpp)) // pp
    return chunk if forward else vpp - 1 - chunk


def interleaved_microbatch(k: int, pp: int, vpp: int) -> int:
    """Microbatch id of the k-th forward (or backward) of a stage in the interleaved schedule."""
    return (k // (pp * vpp)) * pp + k % pp


@dataclasses.dataclass(frozen=True)
class Program:
    """One step of one job shape, as arrays over units (N), records (R) and p2p transfers (G).

    Units are numbered stage by stage, each stage's units stream by stream (compute
    stream first, in program order; then the DP stream and the p2p streams). ``events`` is a topological order of the
    2N events ``2u`` (start of u) and ``2u+1`` (end of u).
    """

    pp: int
    vpp: int
    microbatches: int
    use_dp: bool
    dp_overlap: bool
    unit_stage: np.ndarray        # int16 [N]
    unit_kind: np.ndarray         # int8 [N]
    unit_chunk: np.ndarray        # int16 [N] model chunk (compute, AG, RS), else -1
    unit_microbatch: np.ndarray   # int32 [N] microbatch id (compute), else -1
    unit_position: np.ndarray     # int32 [N] index in its stage's compute-stream program (-1: other streams)
    unit_preds: tuple[tuple[int, ...], ...]   # units whose end gates the start of each unit
    unit_transfers: tuple[tuple[int, ...], ...]  # p2p transfers (G index) each P2P unit waits for
    transfer_units: np.ndarray    # int32 [G, 2] (sending unit, receiving unit)
    transfer_forward: np.ndarray  # bool [G] activation (True) or gradient (False) transfer
    record_unit: np.ndarray       # int32 [R]
    record_optype: np.ndarray     # int8 [R] code in OPTYPES
    record_seq_id: np.ndarray     # int32 [R]
    record_mc: np.ndarray         # int16 [R]
    record_microbatch: np.ndarray  # int32 [R] (mb_id column)
    record_gmc: np.ndarray        # int16 [R]
    record_noop: np.ndarray       # bool [R] p2p record without a peer
    events: np.ndarray            # int32 [2N] topological order of start/end events

    @property
    def n_units(self) -> int:
        return len(self.unit_kind)

    @property
    def n_records(self) -> int:
        return len(self.record_unit)


class _Stage:
    """Collects one stage's units and records, stream by stream, in program order."""

    STREAMS = ("compute", "dp", "forward-send", "forward-recv", "backward-send", "backward-recv")

    def __init__(self, stage: int, pp: int):
        self.stage = stage
        self.pp = pp
        self.streams: dict[str, list[dict]] = {name: [] for name in self.STREAMS}
        self.seq: dict[str, int] = {}

    @property
    def units(self) -> list[dict]:
        """The compute stream's program."""
        return self.streams["compute"]

    def _record(self, optype: str, mc: int = -1, microbatch: int = -1, gmc: int = -1, key=None, noop=False):
        seq = self.seq.get(optype, 0)
        self.seq[optype] = seq + 1
        return {"optype": _CODE[optype], "seq": seq, "mc": mc, "mb": microbatch, "gmc": gmc,
                "key": key, "noop": noop}

    def add(self, kind: int, chunk: int = -1, microbatch: int = -1, stream: str = "compute",
            waits: list | tuple = ()) -> dict:
        optype = _UNIT_OPTYPE[kind]
        gmc = chunk * self.pp + self.stage if kind in (UnitKind.FORWARD, UnitKind.BACKWARD) else -1
        mc = chunk if kind in (UnitKind.FORWARD, UnitKind.BACKWARD, UnitKind.PARAMS_ALL_GATHER,
                               UnitKind.GRADS_REDUCE_SCATTER) else -1
        # The profiler writes mb_id 0 on its gc placeholder (see the published traces).
        mb = microbatch if kind in (UnitKind.FORWARD, UnitKind.BACKWARD) else (0 if kind == UnitKind.GC else -1)
        unit = {"kind": kind, "chunk": chunk, "mb": microbatch, "extra_preds": [u for u in waits if u is not None],
                "records": [self._record(optype, mc, mb, gmc)]}
        self.streams[stream].append(unit)
        return unit

    def p2p(self, transfers: list, stream: str = "compute", after: dict | None = None) -> dict | None:
        """One p2p call; ``transfers`` holds (optype, key or None for a no-op) or None (not recorded).

        On the compute stream the call blocks the next compute; on a p2p stream (one per
        p2p optype) it starts after ``after`` (the compute it follows) and the previous op
        of the stream.
        """
        records = [self._record(optype, key=key, noop=key is None) for optype, key in
                   (t for t in transfers if t is not None)]
        if not records:
            return None
        unit = {"kind": UnitKind.P2P, "chunk": -1, "mb": -1, "extra_preds": [after] if after else [],
                "records": records}
        self.streams[stream].append(unit)
        return unit


def _one_f_one_b(st: _Stage, pp: int, microbatches: int, forward_unit, backward_unit, noop_ends: bool) -> None:
    """Non-interleaved 1F1B (and, for pp == 1, the no-pipelining schedule).

    At the pipeline ends Megatron skips the calls without a peer; with ``noop_ends`` the
    profiler records them anyway, as no-op records (pp > 1 only).
    """
    p, m = st.stage, microbatches
    first, last = p == 0, p == pp - 1
    warmup = min(pp - p - 1, m)
    remaining = m - warmup
    noop = noop_ends and pp > 1

    def end(optype: str, skipped: bool, key):
        if not skipped:
            return (optype, key)
        return (optype, None) if noop else None

    # Transfer keys: ("F", sending stage, microbatch) and ("B", sending stage, microbatch).
    frecv = lambda i: end("forward-recv", first, ("F", p - 1, i))
    fsend = lambda i: end("forward-send", last, ("F", p, i))
    brecv = lambda i: end("backward-recv", last, ("B", p + 1, i))
    bsend = lambda i: end("backward-send", first, ("B", p, i))
    for i in range(warmup):
        st.p2p([frecv(i)])
        forward_unit(0, i, None)
        st.p2p([fsend(i)])
    if remaining > 0:
        st.p2p([frecv(warmup)])
    for i in range(remaining):
        forward_unit(0, warmup + i, None)
        st.p2p([fsend(warmup + i), brecv(i)])
        backward_unit(0, i, None)
        if i == remaining - 1:
            st.p2p([bsend(i)])
        else:
            st.p2p([bsend(i), frecv(warmup + i + 1)])
    for i in range(remaining, m):
        st.p2p([brecv(i)])
        backward_unit(0, i, None)
        st.p2p([bsend(i)])


def _interleaved(st: _Stage, pp: int, vpp: int, microbatches: int, forward_unit, backward_unit) -> None:
    """Interleaved 1F1B with batched 4-way p2p calls (Megatron's schedule with vpp > 1)."""
    p = st.stage
    total = microbatches * vpp
    warmup = min((pp - p - 1) * 2 + (vpp - 1) * pp, total)
    remaining = total - warmup
    last_gmc = pp * vpp - 1

    def fwd(k):
        chunk = interleaved_chunk(k, pp, vpp, True)
        return chunk, interleaved_microbatch(k, pp, vpp), chunk * pp + p

    def bwd(k):
        chunk = interleaved_chunk(k, pp, vpp, False)
        return chunk, interleaved_microbatch(k, pp, vpp), chunk * pp + p

    def frecv(k):
        _, mb, gmc = fwd(k)
        return ("forward-recv", None if gmc == 0 else ("F", gmc - 1, mb))

    def fsend(k):
        _, mb, gmc = fwd(k)
        return ("forward-send", None if gmc == last_gmc else ("F", gmc, mb))

    def brecv(k):
        _, mb, gmc = bwd(k)
        return ("backward-recv", None if gmc == last_gmc else ("B", gmc + 1, mb))

    def bsend(k):
        _, mb, gmc = bwd(k)
        return ("backward-send", None if gmc == 0 else ("B", gmc, mb))

    def call(after: dict | None, *transfers) -> dict | None:
        """Issue the sends/recvs of one Megatron call as separate async ops; return the recv op."""
        received = None
        for transfer in transfers:
            unit = st.p2p([transfer], transfer[0], after=after)
            if transfer[0].endswith("recv"):
                received = unit
        return received

    # A forward waits for the receive of its input, a backward for the receive of its
    # output gradient; sends complete on their own streams while compute goes on.
    forward_input = call(None, frecv(0)) if p > 0 else None
    backward_input = None
    for k in range(warmup):
        unit = forward_unit(*fwd(k)[:2], forward_input)
        forward_input = call(unit, fsend(k), frecv(k + 1) if k + 1 < total else ("forward-recv", None))
        if k == warmup - 1 and remaining > 0:
            backward_input = call(unit, ("backward-send", None), brecv(0))
    for k in range(remaining):
        unit = forward_unit(*fwd(warmup + k)[:2], forward_input)
        last_iteration = k == remaining - 1
        forward_input = call(unit, fsend(warmup + k),
                             ("forward-recv", None) if last_iteration else frecv(warmup + k + 1))
        unit = backward_unit(*bwd(k)[:2], backward_input)
        backward_input = call(unit, bsend(k), brecv(k + 1))
    for k in range(remaining, total):
        unit = backward_unit(*bwd(k)[:2], backward_input)
        backward_input = call(unit, bsend(k), ("backward-recv", None) if k == total - 1 else brecv(k + 1))


def _build_stage(p: int, pp: int, vpp: int, microbatches: int, use_dp: bool, dp_overlap: bool,
                 noop_ends: bool) -> _Stage:
    st = _Stage(p, pp)
    ag_units = [st.add(UnitKind.PARAMS_ALL_GATHER, chunk=c, stream="dp") for c in range(vpp)] if use_dp else []
    first_forward_seen: set[int] = set()
    last_backward: dict[int, dict] = {}

    def forward_unit(chunk: int, mb: int, waits_for: dict | None) -> dict:
        unit = st.add(UnitKind.FORWARD, chunk, mb, waits=[waits_for])
        if use_dp and chunk not in first_forward_seen:
            unit["extra_preds"].append(ag_units[chunk])   # ZeRO: a chunk's params before its first forward
        first_forward_seen.add(chunk)
        return unit

    def backward_unit(chunk: int, mb: int, waits_for: dict | None) -> dict:
        last_backward[chunk] = st.add(UnitKind.BACKWARD, chunk, mb, waits=[waits_for])
        return last_backward[chunk]

    if vpp == 1:
        _one_f_one_b(st, pp, microbatches, forward_unit, backward_unit, noop_ends)
    else:
        _interleaved(st, pp, vpp, microbatches, forward_unit, backward_unit)

    if use_dp and not dp_overlap:
        # Blocking all-gather: the compute stream starts once the first chunk's params are
        # gathered (later chunks' gathers proceed on the DP stream until their first forward).
        st.units[0]["extra_preds"].append(ag_units[0])

    # gc placeholder right after the last compute (before a trailing send, as recorded).
    last_compute = max(i for i, u in enumerate(st.units) if u["kind"] in (UnitKind.FORWARD, UnitKind.BACKWARD))
    gc_unit = {"kind": UnitKind.GC, "chunk": -1, "mb": -1, "extra_preds": [],
               "records": [st._record("gc", microbatch=0)]}
    st.units.insert(last_compute + 1, gc_unit)

    rs_units = []
    if use_dp and dp_overlap:
        # Grads of a chunk are reduce-scattered as soon as its last backward is done.
        order = sorted(last_backward, key=lambda c: st.units.index(last_backward[c]))
        for c in order:
            unit = st.add(UnitKind.GRADS_REDUCE_SCATTER, chunk=c, stream="dp")
            unit["extra_preds"].append(last_backward[c])
            rs_units.append(unit)
    # The tail waits for the grads (overlapped DP) and for outstanding p2p calls (interleaved).
    st.add(UnitKind.LAYERNORM, waits=[rs_units[-1] if rs_units else None,
                                      *(st.streams[name][-1] for name in _Stage.STREAMS[2:]
                                        if st.streams[name])])
    if p == 0 or p == pp - 1:
        st.add(UnitKind.EMBEDDING)
    if use_dp and dp_overlap:
        st.add(UnitKind.SEPARATE_ALL_REDUCE)
    if use_dp and not dp_overlap:
        for c in range(vpp):
            st.add(UnitKind.GRADS_REDUCE_SCATTER, chunk=c)
    st.add(UnitKind.CLIP)
    st.add(UnitKind.OPTIMIZER)
    return st


@functools.lru_cache(maxsize=64)
def build_program(pp: int, vpp: int, microbatches: int, use_dp: bool, dp_overlap: bool,
                  noop_ends: bool = False) -> Program:
    """Build (and cache) the program of one step for a job shape.

    ``noop_ends``: in 1F1B, record the p2p calls Megatron skips at the pipeline ends as
    no-op records (some profilers do); interleaved schedules always record them.

    Raises ValueError for shapes Megatron does not run: vpp > 1 needs pp > 1,
    microbatches a multiple of pp and at least 2 pp; 1F1B needs microbatches >= 1.
    """
    if pp < 1 or vpp < 1 or microbatches < 1:
        raise ValueError(f"pp, vpp and microbatches must be >= 1, got pp={pp} vpp={vpp} microbatches={microbatches}")
    if vpp > 1 and (pp < 2 or microbatches % pp or microbatches < 2 * pp):
        raise ValueError(f"interleaved schedule (vpp={vpp}) needs pp >= 2 and microbatches a multiple of pp "
                         f"and >= 2 pp; got pp={pp} microbatches={microbatches}")
    stages = [_build_stage(p, pp, vpp, microbatches, use_dp, dp_overlap, noop_ends) for p in range(pp)]

    units: list[dict] = []
    for p, st in enumerate(stages):
        for name in _Stage.STREAMS:
            for position, unit in enumerate(st.streams[name]):
                unit["stage"], unit["position"] = p, position if name == "compute" else -1
                units.append(unit)
    index = {id(u): i for i, u in enumerate(units)}

    preds: list[tuple[int, ...]] = []
    for st in stages:
        for name in _Stage.STREAMS:
            stream = st.streams[name]
            for j, unit in enumerate(stream):
                own = [index[id(stream[j - 1])]] if j else []
                preds.append(tuple(own + [index[id(u)] for u in unit["extra_preds"]]))
    # preds was appended stage by stage, stream by stream: the same order as `units`.

    # Records and p2p transfers.
    rec = {k: [] for k in ("unit", "optype", "seq", "mc", "mb", "gmc", "noop")}
    senders: dict[tuple, int] = {}
    receivers: dict[tuple, int] = {}
    for u, unit in enumerate(units):
        for r in unit["records"]:
            rec["unit"].append(u)
            for k in ("optype", "seq", "mc", "mb", "gmc", "noop"):
                rec[k].append(r[k])
            if r["key"] is not None:
                side = senders if OPTYPES[r["optype"]].endswith("send") else receivers
                if r["key"] in side:
                    raise AssertionError(f"duplicate p2p transfer {r['key']} in program pp={pp} vpp={vpp}")
                side[r["key"]] = u
    if senders.keys() != receivers.keys():
        missing = sorted(senders.keys() ^ receivers.keys())[:5]
        raise AssertionError(f"unmatched p2p transfers in program pp={pp} vpp={vpp}: {missing}")
    keys = sorted(senders)
    transfer_units = np.array([[senders[k], receivers[k]] for k in keys], dtype=np.int32).reshape(-1, 2)
    transfer_forward = np.array([k[0] == "F" for k in keys], dtype=bool)
    unit_transfers: list[list[int]] = [[] for _ in units]
    for g, (a, b) in enumerate(transfer_units):
        unit_transfers[a].append(g)
        unit_transfers[b].append(g)

    kinds = np.array([u["kind"] for u in units], dtype=np.int8)
    program = Program(
        pp=pp, vpp=vpp, microbatches=microbatches, use_dp=use_dp, dp_overlap=dp_overlap,
        unit_stage=np.array([u["stage"] for u in units], dtype=np.int16),
        unit_kind=kinds,
        unit_chunk=np.array([u["chunk"] for u in units], dtype=np.int16),
        unit_microbatch=np.array([u["mb"] for u in units], dtype=np.int32),
        unit_position=np.array([u["position"] for u in units], dtype=np.int32),
        unit_preds=tuple(preds),
        unit_transfers=tuple(tuple(t) for t in unit_transfers),
        transfer_units=transfer_units,
        transfer_forward=transfer_forward,
        record_unit=np.array(rec["unit"], dtype=np.int32),
        record_optype=np.array(rec["optype"], dtype=np.int8),
        record_seq_id=np.array(rec["seq"], dtype=np.int32),
        record_mc=np.array(rec["mc"], dtype=np.int16),
        record_microbatch=np.array(rec["mb"], dtype=np.int32),
        record_gmc=np.array(rec["gmc"], dtype=np.int16),
        record_noop=np.array(rec["noop"], dtype=bool),
        events=np.zeros(0, dtype=np.int32),
    )
    return dataclasses.replace(program, events=_topological_events(program))


def _topological_events(program: Program) -> np.ndarray:
    """Kahn order of the 2N start/end events; raises if the program could deadlock."""
    n = program.n_units
    succ: list[list[int]] = [[] for _ in range(2 * n)]
    indegree = np.zeros(2 * n, dtype=np.int64)

    def edge(a: int, b: int) -> None:
        succ[a].append(b)
        indegree[b] += 1

    kinds = program.unit_kind
    clip_units = np.flatnonzero(kinds == UnitKind.CLIP)
    embedding_units = np.flatnonzero(kinds == UnitKind.EMBEDDING)
    for u in range(n):
        for pred in program.unit_preds[u]:
            edge(2 * pred + 1, 2 * u)
        edge(2 * u, 2 * u + 1)
        for g in program.unit_transfers[u]:
            for peer in program.transfer_units[g]:
                if peer != u:
                    edge(2 * int(peer), 2 * u + 1)
        if kinds[u] == UnitKind.CLIP:
            for peer in clip_units:
                if peer != u:
                    edge(2 * int(peer), 2 * u + 1)
        if kinds[u] == UnitKind.EMBEDDING:
            for peer in embedding_units:
                if peer != u:
                    edge(2 * int(peer), 2 * u + 1)
    order = [e for e in range(2 * n) if indegree[e] == 0]
    head = 0
    while head < len(order):
        e = order[head]
        head += 1
        for f in succ[e]:
            indegree[f] -= 1
            if indegree[f] == 0:
                order.append(f)
    if len(order) != 2 * n:
        stuck = [UnitKind.NAMES[kinds[e // 2]] + f"@stage{program.unit_stage[e // 2]}"
                 for e in np.flatnonzero(indegree > 0)[:6]]
        raise AssertionError(f"program pp={program.pp} vpp={program.vpp} m={program.microbatches} "
                             f"has a dependency cycle (deadlock) around {stuck}")
    return np.array(order, dtype=np.int32)
