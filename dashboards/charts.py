"""Altair charts of the fleet report and the per-job page: pure functions, frame in, chart out.

Inputs are pandas frames of the output tables (schemas/tables.py, schemas/fleet.py); no
chart reads files or computes statistics beyond reshaping. Slowdowns are ratios, waste
and shares are fractions (axes format them as percentages).
"""
from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from schemas.fleet import CAUSES

__all__ = [
    "HEATMAP_DOMAIN",
    "WEIGHTING_LABELS",
    "heatmap_colour",
    "cdf_chart",
    "category_slowdown_chart",
    "optype_waste_chart",
    "size_chart",
    "cause_chart",
    "trend_chart",
    "host_chart",
    "coverage_chart",
    "position_chart",
    "step_slowdown_chart",
    "worker_heatmap",
    "step_heatmap",
    "attribution_bars",
]

# SMon's colour range for S_w: 1.0 (white) to 1.5 (dark red), clamped; every heatmap of a
# slowdown uses it, so one colour means one value on every chart.
HEATMAP_DOMAIN = (1.0, 1.5)
_HEATMAP_COLOURS = ["#ffffff", "#fcbba1", "#fb6a4a", "#cb181d", "#67000d"]
_WIDTH, _HEIGHT = 440, 250
_CATEGORY_ORDER = ["compute", "pp-comm", "dp-comm", "group-comm", "other"]
# What each weighting of fleet_distribution counts, in the words of a legend.
WEIGHTING_LABELS = {"job": "each job window once", "gpu_hours": "by GPU-hours", "step": "each (job, step) pair once"}
_STRAGGLING_LABELS = {False: "S < 1.1", True: "straggling, S >= 1.1"}
_TREND_MEASURES = {"straggling_share": "share of job windows with S >= 1.1", "waste_gpu_weighted": "share of GPU-hours wasted"}


def heatmap_colour(field: str, title: str) -> alt.Color:
    """The colour channel of every slowdown heatmap: HEATMAP_DOMAIN from white to dark red, clamped."""
    return alt.Color(f"{field}:Q", title=title, scale=alt.Scale(domain=list(HEATMAP_DOMAIN), range=_HEATMAP_COLOURS, interpolate="rgb", clamp=True),
                     legend=alt.Legend(values=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5], format=".1f"))


def _axis(**kwargs) -> alt.Axis:
    """A quantitative axis whose labels never overlap (greedy: a label that would touch its neighbour is dropped)."""
    return alt.Axis(labelOverlap="greedy", labelSeparation=6, **kwargs)


def _count_axis(maximum: int, title: str) -> alt.Axis:
    """An axis of a whole-number count: integer ticks only, at most about ten of them."""
    step = max(1, -(-int(maximum) // 10))
    return alt.Axis(title=title, values=list(range(0, int(maximum) + step, step)), format="d")


def _empty(title: str, message: str = "no data in the tables for this chart") -> alt.Chart:
    """A chart that says there is nothing to show (still a drawn SVG, so the page is honest)."""
    return (
        alt.Chart(pd.DataFrame({"message": [message]}), title=title, width=_WIDTH, height=60)
        .mark_text(fontSize=13, color="#777")
        .encode(text="message:N")
    )


def _cdf_points(rows: pd.DataFrame, series_field: str) -> pd.DataFrame:
    """Step points (series, value, cumulative_share) of histogram rows: each bin's upper edge at its
    cumulative share, after a zero at the first bin's lower edge so each step starts on the axis."""
    frame = rows[[series_field, "bin_upper", "cumulative_share"]].rename(columns={series_field: "series", "bin_upper": "value"})
    starts = rows.sort_values("bin_lower").groupby(series_field, as_index=False).first()
    return pd.concat([pd.DataFrame({"series": starts[series_field], "value": starts["bin_lower"], "cumulative_share": 0.0}), frame])


def _cdf_encoding(x_title: str, y_title: str, percent: bool) -> dict:
    """x and y channels of a CDF: both padded, so a step on the first value or at 100% is not hidden under an axis."""
    x_axis = _axis(title=x_title, format="%") if percent else _axis(title=x_title)
    return {
        "x": alt.X("value:Q", axis=x_axis, scale=alt.Scale(zero=False, nice=False, padding=10)),
        "y": alt.Y("cumulative_share:Q", title=y_title, axis=alt.Axis(format="%"), scale=alt.Scale(domain=[0, 1], padding=6)),
    }


def cdf_chart(distribution: pd.DataFrame, metric: str, title: str, x_title: str, *, y_title: str = "share of job windows (CDF)",
              percent: bool = False, threshold: tuple[float, str] | None = None, hours: str = "GPU-hours") -> alt.Chart:
    """Step CDF of one fleet_distribution metric, one line per weighting (legend: what each counts).

    distribution: fleet_distribution rows (one period). The x value of a point is the bin's
    upper edge, its y the cumulative share of weight below it. threshold: (x, label) of a
    dashed rule. hours: what the fleet's hours are (CPU rank-hours for CPU ranks), naming that weighting.
    """
    rows = distribution[distribution["metric"] == metric]
    if rows.empty:
        return _empty(title)
    frame = _cdf_points(rows, "weighting")
    frame["series"] = frame["series"].map({**WEIGHTING_LABELS, "gpu_hours": f"by {hours}"}).fillna(frame["series"])
    several = frame["series"].nunique() > 1
    line = alt.Chart(frame).mark_line(interpolate="step-after").encode(
        **_cdf_encoding(x_title, y_title, percent),
        color=alt.Color("series:N", title="counting", legend=alt.Legend(orient="bottom-right") if several else None),
        tooltip=[alt.Tooltip("series:N", title="counting"), alt.Tooltip("value:Q", format=".3f"),
                 alt.Tooltip("cumulative_share:Q", format=".1%")],
    )
    layers = [line]
    if threshold is not None:
        marker = alt.Chart(pd.DataFrame({"value": [threshold[0]], "label": [threshold[1]]}))
        layers += [marker.mark_rule(strokeDash=[4, 3], color="#999").encode(x="value:Q"),
                   marker.mark_text(align="left", dx=4, dy=-6, y=0, color="#666", fontSize=11).encode(x="value:Q", text="label:N")]
    return alt.layer(*layers).properties(title=title, width=_WIDTH, height=_HEIGHT)


def _category_quantiles(rows: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    """Per category (job weighting): windows, S_t at the 0/50/90/100th percentile (the lower edge of the
    first bin whose cumulative share reaches q: exact for S_t = 1.0, else within one bin) and the share of
    windows with S_t >= 1.01."""
    out = []
    for category in order:
        bins = rows[rows["category"] == category].sort_values("bin_lower")
        cumulative = bins["cumulative_share"].to_numpy()
        lower = bins["bin_lower"].to_numpy()

        def quantile(q: float) -> float:
            return float(lower[np.argmax(cumulative >= q - 1e-9)])

        below = bins[bins["bin_lower"] < 1.01 - 1e-9]["cumulative_share"]
        out.append({"category": category, "windows": int(bins["count"].sum()), "p0": float(lower[0]), "p50": quantile(0.5),
                    "p90": quantile(0.9), "max": quantile(1.0), "slowed": 1.0 - (float(below.max()) if len(below) else 0.0)})
    frame = pd.DataFrame(out)
    for column in ("p0", "p50", "p90", "max"):
        frame[f"{column}_excess"] = (frame[column] - 1.0).clip(lower=0.0)
    frame["label"] = [f"{r.windows} windows: median {r.p50:.3f}, p90 {r.p90:.3f}, max {r.max:.3f}; "
                      f"{r.slowed:.0%} at >= 1.01" for r in frame.itertuples()]
    return frame


# Ticks of the S_t axis (S_t - 1 on a symmetric log scale: 1.000 and 1.001 apart as 1.1 and 2.0 are).
_EXCESS_TICKS = [0.0, 0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, 9.0, 19.0, 49.0, 99.0]


def category_slowdown_chart(categories: pd.DataFrame, title: str) -> alt.Chart:
    """S_t per op-type category, one row each on a shared axis stretched near 1.0 (fleet_distribution
    rows of the metrics optype_slowdown:<category>, a `category` column added; each job window once).

    A row shows the spread of S_t over the job windows: a line from the lowest to the highest, a bar
    from the median to the 90th percentile, a tick at the median, and the figures in words. The axis
    is S_t - 1 on a symmetric log scale, so a category whose windows all sit between 1.000 and 1.01
    is told apart from one at exactly 1.0 and from one up to 2.3 (on a linear axis the first two are
    the same vertical line).
    """
    if categories.empty:
        return _empty(title)
    rows = categories[categories["weighting"] == "job"]
    present = set(rows["category"])
    order = [c for c in _CATEGORY_ORDER if c in present] + sorted(present - set(_CATEGORY_ORDER))
    frame = _category_quantiles(rows, order)
    top = max(float(frame["max_excess"].max()) * 1.25, 0.012)
    ticks = [t for t in _EXCESS_TICKS if t <= top]
    x_scale = alt.Scale(type="symlog", constant=0.001, domain=[0, top], nice=False)
    x_axis = alt.Axis(title="S_t (axis stretched near 1.0: S_t - 1 on a log scale)", values=ticks,
                      labelExpr="format(1 + datum.value, '.3~f')", grid=True)
    y = alt.Y("category:N", sort=order, title=None, axis=alt.Axis(labelFontSize=12, labelFontWeight="bold"))
    colour = alt.Color("category:N", sort=order, legend=None)
    tooltip = ["category", "windows", alt.Tooltip("p50:Q", title="median S_t", format=".3f"),
               alt.Tooltip("p90:Q", title="p90 S_t", format=".3f"), alt.Tooltip("max:Q", title="max S_t", format=".3f"),
               alt.Tooltip("slowed:Q", title="windows with S_t >= 1.01", format=".0%")]
    base = alt.Chart(frame).encode(y=y, tooltip=tooltip)
    spread = base.mark_rule(strokeWidth=2).encode(x=alt.X("p0_excess:Q", scale=x_scale, axis=x_axis), x2="max_excess:Q", color=colour)
    middle = base.mark_bar(height=14, opacity=0.55).encode(x=alt.X("p50_excess:Q", scale=x_scale), x2="p90_excess:Q", color=colour)
    median = base.mark_tick(thickness=3, size=22, color="#222").encode(x=alt.X("p50_excess:Q", scale=x_scale))
    highest = base.mark_point(filled=True, size=40).encode(x=alt.X("max_excess:Q", scale=x_scale), color=colour)
    words = base.mark_text(align="left", baseline="middle", dy=-16, x=2, fontSize=11, color="#444").encode(text="label:N")
    return alt.layer(spread, middle, median, highest, words).properties(
        title=alt.TitleParams(title, subtitle="line: lowest to highest S_t; bar: median to p90; black tick: median"),
        width=_WIDTH, height=46 * len(order))


def optype_waste_chart(optype: pd.DataFrame, title: str, unit: str = "GPU-hours") -> alt.Chart:
    """Bars of GPU-hours (unit) wasted per op-type category (fleet_optype category rows). The axis
    labels are as short as the figures allow (a fleet of short profiled windows wastes thousandths
    of an hour: "0.0010" per tick would run into its neighbours) and never overlap."""
    rows = optype[optype["optype"].isna()]
    if rows.empty:
        return _empty(title)
    return (
        alt.Chart(rows, title=title, width=_WIDTH, height=160)
        .mark_bar()
        .encode(
            y=alt.Y("category:N", sort=_CATEGORY_ORDER, title=None),
            x=alt.X("wasted_gpu_hours:Q", title=f"{unit} wasted (attributed)", axis=_axis(format=",~g", tickCount=5)),
            color=alt.Color("category:N", sort=_CATEGORY_ORDER, legend=None),
            tooltip=["category", "jobs", alt.Tooltip("slowdown_mean:Q", format=".3f"), alt.Tooltip("wasted_gpu_hours:Q", format=",.1f"),
                     alt.Tooltip("share_of_attributed_waste:Q", format=".1%")],
        )
    )


def _powers_of_two(values) -> list[int]:
    """Every power of two from the one at or below the smallest value to the one at or above the largest."""
    low, high = max(int(min(values)), 1), max(int(max(values)), 1)
    return [1 << k for k in range(low.bit_length() - 1, (high - 1).bit_length() + 1)]


def size_chart(jobs: pd.DataFrame, size: pd.DataFrame, pearson: float | None, title: str, devices: str = "GPUs") -> alt.Chart:
    """S of every analysed job against its GPU count (log scale), with the per-bucket mean. A GPU count
    is whole: the axis ticks are the powers of two the buckets start at (no 2.5 GPUs), and a bucket's
    mean is a segment across its bucket [lower, upper), not a point at a size no job has."""
    if jobs.empty:
        return _empty(title)
    subtitle = (f"Pearson r(log2 {devices}, S) = {pearson:.2f}" if pearson is not None and np.isfinite(pearson)
                else "too few jobs for a correlation")
    jobs = jobs.assign(straggling=jobs["straggling"].map(_STRAGGLING_LABELS))
    ticks = _powers_of_two([*jobs["gpus"], *size.get("gpus_lower", []), *size.get("gpus_upper", [])])
    x = alt.X("gpus:Q", title=f"{devices} (log scale)", scale=alt.Scale(type="log", base=2, padding=12),
              axis=_axis(values=ticks, format=",d"))
    y = alt.Y("slowdown:Q", title="slowdown S", scale=alt.Scale(zero=False, padding=8))
    points = (
        alt.Chart(jobs)
        .mark_circle(size=28, opacity=0.6)
        .encode(
            x=x, y=y,
            color=alt.Color("straggling:N", title="job window", scale=alt.Scale(domain=list(_STRAGGLING_LABELS.values()), range=["#4c78a8", "#e45756"])),
            tooltip=["job_id", "gpus", alt.Tooltip("slowdown:Q", format=".3f")],
        )
    )
    layers = [points]
    if not size.empty:
        buckets = size.assign(gpus=size["gpus_lower"], slowdown=size["slowdown_mean"])
        layers.append(alt.Chart(buckets).mark_rule(color="#333", strokeWidth=2).encode(
            x=x, x2="gpus_upper:Q", y=y,
            tooltip=["gpus_lower", "gpus_upper", "jobs", alt.Tooltip("slowdown_mean:Q", format=".3f")]))
    return alt.layer(*layers).properties(title=alt.TitleParams(title, subtitle=subtitle), width=_WIDTH, height=_HEIGHT)


def cause_chart(cause: pd.DataFrame, title: str) -> alt.Chart:
    """Share of straggling jobs showing each root cause, labelled with the mean S of its primary jobs."""
    if cause.empty:
        return _empty(title, "no straggling jobs")
    rows = cause.assign(label=[f"mean S {s:.2f}" if s == s and s is not None else "" for s in cause["slowdown_mean"]])
    order = [c for c in CAUSES if c in set(rows["cause"])]
    base = alt.Chart(rows).encode(y=alt.Y("cause:N", sort=order, title=None))
    bars = base.mark_bar(color="#e45756").encode(
        x=alt.X("share_of_straggling:Q", title="share of straggling jobs", axis=alt.Axis(format="%")),
        tooltip=["cause", "jobs", "jobs_primary", alt.Tooltip("share_of_straggling:Q", format=".1%"),
                 alt.Tooltip("slowdown_mean:Q", format=".2f"), alt.Tooltip("savings_gpu_hours:Q", format=",.1f")],
    )
    text = base.mark_text(align="left", dx=4, fontSize=11).encode(x="share_of_straggling:Q", text="label:N")
    return alt.layer(bars, text).properties(title=title, width=_WIDTH - 80, height=24 * len(order))


def _long_measures(frame: pd.DataFrame, hours: str = "GPU-hours") -> pd.DataFrame:
    """fleet_summary rows as (period_start, measure, value) rows of the trend measures."""
    long = frame.melt(id_vars=["period_start"], value_vars=list(_TREND_MEASURES), var_name="measure", value_name="value")
    long["measure"] = long["measure"].map({**_TREND_MEASURES, "waste_gpu_weighted": f"share of {hours} wasted"})
    long["period_start"] = pd.to_datetime(long["period_start"])
    return long.dropna(subset=["value"])


def trend_chart(daily: pd.DataFrame, weekly: pd.DataFrame, title: str, hours: str = "GPU-hours") -> alt.Chart:
    """Straggling share and GPU-hour-weighted waste: a point per day (joined by a thin line) and a
    wide translucent bar across each ISO week at that week's value."""
    if daily.empty and weekly.empty:
        return _empty(title)
    days, weeks = _long_measures(daily, hours), _long_measures(weekly, hours)
    if days.empty and weeks.empty:   # no window analysed and kept: no share to draw (all NaN)
        return _empty(title, "no job window was analysed and kept: every one was discarded or quarantined")
    first = min(f["period_start"].min() for f in (days, weeks) if not f.empty)
    last = max(f["period_start"].max() for f in (days, weeks) if not f.empty)
    step = max(1, -(-((last - first).days + 1) // 12))    # about a dozen date ticks, whole days apart
    x = alt.X("period_start:T", title="date",
              axis=alt.Axis(format="%a %d %b", tickCount={"interval": "day", "step": step}, labelOverlap="greedy", labelAngle=0))
    y = alt.Y("value:Q", axis=alt.Axis(format="%"), title=None)
    colour = alt.Color("measure:N", title=None, legend=alt.Legend(orient="top", symbolOpacity=1))
    layers = []
    if not weeks.empty:
        # a week bar spans the week's published days only
        weeks = weeks.assign(period_start=weeks["period_start"].clip(lower=first),
                             period_end=(weeks["period_start"] + pd.Timedelta(days=6)).clip(upper=last))
        layers.append(alt.Chart(weeks).mark_rule(strokeWidth=8, opacity=0.35).encode(
            x=x, x2="period_end:T", y=y, color=colour,
            tooltip=[alt.Tooltip("period_start:T", title="week from"), "measure", alt.Tooltip("value:Q", format=".1%")]))
    if not days.empty:
        layers.append(alt.Chart(days).mark_line(point=True, strokeWidth=1.5).encode(
            x=x, y=y, color=colour,
            tooltip=[alt.Tooltip("period_start:T", title="day"), "measure", alt.Tooltip("value:Q", format=".1%")]))
    return alt.layer(*layers).properties(title=alt.TitleParams(title, subtitle="dots: one day; wide bars: the ISO week"),
                                         width=_WIDTH + 200, height=_HEIGHT)


def host_chart(host: pd.DataFrame, title: str, top: int = 20) -> alt.Chart:
    """The `top` hosts blamed in the most distinct jobs (repeat offenders red); hosts never blamed are left out."""
    rows = host[host["implicated_jobs"] > 0] if not host.empty else host
    if rows.empty:
        return _empty(title, "no host was blamed: no individual-worker verdict implicated a worker")
    rows = rows.sort_values(["implicated_jobs", "straggling_workers", "host"], ascending=[False, False, True]).head(top)
    rows = rows.assign(offender=rows["repeat_offender"].map({True: "repeat offender (2+ jobs)", False: "blamed in 1 job"}))
    most = int(rows["implicated_jobs"].max())
    return (
        alt.Chart(rows, title=title, width=_WIDTH - 80, height=max(40, 20 * len(rows)))
        .mark_bar()
        .encode(
            y=alt.Y("host:N", sort=list(rows["host"]), title=None),
            x=alt.X("implicated_jobs:Q", axis=_count_axis(max(most, 2), "distinct jobs where a worker on the host was blamed"),
                    scale=alt.Scale(domain=[0, max(most, 2)])),
            color=alt.Color("offender:N", title=None, legend=alt.Legend(orient="bottom"),
                            scale=alt.Scale(domain=["blamed in 1 job", "repeat offender (2+ jobs)"], range=["#9ecae9", "#e45756"])),
            tooltip=["host", alt.Tooltip("implicated_jobs:Q", title="jobs blamed"), "job_windows", "straggling_workers",
                     alt.Tooltip("slowdown_max:Q", format=".3f")],
        )
    )


def coverage_chart(coverage: pd.DataFrame, title: str) -> alt.Chart:
    """Job windows by what happened to them: analysed, discarded (discrepancy), quarantined (reason)."""
    if coverage.empty:
        return _empty(title)
    source = coverage["source_format"] if "source_format" in coverage else ["lake"] * len(coverage)
    rows = coverage.assign(what=[(s if not r else f"{s}: {r}") + ("" if f == "lake" else f" ({f} upload)")
                                 for s, r, f in zip(coverage["status"], coverage["reason"], source)])
    return (
        alt.Chart(rows, title=title, width=_WIDTH - 80, height=22 * len(rows))
        .mark_bar()
        .encode(
            y=alt.Y("what:N", sort=list(rows["what"]), title=None),
            x=alt.X("jobs:Q", axis=_count_axis(max(int(rows["jobs"].max()), 1), "job windows")),   # whole windows
            color=alt.Color("status:N", scale=alt.Scale(domain=["analysed", "discarded", "quarantined"], range=["#54a24b", "#f58518", "#e45756"])),
            tooltip=["status", "reason", *(["source_format"] if "source_format" in rows else []), "jobs",
                     alt.Tooltip("gpu_hours:Q", format=",.1f")],
        )
    )


def position_chart(position: pd.DataFrame, title: str, max_dp: int = 32, max_stage: int = 16) -> alt.Chart:
    """Mean S_w per (dp_rank, stage) position across jobs; the last stage of each job marked."""
    rows = position[(position["dp_rank"] < max_dp) & (position["stage"] < max_stage)]
    if rows.empty:
        return _empty(title)
    rows = rows.assign(role=np.where(rows["last_stage"], "last stage", "other stages"))
    grouped = rows.groupby(["dp_rank", "stage"], as_index=False).apply(
        lambda g: pd.Series({"slowdown_mean": np.average(g["slowdown_mean"], weights=g["worker_windows"]), "worker_windows": g["worker_windows"].sum()}),
        include_groups=False,
    )
    return (
        alt.Chart(grouped, title=title, width=min(_WIDTH, 22 * (grouped["dp_rank"].max() + 1)), height=22 * (grouped["stage"].max() + 1))
        .mark_rect()
        .encode(
            x=alt.X("dp_rank:O", title="DP rank"),
            y=alt.Y("stage:O", title="PP rank (stage)"),
            color=heatmap_colour("slowdown_mean", "mean S_w"),
            tooltip=["dp_rank", "stage", "worker_windows", alt.Tooltip("slowdown_mean:Q", format=".3f")],
        )
    )


def _sampled_runs(steps: np.ndarray) -> np.ndarray:
    """Run number of each sampled step (ascending): a new run starts after a gap over twice the
    median gap, so the line never bridges a stretch of steps that was not sampled."""
    gaps = np.diff(steps)
    if len(gaps) == 0:
        return np.zeros(len(steps), dtype=int)
    return np.concatenate([[0], np.cumsum(gaps > max(1.0, 2 * float(np.median(gaps))))])


def step_slowdown_chart(steps: pd.DataFrame, slowdown: float, title: str) -> alt.Chart:
    """S_s per sampled step, joined only across nearby sampled steps, with the job's S as a dashed rule."""
    if steps.empty:
        return _empty(title)
    steps = steps.sort_values("step")
    steps = steps.assign(run=_sampled_runs(steps["step"].to_numpy()))
    # a step number is whole: a few sampled steps are the ticks themselves (tickMinStep alone still
    # let Vega put a tick at 2.5 between steps 2 and 3, labelled "3" beside the real 3)
    sampled = sorted({int(x) for x in steps["step"]})
    ticks = dict(values=sampled) if len(sampled) <= 12 else dict(tickMinStep=1)
    line = alt.Chart(steps).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step", axis=_axis(format="d", **ticks)),
        y=alt.Y("slowdown:Q", title="per-step slowdown S_s", scale=alt.Scale(zero=False, padding=6)),
        detail="run:N",
        tooltip=["step", alt.Tooltip("slowdown:Q", format=".3f"), alt.Tooltip("step_time:Q", format=".3f"), alt.Tooltip("step_time_ideal:Q", format=".3f")],
    )
    rule = alt.Chart(pd.DataFrame({"slowdown": [slowdown]})).mark_rule(strokeDash=[4, 3], color="#e45756").encode(y="slowdown:Q")
    return alt.layer(line, rule).properties(title=alt.TitleParams(title, subtitle="gaps in the line: steps not sampled"), width=_WIDTH, height=200)


# A cell's value is written in it only when "1.23" at font size 10 fits (about 24 px of text).
_LABELLED_CELL = 30


def _rank_axis(count: int, cell: int, title: str) -> alt.Axis:
    """An ordinal axis of ranks 0..count-1 that stays readable however narrow the cells: every k-th
    rank labelled (k in 1, 2, 5, 10, 20, ... so labels are at least ~22 px apart), upright."""
    step = next(k for k in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10**9) if k * cell >= 22)
    return alt.Axis(title=title, values=list(range(0, count, step)), labelAngle=0, labelOverlap=False)


NO_ATTRIBUTION = "S < 1.03: no attribution computed"


def worker_heatmap(workers: pd.DataFrame, title: str, empty: str = NO_ATTRIBUTION) -> alt.Chart:
    """SMon's worker heatmap: x = DP rank, y = PP rank, colour = S_w from 1.0 to 1.5 (clamped).

    Each cell carries its S_w as text only where the text fits (cells of at least _LABELLED_CELL
    px); narrower cells (many DP ranks) keep the value in the tooltip, and the rank axis labels
    every k-th rank."""
    rows = workers.dropna(subset=["slowdown_worker"])
    if rows.empty:
        return _empty(title, empty)
    dp, pp = int(rows["dp_rank"].max()) + 1, int(rows["stage"].max()) + 1
    cell = max(8, min(48, 640 // max(dp, 1)))
    row_height = max(cell, 22 if pp > 1 else 40)
    base = alt.Chart(rows).encode(
        x=alt.X("dp_rank:O", axis=_rank_axis(dp, cell, "DP rank"), scale=alt.Scale(domain=list(range(dp)))),
        y=alt.Y("stage:O", axis=_rank_axis(pp, row_height, "PP rank"), scale=alt.Scale(domain=list(range(pp)))),
    )
    rects = base.mark_rect(stroke="white", strokeWidth=0.5 if cell >= 12 else 0).encode(
        color=heatmap_colour("slowdown_worker", "S_w"),
        tooltip=["dp_rank", "stage", "host", alt.Tooltip("slowdown_worker:Q", format=".3f"), alt.Tooltip("slowdown_dp:Q", format=".3f"),
                 alt.Tooltip("slowdown_stage:Q", format=".3f")],
    )
    layers = [rects]
    if cell >= _LABELLED_CELL:
        layers.append(base.mark_text(fontSize=10).encode(
            text=alt.Text("slowdown_worker:Q", format=".2f"),
            color=alt.condition(alt.datum.slowdown_worker > 1.3, alt.value("white"), alt.value("black")),
        ))
    subtitle = [] if cell >= _LABELLED_CELL else ["cells too narrow for their values: hover a cell for its S_w"]
    return alt.layer(*layers).properties(title=alt.TitleParams(title, subtitle=subtitle), width=cell * dp, height=row_height * pp)


def step_heatmap(per_step: pd.DataFrame, group: str, title: str, empty: str = NO_ATTRIBUTION) -> alt.Chart:
    """Per-step heatmap: x = step, y = stage or DP rank, colour = that group's per-step S_g (1.0 to 1.5)."""
    rows = per_step.dropna(subset=["step"])
    if rows.empty:
        return _empty(title, empty.replace("no attribution", "no per-step attribution"))
    label = {"stage": "PP rank", "dp_rank": "DP rank"}[group]
    groups = int(rows[group].nunique())
    return (
        alt.Chart(rows, title=title, width=min(640, 14 * rows["step"].nunique()), height=max(14, min(22, 400 // max(groups, 1))) * groups)
        .mark_rect()
        .encode(
            x=alt.X("step:O", title="step", axis=alt.Axis(labelOverlap=True)),
            y=alt.Y(f"{group}:O", title=label),
            color=heatmap_colour("slowdown", "S_stage" if group == "stage" else "S_dp"),
            tooltip=["step", group, alt.Tooltip("slowdown:Q", format=".3f")],
        )
    )


def attribution_bars(rows: pd.DataFrame, field: str, title: str, empty: str = NO_ATTRIBUTION) -> alt.Chart:
    """S attributed to each op type or stage over the window (rows with step null)."""
    rows = rows[rows["step"].isna()] if "step" in rows else rows
    if rows.empty:
        return _empty(title, empty)
    kind = "N" if field == "optype" else "O"
    bars = alt.Chart(rows).mark_bar(color="#f58518").encode(
        y=alt.Y(f"{field}:{kind}", title=None if field == "optype" else "PP rank", sort="-x" if field == "optype" else "ascending"),
        x=alt.X("excess:Q", axis=_axis(title="S_g - 1 (slowdown this group alone causes)", tickCount=5)),
        tooltip=[field, alt.Tooltip("slowdown:Q", format=".4f")],
    ).transform_calculate(excess="datum.slowdown - 1")
    return bars.properties(title=title, width=_WIDTH - 120, height=20 * len(rows))

