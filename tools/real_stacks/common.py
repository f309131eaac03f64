"""Shared pieces of the tools/real_stacks/ scripts (need torch; run from $TORCHENV).

- command-line options every script has (--out, --name, --seed, --steps, profiler schedule, --slow)
- slowdown parsing and the per-rank injections:
    fwd:R:F   forward F times as long: every hooked block re-runs its forward on a shadow copy
              (a deepcopy of the block taken before any DDP/FSDP wrapping) (F-1) times under no_grad,
              inside the block's forward (extra aten ops nested in the forward)
    bwd:R:F   backward F times as long: a hook on the block output's gradient re-runs the shadow's
              forward 2(F-1) times (backward ~= 2x forward) when the gradient arrives: inside the backward
    fwd:R:F:odd, bwd:R:F:odd  the same on odd optimizer steps only (an intermittent straggler; the
              even steps are the run's own clean counterfactual)
              Re-runs are whole, spread over the blocks (4 in every model here): truth.json states the
              factor they carry, with the asked one as `requested` (1.3x: 1.25x; 1.2x: none, a clean run)
    gc:R:N    rank R keeps a live cyclic heap of N*1000 dicts and calls gc.collect() once per optimizer
              step, in the first forward of the step (a forward pre-hook on the model)
    gcall:N   every rank keeps that heap; rank r collects on steps with step % world == r
    gcin:R:N  as gc:R:N, but the collection runs inside the forward: a forward pre-hook on the
              model's middle block (as an automatic collection strikes mid-forward)
    gcend:R:N[:K]  planned GC as a trainer writes it (Megatron's manual_gc_interval): rank R keeps
              that heap and calls gc.collect() at the end of every K-th optimizer step (default 1),
              after the optimizer, where the loop hands the step to the profiler
    gcallend:N every rank keeps that heap; rank r collects at the end of the optimizer steps with
              step % world == r (gcall's rotation, where gcend collects)
    sleep:R:MS rank R sleeps MS ms at the start of every optimizer step's first forward (a forward
              pre-hook on the model: time.sleep, the quickest slow worker to write)
    data:R:MS rank R's Dataset.__getitem__ sleeps so that one batch fetch sleeps MS ms in total
    seq       sequence-length imbalance: dynamic padding, each rank's batch length budget drawn per
              step from [L, 4L]
    split:uneven  (pipelines) stage 0 gets 3x the decoder layers of every other stage
- rank 0 writes truth.json (the schema of tools/real_traces/gen_corpus.py + "stack", "stack_details")
  after every rank has dropped its _info-rank{r}.json (no collective needed at the end, so it works
  whatever state the library left the process group in).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import math
import os
import platform
import random
import sys
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools", "real_traces"))
from train import build_gc_heap, prefault_heap  # noqa: E402  (tools/real_traces/train.py)

SLOW_KINDS = ("fwd", "bwd", "gc", "gcall", "gcin", "gcend", "gcallend", "sleep", "data", "seq", "split", "host")
CAUSES = {
    "fwd": ["individual-worker"],
    "bwd": ["individual-worker"],
    "gc": ["python-gc"],
    "gcall": ["python-gc"],
    "gcin": ["python-gc"],
    "gcend": ["python-gc"],
    "gcallend": ["python-gc"],
    "sleep": ["individual-worker", "untraced-cpu"],
    "data": ["untraced-cpu", "individual-worker"],
    "seq": ["sequence-imbalance"],
    "split": ["stage-imbalance"],
    "host": ["individual-worker"],
}


def rank_world() -> tuple[int, int]:
    """Global rank and world size from the torchrun environment (1 process without torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def add_common_args(ap: argparse.ArgumentParser, steps: int = 7) -> None:
    ap.add_argument("--out", required=True, help="run folder: rank-{r}.json, truth.json, PROVENANCE.json")
    ap.add_argument("--name", default="", help="run name (truth.json 'run'); default: the folder name")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    ap.add_argument("--prof-wait", type=int, default=1)
    ap.add_argument("--prof-warmup", type=int, default=1)
    ap.add_argument("--prof-active", type=int, default=3)
    ap.add_argument("--record-shapes", type=int, choices=[0, 1], default=1)
    ap.add_argument("--with-stack", type=int, choices=[0, 1], default=0)
    ap.add_argument("--profile-memory", type=int, choices=[0, 1], default=0)
    ap.add_argument("--with-modules", type=int, choices=[0, 1], default=0)
    ap.add_argument("--with-flops", type=int, choices=[0, 1], default=0)
    ap.add_argument("--gc-record", type=int, choices=[0, 1], default=1,
                    help="append strag_collect's Python GC record to each trace (0: the plain torch.profiler export)")
    ap.add_argument("--prefault-mb", type=int, default=None,
                    help="pre-touched heap per process (default 512 with record_shapes, else 128; 0: off)")
    ap.add_argument("--slow", action="append", default=[], metavar="KIND:RANK:AMOUNT",
                    help="fwd:R:F bwd:R:F gc:R:N gcall:N gcin:R:N gcend:R:N[:K] gcallend:N sleep:R:MS data:R:MS seq split:uneven "
                         "host:R:F (repeatable)")


def parse_slow(specs: list[str], allowed: tuple[str, ...], world: int) -> list[dict]:
    out = []
    for s in specs:
        parts = s.split(":")
        kind = parts[0]
        if kind not in SLOW_KINDS:
            raise SystemExit(f"--slow {s}: kind must be one of {SLOW_KINDS}")
        if kind not in allowed:
            raise SystemExit(f"--slow {s}: {kind} is not supported by this script (supported: {allowed})")
        if kind == "split":
            if parts[1:] != ["uneven"]:
                raise SystemExit(f"--slow {s}: only split:uneven")
            out.append({"kind": "split", "rank": None, "amount": 3.0})
        elif kind == "seq":
            if len(parts) != 1:
                raise SystemExit(f"--slow {s}: seq takes no argument")
            out.append({"kind": "seq", "rank": None, "amount": 4.0})
        elif kind in ("gcall", "gcallend"):
            if len(parts) != 2:
                raise SystemExit(f"--slow {s}: expected {kind}:N")
            out.append({"kind": kind, "rank": None, "amount": float(parts[1])})
        elif kind == "gcend":
            if len(parts) not in (3, 4):
                raise SystemExit(f"--slow {s}: expected gcend:RANK:N or gcend:RANK:N:EVERY")
            r = int(parts[1])
            if not 0 <= r < world:
                raise SystemExit(f"--slow {s}: rank {r} outside world {world}")
            every = int(parts[3]) if len(parts) == 4 else 1
            if every < 1:
                raise SystemExit(f"--slow {s}: EVERY must be >= 1")
            out.append({"kind": "gcend", "rank": r, "amount": float(parts[2]), **({"every": every} if every > 1 else {})})
        else:
            odd = kind in ("fwd", "bwd") and len(parts) == 4 and parts[3] == "odd"
            if len(parts) != 3 and not odd:
                raise SystemExit(f"--slow {s}: expected {kind}:RANK:AMOUNT" + (" or :odd" if kind in ("fwd", "bwd") else ""))
            r = int(parts[1])
            if not 0 <= r < world:
                raise SystemExit(f"--slow {s}: rank {r} outside world {world}")
            out.append({"kind": kind, "rank": r, "amount": float(parts[2]), **({"steps": "odd"} if odd else {})})
    return out


class RankSlow:
    """This rank's injections, from the parsed slowdowns."""

    def __init__(self, slowdowns: list[dict], rank: int, world: int):
        self.fwd = 1.0
        self.bwd = 1.0
        self.gc_thousands = 0
        self.gc_mode = None          # "rank" (gc:R:N), "inside" (gcin), "end" (gcend), "all" (gcall) or "allend" (gcallend)
        self.gc_every = 1            # gcend: every K-th optimizer step
        self.sleep_ms = 0.0          # sleep:R:MS
        self.data_ms = 0.0
        self.odd = False             # fwd / bwd on odd optimizer steps only
        self.seq = any(s["kind"] == "seq" for s in slowdowns)
        self.split = any(s["kind"] == "split" for s in slowdowns)
        self.host = 1.0              # host:R:F: this rank's machine F x slower at everything (contend_host)
        self.host_job = any(s["kind"] == "host" for s in slowdowns)
        for s in slowdowns:
            if s["kind"] in ("gcall", "gcallend"):
                self.gc_thousands, self.gc_mode = int(s["amount"]), "all" if s["kind"] == "gcall" else "allend"
            if s.get("rank") != rank:
                continue
            if s["kind"] == "fwd":
                self.fwd, self.odd = s["amount"], s.get("steps") == "odd"
            elif s["kind"] == "bwd":
                self.bwd, self.odd = s["amount"], s.get("steps") == "odd"
            elif s["kind"] == "gc":
                self.gc_thousands, self.gc_mode = int(s["amount"]), "rank"
            elif s["kind"] == "gcin":
                self.gc_thousands, self.gc_mode = int(s["amount"]), "inside"
            elif s["kind"] == "gcend":
                self.gc_thousands, self.gc_mode, self.gc_every = int(s["amount"]), "end", int(s.get("every", 1))
            elif s["kind"] == "sleep":
                self.sleep_ms = s["amount"]
            elif s["kind"] == "data":
                self.data_ms = s["amount"]
            elif s["kind"] == "host":
                self.host = s["amount"]


def setup_process(args, slow: "RankSlow | None" = None, rank: int = 0) -> None:
    """One thread, glibc malloc kept from returning / mmapping, heap pre-faulted (see
    tools/real_traces/README.md, 'The malloc work-around'); a host:R:F injection's contention."""
    torch.set_num_threads(1)
    if slow is not None and slow.host_job:
        contend_host(slow, rank)
    if args.prefault_mb is None:
        args.prefault_mb = 512 if args.record_shapes else 128
    if args.prefault_mb > 0:
        prefault_heap(args.prefault_mb)


# ------------------------------------------------------------------------------------------------
# slowdown injections

# CFS load weight of each nice level -5..19 (kernel/sched/core.c sched_prio_to_weight)
_CFS_WEIGHT = {-5: 3121, -4: 2501, -3: 1991, -2: 1586, -1: 1277, 0: 1024, 1: 820, 2: 655, 3: 526, 4: 423, 5: 335,
               6: 272, 7: 215, 8: 172, 9: 137, 10: 110, 11: 87, 12: 70, 13: 56, 14: 45, 15: 36, 16: 29, 17: 23,
               18: 18, 19: 15}
_BURNER = ("import os\np = os.getppid()\nwhile os.getppid() == p:\n    for _ in range(200000):\n        pass\n")


def contend_host(slow: "RankSlow", rank: int) -> None:
    """host:R:F, a machine slower at everything (not one kind of op): every rank of the job is
    pinned to a core of its own, and rank R's core also runs a busy loop at the nice level whose
    CFS weight w leaves the rank 1024 / (1024 + w) of the core, F = 1 + w / 1024 (the nearest
    level). Every thread of rank R (Python between ops, autograd, gloo) waits for the core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    if slow.host <= 1.0:
        return
    nice = min(_CFS_WEIGHT, key=lambda n: abs(_CFS_WEIGHT[n] - (slow.host - 1.0) * 1024))
    import atexit
    import subprocess

    def start():
        os.sched_setaffinity(0, {core})
        os.nice(nice)
    burner = subprocess.Popen([sys.executable, "-c", _BURNER], preexec_fn=start)
    atexit.register(burner.kill)


REALIZED: dict[str, float] = {}   # fwd / bwd factor this process's BlockSlowdown carries (whole re-runs)


def _spread(n_blocks: int, total: float) -> list[int]:
    """Extra re-runs per block so that they add up to floor(n_blocks * total): block i gets
    floor((i+1)t) - floor(it) (fractional factors such as 1.5x spread over the blocks; what
    cannot be whole re-runs is dropped, and truth.json states the factor carried, REALIZED)."""
    return [math.floor((i + 1) * total + 1e-9) - math.floor(i * total + 1e-9) for i in range(n_blocks)]


OPTIMIZER_STEPS = {"done": 0, "optimizer": None, "hooked": False}


def count_optimizer_steps() -> None:
    """Count the optimizer steps this process completes (OPTIMIZER_STEPS["done"]), with torch's
    global optimizer step post-hook; only the first optimizer that steps counts (a process with
    several steps them together). Idempotent."""
    if OPTIMIZER_STEPS["hooked"]:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def done(optimizer, args, kwargs):
        if OPTIMIZER_STEPS["optimizer"] is None:
            OPTIMIZER_STEPS["optimizer"] = id(optimizer)
        if id(optimizer) == OPTIMIZER_STEPS["optimizer"]:
            OPTIMIZER_STEPS["done"] += 1

    register_optimizer_step_post_hook(done)
    OPTIMIZER_STEPS["hooked"] = True


class BlockSlowdown:
    """fwd:R:F / bwd:R:F on a list of blocks (decoder layers, MLP blocks, pipeline stage modules).

    The extra compute runs on a shadow copy of each block (deepcopy taken at install time, before
    DDP / FSDP2 wrap the model; no hooks on it), so it needs no FSDP2 all-gather and never recurses,
    and the training math is unchanged: only this rank's wall time grows, by real aten ops inside
    the forward (fwd) or inside the backward (bwd). odd: only on odd optimizer steps, as counted by
    `count_optimizer_steps` (the steps the first optimizer of the process completed: Lightning's closure,
    HF's Trainer, Accelerate's accumulation, the pipeline schedules all end a step there; counting
    a block's forwards instead miscounts wherever a stack runs extra grad-enabled forwards)."""

    def __init__(self, fwd: float = 1.0, bwd: float = 1.0, odd: bool = False):
        self.fwd, self.bwd = fwd, bwd
        self.odd = odd
        if odd:
            count_optimizer_steps()
        self.handles = []
        self.installed = []

    def install(self, blocks, shadows=None) -> None:
        blocks = list(blocks)
        if self.fwd <= 1.0 and self.bwd <= 1.0:
            return
        if shadows is None:
            shadows = [copy.deepcopy(b) for b in blocks]
        for s in shadows:
            s.requires_grad_(False)
        nf = _spread(len(blocks), max(0.0, self.fwd - 1.0))
        nb = _spread(len(blocks), max(0.0, 2.0 * (self.bwd - 1.0)))
        # whole re-runs only: the factor the blocks carry (1.3x of 4 blocks: one re-run, 1.25x; 1.2x:
        # none) is what truth.json states (`finish`), never the one asked for
        REALIZED.update({kind: 1.0 + runs / (scale * len(blocks)) for kind, wanted, runs, scale in
                         (("fwd", self.fwd, sum(nf), 1.0), ("bwd", self.bwd, sum(nb), 2.0)) if wanted > 1.0})
        for kind, wanted in (("fwd", self.fwd), ("bwd", self.bwd)):
            if wanted > 1.0 and abs(REALIZED[kind] - wanted) > 1e-9:
                print(f"--slow {kind}:...:{wanted:g} on {len(blocks)} block(s) of whole re-runs: {REALIZED[kind]:.3g}x "
                      "(truth.json states it)", file=sys.stderr)
        for block, shadow, f, b in zip(blocks, shadows, nf, nb):
            self.handles.append(block.register_forward_hook(self._hook(shadow, f, b, self.odd), with_kwargs=True))
            self.installed.append({"block": type(block).__name__, "fwd_reruns": f, "bwd_reruns": b})

    @staticmethod
    def _hook(shadow: nn.Module, n_fwd: int, n_bwd: int, odd: bool = False):
        def hook(module, args, kwargs, output):
            if odd and OPTIMIZER_STEPS["done"] % 2 == 0:
                return None
            if n_fwd:
                with torch.no_grad():
                    for _ in range(n_fwd):
                        shadow(*args, **kwargs)
            if n_bwd and torch.is_grad_enabled():
                y = output[0] if isinstance(output, (tuple, list)) else output
                if hasattr(y, "logits"):
                    y = y.logits
                if isinstance(y, torch.Tensor) and y.requires_grad:
                    saved = (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), kwargs)

                    def grad_hook(g):
                        with torch.no_grad():
                            for _ in range(n_bwd):
                                shadow(*saved[0], **saved[1])
                        return None

                    y.register_hook(grad_hook)
            return None

        # under torch.compile the hook would be traced into the graph, where the shadow re-runs, whose
        # outputs nothing uses, are dead code: run it eagerly (a graph break) so the slowdown is real
        disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
        return disable(hook) if disable is not None else hook


class GcInjector:
    """gc:R:N / gcall:N / gcin:R:N / gcend:R:N[:K] / gcallend:N, and sleep:R:MS.  prepare() before any profiler is
    active (a throw-away profiler session creates ~120k objects by lazy imports; those and torch's own
    go to the permanent generation with gc.freeze(), so each collect's cost is set by N); build() right
    before training (freezes again, then builds the live cyclic heap).  attach(model): a forward
    pre-hook that, on the first grad-enabled forward of each optimizer step (forwards_per_step
    forwards per step), runs gc.collect() when this rank is due (gc: every step; gcall: step % world
    == rank) and sleeps sleep_ms.  on_step_end(): the scripts call it once per optimizer step, after
    the optimizer, right before prof.step(); gcend collects there on every K-th step, gcallend when due."""

    def __init__(self, slow: RankSlow, rank: int, world: int, forwards_per_step: int = 1):
        self.n = slow.gc_thousands
        self.mode = slow.gc_mode
        self.rank, self.world = rank, world
        self.fps = max(1, forwards_per_step)
        self.every = slow.gc_every
        self.sleep_s = slow.sleep_ms / 1000.0
        self.forwards = 0
        self.steps_ended = 0
        self.heap = None
        self.collects = []   # (step, ms)

    @property
    def active(self) -> bool:
        return self.n > 0 or self.sleep_s > 0

    def prepare(self) -> None:
        if self.n <= 0:
            return
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            pass
        gc.collect()
        gc.freeze()

    def build(self) -> None:
        if self.n <= 0 or self.heap is not None:
            return
        gc.collect()
        gc.freeze()
        self.heap = build_gc_heap(self.n)

    def due(self, step: int) -> bool:
        return self.mode in ("rank", "inside") or step % self.world == self.rank

    def on_forward(self) -> None:
        if not self.active or not torch.is_grad_enabled():
            return
        i = self.forwards
        self.forwards += 1
        if i % self.fps:
            return
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        step = i // self.fps
        if self.heap is not None and self.mode not in ("end", "allend") and self.due(step):
            t0 = time.perf_counter()
            gc.collect()
            self.collects.append((step, round((time.perf_counter() - t0) * 1e3, 2)))

    def on_step_end(self) -> None:
        step = self.steps_ended
        self.steps_ended += 1
        due = (self.mode == "end" and step % self.every == self.every - 1) or (self.mode == "allend" and self.due(step))
        if self.heap is not None and due:
            t0 = time.perf_counter()
            gc.collect()
            self.collects.append((step, round((time.perf_counter() - t0) * 1e3, 2)))

    def attach(self, module: nn.Module) -> None:
        """The hook on the model (gc, gcall) or, for gcin, on the middle block of its first list of
        blocks (decoder layers, MLP blocks): the collection then runs inside the forward."""
        if not self.active:
            return
        if self.mode == "inside":
            blocks = next((m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) >= 2), None)
            if blocks is None:
                raise SystemExit("--slow gcin: the model has no list of blocks to collect inside")
            module = blocks[len(blocks) // 2]
        module.register_forward_pre_hook(lambda m, a: self.on_forward())


# ------------------------------------------------------------------------------------------------
# data: random-token LM batches (padded / packed), MLP regression-free classification


class LMDataset(torch.utils.data.Dataset):
    """n random token sequences of max_len tokens (seeded per index: the same on every rank, the
    distributed sampler picks each rank's share).  data:R:MS -> sleep_ms_per_item per __getitem__."""

    def __init__(self, n: int, vocab: int, max_len: int, seed: int, sleep_ms_per_item: float = 0.0):
        self.n, self.vocab, self.max_len, self.seed = n, vocab, max_len, seed
        self.sleep_s = sleep_ms_per_item / 1000.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return {"input_ids": torch.randint(4, self.vocab, (self.max_len,), generator=g)}


class LMCollator:
    """packed: fixed-length blocks of L tokens (no padding, no mask).  padded: dynamic padding, each
    sequence cropped to a random length in [0.75T, T], the batch padded to its longest (labels -100
    on pads, attention_mask 0); T = L, or with `seq` (sequence-length imbalance) T drawn per batch
    from [L, 4L] by a per-rank generator.  lengths[] records each batch's padded length."""

    def __init__(self, mode: str, L: int, seq: bool, rank: int, seed: int, pad_id: int = 0):
        self.mode, self.L, self.seq, self.pad_id = mode, L, seq, pad_id
        self.rng = random.Random(seed * 7919 + rank * 104729 + 17)
        self.lengths: list[int] = []

    def __call__(self, items: list[dict]) -> dict:
        ids = [it["input_ids"] for it in items]
        if self.mode == "packed":
            x = torch.stack([t[: self.L] for t in ids])
            self.lengths.append(self.L)
            return {"input_ids": x, "labels": x.clone()}
        T = self.rng.randint(self.L, 4 * self.L) if self.seq else self.L
        lens = [self.rng.randint(max(1, int(0.75 * T)), T) for _ in ids]
        width = max(lens)
        x = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for j, (t, n) in enumerate(zip(ids, lens)):
            x[j, :n] = t[:n]
            mask[j, :n] = 1
        labels = x.masked_fill(mask == 0, -100)
        self.lengths.append(width)
        return {"input_ids": x, "attention_mask": mask, "labels": labels}


def tiny_hf_model(kind: str, seed: int, vocab: int = 1024, layers: int = 4, max_pos: int = 512):
    """GPT2 / Llama causal LMs from small configs (no download)."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=vocab, n_positions=max_pos, n_embd=128, n_layer=layers, n_head=4,
                         use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
        return model, list(model.transformer.h), cfg
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                          use_cache=False, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
        return model, list(model.model.layers), cfg
    raise SystemExit(f"unknown model {kind}")


def cfg_dict(cfg) -> dict:
    keep = ("model_type", "vocab_size", "hidden_size", "n_embd", "intermediate_size", "num_hidden_layers", "n_layer",
            "num_attention_heads", "n_head", "num_key_value_heads", "max_position_embeddings", "n_positions")
    d = cfg.to_dict()
    return {k: d[k] for k in keep if k in d}


def versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("lightning", "transformers", "accelerate"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def make_profiler(args, on_trace_ready):
    from torch.profiler import ProfilerActivity, profile, schedule

    return profile(activities=[ProfilerActivity.CPU],
                   schedule=schedule(wait=args.prof_wait, warmup=args.prof_warmup, active=args.prof_active,
                                     repeat=1),
                   record_shapes=bool(args.record_shapes), with_stack=bool(args.with_stack),
                   profile_memory=bool(args.profile_memory), with_modules=bool(args.with_modules),
                   with_flops=bool(args.with_flops), on_trace_ready=on_trace_ready)


def chrome_exporter(out: str, rank: int, gc_record: bool = True):
    """on_trace_ready: the rank's Chrome trace, with the Python GC record strag_collect's handler adds
    (strag_collect.gcrecord, from this checkout: the collections since the exporter was made)."""
    recorder = None
    if gc_record:
        sys.path.insert(0, REPO)
        from strag_collect.gcrecord import GcRecorder

        recorder = GcRecorder().start()

    def on_ready(prof) -> None:
        path = os.path.join(out, f"rank-{rank}.json")
        prof.export_chrome_trace(path)
        if recorder is not None:
            from strag_collect.gcrecord import GC_KEY, append_top_level

            append_top_level(path, GC_KEY, {"clock": "unix_ns", "pauses": recorder.take()})

    return on_ready


# ------------------------------------------------------------------------------------------------
# ground truth


def _as_realized(slowdowns: list[dict], infos: list[dict]) -> list[dict]:
    """fwd / bwd slowdowns at the factor their rank's blocks carried (`requested` keeps the asked
    one where it differs); one that carried none (no whole re-run) is no slowdown at all."""
    out = []
    for s in slowdowns:
        realized = (infos[s["rank"]].get("realized") or {}).get(s["kind"]) if s["kind"] in ("fwd", "bwd") else None
        if realized is None or abs(realized - s["amount"]) <= 1e-9:
            out.append(s)
        elif realized > 1.0:
            out.append({**s, "amount": realized, "requested": s["amount"]})
    return out


def write_rank_info(out: str, rank: int, info: dict) -> None:
    tmp = os.path.join(out, f".info-rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, os.path.join(out, f"_info-rank{rank}.json"))


def finish(args, *, stack: str, script: str, rank: int, world: int, coords: dict, trace_file: str | None,
           slowdowns: list[dict], truth_fields: dict, stack_details: dict, rank_extra: dict | None = None,
           wait_s: float = 180.0) -> None:
    """Every rank: drop _info-rank{r}.json.  Rank 0: wait for all of them, write truth.json (and
    PROVENANCE.json with every rank's extras), remove the _info files."""
    write_rank_info(args.out, rank, {"coords": coords, "file": trace_file, "extra": rank_extra or {},
                                     "realized": dict(REALIZED)})
    if rank != 0:
        return
    deadline = time.time() + wait_s
    paths = [os.path.join(args.out, f"_info-rank{r}.json") for r in range(world)]
    while not all(os.path.exists(p) for p in paths):
        if time.time() > deadline:
            raise SystemExit("rank 0: not every rank wrote its _info file")
        time.sleep(0.2)
    infos = []
    for p in paths:
        with open(p) as f:
            infos.append(json.load(f))
    coords_all = [i["coords"] for i in infos]
    slowdowns = _as_realized(slowdowns, infos)
    truth_slow = []
    for s in slowdowns:
        c = coords_all[s["rank"]] if s.get("rank") is not None else None
        truth_slow.append({"kind": s["kind"], "rank": s.get("rank"), "dp": c["dp"] if c else None,
                           "pp": c["pp"] if c else None, "amount": s["amount"],
                           **({"requested": s["requested"]} if "requested" in s else {}),
                           **({"steps": s["steps"]} if s.get("steps") else {}),
                           **({"every": s["every"]} if s.get("every") else {})})
    slow_ranks = set()
    for s in slowdowns:
        if s.get("rank") is not None:
            slow_ranks.add(s["rank"])
        elif s["kind"] in ("gcall", "gcallend"):
            slow_ranks.update(range(world))   # every rank is the straggler on 1/world of the steps
    causes: list[str] = []
    for s in slowdowns:
        for c in CAUSES[s["kind"]]:
            if c not in causes:
                causes.append(c)
    nproc = os.environ.get("LOCAL_WORLD_SIZE", str(world))
    argv = " ".join(sys.argv[1:])
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        cmd = f"torchrun --standalone --nproc_per_node {nproc} tools/real_stacks/{script} {argv}"
    else:
        cmd = f"python tools/real_stacks/{script} {argv}"
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    truth = {"run": args.name or os.path.basename(os.path.normpath(args.out)), "world": world}
    truth.update({k: truth_fields[k] for k in ("pp", "dp", "schedule") if k in truth_fields})
    truth.update({
        "schedule_class": truth_fields.get("schedule_class", "none"),
        "virtual_stages_per_rank": truth_fields.get("virtual_stages_per_rank", 1),
        "grad_sync": truth_fields["grad_sync"],
        "model": truth_fields["model"],
        "microbatches": truth_fields["microbatches"],
        "noise": "cpu",
        "seed": args.seed,
        "data_in_step": True if truth_fields.get("data_in_step", True) else False,
        "profiler": {"record_shapes": bool(args.record_shapes), "with_stack": bool(args.with_stack),
                     "profile_memory": bool(args.profile_memory), "with_modules": bool(args.with_modules),
                     "with_flops": bool(args.with_flops),
                     "gc_record": bool(getattr(args, "gc_record", 1)),
                     "wait": args.prof_wait, "warmup": args.prof_warmup, "active": args.prof_active,
                     "repeat": 1, "schedule": True, "export": "chrome"},
        "rank_coords": {str(r): c for r, c in enumerate(coords_all)},
        "slowdowns": truth_slow,
        "expected": {"straggling": bool(slowdowns), "slow_ranks": sorted(slow_ranks),
                     "primary_causes": causes or ["none"]},
        "trace_files": [i["file"] for i in infos],
        "torch_version": torch.__version__,
        "command": cmd,
        "date_utc": date,
        "stack": stack,
        "stack_details": stack_details,
    })
    truth["stack_details"].setdefault("versions", versions())
    with open(os.path.join(args.out, "truth.json"), "w") as f:
        json.dump(truth, f, indent=2)
        f.write("\n")
    prov = {"run": truth["run"], "command": cmd, "stack": stack, "versions": versions(),
            "platform": platform.platform(), "backend": "gloo", "device": "cpu",
            "threads_per_process": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "malloc": (f"mallopt(M_MMAP_THRESHOLD=32MB, M_TRIM_THRESHOLD=2GB), {args.prefault_mb} MB pre-touched"
                       if args.prefault_mb else "default"),
            "ranks": {str(r): i["extra"] for r, i in enumerate(infos)}, "date_utc": date}
    with open(os.path.join(args.out, "PROVENANCE.json"), "w") as f:
        json.dump(prov, f, indent=2)
        f.write("\n")
    for p in paths:
        os.remove(p)


class StepTimer:
    """Wall time between consecutive mark() calls (one per optimizer step)."""

    def __init__(self):
        self.t = None
        self.ms: list[float] = []

    def mark(self) -> None:
        now = time.perf_counter()
        if self.t is not None:
            self.ms.append(round((now - self.t) * 1e3, 1))
        self.t = now


# ------------------------------------------------------------------------------------------------
# a small MLP (the model of tools/real_traces/train.py, 4 blocks)

D_IN, N_CLASSES = 64, 10


class MLPBlock(nn.Module):
    """Pre-LayerNorm MLP block with a residual connection."""

    def __init__(self, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class MLP(nn.Module):
    def __init__(self, hidden: int = 512, n_blocks: int = 4):
        super().__init__()
        self.inp = nn.Linear(D_IN, hidden)
        self.blocks = nn.ModuleList(MLPBlock(hidden) for _ in range(n_blocks))
        self.head = nn.Linear(hidden, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class MLPDataset(torch.utils.data.Dataset):
    """Rows labelled by a fixed random teacher (seeded per index)."""

    def __init__(self, n: int, seed: int, sleep_ms_per_item: float = 0.0):
        self.n, self.seed, self.sleep_s = n, seed, sleep_ms_per_item / 1000.0
        g = torch.Generator().manual_seed(seed + 1000)
        self.teacher = torch.randn(D_IN, N_CLASSES, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(D_IN, generator=g)
        return x, (x @ self.teacher).argmax()
