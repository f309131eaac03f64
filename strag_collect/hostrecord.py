"""How crowded the rank's host is: the cores it may run on and the threads the job asks of them.

The profiler records when ops ran, not whether the rank was running between them. On a host with
more runnable threads than cores, a rank's time between ops (and inside them) includes its wait
for a core: untraced time that is the host's scheduling, not the rank's own work. The trace cannot
tell; the trainer can, at no cost: each exported window carries one top-level key,

    "strag_host": {"cpus": 2, "threads": 1, "local_ranks": 4}

cpus: the cores this process may run on (its CPU affinity: a container's or taskset's limit, not the
machine's count); threads: torch's intra-op threads (None where torch is not loaded); local_ranks: the
job's processes on this host (torchrun's LOCAL_WORLD_SIZE; None where unset). The converter turns it
into the trace's `host_load` column (transforms/ingest/kineto/job.py), and untraced-cpu is never
blamed on a rank of an oversubscribed host (transforms/whatif/causes/untraced.py).
"""
from __future__ import annotations

import os
import sys

__all__ = ["HOST_KEY", "host_record"]

HOST_KEY = "strag_host"


def _positive(value) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def host_record() -> dict[str, int | None]:
    """This process's {"cpus", "threads", "local_ranks"} (see the module docstring); read when each
    window is exported, since a trainer may change its thread count after the collector starts."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux: the machine's count
        cpus = os.cpu_count() or 0
    torch = sys.modules.get("torch")   # never imported here: a trainer that profiles has it loaded
    threads = None
    if torch is not None:
        try:
            threads = _positive(torch.get_num_threads())
        except Exception:   # a torch stand-in without it: the record says unknown
            threads = None
    return {"cpus": _positive(cpus), "threads": threads, "local_ranks": _positive(os.environ.get("LOCAL_WORLD_SIZE"))}
