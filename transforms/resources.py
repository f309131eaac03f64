"""The memory and threads of a process that analyses windows: set once, before it reads any.

Every analysis allocates and frees arrays of the job's op count many times over (the decoded
trace, the compiled graph, each batch of replays, the causes' fix replays). What the allocators
do with freed memory decides whether each new array is page-faulted in afresh, which the kernel
pays for in system time (zeroing pages; on a shared box, at very variable cost):

* Arrow's default pool on Linux, mimalloc, hands freed pages back to the OS within milliseconds,
  so a worker's next window's column buffers fault in again: `use_system_allocator` makes glibc's
  malloc Arrow's pool (unless the user chose one with ARROW_DEFAULT_MEMORY_POOL). Measured on
  benchmarks/bench_batch.py's 30 x 20 fleet, runs alternated with the old pool: reading 65 -> 48
  and validating 67 -> 53 worker-seconds, no phase slower (jemalloc measured as glibc, but is not
  in every pyarrow build).
* glibc's malloc serves blocks above its mmap threshold (dynamic, at most 32 MiB) with fresh
  mappings that it unmaps when freed, and trims the top of its heap beyond twice that:
  `keep_freed_memory` raises both (mallopt) so freed blocks are reused; a process's resident size
  stays at its high-water mark instead of falling back between windows. Off glibc it does nothing.

Threads: the batch pipeline's parallelism is its worker processes, one per core, so Arrow's own
thread pool (as many threads as cores, per process) only oversubscribes them: decoding the trace
files of the fleet's first two dates took 2.6-2.8 CPU-seconds on one thread, 3.1-3.5 on two.
`prepare_batch_worker` gives Arrow one thread. A one-job command (`strag analyze`) and the
watcher, which run alone, keep Arrow's threads; the watcher keeps freed memory too.

Measured together with the reader's savings (transforms/io/lake.py: columns made from the footer,
the host read dictionary-encoded), benchmarks/bench_batch.py's 30 x 20 fleet on the FnApiRunner,
runs alternated with the code before: reading 78 / 55 -> 48 / 44 worker-seconds, wall 139 / 130 ->
128 / 119 s; on a quieter hour of the same box, 46.5 -> 33.7 worker-seconds, wall 102 -> 93 s. The
allocator settings' own share was not isolated. On the one-job command (the 8,192-GPU job of
benchmarks/bench_whatif.py, 10 alternations of each setting, with and without numpy's huge pages)
none beat the box's noise, so `strag analyze` keeps the defaults.
"""
from __future__ import annotations

import ctypes
import os

__all__ = ["use_system_allocator", "keep_freed_memory", "prepare_batch_worker"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3     # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30         # blocks below 1 GiB come from the heap, and are reused once freed
TRIM_THRESHOLD = (1 << 31) - 1   # the largest a C int holds: the heap's top is never handed back


def use_system_allocator() -> None:
    """Make the C library's malloc Arrow's default memory pool in this process, unless the user
    chose one (ARROW_DEFAULT_MEMORY_POOL)."""
    if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks for reuse (see the module docstring); whether it does
    now. False off glibc, and where the user set MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_
    (their choice is kept)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trimmed = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mapped and trimmed)


def prepare_batch_worker() -> None:
    """A batch worker process, one of one per core (the analysis DoFn's set-up): both allocator
    settings, and one Arrow thread."""
    import pyarrow as pa

    use_system_allocator()
    keep_freed_memory()
    pa.set_cpu_count(1)
