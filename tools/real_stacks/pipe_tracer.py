"""torch.distributed.pipelining's tracer frontend (`pipeline()` + `SplitPoint`) over a tiny Llama
built from a LlamaConfig, on CPU / gloo.

    torchrun --standalone --nproc_per_node 2 tools/real_stacks/pipe_tracer.py --out /tmp/pp \
        [--schedule gpipe|1f1b|interleaved|looped-bfs|interleaved-zb|zbv|dualpipev] [--layout pp2|pp2dp2|pp4] [--dp-sync fsdp2|ddp] [--slow ...]
        [--fsdp-per-layer 0|1] [--fsdp-reshard-after-forward 0|1]

Model (PipeLlama): embed_tokens -> rotary (cos, sin) and a causal additive mask computed ONCE ->
every transformers LlamaDecoderLayer(h, attention_mask=mask, position_embeddings=(cos, sin),
position_ids) -> norm -> lm_head.  `pipeline(model, mb_args=(example micro-batch,),
split_spec={"layers.K": SplitPoint.BEGINNING, ...})` traces it (torch.export) and splits it; so the
hidden states, cos, sin and the mask (4 tensors) cross every split.  `pipe.build_stage(i, device,
pp_group)` builds each local stage.  Schedules: ScheduleGPipe, Schedule1F1B (one stage per rank),
ScheduleInterleaved1F1B (2 stages per rank, stage s on pp rank s % pp; the tracer frontend builds
any number of stages, so no manual PipelineStage is needed).  Loss: cross-entropy against
next-token targets, schedules' default scale_grads=True.  4 micro-batches of 2 x 64 tokens.

pp2dp2 (4 ranks): init_device_mesh("cpu", (2, 2), ("pp", "dp")) (rank = pp * 2 + dp); each stage
module is then data-parallel over its dp group: --dp-sync fsdp2: fully_shard(stage.submod,
mesh=mesh["dp"], reshard_after_forward=False) (one FSDP unit per stage), or with --fsdp-per-layer 1
(torchtitan's layout) fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=R) for each decoder
layer of the stage, then fully_shard(stage.submod, ...) for the stage root (embeddings / rotary on
the first stage, norm + lm_head on the last); R = --fsdp-reshard-after-forward (default 1 = FSDP2's
default, so every layer is re-gathered in each micro-batch's backward; torchtitan passes False under
PP).  The tracer's stage GraphModule keeps each decoder layer as an outlined submodule
(InterpreterModule `layers.K`, called by call_module), so fully_shard and its hooks work on it; the
manual frontend's stages hold the transformers layers themselves.  Or --dp-sync ddp with --frontend manual:
stage.submod = DistributedDataParallel(stage.submod, process_group=dp group) after the PipelineStage
is built (1f1b only; the tracer's stage reads submod.graph, which a DDP wrapper hides: see README).

Slowdowns: fwd:R:F / bwd:R:F re-run shadow copies of the local stages' decoder layers (the traced
stage's InterpreterModules `layers.K`; hooks on the original transformers layers never fire: the
traced stage re-creates them), whole re-runs spread over the layers (1.5x of 4 layers: 2 of them); gc:R:N (first forward of
each step on the rank's first local stage); gcall:N; data:R:MS (every rank fetches each step's
batch through a DataLoader inside the step); split:uneven (stage 0 gets 3x the decoder layers of
every other stage: 6+2 layers for 2 stages, 6+2+2+2 for 4).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common as C

SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1), "interleaved": ("ScheduleInterleaved1F1B", 2),
             "looped-bfs": ("ScheduleLoopedBFS", 2), "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2),
             "zbv": ("ScheduleZBVZeroBubble", 2), "dualpipev": ("ScheduleDualPipeV", 2)}
# schedules whose stages sit in a V: pp rank r holds stages r and 2 pp - 1 - r (the rest: stage s on rank s % pp)
V_SCHEDULES = ("zbv", "dualpipev")


class PipeLlama(nn.Module):
    """A LlamaForCausalLM's modules with the rotary embedding and the mask computed once in front."""

    def __init__(self, m):
        super().__init__()
        self.embed_tokens = m.model.embed_tokens
        self.rotary_emb = m.model.rotary_emb
        self.layers = m.model.layers
        self.norm = m.model.norm
        self.lm_head = m.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device).unsqueeze(0)
        cos, sin = self.rotary_emb(h, pos)
        mask = torch.full((T, T), float("-inf"), device=input_ids.device).triu(1)[None, None]
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos)
        return self.lm_head(self.norm(h))


class ManualStage(nn.Module):
    """--frontend manual: one stage of the same model, for a hand-built PipelineStage.  Stage 0 computes
    the embeddings, rotary (cos, sin) and mask; every non-last stage returns (h, cos, sin, mask), so the
    same 4 tensors cross every split (but only between adjacent stages, which the runtime needs)."""

    def __init__(self, m, first: bool, last: bool, lo: int, hi: int):
        super().__init__()
        self.first, self.last = first, last
        self.embed_tokens = m.model.embed_tokens if first else None
        self.rotary_emb = m.model.rotary_emb if first else None
        self.layers = nn.ModuleList(m.model.layers[i] for i in range(lo, hi))
        self.norm = m.model.norm if last else None
        self.lm_head = m.lm_head if last else None

    def forward(self, *args):
        if self.first:
            (input_ids,) = args
            h = self.embed_tokens(input_ids)
            T = input_ids.shape[1]
            pos = torch.arange(T, device=input_ids.device).unsqueeze(0)
            cos, sin = self.rotary_emb(h, pos)
            mask = torch.full((T, T), float("-inf"), device=input_ids.device).triu(1)[None, None]
        else:
            h, cos, sin, mask = args
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=(cos, sin))
        if self.last:
            return self.lm_head(self.norm(h))
        return h, cos, sin, mask


class TokenSteps(torch.utils.data.Dataset):
    """One item = one step's batch: (input ids, next-token targets); data:R:MS sleeps per item."""

    def __init__(self, steps: int, n: int, T: int, vocab: int, seed: int, sleep_ms: float):
        self.steps, self.n, self.T, self.vocab, self.seed, self.sleep_s = steps, n, T, vocab, seed, sleep_ms / 1e3

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int):
        import time

        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        t = torch.randint(4, self.vocab, (self.n, self.T + 1), generator=g)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    ap.add_argument("--layout", choices=["pp2", "pp2dp2", "pp4"], default="pp2",
                    help="pp4: four pipeline stages on 4 ranks (the shape of the torch pipelining tutorial)")
    ap.add_argument("--dp-sync", choices=["fsdp2", "ddp"], default="fsdp2", help="pp2dp2 only")
    ap.add_argument("--frontend", choices=["tracer", "manual"], default=None,
                    help="tracer (pipeline() + SplitPoint; default for gpipe/1f1b) or manual (PipelineStage over "
                         "hand-split stage modules; default for interleaved, where the tracer fails, see README)")
    ap.add_argument("--fsdp-per-layer", type=int, choices=[0, 1], default=0,
                    help="pp2dp2 + fsdp2: fully_shard each decoder layer of a stage, then the stage root "
                         "(torchtitan's layout; per-layer all-gathers / reduce-scatters), instead of one unit "
                         "per stage")
    ap.add_argument("--fsdp-reshard-after-forward", type=int, choices=[0, 1], default=None,
                    help="reshard_after_forward of every FSDP unit (default: 1 with --fsdp-per-layer 1, "
                         "0 with one unit per stage)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary: the last stage's LM head is hidden x vocab")
    args = ap.parse_args()
    rank, world = C.rank_world()
    pp = 4 if args.layout == "pp4" else 2
    dp = 2 if args.layout == "pp2dp2" else 1
    assert world == pp * dp, f"--layout {args.layout} needs {pp * dp} processes"
    slowdowns = C.parse_slow(args.slow, ("fwd", "bwd", "gc", "gcall", "gcend", "gcallend", "sleep", "data", "split", "host"), world)
    slow = C.RankSlow(slowdowns, rank, world)
    sched_name, n_virtual = SCHEDULES[args.schedule]
    if args.frontend is None:
        # the tracer splits off cos / sin / mask once, so past two stages they skip stages (stage 0 sends
        # them to 2 and 3), and the runtime has no backward for skip connections
        args.frontend = "manual" if n_virtual > 1 or pp > 2 else "tracer"
    if dp > 1 and args.dp_sync == "ddp" and args.frontend == "tracer":
        # _PipelineStage._create_act_recv_info reads self.submod.graph.nodes at the first step:
        # AttributeError: 'DistributedDataParallel' object has no attribute 'graph'
        raise SystemExit("--dp-sync ddp needs --frontend manual (the tracer's stage reads submod.graph)")
    if dp > 1 and args.dp_sync == "ddp" and args.schedule != "1f1b":
        raise SystemExit("--dp-sync ddp only with --schedule 1f1b (DDP's reducer asserts with GPipe / interleaved)")
    fsdp = dp > 1 and args.dp_sync == "fsdp2"
    if (args.fsdp_per_layer or args.fsdp_reshard_after_forward is not None) and not fsdp:
        raise SystemExit("--fsdp-per-layer / --fsdp-reshard-after-forward need --layout pp2dp2 --dp-sync fsdp2")
    reshard = bool(args.fsdp_per_layer if args.fsdp_reshard_after_forward is None else args.fsdp_reshard_after_forward)
    C.setup_process(args, slow, rank)
    os.makedirs(args.out, exist_ok=True)
    M = args.microbatches
    gcinj = C.GcInjector(slow, rank, world, forwards_per_step=M)
    gcinj.prepare()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed.pipelining as P
    from torch.distributed.pipelining import SplitPoint, pipeline

    if dp > 1:
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        pp_rank, dp_rank = rank // dp, rank % dp
    else:
        mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
        pp_group, dp_group = mesh.get_group("pp"), None
        pp_rank, dp_rank = rank, 0

    n_stages = pp * n_virtual
    base = (2 if n_virtual == 2 else 4) * 2 // pp   # 8 decoder layers in all (16 with split:uneven at pp2)
    counts = [base] * n_stages
    if slow.split:
        counts[0] = 3 * base
    n_layers = sum(counts)
    hf, _, cfg = C.tiny_hf_model("llama", args.seed, vocab=args.vocab, layers=n_layers)
    model = PipeLlama(hf)
    bounds, acc = [], 0
    for c in counts[:-1]:
        acc += c
        bounds.append(acc)
    split_spec = {f"layers.{b}": SplitPoint.BEGINNING for b in bounds}
    edges = [0] + bounds + [n_layers]
    stage_ids = [pp_rank, 2 * pp - 1 - pp_rank] if args.schedule in V_SCHEDULES else [pp_rank + v * pp for v in range(n_virtual)]
    crossing = {}
    if args.frontend == "tracer":
        example = torch.randint(4, cfg.vocab_size, (args.mb_size, args.seq_len))
        pipe = pipeline(model, mb_args=(example,), split_spec=split_spec)
        assert pipe.num_stages == n_stages, (pipe.num_stages, n_stages)
        stages = [pipe.build_stage(s, torch.device("cpu"), pp_group) for s in stage_ids]
        for s in range(n_stages):
            sm = pipe.get_stage_module(s)
            crossing[str(s)] = [n.name for n in sm.graph.nodes if n.op == "placeholder"]
        del pipe
    else:
        from torch.distributed.pipelining import PipelineStage

        stages = []
        for s in stage_ids:
            mod = ManualStage(hf, s == 0, s == n_stages - 1, edges[s], edges[s + 1])
            stages.append(PipelineStage(mod, s, n_stages, torch.device("cpu"), group=pp_group))
        for s in range(n_stages):
            crossing[str(s)] = ["input_ids"] if s == 0 else ["h", "cos", "sin", "mask"]
    slowdown = C.BlockSlowdown(slow.fwd, slow.bwd, slow.odd)
    if slowdown.fwd > 1 or slowdown.bwd > 1:
        # on each stage's decoder layers (tracer: the outlined InterpreterModules `layers.K`, called via
        # call_module; manual: the LlamaDecoderLayers), so a fractional factor spreads over whole layer
        # re-runs; hooks survive fully_shard, which only swaps the class
        blocks = [layer for st in stages for layer in st.submod.layers.children()]
        slowdown.install(blocks, [copy.deepcopy(b) for b in blocks])
    if dp > 1:
        if args.dp_sync == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for st in stages:
                if args.fsdp_per_layer:
                    # tracer: st.submod.layers is an InterpreterModule whose children "K" are the outlined
                    # decoder layers (called via call_module); manual: the nn.ModuleList of LlamaDecoderLayers
                    for layer in st.submod.layers.children():
                        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
                fully_shard(st.submod, mesh=mesh["dp"], reshard_after_forward=reshard)
        else:
            for st in stages:
                st.submod = nn.parallel.DistributedDataParallel(st.submod, process_group=dp_group)
    gcinj.attach(stages[0].submod)
    del model, hf

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    cls = getattr(P, sched_name)
    sched = cls(stages[0] if n_virtual == 1 else stages, M, loss_fn=loss_fn)
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    has_first, has_last = 0 in stage_ids, (n_stages - 1) in stage_ids
    ds = TokenSteps(args.steps, M * args.mb_size, args.seq_len, cfg.vocab_size, args.seed * 100 + dp_rank,
                    slow.data_ms)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=0)
    it = iter(dl)
    timer = C.StepTimer()
    step_losses: list = []
    gcinj.build()
    with C.make_profiler(args, C.chrome_exporter(args.out, rank, gc_record=bool(args.gc_record))) as prof:
        timer.mark()
        for step in range(args.steps):
            x, y = next(it)
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
            opt.step()
            gcinj.on_step_end()
            prof.step()
            timer.mark()
            if losses:
                step_losses.append(round(sum(l.item() for l in losses) / len(losses), 5))
                print(f"rank {rank} step {step} loss {sum(l.item() for l in losses) / len(losses):.4f} "
                      f"{timer.ms[-1]:.0f} ms", flush=True)
    print(f"rank {rank}: step ms {timer.ms}", flush=True)
    coords = {"dp": dp_rank, "pp": pp_rank, "stages": stage_ids}
    dp_sync_desc = None
    if fsdp and args.fsdp_per_layer:
        dp_sync_desc = (f"fully_shard(layer, mesh=mesh['dp'], reshard_after_forward={reshard}) for each decoder layer "
                        f"of the stage, then fully_shard(stage.submod, mesh=mesh['dp'], reshard_after_forward={reshard})")
    elif fsdp:
        dp_sync_desc = f"fully_shard(stage.submod, mesh=mesh['dp'], reshard_after_forward={reshard})"
    elif dp > 1:
        dp_sync_desc = "DistributedDataParallel(stage.submod, process_group=dp)"
    details = {
        "frontend": ("torch.distributed.pipelining.pipeline() tracer (torch.export) + SplitPoint.BEGINNING, "
                     "pipe.build_stage()" if args.frontend == "tracer" else
                     "manual: torch.distributed.pipelining.PipelineStage over hand-split stage modules (the tracer's "
                     "split sends cos/sin/mask from stage 0 straight to stages 2 and 3: skip connections the "
                     "multi-stage runtime rejects)"),
        "split_spec": sorted(split_spec), "layers_per_stage": counts, "n_layers": n_layers,
        "stage_inputs": crossing,
        "tensors_crossing_each_split": {str(s): len(crossing[str(s)]) for s in range(1, n_stages)},
        "schedule_class": sched_name, "stages_per_rank": n_virtual, "placement": ("V: pp rank r holds stages r and 2 pp - 1 - r" if args.schedule in V_SCHEDULES
                                                   else "stage s on pp rank s % pp"),
        "microbatches": M, "microbatch": [args.mb_size, args.seq_len],
        "dp_sync": dp_sync_desc,
        **({"fsdp_per_layer": bool(args.fsdp_per_layer), "reshard_after_forward": reshard,
            "fsdp_units_per_stage": {str(s): ([f"layers.{i}" for i in range(edges[s], edges[s + 1])]
                                              if args.fsdp_per_layer else []) + ["stage root"]
                                     for s in range(n_stages)}} if fsdp else {}),
        "mesh": f"init_device_mesh('cpu', {(pp, dp) if dp > 1 else (pp,)}, mesh_dim_names="
                f"{('pp', 'dp') if dp > 1 else ('pp',)})",
        "optimizer": "torch.optim.AdamW(lr=1e-3)", "loss": "cross_entropy, scale_grads=True (default)",
        "model_config": C.cfg_dict(cfg),
        "profiler_mode": "torch.profiler.profile(schedule(..., repeat=1)) around the loop, prof.step() after "
                         "optimizer.step()", "profiler_step_unit": "optimizer step", "steps": args.steps,
        "data": "every rank fetches each step's batch through a DataLoader (one item = one step) inside the step",
    }
    C.finish(args, stack="pipe-tracer", script="pipe_tracer.py", rank=rank, world=world, coords=coords,
             trace_file=f"rank-{rank}.json", slowdowns=slowdowns,
             truth_fields={"pp": pp, "dp": dp, "schedule": args.schedule, "schedule_class": sched_name,
                           "virtual_stages_per_rank": n_virtual,
                           "grad_sync": (args.dp_sync if dp > 1 else "none"), "model": "llama",
                           "microbatches": M},
             stack_details=details,
             rank_extra={"step_ms": timer.ms, "gc_collects": gcinj.collects, "stages": stage_ids,
                         **({"losses": step_losses} if step_losses else {})})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
