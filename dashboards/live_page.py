"""Live monitor pages from the streaming tables (live_results, alerts): what `strag serve` shows.

The per-job page follows the SMon-style job page of dashboards/job_page.py and reuses its
charts (dashboards/charts.py) and page renderer (dashboards/html.py), fed from the live
table instead of the batch tables: the job's current result per profiling session (the
highest revision), S over the sessions, the latest session's per-step slowdown and worker
heatmap, the sessions table (revisions, missing workers, duplicates) and the job's alerts.

A small script polls `version_href` every `refresh_seconds` and reloads the page when the
live table changed (a new session, a corrected revision, an alert).
"""
from __future__ import annotations

import datetime as dt
import html
import json

import altair as alt
import pandas as pd
import pyarrow as pa

from dashboards import charts
from dashboards.html import Chart, HtmlTable, Numbers, Text, fmt, render_page
from transforms.live_tables import current_results

__all__ = ["live_job_page", "live_index_page", "live_version", "REFRESH_SECONDS"]

REFRESH_SECONDS = 2.0


def live_version(results: pa.Table, alerts: pa.Table) -> str:
    """A token that changes whenever rows are added to either live table."""
    latest = max(results["analysed"].to_pylist() or [None], key=lambda t: t or dt.datetime.min.replace(tzinfo=dt.timezone.utc))
    return f"{results.num_rows}-{alerts.num_rows}-{latest.isoformat() if latest else ''}"


def _refresh_script(version_href: str, version: str, seconds: float) -> str:
    return f"""<script>
(function() {{
  const seen = {json.dumps(version)};
  async function poll() {{
    try {{
      const reply = await fetch({json.dumps(version_href)}, {{cache: 'no-store'}});
      const body = await reply.json();
      if (body.version !== seen) {{ location.reload(); return; }}
    }} catch (error) {{ /* server restarting: try again at the next tick */ }}
    setTimeout(poll, {int(seconds * 1000)});
  }}
  window.stragLive = poll();
}})();
</script>"""


def _session_chart(sessions: pd.DataFrame, threshold: float) -> alt.Chart:
    """S of each session's current result, in arrival order, with the alert threshold."""
    rows = sessions.dropna(subset=["slowdown"])
    if rows.empty:
        return alt.Chart(pd.DataFrame({"text": ["no analysed session yet"]})).mark_text().encode(text="text:N").properties(
            title="S per session", width=400, height=60)
    line = alt.Chart(rows).mark_line(point=True).encode(
        x=alt.X("first_arrival:T", title="session (first file landed)"),
        y=alt.Y("slowdown:Q", title="slowdown S", scale=alt.Scale(zero=False)),
        tooltip=["session", "revision", "reason", alt.Tooltip("slowdown:Q", format=".3f"), "verdict"],
    )
    rule = alt.Chart(pd.DataFrame({"slowdown": [threshold]})).mark_rule(strokeDash=[4, 3], color="#e45756").encode(y="slowdown:Q")
    return alt.layer(line, rule).properties(title="S per session (dashed: alert threshold)", width=560, height=200)


def _text(value, default: str = "n/a") -> str:
    """A string cell as text: null (None or pandas' NaN) -> default."""
    return default if value is None or (isinstance(value, float) and value != value) else str(value)


def _listed(value) -> list:
    """A list cell as a Python list ([] for null): pandas gives numpy arrays or None."""
    return [] if value is None else list(value)


def _heatmap_frame(row: dict) -> pd.DataFrame:
    dp_size, pp_size, values = row.get("dp_size"), row.get("pp_size"), _listed(row.get("worker_slowdown"))
    if not dp_size or not pp_size or not values:
        return pd.DataFrame(columns=["dp_rank", "stage", "host", "slowdown_worker", "slowdown_dp", "slowdown_stage"])
    return pd.DataFrame({
        "dp_rank": [dp for dp in range(dp_size) for _ in range(pp_size)],
        "stage": [stage for _ in range(dp_size) for stage in range(pp_size)],
        "host": [None] * (dp_size * pp_size),
        "slowdown_worker": [float("nan") if v is None else v for v in values],
        "slowdown_dp": float("nan"),
        "slowdown_stage": float("nan"),
    })


def _steps_frame(row: dict) -> pd.DataFrame:
    return pd.DataFrame({"step": _listed(row.get("steps")), "slowdown": _listed(row.get("step_slowdown")),
                         "step_time": float("nan"), "step_time_ideal": float("nan")})


def live_job_page(job_id: str, results: pa.Table, alerts: pa.Table, *, threshold: float, version_href: str,
                  bundle_href: str, refresh_seconds: float = REFRESH_SECONDS) -> str:
    """HTML of one job's live page. results / alerts: every live row of this job (all revisions)."""
    current = current_results(results).to_pandas()
    version = live_version(results, alerts)
    if current.empty:
        body = [Text(f"No result for job {job_id} yet: waiting for its first profiling session to land.")]
        return render_page(f"Live: job {job_id}", "strag watch", body, inline_js=False, bundle_href=bundle_href).replace(
            "</body>", _refresh_script(version_href, version, refresh_seconds) + "\n</body>")
    latest = current.sort_values(["first_arrival", "session"]).iloc[-1].to_dict()
    missing = _listed(latest["missing_workers"])
    numbers = Numbers([
        ("slowdown S", fmt(latest["slowdown"]), f"session {latest['session']} r{latest['revision']} ({latest['reason']})"),
        ("waste", "n/a" if latest["waste"] is None or latest["waste"] != latest["waste"] else f"{100 * latest['waste']:.1f}%",
         "1 - 1/S"),
        ("verdict", _text(latest["verdict"]), f"confidence {fmt(latest['verdict_confidence'], 2)}"),
        ("status", latest["status"], _text(latest["error"], f"{latest['dp_ranks_analysed']} DP rank(s) analysed")),
        ("workers", f"{latest['workers_present']} / {latest['workers_expected']}",
         f"missing {[(w['dp_rank'], w['stage']) for w in missing][:6]}" if len(missing) else "all arrived"),
        ("alerts", str(alerts.num_rows), f"threshold {threshold:g}"),
    ])
    table_rows = [[r["session"], r["revision"], r["reason"], r["status"], fmt(r["slowdown"]), _text(r["verdict"]),
                   f"{r['workers_present']}/{r['workers_expected']}", r["duplicate_deliveries"],
                   pd.Timestamp(r["analysed"]).strftime("%Y-%m-%d %H:%M:%S")]
                  for r in current.sort_values(["first_arrival", "session"], ascending=False).to_dict("records")]
    alert_rows = [[pd.Timestamp(a["alert_time"]).strftime("%Y-%m-%d %H:%M:%S"), a["kind"], a["message"]]
                  for a in sorted(alerts.to_pylist(), key=lambda a: a["alert_time"], reverse=True)]
    explanation = latest.get("verdict_explanation")
    blocks = [
        numbers,
        Text(f"Why: {explanation}" if isinstance(explanation, str) and explanation else "Why: no verdict for this session yet."),
        [Chart("sessions", "S per session", _session_chart(current, threshold)),
         Chart("steps", "Per-step slowdown, latest session",
               charts.step_slowdown_chart(_steps_frame(latest), float(latest["slowdown"] or 1.0), "S_s per sampled step (dashed: S)"))],
        [Chart("workers", "Worker heatmap, latest session", charts.worker_heatmap(_heatmap_frame(latest), "S_w = min(S_dp, S_stage)"))],
        HtmlTable("Sessions (current revision of each)", ["session", "revision", "reason", "status", "S", "verdict",
                                                          "workers", "duplicates", "analysed (UTC)"], table_rows,
                  "A late file re-analyses its session; the higher revision supersedes the earlier one."),
        HtmlTable("Alerts", ["time (UTC)", "kind", "message"], alert_rows or [["", "", "none yet"]]),
    ]
    page = render_page(f"Live: job {job_id}", f"strag watch · {len(current)} session(s) · refreshes when the live table changes",
                       blocks, inline_js=False, bundle_href=bundle_href)
    return page.replace("</body>", _refresh_script(version_href, version, refresh_seconds) + "\n</body>")


def live_index_page(results: pa.Table, alerts: pa.Table, job_href) -> str:
    """Plain HTML list of the jobs in the live table with their latest S (no charts)."""
    current = current_results(results).to_pandas()
    rows = []
    for job_id, group in current.groupby("job_id", sort=True):
        latest = group.sort_values(["first_arrival", "session"]).iloc[-1]
        count = sum(1 for a in alerts["job_id"].to_pylist() if a == job_id)
        rows.append(f"<tr><td><a href=\"{html.escape(job_href(job_id))}\">{html.escape(job_id)}</a></td>"
                    f"<td>{html.escape(str(latest['session']))}</td><td>{fmt(latest['slowdown'])}</td>"
                    f"<td>{html.escape(_text(latest['verdict']))}</td><td>{count}</td></tr>")
    body = "\n".join(rows) or "<tr><td colspan=5>no session analysed yet</td></tr>"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,"><meta http-equiv="refresh" content="5"><title>strag live</title></head>
<body><h1>strag live monitor</h1>
<table class="data"><tr><th>job</th><th>latest session</th><th>S</th><th>verdict</th><th>alerts</th></tr>
{body}
</table></body></html>
"""
