"""The dependency graph of a job (METHOD.md section 2), inferred from its template slice.

Every step and DP rank of a job runs the same ops in the same dependency graph; `compile_job`
(model.py) takes the graph of the template slice -- the first step of dp_rank 0 -- and lays every
lane's trace out on it. Here: the template (`_Template`: its ops indexed by key, in observed
order per stage), the graph's edges and comm groups (`_Graph`, built by `_build_graph`: ops in a
stream chained in observed (start, seq_id, optype name) order, p2p pairs and no-ops, collectives
inside compute, DP collectives and the step tail per DP mode), its check (every op linked to an
optimizer; no cycle), and the replay order (`_infer_structure`: ops sorted by topological level,
kind, group size and group, with the predecessor CSR and the per-level plans, `Level`).

The rules follow the authors' analyzer (ByteDance-Seed/StragglerAnalysis), written here from its
documented behaviour: op names `{optype}_{seq_id}_{stage}`, p2p no-op detection with a 0.05 ms
tolerance, the first backward p2p waits for the forward compute two places before the first
backward compute, and the step tail per DP mode.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from schemas.trace import DP_COMM_OPTYPES, IN_COMPUTE_OPTYPES, OPTYPES
from transforms.components import components
from transforms.whatif.errors import CycleError, DisconnectedGraphError, MissingOpError, MissingPeerError, TraceStructureError
from transforms.whatif.result import JobMeta

if TYPE_CHECKING:
    from transforms.whatif.model import TraceColumns

__all__ = ["NOOP_TOLERANCE", "Level", "OWN", "MULTI", "SYNCED"]


# Tolerance (seconds) of the p2p no-op test: a recv starting after the last compute
# of its direction started, or a send ending before the first one ended.
NOOP_TOLERANCE = 5e-5


_CODE = {name: code for code, name in enumerate(OPTYPES)}
FWD, BWD = _CODE["forward-compute"], _CODE["backward-compute"]
FSEND, FRECV = _CODE["forward-send"], _CODE["forward-recv"]
BSEND, BRECV = _CODE["backward-send"], _CODE["backward-recv"]
AG, RS = _CODE["params-all-gather"], _CODE["grads-reduce-scatter"]
SEP, LN = _CODE["separate-grads-all-reduce"], _CODE["layernorm-grads-all-reduce"]
EMB, CLIP = _CODE["embedding-grads-all-reduce"], _CODE["optimizer-clip-main-grad"]
OPT, GC, WGT = _CODE["optimizer"], _CODE["gc"], _CODE["backward-weight-compute"]
IN_COMPUTE = tuple(_CODE[name] for name in IN_COMPUTE_OPTYPES)
DP_COMM = tuple(_CODE[name] for name in DP_COMM_OPTYPES)
P2P = (FSEND, FRECV, BSEND, BRECV)
# Ties in start time and seq_id are broken by optype name, alphabetically.
_NAME_RANK = np.argsort(np.argsort(np.array(OPTYPES, dtype=object)))
# p2p optype -> (peer optype, offset of the peer's model chunk from the chunk the op serves)
_PEER = {FSEND: (FRECV, +1), FRECV: (FSEND, -1), BSEND: (BRECV, -1), BRECV: (BSEND, +1)}


# Op kinds inside a level (their order in the level's slice).
OWN, MULTI, SYNCED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Level:
    """One topological level: ops [lo, hi) of the replay order.

    Ops [lo, multi_lo) time themselves (compute, or a comm group of one that is not
    DP-synchronised); [multi_lo, synced_lo) are groups of several members, ended
    together; [synced_lo, hi) are groups synchronised across the DP ranks of a step.
    Group members are contiguous and groups of equal size adjacent: `multi_runs` /
    `synced_runs` list (first op, number of groups, group size) of each run.
    `pred_columns[j]` holds each op's j-th predecessor row (padding: the -inf row).
    """

    lo: int
    hi: int
    multi_lo: int
    synced_lo: int
    pred_columns: tuple[np.ndarray, ...]
    multi_runs: tuple[tuple[int, int, int], ...]
    synced_runs: tuple[tuple[int, int, int], ...]


def _op_name(optype: int, seq_id: int, stage: int) -> str:
    return f"{OPTYPES[optype]}_{seq_id}_{stage}"


def _infer_structure(template: "_Template", dp_size: int, meta: JobMeta) -> dict:
    """The dependency graph of the template as replay-order arrays (the _STRUCTURE_FIELDS)."""
    graph = _build_graph(template, dp_size, meta)
    graph.check_connected(template)
    node_level = graph.levels(template)

    # Replay order: by level, then kind (own / multi / synced), group size, group, template order.
    kind = graph.kinds()
    size = np.array([len(graph.group_members[g]) if g >= 0 else 0 for g in graph.op_group])
    perm = np.lexsort((np.arange(template.n), graph.op_group, size, kind, node_level))
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(len(perm))
    n_ops = template.n

    # Groups renumbered in replay order.
    group_t = graph.op_group[perm]
    in_order = group_t[group_t >= 0]
    first = np.unique(in_order, return_index=True)[1]
    renumber = in_order[np.sort(first)]
    group_order = np.full(graph.n_groups, -1, dtype=np.int64)
    group_order[renumber] = np.arange(len(renumber))
    op_group = np.full(len(group_t), -1, dtype=np.int64)   # a job without groups (one worker) has none
    op_group[group_t >= 0] = group_order[group_t[group_t >= 0]]
    group_synced = np.zeros(len(renumber), dtype=bool)
    group_synced[group_order] = graph.group_synced

    pred_lists = [sorted(int(inverse[p]) for p in graph.preds[old]) for old in perm]
    pred_count = np.array([max(len(p), 1) for p in pred_lists], dtype=np.int64)
    pred_ptr = np.concatenate([[0], np.cumsum(pred_count)])
    pred_index = np.array([x for p in pred_lists for x in (p or [n_ops])], dtype=np.int64)
    return dict(
        vpp_size=template.vpp, uses_dp=graph.uses_dp, dp_overlapped=graph.dp_overlapped,
        op_optype=template.optype[perm], op_seq_id=template.seq_id[perm], op_stage=template.stage[perm],
        op_mc=template.mc[perm], op_gmc=template.gmc[perm], op_group=op_group,
        op_noop=graph.noop[perm], op_kind=kind[perm], group_synced=group_synced,
        pred_ptr=pred_ptr, pred_index=pred_index,
        levels=_levels(node_level[perm], kind[perm], op_group, pred_ptr, pred_index, n_ops),
        optimizer_ops=np.flatnonzero(template.optype[perm] == OPT),
        source_ops=np.flatnonzero(np.array([not p for p in pred_lists])),
    )


def _levels(level: np.ndarray, kind: np.ndarray, group: np.ndarray, pred_ptr: np.ndarray, pred_index: np.ndarray,
            n_ops: int) -> list[Level]:
    """Per-level replay plans; ops must already be sorted by level, kind, group size, group.
    The predecessor columns of every level are views of one [max predecessors, op] table;
    the rest is plain Python over the template's few hundred ops (cheaper than numpy calls)."""
    counts = np.diff(pred_ptr)
    table = np.full((int(counts.max()), n_ops), n_ops + 1, dtype=np.int64)   # padding: the -inf row of the replay
    for j in range(len(table)):
        has = np.flatnonzero(counts > j)
        table[j, has] = pred_index[pred_ptr[has] + j]
    bounds = (np.flatnonzero(np.diff(level)) + 1).tolist()
    starts, ends = [0, *bounds], [*bounds, n_ops]
    widths = np.maximum.reduceat(counts, starts).tolist()
    own = np.concatenate([[0], np.cumsum(kind == OWN)]).tolist()
    multi = np.concatenate([[0], np.cumsum(kind == MULTI)]).tolist()
    groups = group.tolist()
    out = []
    for lo, hi, width in zip(starts, ends, widths):
        multi_lo = lo + own[hi] - own[lo]
        synced_lo = multi_lo + multi[hi] - multi[lo]
        out.append(Level(
            lo=lo, hi=hi, multi_lo=multi_lo, synced_lo=synced_lo, pred_columns=tuple(table[:width, lo:hi]),
            multi_runs=_group_runs(groups, multi_lo, synced_lo), synced_runs=_group_runs(groups, synced_lo, hi),
        ))
    return out


def _group_runs(groups: list[int], lo: int, hi: int) -> tuple[tuple[int, int, int], ...]:
    """(first op, number of groups, group size) of each run of equal-size groups in [lo, hi)
    (a group: consecutive ops with the same group id)."""
    runs: list[tuple[int, int, int]] = []
    first = lo
    while first < hi:
        end = first + 1
        while end < hi and groups[end] == groups[first]:
            end += 1
        size = end - first
        if runs and runs[-1][2] == size:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, size)
        else:
            runs.append((first, 1, size))
        first = end
    return tuple(runs)


# --------------------------------------------------------------------------- template and graph

class _Template:
    """The ops of the template slice (first step, dp_rank 0), indexed 0..n-1 (sorted by key)."""

    def __init__(self, columns: TraceColumns, rows: np.ndarray, pp_size: int, step: int):
        self.step = int(step)
        self.optype = columns.optype[rows].astype(np.int64)
        self.seq_id = columns.seq_id[rows].astype(np.int64)
        self.stage = columns.stage[rows].astype(np.int64)
        self.mc = columns.mc[rows].astype(np.int64)
        self.gmc = columns.gmc[rows].astype(np.int64)
        self.start = columns.start[rows].astype(np.float64)
        self.end = self.start + columns.duration[rows].astype(np.float64)
        self.n = len(rows)
        self.pp = pp_size
        self.vpp = max(int(self.mc.max()) + 1, 1) if self.n else 1
        self.index = {key: i for i, key in enumerate(zip(self.optype.tolist(), self.seq_id.tolist(), self.stage.tolist()))}
        # Observed order within each stage (start, seq_id, optype name), for `ordered`.
        self._observed = np.lexsort((_NAME_RANK[self.optype], self.seq_id, self.start, self.stage))
        self._stage_bounds = np.searchsorted(self.stage[self._observed], np.arange(pp_size + 1)).tolist()
        for stage in range(pp_size):
            if not (self.stage == stage).any():
                raise TraceStructureError(
                    f"stage has no ops in the template (step {self.step}, dp_rank 0) but the job has pp_size={pp_size}",
                    step=self.step, dp_rank=0, stage=stage,
                )

    def name(self, op: int) -> str:
        return _op_name(int(self.optype[op]), int(self.seq_id[op]), int(self.stage[op]))

    def find(self, optype: int, seq_id: int, stage: int) -> int | None:
        return self.index.get((optype, int(seq_id), int(stage)))

    def has(self, optype: int) -> bool:
        """Whether the template holds any op of this type (on any stage)."""
        return bool((self.optype == optype).any())

    def tail_op(self, optype: int, stage: int, why: str) -> list[int]:
        """[the op `{optype}_0_{stage}`], or [] when the job records no op of this type at all
        (a trainer without that step, e.g. no grad clipping, or a converted profiler trace
        that has no gc or layernorm all-reduce); missing on only some stages is an error."""
        return [self.require(optype, 0, stage, why)] if self.has(optype) else []

    def require(self, optype: int, seq_id: int, stage: int, why: str) -> int:
        op = self.find(optype, seq_id, stage)
        if op is None:
            raise MissingOpError(
                f"op {_op_name(optype, seq_id, stage)} is missing from the template (step {self.step}, dp_rank 0): {why}",
                step=self.step, dp_rank=0, stage=stage, op=_op_name(optype, seq_id, stage),
            )
        return op

    def ordered(self, stage: int, optypes: tuple[int, ...]) -> np.ndarray:
        """Ops of these types on a stage in observed order: start, seq_id, optype name."""
        ops = self._observed[self._stage_bounds[stage]:self._stage_bounds[stage + 1]]
        types = self.optype[ops]
        keep = types == optypes[0]
        for optype in optypes[1:]:
            keep |= types == optype
        return ops[keep]

    def error(self, cls, message: str, op: int | None = None, stage: int | None = None):
        return cls(message, step=self.step, dp_rank=0, stage=stage if op is None else int(self.stage[op]),
                   op=None if op is None else self.name(op))


class _Graph:
    """Dependency edges (predecessor sets) and comm groups over template ops."""

    def __init__(self, n: int):
        self.preds: list[set[int]] = [set() for _ in range(n)]
        self.op_group = np.full(n, -1, dtype=np.int64)
        self.noop = np.zeros(n, dtype=bool)
        self.group_members: list[list[int]] = []
        self.synced: list[bool] = []
        self.uses_dp = False
        self.dp_overlapped = False

    @property
    def n_groups(self) -> int:
        return len(self.group_members)

    @property
    def group_synced(self) -> np.ndarray:
        return np.array(self.synced, dtype=bool)

    def edge(self, before: int, after: int) -> None:
        self.preds[after].add(before)

    def chain(self, ops, after=()) -> None:
        """Each op waits for the previous one; the first waits for every op in `after`."""
        previous = list(after)
        for op in ops:
            for before in previous:
                self.edge(before, int(op))
            previous = [int(op)]

    def group(self, members: list[int], synced: bool) -> None:
        for op in members:
            self.op_group[op] = len(self.group_members)
        self.group_members.append([int(op) for op in members])
        self.synced.append(synced)

    def kinds(self) -> np.ndarray:
        kind = np.full(len(self.preds), OWN, dtype=np.int64)
        for members, synced in zip(self.group_members, self.synced):
            if synced:
                kind[members] = SYNCED
            elif len(members) > 1:
                kind[members] = MULTI
        return kind

    def levels(self, template: _Template) -> np.ndarray:
        """Topological level of each op, comm groups contracted to one node (Kahn's algorithm)."""
        n = len(self.preds)
        node = np.where(self.op_group >= 0, n + self.op_group, np.arange(n))
        node_preds: dict[int, set[int]] = {}
        for op, preds in enumerate(self.preds):
            node_preds.setdefault(int(node[op]), set()).update(int(node[p]) for p in preds)
        succ: dict[int, list[int]] = {v: [] for v in node_preds}
        indegree = {}
        for v, preds in node_preds.items():
            indegree[v] = len(preds)
            for u in preds:
                succ[u].append(v)
        level = {}
        frontier = [v for v, d in indegree.items() if d == 0]
        depth = 0
        while frontier:
            following = []
            for v in frontier:
                level[v] = depth
                for w in succ[v]:
                    indegree[w] -= 1
                    if indegree[w] == 0:
                        following.append(w)
            frontier, depth = following, depth + 1
        if len(level) < len(node_preds):
            self._raise_cycle(template, node, node_preds, set(node_preds) - set(level))
        return np.array([level[int(v)] for v in node], dtype=np.int64)

    def _raise_cycle(self, template: _Template, node: np.ndarray, node_preds, stuck: set[int]) -> None:
        members = {}
        for op, v in enumerate(node.tolist()):
            members.setdefault(v, []).append(op)
        # Walk predecessors inside the stuck set until a node repeats: that closes a cycle.
        v = min(stuck)
        path, seen = [], {}
        while v not in seen:
            seen[v] = len(path)
            path.append(v)
            v = min(u for u in node_preds[v] if u in stuck)
        cycle = path[seen[v]:]
        names = [" + ".join(template.name(op) for op in members[u]) for u in cycle]
        first = members[cycle[0]][0]
        raise template.error(
            CycleError,
            "dependency cycle (comm groups contracted; the replay would deadlock): "
            + " -> ".join(reversed(names + names[:1])),
            op=first,
        )

    def check_connected(self, template: _Template) -> None:
        """Every op must be linked (by dependencies or comm groups) to a step's optimizer,
        except p2p no-ops, which may form chains of their own."""
        links = [(p, op) for op, preds in enumerate(self.preds) for p in preds]
        links += [(op, members[0]) for members in self.group_members for op in members[1:]]
        roots = np.array(components(len(self.preds), links))
        with_optimizer = set(roots[template.optype == OPT].tolist())
        loose = ~np.isin(roots, list(with_optimizer)) & ~self.noop
        if loose.any():
            ops = np.flatnonzero(loose)
            ops = ops[np.lexsort((template.seq_id[ops], template.start[ops]))]
            listed = ", ".join(template.name(op) for op in ops[:6]) + (" ..." if len(ops) > 6 else "")
            raise template.error(
                DisconnectedGraphError,
                f"{len(ops)} op(s) not linked to any optimizer op by dependencies or comm groups ({listed}); "
                "the dependency model has no place for them: check that the op types and seq_ids match the job's "
                "parallelism (e.g. DP comm ops in a job without DP, or an extra tail op)",
                op=int(ops[0]),
            )


def _build_graph(template: _Template, dp_size: int, meta: JobMeta) -> _Graph:
    graph = _Graph(template.n)
    pp = template.pp
    _p2p_dependencies(template, graph, meta.host_compute)
    for stage in range(pp):
        graph.chain(template.ordered(stage, (FWD, BWD, WGT)))   # a stage computes one op at a time
        compute = template.ordered(stage, (FWD, BWD))
        for optype in P2P:
            graph.chain(template.ordered(stage, (optype,)))
        _first_backward_p2p(template, graph, stage, compute)

    graph.uses_dp = dp_size * int(meta.dsp_size) > 1
    graph.dp_overlapped = bool((template.optype == SEP).any())
    if graph.uses_dp:
        for stage in range(pp):
            graph.chain(template.ordered(stage, (AG, RS)))
        _chunk_dp_dependencies(template, graph)
    _step_tail(template, graph)
    _in_compute_collectives(template, graph, meta.host_compute)

    # Comm groups beyond p2p: DP collectives (each synchronised over DP ranks), embedding
    # all-reduce between the first and last stage, clip over all stages and DP ranks.
    if graph.uses_dp:
        for op in np.flatnonzero(np.isin(template.optype, (AG, RS, SEP))):
            graph.group([int(op)], synced=True)
    if template.has(EMB):
        embedding = sorted({0, pp - 1})
        graph.group([template.require(EMB, 0, stage, "the embedding all-reduce links the first and last stage") for stage in embedding], synced=False)
    if template.has(CLIP):
        graph.group([template.require(CLIP, 0, stage, "the grad-norm all-reduce synchronises all workers") for stage in range(pp)], synced=True)
    return graph


def _in_compute_collectives(template: _Template, graph: _Graph, host_compute: bool = False) -> None:
    """Collectives of a group spanning workers inside the step (all-to-all, group-collective): in
    start order on a stream of their own per stage, each after the last compute op done when it
    started (the one before its launch), and before the compute op that starts when it ends
    after the compute stream idled (it waited for it: the converter cuts a compute span at the
    collectives it issued), else before the optimizer when it ended before that started. Where
    the thread that computes is the one that called the collective (host_compute: CPU ranks), an
    idle stream means the thread was blocked in the call: the next compute waited for it whatever
    untraced time the thread spent between the two. Each synchronises its group over the DP
    ranks, like the DP collectives."""
    for stage in range(template.pp):
        ops = template.ordered(stage, IN_COMPUTE)
        if not len(ops):
            continue
        graph.chain(ops)
        compute = template.ordered(stage, (FWD, BWD, WGT))
        starts, ends = template.start[compute], template.end[compute]
        tail = template.require(OPT, 0, stage, "every stage ends its step with the optimizer")
        reached = np.maximum.accumulate(ends) if len(ends) else ends
        for op in ops.tolist():
            # the compute it followed: the last one done when it started (on a GPU the compute
            # launched after it may start first, while its stream waits for the compute before it)
            launched_in = int(np.searchsorted(reached, template.start[op] + NOOP_TOLERANCE, side="right")) - 1
            if launched_in >= 0:
                graph.edge(int(compute[launched_in]), op)
            waiting = max(np.searchsorted(starts, template.end[op] - NOOP_TOLERANCE, side="left"), launched_in + 1)
            idle = waiting < len(compute) and (waiting == 0 or ends[waiting - 1] <= template.end[op] + NOOP_TOLERANCE)
            if idle and (host_compute or starts[waiting] - template.end[op] <= NOOP_TOLERANCE):
                graph.edge(op, int(compute[waiting]))
            elif template.end[op] <= template.start[tail] + NOOP_TOLERANCE:
                graph.edge(op, tail)
        for op in ops.tolist():
            graph.group([op], synced=graph.uses_dp)


def _p2p_dependencies(template: _Template, graph: _Graph, host_compute: bool = False) -> None:
    """Match each send/recv to the compute op it serves, mark no-ops, pair peers. The peer is the
    stage holding the neighbouring model chunk (`_placement`); an op whose neighbour chunk does not
    exist or runs on its own stage is a no-op. Valid ops pair by order per channel (optype, stage,
    peer stage): with chunk g on stage g mod pp that is the k-th forward-send of stage s with the
    k-th forward-recv of stage s+1 (mod pp), as METHOD.md section 2 states.

    A recv follows the previous compute of its direction (METHOD.md). With host_compute (the
    compute ran on the thread that issues the recv: CPU jobs), it also follows the compute op run
    just before the one it serves, of any kind, when the template saw it issued after that op
    ended: a thread that computes one op at a time issues nothing during it. Without this, a
    schedule that runs other work between two computes of a direction (1F1B's steady state,
    interleaved and zero-bubble schedules) replays its recvs early and the gap as launch delay."""
    pp, total_chunks = template.pp, template.vpp * template.pp
    placement = _placement(template)
    stream_before = {}   # compute op -> the compute op run just before it on its stage
    if host_compute:
        for stage in range(pp):
            stream = template.ordered(stage, (FWD, BWD, WGT)).tolist()
            stream_before.update(zip(stream[1:], stream[:-1]))
    valid: dict[tuple[int, int, int, int], int] = {}   # (optype, stage, peer stage, k) -> op
    counted: collections.Counter = collections.Counter()   # (optype, stage, peer stage) -> valid ops so far
    for stage in range(pp):
        for compute_type, send, recv in ((FWD, FSEND, FRECV), (BWD, BSEND, BRECV)):
            compute = template.ordered(stage, (compute_type,))
            for optype in (send, recv):
                ops = template.ordered(stage, (optype,))
                if not len(ops):
                    continue
                if not len(compute):
                    raise template.error(TraceStructureError, f"{OPTYPES[optype]} ops on a stage without {OPTYPES[compute_type]} ops", op=int(ops[0]))
                if optype == recv:   # a recv after the last compute of its direction started serves nothing
                    active = template.start[ops] <= template.start[compute].max() + NOOP_TOLERANCE
                else:                # a send that ended before the first compute ended serves nothing
                    active = template.end[ops] >= template.end[compute].min() - NOOP_TOLERANCE
                count, n_compute = int(active.sum()), len(compute)
                compute_seq = 0
                if count != n_compute:
                    if stage not in (0, pp - 1):
                        raise template.error(
                            TraceStructureError,
                            f"{count} active {OPTYPES[optype]} ops for {n_compute} {OPTYPES[compute_type]} ops: "
                            "a middle pipeline stage needs one per compute op", stage=stage,
                        )
                    if count not in (0, n_compute - 1):
                        raise template.error(
                            TraceStructureError,
                            f"{count} active {OPTYPES[optype]} ops for {n_compute} {OPTYPES[compute_type]} ops: "
                            "a pipeline end may lack at most one", stage=stage,
                        )
                    if optype == recv and count == n_compute - 1:
                        compute_seq = 1   # the first recv of the stage was not recorded: skip its compute
                peer_type, chunk_offset = _PEER[optype]
                for op, is_active in zip(ops.tolist(), active.tolist()):
                    if not is_active:
                        graph.noop[op] = True
                        continue
                    served = template.find(compute_type, compute_seq, stage)
                    if served is None:
                        raise template.error(
                            TraceStructureError,
                            f"no {OPTYPES[compute_type]} with seq_id {compute_seq} for this op to serve", op=op,
                        )
                    compute_seq += 1
                    peer_chunk = int(template.gmc[served]) + chunk_offset
                    # no neighbouring chunk, or the neighbour runs here (a V-shaped schedule's turn)
                    peer_stage = int(placement[peer_chunk]) if 0 <= peer_chunk < total_chunks else stage
                    graph.noop[op] = peer_stage == stage
                    if optype == send:
                        graph.edge(served, op)
                    else:
                        graph.edge(op, served)
                        previous = template.find(compute_type, int(template.seq_id[served]) - 1, stage)
                        if previous is not None:
                            graph.edge(previous, op)
                        before = stream_before.get(served)
                        if before is not None and template.end[before] <= template.start[op] + NOOP_TOLERANCE:
                            graph.edge(before, op)
                    if not graph.noop[op]:
                        channel = (optype, stage, peer_stage)
                        valid[(*channel, counted[channel])] = op
                        counted[channel] += 1
    for (optype, stage, peer_stage, k), op in sorted(valid.items()):
        peer_type = _PEER[optype][0]
        peer = valid.get((peer_type, peer_stage, stage, k))
        if peer is None:
            peer_name = f"{OPTYPES[peer_type]} number {k} (counting valid ops) on stage {peer_stage} from stage {stage}"
            raise template.error(MissingPeerError, f"its peer {peer_name} is missing or a no-op", op=op)
        if optype in (FSEND, BSEND):
            graph.group([op, peer], synced=False)
    for op in np.flatnonzero(graph.noop):
        graph.group([int(op)], synced=False)


def _placement(template: _Template) -> np.ndarray:
    """The stage holding each global model chunk (gmc): chunk g on stage g mod pp unless the trace's
    compute ops place it elsewhere (V-shaped schedules hold chunks s and 2 pp - 1 - s on stage s)."""
    pp, total = template.pp, template.vpp * template.pp
    placement = np.arange(total) % pp
    compute = np.flatnonzero(np.isin(template.optype, (FWD, BWD)) & (template.gmc >= 0) & (template.gmc < total))
    if not len(compute):
        return placement
    pairs = np.unique(np.stack([template.gmc[compute], template.stage[compute]]), axis=1, return_index=True)[0]   # (no numpy.ma)
    chunks, counts = np.unique(pairs[0], return_counts=True)
    if (counts > 1).any():
        chunk = int(chunks[counts > 1][0])
        op = int(compute[template.gmc[compute] == chunk][0])
        raise template.error(TraceStructureError, f"model chunk (gmc) {chunk} has compute on stages "
                             f"{sorted(set(pairs[1][pairs[0] == chunk].tolist()))}: a chunk runs on one stage", op=op)
    placement[pairs[0]] = pairs[1]
    return placement


def _first_backward_p2p(template: _Template, graph: _Graph, stage: int, compute: np.ndarray) -> None:
    """The first backward send/recv waits for the forward compute two places before the first backward."""
    backward = np.flatnonzero(template.optype[compute] == BWD)
    if not len(backward):
        raise template.error(MissingOpError, "stage has no backward-compute op", stage=stage)
    first = int(backward[0])
    if first < 2:
        return   # no pipeline warm-up (pp = 1 or a single microbatch)
    for before in (first - 1, first - 2):
        if template.optype[compute[before]] != FWD:
            raise template.error(
                TraceStructureError,
                f"the compute op {before - first} places before the first backward is not a forward", op=int(compute[before]),
            )
    for optype in (BRECV, BSEND):
        op = template.find(optype, 0, stage)
        if op is not None:
            graph.edge(int(compute[first - 2]), op)


def _chunk_dp_dependencies(template: _Template, graph: _Graph) -> None:
    """params-all-gather of a chunk precedes its first forward; with overlapped DP the
    chunk's last backward precedes its first grads-reduce-scatter."""
    for stage in range(template.pp):
        compute = template.ordered(stage, (FWD, BWD))
        gathers = np.flatnonzero((template.stage == stage) & (template.optype == AG))
        assigned = set()
        for op in gathers[np.argsort(-template.seq_id[gathers], kind="stable")].tolist():   # last gather per chunk
            chunk = int(template.mc[op])
            if chunk in assigned:
                continue
            forwards = compute[(template.optype[compute] == FWD) & (template.mc[compute] == chunk)]
            if not len(forwards):
                raise template.error(TraceStructureError, f"no forward-compute of model chunk {chunk} for this all-gather", op=op)
            graph.edge(op, int(forwards[np.argmin(template.start[forwards])]))
            assigned.add(chunk)
        if not graph.dp_overlapped:
            continue
        scatters = np.flatnonzero((template.stage == stage) & (template.optype == RS))
        assigned = set()
        for op in scatters[np.argsort(template.seq_id[scatters], kind="stable")].tolist():   # first scatter per chunk
            chunk = int(template.mc[op])
            if chunk in assigned:
                continue
            backwards = compute[(template.optype[compute] == BWD) & (template.mc[compute] == chunk)]
            if not len(backwards):
                raise template.error(TraceStructureError, f"no backward-compute of model chunk {chunk} for this reduce-scatter", op=op)
            graph.edge(int(backwards[np.argmax(template.end[backwards])]), op)
            assigned.add(chunk)


def _step_tail(template: _Template, graph: _Graph) -> None:
    """gc after the last compute, then the per-stage tail chain ending in the optimizer."""
    pp = template.pp
    for stage in range(pp):
        compute = template.ordered(stage, (FWD, BWD, WGT))
        if not len(compute):
            raise template.error(MissingOpError, "stage has no compute ops", stage=stage)
        last_compute = int(compute[np.argmax(template.end[compute])])
        gc = template.tail_op(GC, stage, "gc follows the last compute op of every stage")
        for op in gc:
            graph.edge(last_compute, op)
        after = gc or [last_compute]
        layernorm = template.tail_op(LN, stage, "every stage ends its step with the layernorm all-reduce")
        embedding = template.tail_op(EMB, stage, "the first and last stage all-reduce embedding grads") if stage in (0, pp - 1) else []
        clip = template.tail_op(CLIP, stage, "every stage joins the grad-norm all-reduce before the optimizer")
        optimizer = template.require(OPT, 0, stage, "every stage ends its step with the optimizer")
        scatters = np.flatnonzero((template.stage == stage) & (template.optype == RS))
        if not graph.uses_dp:
            graph.chain([*layernorm, *embedding, *clip, optimizer], after=after)
            continue
        if not len(scatters):
            raise template.error(MissingOpError, "a job with data parallelism needs grads-reduce-scatter ops on every stage", stage=stage)
        n_scatter = int(template.seq_id[scatters].max()) + 1
        if graph.dp_overlapped:
            last_scatter = template.require(RS, n_scatter - 1, stage, "the last reduce-scatter precedes the step tail")
            separate = template.require(SEP, 0, stage, "overlapped DP all-reduces the separate grads before clipping")
            # (a converted trace may all-reduce more than one set of separate grads: all in the tail)
            more = [op for op in template.ordered(stage, (SEP,)).tolist() if op != separate]
            graph.chain([*layernorm, *embedding, separate, *more, *clip, optimizer], after=[last_scatter, *after])
        else:
            chain = [template.require(RS, i, stage, "non-overlapped DP reduce-scatters all grads in the tail") for i in range(n_scatter)]
            graph.chain([*layernorm, *embedding, *chain, *clip, optimizer], after=after)
