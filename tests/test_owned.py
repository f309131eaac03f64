"""`strag demo` and `strag generate` only ever write into or delete folders they made (issue: a demo
pointed at a real lake deleted it)."""
from __future__ import annotations

import pytest

from pipelines import demo, generate
from pipelines.owned import MARKER, NotOurs, claim


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
