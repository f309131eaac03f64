"""Root causes of a straggling job (METHOD.md section 5), what fixing each would save, and why, in words.

Plain numpy, no Beam. In: a compiled JobModel, its WhatIfResult (with attribution: S >=
1.03) and, when the trainer recorded them, the per-microbatch document lengths. Out: a
`Verdict`: every listed cause (most GPU-hours saved first) with its confidence, its fix
what-if and one sentence for people; the primary cause; the evidence; the workers blamed.

Every fix is a scenario of the engine's batched replay, so "explained" always means: the
share of the straggling time T - T_ideal that disappears when that fix is applied to the
no-delay trace; "saves" means 1 - T_fix / T, the share of the job's GPU-hours.

Signatures (a cause is a candidate when its signature holds)
- individual-worker: a worker's compute (forward + backward) per microbatch against the
  other DP ranks of its stage, per step (signals.peer_comparison: robust to stage imbalance,
  which hits every DP rank of a stage alike), or its step's whole compute against theirs when
  that is higher (a stall in one microbatch every step):
  >= `peer_ratio` (1.2x) or the job's noise floor, whichever is higher, in more than
  `peer_steps` (half) of the steps (most of them); or its forward or backward alone >= `worker_alarm_ratio`
  (and the floor) in three steps of four (a faster other direction dilutes the whole compute). Fix: that worker at peer speed, none of its computes above
  its peers' median of the same compute (GC pauses left to python-gc's fix). Named even below S 1.1
  when >= `worker_alarm_ratio` (1.5x, compute, forward or backward). With one DP rank (no
  peers): M_W > 0.5, fix: the M_W set's compute at ideal speed; the trace's `n_ops` (ops
  autograd recorded) then tells a slow machine (the usual ops, slower) from a heavy
  partition (more ops), and every slow stage is named.
- communication: located when M_W > 0.5 and idealising the M_W set's transfers explains
  more than their compute (a bad link, not a slow GPU; fix: those transfers at typical
  time); else global when communication types hold >= `comm_share` of the per-type
  slowdown or add >= `comm_excess` to it and the transfers beyond their own typical time
  gather on a DP rank, stage or step (fix: every transfer at its own typical time).
- stage-imbalance: M_S >= 0.5 with a hot last-stage row (min/max of S_w - 1 >= 0.5), or
  one model chunk doing >= `stage_chunk_ratio` (1.1x) the compute per microbatch of the
  median chunk, measured on each chunk's fastest DP rank (a slow machine does not make its
  stage heavy). Fix: rebalanced stages, every chunk's compute scaled to the chunks' mean.
- sequence-imbalance: Pearson r >= 0.9 between forward and backward durations of the same
  microbatch, normalised within each (step, worker, chunk) so persistent worker and stage
  differences cancel. Measured by an even spread of each step's compute over microbatches
  and DP ranks (an upper bound); the fix reported is greedy repacking of the recorded
  documents (sequences.py: longest first, each to the lightest microbatch of the step with
  room) when the trace has seq_lens, else that even spread.
- python-gc: forward-only stalls (forward beyond ratio_median x its backward, > 50 ms and
  8 MADs), on >= 2 workers, no worker holding > 80% of them, backwards clean. Measured by
  removing the pauses; the fix reported is planned GC (the same work paid by all at once).

The listing rule (`causes`): a candidate is listed when its fix removes at least its
`*_min_explained` share (worker and communication 10%, stage 10%, sequence 15%, GC 10%)
of the straggling time T - T_ideal alone, or of the straggling time that remains once the
fixes of every other candidate are applied, when that remainder is still a slowdown of at
least 1.05 (over the lower of T_ideal and the step time with every fix: a repaired slow
worker can beat an ideal whose means include it) (so a cause masked by a bigger one still counts: a last stage that is the
bottleneck only once a slow worker is repaired, GC pauses beside a 2x slower machine). Listed causes are ordered by the
GPU-hours their fix saves alone (ties: by the share after the others); `cause` is the
first. Each has a confidence (0.5 at a threshold, 1 at a clear margin, the minimum over
its conditions), a Fix (S after it, share explained alone and after the others, savings)
and a sentence (explain.py). With two or more, `joint_fix` replays all fixes together
(fixes.compose). A fix must also save `min_savings` (3%) of the step alone, unless it matters once
the other causes are fixed or it is a measured slow worker. "unexplained": straggling, nothing
listed; "none": S below 1.1, or straggling no DP rank, stage or step holds twice the next's share
of (or mostly transfer-time variation over every rank and step), or that the best fix removes in
one step only (`transient`: a transfer held up once): the job's own variation. Communication is a
candidate only when its fix saves at least half its largest per-step saving in two steps or more
(a flapping link recurs).

Discarded windows (replay off by more than 5% either way) get measurements only: a worker >=
`worker_alarm_ratio` its peers, a chunk >= `stage_alarm_ratio` the median chunk's compute (with
one DP rank: a stage running its usual work at >= `worker_alarm_ratio` the median pace, forward or
backward, is a slow machine even when its chunk totals are not that much heavier), and
untraced-cpu: workers whose untraced time (launch delay while neither computing nor blocked in a
recv or DP collective) is persistently twice their DP peers' and whose delays make most of the
discrepancy, or 4x their peers' in every step (hidden behind a slower worker now; its fix: that
time removed, against what ran); nothing measured: "none". When the replay with only the named
untraced-cpu workers' launch delays given back is within 5% of what ran, their untraced time is
modelled (`model_untraced` sets result.untraced, result.UntracedWork): the window is kept, its S
and T include that time, and it gets the same measured verdict. A window whose no-delay replay
matches lists untraced-cpu after its what-if causes when such a worker's untraced time is at
least half the straggling threshold's share of the step.

Modules: verdict (dataclasses, job_cause row), signals, sequences, fixes, detect
(classify), explain (sentences). Words for causes, fixes and evidence: schemas/causes.py.
"""
from __future__ import annotations

from transforms.whatif.causes.detect import COMPUTE_GROUPS, analyze_and_classify, classify
from transforms.whatif.causes.sequences import SequenceWorkload, greedy_rebalance, imbalance_degree, sequence_workload
from transforms.whatif.causes.verdict import CauseError, CauseRules, Fix, Verdict, job_cause_table, verdict_json, verdict_row

__all__ = [
    "CauseRules",
    "Fix",
    "Verdict",
    "SequenceWorkload",
    "CauseError",
    "classify",
    "sequence_workload",
    "greedy_rebalance",
    "imbalance_degree",
    "verdict_row",
    "verdict_json",
    "job_cause_table",
    "analyze_and_classify",
    "COMPUTE_GROUPS",
]
