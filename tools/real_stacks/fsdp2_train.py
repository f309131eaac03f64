"""FSDP2 (torch.distributed.fsdp.fully_shard) on CPU / gloo: every decoder layer sharded, then the
root; no pipeline.  Tiny Llama (or GPT2) from a config; plain training loop.

    torchrun --standalone --nproc_per_node 2 tools/real_stacks/fsdp2_train.py --out /tmp/fsdp2 \
        [--model llama|gpt2] [--grad-accum 1|2] [--batches packed|padded] [--slow ...]

Mesh: init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)).  fully_shard(layer, mesh) for each
decoder layer, fully_shard(model, mesh) for the root (embeddings, final norm, LM head).  Each step:
--grad-accum micro-batches (set_requires_gradient_sync(False) on all but the last, so the
reduce-scatter runs once per step), AdamW on the sharded DTensor parameters, zero_grad, prof.step().
fwd/bwd slowdowns re-run a plain (unsharded) shadow copy of each layer taken before fully_shard, so
the slowed rank issues no extra collectives.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

import common as C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--batches", choices=["padded", "packed"], default="packed")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--reshard-after-forward", type=int, choices=[0, 1], default=1)
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
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model, blocks, cfg = C.tiny_hf_model(args.model, args.seed)
    shadows = [copy.deepcopy(b) for b in blocks]
    reshard = bool(args.reshard_after_forward)
    for b in blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    C.BlockSlowdown(slow.fwd, slow.bwd, slow.odd).install(blocks, shadows)
    gcinj.attach(model)

    n_items = args.batch * args.grad_accum * args.steps * world
    ds = C.LMDataset(n_items, cfg.vocab_size, 4 * args.seq_len, args.seed, slow.data_ms / args.batch)
    collate = C.LMCollator(args.batches, args.seq_len, slow.seq, rank, args.seed)
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=0, collate_fn=collate,
                                     drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    timer = C.StepTimer()
    gcinj.build()
    it = iter(dl)
    with C.make_profiler(args, C.chrome_exporter(args.out, rank, gc_record=bool(args.gc_record))) as prof:
        timer.mark()
        for step in range(args.steps):
            for m in range(args.grad_accum):
                model.set_requires_gradient_sync(m == args.grad_accum - 1)
                batch = next(it)
                loss = model(**batch).loss / args.grad_accum
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            gcinj.on_step_end()
            prof.step()
            timer.mark()
            if rank == 0:
                print(f"step {step} loss {loss.item() * args.grad_accum:.4f} {timer.ms[-1]:.0f} ms", flush=True)
    print(f"rank {rank}: step ms {timer.ms}", flush=True)
    details = {
        "loop": "plain loop over an FSDP2 model: fully_shard(layer) per decoder layer + fully_shard(root)",
        "mesh": "init_device_mesh('cpu', (world,), mesh_dim_names=('dp',))",
        "reshard_after_forward": reshard, "grad_accum": args.grad_accum,
        "grad_accum_sync": "set_requires_gradient_sync(last micro-batch only)",
        "optimizer": "torch.optim.AdamW(lr=1e-3) on DTensor shards", "batches": args.batches,
        "batch_per_rank": args.batch, "seq_len": args.seq_len, "model_config": C.cfg_dict(cfg),
        "profiler_mode": "torch.profiler.profile(schedule(..., repeat=1)) around the loop, prof.step() after "
                         "optimizer.step()/zero_grad()",
        "profiler_step_unit": "optimizer step", "steps": args.steps,
    }
    C.finish(args, stack="fsdp2", script="fsdp2_train.py", rank=rank, world=world,
             coords={"dp": rank, "pp": 0, "stages": [0]}, trace_file=f"rank-{rank}.json", slowdowns=slowdowns,
             truth_fields={"pp": 1, "dp": world, "schedule": "dp", "grad_sync": "fsdp2", "model": args.model,
                           "microbatches": args.grad_accum},
             stack_details=details,
             rank_extra={"step_ms": timer.ms, "gc_collects": gcinj.collects, "batch_lengths": collate.lengths})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
