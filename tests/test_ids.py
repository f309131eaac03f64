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
from transforms.live import name_part, result_path

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
