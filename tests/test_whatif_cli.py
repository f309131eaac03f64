"""`strag analyze` end to end: file and lake forms, outputs, exit codes, no Beam import, and the
published meta yamls read as yaml.safe_load reads them without importing PyYAML."""
from __future__ import annotations

import gzip
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from pipelines.analyze import parse
from transforms.io.meta_yaml import flat_yaml

# Runs the CLI in a fresh interpreter, then reports whether Apache Beam and PyYAML got imported.
_DRIVER = textwrap.dedent("""
    import sys
    from pipelines.cli import main
    code = main(sys.argv[1:])
    beam = sorted(name for name in sys.modules if name == "apache_beam" or name.startswith("apache_beam."))
    print("BEAM_MODULES=" + ",".join(beam))
    print("YAML_IMPORTED=" + str("yaml" in sys.modules))
    sys.exit(code)
""")


def strag(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _DRIVER, "analyze", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_file_form_writes_json_and_timeline_without_beam(reference_dir, tmp_path):
    out, timeline = tmp_path / "st.json", tmp_path / "st.json.gz"
    done = strag(reference_dir / "trace-ST.parquet", "--meta", reference_dir / "meta-ST.yaml",
                 "--json", out, "--timeline", timeline)
    assert done.returncode == 0, done.stderr
    assert "BEAM_MODULES=\n" in done.stdout + "\n"
    assert "YAML_IMPORTED=False" in done.stdout, "the published meta yaml takes flat_yaml's path"
    assert "S = 1.1787" in done.stdout and "M_S = 1.219" in done.stdout and "stage partitioning imbalance" in done.stdout
    assert "top stages:   stage 3 1.232" in done.stdout
    assert "verdict: stage-imbalance (stage partitioning imbalance)" in done.stdout
    assert "Model chunk 3 on the last stage does 1.63x the compute per microbatch" in done.stdout
    result = json.loads(out.read_text())
    verdict = result["verdict"]
    assert verdict["causes"] == ["stage-imbalance"] and verdict["verdicts"][0]["explanation"] in done.stdout
    assert verdict["verdicts"][0]["savings_gpu_hours"] is None, "a trace file has no manifest: GPU-hours unknown"
    fix = verdict["verdicts"][0]
    assert f"S 1.179 -> {fix['fixed_slowdown']:.3f}" in done.stdout and fix["fix"] in done.stdout
    expected = json.loads((reference_dir / "result-ST.json").read_text())
    assert result["job_meta"] == expected["job_meta"]
    assert result["blocking_slowdown"] == pytest.approx(expected["blocking_slowdown"], rel=1e-6)
    assert result["M_S"] == pytest.approx(json.loads((reference_dir / "ms-ST.json").read_text())["Ms"], rel=1e-6)
    assert set(result["mw"]) >= {"trem", "tadd", "tori", "tideal", "rem", "add", "Mw", "workers"}
    with gzip.open(timeline, "rt") as handle:
        assert json.load(handle)["traceEvents"]


def test_lake_form(tmp_path):
    from transforms.io.lake import write_job
    from transforms.synth.faults import Cause
    from transforms.synth.job import JobSpec, generate_job

    spec = JobSpec(job_id="cli-job", dp=2, pp=2, microbatches=4, steps=6, sessions=2, seed=11,
                   causes=(Cause("slow_worker", {"dp_rank": 1, "stage": 0}),))
    job = generate_job(spec)
    lake = tmp_path / "lake"
    write_job(str(lake), spec.date, spec.job_id, job.trace, job.manifest)
    out = tmp_path / "job.json"
    done = strag("--lake", lake, "--job-id", spec.job_id, "--json", out)
    assert done.returncode == 0, done.stderr
    assert "BEAM_MODULES=\n" in done.stdout + "\n"
    result = json.loads(out.read_text())
    assert result["job_meta"]["trial_name"] == "cli-job" and result["job_meta"]["dp_size"] == 2
    assert result["mw"]["workers"] == [[1, 0]]
    verdict = result["verdict"]
    assert verdict["cause"] == "individual-worker" and verdict["implicated_workers"] == [[1, 0]]
    saved = verdict["verdicts"][0]["savings_gpu_hours"]
    assert saved == pytest.approx(verdict["gpu_hours"] * verdict["verdicts"][0]["savings_fraction"]) and saved > 0
    def hours(value: float) -> str:   # a small job's GPU-hours in GPU-seconds, not "0.0 of 0.1 GPU-h"
        return f"{value:,.1f} GPU-h" if value >= 0.1 else f"{value * 3600:,.1f} GPU-s"

    assert f"({hours(saved)} of {hours(verdict['gpu_hours'])})" in done.stdout and "0.0 of" not in done.stdout
    assert "Worker dp 1 / stage 0 runs" in done.stdout
    wrong_date = strag("--lake", lake, "--job-id", spec.job_id, "--date", "2020-01-01")
    assert wrong_date.returncode == 2 and "cli-job" in wrong_date.stderr


def test_published_slow_worker_trace_keeps_its_verdict_with_a_sentence(reference_dir, tmp_path):
    """AR: global rank 0 slowed on purpose; the verdict blames it by peer comparison, and says so."""
    out = tmp_path / "ar.json"
    done = strag(reference_dir / "trace-AR.parquet", "--meta", reference_dir / "meta-AR.yaml", "--json", out)
    assert done.returncode == 0, done.stderr
    assert "S = 1.9730" in done.stdout and "verdict: individual-worker (slow worker)" in done.stdout
    assert "Worker dp 0 / stage 0 runs forward 2.5x and backward 2.3x slower than the other DP ranks of stage 0 in 44 of 44 steps" \
        in done.stdout
    verdict = json.loads(out.read_text())["verdict"]
    assert verdict["causes"] == ["individual-worker"] and verdict["implicated_workers"] == [[0, 0]]
    assert json.loads(out.read_text())["blocking_slowdown"] == pytest.approx(
        json.loads((reference_dir / "result-AR.json").read_text())["blocking_slowdown"], rel=1e-6)


def test_bad_trace_exits_1_with_the_typed_error(reference_dir, tmp_path):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(reference_dir / "trace-ST.parquet")
    table = table.filter(pc.invert(pc.equal(table.column("optype").cast("string"), "optimizer")))
    path = tmp_path / "no-optimizer.parquet"
    pq.write_table(table, path)
    done = strag(path, "--meta", reference_dir / "meta-ST.yaml")
    assert done.returncode == 1
    assert "job 'ST'" in done.stderr and "optimizer_0_0" in done.stderr


@pytest.mark.parametrize("argv, message", [
    ([], "give TRACE.parquet --meta META.yaml, a folder of raw traces DIR [--format kineto|ndtimeline], or --lake"),
    ([__file__], "needs --meta"),                        # a file, not a folder of raw traces
    (["x.parquet"], "no such file or folder: x.parquet"),
    (["--lake", "/tmp/nowhere"], "--lake needs --job-id"),
])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        parse(argv)
    assert caught.value.code == 2 and message in capsys.readouterr().err


def test_published_meta_yamls_read_flat_as_yaml_reads_them(reference_dir):
    metas = sorted(reference_dir.glob("meta-*.yaml"))
    assert metas
    for path in metas:
        text = path.read_text()
        assert flat_yaml(text) == yaml.safe_load(text), path


# Lines a meta yaml could hold, with the scalars YAML 1.1 resolves to other types than their look:
# bools and nulls in several cases, octal/underscore/signed ints, floats, dates, sexagesimals.
_KEYS = st.sampled_from(["dp_size", "trial_name", "run_id", "on", "Off", "null", "x", "_k", "a1"])
_VALUES = st.one_of(
    st.sampled_from(["0", "1", "-3", "007", "0o7", "0x1f", "1_000", "+5", "-0", "1.5", "1e3", ".inf", ".NaN",
                     "1:30", "2024-01-01", "yes", "No", "TRUE", "off", "ON", "null", "Null", "~", "y", "n",
                     "AR", "gen1024", "run-1", "a.b", "_x", "<<", "=", "'q'", "a b", "", "é"]),
    st.integers(-10**20, 10**20).map(str),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,6}", fullmatch=True))
_FLAT_LOOKING = st.tuples(_KEYS, _VALUES).map(": ".join)
_LINES = st.one_of(_FLAT_LOOKING, st.tuples(_KEYS, _VALUES).map(lambda kv: f"{kv[0]}:  {kv[1]}"),
                   st.sampled_from(["", "# note", "---", "key: value  ", "  x: 1", "a: [1]"]))


@settings(max_examples=300)
@given(st.one_of(st.lists(_FLAT_LOOKING, min_size=1, max_size=4), st.lists(_LINES, max_size=8)),
       st.sampled_from(["", "\n"]))
def test_flat_yaml_reads_as_yaml_or_declines(lines, end):
    text = "\n".join(lines) + end
    fields = flat_yaml(text)
    if fields is not None:
        expected = yaml.safe_load(text)
        assert fields == expected
        assert [(type(k), type(v)) for k, v in fields.items()] == [(type(k), type(v)) for k, v in expected.items()]


@pytest.mark.parametrize("content, message", [
    (b"- 1\n- 2\n", "not a meta yaml (it holds a list, not 'key: value' lines)"),
    (b"dp_size: [1\n", "not a meta yaml (ParserError)"),
    (b"\xff\xfe\x00", "not a meta yaml (UnicodeDecodeError)"),
])
def test_a_meta_that_is_no_mapping_is_a_usage_error_naming_the_file(reference_dir, tmp_path, capsys, content, message):
    from pipelines.cli import main

    meta = tmp_path / "meta-bad.yaml"
    meta.write_bytes(content)
    assert main(["analyze", str(reference_dir / "trace-AR.parquet"), "--meta", str(meta)]) == 2
    assert f"--meta {meta}: {message}; give the job's meta yaml" in capsys.readouterr().err


def test_a_job_the_trace_cannot_decide_says_so_and_what_would(tmp_path):
    """A real HF run with sequence-length imbalance over 3 steps of 2 ranks: straggling (S >= 1.1),
    a worker 1.2-1.3x its peer within the job's own jitter and the offset healthy peers keep. The
    verdict is insufficient evidence, names no rank, states no confidence, and says what would decide."""
    run = pathlib.Path(__file__).parent / "data" / "real_stacks" / "hf-seq-gpt2-padded"
    out = tmp_path / "job.json"
    done = strag(run, "--format", "kineto", "--json", out)
    assert done.returncode == 0, done.stderr
    verdict_line = next(line for line in done.stdout.splitlines() if line.startswith("verdict:"))
    assert verdict_line == "verdict: insufficient-evidence (insufficient evidence)"
    assert "more DP peers" in done.stdout and "undecided: dp" in done.stdout
    verdict = json.loads(out.read_text())["verdict"]
    assert verdict["cause"] == "insufficient-evidence" and verdict["implicated_workers"] == []
    test = verdict["evidence"]["worker_test"]
    assert test["undecided"]
    # its confidence is the strongest undecided finding's (1 - adjusted p), short of the stated rate
    strongest = max([1 - f["p_value"] for f in test["undecided"]]
                    + ([1 - verdict["evidence"]["sequence_p"]] if verdict["evidence"].get("sequence_samples_needed") else []))
    assert verdict["confidence"] == pytest.approx(strongest) and verdict["confidence"] < 1 - test["alpha"]


def test_an_undecided_worker_of_a_two_step_lightning_run_counts_its_samples_in_words():
    """A real Lightning PyTorchProfiler run (2 whole steps, one microbatch each, rank 0's backward
    slowed): the worker test cannot decide, and every line counting its samples says
    "microbatches" (once printed "microbatchs")."""
    run = pathlib.Path(__file__).parent / "data" / "real_stacks" / "lightning-bwd2-r0-mlp-plprof"
    done = strag(run, "--format", "kineto")
    assert done.returncode == 0, done.stderr
    assert "verdict: insufficient-evidence" in done.stdout
    assert "over 2 microbatches" in done.stdout and "profiled microbatches would decide" in done.stdout
    assert "batchs" not in done.stdout


def test_counted_names_the_unit_in_the_plural():
    from transforms.whatif.causes.explain import counted

    assert [counted(1, "step"), counted(3, "step"), counted(1, "microbatch"), counted(4, "microbatch"),
            counted(2, "profiled microbatch")] == ["1 step", "3 steps", "1 microbatch", "4 microbatches",
                                                   "2 profiled microbatches"]


def test_a_sequence_signature_short_of_significance_is_insufficient_evidence_not_none(tmp_path):
    """A real Lightning run with sequence-length imbalance, one batch per rank and step, 3 steps of 2
    ranks: S 1.19, every worker decided, compute following the recorded tokens (r 0.87 over 6
    microbatches, p just above 1%) and evening the batches would remove most of the straggling.
    Once "none (transient)"; now insufficient evidence saying what would decide, no worker advice."""
    run = pathlib.Path(__file__).parent / "data" / "real_stacks" / "lightning-seq-gpt2-callback"
    out = tmp_path / "job.json"
    done = strag(run, "--json", out)
    assert done.returncode == 0, done.stderr
    verdict = json.loads(out.read_text())["verdict"]
    evidence = verdict["evidence"]
    assert verdict["cause"] == "insufficient-evidence" and verdict["implicated_workers"] == []
    assert not evidence["worker_test"]["undecided"] and not evidence["worker_test"]["limits"]
    assert evidence["sequence_p"] > evidence["worker_test"]["alpha"] and evidence["sequence_samples_needed"] >= 1
    assert max(evidence.get("sequence_fix_explained", 0), evidence.get("sequence_even_explained", 0)) >= 0.15
    assert verdict["confidence"] == pytest.approx(1 - evidence["sequence_p"])
    line = next(line for line in done.stdout.splitlines() if "cannot decide" in line)
    assert "sequence-length imbalance" in line and "would decide" in line and "DP rank to decide" not in line


def test_ddp_all_reduce_is_named_so_for_people_and_kept_in_the_json(tmp_path):
    """A real DDP run (gloo all-reduce of the gradients): the lines say grads-all-reduce; the JSON keeps
    the reference analyzer's op type grads-reduce-scatter, which tooling built on it reads."""
    runs = pathlib.Path(__file__).parent / "data" / "real_runs"
    done = strag(runs / "allreduce-r1-dp4-ddp-mlp-cpu", "--json", tmp_path / "ddp.json")
    assert done.returncode == 0, done.stderr
    top = next(line for line in done.stdout.splitlines() if line.startswith("top op types: "))
    assert "grads-all-reduce 1.0" in top and "grads-reduce-scatter" not in done.stdout
    assert "grads-reduce-scatter" in json.loads((tmp_path / "ddp.json").read_text())["blocking_decompose_by_optype"]
