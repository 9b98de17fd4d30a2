"""Weight figures of KDA: the resting decay gate g0 as a half-life, per layer and per head, read from
A_log and dt_bias (``analysis.weights``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis.figures.style import LAYER_TYPE_COLORS, SEQUENTIAL, apply_style
from analysis.figures.weights_source import run_label, weights_of
from analysis.runs.context import AnalysisContext
from analysis.views.view import NotApplicable

MLA_UNBOUNDED = "MLA layer: unbounded memory (full attention, no half-life)"


def build_kda_half_life(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Per KDA layer: median resting half-life over its channels, with the 10th-90th percentile band;
    MLA layers drawn as bands over the plot's height (unbounded memory has no half-life to plot)."""
    s = weights_of(ctx)
    table = s.kda_layers
    if table.empty:
        why = "no KDA layers" if not (s.structure["mixer"] == "kda").any() else "no config.json (gate form unknown)"
        raise NotApplicable(f"no KDA resting decay: {why}")
    fig = go.Figure()
    med, lo, hi = table["half_life_median"], table["half_life_p10"], table["half_life_p90"]
    fig.add_trace(
        go.Scatter(
            x=table["layer"],
            y=med,
            mode="markers",
            name="KDA: median half-life (p10-p90 bars)",
            marker={"color": LAYER_TYPE_COLORS["KDA"], "size": 8},
            error_y={"type": "data", "symmetric": False, "array": hi - med, "arrayminus": med - lo, "thickness": 1.5},
            customdata=table[["half_life_p10", "half_life_p90", "g0_mean", "heads"]].to_numpy(),
            hovertemplate="layer %{x} (KDA, %{customdata[3]} heads)<br>median half-life %{y:.4g} tokens<br>"
            "p10 %{customdata[0]:.4g}, p90 %{customdata[1]:.4g}<br>mean g0 %{customdata[2]:.4g}<extra></extra>",
        )
    )
    mla = s.structure.loc[s.structure["mixer"] == "mla", "layer"].to_list()
    # "Unbounded" has no value on a half-life axis: each MLA layer is a band over the whole plot height (paper
    # coordinates: no y value at all, so nothing reads as a half-life of ~700 tokens), named once in the legend.
    for k, layer in enumerate(mla):
        fig.add_shape(
            type="rect",
            xref="x",
            yref="paper",
            x0=layer - 0.4,
            x1=layer + 0.4,
            y0=0,
            y1=1,
            fillcolor=LAYER_TYPE_COLORS["MLA"],
            opacity=0.15,
            line_width=0,
            layer="below",
            name=MLA_UNBOUNDED,
            legendgroup="mla",
            showlegend=k == 0,
        )
    fig.update_yaxes(type="log")
    cfg = s.config
    form = (
        f"g0 = {cfg.kda_gate_lower_bound:g}·sigmoid(exp(A_log)·dt_bias)"
        if cfg is not None and cfg.kda_gate == "lower_bound"
        else "g0 = -exp(A_log)·softplus(dt_bias)"
    )
    apply_style(
        fig,
        f"KDA resting half-life by layer, {form} — {run_label(ctx, s)}",
        "layer (0-based)",
        "half-life ln2/(-g0) (tokens, log scale)",
    )
    return fig, table


def build_kda_heads(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Layer x head heatmap of the median resting half-life over each head's channels (log10 colour)."""
    s = weights_of(ctx)
    table = s.kda_heads
    if table.empty:
        raise NotApplicable("no KDA resting decay (no KDA layers, or no config.json)")
    mat = table.pivot(index="layer", columns="head", values="half_life_median")
    with np.errstate(divide="ignore"):
        z = np.log10(mat.to_numpy(dtype=np.float64))
    custom = mat.to_numpy(dtype=np.float64)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[str(h) for h in mat.columns],
            y=[f"L{i}" for i in mat.index],
            colorscale=SEQUENTIAL,
            customdata=custom,
            colorbar={"title": {"text": "log10 half-life<br>(tokens)"}},
            hovertemplate="layer %{y}, head %{x}<br>median half-life %{customdata:.4g} tokens<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    apply_style(
        fig,
        f"KDA resting half-life per head (median over channels) — {run_label(ctx, s)}",
        "KDA head",
        "KDA layer",
        height=max(320, 90 + 14 * len(mat.index)),
    )
    return fig, table
