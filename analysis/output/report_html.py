"""The report as one offline HTML page: runs, input, headline numbers and every view's figure (``render_html``).

plotly.js is inlined once in the page head, so the file opens without a network. ``Entry`` is one figure
of the report (or the note saying why a view was not drawn); ``analysis.output.report`` builds the entries.
"""

from __future__ import annotations

import html
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import plotly.graph_objects as go

from analysis.output.format import format_number
from k3core.tokenizer import token_axis_labels

if TYPE_CHECKING:
    from analysis.metrics.headline import HeadlineComparison
    from analysis.runs.loading import Run
    from analysis.runs.texts import Input

SECTION_TITLES = {
    "density": "KDA layer density allocation",
    "attnres": "AttnRes depth mixing",
    "moe": "LatentMoE expert load and routing",
    "degradation": "Attention degradation diagnostics",
    "long_context": "Long context",
    "history": "Training history",
    "weights": "Weights (from the checkpoint's tensors)",
    "experiment": "Experiment (edits, patching, attribution, lens)",
}


@dataclass
class Entry:
    """One figure of the report (or the note of a view that did not apply / failed)."""

    key: str
    title: str
    section: str
    description: str = ""
    figure: go.Figure | None = None
    table: pd.DataFrame | None = None
    note: str | None = None  # NotApplicable reason
    error: str | None = None  # unexpected failure
    files: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


_CSS = """
body{font-family:Inter,Helvetica,Arial,sans-serif;margin:0 auto;max-width:1500px;padding:16px 28px;color:#222}
h1{font-size:26px;margin-bottom:4px} h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:36px}
h3{margin:28px 0 4px} .desc{color:#555;margin:2px 0 8px} .note{color:#8a6d3b} .err{color:#b00020}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f5f5f5} td.l,th.l{text-align:left} .files a{margin-right:8px;font-size:12px}
pre{background:#f7f7f7;padding:8px;overflow:auto;max-height:320px;font-size:12px}
.grid{display:flex;gap:32px;flex-wrap:wrap} nav a{margin-right:14px}
"""


def _fmt(v: Any) -> str:
    """A table cell: ``analysis.output.format.format_number`` (NaN -> "n/a", inf -> "∞"), HTML-escaped."""
    return html.escape(format_number(v))


def _kv_table(items: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><th class='l'>{html.escape(str(k))}</th><td class='l'>{_fmt(v)}</td></tr>" for k, v in items.items()
    )
    return f"<table>{rows}</table>"


def _headline_html(headlines: list[dict], labels: list[str], comparison: HeadlineComparison | None) -> str:
    from analysis.metrics.headline import HEADLINE_LABELS

    if comparison is not None:
        df = comparison.table
        noisy = "ci95" in df
        head = (
            f"<tr><th class='l'>metric</th><th>{html.escape(labels[0])}</th><th>{html.escape(labels[1])}</th>"
            f"<th>delta (A - B)</th>" + ("<th>± (95% CI)</th><th>within noise</th>" if noisy else "") + "</tr>"
        )
        rows = "".join(
            f"<tr><td class='l'>{html.escape(r.description)}</td><td>{_fmt(r.a)}</td><td>{_fmt(r.b)}</td>"
            f"<td>{_fmt(r.delta)}</td>"
            + (
                f"<td>{_fmt(r.ci95) if math.isfinite(r.ci95) else ''}</td>"
                f"<td>{ {True: 'yes', False: 'no'}.get(r.within_noise, '') }</td>"
                if noisy
                else ""
            )
            + "</tr>"
            for r in df.itertuples()
        )
        statement = comparison.statement
        note = f"<p class='desc' id='loss-noise'>{html.escape(statement)}</p>" if statement else ""
        return f"{note}<table id='headline'>{head}{rows}</table>"
    h = headlines[0]
    rows = "".join(
        f"<tr><td class='l'>{html.escape(HEADLINE_LABELS.get(k, k))}</td><td>{_fmt(v)}</td></tr>"
        for k, v in h.items()
        if k != "label"
    )
    return f"<table id='headline'><tr><th class='l'>metric</th><th>{html.escape(labels[0])}</th></tr>{rows}</table>"


def _figure_div(fig: go.Figure, div_id: str) -> str:
    import plotly.io as pio

    return pio.to_html(
        fig, include_plotlyjs=False, full_html=False, div_id=div_id, config={"displaylogo": False, "responsive": True}
    )


def _run_block(run, label: str) -> str:
    from analysis.weights.checkpoint_summary import config_summary

    card = {k: v for k, v in run.card.items() if k not in ("card_text", "notes", "training")}
    parts = [
        # the folder's name, never its absolute path: a report is shared, the server's layout is not its business
        f"<div><h3>{html.escape(label)}</h3><p class='desc'>folder {html.escape(Path(str(run.path)).name)}<br>"
        f"fingerprint {html.escape(run.fingerprint[:16])}</p>",
        "<h4>Model card</h4>",
        _kv_table(card),
    ]
    if run.card.get("training"):
        parts += ["<h4>Training (metrics.json)</h4>", _kv_table(run.card["training"])]
    parts += ["<h4>Config</h4>", _kv_table(config_summary(run.config))]
    parts += [
        "<details><summary>full config.json</summary><pre>"
        f"{html.escape(json.dumps(run.config.to_dict(), indent=1))}</pre></details>"
    ]
    if run.card.get("card_text"):
        parts.append(
            f"<details><summary>model card (README)</summary><pre>{html.escape(run.card['card_text'])}</pre></details>"
        )
    for note in run.card.get("notes", []):
        parts.append(f"<p class='note'>{html.escape(note)}</p>")
    parts.append("</div>")
    return "".join(parts)


def render_html(
    entries: list[Entry],
    runs: list[Run],
    labels: list[str],
    headlines: list[dict[str, Any]],
    sample: Input,
    timings: dict[str, float],
    comparison: HeadlineComparison | None = None,
) -> str:
    """The whole report as one HTML string (plotly.js inline once); ``comparison``: two runs' headline table with
    its noise floor (``analysis.metrics.headline.compare_headlines``)."""
    from plotly.offline import get_plotlyjs

    title = "k3lab report: " + " vs ".join(labels)
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='desc'>generated {time.strftime('%Y-%m-%d %H:%M:%S')}; input: "
        f"{html.escape(sample.description or sample.name)} ({sample.input_ids.shape[1]} tokens)</p>",
    ]
    sections = list(dict.fromkeys(e.section for e in entries))
    body.append(
        "<nav>"
        + "".join(
            f"<a href='#sec-{s}'>{html.escape(SECTION_TITLES.get(s, s))}</a>" for s in ["runs", "headline"] + sections
        )
        + "</nav>"
    )
    body.append(
        "<h2 id='sec-runs'>Runs</h2><div class='grid'>"
        + "".join(_run_block(r, lab) for r, lab in zip(runs, labels))
        + "</div>"
    )
    if sample.text:
        body.append(f"<details><summary>input text</summary><pre>{html.escape(sample.text)}</pre></details>")
    tokenizer = getattr(runs[0], "tokenizer", None)
    if tokenizer is not None and sample.name != "mqar":  # MQAR ids are synthetic: no text to show
        shown = " ".join(token_axis_labels(tokenizer.token_strings(sample.input_ids[0])))
        body.append(
            f"<details><summary>input tokens ({html.escape(tokenizer.name)})</summary>"
            f"<pre>{html.escape(shown)}</pre></details>"
        )
    body.append("<h2 id='sec-headline'>Headline numbers</h2>" + _headline_html(headlines, labels, comparison))
    for section in sections:
        body.append(f"<h2 id='sec-{section}'>{html.escape(SECTION_TITLES.get(section, section))}</h2>")
        for e in (e for e in entries if e.section == section):
            body.append(f"<section id='view-{e.key}'><h3>{html.escape(e.title)}</h3>")
            if e.description:
                body.append(f"<p class='desc'>{html.escape(e.description)}</p>")
            if e.figure is not None:
                body.append(_figure_div(e.figure, f"fig-{e.key}"))
                links = [
                    f"<a href='figures/{html.escape(Path(p).name)}'>{fmt}</a>"
                    for fmt, p in e.files.items()
                    if isinstance(p, Path)
                ]
                if links:
                    body.append("<p class='files'>data and images: " + "".join(links) + "</p>")
            if e.note:
                body.append(f"<p class='note'>Not shown: {html.escape(e.note)}</p>")
            if e.error:
                body.append(f"<p class='err'>Failed: {html.escape(e.error)}</p>")
            body.append("</section>")
    body.append("<hr><p class='desc'>timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()) + "</p>")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>" + "\n".join(body) + "</body></html>\n"
    )
