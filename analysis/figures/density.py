"""Figures for KDA layer density: allocated (analysis.metrics.allocation) vs measured (analysis.metrics.importance,
with analysis.metrics.kda_memory's per-layer summary), per depth. The KDA memory views are analysis.figures.kda_memory.

Options read from ``ctx.options``: ``seq_len`` (tokens; default 131072) for FLOPs and the cache readout,
``dtype_bytes`` (default 2, bf16) for the MLA latent and KDA conv tails.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.figures.style import LAYER_TYPE_COLORS, LEGEND_RIGHT, RUN_COLORS, apply_style
from analysis.metrics import allocation as al
from analysis.metrics import kda_memory as km
from analysis.metrics.importance import sublayer_importance
from analysis.output.format import format_bytes, format_tokens
from analysis.runs.context import AnalysisContext
from analysis.views.view import Comparison, NotApplicable, View

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
    fig.update_layout(legend=dict(LEGEND_RIGHT))
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
]
