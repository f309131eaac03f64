"""Words for root-cause verdicts: what each cause and its fix are called, what each evidence metric means.

The classifier (transforms/whatif/causes/) writes evidence as metric name -> value; pages
and the CLI show these labels and the glossary instead of the names, so a reader never
needs the code. Every evidence key the classifier writes has an entry (tests check it).
"""
from __future__ import annotations

__all__ = ["CAUSE_TITLES", "FIX_NAMES", "EVIDENCE_LABELS", "evidence_label"]

# The cause as a person would say it (schemas.fleet.CAUSES).
CAUSE_TITLES: dict[str, str] = {
    "individual-worker": "slow worker",
    "stage-imbalance": "stage partitioning imbalance",
    "sequence-imbalance": "sequence-length imbalance",
    "python-gc": "Python garbage collection",
    "communication": "slow communication",
    "untraced-cpu": "untraced CPU work on a worker",
    "insufficient-evidence": "insufficient evidence",
    "unexplained": "unexplained slowdown",
    "none": "no straggler to fix",
}

# The fix of each what-if replay (classifier scenario name), as the verdict names it.
FIX_NAMES: dict[str, str] = {
    "worker-peer": "the slow worker at the speed of its DP peers (repair or replace its machine)",
    "worker-balance": "the slow stage's slow kind of work back at the balance of backward to forward the other stages "
                      "keep (repair or replace its machine)",
    "worker-compute": "the top workers' compute at ideal speed (repair or replace their machines)",
    "worker-others": "the top workers' compute at the other workers' mean speed (repair or replace their machines)",
    "worker-comm": "the blamed worker's transfers at their typical time (repair its link)",
    "stage": "layers repartitioned so every model chunk does the same compute",
    "communication": "every transfer at its own typical time over steps and DP ranks (repair the network)",
    "sequence": "every microbatch of a step given the same work (balanced data loading)",
    "sequence-repacked": "documents repacked across microbatches (greedy, longest first)",
    "gc": "planned GC: every worker collects at the same moment",
    "data": "the blamed worker's data loading at its peers' pace (more DataLoader workers, prefetching, faster storage or decoding)",
    "pauses": "the blamed worker's pauses taken out (its ordinary time between ops kept): find what it runs once per step (a hook, an explicit gc.collect(), a host sync)",
    "gc-pauses": "planned GC: the pauses taken out, the same collections paid by every worker at once (gc.freeze() after setup, gc.disable(), gc.collect() every N steps on every rank)",
    "untraced": "the blamed worker's untraced CPU work removed (pauses, data loading, host syncs)",
    "all": "every listed cause fixed at once",
}

# evidence key -> (label, one-line meaning). Shares are of the straggling time T - T_ideal.
EVIDENCE_LABELS: dict[str, tuple[str, str]] = {
    "slowdown": ("slowdown S", "mean step time over the ideal step time (1.0 = no straggling)"),
    "slowdown_traced": ("slowdown S of the traced ops", "S without the named workers' untraced CPU time (METHOD.md's S)"),
    "launch_slowdown": ("replay discrepancy without untraced time", "observed over the no-delay replay (METHOD.md); above 1.05 or "
                        "below 1/1.05 the window is discarded, unless the named workers' untraced CPU time accounts for it"),
    "attributed": ("attributed", "whether per-worker and per-type attribution ran (S >= 1.03)"),
    "m_w": ("M_W: share explained by the top 3% workers", "idealising the slowest 3% of workers removes this share"),
    "m_s": ("M_S: share explained by the last stage", "idealising the last pipeline stage removes this share"),
    "m_w_workers": ("top 3% workers", "(dp rank, stage) of the workers M_W idealises"),
    "comm_share": ("communication share of the per-type slowdown", "communication op types' part of the slowdown by op type"),
    "comm_excess": ("slowdown from communication types", "sum of S_t - 1 over communication op types"),
    "top_comm_optype": ("slowest communication type", "the communication op type with the largest S_t"),
    "forward_backward_r": ("forward/backward correlation (raw)", "Pearson r of a microbatch's forward and backward times"),
    "forward_backward_r_normalised": ("forward/backward correlation", "the same r within each worker and chunk, so slow workers and stages cancel"),
    "peer_workers": ("workers slower than their DP peers", "the workers the worker test decided slow: dp rank, stage, compute ratio to the peers' median, the steps where slow (persistent or named), confidence"),
    "peer_ratio_max": ("largest worker/peer ratio", "compute time of the slowest worker over the median of its stage's other DP ranks"),
    "below_min_savings": ("signatures not worth a change", "causes whose signature holds and explains enough of the straggling, "
                          "but whose fix saves less of the step than a change must (CauseRules.min_savings, 3%): not listed"),
    "sequence_p": ("compute follows the data (p-value)", "one-sided test that compute follows the data: the forward-backward and the compute-workload correlations, each against Student's t with its degrees of freedom, the smaller p times the number of tests; sequence-imbalance is a candidate at or below the job's false-alarm rate (1%)"),
    "sequence_samples_needed": ("microbatches to decide the sequence signature", "how many more microbatches (steps x DP ranks) the same correlation of compute with the recorded tokens would need to be significant at the false-alarm rate"),
    "workload_compute_r": ("compute follows the data (r)", "Pearson r between each microbatch's compute and the workload of the sequences it recorded (trainer's seq_lens, or record_shapes' token embedding: batch x length), over each stage and chunk's mean across steps and DP ranks; the sequence signature with one microbatch per worker and step"),
    "pauses": ("untraced pauses", "single gaps between a worker's ops, outside data loading, beyond this job's usual largest gap by its own spread (at the false-alarm rate) and by the straggling threshold's share of a step: dp rank, stage, step, seconds, excess"),
    "pause_limit": ("pause limit", "seconds a gap between ops (or inside a compute op) must exceed to count as a pause; a worker-step's pauses must also add up to the straggling share of a step"),
    "typical_largest_gap": ("usual largest gap", "median over worker-steps of the largest gap between a worker's ops outside data loading, seconds"),
    "data_loading_share": ("data loading share", "share of the job's untraced time between ops spent inside DataLoader fetches"),
    "pause_fix_saves": ("planned GC saves", "share of the step the pauses taken out (planned GC paid back) saves, replayed against what ran"),
    "planned_gc_seconds": ("planned GC per step", "seconds per step the same collections cost when every worker collects at once"),
    "untraced_is_pauses": ("untraced time is pauses", "the untraced-cpu workers' untraced time is mostly their pauses: python-gc, not untraced-cpu"),
    "worker_test_at_mean_workload": ("worker test at equal batches", "the batches' recorded lengths explain the compute (the sequence signature), so the worker test compared each worker's work rescaled to its chunk's mean workload: a rank given longer batches is no slower machine"),
    "worker_test": ("worker test", "each worker's forward and backward against its DP peers per step, tested against this job's own jitter (sigma, log units) at a stated false-alarm rate per job: the workers decided slow (persistent or in named steps) and the ones the job's noise cannot decide (with the steps that would)"),
    "untraced_workers": ("workers with untraced CPU time", "dp rank, stage, the no-delay replay's slowdown with only their launch delays given back, and, for a worker a slower one hides, 1 + its untraced time's share of the step (hidden_slowdown)"),
    "localised": ("straggling stands out", "the hottest DP rank, stage or step holds at least twice the slowdown of the next (else: the job's own variation)"),
    "transient": ("one step's", "what the best single fix removes sits in one step (a held-up transfer, a preempted rank): the job's own variation"),
    "comm_localised": ("slow transfers gather", "transfers beyond their own typical time gather on one DP rank, stage or step (else: spread, the machine's noise)"),
    "chunk_work_ratio": ("work of the hot stage", "operations autograd recorded per microbatch in the hot stage's chunks over the median chunk's (more layers: > 1)"),
    "chunk_speed_ratio": ("pace of the hot stage", "seconds per recorded operation of the hot stage's chunks over the median chunk's, forward or backward (a slower machine: > 1)"),
    "chunk_ratio": ("heaviest model chunk over the median chunk", "compute per microbatch of the heaviest chunk (its fastest DP rank)"),
    "heaviest_chunk": ("heaviest model chunk", "global chunk id (and its stage) with the most compute per microbatch"),
    "gc_pauses": ("stretched forwards", "forward computes stalled beyond their backward's proportion: the collector's signature where it runs inside a traced compute (GPU ranks); on CPU ranks a collection is a gap between ops, counted in 'untraced pauses'"),
    "gc_workers": ("workers with pauses", "how many workers the pauses hit (GC rotates)"),
    "gc_max_worker_share": ("largest share of pauses on one worker", "near 1: one machine, not GC"),
    "gc_steps": ("steps with pauses", "sampled steps with at least one pause"),
    "gc_mean_pause": ("mean pause (s)", "mean stall of a paused forward compute"),
    "gc_backward_outliers": ("backward stalls", "the same test on backward computes (GC pauses forwards only)"),
    "worker_fix_explained": ("worker fix: share explained", "share removed with the blamed workers at their peers' speed"),
    "worker_compute_explained": ("top workers at ideal compute: share explained", "share removed with the M_W workers' compute at ideal speed"),
    "worker_comm_explained": ("top workers at ideal communication: share explained", "share removed with the M_W workers' transfers at ideal time"),
    "worker_is_its_pauses": ("slow worker is its GC pauses", "METHOD's M_W named a worker no test decided, and its collector's pauses alone take out M_W's share of the straggling time: the collector is the cause, not its machine"),
    "stage_idealised_explained": ("heavier partition: share its stage explains", "share of the straggling time removed with the heavier partition's stage's compute at ideal speed (METHOD's idealisation of its worker), whatever evening the layers saves"),
    "stage_fix_explained": ("stage rebalancing: share explained", "share removed when every chunk's compute is the mean chunk's"),
    "last_stage_uniformity": ("last-stage row uniformity", "min/max of S_w - 1 over the last stage (1: the whole row is hot)"),
    "communication_fix_explained": ("ideal communication: share explained", "share removed with every transfer at its own typical time over steps and DP ranks"),
    "sequence_even_explained": ("even microbatches: share explained", "share removed when every microbatch of a step carries the same work: its recorded workload at the step's mean (cost model), else the step's compute spread evenly (an upper bound)"),
    "sequence_fix_explained": ("document repacking: share explained", "share removed by the microbatch fix (repacking when lengths are recorded)"),
    "imbalance_degree": ("microbatch imbalance degree", "max / mean microbatch workload (sum of squared lengths) per step"),
    "imbalance_degree_rebalanced": ("imbalance degree after repacking", "the same after greedy document repacking"),
    "workload_forward_r": ("workload/forward correlation", "Pearson r of a microbatch's workload and its forward time"),
    "gc_fix_explained": ("planned GC: share explained", "share removed when pauses are paid by all workers at once"),
    "explained_given_others": ("share explained after the other fixes", "per cause: the share of the remaining straggling time its fix removes once every other cause is fixed"),
    "joint_fix_explained": ("all fixes together: share explained", "share removed when every listed cause is fixed"),
    "worker_set_is_last_stage": ("top workers are the last stage", "one DP rank: the M_W set is the last stage itself"),
}


def evidence_label(key: str) -> tuple[str, str]:
    """(label, meaning) of an evidence key; unknown keys keep their name and have no meaning."""
    return EVIDENCE_LABELS.get(key, (key.replace("_", " "), ""))
