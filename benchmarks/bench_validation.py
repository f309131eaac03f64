"""Cost of validating lake jobs (GX suites + plain checks) and of lake IO. Prints figures.

    .venv/bin/python benchmarks/bench_validation.py

Sizes: jobs of ~10k, ~100k and ~1M op rows, as one file per worker. For each: the
row-level GX suites over every row (the baseline, `screen=False`), the screen for one
window, and the screen for a group of 8 windows (what a batch worker runs), per window.
"""
from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from schemas.expectations import JobFiles  # noqa: E402
from transforms.validation import Validator  # noqa: E402
from tests.lake_samples import sample_job  # noqa: E402
from transforms.io.lake import list_jobs, read_validated_job, write_job  # noqa: E402


def _best(function, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        function()
        times.append(time.perf_counter() - begin)
    return min(times)


def main() -> None:
    begin = time.perf_counter()
    validator = Validator()
    print(f"Validator() (GX import + context, once per worker): {time.perf_counter() - begin:.2f} s")

    _, manifest = sample_job("m", dp=4, pp=4)
    one = _best(lambda: validator.validate_manifest(manifest, "manifests/date=2024-03-01/m.parquet"))
    many = [(f"manifests/date=2024-03-01/m{i}.parquet", {**manifest, "job_id": f"m{i}"}) for i in range(200)]
    bulk = _best(lambda: validator.validate_manifests(many))
    print(f"manifest: one {one * 1e3:.0f} ms; 200 in one call {bulk * 1e3:.0f} ms ({bulk / 200 * 1e3:.1f} ms each)")

    print(f"{'rows':>10}  {'row-level':>10}  {'screen, 1':>10}  {'screen, 8':>10}  (s per window; ratio to row-level)")
    for dp, pp, steps, microbatches in [(2, 2, 5, 16), (4, 4, 10, 32), (8, 8, 20, 32), (8, 8, 90, 32)]:
        trace, manifest = sample_job("bench", dp=dp, pp=pp, steps=steps, microbatches=microbatches)
        keys = trace["dp_rank"].to_numpy() * 1000 + trace["stage"].to_numpy()
        files = [(f"worker-{key}.parquet", trace.filter(keys == key)) for key in sorted(set(keys.tolist()))]
        window = JobFiles("bench", manifest, files, "m.parquet")
        assert validator.validate_jobs([window])[0].ok
        rows_level = _best(lambda: validator.validate_jobs([window], screen=False))
        one = _best(lambda: validator.validate_jobs([window]))
        eight = _best(lambda: validator.validate_jobs([window] * 8)) / 8
        print(f"{trace.num_rows:>10,}  {rows_level:>10.3f}  {one:>10.3f}  {eight:>10.3f}  "
              f"({rows_level / one:.1f}x, {rows_level / eight:.1f}x; {trace.num_rows / eight / 1e6:.1f} M rows/s)")

    trace, manifest = sample_job("io", dp=8, pp=8, steps=20, microbatches=32)
    for lake in ("memory://bench-lake", "/tmp/strag-bench-lake"):
        write = _best(lambda: write_job(lake, "2024-03-01", "io", trace, manifest), repeat=1)
        job = list_jobs(lake)[0]
        read = _best(lambda: read_validated_job(job, validator), repeat=2)
        print(f"{lake}: write_job {trace.num_rows:,} rows {write:.2f} s; read_validated_job {read:.2f} s "
              f"({trace.num_rows / read / 1e6:.2f} M rows/s)")


if __name__ == "__main__":
    main()
