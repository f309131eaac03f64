"""Pass 2: the ranks of one job -> `ConvertedJob` (checks, kept steps, layout, op rows, clocks, manifest); `convert_kineto` runs both passes."""
from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from transforms.ingest.common import ConvertedJob, RawInputError, build_manifest, build_trace
from transforms.whatif.model import MIN_STEPS
from transforms.ingest.kineto.clocks import _clock_offsets
from transforms.ingest.kineto.cycles import join_cycles, split_cycles
from transforms.ingest.kineto.layout import _dp_groups, _layout, _resolve_local_peers
from transforms.ingest.kineto.ops import _ops_of_rank, _pipeline_end_noops, unwaited
from transforms.ingest.kineto.pace import op_paces
from transforms.ingest.kineto.pairing import (_check_comm_pairs, _clip_p2p_waits, _collectives_after_compute,
                                              _overlapped_dp_marker, _recv_waits_after_compute, _seq_gaps,
                                              _serialise_chains)
from transforms.ingest.kineto.rank import _NO_INFO, parse_rank_bytes
from transforms.ingest.kineto.spans import BWD, COLL, FWD, OPT, RankTrace, _CODE, _KIND_NAMES, longest_idle
from transforms.intervals import covered

_COMPUTE_CODES = [_CODE[name] for name in ("forward-compute", "backward-compute", "backward-weight-compute")]


def _paces(rows: dict, by_rank: dict, shift: dict[int, float]) -> dict[int, np.ndarray]:
    """pace.op_paces of every rank's rows (their times back on the rank's own span axis, where its
    recorded operations are: `shift` µs per rank apart); {} when no rank recorded any."""
    on_own_axis = {rank: {"optype": r["optype"], "gmc": r["gmc"], "start": r["start"] - shift[rank],
                          "end": r["end"] - shift[rank]} for rank, r in rows.items()}
    return op_paces(on_own_axis, {rank: by_rank[rank].recorded for rank in rows}, _COMPUTE_CODES[0],
                    tuple(_COMPUTE_CODES[1:]))


def _step_structure(trace: RankTrace, steps: np.ndarray) -> dict[int, tuple]:
    """Per step: counts of spans by kind (the step's op structure as far as kinds go)."""
    out = {}
    for step in steps.tolist():
        kinds = trace.kind[trace.step == step]
        out[step] = tuple(np.bincount(kinds, minlength=len(_KIND_NAMES)).tolist())
    return out


def _kept_steps(ranks: Sequence[RankTrace], job_id: str) -> tuple[np.ndarray, list[int], dict[int, str]]:
    """Steps every analysed rank has complete (optimizer, forward and backward spans, the same
    structure as the rank's other steps, every collective Seq its group's members ran); returns
    (kept, dropped, why: step -> reason, for the steps dropped for a lost collective)."""
    common = None
    union: set[int] = set()
    for trace in ranks:
        present = set(trace.steps.tolist())
        union |= present
        common = present if common is None else common & present
    if not common:
        spans = {t.rank: f"{t.steps.min()}..{t.steps.max()}" for t in ranks[:4]}
        raise RawInputError("raw_steps_misaligned", f"no ProfilerStep is common to all ranks (steps per rank: {spans}"
                            f"{' ...' if len(ranks) > 4 else ''})", job_id=job_id)
    candidates = np.array(sorted(common), dtype=np.int64)
    for trace in ranks:
        in_common = np.isin(trace.step, candidates)
        for kind in (FWD, BWD):
            if not ((trace.kind == kind) & in_common).any():
                raise RawInputError("raw_no_microbatches", f"rank {trace.rank} has no {_KIND_NAMES[kind]} compute in "
                                    "its profiled steps: the schedule's labels were not recognised (set forward_label "
                                    "/ backward_label in job.yaml) and its main thread shows no "
                                    + ("forward ops between p2p calls" if kind == FWD else "autograd backward ops"),
                                    job_id=job_id, path=trace.path)
    keep = np.ones(len(candidates), dtype=bool)
    incomplete: dict[int, str] = {}   # step -> what it lacks on the first rank that lacks it
    for trace in ranks:
        structure = _step_structure(trace, candidates)
        counts = collections.Counter(structure.values())
        modal = counts.most_common(1)[0][0]
        for i, step in enumerate(candidates.tolist()):
            kinds = structure[step]
            if kinds != modal or not (kinds[FWD] and kinds[BWD] and kinds[OPT]):
                keep[i] = False
                missing = [_KIND_NAMES[k] for k in (FWD, BWD, OPT) if not kinds[k]]
                incomplete.setdefault(step, f"rank {trace.rank} has no {' or '.join(missing)} in it" if missing else
                                      f"rank {trace.rank} ran other work in it than in its other steps")
    why = _seq_gaps(ranks, candidates)
    keep &= ~np.isin(candidates, list(why))
    kept = candidates[keep]
    dropped = sorted(union - set(kept.tolist()))
    if len(kept) < MIN_STEPS:
        lost = "".join(f"; step {step}: {reason}" for step, reason in sorted({**incomplete, **why}.items()))
        no_optimizer = [step for step, reason in incomplete.items() if "optimizer" in reason]
        if no_optimizer:   # a step is an iteration up to its optimizer step: the profile holds none
            advice = ("no profiled step holds an optimizer step (`Optimizer.step#...`): profile at least one whole "
                      "training iteration, up to and including its optimizer step, or set optimizer_label in job.yaml "
                      "when the optimizer records another range")
        else:
            advice = "profile more active steps (the profiler schedule's `active`)"
        raise RawInputError("raw_no_steps", f"{len(kept)} profiled step(s) complete on every rank (common steps "
                            f"{candidates.tolist()}){lost}; the analysis needs at least {MIN_STEPS}: {advice}",
                            job_id=job_id)
    return kept, dropped, why


def _placement(ranks: Sequence[RankTrace], layout, job_id: str) -> np.ndarray:
    """The pipeline rank (stage) holding each global model chunk, from the schedule labels, which
    name the chunk (`PP:3F0`: chunk 3): chunk g on stage g mod pp in interleaved schedules, on g and
    2 pp - 1 - g in V-shaped ones (ZBV, DualPipeV). Without chunk labels, chunk s is stage s. A
    placement the dependency model cannot represent (a chunk on two pipeline ranks, two chunks of
    one round on one rank, a chunk on no rank) is raw_unsupported_schedule, naming the rank."""
    pp = layout.pp
    held: dict[int, tuple[int, RankTrace]] = {}
    for trace in ranks:
        stage = layout.worker[trace.rank][1]
        chunks = sorted(set(trace.chunk[(trace.chunk >= 0) & ((trace.kind == FWD) | (trace.kind == BWD))].tolist()))
        rounds = [g // pp for g in chunks]
        if len(set(rounds)) != len(rounds):
            raise RawInputError("raw_unsupported_schedule", f"rank {trace.rank} (pipeline rank {stage} of {pp}) holds "
                                f"model chunks {chunks}: two of one round of {pp}; the dependency model needs each "
                                "pipeline rank to hold one chunk of chunks 0..pp-1, one of pp..2pp-1, ...",
                                job_id=job_id, path=trace.path)
        for g in chunks:
            other = held.setdefault(g, (stage, trace))
            if other[0] != stage:
                raise RawInputError("raw_unsupported_schedule", f"model chunk {g} runs on pipeline rank {stage} "
                                    f"(rank {trace.rank}) and on pipeline rank {other[0]} (rank {other[1].rank})",
                                    job_id=job_id, path=trace.path)
    if not held:
        return np.arange(pp)
    n = (max(held) // pp + 1) * pp
    placement = np.full(n, -1, dtype=np.int64)
    for g, (stage, _) in held.items():
        placement[g] = stage
    if (placement < 0).any():
        missing = np.flatnonzero(placement < 0).tolist()
        raise RawInputError("raw_unsupported_schedule", f"model chunk(s) {missing} of {n} run on no pipeline rank: "
                            "the labels name chunks the ranks present do not hold", job_id=job_id)
    return placement


# Ranks of one job ran at the same time: on one host (one clock) within a profiled window of each
# other (at least a second: the drift of a pipeline); across hosts within an hour, far beyond what
# unsynchronised host clocks differ by (NTP keeps them within milliseconds, a clock left alone drifts
# seconds a day), so two windows farther apart than that are two runs, not a skewed clock.
_SAME_HOST_SLACK_US = 1e6
_OTHER_HOST_SLACK_US = 3600e6
# A GPU rank whose kernels mostly lack their CUDA launch cannot have its compute timed on the GPU.
_UNLINKED_SHARE_MAX = 0.5


def _when(instant_us: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(instant_us / 1e6, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") + " UTC"


def _apart(seconds: float) -> str:
    """A duration for people: seconds, hours or days."""
    seconds = abs(seconds)
    if seconds < 2 * 3600:
        return f"{seconds:.0f} s"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def _window(trace: RankTrace) -> tuple[float, float] | None:
    """(start, end) of the rank's profiled steps on its recorded clock, µs since the epoch; None when
    the recorded clock is no date (a trace without baseTimeNanoseconds on a boot-relative clock)."""
    start = trace.origin_ns / 1e3 + float(trace.step_start.min())
    if not 946684800e6 <= start <= 4102444800e6:   # 2000-01-01 .. 2100-01-01
        return None
    return start, trace.origin_ns / 1e3 + float(trace.step_end.max())


def _odd_value(ranks: Sequence[RankTrace], value_of, what: str, job_id: str) -> None:
    """raw_mixed_jobs when `value_of(trace)` (None: not recorded) differs between ranks: names the rank
    of the rarest value and the others' values. What every rank of one job shares: world size, default
    backend, NCCL version (NCCL refuses to join ranks of different versions)."""
    values = [value_of(t) for t in ranks]   # by file: two files may claim one rank
    counts = collections.Counter(v for v in values if v is not None)
    if len(counts) < 2:
        return
    value, odd = min(((v, t) for v, t in zip(values, ranks) if v is not None), key=lambda vt: (counts[vt[0]], vt[1].path))
    others = " and ".join(f"{v} ({n} file{'s' if n > 1 else ''})" for v, n in sorted(counts.items(), key=str) if v != value)
    jobs = "two jobs" if len(counts) == 2 else f"{len(counts)} jobs"
    raise RawInputError("raw_mixed_jobs", f"ranks of {jobs}: rank {odd.rank} here is of {what} {value}, the "
                        f"other rank files of {what} {others}; give each job's traces a folder of their own",
                        job_id=job_id, path=odd.path)


def _check_times(ranks: Sequence[RankTrace], job_id: str) -> None:
    """raw_mixed_jobs when a rank profiled its steps away from every other rank: beyond a profiled
    window on its own host (one clock), beyond an hour on other hosts (see _OTHER_HOST_SLACK_US)."""
    by_clock: dict[str, list[RankTrace]] = collections.defaultdict(list)
    for trace in ranks:
        if trace.host:
            by_clock[trace.clock].append(trace)
    for members in by_clock.values():
        if len(members) < 2:
            continue
        spans = {t.rank: (t.origin_ns / 1e3 + t.step_start.min(), t.origin_ns / 1e3 + t.step_end.max()) for t in members}
        for trace in members:
            start, end = spans[trace.rank]
            others = [span for rank, span in spans.items() if rank != trace.rank]
            slack = max(end - start, _SAME_HOST_SLACK_US)   # µs: a whole profiled window of drift
            if not any(o_start - slack <= end and start <= o_end + slack for o_start, o_end in others):
                raise RawInputError("raw_mixed_jobs", f"rank {trace.rank} profiled its steps at {_when(start)} on host "
                                    f"{trace.host}, away from the other ranks of that host: a trace of another run",
                                    job_id=job_id, path=trace.path)
    windows = sorted(((w, t) for t in ranks if (w := _window(t)) is not None), key=lambda item: (item[0], item[1].rank))
    # runs: ranks whose windows chain within the slack; two runs in one folder are two jobs
    runs: list[list[tuple[tuple[float, float], RankTrace]]] = []
    reach = -np.inf
    for window, trace in windows:
        if window[0] > reach + _OTHER_HOST_SLACK_US:
            runs.append([])
        runs[-1].append((window, trace))
        reach = max(reach, window[1])
    if len(runs) < 2:
        return
    # the odd run is the smallest (of equal ones, the later); its rank nearest to another run is named
    position = min(range(len(runs)), key=lambda i: (len(runs[i]), -i))
    odd = runs[position]
    near = runs[position - 1] if position else runs[1]
    (start, _), trace = odd[0] if position else odd[-1]
    (other_start, _), other = near[-1] if position else near[0]
    devices = (f"; it ran on {trace.device}, rank {other.rank} on {other.device}" if trace.device != other.device else "")
    raise RawInputError("raw_mixed_jobs", f"rank {trace.rank} profiled its steps at {_when(start)}, "
                        f"{_apart((start - other_start) / 1e6)} {'after' if start > other_start else 'before'} the "
                        f"nearest other rank (rank {other.rank}, at {_when(other_start)}){devices}: ranks of one job run "
                        f"together, so {len(odd)} rank file(s) here are of another run; give each run's traces a folder "
                        "of their own", job_id=job_id, path=trace.path)


def _check_devices(ranks: Sequence[RankTrace], job_id: str) -> None:
    """A GPU job's ranks must all show their GPU work, each launched by a CUDA call in the trace.

    raw_cpu_only_rank: a rank without any kernel among ranks with kernels (profiled without
    ProfilerActivity.CUDA): its compute and collectives would be CPU time beside the others' GPU time.
    raw_unlinked_kernels: a rank most of whose GPU work has no CUDA launch of its `correlation`
    (runtime events dropped or filtered out): which compute range launched it cannot be told, so
    its compute would silently be CPU time. A few such items are counted in source (assemble)."""
    gpu = [t for t in ranks if t.device != "cpu"]
    cpu = [t for t in ranks if t.device == "cpu"]
    if gpu and cpu:
        first = min(cpu, key=lambda t: t.rank)
        shown = ", ".join(str(t.rank) for t in sorted(cpu, key=lambda t: t.rank)[:8]) + (" ..." if len(cpu) > 8 else "")
        raise RawInputError("raw_cpu_only_rank", f"rank {first.rank} recorded no GPU kernel, while {len(gpu)} other rank(s) "
                            f"of the job ran theirs on {gpu[0].device} ({len(cpu)} rank(s) without kernels: {shown}): "
                            "profiled without ProfilerActivity.CUDA, its compute and collectives cannot be timed like the "
                            "others'; profile every rank with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]",
                            job_id=job_id, path=first.path)
    for trace in sorted(gpu, key=lambda t: t.rank):
        if trace.gpu_work and trace.gpu_work_unlinked > _UNLINKED_SHARE_MAX * trace.gpu_work:
            raise RawInputError("raw_unlinked_kernels", f"rank {trace.rank}: {trace.gpu_work_unlinked} of its "
                                f"{trace.gpu_work} GPU kernels, copies and memsets "
                                f"({100.0 * trace.gpu_work_unlinked / trace.gpu_work:.0f}%) have no CUDA launch in the "
                                "file (no cuda_runtime / cuda_driver event with their args.correlation): which compute "
                                "range launched them cannot be told, so its compute cannot be timed on the GPU; export "
                                "the trace whole (runtime events dropped or filtered out?)", job_id=job_id, path=trace.path)


def _check_job(ranks: Sequence[RankTrace], job_id: str) -> int:
    """Ranks of another job (backend, NCCL version, process groups, when they ran; `assemble` checked
    the world sizes before splitting the cycles), duplicate ranks, GPU ranks without their GPU work
    (_check_devices); returns the world size."""
    seen: dict[int, str] = {}
    for trace in ranks:
        if trace.rank in seen:
            raise RawInputError("raw_duplicate_rank", f"rank {trace.rank} appears in {seen[trace.rank]} and {trace.path}",
                                job_id=job_id, path=trace.path)
        seen[trace.rank] = trace.path
    world = ranks[0].world
    for trace in ranks:
        if not 0 <= trace.rank < world:
            raise RawInputError("raw_mixed_jobs", f"rank {trace.rank} outside world size {world}", job_id=job_id, path=trace.path)
    _odd_value(ranks, lambda t: t.backend or None, "backend", job_id)
    _odd_value(ranks, lambda t: t.versions.get("nccl_version"), "NCCL version", job_id)
    _check_times(ranks, job_id)
    # c10d names a group alike on every rank (a creation counter, or a hash of its ranks)
    defined: dict[str, tuple[int, ...]] = {}
    for trace in ranks:
        for group in trace.groups.values():
            if defined.setdefault(group.name, group.ranks) != group.ranks:
                raise RawInputError("raw_mixed_jobs", f"process group {group.name!r} has ranks {group.ranks} here but "
                                    f"{defined[group.name]} in another file", job_id=job_id, path=trace.path)
    _check_devices(ranks, job_id)
    return world


def assemble(ranks: Sequence[RankTrace], job_id: str, date: str, options: Mapping[str, Any] | None = None,
             files: int | None = None) -> ConvertedJob:
    """The parsed ranks of one job -> ConvertedJob (op rows, manifest, source). RawInputError on bad input.
    Several files of one rank with other steps are profiler cycles (cycles.py): each is assembled
    on its own, then joined."""
    options = options or {}
    if not ranks:
        raise RawInputError("raw_missing_rank", f"no readable rank trace in the window ({files or 0} file(s))", job_id=job_id)
    # world sizes first: two files of one rank number but of different world sizes are ranks of two jobs
    _odd_value(ranks, lambda t: t.world, "world size", job_id)
    cycles = split_cycles(ranks, job_id)
    if len(cycles) == 1:
        return _assemble_cycle(ranks, job_id, date, options, files)
    converted, left_out = [], {}
    for cycle in cycles:
        try:
            converted.append(_assemble_cycle(cycle, job_id, date, options, len(cycle)))
        except RawInputError as error:
            # a cycle some rank's file lacks (not uploaded yet, set aside as unreadable): its steps
            # are dropped with the reason, the complete cycles analysed; nothing complete: refused
            if error.reason_code != "raw_missing_rank":
                raise
            left_out[error] = sorted({int(step) for trace in cycle for step in trace.steps.tolist()})
    if not converted:
        raise next(iter(left_out))
    joined = join_cycles(converted, job_id)
    for error, steps in left_out.items():
        joined.source["steps_dropped"] = sorted([*joined.source["steps_dropped"], *steps])
        joined.source["steps_dropped_why"].update({str(step): f"profiler cycle incomplete: {error.message}" for step in steps})
    return joined


def _assemble_cycle(ranks: Sequence[RankTrace], job_id: str, date: str, options: Mapping[str, Any],
                    files: int | None) -> ConvertedJob:
    """`assemble` of one profiler cycle (every rank at most once)."""
    world = _check_job(ranks, job_id)
    layout = _layout(ranks, world, options, job_id)
    by_rank = {t.rank: t for t in ranks}
    missing = sorted(set(layout.worker) - set(by_rank))
    if len(layout.worker) < layout.dp * layout.pp:
        # the groups of the traces present do not place every worker: the absent ranks would
        missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise RawInputError("raw_missing_rank", f"{len(missing)} rank(s) the analysis needs have no trace: ranks {shown} "
                            f"(dp {layout.dp} x pp {layout.pp} workers, layout from {layout.how}); found "
                            f"{len(by_rank)} readable rank file(s) of world size {world}", job_id=job_id)
    analysed = [by_rank[rank] for rank in sorted(layout.worker)]
    waited = [t.waited is not None for t in analysed]
    if any(waited) and not all(waited):   # how the framework syncs is the job's: waited out on every rank or none
        analysed = [unwaited(t) for t in analysed]
        by_rank.update((t.rank, t) for t in analysed)
    placement = _placement(analysed, layout, job_id)
    for trace in analysed:
        _resolve_local_peers(trace, layout)
    steps, dropped, dropped_why = _kept_steps(analysed, job_id)
    described = any(g.syncs_grads() for t in ranks for g in t.groups.values())
    unmapped: collections.Counter = collections.Counter()
    for trace in ranks:
        unmapped.update(trace.unmapped)
    # GPU work whose CUDA launch the file lacks belongs to no compute range: a few are counted (most: refused)
    unlinked = {str(t.rank): t.gpu_work_unlinked for t in sorted(ranks, key=lambda t: t.rank) if t.gpu_work_unlinked}
    if unlinked:
        unmapped["GPU work without its CUDA launch (correlation)"] += sum(unlinked.values())
    rows = {t.rank: _ops_of_rank(t, layout.worker[t.rank][1], layout, steps, _dp_groups(t, layout, described), job_id,
                                 unmapped, placement) for t in analysed}
    _check_comm_pairs(rows, layout, job_id)
    first_origin = min(by_rank[rank].origin_ns for rank in rows)
    # every rank on the recorded clock, µs after the earliest origin: its spans, steps and recorded times
    shift = {rank: (by_rank[rank].origin_ns - first_origin) / 1000.0 for rank in rows}
    for rank, r in rows.items():
        r["start"], r["end"] = r["start"] + shift[rank], r["end"] + shift[rank]
    collapsed = len(ranks) - len(analysed)
    clock = options.get("clock", "auto")
    clock_of = {rank: (by_rank[rank].clock if clock == "auto" else f"rank:{rank}") for rank in rows}
    offsets = {rank: 0.0 for rank in rows} if clock == "trust" else _clock_offsets(rows, layout, clock_of)
    p2p_posted_early = _recv_waits_after_compute(rows, host_thread=all(t.device == "cpu" for t in analysed))
    step_starts = {rank: dict(zip(by_rank[rank].steps.tolist(), (by_rank[rank].step_start + shift[rank]).tolist()))
                   for rank in rows}
    p2p_clipped = _clip_p2p_waits(rows, layout, offsets, step_starts)
    dp_overlapped = _collectives_after_compute(rows)
    chains_serialised = _serialise_chains(rows)
    overlap_markers = _overlapped_dp_marker(rows) if dp_overlapped else 0
    vpp = max(int(r["mc"].max()) + 1 if len(r["mc"]) else 1 for r in rows.values())
    if vpp > 1:
        rows = {rank: _pipeline_end_noops(r, layout.worker[rank][1], placement) for rank, r in rows.items()}
    paces = _paces(rows, by_rank, shift) if layout.pp > 1 or vpp > 1 else {}
    base = min(float(r["start"].min() - offsets[rank]) for rank, r in rows.items() if len(r["start"]))
    columns: dict[str, list] = collections.defaultdict(list)
    for rank, r in rows.items():
        dp, stage = layout.worker[rank]
        n = len(r["step"])
        start = (r["start"] - offsets[rank] - base) * 1e-6
        columns["dp_rank"].append(np.full(n, dp))
        columns["stage"].append(np.full(n, stage))
        columns["rank"].append(np.full(n, rank))
        columns["step"].append(r["step"])
        columns["optype"].append(r["optype"])
        columns["start_ts"].append(start)
        columns["duration"].append(np.maximum(r["end"] - r["start"], 0.0) * 1e-6)
        columns["mb_id"].append(r["mb_id"])
        columns["mc"].append(r["mc"])
        columns["gmc"].append(r["gmc"])
        columns["n_ops"].append(r["n_ops"])
        if paces:
            columns["pace"].append(paces[rank])
        columns["seq_lens"].append(r["seq_lens"])
        loading = by_rank[rank].data_loading
        if loading is not None:
            columns["data_wait"].append(_data_waits(r["start"], r["end"], loading + shift[rank]) * 1e-6)
        else:
            columns["data_wait"].append(np.zeros(n))
        collected = by_rank[rank].gc_pauses
        if collected is not None and len(collected):
            columns["gc_wait"].append(_data_waits(r["start"], r["end"], collected + shift[rank]) * 1e-6)
            columns["gc_within"].append(covered(r["start"], r["end"], *(collected + shift[rank]).T) * 1e-6)
        else:
            columns["gc_wait"].append(np.zeros(n))
            columns["gc_within"].append(np.zeros(n))
        busy = by_rank[rank].main_busy
        compute = np.isin(r["optype"], _COMPUTE_CODES)
        idle = np.zeros(n)
        if busy is not None and compute.any():
            idle[compute] = longest_idle(r["start"][compute], r["end"][compute], busy + shift[rank]) * 1e-6
        columns["idle_within"].append(idle)
        ids = by_rank[rank].steps   # sorted; where the rank entered and left each step, on the job's clock
        position = np.searchsorted(ids, r["step"])
        entered = by_rank[rank].step_start[position] + shift[rank]
        columns["step_entered"].append((entered - offsets[rank] - base) * 1e-6)
        columns["step_left"].append((by_rank[rank].step_end[position] + shift[rank] - offsets[rank] - base) * 1e-6)
        columns["gc_tail"].append(_tail_collections(r, position, by_rank[rank], shift[rank])[position])
    if not any(t.data_loading is not None for t in analysed):
        del columns["data_wait"]
    if not all(by_rank[rank].gc_pauses is not None for rank in rows):   # the record says "none ran" only where kept
        del columns["gc_wait"], columns["gc_within"], columns["gc_tail"]
    if not all(by_rank[rank].main_busy is not None for rank in rows):   # CPU ranks: their threads ran the compute
        del columns["idle_within"], columns["step_entered"], columns["step_left"]
        columns.pop("gc_tail", None)
    if not any(t.seq_lens is not None for t in analysed):
        del columns["seq_lens"]
    hosts = options.get("hosts")
    if isinstance(hosts, list) and len(hosts) >= world:
        host_of = {rank: str(hosts[rank]) for rank in rows}
    elif all(by_rank[rank].host for rank in rows):   # torch >= 2.13 writes the host's name
        host_of = {rank: str(by_rank[rank].host) for rank in rows}
    else:
        host_of = {}
    if host_of:
        columns["host"] = [np.full(len(rows[rank]["step"]), host_of[rank], dtype=object) for rank in rows]
    load = _host_load(by_rank, list(rows), host_of)
    if load is not None:
        columns["host_load"] = [np.full(len(rows[rank]["step"]), load[rank]) for rank in rows]
    trace = build_trace(job_id, **{name: np.concatenate(parts) for name, parts in columns.items()})
    vpp = int(trace.column("mc").to_numpy().max()) + 1 if trace.num_rows else 1
    if "vpp_size" in options and int(options["vpp_size"]) != vpp:
        raise RawInputError("raw_layout_unknown", f"job.yaml vpp_size {options['vpp_size']} but the labels show {vpp} "
                            "model chunk(s) per stage", job_id=job_id)
    first = analysed[0]
    manifest = build_manifest(
        job_id, date, trace, dp_size=layout.dp, pp_size=layout.pp, tp_size=layout.tp, cp_size=layout.cp, vpp_size=vpp,
        world_size=world, worker_rank=layout.rank_of(),
        worker_host={cell: host_of[rank] for cell, rank in layout.rank_of().items()} if host_of else None,
        start_time=_start_time(options) or _recorded_start(first_origin, base), model_family=str(options.get("model_family", "unknown")),
        context_length=int(options.get("context_length", 0)), gpu_hours_scale=float(options.get("gpu_hours_scale", 1.0)),
    )
    source = {
        "format": "kineto",
        "profiler": "torch.profiler (Kineto)",
        "version": {k: v for k, v in first.versions.items() if v is not None},
        "device": first.device,
        "backend": first.backend,
        "ranks": len(ranks),
        "world_size": world,
        "files": files if files is not None else len(ranks),
        "analysed_ranks": len(analysed),
        "tp_cp_collapsed": collapsed,
        "layout": layout.how,
        "steps": steps.tolist(),
        **({"steps_from": "Optimizer.step spans (no ProfilerStep)"} if any(t.steps_inferred for t in analysed) else {}),
        "steps_dropped": dropped,
        "steps_dropped_why": {str(step): reason for step, reason in sorted(dropped_why.items())},
        "clock": clock,
        "clocks": len(set(clock_of.values())) if clock != "trust" else 1,
        "clock_offset_max_s": max(abs(v) for v in offsets.values()) * 1e-6 if offsets else 0.0,
        "clock_offsets_s": {key: offsets[rank] * 1e-6 for rank, key in sorted(clock_of.items()) if offsets[rank]},
        "p2p_waits_clipped": p2p_clipped,
        "chain_waits_cut": chains_serialised,
        "collectives_issued_during_compute": dp_overlapped,
        "grads_collective": _grads_collective(analysed, layout, described),
        "overlapped_dp_markers": overlap_markers,
        "p2p_recvs_posted_early": p2p_posted_early,
        "unmapped": dict(sorted(unmapped.items())),
    }
    if unlinked:   # rank -> its kernels, copies and memsets left out of compute (no CUDA launch in its file)
        source["gpu_work_unlinked"] = unlinked
    return ConvertedJob(job_id, trace, manifest, source)


def _grads_collective(ranks: Sequence[RankTrace], layout, described: bool) -> str | None:
    """How the gradients were synced over the DP group, for people: "reduce_scatter" (ZeRO / FSDP)
    when a rank reduce-scatters them, else "all_reduce" (DDP) when they were all-reduced, None without
    either. Its op type is grads-reduce-scatter both ways (the reference analyzer's name, ops.py): the
    words shown beside it must say which (schemas.trace.optype_words)."""
    names: set[str] = set()
    for trace in ranks:
        groups = _dp_groups(trace, layout, described)
        names.update(trace.coll[(trace.kind == COLL) & np.isin(trace.group, list(groups))].tolist())
    return "reduce_scatter" if "reduce_scatter" in names else "all_reduce" if "all_reduce" in names else None


def _recorded_start(origin_ns: int, offset_us: float):
    """The wall-clock instant `offset_us` after `origin_ns` (baseTimeNanoseconds + first ts) when it is
    a plausible date (torch writes the epoch there; some traces do not), else None."""
    import datetime as dt

    seconds = origin_ns / 1e9 + offset_us * 1e-6
    if not 946684800 <= seconds <= 4102444800:   # 2000-01-01 .. 2100-01-01
        return None
    return dt.datetime.fromtimestamp(round(seconds, 6), tz=dt.timezone.utc)


def _start_time(options: Mapping[str, Any]):
    import datetime as dt

    value = options.get("start_time")
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    try:
        parsed = dt.datetime.fromisoformat(str(value))
    except ValueError:
        raise RawInputError("raw_bad_job_yaml", f"start_time {value!r} is not an ISO timestamp") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def convert_kineto(paths: Sequence[str], job_id: str, date: str, options: Mapping[str, Any] | None = None,
                   *, workers: int = 1) -> ConvertedJob:
    """Convert one job's per-rank torch.profiler traces (URLs) -> ConvertedJob.

    A file that is not a readable trace (`raw_unreadable`, `raw_not_a_trace`) is set aside in
    `ConvertedJob.rejected` and the job is assembled from the others; when that fails too (a rank
    is then missing), the RawInputError raised carries the set-aside files in `.rejected`.
    workers > 1 parses rank files in that many processes (big jobs on a machine of their own).
    OSError while reading a file propagates (infrastructure); bad content raises RawInputError.
    """
    options = dict(options or {})
    if not paths:
        raise RawInputError("raw_missing_rank", "no trace file (*.json or *.json.gz) in the window", job_id=job_id)
    if workers > 1 and len(paths) > 1:
        import concurrent.futures

        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            parsed = list(pool.map(_parse_path, paths, [options] * len(paths)))
    else:
        parsed = [_parse_path(path, options) for path in paths]
    ranks = [item for item in parsed if isinstance(item, RankTrace)]
    lone = [i for i, item in enumerate(parsed) if isinstance(item, RawInputError) and _NO_INFO in item.message]
    if not ranks and len(lone) == 1:
        # the window's one trace, of a process that started no process group (one GPU, no
        # torch.distributed): a job of one rank; among ranks that have it, a file without it is set aside
        parsed[lone[0]] = _parse_path(paths[lone[0]], {**options, "one_process": True})
        ranks = [item for item in parsed if isinstance(item, RankTrace)]
    rejected = [item.with_job(job_id) for item in parsed if not isinstance(item, RankTrace)]
    try:
        converted = assemble(ranks, job_id, date, options, files=len(paths))
    except RawInputError as error:
        error.rejected = rejected
        raise
    converted.rejected = rejected
    if rejected:
        converted.source["files_rejected"] = {error.path: error.reason_code for error in rejected}
    return converted


def _host_load(by_rank: Mapping[int, Any], ranks: list[int], host_of: Mapping[int, str]) -> dict[int, float] | None:
    """{rank: threads the job runs on its host per core the rank may use} from the collector's host
    records (strag_collect.hostrecord), for the trace's `host_load` column: the host's ranks (the
    launcher's local world size, else the job's ranks that name the same host) times each one's threads
    (torch's intra-op threads on CPU ranks; one, the Python thread that launches the kernels, on GPU
    ranks) over the cores the rank may use. None unless every rank recorded its cores and its host's
    ranks are known."""
    load = {}
    for rank in ranks:
        trace = by_rank[rank]
        local = trace.host_ranks or (sum(1 for other in ranks if host_of.get(other) == host_of[rank]) if host_of else None)
        if trace.host_cpus is None or local is None:
            return None
        threads = (trace.host_threads or 1) if trace.device == "cpu" else 1
        load[rank] = local * threads / trace.host_cpus
    return load


def _tail_collections(r: dict, position: np.ndarray, trace: RankTrace, shift: float) -> np.ndarray:
    """Per step of a rank (its `steps`), seconds of its recorded garbage collections between the end
    of its last op of the step and where it left the step (its ProfilerStep's end): a trainer's
    planned gc.collect() after the optimizer. r: the rank's rows (µs on the job's clock, `shift`
    after the rank's own), position: each row's index into the rank's steps. Zeros without a record."""
    if trace.gc_pauses is None or not len(trace.gc_pauses) or not len(position):
        return np.zeros(len(trace.steps))
    last = np.full(len(trace.steps), -np.inf)
    np.maximum.at(last, position, r["end"])
    left = trace.step_end + shift
    last = np.where(np.isfinite(last), last, left)   # a step without rows: an empty tail
    return covered(np.minimum(last, left), left, *(trace.gc_pauses + shift).T) * 1e-6


def _data_waits(start: np.ndarray, end: np.ndarray, loading: np.ndarray) -> np.ndarray:
    """Per op (one rank's rows, µs), the time of `loading`'s spans ([k, 2]: DataLoader fetches, or the
    collector's recorded garbage collections) inside the idle gap before it: from the latest end of
    the ops that started before it to its start."""
    order = np.argsort(start, kind="stable")
    before = np.concatenate([[-np.inf], np.maximum.accumulate(end[order])[:-1]])
    gap_start, gap_end = np.minimum(before, start[order]), start[order]
    out = np.empty(len(start))
    out[order] = covered(gap_start, gap_end, loading[:, 0], loading[:, 1])
    return out


def _parse_path(path: str, options: Mapping[str, Any]) -> RankTrace | RawInputError:
    """One rank file by URL -> RankTrace, or the file-level RawInputError that sets it aside
    (job-level errors, e.g. a bad job.yaml regex, and OSError propagate)."""
    from transforms.ingest import read_raw_file

    try:
        return parse_rank_bytes(path, read_raw_file(path), options)
    except RawInputError as error:
        if error.level != "file":
            raise
        return error
