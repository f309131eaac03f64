"""How the training stacks people use nest their work, read from the spans torch.profiler records:
an optimizer step that runs the model in its closure (PyTorch Lightning), ProfilerSteps that are
not iterations (Lightning's PyTorchProfiler, a ProfilerStep per accumulated batch), several tensors
crossing one pipeline boundary per microbatch (the tracer frontend), a job of one process, and the
evidence every result states. The real runs of each stack are in tests/data/real_stacks (see
test_real_stacks_* below and tools/real_stacks/README.md)."""
from __future__ import annotations

import gzip
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from transforms.ingest.kineto.compute import optimizer_work
from transforms.ingest.kineto.events import CpuOps
from transforms.ingest.kineto.rank import _from_gradients_ready, _iterations, _one_transfer_per_batch
from transforms.ingest.kineto.spans import COLL, RECV, SEND

from conftest import SHARED

STACKS = pathlib.Path(__file__).parent / "data" / "real_stacks"
WORLD1 = SHARED / "traces" / "hta" / "world1_rank0.json.gz"


def _ops(*ops) -> CpuOps:
    return CpuOps.from_tuples([(float(s), float(e), name, 1) for s, e, name in ops])


# --- an optimizer step that runs the model in its closure -------------------------------------------

def test_the_optimizer_starts_after_the_closure_it_ran():
    """Lightning's automatic optimization: optimizer.step(closure) runs the forward, the backward
    (whose DDP hook issues the all-reduce) and DDP's bucket copies, then the optimizer's own ops."""
    ops = _ops((0, 100, "Optimizer.step#AdamW.step"),
               (2, 20, "DistributedDataParallel.forward"), (3, 18, "aten::linear"),
               (25, 50, "autograd::engine::evaluate_function: AddmmBackward0"),
               (45, 47, "c10d::allreduce_"), (46, 70, "gloo:all_reduce"),
               (71, 72, "torch.distributed.ddp.reducer::copy_bucket_to_grad"),
               (75, 80, "aten::add_"), (81, 90, "aten::addcdiv_"))
    flows = np.array([3.5])   # autograd recorded the forward's linear
    assert optimizer_work([(0.0, 100.0)], ops, flows) == [(72.0, 100.0)]
    # the all-reduce was issued before the backward ended: its wait is the closure's, not the optimizer's
    assert optimizer_work([(0.0, 100.0)], ops, np.zeros(0)) == [(72.0, 100.0)]


def test_an_optimizer_step_without_a_closure_is_unchanged():
    ops = _ops((0, 10, "autograd::engine::evaluate_function: MmBackward0"), (20, 40, "Optimizer.step#SGD.step"),
               (21, 30, "aten::add_"), (31, 39, "c10d::allreduce_"))   # a collective the optimizer itself issues
    assert optimizer_work([(20.0, 40.0)], ops, np.array([1.0])) == [(20.0, 40.0)]


def test_the_optimizer_step_holds_the_update_s_preparation_after_the_gradients_are_ready():
    """Hugging Face's Trainer copies DDP's buckets back, logs the loss and clips the gradients between
    the backward and Optimizer.step: that prepares the update (Megatron's step clips too), so it is
    the optimizer's; the wait for the gradient all-reduce before it is not."""
    main = _ops((0, 10, "autograd::engine::evaluate_function: MmBackward0"),
                (9, 9.5, "c10d::allreduce_"),
                (16, 17, "torch.distributed.ddp.reducer::copy_bucket_to_grad"),
                (18, 20, "aten::_foreach_norm"), (22, 30, "Optimizer.step#AdamW.step"), (23, 29, "aten::add_"))
    spans = [(1, 0.0, 10.0, -1, -1, 0, 0.0)]                           # the backward compute
    comm = [(COLL, 9.6, 15.0, -1, "all_reduce", "dp", -1, -1)]           # its all-reduce, waited until 15
    assert _from_gradients_ready([(22.0, 30.0)], main, spans, comm) == [(16.0, 30.0)]
    # nothing between the gradients and the step: unchanged; a second iteration reads only its own ends
    bare = _ops((0, 10, "autograd::engine::evaluate_function: MmBackward0"), (12, 20, "Optimizer.step#SGD.step"))
    assert _from_gradients_ready([(12.0, 20.0)], bare, spans, []) == [(12.0, 20.0)]
    two = _ops((0, 10, "autograd::engine::evaluate_function: MmBackward0"), (12, 20, "Optimizer.step#SGD.step"),
               (30, 40, "autograd::engine::evaluate_function: MmBackward0"), (41, 42, "aten::_foreach_norm"),
               (43, 50, "Optimizer.step#SGD.step"))
    spans2 = [(1, 0.0, 10.0, -1, -1, 0, 0.0), (1, 30.0, 40.0, -1, -1, 0, 30.0)]
    assert _from_gradients_ready([(12.0, 20.0), (43.0, 50.0)], two, spans2, []) == [(12.0, 20.0), (41.0, 50.0)]


# --- ProfilerSteps that are not iterations -----------------------------------------------------------

def test_profiler_steps_that_are_iterations_stay():
    steps = {2: (0.0, 10.0), 3: (10.0, 20.0)}
    optimizer = [(8.0, 9.5), (18.0, 19.5)]
    forward, backward = np.array([1.0, 11.0]), np.array([4.0, 14.0])
    assert _iterations(steps, optimizer, ["t", "t"], "t", forward, backward) == steps


def test_two_optimizers_per_iteration_keep_the_steps():
    """A dense and a sparse optimizer step one after the other in each ProfilerStep."""
    steps = {551: (0.0, 10.0), 552: (10.0, 20.0)}
    optimizer = [(7.0, 8.0), (8.5, 9.5), (17.0, 18.0), (18.5, 19.5)]
    assert _iterations(steps, optimizer, ["t"] * 4, "t", np.array([1.0, 11.0]), np.array([4.0, 14.0])) == steps


def test_lightning_profiler_steps_end_mid_iteration():
    """Lightning's PyTorchProfiler ends a ProfilerStep when training_step returns: the iteration's
    backward and optimizer step fall in the next one. Iterations then run between optimizer steps,
    and the first, whose forward came before the profile, is left out."""
    steps = {2: (0.0, 10.0), 3: (10.0, 20.0), 4: (20.0, 30.0)}
    # step 2 holds the backward of an iteration whose forward was before the trace, its optimizer
    # step, then the next forward; and so on
    forward = np.array([7.0, 17.0, 27.0])
    backward = np.array([1.0, 11.0, 21.0])
    optimizer = [(4.0, 5.0), (14.0, 15.0), (24.0, 25.0)]
    got = _iterations(steps, optimizer, ["t"] * 3, "t", forward, backward)
    assert got == {3: (5.0, 15.0), 4: (15.0, 25.0)}


def test_a_profiler_step_per_accumulated_batch_makes_one_iteration_of_several():
    """accumulate_grad_batches=2 with a callback stepping the profiler per batch: a ProfilerStep per
    microbatch, only every other one holding an optimizer step."""
    steps = {2: (0.0, 10.0), 3: (10.0, 20.0), 4: (20.0, 30.0), 5: (30.0, 40.0)}
    forward = np.array([1.0, 11.0, 21.0, 31.0])
    backward = np.array([5.0, 15.0, 25.0, 35.0])
    optimizer = [(18.0, 19.0), (38.0, 39.0)]
    got = _iterations(steps, optimizer, ["t"] * 2, "t", forward, backward)
    assert got == {3: (0.0, 19.0), 5: (19.0, 39.0)}


def test_lightning_s_profiler_under_accumulation_keeps_the_iteration_a_zero_grad_opens():
    """Lightning's PyTorchProfiler, accumulate_grad_batches=2 (the layout of the committed run
    lightning-clean-mlp-plprof-acc2-s1, in tenths of its milliseconds): the first ProfilerStep holds
    the backward of a microbatch whose forward came before the profile, its optimizer step (whose
    `Optimizer.step` span began before the profile, so the trace lacks it), then the next batch's
    fetch and forward. Lightning zero-grads between that forward and its backward, so the iteration
    ending at the one recorded optimizer step is the work from that fetch on: it is whole."""
    steps = {2: (0.0, 22.1), 3: (22.1, 33.5), 4: (33.5, 52.3)}
    forward = np.array([19.5, 30.7, 49.8])        # b, c (inside Optimizer.step: the closure), d
    backward = np.array([0.1, 22.2, 33.6])       # a (forward before the profile), b, c
    optimizer = [(30.6, 49.2)]
    zero_grads = np.array([22.18])
    fetches = np.array([18.9, 30.3, 49.4])
    got = _iterations(steps, optimizer, ["t"], "t", forward, backward, zero_grads, fetches)
    assert got == {4: (18.9, 49.2)}
    # without the zero_grad nothing tells the optimizer step before the forward from none: left out
    assert _iterations(steps, optimizer, ["t"], "t", forward, backward) == {}
    # a zero_grad before the first backward of the profile says nothing of the work before it
    assert _iterations(steps, optimizer, ["t"], "t", forward, backward, np.array([0.05]), fetches) == {}


def test_a_zero_grad_after_the_optimizer_step_does_not_make_a_partial_iteration_whole():
    """A plain loop (step, then zero_grad), a ProfilerStep per accumulated batch, the profile
    beginning at a second batch: the first iteration's zero_grad came before the profile, so it
    still lacks a microbatch and is left out."""
    steps = {3: (0.0, 10.0), 4: (10.0, 20.0), 5: (20.0, 30.0), 6: (30.0, 40.0), 7: (40.0, 50.0)}
    forward = np.array([1.0, 11.0, 21.0, 31.0, 41.0])
    backward = np.array([5.0, 15.0, 25.0, 35.0, 45.0])
    optimizer = [(8.0, 9.0), (28.0, 29.0), (48.0, 49.0)]
    zero_grads = np.array([9.2, 29.2, 49.2])
    got = _iterations(steps, optimizer, ["t"] * 3, "t", forward, backward, zero_grads, np.array([0.5, 10.5, 20.5]))
    assert got == {5: (9.0, 29.0), 7: (29.0, 49.0)}


def test_a_lightning_profile_of_three_microbatch_steps_under_accumulation_is_read(tmp_path):
    """The committed run that was refused ("the 3 ProfilerSteps hold no whole training iteration"):
    one iteration of two microbatches per rank, its gradient all-reduces and optimizer, replayed
    within 5% of what ran."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif import analyze_job

    run = STACKS / "lightning-clean-mlp-plprof-acc2-s1"
    truth = json.loads((run / "truth.json").read_text())
    converted = convert_kineto([str(run / name) for name in truth["trace_files"]], run.name, "2026-11-28", {})
    table = converted.trace.to_pandas()
    assert table.step.nunique() == 1
    for _, ops in table.groupby("rank"):
        kinds = ops.optype.tolist()
        assert kinds.count("forward-compute") == kinds.count("backward-compute") == truth["microbatches"]
        assert kinds.count("optimizer") == 1
    result = analyze_job(converted.trace, converted.job_meta(), run.name)
    assert 1 / 1.05 <= result.replay_discrepancy <= 1.05


def test_a_profile_begun_mid_iteration_gives_its_first_iteration_the_others_preamble():
    """Lightning broadcasts whether to stop after every optimizer step, before the next batch fetch.
    The first iteration of a profile begun mid-iteration starts at its fetch (the optimizer step
    before it is unseen), so its broadcast fell outside it and its structure differed from the
    others' (one collective fewer): the step was dropped. Its start moves back over the collectives
    the other iterations issue between their start and their first model work."""
    from transforms.ingest.kineto.rank import _with_preamble

    steps = {3: (21.4, 44.6), 4: (44.6, 64.6)}            # begun at the fetch 21.4; 44.6: optimizer end
    all_reduce = lambda t: (COLL, t, t + 1.0, -1, "all_reduce", "dp", -1, -1)
    broadcast = lambda t: (COLL, t, t + 0.1, -1, "broadcast", "dp", -1, -1)
    comm = [all_reduce(10.9), broadcast(21.3), all_reduce(37.9), broadcast(44.7), all_reduce(57.1)]
    issued = [span[1] for span in comm]
    forward, fetches = np.array([21.8, 45.1]), np.array([21.4, 44.8])
    backward = np.array([0.1, 18.3, 25.0, 48.3])          # the previous iteration's last at 18.3
    known = [0.0, 44.6, 64.6]                            # the profile's start, the optimizer steps' ends
    got = _with_preamble(steps, known, comm, issued, forward, fetches, backward)
    assert got == {3: (21.3, 44.6), 4: (44.6, 64.6)}
    # a first iteration that starts with the profile or at an optimizer step's end, or already holds
    # the preamble, stays
    assert _with_preamble(steps, [21.4, 44.6, 64.6], comm, issued, forward, fetches, backward) == steps
    assert _with_preamble(steps, [0.0, 21.4, 44.6, 64.6], comm, issued, forward, fetches, backward) == steps
    assert _with_preamble(got, known, comm, issued, forward, fetches, backward) == got
    # no preamble collective after the previous iteration's backward: nothing to move over
    assert _with_preamble(steps, known, comm[:1] + comm[2:], issued[:1] + issued[2:], forward, fetches, backward) == steps
    # another collective there (the previous backward's all-reduce) is not the preamble
    other = comm[:1] + [all_reduce(21.3)] + comm[2:]
    assert _with_preamble(steps, known, other, issued, forward, fetches, backward) == steps


def test_a_lightning_profile_of_three_active_steps_keeps_both_whole_iterations():
    """The committed run lightning-bwd2-r0-mlp-plprof (Lightning's PyTorchProfiler, active=3): its
    ProfilerSteps 2..4 hold iterations 3 and 4 whole, with the same ops (the preamble's broadcast
    in both); both are kept, replayed within 5% of what ran."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif import analyze_job

    run = STACKS / "lightning-bwd2-r0-mlp-plprof"
    truth = json.loads((run / "truth.json").read_text())
    converted = convert_kineto([str(run / name) for name in truth["trace_files"]], run.name, "2026-11-28", {})
    table = converted.trace.to_pandas()
    assert sorted(table.step.unique().tolist()) == [3, 4]
    counts = table.groupby(["rank", "step"]).optype.apply(lambda kinds: tuple(sorted(kinds)))
    assert counts.nunique() == 1, counts
    result = analyze_job(converted.trace, converted.job_meta(), run.name)
    assert 1 / 1.05 <= result.replay_discrepancy <= 1.05


# --- several tensors across one pipeline boundary ----------------------------------------------------

def _send(start, end, peer=1):
    return (SEND, float(start), float(end), peer, "send", "pp", -1, -1)


def test_the_tensors_one_batch_sends_to_a_peer_are_one_transfer():
    """The tracer frontend sends hidden states, cos, sin and the mask of one microbatch apart, in one
    batch; the next microbatch's sends come after its forward."""
    comm = [_send(0, 30), _send(1, 31), _send(2, 29), _send(3, 33),          # microbatch 0
            _send(50, 70), _send(51, 72),                                    # microbatch 1
            (COLL, 80.0, 90.0, -1, "all_reduce", "dp", -1, -1)]
    calls = [("send", float(s), float(s) + 0.5, 1) for s in (0, 1, 2, 3, 50, 51)]
    main = _ops((0, 0.5, "c10d::send"), (0.1, 0.2, "aten::empty"), (1, 1.5, "c10d::send"), (2, 2.5, "c10d::send"),
                (3, 3.5, "c10d::send"), (10, 45, "aten::linear"), (50, 50.5, "c10d::send"), (51, 51.5, "c10d::send"))
    got = _one_transfer_per_batch(comm, main, calls, [])
    assert [(k, s, e) for k, s, e, *_ in got] == [(SEND, 0.0, 33.0), (SEND, 50.0, 72.0), (COLL, 80.0, 90.0)]


def test_sends_to_other_peers_or_under_other_actions_stay_apart():
    comm = [_send(0, 30, peer=1), _send(1, 31, peer=3), (RECV, 2.0, 20.0, 1, "recv", "pp", -1, -1),
            _send(3, 33, peer=1)]
    calls = [("send", 0.0, 0.5, 1), ("send", 1.0, 1.5, 1), ("recv", 2.0, 2.5, 1), ("send", 3.0, 3.5, 1)]
    main = _ops((0, 0.5, "c10d::send"), (1, 1.5, "c10d::send"), (2, 2.5, "c10d::recv_"), (3, 3.5, "c10d::send"))
    # a schedule's action labels: the send at 3 belongs to another action (another stage or microbatch)
    labels = [(0.0, 2.8, 1, 0), (2.9, 4.0, 1, 2)]
    got = _one_transfer_per_batch(comm, main, calls, labels)
    assert len(got) == 4
    merged = _one_transfer_per_batch(comm, main, calls, [])
    assert [(k, s, e, p) for k, s, e, p, *_ in merged] == [(SEND, 0.0, 33.0, 1), (SEND, 1.0, 31.0, 3), (RECV, 2.0, 20.0, 1)]


# --- one process, and the evidence of every result ---------------------------------------------------

def _analyze(folder: pathlib.Path, out: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", "analyze", str(folder), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)


def test_a_trace_of_one_process_is_a_job_of_one_rank_and_says_what_that_cannot_show(tmp_path):
    if not WORLD1.is_file():
        pytest.skip(f"{WORLD1} not found: clone the project with ../shared beside it")
    for name, document in (("with-info", None), ("no-process-group", "strip")):
        folder = tmp_path / name
        folder.mkdir()
        if document is None:
            shutil.copy(WORLD1, folder / "rank-0.json.gz")
        else:   # the same GPU trace as a script without torch.distributed records it
            doc = json.loads(gzip.decompress(WORLD1.read_bytes()))
            doc.pop("distributedInfo")
            (folder / "trace.json").write_text(json.dumps(doc))
        done = _analyze(folder, tmp_path / f"{name}.json")
        assert done.returncode == 0, done.stderr
        assert "dp 1 x pp 1 workers" in done.stdout and "evidence: " in done.stdout
        assert "cannot show: one rank" in done.stdout
        evidence = json.loads((tmp_path / f"{name}.json").read_text())["evidence"]
        assert evidence["dp_peers"] == 0 and evidence["stages"] == 1 and evidence["steps"] >= 1
        assert evidence["microbatches"] >= 1 and evidence["limits"][0].startswith("one rank")


def test_a_profile_without_an_optimizer_step_is_refused_with_the_setting_that_fixes_it(tmp_path):
    """Every ProfilerStep is there, but no step holds the optimizer's range: the advice names the
    optimizer step (or optimizer_label), not 'profile more steps'."""
    from transforms.ingest.common import RawInputError
    from transforms.ingest.kineto import convert_kineto

    run = pathlib.Path(__file__).parent / "data" / "real_runs" / "dp4-ddp-sleep"
    truth = json.loads((run / "truth.json").read_text())
    paths = []
    for name in truth["trace_files"]:
        document = json.loads(gzip.decompress((run / name).read_bytes()))
        document["traceEvents"] = [e for e in document["traceEvents"]
                                   if not str(e.get("name", "")).startswith("Optimizer.step")]
        paths.append(tmp_path / name.replace(".gz", ""))
        paths[-1].write_text(json.dumps(document))
    with pytest.raises(RawInputError) as error:
        convert_kineto([str(p) for p in paths], "no-optimizer", "2026-11-27", {})
    assert error.value.reason_code == "raw_no_steps"
    assert "no profiled step holds an optimizer step" in str(error.value) and "optimizer_label" in str(error.value)
    assert "profile more active steps" not in str(error.value)
    assert "has no optimizer in it" in str(error.value)


# --- the real runs of each stack (tools/real_stacks, committed subset) --------------------------------

def _stack_runs() -> list[pathlib.Path]:
    return sorted(p.parent for p in STACKS.glob("*/truth.json"))


def test_the_committed_stack_runs_cover_every_stack():
    stacks = {json.loads((run / "truth.json").read_text())["stack"] for run in _stack_runs()}
    assert {"lightning", "hf-trainer", "accelerate", "pipe-tracer"} <= stacks, stacks


@pytest.mark.parametrize("run", _stack_runs(), ids=lambda p: p.name)
def test_every_stack_run_is_read_with_its_microbatches(run):
    """No stack's run is refused; every kept step holds one optimizer op per rank and, on every rank,
    forward and backward compute (FSDP2's in-compute all-gathers cut a microbatch's compute into
    pieces, so the counts of forward and backward pieces may differ)."""
    from transforms.ingest.kineto import convert_kineto

    truth = json.loads((run / "truth.json").read_text())
    converted = convert_kineto([str(run / name) for name in truth["trace_files"]], run.name, "2026-11-27", {})
    table = converted.trace.to_pandas()
    counts = table.groupby("step").optype.value_counts().unstack(fill_value=0)
    assert len(counts) >= 1
    assert (counts["optimizer"] == truth["world"]).all(), counts
    per_rank = table.groupby(["step", "rank"]).optype.value_counts().unstack(fill_value=0)
    assert len(per_rank) == len(counts) * truth["world"]
    assert (per_rank["forward-compute"] > 0).all() and (per_rank["backward-compute"] > 0).all(), per_rank
    # the evidence counts microbatches, not the pieces FSDP2's all-gathers cut them into
    from transforms.whatif import analyze_job

    evidence = analyze_job(converted.trace, converted.job_meta(), run.name).evidence
    assert evidence.steps == len(counts) and evidence.dp_peers == truth["dp"] - 1 and evidence.stages == truth["pp"]
    if truth.get("microbatches") and truth.get("pp", 1) == 1:
        assert evidence.microbatches == truth["microbatches"], evidence


def test_a_gloo_collective_belongs_to_the_step_and_place_its_c10d_call_issued_it():
    """ScheduleInterleavedZeroBubble with FSDP2 (pp2 x dp2, CPU, gloo): each step unshards both local
    chunks (two `PP:sUNSHARD` all-gathers, issued before the step's first compute). gloo runs a
    collective on a thread of its own, which may start the second one after the first compute began,
    or after the step that issued it ended. Read by when its c10d call (`c10d::_allgather_base_`)
    issued it, every profiled step keeps both as params-all-gathers on every rank; read by the gloo
    span's start, the steps' structures differed between ranks and two of the three were dropped (a
    larger run was refused: params-all-gather ops per DP rank differ)."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.ingest.kineto.rank import parse_rank_bytes
    from transforms.ingest.kineto.spans import COLL

    run = STACKS / "pipe-clean-izb-pp2dp2-fsdp2-s0"
    truth = json.loads((run / "truth.json").read_text())
    paths = [str(run / name) for name in truth["trace_files"]]
    later = 0
    for path in paths:
        trace = parse_rank_bytes(path, gzip.decompress(pathlib.Path(path).read_bytes()))
        gathers = (trace.kind == COLL) & (trace.coll == "all_gather")
        assert gathers.sum() == 2 * len(trace.steps)
        assert (trace.issued[gathers] < trace.start[gathers]).all()   # the call, before its gloo span
        later += int((trace.start[gathers] - trace.issued[gathers] > 200.0).sum())
    assert later >= 1   # some gloo span began well (> 0.2 ms) after its call
    converted = convert_kineto(paths, run.name, "2026-11-29", {})
    assert not converted.source.get("steps_dropped")
    table = converted.trace.to_pandas()
    assert table.step.nunique() == 3
    gathers = table[table.optype == "params-all-gather"].groupby(["step", "rank"]).size()
    assert len(gathers) == 3 * truth["world"] and (gathers == 2).all(), gathers


@pytest.mark.parametrize("name", ["ck-hf-clean-llama-packed-gc1", "cc-hf-clean-gpt2-packed-compile"])
def test_gradient_checkpointing_and_torch_compile_read_as_any_trainer_step(name):
    """transformers' Trainer with gradient_checkpointing=True (each decoder layer's forward runs again
    inside its backward: those recomputed ops are the backward's) and with torch_compile=True (the
    model's ops inside compiled graphs): one forward and one backward per rank and step, the replay
    within METHOD.md's 5% of what ran, and on these clean runs no worker or cause is blamed."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif.causes import analyze_and_classify

    run = STACKS / name
    truth = json.loads((run / "truth.json").read_text())
    assert truth["slowdowns"] == [] and truth["stack_details"]["training_args"][
        "gradient_checkpointing" if name.startswith("ck") else "torch_compile"] is True
    converted = convert_kineto([str(run / f) for f in truth["trace_files"]], name, "2026-11-27", {})
    per_rank = converted.trace.to_pandas().groupby(["step", "rank"]).optype.value_counts().unstack(fill_value=0)
    assert (per_rank["forward-compute"] == 1).all() and (per_rank["backward-compute"] == 1).all(), per_rank
    result, verdict = analyze_and_classify(converted.trace, converted.job_meta(), name)
    assert not result.discarded, result.replay_discrepancy
    assert verdict.cause in ("none", "insufficient-evidence") and not verdict.implicated_workers, (verdict.cause, verdict.implicated_workers)


def test_a_profile_begun_at_an_accumulated_batch_s_second_microbatch_drops_that_iteration():
    """A ProfilerStep per batch, two batches per iteration, the profile beginning at a second batch:
    its first iteration holds one ProfilerStep where the others hold two, and lacks a microbatch."""
    steps = {3: (0.0, 10.0), 4: (10.0, 20.0), 5: (20.0, 30.0), 6: (30.0, 40.0), 7: (40.0, 50.0)}
    forward = np.array([1.0, 11.0, 21.0, 31.0, 41.0])
    backward = np.array([5.0, 15.0, 25.0, 35.0, 45.0])
    optimizer = [(8.0, 9.0), (28.0, 29.0), (48.0, 49.0)]
    got = _iterations(steps, optimizer, ["t"] * 3, "t", forward, backward)
    assert got == {5: (9.0, 29.0), 7: (29.0, 49.0)}


# --- gradient syncs the compute waits out (FSDP2 on CPU ranks) --------------------------------------

def _sync(start, end):
    return (COLL, float(start), float(end), -1, "all_reduce", "dp", -1, -1)


def test_a_gradient_sync_the_backward_waits_out_is_cut_from_the_compute():
    """FSDP2 reduce-scatters each layer's gradients inside the backward and, on a CPU rank, the
    thread blocks until its DP peers join: the wait is the collective's, not the backward's; the
    root's sync after the backward ends is the step's gradient sync, as before."""
    from transforms.ingest.kineto.compute import BWD, waited_collectives

    ops = _ops((0, 100, "autograd::engine::evaluate_function: AddBackward0"), (0, 20, "aten::mm"),
               (20, 60, "autograd::engine::evaluate_function: RegisterPostBackwardFunctionBackward"),
               (21, 22, "c10d::_reduce_scatter_base_"), (58, 59, "aten::chunk"), (60, 100, "aten::mm"),
               (130, 131, "c10d::_reduce_scatter_base_"))
    labels = [(BWD, 0.0, 100.0, -1, -1, "backward")]
    comm = [_sync(22, 57), _sync(131, 150)]
    assert waited_collectives(comm, [22.0, 131.0], ops, labels) == [True, False]


def test_ddp_s_all_reduce_beside_the_backward_s_ops_is_not_a_wait():
    """DDP's bucketed all-reduce runs on gloo's threads while the backward goes on computing."""
    from transforms.ingest.kineto.compute import BWD, waited_collectives

    ops = _ops((0, 100, "autograd::engine::evaluate_function: AddmmBackward0"), *[(t, t + 4, "aten::mm") for t in range(0, 100, 5)])
    labels = [(BWD, 0.0, 100.0, -1, -1, "backward")]
    comm = [_sync(20, 50), _sync(55, 80)]
    assert waited_collectives(comm, [20.0, 55.0], ops, labels) == [False, False]
    # in a pipeline the compute stays whole (its p2p serve whole microbatches)
    idle = _ops((0, 100, "autograd::engine::evaluate_function: AddmmBackward0"))
    assert waited_collectives(comm, [20.0, 55.0], idle, labels) == [True, True]
    assert waited_collectives(comm + [(SEND, 101.0, 102.0, 1, "", "pp", 1, -1)], [20.0, 55.0, 101.0], idle, labels) == \
        [False, False, False]


def test_a_ddp_hook_that_now_and_then_holds_its_all_reduce_does_not_cut_the_backward():
    """DDP issues its all-reduces after the backward or beside it; now and then the AccumulateGrad
    hook that issues the last bucket's holds the collective's whole span (a HF Trainer run: 1-3 of
    its 18 syncs). Cutting the backward there gave that one step another structure, and the step was
    dropped; the rank waits out too few of its syncs for that to be how it syncs. FSDP2 waits out
    80-89% of its syncs (each layer's reduce-scatter), and those are cut as before."""
    from transforms.ingest.kineto.compute import BWD, waited_collectives

    held = [(0, 100, "autograd::engine::evaluate_function: AddmmBackward0"),
            (80, 99, "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"),
            (81, 82, "c10d::allreduce_")]
    after = [(200 * k + 110, 200 * k + 111, "c10d::allreduce_") for k in range(3)]
    ops = _ops(*held, *after)
    labels = [(BWD, 0.0, 100.0, -1, -1, "backward")] + [(BWD, 200.0 * k, 200.0 * k + 100, -1, -1, "backward")
                                                         for k in (1, 2)]
    comm = [_sync(82, 97)] + [_sync(200 * k + 111, 200 * k + 130) for k in range(3)]
    issued = [82.0] + [200.0 * k + 111 for k in range(3)]
    assert waited_collectives(comm, issued, ops, labels) == [False] * 4
    # alone (the rank's only sync) it is how the rank syncs
    assert waited_collectives(comm[:1], issued[:1], ops, labels[:1]) == [True]


def test_an_fsdp2_run_syncs_its_dp_ranks_between_the_layers_of_its_backward():
    """The committed FSDP2 run: every rank cuts its backward at the same per-layer syncs, so the
    ranks agree op for op and the fast rank's backward no longer holds its wait for the slow one."""
    from transforms.ingest.kineto import convert_kineto

    run = STACKS / "fsdp2-fwd2-r1-llama-packed"
    truth = json.loads((run / "truth.json").read_text())
    converted = convert_kineto([str(run / name) for name in truth["trace_files"]], run.name, "2026-11-27", {})
    table = converted.trace.to_pandas().sort_values("start_ts")
    per_rank = table.groupby(["step", "rank"]).optype.value_counts().unstack(fill_value=0)
    assert (per_rank.groupby("step").nunique() == 1).all().all(), per_rank   # ranks agree op for op
    # every layer's gradient sync is waited out inside the backward: one sync (the root's) is left
    # for the step's end
    assert (per_rank["grads-reduce-scatter"] == 1).all(), per_rank
    # group collectives between backward pieces: the backward is cut at the syncs it waited out
    for (step, rank), ops in table.groupby(["step", "rank"]):
        kinds = ops.optype.tolist()
        first_bwd = kinds.index("backward-compute")
        assert "group-collective" in kinds[first_bwd:kinds.index("optimizer")], kinds
        assert kinds[first_bwd:].count("backward-compute") >= 2


def test_a_lightning_profile_too_short_for_one_iteration_says_how_many_steps_would_do(tmp_path):
    """Lightning's profiler, one ProfilerStep kept: it holds the end of one iteration and the start
    of the next, no whole one. The refusal counts what it holds and names how many active steps
    would hold a whole iteration (twice the ProfilerSteps of one, and one more)."""
    from transforms.ingest.common import RawInputError
    from transforms.ingest.kineto import convert_kineto

    run = STACKS / "lightning-bwd2-r0-mlp-plprof"
    truth = json.loads((run / "truth.json").read_text())
    paths = []
    for name in truth["trace_files"]:
        document = json.loads(gzip.decompress((run / name).read_bytes()))
        events = document["traceEvents"]
        first = min((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
        start, end = first["ts"], first["ts"] + first["dur"]
        document["traceEvents"] = [e for e in events if e.get("ph") != "X" or start <= e["ts"] <= end]
        paths.append(tmp_path / name.replace(".gz", ""))
        paths[-1].write_text(json.dumps(document))
    with pytest.raises(RawInputError) as error:
        convert_kineto([str(p) for p in paths], "one-step", "2026-11-27", {})
    assert error.value.reason_code == "raw_no_steps"
    assert "the 1 ProfilerStep holds no whole training iteration" in str(error.value)
    assert "with 1 optimizer step(s) in all" in str(error.value) and "profile at least 3 active steps" in str(error.value)


def test_a_vocabulary_sized_lm_head_is_a_heavier_stage_not_a_slower_machine():
    """A clean 1F1B pipeline of two stages whose last holds a 32,000-token LM head: one 16 ms matmul
    among ~400 recorded operations of ~10 us. Seconds per recorded operation read that stage ~1.3x
    slower than the other (a slow machine, at the chunk-balance rule's margin); compared by
    identity, the operations both stages run take the same time on each (pace within 10%), so the
    extra time is work: the verdict is stage imbalance, no worker blamed."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif import compile_job
    from transforms.whatif.causes import analyze_and_classify
    from transforms.whatif.causes.signals import chunk_work

    run = STACKS / "pipe-clean-1f1b-pp2-v32k"
    truth = json.loads((run / "truth.json").read_text())
    converted = convert_kineto([str(run / name) for name in truth["trace_files"]], run.name, "2026-11-29", {})
    table = converted.trace.to_pandas()
    compute = table[table.optype.astype(str).str.endswith("compute")]
    assert compute.pace.notna().all() and table[~table.index.isin(compute.index)].pace.isna().all()
    model = compile_job(converted.trace, converted.job_meta(), run.name)
    work = chunk_work(converted.trace, model)
    per_operation = [s / o for s, o in ((work.seconds_forward, work.ops_forward), (work.seconds_backward, work.ops_backward))]
    assert max(float(p[1] / np.median(p)) for p in per_operation) > 1.2      # the count alone: a slower machine
    ratio, speed = work.of([1])
    assert ratio > 1.1 and speed < 1.1                                        # by identity: more work, same pace
    _, verdict = analyze_and_classify(converted.trace, converted.job_meta(), run.name)
    assert verdict.cause == "stage-imbalance" and verdict.implicated_workers == [], verdict.explanations


def test_a_heavier_first_stage_is_stage_imbalance_even_where_evening_it_gains_little():
    """Four stages, stage 0 with three times the decoder layers (6 + 2 + 2 + 2), 1F1B over 4
    micro-batches: its chunk records ~2.9x the median chunk's operations at the usual pace, and M_W
    blames its worker. Evening the layers replays barely faster (the stages that would take them on
    lie on the critical path too), under the 3% a change must save; the partition is measured all
    the same (as a slow machine is against its peers), so the verdict is stage imbalance, no worker
    blamed, with the small saving stated, never "none" or a transient."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif.causes import CauseRules, analyze_and_classify

    run = STACKS / "p6-pipe-split-1f1b-pp4-a3"
    truth = json.loads((run / "truth.json").read_text())
    converted = convert_kineto([str(run / name) for name in truth["trace_files"]], run.name, "2026-11-29", {})
    result, verdict = analyze_and_classify(converted.trace, converted.job_meta(), run.name)
    evidence, fix = verdict.evidence, verdict.fixes["stage-imbalance"]
    assert result.slowdown >= 1.1 and not result.discarded
    assert evidence["heaviest_chunk"] == [0, 0] and evidence["chunk_work_ratio"] > 2.5 and evidence["chunk_speed_ratio"] < 1.0
    assert fix.savings_fraction < CauseRules.min_savings <= evidence["stage_idealised_explained"]   # its fix alone gains little
    assert verdict.cause == "stage-imbalance" and verdict.implicated_workers == [], verdict.explanations
    assert "a heavier partition, not a slower machine" in verdict.explanation and "gains little" in verdict.explanation


def test_a_stage_s_recorded_collections_are_the_collector_s_not_a_slow_machine_s():
    """Interleaved 1F1B on two stages without DP peers (torch 2.15), rank 1 collecting 27-72 ms at the
    first forward of every step, recorded by the GC record: the collections stretch that chunk's
    forwards, which read as a machine slow in forward against its balance (4 of 4 steps) and a chunk
    1.9x the median's compute. Taken out of the compute the balance test and the chunks' balance
    measure (only where they make a pause), the verdict is python-gc on rank 1 alone, no slow worker."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif.causes import analyze_and_classify

    run = STACKS / "p7-pipe-gc-r1-interleaved-pp2-a4"
    truth = json.loads((run / "truth.json").read_text())
    converted = convert_kineto([str(run / name) for name in truth["trace_files"]], run.name, "2026-11-30", {})
    result, verdict = analyze_and_classify(converted.trace, converted.job_meta(), run.name)
    evidence = verdict.evidence
    assert result.slowdown >= 1.1 and evidence["gc_recorded"]
    assert evidence["untraced_inside_compute"] > 0.1 and evidence["chunk_ratio"] < 1.3
    assert not evidence["worker_test"]["slow"]
    assert verdict.cause == "python-gc" and verdict.causes == ["python-gc"], verdict.explanations
    assert verdict.implicated_workers == [(0, 1)] and int(result.worker_rank[0, 1]) == 1


def test_a_chunk_s_pace_is_its_operations_median_not_stretched_by_one_collection():
    """The same run: the collection at the step's first forward stretches that forward's gaps (its
    pace reads up to 14x the job's), one forward of the chunk's four a step. A machine's pace
    stretches every operation; the chunk's pace is the median over its forwards (and backwards),
    which stays at its usual 1.2x where the mean of its forwards reads 3.9x."""
    from transforms.ingest.kineto import convert_kineto
    from transforms.whatif import compile_job
    from transforms.whatif.causes import CauseRules
    from transforms.whatif.causes.signals import chunk_work

    run = STACKS / "p7-pipe-gc-r1-interleaved-pp2-a4"
    truth = json.loads((run / "truth.json").read_text())
    converted = convert_kineto([str(run / name) for name in truth["trace_files"]], run.name, "2026-11-30", {})
    model = compile_job(converted.trace, converted.job_meta(), run.name)
    work = chunk_work(converted.trace, model)
    rows = converted.trace.to_pydict()
    paces = [p for p, g, o in zip(rows["pace"], rows["gmc"], rows["optype"]) if g == 1 and o == "forward-compute"]
    assert max(paces) > 10 and sum(paces) / len(paces) > 3 * float(np.median(paces))
    assert work.paces[0][list(work.chunks).index(1)] == pytest.approx(float(np.median(paces)))
    assert work.of([1])[1] < CauseRules.slower_pace
