"""Weight figures of the MoE router and routed experts: selection bias, its spread, router row norms and
expert weight norms, layer x expert (``analysis.weights``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis.figures.style import DIVERGING, RUN_COLORS, SEQUENTIAL, apply_style
from analysis.figures.weights_source import run_label, weights_of
from analysis.metrics import moe as mo
from analysis.runs.context import AnalysisContext
from analysis.views.view import NotApplicable


def _layer_expert_heatmap(
    table: pd.DataFrame, value: str, title: str, colorbar: str, diverging: bool, unit: str
) -> go.Figure:
    mat = table.pivot(index="layer", columns="expert", values=value)
    z = mat.to_numpy(dtype=np.float64)
    kw = {"colorscale": SEQUENTIAL}
    if diverging:
        finite = z[np.isfinite(z)]
        bound = float(np.abs(finite).max()) if finite.size else 1.0
        kw = {"colorscale": DIVERGING, "zmid": 0.0, "zmin": -bound or -1.0, "zmax": bound or 1.0}
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[str(e) for e in mat.columns],
            y=[f"L{i}" for i in mat.index],
            colorbar={"title": {"text": colorbar}},
            hovertemplate=f"layer %{{y}}, expert %{{x}}<br>{value} %{{z:.4g}}{unit}<extra></extra>",
            **kw,
        )
    )
    fig.update_yaxes(autorange="reversed")
    apply_style(fig, title, "routed expert", "MoE layer", height=max(320, 90 + 12 * len(mat.index)))
    return fig


def _layer_expert_view(
    ctx: AnalysisContext, table: pd.DataFrame | None, value: str, title: str, colorbar: str, diverging: bool
) -> tuple[go.Figure, pd.DataFrame]:
    """One layer x expert heatmap of ``table[value]``, titled with the run; NotApplicable without MoE layers."""
    if table is None or table.empty:
        raise NotApplicable("no routed experts in this checkpoint (no MoE layers)")
    s = weights_of(ctx)
    return _layer_expert_heatmap(table, value, f"{title} — {run_label(ctx, s)}", colorbar, diverging, ""), table


def build_router_bias(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Selection bias e_bias per MoE layer x expert (diverging colour, 0 = white)."""
    table = weights_of(ctx).router_bias
    title = "Router selection bias e_bias per layer and expert"
    return _layer_expert_view(ctx, table, "bias", title, "e_bias<br>(score units)", True)


def build_router_bias_spread(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Per MoE layer: e_bias std (spread) and its min-max range around the mean; with a trace that recorded
    the expert load, also the bias-load correlation per layer (``analysis.metrics.moe.bias_load_correlation``)."""
    s = weights_of(ctx)
    table = s.router_bias_stats
    if table.empty:
        raise NotApplicable("no router selection biases (no MoE layers)")
    if ctx.trace is not None and mo.moe_layers(ctx.trace):
        corr = mo.bias_load_correlation(s.router_bias, mo.expert_load(ctx.trace))
        table = table.merge(corr, on="layer", how="left")
        table.attrs = dict(s.router_bias_stats.attrs)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=np.concatenate([table["layer"], table["layer"][::-1]]),
            y=np.concatenate([table["max"], table["min"][::-1]]),
            fill="toself",
            mode="lines",
            fillcolor="rgba(44,160,44,0.15)",
            line={"width": 0},
            name="min-max over experts",
            hoverinfo="skip",
        )
    )
    corr = "<br>corr(bias, load) = %{customdata:.2f}" if "load_corr" in table else ""
    for col, name, color, dash in (
        ("mean", "mean", RUN_COLORS[2], "dot"),
        ("std", "std (spread)", RUN_COLORS[0], "solid"),
    ):
        fig.add_trace(
            go.Scatter(
                x=table["layer"],
                y=table[col],
                mode="lines+markers",
                name=name,
                line={"color": color, "dash": dash},
                customdata=table["load_corr"] if corr else None,
                hovertemplate=f"layer %{{x}}<br>{name} %{{y:.4g}}{corr}<extra></extra>",
            )
        )
    apply_style(
        fig,
        f"Router selection bias spread per layer — {run_label(ctx, s)}",
        "MoE layer (0-based)",
        "e_bias (score units)",
    )
    return fig, table


def build_router_norms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Router weight row norm ||W_router[e]|| per MoE layer x expert."""
    table = weights_of(ctx).router_norms
    title = "Router weight norm per expert ‖W_router[e]‖"
    return _layer_expert_view(ctx, table, "weight_norm", title, "‖W_router[e]‖", False)


def build_expert_norms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Routed expert weight norm sqrt(|w1|² + |w2|² + |w3|²) per MoE layer x expert (``--experts``)."""
    table = weights_of(ctx).expert_norms
    if table is None:
        raise NotApplicable("expert norms were not read (run `k3lab weights PATH --experts`)")
    title = "Routed expert weight norm per layer and expert"
    return _layer_expert_view(ctx, table, "norm", title, "Frobenius norm<br>(w1, w2, w3)", False)
