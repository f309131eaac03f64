"""Fleet sampling (a fleet like the paper's, bounded work) and fleet writing (lake layout, truth, bad input)."""
from __future__ import annotations

import collections
import datetime as dt
import pathlib

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest

from schemas.trace import MANIFEST_SCHEMA, TRACE_SCHEMA
from transforms.synth import TRUTH_PATH, TRUTH_SCHEMA, sample_fleet, write_fleet
from transforms.synth.badinput import BAD_KINDS
from transforms.synth.fleet import BAD_HOSTS

from fixtures_s3 import moto_s3  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def fleet():
    return sample_fleet(30, 20, seed=11)


def test_fleet_sizes_are_heavy_tailed_from_128_gpus(fleet):
    gpus = np.array([s.world_size for s in fleet])
    assert gpus.min() >= 128 and gpus.max() <= 6144
    assert (gpus >= 4096).any() and np.median(gpus) < 512 < gpus.mean() * 1.5
    assert np.mean(gpus) > np.median(gpus)          # right-skewed
    assert all(s.world_size == s.dp * s.pp * s.tp * s.cp for s in fleet)


def test_fleet_mixes_models_contexts_and_schedules(fleet):
    assert {s.model_family for s in fleet} == {"dense", "moe"}
    assert {s.context_length for s in fleet} >= {4096, 32768, 131072}
    assert all(s.cp > 1 for s in fleet if s.context_length >= 32768)
    assert any(s.vpp > 1 for s in fleet) and any(s.pp == 1 for s in fleet)
    assert {s.dp_overlap for s in fleet} == {True, False}
    interleaved = [s for s in fleet if s.vpp > 1]
    assert all(s.microbatches % s.pp == 0 and s.microbatches >= 2 * s.pp for s in interleaved)


def test_fleet_causes_have_paper_like_prevalence(fleet):
    with_cause = np.mean([bool(s.causes) for s in fleet])
    assert 0.35 <= with_cause <= 0.6
    kinds = collections.Counter(c.kind for s in fleet for c in s.causes)
    assert kinds.most_common(1)[0][0] == "last_stage_imbalance"
    assert 0 < kinds["slow_worker"] < kinds["seq_len_imbalance"] < kinds["last_stage_imbalance"]
    assert 0.05 <= kinds["untraced_cpu"] / len(fleet) <= 0.15
    assert any(len(s.causes) > 1 for s in fleet)


def test_slow_workers_sit_on_the_fleets_few_bad_hosts(fleet):
    hosts = set()
    for spec in fleet:
        cause = spec.cause("slow_worker")
        if cause is not None:
            rank = spec.tp * spec.cp * (cause.params["dp_rank"] + spec.dp * cause.params["stage"])
            hosts.add(spec.hosts[rank // 8])
            assert len(set(spec.hosts)) == len(spec.hosts)
    assert 1 <= len(hosts) <= BAD_HOSTS


def test_jobs_of_a_day_do_not_share_machines(fleet):
    by_day = collections.defaultdict(list)
    for spec in fleet:
        if spec.cause("slow_worker") is None:   # bad hosts are placed on purpose
            by_day[spec.date].extend(spec.hosts)
    assert all(len(hosts) == len(set(hosts)) for hosts in by_day.values())


def test_fleet_is_deterministic_and_bounded():
    first = sample_fleet(3, 7, seed=5, start_date="2024-02-27", max_records=200_000)
    assert first == sample_fleet(3, 7, seed=5, start_date=dt.date(2024, 2, 27), max_records=200_000)
    assert first != sample_fleet(3, 7, seed=6, start_date="2024-02-27", max_records=200_000)
    assert [s.date for s in first[::7]] == [dt.date(2024, 2, 27), dt.date(2024, 2, 28), dt.date(2024, 2, 29)]
    assert len({s.job_id for s in first}) == 21
    # The cap trims steps, microbatches, then chunks; only jobs already at the floor may stay above it.
    for spec in first:
        floor = spec.steps == 12 and spec.microbatches == spec.pp and spec.vpp == 1
        assert spec.estimated_records <= 200_000 or floor
    uncapped = sample_fleet(3, 7, seed=5, start_date="2024-02-27", max_records=10**9)
    assert [s.world_size for s in uncapped] == [s.world_size for s in first]
    assert any(a.steps > b.steps for a, b in zip(uncapped, first))


def test_sample_fleet_refuses_nonsense():
    with pytest.raises(ValueError, match="days"):
        sample_fleet(0, 3, seed=1)
    with pytest.raises(ValueError, match="max_records"):
        sample_fleet(1, 3, seed=1, max_records=10)


def _small_fleet(seed=3):
    return sample_fleet(2, 3, seed=seed, max_records=40_000)


def _read_tree(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    lake = tmp_path_factory.mktemp("fleet") / "lake"
    specs = _small_fleet()
    summary = write_fleet(str(lake), specs, bad_fraction=0.5, seed=3, processes=2)
    return lake, specs, summary


def test_fleet_lake_layout(written):
    lake, specs, summary = written
    truth = pq.read_table(lake / TRUTH_PATH)
    good = {r["job_id"] for r in truth.to_pylist() if r["bad_kind"] is None}
    assert summary.jobs == len(specs) == 6 and len(good) == 3
    for spec in specs:
        folder = lake / "traces" / f"date={spec.date}" / f"job_id={spec.job_id}"
        manifest = lake / "manifests" / f"date={spec.date}" / f"{spec.job_id}.parquet"
        if spec.job_id not in good:
            continue
        assert pq.read_schema(manifest).equals(MANIFEST_SCHEMA, check_metadata=False)
        files = sorted(folder.glob("*.parquet"))
        assert [f.name for f in files] == sorted(f"part-s{s:02d}-p{p:03d}.parquet"
                                                 for s in range(spec.sessions) for p in range(spec.pp))
        for path in files:
            table = pq.read_table(path)
            assert table.schema.equals(TRACE_SCHEMA, check_metadata=False)
            stage = int(path.stem[-3:])
            assert set(table["stage"].to_pylist()) == {stage}               # one stage per file
            assert set(table["dp_rank"].to_pylist()) == set(range(spec.dp))  # all its DP ranks
        steps = [set(pq.read_table(f, columns=["step"])["step"].to_pylist()) for f in files]
        assert sum(len(s) for s in steps[:: spec.pp]) == spec.steps          # sessions partition the steps


def test_fleet_truth_table(written):
    lake, specs, summary = written
    truth = pq.read_table(lake / TRUTH_PATH)
    assert truth.schema.equals(TRUTH_SCHEMA, check_metadata=False)
    rows = truth.to_pylist()
    assert [r["job_id"] for r in rows] == sorted(s.job_id for s in specs)
    bad = [r for r in rows if r["bad_kind"] is not None]
    assert len(bad) == summary.bad_jobs == 3
    assert {r["bad_kind"] for r in bad} <= set(BAD_KINDS) and all(r["bad_detail"] for r in bad)
    assert sum(r["records"] for r in rows) == summary.records
    for row, spec in zip(rows, sorted(specs, key=lambda s: s.job_id)):
        assert row["causes"] == [c.kind for c in spec.causes]
        assert row["gpus"] == spec.world_size and row["sampled_steps"] == spec.steps


def test_every_bad_kind_is_written_in_a_larger_fleet(tmp_path):
    specs = sample_fleet(1, len(BAD_KINDS), seed=9, max_records=20_000)
    write_fleet(str(tmp_path), specs, bad_fraction=1.0, seed=9, processes=1)
    kinds = pq.read_table(tmp_path / TRUTH_PATH, columns=["bad_kind"])["bad_kind"].to_pylist()
    assert sorted(kinds) == sorted(BAD_KINDS)
    missing = [r for r in pq.read_table(tmp_path / TRUTH_PATH).to_pylist() if r["bad_kind"] == "missing_manifest"]
    assert not (tmp_path / "manifests" / f"date={missing[0]['date']}" / f"{missing[0]['job_id']}.parquet").exists()


def test_same_seed_gives_a_byte_identical_lake(written, tmp_path):
    lake, specs, _ = written
    first = _read_tree(lake)
    # Regenerate at the same path, in one process this time: the bytes must not change.
    other = tmp_path / "lake"
    lake.rename(other)
    try:
        write_fleet(str(lake), specs, bad_fraction=0.5, seed=3, processes=1)
        assert _read_tree(lake) == first
    finally:
        import shutil
        shutil.rmtree(lake, ignore_errors=True)
        other.rename(lake)


def test_memory_lake(tmp_path):
    url = "memory://synth-fleet-test"
    specs = sample_fleet(1, 2, seed=4, max_records=20_000)
    try:
        summary = write_fleet(url, specs, processes=2)
        fs = fsspec.filesystem("memory")
        assert fs.exists(f"/synth-fleet-test/{TRUTH_PATH}")
        assert len(fs.glob("/synth-fleet-test/manifests/*/*.parquet")) == 2
        assert summary.bad_jobs == 0
    finally:
        fsspec.filesystem("memory").rm("/synth-fleet-test", recursive=True)


def test_s3_lake_from_worker_processes(moto_s3):
    """Worker processes reach the object store through the environment, like production."""
    specs = sample_fleet(1, 3, seed=6, max_records=20_000)
    summary = write_fleet(moto_s3.url("fleet"), specs, bad_fraction=0.34, seed=6, processes=2)
    fs = moto_s3.filesystem()
    truth = pq.read_table(fs.open(f"{moto_s3.bucket}/fleet/{TRUTH_PATH}", "rb"))
    assert truth.num_rows == 3 and summary.bad_jobs == 1
    assert len(fs.glob(f"{moto_s3.bucket}/fleet/traces/*/*/part-*.parquet")) > 0


def test_cli_generate(tmp_path, capsys):
    from pipelines.generate import run

    lake = tmp_path / "cli-lake"
    assert run(["--lake", str(lake), "--days", "1", "--jobs-per-day", "2", "--seed", "1",
                "--start-date", "2024-05-01", "--bad-fraction", "0", "--max-records", "20000",
                "--processes", "1"]) == 0
    out = capsys.readouterr().out
    assert "wrote 2 jobs (0 bad)" in out and "truth:" in out
    assert len(list((lake / "manifests" / "date=2024-05-01").glob("*.parquet"))) == 2


@pytest.mark.parametrize("argv", [
    ["--days", "1", "--jobs-per-day", "1", "--seed", "1"],                       # no lake
    ["--lake", "x", "--days", "0", "--jobs-per-day", "1", "--seed", "1"],
    ["--lake", "x", "--days", "1", "--jobs-per-day", "1", "--seed", "1", "--bad-fraction", "1.5"],
    ["--lake", "x", "--days", "1", "--jobs-per-day", "1", "--seed", "1", "--start-date", "May 1"],
])
def test_cli_refuses_bad_arguments(argv, capsys):
    from pipelines.generate import parse

    with pytest.raises(SystemExit):
        parse(argv)
    assert "strag generate" in capsys.readouterr().err
