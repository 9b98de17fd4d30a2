"""The difference A - B of two runs' tidy tables, and its figure.

``difference_table(df_a, df_b, keys, values)`` aligns the rows on the key columns and subtracts each
value column: ``v_a``, ``v_b``, ``v_diff = v_a - v_b``. Which columns are keys and which values form
a difference is the view's declaration (``analysis.views.view.Comparison``), never a guess: a table's
numeric columns include constants (a width multiplier, a layer count) that have no difference.

``difference_figure`` draws one value over two keys as a heatmap on a diverging scale centred at 0,
and anything else (one key, or several values) as bars per value, red above and blue below zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.figures.style import DIVERGING, apply_style, subplot_spacing
from analysis.views.view import NotApplicable

POSITIVE, NEGATIVE = "#d6604d", "#4393c3"  # the ends of DIVERGING: A above B, A below B
# Rows that are learned units of one checkpoint: head i (or expert i) of one checkpoint is not head i of another,
# so between two checkpoints a difference averages over them (analysis.compare.two_runs.difference_view).
LEARNED_UNITS = ("head", "expert")
READABLE = {
    "depth_label": "depth",
    "layer_type": "layer type",
    "part": "part",
    "seq_len": "sequence length",
    "entropy_norm": "normalised entropy",
    "first_token_mass": "first-token mass",
    "gate_mean": "gate (mean)",
    "state_norm": "state norm ‖S‖",
    "half_life_median": "median half-life",
    "frac_near_lb": "share near the gate bound",
    "g_mean": "mean decay g",
    "active_params": "active parameters",
    "cache_bytes": "cache bytes",
    "ablation_attn": "attention ablation Δloss",
    "ablation_ffn": "FFN ablation Δloss",
    "block_influence": "Block Influence",
    "cka": "linear CKA",
    "query_norm": "query norm",
    "scale_mean": "scale (mean)",
    "bias_mean": "bias (mean)",
    "effective_rank": "effective rank",
    "token_cosine": "token cosine",
    "max_weight": "max weight",
    "embedding_weight": "embedding weight",
    "mean": "mean",
}


def readable(column: str) -> str:
    """A column name as words for a title or label: ``READABLE``, else underscores as spaces."""
    return READABLE.get(column, column.replace("_", " "))


def difference_table(
    df_a: pd.DataFrame, df_b: pd.DataFrame, keys: Sequence[str], values: Sequence[str]
) -> pd.DataFrame:
    """Align two tidy tables on ``keys`` and subtract: keys + for each value v: v_a, v_b, v_diff = A - B.

    Raises NotApplicable when a column is missing, the keys do not identify rows uniquely, or the two
    tables do not have the same rows."""
    keys, values = list(keys), list(values)
    if not keys or not values:
        raise NotApplicable("no key or value columns declared for a difference")
    for name, df in (("A", df_a), ("B", df_b)):
        missing = [c for c in keys + values if c not in df.columns]
        if missing:
            raise NotApplicable(f"run {name}'s table has no column(s) {missing}")
        if df.duplicated(keys).any():
            raise NotApplicable(f"the keys {keys} do not identify run {name}'s rows uniquely")
    if len(df_a) != len(df_b):
        raise NotApplicable(f"the runs' tables have different numbers of rows ({len(df_a)} vs {len(df_b)})")
    merged = df_a[keys + values].merge(df_b[keys + values], on=keys, how="inner", suffixes=("_a", "_b"))
    if len(merged) != len(df_a):
        raise NotApplicable(f"the tables' keys {keys} do not match row for row ({len(merged)} of {len(df_a)} align)")
    for v in values:
        merged[f"{v}_diff"] = merged[f"{v}_a"].astype(np.float64) - merged[f"{v}_b"].astype(np.float64)
    merged.attrs.update(keys=keys, values=values)
    return merged


def reduce_keys(df: pd.DataFrame, keys: Sequence[str], values: Sequence[str], over: Sequence[str]) -> pd.DataFrame:
    """Mean of ``values`` over the key columns ``over`` (e.g. heads), grouped by the remaining keys in
    their order of appearance."""
    rest = [k for k in keys if k not in over]
    if not over:
        return df
    if not rest:
        raise NotApplicable(f"averaging over {list(over)} leaves no key to align on")
    out = df.groupby(rest, sort=False, as_index=False)[list(values)].mean()
    out.attrs.update(df.attrs)
    out.attrs["keys"] = rest
    return out


def _key_label(key: str, value) -> str:
    """A key's value as a label: text values as they are ("KDA", "L0 in"), numbers with their key ("layer 3")."""
    return str(value) if isinstance(value, str) else f"{readable(key)} {value}"


def _row_labels(diff: pd.DataFrame, keys: Sequence[str]) -> pd.Series:
    if not keys:
        return pd.Series([""] * len(diff), index=diff.index)
    return diff[list(keys)].agg(lambda r: " ".join(_key_label(k, v) for k, v in zip(keys, r)), axis=1)


def difference_figure(diff: pd.DataFrame, title: str, x: str | None = None) -> go.Figure:
    """A - B of every value of ``diff`` (from ``difference_table``): a heatmap (rows: the other keys,
    columns: ``x``, default the last key) for a single value over two or more keys, else one bar panel
    per value over the keys. The colour range / bar axis is symmetric around 0."""
    keys, values = list(diff.attrs["keys"]), list(diff.attrs["values"])
    x = x or keys[-1]
    if x not in keys:
        raise ValueError(f"x {x!r} is not one of the keys {keys}")
    if len(values) == 1 and len(keys) >= 2:
        return _heatmap(diff, values[0], x, [k for k in keys if k != x], title)
    return _bars(diff, values, keys, x, title)


def _symmetric(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)])
    m = float(finite.max()) if finite.size else 1.0
    return m if m > 0 else 1.0


def _heatmap(diff: pd.DataFrame, value: str, x: str, row_keys: list[str], title: str) -> go.Figure:
    table = pd.DataFrame({"row": _row_labels(diff, row_keys), "x": diff[x].astype(str), "d": diff[f"{value}_diff"]})
    pivot = table.pivot_table(index="row", columns="x", values="d", aggfunc="mean", sort=False)
    z = pivot.to_numpy(dtype=np.float64)
    m = _symmetric(z)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=pivot.columns.tolist(),
            y=pivot.index.tolist(),
            colorscale=DIVERGING,
            zmid=0.0,
            zmin=-m,
            zmax=m,
            colorbar={"title": {"text": f"A - B ({readable(value)})"}},
            hovertemplate="%{y}, " + x + " %{x}<br>A - B = %{z:.4g}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    return apply_style(
        fig,
        title,
        readable(x),
        " / ".join(readable(k) for k in row_keys),
        height=min(900, max(260, 110 + 24 * len(pivot))),
    )


def _bars(diff: pd.DataFrame, values: list[str], keys: list[str], x: str, title: str) -> go.Figure:
    labels = _row_labels(diff, [k for k in keys if k != x])
    xs = [f"{lab} {_key_label(x, v)}".strip() for lab, v in zip(labels, diff[x])]
    height = max(260, 90 + 170 * len(values))
    fig = make_subplots(
        rows=len(values),
        cols=1,
        shared_xaxes=True,
        subplot_titles=[readable(v) for v in values],
        **subplot_spacing(len(values), 1, height),
    )
    for row, value in enumerate(values, start=1):
        d = diff[f"{value}_diff"].to_numpy(dtype=np.float64)
        fig.add_trace(
            go.Bar(
                x=xs,
                y=d,
                name=value,
                showlegend=False,
                marker_color=np.where(d >= 0, POSITIVE, NEGATIVE),
                customdata=np.stack([diff[f"{value}_a"], diff[f"{value}_b"]], axis=-1),
                hovertemplate="%{x}<br>A - B = %{y:.4g}<br>A %{customdata[0]:.4g}, B %{customdata[1]:.4g}"
                "<extra></extra>",
            ),
            row=row,
            col=1,
        )
        m = _symmetric(d) * 1.08
        fig.update_yaxes(range=[-m, m], zeroline=True, zerolinecolor="#888", title_text="A - B", row=row, col=1)
    fig.update_xaxes(type="category", title_text=" / ".join(readable(k) for k in keys), row=len(values), col=1)
    return apply_style(fig, title, height=height)
