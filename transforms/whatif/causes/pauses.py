"""Untraced time between a worker's ops, and the pauses in it (CPU ranks).

On a CPU rank the thread that runs the model also runs Python between its ops: the interpreter's
own work, a DataLoader fetch, a garbage collection. None of it is a traced op; it is the gap
between ops while the worker neither computes nor waits in a recv or DP collective
(`untraced_gaps`). Its parts tell causes apart by physics, not by size:
- data loading: gap time inside `enumerate(DataLoader)` fetches (the trace's `data_wait`);
- a pause: a gap far beyond the job's usual largest gap per worker and step. Python's garbage
  collector stops the world in one piece per collection, where interpreter overhead spreads over
  every gap (a collection inside a forward leaves the same gap within the forward's span:
  `idle_within`); it may collect several times in a step (each time its thresholds are crossed),
  and what the worker loses is their sum;
- the rest: ordinary time between ops.
Where the trainer recorded its garbage collections (strag_collect's gc.callbacks record, the trace's
`gc_wait`), the pauses are the recorded collections themselves, whatever their pattern.
Otherwise `find_pauses` tests each non-data gap of a worker-step against the job's usual largest one
(median and robust spread over the worker-steps that pause too little to make a job straggle, so
a worker pausing in every step does not set the usual), Bonferroni over the cells at the job's
false-alarm rate: a gap no ordinary worker-step's largest reaches is a pause; a worker-step's
pauses also add up to half that share of a step (`CAUSE_SHARE`: what a listed cause must cost).
Pauses are the collector's (`collector`) when they recur and all fall where the collector runs: where
a forward begins or inside one (METHOD.md's GC stalls are forward-only, the forward being where a
step allocates the Python objects whose count triggers a collection), or between two of a worker's
steps (where its step opens, or after its last op: the loop's own Python and a trainer's planned
gc.collect()). Where the trace says when a rank left each step, the time after its last op is that
step's tail, untraced time too (`_step_tails`). Pauses inside the step before a collective, a
backward or the optimizer (an oversubscribed host's OS running another process) stay the worker's
untraced time.
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from transforms.whatif.kernel import covered_grouped, group_order   # compiled, the same floats as numpy's
from transforms.whatif.model import JobModel, median
from transforms.whatif.result import STRAGGLING_THRESHOLD
from schemas.trace import COMPUTE_OPTYPES, DP_COMM_OPTYPES, IN_COMPUTE_OPTYPES, OPTYPES

# the least share of the straggling threshold's share of a step that a worker's untraced time, or
# its pauses, must take to be a cause: what a listed cause's fix must remove in a straggling window
# (half of METHOD.md's 10%: a cause explains part of a straggling step, not all of it)
CAUSE_SHARE = 0.5

__all__ = ["CAUSE_SHARE", "p2p_partner", "untraced_gaps", "untraced_time", "idle_inside_compute", "Pauses", "find_pauses", "recurring",
           "at_collector_sites", "collector", "pause_fix", "pause_confidence", "inside_compute"]

_RECV = [OPTYPES.index("forward-recv"), OPTYPES.index("backward-recv")]
_FORWARD = OPTYPES.index("forward-compute")
_COMPUTE = [OPTYPES.index(name) for name in COMPUTE_OPTYPES]
# busy: computing, or blocked in a collective (DP, or one inside the step: a barrier, a broadcast, FSDP's
# gathers) waiting for its peers, which is no untraced work of the worker's own
_BUSY = [OPTYPES.index(name) for name in (*COMPUTE_OPTYPES, *DP_COMM_OPTYPES, *IN_COMPUTE_OPTYPES)]


def p2p_partner(model: JobModel) -> np.ndarray:
    """Per op, the other op of its comm group when the group is a pair (a p2p send/recv), else -1."""
    partner = np.full(len(model.op_group), -1)
    members = np.flatnonzero(model.op_group >= 0)
    order = members[np.argsort(model.op_group[members], kind="stable")]
    _, first, size = np.unique(model.op_group[order], return_index=True, return_counts=True)
    pairs = first[size == 2]
    partner[order[pairs]], partner[order[pairs + 1]] = order[pairs + 1], order[pairs]
    return partner


def untraced_gaps(model: JobModel, dp: int, stage: int, partner: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(ops of the stage, [len(ops), n_steps] seconds of each op's launch gap that worker (dp, stage)
    spent running none of its traced compute (overlapping gaps count once), of that the seconds
    inside DataLoader fetches (the trace's `data_wait` of an op is a fetch that ended by its start,
    laid out as [start - data_wait, start] on the worker's timeline), and the seconds Python's
    collector ran in it as the trainer recorded it (`gc_wait`, laid out the same way; None when the
    trace holds no record)). A launch delay (start - end of the op's dependencies)
    is the worker's own untraced time only where no compute op of the worker ran meanwhile. A recv
    the schedule posts after the computes in between, which the model starts after the previous
    compute of its direction, is the model's structure, not the worker's time; and a recv that
    starts with its peer's send (it was posted earlier and waited: the converter starts it there)
    is the peer's delay. A recv posted after its peer's send started was the worker's own lateness,
    from that send's start on (before it, the worker waited for the data).
    Where the trace says when each rank entered and left its steps (`step_entered`, `step_left`:
    CPU ranks), the last row is each worker-step's tail (op index n_ops: after its last op, until
    it left the step, `_step_tails`), and a gap before an op starts no earlier than the rank
    entered the step: time between two steps counts once, in the step the rank spent it in."""
    cached = model.__dict__.setdefault("_untraced_gaps", {})
    if stage not in cached or cached[stage][0] is not model.launch_delay:
        cached[stage] = (model.launch_delay, _stage_gaps(model, stage, p2p_partner(model) if partner is None else partner))
    ops, *parts = cached[stage][1]
    lanes = np.flatnonzero(model.lane_dp == dp)
    return ops, *(None if part is None else part[:, lanes] for part in parts)


def _stage_gaps(model: JobModel, stage: int, partner: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """untraced_gaps of every worker of a stage, computed at once: [ops, every lane], each lane (a
    DP rank's step) a timeline of its own."""
    ops = np.flatnonzero(model.op_stage == stage)
    recv = np.isin(model.op_optype[ops], _RECV)
    busy = ops[np.isin(model.op_optype[ops], _BUSY) | recv]
    peer = np.where(recv, partner[ops], -1)
    # where the compute ran on the thread that waits on the recvs (host_compute: CPU jobs), a recv
    # after a compute starts when that thread begins to wait (the converter moves it past the
    # computes and send issues in between): the gap before it is the thread's own time
    own_wait = recv & bool(model.meta.host_compute) & (model.pred_index[model.pred_ptr[ops]] < model.n_ops)
    out = np.zeros((len(ops), model.n_lanes))
    data = np.zeros_like(out)
    collected = None if model.gc_wait is None else np.zeros_like(out)
    started = model.observed_start
    start = started[ops]
    # a CPU rank arriving late at a step because it finished the previous one late: that tail is
    # the previous step's work (JobModel.carried_arrivals), not time between this step's ops
    carried = model.carried_arrivals()
    delay = model.launch_delay[ops]
    delay = np.maximum(delay - carried[ops], 0.0) if carried is not None else np.maximum(delay, 0.0)
    peer_start = started[np.maximum(peer, 0)]
    late = np.where((peer >= 0)[:, None], start > peer_start + 1e-6, True) | own_wait[:, None]
    waiting = (delay > 0) & (~recv[:, None] | late)
    row, lane = np.nonzero(waiting)
    gap_end = start[row, lane]
    gap_start = gap_end - delay[row, lane]
    # before a recv, the time until its peer's send began is waiting for the data, not lateness
    sent = np.where(peer[row] >= 0, peer_start[row, lane], -np.inf)
    gap_start = np.minimum(np.maximum(gap_start, sent), gap_end)
    tails = model.step_left is not None and model.step_entered is not None
    if tails:   # what the rank did before it entered the step is its previous step's tail, counted there
        gap_start = np.minimum(np.maximum(gap_start, model.step_entered[ops[row], lane]), gap_end)
    # gaps of ops that wait from the same moment (two ops free at the step's start) overlap: each
    # counts only the time no earlier-ending gap of its lane already counted (by end, then op)
    order = group_order(lane, gap_end)   # = np.lexsort((row, gap_end, lane)): np.nonzero gave rows in order
    ends = gap_end[order]
    counted = np.r_[-np.inf, ends[:-1]]
    counted[np.r_[True, lane[order][1:] != lane[order][:-1]]] = -np.inf
    gap_start[order] = np.minimum(np.maximum(gap_start[order], counted), ends)

    def spans_covered(mask: np.ndarray | None, begin: np.ndarray, finish: np.ndarray) -> np.ndarray:
        """Per gap, the time inside it that its lane's spans ([op, lane] begins and ends where `mask`,
        or all of them: the same spans in the same order, without gathering every cell) cover."""
        if mask is None:
            on = np.tile(np.arange(begin.shape[1]), begin.shape[0])
            return covered_grouped(lane, gap_start, gap_end, on, begin.ravel(), finish.ravel())
        at, on = np.nonzero(mask)
        return covered_grouped(lane, gap_start, gap_end, on, begin[at, on], finish[at, on])

    busy_time = spans_covered(None, started[busy], model.observed_end[busy])
    out[row, lane] = np.maximum(gap_end - gap_start - busy_time, 0.0)
    if model.data_wait is not None:
        waits = model.data_wait[ops]
        fetch = spans_covered(waits > 0, start - waits, start)
        data[row, lane] = np.minimum(fetch, out[row, lane])
    if collected is not None:
        waits = model.gc_wait[ops]
        ran = spans_covered(waits > 0, start - waits, start)
        collected[row, lane] = np.minimum(ran, out[row, lane] - data[row, lane])
    if not tails:
        return ops, out, data, collected
    tail, tail_data, tail_collected = _step_tails(model, ops)
    rows = (np.append(ops, model.n_ops), np.vstack([out, tail]), np.vstack([data, tail_data]))
    return (*rows, None if collected is None else np.vstack([collected, tail_collected]))


def _step_tails(model: JobModel, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[1, lanes] each worker-step's tail: seconds from its last op's end to where it left the step
    (`step_left`: its loop's prof.step() after the optimizer), its own untraced time (a planned
    gc.collect(), per-step callbacks) that no op of the step waits on; of that, the seconds inside
    DataLoader fetches and recorded collections, which the trace lays before the ops of the
    worker's next profiled step ([start - wait, start], on the absolute clock); the collections as
    the converter measured them in the tail (`gc_tail`) where the trace has that column (the last
    profiled step has no next step to hold them)."""
    last = model.observed_end[ops].max(axis=0)
    left = np.maximum(model.step_left[ops].max(axis=0), last)
    tail = (left - last)[None, :]
    lane_start = np.repeat(np.asarray(model.step_start, dtype=np.float64), model.dp_size)   # lanes onto one clock
    covered = []
    for waits, measured in ((model.data_wait, None), (model.gc_wait, model.gc_tail)):
        part = np.zeros_like(tail)
        if measured is not None:   # the converter measured them in the tail
            part[0] = measured[ops].max(axis=0)
        elif waits is not None and tail.any():
            at, on = np.nonzero(waits[ops] > 0)
            if len(at):   # each worker's spans on its own timeline (its lanes, one after another)
                ends = model.observed_start[ops[at], on] + lane_start[on]
                part[0] = covered_grouped(model.lane_dp, last + lane_start, left + lane_start,
                                          model.lane_dp[on], ends - waits[ops[at], on], ends)
        covered.append(np.minimum(part, tail - sum(covered)))
    return tail, covered[0], covered[1]


def untraced_time(model: JobModel, dp: int, stage: int, partner: np.ndarray | None = None) -> np.ndarray:
    """Seconds per step worker (dp, stage) spends in untraced time: the gaps between its ops
    (`untraced_gaps`, data loading included) and the stretches inside its compute ops in which its
    thread ran no traced op (`idle_inside_compute`: Python stopped mid-forward is no compute either)."""
    ops, gaps, _, _ = untraced_gaps(model, dp, stage, partner)
    inner = idle_inside_compute(model)
    if inner is None or not len(ops):
        return gaps.sum(axis=0)
    return gaps.sum(axis=0) + inner[np.ix_(ops[ops < model.n_ops], np.flatnonzero(model.lane_dp == dp))].sum(axis=0)


def idle_inside_compute(model: JobModel) -> np.ndarray | None:
    """[op, lane] seconds of the longest stretch inside each compute op in which its thread ran no
    traced op (the trace's `idle_within`; 0 for other ops); None when the trace has no such record
    (GPU ranks). Computed once per model."""
    if model.idle_within is None:
        return None
    cached = model.__dict__.get("_idle_inside_compute")
    if cached is None:
        cached = np.where(np.isin(model.op_optype, _COMPUTE)[:, None], np.nan_to_num(model.idle_within), 0.0)
        model.__dict__["_idle_inside_compute"] = cached
    return cached


@dataclasses.dataclass(frozen=True)
class Pauses:
    """Untraced time per worker and step ([pp, n_steps, dp] seconds): `untraced` outside data
    loading, `data` inside DataLoader fetches, `largest` the largest single non-data gap; `cells`:
    the (dp, stage, step index) pauses with their excess over the job's usual largest gap
    (`typical`), summed over the cell's pauses; `limit` the size a single pause must exceed;
    `where`: every pause's (op, lane), the op it ends at (a gap before the op) or falls inside (a
    compute op's `idle_within`: `inside` is true for those), cell by cell.
    recorded: the trainer recorded its garbage collections (`gc_wait`): the cells are then the
    worker-steps whose recorded collections reach `limit` (the straggling share of a step), their
    excess the collections' seconds: GC known, not inferred from a gap's size."""

    untraced: np.ndarray
    data: np.ndarray
    largest: np.ndarray
    typical: float
    limit: float
    cells: tuple[tuple[int, int, int, float], ...]
    where: tuple[tuple[int, int], ...]
    recorded: bool = False
    inside: tuple[bool, ...] = ()
    counts: tuple[int, ...] = ()     # per cell, how many pauses (gaps) it holds; () when recorded

    def workers(self) -> list[tuple[int, int]]:
        """Workers with a pause, most paused first."""
        total: dict[tuple[int, int], float] = {}
        for d, p, _, excess in self.cells:
            total[(d, p)] = total.get((d, p), 0.0) + excess
        return sorted(total, key=lambda w: (-total[w], w))

    def excess_of(self, worker: tuple[int, int]) -> np.ndarray:
        """[n_steps] seconds of pause beyond the usual largest gap, per step, of one worker."""
        out = np.zeros(self.untraced.shape[1])
        for d, p, s, excess in self.cells:
            if (d, p) == worker:
                out[s] += excess
        return out

    def evidence(self, steps: np.ndarray) -> dict:
        counts = self.counts or (1,) * len(self.cells)
        return {"pauses": [{"dp_rank": d, "stage": p, "step": int(steps[s]), "seconds": e + self.typical,
                            "excess": e, "count": n} for (d, p, s, e), n in zip(self.cells, counts)],
                "pause_limit": self.limit, "typical_largest_gap": self.typical, "gc_recorded": self.recorded,
                "data_loading_share": float(self.data.sum() / max(self.data.sum() + self.untraced.sum(), 1e-12))}


def find_pauses(model: JobModel, alpha: float = 0.01, straggling: float = STRAGGLING_THRESHOLD) -> Pauses:
    """Pauses of every worker (module docstring). A pause is a non-data gap (before an op, or inside
    a compute op: the trace's `idle_within`, a stretch in which the compute's thread ran no traced
    op) beyond the job's median largest gap per worker-step by a robust z at Bonferroni-corrected
    `alpha`; a worker-step holds pauses when theirs add up to `CAUSE_SHARE` x (straggling - 1) of
    the median step time beyond that median each (a listed cause's least share). Computed once per
    model and arguments (the worker test and the python-gc cause both ask)."""
    cached = model.__dict__.get("_pauses")
    if cached is not None and cached[0] is model.launch_delay and cached[1] == (alpha, straggling):
        return cached[2]
    pauses = _find_pauses(model, alpha, straggling, p2p_partner(model))
    model.__dict__["_pauses"] = (model.launch_delay, (alpha, straggling), pauses)
    return pauses


def _find_pauses(model: JobModel, alpha: float, straggling: float, partner: np.ndarray) -> Pauses:
    """find_pauses, computed."""
    shape = (model.pp_size, model.n_steps, model.dp_size)
    untraced, data, largest = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    collected = np.zeros(shape) if model.gc_wait is not None else None
    gc_at = np.zeros(shape, dtype=np.int64)
    gaps_of = {}   # (dp, stage) -> (ops, [ops, steps] untraced gaps outside data loading, ... inside compute ops)
    for p in range(model.pp_size):
        for d in range(model.dp_size):
            ops, gaps, loading, ran = untraced_gaps(model, d, p, partner)
            lanes = np.flatnonzero(model.lane_dp == d)
            own = gaps - loading
            real = ops < model.n_ops   # the last row may be the steps' tails (untraced_gaps)
            inner = np.zeros_like(own)
            if model.idle_within is not None:
                inner[real] = model.idle_within[np.ix_(ops[real], lanes)]
            untraced[p, :, d], data[p, :, d] = own.sum(axis=0), loading.sum(axis=0)
            gaps_of[(d, p)] = (ops, own, inner)
            if len(ops):
                largest[p, :, d] = np.maximum(own.max(axis=0), inner.max(axis=0))
                if collected is not None:   # recorded collections in the gaps, and inside the ops (mid-compute)
                    within = np.zeros_like(ran)
                    if model.gc_within is not None:
                        within[real] = model.gc_within[np.ix_(ops[real], lanes)]
                    collected[p, :, d] = ran.sum(axis=0) + within.sum(axis=0)
                    gc_at[p, :, d] = ops[np.maximum(ran, within).argmax(axis=0)]
    floor = CAUSE_SHARE * (straggling - 1.0) * float(median(model.observed_end.max(axis=0) - model.observed_start.min(axis=0)))
    values = largest.ravel()
    if collected is not None:   # recorded: the collections themselves, worth the straggling share of a step
        cells, where = [], []
        for p, s, d in zip(*np.nonzero(collected >= floor)):
            cells.append((int(d), int(p), int(s), float(collected[p, s, d])))
            where.append((int(gc_at[p, s, d]), int(s * model.dp_size + d)))
        typical = float(median(values[values < floor])) if (values < floor).any() else 0.0
        return Pauses(untraced, data, largest, typical, floor, tuple(cells), tuple(where), recorded=True)
    z = statistics.NormalDist().inv_cdf(1.0 - alpha / max(len(values), 1))
    # the job's usual largest gap, from the worker-steps that could hold no pause: first those whose
    # largest gap is below the pauses' least sum, then those without the pauses found
    # (a worker pausing in every step, in one piece or several, is half the cells of a two-rank job
    # and must not set the usual); until the pauses found stay the same. Where every worker-step's
    # largest gap reaches that sum (a job whose ordinary Python between ops is that long), the floor
    # tells no cell apart: the lower half of the cells is the usual (pausing cells are at most half,
    # the median's own breakdown point), never an empty set whose usual gap of 0 s makes every gap a pause
    usual = values < floor if (values < floor).any() else values <= float(median(values))
    first = usual
    found = None
    for _ in range(8):
        typical = float(median(values[usual])) if usual.any() else 0.0
        spread = 1.4826 * float(median(np.abs(values[usual] - typical))) if usual.any() else 0.0
        excess, hits = _pauses_beyond(gaps_of, shape, typical + z * spread, typical)
        paused = excess >= floor if floor > 0 else excess > 0
        if found is not None and np.array_equal(paused, found):
            break
        found = paused
        usual = first & ~paused.ravel()
    cells, where, inside, counts = [], [], [], []
    for p, s, d in zip(*np.nonzero(found)):
        cells.append((int(d), int(p), int(s), float(excess[p, s, d])))
        counts.append(len(hits[(int(p), int(s), int(d))]))
        for op, is_inside in hits[(int(p), int(s), int(d))]:
            where.append((op, int(s * model.dp_size + d)))
            inside.append(is_inside)
    return Pauses(untraced, data, largest, typical, typical + max(z * spread, 0.0), tuple(cells), tuple(where),
                  inside=tuple(inside), counts=tuple(counts))


def _pauses_beyond(gaps_of: dict, shape: tuple, limit: float, typical: float
                   ) -> tuple[np.ndarray, dict[tuple[int, int, int], list[tuple[int, bool]]]]:
    """([pp, n_steps, dp] seconds of pause beyond `typical` per worker-step: the sum over its gaps
    beyond `limit`, before ops and inside compute ops; per (stage, step, dp) its pauses' (op, inside
    the op), largest first)."""
    excess = np.zeros(shape)
    hits: dict[tuple[int, int, int], list[tuple[int, bool]]] = {}
    for (d, p), (ops, own, inner) in gaps_of.items():
        for gaps, is_inside in ((own, False), (inner, True)):
            rows, steps = np.nonzero(gaps > limit)
            if not len(rows):
                continue
            sizes = gaps[rows, steps] - typical
            np.add.at(excess[p, :, d], steps, sizes)
            for row, step, size in zip(rows.tolist(), steps.tolist(), sizes.tolist()):
                hits.setdefault((p, step, d), []).append((size, int(ops[row]), is_inside))
    return excess, {key: [(op, is_inside) for _, op, is_inside in sorted(found, key=lambda h: (-h[0], h[1]))]
                    for key, found in hits.items()}


def inside_compute(model: JobModel, pauses: Pauses) -> np.ndarray | None:
    """[op, lane] seconds of pause inside compute ops: the collections the trainer recorded inside
    them (`gc_within`), or each pause found inside a compute op (its `idle_within`). Not the
    compute's own time: a worker's work measured against its peers' leaves it out (the replay keeps
    it, it ran). None when there is none."""
    if pauses.recorded:
        if model.gc_within is None:
            return None
        out = np.where(np.isin(model.op_optype, _COMPUTE)[:, None], model.gc_within, 0.0)
        return out if out.any() else None
    if model.idle_within is None:
        return None
    out = np.zeros_like(model.idle_within)
    for (op, lane), is_inside in zip(pauses.where, pauses.inside):
        if is_inside:   # the pause is the stretch inside the op
            out[op, lane] = model.idle_within[op, lane]
    return out if out.any() else None


def recurring(pauses: Pauses) -> bool:
    """Pauses that recur (two or more): a collector runs again and again; one pause once is the
    job's own variation (a preempted moment). Recorded collections need no recurrence: one that
    takes the straggling share of a step is GC for sure."""
    return len(pauses.cells) >= (1 if pauses.recorded else 2)


def at_collector_sites(model: JobModel, pauses: Pauses) -> bool:
    """Every worker-step's pause falls where Python's collector runs in a training step: where a
    forward begins or inside one, or between two steps: where the worker's step opens (a gap before
    an op that waits for nothing of the step) or after its last op (the step's tail). The
    stop-the-world stalls of METHOD.md's python-gc row are forward-only because the forward is
    where a step allocates its Python objects, and the collector runs when allocations cross its
    thresholds; between two iterations the loop runs its own Python (the batch's
    collation, per-step callbacks) and a trainer's planned collections (gc.collect() every K steps,
    METHOD.md's planned GC), before anything of the next step began. A pause before a backward, the
    optimizer or a transfer inside the step has no such reason to be the collector.
    A worker-step's pause is its largest: a collection stops the world in one piece, and where the
    job's gaps are even the limit sits close to them, so a step's ordinary gaps a little over it
    count towards its pause time but say nothing of where the collector ran."""
    if not pauses.where:
        return False
    opening = np.append(model.pred_index[model.pred_ptr[:-1]] == model.n_ops, True)   # n_ops: a step's tail
    inside = pauses.inside or (False,) * len(pauses.where)

    def site(i: int) -> bool:
        op = pauses.where[i][0]
        return (op < model.n_ops and int(model.op_optype[op]) == _FORWARD) or (bool(opening[op]) and not inside[i])

    largest = np.cumsum((0, *pauses.counts))[:-1] if pauses.counts else range(len(pauses.where))   # each cell's first
    return all(site(int(i)) for i in largest)


def collector(model: JobModel, pauses: Pauses) -> bool:
    """Recurring pauses that are Python's collector: recorded by the trainer (whichever steps and
    workers they strike), or all where the collector runs (`at_collector_sites`: at forwards, or
    between two of a worker's steps), on one worker in every step or every few (an explicit
    gc.collect()) or a different worker in different steps (the thresholds of each process). A
    pause inside the step before a collective, a backward or the optimizer is something else: on
    an oversubscribed host, the OS running another process. What a DataLoader fetch holds is never
    a pause."""
    return recurring(pauses) and (pauses.recorded or at_collector_sites(model, pauses))


def pause_fix(model: JobModel, pauses: Pauses, traced_step: np.ndarray) -> tuple[float, float, float, float, np.ndarray]:
    """(mean wall-clock step time as it ran, without the pauses with planned GC paid back, planned
    GC seconds per step, share of the untraced time beyond the traced replay (`traced_step`, per
    step) that the pauses make, seconds the pauses take out of each step). Measured, not replayed: the job waits for its slowest worker, so a step without
    its pauses is shorter by its largest pause beyond the usual gap (a recorded launch delay is
    pinned to the time its dependencies ended as they ran, so a replay with the others' delays
    keeps the pause's echo). Planned GC: the same collections, every worker at once: the mean pause
    per worker and step."""
    span = _step_spans(model)
    ran = _wall_steps(model, span)
    saving = np.zeros(model.n_steps)
    for _, _, s, excess in pauses.cells:
        saving[s] = max(saving[s], excess)
    saving = np.minimum(saving, ran)
    planned = sum(excess for *_, excess in pauses.cells) / (model.dp_size * model.pp_size * model.n_steps)
    untraced = float(np.maximum(span - np.asarray(traced_step, dtype=np.float64), 0.0).sum())
    share = float(saving.sum()) / untraced if untraced > 0 else 0.0
    return float(ran.mean()), float((ran - saving).mean()) + planned, planned, float(min(max(share, 0.0), 1.0)), saving


def _step_spans(model: JobModel) -> np.ndarray:
    """[n_steps] seconds from a step's start to its last op's end, over every DP rank."""
    return model.observed_end.max(axis=0).reshape(model.n_steps, model.dp_size).max(axis=1)


def _wall_steps(model: JobModel, span: np.ndarray) -> np.ndarray:
    """Seconds each step took on the wall clock: from its start to the next step's (what GPU-hours
    pay, the time between one step's last op and the next one's first included), the last step
    its op span (`span`: _step_spans) plus the median of that time between steps (its own span
    alone without others)."""
    period = np.diff(np.asarray(model.step_start, dtype=np.float64))
    if not len(period) or not np.all(period > 0):
        return span
    between = float(median(np.maximum(period - span[:-1], 0.0)))
    return np.append(np.maximum(period, span[:-1]), span[-1] + between)


def pause_confidence(pauses: Pauses, alpha: float) -> float:
    """1 - the Bonferroni-adjusted p-value of the least clear pause (its z against the usual largest
    gap's spread), at least 1 - alpha: every pause passed the test at alpha. Recorded collections:
    1 - alpha (what they are is known; that they cost the straggling share is measured)."""
    if pauses.recorded:
        return 1.0 - alpha
    spread = 1.4826 * float(median(np.abs(pauses.largest.ravel() - pauses.typical)))
    if spread <= 0:
        return 1.0
    least = min(excess for *_, excess in pauses.cells)
    tail = statistics.NormalDist().cdf(-least / spread) * pauses.largest.size
    return float(max(1.0 - min(tail, 1.0), 1.0 - alpha))
