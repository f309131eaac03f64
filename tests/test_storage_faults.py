"""Failing storage is not bad data (transforms/io/storage.py, ARCHITECTURE.md "Errors").

The lake is read through `faulty://` (tests/faulty_storage.py), which raises connection resets,
timeouts, throttling and permission errors, or drops a connection halfway, on a schedule:
- transient faults are retried at the IO layer and the run publishes exactly the tables of a
  fault-free run;
- a fault that outlasts the retries fails the run: exit code 1, the failure record names the
  file, the published tables stay byte for byte as they were, no staging is left behind;
- corrupt bytes that did arrive are still bad data: quarantined, and the run goes on.
"""
from __future__ import annotations

import json
import pathlib

import pytest

from batch_lake import DATES, write_batch_lake
from faulty_storage import PARTIAL_READ, Fault, faults, injected
from pipelines import batch
from schemas.raw import raw_dir
from schemas.tables import read_table
from transforms.io.storage import RetryPolicy, StorageError, read_bytes

pytestmark = pytest.mark.slow
DATA = pathlib.Path(__file__).parent / "data" / "real_traces"


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setenv("STRAG_IO_ATTEMPTS", "4")
    monkeypatch.setenv("STRAG_IO_BACKOFF_S", "0.001")


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> str:
    """The batch test lake plus one raw Kineto window, on local disk."""
    path = tmp_path_factory.mktemp("faults") / "lake"
    write_batch_lake(str(path))
    folder = pathlib.Path(raw_dir(str(path), "kineto", DATES[0], "raw-run"))
    folder.mkdir(parents=True)
    for rank in sorted((DATA / "pp2dp2-1f1b").glob("rank-*.json.gz")):
        (folder / rank.name).write_bytes(rank.read_bytes())
    return str(path)


def _run(lake: str, out: pathlib.Path) -> int:
    return batch.run(["--lake", f"faulty://{lake}", "--from", DATES[0], "--to", DATES[-1], "--out", str(out),
                      "--running-mode", "in_memory", "--workers", "1", "--quiet"])


def _published(out: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.parquet"))
            if not str(p.relative_to(out)).startswith("_")}


@pytest.fixture(scope="module")
def clean_tables(lake, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "tables"
    with faults({}):
        assert _run(lake, out) == 0
    return out, _published(out)


def test_read_bytes_retries_then_gives_up_as_a_storage_error(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"payload")
    with faults({"x.bin": Fault(TimeoutError, times=2)}):
        assert read_bytes(f"faulty://{path}", RetryPolicy(3, 0.0)) == b"payload"
        assert len(injected()) == 2
    with faults({"x.bin": Fault(PermissionError, times=None)}):
        with pytest.raises(StorageError) as caught:
            read_bytes(f"faulty://{path}", RetryPolicy(3, 0.0))
    assert caught.value.attempts == 3 and "PermissionError" in str(caught.value) and str(path) in str(caught.value)
    assert isinstance(caught.value, OSError)


@pytest.mark.parametrize("error", [ConnectionResetError, TimeoutError, PARTIAL_READ])
def test_transient_faults_are_retried_and_change_nothing(lake, clean_tables, tmp_path, error):
    clean_out, clean = clean_tables
    out = tmp_path / "tables"
    schedule = {"traces/date=": Fault(error, times=3), "manifests/date=": Fault(error, times=2),
                "job_id=raw-run/rank-1": Fault(error, times=2)}
    with faults(schedule):
        assert _run(lake, out) == 0
        assert len(injected()) == 7
    assert _published(out) == clean


def test_throttling_beyond_the_retries_fails_loud_and_publishes_nothing(lake, clean_tables, tmp_path, capsys):
    """A file that stays unreadable (S3 SlowDown after the client's own retries) fails the run;
    the tables published before stay exactly as they were."""
    clean_out, clean = clean_tables
    out = tmp_path / "tables"
    with faults({}):
        assert _run(lake, out) == 0
    before = _published(out)
    victim = f"traces/date={DATES[1]}/job_id=stage-c/"
    with faults({victim: Fault(OSError, times=None, message="503 SlowDown: please reduce your request rate")}):
        assert _run(lake, out) == 1
    err = capsys.readouterr().err
    assert "FAILED, nothing published" in err and "stage-c" in err and "SlowDown" in err
    assert _published(out) == before == clean
    failures = list((out / "_runs").glob("*.failed.json"))
    assert len(failures) == 1
    record = json.loads(failures[0].read_text())
    assert record["status"] == "failed" and victim in record["reason"] and "after 4 attempts" in record["reason"]
    assert not (out / "_staging").exists() or not any((out / "_staging").iterdir())


def test_a_raw_window_whose_rank_file_cannot_be_fetched_fails_the_run(lake, tmp_path, capsys):
    """Not raw_unreadable: the bytes never arrived."""
    out = tmp_path / "tables"
    with faults({"job_id=raw-run/rank-2": Fault(ConnectionResetError, times=None)}):
        assert _run(lake, out) == 1
    err = capsys.readouterr().err
    assert "storage error reading" in err and "rank-2.json.gz" in err
    assert not (out / "coverage").exists()


def test_corrupt_bytes_are_still_bad_data(lake, tmp_path):
    """A file whose bytes arrive broken is quarantined (unreadable_file) while transient faults
    on other files are retried; the run completes."""
    broken_lake = tmp_path / "lake"
    import shutil

    shutil.copytree(lake, broken_lake)
    victim = sorted((broken_lake / "traces" / f"date={DATES[0]}" / "job_id=clean-a").glob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[:200])
    out = tmp_path / "tables"
    with faults({"job_id=slow-b/": Fault(ConnectionResetError, times=2)}):
        assert _run(str(broken_lake), out) == 0
    quarantine = read_table(str(out), "quarantine").to_pylist()
    assert any(r["job_id"] == "clean-a" and r["reason_code"] == "unreadable_file" for r in quarantine)
    coverage = {r["job_id"]: r for r in read_table(str(out), "coverage").to_pylist()}
    assert coverage["slow-b"]["status"] == "analysed"
    # the window that lost a file is not analysed on what is left
    assert coverage["clean-a"]["status"] == "quarantined"
    assert not any(r["job_id"] == "clean-a" for r in read_table(str(out), "job_summary").to_pylist())


def test_files_the_listing_cannot_place_are_quarantined(lake, tmp_path, capsys):
    """A misplaced file, a job id outside the alphabet (a leading '_' would hide it) and a
    partition that is not a date: none of them silently skipped."""
    import shutil

    from transforms.io.lake import list_jobs

    messy = tmp_path / "lake"
    shutil.copytree(lake, messy)
    day = messy / "traces" / f"date={DATES[0]}"
    (day / "stray.parquet").write_bytes(b"x")
    hidden = day / "job_id=_hidden"
    hidden.mkdir()
    shutil.copy(next((day / "job_id=clean-a").glob("*.parquet")), hidden / "part-0.parquet")
    (messy / "manifests" / f"date={DATES[0]}" / "notes.txt").write_text("hello")
    (messy / "traces" / "date=2024-3-1").mkdir()
    (messy / "raw" / "kineto" / "date=2026-13-45" / "job_id=real").mkdir(parents=True)   # no such date
    (messy / "raw" / "kineto" / "date=2026-13-45" / "job_id=real" / "rank-0.json").write_text("{}")
    strays = []
    listed = {job.job_id for job in list_jobs(str(messy), DATES[0], DATES[-1], strays=strays)}
    assert "_hidden" not in listed and "clean-a" in listed
    found = {(entry.reason, entry.path.rsplit("/", 1)[-1]) for entry in strays}
    assert found == {("misplaced_file", "stray.parquet"), ("unsafe_job_id", "part-0.parquet"),
                     ("misplaced_file", "notes.txt"), ("bad_partition", "date=2024-3-1"),
                     ("bad_partition", "date=2026-13-45")}
    out = tmp_path / "tables"
    with faults({}):
        assert _run(str(messy), out) == 0
    err = capsys.readouterr().err
    assert "date=2024-3-1" in err and "raw/kineto/date=2026-13-45" in err and "quarantined as bad_partition" in err
    quarantine = [r for r in read_table(str(out), "quarantine").to_pylist() if r["job_id"] is None]
    assert {(r["reason_code"], r["source_path"].rsplit("/", 1)[-1]) for r in quarantine} == {
        ("misplaced_file", "stray.parquet"), ("unsafe_job_id", "part-0.parquet"), ("misplaced_file", "notes.txt"),
        ("bad_partition", "date=2024-3-1"), ("bad_partition", "date=2026-13-45")}
    # a folder that is no date hides its files from every date: each date of the run says so, once
    undated = [r for r in read_table(str(out), "quarantine").to_pylist() if r["reason_code"] == "bad_partition"]
    assert sorted(str(r["date"]) for r in undated) == sorted([*DATES, *DATES])
    assert all("not a date=YYYY-MM-DD partition" in r["detail"] for r in undated)


# --------------------------------------------------------------------------- S3 through a faulty proxy

from fixtures_s3 import moto_s3  # noqa: E402,F401  (fixture)


@pytest.fixture(scope="module")
def s3_lake(moto_s3, lake):
    """The lake on moto's S3, reached through FaultProxy (tests/fault_proxy.py): every client,
    in this process or a worker process, talks to the proxy (AWS_ENDPOINT_URL)."""
    from fault_proxy import proxied

    moto_s3.filesystem().put(lake, f"{moto_s3.bucket}/lake", recursive=True)
    with proxied(moto_s3) as proxy:
        yield moto_s3, proxy


def _s3_run(moto, out: str, workers: str = "2") -> int:
    return batch.run(["--lake", moto.url("lake"), "--from", DATES[0], "--to", DATES[-1], "--out", out,
                      "--workers", workers, "--quiet"])


def _s3_published(moto, out: str) -> dict[str, bytes]:
    fs = moto.filesystem()
    root = out.removeprefix("s3://")
    return {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(root) if p.endswith(".parquet") and "/_" not in p[len(root):]}


def test_s3_faults_across_worker_processes(s3_lake, clean_tables, monkeypatch):
    """Throttling, 500s, resets and half-sent bodies from a real S3 endpoint, seen by Beam's worker
    processes: retried, and the tables equal a fault-free run's; a key that stays throttled fails
    the run and leaves the published tables as they were."""
    from fault_proxy import ProxyFault

    monkeypatch.setenv("STRAG_IO_BACKOFF_S", "0.01")
    moto, proxy = s3_lake
    out = moto.url("out")
    proxy.set({})
    assert _s3_run(moto, out) == 0
    clean = _s3_published(moto, out)

    def results(tables: str) -> list[tuple]:
        return sorted((r["job_id"], r["slowdown"]) for r in read_table(tables, "job_summary").to_pylist())

    assert results(out) == results(str(clean_tables[0])) and len(results(out)) >= 4   # the proxy is transparent
    proxy.set({"/traces/date=": ProxyFault("throttle", times=1), "/manifests/": ProxyFault("reset", times=1),
               "job_id=slow-b/": ProxyFault("partial", times=1), "job_id=stage-c/": ProxyFault("error", times=1)})
    assert _s3_run(moto, out) == 0
    assert sum(proxy.injected.values()) >= 4 and set(proxy.injected) >= {"throttle", "reset"}
    assert _s3_published(moto, out) == clean
    proxy.set({"job_id=clean-a/": ProxyFault("throttle", times=None)})
    assert _s3_run(moto, out) == 1
    assert proxy.injected["throttle"] >= 4
    assert _s3_published(moto, out) == clean
    proxy.set({})


# --------------------------------------------------------------------------- a Dask worker killed mid-run


def test_dask_worker_killed_mid_run_completes_identically_or_publishes_nothing(moto_s3, lake, tmp_path):
    """A real cluster (`dask scheduler` + 2 `dask worker` processes with nannies), the lake on S3
    (moto): one worker process is SIGKILLed while it analyses. Dask reruns its tasks elsewhere
    (the run then publishes exactly the fault-free results) or gives up (the run fails loud and
    publishes nothing): never a partial result. "Exactly": every published file (each table's every
    date partition, the fleet tables and rollups) byte for byte equal to a fault-free run's over the
    same lake URL (paths in the quarantine rows name the lake), on the in-process FnApiRunner: the
    commit step writes sorted rows with fixed parquet settings, so neither the runner nor a rerun
    task may change a byte."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from distributed import Client

    fs = moto_s3.filesystem()
    if not fs.exists(f"{moto_s3.bucket}/dask-lake"):
        fs.put(lake, f"{moto_s3.bucket}/dask-lake", recursive=True)
    dask = str(pathlib.Path(sys.executable).with_name("dask"))
    scheduler_file = tmp_path / "scheduler.json"
    processes = [subprocess.Popen([dask, "scheduler", "--scheduler-file", str(scheduler_file), "--port", "0",
                                   "--dashboard-address", ":0", "--host", "127.0.0.1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        for _ in range(300):
            if scheduler_file.exists() and scheduler_file.stat().st_size:
                break
            time.sleep(0.1)
        processes += [subprocess.Popen([dask, "worker", "--scheduler-file", str(scheduler_file), "--nthreads", "1",
                                        "--nworkers", "1", "--host", "127.0.0.1", "--dashboard-address", ":0"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
        client = Client(scheduler_file=str(scheduler_file), timeout=60)
        client.wait_for_workers(2, timeout=120)
        address = client.scheduler.address
        pids = client.run(os.getpid)   # worker address -> pid of its process
        killed = []

        def kill_a_busy_worker():
            deadline = time.time() + 120
            while time.time() < deadline and not killed:
                busy = [w for w, tasks in client.processing().items() if tasks]
                if busy:
                    pid = pids[busy[0]]
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_a_busy_worker, daemon=True)
        killer.start()
        out = moto_s3.url("dask-out")
        code = batch.run(["--lake", moto_s3.url("dask-lake"), "--from", DATES[0], "--to", DATES[-1], "--out", out,
                          "--runner", "DaskRunner", "--dask-address", address, "--workers", "2", "--quiet"])
        killer.join(timeout=5)
        assert killed, "no worker was busy to kill"
        print(f"dask run after a worker kill: exit {code}")
        published = _s3_published(moto_s3, out)
        if code == 0:
            clean_out = moto_s3.url("dask-clean")
            assert batch.run(["--lake", moto_s3.url("dask-lake"), "--from", DATES[0], "--to", DATES[-1], "--out", clean_out,
                              "--running-mode", "in_memory", "--workers", "1", "--quiet"]) == 0
            clean = _s3_published(moto_s3, clean_out)
            assert set(clean) == set(published) and len(clean) > 20   # every table, every date, fleet rollups
            assert [name for name in sorted(clean) if published[name] != clean[name]] == []
            assert read_table(out, "job_summary").num_rows >= 4
        else:
            assert code == 1 and not published
            assert not fs.exists(f"{moto_s3.bucket}/dask-out/_commits")
        client.close()
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
