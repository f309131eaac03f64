"""Greedy document repacking (causes/sequences.py greedy_repack): the compiled kernel and the
Python fallback give identical assignments, and both are exactly the one-at-a-time greedy
written plainly below. Property-based (hypothesis) over small steps with ties, zero room,
overflows, single bins and empty steps; seeded random steps at a realistic size."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transforms.synth import Cause, JobSpec, generate_job
from transforms.whatif import TraceValueError, compile_job, kernel
from transforms.whatif.causes import greedy_rebalance, imbalance_degree, sequence_workload
from transforms.whatif.causes.sequences import greedy_repack

BACKENDS = ["numpy", "kernel"]


def one_at_a_time(lengths: list[float], capacity: float, bins: int) -> tuple[list[int], list[float]]:
    """The rule, O(documents x bins): longest first, each document to the lightest bin (sum of
    squared lengths; ties: lowest index) whose room (capacity - tokens in it) holds it, else to
    the lightest bin. Returns every document's bin and the bins' loads."""
    loads, room, target = [0.0] * bins, [float(capacity)] * bins, []
    for length in sorted(lengths, reverse=True):
        fitting = [b for b in range(bins) if room[b] >= length] or list(range(bins))
        chosen = min(fitting, key=lambda b: (loads[b], b))
        loads[chosen] += length * length
        room[chosen] -= length
        target.append(chosen)
    return target, loads


def flat(steps: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Every step's lengths longest first, one after the other, and the offsets per step."""
    lengths = np.concatenate([np.sort(np.asarray(s, dtype=np.float64))[::-1] for s in steps]) if steps else np.zeros(0)
    return lengths, np.concatenate([[0], np.cumsum([len(s) for s in steps])]).astype(np.int64)


def repack(backend: str, monkeypatch, lengths, doc_ptr, bins, capacity):
    if backend == "kernel" and not kernel.available():
        pytest.skip("no C compiler: the repacking kernel cannot be built (Python fallback only)")
    monkeypatch.setenv("STRAG_REPLAY", backend)
    return greedy_repack(lengths, doc_ptr, bins, capacity)


def assert_is_the_greedy(steps, bins, capacity, target, loads):
    bin_ptr = np.concatenate([[0], np.cumsum(bins)])
    lengths, doc_ptr = flat(steps)
    for s, documents in enumerate(steps):
        expected_target, expected_loads = one_at_a_time(documents, capacity[s], bins[s])
        assert target[doc_ptr[s]:doc_ptr[s + 1]].tolist() == expected_target
        assert loads[bin_ptr[s]:bin_ptr[s + 1]].tolist() == expected_loads
        # a document's bin is one the loads account for: the loads are its documents' squares
        np.testing.assert_array_equal(
            np.bincount(target[doc_ptr[s]:doc_ptr[s + 1]], lengths[doc_ptr[s]:doc_ptr[s + 1]] ** 2, bins[s]),
            loads[bin_ptr[s]:bin_ptr[s + 1]])


# lengths from a few values (ties), zero among them; capacity from 0 (no room ever) up
step = st.tuples(st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 13, 40]), max_size=40), st.integers(1, 7),
                 st.integers(0, 60))


@given(st.lists(step, max_size=5))
@settings(max_examples=300, deadline=None)
def test_kernel_and_fallback_are_the_one_at_a_time_greedy(steps):
    with pytest.MonkeyPatch.context() as monkeypatch:
        documents = [list(map(float, s[0])) for s in steps]
        bins = np.array([s[1] for s in steps], dtype=np.int64)
        capacity = np.array([s[2] for s in steps], dtype=np.float64)
        lengths, doc_ptr = flat(documents)
        results = {backend: repack(backend, monkeypatch, lengths, doc_ptr, bins, capacity) for backend in
                   (BACKENDS if kernel.available() else ["numpy"])}
        for target, loads in results.values():
            assert_is_the_greedy(documents, bins, capacity, target, loads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, documents, bins, capacity", [
    ("ties: equal lengths fill the bins in index order", [4, 4, 4, 4, 4], 3, 100),
    ("zero room: every document overflows to the lightest", [3, 2, 2, 1], 2, 0),
    ("zero-length documents fit anywhere, even with no room", [0, 0, 0], 2, 0),
    ("overflow mid-way: the lightest bin takes what fits nowhere", [6, 5, 5, 4, 3, 1], 2, 10),
    ("a single bin takes everything", [9, 7, 7, 1], 1, 10),
    ("more bins than documents", [5, 1], 6, 5),
    ("a bin back from aside is lighter than the rest", [10, 10, 9, 2, 2, 2, 1, 1], 3, 12),
])
def test_named_cases(backend, monkeypatch, case, documents, bins, capacity):
    steps = [list(map(float, documents))]
    lengths, doc_ptr = flat(steps)
    target, loads = repack(backend, monkeypatch, lengths, doc_ptr, np.array([bins]), np.array([float(capacity)]))
    assert_is_the_greedy(steps, [bins], [capacity], target, loads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_steps_and_steps_without_bins(backend, monkeypatch):
    steps = [[], [3.0, 1.0], [], []]
    lengths, doc_ptr = flat(steps)
    target, loads = repack(backend, monkeypatch, lengths, doc_ptr, np.array([0, 2, 3, 0]), np.array([4.0, 4.0, 4.0, 4.0]))
    assert target.tolist() == [0, 1] and loads.tolist() == [9.0, 1.0, 0.0, 0.0, 0.0]


def _full_microbatches(rng, bins: int, context: int) -> np.ndarray:
    """Lognormal integer documents packed into `bins` microbatches of `context` tokens (the
    last document of each cut), as a trainer's packer leaves them: the repacking overflows."""
    out = []
    for _ in range(bins):
        lengths = np.maximum(1, np.rint(np.exp(rng.standard_normal(64) * 1.4) * context / 8))
        begins = np.cumsum(lengths) - lengths
        out.append(np.minimum(lengths, context - begins)[begins < context])
    return np.concatenate(out)


def test_kernel_equals_fallback_at_a_realistic_size(monkeypatch):
    """Several steps of a few thousand documents over hundreds of microbatches (overflows
    included): identical assignments; the first step also against the plain rule."""
    rng = np.random.default_rng(7)
    bins = np.array([300, 300, 257, 64])
    steps = [_full_microbatches(rng, int(b), 4096).tolist() for b in bins]
    lengths, doc_ptr = flat(steps)
    capacity = np.full(len(steps), 4096.0)
    fallback = repack("numpy", monkeypatch, lengths, doc_ptr, bins, capacity)
    compiled = repack("kernel", monkeypatch, lengths, doc_ptr, bins, capacity)
    np.testing.assert_array_equal(fallback[0], compiled[0])
    np.testing.assert_array_equal(fallback[1], compiled[1])
    assert_is_the_greedy(steps[-1:], bins[-1:], capacity[-1:], compiled[0][doc_ptr[-2]:], compiled[1][-bins[-1]:])
    tokens = np.bincount(compiled[0][:doc_ptr[1]], lengths[:doc_ptr[1]], bins[0])
    assert tokens.max() > 4096      # the case covers overflow: some documents fit nowhere


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths, match", [
    ([1.0, 2.0], "longest first"), ([2.0, -1.0], ">= 0"), ([np.nan], "finite"), ([np.inf], "finite"),
])
def test_lengths_out_of_order_or_invalid_are_refused(backend, monkeypatch, lengths, match):
    with pytest.raises(ValueError, match=match):
        repack(backend, monkeypatch, np.array(lengths), np.array([0, len(lengths)]), np.array([2]), np.array([10.0]))


def test_offsets_that_do_not_match_are_refused():
    with pytest.raises(ValueError, match="offsets"):
        greedy_repack(np.array([2.0, 1.0]), np.array([0, 1]), np.array([2]), np.array([10.0]))
    with pytest.raises(ValueError, match="offsets"):
        greedy_repack(np.array([2.0, 1.0]), np.array([0, 2, 1, 2]), np.array([2, 2, 2]), np.array([10.0] * 3))


def test_greedy_rebalance_keeps_every_document_and_lowers_imbalance():
    rng = np.random.default_rng(0)
    documents = [rng.integers(50, 2000, rng.integers(2, 8)).astype(float) for _ in range(16)]
    capacity = max(d.sum() for d in documents)
    packed = greedy_rebalance(documents)
    assert sorted(np.concatenate(packed)) == sorted(np.concatenate(documents))
    assert max(b.sum() for b in packed) <= capacity
    _, expected_loads = one_at_a_time(list(np.concatenate(documents)), capacity, 16)
    assert [float(np.sum(b * b)) for b in packed] == expected_loads
    before = imbalance_degree([np.sum(d * d) for d in documents])
    after = imbalance_degree([np.sum(b * b) for b in packed])
    assert after < before
    assert imbalance_degree([4.0, 4.0]) == 1.0 and imbalance_degree([6.0, 2.0]) == 1.5


def test_a_negative_recorded_length_names_the_job_step_and_worker():
    import pyarrow as pa
    import pyarrow.compute as pc

    spec = JobSpec(job_id="bad-lengths", dp=2, pp=2, microbatches=4, steps=8, sessions=1, seed=1, context_length=8192,
                   causes=(Cause("seq_len_imbalance", {}),), record_seq_lens=True)
    job = generate_job(spec)
    model = compile_job(job.trace, job.meta, spec.job_id)
    lists = job.trace["seq_lens"].combine_chunks()
    first = int(pc.index(pc.is_valid(lists), True).as_py())            # a microbatch that records lengths
    step, dp_rank, mb = (job.trace[name][first].as_py() for name in ("step", "dp_rank", "mb_id"))
    same = job.trace["step"].to_numpy() == step
    same &= (job.trace["dp_rank"].to_numpy() == dp_rank) & (job.trace["mb_id"].to_numpy() == mb)
    values = [[-5] + v[1:] if v and hit else v for v, hit in zip(lists.to_pylist(), same)]
    trace = job.trace.set_column(job.trace.schema.get_field_index("seq_lens"), "seq_lens",
                                 pa.array(values, type=lists.type))
    with pytest.raises(TraceValueError, match=rf"'bad-lengths'.*step {step}.*dp_rank {dp_rank}.*microbatch {mb}"):
        sequence_workload(trace, model)
