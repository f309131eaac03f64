"""torch.profiler (Kineto) traces -> lake rows (transforms/ingest/kineto.py).

Round trips: a generated job is written as one GPU Kineto trace per rank
(transforms/synth/kineto_writer.py), converted back with `convert_kineto` and analysed; the
what-if results must equal the native analysis of the same generated trace restricted to the
op types the converter maps (gc, layernorm/embedding all-reduces and the clip all-reduce
leave the trace: the converter counts them as unmapped), to 1e-6 relative, with `clock: trust`
and with the default (`auto`: one clock per baseTimeNanoseconds / host, offsets between clocks
estimated); with every rank on its own clock the alignment is exact when matched comm ops end
together, and the result does not move when one rank's clock is 3.7 s off.
Then the public HTA traces (/work/shared/traces/hta) and bad input: each raises RawInputError
with its reason code, naming the job or the file.
"""
from __future__ import annotations

import collections
import gzip
import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from transforms.ingest import RawInputError, convert_window
from transforms.ingest.kineto import convert_kineto
from transforms.synth.faults import Cause
from transforms.synth.job import JobSpec, generate_job
from transforms.synth.kineto_writer import job_arrays, process_groups, rank_document, write_kineto_job, write_rank
from transforms.whatif import JobMeta, analyze_job

TOLERANCE = 1e-6
HTA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "hta"   # public HTA traces
DATE = "2024-01-01"
UNMAPPED_OPTYPES = ("gc", "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "optimizer-clip-main-grad")
SHAPES = {
    "dp2xpp4-slow": dict(dp=2, pp=4, causes=(Cause("slow_worker", {"dp_rank": 1, "stage": 2}),)),
    "dp4xpp1": dict(dp=4, pp=1),
    "dp1xpp2": dict(dp=1, pp=2),
}


def spec_of(name: str, **extra) -> JobSpec:
    return JobSpec(job_id=f"kineto-{name}", microbatches=8, steps=4, sessions=1, seed=11, dp_overlap=False, vpp=1, tp=1,
                   record_noop_p2p=False, **SHAPES[name], **extra)


def mapped_only(trace: pa.Table) -> pa.Table:
    """The trace without the op types the Kineto converter does not map."""
    names = trace.column("optype").cast(pa.string())
    return trace.filter(pc.invert(pc.is_in(names, value_set=pa.array(UNMAPPED_OPTYPES))))


def meta_of(manifest: dict) -> JobMeta:
    return JobMeta(dp_size=manifest["dp_size"], pp_size=manifest["pp_size"], tp_size=manifest["tp_size"],
                   dsp_size=manifest["dsp_size"], vpp_size=manifest["vpp_size"], world_size=manifest["world_size"])


def analyse(trace: pa.Table, meta: JobMeta, job_id: str):
    return analyze_job(trace, meta, job_id, attribution=True)


def close(ours: float, theirs: float) -> bool:
    return abs(ours - theirs) <= TOLERANCE * max(abs(ours), abs(theirs)) + 1e-12


def differences(ours, theirs) -> list[str]:
    """Fields of two WhatIfResults that differ by more than 1e-6 relative."""
    problems = []
    if ours.steps.tolist() != theirs.steps.tolist():
        return [f"steps {ours.steps.tolist()} != {theirs.steps.tolist()}"]

    def scalar(name, a, b):
        if not close(float(a), float(b)):
            problems.append(f"{name}: {a!r} != {b!r} (relative {abs(a - b) / max(abs(a), abs(b), 1e-300):.2e})")

    def array(name, a, b):
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        if a.shape != b.shape:
            problems.append(f"{name}: shape {a.shape} != {b.shape}")
            return
        for index in zip(*np.nonzero(np.abs(a - b) > TOLERANCE * np.maximum(np.abs(a), np.abs(b)) + 1e-12)):
            scalar(f"{name}{list(index)}", a[index], b[index])

    def mapping(name, a, b):
        if set(a) != set(b):
            problems.append(f"{name}: keys {sorted(a)} != {sorted(b)}")
            return
        for key in a:
            (array if isinstance(a[key], np.ndarray) else scalar)(f"{name}[{key}]", a[key], b[key])

    scalar("S", ours.slowdown, theirs.slowdown)
    array("per-step S", ours.step_slowdown, theirs.step_slowdown)
    for name in ("by_dp_rank", "by_stage", "by_optype", "by_optype_per_step"):
        mapping(name, getattr(ours, name), getattr(theirs, name))
    for name in ("by_dp_rank_per_step", "by_stage_per_step", "worker_slowdown"):
        array(name, getattr(ours, name), getattr(theirs, name))
    for name in ("mw", "ms"):
        a, b = getattr(ours, name), getattr(theirs, name)
        for part in ("rem", "add", "tori", "tideal"):
            scalar(f"{name}.{part}", getattr(a, part), getattr(b, part))
        if sorted(a.workers) != sorted(b.workers):
            problems.append(f"{name}.workers {a.workers} != {b.workers}")
    return problems


class Case:
    """One generated job written as Kineto traces, its native analysis and its conversions."""

    def __init__(self, name: str, folder: pathlib.Path):
        self.name = name
        self.job = generate_job(spec_of(name))
        self.arrays = job_arrays(self.job)
        self.native = analyse(mapped_only(self.job.trace), self.job.meta, self.job.spec.job_id)
        self.paths = write_kineto_job(self.job, folder / "plain")
        self._converted: dict = {}

    def converted(self, clock: str):
        """clock: 'trust', 'align' or 'auto' (the default: no option given)."""
        if clock not in self._converted:
            options = {} if clock == "auto" else {"clock": clock}
            self._converted[clock] = convert_kineto(self.paths, self.job.spec.job_id, DATE, options)
        return self._converted[clock]

    def analysed(self, converted):
        return analyse(converted.trace, meta_of(converted.manifest), converted.job_id)


@pytest.fixture(scope="module", params=list(SHAPES))
def case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("clock", ["trust", "auto"])
def test_round_trip_equals_native_analysis(case, clock):
    converted = case.converted(clock)
    assert converted.source["clock"] == clock
    problems = differences(case.analysed(converted), case.native)
    assert not problems, (f"{case.name}, clock {clock} (offset max {converted.source['clock_offset_max_s']:.3g} s): "
                          + "; ".join(problems[:12]))


@pytest.mark.parametrize("clock", ["trust", "auto"])
def test_round_trip_rows(case, clock):
    """The converted trace has exactly the mapped rows of the generated one: same optypes per
    worker and step, same microbatch ids, same durations (a recv posted before its peer's send
    may be shortened: the converter starts it with the send)."""
    converted = case.converted(clock)
    native = mapped_only(case.job.trace)
    key = lambda t: collections.Counter(zip(t.column("dp_rank").to_pylist(), t.column("stage").to_pylist(),
                                            t.column("step").to_pylist(), t.column("optype").cast(pa.string()).to_pylist(),
                                            t.column("mb_id").to_pylist()))
    assert key(converted.trace) == key(native)

    def durations(t):
        optype = np.asarray(t.column("optype").cast(pa.string()).to_pylist())
        order = np.lexsort([t.column(c).to_numpy() for c in ("seq_id", "step", "stage", "dp_rank")] + [optype])
        return t.column("duration").to_numpy()[order], np.char.endswith(optype[order].astype(str), "recv")

    ours, recv = durations(converted.trace)
    theirs, _ = durations(native)
    # µs timestamps of ~4.5e12 carry ~1 ns: durations agree to a nanosecond
    np.testing.assert_allclose(ours[~recv], theirs[~recv], rtol=1e-6, atol=1e-9)
    assert np.all(ours[recv] <= theirs[recv] + 1e-9)


def test_clock_shift_of_one_rank_does_not_change_the_aligned_result(case, tmp_path):
    """Every rank on its own clock (its own baseTimeNanoseconds); one rank's clock 3.7 s ahead:
    the default conversion aligns it away, the result equals the unshifted one."""
    shifted_rank = case.arrays.rank_of[(case.job.spec.dp - 1, case.job.spec.pp - 1)]
    plain = write_kineto_job(case.job, tmp_path / "plain", clocks="rank", arrays=case.arrays)
    paths = write_kineto_job(case.job, tmp_path / "shifted", clocks="rank", clock_offset_us={shifted_rank: 3.7e6},
                             arrays=case.arrays)
    reference = convert_kineto(plain, case.job.spec.job_id, DATE)
    shifted = convert_kineto(paths, case.job.spec.job_id, DATE)
    assert shifted.source["clock"] == "auto" and shifted.source["clocks"] == case.job.spec.dp * case.job.spec.pp
    problems = differences(case.analysed(shifted), case.analysed(reference))
    assert not problems, f"{case.name}: " + "; ".join(problems[:12])


def equal_collective_ends(trace: pa.Table) -> pa.Table:
    """The trace with each DP collective's members ending together (at the latest member's end)."""
    optype = np.asarray(trace.column("optype").cast(pa.string()).to_pylist())
    start, duration = trace.column("start_ts").to_numpy(), trace.column("duration").to_numpy().copy()
    dp = np.isin(optype, ("grads-reduce-scatter", "params-all-gather", "separate-grads-all-reduce"))
    keys = list(zip(trace.column("step").to_pylist(), trace.column("stage").to_pylist(), optype.tolist(),
                    trace.column("seq_id").to_pylist()))
    latest: dict = collections.defaultdict(lambda: -np.inf)
    for i in np.flatnonzero(dp).tolist():
        latest[keys[i]] = max(latest[keys[i]], start[i] + duration[i])
    for i in np.flatnonzero(dp).tolist():
        duration[i] = latest[keys[i]] - start[i]
    return trace.set_column(trace.schema.get_field_index("duration"), "duration", pa.array(duration, pa.float64()))


def test_alignment_is_exact_when_matched_comm_ends_coincide(case, tmp_path):
    """The generator gives each DP collective member its own small transfer skew, so members end up
    to ~0.1 ms apart and the least-squares alignment moves clocks by a few µs. With members ending
    together (and only mapped op types written) the aligned conversion is exact."""
    import types

    trace = equal_collective_ends(mapped_only(case.job.trace))
    native = analyse(trace, case.job.meta, case.job.spec.job_id)
    job = types.SimpleNamespace(trace=trace, manifest=case.job.manifest)
    one_clock = convert_kineto(write_kineto_job(job, tmp_path / "one"), case.job.spec.job_id, DATE, {"clock": "align"})
    assert one_clock.source["clock_offset_max_s"] < 1e-9
    own_clocks = convert_kineto(write_kineto_job(job, tmp_path / "own", clocks="rank"), case.job.spec.job_id, DATE)
    for converted in (one_clock, own_clocks):
        problems = differences(case.analysed(converted), native)
        assert not problems, f"{case.name}, {converted.source['clocks']} clocks: " + "; ".join(problems[:12])


def test_per_rank_alignment_of_the_generated_trace_is_close(case):
    """`clock: align` on one-clock files whose DP collective members do not end together (the
    generator's per-member skew, up to ~0.1 ms): the least-squares offsets are a few µs, and
    the result stays within 1e-4 of the native one."""
    converted = case.converted("align")
    assert converted.source["clock_offset_max_s"] < 1e-4
    ours, theirs = case.analysed(converted), case.native
    assert abs(ours.slowdown / theirs.slowdown - 1) < 1e-4
    np.testing.assert_allclose(ours.step_slowdown, theirs.step_slowdown, rtol=1e-4)
    for name in ("mw", "ms"):
        # rem = (T - trem) / (T - T_ideal): over a small gap, µs of clock error move it by gap-relative amounts
        ours_d, theirs_d = getattr(ours, name), getattr(theirs, name)
        gap = theirs_d.tori - theirs_d.tideal
        assert abs((ours_d.tori - ours_d.trem) - (theirs_d.tori - theirs_d.trem)) < 2e-5 * theirs_d.tori, gap


def test_trust_reads_each_file_on_its_own_base_time(case, tmp_path):
    """Kineto's ts are µs since the file's baseTimeNanoseconds. Ranks whose files have different
    bases (own clocks here, 61 s apart, ts written so that base + ts is the same instant) are
    on one timeline only through base + ts: `clock: trust` must keep that timeline."""
    paths = write_kineto_job(case.job, tmp_path, clocks="rank", arrays=case.arrays)
    converted = convert_kineto(paths, case.job.spec.job_id, DATE, {"clock": "trust"})
    problems = differences(case.analysed(converted), case.native)
    assert not problems, f"{case.name}: " + "; ".join(problems[:12])


def test_tensor_parallel_job_is_analysed_from_its_representative_ranks(tmp_path):
    """tp 2: only the representative rank of each (dp_rank, stage) has a file; the process groups
    name the layout, so the converter analyses exactly those ranks."""
    job = generate_job(JobSpec("kineto-tp2", dp=2, pp=2, tp=2, microbatches=8, steps=4, sessions=1, seed=5,
                               dp_overlap=False, record_noop_p2p=False))
    converted = convert_kineto(write_kineto_job(job, tmp_path), job.spec.job_id, DATE, {"clock": "trust"})
    assert (converted.manifest["tp_size"], converted.manifest["world_size"]) == (2, 8)
    assert {(w["dp_rank"], w["stage"]): w["rank"] for w in converted.manifest["workers"]} == \
        {(w["dp_rank"], w["stage"]): w["rank"] for w in job.manifest.to_pylist()[0]["workers"]}
    problems = differences(analyse(converted.trace, meta_of(converted.manifest), job.spec.job_id),
                           analyse(mapped_only(job.trace), job.meta, job.spec.job_id))
    assert not problems, "; ".join(problems[:12])


def test_manifest_layout_and_ranks(case):
    converted = case.converted("align")
    manifest, expected = converted.manifest, case.job.manifest.to_pylist()[0]
    assert (manifest["dp_size"], manifest["pp_size"], manifest["tp_size"], manifest["vpp_size"]) == \
        (expected["dp_size"], expected["pp_size"], 1, 1)
    assert manifest["world_size"] == expected["world_size"]
    ranks = lambda m: {(w["dp_rank"], w["stage"]): w["rank"] for w in m["workers"]}
    assert ranks(manifest) == ranks(expected)
    assert set(converted.trace.column("rank").to_pylist()) == set(ranks(expected).values())
    assert manifest["microbatches"] == case.job.spec.microbatches
    assert converted.source["format"] == "kineto" and converted.source["device"] == "NVIDIA H800"
    assert converted.source["steps"] == case.native.steps.tolist() and converted.source["steps_dropped"] == []


def test_unmapped_counts_name_the_other_all_reduces(case):
    """The embedding all-reduce (stage 0 + last stage group), the clip all-reduce (default
    group) and the layernorm all-reduce (tp group) are counted per group, never dropped silently."""
    converted = case.converted("align")
    unmapped = converted.source["unmapped"]
    spec = case.job.spec
    steps = len(case.native.steps)
    groups = process_groups(case.arrays)
    default = next(g for g in groups if g["role"] == "default")
    assert unmapped.get(f"all_reduce over group {default['pg_name']}") == steps * spec.dp * spec.pp, unmapped
    for group in (g for g in groups if g["role"] == "embedding"):
        members = 2 if spec.pp > 1 else 1
        assert unmapped.get(f"all_reduce over group {group['pg_name']}") == steps * members, (group, unmapped)
    for group in (g for g in groups if g["role"] == "tp"):
        assert unmapped.get(f"all_reduce over group {group['pg_name']}") == steps, (group, unmapped)


@pytest.fixture(scope="module")
def slow_case(tmp_path_factory) -> Case:
    """The dp 2 x pp 4 job with a slow worker alone, for checks one shape covers."""
    return Case("dp2xpp4-slow", tmp_path_factory.mktemp("slow-case"))


def test_gzip_own_groups_and_worker_processes_give_the_same_trace(slow_case, tmp_path):
    """.json.gz files, pg_config listing only the rank's own groups, and parsing in 2 processes."""
    case = slow_case
    paths = write_kineto_job(case.job, tmp_path, compress=True, groups="own", arrays=case.arrays)
    assert all(p.endswith(".json.gz") for p in paths) and pathlib.Path(paths[0]).read_bytes()[:2] == b"\x1f\x8b"
    converted = convert_kineto(paths, case.job.spec.job_id, DATE, {"clock": "trust"}, workers=2)
    assert converted.trace.equals(case.converted("trust").trace)


def test_event_order_in_the_file_does_not_matter(slow_case, tmp_path):
    """Chrome traces promise no event order: the same events reversed convert to the same rows."""
    case = slow_case
    paths = []
    for (dp_rank, stage), rank in sorted(case.arrays.rank_of.items(), key=lambda item: item[1]):
        document = rank_document(case.arrays, dp_rank, stage, filler=2, host_name="clock-0")
        document["traceEvents"].reverse()
        paths.append(write_rank(document, tmp_path / f"rank-{rank}.json"))
    converted = convert_kineto(paths, case.job.spec.job_id, DATE, {"clock": "trust"})
    _same_rows(converted.trace, case.converted("trust").trace)


def _same_rows(got, expected) -> None:
    """Equal rows; times to the nanosecond: with filler kernels a compute span is read from the GPU
    work it launched (the writer puts its first and last kernel at the span's ends, in ns-rounded
    µs) instead of its GPU annotation, which differs by float rounding only."""
    assert got.column_names == expected.column_names
    for name in got.column_names:
        if name in ("start_ts", "duration"):
            np.testing.assert_allclose(got.column(name).to_numpy(), expected.column(name).to_numpy(), rtol=0, atol=1e-9,
                                       err_msg=name)
        else:
            assert got.column(name).equals(expected.column(name)), name


def test_filler_events_do_not_change_the_rows(tmp_path):
    job = generate_job(spec_of("dp1xpp2"))
    plain = convert_kineto(write_kineto_job(job, tmp_path / "plain"), job.spec.job_id, DATE, {"clock": "trust"})
    paths = write_kineto_job(job, tmp_path / "filled", filler=5)
    events = json.loads(pathlib.Path(paths[0]).read_bytes())["traceEvents"]
    cats = collections.Counter(e.get("cat") for e in events)
    assert cats["kernel"] > 5 * job.spec.microbatches and cats["cuda_runtime"] == cats["kernel"]
    kernels = {e["args"]["correlation"] for e in events if e.get("cat") == "kernel"}
    launches = {e["args"]["correlation"] for e in events if e.get("cat") == "cuda_runtime"}
    assert kernels == launches
    filled = convert_kineto(paths, job.spec.job_id, DATE, {"clock": "trust"})
    _same_rows(filled.trace, plain.trace)


def test_convert_window_reads_job_yaml(tmp_path):
    job = generate_job(spec_of("dp1xpp2"))
    paths = write_kineto_job(job, tmp_path)
    (tmp_path / "job.yaml").write_text("clock: trust\nmodel_family: dense\n")
    converted = convert_window("kineto", [*paths, str(tmp_path / "job.yaml")], job.spec.job_id, DATE)
    assert converted.source["clock"] == "trust" and converted.manifest["model_family"] == "dense"


# --------------------------------------------------------------------------- public traces


def hta(name: str) -> str:
    path = HTA / name
    if not path.is_file():
        pytest.skip(f"public HTA trace {path} not found")
    return str(path)


def raises(reason: str, paths, job_id: str = "bad-job", options=None) -> RawInputError:
    """The RawInputError of `reason`: raised for the job, or, for a file-level reason, the file set
    aside before the job failed for want of that rank (convert_kineto assembles the rest)."""
    with pytest.raises(RawInputError) as caught:
        convert_kineto([str(p) for p in paths], job_id, DATE, options)
    error = caught.value
    if error.reason_code != reason and error.rejected:
        assert error.reason_code == "raw_missing_rank", str(error)
        (error,) = error.rejected
    assert error.reason_code == reason, str(error)
    return error


def test_hta_sampled_ranks_of_a_128_rank_job_are_missing_ranks():
    error = raises("raw_missing_rank", [hta("sampled_rank-0.json.gz"), hta("sampled_rank-1.json.gz")], "hta-sampled")
    assert error.job_id == "hta-sampled" and "hta-sampled" in str(error)
    assert "126 rank(s) the analysis needs have no trace" in str(error) and "world size 128" in str(error)


def test_hta_nccl_rank_0_of_2_alone_is_a_missing_rank():
    error = raises("raw_missing_rank", [hta("nccl_data.json.gz")], "hta-nccl")
    assert "hta-nccl" in str(error) and "ranks 1" in str(error)


# --------------------------------------------------------------------------- bad input


def test_truncated_gzip_is_unreadable(tmp_path):
    data = pathlib.Path(hta("nccl_data.json.gz")).read_bytes()
    truncated = tmp_path / "rank-0.json.gz"
    truncated.write_bytes(data[: len(data) // 2])
    error = raises("raw_unreadable", [truncated])
    assert error.path == str(truncated) and str(truncated) in str(error)


def test_truncated_plain_json_is_unreadable(tmp_path):
    data = gzip.decompress(pathlib.Path(hta("nccl_data.json.gz")).read_bytes())
    truncated = tmp_path / "rank-0.json"
    truncated.write_bytes(data[: len(data) // 3])
    error = raises("raw_unreadable", [truncated])
    assert str(truncated) in str(error)


def test_non_json_file_is_unreadable(tmp_path):
    path = tmp_path / "rank-0.json"
    path.write_bytes(b"PAR1\x00\x01 this is not json")
    error = raises("raw_unreadable", [path])
    assert error.path == str(path) and str(path) in str(error)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A dp 1 x pp 2 job (2 ranks) and a dp 2 x pp 4 job (8 ranks), written."""
    folder = tmp_path_factory.mktemp("small")
    two = generate_job(spec_of("dp1xpp2"))
    eight = generate_job(spec_of("dp2xpp4-slow"))
    return (two, write_kineto_job(two, folder / "two")), (eight, write_kineto_job(eight, folder / "eight"))


def test_two_files_of_the_same_rank(small, tmp_path):
    (job, paths), _ = small
    copy = tmp_path / "copy-of-rank-0.json"
    copy.write_bytes(pathlib.Path(paths[0]).read_bytes())
    error = raises("raw_duplicate_rank", [*paths, copy], job.spec.job_id)
    assert "rank 0" in str(error) and job.spec.job_id in str(error)


def test_files_of_different_world_sizes(small):
    (two, two_paths), (_, eight_paths) = small
    error = raises("raw_mixed_jobs", [*eight_paths[2:], two_paths[0]])   # ranks 2..7 of world 8, rank 0 of world 2
    assert "ranks of two jobs: rank 0 here is of world size 2, the other rank files of world size 8 (6 files)" in str(error)
    # a rank number both jobs have is still two jobs, not one rank twice
    error = raises("raw_mixed_jobs", [*eight_paths, two_paths[0]])
    assert "ranks of two jobs" in str(error) and error.path == str(two_paths[0])


def _rewrite(path: str, target: pathlib.Path, edit) -> str:
    document = json.loads(pathlib.Path(path).read_bytes())
    edit(document)
    target.write_text(json.dumps(document))
    return str(target)


def test_ranks_whose_profiled_steps_do_not_overlap(small, tmp_path):
    (job, paths), _ = small

    def renumber(document):
        for event in document["traceEvents"]:
            if event.get("name", "").startswith("ProfilerStep#"):
                event["name"] = f"ProfilerStep#{int(event['name'].split('#')[1]) + 1000}"

    moved = _rewrite(paths[1], tmp_path / "rank-1.json", renumber)
    error = raises("raw_steps_misaligned", [paths[0], moved], job.spec.job_id)
    assert job.spec.job_id in str(error)


def test_unknown_collective_over_the_data_parallel_group(small, tmp_path):
    _, (job, paths) = small
    arrays = job_arrays(job)
    dp_names = {g["pg_name"] for g in process_groups(arrays) if g["role"] == "dp"}

    def rename(document):
        for event in document["traceEvents"]:
            args = event.get("args") or {}
            if event.get("cat") == "kernel" and args.get("Process Group Name") in dp_names:
                args["Collective name"] = "frobnicate_all"
                return
        raise AssertionError("no DP collective in the file")

    edited = _rewrite(paths[0], pathlib.Path(tmp_path) / "rank-0.json", rename)
    error = raises("raw_unknown_collective", [edited, *paths[1:]], job.spec.job_id)
    assert error.op == "frobnicate_all" and "frobnicate_all" in str(error) and job.spec.job_id in str(error)


def test_a_collective_lost_from_one_rank_drops_its_step_named_by_its_seq(small, tmp_path):
    """A DP collective's kernel dropped from rank 0's file (mid-window): its DP peer still has that
    Seq, so the step is dropped, and the reason names the rank, group, Seq; matching the step's
    collectives by order would have paired the wrong ones."""
    _, (job, paths) = small
    arrays = job_arrays(job)
    dp_names = {g["pg_name"] for g in process_groups(arrays) if g["role"] == "dp"}
    lost = {}

    def drop(document):
        kernels = [e for e in document["traceEvents"] if e.get("cat") == "kernel"
                   and (e.get("args") or {}).get("Process Group Name") in dp_names]
        victim = kernels[len(kernels) // 2]
        lost.update(seq=victim["args"]["Seq"], group=victim["args"]["Process Group Name"])
        document["traceEvents"].remove(victim)

    edited = _rewrite(paths[0], pathlib.Path(tmp_path) / "rank-0.json", drop)
    converted = convert_kineto([edited, *paths[1:]], job.spec.job_id, DATE)
    why = converted.source["steps_dropped_why"]
    assert len(why) == 1 and int(next(iter(why))) in converted.source["steps_dropped"]
    assert int(next(iter(why))) not in converted.source["steps"]
    reason = next(iter(why.values()))
    assert reason.startswith("rank 0 has no ") and f"Seq {lost['seq']} of process group {lost['group']!r}" in reason


def test_connected_components_label_each_component_by_one_member():
    from transforms.components import components

    labels = components(6, [(0, 1), (2, 3), (3, 4)])
    assert labels[0] == labels[1] and labels[2] == labels[3] == labels[4]
    assert len({labels[0], labels[2], labels[5]}) == 3 and labels[5] == 5
    assert components(3, []) == [0, 1, 2]


def test_a_job_yaml_that_is_not_yaml_says_where_the_parser_stopped():
    from transforms.ingest.common import RawInputError, read_job_yaml

    with pytest.raises(RawInputError) as error:
        read_job_yaml(b"dp_size: [2\n", job_id="j", path="p/job.yaml")
    assert error.value.reason_code == "raw_bad_job_yaml" and "not a YAML mapping (ParserError: " in str(error.value)
    assert "line 2" in str(error.value)
    with pytest.raises(RawInputError, match="it holds a list"):
        read_job_yaml(b"- 1\n")
    assert read_job_yaml(b"dp_size: 2\npp_size: 2\n") == {"dp_size": 2, "pp_size": 2}


@pytest.mark.parametrize("desc, dims, syncs", [
    ("TENSOR_MODEL_PARALLEL_GROUP", {"tp"}, False),                 # Megatron-Core group_desc
    ("PIPELINE_MODEL_PARALLEL_GROUP", {"pp"}, False),
    ("DATA_PARALLEL_GROUP", {"dp"}, True),
    ("DATA_PARALLEL_GROUP_WITH_CP", {"dp", "cp"}, True),             # grads sync over data x context
    ("CONTEXT_PARALLEL_GROUP", {"cp"}, False),
    ("EXPERT_MODEL_PARALLEL_GROUP", {"ep"}, False),
    ("EXPERT_DATA_PARALLEL_GROUP", {"ep", "dp"}, False),
    ("TENSOR_AND_DATA_PARALLEL_GROUP", {"tp", "dp"}, False),
    ("MODEL_PARALLEL_GROUP", set(), False),                          # tp x pp: no dim of ours alone
    ("mesh_dp_shard_cp", {"dp", "cp"}, True),                       # torchtitan's flattened mesh dims
    ("mesh_dp_replicate", {"dp"}, True),
    ("mesh_ep", {"ep"}, False),
    ("default_pg", set(), False),
])
def test_group_descriptions_name_their_dims(desc, dims, syncs):
    from transforms.ingest.kineto.spans import Group

    group = Group("7", desc, (0, 1))
    assert group.dims() == dims and group.syncs_grads() == syncs


def test_grads_synced_over_a_data_and_context_group_are_the_dp_collectives(tmp_path):
    """The same tp 2 job with its data-parallel groups described as torchtitan's flattened
    `dp_shard_cp` mesh dim (grads sync over data x context): the same conversion."""
    job = generate_job(JobSpec("kineto-dpcp", dp=2, pp=2, tp=2, microbatches=4, steps=3, sessions=1, seed=5,
                               dp_overlap=False, record_noop_p2p=False))
    plain = convert_kineto(write_kineto_job(job, tmp_path / "plain"), job.spec.job_id, DATE, {"clock": "trust"})
    paths = write_kineto_job(job, tmp_path / "dpcp")
    for path in paths:
        text = pathlib.Path(path).read_text()
        assert '"mesh_dp"' in text
        pathlib.Path(path).write_text(text.replace('"mesh_dp"', '"mesh_dp_shard_cp"'))
    renamed = convert_kineto(paths, job.spec.job_id, DATE, {"clock": "trust"})
    assert renamed.trace.equals(plain.trace)
    assert (renamed.manifest["dp_size"], renamed.manifest["tp_size"]) == (2, 2)


def test_an_unlabelled_forward_ends_where_its_thread_waits_on_a_send():
    """Schedule1F1B without `PP:` labels: a forward is the run of top-level ops between p2p calls.
    When the schedule then waits on the previous send (its gloo span ends when that wait returns:
    the neighbour was late) and does some bookkeeping before the next send, the forward ends with
    its last compute op, not after the wait: the wait is the neighbour's lateness, not this rank's
    compute."""
    from transforms.ingest.kineto.compute import _unlabeled_compute
    from transforms.ingest.kineto.spans import BWD, FWD

    ops = [(0.5, 30.0, "gloo:send", 1),          # the previous microbatch's send, waited on until 30
           (1.0, 5.0, "SleepFn", 1), (6.0, 10.0, "SleepFn", 1),   # this microbatch's forward
           (30.5, 31.0, "aten::detach", 1),      # after the wait: the next send's bookkeeping
           (31.0, 40.0, "gloo:send", 1),
           (41.0, 60.0, "autograd::engine::evaluate_function: AddmmBackward0", 1)]
    spans = _unlabeled_compute(ops, [(0.0, 100.0)], [], forward=True)
    assert [(kind, start, end) for kind, start, end, *_ in spans] == [(FWD, 1.0, 10.0), (BWD, 41.0, 60.0)]
    # without the wait (the send's span ends after the bookkeeping) the bookkeeping is the forward's
    ops[0] = (0.5, 35.0, "gloo:send", 1)
    spans = _unlabeled_compute(ops, [(0.0, 100.0)], [], forward=True)
    assert [(kind, start, end) for kind, start, end, *_ in spans] == [(FWD, 1.0, 31.0), (BWD, 41.0, 60.0)]
