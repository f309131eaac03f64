"""World size 1 (the "one GPU" case): a plain PyTorch training loop under torch.profiler.

    python tools/real_stacks/single.py --out /tmp/single [--model llama|gpt2|mlp] [--slow gc:0:100]
    (or torchrun --standalone --nproc_per_node 1 tools/real_stacks/single.py ...)

No process group.  Each step: batch from a DataLoader (num_workers=0), `--grad-accum` forward +
backward passes, AdamW step, zero_grad, prof.step().  Writes rank-0.json + truth.json.
Slowdowns: fwd:0:F, bwd:0:F, gc:0:N, data:0:MS (a straggler needs peers: with one rank these are
"the step is slow because of ..." cases).
"""

from __future__ import annotations

import argparse
import os

import torch

import common as C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--model", choices=["mlp", "gpt2", "llama"], default="llama")
    ap.add_argument("--batch", type=int, default=None, help="rows (mlp, 64) or sequences (LM, 4) per micro-batch")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--batches", choices=["padded", "packed"], default="packed")
    args = ap.parse_args()
    rank, world = C.rank_world()
    assert world == 1, "single.py is the world-size-1 case"
    slowdowns = C.parse_slow(args.slow, ("fwd", "bwd", "gc", "gcend", "sleep", "data"), world)
    slow = C.RankSlow(slowdowns, rank, world)
    C.setup_process(args)
    os.makedirs(args.out, exist_ok=True)
    gcinj = C.GcInjector(slow, rank, world, forwards_per_step=args.grad_accum)
    gcinj.prepare()

    if args.batch is None:
        args.batch = 64 if args.model == "mlp" else 4
    n_items = args.batch * args.grad_accum * args.steps
    per_item_ms = slow.data_ms / args.batch
    if args.model == "mlp":
        torch.manual_seed(args.seed)
        model = C.MLP()
        blocks, cfg = list(model.blocks), {"hidden": 512, "blocks": 4}
        ds = C.MLPDataset(n_items, args.seed, per_item_ms)
        collate = None
    else:
        model, blocks, hf_cfg = C.tiny_hf_model(args.model, args.seed)
        cfg = C.cfg_dict(hf_cfg)
        ds = C.LMDataset(n_items, hf_cfg.vocab_size, 4 * args.seq_len, args.seed, per_item_ms)
        collate = C.LMCollator(args.batches, args.seq_len, False, rank, args.seed)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=False, num_workers=0, collate_fn=collate,
                                     drop_last=True)
    C.BlockSlowdown(slow.fwd, slow.bwd, slow.odd).install(blocks)
    gcinj.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    timer = C.StepTimer()
    gcinj.build()
    it = iter(dl)
    with C.make_profiler(args, C.chrome_exporter(args.out, rank, gc_record=bool(args.gc_record))) as prof:
        timer.mark()
        for step in range(args.steps):
            for _ in range(args.grad_accum):
                batch = next(it)
                if args.model == "mlp":
                    x, y = batch
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                else:
                    loss = model(**batch).loss
                (loss / args.grad_accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            gcinj.on_step_end()
            prof.step()
            timer.mark()
            print(f"step {step} loss {loss.item():.4f} {timer.ms[-1]:.0f} ms", flush=True)

    C.finish(args, stack="single", script="single.py", rank=rank, world=world,
             coords={"dp": 0, "pp": 0, "stages": [0]}, trace_file="rank-0.json", slowdowns=slowdowns,
             truth_fields={"pp": 1, "dp": 1, "schedule": "dp", "grad_sync": "none", "model": args.model,
                           "microbatches": args.grad_accum},
             stack_details={"loop": "plain PyTorch loop, no process group", "optimizer": "torch.optim.AdamW(lr=1e-3)",
                            "grad_accum": args.grad_accum, "batch": args.batch,
                            "batches": args.batches if args.model != "mlp" else None,
                            "seq_len": args.seq_len if args.model != "mlp" else None, "model_config": cfg,
                            "profiler_mode": "torch.profiler.profile(schedule) around the loop, prof.step() after "
                                             "optimizer.step()/zero_grad(); export_chrome_trace in on_trace_ready",
                            "profiler_step_unit": "optimizer step",
                            "steps": args.steps},
             rank_extra={"step_ms": timer.ms, "gc_collects": gcinj.collects,
                         "batch_lengths": getattr(collate, "lengths", None)})


if __name__ == "__main__":
    main()
