"""Every subcommand given bad arguments: one line on stderr naming the thing and the fix, exit 2, no traceback.

Run in-process through `pipelines.cli.main` (what the `strag` script calls), plus one run of
the installed script to show that no library log line reaches the user.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from pipelines import cli

README = str(pathlib.Path(__file__).parents[1] / "README.md")


def _cases(tmp: pathlib.Path) -> list[tuple[list[str], str]]:
    lake = tmp / "lake"
    (lake / "traces").mkdir(parents=True, exist_ok=True)
    (tmp / "empty").mkdir(exist_ok=True)   # a folder, but no lake
    for rank in (0, 1):                     # each rank's trace in a folder of its own
        (tmp / "per-rank" / f"rank{rank}").mkdir(parents=True, exist_ok=True)
        (tmp / "per-rank" / f"rank{rank}" / f"host_{4000 + rank}.1764371234567.pt.trace.json").write_text("{}")
    out = str(tmp / "out")
    return [
        (["generate", "--lake", str(tmp / "g"), "--days", "0", "--jobs-per-day", "1", "--seed", "1"], "--days"),
        (["import-reference", "/nope/t.parquet", "/nope/m.yaml", "--lake", str(lake), "--job-id", "x"], "/nope"),
        (["import-reference", "/nope/t.parquet", "/nope/m.yaml", "--lake", str(lake)], "--job-id"),
        (["import-reference", README, README, "--lake", str(lake), "--job-id", "../../x"], "--job-id: job id '../../x': use"),
        (["export-reference", "--lake", "/nope", "--job-id", "x", "--out", out], "no lake there"),
        (["import", "--format", "kineto", "--lake", str(lake), "--job-id", "x", "/nope"], "/nope"),
        (["land", "/nope", "--lake", str(lake), "--job-id", "x"], "/nope"),
        (["export", "--format", "ndtimeline", "--lake", "/nope", "--job-id", "x", "--out", out], "no lake there"),
        (["analyze", README, "--meta", README], "--meta"),
        (["analyze", "--lake", "/nope", "--job-id", "x"], "no lake there"),
        (["analyze", "--lake", str(lake), "--job-id", "x"], "no job 'x'"),
        (["analyze", "--lake", str(lake), "--job-id", "../../x"], "--job-id: job id '../../x': use"),
        (["analyze", "--lake", str(lake), "--job-id", "x", "--date", "2024-13-01"], "--date: '2024-13-01' is not a date"),
        (["analyze"], "a folder of raw traces DIR [--format kineto|ndtimeline]"),
        (["analyze", "/no/such/dir"], "no such file or folder: /no/such/dir"),
        (["analyze", str(tmp / "empty")], "give --format kineto|ndtimeline"),
        (["analyze", str(lake)], "is a lake: give --lake"),
        (["analyze", str(tmp / "per-rank")], "its subfolders rank0/, rank1/ hold traces: strag analyze reads one folder"),
        (["batch", "--lake", str(lake), "--from", "2024-01-01", "--to", "2024-01-02", "--out", out, "--wokers", "2"], "did you mean --workers"),
        (["batch", "--lake", "/nope", "--from", "2024-01-01", "--to", "2024-01-02", "--out", out], "no lake there"),
        (["batch", "--lake", str(lake), "--from", "2024-01-02", "--to", "2024-01-01", "--out", out], "--from 2024-01-02 is after --to"),
        (["batch", "--lake", str(lake), "--from", "2024-13-01", "--to", "2024-01-01", "--out", out],
         "--from 2024-13-01: not a date YYYY-MM-DD (month must be in 1..12)"),
        (["report", "--tables", str(lake), "--out", out], "is a lake, not the tables"),
        (["report", "--tables", str(tmp / "none"), "--out", out], "give --tables the --out of `strag batch`"),
        (["report", "--tables", out, "--out", out, "--lake", str(lake)], "run `strag batch --timelines`"),
        (["watch", "--lake", "/nope", "--out", out], "no lake there"),
        (["watch", "--lake", str(tmp / "empty"), "--out", out], "no lake there (expected landing/"),
        (["watch", "--lake", str(lake)], "--out"),
        (["watch", "--lake", str(lake), "--out", out, "--alert-webhook", "hooks.example/x"], "--alert-webhook"),
        (["watch", "--lake", str(lake), "--out", out, "--alert-webhook", "teams=https://h/x"], "unknown format 'teams'"),
        (["serve", "--tables", out, "--port", "70000"], "--port"),
        (["serve", "--tables", str(tmp / "none")], "no folder there"),
        (["demo", "--days", "0"], "--days"),
        (["nope"], "unknown command"),
        (["anlyze", "x"], "unknown command 'anlyze' (did you mean analyze?)"),
        ([], "give a command"),
    ]


@pytest.mark.parametrize("index", range(36))
def test_bad_arguments_give_one_line_and_exit_2(index, tmp_path, capsys):
    argv, expected = _cases(tmp_path)[index]
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert "Traceback" not in err
    first = err.strip().splitlines()[0]
    assert expected in first, (argv, err)
    if argv and argv[0] in cli.COMMANDS:   # an unknown command also lists the commands
        assert len(err.strip().splitlines()) == 1, err


def test_cases_cover_every_subcommand(tmp_path):
    assert {argv[0] for argv, _ in _cases(tmp_path) if argv} >= set(cli.COMMANDS)
    assert len(_cases(tmp_path)) == 36


def test_the_strag_script_shows_no_library_log_lines(tmp_path):
    """`strag batch` imports Apache Beam, which logs warnings as it loads; none reach the user."""
    script = pathlib.Path(sys.executable).with_name("strag")
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])}
    env.pop("STRAG_VERBOSE", None)
    argv = [str(script), "batch", "--lake", "/nope", "--from", "2024-01-01", "--to", "2024-01-01", "--out", str(tmp_path)]
    quiet = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 2
    assert quiet.stderr.splitlines() == ["strag batch: --lake /nope: no lake there (expected traces/, manifests/, raw/, _lake.json); "
                                         "check the URL"]
    loud = subprocess.run([*argv, "--verbose"], capture_output=True, text=True, env=env, timeout=120)
    assert loud.returncode == 2 and "apitools not found" in loud.stderr   # Beam's own warning, shown on request


@pytest.mark.parametrize("given, expected", [(None, "1"), ("4", "4")])
def test_one_blas_thread_unless_the_user_sets_it(given, expected):
    """The CLI starts numpy with one OpenBLAS thread (its pool costs ~50 ms a start and
    oversubscribes worker processes); a user's own OPENBLAS_NUM_THREADS is kept."""
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])}
    env.pop("OPENBLAS_NUM_THREADS", None)
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    probe = "import pipelines.cli, os; import numpy; print(os.environ['OPENBLAS_NUM_THREADS'])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == expected, out.stderr


@pytest.mark.parametrize("given", [None, "1"])
def test_no_huge_page_requests_where_they_stall(given):
    """numpy asks for transparent huge pages on large arrays unless NUMPY_MADVISE_HUGEPAGE=0;
    where the kernel compacts memory synchronously for such requests (THP defrag always / madvise
    / defer+madvise, read from /sys), the `pipelines` package turns that off before numpy loads,
    and keeps a user's own setting. numpy's own flag is read back from the loaded numpy."""
    import pipelines

    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])}
    env.pop("NUMPY_MADVISE_HUGEPAGE", None)
    if given is not None:
        env["NUMPY_MADVISE_HUGEPAGE"] = given
    probe = ("import pipelines.batch, os, numpy; from numpy._core.multiarray import _get_madvise_hugepage as get; "
             "print(os.environ.get('NUMPY_MADVISE_HUGEPAGE'), get())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    stall = pipelines._hugepages_stall()
    expected = {None: ("0 False" if stall else "None True"), "1": "1 True"}[given]
    assert out.stdout.strip() == expected, out.stderr


def test_a_closed_pipe_ends_the_command_quietly(reference_dir):
    """`strag analyze ... | head -1`: once the reader is gone the command stops with the shell's
    SIGPIPE status (141) and no traceback."""
    script = pathlib.Path(sys.executable).with_name("strag")
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])}
    argv = [str(script), "analyze", str(reference_dir / "trace-AR.parquet"), "--meta", str(reference_dir / "meta-AR.yaml")]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    process.stdout.close()                                  # the reader leaves before the first line
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 141 and stderr == b"", stderr.decode()


def test_the_script_ends_analyze_without_teardown_and_loses_nothing(reference_dir, tmp_path, capsys):
    """The `strag` script ends `strag analyze` with os._exit once its output is flushed: the
    same lines as the in-process command, the JSON complete, the exit codes kept (0, and 2 for
    a trace it cannot read), and none of the interpreter's exit work (its atexit hooks) run."""
    trace, meta = str(reference_dir / "trace-AR.parquet"), str(reference_dir / "meta-AR.yaml")
    argv = ["analyze", trace, "--meta", meta, "--json", str(tmp_path / "script.json"), "--threads", "1"]
    assert cli.main([*argv[:4], "--json", str(tmp_path / "inline.json"), "--threads", "1"]) == 0
    inline = capsys.readouterr().out
    probe = ("import atexit, sys; atexit.register(lambda: print('teardown ran', file=sys.stderr)); "
             "sys.argv = ['strag', *sys.argv[1:]]; from pipelines.cli import console; console()")
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    def lines(out: str) -> str:   # the engine's own seconds differ from run to run
        return re.sub(r"analysed in [0-9.]+ s \(compile [0-9.]+, replay [0-9.]+, causes [0-9.]+\)", "analysed in T s", out)

    assert lines(done.stdout) == lines(inline.replace(str(tmp_path / "inline.json"), str(tmp_path / "script.json")))
    assert (tmp_path / "script.json").read_text() == (tmp_path / "inline.json").read_text()
    failed = subprocess.run([sys.executable, "-c", probe, "analyze", README, "--meta", meta], capture_output=True,
                            text=True, env=env, timeout=120)
    assert failed.returncode == 2 and "cannot read the job" in failed.stderr and "teardown" not in failed.stderr
    usage = subprocess.run([sys.executable, "-c", probe, "report"], capture_output=True, text=True, env=env, timeout=120)
    assert usage.returncode == 2 and "teardown ran" in usage.stderr   # other commands exit as usual


def test_version_and_a_mistyped_command(capsys):
    from importlib import metadata

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"strag {metadata.version('strag')}"
    assert cli.main(["imprt"]) == 2
    assert capsys.readouterr().err.startswith("strag: unknown command 'imprt' (did you mean import?)\n")
    assert cli.main(["zzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err   # nothing close: no guess


def test_the_local_dask_cluster_workers_show_no_library_log_lines():
    """The batch's local Dask cluster starts its workers before a run, with the stderr of the command:
    Beam's import-time warning in a worker ("apitools not found") stays hidden without --verbose."""
    probe = ("from pipelines.usage import configure_logs\n"
             "configure_logs()\n"
             "from distributed import Client\n"
             "from pipelines.batch import local_dask_cluster\n"
             "def load_beam():\n"
             "    import apache_beam.io.gcp.internal.clients.bigquery  # logs the warning as it loads\n"
             "    return True\n"
             "with local_dask_cluster(1) as cluster, Client(cluster) as client:\n"
             "    print(list(client.run(load_beam).values()))\n")
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])}
    env.pop("STRAG_VERBOSE", None)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "[True]", done.stderr
    assert "apitools" not in done.stderr, done.stderr


def test_window_lines_are_numbered_with_an_eta(monkeypatch):
    """`strag batch` numbers the per-window lines its workers print (k/N) and gives an ETA at the mean pace."""
    from pipelines import usage

    clock = iter([0.0, 100.0, 110.0, 130.0, 160.0])   # made, started, then three windows
    monkeypatch.setattr(usage.time, "monotonic", lambda: next(clock))
    progress = usage.Progress()
    line = b"  2024-03-04 job-1: analysed, S 1.023, 347,616 ops, 2.3 s\n"
    assert progress(line) == line                      # not started: passed as it is
    progress.start(4)                                   # t = 100
    assert progress(line) == b"  [1/4, ETA 30 s] 2024-03-04 job-1: analysed, S 1.023, 347,616 ops, 2.3 s\n"   # 10 s a window
    assert progress(b"strag batch: something else\n") == b"strag batch: something else\n"
    assert progress(line).startswith(b"  [2/4, ETA 30 s] 2024-03-04 job-1:")   # 30 s for 2: 15 s a window, 2 left
    assert progress(line).startswith(b"  [3/4, ETA 20 s] ")                   # 60 s for 3
    assert usage._duration(200) == "3 min 20 s" and usage._duration(7500) == "2 h 05 min"


def test_the_batch_summary_is_wrapped_and_says_what_it_counts(tmp_path, capsys):
    from pipelines import batch

    (tmp_path / "traces").mkdir()
    opts = batch.parse(["--lake", str(tmp_path), "--from", "2024-03-04", "--to", "2024-03-05", "--out", str(tmp_path / "out")])
    summary = {"jobs": {"analysed": 7, "quarantined": 2}, "ops": 1_783_368, "reasons": {"unreadable_file": 1, "incomplete_window": 1},
               "rows_quarantined": 0, "rows_read": 10, "startup": {"lake listing": 0.01}, "seconds": {"analyze": 3.21, "read": 0.0},
               "table_rows": {f"fleet_table_number_{i}": 1000 * i for i in range(12)}, "timelines": 0}
    counters = {"strag.jobs/analysed": 7, "strag.quarantine/unreadable_file": 2, "strag.tables/rows.coverage": 10}
    batch._print_summary(opts, summary, counters, 12.0)
    out = capsys.readouterr().out
    long = ("strag batch", "  run record", "  tables under")   # these hold the caller's URLs
    assert all(len(line) <= 100 for line in out.splitlines() if not line.startswith(long)), out
    assert "  reasons (job windows discarded or quarantined, by the reason of each):\n    unreadable_file 1, incomplete_window 1\n" in out
    assert "quarantine/* quarantine rows" in out and "quarantine/unreadable_file=2" in out
    assert "tables/rows" not in out                                     # the tables line says those
    assert f"  tables under {tmp_path / 'out'}/ (rows):\n    fleet_table_number_0 0, " in out and "11,000" in out
    assert "  seconds in workers: analyze 3.2\n" in out


def test_a_range_without_windows_is_told_the_lake_dates(tmp_path):
    from pipelines import batch

    for day in ("2024-03-04", "2024-03-05"):
        (tmp_path / "traces" / f"date={day}").mkdir(parents=True)
    (tmp_path / "raw" / "kineto" / "date=2024-03-09").mkdir(parents=True)
    assert batch._dates_held(str(tmp_path)) == "the lake has data on 2024-03-04, 2024-03-05, 2024-03-09"
    for day in range(10, 15):
        (tmp_path / "manifests" / f"date=2024-03-{day}").mkdir(parents=True)
    assert batch._dates_held(str(tmp_path)) == "the lake has data on 8 dates from 2024-03-04 to 2024-03-14"
    (tmp_path / "empty").mkdir()
    assert batch._dates_held(str(tmp_path / "empty")) == "the lake holds no date partition yet"


def test_the_readme_glossary_and_its_s3_endpoint_example(tmp_path):
    """README: every metric the CLI prints has a glossary row, and the S3-compatible endpoint set as the
    README says (environment, fsspec config file) reaches the filesystem strag opens a lake with."""
    text = pathlib.Path(README).read_text()
    glossary = text[text.index("### Words and numbers"):text.index("### Training setups")]
    for term in ("| S (slowdown)", "| waste", "| replay discrepancy", "| S_t, S_dp, S_stage", "| S_w", "| M_W", "| M_S",
                 "Below 0:", "Above 100%:"):
        assert term in glossary, term
    assert "Not yet supported:" in text[text.index("### Training setups"):]
    probe = "from transforms.io.lake import filesystem; print(filesystem('s3://lake/traces')[0].endpoint_url)"
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1]), "FSSPEC_CONFIG_DIR": str(tmp_path)}
    told = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env={**env, "FSSPEC_S3_ENDPOINT_URL": "http://minio.internal:9000"})
    assert told.stdout.strip() == "http://minio.internal:9000", told.stderr
    assert '`{"s3": {"endpoint_url": "http://minio.internal:9000"}}`' in text
    (tmp_path / "s3.json").write_text('{"s3": {"endpoint_url": "http://ceph.internal:7480"}}')
    filed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env)
    assert filed.stdout.strip() == "http://ceph.internal:7480", filed.stderr


def test_serve_on_a_busy_port_says_so_in_one_line(tmp_path, capsys):
    import socket

    (tmp_path / "tables").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["serve", "--tables", str(tmp_path / "tables"), "--port", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"strag serve: cannot listen on 127.0.0.1:{port}: ") and "--port" in err[0]


def test_serve_help_states_the_threshold_default(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--threshold THRESHOLD S drawn as the alert threshold .*\(default 1\.1;", text), text


def test_the_live_demo_finds_torch_where_this_machine_has_it(tmp_path, monkeypatch):
    """Its --torch-python defaults to $TORCHENV's python, else this one (no path of one machine); a python
    without torchrun beside it is one line and exit 2, before anything runs."""
    script = pathlib.Path(__file__).parents[1] / "tools" / "real_traces" / "live_demo.py"
    env = {**os.environ, "TORCHENV": str(tmp_path / "torchvenv")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and not (tmp_path / "torchvenv").exists()
    assert done.stderr.splitlines()[-1] == (f"live_demo.py: error: --torch-python {tmp_path}/torchvenv/bin/python: no "
                                            "torchrun beside it; give the python of a venv with torch (--torch-python or "
                                            "TORCHENV, see tools/real_traces/README.md)")
    sys.path.insert(0, str(script.parent))
    try:
        import live_demo
    finally:
        sys.path.remove(str(script.parent))
    monkeypatch.delenv("TORCHENV", raising=False)
    assert live_demo._default_torch_python() == sys.executable
    monkeypatch.setenv("TORCHENV", "/opt/torch")
    assert live_demo._default_torch_python() == "/opt/torch/bin/python"


def test_the_readme_command_table_names_every_command():
    text = pathlib.Path(README).read_text()
    table = text[text.index("## Commands"):text.index("### One job")]
    named = set(re.findall(r"^\| `strag ([a-z-]+)", table, flags=re.M))
    assert named == set(cli.COMMANDS), set(cli.COMMANDS) ^ named
