"""Write a lake job as torch.profiler (Kineto) GPU traces: one Chrome-trace JSON per rank.

The inverse of transforms/ingest/kineto.py, for round-trip tests and the ingest benchmark:

    from transforms.synth.job import JobSpec, generate_job
    from transforms.synth.kineto_writer import write_kineto_job
    job = generate_job(JobSpec("j1", dp=2, pp=4, microbatches=8, steps=4, sessions=1,
                               dp_overlap=False, record_noop_p2p=False))
    paths = write_kineto_job(job, "/tmp/j1", filler=0, compress=False)

What one rank's file holds (the events and args of a real NCCL/GPU trace, e.g. the public
HTA `nccl_data.json.gz`; tests/test_kineto_writer_structure.py holds the two alike):

- top level: schemaVersion, deviceProperties, distributedInfo (backend nccl, rank,
  world_size, pg_count, pg_config with the default group `default_pg`, the pipeline groups
  `mesh_pp` (ranks in stage order), the data-parallel groups `mesh_dp` (dp order), the
  tensor-parallel groups `mesh_tp`, the embedding groups (stage 0 and pp-1 of a pipeline);
  every group of the job (as DeviceMesh lists them) or only the rank's own), baseTimeNanoseconds,
  displayTimeUnit, traceEvents: process and thread names and sort indices (ph M; CPU ops on pid =
  tid = the process's main thread, the autograd engine's thread `pt_autograd_0`, GPU work on
  pid = device, tid = stream), the profiler's own span (cat Trace) and markers (ph i);
- per step: `ProfilerStep#{step}` (user_annotation, main thread) from a little before the
  rank's first event of the step to a little after its last, and `Optimizer.zero_grad#AdamW.zero_grad`;
- per compute op: CPU user_annotation `PP:{gmc}F{mb}` / `PP:{gmc}B{mb}` (the label of
  torch.distributed.pipelining) starting a little before the op, and a gpu_user_annotation
  of the same name with exactly the op's start and duration; `filler` kernels per forward
  (twice as many per backward) inside it, each with its cpu_op `aten::*`, its
  cudaLaunchKernel (cuda_runtime) and its `kernel`, tied by args.correlation and ac2g flows
  (s at the call, f with bp "e" at the kernel, id = correlation); a backward's ops run on the
  autograd thread (`autograd::engine::evaluate_function: XBackward0` > `XBackward0` > aten op),
  each node the f end of a fwdbwd flow from the forward op that recorded it; `copies`: a
  device-to-device copy and a memset (cudaMemcpyAsync / cudaMemsetAsync) per compute op too;
- per p2p op: a `ncclDevKernel_SendRecv(...)` kernel with the op's exact start and duration,
  "Collective name" send/recv, the pp group's name, description and ranks, the peer's
  GROUP-LOCAL index as "Dst Rank"/"Src Rank", a running "Seq"; plus the CPU side, one
  collective at a time on the main thread (c10d::send / c10d::recv_ > record_param_comms >
  `nccl:send 0->1` annotation > cudaLaunchKernelExC) and the annotation again on the kernel's
  stream. No-op p2p rows (peer outside the pipeline) leave nothing;
- DP ops: grads-reduce-scatter -> ReduceScatter kernel ("reduce_scatter"), params-all-gather ->
  AllGather ("_allgather_base"), separate-grads-all-reduce -> AllReduce ("allreduce"), over the
  stage's dp group; layernorm-grads-all-reduce -> AllReduce over the rank's tp group,
  embedding-grads-all-reduce -> AllReduce over its embedding group, optimizer-clip-main-grad ->
  AllReduce over the default group; gc -> nothing; optimizer -> CPU user_annotation
  `Optimizer.step#AdamW.step` with the op's exact start and duration.

Times: µs, ts = base_us + (step origin + start_ts) * 1e6 (+ the rank's clock offset). Lake
start_ts are per-step offsets (every step starts at 0), so steps are laid end to end on one
timeline (`step_origins`: each step starts `step_gap_s` after the previous one's last end).
Clocks: Kineto's ts are relative to the file's baseTimeNanoseconds (base + ts = the event's
time on the host's clock). `clocks="job"` (default) writes one base for every rank: one clock,
the lake trace's timeline exactly. `clocks="host"` gives each host of the manifest its own
base (hosts booted 61 s apart) and `clocks="rank"` each rank, with ts shifted so that
base + ts stays the same instant; each file names its clock's host in `host_name` (as torch
2.13 writes it), which is how the converter tells clocks apart.
Only the analysed workers (one rank per (dp_rank, stage), the manifest's `workers[...]["rank"]`)
are written: with tp = cp = 1 that is every rank of the world; with tp > 1 the TP peers have no
file, and since the pipeline / data-parallel groups list the representatives only, the converter
analyses exactly those. With vpp > 1 the p2p peer is the next/previous stage modulo pp and the
no-op records of the interleaved schedule cannot be told from the trace rows (they are written
as real transfers): use vpp = 1 where exactness matters.
"""
from __future__ import annotations

import dataclasses
import gzip
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.trace import OPTYPES

__all__ = [
    "DEFAULT_BASE_US",
    "BASE_TIME_NS",
    "CLOCK_SPACING_NS",
    "JobArrays",
    "job_arrays",
    "process_groups",
    "step_origins",
    "rank_document",
    "dump_document",
    "write_rank",
    "write_kineto_job",
]

DEFAULT_BASE_US = 4_458_676_000_000.0     # a CLOCK_MONOTONIC-like µs origin of the size real traces show
BASE_TIME_NS = 1_711_964_646_000_000_000  # baseTimeNanoseconds of the job's clock (whole seconds, as Kineto writes it)
CLOCK_SPACING_NS = 61_000_000_000         # base of clock k = BASE_TIME_NS + k * 61 s ("host"/"rank" clocks)
_CODE = {name: code for code, name in enumerate(OPTYPES)}
_SENDRECV = "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"
_DP_KERNELS = {   # optype -> (kernel name, Collective name, dtype)
    "grads-reduce-scatter": ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                             "reduce_scatter", "BFloat16"),
    "params-all-gather": ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                          "_allgather_base", "BFloat16"),
    "separate-grads-all-reduce": ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                                  "allreduce", "BFloat16"),
    "layernorm-grads-all-reduce": ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                                   "allreduce", "BFloat16"),
    "embedding-grads-all-reduce": ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                                   "allreduce", "BFloat16"),
    "optimizer-clip-main-grad": ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                                 "allreduce", "Float"),
}
_CPU_COLLECTIVE = {"reduce_scatter": "nccl:_reduce_scatter_base", "_allgather_base": "nccl:_all_gather_base",
                   "allreduce": "nccl:all_reduce"}
_GROUP_OF = {"grads-reduce-scatter": "dp", "params-all-gather": "dp", "separate-grads-all-reduce": "dp",
             "layernorm-grads-all-reduce": "tp", "embedding-grads-all-reduce": "embedding",
             "optimizer-clip-main-grad": "default"}
_NELEMS = {"grads-reduce-scatter": 402_653_184, "params-all-gather": 50_331_648, "separate-grads-all-reduce": 8_388_608,
           "layernorm-grads-all-reduce": 1_048_576, "embedding-grads-all-reduce": 525_336_576,
           "optimizer-clip-main-grad": 1, "p2p": 16_777_216}
# Filler: (cpu op, kernel) pairs of a bf16 transformer layer on Hopper.
_FILLER = (
    ("aten::native_layer_norm", "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>"
                                "(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, "
                                "float*, c10::BFloat16*)"),
    ("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
                 "kernel__5x_cublas"),
    ("aten::_flash_attention_forward", "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, "
                                       "128, 64, 4, false, false, cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits"
                                       "<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, "
                                       "false>(pytorch_flash::Flash_fwd_params)"),
    ("aten::add", "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
                  "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)"),
    ("aten::gelu", "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
                   "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::{lambda("
                   "c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
                   "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::{lambda("
                   "c10::BFloat16)#1}, at::detail::Array<char*, 2>)"),
    ("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
                 "kernel__5x_cublas"),
)
_STREAM_COMPUTE, _STREAM_SEND, _STREAM_RECV, _STREAM_DP, _STREAM_OTHER = 7, 20, 24, 28, 32


@dataclasses.dataclass
class JobArrays:
    """A lake job's trace as numpy columns plus its layout (prepared once, shared by every rank)."""

    job_id: str
    dp: int
    pp: int
    tp: int
    cp: int
    vpp: int
    world: int
    rank_of: dict[tuple[int, int], int]     # (dp_rank, stage) -> global rank
    host_of: dict[tuple[int, int], str]     # (dp_rank, stage) -> host name
    dp_rank: np.ndarray
    stage: np.ndarray
    step: np.ndarray
    optype: np.ndarray                      # OPTYPES codes
    start: np.ndarray                       # seconds on the job's timeline (steps laid end to end)
    duration: np.ndarray
    mb: np.ndarray
    gmc: np.ndarray
    steps: np.ndarray                       # sorted step ids


def _manifest_dict(manifest) -> dict[str, Any]:
    if isinstance(manifest, pa.Table):
        return manifest.to_pylist()[0]
    return dict(manifest)


def _optype_codes(column) -> np.ndarray:
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(column.type):
        lookup = np.array([_CODE[name] for name in column.dictionary.to_pylist()], dtype=np.int64)
        return lookup[column.indices.to_numpy(zero_copy_only=False)]
    return np.array([_CODE[name] for name in column.to_pylist()], dtype=np.int64)


def step_origins(step: np.ndarray, start: np.ndarray, end: np.ndarray, gap_s: float) -> dict[int, float]:
    """Offset (seconds) to add to each step's per-step start_ts so that steps follow each other,
    each starting `gap_s` after the previous one's last end."""
    steps = np.unique(step)
    origins, cursor = {}, 0.0
    for value in steps.tolist():
        mine = step == value
        first, last = float(start[mine].min()), float(end[mine].max())
        origins[value] = cursor - first
        cursor += (last - first) + gap_s
    return origins


def job_arrays(job, *, step_gap_s: float = 0.02) -> JobArrays:
    """`job` (anything with .trace (TRACE_SCHEMA table) and .manifest (one-row table or dict)) -> JobArrays."""
    manifest = _manifest_dict(job.manifest)
    trace = job.trace
    col = lambda name: trace.column(name).to_numpy()
    step, start, duration = col("step").astype(np.int64), col("start_ts").astype(np.float64), col("duration").astype(np.float64)
    origins = step_origins(step, start, start + duration, step_gap_s)
    lookup = np.vectorize(origins.__getitem__, otypes=[np.float64])
    dp, pp = int(manifest["dp_size"]), int(manifest["pp_size"])
    rank_of = {(int(w["dp_rank"]), int(w["stage"])): int(w["rank"]) for w in manifest["workers"]}
    host_of = {(int(w["dp_rank"]), int(w["stage"])): str(w.get("host") or f"host-of-rank-{w['rank']}")
               for w in manifest["workers"]}
    return JobArrays(
        job_id=str(manifest["job_id"]), dp=dp, pp=pp, tp=int(manifest.get("tp_size", 1)),
        cp=int(manifest.get("dsp_size", 1)), vpp=int(manifest.get("vpp_size", 1)),
        world=int(manifest.get("world_size") or dp * pp), rank_of=rank_of, host_of=host_of,
        dp_rank=col("dp_rank").astype(np.int64), stage=col("stage").astype(np.int64), step=step,
        optype=_optype_codes(trace.column("optype")), start=start + (lookup(step) if len(step) else 0.0),
        duration=duration, mb=col("mb_id").astype(np.int64), gmc=col("gmc").astype(np.int64), steps=np.unique(step),
    )


def process_groups(arrays: JobArrays) -> list[dict[str, Any]]:
    """Every process group of the job, in creation order (pg_name = creation index, as c10d names them):
    default, pipeline groups (one per dp rank), data-parallel groups (one per stage), tensor-parallel
    groups (one per analysed worker), embedding groups (stage 0 and pp-1 of each pipeline).
    Each entry: pg_config fields plus `role` ('default', 'pp', 'dp', 'tp', 'embedding') and `key`."""
    groups: list[dict[str, Any]] = []

    def add(role, key, desc, ranks):
        groups.append({"pg_name": str(len(groups)), "pg_desc": desc, "backend_config": "cuda:nccl",
                       "pg_size": len(ranks), "ranks": list(ranks), "role": role, "key": key})

    add("default", None, "default_pg", range(arrays.world))
    for d in range(arrays.dp):
        add("pp", d, "mesh_pp", [arrays.rank_of[(d, s)] for s in range(arrays.pp)])
    for s in range(arrays.pp):
        add("dp", s, "mesh_dp", [arrays.rank_of[(d, s)] for d in range(arrays.dp)])
    for d in range(arrays.dp):
        for s in range(arrays.pp):
            rank = arrays.rank_of[(d, s)]
            add("tp", (d, s), "mesh_tp", range(rank, rank + arrays.tp))
    for d in range(arrays.dp):
        add("embedding", d, "embedding", sorted({arrays.rank_of[(d, 0)], arrays.rank_of[(d, arrays.pp - 1)]}))
    return groups


def _ranks_text(ranks) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


# CUDA runtime calls as CUPTI names them: (name, cbid)
_LAUNCH_KERNEL, _LAUNCH_KERNEL_EXC = ("cudaLaunchKernel", 211), ("cudaLaunchKernelExC", 430)   # NCCL >= 2.19: ExC
_MEMCPY, _MEMSET = ("cudaMemcpyAsync", 41), ("cudaMemsetAsync", 51)
# c10d's op around each collective's record_param_comms (Collective name -> op)
_C10D_OP = {"send": "c10d::send", "recv": "c10d::recv_", "allreduce": "c10d::allreduce_",
            "reduce_scatter": "c10d::_reduce_scatter_base_", "_allgather_base": "c10d::_allgather_base_"}


class _Events:
    """Builds one rank's traceEvents: CPU ops on the main thread (pid = tid = the process, as torch
    writes it), a backward's ops on the autograd engine's thread (a GPU backward runs there), GPU
    work on pid = device, tid = stream, each tied to its CUDA call by args.correlation and an ac2g
    flow (s at the call, f with bp "e" at the GPU op, id = correlation)."""

    def __init__(self, rank: int, offset_us: float, seed: int):
        self.pid = 100_000 + rank
        self.tid = self.pid
        self.autograd_tid = self.pid + 1_000
        self.device = rank % 8
        self.offset = offset_us
        self.cpu: list[dict] = []
        self.gpu: list[dict] = []
        self.flows: list[dict] = []
        self.correlation = 1000
        self.external = 1
        self.sequence = 0            # autograd's sequence number of forward ops (fwdbwd flow ids)
        self.rng = np.random.default_rng(seed)

    def _next(self) -> tuple[int, int]:
        self.correlation += 1
        self.external += 1
        return self.correlation, self.external

    def user_annotation(self, name: str, ts: float, dur: float, tid: int | None = None) -> None:
        self.external += 1
        self.cpu.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": self.pid, "tid": tid or self.tid,
                         "ts": ts + self.offset, "dur": dur, "args": {"External id": self.external,
                                                                      "Record function id": self.external,
                                                                      "Ev Idx": self.external - 1}})

    def cpu_op(self, name: str, ts: float, dur: float, tid: int | None = None, args: Mapping[str, Any] | None = None) -> None:
        self.external += 1
        self.cpu.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": self.pid, "tid": tid or self.tid,
                         "ts": ts + self.offset, "dur": dur,
                         "args": {"External id": self.external, "Record function id": self.external,
                                  "Ev Idx": self.external - 1, **(args or {})}})

    def gpu_annotation(self, name: str, ts: float, dur: float, stream: int = _STREAM_COMPUTE) -> None:
        self.external += 1
        self.gpu.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": self.device,
                         "tid": stream, "ts": ts + self.offset, "dur": dur, "args": {"External id": self.external}})

    def fwdbwd(self, phase: str, flow_id: int, ts: float, tid: int) -> None:
        """One end of an autograd flow: s at a forward op, f (bp "e") at the backward node it recorded."""
        flow = {"ph": phase, "id": flow_id, "pid": self.pid, "tid": tid, "ts": ts + self.offset, "cat": "fwdbwd",
                "name": "fwdbwd"}
        self.flows.append(dict(flow, bp="e") if phase == "f" else flow)

    def launch(self, cpu_name: str | None, cpu_ts: float, cpu_dur: float, kernel: str, ts: float, dur: float, stream: int,
               kernel_args: Mapping[str, Any] | None = None, cpu_args: Mapping[str, Any] | None = None,
               grid=(132, 1, 1), block=(256, 1, 1), tid: int | None = None, category: str = "kernel",
               runtime: tuple[str, int] = _LAUNCH_KERNEL) -> None:
        """A cpu_op (None: the caller wrote the ops around the call) issuing one GPU op: the CUDA call
        inside it, the GPU op (`kernel`, `gpu_memcpy` or `gpu_memset`), the ac2g flow binding them."""
        tid = tid or self.tid
        if cpu_name is not None:
            self.cpu_op(cpu_name, cpu_ts, cpu_dur, tid, cpu_args)
        correlation, external = self._next()
        launch_ts = cpu_ts + cpu_dur * 0.55
        launch_dur = cpu_dur * 0.3
        self.cpu.append({"ph": "X", "cat": "cuda_runtime", "name": runtime[0], "pid": self.pid, "tid": tid,
                         "ts": launch_ts + self.offset, "dur": launch_dur,
                         "args": {"External id": external, "cbid": runtime[1], "correlation": correlation}})
        args = {"External id": external, "device": self.device, "context": 1, "stream": stream, "correlation": correlation}
        if category == "kernel":
            args = {"External id": external, "queued": 0, "device": self.device, "context": 1, "stream": stream,
                    "correlation": correlation, "registers per thread": 128, "shared memory": 98304,
                    "blocks per SM": 1.0, "warps per SM": 8.0, "grid": list(grid), "block": list(block),
                    "est. achieved occupancy %": 12}
        else:   # copies and memsets: their size and bandwidth
            size = 4 << 20
            args.update({"bytes": size, "memory bandwidth (GB/s)": size / max(dur, 1e-3) / 1e3})
        args.update(kernel_args or {})
        self.gpu.append({"ph": "X", "cat": category, "name": kernel, "pid": self.device, "tid": stream,
                         "ts": ts + self.offset, "dur": dur, "args": args})
        self.flows.append({"ph": "s", "id": correlation, "pid": self.pid, "tid": tid,
                           "ts": launch_ts + self.offset, "cat": "ac2g", "name": "ac2g"})
        self.flows.append({"ph": "f", "id": correlation, "pid": self.device, "tid": stream,
                           "ts": ts + self.offset, "cat": "ac2g", "name": "ac2g", "bp": "e"})

    def collective(self, c10d_op: str, annotation: str, cpu_ts: float, kernel: str, ts: float, dur: float, stream: int,
                   kernel_args: Mapping[str, Any], cpu_args: Mapping[str, Any]) -> None:
        """An NCCL collective or p2p as torch records it: the c10d op holding record_param_comms holding
        the `nccl:*` range holding the kernel's launch (cudaLaunchKernelExC); the range again on the GPU
        over the kernel."""
        self.cpu_op(c10d_op, cpu_ts, 14.0)
        self.cpu_op("record_param_comms", cpu_ts + 1.0, 12.0, args=cpu_args)
        self.user_annotation(annotation, cpu_ts + 2.0, 10.0)
        self.launch(None, cpu_ts + 3.0, 8.0, kernel, ts, dur, stream, kernel_args=kernel_args, grid=(16, 1, 1),
                    block=(640, 1, 1), runtime=_LAUNCH_KERNEL_EXC)
        self.gpu_annotation(annotation, ts, dur, stream)

    def filler(self, n: int, cpu_ts: float, cpu_dur: float, ts: float, dur: float, *, backward: bool = False,
               recorded: list[int] | None = None, copies: bool = False) -> list[int]:
        """n kernels exactly covering [ts, ts + dur] (first starts at ts, last ends at ts + dur), launched
        from n ops spread over [cpu_ts, cpu_ts + cpu_dur]: a forward's aten ops on the main thread, a
        backward's `autograd::engine::evaluate_function:` nodes on the autograd thread, each node the end
        of the fwdbwd flow of a forward op in `recorded` (latest first). copies: a device-to-device copy
        and a memset (cudaMemcpyAsync / cudaMemsetAsync) in the gaps after the first kernels. Returns
        the flow ids of the forward ops (autograd's sequence numbers)."""
        if n <= 0 or dur <= 0:
            return []
        weights = self.rng.uniform(0.2, 1.0, n)
        bounds = ts + dur * np.concatenate([[0.0], np.cumsum(weights) / weights.sum()])
        gap = min(1.5, dur / (4 * n))
        cpu_step = cpu_dur / n
        last = n - 1
        pending = list(recorded or [])
        flows = []
        for i in range(n):
            lo = ts if i == 0 else round(float(bounds[i]) + gap, 3)
            hi = ts + dur if i == last else round(float(bounds[i + 1]), 3)
            op, kernel = _FILLER[i % len(_FILLER)]
            op_ts, op_dur = round(cpu_ts + i * cpu_step, 3), round(cpu_step * 0.8, 3)
            duration = hi - lo if i in (0, last) else round(hi - lo, 3)
            if backward:
                node = f"{op.split('::')[-1].title().replace('_', '')}Backward0"
                sequence = pending.pop(0) if pending else -1
                args = {"Sequence number": sequence, "Fwd thread id": 1} if sequence >= 0 else {}
                self.cpu_op(f"autograd::engine::evaluate_function: {node}", op_ts, op_dur, self.autograd_tid, args)
                self.cpu_op(node, op_ts + op_dur * 0.05, op_dur * 0.9, self.autograd_tid, args)
                if sequence >= 0:
                    self.fwdbwd("f", sequence, op_ts + op_dur * 0.05, self.autograd_tid)
                self.launch(op, op_ts + op_dur * 0.1, op_dur * 0.8, kernel, lo, duration, _STREAM_COMPUTE,
                            tid=self.autograd_tid)
            else:
                self.sequence += 1
                self.launch(op, op_ts, op_dur, kernel, lo, duration, _STREAM_COMPUTE,
                            cpu_args={"Sequence number": self.sequence, "Fwd thread id": 0})
                self.fwdbwd("s", self.sequence, op_ts, self.tid)
                flows.append(self.sequence)
            if copies and i + 1 < n and i < 2 and gap > 0.2:   # in the gap before the next kernel
                at = round(float(bounds[i + 1]) + gap * 0.25, 3)
                name, category, runtime, cpu_name = (("Memcpy DtoD (Device -> Device)", "gpu_memcpy", _MEMCPY, "aten::copy_")
                                                     if i == 0 else ("Memset (Device)", "gpu_memset", _MEMSET, "aten::zero_"))
                self.launch(cpu_name, op_ts + op_dur * 0.85, op_dur * 0.1, name, at, round(gap * 0.5, 3), _STREAM_COMPUTE,
                            tid=self.autograd_tid if backward else self.tid, category=category, runtime=runtime)
        return flows

    def metadata(self, rank: int, streams: Sequence[int]) -> list[dict]:
        """Process and thread names and sort indices, as torch writes them (every GPU of the host)."""
        name = f"trainer:{rank}"
        out = [{"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0, "args": {"name": name}},
               {"ph": "M", "name": "process_labels", "pid": self.pid, "tid": 0, "args": {"labels": "CPU"}},
               {"ph": "M", "name": "process_sort_index", "pid": self.pid, "tid": 0, "args": {"sort_index": self.pid}}]
        for device in range(8):
            out += [{"ph": "M", "name": "process_name", "pid": device, "tid": 0, "args": {"name": name}},
                    {"ph": "M", "name": "process_labels", "pid": device, "tid": 0, "args": {"labels": f"GPU {device}"}},
                    {"ph": "M", "name": "process_sort_index", "pid": device, "tid": 0,
                     "args": {"sort_index": 16_777_216 + device}}]
        for stream in streams:
            out += [{"ph": "M", "name": "thread_name", "pid": self.device, "tid": stream, "args": {"name": f"stream {stream} "}},
                    {"ph": "M", "name": "thread_sort_index", "pid": self.device, "tid": stream, "args": {"sort_index": stream}}]
        for tid, role in ((self.tid, "pt_main_thread"), (self.autograd_tid, "pt_autograd_0")):
            out += [{"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid, "args": {"name": f"thread {tid} ({role})"}},
                    {"ph": "M", "name": "thread_sort_index", "pid": self.pid, "tid": tid, "args": {"sort_index": tid}}]
        return out

    def profiler_span(self, start: float, end: float) -> list[dict]:
        """The profiler's own events: its whole recording window and the markers at its ends."""
        return [{"ph": "M", "name": "process_sort_index", "pid": "Spans", "tid": 0, "ts": start,
                 "args": {"sort_index": 536_870_912}},
                {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
                 "ts": start, "dur": end - start, "args": {"Op count": 0}},
                {"ph": "i", "name": "Iteration Start: PyTorch Profiler", "s": "g", "pid": "Traces",
                 "tid": "Trace PyTorch Profiler", "ts": start},
                {"ph": "i", "name": "Record Window End", "s": "g", "pid": "", "tid": "", "ts": end}]


def rank_document(arrays: JobArrays, dp_rank: int, stage: int, *, filler: int = 0, clock_offset_us: float = 0.0,
                  base_us: float = DEFAULT_BASE_US, base_time_ns: int = BASE_TIME_NS, groups: str = "all",
                  device_name: str = "NVIDIA H800", host_name: str | None = None,
                  cpu_lead_us: float = 25.0, step_margin_us: float = 40.0, seed: int = 0, copies: bool = False) -> dict[str, Any]:
    """The Kineto JSON document (a dict) of worker (dp_rank, stage).

    filler: kernels per forward compute op (backward: twice as many, launched from the autograd
    thread), each with its cpu_op, cudaLaunchKernel and flow events (0 = none: small files for tests).
    copies: with filler, a device-to-device copy and a memset per compute op too (cudaMemcpyAsync,
    cudaMemsetAsync; inside the op's span, so the rows stay the same).
    clock_offset_us: added to every timestamp of this rank (a skewed host clock).
    base_time_ns: the file's baseTimeNanoseconds; ts are written relative to it (an event at job
    time t has ts = base_us + t - (base_time_ns - BASE_TIME_NS) / 1000).
    groups: 'all' lists every process group of the job in pg_config (as DeviceMesh does),
    'own' only the groups this rank belongs to. host_name: written as torch >= 2.13 does (None:
    left out, like older versions).
    """
    if groups not in ("all", "own"):
        raise ValueError(f"groups must be 'all' or 'own', got {groups!r}")
    rank = arrays.rank_of[(dp_rank, stage)]
    all_groups = process_groups(arrays)
    by_role = {}
    for group in all_groups:
        if group["role"] == "default":
            by_role["default"] = group
        elif group["role"] == "pp" and group["key"] == dp_rank:
            by_role["pp"] = group
        elif group["role"] == "dp" and group["key"] == stage:
            by_role["dp"] = group
        elif group["role"] == "tp" and group["key"] == (dp_rank, stage):
            by_role["tp"] = group
        elif group["role"] == "embedding" and group["key"] == dp_rank:
            by_role["embedding"] = group
    listed = [g for g in all_groups if groups == "all" or rank in g["ranks"]]
    pg_config = [{k: v for k, v in g.items() if k not in ("role", "key")} for g in listed]

    origin = base_us - (int(base_time_ns) - BASE_TIME_NS) / 1000.0
    mine = np.flatnonzero((arrays.dp_rank == dp_rank) & (arrays.stage == stage))
    mine = mine[np.lexsort((arrays.optype[mine], arrays.start[mine]))]
    ev = _Events(rank, clock_offset_us, seed * 1_000_003 + rank)
    seq: dict[str, int] = {}
    issued = [-np.inf]   # end of the last c10d call on the main thread: one collective is issued at a time
    recorded: dict[tuple[int, int], list[int]] = {}   # (chunk, microbatch) -> fwdbwd flow ids of its forward ops
    pp_group = by_role["pp"]
    step_bounds: dict[int, list[float]] = {}

    def bound(step_value: int, lo: float, hi: float) -> None:
        b = step_bounds.setdefault(step_value, [lo, hi])
        b[0], b[1] = min(b[0], lo), max(b[1], hi)

    def comm(optype_name: str, ts: float, dur: float, kernel: str, collective: str, group: dict, stream: int,
             dtype: str, extra: Mapping[str, Any], cpu_name: str) -> None:
        count = seq.get(group["pg_name"], 0)
        seq[group["pg_name"]] = count + 1
        nelems = _NELEMS.get(optype_name, _NELEMS["p2p"])
        common = {"Collective name": collective, "In msg nelems": nelems, "Out msg nelems": nelems,
                  "Group size": group["pg_size"], "dtype": dtype, "In split size": "[]", "Out split size": "[]",
                  "Process Group Name": group["pg_name"], "Process Group Description": group["pg_desc"],
                  "Process Group Ranks": _ranks_text(group["ranks"]), **extra}
        cpu_ts = min(max(ts - cpu_lead_us, issued[0] + 0.5), ts - 10.5)   # its launch still precedes the kernel
        issued[0] = cpu_ts + 14.0
        ev.collective(_C10D_OP[collective], cpu_name, cpu_ts, kernel, ts, dur, stream,
                      kernel_args={**common, "Seq": count},
                      cpu_args={**common, "Seq": count, "Global rank start": 0, "Global rank stride": 1})

    for i in mine.tolist():
        name = OPTYPES[arrays.optype[i]]
        step_value = int(arrays.step[i])
        ts = float(origin + arrays.start[i] * 1e6)
        dur = float(arrays.duration[i] * 1e6)
        lo, hi = ts - cpu_lead_us, ts + dur
        if name in ("forward-compute", "backward-compute"):
            label = f"PP:{int(arrays.gmc[i])}{'F' if name == 'forward-compute' else 'B'}{int(arrays.mb[i])}"
            cpu_dur = max(dur * 0.6, 1.0)
            ev.user_annotation(label, ts - cpu_lead_us, cpu_dur)
            ev.gpu_annotation(label, ts, dur)
            backward = name == "backward-compute"
            key = (int(arrays.gmc[i]), int(arrays.mb[i]))
            flows = ev.filler(filler * (2 if backward else 1), ts - cpu_lead_us + 1.0, max(cpu_dur - 2.0, 0.5), ts, dur,
                              backward=backward, recorded=recorded.pop(key, [])[::-1] if backward else None, copies=copies)
            if not backward:
                recorded[key] = flows
        elif name in ("forward-send", "forward-recv", "backward-send", "backward-recv"):
            towards_next = name in ("forward-send", "backward-recv")
            peer_stage = stage + 1 if towards_next else stage - 1
            if arrays.vpp > 1:
                peer_stage %= arrays.pp
            if not 0 <= peer_stage < arrays.pp:
                continue    # a no-op record: no peer, nothing on the wire
            sending = name.endswith("send")
            peer_rank = arrays.rank_of[(dp_rank, peer_stage)]
            key = "Dst Rank" if sending else "Src Rank"
            arrow = f"{rank}->{peer_rank}" if sending else f"{peer_rank}->{rank}"
            comm("p2p", ts, dur, _SENDRECV, "send" if sending else "recv", pp_group,
                 _STREAM_SEND if sending else _STREAM_RECV, "BFloat16", {key: peer_stage},
                 f"nccl:{'send' if sending else 'recv'} {arrow}")
        elif name in _DP_KERNELS:
            kernel, collective, dtype = _DP_KERNELS[name]
            group = by_role[_GROUP_OF[name]]
            stream = _STREAM_DP if _GROUP_OF[name] == "dp" else _STREAM_OTHER
            comm(name, ts, dur, kernel, collective, group, stream, dtype, {}, _CPU_COLLECTIVE[collective])
        elif name == "optimizer":
            ev.user_annotation("Optimizer.step#AdamW.step", ts, dur)
            lo = ts
        else:   # gc: a placeholder, nothing in a profile
            continue
        bound(step_value, lo, hi)

    for step_value, (lo, hi) in sorted(step_bounds.items()):
        ev.user_annotation("Optimizer.zero_grad#AdamW.zero_grad", lo - step_margin_us * 0.5, step_margin_us * 0.25)
        ev.user_annotation(f"ProfilerStep#{step_value}", lo - step_margin_us, (hi - lo) + 2 * step_margin_us)

    ev.cpu.sort(key=lambda e: e["ts"])
    ev.gpu.sort(key=lambda e: e["ts"])
    info = {"backend": "nccl", "rank": rank, "world_size": arrays.world, "pg_count": len(pg_config),
            "pg_config": pg_config, "nccl_version": "2.21.5"}
    properties = [{"id": i, "name": device_name, "totalGlobalMem": 85029158912, "computeMajor": 9, "computeMinor": 0,
                   "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048, "regsPerBlock": 65536,
                   "warpSize": 32, "sharedMemPerBlock": 49152, "numSms": 132, "regsPerMultiprocessor": 65536,
                   "sharedMemPerBlockOptin": 232448, "sharedMemPerMultiprocessor": 233472} for i in range(8)]
    metadata = ev.metadata(rank, (_STREAM_COMPUTE, _STREAM_SEND, _STREAM_RECV, _STREAM_DP, _STREAM_OTHER))
    timed = ev.cpu + ev.gpu
    first = min((e["ts"] for e in timed), default=origin + clock_offset_us)
    last = max((e["ts"] + e["dur"] for e in timed), default=first)
    for event in metadata:
        event["ts"] = first - 1.0
    profiler = ev.profiler_span(first - 1.0, last + 1.0)
    return {
        "schemaVersion": 1,
        "deviceProperties": properties,
        "distributedInfo": info,
        "record_shapes": 0,
        "with_stack": 0,
        "traceEvents": metadata + ev.cpu + ev.gpu + ev.flows + profiler,
        "traceName": f"rank-{rank}.json",
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": int(base_time_ns),
        **({"host_name": host_name} if host_name is not None else {}),
    }


def dump_document(document: Mapping[str, Any]) -> bytes:
    """JSON bytes of a document (orjson when installed; floats round-trip exactly either way)."""
    try:
        import orjson

        return orjson.dumps(document)
    except ImportError:   # pragma: no cover - orjson is a declared dependency
        import json

        return json.dumps(document, separators=(",", ":")).encode()


def write_rank(document: Mapping[str, Any], path: str | os.PathLike, *, compress: bool | None = None) -> str:
    """Write one document to path (gzip when compress, or by default when the name ends in .gz)."""
    path = str(path)
    data = dump_document(document)
    if compress if compress is not None else path.endswith(".gz"):
        data = gzip.compress(data, compresslevel=1)
    pathlib.Path(path).write_bytes(data)
    return path


def write_kineto_job(job, folder: str | os.PathLike, *, filler: int = 0, compress: bool = False,
                     clock_offset_us: Mapping[int, float] | None = None, base_us: float = DEFAULT_BASE_US,
                     groups: str = "all", clocks: str = "job", workers: Sequence[tuple[int, int]] | None = None,
                     step_gap_s: float = 0.02, seed: int = 0, arrays: JobArrays | None = None,
                     copies: bool = False) -> list[str]:
    """Write `job` as one Kineto trace per analysed worker into folder: rank-{rank:05d}.json[.gz].

    clock_offset_us: global rank -> µs added to all of that rank's timestamps.
    clocks: 'job' (one baseTimeNanoseconds for all ranks), 'host' (one per host of the manifest)
    or 'rank' (one per rank); see the module docstring.
    workers: (dp_rank, stage) cells to write (default: all). Returns the paths, in rank order.
    """
    arrays = arrays or job_arrays(job, step_gap_s=step_gap_s)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    offsets = dict(clock_offset_us or {})
    if clocks not in ("job", "host", "rank"):
        raise ValueError(f"clocks must be 'job', 'host' or 'rank', got {clocks!r}")
    by_rank = sorted(arrays.rank_of, key=lambda c: arrays.rank_of[c])
    keys = {cell: 0 if clocks == "job" else (arrays.host_of[cell] if clocks == "host" else arrays.rank_of[cell])
            for cell in by_rank}
    clock_index = {key: k for k, key in enumerate(dict.fromkeys(keys[cell] for cell in by_rank))}
    base_of = {cell: BASE_TIME_NS + clock_index[keys[cell]] * CLOCK_SPACING_NS for cell in by_rank}
    cells = sorted(workers if workers is not None else arrays.rank_of, key=lambda c: arrays.rank_of[c])
    paths = []
    for dp_rank, stage in cells:
        rank = arrays.rank_of[(dp_rank, stage)]
        document = rank_document(arrays, dp_rank, stage, filler=filler, clock_offset_us=float(offsets.get(rank, 0.0)),
                                 base_us=base_us, base_time_ns=base_of[(dp_rank, stage)], groups=groups, seed=seed,
                                 host_name=f"clock-{clock_index[keys[(dp_rank, stage)]]}", copies=copies)
        suffix = ".json.gz" if compress else ".json"
        paths.append(write_rank(document, folder / f"rank-{rank:05d}{suffix}", compress=compress))
    return paths
