"""Root causes of a straggling job (METHOD.md section 5), what fixing each would save, and why, in words.

Plain numpy, no Beam. In: a compiled JobModel and its WhatIfResult (and, when recorded, document
lengths). Out: a `Verdict`: the listed causes (most GPU-hours saved first), each with its
confidence, its fix and one sentence; the workers blamed; the evidence behind it.

The design in four decisions.

1. Measurements decide who, statistics decide whether. A worker is slow when its own work is
   slower than the same work of its DP peers (same layers, same shapes) beyond what this job's
   own spread allows: `workers.py` tests every worker and kind of work (forward, backward) per
   profiled step against its peers, with the null taken from the job (the step-to-step jitter
   of every comparison, plus the persistent offset healthy peers keep: the job's own where it has
   the peers to bound it, else the prior measured on shared CPU cores, `peer_offset`), at a
   stated false-alarm rate per job (`false_alarm`, Bonferroni over the job's tests). Persistent
   (most steps) and intermittent (named steps: one spike, or a slow level over several steps
   against its simulated null) findings both blame; the verdict names each blamed worker's steps
   (`Verdict.slow_steps`) and every fix's saving step by step (`Fix.step_savings`), which the
   step_slowdown table and the job page carry; an effect the job cannot
   decide makes the verdict "insufficient-evidence", with the steps or peers that would decide.
   Several windows of one job decide together (`workers.pooled_worker_tests`, the same test over
   their samples: the live watcher pages on it, transforms/live/paging.py).
   Confidence is 1 - the adjusted p-value; bench_real_runs prints its reliability table (an
   insufficient-evidence verdict states its strongest undecided finding's). A window that
   straggles with no cause listed is tested the same way (`jitter.py`): replays of the ideal job
   with the measured compute jitter, and the transfers and the worker's other ops (optimizer,
   clipping) as they ran (lanes shuffled), put back give the S the job's own variation makes; an S
   they reach at the false-alarm rate is "none", one beyond them "unexplained".
   Without DP peers (a pipeline of one DP rank per stage) the same test runs on physics
   (`balance_tests`): more layers lengthen a chunk's forward and backward alike, a slow machine
   in one kind of work moves its balance of backward to forward away from the other stages';
   a leading stage whose balance departs is that worker (its fix: the slow kind back at the
   others' balance), one whose balance holds is a heavier stage.
2. Untraced time is split by physics before anyone is blamed for it (`pauses.py`, CPU ranks):
   time in DataLoader fetches is data loading; a gap far beyond the job's usual largest gap (by
   its spread at the same false-alarm rate) is a pause, and a worker-step's pauses count once
   they add up to half the straggling threshold's share of a step (one collection or several);
   the rest is ordinary Python between ops. Recurring pauses that all
   fall where the collector runs are python-gc, on one worker every step or every few, or
   rotating: where forwards begin or inside them (METHOD.md's forward-only stalls: the forward
   allocates the objects whose count triggers the collector), or between two of a worker's
   steps (where it opens, or after its last op: a trainer's planned gc.collect()); pauses inside the step before a
   collective, a backward or the optimizer (an oversubscribed host's OS) stay the worker's
   untraced-cpu. Either fix takes out the pauses and keeps the worker's ordinary time. A worker's
   untraced time (between its ops and inside them) beyond its peers' is tested like its compute:
   step by step against the job's own spread of that excess, at the same false-alarm rate, its
   confidence the test's. On a host with more of the job's threads than cores (the collector's
   record, the trace's `host_load` L) a rank runs at least 1/L of the time it is runnable, so
   waiting for a core can stretch its untraced time L-fold: within L times its peers' it is
   insufficient evidence (what would decide: cores of its own), beyond it the worker's own.
   The worker test measures a CPU rank's compute without the stretches
   inside it in which no traced op ran (a slow machine runs its ops slower; Python stopped runs
   none); without DP peers the balance test and the chunks' balance take out the collections the
   trainer recorded inside compute where they make a pause, a chunk's pace is the median of its
   ops' (one collection stretches one forward's gaps, a slow machine every op's), and a worker only
   M_W names whose pauses alone take out M_W's share of the straggling time is the collector's.
   On GPU ranks GC stretches forwards (signals.py); when the stretches rotate over the workers
   (GC's signature) the worker test leaves them out of the compute: the collector's time is not
   the machine's.
3. Every what-if is a replay: the fixes of all candidate causes are scenarios of one batched
   replay (fixes.py), and "explained" is always the share of T - T_ideal a fix removes; a cause
   is listed when its fix removes enough of it alone or once the others are fixed. A measured
   cause is listed whatever its fix saves, the saving stated: a worker slower than its peers, and
   a heavier partition (without DP peers, a hot stage whose chunk records more operations at the
   usual pace, to which METHOD's idealisation of its worker gives the straggling time: evening
   the layers may gain little where the stages taking them on lie on the critical path too). A
   worker M_W names without DP peers is fixed at the other workers' mean speed, not METHOD's ideal
   (each op type's mean over every worker, its own slow ops in it: with two stages that keeps half
   its excess): a fix is the others' speed, as a DP rank's is its peers'. Untraced
   time is not in the replay, so its fixes (untraced-cpu, python-gc from pauses) are measured
   against what ran and say so (`Fix.measured`).
   Transfers between CPU ranks that all ran on one host (the trace's `host` names) never cross a
   network: their time is the host's CPU and memory work, so communication is never proposed
   there; slow transfers are the host's contention.
4. Windows whose replay does not match the trace (METHOD.md: beyond 5%) get measurements only:
   the worker test, chunk balance, untraced workers, pauses; never a what-if saving of traced ops.

Thresholds live once, in `CauseRules` (verdict.py), grouped by where each comes from: METHOD.md
(the straggling threshold, M_W and M_S at 0.5, the hot last-stage row, "dominant" communication,
the 5% discrepancy), statistics (the false-alarm rate, a stated choice; the healthy peers' offset,
measured on clean real runs only), shares of the straggling threshold (what a cause's fix must
remove or cost), and physical signatures with their stated margins where no replay confirms them.
The sequence signature is a test too: compute following the data (forward against backward of a
microbatch, or compute against its recorded tokens), each correlation against Student's t with its
degrees of freedom, at the false-alarm rate (`paired.correlation_p`). Its fix, where the lengths are
recorded, moves work and never noise: each microbatch rescaled to its step's mean workload by a
cost line bounded by physics (fixed cost >= 0, cost growing with the work), so no duration moves
further than its workload does (`sequences.balanced_sequences`). Modules: workers (the worker
test), jitter (the null of S), pauses (untraced time: gaps, data loading, pauses), untraced
(untraced-cpu and python-gc from pauses), signals (pairs, peer pace, chunk balance, GPU GC stalls),
paired (what the pairs say before any fix: the worker test's findings, the sequence correlations),
sequences, fixes, localise (where straggling and slow transfers sit, link or host), measured
(verdicts from measurements alone: discarded windows, insufficient evidence), detect (classify:
signals -> one batched replay -> candidates -> listing -> verdict), explain (sentences), verdict
(dataclasses, the job_cause row). Words: schemas/causes.py.
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
