"""The fleet report: one self-contained HTML file (JavaScript inlined) plus PNG/SVG per chart.

Reproduces the paper's fleet figures on our tables (METHOD.md section 6): CDF of S, CDF of
waste (job- and GPU-hour-weighted), waste by op type, per-step slowdown normalised by job
S, S against job size, root-cause prevalence, trends per day and week, repeat-offender
hosts, spatial position heatmap and coverage. Inputs: a ReportData (tables only).
"""
from __future__ import annotations

import pathlib
from typing import Callable

import pandas as pd

from dashboards import charts
from dashboards.data import ReportData
from dashboards.html import Chart, HtmlTable, Numbers, Text, confidence_text, export_chart, render_page
from transforms.whatif.result import ATTRIBUTION_THRESHOLD, STRAGGLING_THRESHOLD

__all__ = ["build_fleet_report", "fleet_charts", "REPORT_FILE"]

REPORT_FILE = "index.html"


def _pct(value) -> str:
    return "n/a" if value is None or value != value else f"{100 * value:.1f}%"


def _num(value, digits: int = 3) -> str:
    return "n/a" if value is None or value != value else f"{value:.{digits}f}"


def _hours(value) -> str:
    """Hours: whole above 10; below, two significant digits (a fleet of short profiled windows holds
    thousandths of an hour, which "0" would hide)."""
    if value is None or value != value:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 10 or value == 0 else f"{value:.2g}"


def _units(data: ReportData) -> tuple[str, str]:
    """(hours, ranks) as the fleet's windows ran: ("GPU-hours", "GPUs"); for windows whose ranks ran on
    CPUs (job_summary.device "cpu": torch.profiler said so), their `gpus` count CPU ranks and their
    GPU-hours are CPU rank-hours, and a fleet holding both says both."""
    summary = data.jobs["job_summary"]
    cpu = summary["device"].eq("cpu") if "device" in summary and not summary.empty else pd.Series([], dtype=bool)
    if not cpu.any():
        return "GPU-hours", "GPUs"
    if cpu.all():
        return "CPU rank-hours", "CPU ranks"
    return "GPU-hours and CPU rank-hours", "GPUs or CPU ranks"


def fleet_charts(data: ReportData) -> list[Chart]:
    """Every chart of the fleet report, in page order."""
    distribution = data.fleet_period("fleet_distribution")
    summary = data.fleet_period("fleet_summary")
    pearson = summary["size_slowdown_pearson"].iloc[0] if not summary.empty else None
    weekly = data.fleet_period("fleet_summary", "week")
    jobs = _analysed_jobs(data)
    categories = distribution[distribution["metric"].str.startswith("optype_slowdown:")].copy()
    categories["category"] = categories["metric"].str.split(":").str[1]
    hours, ranks = _units(data)
    return [
        Chart("slowdown_cdf", "CDF of job slowdown S",
              charts.cdf_chart(distribution, "slowdown", "Job slowdown S", "slowdown S",
                               threshold=(STRAGGLING_THRESHOLD, f"straggling: S >= {STRAGGLING_THRESHOLD}"), hours=hours),
              f"S = T / T_ideal per job window: how much longer than straggler-free a step took. Dashed: the straggling "
              f"threshold {STRAGGLING_THRESHOLD}. Two counts: each job window once, or each by its {hours}."),
        Chart("waste_cdf", "CDF of wasted time", charts.cdf_chart(distribution, "waste", "Waste 1 - 1/S", f"share of the job's {hours} wasted", percent=True,
                                                          hours=hours),
              f"Job-weighted (each window counts once) and weighted by {hours} (each window counts by its {hours})."),
        Chart("optype_cdf", "Slowdown by op-type category", charts.category_slowdown_chart(categories, f"S_t per category (job windows with S >= {ATTRIBUTION_THRESHOLD})"),
              f"S_t: the job's slowdown when only that category's ops keep their real durations; compute vs pipeline (pp) vs "
              f"data-parallel (dp) communication. Only job windows with S >= {ATTRIBUTION_THRESHOLD} have S_t: the method (and the "
              f"authors' analyzer) attributes slowdown only from S {ATTRIBUTION_THRESHOLD} up, so this is not the same set of jobs as "
              f"the straggling ones (S >= {STRAGGLING_THRESHOLD})."),
        Chart("optype_waste", f"{hours} wasted by op-type category",
              charts.optype_waste_chart(data.fleet_period("fleet_optype"), "Attributed waste by category", hours)),
        Chart("step_normalised_cdf", "Per-step slowdown normalised by job S",
              charts.cdf_chart(distribution, "step_slowdown_normalised", "S_s / S over all (job, step) pairs", "S_s / S",
                               y_title="share of (job, step) pairs (CDF)"),
              "Close to 1 everywhere means slowdown persists across steps: a few sampled steps characterise a job."),
        Chart("size", "Slowdown against job size", charts.size_chart(jobs, data.fleet_period("fleet_size"), pearson, f"S vs {ranks}", ranks),
              f"Each dot a job window; each bar the mean S of the jobs in a power-of-two bucket of {ranks}, across it."),
        Chart("causes", "Root causes of straggling jobs", charts.cause_chart(data.fleet_period("fleet_cause"), "Share of straggling jobs per cause"),
              "A job may show several causes; the label is the mean S of the jobs where the cause is primary."),
        Chart("trends", "Trends", charts.trend_chart(data.daily_summary, weekly, "Straggling share and waste per day and per week", hours),
              f"Share of job windows that straggle, and share of all {hours} lost to stragglers."),
        Chart("hosts", "Repeat-offender hosts", charts.host_chart(data.fleet_period("fleet_host"), "Hosts blamed in the most distinct jobs"),
              "A host is blamed in a job when the verdict is individual-worker and one of its workers is implicated; "
              "red = blamed in two or more jobs (listed under the charts). Hosts never blamed are not shown."),
        Chart("positions", "Slowdown by (DP rank, PP rank) position", charts.position_chart(data.fleet_period("fleet_position"), "Mean S_w per position across jobs"),
              "A hot bottom row is the last stage carrying the loss layer across the fleet."),
        Chart("coverage", "Coverage", charts.coverage_chart(data.fleet_period("fleet_coverage"), "Job windows by outcome"),
              "Discarded: the replay off by more than 5% either way, kept out of every statistic above. Quarantined: bad input or failed analysis."
              + _method_sentence(data.fleet_period("fleet_coverage"))),
    ]


def _method_sentence(coverage: pd.DataFrame) -> str:
    """Where the model and METHOD.md differ: the analysed windows only the model keeps,
    and both mean S (empty when every kept window is METHOD's too, or the table predates the columns)."""
    if coverage.empty or "kept_by_model" not in coverage:
        return ""
    analysed = coverage[coverage["status"] == "analysed"]
    kept = int(analysed["kept_by_model"].fillna(0).sum())
    jobs = int(analysed["jobs"].sum())
    if not kept or not jobs:
        return ""
    model = float((analysed["slowdown_mean"] * analysed["jobs"]).sum() / jobs)
    method = analysed["slowdown_method_mean"].dropna()
    method_text = (f", METHOD.md's {float((method * analysed.loc[method.index, 'jobs']).sum() / analysed.loc[method.index, 'jobs'].sum()):.3f}"
                   if len(method) else "")
    return (f" {kept} of the {jobs} analysed windows are kept by the model (named workers' untraced CPU time given "
            f"back, or CPU ranks started as late as they finished the previous step); METHOD.md section 3 would discard them. Mean S of the analysed windows: the model's "
            f"{model:.3f}{method_text}.")


def _analysed_jobs(data: ReportData) -> pd.DataFrame:
    summary = data.jobs["job_summary"]
    if summary.empty:
        return pd.DataFrame(columns=["job_id", "gpus", "slowdown", "straggling"])
    rows = summary[~summary["discarded"]]
    return rows[["job_id", "gpus", "slowdown", "straggling"]].reset_index(drop=True)


def _worst_jobs(data: ReportData, job_href: Callable[[object, str], str | None], limit: int = 25) -> HtmlTable | Text:
    summary = data.jobs["job_summary"]
    causes = data.jobs["job_cause"]
    rows = summary
    verdict_columns = ["cause", "confidence", "savings_gpu_hours"]
    # the verdict comes from job_cause; drop same-named summary columns (job_summary may repeat them)
    rows = rows.drop(columns=[c for c in verdict_columns if c in rows.columns])
    if not causes.empty:
        rows = rows.merge(causes[["date", "job_id", *verdict_columns]], on=["date", "job_id"], how="left")
    else:
        rows = rows.assign(cause=None, confidence=None, savings_gpu_hours=None)
    rows = rows.sort_values(["wasted_gpu_hours", "job_id"], ascending=[False, True]).reset_index(drop=True)
    hours, ranks = _units(data)
    # the top wasters of the kept windows, and every window that has a page (a discarded one's on
    # request, `--jobs all`), so each page is reachable from here
    has_page = pd.Series([job_href(d, j) is not None for d, j in zip(rows["date"], rows["job_id"])], dtype=bool)
    kept = ~rows["discarded"].astype(bool) if not rows.empty else pd.Series([], dtype=bool)
    rows = rows[(kept & (kept.cumsum() <= limit)) | has_page]
    body = []
    for row in rows.itertuples():
        href = job_href(row.date, row.job_id)
        slowdown = _num(row.slowdown) + (" (discarded)" if row.discarded else "")
        body.append([
            str(row.date), (row.job_id, href) if href else row.job_id, int(row.gpus), slowdown, _pct(row.waste),
            _hours(row.wasted_gpu_hours), row.cause if isinstance(row.cause, str) else "",
            confidence_text(row.cause, row.confidence),
            _hours(row.savings_gpu_hours),
        ])
    return HtmlTable(
        f"Jobs that wasted the most {hours}, and every job with a page",
        ["date", "job", ranks, "S", "waste", f"{hours} wasted", "primary cause", "confidence", f"{hours} saved by the fix"],
        body,
        "Click a job for its monitor page. Savings: what-if replay of the fix of the primary cause. "
        "Discarded windows (replay off by more than 5%) are listed only when they have a page.",
    ) if body else Text("Jobs: no window was analysed and kept, and none has a page (`strag report --jobs all` "
                        "builds a page for every window, discarded ones included).")


def _offenders(data: ReportData) -> HtmlTable | Text:
    """The repeat offenders' table, or a line saying there are none (not an empty table)."""
    host = data.fleet_period("fleet_host")
    rows = host[host["repeat_offender"]].sort_values(["implicated_jobs", "host"], ascending=[False, True]) if not host.empty else host
    if rows.empty:
        return Text("Repeat offenders: no host was blamed in two or more distinct jobs.")
    return HtmlTable(
        "Repeat offenders",
        ["host", "jobs blamed", "job ids", "max S_w", "windows seen"],
        [[r.host, int(r.implicated_jobs), ", ".join(r.implicated_job_ids), _num(r.slowdown_max), int(r.job_windows)] for r in rows.itertuples()],
        "Hosts blamed for a straggling worker in two or more distinct jobs: candidates for hardware checks.",
    )


def _headline(data: ReportData) -> Numbers:
    summary = data.fleet_period("fleet_summary")
    if summary.empty:
        return Numbers([("job windows", "0", "no dates published")])
    s = summary.iloc[0]
    hours, _ = _units(data)
    return Numbers([
        ("job windows", f"{s.jobs:,}", f"{s.jobs_analysed:,} analysed, {s.jobs_discarded} discarded, {s.jobs_quarantined} quarantined"),
        ("straggling (S >= 1.1)", _pct(s.straggling_share), "paper: 42.5%"),
        (f"{hours} wasted", _pct(s.waste_gpu_weighted),
         (f"{_hours(s.wasted_gpu_hours)} of {_hours(s.gpu_hours)} {hours}" if s.jobs_analysed else "no window analysed and kept")
         + "; paper: 10.4%"),
        ("waste, p90 job", _pct(s.waste_p90), "paper: >10% of jobs waste >= 21.3%"),
        ("S_s / S p50 / p90", f"{_num(s.step_normalised_p50, 2)} / {_num(s.step_normalised_p90, 2)}", "paper: 1.0 / 1.06"),
        ("r(size, S)", _num(s.size_slowdown_pearson, 2), "paper: no correlation"),
        ("savings by fixes", _hours(s.savings_gpu_hours), f"{hours}, what-if replay of each primary fix"),
    ])


def build_fleet_report(
    data: ReportData,
    out_dir: pathlib.Path,
    job_href: Callable[[object, str], str | None] = lambda date, job_id: None,
    images: tuple[str, ...] = ("svg", "png"),
) -> pathlib.Path:
    """Write out_dir/index.html (self-contained) and out_dir/charts/<name>.{svg,png}; returns the HTML path.

    job_href(date, job_id): relative link of a job's page, or None when it has none.
    """
    out_dir = pathlib.Path(out_dir)
    chart_blocks = fleet_charts(data)
    files = {}
    for block in chart_blocks:
        written = export_chart(block.chart, out_dir / "charts" / block.name, images) if images else {}
        files[block.name] = {fmt: str(path.relative_to(out_dir)) for fmt, path in written.items()}
    by_name = {c.name: c for c in chart_blocks}
    dates = data.daily_summary["period_start"]
    span = f"{dates.min()} to {dates.max()}" if len(dates) else "no dates"
    blocks = [
        _headline(data),
        Text(f"Fleet statistics of every published date ({span}), from the fleet_*_rollup tables under {data.out}."),
        [by_name["slowdown_cdf"], by_name["waste_cdf"]],
        [by_name["optype_cdf"], by_name["optype_waste"]],
        [by_name["step_normalised_cdf"], by_name["size"]],
        [by_name["causes"], by_name["coverage"]],
        by_name["trends"],
        [by_name["hosts"], by_name["positions"]],
        _offenders(data),
        _worst_jobs(data, job_href),
    ]
    page = render_page("Straggler fleet report", f"What-if analysis of every job window, {span}", blocks, inline_js=True, files=files)
    path = out_dir / REPORT_FILE
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
