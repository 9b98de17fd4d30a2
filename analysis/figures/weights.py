"""Figures of the weight-only diagnostics (analysis.weights): what a checkpoint learned, read from its
small tensors. They need no trace and no model: a context carrying a ``WeightSummary`` (``ctx.weights``)
is enough, so they work for a checkpoint far too large to load. For a loaded run without a summary the
summary is computed from the model's parameters (once per model)."""

from __future__ import annotations

import weakref

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis import moe as mo
from analysis import weights as wt
from analysis.context import AnalysisContext
from analysis.shared_scales import AXIS_TOP, AXIS_TOP_AT
from analysis.style import DIVERGING, LAYER_TYPE_COLORS, RUN_COLORS, SEQUENTIAL, apply_style
from analysis.view import Comparison, NotApplicable, View
from k3core.model import scale_bias_init

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
UNITS = (
    "expert / head e of one checkpoint and expert / head e of another are different learned units; "
    "compare the per-layer views"
)
_FROM_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_of(ctx: AnalysisContext) -> wt.WeightSummary:
    """The context's WeightSummary: ``ctx.weights``, else one computed from ``ctx.model`` (cached per model),
    else NotApplicable."""
    summary = getattr(ctx, "weights", None)
    if summary is not None:
        return summary
    model = getattr(ctx, "model", None)
    if model is None:
        raise NotApplicable(
            "needs the checkpoint: this run has neither its weights nor a weight summary (a trace folder opened "
            "without its checkpoint)"
        )
    summary = _FROM_MODEL.get(model)
    if summary is None:
        try:
            summary = wt.summary_of_model(model, label=ctx.label)
        except wt.OffloadedWeights as exc:
            raise NotApplicable(f"weights not in memory: {exc}") from exc
        _FROM_MODEL[model] = summary
    return summary


def _label(ctx: AnalysisContext, summary: wt.WeightSummary) -> str:
    return ctx.label or summary.label


# ----------------------------------------------------------------------------- KDA
def build_kda_half_life(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Per KDA layer: median resting half-life over its channels, with the 10th-90th percentile band;
    MLA layers drawn at the top as unbounded memory."""
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
    finite = np.concatenate([np.asarray(v, dtype=np.float64) for v in (lo, med, hi)])
    finite = finite[np.isfinite(finite) & (finite > 0)]
    bottom, top = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 10.0)
    if mla:
        # "Unbounded" has no value: the markers stand at the top of the axis (AXIS_TOP), above every KDA
        # layer, here and on any axis this one shares in a comparison.
        span = np.log10(top) - np.log10(bottom) or 1.0
        y_range = [np.log10(bottom) - 0.05 * span, np.log10(top) + 0.25 * span]
        fig.update_yaxes(range=y_range)
        fig.add_trace(
            go.Scatter(
                x=mla,
                y=[10 ** (y_range[0] + AXIS_TOP_AT * (y_range[1] - y_range[0]))] * len(mla),
                meta=AXIS_TOP,
                mode="markers",
                name="MLA: unbounded memory (full attention)",
                marker={"color": LAYER_TYPE_COLORS["MLA"], "symbol": "triangle-up", "size": 11},
                hovertemplate="layer %{x} (MLA)<br>full attention: every earlier token stays readable<extra></extra>",
            )
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
        f"KDA resting half-life by layer, {form} — {_label(ctx, s)}",
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
        f"KDA resting half-life per head (median over channels) — {_label(ctx, s)}",
        "KDA head",
        "KDA layer",
        height=max(320, 90 + 14 * len(mat.index)),
    )
    return fig, table


# ----------------------------------------------------------------------------- AttnRes, scale/bias
def build_query_norms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """AttnRes pseudo-query norm per site and depth (attention site, MLP site, output mix)."""
    s = weights_of(ctx)
    table = s.query_norms
    if table.empty:
        mode = s.config.residual if s.config is not None else "unknown"
        raise NotApplicable(f"no AttnRes pseudo-queries in this checkpoint (residual={mode!r})")
    colors = {"attn": RUN_COLORS[0], "mlp": RUN_COLORS[1], "output": RUN_COLORS[3]}
    fig = go.Figure()
    for site, g in table.groupby("site", sort=False):
        fig.add_trace(
            go.Bar(
                x=g["depth"],
                y=g["query_norm"],
                name={"attn": "attention site", "mlp": "MLP site", "output": "output mix"}.get(site, site),
                marker_color=colors.get(site, "#777"),
                hovertemplate="%{x}<br>‖w‖ = %{y:.4g}<extra></extra>",
            )
        )
    fig.update_xaxes(categoryorder="array", categoryarray=list(table["depth"]))
    fig.update_layout(barmode="overlay")
    apply_style(
        fig,
        f"AttnRes pseudo-query norm per site (0 = uniform mix over depth) — {_label(ctx, s)}",
        "site (layer, side)",
        "‖w‖ (L2 norm of the pseudo-query)",
    )
    return fig, table


def build_scale_bias(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Scale/bias residual: mean scale and bias per depth and site, bars = std over channels; the initial scale
    (``k3core.model.scale_bias_init``) dashed."""
    s = weights_of(ctx)
    table = s.scale_bias
    if table.empty:
        mode = s.config.residual if s.config is not None else "unknown"
        raise NotApplicable(f"no scale/bias residual parameters (residual={mode!r})")
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("scale (mean ± std over channels)", "bias (mean ± std over channels)")
    )
    for k, (site, g) in enumerate(table.groupby("site", sort=False)):
        for col, what in ((1, "scale"), (2, "bias")):
            fig.add_trace(
                go.Scatter(
                    x=g["layer"],
                    y=g[f"{what}_mean"],
                    error_y={"type": "data", "array": g[f"{what}_std"], "thickness": 1.2},
                    mode="lines+markers",
                    name=f"{site} site",
                    legendgroup=site,
                    showlegend=col == 1,
                    line={"color": RUN_COLORS[k % len(RUN_COLORS)]},
                    hovertemplate=f"layer %{{x}} ({site})<br>{what} mean %{{y:.4g}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    if s.config is not None:  # the initial scale, for reference (the bias starts at 0)
        layers = sorted(table["layer"].unique())
        fig.add_trace(
            go.Scatter(
                x=layers,
                y=[scale_bias_init(s.config, int(i)) for i in layers],
                mode="lines",
                name="scale at init",
                line={"color": "#777", "dash": "dash"},
                hovertemplate="layer %{x}<br>initial scale = %{y:.3f}<extra></extra>",
            ),
            row=1,
            col=1,
        )
    fig.update_xaxes(title_text="layer (0-based)")
    fig.update_yaxes(title_text="scale (multiplier)", row=1, col=1)
    fig.update_yaxes(title_text="bias (hidden units)", row=1, col=2)
    apply_style(fig, f"Residual scale and bias per depth — {_label(ctx, s)}")
    return fig, table


# ----------------------------------------------------------------------------- router
def _layer_expert_heatmap(
    table: pd.DataFrame, value: str, title: str, colorbar: str, diverging: bool, unit: str
) -> go.Figure:
    mat = table.pivot(index="layer", columns="expert", values=value)
    z = mat.to_numpy(dtype=np.float64)
    kw = {"colorscale": SEQUENTIAL}
    if diverging:
        finite = z[np.isfinite(z)]
        bound = float(np.abs(finite).max()) if finite.size else 1.0
        kw = {"colorscale": DIVERGING, "zmid": 0.0, "zmin": -bound or -1.0, "zmax": bound or 1.0}
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[str(e) for e in mat.columns],
            y=[f"L{i}" for i in mat.index],
            colorbar={"title": {"text": colorbar}},
            hovertemplate=f"layer %{{y}}, expert %{{x}}<br>{value} %{{z:.4g}}{unit}<extra></extra>",
            **kw,
        )
    )
    fig.update_yaxes(autorange="reversed")
    apply_style(fig, title, "routed expert", "MoE layer", height=max(320, 90 + 12 * len(mat.index)))
    return fig


def _layer_expert_view(
    ctx: AnalysisContext, table: pd.DataFrame | None, value: str, title: str, colorbar: str, diverging: bool
) -> tuple[go.Figure, pd.DataFrame]:
    """One layer x expert heatmap of ``table[value]``, titled with the run; NotApplicable without MoE layers."""
    if table is None or table.empty:
        raise NotApplicable("no routed experts in this checkpoint (no MoE layers)")
    s = weights_of(ctx)
    return _layer_expert_heatmap(table, value, f"{title} — {_label(ctx, s)}", colorbar, diverging, ""), table


def build_router_bias(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Selection bias e_bias per MoE layer x expert (diverging colour, 0 = white)."""
    table = weights_of(ctx).router_bias
    title = "Router selection bias e_bias per layer and expert"
    return _layer_expert_view(ctx, table, "bias", title, "e_bias<br>(score units)", True)


def build_router_bias_spread(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Per MoE layer: e_bias std (spread) and its min-max range around the mean; with a trace that recorded
    the expert load, also the bias-load correlation per layer (``analysis.moe.bias_load_correlation``)."""
    s = weights_of(ctx)
    table = s.router_bias_stats
    if table.empty:
        raise NotApplicable("no router selection biases (no MoE layers)")
    if ctx.trace is not None and mo.moe_layers(ctx.trace):
        corr = mo.bias_load_correlation(s.router_bias, mo.expert_load(ctx.trace))
        table = table.merge(corr, on="layer", how="left")
        table.attrs = dict(s.router_bias_stats.attrs)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=np.concatenate([table["layer"], table["layer"][::-1]]),
            y=np.concatenate([table["max"], table["min"][::-1]]),
            fill="toself",
            mode="lines",
            fillcolor="rgba(44,160,44,0.15)",
            line={"width": 0},
            name="min-max over experts",
            hoverinfo="skip",
        )
    )
    corr = "<br>corr(bias, load) = %{customdata:.2f}" if "load_corr" in table else ""
    for col, name, color, dash in (
        ("mean", "mean", RUN_COLORS[2], "dot"),
        ("std", "std (spread)", RUN_COLORS[0], "solid"),
    ):
        fig.add_trace(
            go.Scatter(
                x=table["layer"],
                y=table[col],
                mode="lines+markers",
                name=name,
                line={"color": color, "dash": dash},
                customdata=table["load_corr"] if corr else None,
                hovertemplate=f"layer %{{x}}<br>{name} %{{y:.4g}}{corr}<extra></extra>",
            )
        )
    apply_style(
        fig,
        f"Router selection bias spread per layer — {_label(ctx, s)}",
        "MoE layer (0-based)",
        "e_bias (score units)",
    )
    return fig, table


def build_router_norms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Router weight row norm ||W_router[e]|| per MoE layer x expert."""
    table = weights_of(ctx).router_norms
    title = "Router weight norm per expert ‖W_router[e]‖"
    return _layer_expert_view(ctx, table, "weight_norm", title, "‖W_router[e]‖", False)


def build_expert_norms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Routed expert weight norm sqrt(|w1|² + |w2|² + |w3|²) per MoE layer x expert (``--experts``)."""
    table = weights_of(ctx).expert_norms
    if table is None:
        raise NotApplicable("expert norms were not read (run `k3lab weights PATH --experts`)")
    title = "Routed expert weight norm per layer and expert"
    return _layer_expert_view(ctx, table, "norm", title, "Frobenius norm<br>(w1, w2, w3)", False)


# ----------------------------------------------------------------------------- norms, parameters
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
        f"Norm weights by depth (mean solid, max dotted) — {_label(ctx, s)}",
        "layer (0-based)",
        "RMSNorm weight (gain, unitless)",
        height=460,
    )
    # eight entries: a legend beside the plot, not over the title
    fig.update_layout(
        legend={"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"}, margin={"r": 250}
    )
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
        f"Parameters by depth and kind ({s.total_params:,} in all, from the headers) — {_label(ctx, s)}",
        "depth (embedding, decoder layers, output)",
        "parameters (count)",
    )
    return fig, table


VIEWS: list[View] = [
    View(
        "weights_kda_half_life",
        "KDA resting half-life by layer",
        "weights",
        build_kda_half_life,
        description="The KDA decay gate with zero input, g0, as a half-life ln2/(-g0) in tokens per channel: "
        "median and 10th-90th percentiles over each layer's channels. MLA layers keep every token (unbounded).",
        from_weights=True,
        compare=Comparison(difference=("half_life_median",), keys=("layer",)),
    ),
    View(
        "weights_kda_heads",
        "KDA resting half-life per head",
        "weights",
        build_kda_heads,
        description="Median resting half-life over each head's channels, layer x head (log colour scale).",
        from_weights=True,
        compare=Comparison(no_difference=UNITS),
    ),
    View(
        "attnres_query_norms",
        "AttnRes pseudo-query norms",
        "attnres",
        build_query_norms,
        description="Norm of each learned pseudo-query (attention site, MLP site, output mix): the learned "
        "sharpness of attention over depth; 0 means a uniform average of the sources.",
        from_weights=True,
        compare=Comparison(difference=("query_norm",), keys=("layer", "site")),
    ),
    View(
        "attnres_scale_bias",
        "Residual scale and bias per depth",
        "attnres",
        build_scale_bias,
        description="Scale/bias residual runs: learned scale and bias per depth and site (mean, with the "
        "standard deviation over channels), against the initial scale.",
        from_weights=True,
        compare=Comparison(difference=("scale_mean", "bias_mean"), keys=("layer", "site")),
    ),
    View(
        "weights_router_bias",
        "Router selection bias per layer x expert",
        "weights",
        build_router_bias,
        description="e_score_correction_bias: what load balancing pushed up (red) or down (blue) per expert; it "
        "steers which experts are chosen, not their weights.",
        from_weights=True,
        compare=Comparison(no_difference=UNITS),
    ),
    View(
        "moe_bias",
        "Router selection bias spread per layer",
        "moe",
        build_router_bias_spread,
        description="Per MoE layer: the selection bias's standard deviation, mean and min-max range over experts.",
        from_weights=True,
        compare=Comparison(difference=("std",), keys=("layer",)),
    ),
    View(
        "weights_router_norms",
        "Router weight norm per expert",
        "weights",
        build_router_norms,
        description="L2 norm of each expert's router row: how strongly the router's score for that expert "
        "responds to the hidden state.",
        from_weights=True,
        compare=Comparison(no_difference=UNITS),
    ),
    View(
        "weights_norms",
        "Norm weights by depth",
        "weights",
        build_norms,
        description="Mean and max gain of the input, post-attention, KDA output and latent expert RMSNorms.",
        from_weights=True,
        compare=Comparison(difference=("mean",), keys=("layer", "norm"), x="layer"),
    ),
    View(
        "weights_params",
        "Parameters by depth and kind",
        "weights",
        build_params,
        description="Parameter counts per decoder layer (plus embedding and output) split by kind, from the "
        "safetensors header shapes alone.",
        from_weights=True,
        compare=Comparison(difference=("params",), keys=("layer", "kind"), x="layer"),
    ),
    View(
        "weights_expert_norms",
        "Routed expert weight norms",
        "weights",
        build_expert_norms,
        description="Frobenius norm of each routed expert's three matrices, layer x expert (needs --experts: it "
        "reads every expert matrix).",
        from_weights=True,
        compare=Comparison(no_difference=UNITS),
    ),
]
