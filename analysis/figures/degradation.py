"""Figures for the degradation diagnostics: MLA attention (analysis.metrics.attention), hidden states over depth
(analysis.metrics.hidden_states) and their KDA counterparts (analysis.metrics.kda_memory). One View per figure."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.figures import style
from analysis.figures.style import LAYER_TYPE_COLORS, RUN_COLORS, SEQUENTIAL, apply_style, mark_repeat_start
from analysis.metrics import attention as at
from analysis.metrics import hidden_states as hs
from analysis.metrics import kda_memory as km
from analysis.metrics import null_reference as nr
from analysis.runs.context import AnalysisContext
from analysis.runs.missing_data import MissingTraceData
from analysis.views import picks as pk
from analysis.views import view
from analysis.views.view import Comparison, NotApplicable, View


def _guard(fn, ctx: AnalysisContext) -> pd.DataFrame:
    try:
        return fn(ctx.trace)
    except MissingTraceData as exc:
        raise NotApplicable(str(exc)) from exc


#: normalised attention entropy at or above which every head is said to be near uniform
NEAR_UNIFORM = 0.9
UNIFORM_ROW = "uniform (null)"  # the sink profile's reference row


def _heatmap(
    df: pd.DataFrame,
    value: str,
    row_label: str,
    title: str,
    colorbar: str,
    zmin: float | None = None,
    zmax: float | None = None,
    fmt: str = ".2f",
) -> go.Figure:
    table = df.pivot(index="layer", columns="head", values=value).sort_index()
    fig = go.Figure(
        go.Heatmap(
            z=table.to_numpy(),
            x=[f"H{h}" for h in table.columns],
            y=[f"{row_label} {i}" for i in table.index],
            colorscale=SEQUENTIAL,
            zmin=zmin,
            zmax=zmax,
            colorbar={"title": {"text": colorbar}},
            texttemplate=f"%{{z:{fmt}}}",
            hovertemplate="%{y} %{x}<br>" + colorbar + " = %{z:.4f}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    return apply_style(fig, title, "head", "layer", height=max(260, 80 + 45 * len(table)))


# ----------------------------------------------------------------------------- MLA attention
def build_entropy_heatmap(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(at.attention_entropy_table, ctx)
    df = df.assign(uniform_entropy_norm=1.0)  # uniform causal attention (analysis.metrics.null_reference)
    fig = _heatmap(
        df,
        "entropy_norm",
        "MLA L",
        f"MLA attention entropy, causal-normalised (1 = uniform, 0 = one key) — {ctx.label}",
        "H / log(i+1) (1 = uniform)",
        fmt=".3f",
    )  # the colours span the values present (often 0.9-1): a fixed 0..1 drew every head in one colour
    low = float(df["entropy_norm"].min()) if len(df) else 0.0
    if low >= NEAR_UNIFORM:
        # colours stretched over 0.96-0.99 would make noise look like contrast: a fixed NEAR_UNIFORM..1 scale, and
        # the sentence that every head is near uniform
        # round ticks 0.025 apart (colour_ticks: at least four, a chart's minimum): plotly's own put one per 0.01 and
        # stacked the labels on a two-row map's short colour bar
        ticks = style.colour_ticks(NEAR_UNIFORM, 1.0)
        fig.update_traces(zmin=NEAR_UNIFORM, zmax=1.0, colorbar={**ticks, "tickformat": ".3f"})
        fig.add_annotation(
            text=f"every head is near uniform: H / log(i+1) >= {low:.3f} everywhere (1 = uniform; colours "
            f"{NEAR_UNIFORM:g}..1)",
            xref="paper",
            yref="paper",
            x=0,
            y=1.0,
            yanchor="bottom",
            showarrow=False,
            font={"size": 12},
        )
        fig.update_layout(margin={"t": fig.layout.margin.t + 20 if fig.layout.margin.t else 100})
    return fig, df


def _mla_pick(ctx: AnalysisContext) -> tuple[view.PickChoices, int | None, int | None]:
    """The MLA choices of the run and the picked (layer, head); NotApplicable without MLA attention."""
    try:
        choices = pk.mla_choices(ctx)
    except NotApplicable:
        _guard(at.attention_entropy_table, ctx)  # raises the specific reason (not recorded, no MLA layer, ...)
        raise
    return (choices, *pk.picked(ctx, choices))


def build_entropy_by_position(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Normalised entropy per query position: one line per MLA layer (mean over heads); with a layer or head
    picked, one line per picked (layer, head)."""
    df = _guard(at.entropy_by_position_table, ctx)
    choices, layer, head = _mla_pick(ctx)
    df = pk.filter_picked(df, layer, head)
    focused = layer is not None or head is not None
    if focused:
        lines = df.assign(name=[f"MLA layer {r.layer} head {r.head}" for r in df.itertuples()])
        what = pk.pick_title(choices, layer, head).lstrip(", ")
    else:
        lines = df.groupby(["layer", "query"], as_index=False)["entropy_norm"].mean()
        lines["name"] = [f"MLA layer {v}" for v in lines["layer"]]
        what = "mean over heads"
    df = df.assign(uniform_entropy_norm=nr.uniform_entropy_norm(df["query"].to_numpy()))
    mean_norm = float(lines["entropy_norm"].mean())
    level = nr.relative_to(mean_norm, 1.0, tolerance=0.05)  # within 5% of 1: as spread as uniform attention
    fig = go.Figure()
    queries = np.sort(lines["query"].unique())
    fig.add_trace(
        go.Scatter(
            x=queries,
            y=nr.uniform_entropy_norm(queries),
            mode="lines",
            name="uniform causal attention (null reference)",
            line={"color": "#888", "dash": "dash"},
            hoverinfo="skip",
        )
    )
    for n, (name, part) in enumerate(lines.groupby("name", sort=False)):
        fig.add_trace(
            go.Scatter(
                x=part["query"],
                y=part["entropy_norm"],
                mode="lines",
                name=name,
                line={"color": RUN_COLORS[n % len(RUN_COLORS)]},
                text=ctx.position_labels(part["query"]),
                hovertemplate=f"{name}, query %{{text}}<br>H / log(i+1) = %{{y:.3f}}<extra></extra>",
            )
        )
    apply_style(
        fig,
        f"MLA attention entropy by query position ({what}; mean {mean_norm:.3f}: {level} the uniform level 1) — "
        f"{ctx.label}",
        "query position (token)",
        "normalised entropy H / log(i+1)",
    )
    fig.update_xaxes(**ctx.token_axis(lines["query"]))
    mark_repeat_start(fig, None if ctx.repeat_start is None else ctx.repeat_start - 0.5)
    return fig, df


def build_sink_mass(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(at.attention_sink_table, ctx)
    choices, layer, head = _mla_pick(ctx)
    df = pk.filter_picked(df, layer, head)
    focus = pk.pick_title(choices, layer, head)
    rate = at.sink_rate(df["first_token_mass"].to_numpy())
    labels = [f"L{r.layer} H{r.head}" for r in df.itertuples()]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=df["first_token_mass"],
            marker={"color": np.where(df["is_sink"], "#d62728", "#1f77b4")},
            hovertemplate="%{x}<br>first-token mass %{y:.3f}<extra></extra>",
            name="first-token mass",
        )
    )
    fig.add_hline(
        y=at.SINK_THRESHOLD,
        line_dash="dash",
        line_color="#444",
        annotation_text=f"sink threshold {at.SINK_THRESHOLD}",
        annotation_position="top left",
    )
    T = at.attention_tokens(ctx.trace)
    uniform = nr.uniform_first_token_mass(max(T, 1))
    fig.add_trace(  # a legend entry, not a note on the line: a note sat over the bars
        go.Scatter(
            x=labels,
            y=[uniform] * len(labels),
            mode="lines",
            name=f"uniform attention H_T/T = {uniform:.3g}",
            line={"color": "#2ca02c", "dash": "dot", "width": 2},
            hoverinfo="skip",
        )
    )
    fig.update_layout(showlegend=True, legend={"orientation": "h", "y": 1.02, "x": 1.0, "xanchor": "right"})
    df = df.assign(uniform_mass=uniform, vs_uniform=[nr.relative_to(m, uniform) for m in df["first_token_mass"]])
    at_uniform = int((df["vs_uniform"] == "at").sum())
    # from 0 (bars) to just above the larger of the data and the threshold: a fixed 0..1 squashed the bars
    top = max(float(df["first_token_mass"].max()), at.SINK_THRESHOLD)
    fig.update_yaxes(range=[0, min(1.0, top * 1.15)])
    title = (
        f"Attention sink: first-token mass per MLA head{focus} (sink rate {rate:.0%}; {at_uniform} of {len(df)} "
        f"heads at the uniform-attention level) — {ctx.label}"
    )
    if T < at.MIN_SINK_TOKENS:
        # Query 0 sees only key 0, so s_0 >= 1/T: with T <= 3 every head is a 'sink' whatever the model does.
        title = f"Attention sink: first-token mass per MLA head{focus} — {ctx.label}"
        fig.add_annotation(
            text=f"only {T} tokens: the first token takes a large share of attention by construction, so the sink "
            f"rate ({rate:.0%}) means little below {at.MIN_SINK_TOKENS} tokens",
            xref="paper",
            yref="paper",
            x=0.0,
            y=1.0,
            xanchor="left",
            yanchor="top",
            showarrow=False,
            align="left",
            bgcolor="rgba(255, 243, 205, 0.9)",
            font={"size": 11},
        )
    df.attrs["too_few_tokens"] = T < at.MIN_SINK_TOKENS
    apply_style(fig, title, "MLA layer / head", "mean attention on token 0")
    return fig, df


def build_sink_profile(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(at.attention_received_table, ctx)
    choices, layer, head = _mla_pick(ctx)
    df = pk.filter_picked(df, layer, head)
    focus = pk.pick_title(choices, layer, head)
    T = int(df.attrs.get("total_keys", df["key"].max() + 1))
    df = df.assign(
        row=[f"L{r.layer} H{r.head}" for r in df.itertuples()],
        uniform_received=nr.uniform_received(T, df["key"].to_numpy()),
    )
    table = df.pivot(index="row", columns="key", values="received")
    table = table.loc[list(dict.fromkeys(df["row"]))]
    # the first row: what uniform causal attention gives each key (analysis.metrics.null_reference.uniform_received)
    reference = pd.DataFrame([nr.uniform_received(T, table.columns.to_numpy())], columns=table.columns)
    table = pd.concat([reference.set_axis([UNIFORM_ROW]), table])
    fig = go.Figure(
        go.Heatmap(
            z=table.to_numpy(),
            x=table.columns.tolist(),
            y=table.index.tolist(),
            colorscale=SEQUENTIAL,
            zmin=0.0,
            colorbar={"title": {"text": "received"}},
            customdata=[ctx.position_labels(table.columns)] * len(table),
            hovertemplate="%{y}, key %{customdata}<br>mean attention received %{z:.4f}<extra></extra>",
        )
    )
    fig.update_xaxes(**ctx.token_axis(table.columns))
    fig.update_yaxes(autorange="reversed")
    if ctx.repeat_start is not None and ctx.repeat_start <= max(table.columns, default=-1):
        mark_repeat_start(fig, ctx.repeat_start - 0.5)
    total = int(df.attrs.get("total_keys", table.shape[1]))
    shown = f"first {table.shape[1]} of {total} keys" if total > table.shape[1] else f"all {total} keys"
    apply_style(
        fig,
        f"Attention received per key position{focus} ({shown}; mean over the queries that see it) — {ctx.label}",
        "key position (token)",
        "MLA layer / head",
        height=max(280, 80 + 28 * len(table)),
    )
    return fig, df


def build_mla_gate(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(at.mla_gate_table, ctx)
    title = f"MLA output gate: mean sigmoid(W_g x) per head — {ctx.label}"
    fig = _heatmap(df, "gate_mean", "MLA L", title, "gate", 0.0, 1.0)
    return fig, df


# ----------------------------------------------------------------------------- hidden states
def build_rank_collapse(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(hs.rank_collapse_table, ctx)
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=("rank-collapse ratio r", "effective rank (centred)", "token uniformity (mean cosine)"),
        horizontal_spacing=0.08,
    )
    for col, (value, colour) in enumerate(
        (("ratio", "#1f77b4"), ("effective_rank", "#2ca02c"), ("token_cosine", "#d62728")), start=1
    ):
        fig.add_trace(
            go.Scatter(
                x=df["depth_label"],
                y=df[value],
                mode="lines+markers",
                name=value,
                line={"color": colour},
                showlegend=False,
            ),
            row=1,
            col=col,
        )
    fig.update_yaxes(rangemode="tozero")
    apply_style(
        fig,
        f"Rank collapse over depth: ||X - 1 mean(X)||_F / ||X||_F, effective rank, token cosine — {ctx.label}",
        height=380,
    )
    fig.update_xaxes(title_text="depth (state entering layer)")
    return fig, df


def build_layer_redundancy(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(hs.layer_redundancy_table, ctx)
    if df.empty:
        raise NotApplicable("a single depth state: no layer to compare")
    x = [f"L{r.layer} {r.layer_type}" for r in df.itertuples()]
    colours = [LAYER_TYPE_COLORS.get(t, "#7f7f7f") for t in df["layer_type"]]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=x,
            y=df["block_influence"],
            name="Block Influence 1 - cos",
            marker={"color": colours},
            hovertemplate="%{x}<br>BI %{y:.4f}<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x, y=df["cka"], name="linear CKA(in, out)", mode="lines+markers", yaxis="y2", line={"color": "#444"}
        )
    )
    apply_style(
        fig,
        f"Layer redundancy: Block Influence (bars, by layer type) and CKA between input and output — {ctx.label}",
        "layer",
        "Block Influence (1 - mean cosine)",
    )
    # one zero for both axes: the bars' axis is stretched so that its 0 sits where the CKA axis has its 0
    cka_range = [-0.06, 1.06]
    zero_at = -cka_range[0] / (cka_range[1] - cka_range[0])
    top = 1.1 * max(float(df["block_influence"].max()), 1e-12)
    fig.update_yaxes(range=[-zero_at * top / (1 - zero_at), top])
    fig.update_layout(
        yaxis2={
            "title": {"text": "linear CKA"},
            "overlaying": "y",
            "side": "right",
            "range": cka_range,  # 0 above the x axis: clear of the turned layer labels
            "showgrid": False,
            "tickmode": "linear",
            "tick0": 0,
            "dtick": 0.2,
        }
    )
    return fig, df


def build_massive_activations(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(hs.massive_activation_table, ctx)
    top = df[df["rank"] == 0]
    hover = [
        f"max |h| = {r.abs_value:.3g} at token {r.token}, channel {r.channel}<br>median |h| = {r.median_abs:.3g}"
        for r in top.itertuples()
    ]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=top["depth_label"],
            y=top["abs_value"],
            name="max |h|",
            mode="lines+markers",
            hovertext=hover,
            hoverinfo="text",
        )
    )
    fig.add_trace(go.Scatter(x=top["depth_label"], y=top["median_abs"], name="median |h|", mode="lines+markers"))
    fig.add_trace(
        go.Scatter(
            x=top["depth_label"],
            y=top["max_median_ratio"],
            name="max / median (right axis)",
            mode="lines+markers",
            line={"dash": "dot"},
            yaxis="y2",  # a unitless ratio: its own axis, not |h|'s
        )
    )
    fig.update_yaxes(type="log")
    apply_style(
        fig,
        f"Massive activations: largest |h| per depth, median and their ratio (hover: token, channel) — {ctx.label}",
        "depth (state entering layer)",
        "|h| (log scale)",
    )
    fig.update_layout(
        yaxis2={"title": {"text": "max / median (ratio, log)"}, "overlaying": "y", "side": "right", "type": "log"}
    )
    return fig, df


# ----------------------------------------------------------------------------- KDA
def build_kda_state_rank(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = km.kda_state_rank(ctx.trace)
    if df.empty:
        raise NotApplicable("no KDA final states in this trace (kda.i.final_state); record with 'kda'")
    d = int(df["head_dim"].max())
    fig = _heatmap(
        df,
        "effective_rank",
        "KDA L",
        f"KDA final state S: effective rank per head (of at most {d}); no attention matrix for KDA — {ctx.label}",
        "eff. rank",
        0.0,
        float(d),
        fmt=".1f",
    )
    return fig, df


VIEWS: list[View] = [
    View(
        "degradation_entropy",
        "MLA attention entropy",
        "degradation",
        build_entropy_heatmap,
        description="Causal-normalised attention entropy per MLA layer and head (Zhai et al. 2023).",
        compare=Comparison(difference=("entropy_norm",), keys=("layer", "head"), x="head"),
    ),
    View(
        "degradation_entropy_position",
        "Entropy by query position",
        "degradation",
        build_entropy_by_position,
        description="Normalised entropy of each query row, mean over heads.",
        compare=Comparison(difference=("entropy_norm",), keys=("layer", "head", "query"), reduce=("head",), x="query"),
        picks=view.Picks((view.LAYER, view.HEAD), pk.mla_choices),
    ),
    View(
        "degradation_sink",
        "Attention sink",
        "degradation",
        build_sink_mass,
        description="First-token sink mass per head and the sink rate (share above 0.3; Gu et al. 2024).",
        compare=Comparison(difference=("first_token_mass",), keys=("layer", "head"), x="head"),
        picks=view.Picks((view.LAYER, view.HEAD), pk.mla_choices),
    ),
    View(
        "degradation_sink_profile",
        "Attention received per key",
        "degradation",
        build_sink_profile,
        description="Mean attention each key position receives from the queries that can see it.",
        compare=Comparison(difference=("received",), keys=("layer", "head", "key"), x="key"),
        picks=view.Picks((view.LAYER, view.HEAD), pk.mla_choices),
    ),
    View(
        "degradation_mla_gate",
        "MLA output gate",
        "degradation",
        build_mla_gate,
        description="Mean sigmoid output-gate value of gated MLA, per layer and head.",
        compare=Comparison(difference=("gate_mean",), keys=("layer", "head"), x="head"),
    ),
    View(
        "degradation_rank_collapse",
        "Rank collapse",
        "degradation",
        build_rank_collapse,
        description="Rank-collapse ratio (Dong et al. 2021), effective rank and token uniformity over depth.",
        compare=Comparison(difference=("ratio", "effective_rank", "token_cosine"), keys=("depth_label",)),
    ),
    View(
        "degradation_redundancy",
        "Layer redundancy",
        "degradation",
        build_layer_redundancy,
        description="Block Influence (ShortGPT) and linear CKA (Kornblith 2019) between each layer's input/output.",
        compare=Comparison(difference=("block_influence", "cka"), keys=("layer",)),
    ),
    View(
        "degradation_massive",
        "Massive activations",
        "degradation",
        build_massive_activations,
        description="Largest |h| per depth, its (token, channel), and max/median (Sun et al. 2024).",
        compare=Comparison(
            no_difference="the largest activations sit at different tokens and channels in the two runs: "
            "compare the two halves"
        ),
    ),
    View(
        "degradation_kda_state_rank",
        "KDA state rank",
        "degradation",
        build_kda_state_rank,
        description="Effective rank of the final KDA state per head (the KDA counterpart of attention entropy).",
        compare=Comparison(difference=("effective_rank",), keys=("layer", "head"), x="head"),
    ),
]
