"""The engine's compiled functions (C, `kernel.c`, loaded with ctypes), each with an exactly
equal numpy / Python fallback: the replay of a what-if scenario (`replay.py`'s numpy path is the
reference), greedy document repacking (`causes/sequences.py`'s Python path), and for the
untraced-time measurement (`causes/pauses.py`) the time busy spans cover inside gaps on many
timelines at once and a per-timeline ordering (`intervals.covered_grouped`, `np.lexsort`).

Covered time and ordering: numpy sorts every span of a stage's lanes in one global sort (and
ranks every time for its searches); the kernel sorts each lane's few hundred spans on its own,
which arrive nearly in order (merges skipped where blocks already are): ~13x faster on a
1,200-op x 780-lane stage, the same floats (tests/test_pauses.py checks both ways).

Replay: the numpy path walks the levels with a few vectorised calls per level over
`[op, scenario, lane]` blocks: Python cost per level, but every value crosses memory
several times (gathers, temporaries, the scenario arrays themselves). `strag_replay` runs the
same replay rule as one compiled loop per scenario, a block of steps at a time: the block's
`[op, lane]` starts and ends stay in cache, every inner loop is a vectorised pass over the
block's lanes, each scenario's cost and delay are read straight from its `Mix` parts (no
materialised `[op, lane]` arrays), and only step times and spans come back. It uses the same
float64 operations in the same order, so results are equal bit for bit
(tests/test_whatif_replay.py checks every schedule variant both ways).

Repacking: one-at-a-time greedy over every document of every step is a loop with a decision
per document; `strag_repack` runs it over all steps in one call (a tournament tree of the
bins, O(documents x log bins), ~30 ns a document), ~20x faster than the same rule with heapq
(tests/test_causes_repack.py checks both against a plain reference).

Why C and not numba: on the 8,192-GPU job both replay at the same speed, but numba costs
~0.5 s per process to import and load its cached code (more than the whole replay), the C
kernel ~5 ms. It is built once per machine (transforms/native.py) with the system C compiler (`$CC`, else `cc`)
into `$STRAG_KERNEL_CACHE` (default `~/.cache/strag`), named by a CRC of source and flags;
without a compiler both fall back (same results; replay ~4x slower on big jobs, repacking ~20x),
and say so once per process in one line on stderr naming the reason. A cached library that fails
to load (truncated, another architecture) is rebuilt. The cache folder is created 0700, and a
library is loaded only when it and its folder are owned by this user and writable by nobody else
(a shared cache folder would let anyone who can write there run code in strag): else the kernel
is refused, said in that line, and the numpy path runs.
`STRAG_REPLAY=numpy|kernel` forces one path for every function (tests, benchmarks).
"""
from __future__ import annotations

import ctypes
import pathlib
import threading

import numpy as np

from transforms.native import CompiledHelper, LibraryBuildError, LibraryRefused

__all__ = ["BLOCK_LANES", "HELPER", "available", "wanted", "canonical", "replay_scenario", "op_layout", "repack", "covered_grouped",
           "group_order",
           "KernelBuildError", "KernelRefused"]

# Lanes replayed together (whole steps): long enough rows to vectorise, short enough for cache.
BLOCK_LANES = 256
SOURCE = pathlib.Path(__file__).with_name("kernel.c")
FLAGS = ("-O3", "-std=c99", "-ffp-contract=off", "-fPIC", "-shared")   # no -ffast-math: exact IEEE order
_ENV = "STRAG_REPLAY"
INVALID_REPACK = ("repacking: document lengths must be finite, >= 0 and longest first within each step, "
                  "and a step with documents needs a bin")
KernelBuildError, KernelRefused = LibraryBuildError, LibraryRefused   # the names the replay's callers know


def _declare(library) -> None:
    function = library.strag_replay
    function.restype = None
    function.argtypes = ([ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5
                         + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 7 + [ctypes.c_int] + [ctypes.c_void_p] * 5)
    library.strag_repack.restype = ctypes.c_int
    library.strag_repack.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 6
    library.strag_covered.restype = ctypes.c_int
    library.strag_group_order.restype = ctypes.c_int
    library.strag_group_order.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
    library.strag_covered.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 4


HELPER = CompiledHelper(SOURCE, FLAGS, _declare, env=_ENV, off="numpy", on="kernel",
                        fallback="strag: C replay kernel not used ({reason}); replaying with numpy (same results, "
                                 "~4x slower on big jobs)")


def wanted() -> bool:
    """Use the compiled kernel (replay and repacking)? STRAG_REPLAY=numpy|kernel forces the choice
    (kernel: KernelBuildError with the compiler's message when it cannot be built); by default
    whenever it builds."""
    return HELPER.wanted()


def available() -> bool:
    """Whether the kernel is built (building it on first use) and loadable. When not, one line on
    stderr (once per process) says why and that the numpy path runs."""
    return HELPER.available()


def _load() -> ctypes.CDLL:
    """The kernel library, built on first use on this machine; KernelBuildError if it cannot be."""
    return HELPER.load()


def op_layout(model) -> tuple[np.ndarray, ...]:
    """The model's graph as the kernel reads it: (pred_ptr, pred_index, level bounds
    [n_levels + 1], group end [n_ops], synced [n_ops], optimizer [n_ops], track [n_ops], track
    without negative values [n_ops]). A group's members are contiguous in replay order, so each op
    records where its group ends (its own op + 1 outside groups); the first member stands for the
    group. track (kernel.c): every op's starts and ends count toward a step's earliest start and
    latest end (3); where no cost or delay is negative, only the sources' starts (1) and the ends of
    the ops no other op waits for (2) can be the earliest and the latest."""
    pred_ptr = np.ascontiguousarray(model.pred_ptr, dtype=np.int64)
    pred_index = np.ascontiguousarray(model.pred_index, dtype=np.int64)
    bounds = np.array([level.lo for level in model.levels] + [model.n_ops], dtype=np.int64)
    group = model.op_group
    group_end = np.arange(1, model.n_ops + 1, dtype=np.int64)
    members = np.flatnonzero(group >= 0)
    if len(members):
        last = np.flatnonzero(np.diff(np.append(group[members], -2)))   # last member of each group
        group_end[members] = np.repeat(members[last] + 1, np.diff(np.concatenate([[-1], last])))
    synced = np.zeros(model.n_ops, dtype=np.uint8)
    synced[members] = model.group_synced[group[members]]
    optimizer = np.zeros(model.n_ops, dtype=np.uint8)
    optimizer[model.optimizer_ops] = 1
    every = np.full(model.n_ops, 3, dtype=np.uint8)
    bounded = np.zeros(model.n_ops, dtype=np.uint8)
    bounded[model.source_ops] |= 1
    waited_for = np.zeros(model.n_ops + 1, dtype=bool)
    waited_for[pred_index[pred_index < model.n_ops]] = True
    bounded[~waited_for[:model.n_ops]] |= 2
    return pred_ptr, pred_index, bounds, group_end, synced, optimizer, every, bounded


def canonical(values, dtype, shape: tuple[int, int]) -> np.ndarray:
    """`values` as a C-contiguous 2-D array of `dtype` whose dims are 1 or `shape`'s (a
    lane-independent value stays [n_ops or 1, 1]: the kernel reads what it needs, and a full
    [op, lane] array is copied only when its layout or dtype demands it)."""
    array = np.asarray(values, dtype=dtype)
    if array.ndim > 2:
        raise ValueError(f"scenario values must broadcast to [n_ops, n_lanes] = {shape}, got shape {array.shape}")
    array = array.reshape((1,) * (2 - array.ndim) + array.shape)
    if any(size not in (1, full) for size, full in zip(array.shape, shape)):
        array = np.broadcast_to(array, shape)
    return np.ascontiguousarray(array)


def replay_scenario(model, layout, n_steps: int, dp: int, parts, keep: bool, nonnegative: bool = False):
    """One scenario over n_steps x dp lanes: (step_time [n_steps], step_span [n_steps], starts, ends).

    parts: (cost base, cost alt, cost where, delay base, delay alt, delay where, has delay) as
    `canonical` arrays (float64, float64, bool). starts / ends are [n_ops, n_steps * dp] when
    keep, else None. nonnegative: no value of the parts is negative (nor NaN), so the step's
    earliest start and latest end are read from its sources and sinks alone (op_layout)."""
    pred_ptr, pred_index, bounds, group_end, synced, optimizer, every, bounded = layout
    *arrays, has_delay = parts
    dims = np.array([size for array in arrays for size in array.shape], dtype=np.int64)
    step_time, step_span = np.empty(n_steps), np.empty(n_steps)
    starts = ends = None
    if keep:
        starts, ends = np.empty((model.n_ops, n_steps * dp)), np.empty((model.n_ops, n_steps * dp))
    block = max(1, BLOCK_LANES // dp)

    def pointer(array):
        return None if array is None else array.ctypes.data

    _load().strag_replay(
        model.n_ops, pointer(pred_ptr), pointer(pred_index), len(bounds) - 1, pointer(bounds),
        pointer(group_end), pointer(synced), pointer(optimizer), pointer(bounded if nonnegative else every), n_steps, dp, block,
        *(pointer(array) for array in arrays), pointer(dims), int(has_delay),
        pointer(_workspace((2 * model.n_ops + 5) * block * dp)),
        pointer(starts), pointer(ends), pointer(step_time), pointer(step_span))
    return step_time, step_span, starts, ends


_scratch = threading.local()


def _workspace(size: int) -> np.ndarray:
    """This thread's kernel scratch of at least `size` doubles, kept from call to call (grown,
    never shrunk): touched once, not page-faulted in afresh by every scenario. Per thread, as
    the kernel runs without the GIL and a runner may replay in several threads."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _scratch.buffer = np.empty(size)
    return buffer


def repack(lengths: np.ndarray, doc_ptr: np.ndarray, bin_ptr: np.ndarray, capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Greedy repacking of every step in one call (the rule: `kernel.c`, strag_repack); the
    arguments as `causes.sequences.greedy_repack` checked them. Returns (every document's bin
    within its step [n_docs] int64, the bins' loads [bin_ptr[-1]] float64)."""
    lengths = np.ascontiguousarray(lengths, dtype=np.float64)
    doc_ptr, bin_ptr = (np.ascontiguousarray(a, dtype=np.int64) for a in (doc_ptr, bin_ptr))
    capacity = np.ascontiguousarray(capacity, dtype=np.float64)
    target, loads = np.empty(len(lengths), dtype=np.int64), np.empty(int(bin_ptr[-1]))
    status = _load().strag_repack(len(doc_ptr) - 1, doc_ptr.ctypes.data, lengths.ctypes.data, bin_ptr.ctypes.data,
                                  capacity.ctypes.data, target.ctypes.data, loads.ctypes.data)
    if status == -2:
        raise ValueError(INVALID_REPACK)
    if status:
        raise MemoryError(f"repacking kernel: cannot allocate the tree of {int(np.diff(bin_ptr).max())} bins")
    return target, loads


def covered_grouped(gap_group: np.ndarray, gap_start: np.ndarray, gap_end: np.ndarray,
                    busy_group: np.ndarray, busy_start: np.ndarray, busy_end: np.ndarray) -> np.ndarray:
    """transforms.intervals.covered_grouped (the same floats, bit for bit) in one compiled pass
    (`kernel.c`, strag_covered): each timeline's spans sorted on their own rather than every span
    of a stage's lanes in one global sort. Falls back to the numpy function without the kernel,
    and for values it does not take (NaN, negative timeline ids)."""
    from transforms.intervals import covered_grouped as numpy_covered

    groups = [np.ascontiguousarray(a, dtype=np.int64) for a in (gap_group, busy_group)]
    values = [np.ascontiguousarray(a, dtype=np.float64) for a in (gap_start, gap_end, busy_start, busy_end)]
    if (not len(values[0]) or not len(values[2]) or not wanted() or not available()
            or min(int(g.min()) for g in groups) < 0 or any(np.isnan(v).any() for v in values)):
        return numpy_covered(gap_group, gap_start, gap_end, busy_group, busy_start, busy_end)
    (gap_group, busy_group), (gap_start, gap_end, busy_start, busy_end) = groups, values
    out = np.zeros(len(gap_start))
    n_groups = max(int(gap_group.max()), int(busy_group.max())) + 1
    status = _load().strag_covered(n_groups, len(busy_start), busy_group.ctypes.data, busy_start.ctypes.data,
                                   busy_end.ctypes.data, len(gap_start), gap_group.ctypes.data, gap_start.ctypes.data,
                                   gap_end.ctypes.data, out.ctypes.data)
    if status:
        raise MemoryError(f"covered-time kernel: cannot allocate for {len(busy_start)} spans in {n_groups} timelines")
    return out


def group_order(group: np.ndarray, value: np.ndarray) -> np.ndarray:
    """np.lexsort((value, group)) (positions by group, then value, ties in position order) with each
    group sorted on its own (`kernel.c`, strag_group_order); the numpy call without the kernel, and
    for values it does not take (NaN, negative groups)."""
    group, value = np.ascontiguousarray(group, dtype=np.int64), np.ascontiguousarray(value, dtype=np.float64)
    if not len(value) or not wanted() or not available() or int(group.min()) < 0 or np.isnan(value).any():
        return np.lexsort((value, group))
    order = np.empty(len(value), dtype=np.int64)
    if _load().strag_group_order(int(group.max()) + 1, len(value), group.ctypes.data, value.ctypes.data, order.ctypes.data):
        raise MemoryError(f"ordering kernel: cannot allocate for {len(value)} values")
    return order
