"""What strag_collect's handler uses of torch.profiler.profile, without torch (tests only)."""
from __future__ import annotations

import gzip
import pathlib
import shutil


class FakeProfiler:
    """export_chrome_trace(path) writes a committed real trace's plain JSON, as torch does."""

    def __init__(self, trace: pathlib.Path):
        self.trace = trace

    def export_chrome_trace(self, path: str) -> None:
        with gzip.open(self.trace, "rb") as source, open(path, "wb") as out:
            shutil.copyfileobj(source, out)
