"""The C kernel's cache (transforms/whatif/kernel.py): never a silent fallback, never a foreign library.

- without a compiler the numpy path runs and one line on stderr names the reason, once per process;
- a cached library that fails to load is rebuilt (and then loads);
- the cache folder is created 0700;
- a library (or cache folder) owned by another user or writable by others is refused: the line says
  so, STRAG_REPLAY=kernel raises, and the library is neither loaded nor replaced.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import stat

import pytest

from transforms.whatif import kernel


def _fresh(monkeypatch, cache: pathlib.Path, compiler: str | None = None) -> None:
    """A process that has not loaded the kernel yet, with this cache folder (and compiler)."""
    monkeypatch.setattr(kernel.HELPER, "library", None)
    monkeypatch.setattr(kernel.HELPER, "build_error", None)
    monkeypatch.setattr(kernel.HELPER, "reported", False)
    monkeypatch.setenv("STRAG_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("STRAG_REPLAY", "auto")
    if compiler is not None:
        monkeypatch.setenv("CC", compiler)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> pathlib.Path:
    """A cache folder holding a freshly built library (built once for the module)."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    cache = tmp_path_factory.mktemp("kernel") / "cache"
    with pytest.MonkeyPatch.context() as patch:
        _fresh(patch, cache)
        assert kernel.available()
    return cache


def _copy(built: pathlib.Path, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    cache.chmod(0o700)
    (library,) = cache.glob("kernel-*.so")
    return cache, library


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("strag: C replay kernel")]


def test_no_compiler_falls_back_with_one_line_naming_the_reason(monkeypatch, tmp_path, capsys):
    _fresh(monkeypatch, tmp_path / "cache", str(tmp_path / "no-such-compiler"))
    assert not kernel.wanted()
    assert not kernel.available()
    lines = _lines(capsys)
    assert len(lines) == 1, lines
    assert "no-such-compiler" in lines[0] and "numpy" in lines[0]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_cached_library_that_fails_to_load_is_rebuilt(built, monkeypatch, tmp_path, capsys, damage):
    """Truncated (an interrupted copy; dlopen of it would crash the process) or not a library at all."""
    cache, library = _copy(built, tmp_path)
    good = library.read_bytes()
    bad = good[: len(good) // 2] if damage == "truncated" else b"not a shared library\n" * 100
    library.write_bytes(bad)
    library.chmod(0o600)
    _fresh(monkeypatch, cache)
    assert kernel.available()
    assert library.read_bytes() != bad and library.stat().st_size == len(good)
    assert _lines(capsys) == []


def test_the_cache_folder_is_created_private(monkeypatch, tmp_path):
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    cache = tmp_path / "new" / "cache"
    _fresh(monkeypatch, cache)
    assert kernel.available()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (library,) = cache.glob("kernel-*.so")
    assert not library.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


@pytest.mark.parametrize("what", ["library", "folder"])
def test_a_library_writable_by_others_is_refused(built, monkeypatch, tmp_path, capsys, what):
    cache, library = _copy(built, tmp_path)
    (library if what == "library" else cache).chmod(0o666 if what == "library" else 0o777)
    before = library.read_bytes()
    _fresh(monkeypatch, cache)
    assert not kernel.available()
    lines = _lines(capsys)
    assert len(lines) == 1 and "writable by others" in lines[0] and str(library if what == "library" else cache) in lines[0]
    assert library.read_bytes() == before   # refused, not replaced
    monkeypatch.setenv("STRAG_REPLAY", "kernel")
    with pytest.raises(kernel.KernelBuildError, match="writable by others"):
        kernel.wanted()


def test_a_library_owned_by_another_user_is_refused(built, monkeypatch, tmp_path, capsys):
    cache, library = _copy(built, tmp_path)
    library.chmod(0o644)
    other = 65534 if os.geteuid() != 65534 else 65533
    try:
        os.chown(library, other, -1)
    except PermissionError:
        pytest.skip("cannot give a file to another user here (not root)")
    _fresh(monkeypatch, cache)
    assert not kernel.available()
    lines = _lines(capsys)
    assert len(lines) == 1 and f"owned by uid {other}" in lines[0] and "numpy" in lines[0]
    assert library.stat().st_uid == other
