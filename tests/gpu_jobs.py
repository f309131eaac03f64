"""Multi-rank GPU jobs with a known answer, built from one real GPU rank (issue 22).

A real torch.profiler rank of a DDP job (`../shared/traces/hta/`) is written out as every rank of a
`world`-rank data-parallel job. A slowed rank is a slower machine: its whole timeline (CPU ops,
kernels, NCCL, idle time) runs `factor` times slower from the first profiled step on. The others
wait for it at each step's gradient all-reduce, so each of their steps starts when the slowed
rank's does: their events shift by the time the slowed rank has lost so far (an event counts
for the step whose CPU span holds the call that launched it: GPU work of a step may run past its
CPU span). Ranks are put on hosts of `per_host` ranks; a host's clock reads `host_offset_us` times
its index later, as unsynchronised host clocks do; the converter must find the offsets.

The others' waits are not written into their traces (their all-reduce kernels end as they did, and
they idle before the next step instead): the step times and each rank's compute are right, the
comm ends the clock alignment fits are not, so a job with a slowed rank is meant for one host.
"""
from __future__ import annotations

import gzip
import json
import pathlib
from collections.abc import Mapping

import numpy as np

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def _owner_times(events: list[dict]) -> np.ndarray:
    """Per event, the time that says which step it belongs to: a GPU op's launch call, else its own ts."""
    launched = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})}
    return np.array([launched.get((e.get("args") or {}).get("correlation"), float(e["ts"]))
                     if e.get("cat") in GPU_WORK else float(e.get("ts", 0.0)) for e in events])


def build_job(source: pathlib.Path, folder: pathlib.Path, world: int, slow: Mapping[int, float] | None = None,
              per_host: int = 2, host_offset_us: float = 0.0) -> list[pathlib.Path]:
    """Write `world` rank traces of the job into `folder` (rank-{r}.json.gz); returns their paths."""
    slow = dict(slow or {})
    if len(set(slow.values())) > 1:
        raise ValueError("the slowed ranks share one factor (the others wait for the slowest)")
    document = json.loads(gzip.decompress(source.read_bytes()))
    events = document["traceEvents"]
    timed = [e for e in events if "ts" in e]
    steps = sorted(float(e["ts"]) for e in timed if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#"))
    origin = steps[0]
    owner = _owner_times(timed)
    step_of = np.searchsorted(np.array(steps), owner, side="right") - 1   # -1: before the first step
    factor = max(slow.values(), default=1.0)
    # what the slowest rank has lost by the start of each step: the others' events of that step shift by it
    lost = np.where(step_of >= 0, (factor - 1.0) * (np.array(steps)[np.maximum(step_of, 0)] - origin), 0.0)
    paths = []
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        f = slow.get(rank, 1.0)
        host = rank // per_host
        skew = host * host_offset_us
        out = []
        for event, t, shift in zip(timed, (float(e["ts"]) for e in timed), lost.tolist()):
            copy = dict(event)
            if f != 1.0:   # the slower machine: its own timeline stretched (it is the one the others wait for)
                copy["ts"] = origin + f * (t - origin) + skew if t >= origin else t + skew
                if "dur" in copy:
                    copy["dur"] = float(copy["dur"]) * (f if t >= origin else 1.0)
            else:
                copy["ts"] = t + (shift if factor > 1.0 else 0.0) + skew
            out.append(copy)
        paths.append(_write_rank(folder, document, out, rank, world, host))
    return paths


def _write_rank(folder: pathlib.Path, document: dict, timed: list[dict], rank: int, world: int, host: int) -> pathlib.Path:
    """Rank `rank` of a `world`-rank data-parallel job: the document with these timed events (its
    untimed ones kept), its distributedInfo and process groups made the job's, on host `host`."""
    info = document.get("distributedInfo") or {}
    rank_info = dict(info, rank=rank, world_size=world)
    if info.get("pg_config"):
        rank_info["pg_config"] = [dict(g, ranks=list(range(world)), pg_size=world) for g in info["pg_config"]]
    events = timed + [e for e in document["traceEvents"] if "ts" not in e]
    path = folder / f"rank-{rank}.json.gz"
    path.write_bytes(gzip.compress(json.dumps(dict(document, traceEvents=events, distributedInfo=rank_info,
                                                   host_name=f"gpu-host-{host}")).encode(), compresslevel=1))
    return path


def build_gc_job(source: pathlib.Path, folder: pathlib.Path, world: int, pauses: Mapping[int, tuple[int, float]],
                 at: float = 0.4, per_host: int = 8) -> list[pathlib.Path]:
    """Write `world` rank traces of a data-parallel job whose ranks stop for Python's garbage collector:
    pauses[step index] = (rank, seconds). The paused rank's CPU thread stops `at` of the way into
    that step (mid-forward, where allocations trigger a collection): every event it launches from
    then on, and the GPU work those launches queue, happens `seconds` later, and the ranges open
    around that moment (the step, the forward) last that much longer. The others wait for it
    at the step's gradient all-reduce, so their next steps start that much later (each step's loss is
    its longest pause); their waits are not written into their traces, as in build_job."""
    document = json.loads(gzip.decompress(source.read_bytes()))
    events = document["traceEvents"]
    timed = [e for e in events if "ts" in e]
    spans = sorted((float(e["ts"]), float(e["dur"])) for e in timed
                   if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#"))
    starts = np.array([s for s, _ in spans])
    owner = _owner_times(timed)
    step_of = np.searchsorted(starts, owner, side="right") - 1
    loss = np.array([pauses.get(k, (None, 0.0))[1] * 1e6 for k in range(len(spans))])
    before = np.concatenate([[0.0], np.cumsum(loss)])[:len(spans)]          # lost by the start of each step
    paths = []
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        out = []
        for event, t, k in zip(timed, owner.tolist(), step_of.tolist()):
            copy = dict(event)
            shift = before[k] if k >= 0 else 0.0
            paused_rank, seconds = pauses.get(k, (None, 0.0))
            if k >= 0 and paused_rank == rank:
                stop = spans[k][0] + at * spans[k][1]
                if t >= stop:
                    shift += seconds * 1e6
                elif float(event["ts"]) + float(event.get("dur", 0.0)) > stop:   # a range around the pause lasts longer
                    copy["dur"] = float(event["dur"]) + seconds * 1e6
            copy["ts"] = float(event["ts"]) + shift
            out.append(copy)
        paths.append(_write_rank(folder, document, out, rank, world, rank // per_host))
    return paths
