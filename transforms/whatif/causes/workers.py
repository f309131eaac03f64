"""The worker detector: is a worker slower than its DP peers beyond the job's own noise?

One statistical test in place of ratio thresholds. Per worker (dp rank, stage), kind of work
(forward, backward) and sample (a profiled step; the step's microbatches when fewer than three
steps were profiled) the effect is

    e = log(the worker's work in the sample) - log(median of its DP peers' same work)

(DP ranks of one stage run the same layers on the same shapes: a heavy stage or a long batch
moves them alike, a slow machine moves one). The null comes from the job itself: the spread of
every comparison's effects around their own mean over the samples (pooled over workers, stages
and both kinds; with two DP ranks the two workers' effects mirror each other and count once) is
the job's jitter, sigma, with its degrees of freedom. Student's t turns each test into a p-value;
Bonferroni over every test of the job holds the false-alarm rate per job at `alpha`.

- persistent: the worker's mean effect over its samples is significant and its median (most
  samples) at least the straggling threshold's ratio (METHOD.md: 1.1; a worker that alone would make a job straggle);
- intermittent (a worker slow in k of n steps, named with those steps, never averaged away), when
  it is not persistent: two tests against the jitter of the job's other comparisons, each at half
  the false-alarm rate (weighted Bonferroni): a single sample beyond both its peers and its own
  other samples (a spike), and a slow level, the split of its samples into k >= 2 slow ones and
  n - k >= 2 usual ones with the largest t, against that largest t's null simulated for the
  job's samples and degrees of freedom (a level over several steps decides where no single
  step can); a persistent finding whose samples split so (the usual level at its peers' pace) is
  named with the slow level's steps, as an intermittent one: half the steps slow is both;
A worker is blamed only where its whole compute (forward + backward) exceeds its peers': DP ranks
wait for each other at the gradient all-reduce, so one that finishes its compute first delays no
one (its slower backward beside a far faster forward is the peer's interference, not a straggler).

- undecided: a median effect above the threshold that the job's noise cannot confirm, on a worker
  whose whole compute is also beyond the threshold in most samples (one that could make the job
  straggle by itself: a 1.2x forward in a compute 1.05x its peers' cannot); the finding says how
  many samples would (`samples_needed`): the job gives "insufficient evidence".

Confidence of a finding: 1 - its Bonferroni-adjusted p-value. Without DP peers a pipeline's
stages are tested by physics instead (`balance_tests`: a stage's balance of backward to forward
against the other stages', and a slow level in some steps against its own other steps).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from typing import Sequence

import numpy as np

from schemas.trace import OPTYPES
from transforms.whatif.causes.signals import counted_pieces, nanmedian, peer_median, pieces_sum
from transforms.whatif.model import WGT, JobModel, distinct, median
from transforms.whatif.result import STRAGGLING_THRESHOLD

__all__ = ["KINDS", "WorkerFinding", "WorkerTests", "worker_tests", "pooled_worker_tests", "balance_tests", "t_sf", "median_variance",
           "reads_offset"]

KINDS = ("forward", "backward")
_FORWARD = OPTYPES.index("forward-compute")
_BACKWARD = (OPTYPES.index("backward-compute"), WGT)
_LARGE_DF = 200          # beyond it t_sf takes the normal approximation (the closed form sums df / 2 terms)


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with integer df >= 1 (closed form, Abramowitz & Stegun 26.7.3-4)."""
    if math.isnan(t):
        return 1.0
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    df = max(int(df), 1)
    if df > _LARGE_DF:   # A&S 26.7.8: t -> normal, error far below the p-values that matter here
        z = t * (1.0 - 1.0 / (4.0 * df)) / math.sqrt(1.0 + t * t / (2.0 * df))
        return 0.5 * math.erfc(z / math.sqrt(2.0))
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:                       # A = 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2.4/3.5 cos^4 ...))
        term = series = math.cos(theta) if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= c2 * (2 * j) / (2 * j + 1)
            series += term
        inside = 2.0 / math.pi * (theta + s * series)
    else:                            # A = sin (1 + 1/2 cos^2 + 1.3/2.4 cos^4 ...)
        term = series = 1.0
        for j in range(1, df // 2):
            term *= c2 * (2 * j - 1) / (2 * j)
            series += term
        inside = s * series
    inside = min(max(inside, 0.0), 1.0)
    return (1.0 - inside) / 2.0 if t >= 0 else (1.0 + inside) / 2.0


def median_variance(n: int) -> float:
    """Variance of the median of n unit-normal samples (1/n for n <= 2; pi / 2n beyond)."""
    return 1.0 / max(n, 1) if n <= 2 else math.pi / (2.0 * n)


@dataclasses.dataclass(frozen=True)
class WorkerFinding:
    """One worker's test in one kind of work. ratio: its work over its peers' (persistent:
    the median over samples; intermittent: the median over the slow steps); steps: the profiled
    steps (indices) where it is slow (undecided: where its samples fall in a slow level above the
    threshold and a usual one below it, else empty); p_value: Bonferroni-adjusted; samples_needed (undecided):
    samples at which the measured effect would be significant at the job's noise."""

    worker: tuple[int, int]
    kind: str
    ratio: float
    steps: tuple[int, ...]
    persistent: bool
    p_value: float
    samples: int
    samples_needed: int | None = None
    # undecided with two levels (`_seen_levels`): the ratio range of the slow samples, then of the usual ones
    levels: tuple[float, float, float, float] | None = None

    @property
    def confidence(self) -> float:
        return 1.0 - self.p_value

    def as_json(self) -> dict:
        return {"dp_rank": self.worker[0], "stage": self.worker[1], "kind": self.kind, "ratio": self.ratio,
                "steps": list(self.steps), "persistent": self.persistent, "p_value": self.p_value,
                "confidence": self.confidence, "samples": self.samples, "samples_needed": self.samples_needed,
                **({"levels": list(self.levels)} if self.levels is not None else {})}


@dataclasses.dataclass(frozen=True)
class WorkerTests:
    """Every test of one job. sigma: the job's jitter of a sample's log effect; df: degrees of
    freedom of that estimate; n_tests: the tests Bonferroni divides alpha among; unit: "step" or
    "microbatch"; slow: decided findings (persistent first, by ratio); undecided: effects above
    the threshold the noise cannot confirm; limits: why the job cannot test at all."""

    alpha: float
    floor: float
    sigma: float
    df: int
    n_tests: int
    unit: str
    slow: tuple[WorkerFinding, ...]
    undecided: tuple[WorkerFinding, ...]
    limits: tuple[str, ...] = ()
    peers: bool = True                   # whether the job has DP peers to test against
    tau: float = 0.0                     # persistent offset (log, RMS) of healthy peers in the null
    tau_prior: float = 0.0               # the prior offset (CauseRules.peer_offset) the job's own reading may replace
    # per [kind, stage, dp]: the mean log effect against the DP peers and its samples (worker_tests;
    # None elsewhere): what `summary` hands to the test over several windows of one job
    levels: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    counts: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    stages: tuple[int, ...] = ()

    @property
    def decided(self) -> bool:
        """Whether every worker with peers could be decided (no effect left within the jitter)."""
        return not self.undecided and (not self.limits or not self.peers)

    def workers(self) -> list[tuple[int, int]]:
        """Workers with a decided finding, the strongest first (persistent before intermittent)."""
        return list(dict.fromkeys(f.worker for f in self.slow))

    def of(self, worker: tuple[int, int]) -> list[WorkerFinding]:
        return [f for f in self.slow if f.worker == worker]

    def summary(self) -> dict | None:
        """What the test of several windows of the job (`pooled_worker_tests`) needs of this one: per
        kind, stage and DP rank the mean log effect against its peers and its samples, the job's
        jitter (variance and degrees of freedom), the healthy offset and the number of tests. None
        where the job had no peer test."""
        if self.levels is None or not self.df:
            return None
        return {"kinds": list(KINDS), "stages": list(self.stages), "dp": int(self.levels.shape[2]),
                "levels": np.where(self.counts > 0, self.levels, 0.0).round(9).tolist(),
                "counts": self.counts.astype(int).tolist(), "sigma2": self.sigma * self.sigma, "df": int(self.df),
                "tau": float(self.tau), "tau_prior": float(self.tau_prior), "tests": int(self.n_tests), "unit": self.unit}

    def evidence(self) -> dict:
        return {"worker_test": {"alpha": self.alpha, "ratio_floor": self.floor, "sigma": self.sigma, "df": self.df,
                                "tau": self.tau, "peers": self.peers,
                                "tests": self.n_tests, "unit": self.unit, "limits": list(self.limits),
                                "slow": [f.as_json() for f in self.slow],
                                "undecided": [f.as_json() for f in self.undecided]}}


def _empty(alpha: float, floor: float, limit: str, peers: bool = True) -> WorkerTests:
    return WorkerTests(alpha, floor, math.nan, 0, 0, "step", (), (), (limit,), peers)


def _samples(model: JobModel, forward: np.ndarray, backward: np.ndarray, cost: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, str, np.ndarray]:
    """[kind, stage, sample, dp] work per sample, each sample's step index, the unit, and the stage
    of each row of the stage axis. Samples are steps (per-step sums over the worker's microbatches
    and chunks) when three or more were profiled, else (step, microbatch) pairs. A forward (backward)
    a collective cuts into pieces counts the pieces `signals.counted_pieces` names."""
    shape = (len(forward), model.n_steps, model.dp_size)                 # lanes are step-major, dp minor
    cost = model.original_cost if cost is None else cost
    work = np.stack([pieces_sum(model, forward, counted_pieces(model, _FORWARD), cost).reshape(shape),
                     pieces_sum(model, backward, counted_pieces(model, _BACKWARD[0]), cost).reshape(shape)])
    stage_of_row = model.op_stage[forward[:, 0]]
    stages = distinct(stage_of_row)
    if model.n_steps >= 3:
        out = np.stack([work[:, stage_of_row == p].sum(axis=1) for p in stages], axis=1)
        return out, np.arange(model.n_steps), "step", stages
    rows = min(int((stage_of_row == p).sum()) for p in stages)
    out = np.stack([work[:, stage_of_row == p][:, :rows].transpose(0, 2, 1, 3).reshape(2, -1, model.dp_size)
                    for p in stages], axis=1)                           # [kind, stage, step * rows, dp]
    return out, np.repeat(np.arange(model.n_steps), rows), "microbatch", stages


def worker_tests(model: JobModel, forward: np.ndarray, backward: np.ndarray, alpha: float = 0.01,
                 floor: float = STRAGGLING_THRESHOLD, offset: float = 0.0, cost: np.ndarray | None = None) -> WorkerTests:
    """Test every worker of a compiled job against its DP peers (module docstring).

    forward/backward: signals.pairs(model); alpha: false-alarm rate per job; floor: the least
    ratio a finding may have (the straggling threshold); offset: the persistent log offset healthy
    DP peers were measured to keep (RMS, CauseRules.peer_offset): the null's `tau` with two DP ranks;
    with three or more, unless the job shows more or bounds its own below it (`_healthy_offset`); cost: the work
    measured per [op, lane] (default the model's; pauses.inside_compute taken out: a collection
    mid-forward is no slower compute)."""
    if model.dp_size < 2:
        return _empty(alpha, floor, "one DP rank per stage: no peers doing the same work to compare a worker with", False)
    if not len(forward):
        return _empty(alpha, floor, "no forward/backward pairs to compare", False)
    work, step_of, unit, stage_ids = _samples(model, forward, backward, cost)
    n = work.shape[2]
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(work)
        effect = logs - peer_median(logs)                                # [kind, stage, sample, dp]
        total = np.log(work.sum(axis=0))
        ahead = np.nanmean(total - peer_median(total), axis=1) > 0      # [stage, dp]: its compute exceeds its peers'
        # [stage, dp]: its whole compute beyond the threshold in most samples, so it alone could make the job straggle
        could_straggle = nanmedian(total - peer_median(total), axis=1) >= math.log(floor)
    effect[~np.isfinite(effect)] = np.nan
    count = np.isfinite(effect).sum(axis=2)                             # [kind, stage, dp]
    level = np.nanmean(np.where(count[:, :, None] > 0, effect, 0.0), axis=2)
    squares = np.nansum((effect - level[:, :, None, :]) ** 2, axis=2)   # [kind, stage, dp]
    # dp = 2: the two workers' effects mirror each other; each comparison counts once
    families = 1 if model.dp_size == 2 else model.dp_size
    ss, dfs = squares[..., :families], np.maximum(count[..., :families] - 1, 0)
    df = int(dfs.sum())
    if n < 2 or df < 1:
        return _empty(alpha, floor, "one profiled step with one microbatch: no spread to tell noise from a slow worker")
    sigma = math.sqrt(float(ss.sum()) / df)
    tau = _healthy_offset(level[..., :families], count[..., :families], sigma, offset, alpha) \
        if reads_offset(model.dp_size, work.shape[1]) else offset
    n_tests = len(KINDS) * work.shape[1] * model.dp_size
    limit = math.log(floor)
    slow, undecided = [], []
    # only a comparison with a sample at the threshold can give a finding (persistent, intermittent
    # or undecided): the others are decided healthy without a test each
    with np.errstate(invalid="ignore"):
        reach = np.where(np.isfinite(effect), effect, -np.inf).max(axis=2) >= limit
    candidates = reach & (count >= 2) & ahead[None, :, :]
    for k, p, d in zip(*np.nonzero(candidates)):
        kind, e, m = KINDS[k], effect[k, p, :, d], int(count[k, p, d])
        ok = np.isfinite(e)
        # t on the mean; "persistent" also needs the median above the threshold (most samples: a
        # worker slow in two steps of eight is intermittent)
        worker, mean, middle = (int(d), int(stage_ids[p])), float(level[k, p, d]), float(median(e[ok]))
        p_level = _level_p(mean, sigma * sigma, m, tau, df, n_tests)
        if middle >= limit and p_level <= alpha:
            levels = _two_levels(effect, ss, dfs, (int(k), int(p), int(d)), families, n_tests, alpha, limit)
            if levels is not None:   # slow in some steps, at its peers' pace in the others: name those steps
                slow.append(WorkerFinding(worker, kind, math.exp(float(median(e[levels]))),
                                          tuple(sorted(set(step_of[levels].tolist()))), False, p_level, m))
                continue
            slow.append(WorkerFinding(worker, kind, math.exp(middle), tuple(sorted(set(step_of[ok & (e >= limit)].tolist()))),
                                      True, p_level, m))
            continue
        found = _intermittent(effect, ss, dfs, (int(k), int(p), int(d)), families, n_tests, alpha, limit)
        if found is not None:
            hit, p_cells = found
            slow.append(WorkerFinding(worker, kind, math.exp(float(median(e[hit]))),
                                      tuple(sorted(set(step_of[hit].tolist()))), False, p_cells, m))
        elif middle >= limit and could_straggle[p, d]:
            seen = _seen_levels(e, limit)
            levels = None
            if seen.any():
                usual = np.isfinite(e) & ~seen
                levels = tuple(math.exp(float(x)) for x in (e[seen].min(), e[seen].max(), e[usual].min(), e[usual].max()))
            undecided.append(WorkerFinding(worker, kind, math.exp(middle), tuple(sorted(set(step_of[seen].tolist()))), True,
                                           p_level, m, _samples_needed(max(mean, limit), sigma, tau, df, alpha / n_tests, m),
                                           levels))
    slow.sort(key=lambda f: (not f.persistent, -f.ratio, f.worker, f.kind))
    undecided.sort(key=lambda f: (-f.ratio, f.worker, f.kind))
    return WorkerTests(alpha, floor, sigma, df, n_tests, unit, tuple(slow), tuple(undecided), tau=tau, tau_prior=offset,
                       levels=level, counts=count, stages=tuple(int(p) for p in stage_ids))


def _level_p(mean: float, sigma2: float, samples: float, tau: float, df: int, tests: int) -> float:
    """Bonferroni-adjusted p-value of a worker's mean log effect over `samples` samples: its null is
    the jitter over those samples (variance `sigma2` per sample, estimated on `df` degrees of
    freedom) plus the offset healthy peers keep (`tau`, known), with Welch-Satterthwaite degrees of
    freedom; `tests` the job's tests."""
    jitter = sigma2 / samples
    se = math.sqrt(jitter + tau * tau)
    df_mean = max(1, int(df * ((jitter + tau * tau) / jitter) ** 2)) if jitter > 0 else 10 ** 6
    return min(1.0, tests * t_sf(mean / se, df_mean)) if se > 0 else float(mean <= 0)


def pooled_worker_tests(summaries: Sequence[dict | None], alpha: float = 0.01,
                        floor: float = STRAGGLING_THRESHOLD) -> list[dict]:
    """The persistent worker test over several windows of one job (the live watcher's profiling
    sessions; `WorkerTests.summary` of each, oldest first): one window of a few steps may leave a
    slow worker within the job's jitter, where its windows together decide. The same test as
    `worker_tests`' persistent one, its samples the windows' samples: a worker's mean log effect
    against its DP peers over all of them, the jitter pooled over the windows' degrees of freedom,
    the healthy peers' offset (with three or more DP ranks read and bounded again from the pooled
    means, as each window does from its own), Bonferroni over the job's tests (kinds x workers) at `alpha`; and slow in most windows (the median of its
    windows' means at least the `floor` ratio, as the persistent test asks of most steps), the
    newest window included (what pages is slow now: a worker repaired stops at once). Only
    windows of the newest one's layout (kinds, stages, DP ranks) count, and only when two or more
    do. A test at `alpha` each time it is run (each new window). Findings, strongest first:
    {dp_rank, stage, kind, ratio, samples, windows, p_value}."""
    latest = summaries[-1] if summaries else None
    if latest is None:
        return []
    layout = (latest["kinds"], latest["stages"], latest["dp"])
    usable = [s for s in summaries if s and (s["kinds"], s["stages"], s["dp"]) == layout and s["df"] > 0]
    if len(usable) < 2 or usable[-1] is not latest:
        return []
    levels = np.array([s["levels"] for s in usable], dtype=np.float64)     # [window, kind, stage, dp]
    counts = np.array([s["counts"] for s in usable], dtype=np.float64)
    samples = counts.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (levels * counts).sum(axis=0) / samples
    df = int(sum(s["df"] for s in usable))
    sigma2 = float(sum(s["sigma2"] * s["df"] for s in usable)) / df
    # the healthy peers' offset read and bounded again from the pooled means (three or more DP
    # ranks: more samples per mean, less jitter in both), against the prior the windows used; two DP
    # ranks: the prior itself
    prior = max(float(s.get("tau_prior", s["tau"])) for s in usable)
    families = 1 if latest["dp"] == 2 else latest["dp"]
    tau = _healthy_offset(mean[..., :families], samples[..., :families], math.sqrt(sigma2), prior, alpha) \
        if reads_offset(latest["dp"], len(latest["stages"])) else prior
    tests = max(int(s["tests"]) for s in usable)
    limit = math.log(floor)
    out = []
    for k, p, d in zip(*np.nonzero((samples >= 2) & (mean >= limit))):
        seen = counts[:, k, p, d] > 0
        if float(median(levels[seen, k, p, d])) < limit or not (seen[-1] and levels[-1, k, p, d] >= limit):
            continue   # slow in some windows only (each window's intermittent test speaks for those), or not now
        p_value = _level_p(float(mean[k, p, d]), sigma2, float(samples[k, p, d]), tau, df, tests)
        if p_value <= alpha:
            out.append({"dp_rank": int(d), "stage": int(latest["stages"][p]), "kind": latest["kinds"][k],
                        "ratio": math.exp(float(mean[k, p, d])), "samples": int(samples[k, p, d]),
                        "windows": int(seen.sum()), "p_value": p_value})
    return sorted(out, key=lambda f: (-f["ratio"], f["dp_rank"], f["stage"], f["kind"]))


def balance_tests(model: JobModel, alpha: float = 0.01, floor: float = STRAGGLING_THRESHOLD,
                  offset: float = 0.0, cost: np.ndarray | None = None) -> WorkerTests:
    """The worker test of a pipeline without DP peers (one DP rank per stage), from physics.

    No peer runs a stage's layers, so a slow machine and a heavier stage look alike in time. What
    tells them apart: more layers scale a chunk's forward and backward alike (each layer's backward
    is its own fixed multiple of its forward), so the balance of a chunk's backward to its forward
    (log of their per-step sums, weight gradients included) matches the other chunks', while a
    worker slow in one kind of work moves it. A stage that leads the pipeline (its compute per step
    at least `floor` times the median other stage's: it sets the pace) is slow in forward
    (backward) when its chunks' balance lies below (above) the other stages' chunks' by at least
    the `floor` ratio, beyond the job's own spread (per-step values, pooled within chunks, plus
    `offset`, the persistent log offset like units keep; two-sided t, Bonferroni over the stages,
    at `alpha`), and that departure accounts for its lead: with the kind at the others' balance its
    compute would be within `floor` of theirs. The finding's ratio is how much slower that kind runs
    than its balance implies. A stage slow in both kinds alike keeps its balance and cannot be told
    from a heavier one: `limits` says so. A stage without a persistent finding is tested for a slow
    level in some steps against its own other steps (`_balance_levels`: intermittent, named steps).
    cost: the work measured per [op, lane] (default the model's; paired.pair_signals takes out the
    collections the trainer recorded inside compute: the collector's time, not the machine's)."""
    limit = "one DP rank per stage: a stage slow in forward and backward alike cannot be told from a heavier one"
    if model.dp_size != 1 or model.pp_size < 2 or model.n_steps < 2:
        return _empty(alpha, floor, "one DP rank per stage: no peers doing the same work to compare a worker with", False)
    forward = model.op_optype == _FORWARD
    backward = np.isin(model.op_optype, _BACKWARD)
    chunks = distinct(model.op_gmc[forward])
    stage_of = np.array([int(model.op_stage[forward & (model.op_gmc == g)][0]) for g in chunks])
    cost = model.original_cost if cost is None else cost   # the work measured (recorded collections taken out)
    f = np.stack([cost[forward & (model.op_gmc == g)].sum(axis=0) for g in chunks])   # [chunk, step]
    b = np.stack([cost[backward & (model.op_gmc == g)].sum(axis=0) for g in chunks])
    stages = distinct(stage_of)
    if len(stages) < 2 or not (f > 0).all() or not (b > 0).all():
        return _empty(alpha, floor, limit, False)
    balance = np.log(b) - np.log(f)
    level = balance.mean(axis=1)
    n = balance.shape[1]
    df = int(balance.shape[0] * (n - 1))
    sigma = math.sqrt(float(((balance - level[:, None]) ** 2).sum()) / df)
    typical = np.array([float(median((f + b)[stage_of == p].sum(axis=0))) for p in stages])
    slow, undecided = [], []
    for index, stage in enumerate(stages.tolist()):
        others = float(median(np.delete(typical, index)))
        mine, rest = stage_of == stage, stage_of != stage
        effect = float(level[mine].mean() - median(level[rest]))
        slow_part = float(median((b if effect > 0 else f)[mine].sum(axis=0)))
        restored = typical[index] - slow_part * (1.0 - math.exp(-abs(effect)))
        if typical[index] < floor * others or abs(effect) < math.log(floor) or restored >= floor * others:
            continue   # not leading, balanced, or its departure does not make its lead
        se = math.sqrt(sigma * sigma * (1.0 / (mine.sum() * n) + 1.0 / (rest.sum() * n)) + 2.0 * offset * offset)
        p_value = min(1.0, 2.0 * len(stages) * t_sf(abs(effect) / se, df)) if se > 0 else 0.0
        finding = WorkerFinding((0, stage), "backward" if effect > 0 else "forward", math.exp(abs(effect)),
                                tuple(range(model.n_steps)) if p_value <= alpha else (), True, p_value, n)
        if p_value <= alpha:
            slow.append(finding)
        else:
            undecided.append(dataclasses.replace(finding, samples_needed=_samples_needed(
                abs(effect), sigma, offset, df, alpha / len(stages), n)))
    found = {f.worker for f in slow}
    for stage in stages.tolist():
        if (0, stage) not in found:
            slow.extend(_balance_levels(stage_of, stage, f, b, len(stages), alpha, floor))
    slow.sort(key=lambda f: (not f.persistent, -f.ratio))
    blamed = {f.worker for f in slow}
    return WorkerTests(alpha, floor, sigma, df, len(stages), "step", tuple(slow),
                       tuple(u for u in undecided if u.worker not in blamed), (limit,), False, offset)


def _balance_levels(stage_of: np.ndarray, stage: int, f: np.ndarray, b: np.ndarray, stages: int,
                    alpha: float, floor: float) -> list[WorkerFinding]:
    """A stage without DP peers slow in some steps only (intermittent): per step and kind of work,
    its time against the other stages' same work in the same step (what slows a whole step, a
    busy host, moves every stage alike and cancels; a heavier partition is heavier in every step
    and cancels in the split), split into a slow level and a usual one by `_level_shift` (its null
    simulated for the steps, its noise the spread within the two levels), forward and backward each
    a test, Bonferroni over the stages (one for two stages: they mirror each other). Blamed when the
    slow level lies the `floor` ratio above the usual one and, in those steps, the stage leads the
    pipeline by `floor` (the slowest stage paces it)."""
    mine, other_stages = stage_of == stage, distinct(stage_of[stage_of != stage])

    def per_stage(work: np.ndarray) -> np.ndarray:   # [other stage, step] sums of its chunks
        return np.stack([work[stage_of == p].sum(axis=0) for p in other_stages])

    compute = (f + b)[mine].sum(axis=0)
    others = np.median(per_stage(f + b), axis=0)
    out = []
    for kind, work in (("forward", f), ("backward", b)):
        e = np.log(work[mine].sum(axis=0)) - np.median(np.log(per_stage(work)), axis=0)
        found = _level_shift(e - float(median(e)), 0.0, 0, 2 * (1 if stages == 2 else stages), alpha, -math.inf)
        if found is None:
            continue
        hit, p_value = found
        shift = float(e[hit].mean() - e[~hit].mean())
        if shift >= math.log(floor) and float(median(compute[hit] / others[hit])) >= floor:
            out.append(WorkerFinding((0, stage), kind, math.exp(shift), tuple(np.flatnonzero(hit).tolist()), False,
                                     p_value, len(e)))
    return sorted(out, key=lambda f: f.p_value)[:1]


def reads_offset(dp: int, stages: int) -> bool:
    """Whether a job reads its healthy peers' offset itself (`_healthy_offset`): where one worker's
    comparisons are at most a third of its independent ones (a median of the rest is then the
    healthy peers'): three or more DP ranks, or two DP ranks (one comparison per stage, the two
    mirroring) over three or more pipeline stages."""
    return dp >= 3 or (dp == 2 and stages >= 3)


def _healthy_offset(level: np.ndarray, count: np.ndarray, sigma: float, prior: float, alpha: float) -> float:
    """tau: the persistent offset (log, RMS) between healthy DP peers, beyond the jitter of their
    means, for a job whose peers can show it (`reads_offset`). The job reads its own robustly (the median squared
    mean over every worker, kind and stage, so a slow worker among three or more does not set it,
    less the jitter's share) and bounds it from above at `alpha`: the median of m squared normal
    means estimates their variance with the spread of a chi-square of 0.3675 m degrees of freedom
    (the sample median's asymptotic variance, 1 / (4 m f(q)^2) at the chi-square(1) median
    q = 0.4549, f(q) = 0.4712, against 2 / nu for a chi-square mean). tau is the prior (`prior`, the
    offset healthy peers were measured to keep on shared CPU cores, CauseRules.peer_offset) unless
    the job shows more (its reading, as before) or bounds its own below it: a job of many quiet peers
    (GPU ranks) measures its slow workers against its own, far smaller offset; a few peers cannot
    bound theirs below the prior. `level` and `count` hold the independent comparisons only (one
    per stage with two DP ranks); the caller asks `reads_offset` first."""
    means = level[count >= 2]
    if means.size < 3:
        return prior
    n = float(median(count[count >= 2]))
    nu = 0.3675 * means.size   # 2 / (1 / (4 f(q)^2) / q^2), q and f(q) as in the docstring
    variance = float(median(means * means)) / 0.4549
    read = math.sqrt(max(variance - sigma * sigma / n, 0.0))
    bound = math.sqrt(max(variance * nu / _chi2_quantile(alpha, nu) - sigma * sigma / n, 0.0))
    return max(read, min(prior, bound))


def _chi2_quantile(p: float, nu: float) -> float:
    """The p-quantile of a chi-square of nu (> 0, not necessarily whole) degrees of freedom
    (Wilson-Hilferty; floored at a tiny positive value where the cube root's base turns negative)."""
    z = statistics.NormalDist().inv_cdf(p)
    base = 1.0 - 2.0 / (9.0 * nu) + z * math.sqrt(2.0 / (9.0 * nu))
    return nu * max(base, 1e-3) ** 3


def _samples_needed(effect: float, sigma: float, tau: float, df: int, tail: float, m: int) -> int | None:
    """Samples at which an effect of this size would be significant; None when no number would: the
    healthy peers' persistent offset alone hides it (more peers, not more steps, decide then)."""
    target = effect / max(_t_for(tail, max(df, 30)), 1e-12)       # the standard error that would do
    room = target * target - tau * tau
    if room <= 0:
        return None
    return max(math.ceil(sigma * sigma / room), m + 1)


def _intermittent(effect: np.ndarray, ss: np.ndarray, dfs: np.ndarray, cell: tuple[int, int, int], families: int,
                  n_tests: int, alpha: float, limit: float) -> tuple[np.ndarray, float] | None:
    """The steps where one worker is slow while it runs at its usual pace in the others: (mask of
    slow samples, adjusted p) or None. Two tests, each at half the job's false-alarm rate (weighted
    Bonferroni): a single spike (`_spike`) and a slow level over two steps or more (`_level_shift`);
    both take the noise of every *other* comparison of the job (its own swings do not widen the
    null it is tested against)."""
    rest_ss, rest_df = _rest_noise(ss, dfs, cell, families)
    if rest_df < 1:
        return None
    k, p, d = cell
    e = effect[k, p, :, d]
    # a spike up of one of two mirrored DP ranks is a distinct event from the other's: every test counts
    found = [f for f in (_spike(e, rest_ss, rest_df, 2 * n_tests, alpha, limit),
                         _level_shift(e, rest_ss, rest_df, 2 * _level_tests(n_tests, families), alpha, limit))
             if f is not None]
    return max(found, key=lambda f: (int(f[0].sum()), -f[1])) if found else None


def _rest_noise(ss: np.ndarray, dfs: np.ndarray, cell: tuple[int, int, int], families: int) -> tuple[float, int]:
    """(sum of squares, degrees of freedom) of every comparison of the job but this cell's: the
    noise a worker's own samples are tested against (its own swings do not widen it)."""
    k, p, d = cell
    own = (k, p, min(d, families - 1))
    return float(ss.sum() - ss[own]), int(dfs.sum() - dfs[own])


def _level_tests(n_tests: int, families: int) -> int:
    """Level tests of a job: two DP ranks mirror each other, the split t of one is the other's, so
    the pair is one level test (the threshold picks its slow side)."""
    return n_tests // 2 if families == 1 else n_tests


def _seen_levels(e: np.ndarray, limit: float) -> np.ndarray:
    """Where an undecided worker's samples fall in two levels, a slow one at least the threshold
    ratio over its peers (median) and a usual one below it, every slow sample at least the threshold
    ratio above every usual one: the slow samples (mask), else none. A description, not a test (the
    split with the largest t on the samples' own spread): the verdict says where the effect lies
    instead of averaging it over every step."""
    ok = np.flatnonzero(np.isfinite(e))
    hit = np.zeros(len(e), dtype=bool)
    if len(ok) < 4:
        return hit
    order = ok[np.argsort(-e[ok], kind="stable")]
    k = int(_split_t(e[order][None, :], np.zeros(1), 0)[1][0])
    if k and float(median(e[order[:k]])) >= limit and float(median(e[order[k:]])) < limit \
            and float(e[order[k - 1]] - e[order[k]]) >= limit:
        hit[order[:k]] = True
    return hit


def _two_levels(effect: np.ndarray, ss: np.ndarray, dfs: np.ndarray, cell: tuple[int, int, int], families: int,
                n_tests: int, alpha: float, limit: float) -> np.ndarray | None:
    """A worker the persistent test blames that runs at two levels: the slow samples (mask) when
    the level test (`_level_shift`, as `_intermittent` runs it) splits its samples into a slow level
    and a usual one, and the usual one is at its peers' pace (median below the threshold); None
    when it is slow throughout. Half the steps slow is both "most" and "some": the steps named
    are the ones the split finds, not the ones a noisy sample happens to lift past the threshold."""
    rest_ss, rest_df = _rest_noise(ss, dfs, cell, families)
    if rest_df < 1:
        return None
    k, p, d = cell
    e = effect[k, p, :, d]
    found = _level_shift(e, rest_ss, rest_df, 2 * _level_tests(n_tests, families), alpha, limit)
    if found is None:
        return None
    usual = np.isfinite(e) & ~found[0]
    return found[0] if usual.any() and float(median(e[usual])) < limit else None


def _spike(e: np.ndarray, rest_ss: float, rest_df: int, tests: int, alpha: float, limit: float
           ) -> tuple[np.ndarray, float] | None:
    """Single samples beyond the worker's peers and its own other samples (`tests` x samples
    hypotheses, Bonferroni)."""
    sigma = math.sqrt(rest_ss / rest_df)
    ok = np.isfinite(e)
    m = int(ok.sum())
    if sigma <= 0 or m < 2:
        return None
    others = peer_median(e[ok])                          # each sample's own other samples' median
    value = np.full(len(e), -np.inf)
    value[ok] = np.fmin(e[ok], e[ok] - others)          # beyond its peers and beyond its own usual
    spread = sigma * math.sqrt(1.0 + median_variance(m - 1))
    # p only where a sample reaches the threshold: no other can be a hit
    p_cells = np.array([min(1.0, tests * len(e) * t_sf(v / spread, rest_df)) if v >= limit and np.isfinite(v) else 1.0
                        for v in value.tolist()])
    hit = (value >= limit) & (p_cells <= alpha)
    return (hit, float(p_cells[hit].max())) if hit.any() else None


def _level_shift(e: np.ndarray, rest_ss: float, rest_df: int, tests: int, alpha: float, limit: float
                 ) -> tuple[np.ndarray, float] | None:
    """A slow level in k of the worker's n samples (2 <= k <= n - 2: each level a mean of two samples
    or more; one slow sample is a spike, all but one is the persistent test's): the split of its
    sorted effects with the largest t of the slow level's mean over the usual level's, the
    variance pooled over both levels and every other comparison. The largest t over every split
    has no closed form; its null is simulated (`_level_shift_null`: normal jitter, the same
    samples and degrees of freedom). Blames when the slow level is at least `limit` over its peers
    (median) and p x `tests` <= alpha."""
    ok = np.flatnonzero(np.isfinite(e))
    m = len(ok)
    if m < 4:
        return None
    order = ok[np.argsort(-e[ok], kind="stable")]
    t, k = _split_t(e[order][None, :], np.array([rest_ss]), rest_df)
    k = int(k[0])
    draws, df = _draws(tests, alpha), _null_df(rest_df)
    if k == 0 or float(median(e[order[:k]])) < limit or tests / (draws + 1) > alpha:
        return None     # no slow level, or one below the threshold, or more tests than simulated jobs resolve
    if alpha / tests < 0.1 and float(t[0]) < _level_shift_null(m, df, _SCREEN)[int(0.9 * _SCREEN)]:
        return None     # below the null's 90th percentile: p > 0.1, beyond alpha / tests
    null = _level_shift_null(m, df, draws)
    p_value = min(1.0, tests * (len(null) - np.searchsorted(null, float(t[0])) + 1) / (len(null) + 1))
    if p_value > alpha:
        return None
    hit = np.zeros(len(e), dtype=bool)
    hit[order[:k]] = True
    return hit, p_value


def _split_t(values: np.ndarray, rest_ss: np.ndarray, rest_df: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of effects sorted high to low ([rows, n]): the largest two-sample t of the top k over
    the rest (2 <= k <= n - 2; variance pooled with `rest_ss` on `rest_df` degrees of freedom) and
    its k (the smallest k of equal t's; 0 and -inf where no split has a t). Every split of a block
    of rows at once, blocks of ~32k values (a simulated null's 50,000 rows stay in cache)."""
    rows, n = values.shape
    best, best_k = np.full(rows, -np.inf), np.zeros(rows, dtype=np.int64)
    if n < 4:
        return best, best_k
    rest_ss = np.broadcast_to(np.asarray(rest_ss, dtype=np.float64), (rows,))
    k = np.arange(2, n - 1, dtype=np.float64)
    block = max(1, 32_768 // (n - 3))
    for lo in range(0, rows, block):
        part = values[lo:lo + block]
        total, squares = np.cumsum(part, axis=1), np.cumsum(part * part, axis=1)
        top, top_sq = total[:, 1:n - 2], squares[:, 1:n - 2]
        rest, rest_sq = total[:, -1:] - top, squares[:, -1:] - top_sq
        within = (top_sq - top * top / k) + (rest_sq - rest * rest / (n - k))
        variance = np.maximum(within + rest_ss[lo:lo + block, None], 0.0) / (n - 2 + rest_df)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (top / k - rest / (n - k)) / np.sqrt(variance * (1.0 / k + 1.0 / (n - k)))
        t[np.isnan(t)] = -np.inf
        first = np.argmax(t, axis=1)                                      # the first of equal largest t's
        best[lo:lo + block] = t[np.arange(len(part)), first]
        best_k[lo:lo + block] = np.where(best[lo:lo + block] > -np.inf, first + 2, 0)
    return best, best_k


_SCREEN = 2_000          # simulated jobs of the first look (is the split t anywhere near significance?)


def _draws(tests: int, alpha: float) -> int:
    """Simulated jobs enough to resolve p = alpha / tests twenty times over (20,000 to 50,000: a job
    with more tests than that resolves leaves intermittent levels to the spike test)."""
    return int(min(50_000, max(20_000, math.ceil(20 * tests / alpha))))


_EXACT_NULL_DF = 32   # up to here the null is simulated at the job's own degrees of freedom


def _null_df(rest_df: int) -> int:
    """The other comparisons' degrees of freedom the null is simulated with: their own up to
    _EXACT_NULL_DF, where each one more narrows the null markedly (a job of few steps, whose power
    is the least, keeps all of it: 5 rounded to 4 widened the 99.75th percentile of a 6-sample null
    from 6.66 to 7.11); beyond, the largest power of two not above them (0 without any): fewer
    degrees of freedom make a slightly wider null (conservative), and jobs share it."""
    if rest_df <= 0:
        return 0
    return int(rest_df) if rest_df <= _EXACT_NULL_DF else 1 << (int(rest_df).bit_length() - 1)


@functools.lru_cache(maxsize=64)
def _level_shift_null(n: int, rest_df: int, draws: int) -> np.ndarray:
    """The largest split t of n normal samples with a variance pooled over rest_df more degrees of
    freedom, over `draws` simulated jobs, sorted. Seeded: one job always gets the same p-value."""
    rng = np.random.default_rng(n * 100_003 + rest_df)
    values = -np.sort(-rng.standard_normal((draws, n)), axis=1)
    return np.sort(_split_t(values, rng.chisquare(rest_df, draws) if rest_df > 0 else np.zeros(draws), rest_df)[0])


def _t_for(tail: float, df: int) -> float:
    """The t value whose upper tail is `tail` (bisection on t_sf)."""
    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_sf(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    return hi
