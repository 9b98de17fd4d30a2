"""Figures of KDA's implicit attention beside MLA's attention (``analysis.metrics.kda_attention``): one figure per
statistic with every head of both kinds (layer kind as colour, the uniform-causal null reference drawn), the sink rate
per layer and kind (Gu et al. 2024), the KDA window map and reach vs resting half-life. The distance profile over
position is a Long context view (``analysis.figures.long_context``). One View per figure; their sections are the
Degradation and KDA & density pages."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.subplots import make_subplots

from analysis.figures.style import DIVERGING, LAYER_TYPE_COLORS, SEQUENTIAL, apply_style
from analysis.figures.weights_source import weights_of
from analysis.metrics import attention as at
from analysis.metrics import kda_attention as ka
from analysis.runs.context import AnalysisContext
from analysis.runs.missing_data import MissingTraceData
from analysis.views import picks as pk
from analysis.views import view
from analysis.views.view import Comparison, NotApplicable, View


def _guard(fn, *args):
    try:
        return fn(*args)
    except MissingTraceData as exc:
        raise NotApplicable(str(exc)) from exc


def _per_head_strip(df: pd.DataFrame, value: str, hover: str) -> go.Figure:
    """Every head as a point at its layer (jittered by head), coloured by layer kind."""
    fig = go.Figure()
    for kind in ("KDA", "MLA"):
        part = df[df["kind"] == kind]
        if part.empty:
            continue
        heads = max(1, int(df["head"].max()) + 1)
        fig.add_trace(
            go.Scatter(
                x=part["layer"] + (part["head"] - (heads - 1) / 2) * 0.5 / heads,
                y=part[value],
                mode="markers",
                name=f"{kind} heads",
                marker={"color": LAYER_TYPE_COLORS[kind], "size": 9},
                customdata=part[["layer", "head"]].to_numpy(),
                hovertemplate=f"{kind} layer %{{customdata[0]}} head %{{customdata[1]}}<br>{hover} %{{y:.3f}}"
                "<extra></extra>",
            )
        )
    fig.update_xaxes(dtick=1)
    return fig


def _null_line(fig: go.Figure, df: pd.DataFrame, y: float, name: str) -> None:
    """The null reference as a dotted line across the layers with its own legend entry (a note on the line would
    sit over the heads' points)."""
    lo, hi = float(df["layer"].min()) - 0.5, float(df["layer"].max()) + 0.5
    fig.add_trace(
        go.Scatter(
            x=[lo, hi],
            y=[y, y],
            mode="lines",
            name=name,
            line={"dash": "dot", "color": "#444"},
            hovertemplate=f"{name}<extra></extra>",
        )
    )


def build_kinds_entropy(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(ka.head_statistics_table, ctx.trace)
    fig = _per_head_strip(df, "entropy_norm", "H / log(t+1)")
    _null_line(fig, df, 1.0, "uniform causal attention (1)")
    apply_style(
        fig,
        f"Attention entropy per head, KDA (implicit, on |A|) and MLA, mean over queries — {ctx.label}",
        "layer (0-based)",
        "normalised entropy H / log(t+1)",
    )
    return fig, df


def build_kinds_sink(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(ka.head_statistics_table, ctx.trace)
    fig = _per_head_strip(df, "first_token_mass", "first-token mass")
    null = df.attrs["null_first_token_mass"]
    _null_line(fig, df, null, f"uniform causal attention (H_T/T = {null:.3f})")
    fig.add_hline(
        y=at.SINK_THRESHOLD,
        line_dash="dash",
        line_color="#999",
        annotation_text=f"sink threshold {at.SINK_THRESHOLD}",
        annotation_position="top left",
    )
    apply_style(
        fig,
        f"First-token (sink) mass per head, KDA (implicit, on |A|) and MLA — {ctx.label}",
        "layer (0-based)",
        "mean attention on token 0",
    )
    return fig, df


def build_kinds_received(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(ka.received_by_kind_table, ctx.trace)
    fig = go.Figure()
    for (kind, layer), part in df.groupby(["kind", "layer"], sort=False):
        fig.add_trace(
            go.Scatter(
                x=part["key"],
                y=part["received"],
                mode="lines+markers",
                name=f"{kind} layer {layer}",
                line={"color": LAYER_TYPE_COLORS[kind]},
                marker={"size": 4},
                hovertemplate=f"{kind} layer {layer}, key %{{x}}<br>received %{{y:.4f}}<extra></extra>",
            )
        )
    first = df[df["layer"] == df["layer"].iloc[0]]
    fig.add_trace(
        go.Scatter(
            x=first["key"],
            y=first["uniform"],
            mode="lines",
            name="uniform causal attention",
            line={"dash": "dot", "color": "#444"},
        )
    )
    fig.update_yaxes(type="log")
    apply_style(
        fig,
        f"Attention received per key position (mean over heads and the queries that see it) — {ctx.label}",
        "key position (token)",
        "mean attention received (log)",
    )
    return fig, df


def build_sink_rate(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Gu et al. 2024 ("When Attention Sink Emerges", arXiv 2410.10781), Fig. 2 style: the share of heads whose
    first-token mass exceeds the threshold, per layer and kind; beside it the rate of each kind against the
    threshold (the control), the chosen one marked."""
    heads = _guard(ka.head_statistics_table, ctx.trace)
    threshold = float(ctx.options.get("sink_threshold", at.SINK_THRESHOLD))
    df = (
        heads.assign(is_sink=heads["first_token_mass"] > threshold)
        .groupby(["kind", "layer"], as_index=False)["is_sink"]
        .mean()
        .rename(columns={"is_sink": "sink_rate"})
    )
    df["threshold"] = threshold
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.6, 0.4],
        shared_yaxes=True,
        subplot_titles=(f"per layer at threshold {threshold:g}", "per kind against the threshold"),
    )
    grid = np.linspace(0.0, 1.0, 101)
    for kind in ("KDA", "MLA"):
        part = df[df["kind"] == kind]
        if part.empty:
            continue
        color = LAYER_TYPE_COLORS[kind]
        fig.add_trace(
            go.Bar(
                x=part["layer"],
                y=part["sink_rate"],
                name=f"{kind} layers",
                marker_color=color,
                hovertemplate=f"{kind} layer %{{x}}<br>sink rate %{{y:.0%}}<extra></extra>",
            ),
            1,
            1,
        )
        mass = heads.loc[heads["kind"] == kind, "first_token_mass"].to_numpy()
        curve = [at.sink_rate(mass, t) for t in grid]
        fig.add_trace(
            go.Scatter(
                x=grid,
                y=curve,
                mode="lines",
                name=f"{kind} heads",
                line={"color": color},
                hovertemplate="threshold %{x:.2f}<br>sink rate %{y:.0%}<extra></extra>",
            ),
            1,
            2,
        )
    fig.add_vline(x=threshold, line_dash="dash", line_color="#444", row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    fig.update_xaxes(title_text="layer (0-based)", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="first-token mass threshold", row=1, col=2)
    apply_style(
        fig,
        f"Sink rate per layer and kind (Gu et al. 2024, arXiv 2410.10781) — {ctx.label}",
        None,
        None,
    )
    fig.update_yaxes(title_text="share of heads that sink", row=1, col=1)
    return fig, df


def build_kda_map(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    choices = pk.kda_attention_choices(ctx)
    layer, head = pk.picked(ctx, choices)
    layer = choices.layers[0] if layer is None else layer
    attn, before, (start, stop) = _guard(ka.kda_map, ctx.trace, layer, head)
    n = attn.shape[0]
    pos = np.arange(start, start + n)
    limit = float(np.abs(attn).max()) or 1.0
    fig = go.Figure(
        go.Heatmap(
            z=attn,
            x=pos,
            y=pos,
            colorscale=DIVERGING,
            zmin=-limit,
            zmax=limit,
            zmid=0.0,
            colorbar={"title": {"text": "A[t, s]"}},
            hovertemplate="query %{y}, key %{x}<br>A = %{z:.4g}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    who = "mean over heads" if head is None else f"head {head}"
    apply_style(
        fig,
        f"KDA implicit attention A (o = A v, signed), layer {layer}, {who}, window [{start}, {stop}) — {ctx.label}",
        "key position (token)",
        "query position (token)",
        height=520,
    )
    df = pd.DataFrame({"query": np.repeat(pos, n), "key": np.tile(pos, n), "attention": attn.ravel()})
    df = df[df["key"] <= df["query"]].reset_index(drop=True)
    df.attrs.update(keys=["query", "key"], value="attention", before=before.tolist(), layer=layer)
    return fig, df


def build_kda_reach(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    if not ka.kda_statistic_layers(ctx.trace):
        raise NotApplicable("no KDA implicit-attention statistics in this trace: record with 'kda_attn'")
    heads = weights_of(ctx).kda_heads
    if heads.empty:
        raise NotApplicable("no KDA resting decay from the weights (no config.json: gate form unknown)")
    df = _guard(ka.reach_table, ctx.trace, heads)
    # one legend entry per layer (a colour bar per figure doubled up when two runs stand side by side)
    fig = go.Figure()
    layers = sorted(df["layer"].unique())
    colours = sample_colorscale(SEQUENTIAL, [i / max(1, len(layers) - 1) for i in range(len(layers))])
    for layer, colour in zip(layers, colours, strict=True):
        part = df[df["layer"] == layer]
        fig.add_trace(
            go.Scatter(
                x=part["half_life_median"],
                y=part["reach_mean"],
                mode="markers",
                marker={"color": colour, "size": 10},
                customdata=part[["layer", "head", "reach_median"]].to_numpy(),
                hovertemplate="layer %{customdata[0]} head %{customdata[1]}<br>resting half-life %{x:.3g} tokens"
                "<br>reach: mean %{y:.3g}, median %{customdata[2]:.3g} tokens<extra></extra>",
                name=f"KDA layer {layer}",
            )
        )
    lo = max(0.5, float(np.nanmin([df["half_life_median"].min(), df["reach_mean"].clip(lower=0.5).min()])))
    hi = float(np.nanmax([df["half_life_median"].max(), df["reach_mean"].max()])) * 1.2
    fig.add_trace(
        go.Scatter(
            x=[lo, hi], y=[lo, hi], mode="lines", name="reach = half-life", line={"dash": "dot", "color": "#444"}
        )
    )
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    apply_style(
        fig,
        f"KDA reach (distance holding half of |A|) vs resting half-life per head — {ctx.label}",
        "resting half-life ln2/(-g0), median over the head's channels (tokens)",
        "reach: mean half-mass distance over queries (tokens)",
    )
    return fig, df


_HEADS = Comparison(difference=("entropy_norm", "first_token_mass"), keys=("layer", "head"), x="layer")

VIEWS: list[View] = [
    View(
        "degradation_kinds_entropy",
        "Attention entropy, KDA and MLA",
        "degradation",
        build_kinds_entropy,
        description="Normalised entropy of every head, KDA's implicit attention (on |A|) beside MLA's, with the "
        "uniform causal reference.",
        compare=_HEADS,
    ),
    View(
        "degradation_kinds_sink",
        "Attention sink, KDA and MLA",
        "degradation",
        build_kinds_sink,
        description="First-token mass of every head, both kinds, with the uniform causal reference and the 0.3 "
        "threshold.",
        compare=_HEADS,
    ),
    View(
        "degradation_kinds_received",
        "Attention received, KDA and MLA",
        "degradation",
        build_kinds_received,
        description="Mean attention each key receives, per layer of both kinds, against uniform causal attention.",
        compare=Comparison(difference=("received",), keys=("layer", "key"), x="key"),
    ),
    View(
        "degradation_sink_rate",
        "Sink rate per layer and kind",
        "degradation",
        build_sink_rate,
        description="Share of heads whose first-token mass exceeds the threshold (Gu et al. 2024, arXiv "
        "2410.10781), per layer and kind, and against the threshold.",
        compare=Comparison(difference=("sink_rate",), keys=("kind", "layer"), x="layer"),
    ),
    View(
        "density_kda_attention_map",
        "KDA implicit attention map",
        "density",
        build_kda_map,
        description="KDA's exact implicit attention A (o = A v) over the query window, signed.",
        compare=Comparison(difference=("attention",), keys=("query", "key"), x="key"),
        picks=view.Picks((view.LAYER, view.HEAD), pk.kda_attention_choices),
    ),
    View(
        "density_kda_reach",
        "KDA reach vs resting half-life",
        "density",
        build_kda_reach,
        description="Per KDA head the distance holding half its |A| against the half-life of its resting decay.",
        compare=Comparison(difference=("reach_mean",), keys=("layer", "head"), x="head"),
    ),
]
