"""torch.profiler (Kineto) Chrome-trace JSON, one file per rank -> TRACE_SCHEMA rows + manifest.

Two passes, both plain functions:

1. `parse_rank(path, data)`: one rank's JSON -> `RankTrace`, compact numpy columns of the
   spans that matter (profiled steps, per-microbatch forward/backward compute, p2p and
   collective comm, optimizer) plus counts of everything that fit no op type. The events
   arrive as numpy columns a run of a few MB at a time (reader.py; scan.c writes them from
   the bytes in one C pass, columns.py from msgspec's structs where it stops); the event
   pass (events.py) reads names and args only of the few that need them (steps, labels,
   comm), the rest vectorised. Only this pass touches the JSON, one rank at a time, so
   memory stays bounded by the largest rank file.
2. `assemble(ranks, job_id, date, options)`: the ranks of one job -> `ConvertedJob`:
   checks (duplicate, missing or foreign ranks, steps that do not line up), the dp/pp
   layout, op types, seq ids, clock alignment, manifest.

The mapping (ARCHITECTURE.md, "Kineto mapping"):
- steps: training iterations, `ProfilerStep#N` where those are iterations (without them: each ends
  with an `Optimizer.step` span); where they are not (Lightning's PyTorchProfiler ends one when
  training_step returns, a ProfilerStep per accumulated batch), the iterations run between optimizer
  steps (rank._iterations; a profile begun mid-iteration keeps its first one from the batch whose
  backward follows the last zero_grad, when it holds that batch's forward, and gives it the
  collectives the other iterations issue before their batch fetch, rank._with_preamble); a step is kept when
  every analysed rank has it complete (an optimizer span and every kind of compute), others are
  listed in source.steps_dropped; a rank's files of other steps are profiler cycles (cycles.py);
- rank and world: `distributedInfo` (a window's lone trace without it: a process that started no
  process group, rank 0 of 1); process groups: `distributedInfo.pg_config`
  ({pg_name, pg_desc, ranks}); the pp / dp coordinates of a rank are its index in the
  group whose description names the dim (`mesh_pp`, `PIPELINE...`, `DATA_PARALLEL...`),
  else job.yaml sizes + layout, else inferred from what the ranks did (layout.py: first
  stages start their steps with a send; pipelines from any-named groups, the world or peers);
- compute: the schedule's record_function labels (`PP:{stage}F{mb}` / `PP:{stage}B{mb}` of
  torch.distributed.pipelining, `Forward k` / `Backward k` of its GPipe, `forward-compute k`,
  or job.yaml forward_label / backward_label), with p2p waits nested at a label's edges
  cut off; on GPU traces the label's `gpu_user_annotation` span (kernel time) when present;
- p2p: gloo `gloo:send` / `gloo:recv` spans (CPU) or NCCL send/recv kernels (GPU); the
  direction from the peer's stage, else the label that issued it (`PP:sSEND_Fm`, `Forward k`),
  else the pipeline's ends, else the compute it serves (a send carries the compute before it, a
  recv feeds the compute after it); interleaved: pairs wrap around, no-op p2p at the ends; the
  tensors one batch passes to one peer (the tracer frontend's hidden states, rotary cos/sin, mask)
  are one transfer (rank._one_transfer_per_batch);
- DP collectives (all_reduce, reduce_scatter, all_gather over the data-parallel group):
  gloo spans on the runloop threads or NCCL kernels; all_reduce and reduce_scatter of
  gradients -> grads-reduce-scatter, all_gather -> params-all-gather, matched across
  ranks by their order in the group within the step (= NCCL's sequence number order); where
  the trace records `Seq` (recent NCCL), a step in which a member lacks a Seq the group's other
  members ran is dropped, the reason in source.steps_dropped_why;
- optimizer: `Optimizer.step#...` (union of the step's optimizer spans), from where the closure it
  ran ends (`optimizer.step(closure)`: Lightning's automatic optimization runs the forward, backward
  and gradient all-reduce inside it; compute.optimizer_work); on CPU ranks from when its gradients
  are ready, with the update's preparation (DDP's bucket copy-back, gradient clipping) in it
  (rank._from_gradients_ready);
- collectives inside the compute (all_to_all, broadcast, barrier, FSDP's per-layer all_gather,
  and on CPU ranks the gradient syncs the compute thread waited out: FSDP2's per-layer
  reduce-scatter, compute.waited_collectives: a rank that waits out at least half of its syncs;
  decided for the job: if some ranks waited out none,
  none did, ops.unwaited, since a straggling peer makes a DDP rank's all-reduces short and late)
  over a group of several workers, without a pipeline: `all-to-all` / `group-collective` ops, the
  compute label that issued one cut there into pieces of its microbatch;
- CPU ranks: per compute op, the longest stretch inside its span in which the step thread ran no
  traced op (`idle_within`: a garbage collection or the OS mid-forward), and the collector's
  recorded time inside it (`gc_within`, with the trainer's GC record); per rank and step, where
  the rank entered and left it (`step_entered`, `step_left`: its ProfilerStep, or its rebuilt
  iteration), so the time after its last op (a planned gc.collect()) is that step's, and the
  recorded collections in that tail (`gc_tail`);
- everything else that is communication or a label (collectives of other groups, those inside a
  pipeline's compute, unknown labels) is counted in source.unmapped.
- clocks: a rank's times are `baseTimeNanoseconds` + ts; ranks of one host (`host_name`) share
  a clock, and between hosts offsets are estimated so that the ends of matched collectives and
  p2p pairs coincide (least squares). A shift of one host's clock then changes nothing: the
  analysis depends on durations, each rank's order of ops, and where matched ops end (exact when
  they end together, else within their spread). job.yaml `clock: trust` keeps the recorded
  clocks, `clock: align` gives every rank its own.
"""
from __future__ import annotations

from transforms.ingest.kineto.job import assemble, convert_kineto
from transforms.ingest.kineto.rank import parse_rank, parse_rank_bytes
from transforms.ingest.kineto.spans import (DEFAULT_BACKWARD_LABELS, DEFAULT_FORWARD_LABELS, DEFAULT_OPTIMIZER_LABEL,
                                            Group, RankTrace)

__all__ = [
    "RankTrace",
    "Group",
    "parse_rank",
    "parse_rank_bytes",
    "assemble",
    "convert_kineto",
    "DEFAULT_FORWARD_LABELS",
    "DEFAULT_BACKWARD_LABELS",
    "DEFAULT_OPTIMIZER_LABEL",
]
