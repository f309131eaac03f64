"""Ids at the lowest layer: one alphabet for job ids in every lake path (schemas.lake.safe_job_id),
and injective encodings where ids become file names (live results, alerts, job pages).
Property-based (hypothesis) over random ids."""
from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dashboards.job_page import job_page_path
from schemas.lake import manifest_path, safe_job_id, trace_dir
from schemas.raw import raw_dir
from transforms.live.results import name_part, result_path

ids = st.text(min_size=0, max_size=24)


@given(ids)
@settings(max_examples=300, deadline=None)
def test_a_job_id_is_either_refused_or_stays_inside_its_partition(job_id):
    try:
        safe_job_id(job_id)
    except ValueError as error:
        assert repr(job_id) in str(error)
        for build in (lambda: trace_dir("/lake", "2024-01-01", job_id), lambda: manifest_path("/lake", "2024-01-01", job_id),
                      lambda: raw_dir("/lake", "kineto", "2024-01-01", job_id)):
            with pytest.raises(ValueError):
                build()
        return
    folder = trace_dir("/lake", "2024-01-01", job_id)
    assert folder == f"/lake/traces/date=2024-01-01/job_id={job_id}"
    assert "/" not in job_id and ".." not in job_id and not job_id.startswith((".", "_"))
    assert manifest_path("/lake", "2024-01-01", job_id).rsplit("/", 1)[-1] == f"{job_id}.parquet"


@pytest.mark.parametrize("job_id", ["../../x", "a/b", "_hidden", ".dot", "a=b", "", "x\ny", "a\x00b", "é"])
def test_hostile_ids_are_refused(job_id):
    with pytest.raises(ValueError, match="job id"):
        safe_job_id(job_id)


@given(st.tuples(ids, ids), st.tuples(ids, ids))
@settings(max_examples=300, deadline=None)
def test_live_file_names_never_collide(first, second):
    def path(job, session):
        return result_path("/out", {"job_id": job, "session": session, "revision": 1, "first_arrival": 1.7e9})

    if first != second:
        assert path(*first) != path(*second)
    assert "/" not in name_part(first[0]) and "--" not in name_part(first[0])


def test_the_collision_the_old_names_had():
    assert name_part("a--b") + "--" + name_part("c") != name_part("a") + "--" + name_part("b--c")


@given(ids, ids)
@settings(max_examples=300, deadline=None)
def test_job_pages_never_collide(first, second):
    date = dt.date(2024, 1, 1)
    if first != second:
        assert job_page_path(date, first) != job_page_path(date, second)
    assert job_page_path(date, first).count("/") == 1


# --------------------------------------------------------------------------- corrupt bytes


@pytest.fixture(scope="module")
def corruptible(tmp_path_factory):
    """One generated job written as parquet (one file per stage), its clean S, and a validator."""
    from transforms.validation import Validator
    from transforms.io.lake import write_job
    from transforms.synth.job import JobSpec, generate_job
    from transforms.whatif import analyze_job

    lake = str(tmp_path_factory.mktemp("corrupt") / "lake")
    job = generate_job(JobSpec("victim", dp=2, pp=2, microbatches=4, steps=4, sessions=1, seed=9))
    written = write_job(lake, job.spec.date, "victim", dict(job.files()), job.manifest)
    clean = analyze_job(job.trace, job.meta, "victim").slowdown
    return written, clean, Validator()


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_random_byte_corruption_is_quarantined_or_harmless(corruptible, data):
    """Flip random bytes of one trace file: the window is quarantined with a reason, or (the bytes
    did not matter) analysed to exactly the clean S. Never a crash, never a different S."""
    import pathlib

    from transforms.batch.analyze_jobs import analyze_group
    from transforms.batch.elements import WindowGroup
    from transforms.batch.match import match_windows
    from transforms.whatif import analyze_job

    written, clean, validator = corruptible
    path = pathlib.Path(data.draw(st.sampled_from(written.trace_files)))
    original = path.read_bytes()
    positions = data.draw(st.lists(st.integers(0, len(original) - 1), min_size=1, max_size=4, unique=True))
    corrupted = bytearray(original)
    for position in positions:
        corrupted[position] ^= data.draw(st.integers(1, 255))
    try:
        path.write_bytes(bytes(corrupted))
        (outcome,) = analyze_group(WindowGroup(tuple(match_windows([written], validator))), validator, analyze_job)
    finally:
        path.write_bytes(original)
    if outcome.stats.status == "quarantined":
        assert outcome.stats.reason_code and outcome.tables["quarantine"].num_rows
    else:
        summary = outcome.tables["job_summary"].to_pylist()[0]
        assert summary["slowdown"] == clean
