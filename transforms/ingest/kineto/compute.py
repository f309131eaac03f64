"""Per-microbatch compute spans of one rank: schedule labels (their GPU span where present) or, without labels, runs of the main thread's top-level ops."""
from __future__ import annotations

import collections
import re
from collections.abc import Mapping

import numpy as np

from transforms.ingest.kineto.spans import BWD, COLL, FWD, IN_COMPUTE_COLLECTIVES, RECV, SEND, Group, _STEP



# labels that are no op of the model and lose nothing: c10d's own ranges (`nccl:all_reduce`, whose
# kernels are read), DDP's forward wrapper, data loading, the schedule's comm actions
# (the wrappers' annotations too: FSDP2's `FSDP::pre_forward (layers.0)`, Lightning's `[pl][profile]...`; the
# work they wrap is read from its ops and collectives), and the schedule's FSDP actions (`PP:0UNSHARD`,
# `PP:0RESHARD`: the all-gathers inside them are read as collectives; empty without FSDP)
_UNMAPPED_QUIET = re.compile(r"^(Optimizer\.zero_grad#|## |enumerate\(DataLoader\)|PP:\w*?(RECV|SEND|WAIT|REDUCE|UNSHARD|RESHARD)"
                             r"|nccl:|gloo:"
                             r"|DistributedDataParallel\.forward|FSDP::|\[pl\]\[)")
_BACKWARD_OP = "autograd::engine::evaluate_function:"
# Ops that end a run of compute on the main thread: p2p, labels, the optimizer.
_RUN_BREAK = ("c10d::send", "c10d::recv", "gloo:send", "gloo:recv", "c10d::batch_isend_irecv", "Optimizer.")
# Ops that neither compute nor break a run (collective issue calls inside DDP's backward hooks).
_RUN_NEUTRAL = ("c10d::", "gloo:", "record_param_comms", "nccl:")


def _unlabeled_compute(ops: list, steps: list[tuple[float, float]], optimizer: list, *, forward: bool,
                       autograd: np.ndarray | None = None) -> list:
    """Per-microbatch compute spans of a trace without schedule labels (torch.distributed.pipelining's
    Schedule1F1B, plain DDP), from the main thread's top-level ops in each step: a run of
    `autograd::engine::evaluate_function:` ops is one microbatch's backward, a run of other ops
    between p2p calls is a forward when a backward run follows it in the step (trailing grad-sync
    copies are not), and a run ends where the thread waited on a p2p op (a gloo span ended); without
    fwdbwd flows, runs shorter than a tenth of the step's median backward run are bookkeeping between
    p2p calls, not compute, and of more forward runs than backward ones the longest are the forwards. With `autograd` (sorted starts of the forward ops autograd recorded for a backward:
    the trace's `fwdbwd` flows), a forward run is the span of its top-level ops that hold such an
    op: data loading, zeroing grad buffers, splitting inputs or targets and logging record none,
    so they are neither a microbatch nor part of one (their time stays untraced, as launch delay).
    Returns label tuples (kind, start, end, mb=-1, chunk=-1, name)."""
    if not len(ops):
        return []
    if isinstance(ops, list):
        classes = _classes_of([op[2] for op in ops])
        starts = np.fromiter((op[0] for op in ops), np.float64, len(ops))
        ends = np.fromiter((op[1] for op in ops), np.float64, len(ops))
    else:   # columns (events.CpuOps): each distinct name looked at once
        classes, starts, ends = ops.per_name(_class_of, np.int64), ops.start, ops.end
    order = np.lexsort((-ends, starts))   # by start, the longer first (stable, as sorted() was)
    starts, ends = starts[order], ends[order]
    classes = classes[order]
    flows = autograd if autograd is not None and len(autograd) else None
    recorded = np.ones(len(starts), dtype=bool) if flows is None else \
        np.searchsorted(flows, starts, side="left") < np.searchsorted(flows, ends, side="right")
    recorded |= (classes & _C_BACKWARD) != 0
    in_optimizer = _inside(starts, optimizer)
    out = []
    for step_start, step_end in steps:
        lo, hi = np.searchsorted(starts, step_start, side="left"), np.searchsorted(starts, step_end, side="right")
        runs = _step_runs(starts[lo:hi], ends[lo:hi], classes[lo:hi], recorded[lo:hi], in_optimizer[lo:hi])
        out += _step_labels(runs, forward, floor=flows is None)
    return out


# Ops that are the model's work when an optimizer step holds them (a closure's forward and backward,
# the gradient synchronisation its backward issues): never the optimizer's own, which runs under no_grad
# after the closure returned and issues no DDP reducer work.
_CLOSURE_WORK = ("autograd::engine::evaluate_function:", "torch.distributed.ddp.", "DistributedDataParallel.")
_CLOSURE_COMM = ("c10d::", "gloo:", "nccl:", "record_param_comms")


def optimizer_work(optimizer: list[tuple[float, float]], ops, autograd: np.ndarray | None) -> list[tuple[float, float]]:
    """The optimizer's own part of each `Optimizer.step` span: what follows the model's work a closure
    ran inside it. `optimizer.step(closure)` (PyTorch Lightning's automatic optimization, LBFGS) calls the
    closure first, so the span holds the microbatch's forward and backward and the gradient all-reduce its
    backward issued; the optimizer's own ops (run under no_grad, so autograd records none) follow once the
    closure returned. The closure's work is every op in the span that autograd recorded for a backward
    (`autograd`: the sorted fwdbwd flow starts), the backward's own ops, DDP's hooks and reducer, and the
    communication issued before the last of those ended; the span then starts where the last of them
    ends. A span without a closure is unchanged. `ops`: every thread's CPU ops (CpuOps columns)."""
    if not optimizer or not len(ops):
        return list(optimizer)
    held = np.flatnonzero(_inside(ops.start, list(optimizer)))   # only the ops some optimizer span holds
    starts, ends, names = ops.start[held], ops.end[held], ops.name_ids[held]

    def per_name(prefixes) -> np.ndarray:
        return np.fromiter((name.startswith(prefixes) for name in ops.name_table), bool, len(ops.name_table))[names]

    model, comm, label = per_name(_CLOSURE_WORK), per_name(_CLOSURE_COMM), per_name(("Optimizer.", "ProfilerStep#"))
    if autograd is not None and len(autograd):
        model |= ~label & (np.searchsorted(autograd, starts, side="left") < np.searchsorted(autograd, ends, side="right"))
    out = []
    for start, end in optimizer:
        inside = (starts >= start) & (starts < end) & ~label
        closure = inside & model
        if not closure.any():
            out.append((start, end))
            continue
        done = float(ends[closure].max())
        issued = inside & comm & (starts < done)
        if issued.any():
            done = max(done, float(ends[issued].max()))
        out.append((min(done, end), end))
    return out


def _inside(points: np.ndarray, spans: list[tuple[float, float]]) -> np.ndarray:
    """Whether each point lies in some span [start, end): the spans sorted by start, a point is in one
    exactly when the furthest end of those starting at or before it lies beyond it."""
    if not spans:
        return np.zeros(len(points), dtype=bool)
    ordered = np.array(sorted(spans), dtype=np.float64).reshape(-1, 2)
    reach = np.maximum.accumulate(ordered[:, 1])
    last = np.searchsorted(ordered[:, 0], points, side="right") - 1
    return (last >= 0) & (points < reach[np.maximum(last, 0)])


# what the run-building reads of an op's name, one bit each
_C_GLOO, _C_GLOO_P2P, _C_BREAK, _C_NEUTRAL, _C_BACKWARD, _C_STEP, _C_OPTIMIZER = 1, 2, 4, 8, 16, 32, 64


def _class_of(name: str) -> int:
    step = bool(_STEP.match(name))
    return (_C_GLOO * name.startswith("gloo:") | _C_GLOO_P2P * name.startswith(("gloo:send", "gloo:recv"))
            | _C_BREAK * (name.startswith(_RUN_BREAK) or step) | _C_NEUTRAL * name.startswith(_RUN_NEUTRAL)
            | _C_BACKWARD * name.startswith(_BACKWARD_OP) | _C_STEP * step
            | _C_OPTIMIZER * name.startswith("Optimizer.step"))


def _classes_of(names: list[str]) -> np.ndarray:
    """`_class_of` of each name, each distinct name looked at once."""
    known = {name: _class_of(name) for name in set(names)}
    return np.fromiter(map(known.__getitem__, names), np.int64, len(names))


def _step_runs(starts: np.ndarray, ends: np.ndarray, classes: np.ndarray, recorded: np.ndarray,
               in_optimizer: np.ndarray) -> list:
    """The runs [kind, start, end, first recorded start] of one step's ops (sorted by start, the
    longer first). An op nested in an earlier op of the step is no run's: it is top-level exactly
    when every earlier op (gloo's spans aside) ended by its start."""
    keep = (classes & _C_STEP) == 0   # ProfilerSteps bound the steps (a mid-iteration one is no op of it)
    gloo = (classes & _C_GLOO) != 0
    # an optimizer step's range breaks the run it starts in, but holds no op: a closure's forward and
    # backward inside it are top-level work (optimizer_work trimmed `in_optimizer` to its own ops)
    label = keep & ((classes & _C_OPTIMIZER) != 0)
    pushed = keep & ~gloo & ~label
    reach = np.maximum.accumulate(np.where(pushed, ends, -np.inf))
    before = np.concatenate([[-np.inf], reach[:-1]])
    top = (pushed | label) & (before <= starts)
    p2p = keep & ((classes & _C_GLOO_P2P) != 0)
    # where the thread waited on a p2p op: gloo's send / recv spans end when the schedule's wait on
    # them returns; a run does not go on over such a wait (the compute before it is done, what
    # follows is the next action's bookkeeping)
    waits = np.sort(ends[p2p])
    # the ops in order: gloo's spans (asynchronous p2p spans stay open until the schedule waits on them,
    # over the compute issued meanwhile: only their start breaks a run), breaks and the optimizer's ops
    # end the run; neutral ops are passed over; any other top-level op goes on the run before it when
    # the op before it was of that run and of its kind, and no wait ended between that op's end (the
    # run's: top-level ops end in order) and its start; else it starts a run
    seen = np.flatnonzero(top | p2p)
    cls = classes[seen]
    ends_run = ((cls & (_C_GLOO | _C_BREAK)) != 0) | in_optimizer[seen]
    looked = ends_run | ((cls & _C_NEUTRAL) == 0)
    seen, ends_run = seen[looked], ends_run[looked]
    member = ~ends_run
    kind = np.where((classes[seen] & _C_BACKWARD) != 0, BWD, FWD)
    goes_on = member.copy()
    goes_on[0:1] = False
    goes_on[1:] &= member[:-1] & (kind[1:] == kind[:-1])
    if len(waits):
        waited = np.searchsorted(waits, ends[seen], side="right")
        goes_on[1:] &= waited[:-1] == np.searchsorted(waits, starts[seen[1:]], side="right")
    members = np.flatnonzero(member)
    if not len(members):
        return []
    first = np.flatnonzero(~goes_on[members])   # where each run starts, among the members
    ops = seen[members]
    run_end = np.maximum.reduceat(ends[ops], first)
    run_recorded = np.minimum.reduceat(np.where(recorded[ops], starts[ops], np.inf), first)
    return [list(run) for run in zip(kind[members[first]].tolist(), starts[ops[first]].tolist(), run_end.tolist(),
                                     run_recorded.tolist())]


def _step_labels(runs: list, forward: bool, floor: bool = True) -> list:
    """One step's compute labels from its runs (see `_unlabeled_compute`). `floor`: the trace has no
    fwdbwd flows to tell a forward by, so runs too short to be a microbatch's compute are dropped."""
    out = []
    # a forward run starts at its first op autograd recorded (none: not a forward); what
    # follows the last one (the stage detaching its output to send) is still its work
    runs = [[kind, s, e] for kind, s0, e, s in runs if s < np.inf]
    backward = [end - start for kind, start, end in runs if kind == BWD]
    # without flows, bookkeeping between p2p calls (splitting inputs, allocating buffers) makes runs
    # of microseconds; a microbatch's compute is a sizeable share of a backward. With flows a run that
    # holds an op autograd recorded is a forward however short (a short forward beside a slow backward)
    shortest = 0.1 * float(np.median(backward)) if backward and floor else 0.0
    runs = [run for run in runs if run[2] - run[1] >= shortest]
    last_backward = max((i for i, run in enumerate(runs) if run[0] == BWD), default=-1)
    forwards = [i for i, run in enumerate(runs) if run[0] == FWD and i < last_backward]
    if len(forwards) > len(backward):
        # every microbatch has one forward and one backward: the longest runs are the forwards,
        # the rest is bookkeeping the OS stretched (splitting inputs, allocating recv buffers)
        forwards = sorted(sorted(forwards, key=lambda i: runs[i][1] - runs[i][2])[:len(backward)])
    for i, (kind, start, end) in enumerate(runs):
        if kind == BWD:
            out.append((BWD, start, end, -1, -1, "autograd backward"))
        elif forward and i in forwards:
            out.append((FWD, start, end, -1, -1, "forward ops"))
    return out


# Ops inside a compute label that are not its compute: communication issue and bookkeeping labels.
_NOT_COMPUTE = ("gloo:", "c10d::", "PP:", "ProfilerStep#", "Optimizer.", "record_param_comms", "enumerate(DataLoader)",
                "## ", "nccl:")


class _GpuWork:
    """A GPU trace's work (kernels, copies, memsets; NCCL kernels are communication) found by the
    CPU-side CUDA call that launched it (`correlation`): what a CPU range launched, on any thread.
    `work` counts the GPU work items, `unlinked` those whose launch is not in the trace (no
    cuda_runtime / cuda_driver event of their correlation): no range can own their time."""

    def __init__(self, launch_at: np.ndarray, launch_correlation: np.ndarray, work_correlation: np.ndarray,
                 work_start: np.ndarray, work_end: np.ndarray):
        """The CUDA calls (start, correlation) and the GPU work (correlation, start, end), as columns."""
        self.work = len(work_correlation)
        correlation = np.asarray(work_correlation, dtype=np.int64)
        called = np.asarray(launch_correlation, dtype=np.int64)
        self.unlinked = int((~np.isin(correlation, called)).sum())
        if not len(called) or not len(correlation):
            self._at = self._start = self._end = np.zeros(0)
            return
        order = np.argsort(correlation, kind="stable")
        ids, first = np.unique(correlation[order], return_index=True)   # a launch may run several kernels
        start = np.minimum.reduceat(np.asarray(work_start, dtype=np.float64)[order], first)
        end = np.maximum.reduceat(np.asarray(work_end, dtype=np.float64)[order], first)
        by_time = np.lexsort((called, launch_at))   # the calls in time order
        at, called = np.asarray(launch_at, dtype=np.float64)[by_time], called[by_time]
        index = np.minimum(np.searchsorted(ids, called), len(ids) - 1)
        found = ids[index] == called
        self._at, self._start, self._end = at[found], start[index[found]], end[index[found]]

    def span(self, start: float, end: float) -> tuple[float, float] | None:
        """(first start, last end) of the GPU work launched within [start, end] on the CPU; None if none."""
        lo, hi = np.searchsorted(self._at, start, side="left"), np.searchsorted(self._at, end, side="right")
        if lo == hi:
            return None
        return float(self._start[lo:hi].min()), float(self._end[lo:hi].max())

    def pieces(self, start: float, end: float, cuts: list[float]) -> list[tuple[float, float]]:
        """The GPU work launched within [start, end] on the CPU, split at the CPU times `cuts`
        (sorted, inside): (first start, last end) of each part, an empty part a zero-length span
        where the part before it ended (one part more than cuts, whatever ran)."""
        bounds = np.searchsorted(self._at, [start, *cuts], side="left").tolist()
        bounds.append(int(np.searchsorted(self._at, end, side="right")))
        out, at = [], None
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:   # a part's work on another stream may start before the part before ends: from there
                first, last = float(self._start[lo:hi].min()), float(self._end[lo:hi].max())
                first = first if at is None else min(max(first, at), max(last, at))
                out.append((first, max(last, first)))
                at = out[-1][1]
            else:
                out.append((at, at))
        first = next((s for s, _ in out if s is not None), None)   # empty leading parts: at the first work
        return [(first, first) if s is None else (s, e) for s, e in out]


def _issued_collectives(comm: list, issued: list[float], groups: Mapping[str, Group] | None = None,
                        waited: list[bool] | None = None) -> list[tuple[float, float, float]]:
    """(issued at, start, end) of each collective a compute op may hold: IN_COMPUTE_COLLECTIVES
    (all-to-all, broadcast ...), the all-gathers of FSDP's per-layer parameters and the gradient
    syncs the compute waited out (`waited`: waited_collectives), over any group not described as
    tensor or context parallel (whose collectives are the worker's compute).
    `issued`: per comm span, the CPU time it was issued at (a NCCL kernel's launch, a CPU span's start)."""
    inside_worker = {name for name, group in (groups or {}).items() if group.dims() & {"tp", "cp"}}
    held = {*IN_COMPUTE_COLLECTIVES, "all_gather"}
    waited = waited or [False] * len(comm)
    return sorted((at, span[1], span[2]) for span, at, wait in zip(comm, issued, waited)
                  if span[0] == COLL and (span[4] in held or wait) and span[5] not in inside_worker)


# Gradient syncs: DDP's bucketed all-reduce runs beside the backward's ops; FSDP's per-layer
# reduce-scatter (an all-reduce on gloo) is waited for inside the backward on CPU ranks.
GRADIENT_SYNCS = ("all_reduce", "reduce_scatter")


def waited_collectives(comm: list, issued: list[float], ops, labels: list) -> list[bool]:
    """Per comm span: True for a gradient sync the compute thread waited out in the middle of a
    forward or backward (FSDP2 reduce-scatters each layer's gradients inside the backward and,
    on a CPU rank, blocks until its DP peers join): issued inside a compute label that goes on
    after the collective ends, while the thread ran ops of its own for less than half of the
    collective's span (ops that hold all of it, its callers, are not work done meanwhile), decided
    over the rank's syncs together: at least half of them waited out. DDP's
    all-reduces run beside the backward's ops: not waited. A waited sync synchronises the DP ranks
    between the layers' compute, like FSDP's per-layer all-gather (the label is cut there)."""
    out = [False] * len(comm)
    compute = sorted((s, e) for k, s, e, *_ in labels if k in (FWD, BWD))
    syncs = [i for i, span in enumerate(comm) if span[0] == COLL and span[4] in GRADIENT_SYNCS and span[2] > span[1]]
    if not compute or not syncs or not len(ops) or any(span[0] in (SEND, RECV) for span in comm):
        return out   # (a pipeline's compute is whole: its p2p serve whole microbatches)
    c_start = np.array([s for s, _ in compute])
    c_end = np.array([e for _, e in compute])
    order = np.argsort(ops.start, kind="stable")
    starts, ends = ops.start[order], ops.end[order]
    inside, idle = [], 0
    for i in syncs:
        s, e, at = comm[i][1], comm[i][2], issued[i]
        j = int(np.searchsorted(c_start, at, side="right")) - 1
        if j < 0 or at > c_end[j] or c_end[j] <= e:
            continue   # not issued inside a compute that goes on after it
        lo, hi = np.searchsorted(starts, c_start[j]), np.searchsorted(starts, e)
        inside.append(i)
        idle += _busy(starts[lo:hi], ends[lo:hi], s, e) < 0.5 * (e - s)
    # how the framework syncs is one decision per rank (at least half of all its gradient syncs, not
    # of those a compute happened to hold), never per span: a span whose peer was already waiting
    # ends before the thread idles, and every DP rank must cut its compute at the same collectives.
    # FSDP2 waits out 80-89% of its syncs (each layer's reduce-scatter); DDP issues its all-reduces
    # after the backward or beside it, and the hook that issues one now and then holds its whole
    # span (1-3 of 18 syncs): cutting those made one step's structure differ and dropped it
    if idle and 2 * idle >= len(syncs):
        for i in inside:
            out[i] = True
    return out


def _busy(starts: np.ndarray, ends: np.ndarray, s: float, e: float) -> float:
    """Time within [s, e] covered by the ops (sorted by start) that begin or end inside it."""
    inside = (ends > s) & ~((starts <= s) & (ends >= e))
    a, b = np.maximum(starts[inside], s), np.minimum(ends[inside], e)
    if not len(a):
        return 0.0
    reach = np.concatenate([[s], np.maximum.accumulate(b)[:-1]])
    return float(np.maximum(b - np.maximum(a, reach), 0.0).sum())


def _pieces(start: float, end: float, held: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """[start, end] cut at each (collective start, end) in `held` (sorted): the work before it and the
    work after it; one more piece per collective however they overlap (pieces may be empty), so a
    compute op holds the same pieces in every step."""
    pieces, at = [], start
    for a, b in held:
        cut = min(max(a, at), end)
        pieces.append((at, cut))
        at = min(max(b, cut), end)
    pieces.append((at, end))
    return pieces


def _compute_spans(labels: list, gpu_labels: Mapping[str, list], comm: list,
                   ops: list | None = None, gpu_work: _GpuWork | None = None,
                   collectives: list[tuple[float, float, float]] = ()) -> list[tuple[int, float, float, int, int, int, float]]:
    """(kind, start, end, mb, chunk, piece, issued) of each compute label (issued: the label's CPU
    start, which says the step it belongs to): on a GPU trace the span of the GPU work
    launched while the label was open, on any thread (a backward's kernels come from the autograd
    engine's thread), else its GPU annotation span, else the CPU span with p2p waits at its edges cut off (a recv ending inside it,
    a send issued at its back) and, given the label thread's ops (start, end, name, tid), when it
    issues a send (GPipe's `Forward k`), ending at its last op: time between that op and the send
    that no op accounts for (a pause before the send) is untraced, the send's launch delay, not
    compute. A label that issued collectives of a group (`collectives`: _issued_collectives) is cut
    at each into pieces (piece 0, 1, ...): on a CPU trace the work before the collective and the
    work after it (the thread blocked in it); on a GPU the kernels launched before and after it,
    those after running alongside the collective's stream until one needs its result."""
    inner: list[np.ndarray] = []   # (starts, ends) of the ops that are compute, sorted; made when first needed

    def compute_ops() -> tuple[np.ndarray, np.ndarray]:
        if not inner:
            kept = [(s, e) for s, e, name, _ in (ops or ()) if not name.startswith(_NOT_COMPUTE)]
            starts = np.array([s for s, _ in kept], dtype=np.float64)
            ends = np.array([e for _, e in kept], dtype=np.float64)
            order = np.lexsort((ends, starts))
            inner.extend((starts[order], ends[order]))
        return inner[0], inner[1]

    next_gpu: dict[str, int] = collections.Counter()
    gpu_sorted = {name: sorted(spans) for name, spans in gpu_labels.items()}
    p2p = sorted((s, e, k) for k, s, e, *_ in comm if k in (SEND, RECV))
    p2p_start = np.array([s for s, _, _ in p2p]) if p2p else np.zeros(0)
    recv_spans = sorted(((s, e) for s, e, k in p2p if k == RECV), key=lambda span: span[1])
    recv_end = np.array([e for _, e in recv_spans]) if recv_spans else np.zeros(0)
    issued_at = np.array([t for t, _, _ in collectives])
    out = []

    def issued_in(label_start, label_end):   # the collectives a label issued
        return collectives[np.searchsorted(issued_at, label_start):np.searchsorted(issued_at, label_end, side="right")]

    def emit(kind, label_start, label_end, start, end, mb, chunk):
        held = sorted((a, b) for _, a, b in issued_in(label_start, label_end))
        for piece, (s, e) in enumerate(_pieces(start, end, held)):
            out.append((kind, s, e, mb, chunk, piece, label_start))

    for kind, start, end, mb, chunk, name in sorted(labels, key=lambda l: l[1]):
        launched = gpu_work.span(start, end) if gpu_work is not None else None
        if launched is not None:
            # its kernels before and after each collective it launched: the compute stream runs them
            # in launch order, the collective's stream alongside (no hole: overlap stays compute)
            cuts = sorted(t for t, _, _ in issued_in(start, end))
            for piece, (s, e) in enumerate(gpu_work.pieces(start, end, cuts)):
                out.append((kind, s, e, mb, chunk, piece, start))
            continue
        # the label's GPU span: the next one of that name starting after the CPU label did (GPU work
        # follows its launch), so a span the profiler dropped costs only its own step
        on_gpu = gpu_sorted.get(name, ())
        position = next_gpu[name]
        while position < len(on_gpu) and on_gpu[position][0] < start:
            position += 1
        if position < len(on_gpu):
            next_gpu[name] = position + 1
            gpu_start, gpu_end = on_gpu[position]
            emit(kind, start, end, gpu_start, gpu_end, mb, chunk)
            continue
        lo, hi = np.searchsorted(p2p_start, start), np.searchsorted(p2p_start, end)
        compute_start, compute_end = start, end
        # a recv posted before the label (torch's interleaved schedule posts RECV_B early) ends when
        # the label's action waits on it, at its front: the compute starts after that wait
        first, past = np.searchsorted(recv_end, start), np.searchsorted(recv_end, end, side="right")
        for s, e in recv_spans[first:past]:
            if s < start:
                compute_start = max(compute_start, e)
        nested = p2p[lo:hi]
        for s, e, k in nested:             # waits at the front: the compute starts after them
            if k == RECV and e <= end and s - compute_start <= max(0.0, (end - start) * 0.5):
                compute_start = max(compute_start, e)
        issues_send = False
        for s, e, k in reversed(nested):   # sends at the back: the compute ended before them
            if k == SEND and s >= compute_start:
                compute_end, issues_send = min(compute_end, s), True
        inner_start, inner_end = compute_ops() if issues_send else (None, None)
        if issues_send and len(inner_start):
            lo, hi = np.searchsorted(inner_start, compute_start), np.searchsorted(inner_start, compute_end, side="right")
            held = (inner_end[lo:hi] <= end) & ~((inner_start[lo:hi] == start) & (inner_end[lo:hi] == end))
            if held.any():   # between its last op and the send it issues: untraced (its front stays compute)
                compute_end = min(compute_end, float(inner_end[lo:hi][held].max()))
        emit(kind, start, end, compute_start, max(compute_end, compute_start), mb, chunk)
    return out
