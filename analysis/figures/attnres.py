"""Figures for AttnRes (analysis.attnres): depth-weight map, per-site statistics, pseudo-query norms,
scale/bias per depth and residual growth."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis import attnres as ar
from analysis.context import AnalysisContext
from analysis.style import RUN_COLORS, SEQUENTIAL, apply_style
from analysis.view import Comparison, NotApplicable, View


def _require_attnres(ctx: AnalysisContext) -> None:
    if not ar.sites(ctx.trace):
        mode = ctx.config.residual
        why = (
            "the run uses a plain/scale-bias residual"
            if mode in ("plain", "scale_bias")
            else "the trace was recorded without 'attnres'"
        )
        raise NotApplicable(f"no AttnRes depth weights: {why} (residual={mode!r})")


def _site_label(site: str) -> str:
    return "output mix" if site == "output" else f"L{site.replace('.', ' ')}"


def build_depth_weights(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Sites x sources heatmap of the depth-softmax weights, mean over tokens."""
    _require_attnres(ctx)
    table = ar.depth_weights(ctx.trace)
    mat, site_names, labels = ar.weight_matrix(table)
    names = {(r.site, r.source): r.source_name for r in table.itertuples()}
    hover = [
        [f"site {_site_label(s)}<br>source {j}: {names.get((s, j), '—')}" for j in range(mat.shape[1])]
        for s in site_names
    ]
    fig = go.Figure(
        go.Heatmap(
            z=mat,
            x=[f"{j}: {lab}" for j, lab in enumerate(labels)],
            y=[_site_label(s) for s in site_names],
            colorscale=SEQUENTIAL,
            zmin=0,
            zmax=1,
            customdata=hover,
            colorbar={"title": {"text": "weight p"}},
            hovertemplate="%{customdata}<br>mean weight p = %{z:.3f}<extra></extra>",
            texttemplate="%{z:.2f}" if mat.size <= 400 else None,
        )
    )
    fig.update_yaxes(autorange="reversed")
    apply_style(
        fig,
        f"AttnRes depth weights per site (mean over tokens) — {ctx.label}",
        "source (0 = embedding; last = running partial sum)",
        "site (layer, side)",
        height=max(320, 90 + 22 * len(site_names)),
    )
    return fig, table


def build_site_stats(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Per site: normalised entropy (of the mean mix and per token), max weight, embedding (sink) weight."""
    _require_attnres(ctx)
    table = ar.site_stats(ctx.trace)
    x = [_site_label(s) for s in table["site"]]
    fig = go.Figure()
    series = [
        ("entropy", "entropy of mean mix (norm.)", RUN_COLORS[0], "solid"),
        ("token_entropy", "per-token entropy (norm., mean)", RUN_COLORS[0], "dot"),
        ("max_weight", "max weight", RUN_COLORS[1], "solid"),
        ("embedding_weight", "embedding weight (depth sink)", RUN_COLORS[2], "solid"),
    ]
    custom = table[["n_sources", "argmax"]].to_numpy()
    for col, name, color, dash in series:
        fig.add_trace(
            go.Scatter(
                x=x,
                y=table[col],
                mode="lines+markers",
                name=name,
                line={"color": color, "dash": dash},
                customdata=custom,
                hovertemplate="site %{x} (%{customdata[0]} sources, argmax source %{customdata[1]})<br>"
                f"{name} = %{{y:.3f}}<extra></extra>",
            )
        )
    fig.update_yaxes(range=[0, 1.05])
    apply_style(
        fig, f"AttnRes per-site entropy, max and embedding weight — {ctx.label}", "site (layer, side)", "value (0..1)"
    )
    return fig, table


def build_query_norms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Pseudo-query norm ||w|| per site (0: uniform mix)."""
    _require_attnres(ctx)
    table = ar.query_norms(ctx.trace)
    if table.empty:
        raise NotApplicable("trace has no attnres.*_query_norm values")
    colors = {"attn": RUN_COLORS[0], "mlp": RUN_COLORS[1], "output": RUN_COLORS[3]}
    fig = go.Figure()
    for side, g in table.groupby("side", sort=False):
        fig.add_trace(
            go.Bar(
                x=[_site_label(s) for s in g["site"]],
                y=g["query_norm"],
                name=f"{side} site",
                marker_color=colors.get(side, "#777"),
                hovertemplate="site %{x}<br>‖w‖ = %{y:.4g}<extra></extra>",
            )
        )
    fig.update_xaxes(categoryorder="array", categoryarray=[_site_label(s) for s in table["site"]])
    fig.update_layout(barmode="overlay")  # one bar per site: no side-by-side offsets
    apply_style(
        fig,
        f"AttnRes pseudo-query norm per site — {ctx.label}",
        "site (layer, side)",
        "pseudo-query norm ‖w‖ (0 = uniform mix)",
    )
    return fig, table


def build_scale_bias(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Scale/bias residual mode: per-layer scale and bias (mean ± std over channels) vs depth, with init."""
    table = ar.scale_bias_stats(ctx.trace, ctx.config)
    if table.empty:
        raise NotApplicable(
            f"no learned residual scale/bias (residual={ctx.config.residual!r}; needs 'scale_bias' "
            "and a trace recorded with 'attnres')"
        )
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=("residual scale (mean ± std over channels)", "residual bias (mean ± std over channels)"),
    )
    colors = {"attn": RUN_COLORS[0], "mlp": RUN_COLORS[1]}
    for side, g in table.groupby("side", sort=False):
        for row, key in ((1, "scale"), (2, "bias")):
            fig.add_trace(
                go.Scatter(
                    x=g["layer"],
                    y=g[f"{key}_mean"],
                    mode="lines+markers",
                    name=f"{side} {key}",
                    legendgroup=side,
                    line={"color": colors[side]},
                    error_y={"type": "data", "array": g[f"{key}_std"], "visible": True},
                    hovertemplate=f"layer %{{x}}, {side} site<br>{key} mean = %{{y:.4f}}<extra></extra>",
                ),
                row=row,
                col=1,
            )
    init = table.drop_duplicates("layer")
    fig.add_trace(
        go.Scatter(
            x=init["layer"],
            y=init["scale_init"],
            mode="lines",
            name="scale at init",
            line={"color": "#777", "dash": "dash"},
            hovertemplate="layer %{x}<br>initial scale = %{y:.3f}<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=init["layer"],
            y=init["bias_init"],
            mode="lines",
            name="bias at init",
            line={"color": "#777", "dash": "dot"},
            hovertemplate="layer %{x}<br>initial bias = %{y:.3f}<extra></extra>",
        ),
        row=2,
        col=1,
    )
    fig.update_yaxes(title_text="scale", row=1, col=1)
    fig.update_yaxes(title_text="bias", row=2, col=1)
    fig.update_xaxes(
        title_text="decoder layer (0-based)", dtick=1 if table["layer"].nunique() <= 40 else None, row=2, col=1
    )
    apply_style(fig, f"Residual scale and bias per depth — {ctx.label}", height=560)
    return fig, table


def build_hidden_rms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """RMS of the hidden state entering each layer (and the final state): mean with the p10-p90 band."""
    table = ar.hidden_rms_by_depth(ctx.trace)
    if table.empty:
        raise NotApplicable("trace has no hidden_rms (record with 'hidden')")
    x = table["depth"]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=np.concatenate([x, x[::-1]]),
            y=np.concatenate([table["p90"], table["p10"][::-1]]),
            fill="toself",
            mode="lines",
            fillcolor="rgba(31,119,180,0.18)",
            line={"width": 0},
            name="p10-p90 of tokens",
            hoverinfo="skip",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=table["mean"],
            mode="lines+markers",
            name="mean over tokens",
            line={"color": RUN_COLORS[0]},
            customdata=table[["label", "median", "max"]].to_numpy(),
            hovertemplate="%{customdata[0]}<br>mean RMS %{y:.4g}, median %{customdata[1]:.4g}, "
            "max %{customdata[2]:.4g}<extra></extra>",
        )
    )
    fig.update_xaxes(tickmode="array", tickvals=list(x), ticktext=list(table["label"]))
    apply_style(
        fig,
        f"Hidden-state RMS by depth (residual={ctx.config.residual}) — {ctx.label}",
        "depth (state entering layer; final = before the last RMSNorm)",
        "RMS sqrt(mean h²)",
    )
    return fig, table


VIEWS: list[View] = [
    View(
        "attnres_depth_weights",
        "AttnRes depth weights",
        "attnres",
        build_depth_weights,
        description="Sites x sources map of the depth-softmax weights, averaged over tokens.",
        compare=Comparison(difference=("weight",), keys=("site", "source"), x="source"),
    ),
    View(
        "attnres_site_stats",
        "AttnRes per-site entropy, max, embedding weight",
        "attnres",
        build_site_stats,
        description="Normalised entropy of each site's depth mix, its max weight and the weight on the embedding.",
        compare=Comparison(difference=("entropy", "max_weight", "embedding_weight"), keys=("site",)),
    ),
    View(
        "attnres_query_norms",
        "AttnRes pseudo-query norms",
        "attnres",
        build_query_norms,
        description="Norm of each site's learned pseudo-query; zero means a uniform mix.",
        compare=Comparison(difference=("query_norm",), keys=("site",)),
    ),
    View(
        "attnres_scale_bias",
        "Residual scale and bias per depth",
        "attnres",
        build_scale_bias,
        description="Scale/bias residual mode: learned per-layer scale and bias against their initial values.",
        compare=Comparison(difference=("scale_mean", "bias_mean"), keys=("layer", "side")),
    ),
    View(
        "attnres_hidden_rms",
        "Hidden-state RMS by depth",
        "attnres",
        build_hidden_rms,
        description="Residual growth: RMS of the hidden state entering each layer.",
        compare=Comparison(difference=("mean", "median"), keys=("label",)),
    ),
]
