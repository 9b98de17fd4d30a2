"""Training-history views (analysis.figures.history): runs overlaid, numbers as logged, clear NotApplicable."""

from __future__ import annotations

import pytest

from analysis.figures import history as fig_hist
from analysis.runs.context import AnalysisContext
from analysis.views.view import NotApplicable
from k3core.interp.trace import Trace
from k3core.modeling.presets import from_preset
from tests.analysis.metrics.test_history import METRICS, NATIVE

CONFIG = from_preset("k3-nano")


def test_history_views_draw_the_native_metrics():
    ctx = AnalysisContext(trace=Trace(), config=CONFIG, metrics=NATIVE, label="r")
    for view in fig_hist.VIEWS:
        fig, df = view.build(ctx)
        assert len(fig.data) and len(df), view.key


def test_history_views_overlay_runs_and_say_not_applicable():
    ctx = AnalysisContext(
        trace=Trace(),
        config=CONFIG,
        metrics=METRICS,
        label="A",
        options={"overlay_metrics": {"B": {"history": [{"step": 0, "loss": 4.0}, {"step": 20, "loss": 2.0}]}}},
    )
    fig, df = fig_hist.build_curves(ctx)
    assert set(df["run"]) == {"A", "B"}
    assert {t.name for t in fig.data if not t.name.startswith("chance 1/")} == {"A", "B"}
    fig, df = fig_hist.build_moe(ctx)
    assert set(df["stat"]) == {"MaxVio", "CV"}
    mean_a = df[(df["run"] == "A") & (df["stat"] == "MaxVio") & (df["step"] == 0)]["value"].mean()
    assert mean_a == pytest.approx(1.5)
    fig, _ = fig_hist.build_attnres(ctx)
    assert len(fig.data) == 1
    bare = AnalysisContext(trace=Trace(), config=CONFIG, label="bare")
    for view in fig_hist.VIEWS:
        with pytest.raises(NotApplicable):
            view.build(bare)
    no_moe = AnalysisContext(trace=Trace(), config=CONFIG, metrics={"history": [{"step": 1, "loss": 1.0}]})
    with pytest.raises(NotApplicable, match="MoE"):
        fig_hist.build_moe(no_moe)


SCALE_BIAS = {
    "history": {
        "attnres": [
            {"step": 2, "mode": "scale_bias", "layers": {"0": {"attn_scale_mean": 1.0}, "1": {"attn_scale_mean": 0.5}}},
            {"step": 4, "mode": "scale_bias", "layers": {"0": {"attn_scale_mean": 0.8}, "1": {"attn_scale_mean": 0.4}}},
        ]
    }
}


def test_history_figures_are_readable_and_keep_each_runs_colour():
    # run A has no MoE statistics: B must still get the second colour in the MoE chart, as in the curves chart
    b = {"history": [{"step": 0, "loss": 4.0, "maxvio": {"1": 0.5, "3": 0.9}}, {"step": 20, "loss": 2.0}]}
    ctx = AnalysisContext(
        trace=Trace(),
        config=CONFIG,
        metrics={"history": [{"step": 0, "loss": 5.0}]},
        label="A",
        options={"overlay_metrics": {"B": b}},
    )
    curves, _ = fig_hist.build_curves(ctx)
    moe, df = fig_hist.build_moe(ctx)
    colour_b = {t.line.color for t in curves.data if t.legendgroup == "B"}
    assert colour_b == {t.line.color for t in moe.data} == {"#ff7f0e"}
    mean_b = next(t for t in moe.data if t.name == "B mean")
    assert list(mean_b.y) == [pytest.approx((0.5 + 0.9) / 2)]  # mean over the two MoE layers at step 0
    # one legend entry per run (the titles say what a dotted line is): seven runs fit the legend's column
    assert [t.name for t in moe.data if t.showlegend is not False] == ["B mean"]
    assert "worst layer dotted" in moe.layout.title.text
    assert [t.name for t in curves.data if t.showlegend is not False] == ["A", "B"]
    for fig in (curves, moe):
        assert fig.layout.legend.orientation == "v" and fig.layout.legend.x > 1  # right of the plots
        assert all(fig.layout[k].title.text for k in fig.layout if k.startswith("yaxis"))
    scale = AnalysisContext(trace=Trace(), config=CONFIG, metrics=SCALE_BIAS, label="sb")
    fig, df = fig_hist.build_attnres(scale)
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["attention residual scale (mean)"] and "attn_scale_mean" not in str(titles)
    assert list(fig.data[0].y) == [pytest.approx(0.75), pytest.approx(0.6)]  # mean over layers 0 and 1
    assert fig.layout.yaxis.title.text == "scale"


def test_mqar_accuracy_stands_against_its_chance_line_from_zero():
    from k3core.data.mqar import mqar_chance

    assert mqar_chance() == 1 / 64
    metrics = {"val": [{"step": s, "val_loss": 3.0, "mqar_accuracy": a} for s, a in ((0, 0.004), (50, 0.032))]}
    fig, _ = fig_hist.history_curves_figure({"run": metrics})
    titles = [a.text for a in fig.layout.annotations]
    col = [t for t in titles if t in ("val loss", "bits per byte", "MQAR accuracy")].index("MQAR accuracy") + 1
    axis = fig.layout[f"yaxis{col if col > 1 else ''}"]
    assert axis.range[0] == 0 and axis.range[1] >= 2 / 64
    lines = [t for t in fig.data if list(t.y) == [1 / 64, 1 / 64]]
    assert len(lines) == 1 and lines[0].name.startswith("chance 1/64") and lines[0].showlegend is not False
    assert lines[0].yaxis == ("y" if col == 1 else f"y{col}")  # drawn in the MQAR panel
    assert list(lines[0].x) == [0, 50]  # across the steps validated


def test_mqar_panel_shades_a_guessers_range_at_the_evals_query_count():
    """The band is Binomial(n, 1/64)'s central 95% over n = examples x pairs scored queries; a run that does not say
    how many queries it scored gets the line only."""
    import numpy as np

    from analysis.metrics.null_reference import chance_interval

    val = [{"step": s, "val_loss": 3.0, "mqar_accuracy": a} for s, a in ((0, 0.004), (50, 0.032))]
    metrics = {"val": val, "eval": {"mqar": {"examples": 32, "num_kv_pairs": 8}}}
    assert fig_hist.mqar_queries(metrics) == 256
    fig, _ = fig_hist.history_curves_figure({"run": metrics})
    low, high = chance_interval(64, 256)
    rng = np.random.default_rng(0)
    sims = rng.binomial(256, 1 / 64, size=200_000) / 256
    assert 0.94 <= np.mean((sims >= low) & (sims <= high)) <= 1.0 and low < 1 / 64 < high
    bands = [s for s in fig.layout.shapes if s.type == "rect" and s.y0 == low and s.y1 == high]
    assert len(bands) == 1
    lines = [t for t in fig.data if t.name and t.name.startswith("chance 1/64")]
    assert len(lines) == 1 and f"(95%: {low:.3f}-{high:.3f})" in lines[0].name
    assert f"over 256 queries: {low:.3f}-{high:.3f}" in lines[0].hovertemplate
    bare, _ = fig_hist.history_curves_figure({"run": {"val": val}})
    assert not [s for s in bare.layout.shapes if s.type == "rect"]
