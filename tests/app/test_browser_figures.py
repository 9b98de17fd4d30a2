"""Figures a reader can trust, checked in Chromium on the drawn SVG (benchmarks/figure_check.py).

Every view of the four shipped samples and every side-by-side and difference view of two Compare pairs is drawn by
plotly.js in a local page (offline) and read back: no overlapping text, no bar/marker/line outside its axis, no
scrolling or cut legend, one colour per series across a pair's panels, a note in every empty panel and never over
data, at least four labelled ticks on every colour bar; dropdown states (a layer selector) are each checked. The
probes plant each fault in a hand-made figure and see the check report it. The same check on the charts as
Streamlit draws them, page by page in the app, is part of the walk (test_browser_walk.py).
"""

from __future__ import annotations

import time

import plotly.graph_objects as go
import pytest
from plotly.subplots import make_subplots

from analysis.compare.side_by_side import combine_side_by_side
from benchmarks.bench_app import (
    CHROMIUM,
)
from benchmarks.figure_check import (
    PAIRS,
    SAMPLES,
    all_figures,
    experiment_figures,
    figure_problems,
    open_check_page,
    sample_contexts,
)

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("browser tests need /usr/bin/chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")


@pytest.fixture(scope="module")
def browser():
    from tests.app.library.test_browser_library import chromium

    with chromium() as launched:
        yield launched


@pytest.fixture(scope="module")
def check_page(browser):
    page = open_check_page(browser)
    yield page
    page.close()


@pytest.fixture(scope="module")
def contexts():
    """The shipped samples traced once, for both passes below."""
    return sample_contexts()


def test_every_view_and_comparison_of_the_samples_passes_the_figure_check(check_page, contexts):
    t0 = time.perf_counter()
    drawn = all_figures(contexts)
    t1 = time.perf_counter()
    compared = [d for d in drawn if d.where.startswith("compare")]
    assert len(drawn) > 200 and len(compared) > 80, len(drawn)
    assert {d.where.split("/")[0] for d in drawn} >= set(SAMPLES) | {f"compare {a} vs {b}" for a, b in PAIRS}
    bad = {}
    for d in drawn:
        problems = figure_problems(check_page, d.spec)
        if problems:
            bad[d.where] = list(dict.fromkeys(problems))[:6]
    t2 = time.perf_counter()
    print(f"\nfigure check: {len(drawn)} figures, built in {t1 - t0:.1f} s, checked in Chromium in {t2 - t1:.1f} s")
    assert not bad, "\n".join(f"{where}:\n  " + "\n  ".join(p) for where, p in bad.items())


def test_the_experiment_pages_figures_pass_the_figure_check(check_page, contexts):
    drawn = experiment_figures(contexts)
    assert len(drawn) >= 10 * len(SAMPLES), len(drawn)
    bad = {d.where: problems for d in drawn if (problems := figure_problems(check_page, d.spec))}
    assert not bad, "\n".join(f"{where}:\n  " + "\n  ".join(p[:6]) for where, p in bad.items())


# ----------------------------------------------------------------------------------------- the check catches faults
def _problems(page, fig: go.Figure) -> list[str]:
    return figure_problems(page, fig.to_plotly_json())


def test_probe_overlapping_text_and_cut_text(check_page):
    fig = go.Figure(go.Scatter(x=[0, 1], y=[0, 1]))
    fig.add_annotation(text="first note here", xref="paper", yref="paper", x=0.5, y=1.05, showarrow=False)
    fig.add_annotation(text="second note here", xref="paper", yref="paper", x=0.52, y=1.05, showarrow=False)
    assert any(p.startswith("text overlap: annotation") for p in _problems(check_page, fig))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("a long subplot title " * 3, "another long subplot title"))
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1]), row=1, col=1)
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1]), row=1, col=2)
    fig.update_layout(width=500)
    assert any("text overlap" in p for p in _problems(check_page, fig))
    fig = go.Figure(go.Scatter(x=[0, 1], y=[0, 1]))
    fig.add_annotation(text="far out", xref="paper", yref="paper", x=1.3, y=0.5, showarrow=False)
    assert any(p.startswith("text cut by the figure edge") for p in _problems(check_page, fig))


def test_probe_bars_and_markers_outside_their_axis(check_page):
    # the stacked bars: each segment below the axis top, the stack above it
    fig = go.Figure([go.Bar(x=[0, 1], y=[100, 150], name="a"), go.Bar(x=[0, 1], y=[90, 90], name="b")])
    fig.update_layout(barmode="stack", yaxis_range=[0, 155])
    problems = _problems(check_page, fig)
    assert any("point(s) of 'b' outside the axis range" in p for p in problems), problems
    assert not any("of 'a' outside" in p for p in problems)
    fig = go.Figure(go.Scatter(x=[0, 1, 2], y=[1, 2, 50], mode="markers", name="m"))
    fig.update_yaxes(range=[0, 10])
    assert any("1 point(s) of 'm' outside" in p for p in _problems(check_page, fig))


def test_probe_scrolling_legend(check_page):
    fig = go.Figure([go.Scatter(x=[0, 1], y=[i, i + 1], name=f"L{i // 4} H{i % 4}") for i in range(30)])
    fig.update_layout(height=300)
    assert any(p.startswith("legend scrolls") for p in _problems(check_page, fig))


def test_probe_a_series_in_two_colours_across_a_pair(check_page):
    def run(offset):  # plotly's colorway by trace index: the same series gets another colour in B
        traces = [go.Scatter(x=[0, 1], y=[0, 1], name="other") for _ in range(offset)]
        return go.Figure([*traces, go.Scatter(x=[0, 1], y=[1, 2], name="max |h|")])

    spec = {"data": [], "layout": {"meta": {"export_width": 1600}}}
    a, b = run(0).to_plotly_json(), run(1).to_plotly_json()
    spec["data"] = a["data"] + [{**t, "xaxis": "x2", "yaxis": "y2"} for t in b["data"]]
    spec["layout"].update(xaxis={"domain": [0, 0.45]}, xaxis2={"domain": [0.55, 1]}, yaxis2={"anchor": "x2"})
    assert any("series 'max |h|' drawn in 2 colours" in p for p in figure_problems(check_page, spec))
    # combine_side_by_side gives the series one colour (A's) in both panels
    combined = combine_side_by_side(run(0), run(1), "A", "B")
    assert not any("colours" in p for p in _problems(check_page, combined))


def test_probe_empty_panel_and_note_over_data(check_page):
    fig = make_subplots(rows=1, cols=2)
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1]), row=1, col=1)
    fig.add_trace(go.Bar(x=[0, 1], y=[0, 0]), row=1, col=2)  # all zero: nothing drawn
    assert any(p.startswith("empty panel") for p in _problems(check_page, fig))
    fig = go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]))
    fig.add_annotation(text="not applicable: a note", xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False)
    assert any("over data" in p for p in _problems(check_page, fig))


def test_probe_colour_bar_with_too_few_ticks(check_page):
    fig = go.Figure(go.Heatmap(z=[[0.96, 0.99]], colorbar={"tickvals": [0.97, 0.98]}))
    assert any("labelled ticks" in p for p in _problems(check_page, fig))
