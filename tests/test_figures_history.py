"""Training-history views (analysis.figures.history): runs overlaid, numbers as logged, clear NotApplicable."""

from __future__ import annotations

import pytest

from analysis.figures import history as fig_hist
from analysis.views import AnalysisContext, NotApplicable
from k3core.config import K3Config
from k3core.trace import Trace
from tests.test_history import METRICS, NATIVE

CONFIG = K3Config.from_preset("k3-nano")


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
    assert {t.name for t in fig.data} == {"A", "B"}
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
