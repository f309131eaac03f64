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
import json

import altair as alt
import pandas as pd
import pyarrow as pa

from dashboards import charts
from dashboards.html import Chart, HtmlTable, Numbers, Text, fmt, job_title, render_page
from transforms.live.tables import current_results

__all__ = ["live_job_page", "live_index_page", "live_unknown_job_page", "live_version", "REFRESH_SECONDS"]

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
    """S of each session's current result in landing order (session 1, 2, ...: sessions land
    seconds or hours apart, so a time axis shows sub-second ticks or crowds), with the alert threshold."""
    rows = sessions.dropna(subset=["slowdown"])
    if rows.empty:
        return alt.Chart(pd.DataFrame({"text": ["no analysed session yet"]})).mark_text().encode(text="text:N").properties(
            title="S per session", width=400, height=60)
    rows = rows.sort_values(["first_arrival", "session"]).reset_index(drop=True)
    rows = rows.assign(order=range(1, len(rows) + 1),
                       landed=[pd.Timestamp(t).strftime("%Y-%m-%d %H:%M:%S") for t in rows["first_arrival"]])
    base = alt.Chart(rows).encode(
        x=alt.X("order:Q", title="session, in landing order",
                axis=alt.Axis(format="d", tickMinStep=1, labelOverlap="greedy"),
                scale=alt.Scale(domain=[0.5, len(rows) + 0.5], nice=False)),
        y=alt.Y("slowdown:Q", title="slowdown S", scale=alt.Scale(zero=False, padding=8)),
    )
    line = base.mark_line(color="#4c78a8")
    points = base.mark_point(filled=True, size=60).encode(
        color=alt.Color("status:N", title="session", scale=alt.Scale(domain=["analysed", "discarded"],
                                                                      range=["#4c78a8", "#f58518"])),
        shape=alt.Shape("status:N", scale=alt.Scale(domain=["analysed", "discarded"], range=["circle", "triangle"])),
        tooltip=["session", alt.Tooltip("landed:N", title="first file landed (UTC)"), "revision", "reason", "status",
                 alt.Tooltip("slowdown:Q", format=".3f"), "verdict"],
    )
    rule = alt.Chart(pd.DataFrame({"slowdown": [threshold]})).mark_rule(strokeDash=[4, 3], color="#e45756").encode(y="slowdown:Q")
    return alt.layer(line, points, rule).properties(
        title=alt.TitleParams("S per session (dashed: the threshold for job-wide causes)",
                              subtitle=["discarded: the replay is off by more than 5%, S is not trustworthy"]),
        width=560, height=200)


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
        return render_page(f"Live: {job_title(job_id, 'job')}", "strag watch", body, inline_js=False, bundle_href=bundle_href).replace(
            "</body>", _refresh_script(version_href, version, refresh_seconds) + "\n</body>")
    latest = current.sort_values(["first_arrival", "session"]).iloc[-1].to_dict()
    missing = _listed(latest["missing_workers"])
    alert_list = sorted(alerts.to_pylist(), key=lambda a: a["alert_time"], reverse=True)
    open_now = _open_alerts(alert_list)
    # open alerts this session's own verdict does not give: fired by earlier sessions, or by the job's
    # windows decided together (a pooled page); the page says so beside the window's verdict (an
    # alert of this session's superseded revision is the watcher's to resolve, not another finding)
    elsewhere = [a for a in open_now if a["cause"] != latest["verdict"]
                 and (a["session"] != latest["session"] or a["revision"] == latest["revision"])]
    numbers = Numbers([
        ("slowdown S", fmt(latest["slowdown"]) + (" (discarded)" if latest["status"] == "discarded" else ""),
         f"session {latest['session']} r{latest['revision']} ({latest['reason']})"
         + ("; the replay is off by more than 5%: S is not trustworthy" if latest["status"] == "discarded" else "")),
        ("waste", "n/a" if latest["waste"] is None or latest["waste"] != latest["waste"] else f"{100 * latest['waste']:.1f}%",
         "1 - 1/S"),
        ("verdict", _text(latest["verdict"]), f"confidence {fmt(latest['verdict_confidence'], 2)}"
         + ("; this session alone (the open alert is from earlier sessions or the job's windows together)" if elsewhere else "")),
        ("status", latest["status"], _text(latest["error"], f"{latest['dp_ranks_analysed']} DP rank(s) analysed")
         if latest["status"] != "failed" else f"failed: {_text(latest['error'], 'no reason recorded')}"),
        ("workers", f"{latest['workers_present']} / {latest['workers_expected']}",
         f"missing {[(w['dp_rank'], w['stage']) for w in missing][:6]}" if len(missing) else "all arrived"),
        ("alerts open", str(len(open_now)), "; ".join(f"{a['cause']} rank(s) {', '.join(map(str, a['ranks'] or [])) or '-'}"
                                                   for a in open_now) or f"fired {sum(a['kind'] == 'firing' for a in alert_list)}"),
    ])
    table_rows = [[r["session"], r["revision"], r["reason"], r["status"], fmt(r["slowdown"]), _text(r["verdict"]),
                   f"{r['workers_present']}/{r['workers_expected']}", r["duplicate_deliveries"],
                   pd.Timestamp(r["analysed"]).strftime("%Y-%m-%d %H:%M:%S")]
                  for r in current.sort_values(["first_arrival", "session"], ascending=False).to_dict("records")]
    alert_rows = [[pd.Timestamp(a["alert_time"]).strftime("%Y-%m-%d %H:%M:%S"), a["kind"], _text(a["cause"]),
                   ", ".join(map(str, a["ranks"] or [])) or "-", a["message"]] for a in alert_list]
    explanation = latest.get("verdict_explanation")
    blocks = [
        numbers,
        Text(f"Why: {explanation}" if isinstance(explanation, str) and explanation else "Why: no verdict for this session yet."),
        *[Text(f"Open alert, not this session's verdict (fired by session {a['session']}): {a['message']}") for a in elsewhere],
        [Chart("sessions", "S per session", _session_chart(current, threshold)),
         Chart("steps", "Per-step slowdown, latest session",
               charts.step_slowdown_chart(_steps_frame(latest), float(latest["slowdown"] or 1.0), "S_s per sampled step (dashed: S)"))],
        [Chart("workers", "Worker heatmap, latest session", charts.worker_heatmap(_heatmap_frame(latest), "S_w = min(S_dp, S_stage)"))],
        HtmlTable("Sessions (current revision of each)", ["session", "revision", "reason", "status", "S", "verdict",
                                                          "workers", "duplicates", "analysed (UTC)"], table_rows,
                  "A late file re-analyses its session; the higher revision supersedes the earlier one."),
        HtmlTable("Alerts", ["time (UTC)", "kind", "cause", "ranks", "message"], alert_rows or [["", "", "", "", "none yet"]],
                  "One alert per (cause, blamed ranks): it fires once, and resolves when a later session is healthy (and "
                  "no longer measures the blamed worker slow) or the job stops landing sessions."),
    ]
    page = render_page(f"Live: {job_title(job_id, 'job')}", f"strag watch · {len(current)} session(s) · refreshes when the live table changes",
                       blocks, inline_js=False, bundle_href=bundle_href)
    return page.replace("</body>", _refresh_script(version_href, version, refresh_seconds) + "\n</body>")


def _open_alerts(alerts: list[dict]) -> list[dict]:
    """The firing rows of the alerts not resolved (alert rows: one per firing or resolved event)."""
    resolved = {(a["fingerprint"], a["session"], a["revision"]) for a in alerts if a["kind"] == "resolved"}
    return [a for a in alerts if a["kind"] == "firing" and (a["fingerprint"], a["session"], a["revision"]) not in resolved]


def live_index_page(results: pa.Table, alerts: pa.Table, job_href) -> str:
    """The jobs in the live table with their latest S, verdict and alert count (no charts); reloads every 5 s."""
    current = current_results(results).to_pandas()
    rows = []
    for job_id, group in current.groupby("job_id", sort=True):
        latest = group.sort_values(["first_arrival", "session"]).iloc[-1]
        count = len(_open_alerts([a for a in alerts.to_pylist() if a["job_id"] == job_id]))
        rows.append([(job_id, job_href(job_id)), str(latest["session"]), len(group), fmt(latest["slowdown"]),
                     _text(latest["verdict"]), latest["status"], count,
                     pd.Timestamp(latest["analysed"]).strftime("%Y-%m-%d %H:%M:%S")])
    table = HtmlTable("Jobs", ["job", "latest session", "sessions", "S", "verdict", "status", "alerts open", "analysed (UTC)"],
                      rows or [["no session analysed yet", "", "", "", "", "", "", ""]],
                      "S and verdict of each job's latest session (its current revision). Click a job for its live page.")
    subtitle = f"strag watch · {len(rows)} job(s) · reloads every 5 s"
    return render_page("strag live monitor", subtitle, [table], inline_js=False, refresh_seconds=5)


def live_unknown_job_page(job_id: str, known: list[str], job_href) -> str:
    """The page of a job the live tables do not hold (answered with 404); reloads every 5 s, so it
    turns into the job's page once its first session is analysed."""
    links = [Text(f"{len(known)} job(s) in the live table:")] + [Text("", (j, job_href(j))) for j in known[:50]]
    blocks = [Text(f"No job {job_id!r} in the live tables: no session of it has been analysed, or the name is misspelt "
                   "(job ids are case-sensitive). This page reloads every 5 s and shows the job once its first session "
                   "lands."), Text("", ("all jobs", "/")), *(links if known else [Text("No job in the live table yet.")])]
    return render_page(f"Not found: job {job_id}", "strag watch · 404", blocks, inline_js=False, refresh_seconds=5)
