"""Compiled helpers of strag, built once per machine with the system C compiler and loaded with
ctypes: the replay kernel (transforms/whatif/kernel.c) and the trace event scanner
(transforms/ingest/kineto/scan.c). Each is compiled into `$STRAG_KERNEL_CACHE` (default
`~/.cache/strag`), named by a CRC of its source, flags, compiler and machine. A cached library
that fails to load (truncated, another architecture) is rebuilt. The cache folder is created
0700, and a library is loaded only when it and its folder are owned by this user and writable by
nobody else (a shared cache folder would let anyone who can write there run code in strag):
`LibraryRefused` says so. Every other failure (no compiler, a compiler error) is a
`LibraryBuildError` naming the source, the compiler and its message; callers fall back to their
Python path.
"""
from __future__ import annotations

import ctypes
import os
import pathlib
import stat
import sys
import zlib
from collections.abc import Callable

__all__ = ["LibraryBuildError", "LibraryRefused", "CompiledHelper", "load_library", "cache_dir", "short_reason"]


class LibraryBuildError(RuntimeError):
    """A compiled library could not be built or loaded (no compiler, compiler error, refused); says why."""


class LibraryRefused(LibraryBuildError):
    """A cached library (or its folder) is not this user's, or others can write it."""


def cache_dir() -> pathlib.Path:
    configured = os.environ.get("STRAG_KERNEL_CACHE")
    if configured:
        return pathlib.Path(configured)
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "strag"


class CompiledHelper:
    """One compiled helper as a process sees it: its library, built and loaded once (`load`), or
    the reason it cannot be, remembered; whether to use it (`wanted`: the environment variable
    `env` set to `off` or `on` forces the choice, else whenever it builds); and, when it is not
    used, one line on stderr, once per process (`fallback`: the line, `{reason}` in it)."""

    def __init__(self, source: pathlib.Path, flags: tuple[str, ...], declare: Callable[[ctypes.CDLL], None], *,
                 env: str, off: str, on: str, fallback: str):
        self.source, self.flags, self._declare = source, flags, declare
        self.env, self.off, self.on, self.fallback = env, off, on, fallback
        self.library: ctypes.CDLL | None = None
        self.build_error: str | None = None
        self.reported = False   # the fallback line was printed

    def load(self) -> ctypes.CDLL:
        """The library (its functions declared by `declare`); LibraryBuildError if it cannot be built."""
        if self.library is not None:
            return self.library
        if self.build_error is not None:
            raise LibraryBuildError(self.build_error)
        try:
            library = load_library(self.source, self.flags)
        except LibraryBuildError as error:
            self.build_error = str(error)
            raise LibraryBuildError(self.build_error) from None
        self._declare(library)
        self.library = library
        return library

    def available(self) -> bool:
        """Whether the library builds and loads; when not, the fallback line (once) says why."""
        try:
            self.load()
        except LibraryBuildError as error:
            if not self.reported:
                self.reported = True
                print(self.fallback.format(reason=short_reason(error)), file=sys.stderr, flush=True)
            return False
        return True

    def wanted(self) -> bool:
        """Use the library? `env` = off | on forces the choice (on: LibraryBuildError when it cannot
        be built); by default whenever it is available."""
        choice = os.environ.get(self.env, "auto")
        if choice not in ("auto", self.off, self.on):
            raise ValueError(f"{self.env}={choice!r}: expected auto, {self.off} or {self.on}")
        if choice == self.off:
            return False
        if choice == self.on:
            self.load()
            return True
        return self.available()


def load_library(source: pathlib.Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """The library of `source` (C) built with `flags`, built on first use on this machine and kept
    in the cache folder as `<source stem>-<crc>.so`; LibraryBuildError (LibraryRefused) if it cannot be."""
    compiler = os.environ.get("CC", "cc")
    text = source.read_bytes()
    key = zlib.crc32(b"\0".join([text, " ".join(flags).encode(), compiler.encode(), os.uname().machine.encode()]))
    folder = cache_dir()
    target = folder / f"{source.stem}-{key:08x}.so"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(folder, "cache folder")
        if not target.exists():
            _build(compiler, source, flags, target)
        _check_private(target, "library")
        try:
            if not _whole(target):   # dlopen of a truncated ELF file can crash the process (SIGBUS)
                raise OSError(f"{target} is truncated")
            return ctypes.CDLL(str(target))
        except OSError:   # a cached library that does not load (truncated, corrupt): built again
            target.unlink()
            _build(compiler, source, flags, target)
            return ctypes.CDLL(str(target))
    except LibraryRefused:
        raise
    except (OSError, LibraryBuildError) as error:
        raise LibraryBuildError(f"cannot build {source} with {compiler!r}: {error}") from None


def short_reason(error: BaseException) -> str:
    """The error on one line of at most ~400 characters (a compiler's message can be pages)."""
    reason = " ".join(str(error).split())
    return reason if len(reason) <= 400 else reason[:400] + " ..."


def _whole(path: pathlib.Path) -> bool:
    """False when `path` is an ELF file shorter than its own header says (its section header table,
    written last by the linker, ends past the end of the file); True otherwise (dlopen judges the rest)."""
    import struct

    with open(path, "rb") as handle:
        header = handle.read(64)
    if header[:4] != b"\x7fELF":
        return True   # not ELF at all: dlopen refuses it with an error (or it is another platform's format)
    if len(header) < 64 or header[4] not in (1, 2) or header[5] not in (1, 2):
        return False
    order = "<" if header[5] == 1 else ">"
    if header[4] == 2:
        (offset,), (size, count) = struct.unpack_from(order + "Q", header, 0x28), struct.unpack_from(order + "HH", header, 0x3A)
    else:
        (offset,), (size, count) = struct.unpack_from(order + "I", header, 0x20), struct.unpack_from(order + "HH", header, 0x2E)
    return offset + size * count <= path.stat().st_size


def _check_private(path: pathlib.Path, what: str) -> None:
    """Raise KernelRefused unless `path` is owned by this user and not writable by group or others."""
    info = path.stat()
    if info.st_uid != os.geteuid():
        raise LibraryRefused(f"refusing to load a compiled library: its {what} {path} is owned by uid {info.st_uid}, "
                            f"not by this user (uid {os.geteuid()}); set STRAG_KERNEL_CACHE to a folder of yours")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LibraryRefused(f"refusing to load a compiled library: its {what} {path} is writable by others "
                            f"(mode {stat.S_IMODE(info.st_mode):o}); chmod go-w it or remove it")


def _build(compiler: str, source: pathlib.Path, flags: tuple[str, ...], target: pathlib.Path) -> None:
    """Compile `source` into `target` atomically (concurrent builders each write their own file)."""
    import subprocess   # here, not at the top: only the first use on a machine builds
    import tempfile

    handle, partial = tempfile.mkstemp(prefix=target.stem, suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        try:
            done = subprocess.run([compiler, *flags, "-o", partial, str(source)], capture_output=True, text=True,
                                  timeout=120)
        except subprocess.SubprocessError as error:   # timeout
            raise LibraryBuildError(str(error)) from None
        if done.returncode:
            raise LibraryBuildError(done.stderr.strip()[-2000:] or f"exit status {done.returncode}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
