"""Figures for AttnRes (analysis.metrics.attnres): depth-weight map, per-site statistics, pseudo-query norms,
scale/bias per depth and residual growth."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis.figures.style import RUN_COLORS, SEQUENTIAL, apply_style
from analysis.metrics import attnres as ar
from analysis.runs.context import AnalysisContext
from analysis.views import picks as pk
from analysis.views import view
from analysis.views.view import Comparison, NotApplicable, View
from k3core.modeling.hooks import AttnResSite


def _require_attnres(ctx: AnalysisContext) -> None:
    if not ar.sites(ctx.trace):
        mode = ctx.config.residual
        why = (
            "the run uses a plain/scale-bias residual"
            if mode in ("plain", "scale_bias")
            else "the trace was recorded without 'attnres'"
        )
        raise NotApplicable(f"no AttnRes depth weights: {why} (residual={mode!r})")


def attnres_choices(ctx: AnalysisContext) -> view.PickChoices:
    """Decoder layers with AttnRes sites in the trace (the output mix is not a layer)."""
    _require_attnres(ctx)
    layers = sorted({where.layer for site in ar.sites(ctx.trace) if not (where := AttnResSite.parse(site)).is_output})
    return view.PickChoices("AttnRes", tuple(layers))


def _site_label(site: str) -> str:
    return "output mix" if site == "output" else f"L{site.replace('.', ' ')}"


def build_depth_weights(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Sites x sources heatmap of the depth-softmax weights, mean over tokens."""
    choices = attnres_choices(ctx)
    layer, _ = pk.picked(ctx, choices, (view.LAYER,))
    table = ar.depth_weights(ctx.trace)
    if layer is not None:  # the picked layer's sites (its output-mix row is not a layer's)
        table = pk.filter_picked(table[table["side"] != "output"], layer, None)
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
        f"AttnRes depth weights per site{pk.pick_title(choices, layer, None)} (mean over tokens) — {ctx.label}",
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
        picks=view.Picks((view.LAYER,), attnres_choices),
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
        "attnres_hidden_rms",
        "Hidden-state RMS by depth",
        "attnres",
        build_hidden_rms,
        description="Residual growth: RMS of the hidden state entering each layer.",
        compare=Comparison(difference=("mean", "median"), keys=("label",)),
    ),
]
