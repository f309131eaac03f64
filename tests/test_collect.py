"""The trainer-side collector (strag_collect) and `strag land`: real committed torch.profiler runs
(tests/data/real_runs) land in a local and a moto S3 lake in the raw layout, and strag reads them back.

torch is not installed here: a stand-in profiler's `export_chrome_trace(path)` writes a committed
rank trace, which is all the handler asks of torch.profiler.profile.
"""
from __future__ import annotations

import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import types

import fsspec
import pytest
import yaml
from fsspec.implementations.memory import MemoryFileSystem

from fake_profiler import FakeProfiler
from fixtures_s3 import moto_s3  # noqa: F401 - a fixture
from pipelines import analyze as analyze_cli
from pipelines import cli
from schemas.raw import JOB_YAML_KEYS, LAYOUT_DIMS, raw_dir
from strag_collect import CollectorWarning, kineto, kineto_handler, window_dir
from transforms.ingest import convert_window
from transforms.ingest.common import read_job_yaml
from transforms.io.lake import list_raw_jobs

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "data" / "real_runs"
DATE = "2026-11-25"


class BlockedStore(MemoryFileSystem):
    """A store whose writes wait for `release`, then fail: a stalled, then refusing, object store."""

    protocol = "strag-blocked"
    store, pseudo_dirs = {}, [""]   # its own, not memory://'s: its folders must not appear in other tests' lakes
    release = threading.Event()
    attempts = 0

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            type(self).release.wait(30)
            type(self).attempts += 1
            raise PermissionError(f"{path}: access denied")
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation(BlockedStore.protocol, BlockedStore, clobber=True)


def _truth(run: str) -> dict:
    return json.loads((RUNS / run / "truth.json").read_text())


def _rank_traces(run: str) -> dict[int, pathlib.Path]:
    return {int(name.split("-")[1].split(".")[0]): RUNS / run / name for name in _truth(run)["trace_files"]}


@pytest.fixture(autouse=True)
def local_temp(tmp_path, monkeypatch) -> pathlib.Path:
    """The handler's local temporary files go here, so a test can check none is left behind."""
    folder = tmp_path / "local-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _land_run(run: str, lake: str, job_id: str, **options) -> list[str]:
    """Every rank of a committed run through its own handler, as each rank of the job would; the URLs landed."""
    landed = []
    options.setdefault("record_gc", False)   # committed traces of another process: this one's collections are not theirs
    options.setdefault("record_host", False)   # ... nor this machine's cores
    for rank, trace in sorted(_rank_traces(run).items()):
        handler = kineto_handler(lake, job_id=job_id, date=DATE, rank=rank, world=4, **options)
        handler(FakeProfiler(trace))
        assert handler.flush(timeout=60)
        landed += handler.landed
    return landed


def _visible_files(folder: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


# ---- the handler ----------------------------------------------------------------------------------------------


def test_handler_lands_gzipped_rank_traces_and_job_yaml(tmp_path, local_temp):
    lake = str(tmp_path / "lake")
    run = "clean-gpipe-pp4-mlp-sleep-data-s1"
    landed = _land_run(run, lake, "gpipe-run", mesh={"pp": 4}, schedule="ScheduleGPipe", microbatches=6)
    folder = pathlib.Path(raw_dir(lake, "kineto", DATE, "gpipe-run"))
    files = _visible_files(folder)   # hidden temporaries included: none may be left
    assert sorted(files) == ["job.yaml", "rank-0.0.json.gz", "rank-1.0.json.gz", "rank-2.0.json.gz", "rank-3.0.json.gz"]
    assert sorted(landed) == sorted(f"{folder}/{name}" for name in files)
    for rank, trace in _rank_traces(run).items():
        assert gzip.decompress(files[f"rank-{rank}.0.json.gz"]) == gzip.decompress(trace.read_bytes())
    job_yaml = files["job.yaml"].decode()
    assert yaml.safe_load(job_yaml) == {"dp_size": 1, "pp_size": 4, "tp_size": 1, "cp_size": 1, "layout": "pp-tp-cp-dp"}
    assert "# schedule: ScheduleGPipe" in job_yaml and "# microbatches: 6" in job_yaml and "# world_size: 4" in job_yaml
    assert read_job_yaml(files["job.yaml"]) and not list(local_temp.iterdir())


def test_a_collected_run_imports_and_analyses_like_the_folder_itself(tmp_path, capsys):
    """End to end: four ranks through the handler, `strag import` as a user runs it on the landed
    window, `strag analyze --lake`: the same S as the run's own folder without job.yaml."""
    lake = str(tmp_path / "lake")
    run = "clean-gpipe-pp4-mlp-sleep-data-s1"
    _land_run(run, lake, "gpipe-run", mesh={"pp": 4})
    window = raw_dir(lake, "kineto", DATE, "gpipe-run")
    imported = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "import", "--format", "kineto", window, "--lake", lake,
         "--job-id", "gpipe-run", "--date", DATE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr
    assert "imported job gpipe-run on 2026-11-25" in imported.stdout and "dp 1 x pp 4" in imported.stdout
    from_lake, from_folder = tmp_path / "lake.json", tmp_path / "folder.json"
    assert analyze_cli.run(["--lake", lake, "--job-id", "gpipe-run", "--json", str(from_lake)]) == 0
    folder = tmp_path / "run"
    folder.mkdir()
    for trace in _rank_traces(run).values():
        shutil.copy(trace, folder)
    assert analyze_cli.run(["--format", "kineto", str(folder), "--json", str(from_folder)]) == 0
    lake_result, folder_result = (json.loads(p.read_text()) for p in (from_lake, from_folder))
    assert lake_result["blocking_slowdown"] == pytest.approx(folder_result["blocking_slowdown"], rel=1e-12)
    assert lake_result["verdict"]["cause"] == folder_result["verdict"]["cause"] == "none"


@pytest.mark.parametrize("run, mesh", [("dpmaj-inter-sleep", {"dp": 2, "pp": 2}),
                                       ("onestep-1f1b-fwd3-sleep", {"pp": 2, "dp": 2})])
def test_job_yaml_from_the_mesh_places_every_rank_where_it_ran(tmp_path, run, mesh):
    """job.yaml's sizes override the traces' process groups, so its layout must be right: the
    converter, reading it alone, puts each rank at its true (dp, pp) coordinates."""
    lake = str(tmp_path / "lake")
    _land_run(run, lake, "meshed", mesh=mesh)
    folder = pathlib.Path(raw_dir(lake, "kineto", DATE, "meshed"))
    converted = convert_window("kineto", sorted(str(p) for p in folder.iterdir()), "meshed", DATE)
    assert converted.source["layout"].startswith("job.yaml layout")
    found = {int(w["rank"]): (int(w["dp_rank"]), int(w["stage"])) for w in converted.manifest["workers"]}
    assert found == {int(r): (c["dp"], c["pp"]) for r, c in _truth(run)["rank_coords"].items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_uploads_run_below_training_priority(tmp_path, monkeypatch):
    """gzip and the writes of a window run in a thread at UPLOAD_NICENESS below the trainer's (capped
    at 19); the training thread keeps its own priority."""
    seen = []
    real = kineto.land_file

    def spy(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():   # not the lake check at set-up
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(*args, **kwargs)

    monkeypatch.setattr(kineto, "land_file", spy)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    _land_run("dp4-ddp-sleep", str(tmp_path / "lake"), "nice-run")
    assert seen and set(seen) == {min(before + kineto.UPLOAD_NICENESS, 19)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_only_rank_0_writes_job_yaml(tmp_path):
    lake = str(tmp_path / "lake")
    handler = kineto_handler(lake, job_id="j", date=DATE, rank=1, world=4, mesh={"dp": 4})
    handler(FakeProfiler(_rank_traces("dp4-ddp-sleep")[1]))
    assert handler.flush(timeout=60)
    assert sorted(_visible_files(pathlib.Path(raw_dir(lake, "kineto", DATE, "j")))) == ["rank-1.0.json.gz"]


def test_each_window_is_its_own_job_window(tmp_path):
    """A profiler schedule with repeat calls the handler once per window; the converter reads one
    window per folder, so window n >= 1 lands as job `J@n` and no window overwrites another."""
    lake = str(tmp_path / "lake")
    handler = kineto_handler(lake, job_id="j", date=DATE, rank=0, world=4, compress=False)
    for _ in range(3):
        handler(FakeProfiler(_rank_traces("dp4-ddp-sleep")[0]))
        assert handler.flush(timeout=60)
    windows = {job.job_id: [p.rsplit("/", 1)[-1] for p in job.trace_files] for job in list_raw_jobs(lake)}
    assert windows == {"j": ["job.yaml", "rank-0.0.json"], "j@1": ["job.yaml", "rank-0.1.json"],
                       "j@2": ["job.yaml", "rank-0.2.json"]}
    assert window_dir(lake, DATE, "j", 2) == raw_dir(lake, "kineto", DATE, "j@2")


def test_rank_and_world_come_from_torch_distributed_else_the_environment(tmp_path, monkeypatch):
    lake = str(tmp_path / "lake")
    trace = FakeProfiler(_rank_traces("dp4-ddp-sleep")[2])
    distributed = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                        get_rank=lambda: 2, get_world_size=lambda: 4)
    monkeypatch.setitem(sys.modules, "torch.distributed", distributed)
    monkeypatch.setenv("RANK", "3")
    handler = kineto_handler(lake, job_id="from-dist", date=DATE)
    handler(trace)
    assert handler.flush(timeout=60) and handler.landed[-1].endswith("/job_id=from-dist/rank-2.0.json.gz")
    monkeypatch.delitem(sys.modules, "torch.distributed")
    handler = kineto_handler(lake, job_id="from-env", date=DATE)
    handler(trace)
    assert handler.flush(timeout=60) and handler.landed[-1].endswith("/job_id=from-env/rank-3.0.json.gz")


def test_a_stalled_then_failing_store_never_reaches_the_training_loop(tmp_path, local_temp):
    """The call returns while storage hangs (the upload runs beside training); once storage answers
    with errors, bounded retries, then one warning per file naming it and the error, no exception."""
    BlockedStore.release.clear()
    BlockedStore.attempts = 0
    handler = kineto_handler("strag-blocked://lake", job_id="j", date=DATE, rank=0, world=4, retries=2, backoff=0.01,
                             check=False)   # the store fails once training runs (check_lake would refuse it at set-up)
    with pytest.warns(CollectorWarning) as caught:
        handler(FakeProfiler(_rank_traces("dp4-ddp-sleep")[0]))   # returns although the store does not answer
        assert not handler.flush(timeout=0)
        BlockedStore.release.set()
        assert handler.flush(timeout=30)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and BlockedStore.attempts == 2 * 3   # job.yaml and the trace, 1 + 2 retries each
    assert "job_id=j/job.yaml not written after 3 attempt(s) (PermissionError" in messages[0]
    assert "job_id=j/rank-0.0.json.gz not written after 3 attempt(s)" in messages[1]
    assert handler.landed == [] and not list(local_temp.iterdir())


def test_the_default_retry_policy_is_bounded(monkeypatch):
    """Default policy against a store that always fails: 3 retries, at most 0.5 + 1 + 2 s of sleep per file."""
    slept = []
    monkeypatch.setattr(kineto.time, "sleep", slept.append)
    BlockedStore.release.set()
    with pytest.raises(PermissionError):
        kineto.land_file(b"{}", "strag-blocked://lake/f.json.gz", compress=True)
    assert len(slept) == 3 and all(0 <= s <= bound for s, bound in zip(slept, (0.5, 1.0, 2.0)))


def test_an_export_that_fails_is_a_warning(tmp_path):
    class Broken:
        def export_chrome_trace(self, path):
            raise RuntimeError("kineto: no trace collected")

    handler = kineto_handler(str(tmp_path / "lake"), job_id="j", date=DATE, rank=0, world=1)
    with pytest.warns(CollectorWarning, match="window 0 of job j not landed .RuntimeError: kineto: no trace collected"):
        handler(Broken())
    assert handler.flush(timeout=5) and not list((tmp_path / "lake").rglob("*"))   # the set-up probe left nothing


def test_a_trace_above_the_size_cap_is_skipped_with_a_warning(tmp_path, local_temp):
    handler = kineto_handler(str(tmp_path / "lake"), job_id="j", date=DATE, rank=0, world=4, max_bytes=1000)
    with pytest.warns(CollectorWarning, match=r"rank-0\.0\.json\.gz skipped: the trace is [\d,]+ bytes, above max_bytes=1,000"):
        handler(FakeProfiler(_rank_traces("dp4-ddp-sleep")[0]))
    assert handler.flush(timeout=5) and not list((tmp_path / "lake").rglob("*")) and not list(local_temp.iterdir())


def test_set_up_mistakes_fail_at_once():
    for bad in ({"job_id": "../x"}, {"job_id": "j", "date": "25/11/2026"}, {"job_id": "j", "max_bytes": 0}):
        with pytest.raises(ValueError):
            kineto_handler("lake", **bad)


def test_the_lake_is_checked_before_training_with_one_clear_error(tmp_path):
    """An unknown scheme, a filesystem whose package is missing and a store that refuses writes are
    found when the handler is made, before the first step, each with one line saying what to do."""
    from strag_collect import check_lake

    with pytest.raises(ValueError, match=r"lake foo://x: unknown URL scheme 'foo'"):
        kineto_handler("foo://x", job_id="j")
    from fsspec.registry import known_implementations

    missing = next(p for p, spec in known_implementations.items()
                   if p in ("gs", "gcs", "abfs", "az", "hdfs", "sftp", "smb") and not _importable(spec["class"]))
    with pytest.raises(ValueError, match=rf"lake {missing}://b/lake: the {missing}:// filesystem's package is not installed"):
        kineto_handler(f"{missing}://b/lake", job_id="j")
    was_released = BlockedStore.release.is_set()
    BlockedStore.release.set()   # refuse at once, not after a stall
    try:
        with pytest.raises(OSError, match=r"lake strag-blocked://lake: cannot write there \(PermissionError"):
            check_lake("strag-blocked://lake")
    finally:
        if not was_released:
            BlockedStore.release.clear()
    check_lake(str(tmp_path / "new-lake"))   # a folder that does not exist yet is made; nothing is left in it
    assert list((tmp_path / "new-lake").iterdir()) == []


def _importable(class_path: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(class_path.split(".")[0]) is not None


def test_cadence_and_run_id(monkeypatch):
    from strag_collect import cadence, run_id

    assert cadence() == {"wait": 196, "warmup": 1, "active": 3, "repeat": 0}
    assert sum(cadence(every=50).values()) - cadence(every=50)["repeat"] == 50
    with pytest.raises(ValueError, match="every must exceed"):
        cadence(every=4)
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert run_id() == ""
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "41235")     # a Lightning or mp.spawn launcher's port of this run
    assert run_id() == "10.0.0.7-41235"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a1b2")
    assert run_id() == "a1b2"


def test_importing_the_collector_loads_no_heavy_library():
    probe = ("import sys, strag_collect; print(sorted(m for m in ('apache_beam', 'pyarrow', 'numpy', 'pandas', 'torch', "
             "'yaml', 'schemas', 'transforms') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_collector_copies_of_the_contract_match_the_lake_schemas():
    from schemas.lake import _JOB_ID
    from transforms.ingest.kineto.spans import _DIM_TOKENS

    assert kineto._JOB_ID.pattern == _JOB_ID.pattern
    assert kineto.DIM_TOKENS == _DIM_TOKENS and kineto._LAYOUT_DIMS == LAYOUT_DIMS
    assert window_dir("s3://b/lake/", DATE, "j") == raw_dir("s3://b/lake", "kineto", DATE, "j")


class FakeDeviceMesh:
    """What job_yaml_fields reads of a torch DeviceMesh: mesh_dim_names and the rank tensor `mesh`."""

    def __init__(self, names, shape, ranks):
        self.mesh_dim_names = names
        self.mesh = types.SimpleNamespace(shape=shape, flatten=lambda: types.SimpleNamespace(tolist=lambda: ranks))


@pytest.mark.parametrize("mesh, world, expected", [
    ({"dp": 2, "pp": 2}, 4, (2, 2, 1, 1, "pp-dp-tp-cp")),
    ({"pp": 2, "dp": 2}, 4, (2, 2, 1, 1, "dp-pp-tp-cp")),
    ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, 8, (4, 1, 2, 1, "tp-dp-cp-pp")),
    ({"pipeline": 2, "data_parallel": 2, "ep": 1}, None, (2, 2, 1, 1, "dp-pp-tp-cp")),
    (FakeDeviceMesh(("pp", "dp"), (2, 2), [0, 1, 2, 3]), 4, (2, 2, 1, 1, "dp-pp-tp-cp")),
    (FakeDeviceMesh(("pp", "dp"), (2, 2), [0, 2, 1, 3]), 4, None),   # not rank order: the groups say
    (FakeDeviceMesh(None, (4,), [0, 1, 2, 3]), 4, None),
    ({"dp": 2, "ep": 2}, 4, None),                                   # a dim strag does not model
    ({"dp": 2, "tp": 2, "fsdp": 2}, 8, None),                        # dp split by tp
    ({"dp": 2, "pp": 2}, 8, None),                                   # not the world
])
def test_job_yaml_fields_from_a_mesh(mesh, world, expected):
    fields = kineto.job_yaml_fields(mesh, world)
    if expected is None:
        assert fields == {}
    else:
        assert tuple(fields[k] for k in ("dp_size", "pp_size", "tp_size", "cp_size", "layout")) == expected
    text = kineto._job_yaml(mesh, world, types.SimpleNamespace(_n_microbatches=8), None)
    assert set(yaml.safe_load(text) or {}) <= set(JOB_YAML_KEYS)
    assert read_job_yaml(text) == fields and "# schedule: SimpleNamespace" in text and "# microbatches: 8" in text


def test_handler_writes_to_s3_with_nothing_hidden_left(moto_s3):  # noqa: F811
    lake = moto_s3.url("collected")
    _land_run("clean-gpipe-pp4-mlp-sleep-data-s1", lake, "gpipe-run", mesh={"pp": 4})
    fs = moto_s3.filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.find(raw_dir(lake, "kineto", DATE, "gpipe-run")))
    assert names == ["job.yaml", "rank-0.0.json.gz", "rank-1.0.json.gz", "rank-2.0.json.gz", "rank-3.0.json.gz"]


# ---- strag land -----------------------------------------------------------------------------------------------


def test_land_a_run_folder_into_a_local_lake_then_import(tmp_path, capsys):
    """A tensorboard_trace_handler run folder (its names kept) with the run's notes (truth.json) beside the traces."""
    lake = str(tmp_path / "lake")
    run = RUNS / "clean-loopedbfs-dpmajor-flat-mlp-sleep-s0"
    assert cli.main(["land", str(run), "--lake", lake, "--job-id", "landed", "--date", DATE]) == 0
    printed = capsys.readouterr().out
    assert "landed 4 rank traces of job landed on 2026-11-25" in printed and "left out: truth.json" in printed
    window = pathlib.Path(raw_dir(lake, "kineto", DATE, "landed"))
    assert _visible_files(window) == {p.name: p.read_bytes() for p in run.glob("*.pt.trace.json.gz")}
    assert cli.main(["import", "--format", "kineto", str(window), "--lake", lake, "--job-id", "landed",
                     "--date", DATE]) == 0
    assert "imported job landed on 2026-11-25" in capsys.readouterr().out


def test_land_gzips_plain_traces_and_checks_job_yaml(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    for rank, trace in _rank_traces("dp4-ddp-sleep").items():
        (folder / f"rank-{rank}.json").write_bytes(gzip.decompress(trace.read_bytes()))
    (folder / "job.yaml").write_text("dp_size: 4\n")
    lake = str(tmp_path / "lake")
    assert cli.main(["land", str(folder), "--lake", lake, "--job-id", "plain", "--date", DATE]) == 0
    assert "landed 4 rank traces and job.yaml" in capsys.readouterr().out
    files = _visible_files(pathlib.Path(raw_dir(lake, "kineto", DATE, "plain")))
    assert sorted(files) == ["job.yaml", "rank-0.json.gz", "rank-1.json.gz", "rank-2.json.gz", "rank-3.json.gz"]
    assert gzip.decompress(files["rank-2.json.gz"]) == (folder / "rank-2.json").read_bytes()
    (folder / "job.yaml").write_text("world_size: 4\n")
    assert cli.main(["land", str(folder), "--lake", lake, "--job-id", "plain2", "--date", DATE]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key(s) world_size" in err[0] and "[raw_bad_job_yaml]" in err[0]


def test_land_into_an_s3_lake_then_import(tmp_path, moto_s3, capsys):  # noqa: F811
    lake = moto_s3.url("landed")
    run = RUNS / "dpmaj-inter-sleep"
    assert cli.main(["land", str(run), "--lake", lake, "--job-id", "s3-run", "--date", DATE]) == 0
    window = raw_dir(lake, "kineto", DATE, "s3-run")
    names = sorted(p.rsplit("/", 1)[-1] for p in moto_s3.filesystem().find(window))
    assert names == ["rank-0.json.gz", "rank-1.json.gz", "rank-2.json.gz", "rank-3.json.gz"]
    assert cli.main(["import", "--format", "kineto", window, "--lake", lake, "--job-id", "s3-run", "--date", DATE]) == 0
    printed = capsys.readouterr().out
    assert "imported job s3-run on 2026-11-25" in printed and "dp 2 x pp 2" in printed


def _land_error(argv: list[str], capsys) -> str:
    try:
        code = cli.main(["land", *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_land_usage_errors_are_one_line_and_exit_2(tmp_path, capsys):
    lake = str(tmp_path / "lake")
    run = str(RUNS / "dp4-ddp-sleep")
    assert "/nope: no such folder" in _land_error(["/nope", "--lake", lake, "--job-id", "x"], capsys)
    assert "--job-id: job id '../x'" in _land_error([run, "--lake", lake, "--job-id", "../x"], capsys)
    assert "--session names a live session: give --live too" in _land_error(
        [run, "--lake", lake, "--job-id", "x", "--session", "s1"], capsys)
    assert "--session: session 'a/b'" in _land_error([run, "--lake", lake, "--job-id", "x", "--live", "--session", "a/b"],
                                                     capsys)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "truth.json").write_text('{"run": "x"}')
    assert "no torch.profiler traces" in _land_error([str(tmp_path / "notes"), "--lake", lake, "--job-id", "x"], capsys)
    assert not (tmp_path / "lake").exists()


def test_land_refuses_a_truncated_trace_and_lands_nothing(tmp_path, capsys):
    """A rank file cut short (gzip or plain JSON) would make an incomplete window: nothing lands."""
    lake = tmp_path / "lake"
    for name, cut in (("rank-1.json.gz", lambda b: b[: len(b) // 2]),
                      ("rank-1.json", lambda b: gzip.decompress(b)[:-5000])):
        folder = tmp_path / name
        folder.mkdir()
        for rank, trace in _rank_traces("dp4-ddp-sleep").items():
            data = trace.read_bytes()
            (folder / f"rank-{rank}.json.gz").write_bytes(data)
        (folder / "rank-1.json.gz").unlink()
        (folder / name).write_bytes(cut((RUNS / "dp4-ddp-sleep" / "rank-1.json.gz").read_bytes()))
        err = _land_error([str(folder), "--lake", str(lake), "--job-id", "cut", "--date", DATE], capsys)
        assert name in err and "cut short" in err and "nothing was landed" in err
    assert not lake.exists()


def test_a_one_process_trace_lands_live_as_rank_0_of_1(tmp_path, capsys):
    """torch writes no distributedInfo without a process group: one such trace is a one-process job
    (where most users start), landed live as rank 0 of 1; two such traces are still refused."""
    run = pathlib.Path(__file__).parent / "data" / "real_stacks" / "single-gc-r0-llama-packed"
    lake = tmp_path / "lake"
    assert cli.main(["land", str(run), "--lake", str(lake), "--job-id", "one", "--date", DATE, "--live",
                     "--session", "s1"]) == 0
    assert [p.name for p in (lake / "landing" / "one" / "s1").iterdir()] == ["rank-0-of-1.json.gz"]
    two = tmp_path / "two"
    two.mkdir()
    for name in ("rank-0.json.gz", "rank-1.json.gz"):
        shutil.copy(run / "rank-0.json.gz", two / name)
    err = _land_error([str(two), "--lake", str(lake), "--job-id", "two", "--date", DATE, "--live"], capsys)
    assert "no distributedInfo" in err


def test_a_second_run_of_a_job_id_never_mixes_into_the_first_runs_window(tmp_path, capsys):
    """Landing the same run again (after a storage failure, say) is fine; another run of the job id on the
    same date (same rank file names, other traces; or ranks the first did not have) is refused with one
    line, and the first run's window is left as it was."""
    lake = str(tmp_path / "lake")
    first, second = RUNS / "dp4-ddp-sleep", RUNS / "allreduce-r1-dp4-ddp-mlp-cpu"
    assert cli.main(["land", str(first), "--lake", lake, "--job-id", "j", "--date", DATE]) == 0
    window = pathlib.Path(raw_dir(lake, "kineto", DATE, "j"))
    before = _visible_files(window)
    assert cli.main(["land", str(first), "--lake", lake, "--job-id", "j", "--date", DATE]) == 0   # the same again
    capsys.readouterr()
    err = _land_error([str(second), "--lake", lake, "--job-id", "j", "--date", DATE], capsys)
    assert "job j already has a window of another run landed on 2026-11-25" in err and "differ" in err
    assert "--job-id j-run2" in err and _visible_files(window) == before
    (window / "rank-9.json.gz").write_bytes(b"")    # a rank of another run the folder has and this run lacks
    err = _land_error([str(first), "--lake", lake, "--job-id", "j", "--date", DATE], capsys)
    assert "rank-9.json.gz is not in this folder" in err


def test_land_on_failing_storage_exits_1_naming_the_file(tmp_path, monkeypatch, capsys):
    BlockedStore.release.set()
    monkeypatch.setenv("STRAG_IO_ATTEMPTS", "2")
    monkeypatch.setenv("STRAG_IO_BACKOFF_S", "0.01")
    code = cli.main(["land", str(RUNS / "dp4-ddp-sleep"), "--lake", "strag-blocked://lake", "--job-id", "x", "--date", DATE])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert "storage failed" in err[0] and "job_id=x/rank-0.json.gz" in err[0] and "PermissionError" in err[0]


@pytest.mark.slow
def test_the_collector_installs_alone_in_a_fresh_venv(tmp_path):
    """`pip install ./collector` (the README's one command) in a fresh venv: strag_collect imports and
    checks a lake; none of the analysis side comes with it (no pyarrow, numpy, Beam, no `strag` command,
    no schemas / transforms / pipelines packages). Built from a copy, so the checkout stays clean."""
    import venv

    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "collector", copy / "collector", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    shutil.copytree(ROOT / "strag_collect", copy / "strag_collect", ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = tmp_path / "trainer-env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", str(copy / "collector")], cwd=tmp_path,
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    probe = ("import importlib.util as u, strag_collect; strag_collect.check_lake(%r); "
             "print(sorted(m for m in ('pyarrow', 'numpy', 'apache_beam', 'pandas', 'schemas', 'transforms', 'pipelines', "
             "'dashboards', 'orchestration') if u.find_spec(m)))" % str(tmp_path / "lake"))
    shown = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout.strip() == "[]", shown.stderr[-2000:]
    assert not (env_dir / "bin" / "strag").exists()
    names = subprocess.run([str(python), "-m", "pip", "list", "--format", "freeze"], capture_output=True, text=True,
                           timeout=120).stdout.lower()
    assert "strag-collect==" in names and "strag==" not in names and "pyarrow" not in names


def test_each_window_carries_the_python_collections_of_its_time(tmp_path):
    """The handler records gc.callbacks from its set-up on, and each exported window gets the
    collections since the previous one (wall-clock ns, the clock Kineto's baseTimeNanoseconds counts)."""
    import gc as python_gc
    import time as clock

    handler = kineto_handler(str(tmp_path / "lake"), job_id="j", date=DATE, rank=0, world=1)
    before = clock.time_ns()
    python_gc.collect()
    python_gc.collect(0)
    handler(FakeProfiler(_rank_traces("dp4-ddp-sleep")[0]))
    assert handler.flush(timeout=30)
    [landed] = [url for url in handler.landed if url.endswith(".json.gz")]
    record = json.loads(gzip.decompress(pathlib.Path(landed).read_bytes()))["strag_gc"]
    assert record["clock"] == "unix_ns" and len(record["pauses"]) >= 2
    assert all(before <= start <= stop <= clock.time_ns() for start, stop, _ in record["pauses"])
    assert {generation for *_, generation in record["pauses"]} >= {0, 2}
    handler(FakeProfiler(_rank_traces("dp4-ddp-sleep")[0]))   # the next window: only what ran since
    assert handler.flush(timeout=30)
    second = [url for url in handler.landed if url.endswith("rank-0.1.json.gz")][0]
    later = json.loads(gzip.decompress(pathlib.Path(second).read_bytes()))["strag_gc"]["pauses"]
    assert all(start > record["pauses"][-1][1] for start, _, _ in later)
    assert handler.close(timeout=30)   # the recorder leaves gc.callbacks
    assert all(getattr(callback, "__self__", None) is not handler.gc for callback in python_gc.callbacks)


def test_each_window_carries_how_crowded_its_host_is(tmp_path, monkeypatch):
    """Each exported window says how many cores the rank may run on (its CPU affinity), torch's
    threads (when torch is loaded) and the job's ranks on the host (torchrun's LOCAL_WORLD_SIZE)."""
    import os
    import sys
    import types

    from strag_collect.hostrecord import host_record

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda: 3))
    handler = kineto_handler(str(tmp_path / "lake"), job_id="j", date=DATE, rank=0, world=1, record_gc=False)
    handler(FakeProfiler(_rank_traces("dp4-ddp-sleep")[0]))
    assert handler.flush(timeout=30)
    [landed] = [url for url in handler.landed if url.endswith(".json.gz")]
    record = json.loads(gzip.decompress(pathlib.Path(landed).read_bytes()))["strag_host"]
    assert record == {"cpus": len(os.sched_getaffinity(0)), "threads": 3, "local_ranks": 4}
    # unknowns are None, never guesses: no torch loaded, no torchrun, a stand-in without the call
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delitem(sys.modules, "torch")
    assert host_record()["threads"] is None and host_record()["local_ranks"] is None
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "zero")
    assert host_record() == {"cpus": len(os.sched_getaffinity(0)), "threads": None, "local_ranks": None}
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")   # launched by mpirun
    assert host_record()["local_ranks"] == 8


def test_a_container_s_cpu_quota_bounds_the_cores_it_records(tmp_path, monkeypatch):
    from strag_collect import hostrecord

    quota = tmp_path / "cpu.max"
    for text, cores in (("max 100000\n", None), ("400000 100000\n", 4), ("150000 100000", 2), ("garbage", None)):
        quota.write_text(text)
        assert hostrecord.cpu_quota(str(quota)) == cores
    assert hostrecord.cpu_quota(str(tmp_path / "absent")) is None
    quota.write_text("100000 100000")   # a 1-core container on a machine of many
    monkeypatch.setattr(hostrecord, "CPU_MAX", str(quota))
    assert hostrecord.host_record()["cpus"] == 1


def test_append_top_level_writes_before_the_closing_brace(tmp_path):
    from strag_collect.gcrecord import append_top_level

    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [{"ph": "X"}],\n "traceName": "x"\n}\n\n')
    append_top_level(str(path), "strag_gc", {"clock": "unix_ns", "pauses": [[1, 2, 0]]})
    assert json.loads(path.read_text()) == {"traceEvents": [{"ph": "X"}], "traceName": "x",
                                            "strag_gc": {"clock": "unix_ns", "pauses": [[1, 2, 0]]}}
    for bad in ("[1, 2]", "{}", "{\"a\": 1"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            append_top_level(str(path), "k", 1)
