"""The per-job monitor page, in the style of the paper's SMon: S and verdict, per-step
slowdown, the worker heatmap (x = DP rank, y = PP rank, colour = S_w from 1.0 to 1.5),
per-step heatmaps, S by op type and by stage, and a link to the Perfetto timeline.

Built from the tables alone (one job window = one (date, job_id)); pages share one
JavaScript bundle in `assets/` next to them, so hundreds of pages stay small and offline.
"""
from __future__ import annotations

import datetime as dt
import json
import pathlib
import urllib.parse

from dashboards import charts
from dashboards.data import ReportData
from dashboards.html import BUNDLE_PATH, Chart, HtmlTable, Numbers, Text, fmt, render_page

__all__ = ["build_job_page", "job_page_path", "JOBS_DIR"]

JOBS_DIR = "jobs"


def job_page_path(date: dt.date, job_id: str) -> str:
    """Page path relative to the report folder: jobs/<date>_<job id>.html, the id percent-encoded
    (so no two ids share a page: 'a/b' -> 'a%2Fb', 'a_b' stays)."""
    return f"{JOBS_DIR}/{date.isoformat()}_{urllib.parse.quote(job_id, safe='')}.html"


def _source_format(summary) -> str:
    """Where the op rows came from: the lake's parquet, or a profiler's output converted."""
    names = {"lake": "lake parquet", "kineto": "torch.profiler", "ndtimeline": "NDTimeline"}
    value = getattr(summary, "source_format", None)
    return names.get(value, str(value)) if isinstance(value, str) else "lake parquet"


def _source_detail(summary) -> str:
    detail = getattr(summary, "source", None)
    return detail if isinstance(detail, str) and detail else "trace rows written in the lake's format"


def build_job_page(data: ReportData, date: dt.date, job_id: str, out_dir: pathlib.Path, timeline_href: str | None = None) -> pathlib.Path:
    """Write the page of one job window under out_dir (see job_page_path); returns its path.

    timeline_href: link (relative to the page) of the job's Chrome-trace JSON for Perfetto, if any.
    Raises KeyError naming the job when the tables hold no summary for it.
    """
    summary = data.job("job_summary", date, job_id)
    if summary.empty:
        raise KeyError(f"job {job_id!r} on {date}: no job_summary row under {data.out}")
    s = summary.iloc[0]
    verdict = data.job("job_cause", date, job_id)
    v = verdict.iloc[0] if not verdict.empty else None
    steps = data.job("step_slowdown", date, job_id)
    workers = data.job("worker_attribution", date, job_id)
    stages = data.job("stage_attribution", date, job_id)
    dp_ranks = data.job("dp_attribution", date, job_id)
    optypes = data.job("optype_attribution", date, job_id)

    cause = v["cause"] if v is not None else "n/a"
    numbers = Numbers([
        ("slowdown S", fmt(s.slowdown), "S >= 1.1: straggling" if s.straggling else "below the 1.1 straggling threshold"),
        ("waste", f"{100 * s.waste:.1f}%", f"{s.wasted_gpu_hours:,.0f} of {s.gpu_hours:,.0f} GPU-hours"),
        ("verdict", cause, f"confidence {v['confidence']:.2f}" if v is not None else "no verdict (discarded window)"),
        ("M_W / M_S", f"{fmt(s.m_w, 2)} / {fmt(s.m_s, 2)}", "> 0.5: a few workers / the last stage explain S"),
        ("saved by the fix", f"{v['savings_gpu_hours']:,.0f} GPU-h" if v is not None and v["savings_gpu_hours"] == v["savings_gpu_hours"] and v["savings_gpu_hours"] is not None else "n/a",
         f"S after the fix {fmt(v['fixed_slowdown'])}" if v is not None else ""),
        ("replay discrepancy", f"{100 * (s.launch_slowdown - 1):.1f}%", "discarded: above 5%" if s.discarded else "within 5%: kept"),
        ("parallelism", s.parallelism, f"{s.gpus} GPUs, {s.n_steps} sampled steps"),
        ("source", _source_format(s), _source_detail(s)),
    ])
    blocks: list = [numbers]
    if v is not None:
        evidence = json.loads(v["evidence_json"])
        blocks.append(HtmlTable("Evidence", ["metric", "value"], [[k, fmt(x, 4) if isinstance(x, float) else json.dumps(x)] for k, x in evidence.items()],
                                "The metric values behind the verdict (see transforms/whatif/causes.py)."))
    if timeline_href:
        blocks.append(Text("Timeline (original and simulated ideal side by side, Chrome-trace JSON): open it in Perfetto (ui.perfetto.dev, Open trace file).",
                           ("download the timeline", timeline_href)))
    else:
        blocks.append(Text("No timeline export for this job: `strag report --lake URL` writes one per job page (Chrome-trace JSON for Perfetto)."))
    blocks += [
        [Chart("steps", "Per-step slowdown", charts.step_slowdown_chart(steps, float(s.slowdown), "S_s per sampled step (dashed: S)")),
         Chart("workers", "Worker heatmap", charts.worker_heatmap(workers, "S_w = min(S_dp, S_stage)"))],
        [Chart("stage_steps", "Per-step heatmap by stage", charts.step_heatmap(stages, "stage", "S_stage per step")),
         Chart("dp_steps", "Per-step heatmap by DP rank", charts.step_heatmap(dp_ranks, "dp_rank", "S_dp per step"))],
        [Chart("optypes", "Slowdown by op type", charts.attribution_bars(optypes, "optype", "S_t - 1 per op type")),
         Chart("stages", "Slowdown by stage", charts.attribution_bars(stages, "stage", "S_stage - 1 per stage"))],
    ]
    page = render_page(
        f"Job {job_id}", f"{date.isoformat()} · what-if analysis of {s.n_steps} sampled steps · tables {data.out}",
        blocks, inline_js=False, bundle_href=f"../{BUNDLE_PATH}",
    )
    path = pathlib.Path(out_dir) / job_page_path(date, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
