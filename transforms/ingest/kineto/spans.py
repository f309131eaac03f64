"""Span kinds, label patterns and the per-rank record (`RankTrace`) the other kineto modules share."""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import numpy as np

from schemas.trace import OPTYPES


_CODE = {name: code for code, name in enumerate(OPTYPES)}

# Span kinds inside a RankTrace.
FWD, BWD, OPT, SEND, RECV, COLL, WGT = range(7)
_KIND_NAMES = ("forward", "backward", "optimizer", "send", "recv", "collective", "weight-gradient")

DEFAULT_FORWARD_LABELS = (
    r"^PP:(?P<stage>\d+)F(?P<mb>\d+)$",                         # torch.distributed.pipelining runtime
    r"^Forward (?P<mb>\d+)$",                                   # torch.distributed.pipelining GPipe / 1F1B
    r"^forward[-_ ](?:compute|step)(?:[ #:_=-]*(?:mb|microbatch)?[ #:_=-]*(?P<mb>\d+))?$",
)
DEFAULT_BACKWARD_LABELS = (
    r"^PP:(?P<stage>\d+)B(?P<mb>\d+)$",
    r"^PP:(?P<stage>\d+)I(?P<mb>\d+)$",                         # zero-bubble: the input-gradient half
    r"^Backward (?P<mb>\d+)$",
    r"^backward[-_ ](?:compute|step)(?:[ #:_=-]*(?:mb|microbatch)?[ #:_=-]*(?P<mb>\d+))?$",
)
DEFAULT_OPTIMIZER_LABEL = r"^Optimizer\.step#"
# zero-bubble schedules: the weight-gradient half of a microbatch's backward
WEIGHT_LABEL = re.compile(r"^PP:(?P<stage>\d+)W(?P<mb>\d+)$")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_NCCL = ("ncclKernel_", "ncclDevKernel_")
# Collective names as c10d / NCCL / gloo spell them -> canonical name.
_COLLECTIVES = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "allreduce_sparse": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "reduce_scatter": "reduce_scatter", "reducescatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allgather": "all_gather", "all_gather": "all_gather", "_allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
    "allgather_coalesced": "all_gather",
    "all_to_all": "all_to_all", "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_allv": "all_to_all",
    "broadcast": "broadcast", "barrier": "barrier", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recv_anysource": "recv", "sendrecv": "sendrecv",
}
# Collectives a compute op may hold, each a synchronising op of its group inside the step
# (all-to-all of expert / embedding parallelism, broadcast, barrier ...): compute is cut at them.
IN_COMPUTE_COLLECTIVES = ("all_to_all", "broadcast", "barrier", "gather", "scatter", "reduce")
# Canonical DP collective -> op type; the other known collectives are counted as unmapped.
_DP_OPTYPE = {"all_reduce": "grads-reduce-scatter", "reduce_scatter": "grads-reduce-scatter", "all_gather": "params-all-gather"}
_DIM_TOKENS = {
    "pp": {"pp", "pipe", "pipeline"},
    "dp": {"dp", "data", "ddp", "fsdp", "replicate", "shard"},
    "tp": {"tp", "tensor"},
    "cp": {"cp", "context"},
    "ep": {"ep", "expert", "moe"},
}


def longest_idle(start: np.ndarray, end: np.ndarray, busy: np.ndarray) -> np.ndarray:
    """Per interval [start, end], the longest stretch inside it that no run of `busy`
    (intervals.union_runs) covers: 0 for an interval the runs cover whole, its length for one
    they miss."""
    out = np.zeros(len(start))
    if not len(start):
        return out
    gap_lo = np.r_[-np.inf, busy[:, 1]]       # the stretches between runs, and before the first / after the last
    gap_hi = np.r_[busy[:, 0], np.inf]
    first = np.searchsorted(gap_hi, start, side="right")   # first stretch ending after the interval starts
    last = np.searchsorted(gap_lo, end, side="left")       # stretches starting before it ends
    for i, (a, b, j, k) in enumerate(zip(start.tolist(), end.tolist(), first.tolist(), last.tolist())):
        if k > j:
            out[i] = max(float((np.minimum(gap_hi[j:k], b) - np.maximum(gap_lo[j:k], a)).max()), 0.0)
    return out


def first_start_per_step(step: np.ndarray, start: np.ndarray, mask: np.ndarray) -> dict[int, float]:
    """Step -> earliest start among the masked spans of that step."""
    steps, inverse = np.unique(step[mask], return_inverse=True)
    first = np.full(len(steps), np.inf)
    np.minimum.at(first, inverse, start[mask])
    return dict(zip(steps.tolist(), first.tolist()))


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group as `distributedInfo.pg_config` lists it (ranks in group-rank order)."""

    name: str
    desc: str
    ranks: tuple[int, ...]

    def dims(self) -> set[str]:
        tokens = set(re.split(r"[^a-z]+", self.desc.lower()))
        return {dim for dim, names in _DIM_TOKENS.items() if tokens & names}

    def syncs_grads(self) -> bool:
        """Whether the description names a data-parallel group: dp alone, or dp with cp (Megatron's
        DATA_PARALLEL_GROUP_WITH_CP, torchtitan's `dp_cp` / `dp_shard_cp`: context-parallel ranks
        are one worker, so their grads sync over data x context)."""
        return self.dims() in ({"dp"}, {"dp", "cp"})


@dataclasses.dataclass
class RankTrace:
    """One rank's spans (times in µs after `origin_ns` on the rank's own clock), before the job is assembled.

    Span columns (equal length): kind (FWD/BWD/OPT/SEND/RECV/COLL), start, end, step
    (ProfilerStep number, -1 outside every step), mb (microbatch id or -1), chunk (global
    pipeline stage index from a `PP:` label, else -1), peer (global rank of a p2p peer or
    -1), coll (canonical collective name for COLL spans), group (pg_name or ""), peer_local
    (the peer as a rank of an unnamed group, resolved once the layout is known, or -1),
    direction (+1 forward / -1 backward for p2p issued under a label that says so, else 0),
    n_ops (operations autograd recorded inside a compute span, else -1), piece (0, or the
    k-th piece of a compute label cut at the collectives it issued), seq (a collective's number
    in its process group, `Seq` of recent NCCL traces, else -1).
    """

    path: str
    rank: int
    world: int
    backend: str
    groups: dict[str, Group]
    device: str
    versions: dict[str, Any]
    steps: np.ndarray            # ProfilerStep numbers, sorted
    step_start: np.ndarray       # µs
    step_end: np.ndarray
    kind: np.ndarray
    start: np.ndarray
    end: np.ndarray
    step: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    peer: np.ndarray
    coll: np.ndarray             # object: str
    group: np.ndarray            # object: str
    unmapped: collections.Counter
    peer_local: np.ndarray
    direction: np.ndarray        # int8
    n_ops: np.ndarray
    piece: np.ndarray | None = None   # int8; None: no compute was cut
    seq: np.ndarray | None = None     # int64 NCCL Seq of collectives (-1 elsewhere); None: the trace has none
    host: str | None = None      # the trace's host_name, when torch wrote it
    clock: str = ""              # ranks with equal clock keys share one clock (their host)
    steps_inferred: bool = False  # no ProfilerStep: steps told by the optimizer's step spans
    origin_ns: int = 0           # recorded instant of time 0 of the span columns (baseTimeNanoseconds + first ts)
    gpu_work: int = 0            # GPU work items (kernels, copies, memsets; not NCCL) in the file
    gpu_work_unlinked: int = 0   # ... of which no CUDA launch (cuda_runtime / cuda_driver correlation) is in the file
    data_loading: np.ndarray | None = None   # [k, 2] start, end (µs) of each `enumerate(DataLoader)` fetch; None: none
    # [k, 2] start, end (µs) of each Python garbage collection the collector recorded (strag_collect's
    # "strag_gc" key); None: no record (a trace not landed by strag_collect), empty: recorded, none ran
    gc_pauses: np.ndarray | None = None
    # the collector's record of the host (strag_collect's "strag_host" key): cores the rank may run on,
    # torch's intra-op threads and the job's ranks on the host; None where not recorded
    host_cpus: int | None = None
    host_threads: int | None = None
    host_ranks: int | None = None
    # [k, 2] start, end (µs) of the disjoint runs in which the steps' thread ran a traced op
    # (annotations left out; CPU ranks only, None elsewhere): where a compute span holds none, its
    # thread ran untraced Python (the collector, the OS) inside the compute
    main_busy: np.ndarray | None = None
    seq_lens: np.ndarray | None = None   # object, per span: a forward's batch lengths ([T] * B, record_shapes), else None
    waited: np.ndarray | None = None     # bool, per span: a gradient sync the compute waited out (compute.waited_collectives)
    issued: np.ndarray | None = None     # µs, per span: the CPU time it was issued at (a collective's c10d call, a launch)
    # the operations autograd recorded, with their names and durations (CPU ranks; pace.RecordedOps): each
    # compute op's pace by operation identity at the job level; None on GPU ranks or without flows
    recorded: Any = None

    def groups_of_rank(self) -> list[Group]:
        return [g for g in self.groups.values() if self.rank in g.ranks]
