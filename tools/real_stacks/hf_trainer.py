"""transformers.Trainer (DDP on CPU / gloo under torchrun) on a tiny GPT2 or Llama built from a config.

    torchrun --standalone --nproc_per_node 2 tools/real_stacks/hf_trainer.py --out /tmp/hf \
        [--model gpt2|llama] [--grad-accum 1|2] [--batches padded|packed] [--slow ...]

TrainingArguments(use_cpu=True, ddp_backend="gloo", max_steps=--steps, per_device_train_batch_size=4,
gradient_accumulation_steps=--grad-accum, optim="adamw_torch", dataloader_num_workers=0, no logging /
saving / reporting).  A TrainerCallback drives torch.profiler: start in on_train_begin, prof.step() in
on_step_end (once per optimizer step), stop in on_train_end; chrome export per rank.

--batches padded: random-token sequences of variable length, a data collator pads to the longest in
the batch (attention_mask, labels -100 on pads); packed: fixed-length blocks of --seq-len tokens.
--slow seq: padded batches whose length budget is drawn per rank and step from [L, 4L].
--grad-ckpt 1: gradient checkpointing (every block's forward runs again inside its backward);
--compile 1: torch.compile through TrainingArguments (inductor's compiled graphs in the trace).
"""

from __future__ import annotations

import argparse
import os

import torch

import common as C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--batches", choices=["padded", "packed"], default="padded")
    ap.add_argument("--batch", type=int, default=4, help="sequences per device and micro-batch")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--grad-ckpt", type=int, choices=[0, 1], default=0,
                    help="TrainingArguments(gradient_checkpointing=True): each block's forward recomputed in its backward")
    ap.add_argument("--dl-workers", type=int, default=0, help="TrainingArguments(dataloader_num_workers=N)")
    ap.add_argument("--bf16", type=int, choices=[0, 1], default=0, help="TrainingArguments(bf16=True): CPU autocast")
    ap.add_argument("--compile", type=int, choices=[0, 1], default=0, help="TrainingArguments(torch_compile=True)")
    ap.add_argument("--strag-lake", default=None,
                    help="profile with strag_collect.huggingface.StragTrainerCallback into this lake (live sessions)")
    ap.add_argument("--strag-job-id", default=None, help="with --strag-lake: the job id (default: --name)")
    ap.add_argument("--strag-every", type=int, default=6, help="with --strag-lake: a window every N optimizer steps")
    args = ap.parse_args()
    rank, world = C.rank_world()
    slowdowns = C.parse_slow(args.slow, ("fwd", "bwd", "gc", "gcall", "gcin", "gcend", "gcallend", "sleep", "data", "seq", "host"), world)
    slow = C.RankSlow(slowdowns, rank, world)
    if slow.seq and args.batches != "padded":
        raise SystemExit("--slow seq needs --batches padded")
    C.setup_process(args, slow, rank)
    os.makedirs(args.out, exist_ok=True)
    gcinj = C.GcInjector(slow, rank, world, forwards_per_step=args.grad_accum)
    gcinj.prepare()

    from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

    set_seed(args.seed)
    model, blocks, cfg = C.tiny_hf_model(args.model, args.seed)
    n_items = args.batch * args.grad_accum * (args.steps + 2) * world
    ds = C.LMDataset(n_items, cfg.vocab_size, 4 * args.seq_len, args.seed, slow.data_ms / args.batch)
    collate = C.LMCollator(args.batches, args.seq_len, slow.seq, rank, args.seed)
    C.BlockSlowdown(slow.fwd, slow.bwd, slow.odd).install(blocks)
    gcinj.attach(model)
    timer = C.StepTimer()

    class ProfilerCallback(TrainerCallback):
        def __init__(self):
            self.prof = None

        def on_train_begin(self, targs, state, control, **kw):
            gcinj.build()
            self.prof = C.make_profiler(args, C.chrome_exporter(args.out, rank, gc_record=bool(args.gc_record)))
            self.prof.start()
            timer.mark()

        def on_step_end(self, targs, state, control, **kw):
            gcinj.on_step_end()
            self.prof.step()
            timer.mark()

        def on_train_end(self, targs, state, control, **kw):
            self.prof.stop()

    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "_hf_output"), use_cpu=True, ddp_backend="gloo", max_steps=args.steps,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.grad_accum, learning_rate=1e-3,
        optim="adamw_torch", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=args.dl_workers, bf16=bool(args.bf16), dataloader_drop_last=True, remove_unused_columns=False, seed=args.seed,
        data_seed=args.seed, gradient_checkpointing=bool(args.grad_ckpt), torch_compile=bool(args.compile))
    if args.strag_lake:   # the one line a Hugging Face user adds
        from strag_collect.huggingface import StragTrainerCallback

        class TimerCallback(TrainerCallback):
            def on_train_begin(self, targs, state, control, **kw):
                gcinj.build()
                timer.mark()

            def on_step_end(self, targs, state, control, **kw):
                gcinj.on_step_end()
                timer.mark()

        strag = StragTrainerCallback(args.strag_lake, args.strag_job_id or args.name, every=args.strag_every,
                                     active=args.prof_active, record_shapes=bool(args.record_shapes))
        callbacks = [strag, TimerCallback()]
    else:
        callbacks = [ProfilerCallback()]
    trainer = Trainer(model=model, args=targs, train_dataset=ds, data_collator=collate, callbacks=callbacks)
    trainer.train()
    if args.strag_lake:   # the traces went to the lake: no run folder to finish
        print(f"rank {rank}: step ms {timer.ms}; landed {len(strag.profiler.handler.landed)} file(s)", flush=True)
        return
    assert trainer.args.process_index == rank, (trainer.args.process_index, rank)
    print(f"rank {rank}: step ms {timer.ms}", flush=True)
    trainer.accelerator.wait_for_everyone()   # every rank past the Trainer's own look into its output folder
    if rank == 0:
        try:
            os.rmdir(os.path.join(args.out, "_hf_output"))
        except OSError:
            pass
    import transformers

    details = {
        "trainer": "transformers.Trainer", "training_args": {
            "use_cpu": True, "ddp_backend": "gloo", "max_steps": args.steps,
            "per_device_train_batch_size": args.batch, "gradient_accumulation_steps": args.grad_accum,
            "optim": "adamw_torch", "lr_scheduler_type": "constant", "dataloader_num_workers": args.dl_workers,
            "bf16": bool(args.bf16),
            "logging_strategy": "no", "save_strategy": "no",
            "gradient_checkpointing": bool(args.grad_ckpt), "torch_compile": bool(args.compile)},
        "parallel_mode": str(trainer.args.parallel_mode), "grad_accum": args.grad_accum,
        "batches": args.batches, "seq_len": args.seq_len, "model_config": C.cfg_dict(cfg),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "model_wrapper": type(trainer.model_wrapped).__name__,
        "profiler_mode": "TrainerCallback: torch.profiler.profile(schedule(..., repeat=1)).start() in on_train_begin, "
                         "prof.step() in on_step_end, stop() in on_train_end",
        "profiler_step_unit": "optimizer step", "steps": args.steps,
        "transformers": transformers.__version__,
    }
    C.finish(args, stack="hf-trainer", script="hf_trainer.py", rank=rank, world=world,
             coords={"dp": rank, "pp": 0, "stages": [0]}, trace_file=f"rank-{rank}.json", slowdowns=slowdowns,
             truth_fields={"pp": 1, "dp": world, "schedule": "dp",
                           "grad_sync": "ddp" if world > 1 else "none",
                           "model": args.model, "microbatches": args.grad_accum},
             stack_details=details,
             rank_extra={"step_ms": timer.ms, "gc_collects": gcinj.collects, "batch_lengths": collate.lengths})


if __name__ == "__main__":
    main()
