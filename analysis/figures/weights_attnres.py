"""Weight figures of the residual stream: AttnRes pseudo-query norms and the scale/bias residual's learned
scale and bias per depth (``analysis.weights``)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.figures.style import RUN_COLORS, apply_style
from analysis.figures.weights_source import run_label, weights_of
from analysis.runs.context import AnalysisContext
from analysis.views.view import NotApplicable
from k3core.modeling.layers.residual import scale_bias_init


def build_query_norms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """AttnRes pseudo-query norm per site and depth (attention site, MLP site, output mix)."""
    s = weights_of(ctx)
    table = s.query_norms
    if table.empty:
        mode = s.config.residual if s.config is not None else "unknown"
        raise NotApplicable(f"no AttnRes pseudo-queries in this checkpoint (residual={mode!r})")
    colors = {"attn": RUN_COLORS[0], "mlp": RUN_COLORS[1], "output": RUN_COLORS[3]}
    fig = go.Figure()
    for site, g in table.groupby("site", sort=False):
        fig.add_trace(
            go.Bar(
                x=g["depth"],
                y=g["query_norm"],
                name={"attn": "attention site", "mlp": "MLP site", "output": "output mix"}.get(site, site),
                marker_color=colors.get(site, "#777"),
                hovertemplate="%{x}<br>‖w‖ = %{y:.4g}<extra></extra>",
            )
        )
    fig.update_xaxes(categoryorder="array", categoryarray=list(table["depth"]))
    fig.update_layout(barmode="overlay")
    apply_style(
        fig,
        f"AttnRes pseudo-query norm per site (0 = uniform mix over depth) — {run_label(ctx, s)}",
        "site (layer, side)",
        "‖w‖ (L2 norm of the pseudo-query)",
    )
    return fig, table


def build_scale_bias(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Scale/bias residual: mean scale and bias per depth and site, bars = std over channels; the initial scale
    (``k3core.modeling.layers.residual.scale_bias_init``) dashed."""
    s = weights_of(ctx)
    table = s.scale_bias
    if table.empty:
        mode = s.config.residual if s.config is not None else "unknown"
        raise NotApplicable(f"no scale/bias residual parameters (residual={mode!r})")
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("scale (mean ± std over channels)", "bias (mean ± std over channels)")
    )
    for k, (site, g) in enumerate(table.groupby("site", sort=False)):
        for col, what in ((1, "scale"), (2, "bias")):
            fig.add_trace(
                go.Scatter(
                    x=g["layer"],
                    y=g[f"{what}_mean"],
                    error_y={"type": "data", "array": g[f"{what}_std"], "thickness": 1.2},
                    mode="lines+markers",
                    name=f"{site} site",
                    legendgroup=site,
                    showlegend=col == 1,
                    line={"color": RUN_COLORS[k % len(RUN_COLORS)]},
                    hovertemplate=f"layer %{{x}} ({site})<br>{what} mean %{{y:.4g}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    if s.config is not None:  # the initial scale, for reference (the bias starts at 0)
        layers = sorted(table["layer"].unique())
        fig.add_trace(
            go.Scatter(
                x=layers,
                y=[scale_bias_init(s.config, int(i)) for i in layers],
                mode="lines",
                name="scale at init",
                line={"color": "#777", "dash": "dash"},
                hovertemplate="layer %{x}<br>initial scale = %{y:.3f}<extra></extra>",
            ),
            row=1,
            col=1,
        )
    fig.update_xaxes(title_text="layer (0-based)")
    fig.update_yaxes(title_text="scale (multiplier)", row=1, col=1)
    fig.update_yaxes(title_text="bias (hidden units)", row=1, col=2)
    apply_style(fig, f"Residual scale and bias per depth — {run_label(ctx, s)}")
    return fig, table
