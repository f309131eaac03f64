"""Offline HTML pages of Altair charts, and PNG/SVG files of each chart.

A page is a list of blocks (headline numbers, charts, small HTML tables). The Vega,
Vega-Lite and vega-embed JavaScript comes from vl-convert's bundled copies, so pages
open with no network: either inlined in the page (`inline_js=True`: one self-contained
file) or as one shared `assets/vega-bundle.js` next to the pages (many per-job pages
share one 0.9 MB copy). Every page defines `window.stragReady`, a promise resolved when
every chart has been drawn; the browser test waits on it.
"""
from __future__ import annotations

import dataclasses
import functools
import html
import json
import pathlib
from typing import Sequence

import altair as alt

__all__ = ["Chart", "Numbers", "HtmlTable", "Text", "fmt", "job_title", "render_page", "export_chart", "write_bundle", "BUNDLE_PATH"]

BUNDLE_PATH = "assets/vega-bundle.js"


@dataclasses.dataclass
class Chart:
    """One chart block: `name` is the file stem of its PNG/SVG and the element id."""

    name: str
    title: str
    chart: alt.TopLevelMixin
    note: str = ""


@dataclasses.dataclass
class Numbers:
    """A row of headline numbers: (label, formatted value, optional hint)."""

    items: Sequence[tuple[str, str, str]]


@dataclasses.dataclass
class HtmlTable:
    """A small table; cells are text, escaped on output, except `links` columns (text, href) pairs."""

    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[object]]
    note: str = ""


@dataclasses.dataclass
class Text:
    """A paragraph of plain text (escaped), optionally with one link."""

    text: str
    link: tuple[str, str] | None = None   # (label, href)


def fmt(value, digits: int = 3) -> str:
    """A table cell's number: floats to `digits` decimals ("0.000", never "-0.000"), "n/a" for a
    missing or NaN value."""
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    if not isinstance(value, float):
        return str(value)
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text


def confidence_text(cause: str, confidence) -> str:
    """A verdict's confidence as shown: two decimals; an insufficient-evidence verdict's (its
    strongest undecided finding) three, since two would round 0.988 up to the 0.99 a verdict needs."""
    return fmt(None if confidence is None else float(confidence), 3 if cause == "insufficient-evidence" else 2)


def job_title(job_id: str, prefix: str = "Job") -> str:
    """A page title naming a job: "Job llama-7b", but "job-20240304-003" as it is (no "Job job-...")."""
    return job_id if job_id.lower().startswith("job") else f"{prefix} {job_id}"


@functools.lru_cache(maxsize=1)
def _bundle() -> str:
    import vl_convert

    return vl_convert.javascript_bundle()


def write_bundle(out_dir: pathlib.Path) -> pathlib.Path:
    """Write the shared JavaScript bundle under out_dir; returns its path."""
    path = pathlib.Path(out_dir) / BUNDLE_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    text = _bundle()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


_STYLE = """
body { font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 24px 32px; color: #222; max-width: 1500px; }
h1 { margin: 0 0 4px 0; font-size: 26px; } h2 { font-size: 18px; margin: 28px 0 6px 0; }
.subtitle { color: #555; margin: 0 0 16px 0; }
.numbers { display: flex; flex-wrap: wrap; gap: 12px; margin: 12px 0; }
.number { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 130px; background: #fafafa; }
.number .value { font-size: 22px; font-weight: bold; } .number .label { color: #555; font-size: 12px; }
.number .hint { color: #888; font-size: 11px; }
.grid { display: flex; flex-wrap: wrap; gap: 8px 36px; align-items: flex-start; }
.grid > .block { flex: 0 1 auto; min-width: 0; } .grid .note { max-width: 560px; }
.block { margin-bottom: 8px; } .note { color: #555; font-size: 13px; max-width: 720px; margin: 2px 0 6px 0; }
.files { font-size: 12px; color: #777; } .files a { color: #777; }
table.data { border-collapse: collapse; font-size: 13px; } table.data th, table.data td { border-bottom: 1px solid #e4e4e4; padding: 3px 10px; text-align: left; }
table.data th { background: #f3f3f3; }
"""


def _spec(chart: alt.TopLevelMixin) -> dict:
    """Vega-Lite spec as plain JSON types: dates left in data frames (object columns) become ISO text."""
    return json.loads(json.dumps(chart.to_dict(), default=str))


def _script_json(value) -> str:
    # "</" inside a <script> would end it early
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


def _render_block(block, files: dict[str, dict[str, str]]) -> str:
    if isinstance(block, Numbers):
        cells = "".join(
            f'<div class="number"><div class="label">{html.escape(label)}</div><div class="value">{html.escape(value)}</div>'
            + (f'<div class="hint">{html.escape(hint)}</div>' if hint else "")
            + "</div>"
            for label, value, hint in block.items
        )
        return f'<div class="numbers">{cells}</div>'
    if isinstance(block, Chart):
        links = " ".join(f'<a href="{html.escape(href)}">{fmt.upper()}</a>' for fmt, href in files.get(block.name, {}).items())
        return (
            f'<div class="block"><h2>{html.escape(block.title)}</h2>'
            + (f'<p class="note">{html.escape(block.note)}</p>' if block.note else "")
            + f'<div class="chart-slot" id="chart-{html.escape(block.name)}"></div>'
            + (f'<div class="files">{links}</div>' if links else "")
            + "</div>"
        )
    if isinstance(block, HtmlTable):
        head = "".join(f"<th>{html.escape(c)}</th>" for c in block.columns)
        body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in block.rows)
        return (
            f'<div class="block"><h2>{html.escape(block.title)}</h2>'
            + (f'<p class="note">{html.escape(block.note)}</p>' if block.note else "")
            + f'<table class="data"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
        )
    if isinstance(block, Text):
        link = f' <a href="{html.escape(block.link[1])}">{html.escape(block.link[0])}</a>' if block.link else ""
        return f'<p class="note">{html.escape(block.text)}{link}</p>'
    if isinstance(block, list):  # side by side
        return '<div class="grid">' + "".join(_render_block(b, files) for b in block) + "</div>"
    raise TypeError(f"unknown page block {type(block).__name__}")


def _cell(value) -> str:
    if isinstance(value, tuple) and len(value) == 2:  # (text, href)
        return f'<a href="{html.escape(str(value[1]))}">{html.escape(str(value[0]))}</a>'
    if isinstance(value, float):
        return html.escape(f"{value:.3f}")
    return html.escape("" if value is None else str(value))


def _charts(blocks) -> list[Chart]:
    out = []
    for block in blocks:
        if isinstance(block, list):
            out += _charts(block)
        elif isinstance(block, Chart):
            out.append(block)
    return out


def render_page(
    title: str,
    subtitle: str,
    blocks: Sequence,
    *,
    inline_js: bool,
    bundle_href: str = BUNDLE_PATH,
    files: dict[str, dict[str, str]] | None = None,
    refresh_seconds: int | None = None,
) -> str:
    """HTML text of one page. files: chart name -> {"svg": href, "png": href} links shown under it.
    A page without charts loads no JavaScript bundle; refresh_seconds: reload the page that often."""
    charts = _charts(blocks)
    names = [c.name for c in charts]
    if len(set(names)) != len(names):
        raise ValueError(f"page {title!r}: chart names repeat: {sorted(names)}")
    specs = {f"chart-{c.name}": _spec(c.chart) for c in charts}
    if not charts:
        script = ""
    else:
        script = f"<script>\n{_bundle()}\n</script>" if inline_js else f'<script src="{html.escape(bundle_href)}"></script>'
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_seconds)}">\n' if refresh_seconds else ""
    body = "\n".join(_render_block(b, files or {}) for b in blocks)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<link rel="icon" href="data:,">
{refresh}<title>{html.escape(title)}</title>
<style>{_STYLE}</style>
{script}
</head>
<body>
<h1>{html.escape(title)}</h1>
<p class="subtitle">{html.escape(subtitle)}</p>
{body}
<script>
const stragSpecs = {_script_json(specs)};
window.stragReady = Promise.all(Object.entries(stragSpecs).map(
  ([id, spec]) => vegaEmbed('#' + id, spec, {{renderer: 'svg', actions: false}})
)).then(views => String(views.length));
window.stragReady.catch(error => console.error('chart failed:', error));
</script>
</body>
</html>
"""


def export_chart(chart: alt.TopLevelMixin, stem: pathlib.Path, formats: Sequence[str] = ("svg", "png")) -> dict[str, pathlib.Path]:
    """Write chart to stem.svg / stem.png with vl-convert (offline); returns {format: path}."""
    import vl_convert

    spec = _spec(chart)
    stem = pathlib.Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    out = {}
    for fmt in formats:
        path = stem.with_suffix(f".{fmt}")
        if fmt == "svg":
            path.write_text(vl_convert.vegalite_to_svg(spec))
        elif fmt == "png":
            path.write_bytes(vl_convert.vegalite_to_png(spec, scale=2))
        else:
            raise ValueError(f"chart {stem.name}: unknown image format {fmt!r} (svg, png)")
        out[fmt] = path
    return out
