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
    out = str(tmp / "out")
    return [
        (["generate", "--lake", str(tmp / "g"), "--days", "0", "--jobs-per-day", "1", "--seed", "1"], "--days"),
        (["import-reference", "/nope/t.parquet", "/nope/m.yaml", "--lake", str(lake), "--job-id", "x"], "/nope"),
        (["import-reference", "/nope/t.parquet", "/nope/m.yaml", "--lake", str(lake)], "--job-id"),
        (["export-reference", "--lake", "/nope", "--job-id", "x", "--out", out], "no lake there"),
        (["import", "--format", "kineto", "--lake", str(lake), "--job-id", "x", "/nope"], "/nope"),
        (["land", "/nope", "--lake", str(lake), "--job-id", "x"], "/nope"),
        (["export", "--format", "ndtimeline", "--lake", "/nope", "--job-id", "x", "--out", out], "no lake there"),
        (["analyze", README, "--meta", README], "--meta"),
        (["analyze", "--lake", "/nope", "--job-id", "x"], "no lake there"),
        (["analyze", "--lake", str(lake), "--job-id", "x"], "no job 'x'"),
        (["batch", "--lake", str(lake), "--from", "2024-01-01", "--to", "2024-01-02", "--out", out, "--wokers", "2"], "did you mean --workers"),
        (["batch", "--lake", "/nope", "--from", "2024-01-01", "--to", "2024-01-02", "--out", out], "no lake there"),
        (["batch", "--lake", str(lake), "--from", "2024-01-02", "--to", "2024-01-01", "--out", out], "--from/--to"),
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
        ([], "give a command"),
    ]


@pytest.mark.parametrize("index", range(26))
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
    if argv and argv[0] != "nope":   # the unknown command also lists the commands
        assert len(err.strip().splitlines()) == 1, err


def test_cases_cover_every_subcommand(tmp_path):
    assert {argv[0] for argv, _ in _cases(tmp_path) if argv} >= set(cli.COMMANDS)
    assert len(_cases(tmp_path)) == 26


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
        return re.sub(r"analysed in [0-9.]+ s", "analysed in T s", out)

    assert lines(done.stdout) == lines(inline.replace(str(tmp_path / "inline.json"), str(tmp_path / "script.json")))
    assert (tmp_path / "script.json").read_text() == (tmp_path / "inline.json").read_text()
    failed = subprocess.run([sys.executable, "-c", probe, "analyze", README, "--meta", meta], capture_output=True,
                            text=True, env=env, timeout=120)
    assert failed.returncode == 2 and "cannot read the job" in failed.stderr and "teardown" not in failed.stderr
    usage = subprocess.run([sys.executable, "-c", probe, "report"], capture_output=True, text=True, env=env, timeout=120)
    assert usage.returncode == 2 and "teardown ran" in usage.stderr   # other commands exit as usual
