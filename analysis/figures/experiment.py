"""Figures for experiments: per-token loss change of an edit, activation-patching heatmaps, token
attribution (output x input), layer attribution by kind, and the AttnRes / logit lens."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis.attribution import LayerAttribution, TokenAttribution
from analysis.style import DIVERGING, LAYER_TYPE_COLORS, SEQUENTIAL_REVERSED, apply_style

KIND_COLORS = {
    "KDA": LAYER_TYPE_COLORS["KDA"],
    "MLA": LAYER_TYPE_COLORS["MLA"],
    "dense": LAYER_TYPE_COLORS["dense FFN"],
    "routed": LAYER_TYPE_COLORS["LatentMoE"],
    "shared": "#9467bd",
}


def _symmetric(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(np.abs(finite).max()) if finite.size else 1.0


def loss_change_figure(effects: pd.DataFrame, title: str = "Per-token loss change of the edit") -> go.Figure:
    """Bars: edited - baseline next-token loss per position (positive: the edit hurts)."""
    labels = [f"{r.position}: {r.token!s}" for r in effects.itertuples()]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=effects.loss_change,
            marker_color=np.where(effects.loss_change > 0, "#d62728", "#1f77b4"),
            customdata=np.stack([effects.base_loss, effects.edited_loss, effects.next_token.astype(str)], -1),
            hovertemplate="%{x} -> %{customdata[2]}<br>baseline %{customdata[0]:.3f} nats<br>"
            "edited %{customdata[1]:.3f} nats<br>change %{y:+.3f}<extra></extra>",
        )
    )
    return apply_style(fig, title, "position: token", "loss change (nats, edited - baseline)")


def patching_figure(df: pd.DataFrame) -> go.Figure:
    """Heatmap of the fraction of the metric restored: layer x site, or position x layer for one site
    when the table is per position."""
    per_position = (df.position >= 0).any()
    if per_position:
        table = df.groupby(["layer", "position"]).fraction_restored.mean().unstack("position")
        x_title, y_title = "position patched", "layer"
        site = ", ".join(sorted(df.site.unique()))
        title = f"Activation patching: fraction restored per position ({site})"
    else:
        order = [s for s in ("resid", "mixer_out", "ffn_out", "depth_weights") if s in set(df.site)]
        table = df.groupby(["layer", "site"]).fraction_restored.mean().unstack("site")[order]
        x_title, y_title, title = "site", "layer", "Activation patching: fraction of the metric restored"
    z = table.to_numpy(dtype=float)
    bound = max(1.0, _symmetric(z))
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[str(c) for c in table.columns],
            y=[f"L{i}" for i in table.index],
            colorscale=DIVERGING,
            zmid=0,
            zmin=-bound,
            zmax=bound,
            texttemplate="%{z:.2f}" if z.size <= 400 else None,
            colorbar={"title": {"text": "restored"}},
            hovertemplate="%{y} %{x}<br>fraction restored %{z:.3f}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    clean, corrupt = df.attrs.get("clean_metric"), df.attrs.get("corrupted_metric")
    if clean is not None:
        title += f" (clean {clean:.3f}, corrupted {corrupt:.3f})"
    return apply_style(fig, title, x_title, y_title)


def attribution_figure(result: TokenAttribution) -> go.Figure:
    """Output token x input token heatmap of the attributions (diverging, zero white)."""
    z = result.matrix.numpy()
    bound = _symmetric(z) or 1.0
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"{i}: {t}" for i, t in enumerate(result.input_labels)],
            y=[f"{j}: {t}" for j, t in enumerate(result.output_labels)],
            colorscale=DIVERGING,
            zmid=0,
            zmin=-bound,
            zmax=bound,
            colorbar={"title": {"text": "attribution"}},
            hovertemplate="output %{y}<br>input %{x}<br>attribution %{z:.4f}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    note = ""
    if result.delta is not None:
        note = f"; IG delta max |{max(abs(d) for d in result.delta):.2g}|"
    return apply_style(
        fig,
        f"Attribution ({result.method}) of log p(output token); baseline: {result.baseline}{note}",
        "input token",
        "output token",
    )


def layer_attribution_figure(result: LayerAttribution) -> go.Figure:
    """Bars per layer and sub-layer output, coloured by kind (KDA, MLA, dense, routed, shared)."""
    fig = go.Figure()
    depth_order = [f"L{r.layer} {r.group}" for r in result.table.sort_values(["layer", "group"]).itertuples()]
    for kind, rows in result.table.groupby("kind", sort=False):
        fig.add_bar(
            x=[f"L{r.layer} {r.group}" for r in rows.itertuples()],
            y=rows.attribution,
            name=f"{kind} ({rows.attribution.sum():+.3f})",
            marker_color=KIND_COLORS.get(kind, "#7f7f7f"),
            hovertemplate="%{x}<br>attribution %{y:.4f}<extra>" + kind + "</extra>",
        )
    # one trace per kind: without a fixed order the categories would follow the traces (every KDA layer first)
    fig.update_xaxes(categoryorder="array", categoryarray=depth_order)
    return apply_style(
        fig,
        f"Layer attribution (integrated gradients; f = {result.f_model:.3f}, "
        f"all sub-layers off = {result.f_baseline:.3f}, delta {result.delta:.2g})",
        "sub-layer output",
        "attribution to sum log p(target)",
    )


def lens_figure(table: pd.DataFrame, value: str = "next_rank") -> go.Figure:
    """Depth x position heatmap of the lens: the next token's rank (log colour) or KL to the final."""
    pivot = table[table.position < table.position.max()] if value == "next_rank" else table
    wide = pivot.pivot_table(index="depth", columns="position", values=value)
    labels = table.drop_duplicates("depth").set_index("depth").label
    z = wide.to_numpy(dtype=float)
    shown = np.log10(1 + z) if value == "next_rank" else z
    fig = go.Figure(
        go.Heatmap(
            z=shown,
            x=[str(c) for c in wide.columns],
            y=[labels[d] for d in wide.index],
            customdata=z,
            colorscale=SEQUENTIAL_REVERSED,
            colorbar={"title": {"text": "log10(1 + rank)" if value == "next_rank" else "KL (nats)"}},
            hovertemplate="%{y}<br>position %{x}<br>" + value + " %{customdata:.4g}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    what = "rank of the actual next token" if value == "next_rank" else "KL(final || depth)"
    return apply_style(fig, f"Lens: {what} per depth", "position", "depth")


def mla_attention_figure(rows: pd.DataFrame, query: int, what: str) -> go.Figure:
    """Bars: one MLA head's attention from token ``query`` to each key position 0..query, keys on a numeric axis
    (in position order, not as text: 0, 1, 2, ..., never 0, 105, 112, 12)."""
    keys = rows.key.astype(int).to_numpy()
    order = np.argsort(keys, kind="stable")
    fig = go.Figure(
        go.Bar(
            x=keys[order],
            y=rows.prob.to_numpy()[order],
            marker_color=LAYER_TYPE_COLORS["MLA"],
            hovertemplate="key %{x}<br>attention %{y:.4f}<extra></extra>",
        )
    )
    fig.update_xaxes(type="linear", range=[-0.5, query + 0.5])
    fig.update_yaxes(rangemode="tozero")
    return apply_style(fig, f"MLA attention from token {query} ({what})", "key position", "attention weight")
