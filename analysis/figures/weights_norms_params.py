"""Weight figures of the RMSNorm gains by depth and the parameter counts by depth and kind
(``analysis.weights``)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from analysis import weights as wt
from analysis.figures.style import LAYER_TYPE_COLORS, LEGEND_RIGHT, RUN_COLORS, apply_style
from analysis.figures.weights_source import run_label, weights_of
from analysis.runs.context import AnalysisContext
from analysis.views.view import NotApplicable

KIND_COLORS = {
    "KDA": LAYER_TYPE_COLORS["KDA"],
    "MLA": LAYER_TYPE_COLORS["MLA"],
    "dense FFN": LAYER_TYPE_COLORS["dense FFN"],
    "routed experts": LAYER_TYPE_COLORS["LatentMoE"],
    "shared experts": "#9467bd",
    "norms/other": "#bcbd22",
    "embedding / LM head": "#8c564b",
}
NORM_LABELS = {
    "input": "input RMSNorm",
    "post_attention": "post-attention RMSNorm",
    "kda_o_norm": "KDA output norm",
    "latent_expert_norm": "latent expert norm",
}


def build_norms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """RMSNorm weights by depth: mean (solid) and max (dotted) of each norm kind."""
    s = weights_of(ctx)
    table = s.norms
    if table.empty:
        raise NotApplicable("no norm weights found")
    fig = go.Figure()
    for k, (norm, g) in enumerate(table.groupby("norm", sort=False)):
        color = RUN_COLORS[k % len(RUN_COLORS)]
        label = NORM_LABELS.get(norm, norm)
        for stat, dash in (("mean", "solid"), ("max", "dot")):
            fig.add_trace(
                go.Scatter(
                    x=g["layer"],
                    y=g[stat],
                    mode="lines+markers",
                    name=f"{label} ({stat})",
                    legendgroup=norm,
                    line={"color": color, "dash": dash},
                    marker={"size": 5},
                    hovertemplate=f"layer %{{x}}<br>{label} {stat} %{{y:.4g}}<extra></extra>",
                )
            )
    apply_style(
        fig,
        f"Norm weights by depth (mean solid, max dotted) — {run_label(ctx, s)}",
        "layer (0-based)",
        "RMSNorm weight (gain, unitless)",
        height=460,
    )
    # eight entries: a legend beside the plot, not over the title
    fig.update_layout(legend=dict(LEGEND_RIGHT), margin={"r": 250})
    return fig, table


def build_params(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Parameters by depth and kind (stacked bars), from the checkpoint's header shapes."""
    s = weights_of(ctx)
    table = s.params
    if table.empty:
        raise NotApplicable("no tensors")
    order = list(dict.fromkeys(table.sort_values("layer")["depth"]))
    fig = go.Figure()
    for kind in wt.KINDS:
        g = table[table["kind"] == kind]
        if g.empty:
            continue
        fig.add_trace(
            go.Bar(
                x=g["depth"],
                y=g["params"],
                name=kind,
                marker_color=KIND_COLORS.get(kind, "#777"),
                hovertemplate=f"%{{x}}<br>{kind}: %{{y:,}} parameters<extra></extra>",
            )
        )
    fig.update_layout(barmode="stack")
    fig.update_xaxes(categoryorder="array", categoryarray=order)
    apply_style(
        fig,
        f"Parameters by depth and kind ({s.total_params:,} in all, from the headers) — {run_label(ctx, s)}",
        "depth (embedding, decoder layers, output)",
        "parameters (count)",
    )
    return fig, table
