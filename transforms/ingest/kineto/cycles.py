"""Profiler cycles: several files of one rank, each a cycle of the same profiling session.

torch.profiler's `schedule(wait, warmup, active, repeat)` records a cycle of `active` steps again
and again (repeat=0, the default, until the loop ends), and `on_trace_ready` writes a file per
cycle: `tensorboard_trace_handler` one `<worker>.<ts>.pt.trace.json` each, a script's own handler
whatever names it picks. A window then holds several files per rank, each with other
`ProfilerStep#N` numbers. Steps are independent in the method (METHOD.md section 3), so the cycles
are one job: each is assembled on its own (its ranks, clocks and checks), and their rows and
manifests are joined. Two files of one rank whose steps overlap are a duplicate (an upload made
twice, ranks of two runs), as before.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import pyarrow as pa

from transforms.ingest.common import ConvertedJob, RawInputError
from transforms.ingest.kineto.spans import RankTrace

__all__ = ["split_cycles", "join_cycles"]

# the manifest fields every cycle must agree on (one job, one layout)
_SAME = ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size", "world_size")


def split_cycles(ranks: Sequence[RankTrace], job_id: str) -> list[list[RankTrace]]:
    """The rank traces of a window by profiler cycle, in step order: one list when every rank has
    one file. Files group into a cycle where their step ranges overlap (a cycle's ranks profile the
    same steps); raw_duplicate_rank when one rank has two files in a cycle (their steps overlap)."""
    by_rank: dict[int, list[RankTrace]] = {}
    for trace in ranks:
        by_rank.setdefault(trace.rank, []).append(trace)
    if all(len(traces) == 1 for traces in by_rank.values()):
        return [list(ranks)]
    spans = sorted(((int(t.steps.min()), int(t.steps.max()), i) for i, t in enumerate(ranks) if len(t.steps)),
                   key=lambda span: span[:2])
    cycles: list[list[RankTrace]] = []
    reach = None
    for low, high, i in spans:
        if reach is None or low > reach:
            cycles.append([])
            reach = high
        reach = max(reach, high)
        cycles[-1].append(ranks[i])
    for cycle in cycles:
        seen: dict[int, str] = {}
        for trace in cycle:
            if trace.rank in seen:
                raise RawInputError("raw_duplicate_rank", f"rank {trace.rank} appears in {seen[trace.rank]} and "
                                    f"{trace.path} with overlapping steps ({_steps(cycle, trace.rank)}): the same "
                                    "profiled steps twice, not two profiler cycles", job_id=job_id, path=trace.path)
            seen[trace.rank] = trace.path
    stepless = [t for t in ranks if not len(t.steps)]
    if stepless:   # no step to place it by: its cycle cannot be told (parse_rank refuses these first)
        raise RawInputError("raw_no_steps", f"rank {stepless[0].rank}: no ProfilerStep in a window of several "
                            "profiler cycles", job_id=job_id, path=stepless[0].path)
    return cycles


def _steps(cycle: Sequence[RankTrace], rank: int) -> str:
    return "; ".join(f"{t.path}: steps {int(t.steps.min())}..{int(t.steps.max())}" for t in cycle if t.rank == rank)


def join_cycles(cycles: Sequence[ConvertedJob], job_id: str) -> ConvertedJob:
    """One ConvertedJob of the cycles' (assembled in step order): their rows, each cycle's times after
    the one before (its recorded start when the clocks give one), the first cycle's manifest with
    GPU-hours over every cycle's traced time, and a source that counts every cycle."""
    if len(cycles) == 1:
        return cycles[0]
    first = cycles[0]
    for cycle in cycles[1:]:
        odd = [name for name in _SAME if cycle.manifest[name] != first.manifest[name]]
        if odd or [w["rank"] for w in cycle.manifest["workers"]] != [w["rank"] for w in first.manifest["workers"]]:
            raise RawInputError("raw_mixed_jobs", f"profiler cycles of one window disagree on the layout "
                                f"({', '.join(f'{n} {first.manifest[n]} vs {cycle.manifest[n]}' for n in odd) or 'workers'}): "
                                "files of two jobs?", job_id=job_id)
    tables, shift, traced = [], 0.0, dt.timedelta(0)
    for cycle in cycles:
        table = cycle.trace
        start = table.column("start_ts").to_numpy()
        end = start + table.column("duration").to_numpy()
        if tables:
            recorded = (cycle.manifest["start_time"] - first.manifest["start_time"]).total_seconds()
            shift = max(recorded, shift)
            field = table.schema.field("start_ts")
            table = table.set_column(table.schema.get_field_index("start_ts"), field, pa.array(start + shift, field.type))
        tables.append(table)
        shift += float(end.max() - start.min()) if len(start) else 0.0
        traced += cycle.manifest["end_time"] - cycle.manifest["start_time"]
    manifest = dict(first.manifest)
    manifest["end_time"] = manifest["start_time"] + traced
    manifest["microbatches"] = max(int(c.manifest["microbatches"]) for c in cycles)
    source = dict(first.source)
    source["profiler_cycles"] = len(cycles)
    source["files"] = sum(int(c.source.get("files", 0)) for c in cycles)
    source["steps"] = [step for c in cycles for step in c.source.get("steps", [])]
    source["steps_dropped"] = [step for c in cycles for step in c.source.get("steps_dropped", [])]
    source["steps_dropped_why"] = {k: v for c in cycles for k, v in c.source.get("steps_dropped_why", {}).items()}
    for key in ("p2p_waits_clipped", "chain_waits_cut", "collectives_issued_during_compute", "overlapped_dp_markers",
                "p2p_recvs_posted_early"):
        source[key] = sum(int(c.source.get(key, 0)) for c in cycles)
    unmapped: dict[str, int] = {}
    for cycle in cycles:
        for name, count in cycle.source.get("unmapped", {}).items():
            unmapped[name] = unmapped.get(name, 0) + int(count)
    source["unmapped"] = dict(sorted(unmapped.items()))
    source["clock_offset_max_s"] = max(float(c.source.get("clock_offset_max_s", 0.0)) for c in cycles)
    return ConvertedJob(job_id, pa.concat_tables(tables), manifest, source)
