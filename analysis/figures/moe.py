"""Figures for LatentMoE (analysis.metrics.moe): load heatmap, imbalance, weight by rank, co-activation,
next-token reuse, latent PCA and router bias.

Per-layer figures (co-activation, latent PCA) show one MoE layer at a time with a layer dropdown;
``ctx.options["layer"]`` picks a single layer (default: all, up to a size budget). The load heatmap and the
weight by rank also focus on a picked layer (``analysis.views.picks``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from analysis.figures.style import RUN_COLORS, SEQUENTIAL, apply_style
from analysis.metrics import moe as mo
from analysis.metrics.null_reference import AT_REFERENCE, balanced_routing_floor
from analysis.runs.context import AnalysisContext
from analysis.views import picks as pk
from analysis.views import view
from analysis.views.view import Comparison, NotApplicable, View
from k3core.interp.trace import names

COACT_CELL_BUDGET = 1_000_000  # E * E * layers shown in one co-activation figure
PCA_POINT_BUDGET = 200_000


def _require_moe(ctx: AnalysisContext) -> list[int]:
    layers = mo.moe_layers(ctx.trace)
    if not layers:
        why = (
            "the run has no MoE layers (num_experts=0)"
            if not ctx.config.num_experts
            else "the trace was recorded without 'moe'"
        )
        raise NotApplicable(f"no MoE routing data: {why}")
    return layers


def _layers_with(ctx: AnalysisContext, array: Callable[[int], str], hint: str = "") -> list[int]:
    """The MoE layers whose ``array(i)`` is in the trace; NotApplicable (naming the array) when none is."""
    layers = [i for i in _require_moe(ctx) if array(i) in ctx.trace]
    if not layers:
        raise NotApplicable(f"trace has no {array('*')} arrays{hint}")
    return layers


def _pick_layers(ctx: AnalysisContext, layers: list[int], cost_per_layer: int, budget: int) -> list[int]:
    layer, _ = pk.picked(ctx, view.PickChoices("MoE", tuple(layers)), (view.LAYER,))
    if layer is not None:
        return [layer]
    n = max(1, budget // max(cost_per_layer, 1))
    if n >= len(layers):
        return layers
    idx = np.unique(np.linspace(0, len(layers) - 1, n).round().astype(int))
    return [layers[i] for i in idx]


def _layer_dropdown(fig: go.Figure, layers: list[int], traces_per_layer: list[int], titles: list[str]) -> None:
    """Show one layer's traces at a time; a dropdown switches layers (first layer visible)."""
    if len(layers) <= 1:
        return
    total = sum(traces_per_layer)
    buttons, start = [], 0
    for layer, n, title in zip(layers, traces_per_layer, titles):
        vis = [False] * total
        vis[start : start + n] = [True] * n
        buttons.append(
            {"label": f"layer {layer}", "method": "update", "args": [{"visible": vis}, {"title.text": title}]}
        )
        start += n
    fig.update_layout(
        updatemenus=[
            {
                "buttons": buttons,
                "x": 1.0,
                "xanchor": "right",
                "y": 1.16,
                "yanchor": "top",
                "direction": "down",
                "showactive": True,
            }
        ]
    )


def build_load_heatmap(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Layers x experts heatmap of each expert's share of its layer's assignments (whole batch)."""
    _require_moe(ctx)
    choices = pk.moe_choices(ctx)
    layer, _ = pk.picked(ctx, choices, (view.LAYER,))
    table = pk.filter_picked(mo.expert_load(ctx.trace), layer, None)
    share = table.pivot(index="layer", columns="expert", values="share").sort_index()
    count = table.pivot(index="layer", columns="expert", values="count").sort_index()
    E = share.shape[1]
    first = int(share.index[0])
    k = mo.top_k_of(ctx.trace, first)
    tokens = int(round(count.loc[first].sum() / k))
    floor = balanced_routing_floor(tokens, k, E)
    inside = float(((share >= floor.share_lo) & (share <= floor.share_hi)).to_numpy().mean())
    table = table.assign(share_floor_lo=floor.share_lo, share_floor_hi=floor.share_hi)
    fig = go.Figure(
        go.Heatmap(
            z=share.to_numpy(),
            x=list(share.columns),
            y=[f"L{i}" for i in share.index],
            colorscale=SEQUENTIAL,
            zmin=0,
            customdata=count.to_numpy(),
            colorbar={"title": {"text": "share of the layer's assignments"}, "tickformat": ".1%"},
            hovertemplate="layer %{y}, expert %{x}<br>share %{z:.2%} (%{customdata} assignments)<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    apply_style(
        fig,
        f"Expert load per layer{pk.pick_title(choices, layer, None)} (uniform = {1 / E:.2%}; balanced routing of "
        f"{tokens:,} tokens spreads shares over {floor.share_lo:.2%}-{floor.share_hi:.2%} (95%): {inside:.0%} of "
        f"cells lie within it) — {ctx.label}",
        "expert",
        "MoE layer",
        height=max(300, 90 + 24 * len(share)),
    )
    return fig, table


def build_imbalance(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Per MoE layer: MaxVio, CV, normalised entropy and dead experts."""
    _require_moe(ctx)
    table = mo.imbalance_table(ctx.trace)
    panels = [
        ("max_vio", "MaxVio = max c / mean c - 1"),
        ("cv", "CV = std c / mean c"),
        ("entropy", "normalised entropy (1 = balanced)"),
        ("dead", "dead experts (c = 0)"),
    ]
    fig = make_subplots(
        rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.05, subplot_titles=[t for _, t in panels]
    )
    custom = table[["min_over_mean", "experts", "total"]].to_numpy()
    for row, (col, name) in enumerate(panels, start=1):
        fig.add_trace(
            go.Bar(
                x=table["layer"],
                y=table[col],
                name=name,
                marker_color=RUN_COLORS[row - 1],
                showlegend=False,
                customdata=custom,
                hovertemplate=f"layer %{{x}}<br>{name}: %{{y:.4g}}<br>min/mean %{{customdata[0]:.3f}}, "
                "%{customdata[1]} experts, %{customdata[2]} assignments<extra></extra>",
            ),
            row=row,
            col=1,
        )
        if col in ("max_vio", "cv"):  # the sampling floor of perfectly balanced routing at this token count
            mean, hi = table[f"{col}_floor"], table[f"{col}_floor_hi"]
            fig.add_trace(
                go.Scatter(
                    x=table["layer"],
                    y=mean,
                    mode="markers",
                    name="balanced routing: sampling floor (mean, bar to 97.5%)",
                    legendgroup="floor",
                    showlegend=row == 1,
                    marker={"color": "#444", "symbol": "line-ew-open", "size": 14, "line": {"width": 2}},
                    error_y={"type": "data", "symmetric": False, "array": hi - mean, "arrayminus": 0 * mean},
                    hovertemplate=f"layer %{{x}}<br>{col.replace('_', ' ')} of balanced routing: mean %{{y:.3g}}"
                    "<extra></extra>",
                ),
                row=row,
                col=1,
            )
        fig.update_yaxes(title_text=col.replace("_", " "), row=row, col=1)
    fig.update_yaxes(rangemode="nonnegative")
    fig.update_yaxes(range=[0, 1.02], row=3, col=1)
    fig.update_xaxes(title_text="MoE layer (0-based)", dtick=1 if len(table) <= 40 else None, row=len(panels), col=1)
    within = int(table["within_floor"].sum())
    words = (
        f"{within} of {len(table)} layers within the sampling floor of balanced routing at "
        f"{int(table['tokens'].iloc[0]):,} tokens"
        if len(table)
        else ""
    )
    apply_style(fig, f"Expert load imbalance per layer ({words}) — {ctx.label}", height=720)
    fig.update_layout(legend={"orientation": "h", "y": -0.08, "x": 0.0})
    return fig, table


def build_weight_by_rank(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Mean routing weight of the 1st..k-th chosen expert, one line per MoE layer."""
    _require_moe(ctx)
    table = mo.weight_by_rank(ctx.trace)
    if table.empty:
        raise NotApplicable("trace has no moe.*.weights arrays")
    choices = view.PickChoices("MoE", tuple(sorted(int(v) for v in table["layer"].unique())))
    picked_layer, _ = pk.picked(ctx, choices, (view.LAYER,))
    table = pk.filter_picked(table, picked_layer, None)
    fig = go.Figure()
    layers = sorted(table["layer"].unique())
    for li, layer in enumerate(layers):
        g = table[table["layer"] == layer]
        fig.add_trace(
            go.Scatter(
                x=g["rank"],
                y=g["mean_weight"],
                mode="lines+markers",
                name=f"layer {layer}",
                line={"color": RUN_COLORS[li % len(RUN_COLORS)]},
                error_y={"type": "data", "array": g["std_weight"], "visible": len(layers) <= 4},
                hovertemplate=f"layer {layer}, rank %{{x}}<br>mean weight %{{y:.4f}}<extra></extra>",
            )
        )
    fig.update_xaxes(dtick=1)
    apply_style(
        fig,
        f"Routing weight by rank{pk.pick_title(choices, picked_layer, None)} — {ctx.label}",
        "rank of chosen expert (1 = largest weight)",
        "mean routing weight",
    )
    return fig, table


def build_coactivation(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Expert co-activation: share of tokens choosing both i and j (diagonal: tokens choosing i), per layer."""
    layers = _layers_with(ctx, names.moe_experts)
    E = mo.num_experts_of(ctx.trace, layers[0])
    shown = _pick_layers(ctx, layers, E * E, COACT_CELL_BUDGET)
    table = mo.coactivation_table(ctx.trace, shown)
    fig = go.Figure()
    titles = []
    for n, layer in enumerate(shown):
        g = table[table["layer"] == layer]
        rate = g.pivot(index="expert_i", columns="expert_j", values="rate").to_numpy().copy()
        count = g.pivot(index="expert_i", columns="expert_j", values="count").to_numpy()
        independent = g.pivot(index="expert_i", columns="expert_j", values="independent").to_numpy()
        off = rate.copy()
        np.fill_diagonal(off, np.nan)  # the diagonal (own frequency) would swamp the colour scale
        fig.add_trace(
            go.Heatmap(
                z=off,
                x=list(range(E)),
                y=list(range(E)),
                colorscale=SEQUENTIAL,
                zmin=0,
                visible=n == 0,
                customdata=np.stack([count, np.broadcast_to(np.diag(count), count.shape), independent], axis=-1),
                colorbar={"title": {"text": "share of tokens"}},
                hovertemplate=(
                    f"layer {layer}<br>experts %{{y}} and %{{x}}: %{{z:.2%}} of tokens "
                    "(%{customdata[0]} tokens; expert %{y} chosen by %{customdata[1]})<br>"
                    "independence p_i p_j: %{customdata[2]:.2%}<extra></extra>"
                ),
            )
        )
        off_diag = ~np.eye(E, dtype=bool)
        lift = np.abs(rate[off_diag] - independent[off_diag]) <= AT_REFERENCE * independent[off_diag]
        titles.append(  # two short lines: the layer dropdown sits at the top right
            f"Expert co-activation, layer {layer} — {ctx.label}<br>diagonal blank; {lift.mean():.0%} of pairs "
            f"within {AT_REFERENCE:.0%} of independence p_i p_j"
        )
    fig.update_yaxes(autorange="reversed")
    apply_style(fig, titles[0], "expert j", "expert i", height=520)
    _layer_dropdown(fig, shown, [1] * len(shown), titles)
    return fig, table


def build_reuse(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Next-token expert reuse per MoE layer, against the chance level k / E."""
    _require_moe(ctx)
    table = mo.reuse_table(ctx.trace)
    if table.empty:
        raise NotApplicable("trace has no moe.*.experts arrays")
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=table["layer"],
            y=table["reuse"],
            name="reuse",
            marker_color=RUN_COLORS[2],
            customdata=table[["k", "experts"]].to_numpy(),
            hovertemplate="layer %{x}<br>reuse %{y:.3f} (k = %{customdata[0]} of %{customdata[1]})<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=table["layer"],
            y=table["chance"],
            mode="lines+markers",
            name="chance k/E",
            line={"color": "#777", "dash": "dash"},
            hovertemplate="layer %{x}<br>chance k/E = %{y:.3f}<extra></extra>",
        )
    )
    fig.update_yaxes(range=[0, 1.02])
    fig.update_xaxes(dtick=1 if len(table) <= 40 else None)
    apply_style(
        fig,
        f"Next-token expert reuse — {ctx.label}",
        "MoE layer (0-based)",
        "share of token t's experts chosen again at t+1",
    )
    return fig, table


def build_latent_pca(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """2-D PCA of the routed-expert inputs z per token, coloured by top-1 expert (one layer at a time)."""
    layers = _layers_with(ctx, names.moe_latent, " (record with 'latent')")
    n_tok = int(np.prod(ctx.trace[names.moe_latent(layers[0])].shape[:2]))
    shown = _pick_layers(ctx, layers, n_tok, PCA_POINT_BUDGET)
    E = mo.num_experts_of(ctx.trace, shown[0])
    palette = qualitative.Dark24 if E <= 24 else None
    what = "latent z = W_down x" if ctx.config.is_latent_moe else "router input x (plain MoE)"
    fig = go.Figure()
    frames, counts, titles = [], [], []
    for n, layer in enumerate(shown):
        df, ratio = mo.latent_pca(ctx.trace, layer)
        df = df.assign(pc1_ratio=ratio[0], pc2_ratio=ratio[1])
        frames.append(df)
        hover = (
            "layer " + str(layer) + ", token %{customdata[0]} %{text} (id %{customdata[1]})<br>top-1 expert "
            "%{customdata[2]} (weight %{customdata[3]:.3f})<extra></extra>"
        )
        before = len(fig.data)
        if palette is not None:
            for e, g in df.groupby("top1_expert"):
                # One trace per expert: the expert goes into the hover text, not into every point's data.
                # float32: positions and token ids (< 2**24) stay exact, the weight is printed with 3 decimals;
                # half the bytes of float64 for the browser (the table keeps full precision).
                hover_e = (
                    f"layer {layer}, token %{{customdata[0]}} %{{text}} (id %{{customdata[1]}})<br>top-1 expert {e} "
                    "(weight %{customdata[2]:.3f})<extra></extra>"
                )
                fig.add_trace(
                    go.Scatter(
                        x=g["pc1"],
                        y=g["pc2"],
                        mode="markers",
                        name=f"{e}",
                        visible=n == 0,
                        marker={"size": 5, "color": palette[int(e) % len(palette)], "opacity": 0.75},
                        customdata=g[["token", "token_id", "top1_weight"]].to_numpy(dtype=np.float32),
                        text=ctx.token_texts(g["token_id"]),
                        hovertemplate=hover_e,
                        legendgroup=f"e{e}",
                    )
                )
        else:
            fig.add_trace(
                go.Scatter(
                    x=df["pc1"],
                    y=df["pc2"],
                    mode="markers",
                    name=f"layer {layer}",
                    visible=n == 0,
                    marker={
                        "size": 4,
                        "color": df["top1_expert"],
                        "colorscale": SEQUENTIAL,
                        "showscale": True,
                        "colorbar": {"title": {"text": "top-1 expert"}},
                        "opacity": 0.75,
                    },
                    customdata=df[["token", "token_id", "top1_expert", "top1_weight"]].to_numpy(),
                    text=ctx.token_texts(df["token_id"]),
                    hovertemplate=hover,
                )
            )
        counts.append(len(fig.data) - before)
        titles.append(
            f"MoE {what}, layer {layer}: PCA (PC1 {ratio[0]:.0%}, PC2 {ratio[1]:.0%} of variance) — {ctx.label}"
        )
    apply_style(fig, titles[0], "PC1", "PC2", height=520)
    if palette is not None:  # one legend entry per expert: a column on the right, clear of the title
        fig.update_layout(
            legend={
                "orientation": "v",
                "x": 1.02,
                "xanchor": "left",
                "y": 1.0,
                "yanchor": "top",
                "title": {"text": "top-1 expert"},
            }
        )
    _layer_dropdown(fig, shown, counts, titles)
    return fig, pd.concat(frames, ignore_index=True)


VIEWS: list[View] = [
    View(
        "moe_load_heatmap",
        "Expert load heatmap",
        "moe",
        build_load_heatmap,
        description="Share of each layer's assignments per expert, layers x experts.",
        compare=Comparison(difference=("share",), keys=("layer", "expert"), x="expert", same_weights=True),
        picks=view.Picks((view.LAYER,), pk.moe_choices),
    ),
    View(
        "moe_imbalance",
        "Expert load imbalance",
        "moe",
        build_imbalance,
        description="MaxVio, CV, normalised entropy and dead experts per MoE layer.",
        compare=Comparison(difference=("max_vio", "cv", "entropy", "dead"), keys=("layer",)),
    ),
    View(
        "moe_weight_by_rank",
        "Routing weight by rank",
        "moe",
        build_weight_by_rank,
        description="Mean routing weight of the 1st..k-th chosen expert.",
        compare=Comparison(difference=("mean_weight",), keys=("layer", "rank"), x="rank"),
        picks=view.Picks((view.LAYER,), pk.moe_choices),
    ),
    View(
        "moe_coactivation",
        "Expert co-activation",
        "moe",
        build_coactivation,
        description="How often two experts are chosen for the same token, per layer.",
        compare=Comparison(
            difference=("rate",), keys=("layer", "expert_i", "expert_j"), x="expert_j", same_weights=True
        ),
        picks=view.Picks((view.LAYER,), pk.moe_choices, one_at_a_time=True),
    ),
    View(
        "moe_reuse",
        "Next-token expert reuse",
        "moe",
        build_reuse,
        description="Share of a token's experts also chosen for the next token, against chance k/E.",
        compare=Comparison(difference=("reuse",), keys=("layer",)),
    ),
    View(
        "moe_latent_pca",
        "Latent routing PCA",
        "moe",
        build_latent_pca,
        description="2-D PCA of the latent vectors routed to experts, coloured by top-1 expert.",
        compare=Comparison(no_difference="PCA axes of two runs are not the same directions: compare the two halves"),
        picks=view.Picks((view.LAYER,), pk.moe_latent_choices, one_at_a_time=True),
    ),
]
