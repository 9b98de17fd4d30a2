"""Figures for KDA layer density: allocated (analysis.metrics.allocation) vs measured (analysis.metrics.kda_memory,
analysis.metrics.importance), per depth.

Options read from ``ctx.options``: ``seq_len`` (tokens; default 131072) for FLOPs and the cache readout,
``dtype_bytes`` (default 2, bf16) for the MLA latent and KDA conv tails.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.figures.style import LAYER_TYPE_COLORS, RUN_COLORS, apply_style, mark_repeat_start
from analysis.metrics import allocation as al
from analysis.metrics import kda_memory as km
from analysis.metrics.importance import sublayer_importance
from analysis.output.format import format_bytes, format_tokens
from analysis.runs.context import AnalysisContext
from analysis.views import picks as pk
from analysis.views import view
from analysis.views.view import Comparison, NotApplicable, View
from k3core.interp.trace import names

DEFAULT_SEQ_LEN = 131072


def _seq_len(ctx: AnalysisContext) -> int:
    T = int(ctx.options.get("seq_len", DEFAULT_SEQ_LEN))
    if T < 1:
        raise ValueError(f"seq_len must be >= 1, got {T}")
    return T


def _dtype_bytes(ctx: AnalysisContext) -> int:
    return int(ctx.options.get("dtype_bytes", 2))


def _layer_bars(
    fig: go.Figure,
    layers: pd.DataFrame,
    column: str,
    row: int,
    hover_name: str,
    fmt: str,
    show_legend: bool,
    log: bool = False,
) -> None:
    """One bar trace per layer type (so the legend explains the colours), hover naming the layer. ``log``: markers
    instead (a bar's length on a log axis depends on where the axis happens to start: it means nothing)."""
    for ltype, g in layers.groupby("layer_type", sort=False):
        shape = (
            {"mode": "markers", "marker": {"size": 9, "symbol": "diamond"}}
            if log
            else {"width": 0.8}  # explicit: plotly would size each trace's bars from its own x spacing
        )
        fig.add_trace(
            (go.Scatter if log else go.Bar)(
                x=g["layer"],
                y=g[column],
                **shape,
                name=ltype,
                legendgroup=ltype,
                showlegend=show_legend,
                marker_color=LAYER_TYPE_COLORS.get(ltype, "#7f7f7f"),
                customdata=np.stack([g["layer_type"], g["ffn_kind"], g["width_multiplier"]], axis=-1),
                hovertemplate=(
                    "layer %{x} (%{customdata[0]} + %{customdata[1]}, width x%{customdata[2]})<br>"
                    f"{hover_name} = %{{y:{fmt}}}<extra></extra>"
                ),
            ),
            row=row,
            col=1,
        )


def _decoder_rows(alloc: pd.DataFrame) -> pd.DataFrame:
    return alloc[alloc["part"].str.startswith("L")]


# ----------------------------------------------------------------------------- allocated


def build_allocation(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Active params, FLOPs per token and cache bytes per decoder layer, from the config (all parameters by layer
    are one view, ``weights_params``, drawn from the weights)."""
    T = _seq_len(ctx)
    alloc = al.layer_allocation(ctx.config, seq_len=T, dtype_bytes=_dtype_bytes(ctx))
    layers = _decoder_rows(alloc)
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=(
            "active parameters per token (all parameters: the view Parameters by depth and kind)",
            f"FLOPs per token at T = {format_tokens(T)} (prefill average)",
            f"decode cache per sequence at T = {format_tokens(T)}",
        ),
    )
    _layer_bars(fig, layers, "active_params", 1, "active parameters", ",.0f", True)
    _layer_bars(fig, layers, "flops", 2, "FLOPs/token", ".3s", False, log=True)
    _layer_bars(fig, layers, "cache_bytes", 3, "cache bytes", ",.0f", False, log=True)
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(title_text="parameters", row=1, col=1)
    fig.update_yaxes(title_text="FLOPs / token", type="log", row=2, col=1)
    fig.update_yaxes(title_text="bytes", type="log", row=3, col=1)
    fig.update_xaxes(title_text="decoder layer (0-based)", dtick=1 if len(layers) <= 40 else None, row=3, col=1)
    fig.update_xaxes(range=[-0.5, ctx.config.num_hidden_layers - 0.5])  # no empty slots past the last layer
    apply_style(fig, f"Allocated density per layer — {ctx.label}", height=720)
    return fig, alloc


def build_cache_vs_length(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Decode cache per sequence vs length, KDA (flat) vs MLA (linear), log-log, with a readout at seq_len."""
    T = _seq_len(ctx)
    lengths = sorted(set(al.DEFAULT_LENGTHS) | {T})
    table = al.cache_bytes_by_length(ctx.config, lengths, dtype_bytes=_dtype_bytes(ctx))
    fig = go.Figure()
    styles = {"KDA": LAYER_TYPE_COLORS["KDA"], "MLA": LAYER_TYPE_COLORS["MLA"], "total": "#222222"}
    for ltype, g in table.groupby("layer_type", sort=False):
        n = int(g["n_layers"].iloc[0])
        if n == 0:
            continue
        fig.add_trace(
            go.Scatter(
                x=g["seq_len"],
                y=g["bytes"],
                mode="lines+markers",
                name=f"{ltype} ({n} layers)",
                line={"color": styles[ltype], "dash": "dash" if ltype == "total" else "solid"},
                customdata=np.stack([g["bytes"].map(format_bytes)], axis=-1),
                hovertemplate=f"{ltype}<br>T = %{{x:,}} tokens<br>cache = %{{customdata[0]}}<extra></extra>",
            )
        )
    at = table[table["seq_len"] == T].set_index("layer_type")["bytes"]
    readout = "<br>".join(f"{k} {format_bytes(v)}" for k, v in at.items() if v > 0)
    fig.add_vline(x=T, line={"color": "#888", "dash": "dot"})
    # In the top left corner of the plot (cache grows to the right): inside the panel at any width.
    fig.add_annotation(
        x=0.02,
        y=0.98,
        xref="paper",
        yref="paper",
        text=f"at T = {format_tokens(T)} (dotted line):<br>{readout}",
        showarrow=False,
        xanchor="left",
        yanchor="top",
        align="left",
        font={"size": 11},
        bgcolor="rgba(255, 255, 255, 0.8)",
    )
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    apply_style(
        fig, f"Decode cache per sequence vs length — {ctx.label}", "sequence length T (tokens)", "cache (bytes)"
    )
    return fig, table


# ----------------------------------------------------------------------------- allocated vs measured


def _importance(ctx: AnalysisContext) -> pd.DataFrame:
    if ctx.model is None or ctx.input_ids is None:
        raise NotApplicable(
            "needs the checkpoint: importance reruns the model on the tokens (ctx.model, ctx.input_ids), and this "
            "run has no model loaded (a trace folder opened without its checkpoint)"
        )
    # once per (model, tokens): the ablations do not depend on the view options (seq_len)
    return ctx.once("sublayer_importance", lambda: sublayer_importance(ctx.model, ctx.input_ids))


def build_allocated_vs_measured(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Shared depth axis: active params and FLOPs (bars by layer type) over measured importance (lines)."""
    T = _seq_len(ctx)
    alloc = al.layer_allocation(ctx.config, seq_len=T, dtype_bytes=_dtype_bytes(ctx))
    imp = _importance(ctx)
    table = al.allocated_vs_measured(alloc, imp, km.kda_layer_summary(ctx.trace))
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=(
            "active parameters per token",
            f"FLOPs per token at T = {format_tokens(T)}",
            "measured importance: loss increase when the sub-layer output is zeroed",
        ),
    )
    _layer_bars(fig, table, "active_params", 1, "active parameters", ",.0f", True)
    _layer_bars(fig, table, "flops", 2, "FLOPs/token", ".3s", False, log=True)
    lines = [
        ("ablation_attn", "ablation, mixer", RUN_COLORS[0], "solid"),
        ("ablation_ffn", "ablation, FFN", RUN_COLORS[1], "solid"),
        ("gxa_attn", "grad x act (1st order), mixer", RUN_COLORS[0], "dot"),
        ("gxa_ffn", "grad x act (1st order), FFN", RUN_COLORS[1], "dot"),
    ]
    for col, name, color, dash in lines:
        if col in table:
            noise = col.replace("ablation_", "ablation_noise_")  # error bars: a bar across 0 is within text noise
            floor = col.startswith("ablation_") and noise in table
            fig.add_trace(
                go.Scatter(
                    x=table["layer"],
                    y=table[col],
                    error_y={"type": "data", "array": table[noise].to_numpy(), "thickness": 1} if floor else None,
                    mode="lines+markers",
                    name=name,
                    line={"color": color, "dash": dash},
                    customdata=table[["layer_type", noise] if floor else ["layer_type"]].to_numpy(),
                    hovertemplate=f"layer %{{x}} (%{{customdata[0]}})<br>{name}: Δloss = %{{y:.4g}} nats"
                    + (" ± %{customdata[1]:.2g} (bar: its 95% noise floor)" if floor else "")
                    + "<extra></extra>",
                ),
                row=3,
                col=1,
            )
    fig.add_hline(y=0, line={"color": "#999", "width": 1}, row=3, col=1)
    fig.update_yaxes(title_text="parameters", row=1, col=1)
    fig.update_yaxes(title_text="FLOPs / token", type="log", row=2, col=1)
    fig.update_yaxes(title_text="Δ loss (nats)", row=3, col=1)
    fig.update_xaxes(title_text="decoder layer (0-based)", dtick=1 if len(table) <= 40 else None, row=3, col=1)
    apply_style(fig, f"Allocated vs measured density per layer — {ctx.label}", height=760)
    # seven legend entries would run into the title: a column on the right instead
    fig.update_layout(legend={"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"})
    return fig, table


# ----------------------------------------------------------------------------- KDA memory


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
        fig.update_layout(legend={"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"})
    return fig, table


VIEWS: list[View] = [
    View(
        "density_allocation",
        "Allocated density per layer",
        "density",
        build_allocation,
        description="Parameters, active parameters, FLOPs per token and cache bytes per layer, from the config.",
        from_config=True,
        compare=Comparison(difference=("params", "active_params", "flops", "cache_bytes"), keys=("part",)),
    ),
    View(
        "density_cache_vs_length",
        "Cache vs sequence length",
        "density",
        build_cache_vs_length,
        description="Decode cache per sequence from 1K to 1M tokens: KDA state is flat, MLA latent grows linearly.",
        from_config=True,
        compare=Comparison(difference=("bytes",), keys=("layer_type", "seq_len"), x="seq_len"),
    ),
    View(
        "density_allocated_vs_measured",
        "Allocated vs measured density",
        "density",
        build_allocated_vs_measured,
        needs_model=True,
        description="Allocation bars on the same depth axis as ablation (with its 95% noise floor) and gradient x "
        "activation importance.",
        compare=Comparison(difference=("ablation_attn", "ablation_ffn"), keys=("layer",)),
    ),
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
