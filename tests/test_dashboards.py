"""Reports from published tables: offline HTML, chart files, chart specs, `strag report` CLI."""
from __future__ import annotations

import datetime as dt
import html
import json
import re

import pandas as pd
import pytest

from dashboards import charts
from dashboards.data import load_report_data
from dashboards.fleet_report import build_fleet_report, fleet_charts
from dashboards.html import BUNDLE_PATH
from dashboards.job_page import build_job_page, job_page_path
from fleet_tables_fixture import START, commit_fleet, random_outcomes
from pipelines import report

DAYS = 4


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    out = tmp_path_factory.mktemp("tables")
    commit_fleet(random_outcomes(seed=11, days=DAYS, jobs_per_day=10), out, [(START + dt.timedelta(days=d)).isoformat() for d in range(DAYS)])
    return out


@pytest.fixture(scope="module")
def data(tables):
    return load_report_data(str(tables))


def _specs(page: str) -> dict:
    match = re.search(r"const stragSpecs = (\{.*?\});\n", page, re.S)
    assert match, "page has no chart specs"
    return json.loads(match.group(1).replace("<\\/", "</"))


def test_fleet_report_is_self_contained_with_chart_files(data, tmp_path):
    path = build_fleet_report(data, tmp_path, images=("svg", "png"))
    page = path.read_text()
    # no script or stylesheet from anywhere but the page itself
    assert not re.search(r"<script[^>]+src=", page)
    assert not re.search(r"<link[^>]+href=\"(?!data:)", page)   # inline data: URLs only
    assert "window.vegaEmbed=" in page and "window.stragReady" in page
    specs = _specs(page)
    names = [c.name for c in fleet_charts(data)]
    assert sorted(specs) == sorted(f"chart-{n}" for n in names)
    for name in names:
        assert (tmp_path / "charts" / f"{name}.svg").read_text().lstrip().startswith("<svg"), name
        assert (tmp_path / "charts" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f'href="charts/{name}.svg"' in page


def test_fleet_report_numbers_come_from_the_tables(data, tmp_path):
    page = build_fleet_report(data, tmp_path, images=()).read_text()
    summary = data.fleet_period("fleet_summary").iloc[0]
    assert f"{100 * summary.straggling_share:.1f}%" in page
    assert f"{summary.jobs:,}" in page
    # the CDF data in the page is the distribution table
    spec = _specs(page)["chart-slowdown_cdf"]
    points = [row for values in spec["datasets"].values() for row in values if "cumulative_share" in row]
    job_weighted = data.fleet_period("fleet_distribution").query("metric == 'slowdown' and weighting == 'job'")
    assert max(p["cumulative_share"] for p in points) == pytest.approx(1.0)
    job_series = charts.WEIGHTING_LABELS["job"]
    assert len([p for p in points if p["series"] == job_series]) == len(job_weighted) + 1  # + the zero start


def test_report_reads_the_published_rollups_which_merge_every_dates_state(tables, data):
    """The report recomputes nothing: its fleet frames are the fleet_*_rollup tables, and those
    equal the rollups rebuilt here from the published fleet_state of every date."""
    from schemas.tables import read_table
    from transforms.batch.rollups import rollup_fleet

    rebuilt = rollup_fleet(read_table(str(tables), "fleet_state"))
    assert set(data.fleet) == set(rebuilt)
    for name, table in rebuilt.items():
        expected = table.to_pandas()
        keys = [c for c in expected.columns if expected[c].map(lambda v: isinstance(v, (str, int, dt.date))).all()]
        ordered = [frame.sort_values(keys).reset_index(drop=True) for frame in (data.fleet[name], expected)]
        pd.testing.assert_frame_equal(*ordered, check_exact=True, obj=name)


def test_report_without_rollup_tables_says_to_rerun_the_batch(tables, tmp_path):
    import shutil

    from dashboards.data import ReportDataError

    copy = tmp_path / "copy"
    shutil.copytree(tables, copy)
    shutil.rmtree(copy / "fleet_host_rollup")
    with pytest.raises(ReportDataError, match=r"no fleet_host_rollup under .*strag batch"):
        load_report_data(str(copy))


def test_job_page_shows_the_smon_views(data, tmp_path):
    summary = data.jobs["job_summary"]
    row = summary[summary["attributed"] & ~summary["discarded"]].sort_values("slowdown").iloc[-1]
    path = build_job_page(data, row.date, row.job_id, tmp_path, timeline_href="../timelines/x.json.gz")
    assert path == tmp_path / job_page_path(row.date, row.job_id)
    page = path.read_text()
    assert f'src="../{BUNDLE_PATH}"' in page and "../timelines/x.json.gz" in page
    specs = _specs(page)
    assert set(specs) == {f"chart-{n}" for n in ("steps", "workers", "stage_steps", "dp_steps", "optypes", "stages")}
    heatmap = specs["chart-workers"]["layer"][0]["encoding"]
    assert heatmap["x"]["field"] == "dp_rank" and heatmap["y"]["field"] == "stage"
    assert heatmap["color"]["scale"]["domain"] == list(charts.HEATMAP_DOMAIN) == [1.0, 1.5]
    workers = data.job("worker_attribution", row.date, row.job_id)
    cells = next(v for v in specs["chart-workers"]["datasets"].values())
    assert sorted(c["slowdown_worker"] for c in cells) == sorted(workers["slowdown_worker"])
    assert f"{row.slowdown:.3f}" in page


def test_job_page_of_an_unknown_job_names_it(data, tmp_path):
    with pytest.raises(KeyError, match="nope"):
        build_job_page(data, START, "nope", tmp_path)


def test_report_cli_builds_pages_for_straggling_jobs(tables, data, tmp_path, capsys):
    out = tmp_path / "report"
    assert report.run(["--tables", str(tables), "--out", str(out), "--images", "svg"]) == 0
    summary = data.jobs["job_summary"]
    straggling = summary[summary["straggling"] & ~summary["discarded"]]
    pages = sorted(p.name for p in (out / "jobs").glob("*.html"))
    assert pages == sorted(job_page_path(d, j).split("/")[1] for d, j in zip(straggling["date"], straggling["job_id"]))
    assert (out / BUNDLE_PATH).stat().st_size > 100_000
    index = (out / "index.html").read_text()
    linked = set(re.findall(r'href="jobs/([^"]+)"', index))
    assert linked == set(pages)  # every page is reachable from the fleet report
    assert "fleet report:" in capsys.readouterr().out


def test_report_cli_explains_missing_tables(tmp_path, capsys):
    assert report.run(["--tables", str(tmp_path / "empty"), "--out", str(tmp_path / "r")]) == 2
    assert "give --tables the --out of `strag batch`" in capsys.readouterr().err


def test_report_cli_rejects_unknown_job_ids(tables, tmp_path, capsys):
    assert report.run(["--tables", str(tables), "--out", str(tmp_path / "r"), "--jobs", "job-000-00,ghost"]) == 2
    assert "ghost" in capsys.readouterr().err
    assert report.run(["--tables", str(tables), "--out", str(tmp_path / "r"), "--images", "gif"]) == 2


def _chart_rows(chart) -> list[dict]:
    spec = chart.to_dict()
    return [row for values in spec.get("datasets", {}).values() for row in values]


def test_host_chart_shows_only_blamed_hosts_on_a_whole_number_axis():
    host = pd.DataFrame({"host": ["a", "b", "c"], "implicated_jobs": [3, 1, 0], "straggling_workers": [4, 1, 9],
                         "repeat_offender": [True, False, False], "job_windows": [5, 2, 9], "slowdown_max": [1.3, 1.2, 1.1]})
    chart = charts.host_chart(host, "hosts")
    assert sorted(r["host"] for r in _chart_rows(chart)) == ["a", "b"]
    axis = chart.to_dict()["encoding"]["x"]["axis"]
    assert axis["values"] == [0, 1, 2, 3] and axis["format"] == "d"
    never = charts.host_chart(host.assign(implicated_jobs=0), "hosts").to_dict()
    assert "no host was blamed" in json.dumps(never)


def _x_labels(chart) -> list[tuple[float, str]]:
    """(x, text) of the visible labels of the chart's horizontal axis, as Vega renders them (SVG)."""
    import vl_convert

    svg = vl_convert.vegalite_to_svg(chart.to_json())
    labels = []
    for group in re.findall(r'<g class="mark-text role-axis-label"[^>]*>(.*?)</g>', svg, re.S):
        texts = re.findall(r'<text[^>]*transform="translate\(([-\d.]+),([-\d.]+)\)"[^>]*opacity="([\d.]+)"[^>]*>([^<]*)</text>', group)
        visible = [(float(x), float(y), text) for x, y, opacity, text in texts if float(opacity) > 0]
        if len({y for _, y, _ in visible}) == 1 and len(visible) > 1:   # one row of labels: the x axis
            labels = [(x, text) for x, _, text in visible]
    return labels


def test_size_chart_ticks_are_whole_gpu_counts_and_bucket_means_span_their_bucket():
    """CPU jobs of 2 to 4 ranks: the axis said 2, 2.5, 3, 3.5 GPUs and the one bucket's mean was a lone
    dot at 2.8 GPUs (the bucket's geometric middle)."""
    jobs = pd.DataFrame({"job_id": ["a", "b", "c"], "gpus": [2, 3, 2], "slowdown": [1.2, 1.4, 1.05], "straggling": [True, True, False]})
    size = pd.DataFrame({"gpus_lower": [2], "gpus_upper": [4], "jobs": [3], "slowdown_mean": [1.22]})
    chart = charts.size_chart(jobs, size, None, "S vs CPU ranks", "CPU ranks")
    assert [text for _, text in _x_labels(chart)] == ["2", "4"]
    spec = chart.to_dict()
    mean = next(layer for layer in spec["layer"] if layer["mark"]["type"] == "rule")
    assert mean["encoding"]["x"]["field"] == "gpus" and mean["encoding"]["x2"]["field"] == "gpus_upper"
    assert spec["layer"][0]["encoding"]["x"]["title"] == "CPU ranks (log scale)"
    assert {r["gpus"] for r in _chart_rows(chart)} <= {2, 3}   # every x a job's size or a bucket's edge


def test_waste_axis_labels_are_short_and_never_touch():
    """A fleet of short profiled windows wastes thousandths of an hour: the labels carry no padding
    zeros ("0.0010") and keep apart."""
    optype = pd.DataFrame({"optype": [None] * 4, "category": ["compute", "pp-comm", "dp-comm", "other"], "jobs": 3,
                           "slowdown_mean": 1.1, "wasted_gpu_hours": [0.0061, 0.0011, 0.0007, 0.0002],
                           "share_of_attributed_waste": [0.7, 0.15, 0.1, 0.05]})
    chart = charts.optype_waste_chart(optype, "waste", "CPU rank-hours")
    labels = _x_labels(chart)
    assert labels and all(not text.endswith("0") or text == "0" for _, text in labels), labels
    for (x0, a), (x1, b) in zip(labels, labels[1:]):   # ~6 px per character at the axis' 10 px font
        assert x1 - x0 >= 3 * (len(a) + len(b)) + 6, labels
    assert chart.to_dict()["encoding"]["x"]["title"] == "CPU rank-hours wasted (attributed)"


def test_step_axis_ticks_are_the_sampled_steps():
    """Two sampled steps (2 and 3): the axis read 2, 3, 3 (a tick at 2.5 formatted as a whole number)."""
    steps = pd.DataFrame({"step": [2, 3], "slowdown": [1.5, 1.33], "step_time": 1.0, "step_time_ideal": 0.7})
    assert [text for _, text in _x_labels(charts.step_slowdown_chart(steps, 1.41, "steps"))] == ["2", "3"]


def test_step_line_is_broken_where_steps_were_not_sampled():
    steps = pd.DataFrame({"step": [35, 37, 38, 40, 48, 49, 111, 113, 114], "slowdown": 1.1, "step_time": 1.0, "step_time_ideal": 0.9})
    runs = {r["step"]: r["run"] for r in _chart_rows(charts.step_slowdown_chart(steps, 1.1, "steps")) if "step" in r}
    assert runs[49] != runs[111]                 # 62 steps unsampled: no line across
    assert runs[35] == runs[40] and runs[111] == runs[114]


def test_every_heatmap_uses_one_colour_scale(data):
    summary = data.jobs["job_summary"]
    row = summary[summary["attributed"] & ~summary["discarded"]].iloc[0]
    scales = [
        charts.position_chart(data.fleet_period("fleet_position"), "p").to_dict()["encoding"]["color"]["scale"],
        charts.worker_heatmap(data.job("worker_attribution", row.date, row.job_id), "w").to_dict()["layer"][0]["encoding"]["color"]["scale"],
        charts.step_heatmap(data.job("stage_attribution", row.date, row.job_id), "stage", "s").to_dict()["encoding"]["color"]["scale"],
    ]
    assert all(scale == scales[0] for scale in scales) and scales[0]["domain"] == list(charts.HEATMAP_DOMAIN)


def test_category_chart_has_a_row_per_category_with_its_job_count(data):
    distribution = data.fleet_period("fleet_distribution")
    categories = distribution[distribution["metric"].str.startswith("optype_slowdown:")].copy()
    categories["category"] = categories["metric"].str.split(":").str[1]
    rows = {r["category"]: r for r in _chart_rows(charts.category_slowdown_chart(categories, "t"))}
    jobs = categories[categories["weighting"] == "job"].groupby("category")["count"].sum()
    assert set(rows) == set(jobs.index)
    assert all(rows[c]["windows"] == n and rows[c]["label"].startswith(f"{n} windows: median") for c, n in jobs.items())


def _histogram(category: str, values: list[float]) -> pd.DataFrame:
    """fleet_distribution rows (job weighting) of S_t values, bins of 0.001 as the fleet tables bin them."""
    bins = pd.Series([round(v, 3) for v in values]).value_counts().sort_index()
    return pd.DataFrame({"metric": f"optype_slowdown:{category}", "category": category, "weighting": "job",
                         "bin_lower": bins.index, "bin_upper": bins.index + 0.001, "count": bins.to_numpy(),
                         "cumulative_share": bins.cumsum().to_numpy() / bins.sum()})


def test_category_chart_tells_apart_categories_a_linear_axis_draws_as_one_line():
    """Three categories within 1% of S_t = 1 and one up to 2.3: each row's figures are its own, and
    the axis (S_t - 1 on a symmetric log scale) puts 1.000, 1.004 and 1.01 apart as it does 1.1 and 2.3."""
    categories = pd.concat([_histogram("compute", [1.05, 1.2, 1.4, 2.3]), _histogram("pp-comm", [1.0, 1.0, 1.0, 1.01]),
                            _histogram("dp-comm", [1.0] * 4), _histogram("other", [1.0, 1.002, 1.003, 1.004])])
    chart = charts.category_slowdown_chart(categories, "t")
    rows = {r["category"]: r for r in _chart_rows(chart)}
    assert (rows["compute"]["p50"], rows["compute"]["max"]) == pytest.approx((1.2, 2.3))
    assert (rows["pp-comm"]["p50"], rows["pp-comm"]["max"], rows["pp-comm"]["slowed"]) == pytest.approx((1.0, 1.01, 0.25))
    assert (rows["dp-comm"]["p50"], rows["dp-comm"]["max"], rows["dp-comm"]["slowed"]) == pytest.approx((1.0, 1.0, 0.0))
    assert (rows["other"]["p90"], rows["other"]["max"]) == pytest.approx((1.004, 1.004))
    assert "max 1.004" in rows["other"]["label"] and "max 1.000" in rows["dp-comm"]["label"]
    spread = chart.to_dict()["layer"][0]["encoding"]["x"]
    assert spread["scale"]["type"] == "symlog" and spread["scale"]["constant"] == 0.001
    assert spread["scale"]["domain"][1] >= 1.3 and {0.0, 0.001, 0.01, 0.1, 1.0} <= set(spread["axis"]["values"])


@pytest.mark.parametrize("dp, pp, labelled", [(69, 1, False), (8, 4, True), (21, 16, True), (22, 2, False)])
def test_worker_heatmap_labels_cells_only_where_the_values_fit(dp, pp, labelled):
    workers = pd.DataFrame({"dp_rank": [d for d in range(dp) for _ in range(pp)], "stage": [s for _ in range(dp) for s in range(pp)],
                            "host": "h", "slowdown_worker": 1.05, "slowdown_dp": 1.0, "slowdown_stage": 1.0})
    spec = charts.worker_heatmap(workers, "w").to_dict()
    texts = [layer for layer in spec["layer"] if layer["mark"]["type"] == "text"]
    assert bool(texts) == labelled
    cell = spec["width"] / dp
    assert (cell >= 30) == labelled   # a "1.05" at font size 10 is ~24 px wide
    ticks = spec["layer"][0]["encoding"]["x"]["axis"]["values"]
    assert ticks[0] == 0 and ticks[-1] <= dp - 1 and len(ticks) * 22 <= spec["width"] + 22   # labels >= 22 px apart
    assert spec["layer"][0]["encoding"]["x"]["axis"]["labelAngle"] == 0


def test_readme_sql_example_runs_on_the_tables(tables, data):
    """The README's DuckDB query (the `sql` extra), run as written on published tables."""
    import pathlib

    import duckdb

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    query = re.search(r"```sql\n(.*?)```", readme, re.S).group(1)
    rows = duckdb.sql(query.replace("demo-out", str(tables))).df()
    kept = data.jobs["job_summary"].query("not discarded").sort_values("wasted_gpu_hours", ascending=False).head(10)
    assert list(rows["job_id"]) == list(kept["job_id"])
    assert [d.isoformat() for d in pd.to_datetime(rows["date"]).dt.date] == [d.isoformat() for d in kept["date"]]


def test_job_page_explains_the_verdict_in_words(data, tmp_path):
    """A real verdict (slow worker masking a heavy last stage) in place of the fixture's: the page
    says why in sentences, names each fix and what it saves, and labels the evidence."""
    import dataclasses

    from transforms.synth import Cause, JobSpec, generate_job
    from transforms.whatif.causes import analyze_and_classify, verdict_row

    spec = JobSpec(job_id="masked", dp=4, pp=4, microbatches=8, steps=16, sessions=2, seed=3,
                   causes=(Cause("slow_worker", {"dp_rank": 1, "stage": 1, "factor": 1.6}),
                           Cause("last_stage_imbalance", {"forward_extra": 0.6, "backward_extra": 0.25})))
    job = generate_job(spec)
    _, verdict = analyze_and_classify(job.trace, job.meta, "masked")
    summary = data.jobs["job_summary"]
    row = summary[summary["attributed"] & ~summary["discarded"]].iloc[0]
    causes = data.jobs["job_cause"]
    replaced = causes[~((causes["date"] == row.date) & (causes["job_id"] == row.job_id))]
    real = {**verdict_row(dataclasses.replace(verdict, job_id=row.job_id), gpu_hours=100.0), "date": row.date}
    with_real = dataclasses.replace(data, jobs={**data.jobs, "job_cause": pd.concat([replaced, pd.DataFrame([real])])})
    page = build_job_page(with_real, row.date, row.job_id, tmp_path).read_text()
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))
    assert "Why (2 causes):" in text and "1. slow worker: Worker dp 1 / stage 1 runs" in text
    assert "2. stage partitioning imbalance: Model chunk" in text
    assert "saved by fixing every cause" in text and "every listed cause fixed at once" in text
    assert "layers repartitioned so every model chunk does the same compute" in text
    assert "M_W: share explained by the top 3% workers" in text and "forward_backward_r_normalised" not in text
    assert "transforms/whatif/causes" not in text
    # workers in words, never a raw [[1, 1]]; the way back to the fleet report
    assert "top 3% workers dp 1 / stage 1 (dp rank, stage)" in text and "[[" not in text
    assert '<a href="../index.html">back to the fleet report</a>' in page
    # fixing every cause gives S 0.995 < 1 (the slow worker raised its op types' means): said why in words
    plain = html.unescape(text)
    assert re.search(r"\d\.\d{3} -> 0\.995 all \(\d+%\)", plain), plain[plain.index("all of them"):][:300]
    assert "A fix with S below 1 after it" in plain and "the slow ops themselves raise that mean" in plain
    assert "exceed the wasted hours" in plain


def test_job_page_shows_who_was_slow_in_each_step_and_what_the_fix_saves_there(data, tmp_path):
    """An intermittent straggler (slow in steps 2 and 5 of 8) through the batch's own projection
    (result_tables): the page's step table names its rank in those steps only, with the fix's
    per-step saving, and the sentence names the same step numbers."""
    import dataclasses

    from transforms.batch.analyze_jobs import _step_verdict
    from transforms.synth import Cause, JobSpec, generate_job
    from transforms.whatif.causes import analyze_and_classify

    spec = JobSpec(job_id="flaky", dp=4, pp=1, microbatches=2, steps=8, sessions=1, seed=11,
                   causes=(Cause("slow_worker", {"dp_rank": 2, "stage": 0, "factor": 2.0, "steps": [2, 5]}),))
    job = generate_job(spec)
    result, verdict = analyze_and_classify(job.trace, job.meta, "flaky")
    assert verdict.slow_steps() == {(2, 0): (2, 5)}, verdict.explanation
    assert verdict.cause == "individual-worker", (verdict.cause, verdict.explanation)
    summary = data.jobs["job_summary"]
    row = summary[summary["attributed"] & ~summary["discarded"]].iloc[0]
    workers = [{"dp_rank": d, "stage": 0, "rank": 10 + d} for d in range(4)]
    columns = _step_verdict(verdict, {"workers": workers}, len(result.steps), kept=True)
    steps = pd.DataFrame({"job_id": row.job_id, "date": row.date, "step": result.steps, "slowdown": result.step_slowdown,
                          "step_time": result.step_t_nodelay, **columns})
    old = data.jobs["step_slowdown"]
    kept = old[~((old["date"] == row.date) & (old["job_id"] == row.job_id))]
    with_steps = dataclasses.replace(data, jobs={**data.jobs, "step_slowdown": pd.concat([kept, steps])})
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", build_job_page(with_steps, row.date, row.job_id, tmp_path).read_text()))
    table = text[text.index("Step by step"):]
    numbers = [int(result.steps[i]) for i in (2, 5)]
    for i, step in enumerate(result.steps):
        saving = verdict.primary_fix.step_savings[i]
        cell = f" {int(step)} {result.step_slowdown[i]:.3f} {'rank 12' if i in (2, 5) else '-'} {1e3 * saving:.1f} ms"
        assert cell in table, cell
    assert f"in steps {numbers[0]} and {numbers[1]} (2 of 8 sampled steps; intermittent" in verdict.explanation
    # the evidence row gives the ratio in those steps, as the sentence does, not the whole run's
    entry = verdict.evidence["peer_workers"][0]
    slower = max(("forward", "backward"), key=lambda kind: entry[kind])
    assert entry[slower] == pytest.approx(2.0, rel=0.1) and entry["ratio"] < 1.5
    from dashboards.job_page import _evidence_value

    assert _evidence_value([entry]).startswith(f"dp 2 / stage 0: {slower} {entry[slower]:.2f}x in steps {numbers[0]} and {numbers[1]}")


def test_the_evidence_row_of_causes_below_the_savings_floor_reads_as_words():
    """classify's below_min_savings (a cause whose signature holds but whose fix saves less than a
    change must) has a label and reads as the cause and its saving, not as a worker entry."""
    from dashboards.job_page import _evidence_value
    from schemas.causes import evidence_label

    value = [{"cause": "sequence-imbalance", "saves": 0.0251}]
    assert _evidence_value(value) == "sequence-length imbalance: its fix saves 2.5% of the step"
    assert evidence_label("below_min_savings")[0] == "signatures not worth a change"


def test_cells_and_titles_say_nothing_meaningless():
    """Evidence that rounds to zero shows "0.000", not "-0.000"; a job id that already says "job" is
    not titled "Job job-..."."""
    from dashboards.html import fmt, job_title

    assert [fmt(x) for x in (-0.0, -0.0004, -0.0006, 0.25, -1.25)] == ["0.000", "0.000", "-0.001", "0.250", "-1.250"]
    assert fmt(-0.004, 2) == "0.00" and fmt(None) == "n/a" and fmt(3) == "3"
    assert job_title("job-20240304-003") == "job-20240304-003" and job_title("llama-7b") == "Job llama-7b"
    assert job_title("llama-7b", "job") == "job llama-7b"


def test_the_verdict_tile_never_rounds_an_undecided_finding_up_to_a_decision():
    """Insufficient evidence states its strongest undecided finding to three digits (p 0.0125 is
    0.988, short of the 0.99 a verdict needs at 1%); a cause states its own confidence."""
    from dashboards.job_page import _confidence_words

    assert _confidence_words("insufficient-evidence", {"confidence": 1 - 0.0125}) == \
        "strongest undecided finding at confidence 0.988"
    assert _confidence_words("python-gc", {"confidence": 0.99}) == "python-gc, confidence 0.99"
    assert _confidence_words("none", None) == "no verdict (discarded window)"
    # a confidence that shows as 0.000 (p about 1 after Bonferroni) is said in words
    assert _confidence_words("insufficient-evidence", {"confidence": 1e-6}) == \
        "no undecided finding is near significance: the job's jitter covers them all"
    assert _confidence_words("insufficient-evidence", {"confidence": 0.001}) == "strongest undecided finding at confidence 0.001"


def test_a_measured_fix_shows_what_it_saves_of_the_step_not_a_replayed_s():
    """A fix measured against what ran (python-gc from pauses, untraced-cpu) leaves S as is: the
    headline and the causes table say what it saves of the step as it ran, never 'S 1.383 -> 1.383,
    100% of the straggling time'."""
    from dashboards.job_page import _saved_number

    measured = {"python-gc": {"savings_gpu_hours": 0.5, "fixed_slowdown": 1.383, "explained": 1.0,
                              "savings_fraction": 0.302, "fix": "planned GC", "measured": True}}
    label, value, note = _saved_number(measured, "python-gc", "GPU-hours")
    assert note == "planned GC: measured on the steps as they ran, 30% of the step" and "S after" not in note
    replayed = {"individual-worker": {**measured["python-gc"], "fixed_slowdown": 1.05, "explained": 0.8, "measured": False,
                                      "fix": "peer speed"}}
    assert "S after 1.050" in _saved_number(replayed, "individual-worker", "GPU-hours")[2]
