"""How crowded the rank's host is: the cores it may run on and the threads the job asks of them.

The profiler records when ops ran, not whether the rank was running between them. On a host with
more runnable threads than cores, a rank's time between ops (and inside them) includes its wait
for a core: untraced time that is the host's scheduling, not the rank's own work. The trace cannot
tell; the trainer can, at no cost: each exported window carries one top-level key,

    "strag_host": {"cpus": 2, "threads": 1, "local_ranks": 4}

cpus: the cores this process may run on (its CPU affinity, taskset's limit, and its container's CPU
quota where cgroup v2 sets one; not the machine's count); threads: torch's intra-op threads (None
where torch is not loaded); local_ranks: the job's processes on this host (torchrun's
LOCAL_WORLD_SIZE, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE; None where neither is set: the converter
then counts the job's ranks that name the same host). The converter turns it into the trace's
`host_load` column (transforms/ingest/kineto/job.py); untraced-cpu is then never blamed on a rank
for untraced time its host's crowding can explain (transforms/whatif/causes/untraced.py).
"""
from __future__ import annotations

import os
import sys

__all__ = ["HOST_KEY", "host_record", "cpu_quota"]

HOST_KEY = "strag_host"
# where launchers say how many of the job's processes run on this host: torchrun, Open MPI
LOCAL_RANKS_ENV = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _positive(value) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


# cgroup v2's CPU quota of this process's container ("max 100000", or "400000 100000": 4 cores)
CPU_MAX = "/sys/fs/cgroup/cpu.max"


def cpu_quota(path: str | None = None) -> int | None:
    """The cores a container's CPU quota allows (rounded up; path: default CPU_MAX), or None where
    there is no quota file, no limit or one this reader does not know."""
    try:
        with open(path or CPU_MAX) as handle:
            quota, period = handle.read().split()[:2]
        return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError, ZeroDivisionError):   # no cgroup v2 file, "max" (no limit), malformed
        return None


def host_record() -> dict[str, int | None]:
    """This process's {"cpus", "threads", "local_ranks"} (see the module docstring); read when each
    window is exported, since a trainer may change its thread count after the collector starts."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux: the machine's count
        cpus = os.cpu_count() or 0
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, quota) if cpus else quota
    torch = sys.modules.get("torch")   # never imported here: a trainer that profiles has it loaded
    threads = None
    if torch is not None:
        try:
            threads = _positive(torch.get_num_threads())
        except Exception:   # a torch stand-in without it: the record says unknown
            threads = None
    local = None
    for name in LOCAL_RANKS_ENV:
        local = _positive(os.environ.get(name))
        if local is not None:
            break
    return {"cpus": _positive(cpus), "threads": threads, "local_ranks": local}
