"""Folders a command may fill or wipe: only those it made itself.

`strag demo` regenerates its lake (and writes its tables) and `strag generate` writes a synthetic
fleet; pointed at a real lake by mistake, the one would delete it and the other would mix made-up
jobs into it. Each folder they make gets a marker file (`MARKER`, naming the command); they then
only ever write into, or delete, a folder that is absent, empty, or holds that marker. Anything else
is refused with one line naming the folder, before anything is written.
"""
from __future__ import annotations

import fsspec

__all__ = ["MARKER", "NotOurs", "claim"]

MARKER = ".strag-made-by"


class NotOurs(Exception):
    """The folder holds data that no strag command made: it is not this command's to write or delete."""


def claim(url: str, command: str) -> None:
    """Make `url` this command's folder: create it with the marker when absent or empty; accept it
    when it holds the marker; else raise NotOurs naming it."""
    fs, path = fsspec.core.url_to_fs(url)
    path = path.rstrip("/")
    if fs.exists(path):
        if not fs.isdir(path):
            raise NotOurs(f"{url} is a file, not a folder")
        entries = [p for p in fs.ls(path, detail=False) if p.rstrip("/").rsplit("/", 1)[-1] != MARKER]
        if entries and not fs.exists(f"{path}/{MARKER}"):
            raise NotOurs(f"{url} holds data that `strag {command}` did not make (no {MARKER} marker): it never "
                          "writes into or deletes such a folder; give an empty or new folder")
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/{MARKER}", "w") as marker:
        marker.write(f"strag {command}\n")
