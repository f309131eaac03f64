"""Folders a command may fill or wipe: only those it made itself.

`strag demo` regenerates its lake (and writes its tables) and `strag generate` writes a synthetic
fleet; pointed at a real lake by mistake, the one would delete it and the other would mix made-up
jobs into it. Each folder they make gets a marker file (`MARKER`, naming the command); they then
only ever write into, or delete, a folder that is absent, empty, or holds that marker. Anything else
is refused with one line naming the folder, before anything is written.

A marker alone does not keep a lake safe: a folder the demo made can receive real data afterwards
(`strag import ... --lake demo-lake`, `strag land`, a trainer's collector), which the demo's next run
would delete and the next `strag generate` would mix made-up jobs into. So at its end a command lists
in the marker every file it leaves in the folder (`record`), and a lake is claimed `exclusive`ly only
while it holds nothing else: a file no strag demo or generate wrote makes the folder foreign, refused
the same way, naming that file.
"""
from __future__ import annotations

import fsspec

__all__ = ["MARKER", "NotOurs", "claim", "record"]

MARKER = ".strag-made-by"


class NotOurs(Exception):
    """The folder holds data that no strag command made: it is not this command's to write or delete."""


def claim(url: str, command: str, *, exclusive: bool = False) -> None:
    """Make `url` this command's folder: create it with the marker when absent or empty; accept it
    when it holds the marker (and, when `exclusive`, no file the marker does not list); else raise
    NotOurs naming it."""
    fs, path = fsspec.core.url_to_fs(url)
    path = path.rstrip("/")
    if fs.exists(path):
        if not fs.isdir(path):
            raise NotOurs(f"{url} is a file, not a folder")
        entries = [p for p in fs.ls(path, detail=False) if p.rstrip("/").rsplit("/", 1)[-1] != MARKER]
        if entries and not fs.exists(f"{path}/{MARKER}"):
            raise NotOurs(f"{url} holds data that `strag {command}` did not make (no {MARKER} marker): it never "
                          "writes into or deletes such a folder; give an empty or new folder")
        foreign = _unrecorded(fs, path) if entries and exclusive else []
        if foreign:
            raise NotOurs(f"{url} holds {len(foreign)} file(s) no `strag demo` or `strag generate` wrote (e.g. "
                          f"{foreign[0]}; its {MARKER} lists theirs): `strag {command}` never writes into or deletes "
                          "such a folder; give an empty or new folder")
    fs.makedirs(path, exist_ok=True)
    if not fs.exists(f"{path}/{MARKER}"):
        _write_marker(fs, path, command, [])


def record(url: str, command: str) -> None:
    """List in the folder's marker every file now in it: what this command (and the strag commands
    before it, which `claim` checked) wrote there. Called at the command's end, failed or not."""
    fs, path = fsspec.core.url_to_fs(url)
    path = path.rstrip("/")
    if fs.isdir(path):
        _write_marker(fs, path, command, _files(fs, path))


def _files(fs, path: str) -> list[str]:
    """Every file under `path` (relative, sorted), the marker aside."""
    fs.invalidate_cache(path)
    found = fs.find(path, detail=False)
    return sorted(p[len(path) + 1:] for p in found if p.startswith(path + "/") and p[len(path) + 1:] != MARKER)


def _unrecorded(fs, path: str) -> list[str]:
    """The files of `path` its marker does not list (the marker's first line names the command)."""
    with fs.open(f"{path}/{MARKER}", "r") as marker:
        recorded = set(marker.read().splitlines()[1:])
    return [name for name in _files(fs, path) if name not in recorded]


def _write_marker(fs, path: str, command: str, files: list[str]) -> None:
    with fs.open(f"{path}/{MARKER}", "w") as marker:
        marker.write("\n".join([f"strag {command}", *files]) + "\n")
