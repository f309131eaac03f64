"""transforms.synth.badinput: every kind of corruption is rejected with its reason code."""
from __future__ import annotations

import uuid

import fsspec
import numpy as np
import pytest

from lake_samples import sample_job
from schemas import expectations as ex
from transforms.io import lake as lk
from transforms import validation as va
from transforms.synth.badinput import BAD_KINDS, EXPECTED_REASON, BadInputError, corrupt_job


@pytest.fixture(scope="module")
def validator() -> va.Validator:
    return va.Validator()


@pytest.fixture(params=["memory", "local"])
def lake(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "lake")
        return
    root = f"memory://bad-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _written_job(lake: str, files: int = 2) -> lk.LakeJob:
    trace, manifest = sample_job("job-x", dp=2, pp=2, steps=3, microbatches=4)
    keys = trace["dp_rank"].to_numpy() * 10 + trace["stage"].to_numpy()
    parts = [trace.filter(np.isin(keys, group)) for group in np.array_split(np.unique(keys), files)]
    return lk.write_job(lake, "2024-03-01", "job-x", parts, manifest)


def test_every_kind_has_a_known_reason():
    assert set(EXPECTED_REASON) == set(BAD_KINDS)
    assert set(EXPECTED_REASON.values()) <= set(ex.REASONS)


def test_clean_job_passes(lake, validator):
    report = lk.read_validated_job(_written_job(lake), validator)
    assert report.ok, report.summary()


# every kind on memory://; the kinds that remove or rewrite files also on a local folder
KIND_CASES = [("memory", kind) for kind in BAD_KINDS] + [
    ("local", kind) for kind in ("truncated_file", "missing_workers", "missing_manifest")]


@pytest.mark.parametrize(("lake", "kind"), KIND_CASES, indirect=["lake"])
def test_each_kind_is_rejected_with_its_reason(lake, validator, kind):
    job = _written_job(lake)
    fs, _ = lk.filesystem(lake)
    description = corrupt_job(fs, kind, job.trace_files, job.manifest_path, np.random.default_rng(7))
    assert isinstance(description, str) and description
    [after] = lk.list_jobs(lake)
    report = lk.read_validated_job(after, validator)
    assert not report.ok
    assert EXPECTED_REASON[kind] in report.reasons, (kind, description, report.summary())
    problem = next(p for p in report.problems if p.reason == EXPECTED_REASON[kind])
    assert "job-x" in problem.detail


def test_corrupt_bytes_never_pass_unnoticed(tmp_path):
    """Whatever bytes are hit, the lake's page checksums make the reader refuse the file."""
    for seed in range(25):
        job = _written_job(str(tmp_path / f"lake{seed}"), files=1)
        corrupt_job(None, "corrupt_bytes", job.trace_files, job.manifest_path, np.random.default_rng(seed))
        with pytest.raises(lk.LakeReadError) as error:
            lk.read_parquet(job.trace_files[0])
        assert error.value.reason == ex.UNREADABLE_FILE


def test_unknown_kind_and_impossible_corruptions(lake):
    trace, manifest = sample_job("solo", dp=1, pp=1, steps=2)
    job = lk.write_job(lake, "2024-03-01", "solo", trace, manifest)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown bad-input kind"):
        corrupt_job(None, "gremlins", job.trace_files, job.manifest_path, rng)
    with pytest.raises(BadInputError, match="single worker"):
        corrupt_job(None, "missing_workers", job.trace_files, job.manifest_path, rng)
    with pytest.raises(BadInputError, match="one worker"):
        corrupt_job(None, "missing_steps", job.trace_files, job.manifest_path, rng)


def test_same_seed_same_corruption(tmp_path):
    outputs = []
    for name in ("a", "b"):
        job = _written_job(str(tmp_path / name))
        outputs.append(corrupt_job(None, "negative_duration", job.trace_files, job.manifest_path,
                                   np.random.default_rng(3)).replace(str(tmp_path / name), ""))
    assert outputs[0] == outputs[1]
