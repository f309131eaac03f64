"""Hugging Face Accelerate's own training loop (DDP on CPU / gloo under torchrun), tiny GPT2 / Llama.

    torchrun --standalone --nproc_per_node 2 tools/real_stacks/accelerate_loop.py --out /tmp/acc \
        [--model llama|gpt2] [--grad-accum 1|2] [--batches padded|packed] [--slow ...]

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=--grad-accum)
    model, opt, dl = accelerator.prepare(model, AdamW, DataLoader)
    for batch in dl:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step(); opt.zero_grad()
        if accelerator.sync_gradients: prof.step()

torch.profiler with schedule(wait, warmup, active, repeat=1) around the loop, one ProfilerStep per
optimizer step (accelerator.sync_gradients); chrome export per rank.  The prepared optimizer's
step() / zero_grad() are no-ops on the accumulating micro-batches (AcceleratedOptimizer), and
accelerator.accumulate() enters DDP's no_sync() on them.
"""

from __future__ import annotations

import argparse
import os

import torch

import common as C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--model", choices=["gpt2", "llama"], default="llama")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--batches", choices=["padded", "packed"], default="padded")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--mixed-precision", default="no", choices=["no", "bf16"], help="Accelerator(mixed_precision=...)")
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

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.grad_accum,
                              mixed_precision=args.mixed_precision)
    assert accelerator.process_index == rank and accelerator.num_processes == world
    set_seed(args.seed)
    model, blocks, cfg = C.tiny_hf_model(args.model, args.seed)
    n_items = args.batch * args.grad_accum * (args.steps + 1) * world
    ds = C.LMDataset(n_items, cfg.vocab_size, 4 * args.seq_len, args.seed, slow.data_ms / args.batch)
    collate = C.LMCollator(args.batches, args.seq_len, slow.seq, rank, args.seed)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=0, collate_fn=collate,
                                     drop_last=True, generator=torch.Generator().manual_seed(args.seed))
    C.BlockSlowdown(slow.fwd, slow.bwd, slow.odd).install(blocks)
    gcinj.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    model.train()
    timer = C.StepTimer()
    gcinj.build()
    steps = 0
    with C.make_profiler(args, C.chrome_exporter(args.out, rank, gc_record=bool(args.gc_record))) as prof:
        timer.mark()
        for batch in dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                gcinj.on_step_end()
                prof.step()
                timer.mark()
                steps += 1
                if steps >= args.steps:
                    break
    print(f"rank {rank}: step ms {timer.ms}", flush=True)
    import accelerate

    details = {
        "loop": "accelerate: Accelerator(cpu=True, gradient_accumulation_steps=N); prepare(model, AdamW, DataLoader); "
                "with accelerator.accumulate(model): forward, accelerator.backward, opt.step, opt.zero_grad",
        "distributed_type": str(accelerator.distributed_type), "model_wrapper": type(model).__name__,
        "grad_accum": args.grad_accum, "mixed_precision": args.mixed_precision, "batches": args.batches, "batch_per_rank": args.batch, "seq_len": args.seq_len,
        "model_config": C.cfg_dict(cfg),
        "profiler_mode": "torch.profiler.profile(schedule(..., repeat=1)) around the loop, prof.step() when "
                         "accelerator.sync_gradients (after the optimizer step)",
        "profiler_step_unit": "optimizer step", "steps": args.steps, "accelerate": accelerate.__version__,
    }
    accelerator.wait_for_everyone()
    C.finish(args, stack="accelerate", script="accelerate_loop.py", rank=rank, world=world,
             coords={"dp": rank, "pp": 0, "stages": [0]}, trace_file=f"rank-{rank}.json", slowdowns=slowdowns,
             truth_fields={"pp": 1, "dp": world, "schedule": "dp", "grad_sync": "ddp" if world > 1 else "none",
                           "model": args.model, "microbatches": args.grad_accum},
             stack_details=details,
             rank_extra={"step_ms": timer.ms, "gc_collects": gcinj.collects, "batch_lengths": collate.lengths})


if __name__ == "__main__":
    main()
