"""The per-job monitor page, in the style of the paper's SMon: S and verdict, per-step
slowdown, the worker heatmap (x = DP rank, y = PP rank, colour = S_w from 1.0 to 1.5),
per-step heatmaps, S by op type and by stage, and a link to the Perfetto timeline.

Built from the tables alone (one job window = one (date, job_id)); pages share one
JavaScript bundle in `assets/` next to them, so hundreds of pages stay small and offline.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import pathlib
import urllib.parse

from dashboards import charts
from dashboards.data import ReportData
from dashboards.html import BUNDLE_PATH, Chart, HtmlTable, Numbers, Text, confidence_text, fmt, job_title, render_page
from schemas.causes import CAUSE_TITLES, evidence_label
from schemas.tables import KEPT_BY_MODEL
from schemas.trace import OPTYPES, optype_words
from transforms.whatif.causes.explain import what_would_decide, when_slow

__all__ = ["build_job_page", "job_page_path", "JOBS_DIR"]

JOBS_DIR = "jobs"
FLEET_HREF = "../index.html"   # the fleet report, written beside jobs/ by `strag report`


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


def _share(value) -> str:
    """A share of the straggling time: "42%", "all (142%)" above 100%, "none (-12%)" below 0."""
    from transforms.whatif.causes.explain import share_words

    return "n/a" if value is None or value != value else share_words(value)


def _discrepancy_number(s) -> tuple[str, str, str]:
    """What ran against the model's replay; with the untraced CPU time of named workers modelled,
    which ones, or with CPU ranks' carried arrivals, that, and METHOD.md's no-delay figure beside
    it (rows written before the column: that)."""
    replayed = getattr(s, "replay_discrepancy", None)
    replayed = s.launch_slowdown if replayed is None or replayed != replayed else replayed
    note = "discarded: replay off by more than 5%" if s.discarded else "within 5%: kept"
    workers = _untraced_workers(s)
    if workers:
        named = ", ".join(f"dp {w['dp_rank']} / stage {w['stage']}" for w in workers)
        note += (f"; the replay includes the untraced CPU time of {named} "
                 f"(without it: {100 * (s.launch_slowdown - 1):.1f}%)")
    elif getattr(s, "kept_by", None) == "arrivals-model":
        note += ("; each rank starts a step as late as it finished the previous one (ranks end a step apart; "
                 f"METHOD.md's replay starts them together: {100 * (s.launch_slowdown - 1):.1f}%, S unchanged)")
    return ("replay discrepancy", f"{100 * (replayed - 1):.1f}%", note)


def _method_note(s) -> str:
    """METHOD.md's own S beside the model's, where they differ (the model gave named workers' untraced
    CPU time back, so METHOD's no-delay replay would discard this window); '' where they agree or the
    row predates the columns."""
    method = getattr(s, "slowdown_method", None)
    if method is None or method != method or abs(float(method) - float(s.slowdown)) < 5e-4:
        return ""
    kept = getattr(s, "kept_by", None)
    why = "; METHOD.md would discard this window: the model keeps it" if kept in KEPT_BY_MODEL else ""
    return f"; METHOD.md's S (no untraced time modelled) {fmt(method)}{why}"


def _evidence_number(s) -> tuple[str, str, str]:
    """What the result stands on: steps, microbatches, DP peers, and what the trace cannot show
    (rows written before the columns: the steps alone)."""
    microbatches, peers = getattr(s, "n_microbatches", None), getattr(s, "dp_peers", None)
    if microbatches is None or microbatches != microbatches or peers is None or peers != peers:
        return ("evidence", f"{s.n_steps} steps", "microbatches and peers not recorded (older row)")
    limits = getattr(s, "evidence_limits", None)
    limits = [] if limits is None else list(limits)
    value = f"{s.n_steps} x {int(microbatches)} x {int(peers)}"
    note = "steps x microbatches per worker x DP peers per worker" + ("; cannot show: " + "; ".join(limits)
                                                                      if limits else "")
    return ("evidence", value, note)


def _on_cpu(s) -> bool:
    """Whether the window's ranks ran on CPUs (the source recorded it): its `gpus` are then CPU
    ranks and its GPU-hours their rank-hours, and the page says so."""
    return getattr(s, "device", None) == "cpu"


def _hours(value: float, unit: str) -> str:
    """Hours with a unit; small figures (a profiled window of a few seconds) keep two significant
    digits instead of rounding to "0"."""
    if value is None or value != value:
        return "n/a"
    return (f"{value:,.0f} {unit}" if abs(value) >= 10 or value == 0 else f"{value:.2g} {unit}").rstrip()


def _unit(s) -> str:
    return "CPU rank-hours" if _on_cpu(s) else "GPU-hours"


def _untraced_workers(s) -> list:
    """The workers whose untraced CPU time the window's T includes ([] when none, or in rows written
    before the column existed)."""
    workers = getattr(s, "untraced_workers", None)
    return [] if workers is None else list(workers)


def _confidence_words(cause: str, verdict: dict | None) -> str:
    """The verdict tile's note: the cause's confidence; for insufficient evidence, that of the
    strongest finding the job could not decide (never read as a certainty about a cause)."""
    if verdict is None:
        return "no verdict (discarded window)"
    if cause == "insufficient-evidence" and float(verdict["confidence"]) < 0.0005:   # 0.000: p about 1, said in words
        return "no undecided finding is near significance: the job's jitter covers them all"
    if cause == "insufficient-evidence":
        return f"strongest undecided finding at confidence {confidence_text(cause, verdict['confidence'])}"
    return f"{cause}, confidence {confidence_text(cause, verdict['confidence'])}"


def _saved_number(fixes: dict, cause: str, unit: str) -> tuple[str, str, str]:
    """Headline: GPU-hours (CPU rank-hours) the primary cause's fix saves, naming the fix (all fixes when
    several causes)."""
    fix = fixes.get("all") or fixes.get(cause)
    if cause in ("none", "unexplained", "n/a") or fix is None or fix.get("savings_gpu_hours") is None:
        return ("saved by the fix", "n/a", "no listed cause to fix")
    label = "saved by fixing every cause" if "all" in fixes else f"saved by fixing the {CAUSE_TITLES.get(cause, cause)}"
    if fix.get("measured"):   # taken out of the steps as they ran: S itself is not replayed
        return (label, _hours(fix["savings_gpu_hours"], unit),
                f"{fix.get('fix', 'its fix')}: measured on the steps as they ran, {100 * fix['savings_fraction']:.0f}% of the step")
    return (label, _hours(fix["savings_gpu_hours"], unit),
            f"{fix.get('fix', 'its fix')}: S after {fmt(fix['fixed_slowdown'])}, {_share(fix.get('explained'))} of the straggling time")


def _evidence_value(value, grads_collective: str | None = None) -> str:
    if isinstance(value, float):
        return fmt(value, 3)
    if isinstance(value, list) and not value:
        return "none"
    if isinstance(value, list) and all(_is_worker(w) for w in value):     # (dp rank, stage) pairs: M_W's set
        return "; ".join(f"dp {w[0]} / stage {w[1]}" for w in value)
    if isinstance(value, str):     # a name: an op type read as people know it (DDP's all-reduce by its name)
        return optype_words(value, grads_collective) if value in OPTYPES else value
    if isinstance(value, list) and isinstance(value[0], dict) and "cause" in value[0]:   # causes below the savings floor
        return "; ".join(f"{CAUSE_TITLES.get(c['cause'], c['cause'])}: its fix saves {100 * c['saves']:.1f}% of the step"
                         for c in value)
    if isinstance(value, list) and isinstance(value[0], dict):     # per worker: peer workers, untraced workers
        return "; ".join(_worker_evidence(w) for w in value)
    if isinstance(value, dict) and "sigma" in value and "tests" in value:     # the worker test
        return _worker_test_words(value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {fmt(x, 3)}" for k, x in value.items())
    return json.dumps(value)


def _is_worker(value) -> bool:
    """A (dp rank, stage) pair, as the evidence lists workers (JSON: [1, 0])."""
    return isinstance(value, list) and len(value) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def _worker_test_words(test: dict) -> str:
    """The worker test in words: the null it used, then what it decided and what it could not."""
    if not test.get("tests"):
        return "not run: " + "; ".join(test.get("limits") or ["no peers"])
    head = (f"{test['tests']} tests at a {100 * test['alpha']:g}% false-alarm rate per job; jitter "
            f"{100 * (math.exp(test['sigma']) - 1):.0f}% per {test['unit']} ({test['df']} df), healthy peers' offset "
            f"{100 * (math.exp(test.get('tau') or 0.0) - 1):.0f}%")
    slow = [f"dp {w['dp_rank']} / stage {w['stage']} {w['kind']} {w['ratio']:.2f}x "
            + ("persistent" if w["persistent"] else f"in steps {', '.join(map(str, w['steps']))}")
            + f" (confidence {w['confidence']:.2f})" for w in test.get("slow", [])]
    undecided = [f"dp {w['dp_rank']} / stage {w['stage']} {w['kind']} {w['ratio']:.2f}x ({what_would_decide(w, test['unit'])})"
                 for w in test.get("undecided", [])]
    return "; ".join([head, *(["slow: " + ", ".join(slow)] if slow else []),
                      *(["undecided: " + ", ".join(undecided)] if undecided else [])])


def _worker_evidence(w: dict) -> str:
    """One worker's entry of a per-worker evidence list, in words."""
    head = f"dp {w.get('dp_rank')} / stage {w.get('stage')}"
    if "ratio" in w:    # measured against its DP peers
        if not w.get("persistent", True) and "forward" in w and "backward" in w:
            # intermittent: the slower kind in the steps it is slow in, as the sentence says it
            kind = "forward" if w["forward"] >= w["backward"] else "backward"
            return f"{head}: {kind} {w[kind]:.2f}x {when_slow(w)}"
        return f"{head}: {w['ratio']:.2f}x {when_slow(w)}"
    if "hidden_slowdown" in w:    # untraced CPU time
        replayed = w.get("launch_slowdown")
        return (f"{head}: untraced time {100 * (w['hidden_slowdown'] - 1):.0f}% of the step"
                + ("" if replayed is None else f", the replay with it {100 * (replayed - 1):.0f}% longer"))
    return f"{head}: " + ", ".join(f"{k} {fmt(x, 3) if isinstance(x, float) else x}" for k, x in w.items()
                                   if k not in ("dp_rank", "stage"))


def _verdict_blocks(v, fixes: dict, slowdown: float, unit: str, grads_collective: str | None = None) -> list:
    """Why: the sentence of each listed cause, the fixes with what each saves, the evidence with labels."""
    sentences = [f"{i}. {CAUSE_TITLES.get(c, c)}: {fixes[c]['explanation']}" for i, c in enumerate(v["causes"], 1)
                 if fixes.get(c, {}).get("explanation")]
    explanation = v.get("explanation")
    if not sentences:
        sentences = [explanation if isinstance(explanation, str) and explanation
                     else "No explanation recorded for this window (analysed before explanations existed)."]
    blocks: list = [Text(f"Why{' (' + str(len(sentences)) + ' causes)' if len(sentences) > 1 else ''}:"), *map(Text, sentences)]

    def row(title: str, fix: dict) -> list:
        saved = fix.get("savings_gpu_hours")
        if fix.get("measured"):   # measured against what ran: no replayed S, no share of the straggling time
            effect, removed = f"measured: {100 * fix['savings_fraction']:.0f}% of the step as it ran", "n/a (measured)"
        else:
            effect, removed = f"{slowdown:.3f} -> {fix['fixed_slowdown']:.3f}", _share(fix.get("explained"))
        return [title, fmt(fix.get("confidence"), 2) if "confidence" in fix else "", fix.get("fix", "n/a"), effect,
                removed, _share(fix.get("explained_given_others")), _hours(saved, "")]

    rows = [row(CAUSE_TITLES.get(c, c), fixes[c]) for c in v["causes"] if c in fixes]
    if "all" in fixes:
        rows.append(row("all of them", fixes["all"]))
    if rows:
        blocks.append(HtmlTable("Causes and their fixes", ["cause", "confidence", "fix (what-if replay)", "S", "straggling time removed",
                                                           "... of what remains after the other fixes", f"{unit} saved"], rows,
                                "Each fix is replayed on the trace; the straggling time is the step time above the ideal "
                                f"(every op at its type's typical duration). Causes are ordered by the {unit} their fix saves alone."))
        beyond = [fix for fix in [*(fixes[c] for c in v["causes"] if c in fixes), fixes.get("all")]
                  if fix is not None and fix.get("fixed_slowdown") is not None and fix["fixed_slowdown"] < 1.0]
        if beyond:
            blocks.append(Text(_BEYOND_ALL))
    evidence = json.loads(v["evidence_json"])
    labelled = [(*evidence_label(k), _evidence_value(x, grads_collective)) for k, x in evidence.items()]
    blocks.append(HtmlTable("Evidence", ["measure", "value", "what it means"], [[label, value, meaning] for label, meaning, value in labelled],
                            "The measurements behind the verdict. Shares are of the straggling time."))
    return blocks


def _step_verdicts(steps) -> HtmlTable | None:
    """The verdict step by step (step_slowdown's verdict columns): which blamed ranks were slow in
    each sampled step and what the primary fix saves there; None when no step has either (no
    verdict, or nobody blamed and no per-step fix)."""
    if steps.empty or "slow_ranks" not in steps:
        return None
    steps = steps.sort_values("step")
    ranks = [list(r) if r is not None and not (isinstance(r, float) and math.isnan(r)) else [] for r in steps["slow_ranks"]]
    savings = [float(x) if x is not None and math.isfinite(float(x)) else None for x in steps["fix_saving"]]
    if not any(ranks) and all(x is None for x in savings):
        return None
    cause = next((c for c in steps["fix_cause"] if isinstance(c, str)), None)
    rows = [[str(int(step)), f"{slowdown:.3f}", ", ".join(f"rank {r}" for r in rank) or "-",
             "n/a" if saving is None else f"{1e3 * saving:.1f} ms ({100 * saving / observed:.0f}% of the step)" if observed > 0
             else f"{1e3 * saving:.1f} ms"]
            for step, slowdown, rank, saving, observed in zip(steps["step"], steps["slowdown"], ranks, savings, steps["step_time"])]
    fix = CAUSE_TITLES.get(cause, cause) if cause else "the primary cause"
    return HtmlTable("Step by step", ["step", "S_s", "slow in this step", f"{fix}: its fix saves"], rows,
                     "A worker slow in only some steps (an intermittent straggler) is named with those steps; a persistent "
                     "one shows in every step. The saving is the fix's what-if step by step: replayed, or for untraced time measured against the step as it ran.")


# Why a fix can remove more than all of the straggling time (S after it below 1, "all (N%)")
_BEYOND_ALL = ("A fix with S below 1 after it (\"all (N%)\" above 100%) makes the step faster than the ideal replay, "
               "so it removes all of the straggling time and more. The ideal gives every op its type's typical "
               "duration, the mean for compute, and the slow ops themselves raise that mean: with them at their "
               "peers' speed, the step beats it. Its hours saved (1 - T_fix / T of the hours) therefore exceed the "
               "wasted hours (1 - T_ideal / T).")


_GRADS_ALL_REDUCE = ("grads-all-reduce: DDP's gradient all-reduce (op type grads-reduce-scatter in the tables, "
                     "the reference analyzer's name for the DP gradient collective)")


def _optype_words(optypes, grads_collective: str | None):
    """The op type rows with their names as people read them (optype_words)."""
    if optypes.empty:
        return optypes
    return optypes.assign(optype=[optype_words(t, grads_collective) for t in optypes["optype"]])


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
    fixes = json.loads(v["savings_json"]) if v is not None else {}
    unit = _unit(s)
    grads = getattr(s, "grads_collective", None)
    grads = grads if isinstance(grads, str) else None
    numbers = Numbers([
        ("slowdown S", fmt(s.slowdown), ("from a replay off by more than 5%: not trustworthy" if s.discarded else
                                         "S >= 1.1: straggling" if s.straggling else "below the 1.1 straggling threshold")
         + _method_note(s)),
        ("waste", f"{100 * s.waste:.1f}%", f"{_hours(s.wasted_gpu_hours, '')} of {_hours(s.gpu_hours, unit)}") if s.waste >= 0 else
        ("waste", "none", "S < 1: the ideal replay is slower than the replay, within its noise"),
        ("verdict", CAUSE_TITLES.get(cause, cause), _confidence_words(cause, v)),
        ("M_W / M_S", f"{fmt(s.m_w, 2)} / {fmt(s.m_s, 2)}", "share of the straggling time the top 3% workers / the last stage explain")
        if s.straggling else ("M_W / M_S", "n/a", "not straggling: too little straggling time to share out"),
        _saved_number(fixes, cause, unit),
        _discrepancy_number(s),
        ("parallelism", s.parallelism, f"{s.gpus} {'CPU ranks' if _on_cpu(s) else 'GPUs'}, {s.n_steps} sampled steps"),
        _evidence_number(s),
        ("source", _source_format(s), _source_detail(s)),
    ])
    blocks: list = [Text("One job window of the fleet report.", ("back to the fleet report", FLEET_HREF)), numbers]
    if v is not None:
        blocks += _verdict_blocks(v, fixes, float(s.slowdown), unit, grads)
    step_table = _step_verdicts(steps)
    if step_table is not None:
        blocks.append(step_table)
    if timeline_href:
        blocks.append(Text("Timeline (original and simulated ideal side by side, Chrome-trace JSON): open it in Perfetto (ui.perfetto.dev, Open trace file).",
                           ("download the timeline", timeline_href)))
    else:
        blocks.append(Text("No timeline for this job window: `strag batch --timelines` writes one for every straggling window "
                           "(Chrome-trace JSON for Perfetto), and the report links it."))
    # attribution is of the traced ops: where T holds named workers' untraced time, say whose S it is
    empty = charts.NO_ATTRIBUTION if not _untraced_workers(s) else \
        "the traced ops' S < 1.03: no attribution computed (the slowdown is untraced CPU time)"
    blocks += [
        [Chart("steps", "Per-step slowdown", charts.step_slowdown_chart(steps, float(s.slowdown), "S_s per sampled step (dashed: S)")),
         Chart("workers", "Worker heatmap", charts.worker_heatmap(workers, "S_w = min(S_dp, S_stage)", empty))],
        [Chart("stage_steps", "Per-step heatmap by stage", charts.step_heatmap(stages, "stage", "S_stage per step", empty)),
         Chart("dp_steps", "Per-step heatmap by DP rank", charts.step_heatmap(dp_ranks, "dp_rank", "S_dp per step", empty))],
        [Chart("optypes", "Slowdown by op type", charts.attribution_bars(_optype_words(optypes, grads), "optype", "S_t - 1 per op type", empty),
               *([_GRADS_ALL_REDUCE] if grads == "all_reduce" else [])),
         Chart("stages", "Slowdown by stage", charts.attribution_bars(stages, "stage", "S_stage - 1 per stage", empty))],
    ]
    page = render_page(
        job_title(job_id), f"{date.isoformat()} · what-if analysis of {s.n_steps} sampled steps · tables {data.out}",
        blocks, inline_js=False, bundle_href=f"../{BUNDLE_PATH}",
    )
    path = pathlib.Path(out_dir) / job_page_path(date, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
