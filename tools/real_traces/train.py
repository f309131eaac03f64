"""Small, real, seeded training run that writes one torch.profiler (Kineto) trace per rank.

Launch (CPU, gloo, 4 processes):

    torchrun --standalone --nproc_per_node 4 tools/real_traces/train.py \
        --schedule 1f1b --out /tmp/run

Schedules:
  1f1b         2 pipeline stages x 2 DP replicas, torch.distributed.pipelining.Schedule1F1B
  gpipe        same mesh, ScheduleGPipe
  interleaved  same mesh, ScheduleInterleaved1F1B with 2 virtual stages per rank (4 in all)
  dp           DP only over the 4 ranks with DistributedDataParallel (gradient accumulation over
               the microbatches with no_sync(), DDP's bucketed all-reduce on the last one)

The pipeline schedules sync gradients over the "dp" mesh dimension with explicit dist.all_reduce
calls on contiguous gradient buckets (<= 25 MB, reverse parameter order, like DDP; each
parameter's .grad is a view into its bucket, like Megatron's grad buffers, so there is no
flattening copy), summing (the loss carries 1 / dp), after schedule.step() and before
optimizer.step(). The schedule does not rescale the gradients after the step either
(scale_grads=False, the loss carries 1 / microbatches): the step has little CPU work between the
last backward and the all-reduces that no traced op accounts for.

Writes DIR/rank-{r}.json (Chrome trace, exported by torch.profiler) and DIR/PROVENANCE.json
(rank 0).  Gzipping is left to the driver (make_all.sh).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, schedule as prof_schedule

D_IN = 64  # input features
HIDDEN = 512  # model width
N_CLASSES = 10
N_BLOCKS = 8  # MLP blocks in the whole model (4 per pipeline stage)
PROF_WAIT, PROF_WARMUP, PROF_ACTIVE = 1, 1, 4


class Block(nn.Module):
    """Pre-LayerNorm transformer-style MLP block with a residual connection."""

    def __init__(self, hidden: int, slow_factor: int = 1, slow_mode: str = "none"):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.slow_factor = slow_factor
        self.slow_mode = slow_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(self.ln(x))))
        if self.slow_factor > 1 and self.slow_mode == "compute":
            # Straggler injection: run this block's matmuls (slow_factor - 1) more times.
            # Outside autograd, so backward and the result are unchanged; only the forward
            # takes ~slow_factor times as long (the extra aten::linear ops are in the trace).
            with torch.no_grad():
                for _ in range(self.slow_factor - 1):
                    self.fc2(F.gelu(self.fc1(self.ln(x))))
        return x + y


class Chunk(nn.Module):
    """A contiguous slice of the model: optional input projection, blocks, optional head."""

    def __init__(self, first: bool, last: bool, n_blocks: int, slow_factor: int, slow_mode: str,
                 sleep_s: float):
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN) if first else None
        self.blocks = nn.ModuleList(Block(HIDDEN, slow_factor, slow_mode) for _ in range(n_blocks))
        self.head = nn.Linear(HIDDEN, N_CLASSES) if last else None
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)  # straggler injection, --slow-mode sleep
        if self.head is not None:
            x = self.head(x)
        return x


def build_chunks(n_chunks: int, slow: bool, args) -> list[Chunk]:
    """Build all n_chunks chunks of the model with the same seed on every rank (replicas equal)."""
    torch.manual_seed(args.seed)
    per = N_BLOCKS // n_chunks
    chunks = []
    for i in range(n_chunks):
        chunks.append(Chunk(first=i == 0, last=i == n_chunks - 1, n_blocks=per,
                            slow_factor=args.slow_factor if slow else 1,
                            slow_mode=args.slow_mode if slow else "none",
                            sleep_s=args.slow_sleep_ms / 1000.0 if (slow and args.slow_mode == "sleep") else 0.0))
    return chunks


def make_data(args, dp_rank: int, n_rows: int):
    """Synthetic classification data: labels from a fixed random teacher; one shard per DP rank."""
    g = torch.Generator().manual_seed(args.seed + 1000)
    teacher = torch.randn(D_IN, N_CLASSES, generator=g)
    g = torch.Generator().manual_seed(args.seed + 2000 + dp_rank)
    xs, ys = [], []
    for _ in range(args.steps):
        x = torch.randn(n_rows, D_IN, generator=g)
        xs.append(x)
        ys.append((x @ teacher).argmax(dim=1))
    return xs, ys


BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


class GradBuffer:
    """Megatron-style contiguous gradient buckets: every parameter's .grad is a view into one flat
    tensor per bucket (<= 25 MB, reverse parameter order, like DDP), so backward accumulates in
    place and the DP sync all-reduces whole buckets with no copies before or after."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.flats, bucket, size = [], [], 0
        for p in reversed(self.params):
            if bucket and size + p.numel() * p.element_size() > BUCKET_BYTES:
                self._add(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += p.numel() * p.element_size()
        if bucket:
            self._add(bucket)

    def _add(self, bucket) -> None:
        flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype)
        offset = 0
        for p in bucket:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.flats.append((flat, bucket))

    def zero(self) -> None:
        for flat, _ in self.flats:
            flat.zero_()

    def allreduce(self, group) -> None:
        """Sum every bucket over group (the loss carries the 1 / dp of the mean)."""
        for flat, bucket in self.flats:
            for p in bucket:   # autograd must have accumulated into the views, not replaced them
                assert p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            dist.all_reduce(flat, group=group)


def prefault_heap(mb: int) -> None:
    """Keep freed memory in the process heap and pre-touch `mb` MB of it.

    record_shapes=True makes torch.profiler hold a reference to every op's input tensors until the
    profile ends (pytorch/pytorch#133444), so the fresh weight-gradient buffers of each backward are
    never reused: ~128 MB of new pages per step and pipeline rank.  On this VM the first-touch page
    faults made the weight-gradient matmuls 2-25x slower, growing step by step (a profiler/VM
    artifact, not the training code).  glibc malloc is told not to use mmap below 32 MB nor to trim
    its heap, and `mb` MB of 4 MB tensors are allocated, touched and freed at start-up, so later
    allocations reuse already-faulted pages.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    pool = [torch.ones(1024 * 1024) for _ in range(mb // 4)]
    del pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for rank-{r}.json and PROVENANCE.json")
    ap.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved", "dp"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=128, help="rows per microbatch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=PROF_WAIT + PROF_WARMUP + PROF_ACTIVE,
                    help="training steps (the profiler schedule covers the first 6)")
    ap.add_argument("--slow-rank", type=int, default=-1, help="global rank to slow down (-1: none)")
    ap.add_argument("--slow-factor", type=int, default=1,
                    help="--slow-mode compute: run the forward's matmuls this many times on --slow-rank")
    ap.add_argument("--slow-mode", choices=["compute", "sleep"], default="compute")
    ap.add_argument("--slow-sleep-ms", type=float, default=0.0, help="sleep per chunk forward, --slow-mode sleep")
    ap.add_argument("--prefault-mb", type=int, default=None,
                    help="pre-touched heap per process, 0: off (default 1536, 3072 for dp); see prefault_heap()")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--name", default="", help="run name recorded in PROVENANCE.json")
    args = ap.parse_args()

    loadavg_start = open("/proc/loadavg").read().split()[:3]
    torch.set_num_threads(1)
    if args.prefault_mb is None:
        args.prefault_mb = 3072 if args.schedule == "dp" else 1536
    if args.prefault_mb > 0:
        prefault_heap(args.prefault_mb)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "this script expects --nproc_per_node 4"
    slow = rank == args.slow_rank
    device = torch.device("cpu")
    coords: dict = {}

    if args.schedule == "dp":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        dp_group = mesh.get_group("dp")
        dp_rank = mesh.get_local_rank("dp")
        coords = {"dp": dp_rank, "stage": None}
        model = nn.Sequential(*build_chunks(1, slow, args))
        ddp = nn.parallel.DistributedDataParallel(model, process_group=dp_group)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        xs, ys = make_data(args, dp_rank, args.microbatches * args.microbatch_size)

        def train_step(i: int) -> float:
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for m, (x, y) in enumerate(zip(xs[i].chunk(args.microbatches), ys[i].chunk(args.microbatches))):
                last = m == args.microbatches - 1
                if last:
                    loss = F.cross_entropy(ddp(x), y) / args.microbatches
                    loss.backward()
                else:
                    with ddp.no_sync():
                        loss = F.cross_entropy(ddp(x), y) / args.microbatches
                        loss.backward()
                total += loss.item()
            opt.step()
            return total
    else:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        pp_size = 2
        n_virtual = 2 if args.schedule == "interleaved" else 1
        n_stages = pp_size * n_virtual
        all_chunks = build_chunks(n_stages, slow, args)
        stage_ids = [pp_rank + v * pp_size for v in range(n_virtual)]
        coords = {"dp": dp_rank, "pp": pp_rank, "stages": stage_ids}
        chunks = [all_chunks[s] for s in stage_ids]
        del all_chunks
        stages = [PipelineStage(c, s, n_stages, device, group=pp_group) for c, s in zip(chunks, stage_ids)]
        # the mean over microbatches and DP replicas comes from the loss: the schedule does not rescale
        # the gradients after the step (scale_grads=False) and the DP all-reduce sums
        scale = 1.0 / (2 * args.microbatches)
        loss_fn = lambda out, tgt: F.cross_entropy(out, tgt) * scale  # noqa: E731
        if args.schedule == "1f1b":
            sched = Schedule1F1B(stages[0], args.microbatches, loss_fn=loss_fn, scale_grads=False)
        elif args.schedule == "gpipe":
            sched = ScheduleGPipe(stages[0], args.microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            sched = ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=loss_fn, scale_grads=False)
        params = [p for c in chunks for p in c.parameters()]
        buffers = [GradBuffer(c.parameters()) for c in chunks]
        opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
        xs, ys = make_data(args, dp_rank, args.microbatches * args.microbatch_size)
        has_first = 0 in stage_ids
        has_last = (n_stages - 1) in stage_ids

        def train_step(i: int) -> float:
            for buffer in buffers:
                buffer.zero()
            losses: list = []
            if has_first and has_last:
                sched.step(xs[i], target=ys[i], losses=losses)
            elif has_first:
                sched.step(xs[i])
            elif has_last:
                sched.step(target=ys[i], losses=losses)
            else:
                sched.step()
            for buffer in buffers:  # DP gradient sync: explicit all_reduce of each contiguous bucket, per model chunk
                buffer.allreduce(dp_group)
            opt.step()
            return float(sum(l.item() for l in losses) / len(losses)) if losses else float("nan")

    os.makedirs(args.out, exist_ok=True)

    def on_ready(prof) -> None:
        prof.export_chrome_trace(os.path.join(args.out, f"rank-{rank}.json"))

    step_times = []
    with profile(activities=[ProfilerActivity.CPU],
                 schedule=prof_schedule(wait=PROF_WAIT, warmup=PROF_WARMUP, active=PROF_ACTIVE, repeat=1),
                 record_shapes=True, on_trace_ready=on_ready) as prof:
        for i in range(args.steps):
            t0 = time.perf_counter()
            loss = train_step(i)
            step_times.append(time.perf_counter() - t0)
            prof.step()
            if rank == world - 1 or rank == 0:
                print(f"rank {rank} step {i} loss {loss:.4f} {step_times[-1] * 1e3:.0f} ms", flush=True)

    all_coords = [None] * world
    dist.all_gather_object(all_coords, coords)
    dist.barrier()
    if rank == 0:
        prov = {
            "run": args.name,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "command": "torchrun --standalone --nproc_per_node 4 tools/real_traces/train.py " + " ".join(sys.argv[1:]),
            "backend": "gloo",
            "device": "cpu",
            "threads_per_process": torch.get_num_threads(),
            "env": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
            "malloc": (f"mallopt(M_MMAP_THRESHOLD=32MB, M_TRIM_THRESHOLD=2GB) and {args.prefault_mb} MB of heap "
                       "pre-touched at start-up (see prefault_heap: record_shapes keeps op inputs alive, fresh "
                       "page faults otherwise slowed backward matmuls)" if args.prefault_mb > 0 else "default"),
            "world_size": world,
            "mesh": ({"shape": [4], "dim_names": ["dp"]} if args.schedule == "dp"
                     else {"shape": [2, 2], "dim_names": ["pp", "dp"], "global_rank": "pp * 2 + dp"}),
            "schedule": args.schedule,
            "schedule_class": {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
                               "interleaved": "ScheduleInterleaved1F1B",
                               "dp": "DistributedDataParallel (no pipeline)"}[args.schedule],
            "grad_sync": ("DDP buckets, no_sync() on all but the last microbatch" if args.schedule == "dp"
                          else "explicit dist.all_reduce over the dp group of contiguous gradient buckets (<= 25 MB, "
                               "reverse parameter order, .grad views into them: no copies) per model chunk, "
                               "after schedule.step(), before optimizer.step()"),
            "optimizer": "torch.optim.SGD(lr=%g, momentum=0.9)" % args.lr,
            "model": f"MLP: Linear({D_IN},{HIDDEN}) + {N_BLOCKS} x [LayerNorm, Linear({HIDDEN},{4 * HIDDEN}), GELU, "
                     f"Linear({4 * HIDDEN},{HIDDEN}), residual] + Linear({HIDDEN},{N_CLASSES}); "
                     "split evenly over the stages",
            "seed": args.seed,
            "microbatches": args.microbatches,
            "microbatch_size": args.microbatch_size,
            "train_steps": args.steps,
            "profiler": {"activities": ["CPU"], "record_shapes": True,
                         "schedule": {"wait": PROF_WAIT, "warmup": PROF_WARMUP, "active": PROF_ACTIVE, "repeat": 1},
                         "export": "prof.export_chrome_trace in on_trace_ready"},
            "steps_profiled": list(range(PROF_WAIT + PROF_WARMUP, PROF_WAIT + PROF_WARMUP + PROF_ACTIVE)),
            "rank_coords": {str(r): c for r, c in enumerate(all_coords)},
            "slow_rank": args.slow_rank if args.slow_rank >= 0 else None,
            "slow_rank_coords": all_coords[args.slow_rank] if args.slow_rank >= 0 else None,
            "slow_factor": (args.slow_factor if args.slow_rank >= 0 and args.slow_mode == "compute" else None),
            "slow_sleep_ms": (args.slow_sleep_ms if args.slow_rank >= 0 and args.slow_mode == "sleep" else None),
            "slow_injection": (None if args.slow_rank < 0 else
                               (f"real compute: every Block.forward on the slow rank runs its LayerNorm/fc1/GELU/fc2 "
                                f"{args.slow_factor - 1} extra time(s) under torch.no_grad() (extra aten::linear ops "
                                f"inside the forward; backward unchanged)" if args.slow_mode == "compute" else
                                f"time.sleep({args.slow_sleep_ms} ms) at the end of every chunk forward on the slow rank")),
            "rank0_step_wall_ms": [round(t * 1e3, 1) for t in step_times],
            "loadavg_1_5_15min": {"start": loadavg_start, "end": open("/proc/loadavg").read().split()[:3],
                                  "note": "the run's own 4 processes add up to ~4 at the end"},
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        with open(os.path.join(args.out, "PROVENANCE.json"), "w") as f:
            json.dump(prov, f, indent=2)
            f.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
