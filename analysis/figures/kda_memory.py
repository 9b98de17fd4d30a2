"""Figures of KDA memory per layer and head: the decay (memory half-life over key channels, share near the lower
bound), the write strength beta, and the state norm over time (analysis.metrics.kda_memory). Shown on the density
page beside the allocation views (analysis.figures.density).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.figures.style import LAYER_TYPE_COLORS, LEGEND_RIGHT, RUN_COLORS, apply_style, mark_repeat_start
from analysis.metrics import kda_memory as km
from analysis.output.format import format_tokens
from analysis.runs.context import AnalysisContext
from analysis.views import picks as pk
from analysis.views import view
from analysis.views.view import Comparison, NotApplicable, View
from k3core.interp.trace import names


def _require_kda(ctx: AnalysisContext) -> None:
    if not any(names.kda_g(i) in ctx.trace for i in ctx.trace.layer_indices("kda")):
        raise NotApplicable("no KDA data in this trace (no KDA layers, or recorded without 'kda')")


def _box_from_quantiles(
    fig: go.Figure,
    x: list[str],
    q: dict[str, np.ndarray],
    name: str,
    color: str,
    hover: list[str],
    row: int | None = None,
) -> None:
    trace = go.Box(
        x=x,
        q1=q["q1"],
        median=q["median"],
        q3=q["q3"],
        lowerfence=q["lo"],
        upperfence=q["hi"],
        name=name,
        marker_color=color,
        boxpoints=False,
        hovertext=hover,
        hoverinfo="text+y",
    )
    if row is None:
        fig.add_trace(trace)
    else:
        fig.add_trace(trace, row=row, col=1)
    # a label under every box (plotly's own ticks drop every other one on a category axis of 20+ boxes); upright
    # text, smaller, once they would no longer fit side by side
    many = len(x) > 16
    fig.update_xaxes(
        type="category",
        tickmode="array",
        tickvals=list(x),
        ticktext=list(x),
        tickangle=-90 if many else 0,
        tickfont={"size": 10 if many else 12},
    )


MAX_HEAD_BOXES = 64  # above this many KDA (layer, head) pairs, distributions are pooled per layer
MAX_HEAD_LINES = 24


def _group_label(layer: int, head: int | None) -> str:
    return f"L{layer}" if head is None else f"L{layer} h{head}"


def build_kda_decay(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Per KDA layer/head (pooled per layer when there are many heads): spread over key channels of the
    half-life ln 2 / (-mean_t g) (``analysis.metrics.kda_memory.half_life``), and the share of decays near the lower
    bound (g < 0.9 lb)."""
    _require_kda(ctx)
    choices = pk.kda_choices(ctx)
    layer, head = pk.picked(ctx, choices)
    chan = pk.filter_picked(km.kda_channel_decay(ctx.trace), layer, head)
    stats = pk.filter_picked(km.kda_decay_stats(ctx.trace), layer, head)
    per_head = len(stats) <= MAX_HEAD_BOXES
    keys = ["layer", "head"] if per_head else ["layer"]
    if not per_head:
        stats = stats.groupby("layer", as_index=False).agg(
            g_mean=("g_mean", "mean"),
            alpha_mean=("alpha_mean", "mean"),
            half_life_median=("half_life_median", "median"),
            frac_near_lb=("frac_near_lb", "mean"),
        )
    cap = float(ctx.config.max_position_embeddings)
    stats_names = ("lo", "q1", "median", "q3", "hi")
    rows = []
    for key, g in chan.groupby(keys):
        key = key if isinstance(key, tuple) else (key,)
        hz = km.half_life_quantiles(g["g_mean"], (0.0, 0.25, 0.5, 0.75, 1.0))
        rows.append({**dict(zip(keys, key)), **{f"channel_half_life_{k}": v for k, v in zip(stats_names, hz)}})
    table = stats.merge(pd.DataFrame(rows), on=keys)
    shown = {k: np.minimum(table[f"channel_half_life_{k}"].to_numpy(), cap) for k in stats_names}
    heads = table["head"] if per_head else [None] * len(table)
    x = [_group_label(layer, head) for layer, head in zip(table["layer"], heads)]
    what = "layer/head" if per_head else "layer (all heads pooled)"
    hover = [
        f"layer {r.layer}, {f'head {r.head}' if per_head else 'all heads'}<br>"
        f"median half-life over channels {r.channel_half_life_median:.3g} tokens"
        for r in table.itertuples()
    ]
    lower_bound = ctx.config.kda_gate == "lower_bound"
    fig = make_subplots(
        rows=2 if lower_bound else 1,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        row_heights=[0.7, 0.3] if lower_bound else None,
    )
    _box_from_quantiles(fig, x, shown, "half-life over key channels", LAYER_TYPE_COLORS["KDA"], hover, row=1)
    fig.update_yaxes(type="log", title_text=f"half-life (tokens, capped at {format_tokens(int(cap))})", row=1, col=1)
    if lower_bound:
        lb = ctx.config.kda_gate_lower_bound
        fig.add_trace(
            go.Bar(
                x=x,
                y=table["frac_near_lb"],
                name=f"share g < {km.NEAR_LOWER_BOUND:g} x ({lb:g})",
                marker_color="#555",
                hovertemplate="%{x}<br>share near lower bound = %{y:.3f}<extra></extra>",
            ),
            row=2,
            col=1,
        )
        fig.update_yaxes(title_text="share near bound", range=[0, 1], row=2, col=1)
    fig.update_xaxes(title_text=f"KDA {what}", row=2 if lower_bound else 1, col=1)
    focus = pk.pick_title(choices, layer, head)
    shown = focus or f" per {what}"  # a pick names what is shown
    apply_style(fig, f"KDA decay: half-life ln 2/(-g){shown} — {ctx.label}", height=560)
    return fig, table


def build_kda_beta(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Per KDA layer/head (pooled per layer when there are many heads): the write strength beta over
    tokens (box: min, p10, median, p90, max)."""
    _require_kda(ctx)
    choices = pk.kda_choices(ctx)
    layer, head = pk.picked(ctx, choices)
    table = pk.filter_picked(km.kda_beta_stats(ctx.trace), layer, head)
    per_head = len(table) <= MAX_HEAD_BOXES
    if not per_head and head is None:
        table = pk.filter_picked(km.kda_beta_stats(ctx.trace, by="layer"), layer, None)
    per_head = "head" in table
    heads = table["head"] if per_head else [None] * len(table)
    x = [_group_label(layer, head) for layer, head in zip(table["layer"], heads)]
    hover = [f"{label}<br>mean β {r.mean:.3f} (std {r.std:.3f})" for label, r in zip(x, table.itertuples())]
    what = "layer/head" if per_head else "layer (all heads pooled)"
    fig = go.Figure()
    _box_from_quantiles(
        fig,
        x,
        {"lo": table["min"], "q1": table["p10"], "median": table["median"], "q3": table["p90"], "hi": table["max"]},
        "β over tokens (box: p10-p90)",
        LAYER_TYPE_COLORS["KDA"],
        hover,
    )
    fig.update_yaxes(range=[0, 1])
    focus = pk.pick_title(choices, layer, head)
    apply_style(fig, f"KDA write strength β{focus or f' per {what}'} — {ctx.label}", f"KDA {what}", "β (0..1)")
    return fig, table


def build_kda_state_norm(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """||S||_F of each KDA head's state at chunk ends, over token position (mean over heads per layer,
    with the heads' min-max in the hover, when there are many heads)."""
    _require_kda(ctx)
    table = km.kda_state_norms(ctx.trace)
    if table.empty:
        raise NotApplicable("trace has no kda.*.state_norm arrays")
    choices = pk.kda_state_choices(ctx)
    picked_layer, picked_head = pk.picked(ctx, choices)
    table = pk.filter_picked(table, picked_layer, picked_head)
    fig = go.Figure()
    layers = sorted(table["layer"].unique())
    per_head = len(table.drop_duplicates(["layer", "head"])) <= MAX_HEAD_LINES
    for li, layer in enumerate(layers):
        color = RUN_COLORS[li % len(RUN_COLORS)]
        sub = table[table["layer"] == layer]
        if not per_head:
            g = sub.groupby("token")["state_norm"].agg(["mean", "min", "max"]).reset_index()
            fig.add_trace(
                go.Scatter(
                    x=g["token"],
                    y=g["mean"],
                    mode="lines+markers",
                    name=f"L{layer}",
                    line={"color": color, "dash": ("solid", "dot", "dash", "dashdot")[(li // len(RUN_COLORS)) % 4]},
                    customdata=g[["min", "max"]].to_numpy(),
                    text=ctx.position_labels(g["token"] - 1),  # the chunk's last token: S has read it
                    hovertemplate=f"layer {layer}, mean over heads<br>after token %{{text}}<br>‖S‖_F = %{{y:.4g}} "
                    "(heads %{customdata[0]:.4g}..%{customdata[1]:.4g})<extra></extra>",
                )
            )
            continue
        for head, g in sub.groupby("head"):
            fig.add_trace(
                go.Scatter(
                    x=g["token"],
                    y=g["state_norm"],
                    mode="lines+markers",
                    name=f"L{layer}",  # one legend entry per layer (heads: line styles, named in the hover)
                    legendgroup=f"L{layer}",
                    showlegend=bool(head == sub["head"].min()),
                    line={"color": color, "dash": ("solid", "dot", "dash", "dashdot")[int(head) % 4]},
                    text=ctx.position_labels(g["token"] - 1),  # the chunk's last token: S has read it
                    hovertemplate=f"layer {layer}, head {head}<br>after token %{{text}}<br>‖S‖_F = %{{y:.4g}}"
                    "<extra></extra>",
                )
            )
    what = "per layer/head" if per_head else "per layer (mean over heads)"
    focus = pk.pick_title(choices, picked_layer, picked_head)
    apply_style(
        fig,
        f"KDA state norm over time, {focus.removeprefix(', ') or what} — {ctx.label}",
        "tokens read (labelled with the chunk's last token)",
        "state Frobenius norm ‖S‖_F",
    )
    # x = tokens read at the chunk end (64: tokens 0..63), so a tick names token x - 1, the last one read
    axis = ctx.token_axis(table["token"] - 1)
    if axis:
        axis["tickvals"] = [v + 1 for v in axis["tickvals"]]
    fig.update_xaxes(**axis)
    mark_repeat_start(fig, ctx.repeat_start)  # x = tokens read: the first copy is read once x reaches it
    if len(layers) > 4:  # many entries: legend as a column on the right
        fig.update_layout(legend=dict(LEGEND_RIGHT))
    return fig, table


VIEWS: list[View] = [
    View(
        "kda_decay",
        "KDA decay and memory half-life",
        "density",
        build_kda_decay,
        description="Memory half-life ln 2/(-g) in tokens over key channels per KDA head; share of decays near "
        "the lower bound.",
        compare=Comparison(difference=("g_mean", "frac_near_lb"), keys=("layer", "head")),
        picks=view.Picks((view.LAYER, view.HEAD), pk.kda_choices),
    ),
    View(
        "kda_beta",
        "KDA write strength β",
        "density",
        build_kda_beta,
        description="Distribution of the delta-rule write strength β per KDA head.",
        compare=Comparison(difference=("mean",), keys=("layer", "head")),
        picks=view.Picks((view.LAYER, view.HEAD), pk.kda_choices),
    ),
    View(
        "kda_state_norm",
        "KDA state norm over time",
        "density",
        build_kda_state_norm,
        description="Frobenius norm of each KDA head's state at chunk ends.",
        compare=Comparison(difference=("state_norm",), keys=("layer", "head", "token"), reduce=("head",), x="token"),
        picks=view.Picks((view.LAYER, view.HEAD), pk.kda_state_choices),
    ),
]
