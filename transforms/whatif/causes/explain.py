"""One sentence per verdict, in plain words, built from its evidence and its fix what-if.

"worker dp 1 / stage 1 runs forward and backward compute 1.6x slower than the other DP
ranks of stage 1 in 32 of 32 steps; at peer speed the job would be 12% faster."
Percentages of the straggling time are shares of T - T_ideal; "x% faster" is the share of
step time (and so of GPU-hours) the fix saves. A share above 100% reads "all" (the fix leaves the
step faster than the ideal: what stays runs faster than its op type's mean), below 0 "none"
(the fix makes the step slower); the figure follows in brackets.
"""
from __future__ import annotations

import math

from schemas.causes import CAUSE_TITLES, FIX_NAMES
from transforms.whatif.causes.verdict import CauseRules, Fix

__all__ = ["CAUSE_ORDER", "counted", "cause_sentence", "verdict_sentence", "insufficient_sentence", "what_would_decide", "when_slow", "discarded_sentence", "untraced_sentence", "share_words",
           "times_words"]

CAUSE_ORDER = ("individual-worker", "stage-imbalance", "sequence-imbalance", "python-gc", "communication")


def _pct(share: float) -> str:
    return f"{int(round(100 * share))}%"


def counted(n: int, unit: str) -> str:
    """n of the worker test's sampling unit, in words: "1 step", "2 steps", "4 microbatches"."""
    if n == 1:
        return f"1 {unit}"
    return f"{n} {unit}{'es' if unit.endswith(('ch', 'sh', 's', 'x')) else 's'}"


def share_words(share: float) -> str:
    """A share of the straggling time in words: "42%", "all (142%)" above 100%, "none (-12%)" below 0."""
    percent = int(round(100 * share))
    if percent > 100:
        return f"all ({percent}%)"
    if percent < 0:
        return f"none ({percent}%)"
    return f"{percent}%"


def times_words(ratio: float, what: str = "") -> str:
    """A time ratio against peers in words: "forward 1.6x slower", "backward 1.4x faster" (1/ratio)."""
    subject = f"{what} " if what else ""
    if ratio >= 1.0 or ratio <= 0.0:
        return f"{subject}{ratio:.1f}x slower"
    return f"{subject}{1.0 / ratio:.1f}x faster"


def _faster(fix: Fix) -> str:
    return f"the job would be {_pct(max(fix.savings_fraction, 0.0))} faster"


def _masked(fix: Fix) -> str:
    """The share after the other causes are fixed, when it says more than the share alone."""
    given = fix.explained_given_others
    if given is None or given < fix.explained + 0.05:
        return ""
    return f" (once the other causes are fixed, it removes {share_words(given)} of the straggling time that remains)"


def _two_speeds(forward: float, backward: float) -> str:
    """"forward 2.5x and backward 2.3x slower"; each with its own word when one is faster than its peers."""
    if (forward >= 1.0) == (backward >= 1.0):
        slower = forward >= 1.0
        first, second = (forward, backward) if slower else (1.0 / forward, 1.0 / backward)
        return f"forward {first:.1f}x and backward {second:.1f}x {'slower' if slower else 'faster'}"
    return f"{times_words(forward, 'forward')} and {times_words(backward, 'backward')}"


def listed(words: list[str]) -> str:
    """"3", "3 and 5", "3, 5 and 7"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def when_slow(w: dict) -> str:
    """When a worker the detector decided is slow was slow: "in 3 of 3 steps" (persistent), or
    "in steps 1 and 3 of 5 (intermittent)"; with its confidence."""
    confidence = f", confidence {w['confidence']:.2f}" if w.get("confidence") is not None else ""
    if w.get("persistent", True):
        return f"in {w['slow_steps']} of {w['steps']} steps{confidence}"
    numbers = w.get("step_numbers")
    steps = [str(s) for s in (numbers if numbers is not None else w.get("step_indices", []))]
    named = listed(steps)
    if numbers is not None:   # the profiled steps' own numbers, as the step table shows them
        return f"in step{'s' if len(steps) > 1 else ''} {named} ({len(steps)} of {w['steps']} sampled steps; intermittent{confidence})"
    return f"in step{'s' if len(steps) > 1 else ''} {named} of {w['steps']} (intermittent{confidence})"


def _worker(evidence: dict, fix: Fix, implicated) -> str:
    peers = {(w["dp_rank"], w["stage"]): w for w in evidence.get("peer_workers", [])}
    if implicated and all(w in peers for w in implicated):
        parts = []
        for d, p in implicated:
            w = peers[(d, p)]
            speed = (times_words(w["ratio"], "forward and backward compute") if abs(w["forward"] - w["backward"]) < 0.1
                     else _two_speeds(w["forward"], w["backward"]))
            parts.append(f"worker dp {d} / stage {p} runs {speed} than the other DP ranks of stage {p} "
                         f"{when_slow(w)}")
        return "; ".join(parts) + f"; at peer speed {_faster(fix)}{_masked(fix)}."
    balance = {(w["dp_rank"], w["stage"]): w for w in evidence.get("balance_workers", [])}
    if implicated and all(w in balance for w in implicated):
        return "; ".join(_balance_fact(balance[w]) for w in implicated) + f"; at that balance {_faster(fix)}{_masked(fix)}."
    workers = ", ".join(f"dp {d} / stage {p}" for d, p in implicated) or "a few workers"
    speed = "the other workers' mean speed" if fix.description == FIX_NAMES["worker-others"] else "ideal speed"
    return (f"worker {workers} explains {share_words(evidence['m_w'])} of the straggling time (M_W, no DP peers to compare with); "
            f"with its compute at {speed} {_faster(fix)}.")


def _balance_fact(w: dict) -> str:
    """A stage the balance test blames (workers.balance_tests: no DP peers), in words."""
    other = "backward" if w["kind"] == "forward" else "forward"
    if not w.get("persistent", True):
        return (f"stage {w['stage']} (its only DP rank) runs its {w['kind']} {w['ratio']:.2f}x as long as in its other "
                f"steps, beside the other stages' {w['kind']} in the same steps, {when_slow(w)} (a heavier partition "
                f"would be heavier in every step)")
    return (f"stage {w['stage']} (its only DP rank) runs its {w['kind']} {w['ratio']:.2f}x as long as its {other} "
            f"implies beside the other stages' balance of backward to forward, in every step (confidence "
            f"{w['confidence']:.2f}; more layers would lengthen both alike)")


def _stage(evidence: dict, fix: Fix, pp_size: int, min_savings: float) -> str:
    measured = "stage_idealised_explained" in evidence   # detect._work_or_speed: the partition measured heavier
    heavy = ""
    if "heaviest_chunk" in evidence and evidence.get("chunk_ratio", 0.0) >= 1.0:
        chunk, stage = evidence["heaviest_chunk"]
        where = "the last stage" if stage == pp_size - 1 else f"stage {stage}"
        heavy = f"model chunk {chunk} on {where} does {evidence['chunk_ratio']:.2f}x the compute per microbatch of the median chunk"
        if measured:
            heavy += (f", {evidence['chunk_work_ratio']:.2f}x its recorded operations at {evidence['chunk_speed_ratio']:.2f}x "
                      f"their pace (a heavier partition, not a slower machine); that stage's compute at ideal speed "
                      f"removes {share_words(evidence['stage_idealised_explained'])} of the straggling time")
        heavy += "; "
    if not measured:
        heavy += f"the last stage explains {share_words(evidence['m_s'])} of the straggling time (M_S); "
    text = f"{heavy}with layers repartitioned evenly {_faster(fix)}{_masked(fix)}"
    if measured and fix.savings_fraction < min_savings:
        text += (": the stages that would take on its layers lie on the critical path too, so evening the "
                 "partition alone gains little here")
    return text + "."


def _follows_data(evidence: dict) -> str:
    """The correlation(s) that showed compute following the data, as measured: forward against
    backward of the same microbatch (several per worker and step), compute against its recorded
    tokens (the only one with one microbatch per worker and step); NaN ones are not shown."""
    said = []
    pair = evidence.get("forward_backward_r_normalised")
    if pair is not None and math.isfinite(pair):
        said.append(f"the forward and backward of the same microbatch are slow together (r = {pair:.2f})")
    tokens = evidence.get("workload_compute_r")
    if tokens is not None and math.isfinite(tokens):
        said.append(f"compute follows the microbatches' recorded tokens (r = {tokens:.2f})")
    return " and ".join(said) if said else "compute follows the data"


def _sequence(evidence: dict, fix: Fix) -> str:
    text = f"{_follows_data(evidence)}, so microbatches carry unequal work"
    if "imbalance_degree" in evidence:
        text += f" (the heaviest has {evidence['imbalance_degree']:.2f}x the mean workload per step)"
    balance = ("giving every microbatch its step's mean recorded workload" if "imbalance_degree" in evidence
               else "spreading each step's work evenly")
    text += f"; {balance} would remove {share_words(evidence['sequence_even_explained'])} of the straggling time"
    if "imbalance_degree_rebalanced" in evidence:
        text += (f"; greedy repacking of the recorded documents (imbalance {evidence['imbalance_degree_rebalanced']:.2f}x) "
                 f"removes {share_words(fix.explained)}: {_faster(fix)}")
    else:
        text += f": {_faster(fix)}"
    return text + f"{_masked(fix)}."


def _gc(evidence: dict, fix: Fix) -> str:
    return (f"forward computes stall {evidence['gc_mean_pause']:.2f} s on average, {evidence['gc_pauses']} times on "
            f"{evidence['gc_workers']} workers in {evidence['gc_steps']} steps, no worker holding more than "
            f"{_pct(evidence['gc_max_worker_share'])} of them: Python garbage collection; the pauses are "
            f"{share_words(evidence['gc_fix_explained'])} of the straggling time, and with planned GC (all workers at once) "
            f"{_faster(fix)}{_masked(fix)}.")


def _communication(evidence: dict, fix: Fix, implicated) -> str:
    if implicated:
        workers = ", ".join(f"dp {d} / stage {p}" for d, p in implicated)
        return (f"the transfers of worker {workers} are slow: at their typical time they remove "
                f"{share_words(evidence['worker_comm_explained'])} of the straggling time (its compute only "
                f"{share_words(evidence['worker_compute_explained'])}); with its link repaired {_faster(fix)}{_masked(fix)}.")
    return (f"communication op types make {_pct(evidence['comm_share'])} of the slowdown by op type "
            f"(slowest: {evidence['top_comm_optype']}); with every transfer at its typical time {_faster(fix)}{_masked(fix)}.")


def cause_sentence(cause: str, evidence: dict, fix: Fix, implicated, pp_size: int,
                    min_savings: float = CauseRules.min_savings) -> str:
    """The sentence of one listed cause (its evidence keys as classify writes them); min_savings:
    the rules' floor a change must save (classify passes its own)."""
    if cause == "individual-worker":
        text = _worker(evidence, fix, implicated)
    elif cause == "stage-imbalance":
        text = _stage(evidence, fix, pp_size, min_savings)
    elif cause == "sequence-imbalance":
        text = _sequence(evidence, fix)
    elif cause == "python-gc":
        text = _gc(evidence, fix)
    elif cause == "communication":
        text = _communication(evidence, fix, implicated)
    else:
        raise ValueError(f"no sentence for cause {cause!r}")
    return text[0].upper() + text[1:]


def pause_sentence(evidence: dict, fix: Fix, worker_rank=None) -> str:
    """The sentence of python-gc read from untraced pauses (CPU ranks): who pauses, in which steps,
    how long against the job's usual largest gap, and what planned GC saves."""
    pauses = evidence.get("pauses") or []
    by_worker: dict[tuple[int, int], list[dict]] = {}
    for p in pauses:
        by_worker.setdefault((p["dp_rank"], p["stage"]), []).append(p)
    steps = sorted({p["step"] for p in pauses})
    parts = []
    for (d, s), hits in by_worker.items():
        rank = f" (rank {int(worker_rank[d, s])})" if worker_rank is not None else ""
        longest = max(h["seconds"] for h in hits)
        several = max(h.get("count", 1) for h in hits) > 1
        parts.append(f"dp {d} / stage {s}{rank} in step{'s' if len(hits) > 1 else ''} "
                     f"{', '.join(str(h['step']) for h in hits)} (up to {1e3 * longest:.0f} ms"
                     f"{' a step, in up to ' + str(max(h.get('count', 1) for h in hits)) + ' pauses' if several else ''})")
    rotating = len(by_worker) > 1
    if evidence.get("gc_recorded"):
        return (f"Python's garbage collector, as the trainer recorded it, stopped {'; '.join(parts)} for at least the "
                f"straggling threshold's share of a step. "
                f"{fix.description[0].upper() + fix.description[1:]} would save {_pct(max(fix.savings_fraction, 0.0))} of "
                f"the step (measured on the steps as they ran; {len(pauses)} collections in {len(steps)} steps).")
    return (f"Untraced pauses, each one gap where a forward begins, inside a forward or between two of a worker's steps, outside "
            f"data loading, far beyond this job's usual largest gap ({1e3 * evidence.get('typical_largest_gap', 0.0):.0f} ms): {'; '.join(parts)}"
            f"{', a different worker in different steps' if rotating else ''}. Python's garbage collector stops a "
            f"process like this (so do the OS preempting it and slow per-step Python; a GC record from the collector tells "
            f"them apart). "
            f"{fix.description[0].upper() + fix.description[1:]} would save {_pct(max(fix.savings_fraction, 0.0))} of "
            f"the step (replayed with every other gap between ops kept; "
            f"{sum(p.get('count', 1) for p in pauses)} pauses in {len(steps)} steps).")


def where_undecided(finding: dict) -> str:
    """Where an undecided worker's effect lies, when its samples fall in a slow level and a usual one
    (workers._seen_levels): " (1.6-1.9x in steps 3, 5 and 7, 1.0-1.3x in the others)"; else ""."""
    steps = [str(s) for s in finding.get("step_numbers") or finding.get("steps") or []]
    levels = finding.get("levels")
    if not steps or not levels:
        return ""
    named = listed(steps)
    return (f" ({levels[0]:.1f}-{levels[1]:.1f}x in step{'s' if len(steps) > 1 else ''} {named}, "
            f"{levels[2]:.1f}-{levels[3]:.1f}x in the others)")


def what_would_decide(finding: dict, unit: str) -> str:
    """What would decide an undecided worker finding (workers.WorkerFinding.as_json): more samples
    (`samples_needed` of the test's `unit`), or, where the offset healthy peers keep hides the
    effect whatever the steps, more DP peers."""
    if finding.get("samples_needed"):
        return f"about {counted(finding['samples_needed'], 'profiled ' + unit)} would decide"
    return "more DP peers, not more steps, would decide"


def insufficient_sentence(slowdown: float, test: dict, evidence: dict | None = None,
                          discarded_launch: float | None = None) -> str:
    """Why the job cannot support a decision, and what would settle it ("insufficient-evidence");
    with a sequence signature short of significance (evidence sequence_samples_needed), that too.
    discarded_launch: the discarded window's no-delay discrepancy, whose S the sentence then does
    not lean on (it comes from the replay that does not match)."""
    head = f"S = {slowdown:.3f}, but the trace cannot decide who or what is slow" if discarded_launch is None else \
        f"{replay_mismatch(discarded_launch)}, and the trace cannot decide who or what is slow"
    evidence = evidence or {}
    parts = []
    crowded = evidence.get("untraced_crowded")
    if crowded:   # untraced-cpu's worker on an oversubscribed host (measured.crowded_untraced)
        c = crowded[0]
        parts.append(f"worker dp {c['dp_rank']} / stage {c['stage']} (rank {c['rank']}) spends {100 * c['excess']:.0f}% of "
                     f"a step more untraced time than its peers, but its host ran {c['host_load']:.1f} of the job's threads "
                     "per core, so that time includes its wait for a core, which no trace tells apart from its own work: "
                     "give each rank cores of its own (fewer ranks or torch threads per host) to decide")
    if evidence.get("chunk_undecided"):   # detect._work_or_speed: one DP rank per stage
        chunk = evidence.get("heaviest_chunk") or [None, None]
        parts.append(f"stage {chunk[1]}'s chunk does {evidence['chunk_work_ratio']:.2f}x the median chunk's recorded work "
                     f"at {evidence['chunk_speed_ratio']:.2f}x its pace, as much a slower machine as a heavier partition, "
                     "and with one DP rank per stage no replica tells them apart: DP replicas of the stages (DP >= 2), "
                     "or a pace 1.3x the others', would decide")
    needed = evidence.get("sequence_samples_needed")
    if needed:
        parts.append(f"compute follows the batches' recorded tokens (r = {evidence['workload_compute_r']:.2f}, p = "
                     f"{evidence['sequence_p']:.2g}), not clearly enough to call it sequence-length imbalance at a "
                     f"{100 * test.get('alpha', 0.01):g}% false-alarm rate: about {needed} more "
                     f"microbatch{'es' if needed != 1 else ''} (steps x DP ranks) would decide")
    if parts and not test.get("undecided") and (crowded or not test.get("limits")):
        # the workers' compute is decided (or untestable beside a crowded host): only these are not
        return f"{head}: " + "; and ".join(parts) + "."
    return "; and ".join([_insufficient_workers(head, test), *parts]) + "."


def _insufficient_workers(head: str, test: dict) -> str:
    """The workers' part of `insufficient_sentence`, without its closing period."""
    undecided = test.get("undecided") or []
    if undecided:
        w = undecided[0]
        jitter = 100 * (math.exp(test["sigma"]) - 1)
        how = ("a longer active window of the profiler's schedule" if w.get("samples_needed") else
               "healthy DP peers differ persistently by about this much; or a record of what the worker ran")
        return (f"{head}: worker dp {w['dp_rank']} / stage {w['stage']}'s {w['kind']} measures {w['ratio']:.2f}x its DP "
                f"peers' over {counted(w['samples'], test['unit'])}{where_undecided(w)}, within this job's own jitter ({jitter:.0f}% per "
                f"{test['unit']}) at a {100 * test['alpha']:g}% false-alarm rate; {what_would_decide(w, test['unit'])} "
                f"({how})")
    limits = "; ".join(test.get("limits") or []) or "no measurement stands out"
    return f"{head}: {limits}; profile at least 3 steps on more than one DP rank to decide"


def verdict_sentence(verdict: str, slowdown: float, threshold: float, best: Fix | None, spread: bool = False,
                     transient: bool = False, jitter: dict | None = None, small: list[dict] | None = None,
                     min_savings: float = CauseRules.min_savings) -> str:
    """The sentence of a verdict without a listed cause: "none" or "unexplained"; `jitter`: the
    evidence's jitter_null (causes/jitter.py), when S is one the job's own jitter reaches; `small`:
    the causes whose signature holds but whose fix saves less than `min_savings` of the step
    (evidence below_min_savings), which the sentence names rather than saying no signature holds."""
    nothing = "no cause's signature holds"
    if small:
        nothing = "no cause worth a change (" + "; ".join(
            f"{CAUSE_TITLES.get(c['cause'], c['cause'])}'s signature holds, but its fix would save only "
            f"{100 * max(c['saves'], 0.0):.1f}% of the step, less than the {_pct(min_savings)} a change must save"
            for c in small) + ")"
    if verdict == "none" and jitter is not None:
        return (f"S = {slowdown:.3f}, within this job's own jitter: with every compute at its ideal, its "
                "transfers and other ops (optimizer, clipping) as they ran (in steps and ranks drawn at random) and each "
                "worker's compute varying by "
                f"{100 * (math.exp(jitter['jitter']) - 1):.0f}% per {jitter['unit']} as measured "
                f"(persistent offsets of {100 * (math.exp(jitter['offset']) - 1):.0f}%), {jitter['draws']} replays reach "
                f"S {jitter['median']:.3f} typically and {jitter['quantile']:.3f} at the false-alarm rate (p = "
                f"{jitter['p_value']:.2f}); {nothing}. Each step waits for whichever rank is slowest "
                "in it: the job's own variation, not a straggler to fix.")
    if verdict == "none" and transient:
        return (f"S = {slowdown:.3f}, but transient: what the best single fix ({best.description}) removes sits in one "
                "step, not in the others; one held-up transfer or a rank preempted for a moment "
                "is the job's own variation, not a straggler to fix.")
    if verdict == "none" and spread:
        return (f"S = {slowdown:.3f}, but spread: no DP rank, stage or step holds twice the slowdown of the next, "
                f"or most of it is transfer time varying over every rank and step, and {nothing}; "
                "this is the job's own variation, not a straggler to fix.")
    if verdict == "none":
        return f"S = {slowdown:.3f} is below the {threshold:g} straggling threshold: nothing to fix."
    if best is None or best.explained <= 0:
        return f"S = {slowdown:.3f} but no detector could run (no attribution): the cause is unknown."
    if best.explained >= 0.5:   # the replay can remove it, the trace cannot say why it is there
        return (f"S = {slowdown:.3f} but {nothing}: the best single fix ({best.description}) "
                f"would remove {share_words(best.explained)} of the straggling time, yet nothing in the trace "
                "shows that cause.")
    return (f"S = {slowdown:.3f} but {nothing}; the best single fix ({best.description}) "
            f"would remove only {share_words(best.explained)} of the straggling time.")


def replay_mismatch(launch_slowdown: float, modelled: bool = False) -> str:
    """What a window whose replay does not match its trace (discrepancy beyond 5% either way) means,
    or one that matches it only with named workers' untraced CPU time (`modelled`)."""
    off = (f"what ran took {100 * (launch_slowdown - 1):.0f}% longer than the replay of its ops (untraced CPU work)"
           if launch_slowdown > 1 else f"the replay takes {100 * (1 / launch_slowdown - 1):.0f}% longer than what ran "
           "(the dependency model serialises work that overlapped)")
    if modelled:
        return (f"The replay of its traced ops matches the trace only with the named workers' untraced CPU time ({off}), "
                "so no what-if saving of traced ops is given")
    return f"The replay does not match the trace ({off}), so no what-if saving is given"


def discarded_sentence(cause: str, evidence: dict, implicated, launch_slowdown: float, modelled: bool = False) -> str:
    """The sentence of a window whose replay does not match its trace, or matches it only with named
    workers' untraced CPU time (`replay_mismatch`), and only what the trace measured (no what-if
    savings of traced ops)."""
    head = replay_mismatch(launch_slowdown, modelled)
    if cause == "individual-worker":
        peers = {(w["dp_rank"], w["stage"]): w for w in evidence.get("peer_workers", [])}
        facts = [f"worker dp {d} / stage {p}'s forward takes {peers[(d, p)]['forward']:.1f}x and its backward "
                 f"{peers[(d, p)]['backward']:.1f}x its DP peers' {when_slow(peers[(d, p)])}"
                 for d, p in implicated if (d, p) in peers]
        balance = {(w["dp_rank"], w["stage"]): w for w in evidence.get("balance_workers", [])}
        facts += [_balance_fact(balance[(d, p)]) for d, p in implicated if (d, p) not in peers and (d, p) in balance]
        facts += [f"stage {p} (its only DP rank) runs the usual number of recorded operations per microbatch more "
                  "slowly than the other stages" for d, p in implicated if (d, p) not in peers and (d, p) not in balance]
        return f"{head}; measured: {'; '.join(facts)}."
    if cause == "stage-imbalance":
        chunk, stage = evidence["heaviest_chunk"]
        return (f"{head}; measured: model chunk {chunk} (stage {stage}) does {evidence['chunk_ratio']:.2f}x the compute "
                "per microbatch of the median chunk, on its fastest DP rank.")
    return f"{head}; no worker measures slower than its DP peers beyond the job's own jitter."


def untraced_sentence(untraced, launch_slowdown: float, fix: Fix, data_share: float | None = None) -> str:
    """The sentence of the untraced-cpu cause: whose untraced CPU time stalls the job, by how much;
    data_share: the share of the worker's untraced time inside DataLoader fetches (None: unknown)."""
    (d, p), excess, free, _ = untraced[0]
    others = f" (also {', '.join(f'dp {w[0]} / stage {w[1]}' for w, *_ in untraced[1:])})" if len(untraced) > 1 else ""
    if data_share is not None and data_share >= 0.5:
        what = f"mostly data loading: {100 * data_share:.0f}% of it inside its DataLoader fetches"
    elif data_share is not None:
        what = (f"outside data loading ({100 * (1 - data_share):.0f}% of it not in DataLoader fetches): pauses, "
                "host syncs, Python between its ops")
    else:
        what = "pauses, data loading, host syncs between its ops"
    head = f"Worker dp {d} / stage {p}{others} spends CPU time the trace does not record ({what})"
    if excess is None:
        return (f"{head}: its untraced time is {100 * free:.0f}% of the step and beyond its peers' in every step; "
                "they wait for it in their collectives, which the replay (within 5% of what ran) cannot tell from "
                f"transfer time; without it the job would be up to {100 * fix.savings_fraction:.0f}% faster (measured).")
    if free > excess:
        return (f"{head}: its untraced time is {100 * free:.0f}% of the step and far beyond its peers' in every step; "
                f"with only its untraced time the replay is {100 * max(excess, 0.0):.0f}% longer now, the rest is hidden "
                "behind slower work elsewhere and costs once that is fixed.")
    return (f"{head}: with only its untraced time the replay is {100 * excess:.0f}% longer, "
            f"{share_words(fix.explained)} of the {100 * (launch_slowdown - 1):.0f}% by which what ran exceeds the replay; "
            f"without it the job would be {100 * fix.savings_fraction:.0f}% faster.")
