"""PyTorch Lightning DDP on CPU (gloo), launched by torchrun (Lightning detects the torchelastic env).

    torchrun --standalone --nproc_per_node 2 tools/real_stacks/lightning_ddp.py --out /tmp/l \
        [--model mlp|gpt2] [--profiler lightning|callback] [--accumulate 1|2] [--manual-opt 0|1] \
        [--slow fwd:1:2 ...]

Trainer(accelerator="cpu", devices=N, strategy="ddp", max_steps=--steps, accumulate_grad_batches=...)
over a LightningModule holding an MLP (4 pre-LN blocks, like tools/real_traces) or a tiny GPT2 LM.
Optimizer AdamW.  --manual-opt 1: automatic_optimization=False, training_step does
manual_backward(loss / accumulate) and opt.step() / opt.zero_grad() every --accumulate batches.

--profiler lightning: Lightning's own PyTorchProfiler(dirpath, filename="prof", export_to_chrome=True,
schedule=torch.profiler.schedule(wait, warmup, active), record_shapes=...).  It steps the torch
profiler whenever a `*training_step` action stops (once per training_step call = per micro-batch)
and writes `<dirpath>/fit-prof-<local_rank>-[Strategy]DDPStrategy.training_step.<ns>.pt.trace.json`
through tensorboard_trace_handler; this script renames it to rank-{r}.json.
--profiler callback: a lightning.Callback drives torch.profiler itself: started in on_train_start,
prof.step() in on_train_batch_end whenever trainer.global_step advanced (= per optimizer step),
stopped in on_train_end; chrome export per rank.
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
import torch.nn.functional as F

import common as C

import lightning as L  # noqa: E402


class LitModel(L.LightningModule):
    def __init__(self, kind: str, seed: int, manual: bool, accumulate: int):
        super().__init__()
        self.kind, self.accumulate = kind, accumulate
        self.automatic_optimization = not manual
        if kind == "mlp":
            torch.manual_seed(seed)
            self.net = C.MLP()
            self.blocks = list(self.net.blocks)
            self.model_cfg = {"hidden": 512, "blocks": 4}
        else:
            self.net, self.blocks, cfg = C.tiny_hf_model(kind, seed)
            self.model_cfg = C.cfg_dict(cfg)

    def _loss(self, batch):
        if self.kind == "mlp":
            x, y = batch
            return F.cross_entropy(self.net(x), y)
        return self.net(**batch).loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            opt.step()
            opt.zero_grad()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TorchProfilerCallback(L.Callback):
    """--profiler callback: torch.profiler driven from Lightning hooks, one step per optimizer step."""

    def __init__(self, args, rank: int, gcinj: C.GcInjector, timer: C.StepTimer):
        self.args, self.rank, self.gcinj, self.timer = args, rank, gcinj, timer
        self.prof = None
        self.last = 0

    def on_train_start(self, trainer, pl_module):
        self.gcinj.build()
        self.prof = C.make_profiler(self.args, C.chrome_exporter(self.args.out, self.rank, gc_record=bool(self.args.gc_record)))
        self.prof.start()
        self.timer.mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.last:
            self.last = trainer.global_step
            self.gcinj.on_step_end()
            self.prof.step()
            self.timer.mark()

    def on_train_end(self, trainer, pl_module):
        self.prof.stop()


class GcAndTimerCallback(L.Callback):
    """--profiler lightning: build the gc heap at train start, time optimizer steps."""

    def __init__(self, gcinj: C.GcInjector, timer: C.StepTimer):
        self.gcinj, self.timer, self.last = gcinj, timer, 0

    def on_train_start(self, trainer, pl_module):
        self.gcinj.build()
        self.timer.mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.last:
            self.last = trainer.global_step
            self.gcinj.on_step_end()
            self.timer.mark()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--model", choices=["mlp", "gpt2"], default="mlp")
    ap.add_argument("--profiler", choices=["lightning", "callback", "strag"], default="callback",
                    help="strag: strag_collect.lightning.StragProfiler lands live sessions in --strag-lake")
    ap.add_argument("--strag-lake", default=None, help="--profiler strag: the lake URL")
    ap.add_argument("--strag-job-id", default=None, help="--profiler strag: the job id (default: --name)")
    ap.add_argument("--strag-every", type=int, default=6, help="--profiler strag: a window every N optimizer steps")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--manual-opt", type=int, choices=[0, 1], default=0)
    ap.add_argument("--batch", type=int, default=None, help="per-rank micro-batch: rows (mlp, 64) or sequences (gpt2, 4)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--precision", default="32-true", help="Trainer(precision=...): 32-true, bf16-mixed")
    args = ap.parse_args()
    rank, world = C.rank_world()
    allowed = ("fwd", "bwd", "gc", "gcall", "gcin", "gcend", "gcallend", "sleep", "data", "host") + (("seq",) if args.model != "mlp" else ())
    slowdowns = C.parse_slow(args.slow, allowed, world)
    slow = C.RankSlow(slowdowns, rank, world)
    C.setup_process(args, slow, rank)
    os.makedirs(args.out, exist_ok=True)
    L.seed_everything(args.seed, workers=True, verbose=False)
    # the micro-batches (training_step calls) per optimizer step: Lightning counts one forward each
    gcinj = C.GcInjector(slow, rank, world, forwards_per_step=args.accumulate)
    gcinj.prepare()

    if args.batch is None:
        args.batch = 64 if args.model == "mlp" else 4
    n_items = args.batch * args.accumulate * (args.steps + 1) * world
    per_item_ms = slow.data_ms / args.batch
    module = LitModel(args.model, args.seed, bool(args.manual_opt), args.accumulate)
    if args.model == "mlp":
        ds, collate = C.MLPDataset(n_items, args.seed, per_item_ms), None
    else:
        ds = C.LMDataset(n_items, module.net.config.vocab_size, 4 * args.seq_len, args.seed, per_item_ms)
        collate = C.LMCollator("padded", args.seq_len, slow.seq, rank, args.seed)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=False, num_workers=0, collate_fn=collate,
                                     drop_last=True)
    C.BlockSlowdown(slow.fwd, slow.bwd, slow.odd).install(module.blocks)
    gcinj.attach(module.net)

    timer = C.StepTimer()
    prof_dir = os.path.join(args.out, "_lightning_profiler")
    if args.profiler == "lightning":
        from lightning.pytorch.profilers import PyTorchProfiler

        profiler = PyTorchProfiler(dirpath=prof_dir, filename="prof", export_to_chrome=True,
                                   schedule=torch.profiler.schedule(wait=args.prof_wait, warmup=args.prof_warmup,
                                                                    active=args.prof_active),
                                   record_shapes=bool(args.record_shapes), with_stack=bool(args.with_stack),
                                   profile_memory=bool(args.profile_memory), with_modules=bool(args.with_modules),
                                   with_flops=bool(args.with_flops))
        callbacks = [GcAndTimerCallback(gcinj, timer)]
    elif args.profiler == "strag":   # the one line a Lightning user adds
        from strag_collect.lightning import StragProfiler

        profiler = None
        callbacks = [StragProfiler(args.strag_lake, args.strag_job_id or args.name, every=args.strag_every,
                                   active=args.prof_active, record_shapes=bool(args.record_shapes)),
                     GcAndTimerCallback(gcinj, timer)]
    else:
        profiler = None
        callbacks = [TorchProfilerCallback(args, rank, gcinj, timer)]
    trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy="ddp", max_steps=args.steps,
                        precision=args.precision, accumulate_grad_batches=1 if args.manual_opt else args.accumulate,
                        profiler=profiler, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, use_distributed_sampler=True)
    trainer.fit(module, train_dataloaders=dl)
    torch_rank = trainer.global_rank
    assert torch_rank == rank, (torch_rank, rank)
    if args.profiler == "strag":   # the traces went to the lake: no run folder to finish
        print(f"rank {rank}: step ms {timer.ms}; landed {len(callbacks[0].profiler.handler.landed)} file(s)", flush=True)
        return

    original = None
    if args.profiler == "lightning":
        found = sorted(glob.glob(os.path.join(prof_dir, f"*-{trainer.local_rank}-*.pt.trace.json")))
        if len(found) != 1:
            raise SystemExit(f"rank {rank}: expected one Lightning trace in {prof_dir}, found {found}")
        original = os.path.basename(found[0])
        os.replace(found[0], os.path.join(args.out, f"rank-{rank}.json"))
        for leftover in glob.glob(os.path.join(prof_dir, f"*-{trainer.local_rank}*")):
            os.remove(leftover)   # the text summary Lightning writes next to it
    print(f"rank {rank}: step ms {timer.ms}", flush=True)

    details = {
        "trainer": f"lightning.Trainer(accelerator='cpu', devices={world}, strategy='ddp', max_steps={args.steps}, "
                   f"accumulate_grad_batches={1 if args.manual_opt else args.accumulate})",
        "strategy": "ddp (DDPStrategy, gloo)", "optimizer": "torch.optim.AdamW(lr=1e-3)",
        "accumulate_grad_batches": args.accumulate, "manual_optimization": bool(args.manual_opt),
        "batch_per_rank": args.batch, "model_config": module.model_cfg,
        "profiler_mode": args.profiler,
        "profiler": ("lightning.pytorch.profilers.PyTorchProfiler(dirpath, filename='prof', export_to_chrome=True, "
                     "schedule=torch.profiler.schedule(wait, warmup, active)), steps at the end of each "
                     "training_step action (per micro-batch); trace renamed from " + str(original)
                     if args.profiler == "lightning" else
                     "lightning.Callback: torch.profiler.profile(schedule(..., repeat=1)).start() in on_train_start, "
                     "prof.step() in on_train_batch_end when trainer.global_step advanced, stop() in on_train_end"),
        "profiler_step_unit": "training_step call (micro-batch)" if args.profiler == "lightning" else "optimizer step",
        "lightning_original_trace_name": original,
        "steps": args.steps, "precision": args.precision,
        "padding": "dynamic (pad to longest in batch)" if args.model != "mlp" else None,
    }
    C.finish(args, stack="lightning", script="lightning_ddp.py", rank=rank, world=world,
             coords={"dp": rank, "pp": 0, "stages": [0]}, trace_file=f"rank-{rank}.json", slowdowns=slowdowns,
             truth_fields={"pp": 1, "dp": world, "schedule": "dp", "grad_sync": "ddp",
                           "model": args.model, "microbatches": args.accumulate},
             stack_details=details,
             rank_extra={"step_ms": timer.ms, "gc_collects": gcinj.collects,
                         "batch_lengths": getattr(collate, "lengths", None)})
    if rank == 0 and os.path.isdir(prof_dir):
        # every rank has moved its trace out by now (finish() waited for all _info files)
        try:
            os.rmdir(prof_dir)
        except OSError:
            pass


if __name__ == "__main__":
    main()
