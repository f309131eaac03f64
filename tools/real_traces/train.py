"""Small, real, seeded training run that writes one torch.profiler (Kineto) trace per rank.

Launch (CPU, gloo, 4 processes):

    torchrun --standalone --nproc_per_node 4 tools/real_traces/train.py \
        --schedule 1f1b --out /tmp/run

Schedules (--schedule):
  1f1b         torch.distributed.pipelining.Schedule1F1B (one stage per rank)
  gpipe        ScheduleGPipe (one stage per rank)
  interleaved  ScheduleInterleaved1F1B, 2 virtual stages per rank (stage s on pp rank s % pp)
  loopedbfs    ScheduleLoopedBFS, 2 virtual stages per rank (same placement)
  izb          ScheduleInterleavedZeroBubble, 2 virtual stages per rank (same placement)
  zbv          ScheduleZBVZeroBubble, 2 stages per rank in a V (pp rank r holds r and 2*pp-1-r)
  dualpipev    ScheduleDualPipeV, V placement like zbv
  dp           no pipeline: every rank runs the whole model over the microbatches

Layouts (--layout): pp2dp2-ppmajor (mesh ("pp","dp"), rank = pp*2+dp), pp2dp2-dpmajor (mesh
("dp","pp"), rank = dp*2+pp), pp4 (4 stages x 1 replica), dp4 (data parallel only); any other
ppPdpD-ppmajor / ppPdpD-dpmajor / ppN / dpN too, launched with --nproc_per_node P x D (e.g.
pp2dp4-dpmajor on 8 processes).
Groups (--groups): mesh (init_device_mesh + get_group) or new_group (dist.new_group for every pp
group, then every dp group, on every rank, in the same order; no mesh).

Gradient sync (--grad-sync): flat (explicit dist.all_reduce of contiguous gradient buckets after
the microbatches), ddp (DistributedDataParallel; per stage module over the dp group in pipeline
runs), async (per-parameter dist.all_reduce(async_op=True) launched from a post-accumulate-grad
hook on the last microbatch's accumulation, waited before optimizer.step), fsdp2 (fully_shard,
dp4 only), none (pp4: no data parallelism).

Slowdowns: --slow kind:rank:amount (repeatable), see README.md.

Writes DIR/rank-{r}.json (Chrome trace, --export chrome) or DIR/<worker>.<ts>.pt.trace.json
(--export tensorboard), DIR/PROVENANCE.json and DIR/truth.json (rank 0).  Gzipping is left to
the driver (make_all.sh, gen_corpus.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, schedule as prof_schedule

D_IN = 64  # MLP input features
N_CLASSES = 10
N_BLOCKS = 8  # blocks in the whole model (split over the pipeline stages)
PROF_WAIT, PROF_WARMUP, PROF_ACTIVE = 1, 1, 4

SCHEDULES = {
    # name: (class name, virtual stages per rank, placement)
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "interleaved": ("ScheduleInterleaved1F1B", 2, "loop"),
    "loopedbfs": ("ScheduleLoopedBFS", 2, "loop"),
    "izb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
    "dp": ("none (data parallel only)", 1, "loop"),
}


def _layout_arg(value: str) -> str:
    try:
        layout_sizes(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value
SLOW_KINDS = ("fwd", "bwd", "send", "allreduce", "gc", "data", "split")
CAUSES = {"fwd": ["individual-worker"], "bwd": ["individual-worker"],
          "send": ["untraced-cpu", "individual-worker"], "allreduce": ["untraced-cpu", "individual-worker"],
          "data": ["untraced-cpu", "individual-worker"], "gc": ["python-gc", "individual-worker", "untraced-cpu"],
          "split": ["stage-imbalance"]}


# ----------------------------------------------------------------------------------------------
# per-rank injection settings (filled in main)

class RankCfg:
    noise = "cpu"
    fwd_factor = 1.0      # fwd:R:F
    bwd_factor = 1.0      # bwd:R:F
    send_ms = 0.0         # send:R:MS
    allreduce_ms = 0.0    # allreduce:R:MS
    gc_heap = None        # gc:R:N -> list of live cyclic objects
    data_ms = 0.0         # data:R:MS
    legacy_sleep_s = 0.0  # --slow-mode sleep (old flag): sleep at the end of each chunk forward
    sleep_fwd_ms = 3.0    # --noise sleep: per-block forward sleep (backward sleeps 2x)
    ep_group = None       # --moe: the expert-parallel group (the DP group) of the MLP blocks' all-to-alls


CFG = RankCfg()


class SleepFn(torch.autograd.Function):
    """--noise sleep: stands in for a GPU kernel; forward sleeps fwd_s, backward sleeps bwd_s."""

    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        return g, None, None


def build_gc_heap(n_thousand: int) -> list:
    """A doubly linked chain of n_thousand*1000 dicts (each with a list): all live, all cyclic, so
    every full gc.collect() traverses them (alone on this VM: 50k ~4 ms, 100k ~15 ms, 200k ~40 ms)."""
    objs, prev = [], None
    for i in range(n_thousand * 1000):
        d = {"i": i, "p": prev, "l": [i]}
        if prev is not None:
            prev["n"] = d
        objs.append(d)
        prev = d
    return objs


class SlowWrap(nn.Module):
    """Wraps a block: sleep-noise kernel stand-in, forward / backward slowdown injection."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if CFG.noise == "sleep":
            f = CFG.sleep_fwd_ms / 1000.0
            x = SleepFn.apply(x, f * CFG.fwd_factor, 2 * f * CFG.bwd_factor)
        y = self.inner(x)
        if CFG.noise == "cpu":
            if CFG.fwd_factor > 1:
                # run the block's compute (F - 1) more times outside autograd: extra aten ops
                # inside this rank's forward, result and backward unchanged
                n = max(1, round(CFG.fwd_factor - 1))
                with torch.no_grad():
                    for _ in range(n):
                        self.inner(x)
            if CFG.bwd_factor > 1 and y.requires_grad:
                # backward ~= 2x forward: re-run the block's forward 2*(F-1) times when the
                # gradient of this block's output arrives (inside this block's backward)
                n = max(1, round(2 * (CFG.bwd_factor - 1)))
                xd, inner = x.detach(), self.inner

                def hook(g):
                    with torch.no_grad():
                        for _ in range(n):
                            inner(xd)
                    return None

                y.register_hook(hook)
        return y


class MLPBlock(nn.Module):
    """Pre-LayerNorm transformer-style MLP block with a residual connection. With --moe its MLP is
    this rank's expert: the block's rows are dispatched evenly over the expert-parallel group (the DP
    group) by an all-to-all, run through the expert, and combined back by another (autograd runs
    both again in the backward)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        if CFG.ep_group is None:
            return x + self.fc2(F.gelu(self.fc1(h)))
        from torch.distributed.nn.functional import all_to_all_single

        shape = h.shape
        flat = h.reshape(-1, shape[-1])
        routed = all_to_all_single(torch.empty_like(flat), flat, group=CFG.ep_group)
        out = self.fc2(F.gelu(self.fc1(routed)))
        back = all_to_all_single(torch.empty_like(out), out, group=CFG.ep_group)
        return x + back.reshape(shape)


class DecoderBlock(nn.Module):
    """Pre-LN decoder block: causal multi-head self-attention (F.scaled_dot_product_attention) + MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Chunk(nn.Module):
    """A contiguous slice of the model: optional input layer, blocks, optional head."""

    def __init__(self, model: str, first: bool, last: bool, n_blocks: int, dims: dict):
        super().__init__()
        self.model = model
        if model == "mlp":
            h = dims["hidden"]
            self.inp = nn.Linear(D_IN, h) if first else None
            self.blocks = nn.ModuleList(SlowWrap(MLPBlock(h)) for _ in range(n_blocks))
            self.head = nn.Linear(h, N_CLASSES) if last else None
        else:
            d = dims["d"]
            self.inp = nn.Embedding(dims["vocab"], d) if first else None
            self.pos = nn.Parameter(torch.randn(dims["seq"], d) * 0.02) if first else None
            self.blocks = nn.ModuleList(SlowWrap(DecoderBlock(d, dims["heads"])) for _ in range(n_blocks))
            self.ln_f = nn.LayerNorm(d) if last else None
            self.head = nn.Linear(d, dims["vocab"]) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if CFG.gc_heap is not None:
            gc.collect()  # gc:R:N -- a full collection over the rank's large live heap
        if self.inp is not None:
            x = self.inp(x)
            if self.model == "transformer":
                x = x + self.pos
        for b in self.blocks:
            x = b(x)
        if CFG.legacy_sleep_s > 0:
            time.sleep(CFG.legacy_sleep_s)  # old --slow-mode sleep
        if self.head is not None:
            if self.model == "transformer":
                x = self.ln_f(x)
            x = self.head(x)
        return x


def model_dims(model: str, noise: str) -> dict:
    if model == "mlp":
        return {"hidden": 512 if noise == "cpu" else 64}
    if noise == "cpu":
        return {"d": 256, "heads": 4, "seq": 64, "vocab": 512}
    return {"d": 64, "heads": 4, "seq": 16, "vocab": 128}


def blocks_per_stage(n_stages: int, uneven: bool) -> list[int]:
    base = max(1, N_BLOCKS // n_stages)
    counts = [base] * n_stages
    if uneven:
        counts[0] = 3 * base  # the first stage gets 3x the blocks of every other stage
    return counts


def build_chunks(n_stages: int, args, dims: dict) -> list[Chunk]:
    """Build every stage's chunk with the same seed on every rank (replicas equal)."""
    torch.manual_seed(args.seed)
    counts = blocks_per_stage(n_stages, args.uneven)
    return [Chunk(args.model, i == 0, i == n_stages - 1, counts[i], dims) for i in range(n_stages)]


def make_data(args, dp_rank: int, mb_size: int, dims: dict):
    """Synthetic data: MLP = classification from a fixed random teacher; transformer = token ids
    with next-token targets from a fixed random permutation.  One shard per DP rank."""
    n = args.microbatches * mb_size
    g = torch.Generator().manual_seed(args.seed + 1000)
    if args.model == "mlp":
        teacher = torch.randn(D_IN, N_CLASSES, generator=g)
    else:
        perm = torch.randperm(dims["vocab"], generator=g)
    g = torch.Generator().manual_seed(args.seed + 2000 + dp_rank)
    xs, ys = [], []
    for _ in range(args.steps):
        if args.model == "mlp":
            x = torch.randn(n, D_IN, generator=g)
            xs.append(x)
            ys.append((x @ teacher).argmax(dim=1))
        else:
            x = torch.randint(0, dims["vocab"], (n, dims["seq"]), generator=g)
            xs.append(x)
            ys.append(perm[x])
    return xs, ys


class StepDataset(torch.utils.data.Dataset):
    """One item = one training step's batch; --slow data:R:MS sleeps in __getitem__."""

    def __init__(self, xs, ys, sleep_s: float):
        self.xs, self.ys, self.sleep_s = xs, ys, sleep_s

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i):
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        return self.xs[i], self.ys[i]


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


class AsyncGradSync:
    """Per-parameter dist.all_reduce(async_op=True) launched from a post-accumulate-grad hook once the
    parameter's last microbatch gradient has been accumulated (counted per step); waited before
    optimizer.step().  --slow allreduce:R:MS sleeps before the step's first launch."""

    def __init__(self, params, group, n_accum: int):
        self.group, self.n_accum = group, n_accum
        self.works, self.count, self.paused = [], {}, False
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: torch.Tensor) -> None:
        c = self.count.get(id(p), 0) + 1
        self.count[id(p)] = c
        if c == self.n_accum:
            if CFG.allreduce_ms > 0 and not self.paused:
                time.sleep(CFG.allreduce_ms / 1000.0)
                self.paused = True
            self.works.append(dist.all_reduce(p.grad, group=self.group, async_op=True))

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.count, self.paused = [], {}, False


def ddp_pause_hook(state, bucket):
    """DDP comm hook (registered on every rank of an allreduce-slowdown run): the default allreduce
    (sum, then divide by the group size), with CFG.allreduce_ms sleep before the first bucket."""
    group = state
    if CFG.allreduce_ms > 0 and bucket.index() == 0:
        time.sleep(CFG.allreduce_ms / 1000.0)
    t = bucket.buffer().div_(group.size())
    return dist.all_reduce(t, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def patch_send_pause(ms: float) -> None:
    """--slow send:R:MS: sleep MS ms (no traced op) right before every batch of pipeline ops that
    contains a send.  The schedules call the module-level _batch_p2p for every send they fire
    (single-stage schedules via _sorted_batch_p2p, which calls _batch_p2p by name)."""
    import torch.distributed.pipelining.schedules as S

    orig = S._batch_p2p

    def _batch_p2p(p2p_ops, desc=None):
        if any(op.op is dist.isend for op in p2p_ops):
            time.sleep(ms / 1000.0)
        return orig(p2p_ops, desc)

    S._batch_p2p = _batch_p2p


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


def parse_slow(specs: list[str]) -> list[dict]:
    out = []
    for s in specs:
        parts = s.split(":")
        if parts[0] == "split":
            if parts[1:] != ["uneven"]:
                raise SystemExit(f"--slow {s}: only split:uneven")
            out.append({"kind": "split", "rank": None, "amount": 3.0})
            continue
        if len(parts) != 3 or parts[0] not in SLOW_KINDS:
            raise SystemExit(f"--slow {s}: expected kind:rank:amount, kind in {SLOW_KINDS}")
        out.append({"kind": parts[0], "rank": int(parts[1]), "amount": float(parts[2])})
    return out


_LAYOUT = re.compile(r"^(?:pp(?P<pp>\d+)dp(?P<dp>\d+)-(?P<order>ppmajor|dpmajor)|pp(?P<pp_only>\d+)|dp(?P<dp_only>\d+))$")


def layout_sizes(layout: str) -> tuple[int, int, str]:
    """(pp_size, dp_size, order) of a layout name: ppPdpD-ppmajor / -dpmajor, ppN, dpN."""
    m = _LAYOUT.match(layout)
    if not m:
        raise ValueError(f"layout {layout!r}: expected ppPdpD-ppmajor, ppPdpD-dpmajor, ppN or dpN")
    if m["pp_only"]:
        return int(m["pp_only"]), 1, "ppmajor"
    if m["dp_only"]:
        return 1, int(m["dp_only"]), "dpmajor"
    return int(m["pp"]), int(m["dp"]), m["order"]


def layout_coords(layout: str, rank: int) -> tuple[int, int, int, int]:
    """(pp_size, dp_size, pp_rank, dp_rank) of a global rank: ppmajor is mesh ("pp", "dp"), rank =
    pp_rank * dp + dp_rank; dpmajor is mesh ("dp", "pp"), rank = dp_rank * pp + pp_rank."""
    pp, dp, order = layout_sizes(layout)
    if order == "ppmajor":
        return pp, dp, rank // dp, rank % dp
    return pp, dp, rank % pp, rank // pp


def make_groups(layout: str, groups: str, rank: int):
    """Returns (pp_group, dp_group, description).  Either group is None when its size is 1."""
    pp, dp, _, _ = layout_coords(layout, rank)
    if groups == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        _, _, order = layout_sizes(layout)
        if pp > 1 and dp > 1:
            shape, names = ((pp, dp), ("pp", "dp")) if order == "ppmajor" else ((dp, pp), ("dp", "pp"))
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        elif dp == 1:
            mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
        else:
            mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        names = mesh.mesh_dim_names
        pg = mesh.get_group("pp") if "pp" in names else None
        dg = mesh.get_group("dp") if "dp" in names else None
        return pg, dg, {"kind": "init_device_mesh", "shape": list(mesh.mesh.shape), "dim_names": list(names)}
    # new_group: every rank creates every group, pp groups first, then dp groups, same order everywhere
    by_pp, by_dp = {}, {}
    for r in range(pp * dp):
        _, _, p, d = layout_coords(layout, r)
        by_dp.setdefault(p, []).append(r)  # same pp coordinate -> one dp group
        by_pp.setdefault(d, []).append(r)  # same dp coordinate -> one pp group
    _, _, my_pp, my_dp = layout_coords(layout, rank)

    def create(members: dict, mine: int, size: int):
        """Every group of one dim, in the same order on every rank; returns (this rank's group, all ranks lists)."""
        own = None
        if size > 1:
            for key in sorted(members):
                group = dist.new_group(ranks=members[key])
                own = group if key == mine else own
        return own, [members[key] for key in sorted(members)] if size > 1 else []

    pg, pp_groups = create(by_pp, my_dp, pp)
    dg, dp_groups = create(by_dp, my_pp, dp)
    return pg, dg, {"kind": "dist.new_group", "pp_groups": pp_groups, "dp_groups": dp_groups}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the traces, PROVENANCE.json and truth.json")
    ap.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    ap.add_argument("--layout", type=_layout_arg, default=None,
                    help="default: dp4 for --schedule dp, else pp2dp2-ppmajor")
    ap.add_argument("--groups", choices=["mesh", "new_group"], default="mesh")
    ap.add_argument("--grad-sync", choices=["flat", "ddp", "async", "fsdp2", "none"], default=None,
                    help="default: ddp for --schedule dp, none for pp4, else flat")
    ap.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    ap.add_argument("--moe", type=int, choices=[0, 1], default=0,
                    help="mlp, --schedule dp: each block's MLP is an expert, tokens exchanged by all-to-all over the DP group")
    ap.add_argument("--noise", choices=["cpu", "sleep"], default="cpu")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=None,
                    help="rows (mlp) or sequences (transformer) per microbatch; default 128 / 2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default wait+warmup+active)")
    ap.add_argument("--record-shapes", type=int, choices=[0, 1], default=1)
    ap.add_argument("--with-stack", type=int, choices=[0, 1], default=0)
    ap.add_argument("--profile-memory", type=int, choices=[0, 1], default=0,
                    help="torch.profiler profile_memory: [memory] instant events on every allocation")
    ap.add_argument("--with-modules", type=int, choices=[0, 1], default=0,
                    help="torch.profiler with_modules: nn.Module hierarchy events")
    ap.add_argument("--with-flops", type=int, choices=[0, 1], default=0)
    ap.add_argument("--prof-wait", type=int, default=PROF_WAIT)
    ap.add_argument("--prof-warmup", type=int, default=PROF_WARMUP)
    ap.add_argument("--prof-active", type=int, default=PROF_ACTIVE)
    ap.add_argument("--prof-schedule", type=int, choices=[0, 1], default=1,
                    help="0: profile every step without a schedule and without prof.step() (no ProfilerStep "
                         "spans), the trace written when the profiler stops")
    ap.add_argument("--prof-repeat", type=int, default=1,
                    help="profiler cycles (schedule repeat); with --steps past one cycle, each cycle writes its own "
                         "file per rank (--export chrome: rank-{r}-cycle{c}.json)")
    ap.add_argument("--export", choices=["chrome", "tensorboard"], default="chrome")
    ap.add_argument("--data-in-step", type=int, choices=[0, 1], default=0,
                    help="1: fetch each step's batch through a DataLoader inside the profiled step")
    ap.add_argument("--slow", action="append", default=[], metavar="KIND:RANK:AMOUNT",
                    help="fwd:R:F bwd:R:F send:R:MS allreduce:R:MS gc:R:N(thousand objects) data:R:MS split:uneven")
    ap.add_argument("--sleep-ms", type=float, default=3.0, help="--noise sleep: forward sleep per block (backward 2x)")
    # old flags (kept working)
    ap.add_argument("--slow-rank", type=int, default=-1, help="(old) global rank to slow down (-1: none)")
    ap.add_argument("--slow-factor", type=int, default=1, help="(old) = --slow fwd:RANK:FACTOR with --slow-mode compute")
    ap.add_argument("--slow-mode", choices=["compute", "sleep"], default="compute")
    ap.add_argument("--slow-sleep-ms", type=float, default=0.0, help="(old) sleep per chunk forward, --slow-mode sleep")
    ap.add_argument("--prefault-mb", type=int, default=None,
                    help="pre-touched heap per process, 0: off (default 1536, 3072 for dp; 256 for --noise sleep "
                         "or --record-shapes 0)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--name", default="", help="run name recorded in PROVENANCE.json / truth.json")
    ap.add_argument("--strag-lake", default=None, metavar="URL",
                    help="land each rank's trace with strag_collect.kineto_handler(URL, live=True) instead of "
                         "exporting it to --out (tools/real_traces/live_demo.py; PYTHONPATH must reach the repo)")
    ap.add_argument("--strag-job-id", default=None, help="with --strag-lake: the lake job id (default: --name)")
    args = ap.parse_args()

    # ---- resolve defaults and validate
    if args.layout is None:
        args.layout = "dp4" if args.schedule == "dp" else "pp2dp2-ppmajor"
    pp_size, dp_size, _ = layout_sizes(args.layout)
    if (args.schedule == "dp") != (pp_size == 1):
        raise SystemExit("--schedule dp goes with a dpN layout (and only it)")
    if args.grad_sync is None:
        args.grad_sync = "ddp" if args.schedule == "dp" else ("none" if dp_size == 1 else "flat")
    if dp_size == 1 and args.grad_sync != "none":
        raise SystemExit(f"--layout {args.layout} has no data parallelism: --grad-sync none")
    if dp_size > 1 and args.grad_sync == "none":
        raise SystemExit("--grad-sync none is only for a ppN layout")
    if args.grad_sync == "fsdp2" and pp_size != 1:
        raise SystemExit("--grad-sync fsdp2 only with a dpN layout")
    if args.grad_sync == "ddp" and args.schedule not in ("dp", "1f1b"):
        # every multi-microbatch schedule but 1F1B runs several forwards before the last backward;
        # DDP's bucket rebuild then trips "params_.size() == rebuilt_param_indices_.size() INTERNAL
        # ASSERT" (reducer.cpp) at the 2nd step; static_graph=True runs but gives different gradients
        raise SystemExit(f"--grad-sync ddp with --schedule {args.schedule}: DDP reducer assert (only 1f1b works)")
    if args.grad_sync == "async" and args.schedule in ("izb", "zbv", "dualpipev"):
        # zero-bubble schedules accumulate weight gradients by hand (weight.grad += dw in
        # stage_backward_weight), so post-accumulate-grad hooks never fire
        raise SystemExit(f"--grad-sync async with --schedule {args.schedule}: weight grads bypass AccumulateGrad")
    if args.microbatch_size is None:
        args.microbatch_size = 128 if args.model == "mlp" else 2
    if args.steps is None:
        args.steps = (args.prof_wait + args.prof_warmup + args.prof_active) * args.prof_repeat
    slowdowns = parse_slow(args.slow)
    if args.slow_rank >= 0:
        if args.slow_mode == "compute" and args.slow_factor > 1:
            slowdowns.append({"kind": "fwd", "rank": args.slow_rank, "amount": float(args.slow_factor)})
        elif args.slow_mode == "sleep":
            slowdowns.append({"kind": "fwd", "rank": args.slow_rank, "amount": None,
                              "legacy_sleep_ms": args.slow_sleep_ms})
    args.uneven = any(s["kind"] == "split" for s in slowdowns)
    if args.uneven and pp_size == 1:
        raise SystemExit("split:uneven needs a pipeline layout")
    for s in slowdowns:
        if s["kind"] == "data" and not args.data_in_step:
            raise SystemExit("--slow data:... needs --data-in-step 1")
        if s["kind"] == "send" and pp_size == 1:
            raise SystemExit("--slow send:... needs a pipeline layout")
        if s["kind"] == "allreduce" and args.grad_sync in ("none", "fsdp2"):
            raise SystemExit(f"--slow allreduce:... not supported with --grad-sync {args.grad_sync}")
    sched_class, n_virtual, placement = SCHEDULES[args.schedule]

    loadavg_start = open("/proc/loadavg").read().split()[:3]
    torch.set_num_threads(1)
    if args.prefault_mb is None:
        # record_shapes holds every op input until the profile ends: pre-fault a big heap; without it
        # only the mallopt settings matter (freed gradient buffers are then reused)
        args.prefault_mb = (256 if args.noise == "sleep" or not args.record_shapes
                            else (3072 if args.schedule == "dp" else 1536))
    if args.prefault_mb > 0:
        prefault_heap(args.prefault_mb)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == math.prod(layout_sizes(args.layout)[:2]), f"--layout {args.layout} needs --nproc_per_node pp x dp"

    # ---- this rank's injections
    gc_thousands = 0
    CFG.noise = args.noise
    CFG.sleep_fwd_ms = args.sleep_ms
    for s in slowdowns:
        if s.get("rank") != rank:
            continue
        k, a = s["kind"], s["amount"]
        if k == "fwd" and a is not None:
            CFG.fwd_factor = a
        elif k == "fwd":
            CFG.legacy_sleep_s = s["legacy_sleep_ms"] / 1000.0
        elif k == "bwd":
            CFG.bwd_factor = a
        elif k == "send":
            CFG.send_ms = a
        elif k == "allreduce":
            CFG.allreduce_ms = a
        elif k == "gc":
            gc_thousands = int(a)  # the heap is built just before the training loop, see below
        elif k == "data":
            CFG.data_ms = a
    if CFG.send_ms > 0:
        patch_send_pause(CFG.send_ms)
    any_allreduce_slow = any(s["kind"] == "allreduce" for s in slowdowns)

    pp_size, dp_size, pp_rank, dp_rank = layout_coords(args.layout, rank)
    pp_group, dp_group, groups_desc = make_groups(args.layout, args.groups, rank)
    dims = model_dims(args.model, args.noise)
    if args.grad_sync == "fsdp2" and args.noise == "cpu" and CFG.bwd_factor > 1:
        # the CPU backward slowdown re-runs a block in its backward hook, after FSDP2 resharded its
        # parameters (DTensors the plain forward cannot mix with tensors)
        raise SystemExit("--grad-sync fsdp2 slows backward with --noise sleep only")
    if args.moe:
        if args.schedule != "dp" or args.model != "mlp":
            raise SystemExit("--moe needs --schedule dp and --model mlp")
        if args.noise == "cpu" and (CFG.fwd_factor > 1 or CFG.bwd_factor > 1):
            # the CPU slowdowns re-run a block on the slowed rank alone: its all-to-alls would hang
            raise SystemExit("--moe slows forward / backward with --noise sleep only")
        CFG.ep_group = dp_group
    device = torch.device("cpu")
    xs, ys = make_data(args, dp_rank, args.microbatch_size, dims)
    loader_it = None
    if args.data_in_step:
        loader = torch.utils.data.DataLoader(StepDataset(xs, ys, CFG.data_ms / 1000.0), batch_size=None,
                                             shuffle=False, num_workers=0)
        loader_it = iter(loader)

    def get_batch(i: int):
        if loader_it is not None:
            return next(loader_it)
        return xs[i], ys[i]

    M = args.microbatches
    averaging = args.grad_sync in ("ddp", "fsdp2")  # these divide by the dp size themselves
    scale = 1.0 / (M * (1 if averaging else dp_size))

    def loss_fn(out, tgt):
        if args.model == "transformer":
            return F.cross_entropy(out.flatten(0, 1), tgt.flatten()) * scale
        return F.cross_entropy(out, tgt) * scale

    if args.schedule == "dp":
        stage_ids = [0]
        model = build_chunks(1, args, dims)[0]
        params = list(model.parameters())
        sync = None
        if args.grad_sync == "ddp":
            run_model = nn.parallel.DistributedDataParallel(model, process_group=dp_group)
            if any_allreduce_slow:
                run_model.register_comm_hook(dp_group, ddp_pause_hook)
        elif args.grad_sync == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            from torch.distributed.device_mesh import DeviceMesh

            fmesh = DeviceMesh.from_group(dp_group, "cpu")
            for b in model.blocks:
                fully_shard(b, mesh=fmesh)
            fully_shard(model, mesh=fmesh)
            run_model = model
            params = list(model.parameters())
        else:
            run_model = model
        if args.grad_sync == "flat":
            buffers = [GradBuffer(params)]
        elif args.grad_sync == "async":
            sync = AsyncGradSync(params, dp_group, M)
        opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)

        def train_step(i: int) -> float:
            x_all, y_all = get_batch(i)
            if args.grad_sync == "flat":
                buffers[0].zero()
            else:
                opt.zero_grad(set_to_none=True)
            total = 0.0
            for m, (x, y) in enumerate(zip(x_all.chunk(M), y_all.chunk(M))):
                last = m == M - 1
                ctx = contextlib.nullcontext()
                if args.grad_sync == "ddp" and not last:
                    ctx = run_model.no_sync()
                if args.grad_sync == "fsdp2":
                    run_model.set_requires_gradient_sync(last)
                with ctx:
                    loss = loss_fn(run_model(x), y)
                    loss.backward()
                total += loss.item()
            if args.grad_sync == "flat":
                if CFG.allreduce_ms > 0:
                    time.sleep(CFG.allreduce_ms / 1000.0)
                buffers[0].allreduce(dp_group)
            elif args.grad_sync == "async":
                sync.wait()
            opt.step()
            return total
    else:
        import torch.distributed.pipelining as P
        from torch.distributed.pipelining import PipelineStage

        n_stages = pp_size * n_virtual
        all_chunks = build_chunks(n_stages, args, dims)
        if placement == "v":
            stage_ids = [pp_rank, 2 * pp_size - 1 - pp_rank]
        else:
            stage_ids = [pp_rank + v * pp_size for v in range(n_virtual)]
        chunks = [all_chunks[s] for s in stage_ids]
        del all_chunks
        params = [p for c in chunks for p in c.parameters()]
        mods = chunks
        if args.grad_sync == "ddp":
            mods = [nn.parallel.DistributedDataParallel(c, process_group=dp_group) for c in chunks]
            if any_allreduce_slow:
                for m in mods:
                    m.register_comm_hook(dp_group, ddp_pause_hook)
        stages = [PipelineStage(m, s, n_stages, device, group=pp_group) for m, s in zip(mods, stage_ids)]
        cls = getattr(P, sched_class)
        if n_virtual == 1:
            sched = cls(stages[0], M, loss_fn=loss_fn, scale_grads=False)
        else:
            sched = cls(stages, M, loss_fn=loss_fn, scale_grads=False)
        buffers, sync = [], None
        if args.grad_sync == "flat":
            buffers = [GradBuffer(c.parameters()) for c in chunks]
        elif args.grad_sync == "async":
            sync = AsyncGradSync(params, dp_group, M)
        opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
        has_first = 0 in stage_ids
        has_last = (n_stages - 1) in stage_ids

        def train_step(i: int) -> float:
            x, y = get_batch(i)
            if args.grad_sync == "flat":
                for buffer in buffers:
                    buffer.zero()
            else:
                opt.zero_grad(set_to_none=True)
            losses: list = []
            if has_first and has_last:
                sched.step(x, target=y, losses=losses)
            elif has_first:
                sched.step(x)
            elif has_last:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
            if args.grad_sync == "flat":
                if CFG.allreduce_ms > 0:
                    time.sleep(CFG.allreduce_ms / 1000.0)
                for buffer in buffers:  # explicit all_reduce of each contiguous bucket, per model chunk
                    buffer.allreduce(dp_group)
            elif args.grad_sync == "async":
                sync.wait()
            opt.step()
            return float(sum(l.item() for l in losses) / len(losses)) if losses else float("nan")

    coords = {"dp": dp_rank, "pp": pp_rank, "stages": stage_ids}
    os.makedirs(args.out, exist_ok=True)
    before = set(os.listdir(args.out))
    worker = f"{socket.gethostname()}_{os.getpid()}"  # tensorboard_trace_handler's default worker name

    strag_handler = None
    if args.strag_lake:
        # the two lines a training script adds to land its windows live in a strag lake
        from strag_collect import kineto_handler

        strag_handler = on_ready = kineto_handler(args.strag_lake, job_id=args.strag_job_id or args.name, live=True)
    elif args.export == "chrome":
        cycles = []

        def on_ready(prof) -> None:
            cycles.append(prof.step_num)
            name = f"rank-{rank}.json" if args.prof_repeat == 1 else f"rank-{rank}-cycle{len(cycles)}.json"
            prof.export_chrome_trace(os.path.join(args.out, name))
    else:
        on_ready = torch.profiler.tensorboard_trace_handler(args.out)

    if gc_thousands:
        # --slow gc:R:N.  Torch's own objects (~285k after import; a full collect over them takes
        # 50-140 ms here) and the ~120k objects that the profiler's first start creates (lazy
        # imports) go to the permanent generation first (a throw-away profiler session, then
        # gc.freeze()), so the cost of each gc.collect() is set by N: the live cyclic heap built after.
        with profile(activities=[ProfilerActivity.CPU]):
            pass
        gc.collect()
        gc.freeze()
        CFG.gc_heap = build_gc_heap(gc_thousands)

    step_times = []
    with profile(activities=[ProfilerActivity.CPU],
                 schedule=prof_schedule(wait=args.prof_wait, warmup=args.prof_warmup, active=args.prof_active,
                                        repeat=args.prof_repeat) if args.prof_schedule else None,
                 record_shapes=bool(args.record_shapes), with_stack=bool(args.with_stack),
                 profile_memory=bool(args.profile_memory), with_modules=bool(args.with_modules),
                 with_flops=bool(args.with_flops), on_trace_ready=on_ready) as prof:
        for i in range(args.steps):
            t0 = time.perf_counter()
            loss = train_step(i)
            step_times.append(time.perf_counter() - t0)
            if args.prof_schedule:
                prof.step()
            if rank == world - 1 or rank == 0:
                print(f"rank {rank} step {i} loss {loss:.4f} {step_times[-1] * 1e3:.0f} ms", flush=True)
    if strag_handler is not None and not strag_handler.flush(timeout=120):
        print(f"rank {rank}: strag_collect uploads still running after 120 s", flush=True)

    if args.export == "chrome":
        my_files = ([f"rank-{rank}.json"] if args.prof_repeat == 1 else
                    [f"rank-{rank}-cycle{c}.json" for c in range(1, args.prof_repeat + 1)])
    else:   # one file per profiler cycle
        my_files = sorted(f for f in set(os.listdir(args.out)) - before if f.startswith(worker + "."))
    all_info = [None] * world
    dist.all_gather_object(all_info, {"coords": coords, "files": my_files,
                                      "step_ms": [round(t * 1e3, 1) for t in step_times]})
    dist.barrier()
    if rank == 0:
        all_coords = [a["coords"] for a in all_info]

        def coord_of(r):
            return all_coords[r] if r is not None else None

        truth_slow = []
        for s in slowdowns:
            c = coord_of(s["rank"])
            truth_slow.append({"kind": s["kind"], "rank": s["rank"], "dp": c["dp"] if c else None,
                               "pp": c["pp"] if c else None, "amount": s["amount"]})
        slow_ranks = sorted({s["rank"] for s in slowdowns if s["rank"] is not None})
        causes: list[str] = []
        for s in slowdowns:
            for c in CAUSES[s["kind"]]:
                if c not in causes:
                    causes.append(c)
        cmd = "torchrun --standalone --nproc_per_node 4 tools/real_traces/train.py " + " ".join(sys.argv[1:])
        loadavg = {"start": loadavg_start, "end": open("/proc/loadavg").read().split()[:3]}
        date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        truth = {
            "run": args.name, "world": world, "pp": pp_size, "dp": dp_size, "layout": args.layout,
            "groups": args.groups, "schedule": args.schedule,
            "schedule_class": sched_class if args.schedule != "dp" else "none",
            "virtual_stages_per_rank": n_virtual, "grad_sync": args.grad_sync,
            "model": args.model + ("-moe" if args.moe else ""),
            "microbatches": M, "noise": args.noise, "seed": args.seed, "data_in_step": bool(args.data_in_step),
            "profiler": {"record_shapes": bool(args.record_shapes), "with_stack": bool(args.with_stack),
                         "profile_memory": bool(args.profile_memory), "with_modules": bool(args.with_modules),
                         "with_flops": bool(args.with_flops),
                         "wait": args.prof_wait, "warmup": args.prof_warmup, "active": args.prof_active,
                         "repeat": args.prof_repeat, "schedule": bool(args.prof_schedule), "export": args.export},
            "rank_coords": {str(r): c for r, c in enumerate(all_coords)},
            "slowdowns": truth_slow,
            "expected": {"straggling": bool(slowdowns), "slow_ranks": slow_ranks,
                         "primary_causes": causes or ["none"]},
            "trace_files": [f for a in all_info for f in a["files"]],
            "torch_version": torch.__version__, "command": cmd, "loadavg": loadavg, "date_utc": date,
        }
        with open(os.path.join(args.out, "truth.json"), "w") as f:
            json.dump(truth, f, indent=2)
            f.write("\n")
        prov = {
            "run": args.name,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "command": cmd,
            "backend": "gloo",
            "device": "cpu",
            "threads_per_process": torch.get_num_threads(),
            "env": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
            "malloc": (f"mallopt(M_MMAP_THRESHOLD=32MB, M_TRIM_THRESHOLD=2GB) and {args.prefault_mb} MB of heap "
                       "pre-touched at start-up (see prefault_heap: record_shapes keeps op inputs alive, fresh "
                       "page faults otherwise slowed backward matmuls)" if args.prefault_mb > 0 else "default"),
            "world_size": world,
            "layout": args.layout,
            "groups": groups_desc,
            "schedule": args.schedule,
            "schedule_class": sched_class,
            "grad_sync": args.grad_sync,
            "optimizer": "torch.optim.SGD(lr=%g, momentum=0.9)" % args.lr,
            "model": args.model,
            "model_dims": dims,
            "noise": args.noise,
            "sleep_ms_per_block_fwd": args.sleep_ms if args.noise == "sleep" else None,
            "blocks_per_stage": blocks_per_stage(pp_size * n_virtual if args.schedule != "dp" else 1, args.uneven),
            "seed": args.seed,
            "microbatches": M,
            "microbatch_size": args.microbatch_size,
            "train_steps": args.steps,
            "data_in_step": bool(args.data_in_step),
            "profiler": {"activities": ["CPU"], "record_shapes": bool(args.record_shapes),
                         "with_stack": bool(args.with_stack),
                         "schedule": {"wait": args.prof_wait, "warmup": args.prof_warmup,
                                      "active": args.prof_active, "repeat": args.prof_repeat},
                         "export": ("prof.export_chrome_trace in on_trace_ready" if args.export == "chrome"
                                    else "torch.profiler.tensorboard_trace_handler(out)")},
            "steps_profiled": list(range(args.prof_wait + args.prof_warmup,
                                         args.prof_wait + args.prof_warmup + args.prof_active)),
            "rank_coords": {str(r): c for r, c in enumerate(all_coords)},
            "slowdowns": slowdowns,
            # the keys of the older PROVENANCE.json (tests/data/real_traces), kept for its readers
            "mesh": groups_desc,
            "slow_rank": slow_ranks[0] if len(slow_ranks) == 1 else None,
            "slow_rank_coords": all_coords[slow_ranks[0]] if len(slow_ranks) == 1 else None,
            "slow_factor": (args.slow_factor if args.slow_rank >= 0 and args.slow_mode == "compute" else None),
            "slow_sleep_ms": (args.slow_sleep_ms if args.slow_rank >= 0 and args.slow_mode == "sleep" else None),
            "rank0_step_wall_ms": all_info[0]["step_ms"],
            "step_wall_ms": {str(r): a["step_ms"] for r, a in enumerate(all_info)},
            "loadavg_1_5_15min": loadavg,
            "date_utc": date,
        }
        with open(os.path.join(args.out, "PROVENANCE.json"), "w") as f:
            json.dump(prov, f, indent=2)
            f.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
