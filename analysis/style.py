"""One look for every k3lab figure: template, colour scales that read in print, layer-type colours."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

# Set once: passing template= per figure re-validates and deep-copies the template (~0.2 s a figure).
pio.templates.default = "plotly_white"

FONT = "Inter, Helvetica, Arial, sans-serif"
# Perceptually uniform, readable in greyscale print.
SEQUENTIAL = "Viridis"
SEQUENTIAL_REVERSED = "Viridis_r"
DIVERGING = "RdBu_r"  # for differences: zero is white
LAYER_TYPE_COLORS = {
    "KDA": "#1f77b4",
    "MLA": "#d62728",
    "dense FFN": "#7f7f7f",
    "LatentMoE": "#2ca02c",
    "MoE": "#2ca02c",
}
RUN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def apply_style(
    fig: go.Figure, title: str, x_title: str | None = None, y_title: str | None = None, height: int = 420
) -> go.Figure:
    """Title, axis labels (with units in the label text), white background, consistent margins.

    The legend sits in a row above the plot, or in a column on its right when subplot titles take that row."""
    subplot_titles = any(a.yref == "paper" and a.y is not None and a.y >= 0.99 for a in fig.layout.annotations)
    if subplot_titles:
        legend = {"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"}
    else:
        legend = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "right", "x": 1.0}
    fig.update_layout(
        title={"text": title, "x": 0.0, "xanchor": "left", "font": {"size": 16}},
        font={"family": FONT, "size": 12},
        height=height,
        margin={"l": 70, "r": 30, "t": 60, "b": 60},
        legend=legend,
        hoverlabel={"font": {"family": FONT}},
    )
    if x_title is not None:
        fig.update_xaxes(title_text=x_title)
    if y_title is not None:
        fig.update_yaxes(title_text=y_title)
    return fig


# ----------------------------------------------------------------------------------------- screen payload
SCREEN_MAX_TICKS = 16  # explicit tick labels per axis on screen (every point still names its token in the hover)
_SUBPLOT_KINDS = ("polar", "ternary", "scene", "geo", "map", "mapbox")
_FLOAT_KINDS = "f"


def _trimmed_template(template: dict, data: list[dict], layout: dict) -> dict:
    """The part of a template this figure can use: trace defaults of its own trace types, and no 3-D, polar,
    ternary or map settings when it has no such subplot. What is left over could never change the figure."""
    types = {trace.get("type", "scatter") for trace in data}
    used = {kind for kind in _SUBPLOT_KINDS for key in layout if key.startswith(kind)}
    used |= {kind for kind in _SUBPLOT_KINDS for trace in data if trace.get("subplot", "").startswith(kind)}
    out = dict(template)
    if "data" in out:
        out["data"] = {t: v for t, v in out["data"].items() if t in types}
    if "layout" in out:
        out["layout"] = {k: v for k, v in out["layout"].items() if k not in _SUBPLOT_KINDS or k in used}
    return out


def round_significant(values: np.ndarray, digits: int) -> np.ndarray:
    """Each value rounded to ``digits`` significant digits: ``round(v, digits - 1 - floor(log10|v|))``
    (0, inf and nan unchanged)."""
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        magnitude = np.floor(np.log10(np.abs(v)))
    magnitude = np.where(np.isfinite(magnitude), magnitude, 0.0)
    scale = 10.0 ** (digits - 1 - magnitude)
    out = np.round(v * scale) / scale
    return np.where(np.isfinite(v), out, v)


def screen_floats(values: np.ndarray, digits: int) -> np.ndarray:
    """float32 copy of a float array for the screen: whole numbers below 2**24 (token positions and ids, counts)
    exactly, others rounded to ``digits`` significant digits first (float32 keeps 7, so the rounded value is what
    any hover label prints). A 2-D array is treated column by column."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 2:
        return np.stack([screen_floats(v[:, j], digits) for j in range(v.shape[1])], axis=1) if v.size else v
    finite = v[np.isfinite(v)]
    if np.all(finite == np.round(finite)) and (finite.size == 0 or np.abs(finite).max() <= 2**24):
        return v.astype(np.float32)
    return round_significant(v, digits).astype(np.float32)


def _lighten(value: Any, digits: int, key: str = "") -> Any:
    """Float arrays (plotly's typed-array dicts, or lists of plain floats) through ``screen_floats``; ``customdata``
    (printed as is by hover templates) untouched; dicts and lists of dicts walked; everything else as is."""
    if key == "customdata":
        return value
    if isinstance(value, dict):
        if value.get("dtype") == "f8" and isinstance(value.get("bdata"), str):  # plotly's typed-array encoding
            flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype="<f8")
            shape = [int(n) for n in str(value.get("shape", len(flat))).split(",")]
            return screen_floats(flat.reshape(shape), digits)  # plotly sends it back as a float32 typed array
        return {k: _lighten(v, digits, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(v, float) for v in value):
            return [float(v) for v in screen_floats(np.array(value), digits)]
        if any(isinstance(v, (dict, list, tuple)) for v in value):
            return [_lighten(v, digits, key) for v in value]
    return value


def _as_list(value: Any) -> list | None:
    """A list from a plain list or plotly's typed-array dict (``{"dtype", "bdata"[, "shape"]}``); else None."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict) and isinstance(value.get("bdata"), str) and "shape" not in value:
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"])).tolist()
    return None


def _thin_ticks(axis: dict, max_ticks: int) -> dict:
    """At most ``max_ticks`` of an axis' explicit (tickmode "array") ticks: every k-th, the first kept. Plotly measures
    every tick label to place and turn them; 47 "position:token" labels cost ~0.1 s of drawing a chart, 16 ~0.02 s."""
    if axis.get("tickmode") != "array":
        return axis
    vals, texts = _as_list(axis.get("tickvals")), _as_list(axis.get("ticktext"))
    if vals is None or len(vals) <= max_ticks:
        return axis
    step = -(-len(vals) // max_ticks)
    out = {**axis, "tickvals": vals[::step]}
    if texts is not None:
        out["ticktext"] = texts[::step]
    return out


def screen_figure(fig: go.Figure, digits: int = 5, max_ticks: int = SCREEN_MAX_TICKS) -> go.Figure:
    """A lighter copy of ``fig`` for drawing on screen; ``fig`` itself (exports, tables, tests) is unchanged.

    Float data are rounded to ``digits`` significant digits and sent as float32 (half the bytes of float64; hover
    labels print at most 4 digits), and the template keeps only what this figure can use (trace defaults of its
    own trace types; no 3-D, polar or map settings without such a subplot), so the look is the same. Axes with
    more than ``max_ticks`` explicit tick labels (token positions) show every k-th; the hover still names each
    point, and the exported files keep every label."""
    spec = fig.to_dict()
    data = [_lighten(trace, digits) for trace in spec.get("data", [])]
    layout = {
        k: _thin_ticks(v, max_ticks) if k.startswith(("xaxis", "yaxis")) and isinstance(v, dict) else v
        for k, v in spec.get("layout", {}).items()
    }
    template = layout.get("template")
    if template is None:  # the default template (pio.templates.default), written out so it can be trimmed
        template = pio.templates[pio.templates.default].to_plotly_json()
    layout["template"] = _trimmed_template(template, data, layout)
    return go.Figure({"data": data, "layout": layout, "frames": spec.get("frames", [])}, skip_invalid=True)
