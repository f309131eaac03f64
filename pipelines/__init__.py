"""strag's entry points (the `strag` CLI, the Beam pipelines, the Dagster assets' jobs).

Importing the package sets two process settings numpy reads when it loads, unless the user set
them: every entry point comes through here first (`pipelines.cli`, `pipelines.batch`, ...), and
Beam's worker processes inherit them.
- OPENBLAS_NUM_THREADS=1: strag's numeric work is sorts, gathers and elementwise passes (no large
  matrix products), and its parallelism is worker processes, which a BLAS pool per process would
  oversubscribe. OpenBLAS also starts its pool at import: ~50 ms of every command on 2 cores.
- NUMPY_MADVISE_HUGEPAGE=0 where the kernel compacts memory synchronously for a region that asks
  for transparent huge pages (`_hugepages_stall`): numpy asks for them on every array >= 4 MiB,
  and each fresh large array then pays a compaction on first touch, not just its page faults.
"""
from __future__ import annotations

import os

__all__: list[str] = []


def _hugepages_stall() -> bool:
    """Whether THP defrag is `always`, `madvise` or `defer+madvise`: a page fault in a region numpy
    madvised then waits for the kernel to compact memory into a huge page. Measured here: the first
    touch of a fresh 31 MB [op, lane] array ~5x slower, 0.3-0.6 s of the 8,192-GPU job
    (benchmarks/bench_whatif.py); the engine reads each array once or twice, so huge pages' fewer
    TLB misses never pay that back."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/defrag") as setting:
            chosen = setting.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return False
    return chosen in ("always", "madvise", "defer+madvise")


os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if "NUMPY_MADVISE_HUGEPAGE" not in os.environ and _hugepages_stall():
    os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"
