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
    "cdf_chart",
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

# SMon's colour range for S_w: 1.0 (white) to 1.5 (dark red), clamped.
HEATMAP_DOMAIN = (1.0, 1.5)
_WIDTH, _HEIGHT = 440, 250
_CATEGORY_ORDER = ["compute", "pp-comm", "dp-comm", "other"]


def _empty(title: str, message: str = "no data in the tables for this chart") -> alt.Chart:
    """A chart that says there is nothing to show (still a drawn SVG, so the page is honest)."""
    return (
        alt.Chart(pd.DataFrame({"message": [message]}), title=title, width=_WIDTH, height=60)
        .mark_text(fontSize=13, color="#777")
        .encode(text="message:N")
    )


def cdf_chart(distribution: pd.DataFrame, metric: str, title: str, x_title: str, *, percent: bool = False,
              threshold: float | None = None, colour_field: str = "weighting") -> alt.Chart:
    """Step CDF of one fleet_distribution metric (rows of every weighting, or series in colour_field).

    distribution: fleet_distribution rows (one period). The x value of a point is the bin's
    upper edge, its y the cumulative share of weight below it.
    """
    rows = distribution[distribution["metric"] == metric] if metric else distribution
    if rows.empty:
        return _empty(title)
    frame = rows[[colour_field, "bin_upper", "cumulative_share"]].rename(columns={colour_field: "series", "bin_upper": "value"})
    # start each curve at zero so the step begins at its first bin
    starts = rows.sort_values("bin_lower").groupby(colour_field, as_index=False).first()
    frame = pd.concat([pd.DataFrame({"series": starts[colour_field], "value": starts["bin_lower"], "cumulative_share": 0.0}), frame])
    axis = alt.Axis(format="%") if percent else alt.Axis()
    line = (
        alt.Chart(frame)
        .mark_line(interpolate="step-after")
        .encode(
            x=alt.X("value:Q", title=x_title, axis=axis, scale=alt.Scale(zero=False, nice=False)),
            y=alt.Y("cumulative_share:Q", title="share of jobs (CDF)", axis=alt.Axis(format="%"), scale=alt.Scale(domain=[0, 1])),
            color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom-right")),
            tooltip=[alt.Tooltip("series:N"), alt.Tooltip("value:Q", format=".3f"), alt.Tooltip("cumulative_share:Q", format=".1%")],
        )
    )
    layers = [line]
    if threshold is not None:
        layers.append(alt.Chart(pd.DataFrame({"value": [threshold]})).mark_rule(strokeDash=[4, 3], color="#999").encode(x="value:Q"))
    return alt.layer(*layers).properties(title=title, width=_WIDTH, height=_HEIGHT)


def optype_waste_chart(optype: pd.DataFrame, title: str) -> alt.Chart:
    """Bars of GPU-hours wasted per op-type category (fleet_optype category rows)."""
    rows = optype[optype["optype"].isna()]
    if rows.empty:
        return _empty(title)
    return (
        alt.Chart(rows, title=title, width=_WIDTH, height=160)
        .mark_bar()
        .encode(
            y=alt.Y("category:N", sort=_CATEGORY_ORDER, title=None),
            x=alt.X("wasted_gpu_hours:Q", title="GPU-hours wasted (attributed)"),
            color=alt.Color("category:N", sort=_CATEGORY_ORDER, legend=None),
            tooltip=["category", "jobs", alt.Tooltip("slowdown_mean:Q", format=".3f"), alt.Tooltip("wasted_gpu_hours:Q", format=",.1f"),
                     alt.Tooltip("share_of_attributed_waste:Q", format=".1%")],
        )
    )


def size_chart(jobs: pd.DataFrame, size: pd.DataFrame, pearson: float | None, title: str) -> alt.Chart:
    """S of every analysed job against its GPU count (log scale), with the per-bucket mean."""
    if jobs.empty:
        return _empty(title)
    subtitle = f"Pearson r(log2 GPUs, S) = {pearson:.2f}" if pearson is not None and np.isfinite(pearson) else "too few jobs for a correlation"
    points = (
        alt.Chart(jobs)
        .mark_circle(size=28, opacity=0.6)
        .encode(
            x=alt.X("gpus:Q", scale=alt.Scale(type="log", base=2), title="GPUs"),
            y=alt.Y("slowdown:Q", scale=alt.Scale(zero=False), title="slowdown S"),
            color=alt.Color("straggling:N", title="S >= 1.1", scale=alt.Scale(domain=[False, True], range=["#4c78a8", "#e45756"])),
            tooltip=["job_id", "gpus", alt.Tooltip("slowdown:Q", format=".3f")],
        )
    )
    layers = [points]
    if not size.empty:
        buckets = size.assign(gpus=np.sqrt(size["gpus_lower"] * size["gpus_upper"]))
        layers.append(alt.Chart(buckets).mark_line(point=True, color="#333").encode(x="gpus:Q", y="slowdown_mean:Q",
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


def trend_chart(daily: pd.DataFrame, weekly: pd.DataFrame, title: str) -> alt.Chart:
    """Straggling share and GPU-hour-weighted waste per day (thin) and per ISO week (thick)."""
    if daily.empty and weekly.empty:
        return _empty(title)
    measures = {"straggling_share": "share of jobs with S >= 1.1", "waste_gpu_weighted": "GPU-hours wasted (share)"}
    parts = []
    for frame, period in ((daily, "day"), (weekly, "week")):
        if frame.empty:
            continue
        long = frame.melt(id_vars=["period_start"], value_vars=list(measures), var_name="measure", value_name="value")
        long["measure"] = long["measure"].map(measures)
        long["period"] = period
        parts.append(long)
    data = pd.concat(parts).dropna(subset=["value"])
    data["period_start"] = pd.to_datetime(data["period_start"])
    return (
        alt.Chart(data, title=title, width=_WIDTH + 200, height=_HEIGHT)
        .mark_line(point=True)
        .encode(
            x=alt.X("period_start:T", title="date"),
            y=alt.Y("value:Q", axis=alt.Axis(format="%"), title=None),
            color=alt.Color("measure:N", title=None, legend=alt.Legend(orient="top")),
            strokeDash=alt.StrokeDash("period:N", title="period", scale=alt.Scale(domain=["day", "week"], range=[[2, 2], [1, 0]])),
            size=alt.Size("period:N", scale=alt.Scale(domain=["day", "week"], range=[1, 2.5]), legend=None),
            tooltip=["period", alt.Tooltip("period_start:T"), "measure", alt.Tooltip("value:Q", format=".1%")],
        )
    )


def host_chart(host: pd.DataFrame, title: str, top: int = 20) -> alt.Chart:
    """Hosts implicated in the most distinct jobs (repeat offenders red), then by straggling workers."""
    if host.empty:
        return _empty(title)
    rows = host.sort_values(["implicated_jobs", "straggling_workers", "host"], ascending=[False, False, True]).head(top)
    rows = rows[(rows["implicated_jobs"] > 0) | (rows["straggling_workers"] > 0)]
    if rows.empty:
        return _empty(title, "no host held a straggling worker")
    return (
        alt.Chart(rows, title=title, width=_WIDTH - 80, height=18 * len(rows))
        .mark_bar()
        .encode(
            y=alt.Y("host:N", sort=list(rows["host"]), title=None),
            x=alt.X("implicated_jobs:Q", title="distinct jobs where a worker on the host was blamed", axis=alt.Axis(tickMinStep=1)),
            color=alt.Color("repeat_offender:N", title="repeat offender", scale=alt.Scale(domain=[False, True], range=["#9ecae9", "#e45756"])),
            tooltip=["host", "implicated_jobs", "job_windows", "straggling_workers", alt.Tooltip("slowdown_max:Q", format=".3f")],
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
            x=alt.X("jobs:Q", title="job windows"),
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
            color=alt.Color("slowdown_mean:Q", title="mean S_w", scale=alt.Scale(domain=list(HEATMAP_DOMAIN), scheme="reds", clamp=True)),
            tooltip=["dp_rank", "stage", "worker_windows", alt.Tooltip("slowdown_mean:Q", format=".3f")],
        )
    )


def step_slowdown_chart(steps: pd.DataFrame, slowdown: float, title: str) -> alt.Chart:
    """S_s per sampled step, with the job's S as a dashed rule."""
    if steps.empty:
        return _empty(title)
    line = alt.Chart(steps).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step", axis=alt.Axis(tickMinStep=1, format="d")),
        y=alt.Y("slowdown:Q", title="per-step slowdown S_s", scale=alt.Scale(zero=False)),
        tooltip=["step", alt.Tooltip("slowdown:Q", format=".3f"), alt.Tooltip("step_time:Q", format=".3f"), alt.Tooltip("step_time_ideal:Q", format=".3f")],
    )
    rule = alt.Chart(pd.DataFrame({"slowdown": [slowdown]})).mark_rule(strokeDash=[4, 3], color="#e45756").encode(y="slowdown:Q")
    return alt.layer(line, rule).properties(title=title, width=_WIDTH, height=200)


def worker_heatmap(workers: pd.DataFrame, title: str) -> alt.Chart:
    """SMon's worker heatmap: x = DP rank, y = PP rank, colour = S_w from 1.0 to 1.5 (clamped)."""
    rows = workers.dropna(subset=["slowdown_worker"])
    if rows.empty:
        return _empty(title, "S < 1.03: no attribution computed")
    dp, pp = int(rows["dp_rank"].max()) + 1, int(rows["stage"].max()) + 1
    cell = max(8, min(48, 640 // max(dp, 1)))
    base = alt.Chart(rows).encode(
        x=alt.X("dp_rank:O", title="DP rank"),
        y=alt.Y("stage:O", title="PP rank"),
    )
    rects = base.mark_rect(stroke="white", strokeWidth=0.5).encode(
        color=alt.Color("slowdown_worker:Q", title="S_w", scale=alt.Scale(domain=list(HEATMAP_DOMAIN), scheme="reds", clamp=True)),
        tooltip=["dp_rank", "stage", "host", alt.Tooltip("slowdown_worker:Q", format=".3f"), alt.Tooltip("slowdown_dp:Q", format=".3f"),
                 alt.Tooltip("slowdown_stage:Q", format=".3f")],
    )
    layers = [rects]
    if dp * pp <= 128:
        layers.append(base.mark_text(fontSize=10).encode(
            text=alt.Text("slowdown_worker:Q", format=".2f"),
            color=alt.condition(alt.datum.slowdown_worker > 1.3, alt.value("white"), alt.value("black")),
        ))
    return alt.layer(*layers).properties(title=title, width=cell * dp, height=max(cell, 22) * pp)


def step_heatmap(per_step: pd.DataFrame, group: str, title: str) -> alt.Chart:
    """Per-step heatmap: x = step, y = stage or DP rank, colour = that group's per-step S_g (1.0 to 1.5)."""
    rows = per_step.dropna(subset=["step"])
    if rows.empty:
        return _empty(title, "S < 1.03: no per-step attribution computed")
    label = {"stage": "PP rank", "dp_rank": "DP rank"}[group]
    groups = int(rows[group].nunique())
    return (
        alt.Chart(rows, title=title, width=min(640, 14 * rows["step"].nunique()), height=max(14, min(22, 400 // max(groups, 1))) * groups)
        .mark_rect()
        .encode(
            x=alt.X("step:O", title="step", axis=alt.Axis(labelOverlap=True)),
            y=alt.Y(f"{group}:O", title=label),
            color=alt.Color("slowdown:Q", title="S", scale=alt.Scale(domain=list(HEATMAP_DOMAIN), scheme="reds", clamp=True)),
            tooltip=["step", group, alt.Tooltip("slowdown:Q", format=".3f")],
        )
    )


def attribution_bars(rows: pd.DataFrame, field: str, title: str) -> alt.Chart:
    """S attributed to each op type or stage over the window (rows with step null)."""
    rows = rows[rows["step"].isna()] if "step" in rows else rows
    if rows.empty:
        return _empty(title, "S < 1.03: no attribution computed")
    kind = "N" if field == "optype" else "O"
    bars = alt.Chart(rows).mark_bar(color="#f58518").encode(
        y=alt.Y(f"{field}:{kind}", title=None if field == "optype" else "PP rank", sort="-x" if field == "optype" else "ascending"),
        x=alt.X("excess:Q", title="S_g - 1 (slowdown this group alone causes)"),
        tooltip=[field, alt.Tooltip("slowdown:Q", format=".4f")],
    ).transform_calculate(excess="datum.slowdown - 1")
    return bars.properties(title=title, width=_WIDTH - 120, height=20 * len(rows))

