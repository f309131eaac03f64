"""`strag report --tables URL --out DIR`: the fleet report and per-job pages from the tables alone.

    strag report --tables ./demo-out --out ./demo-out/_reports
    strag report --tables s3://bucket/strag --out s3://bucket/strag/_reports --jobs all --images svg

Writes DIR/index.html (the fleet report, JavaScript inlined: opens offline), DIR/charts/
(PNG and SVG of every fleet chart), DIR/jobs/<date>_<job>.html (one monitor page per
selected job window) and DIR/assets/vega-bundle.js (shared by the job pages). With
--check, opens every page in headless Chromium and fails unless all charts are drawn
with no console error. A job page whose window has a timeline under the tables (original and
simulated ideal side by side, Chrome-trace JSON for Perfetto: `strag batch --timelines` writes
them during the analysis) gets a copy under DIR/timelines/ and links it. Nothing here reads
traces or runs the engine: every page comes from what the batch published.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time
import urllib.parse

import fsspec

from pipelines.usage import ArgumentParser

__all__ = ["ReportOptions", "parse", "build", "run"]

_JOB_SELECTIONS = ("straggling", "all", "none")
_IMAGE_FORMATS = ("svg", "png")


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """tables: the batch output URL; out: report folder (local path or fsspec URL).
    jobs: "straggling" (kept windows with S >= 1.1) | "all" | "none" | explicit job ids; max_jobs caps the pages (worst first).
    images: chart file formats for the fleet report; check: verify pages in headless Chromium."""

    tables: str
    out: str
    jobs: str | tuple[str, ...] = "straggling"
    max_jobs: int = 200
    images: tuple[str, ...] = _IMAGE_FORMATS
    check: bool = False

    def __post_init__(self):
        if not self.tables:
            raise ValueError("--tables: the batch output URL is required")
        if not self.out:
            raise ValueError("--out: a report folder is required")
        if self.max_jobs < 0:
            raise ValueError(f"--max-jobs must be >= 0, got {self.max_jobs}")
        unknown = [f for f in self.images if f not in _IMAGE_FORMATS]
        if unknown:
            raise ValueError(f"--images: unknown formats {unknown}; choose from {_IMAGE_FORMATS} or 'none'")


def parse(argv: list[str]) -> ReportOptions:
    parser = ArgumentParser(prog="strag report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", required=True, help="output URL of `strag batch` (local folder, file://, s3://)")
    parser.add_argument("--out", required=True, help="report folder (local path or fsspec URL)")
    parser.add_argument("--jobs", default="straggling",
                        help="job pages to build: straggling (default), all, none, or comma-separated job ids")
    parser.add_argument("--max-jobs", type=int, default=200, help="at most this many job pages, most GPU-hours wasted first (default 200)")
    parser.add_argument("--images", default="svg,png", help="chart files for the fleet report: svg,png (default), svg, png or none")
    parser.add_argument("--check", action="store_true", help="open every page in headless Chromium and fail on undrawn charts or console errors")
    parser.add_argument("--lake", help=argparse.SUPPRESS)   # gone: say where timelines come from now
    args = parser.parse_args(argv)
    if args.lake is not None:
        parser.error("--lake: the report no longer reads traces; run `strag batch --timelines` to write each straggling "
                     "window's timeline beside the tables, and the job pages link them")
    jobs = args.jobs if args.jobs in _JOB_SELECTIONS else tuple(j for j in args.jobs.split(",") if j)
    images = () if args.images == "none" else tuple(f for f in args.images.split(",") if f)
    return ReportOptions(args.tables, args.out, jobs, args.max_jobs, images, args.check)


def _selected_jobs(data, opts: ReportOptions) -> list[tuple]:
    """(date, job_id) of every window the options ask a page for, most GPU-hours wasted first,
    before --max-jobs cuts the list."""
    summary = data.jobs["job_summary"]
    if summary.empty or opts.jobs == "none":
        return []
    rows = summary.sort_values(["wasted_gpu_hours", "job_id"], ascending=[False, True])
    if opts.jobs == "straggling":
        # discarded windows (replay off by more than 5% either way) have no trustworthy S: pages only on request
        rows = rows[rows["straggling"] & ~rows["discarded"]]
    elif opts.jobs != "all":
        wanted = set(opts.jobs)
        missing = wanted - set(rows["job_id"])
        if missing:
            raise ValueError(f"--jobs: no job_summary rows for {sorted(missing)} under {opts.tables}")
        rows = rows[rows["job_id"].isin(wanted)]
    return list(zip(rows["date"], rows["job_id"]))


def build(opts: ReportOptions, out_dir: pathlib.Path) -> dict:
    """Build every page into the local folder out_dir; returns a summary dict."""
    from dashboards.data import load_report_data
    from dashboards.fleet_report import build_fleet_report
    from dashboards.html import write_bundle
    from dashboards.job_page import build_job_page, job_page_path

    started = time.perf_counter()
    data = load_report_data(opts.tables)
    wanted = _selected_jobs(data, opts)
    selected = wanted[: opts.max_jobs]
    pages = []
    if selected:
        write_bundle(out_dir)
    timelines = 0
    for index, (date, job_id) in enumerate(selected, 1):
        href = None
        relative = f"timelines/{job_page_path(date, job_id).split('/', 1)[1].removesuffix('.html')}.json.gz"
        if _copy_timeline(opts.tables, date, job_id, out_dir / relative):
            href, timelines = f"../{urllib.parse.quote(relative)}", timelines + 1
        pages.append(build_job_page(data, date, job_id, out_dir, timeline_href=href))
        if index % 25 == 0:
            print(f"  job pages: {index}/{len(selected)}", file=sys.stderr)
    linked = set(selected)
    # hrefs: the page file names are percent-encoded ids, so their '%' is escaped once more in the link
    report = build_fleet_report(data, out_dir, lambda d, j: urllib.parse.quote(job_page_path(d, j)) if (d, j) in linked else None,
                                opts.images)
    checked = []
    if opts.check:
        from dashboards.browser import check_page

        for page in [report, *pages]:
            result = check_page(page)
            result.raise_for_problems()
            checked.append(page)
    return {"report": report, "job_pages": len(pages), "checked": len(checked), "windows": len(data.jobs["job_summary"]),
            "beyond_max_jobs": len(wanted) - len(selected),
            "timelines": timelines, "seconds": time.perf_counter() - started}


def _copy_timeline(tables: str, date, job_id: str, path: pathlib.Path) -> bool:
    """Copy the window's timeline that `strag batch --timelines` published under the tables to
    `path`; False when the batch wrote none (run without --timelines, or the window not straggling)."""
    from schemas.tables import timeline_path

    fs, root = fsspec.core.url_to_fs(tables)
    source = f"{root.rstrip('/')}/{timeline_path(date, job_id)}"
    if not fs.exists(source):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fs.get_file(source, str(path))
    return True


def run(argv: list[str]) -> int:
    try:
        opts = parse(argv)
    except ValueError as error:
        print(f"strag report: {error}", file=sys.stderr)
        return 2
    fs, root = fsspec.core.url_to_fs(opts.out)
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    from dashboards.browser import BrowserError
    from dashboards.data import ReportDataError

    try:
        if local:
            summary = build(opts, pathlib.Path(root))
        else:
            # build locally, then upload the folder: pages link to each other by relative paths
            with tempfile.TemporaryDirectory(prefix="strag-report-") as staging:
                summary = build(opts, pathlib.Path(staging))
                fs.put(staging.rstrip("/") + "/", root.rstrip("/") + "/", recursive=True)
    except (ReportDataError, ValueError, KeyError) as error:   # the command line names something that is not there
        print(f"strag report: {error}", file=sys.stderr)
        return 2
    except BrowserError as error:   # --check: a page did not render
        print(f"strag report: {error}", file=sys.stderr)
        return 1
    where = opts.out.rstrip("/")
    print(f"fleet report: {where}/index.html")
    print(f"job pages:    {summary['job_pages']} under {where}/jobs/" + (f", {summary['checked']} pages checked in Chromium" if opts.check else ""))
    others = summary["windows"] - summary["job_pages"]
    if opts.jobs == "straggling" and others > 0:   # say why the other windows have no page, and how to get one
        beyond = f", or beyond --max-jobs {opts.max_jobs}" if summary["beyond_max_jobs"] else ""
        print(f"              {others} other window(s) (not straggling, or discarded: replay off by more than 5%{beyond}) "
              f"have no page; --jobs all (or their ids) gives them one")
    if summary["job_pages"]:
        print(f"timelines:    {summary['timelines']} of the {summary['job_pages']} pages link a Perfetto timeline"
              + (f" (under {where}/timelines/)" if summary["timelines"] else
                 " (`strag batch --timelines` writes them for straggling windows)"))
    print(f"done in {summary['seconds']:.1f} s")
    return 0
