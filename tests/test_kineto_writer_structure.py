"""The Kineto writer's GPU mode (transforms/synth/kineto_writer.py) against real GPU traces (issue 22, item 3).

The writer stands in for torch.profiler in the round-trip tests and the ingest benchmark, so what it
writes must have the structure real files have in everything the converter reads: top-level keys,
event categories, the args each category carries, threads and streams, the flows binding a CUDA call
to its GPU op, metadata. Each property is read the same way from the writer's document and from real
GPU ranks (`../shared/traces/hta/`: `ddp2_rank1` V100 DDP on an older torch, `nccl_data` A100 DDP on a
recent one): a property both real files hold must hold in the writer's document, and a property only
the recent file holds (its NCCL kernel args, fwdbwd flows) must hold too, since the writer writes a
recent torch (NCCL 2.21).
"""
from __future__ import annotations

import collections
import gzip
import json
import pathlib

import pytest

from transforms.synth.job import JobSpec, generate_job
from transforms.synth.kineto_writer import job_arrays, rank_document

HTA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "hta"
REAL = ("ddp2_rank1.json.gz", "nccl_data.json.gz")
RECENT = "nccl_data.json.gz"
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
# the events the converter reads (transforms/ingest/kineto/rank.py), by (ph, cat)
READ = {("X", "cpu_op"), ("X", "user_annotation"), ("X", "cuda_runtime"), ("X", "cuda_driver"), ("X", "kernel"),
        ("X", "gpu_memcpy"), ("X", "gpu_memset"), ("X", "gpu_user_annotation"), ("s", "fwdbwd"), ("f", "fwdbwd")}
NCCL = ("ncclKernel_", "ncclDevKernel_")


@pytest.fixture(scope="module")
def real() -> dict[str, dict]:
    out = {}
    for name in REAL:
        path = HTA / name
        if not path.is_file():
            pytest.skip(f"public HTA trace {path} not found")
        out[name] = json.loads(gzip.decompress(path.read_bytes()))
    return out


@pytest.fixture(scope="module")
def written() -> dict:
    """Rank (dp 1, stage 1) of a dp 2 x pp 2 job in GPU mode: filler kernels, copies and memsets."""
    job = generate_job(JobSpec(job_id="writer-structure", dp=2, pp=2, tp=1, microbatches=4, steps=3, sessions=1, seed=5,
                               dp_overlap=False, vpp=1, record_noop_p2p=False))
    return json.loads(json.dumps(rank_document(job_arrays(job), 1, 1, filler=4, copies=True, host_name="gpu-host-0")))


def _events(document: dict, ph: str, cat: str | None) -> list[dict]:
    return [e for e in document["traceEvents"] if e.get("ph") == ph and e.get("cat") == cat]


def _kinds(document: dict) -> set[tuple[str, str | None]]:
    return {(e.get("ph"), e.get("cat")) for e in document["traceEvents"]}


def _common(values) -> set:
    """What every element holds: the intersection of sets."""
    values = list(values)
    return set.intersection(*values) if values else set()


def test_top_level_keys_and_distributed_info(real, written):
    for key in _common(set(document) for document in real.values()) | {"baseTimeNanoseconds", "displayTimeUnit"}:
        assert key in written, key
    assert set(real[RECENT]) - {"INFO"} <= set(written)   # INFO: the profiler's log lines, nothing read
    assert isinstance(written["baseTimeNanoseconds"], int) and written["schemaVersion"] == 1
    info = written["distributedInfo"]
    assert set(real[RECENT]["distributedInfo"]) <= set(info)
    assert info["backend"] == "nccl" and 0 <= info["rank"] < info["world_size"] and info["pg_count"] == len(info["pg_config"])
    group_keys = _common(set(g) for g in real[RECENT]["distributedInfo"]["pg_config"])
    for group in info["pg_config"]:
        assert group_keys <= set(group) and group["pg_size"] == len(group["ranks"])
        assert all(isinstance(r, int) for r in group["ranks"])
    device_keys = _common(set(p) for document in real.values() for p in document["deviceProperties"])
    assert all(device_keys <= set(p) for p in written["deviceProperties"])


def test_event_categories_are_those_real_files_hold(real, written):
    held = _common(_kinds(document) for document in real.values())
    for kind in (held | _kinds(real[RECENT])) & READ:
        assert kind in _kinds(written), kind
    assert ("s", "ac2g") in _kinds(written) and ("f", "ac2g") in _kinds(written)
    # nothing real files do not hold (a category the converter would read only in synthetic files)
    assert _kinds(written) <= set.union(*(_kinds(d) for d in real.values())), _kinds(written) - held


def test_every_category_has_the_keys_and_args_of_real_events(real, written):
    for ph, cat in _kinds(written):
        if ph == "M" or cat is None:
            continue
        mine = _events(written, ph, cat)
        theirs = [e for document in real.values() for e in _events(document, ph, cat)]
        keys = collections.Counter(tuple(sorted(e)) for e in theirs)
        assert {tuple(sorted(e)) for e in mine} <= set(keys), (ph, cat)
        if ph != "X":
            continue
        # the args every real event of the category carries, in every real file that has it
        required = _common(_common(set(e.get("args") or {}) for e in _events(document, ph, cat))
                           for document in real.values() if _events(document, ph, cat))
        if cat == "cpu_op":   # ops with autograd or comm args are a subset; every op has these
            required &= {"External id", "Ev Idx"}
        for event in mine:
            assert required <= set(event["args"]), (cat, event["name"], required - set(event["args"]))


def test_gpu_ops_run_on_their_device_and_stream(real, written):
    for document in [*real.values(), written]:
        work = [e for cat in GPU_WORK for e in _events(document, "X", cat)]
        cpu_pids = {e["pid"] for e in _events(document, "X", "cpu_op")}
        assert work and len(cpu_pids) == 1
        for event in work:
            args = event["args"]
            assert event["pid"] == args["device"] and event["tid"] == args["stream"]
            assert isinstance(args["correlation"], int) and event["pid"] not in cpu_pids
        for kernel in _events(document, "X", "kernel"):
            grid, block = kernel["args"]["grid"], kernel["args"]["block"]
            assert len(grid) == len(block) == 3 and all(isinstance(v, int) for v in grid + block)
        streams = {"nccl": set(), "compute": set()}
        for kernel in _events(document, "X", "kernel"):
            streams["nccl" if kernel["name"].startswith(NCCL) else "compute"].add(kernel["args"]["stream"])
        assert streams["nccl"] and not streams["nccl"] & streams["compute"]   # NCCL has streams of its own


def _launches(document: dict) -> dict[int, dict]:
    return {e["args"]["correlation"]: e for cat in ("cuda_runtime", "cuda_driver") for e in _events(document, "X", cat)
            if "correlation" in e.get("args", {})}


def test_ac2g_flows_bind_each_launch_to_its_gpu_op(real, written):
    """s at the CUDA call (same thread, same ts), f with bp "e" at the GPU op (device pid, stream tid,
    same ts), id = correlation; every GPU op has its launch and its f, every launch of GPU work its s."""
    for name, document in [*real.items(), ("writer", written)]:
        launches = _launches(document)
        work = {e["args"]["correlation"]: e for cat in GPU_WORK for e in _events(document, "X", cat)}
        starts = {e["id"]: e for e in _events(document, "s", "ac2g")}
        finishes = collections.defaultdict(list)
        for flow in _events(document, "f", "ac2g"):
            finishes[flow["id"]].append(flow)
        assert set(work) <= set(launches), name
        for correlation, flow in starts.items():
            call = launches[correlation]
            assert (flow["pid"], flow["tid"], flow["ts"]) == (call["pid"], call["tid"], call["ts"]), name
            assert "bp" not in flow
        for correlation, op in work.items():
            assert correlation in starts, name
            [flow] = [f for f in finishes[correlation] if f["pid"] == op["pid"]]
            assert (flow["tid"], flow["ts"], flow["bp"]) == (op["tid"], op["ts"], "e"), name


def _main_thread(document: dict):
    [tid] = {e["tid"] for e in _events(document, "X", "user_annotation") if e["name"].startswith("ProfilerStep#")}
    return tid


def _within(events: list[dict], tid, ts: float) -> list[dict]:
    return sorted((e for e in events if e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]), key=lambda e: e["ts"])


def test_the_backward_runs_on_the_autograd_thread(real, written):
    """The main thread (pid = tid, where ProfilerStep is) runs the forward; the autograd engine's thread
    runs the backward's `evaluate_function` nodes and launches their kernels."""
    for name, document in [*real.items(), ("writer", written)]:
        main = _main_thread(document)
        cpu = _events(document, "X", "cpu_op")
        assert main == cpu[0]["pid"], name
        nodes = [e for e in cpu if e["name"].startswith("autograd::engine::evaluate_function:")]
        threads = {e["tid"] for e in nodes}
        assert len(threads) == 1 and main not in threads, name
        [autograd] = threads
        launched = {call["tid"] for call in _launches(document).values()}
        assert {main, autograd} <= launched, name
        # a kernel launched inside a backward node is launched from the autograd thread
        calls = [c for c in _launches(document).values() if c["tid"] == autograd]
        assert any(_within(nodes, autograd, c["ts"]) for c in calls), name


def test_fwdbwd_flows_join_a_forward_op_to_its_backward_node(real, written):
    for document in (real[RECENT], written):
        cpu = _events(document, "X", "cpu_op")
        at = {(e["tid"], e["ts"]): e for e in cpu}
        main = _main_thread(document)
        starts, finishes = _events(document, "s", "fwdbwd"), _events(document, "f", "fwdbwd")
        assert starts and {e["id"] for e in starts} == {e["id"] for e in finishes}
        for flow in starts:
            assert flow["tid"] == main and (flow["tid"], flow["ts"]) in at and "bp" not in flow
        for flow in finishes:
            node = at[(flow["tid"], flow["ts"])]
            assert flow["bp"] == "e" and flow["tid"] != main and "Backward" in node["name"]


def test_nccl_kernels_carry_their_collective_as_recent_torch_writes_it(real, written):
    """NCCL kernel args (Collective name, sizes, dtype, group), the c10d op > record_param_comms >
    `nccl:*` range > cudaLaunchKernelExC nesting on the launching thread, and the range on the GPU."""
    recent = real[RECENT]
    for document in (recent, written):
        launches = _launches(document)
        nccl = [k for k in _events(document, "X", "kernel") if k["name"].startswith(NCCL)]
        assert nccl
        required = _common(set(k["args"]) for k in _events(recent, "X", "kernel") if k["name"].startswith(NCCL))
        ops = _events(document, "X", "cpu_op") + _events(document, "X", "user_annotation")
        gpu_ranges = {(e["name"], e["tid"]) for e in _events(document, "X", "gpu_user_annotation")}
        for kernel in nccl:
            assert required <= set(kernel["args"]), required - set(kernel["args"])
            call = launches[kernel["args"]["correlation"]]
            assert call["name"] == "cudaLaunchKernelExC"
            names = [e["name"] for e in _within(ops, call["tid"], call["ts"])]   # outermost first
            c10d = next(i for i, n in enumerate(names) if n.startswith("c10d::"))
            comms = names.index("record_param_comms", c10d)
            [annotation] = [n for n in names[comms:] if n.startswith("nccl:")]   # one collective at a time
            assert (annotation, kernel["tid"]) in gpu_ranges


def test_metadata_names_every_process_and_thread(real, written):
    for name, document in [*real.items(), ("writer", written)]:
        meta = [e for e in document["traceEvents"] if e.get("ph") == "M"]
        assert {e["name"] for e in meta} == {"process_name", "process_labels", "process_sort_index", "thread_name",
                                             "thread_sort_index"}, name
        named = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
        used = {(e["pid"], e["tid"]) for e in document["traceEvents"]
                if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", *GPU_WORK)}
        assert used <= named, (name, used - named)
        labels = {e["pid"]: e["args"]["labels"] for e in meta if e["name"] == "process_labels"}
        for op in (e for cat in GPU_WORK for e in _events(document, "X", cat)):
            assert labels[op["pid"]] == f"GPU {op['pid']}"
        assert labels[_main_thread(document)] == "CPU"
        profiler = [e for e in document["traceEvents"] if e.get("cat") == "Trace"]
        assert len(profiler) == 1 and profiler[0]["name"].startswith("PyTorch Profiler")
