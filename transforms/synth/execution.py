"""Vectorised execution of a step :class:`~transforms.synth.program.Program` over (step, dp_rank).

Three pieces, all plain numpy:

* :class:`Timing` - the base durations of one job (seconds), sampled from its shape;
* :func:`draw_arrays` - per-unit random durations, transfers and launch gaps for every
  sampled step and DP rank (:class:`StepArrays`, arrays shaped ``[unit, step, dp_rank]``);
* :func:`simulate` - walks the program's events once in topological order; each event
  is a few numpy ``maximum``/``add`` over all ``step x dp_rank`` lanes at once, DP
  collectives reduce over the dp axis, the clip all-reduce over stages and dp.

Then :func:`emit_trace` turns simulated times into op records (TRACE_SCHEMA) with a
per-worker profiler clock offset and per-step start offsets, ordered by
(session, stage, step, dp_rank, program order) so that each (session, stage) is one
contiguous slice (one lake file).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from schemas.trace import OPTYPES, trace_table
from transforms.synth.program import Program, UnitKind

__all__ = ["Timing", "StepArrays", "draw_arrays", "simulate", "step_times", "emit_trace", "TracePart"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Base durations of one job, seconds, before noise and injected causes.

    Compute times are per microbatch for the whole stage (a chunk takes 1/vpp of it).
    Collective times are transfer times once every member has started.
    """

    forward: float = 0.1               # forward compute of one microbatch on one stage
    backward_ratio: float = 2.0        # backward / forward
    compute_noise: float = 0.015       # lognormal sigma per compute op
    worker_noise: float = 0.004        # persistent per-worker speed sigma
    step_noise: float = 0.005          # per-step speed sigma shared by all workers
    last_stage_extra: float = 0.03     # loss layer baseline on the last chunk (fraction of compute)
    attention_fraction: float = 0.1    # share of compute growing with sum of squared doc lengths
    p2p: float = 0.0008                # activation/gradient transfer
    p2p_noise: float = 0.15
    p2p_call: float = 15e-6            # cost of a p2p call whose peer is already waiting (or no-op)
    params_all_gather: float = 0.04    # per step (split over chunks)
    grads_reduce_scatter: float = 0.06
    separate_all_reduce: float = 0.02
    layernorm_all_reduce: float = 0.0002
    embedding_all_reduce: float = 0.02
    clip: float = 0.008
    optimizer: float = 0.03
    comm_noise: float = 0.08           # lognormal sigma of collective transfers
    launch_gap: float = 15e-6          # mean untraced CPU gap before an op
    data_gap: float = 0.01             # mean untraced gap before the first compute-stream op (data loading)
    tail_gap: float = 0.001            # mean gap before the step tail (layernorm)
    grads_copy_gap: float = 0.01       # mean gap before non-overlapped grads-reduce-scatter
    clock_jitter: float = 30e-6        # sigma of per-worker profiler clock offsets, per session

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise ValueError(f"Timing.{field.name} must be a finite number >= 0 seconds, got {value!r}")
        if self.forward <= 0:
            raise ValueError(f"Timing.forward must be > 0 seconds, got {self.forward!r}")


@dataclasses.dataclass
class StepArrays:
    """Random inputs of a simulation, shaped [unit or transfer, step, dp_rank], seconds.

    ``duration``: compute time of compute-like units, transfer time of collectives
    (counted from the last member's start), call cost of p2p units.
    ``transfer``: p2p transfer time of each program transfer (G rows).
    ``gap``: untraced CPU time before each unit starts.
    """

    duration: np.ndarray
    transfer: np.ndarray
    gap: np.ndarray

    def copy(self) -> "StepArrays":
        return StepArrays(self.duration.copy(), self.transfer.copy(), self.gap.copy())


def _lognormal(rng: np.random.Generator, sigma: float, shape) -> np.ndarray:
    """Multiplicative noise with mean 1."""
    if sigma <= 0:
        return np.ones(shape)
    return np.exp(rng.standard_normal(shape) * sigma - 0.5 * sigma * sigma)


def draw_arrays(program: Program, timing: Timing, n_steps: int, dp: int, rng: np.random.Generator) -> StepArrays:
    """Sample durations, transfers and gaps of every unit for n_steps x dp lanes (fault-free)."""
    kinds = program.unit_kind
    shape = (program.n_units, n_steps, dp)
    pp, vpp = program.pp, program.vpp
    duration = np.zeros(shape)
    gap = np.zeros(shape)

    compute = (kinds == UnitKind.FORWARD) | (kinds == UnitKind.BACKWARD)
    base = np.where(kinds == UnitKind.BACKWARD, timing.forward * timing.backward_ratio, timing.forward) / vpp
    last_chunk = (program.unit_stage == pp - 1) & (program.unit_chunk == vpp - 1)
    base = base * np.where(last_chunk & (pp > 1), 1.0 + timing.last_stage_extra, 1.0)
    idx = np.flatnonzero(compute)
    worker = _lognormal(rng, timing.worker_noise, (pp, 1, dp))[program.unit_stage[idx]]
    per_step = _lognormal(rng, timing.step_noise, (1, n_steps, 1))
    duration[idx] = base[idx, None, None] * worker * per_step * _lognormal(rng, timing.compute_noise, (len(idx), n_steps, dp))

    def collective(kind, mean, per_rank=0.02):
        sel = np.flatnonzero(kinds == kind)
        if len(sel):
            # One transfer per collective and step, tiny per-rank skew (same op on every member).
            shared = mean * _lognormal(rng, timing.comm_noise, (len(sel), n_steps, 1))
            duration[sel] = shared * _lognormal(rng, per_rank * timing.comm_noise, (len(sel), n_steps, dp))

    collective(UnitKind.PARAMS_ALL_GATHER, timing.params_all_gather / vpp)
    collective(UnitKind.GRADS_REDUCE_SCATTER, timing.grads_reduce_scatter / vpp)
    collective(UnitKind.SEPARATE_ALL_REDUCE, timing.separate_all_reduce)
    sel = np.flatnonzero(kinds == UnitKind.EMBEDDING)
    # One all-reduce between stage 0 and stage pp-1 of each DP rank: both members share its transfer.
    embedding = timing.embedding_all_reduce if pp > 1 else timing.layernorm_all_reduce
    duration[sel] = embedding * _lognormal(rng, timing.comm_noise, (1, n_steps, dp)) \
        * _lognormal(rng, 0.02 * timing.comm_noise, (len(sel), n_steps, dp))
    sel = np.flatnonzero(kinds == UnitKind.LAYERNORM)
    duration[sel] = timing.layernorm_all_reduce * _lognormal(rng, 3 * timing.comm_noise, (len(sel), n_steps, dp))
    sel = np.flatnonzero(kinds == UnitKind.CLIP)
    # The clip all-reduce is one global collective: the same transfer on every stage.
    duration[sel] = timing.clip * _lognormal(rng, timing.comm_noise, (1, n_steps, 1)) \
        * _lognormal(rng, 0.02 * timing.comm_noise, (len(sel), n_steps, dp))
    sel = np.flatnonzero(kinds == UnitKind.OPTIMIZER)
    duration[sel] = timing.optimizer * _lognormal(rng, 0.03, (len(sel), n_steps, dp))
    sel = np.flatnonzero(kinds == UnitKind.P2P)
    duration[sel] = timing.p2p_call * _lognormal(rng, 0.3, (len(sel), n_steps, dp))

    transfer = timing.p2p * _lognormal(rng, timing.p2p_noise, (len(program.transfer_units), n_steps, dp))

    # Untraced CPU gaps: small everywhere, larger at a few known places of a step.
    gap[:] = rng.exponential(timing.launch_gap, shape) if timing.launch_gap > 0 else 0.0
    gap[kinds == UnitKind.GC] = 0.0
    gap[kinds == UnitKind.OPTIMIZER] = 0.0
    first = program.unit_position == 0
    gap[first] += rng.exponential(timing.data_gap, (int(first.sum()), n_steps, dp))
    ag = np.flatnonzero(kinds == UnitKind.PARAMS_ALL_GATHER)
    first_ag = ag[np.r_[True, program.unit_stage[ag][1:] != program.unit_stage[ag][:-1]]] if len(ag) else ag
    gap[first_ag] = rng.uniform(0.0, 0.005, (len(first_ag), n_steps, dp))
    sel = np.flatnonzero(kinds == UnitKind.LAYERNORM)
    gap[sel] += rng.exponential(timing.tail_gap, (len(sel), n_steps, dp))
    if program.use_dp and not program.dp_overlap:
        rs = np.flatnonzero((kinds == UnitKind.GRADS_REDUCE_SCATTER) & (program.unit_position >= 0))
        first_rs = rs[np.r_[True, program.unit_stage[rs][1:] != program.unit_stage[rs][:-1]]] if len(rs) else rs
        gap[first_rs] += rng.exponential(timing.grads_copy_gap, (len(first_rs), n_steps, dp))
    return StepArrays(duration=duration, transfer=transfer, gap=gap)


def simulate(program: Program, arrays: StepArrays, with_gaps: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Start and end time of every unit, seconds from the step start, shaped [unit, step, dp_rank].

    Start = max end of the unit's predecessors (program order on its stream, ZeRO and
    tail dependencies) + its launch gap (skipped when ``with_gaps`` is False). End:
    compute-like units add their duration; a p2p call ends when every transfer it
    carries is done (a transfer starts once both sides have started); collectives end
    a transfer time after their last member (DP rank, stage pair or all workers) started.
    """
    kinds = program.unit_kind
    duration, transfer = arrays.duration, arrays.transfer
    gap = arrays.gap if with_gaps else None
    start = np.empty_like(duration)
    end = np.empty_like(duration)
    zero = np.zeros(duration.shape[1:])
    clip_units = np.flatnonzero(kinds == UnitKind.CLIP)
    embedding_units = np.flatnonzero(kinds == UnitKind.EMBEDDING)
    preds, transfers, pairs = program.unit_preds, program.unit_transfers, program.transfer_units
    clip_end = None

    for event in program.events.tolist():
        u = event >> 1
        if not event & 1:
            ps = preds[u]
            if not ps:
                ready = zero
            elif len(ps) == 1:
                ready = end[ps[0]]
            else:
                ready = np.maximum(end[ps[0]], end[ps[1]])
                for p in ps[2:]:
                    np.maximum(ready, end[p], out=ready)
            if gap is not None:
                np.add(ready, gap[u], out=start[u])
            else:
                start[u] = ready
            continue
        kind = kinds[u]
        if kind == UnitKind.P2P:
            out = start[u] + duration[u]
            for g in transfers[u]:
                a, b = pairs[g]
                np.maximum(out, np.maximum(start[a], start[b]) + transfer[g], out=out)
            end[u] = out
        elif kind in UnitKind.DP_COLLECTIVES:
            end[u] = start[u].max(axis=1, keepdims=True) + duration[u]
        elif kind == UnitKind.CLIP:
            if clip_end is None:
                clip_end = start[clip_units].max(axis=(0, 2))[:, None]
            end[u] = clip_end + duration[u]
        elif kind == UnitKind.EMBEDDING:
            end[u] = start[embedding_units].max(axis=0) + duration[u]
        else:
            np.add(start[u], duration[u], out=end[u])
    return start, end


def step_times(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Step time per sampled step, seconds: latest end minus earliest start over all units and DP ranks."""
    return end.max(axis=(0, 2)) - start.min(axis=(0, 2))


@dataclasses.dataclass(frozen=True)
class TracePart:
    """Rows [offset, offset + length) of a generated trace: one (session, stage) file."""

    session: int
    stage: int
    offset: int
    length: int


def emit_trace(
    job_id: str,
    program: Program,
    start: np.ndarray,
    end: np.ndarray,
    steps: np.ndarray,
    step_session: np.ndarray,
    clock_offset: np.ndarray,
    ranks: np.ndarray,
    hosts: np.ndarray,
    seq_lens: pa.ListArray | None = None,
) -> tuple[pa.Table, list[TracePart]]:
    """Op records of a simulated job as a TRACE_SCHEMA table, plus its (session, stage) slices.

    start/end: [unit, step, dp] seconds; steps: int64 [S] step ids; step_session: int [S]
    session of each step (contiguous, ascending); clock_offset: [n_sessions, dp, pp]
    seconds added to every start of a worker; ranks: int [dp, pp] global rank of each
    worker; hosts: str [dp, pp]; seq_lens: list<int32> per (step, dp, microbatch)
    (flat index (s * dp + d) * microbatches + m) or None.
    """
    n_steps, dp = start.shape[1], start.shape[2]
    pp = program.pp
    # clock_offset[step_session] is [S, dp, pp]; pick each unit's stage -> [unit, S, dp].
    obs_start = start + np.moveaxis(clock_offset[step_session][:, :, program.unit_stage], 2, 0)
    # Per-step offsets: each step starts at 0, like the published traces.
    obs_start -= obs_start.min(axis=(0, 2))[None, :, None]
    duration = end - start

    rec_unit = program.record_unit
    rec_stage = program.unit_stage[rec_unit]
    # Row order: session, stage, step, dp_rank, record (program order).
    blocks, parts, offset = [], [], 0
    session_bounds = np.flatnonzero(np.r_[True, step_session[1:] != step_session[:-1], True])
    flat_rec = rec_unit.astype(np.int64) * (n_steps * dp)
    for lo, hi in zip(session_bounds[:-1], session_bounds[1:]):
        for p in range(pp):
            recs = np.flatnonzero(rec_stage == p)
            lanes = (np.arange(lo, hi)[:, None] * dp + np.arange(dp)[None, :]).reshape(-1)
            block = np.tile(recs, len(lanes)), np.repeat(lanes, len(recs))
            blocks.append(block)
            parts.append(TracePart(int(step_session[lo]), p, offset, len(block[0])))
            offset += len(block[0])
    rec_idx = np.concatenate([b[0] for b in blocks])
    lane_idx = np.concatenate([b[1] for b in blocks])
    step_idx, dp_idx = np.divmod(lane_idx, dp)
    unit_flat = flat_rec[rec_idx] + lane_idx
    stage_col = rec_stage[rec_idx]

    n_rows = len(rec_idx)
    optype = pa.DictionaryArray.from_arrays(pa.array(program.record_optype[rec_idx], pa.int8()),
                                            pa.array(OPTYPES, pa.string()))
    worker_idx = dp_idx * pp + stage_col
    host_col = pa.DictionaryArray.from_arrays(pa.array(worker_idx.astype(np.int32)),
                                              pa.array(hosts.reshape(-1).tolist(), pa.string())).cast(pa.string())
    if seq_lens is not None:
        is_compute = np.isin(program.unit_kind[rec_unit[rec_idx]], (UnitKind.FORWARD, UnitKind.BACKWARD))
        mb = program.record_microbatch[rec_idx]
        take = (step_idx * dp + dp_idx) * program.microbatches + mb
        seq_col = seq_lens.take(pa.array(take, mask=~is_compute, type=pa.int64()))
    else:
        seq_col = pa.nulls(n_rows, pa.list_(pa.int32()))
    columns = {
        "job_id": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n_rows, np.int8)),
                                                 pa.array([job_id])).cast(pa.string()),
        "dp_rank": pa.array(dp_idx.astype(np.int16)),
        "stage": pa.array(stage_col.astype(np.int16)),
        "rank": pa.array(ranks.reshape(-1)[worker_idx].astype(np.int32)),
        "step": pa.array(steps.astype(np.int64)[step_idx]),
        "optype": optype,
        "start_ts": pa.array(obs_start.reshape(-1)[unit_flat]),
        "duration": pa.array(duration.reshape(-1)[unit_flat]),
        "seq_id": pa.array(program.record_seq_id[rec_idx]),
        "mc": pa.array(program.record_mc[rec_idx]),
        "mb_id": pa.array(program.record_microbatch[rec_idx]),
        "gmc": pa.array(program.record_gmc[rec_idx]),
        "host": host_col,
        "seq_lens": seq_col,
    }
    table = trace_table(columns, len(rec_idx))
    return table, parts
