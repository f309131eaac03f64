"""`strag demo` and `strag generate` only ever write into or delete folders they made (issue: a demo
pointed at a real lake deleted it)."""
from __future__ import annotations

import pathlib

import pytest

from pipelines import cli, demo, generate
from pipelines.owned import MARKER, NotOurs, claim, record

RUN = pathlib.Path(__file__).parent / "data" / "real_runs" / "allreduce-r1-dp4-ddp-mlp-cpu"
TINY = ["--days", "1", "--jobs-per-day", "2", "--seed", "3", "--max-records", "20000"]


def _real_lake(tmp_path):
    lake = tmp_path / "real-lake"
    (lake / "raw" / "kineto").mkdir(parents=True)
    (lake / "raw" / "kineto" / "rank-0.json").write_text("{}")
    (lake / "landing").mkdir()
    return lake


def test_demo_refuses_a_folder_it_did_not_make_and_deletes_nothing(tmp_path, capsys):
    lake = _real_lake(tmp_path)
    code = demo.run(["--lake", str(lake), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(lake) in err[0] and err[0].startswith("strag demo: ")
    assert (lake / "raw" / "kineto" / "rank-0.json").read_text() == "{}" and (lake / "landing").is_dir()
    assert not (lake / MARKER).exists()


def test_demo_refuses_tables_it_did_not_make(tmp_path, capsys):
    out = _real_lake(tmp_path)
    assert demo.run(["--lake", str(tmp_path / "lake"), "--out", str(out)]) == 2
    assert str(out) in capsys.readouterr().err and (out / "landing").is_dir()


def test_generate_refuses_to_mix_a_synthetic_fleet_into_a_real_lake(tmp_path, capsys):
    lake = _real_lake(tmp_path)
    code = generate.run(["--lake", str(lake), "--days", "1", "--jobs-per-day", "1", "--seed", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "strag generate" in err[0] and str(lake) in err[0]
    assert sorted(p.name for p in lake.iterdir()) == ["landing", "raw"]


def test_a_folder_is_claimed_when_absent_empty_or_marked_and_only_then(tmp_path):
    fresh, empty, made = tmp_path / "fresh", tmp_path / "empty", tmp_path / "made"
    empty.mkdir()
    claim(str(fresh), "demo")
    claim(str(empty), "demo")
    claim(str(made), "generate")
    (made / "traces").mkdir()
    claim(str(made), "demo")   # holds the marker: the demo's own (or generate's) folder
    for folder in (fresh, empty, made):
        assert (folder / MARKER).is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotOurs, match="is a file"):
        claim(str(tmp_path / "file"), "demo")
    claim("memory://owned-test/lake", "generate")   # any fsspec URL
    with pytest.raises(NotOurs):
        other = tmp_path / "other"
        other.mkdir()
        (other / "part-0.parquet").write_text("")
        claim(str(other), "generate")


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _marked(folder: pathlib.Path) -> list[str]:
    """The files the folder's marker says a strag command wrote."""
    return (folder / MARKER).read_text().splitlines()[1:]


def test_demo_into_a_new_folder_then_again_then_refused_once_a_real_job_is_imported(tmp_path, capsys):
    """The demo's own lake is regenerated on every run; once a real job is imported into it (as a user
    would: `strag import ... --lake demo-lake`), the next demo refuses and deletes nothing."""
    lake, out = tmp_path / "demo-lake", tmp_path / "demo-out"
    argv = ["demo", "--lake", str(lake), "--out", str(out), *TINY]
    assert cli.main(argv) == 0
    first = _files(lake)
    assert (lake / "_lake.json").is_file() and any(name.startswith("traces/") for name in first)
    assert sorted(first) == sorted([*_marked(lake), MARKER])   # the marker lists every file it wrote
    (lake / "traces" / "stale.parquet").write_bytes(b"x")   # as if an older demo had left it: recorded, then deleted
    record(str(lake), "demo")
    assert cli.main(argv) == 0   # rerun into its own folder: regenerated, the same fleet
    assert _files(lake) == first and (out / "_reports" / "index.html").is_file()
    capsys.readouterr()

    assert cli.main(["import", "--format", "kineto", str(RUN), "--lake", str(lake), "--job-id", "my-job",
                     "--date", "2024-03-04"]) == 0
    imported = _files(lake)
    mine = sorted(set(imported) - set(first))
    assert mine and all("my-job" in name for name in mine)
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"strag demo: {lake} holds {len(mine)} file(s) no `strag demo` or "
                                               f"`strag generate` wrote (e.g. {mine[0]};")
    assert _files(lake) == imported   # every file kept, the imported job's too
    assert cli.main(["generate", "--lake", str(lake), *TINY]) == 2   # nor mixed with a synthetic fleet
    assert "strag generate: " in capsys.readouterr().err and _files(lake) == imported


def test_generate_into_a_new_folder_then_again_into_its_own(tmp_path, capsys):
    lake = tmp_path / "synthetic"
    assert cli.main(["generate", "--lake", str(lake), *TINY]) == 0
    first = _files(lake)
    assert sorted(first) == sorted([*_marked(lake), MARKER]) and "_truth/truth.parquet" in first
    assert cli.main(["generate", "--lake", str(lake), *TINY]) == 0   # the same seed: the same lake, byte for byte
    assert _files(lake) == first
    (lake / "notes.txt").write_text("mine")
    assert cli.main(["generate", "--lake", str(lake), *TINY]) == 2
    assert "(e.g. notes.txt;" in capsys.readouterr().err and _files(lake) == {**first, "notes.txt": b"mine"}
