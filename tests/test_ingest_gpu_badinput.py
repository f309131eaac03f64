"""Bad GPU input (issue 22, item 5): each case is refused with its reason code, naming the job, the
file and what is missing or inconsistent, never converted into a silently wrong answer.

Built from the real torch.profiler GPU ranks in `../shared/traces/hta/` (a copy modified in
tmp_path): `nccl_data.json.gz` (A100, NCCL, rank 0 of 2) written out as both ranks of a job, then
one rank broken: no `distributedInfo`; a rank of another run (another source trace, backend, NCCL
version, process group, or steps hours away from the others'); a rank profiled without CUDA activity
(no kernels); a rank whose CUDA runtime events are gone (kernels without their launch).
"""
from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from transforms.ingest.common import RawInputError
from transforms.ingest.kineto import convert_kineto

HTA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "hta"
DATE = "2026-11-25"
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")


def _load(name: str) -> dict:
    path = HTA / name
    if not path.is_file():
        pytest.skip(f"public HTA trace {path} not found")
    return json.loads(gzip.decompress(path.read_bytes()))


@pytest.fixture(scope="module")
def nccl_data() -> dict:
    return _load("nccl_data.json.gz")


def _as_rank(document: dict, rank: int, **info) -> dict:
    return dict(document, distributedInfo=dict(document["distributedInfo"], rank=rank, **info))


def _write(folder: pathlib.Path, documents: list[dict]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, document in enumerate(documents):
        path = folder / f"rank-{rank}.json.gz"
        path.write_bytes(gzip.compress(json.dumps(document).encode(), compresslevel=1))
        paths.append(str(path))
    return paths


def _refused(folder: pathlib.Path, documents: list[dict], job_id: str) -> RawInputError:
    with pytest.raises(RawInputError) as caught:
        convert_kineto(_write(folder, documents), job_id, DATE)
    return caught.value


def _without(document: dict, categories: tuple[str, ...]) -> dict:
    return dict(document, traceEvents=[e for e in document["traceEvents"] if e.get("cat") not in categories])


# --- 1. no distributedInfo ---------------------------------------------------------------------------

def test_a_gpu_rank_without_distributed_info_is_set_aside_and_named_as_the_cause(nccl_data, tmp_path):
    lost = {k: v for k, v in nccl_data.items() if k != "distributedInfo"}
    error = _refused(tmp_path / "job", [_as_rank(nccl_data, 0), lost], "gpu-no-info")
    # the job then misses rank 1; the file set aside comes first, as the window's cause
    assert error.reason_code == "raw_missing_rank" and "ranks 1" in str(error)
    [cause] = error.rejected
    assert cause.reason_code == "raw_not_a_trace" and cause.path.endswith("rank-1.json.gz")
    assert "job gpu-no-info" in str(cause) and "rank-1.json.gz" in str(cause)
    assert "no distributedInfo (rank, world_size)" in str(cause)
    lines = error.lines()
    assert lines[0].endswith("[raw_not_a_trace]") and lines[-1].startswith("  so: job gpu-no-info")


def test_a_lone_trace_without_distributed_info_is_a_job_of_one_process(nccl_data, tmp_path):
    """A process that started no process group (one GPU, no torch.distributed) records no
    distributedInfo: the window's only trace is then rank 0 of a world of one, not refused."""
    lost = {k: v for k, v in nccl_data.items() if k != "distributedInfo"}
    folder = tmp_path / "job"
    converted = convert_kineto(_write(folder, [lost]), "gpu-alone", DATE)
    assert converted.rejected == []
    assert sorted(set(converted.trace.column("dp_rank").to_pylist())) == [0]
    assert sorted(set(converted.trace.column("stage").to_pylist())) == [0]


# --- 2. ranks of two jobs in one folder --------------------------------------------------------------

def test_ranks_of_two_real_jobs_are_refused_by_when_they_ran(nccl_data, tmp_path):
    """nccl_data (A100, 2024) as rank 0 and ddp2_rank1 (V100, 2022) as rank 1: both nccl, world 2,
    distinct ranks; today they would convert into one job (or fail on unmatched collectives). The
    recorded clock says they ran 540 days apart."""
    other = _load("ddp2_rank1.json.gz")
    error = _refused(tmp_path / "job", [_as_rank(nccl_data, 0), other], "gpu-two-jobs")
    assert error.reason_code == "raw_mixed_jobs"
    message = str(error)
    assert "job gpu-two-jobs" in message and "rank-0.json.gz" in message
    assert "540 days after the nearest other rank (rank 1, at 2022-11-30" in message
    assert "NVIDIA A100-PG509-200" in message and "Tesla V100-SXM2-32GB" in message


def _world_of_three(document: dict) -> list[dict]:
    """Ranks 0..2 of a 3-rank job, all from one source rank (default group of the three)."""
    group = dict(document["distributedInfo"]["pg_config"][0], ranks=[0, 1, 2], pg_size=3)
    return [_as_rank(document, rank, world_size=3, pg_config=[group]) for rank in range(3)]


@pytest.mark.parametrize(("info", "words"), [
    ({"backend": "gloo"}, "rank 2 here is of backend gloo, the other rank files of backend nccl (2 files)"),
    ({"nccl_version": "2.21.5"}, "rank 2 here is of NCCL version 2.21.5, the other rank files of NCCL version 2.17.1 (2 files)"),
])
def test_ranks_whose_distributed_info_disagrees_are_of_two_jobs(nccl_data, tmp_path, info, words):
    documents = _world_of_three(nccl_data)
    documents[2]["distributedInfo"].update(info)
    error = _refused(tmp_path / "job", documents, "gpu-info")
    assert error.reason_code == "raw_mixed_jobs" and words in str(error)
    assert error.path.endswith("rank-2.json.gz") and "job gpu-info" in str(error)


def test_one_process_group_name_with_two_memberships_is_two_jobs(nccl_data, tmp_path):
    """c10d names a group alike on every rank: group '1' of rank 0 alone here and of rank 1 alone there."""
    documents = []
    for rank in (0, 1):
        config = [*nccl_data["distributedInfo"]["pg_config"],
                  {"pg_name": "1", "pg_desc": "undefined", "backend_config": "cuda:nccl", "pg_size": 1, "ranks": [rank]}]
        documents.append(_as_rank(nccl_data, rank, pg_config=config, pg_count=2))
    error = _refused(tmp_path / "job", documents, "gpu-groups")
    assert error.reason_code == "raw_mixed_jobs"
    assert "process group '1' has ranks (1,) here but (0,) in another file" in str(error)
    assert error.path.endswith("rank-1.json.gz")


def _shifted(document: dict, seconds: float) -> dict:
    return dict(document, baseTimeNanoseconds=document["baseTimeNanoseconds"] + int(seconds * 1e9))


def test_a_rank_profiled_hours_away_from_the_others_is_another_run(nccl_data, tmp_path):
    documents = _world_of_three(nccl_data)
    documents[2] = _shifted(documents[2], 5 * 3600)
    error = _refused(tmp_path / "job", documents, "gpu-rerun")
    assert error.reason_code == "raw_mixed_jobs" and error.path.endswith("rank-2.json.gz")
    assert "job gpu-rerun" in str(error) and "rank 2 profiled its steps at" in str(error)
    assert "5.0 h after the nearest other rank (rank 1" in str(error)
    assert "1 rank file(s) here are of another run" in str(error)


def test_host_clocks_minutes_apart_are_one_job(nccl_data, tmp_path):
    """Unsynchronised host clocks are no second job: 20 minutes apart, the clocks are aligned."""
    documents = [dict(_as_rank(nccl_data, 0), host_name="a"), dict(_shifted(_as_rank(nccl_data, 1), 1200), host_name="b")]
    job = convert_kineto(_write(tmp_path / "job", documents), "gpu-skewed", DATE)
    assert job.source["clocks"] == 2
    assert abs(next(iter(job.source["clock_offsets_s"].values()))) == pytest.approx(1200, abs=0.01)


# --- 3. a rank profiled without CUDA activity ----------------------------------------------------------

def test_a_cpu_only_rank_in_a_gpu_job_is_refused(nccl_data, tmp_path):
    """Rank 1 profiled with ProfilerActivity.CPU only: no kernels, runtime calls, GPU annotations or flows.
    Today's answer was an unmatched-collective error about grads-reduce-scatter, not the cause."""
    cpu_only = _without(_as_rank(nccl_data, 1), (*GPU_WORK, *LAUNCHES, "gpu_user_annotation", "ac2g"))
    error = _refused(tmp_path / "job", [_as_rank(nccl_data, 0), cpu_only], "gpu-cpu-rank")
    assert error.reason_code == "raw_cpu_only_rank" and error.level == "job"
    assert error.path.endswith("rank-1.json.gz") and "job gpu-cpu-rank" in str(error)
    assert "rank 1 recorded no GPU kernel, while 1 other rank(s) of the job ran theirs on NVIDIA A100-PG509-200" in str(error)
    assert "ProfilerActivity.CUDA" in str(error)


def test_a_job_of_cpu_ranks_only_is_not_refused_for_it(tmp_path):
    """The CPU-only check is about a mix: gloo jobs profiled on CPU convert as before."""
    corpus = pathlib.Path(__file__).parent / "data" / "real_traces" / "dp4-ddp"
    job = convert_kineto(sorted(str(p) for p in corpus.glob("rank-*.json*")), "cpu-job", DATE)
    assert job.source["device"] == "cpu" and "gpu_work_unlinked" not in job.source


# --- 4. kernels without their CUDA launch --------------------------------------------------------------

def test_a_rank_whose_runtime_events_were_dropped_is_refused(nccl_data, tmp_path):
    """Without cuda_runtime events no kernel can be traced to the range that launched it: the compute
    would silently fall back to CPU time (today it did, and converted)."""
    stripped = _without(_as_rank(nccl_data, 1), LAUNCHES)
    work = sum(e.get("cat") in GPU_WORK and not e["name"].startswith("nccl") for e in nccl_data["traceEvents"])
    error = _refused(tmp_path / "job", [_as_rank(nccl_data, 0), stripped], "gpu-no-launch")
    assert error.reason_code == "raw_unlinked_kernels" and error.path.endswith("rank-1.json.gz")
    assert "job gpu-no-launch" in str(error)
    assert f"rank 1: {work} of its {work} GPU kernels, copies and memsets (100%) have no CUDA launch" in str(error)
    assert "args.correlation" in str(error)


def test_a_few_kernels_without_their_launch_are_counted_in_the_source(nccl_data, tmp_path):
    """A handful of launches lost (here those of 40 kernels): converted, and the job says how many per rank."""
    events = nccl_data["traceEvents"]
    lost = {e["args"]["correlation"] for e in events if e.get("cat") == "kernel" and not e["name"].startswith("nccl")}
    lost = set(sorted(lost)[100:140])
    thinned = dict(_as_rank(nccl_data, 1), traceEvents=[
        e for e in events if not (e.get("cat") in LAUNCHES and (e.get("args") or {}).get("correlation") in lost)])
    expected = sum(e.get("cat") in GPU_WORK and e["args"].get("correlation") in lost for e in events)
    job = convert_kineto(_write(tmp_path / "job", [_as_rank(nccl_data, 0), thinned]), "gpu-few", DATE)
    assert expected >= 40
    assert job.source["gpu_work_unlinked"] == {"1": expected}
    assert job.source["unmapped"]["GPU work without its CUDA launch (correlation)"] == expected


def test_the_refusal_is_quarantined_with_its_reason(nccl_data, tmp_path):
    """The batch pipeline's reading step quarantines the window with the converter's reason and message."""
    from transforms.batch.elements import MatchedJob
    from transforms.io.lake import LakeJob
    from transforms.batch.read_windows import validate_job_window

    class NoScreen:   # nothing converted, so nothing to validate
        def validate_jobs(self, jobs):
            assert not jobs
            return []

    cpu_only = _without(_as_rank(nccl_data, 1), (*GPU_WORK, *LAUNCHES, "gpu_user_annotation", "ac2g"))
    paths = _write(tmp_path / "job", [_as_rank(nccl_data, 0), cpu_only])
    job = LakeJob(str(tmp_path), DATE, "gpu-cpu-rank", tuple(paths), None, raw_format="kineto")
    validated = validate_job_window(MatchedJob(job, None), NoScreen())
    assert validated.problem.reason_code == "raw_cpu_only_rank"
    [row] = validated.quarantine.to_pylist()
    assert row["reason_code"] == "raw_cpu_only_rank" and row["level"] == "job" and row["source_path"] == paths[1]
    assert "job gpu-cpu-rank" in row["detail"] and "ProfilerActivity.CUDA" in row["detail"]
