"""Untraced time on CPU ranks (transforms/whatif/causes/pauses.py): data loading told apart by the
DataLoader's spans, pauses by being gaps far beyond the job's usual largest one (one or several per step), python-gc
when the pauses fall where forwards begin; on real runs of real stacks (tests/data/real_stacks)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

STACKS = pathlib.Path(__file__).parent / "data" / "real_stacks"


def _job(name: str):
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif import compile_job

    truth = json.loads((STACKS / name / "truth.json").read_text())
    converted = convert_kineto([str(STACKS / name / f) for f in truth["trace_files"]], name, "2026-11-27", {})
    return converted, compile_job(converted.trace, converted.job_meta(), name), truth


def _verdict(name: str):
    from transforms.whatif.causes import analyze_and_classify

    converted, _, truth = _job(name)
    return analyze_and_classify(converted.trace, converted.job_meta(), name)[1], truth


def test_data_waits_are_the_fetch_time_inside_each_op_s_gap():
    from transforms.ingest.kineto.job import _data_waits

    # ops at [0, 10], [30, 40], [41, 50] µs; fetches [12, 20] and [18, 25] (nested: counted once), [40.5, 41]
    start, end = np.array([0.0, 30.0, 41.0]), np.array([10.0, 40.0, 50.0])
    waits = _data_waits(start, end, np.array([[12.0, 20.0], [18.0, 25.0], [40.5, 41.0]]))
    assert waits.tolist() == [0.0, 13.0, 0.5]


def test_data_loading_is_recorded_and_named_as_such():
    """Rank 1's Dataset sleeps 300 ms per batch (Accelerate loop): the trace's data_wait holds it, the
    pauses exclude it, and the untraced-cpu verdict says data loading with the data loader's fix."""
    from transforms.whatif.causes.pauses import find_pauses

    converted, model, truth = _job("accelerate-data-r1-gpt2-padded")
    table = converted.trace.to_pandas()
    per_rank = table.groupby("rank").data_wait.sum()
    assert per_rank[1] > 0.25 * 3 and per_rank[0] < 0.01          # three profiled steps of 300 ms fetches
    assert not find_pauses(model).cells
    verdict, _ = _verdict("accelerate-data-r1-gpt2-padded")
    assert verdict.cause == "untraced-cpu" and verdict.implicated_workers == [(1, 0)]
    assert "data loading" in verdict.explanations["untraced-cpu"]
    assert verdict.fixes["untraced-cpu"].description.startswith("the blamed worker's data loading")
    assert verdict.evidence["untraced_workers"][0]["data_loading_share"] > 0.9


def test_pauses_on_a_different_rank_in_different_steps_are_python_gc():
    """HF Trainer, gc.collect() on rank (step % 2): single gaps of ~150 ms outside data loading, one
    rank per step. The GC record the run kept (PROVENANCE, not given to strag) is the check."""
    from transforms.whatif.causes.pauses import at_collector_sites, collector, find_pauses

    _, model, truth = _job("hf-gcall-gpt2-packed")
    pauses = find_pauses(model)
    assert at_collector_sites(model, pauses) and collector(model, pauses)
    hit = {(int(model.worker_rank[d, p]), int(model.steps[s])) for d, p, s, _ in pauses.cells}
    assert hit == {(int(step) % 2, int(step)) for step in model.steps}    # rank = step % 2 collects
    assert all(0.1 < excess < 0.25 for *_, excess in pauses.cells)
    verdict, _ = _verdict("hf-gcall-gpt2-packed")
    assert verdict.cause == "python-gc" and sorted(verdict.implicated_workers) == [(0, 0), (1, 0)]
    # no worker's untraced time is beyond its peer's in most steps (each pauses in half of them), so
    # the untraced-cpu test names nobody; the collector's workers are named instead, and with their
    # untraced time given back the replay matches what ran: the window is kept
    from transforms.whatif.causes import analyze_and_classify
    from transforms.whatif.causes.untraced import untraced_workers

    converted, _, _ = _job("hf-gcall-gpt2-packed")
    result = analyze_and_classify(converted.trace, converted.job_meta(), "hf-gcall-gpt2-packed")[0]
    assert result.discarded_method and result.kept_by == "untraced-model"
    assert sorted(result.untraced.workers) == [(0, 0), (1, 0)]
    assert untraced_workers(model, result) == []
    fix = verdict.fixes["python-gc"]
    assert fix.measured and 0.0 < fix.savings_fraction < 0.6
    assert "planned GC" in fix.description and "step" in verdict.explanations["python-gc"]


def test_a_pause_at_the_forward_in_every_step_on_one_rank_is_python_gc_and_its_fix_keeps_ordinary_time():
    """Lightning, gc.collect() on rank 1 in every step, in a forward pre-hook: rank 0 waits for it
    inside a collective (no pause of its own); rank 1's pause falls where its forward begins, every
    step: the collector (METHOD.md's forward-only stalls), not the rank's untraced time at large. The
    fix takes out the pauses, not all of rank 1's untraced time."""
    from transforms.whatif.causes.pauses import at_collector_sites, collector, find_pauses

    _, model, _ = _job("lightning-gc-r1-mlp-callback-acc2")
    pauses = find_pauses(model)
    assert pauses.workers() == [(1, 0)] and len(pauses.cells) == model.n_steps
    assert at_collector_sites(model, pauses) and collector(model, pauses)
    verdict, _ = _verdict("lightning-gc-r1-mlp-callback-acc2")
    assert verdict.cause == "python-gc" and verdict.implicated_workers == [(1, 0)]
    assert "untraced-cpu" not in verdict.causes                 # the pauses are most of its untraced time
    fix = verdict.fixes["python-gc"]
    planned = verdict.evidence["planned_gc_seconds"]
    ran = fix.step_time / (1.0 - fix.savings_fraction)
    # each step ran ~400 ms with a ~140 ms collect in it (PROVENANCE of the run): about a third
    # without the collections; planned GC pays back the mean collection per worker and step
    assert 0.25 < 1.0 - (fix.step_time - planned) / ran < 0.45
    assert abs(planned - np.mean([e for *_, e in pauses.cells]) / model.dp_size) < 1e-9


def test_where_every_worker_step_has_a_long_gap_the_usual_is_the_lower_half_not_zero(monkeypatch):
    """Two workers, six steps of 1 s: worker 0's ordinary Python leaves its largest gap at ~60 ms in
    every step (beyond the 50 ms a pause must add up to), worker 1 collects for 400 ms in every step.
    No worker-step is below that least sum, so the floor tells none apart; the usual largest gap is
    read from the lower half of the worker-steps (pausing ones are at most half), never from an empty
    set whose 0 s made every gap of both workers a pause. Worker 1's collections are its pauses, each
    counted beyond the usual gap; worker 0's ordinary gaps are not."""
    import types

    import numpy as np

    from transforms.whatif.causes import pauses as module

    steps, ops = 6, 20
    rng = np.random.default_rng(5)
    ordinary = 0.002 + 0.001 * rng.random((ops, steps))
    gaps = {0: ordinary.copy(), 1: ordinary.copy()}
    gaps[0][7] = 0.058 + 0.004 * rng.random(steps)               # the longest ordinary gap of each step
    gaps[1][7] = gaps[0][7] + rng.normal(0.0, 0.001, steps)
    gaps[1][0] = 0.400                                             # a collection where each step opens
    model = types.SimpleNamespace(pp_size=1, dp_size=2, n_steps=steps, n_ops=ops, gc_wait=None, gc_within=None,
                                  idle_within=None, lane_dp=np.tile([0, 1], steps), launch_delay=None,
                                  observed_start=np.zeros((ops, 2 * steps)), observed_end=np.ones((ops, 2 * steps)))
    monkeypatch.setattr(module, "untraced_gaps", lambda model, d, p, partner=None:
                        (np.arange(ops), gaps[d], np.zeros((ops, steps)), None))
    monkeypatch.setattr(module, "p2p_partner", lambda model: np.full(ops, -1))
    found = module.find_pauses(model)
    assert found.workers() == [(1, 0)]
    assert 0.055 < found.typical < 0.065 and sorted(s for _, _, s, _ in found.cells) == list(range(steps))
    assert all(abs(excess - (0.400 - found.typical)) < 1e-9 for _, _, _, excess in found.cells)


def test_pauses_before_a_collective_inside_the_step_are_not_the_collector():
    """The same pauses moved to end where a gradient all-reduce begins, inside the step (as an
    oversubscribed host's OS descheduling a process leaves them), are no longer the collector's:
    they stay untraced time. Moved to the op that opens the step (between iterations, where a
    trainer's planned gc.collect() runs), they are."""
    import dataclasses

    from schemas.trace import OPTYPES
    from transforms.whatif.causes.pauses import at_collector_sites, collector, find_pauses

    _, model, _ = _job("lightning-gc-r1-mlp-callback-acc2")
    pauses = find_pauses(model)
    opening = model.pred_index[model.pred_ptr[:-1]] == model.n_ops
    reduces = np.flatnonzero((model.op_optype == OPTYPES.index("grads-reduce-scatter")) & ~opening)   # DDP's all-reduce
    moved = dataclasses.replace(pauses, where=tuple((int(reduces[0]), lane) for _, lane in pauses.where))
    assert not at_collector_sites(model, moved) and not collector(model, moved)
    one = dataclasses.replace(pauses, where=pauses.where[:1] + moved.where[1:])
    assert not collector(model, one)                            # every pause where the collector runs, not most
    first = int(np.flatnonzero(opening & (model.op_optype != OPTYPES.index("forward-compute")))[0])
    between = dataclasses.replace(pauses, where=tuple((first, lane) for _, lane in pauses.where))
    assert at_collector_sites(model, between) and collector(model, between)


def test_planned_gc_at_the_end_of_each_step_without_a_record_is_python_gc():
    """HF Trainer, rank 1 runs gc.collect() at the end of every optimizer step (on_step_end, after the
    optimizer, before prof.step(): a trainer's planned GC), exported by plain torch.profiler without
    the trainer's GC record. Each collection is untraced time after rank 1's last op of the step,
    before it left the step (the step's tail: between iterations, where the collector runs), in
    every profiled step, the last one included. The verdict is python-gc on rank 1 alone, not
    untraced-cpu and not "none"; each pause is as long as the collection the run timed
    (PROVENANCE.json, not given to strag)."""
    from transforms.whatif.causes.pauses import at_collector_sites, collector, find_pauses, untraced_gaps

    name = "p3-hf-gcend-r1-gpt2-packed-norec"
    converted, model, truth = _job(name)
    assert model.gc_wait is None and model.step_left is not None      # nothing recorded: found from the gaps
    table = converted.trace.to_pandas()                               # each rank's ProfilerStep holds its ops
    assert (table.step_entered <= table.start_ts + 1e-9).all() and (table.step_left >= table.start_ts + table.duration - 1e-9).all()
    assert (table.groupby(["rank", "step"]).step_left.nunique() == 1).all()
    pauses = find_pauses(model)
    assert pauses.workers() == [(1, 0)] and not pauses.recorded
    assert all(op == model.n_ops for op, _ in pauses.where)          # each in its step's tail
    assert at_collector_sites(model, pauses) and collector(model, pauses)
    assert sorted(s for _, _, s, _ in pauses.cells) == list(range(model.n_steps))
    timed = dict(json.loads((STACKS / name / "PROVENANCE.json").read_text())["ranks"]["1"]["gc_collects"])
    for _, _, s, excess in pauses.cells:
        collected = timed[int(model.steps[s])] / 1e3                         # gc_collects: (step, ms)
        assert abs(excess + pauses.typical - collected) < 0.1 * collected
    # the time between two steps counts once: rank 1's next step opens without it
    ops, gaps, _, _ = untraced_gaps(model, 1, 0)
    assert (gaps[:-1].sum(axis=0) < 0.01).all() and (gaps[-1] > 0.05).all()
    verdict, _ = _verdict(name)
    assert verdict.cause == "python-gc" and verdict.implicated_workers == [(1, 0)]
    assert "untraced-cpu" not in verdict.causes and "individual-worker" not in verdict.causes
    # METHOD's replay, without the collections, is ~2x off; with rank 1's untraced time given back it
    # matches what ran (the untraced-cpu test names rank 1: its tails in every step), so the window
    # is kept (its S counts the collections)
    from transforms.whatif.causes import analyze_and_classify

    result = analyze_and_classify(converted.trace, converted.job_meta(), name)[0]
    assert result.discarded_method and not result.discarded and result.kept_by == "untraced-model"
    assert result.untraced.workers == ((1, 0),) and result.model_slowdown > 1.5 * result.slowdown


def test_recorded_collections_in_a_step_s_tail_count_in_that_step_the_last_one_included():
    """Accelerate loop whose rank 0 runs gc.collect() at the end of every optimizer step (after the
    optimizer, before prof.step()), exported with the trainer's GC record. The converter measures
    each recorded collection between rank 0's last op of a step and where it left the step
    (`gc_tail`): in all five profiled steps, the last included, which no later op's gc_wait can
    hold. Each equals the collection the run timed (PROVENANCE.json, not given to strag), and the
    python-gc fix takes out all five: its saving is the timed collections' share of the profiled
    steps (before the column, the last step's collection was lost and the fix fell 8.5 points short)."""
    from transforms.whatif.causes.pauses import find_pauses

    name = "p3-accelerate-gcend-r0-llama-packed"
    converted, model, truth = _job(name)
    assert model.gc_wait is not None and model.gc_tail is not None
    table = converted.trace.to_pandas()
    assert (table.groupby(["rank", "step"]).gc_tail.nunique() == 1).all()   # one value per rank and step
    tails = table.groupby(["rank", "step"]).gc_tail.first()
    provenance = json.loads((STACKS / name / "PROVENANCE.json").read_text())["ranks"]
    timed = dict(provenance["0"]["gc_collects"])                           # (step, ms)
    for step in model.steps.tolist():
        assert tails[0, step] == pytest.approx(timed[step] / 1e3, rel=0.01)
        assert tails[1, step] == 0.0
    pauses = find_pauses(model)
    assert pauses.recorded and pauses.workers() == [(0, 0)]
    assert sorted(s for _, _, s, _ in pauses.cells) == list(range(model.n_steps))   # the last step's too
    verdict, _ = _verdict(name)
    assert verdict.cause == "python-gc" and verdict.implicated_workers == [(0, 0)]
    # the pauses taken out (no planned GC paid back) against the timed collections' share of the
    # profiled steps, as the real-run benchmark measures it (bench_real_runs.gc_counterfactual)
    import importlib.util

    from transforms.whatif.causes import verdict_json

    spec = importlib.util.spec_from_file_location("bench_real_runs", STACKS.parents[2] / "benchmarks" / "bench_real_runs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    check = bench.gc_counterfactual(STACKS / name, truth, verdict_json(verdict))
    assert check["predicted"] == pytest.approx(check["measured"], abs=0.03) and check["measured"] > 0.4


def test_a_fetch_in_a_step_s_tail_is_data_loading_not_a_pause():
    """The same run with each of rank 1's steps opened by a DataLoader fetch that began right after
    its previous step's last op (the trace's data_wait on the op after it): the time between its
    steps is data loading, in the previous step's tail and in the next step's opening alike; no pause
    is left, except in the last step, whose tail no later fetch covers."""
    import pyarrow as pa

    from transforms.whatif import compile_job
    from transforms.whatif.causes.pauses import find_pauses, untraced_gaps

    name = "p3-hf-gcend-r1-gpt2-packed-norec"
    converted, model, _ = _job(name)
    table = converted.trace
    rank, step = (table.column(c).to_numpy() for c in ("rank", "step"))
    start, duration = (table.column(c).to_numpy() for c in ("start_ts", "duration"))
    waits = np.zeros(table.num_rows)
    steps = np.unique(step)
    for previous, current in zip(steps[:-1], steps[1:]):
        last_end = (start + duration)[(rank == 1) & (step == previous)].max()
        first = np.flatnonzero((rank == 1) & (step == current))
        opening = first[np.argmin(start[first])]
        waits[opening] = start[opening] - last_end
    fetched = table.set_column(table.schema.get_field_index("data_wait"), "data_wait", pa.array(waits))
    model = compile_job(fetched, converted.job_meta(), name)
    ops, gaps, data, _ = untraced_gaps(model, 1, 0)
    assert np.allclose(data[-1, :-1], gaps[-1, :-1]) and gaps[-1, :-1].min() > 0.05   # the tails: all data
    assert data[-1, -1] == 0.0                                                          # the last step's: no fetch after it
    assert [s for d, _, s, _ in find_pauses(model).cells if d == 1] == [model.n_steps - 1]


def test_clean_runs_have_no_pauses():
    from transforms.whatif.causes.pauses import find_pauses

    _, model, _ = _job("pipe-clean-1f1b-pp2-s0")
    assert find_pauses(model).cells == ()


def test_record_shapes_give_each_forward_its_batch_lengths():
    """HF Trainer with dynamic padding, the batch length drawn per step and rank: the token embedding's
    index shape [B, T] (record_shapes) becomes the forward's seq_lens, [T] * B, different per rank."""
    converted, _, _ = _job("hf-seq-gpt2-padded")
    table = converted.trace.to_pandas()
    forward = table[table.optype == "forward-compute"]
    lengths = forward.seq_lens.tolist()
    assert all(v is not None and len(v) == 4 and len(set(v)) == 1 for v in lengths)
    per_step = forward.groupby("step").seq_lens.apply(lambda s: len({v[0] for v in s}))
    assert (per_step == 2).all()                                      # the two ranks ran different lengths
    assert table[table.optype != "forward-compute"].seq_lens.isna().all()


def test_compute_that_follows_the_recorded_lengths_is_the_sequence_signature():
    """One microbatch per rank and step: forward against backward cannot be correlated, compute
    against the recorded workload can. Compute made proportional to the workload reads r = 1; the
    same compute given to the other rank of each step (against its data) reads no correlation."""
    from transforms.whatif import analyze_model
    from transforms.whatif.causes import sequence_workload
    from transforms.whatif.causes.detect import _signals
    from transforms.whatif.causes.paired import workload_fit
    from transforms.whatif.causes.signals import take
    from transforms.whatif.causes.verdict import CauseRules

    converted, model, _ = _job("hf-seq-gpt2-padded")
    workload = sequence_workload(converted.trace, model)
    signals = _signals(model, analyze_model(model), CauseRules(), {}, None, workload)
    load = take(workload.op_workload, signals.forward)
    for ops in (signals.forward, signals.backward):
        np.put_along_axis(model.original_cost, ops, 1e-7 * load, axis=0)
    assert workload_fit(model, signals.forward, signals.backward, signals.gc, workload)[0] == pytest.approx(1.0)
    swapped = load.reshape(len(load), model.n_steps, model.dp_size)[:, :, ::-1].reshape(load.shape)
    for ops in (signals.forward, signals.backward):
        np.put_along_axis(model.original_cost, ops, 1e-7 * swapped, axis=0)
    assert workload_fit(model, signals.forward, signals.backward, signals.gc, workload)[0] < 0.5


def _strip_gc_record(run: str, into: pathlib.Path) -> pathlib.Path:
    """A copy of a committed run whose traces lost the trainer's GC record (as torch alone writes them)."""
    import gzip

    into.mkdir()
    for path in sorted((STACKS / run).glob("rank-*.json.gz")):
        trace = json.loads(gzip.decompress(path.read_bytes()))
        trace.pop("strag_gc")
        (into / path.name).write_bytes(gzip.compress(json.dumps(trace).encode()))
    (into / "truth.json").write_text((STACKS / run / "truth.json").read_text())
    return into


def test_recorded_collections_are_python_gc_whatever_their_pattern(tmp_path):
    """Lightning DDP whose rank 1 runs gc.collect() over 600k objects once per optimizer step (the same
    rank in every step: from gaps alone, that is the worker's own per-step work, untraced-cpu). With
    strag_collect's GC record in the traces, the converter's gc_wait holds the collections, in rank
    1's gaps only, and the verdict is python-gc on rank 1, its fix saving about what the run's own
    measured collections cost (PROVENANCE at generation: 34.7% of the profiled steps)."""
    run = "lightning-gc-r1-mlp-callback-acc2-gcrec"
    converted, model, truth = _job(run)
    table = converted.trace.to_pandas()
    per_rank = table.groupby("rank").gc_wait.sum()
    assert per_rank[1] > 0.1 and per_rank[0] < 0.2 * per_rank[1]
    assert model.gc_wait is not None
    verdict, _ = _verdict(run)
    assert verdict.cause == "python-gc" and verdict.implicated_workers == [(1, 0)]
    assert verdict.evidence["gc_recorded"] is True and verdict.confidence == pytest.approx(0.99)
    assert "as the trainer recorded it" in verdict.explanations["python-gc"]
    # without the collections (planned GC not yet paid back) the steps as they ran would be about the
    # collections' measured cost shorter; planned GC (every rank at once, every N steps) pays some back
    fix, planned = verdict.fixes["python-gc"], verdict.evidence["planned_gc_seconds"]
    ran = fix.step_time / (1.0 - fix.savings_fraction)
    assert 0.25 < 1.0 - (fix.step_time - planned) / ran < 0.45 and 0.1 < fix.savings_fraction
    # the same traces without the record: the gaps alone cannot say GC for a pause in every step
    stripped = _strip_gc_record(run, tmp_path / "stripped")
    from transforms.ingest.kineto import convert_kineto

    plain = convert_kineto(sorted(str(p) for p in stripped.glob("rank-*.json.gz")), run, "2026-11-27", {})
    assert "gc_wait" not in plain.trace.column_names or plain.trace.column("gc_wait").null_count == plain.trace.num_rows


def _with_host_record(run: pathlib.Path, into: pathlib.Path, record: dict) -> list[str]:
    """A copy of a committed run whose traces carry strag_collect's host record (strag_collect.hostrecord)."""
    import gzip

    into.mkdir()
    for path in sorted(run.glob("rank-*.json.gz")):
        trace = json.loads(gzip.decompress(path.read_bytes()))
        trace["strag_host"] = record
        (into / path.name).write_bytes(gzip.compress(json.dumps(trace).encode()))
    return sorted(str(p) for p in into.glob("rank-*.json.gz"))


def test_untraced_time_a_crowded_host_can_explain_is_undecided_not_blamed(tmp_path):
    """DDP on 4 CPU ranks whose rank 3 sleeps before its all-reduce: its untraced time is ~59x its
    peers' (untraced-cpu on rank 3 without a host record). On a host of 2 threads per core (4 ranks of
    1 thread, 2 cores) a rank gets at least half a core while runnable, so waiting can stretch its
    untraced time at most 2-fold: 59x is its own, still untraced-cpu. Were the host crowded enough to
    explain it (64 threads per core), no trace could tell its wait from its work: insufficient evidence,
    naming the rank and its host's load, never a page."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif.causes import analyze_and_classify
    from transforms.whatif.causes.untraced import crowded

    run = pathlib.Path(__file__).parent / "data" / "real_runs" / "allreduce-r3-dp4-flat-mlp-sleep-ng"
    name = run.name

    def verdict(record: dict | None, folder: str):
        files = sorted(str(p) for p in run.glob("rank-*.json.gz")) if record is None else \
            _with_host_record(run, tmp_path / folder, record)
        converted = convert_kineto(files, name, "2026-11-27", {})
        return converted, analyze_and_classify(converted.trace, converted.job_meta(), name)[1]

    plain, unrecorded = verdict(None, "")
    assert plain.trace.column("host_load").null_count == plain.trace.num_rows
    assert unrecorded.cause == "untraced-cpu" and unrecorded.implicated_workers == [(3, 0)]

    two, halved = verdict({"cpus": 2, "threads": 1, "local_ranks": 4}, "two")
    assert two.trace.column("host_load").to_pylist() == [2.0] * two.trace.num_rows
    assert halved.cause == "untraced-cpu" and halved.implicated_workers == [(3, 0)]
    assert "untraced_crowded" not in halved.evidence

    packed, undecided = verdict({"cpus": 1, "threads": 16, "local_ranks": 4}, "packed")
    from transforms.whatif import compile_job

    assert crowded(compile_job(packed.trace, packed.job_meta(), name)) == {(d, 0): 64.0 for d in range(4)}
    assert undecided.cause == "insufficient-evidence" and "untraced-cpu" not in undecided.causes
    assert undecided.evidence["untraced_crowded"][0]["rank"] == 3
    sentence = undecided.explanations["insufficient-evidence"]
    assert "(rank 3)" in sentence and "64.0 of the job's threads per core" in sentence and "cores of its own" in sentence
    assert undecided.confidence < 0.99


def test_a_clean_run_with_a_gc_record_names_no_gc():
    """The record of a clean run holds the interpreter's ordinary young collections: none is worth a
    share of a step, so nothing is named."""
    verdict, _ = _verdict("lightning-clean-mlp-callback-s0-gcrec")
    converted, _, _ = _job("lightning-clean-mlp-callback-s0-gcrec")
    assert converted.trace.column("gc_wait").null_count == 0
    assert verdict.cause != "python-gc" and "python-gc" not in verdict.causes


def test_a_worker_is_blamed_for_untraced_time_only_beyond_the_job_s_own_spread():
    """The untraced-cpu test: a worker 10-20 ms beyond its peer in two steps that disagree by as
    much is not named (a clean Hugging Face run's profiler overhead); 300 ms beyond in three steps
    within a ms of each other is (a data stall), at a confidence the t test gives; one step gives
    no spread to test against."""
    from transforms.whatif.causes.untraced import _untraced_test
    from transforms.whatif.causes.workers import t_sf

    a, b = (0, 0), (1, 0)
    peers = {a: [b], b: [a]}
    noisy = _untraced_test({a: np.array([0.0012, 0.0013]), b: np.array([0.0205, 0.0101])}, peers, [a, b], 0.01)
    assert noisy[b] < 0.99
    steady = _untraced_test({a: np.array([0.001, 0.0011, 0.0009]), b: np.array([0.300, 0.302, 0.299])}, peers, [a, b], 0.01)
    assert steady[b] >= 0.99 and steady[a] < 0.5
    # its confidence: the excesses 0.299, 0.3009, 0.2981 (mean 0.299), their spread with 2 degrees of freedom
    e = np.array([0.299, 0.3009, 0.2981])
    t = e.mean() / (e.std(ddof=1) / np.sqrt(3))
    assert steady[b] == pytest.approx(1.0 - 2 * t_sf(t, 2))
    assert _untraced_test({a: np.array([0.001]), b: np.array([0.3])}, peers, [a, b], 0.01) == {}


def test_the_untraced_test_s_null_compares_like_with_like():
    """With DP peers each worker's untraced time is tested against its stage's peers, and the null's
    spread comes from the same comparisons: stage 0's two ranks share a jitter of 100 ms every other
    step (a pipeline neighbour's), which cancels between them and must not hide a steady 5 ms excess
    on stage 1's rank 1 (compared with every other worker it would)."""
    from transforms.whatif.causes.untraced import _untraced_test

    rng = np.random.default_rng(7)
    steps = 8
    shared = np.tile([0.0, 0.1], steps // 2)
    per_step = {(0, 0): 0.02 + shared + rng.normal(0, 1e-4, steps), (1, 0): 0.02 + shared + rng.normal(0, 1e-4, steps),
                (0, 1): 0.01 + rng.normal(0, 1e-4, steps), (1, 1): 0.015 + rng.normal(0, 1e-4, steps)}
    workers = list(per_step)
    peers = {w: [(1 - w[0], w[1])] for w in workers}
    confidence = _untraced_test(per_step, peers, workers, 0.01)
    assert confidence[(1, 1)] > 0.99 and confidence[(0, 1)] == 0.0


def test_a_sequence_signature_short_of_significance_says_how_many_microbatches_would_decide():
    """HF Trainer, dynamic padding, one microbatch per rank and step, 3 steps: compute follows the
    batches' tokens (r ~0.7 over 6 microbatches) but not at 1%; the insufficient-evidence verdict
    says so and how many more microbatches the same r would need (recomputed here)."""
    from transforms.whatif.causes.paired import correlation_p

    verdict, _ = _verdict("hf-seq-gpt2-padded")
    assert verdict.cause == "insufficient-evidence"
    r, p, needed = (verdict.evidence[k] for k in ("workload_compute_r", "sequence_p", "sequence_samples_needed"))
    df = 6 - 1 - 1                                    # 6 microbatches, one chunk's mean, the slope
    assert p == pytest.approx(correlation_p(r, df)) and p > 0.01
    assert correlation_p(r, df + needed) <= 0.01 < correlation_p(r, df + needed - 1)
    sentence = verdict.explanations["insufficient-evidence"]
    assert f"about {needed} more microbatches" in sentence and "sequence-length imbalance" in sentence


def test_the_longest_untraced_stretch_inside_a_span():
    """union_runs merges a thread's ops into disjoint runs; longest_idle gives, per span, the longest
    stretch inside it no run covers (before the first run and after the last included)."""
    from transforms.ingest.kineto.spans import longest_idle
    from transforms.intervals import union_runs

    runs = union_runs(np.array([5.0, 0.0, 1.0, 10.0, 11.0]), np.array([6.0, 2.0, 1.5, 12.0, 11.5]))
    assert runs.tolist() == [[0.0, 2.0], [5.0, 6.0], [10.0, 12.0]]
    spans = np.array([[1.0, 11.0], [0.0, 2.0], [3.0, 4.0], [11.0, 15.0], [-3.0, 1.0]])
    assert longest_idle(spans[:, 0], spans[:, 1], runs).tolist() == [4.0, 0.0, 1.0, 3.0, 3.0]
    assert longest_idle(spans[:, 0], spans[:, 1], union_runs(np.zeros(0), np.zeros(0))).tolist() == [10.0, 2.0, 1.0, 4.0, 4.0]


def test_many_timelines_at_once_give_each_timeline_s_own_covered_time_bit_for_bit():
    """covered_grouped (every lane of a stage in one call) against covered per timeline: spans of
    the timelines interleaved in any order, overlapping and nested, gaps from -inf, equal times,
    timelines without spans or gaps; the same floats, not only close ones."""
    from transforms.intervals import covered, covered_grouped

    rng = np.random.default_rng(7)
    for _ in range(200):
        groups = int(rng.integers(1, 6))
        spans = [(g, a, a + float(rng.uniform(0, 3))) for g in range(groups) for a in rng.uniform(0, 10, rng.integers(0, 8)).round(1)]
        gaps = [(g, b - float(rng.uniform(0, 4)), b) for g in range(groups) for b in rng.uniform(0, 12, rng.integers(0, 6)).round(1)]
        if gaps and rng.random() < 0.3:
            gaps[0] = (gaps[0][0], -np.inf, gaps[0][2])
        order = rng.permutation(len(spans))
        spans = [spans[i] for i in order]   # timelines interleaved; each keeps its spans' relative order below
        expected = np.zeros(len(gaps))
        for g in range(groups):
            mine = [i for i, gap in enumerate(gaps) if gap[0] == g]
            theirs = np.array([s for s in spans if s[0] == g]).reshape(-1, 3)
            expected[mine] = covered(np.array([gaps[i][1] for i in mine]), np.array([gaps[i][2] for i in mine]),
                                     theirs[:, 1], theirs[:, 2])
        gap, span = np.array(gaps).reshape(-1, 3), np.array(spans).reshape(-1, 3)
        got = covered_grouped(gap[:, 0].astype(int), gap[:, 1], gap[:, 2], span[:, 0].astype(int), span[:, 1], span[:, 2])
        assert np.array_equal(got, expected)


def test_the_compiled_covered_time_and_lane_order_equal_numpy_bit_for_bit(monkeypatch):
    """kernel.covered_grouped and kernel.group_order (what pauses uses per stage) against
    intervals.covered_grouped and np.lexsort: ties in start and end, nested and overlapping
    spans, gaps reversed or from -inf, timelines with no spans, big timelines (the merge sort past
    its 32-blocks, in and out of order). The same floats and positions, not close ones; with the
    kernel forced off, the numpy path itself."""
    from transforms.intervals import covered_grouped as numpy_covered
    from transforms.whatif import kernel

    rng = np.random.default_rng(11)
    for backend in ("kernel", "numpy"):
        monkeypatch.setenv("STRAG_REPLAY", backend)
        for trial in range(400):
            groups, spans, gaps = int(rng.integers(1, 7)), int(rng.integers(0, 400)), int(rng.integers(0, 80))
            busy_group = rng.integers(0, groups, spans)
            busy_start = rng.uniform(0, 10, spans).round(int(rng.integers(0, 3)))
            if trial % 3 == 0:   # mostly in order, as a lane's ops are
                busy_start = np.sort(busy_start) + rng.normal(0, 0.05, spans).round(2)
            busy_end = busy_start + rng.uniform(0, 3, spans).round(1)
            gap_group, gap_end = rng.integers(0, groups + 1, gaps), rng.uniform(0, 12, gaps).round(1)
            gap_start = gap_end - rng.uniform(-1, 4, gaps).round(1)
            if gaps and trial % 4 == 0:
                gap_start[0] = -np.inf
            expected = numpy_covered(gap_group, gap_start, gap_end, busy_group, busy_start, busy_end)
            got = kernel.covered_grouped(gap_group, gap_start, gap_end, busy_group, busy_start, busy_end)
            assert np.array_equal(got, expected) and not np.signbit(got).any()
            assert np.array_equal(kernel.group_order(busy_group, busy_start), np.lexsort((busy_start, busy_group)))


def test_a_collection_inside_the_forward_is_python_gc_not_a_slow_worker(tmp_path):
    """HF Trainer DDP, rank 1 collecting once per step inside its forward (a pre-hook on the middle
    decoder layer). Its peer's all-reduces wait out the pause, so rank 1's own are short, at the
    end of its backward: the two ranks must still read one way of syncing (once refused,
    raw_unmatched_comm: 3 all-reduces on rank 0, 1 on rank 1). The collection is a stretch inside
    the forward in which the thread ran no traced op (idle_within); the trainer's record puts the
    collector there (gc_within). Recorded or not, the verdict is python-gc on rank 1 and no slow
    worker: the pause is not the forward's compute."""
    import gzip

    converted, model, truth = _job("hf-gcin-r1-gpt2-packed")
    table = converted.trace.to_pandas()
    syncs = table[table.optype == "grads-reduce-scatter"].groupby(["step", "rank"]).size().unstack()
    assert (syncs[0] == syncs[1]).all()
    forward = table[table.optype == "forward-compute"]
    idle = forward.groupby(["rank", "step"]).idle_within.max().unstack()
    assert (idle.loc[1] > 0.1).all() and (idle.loc[0] < 0.02).all()
    inside = forward[forward["rank"] == 1]
    # the recorded collection lies inside that stretch: no longer than it, most of it
    assert (inside.gc_within <= inside.idle_within + 1e-3).all() and (inside.gc_within >= 0.8 * inside.idle_within).all()
    verdict, _ = _verdict("hf-gcin-r1-gpt2-packed")
    assert verdict.cause == "python-gc" and verdict.implicated_workers == [(1, 0)]
    assert "individual-worker" not in verdict.causes and verdict.evidence["gc_recorded"]
    # the same traces without the trainer's record: found from the stretch itself
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in truth["trace_files"]:
        document = json.loads(gzip.decompress((STACKS / "hf-gcin-r1-gpt2-packed" / name).read_bytes()))
        assert document.pop("strag_gc", None) is not None
        (plain / name.removesuffix(".gz")).write_text(json.dumps(document))
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif.causes import analyze_and_classify

    unrecorded = convert_kineto(sorted(str(p) for p in plain.iterdir()), "plain", "2026-11-27", {})
    assert "gc_within" not in unrecorded.trace.column_names or unrecorded.trace.column("gc_within").null_count
    found = analyze_and_classify(unrecorded.trace, unrecorded.job_meta(), "plain")[1]
    assert found.cause == "python-gc" and found.implicated_workers == [(1, 0)] and not found.evidence["gc_recorded"]
    assert "individual-worker" not in found.causes
    assert "inside a forward" in found.explanations["python-gc"]


@pytest.mark.parametrize("run", ["gc-r0-izb-dpmajor-flat-mlp-sleep", "g-dp4-async-mesh-mlp-sleep-gc-r0"])
def test_a_collection_in_every_microbatch_is_python_gc_not_a_slow_machine(run):
    """Hand-written loops (tests/data/real_runs), gc.collect() of a live heap at the start of every
    chunk forward on rank 0: several collections a step, each ~10-30 ms and none worth the straggling
    share of a step alone. Their sum per step is (the collector stops the world once per
    collection); they sit inside rank 0's forwards (an interleaved pipeline: `idle_within`) or end
    where they begin (DDP: the gap before them). The worker test measures the forwards without the
    stretches that ran no op: rank 0's ops run at its peers' pace, so it is no slow machine; the
    cause is python-gc on rank 0, in most steps."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif import compile_job
    from transforms.whatif.causes import analyze_and_classify
    from transforms.whatif.causes.pauses import at_collector_sites, collector, find_pauses

    folder = pathlib.Path(__file__).parent / "data" / "real_runs" / run
    truth = json.loads((folder / "truth.json").read_text())
    converted = convert_kineto([str(folder / f) for f in truth["trace_files"]], run, "2026-11-27", {})
    model = compile_job(converted.trace, converted.job_meta(), run)
    pauses = find_pauses(model)
    assert pauses.workers() == [(0, 0)] and len({s for *_, s, _ in pauses.cells}) >= 2
    assert at_collector_sites(model, pauses) and collector(model, pauses)
    per_cell = {}
    for (op, lane) in pauses.where:
        per_cell[lane] = per_cell.get(lane, 0) + 1
    assert max(per_cell.values()) >= 2                                # several pauses in one step
    verdict = analyze_and_classify(converted.trace, converted.job_meta(), run)[1]
    assert verdict.cause == "python-gc" and verdict.implicated_workers == [(0, 0)]
    assert "individual-worker" not in verdict.causes
    slow = {(f["dp_rank"], f["stage"]) for f in verdict.evidence["worker_test"]["slow"]}
    assert (0, 0) not in slow                                         # its ops ran at its peers' pace
