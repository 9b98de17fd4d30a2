"""One look for every k3lab figure: template, colour scales that read in print, layer-type colours."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

# Set once: passing template= per figure re-validates and deep-copies the template (~0.2 s a figure).
# plotly_white, with log axes' minor ticks labelled by their value: plotly's default labels 0.5 as a small "5".
_TEMPLATE = go.layout.Template(pio.templates["plotly_white"])
_TEMPLATE.layout.xaxis.minorloglabels = "complete"
_TEMPLATE.layout.yaxis.minorloglabels = "complete"
pio.templates["k3lab"] = _TEMPLATE


def use_k3lab_template() -> None:
    """Make the k3lab template plotly's default (again). Importing streamlit sets its own template ("streamlit",
    placeholder colours) as the default, and a figure takes the default when it is built: so whatever imports
    streamlit after this module (the app's pages, the test workers) calls this after that import."""
    pio.templates.default = "k3lab"


use_k3lab_template()

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
FIGURE_WIDTH = 900  # px: the app's main column (1280-px window, sidebar open), where a figure's text must fit
CHAR_PX = 0.6  # average glyph width of the sans-serif font, in units of its size
SUBPLOT_TITLE_SIZE = 13
MIN_COLOUR_TICKS = 4
#: a legend as a column right of the plot (where a row above it would run into titles); copy it before changing it
LEGEND_RIGHT = {"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"}


def apply_style(
    fig: go.Figure, title: str, x_title: str | None = None, y_title: str | None = None, height: int = 420
) -> go.Figure:
    """Title, axis labels (with units in the label text), white background, consistent margins.

    The legend sits in a row above the plot, or in a column on its right when subplot titles take that row."""
    subplot_titles = any(a.yref == "paper" and a.y is not None and a.y >= 0.99 for a in fig.layout.annotations)
    if subplot_titles:
        legend = dict(LEGEND_RIGHT)
    else:
        legend = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "right", "x": 1.0}
    # The title wrapped to the figure's width, at the top; a legend row (wrapped as plotly wraps it) between the
    # title and the plot: the top margin holds both, so a long title never runs into the legend.
    text = wrap_to_px(title, FIGURE_WIDTH - 60, 16)
    rows = 0 if subplot_titles else legend_rows(fig, FIGURE_WIDTH - 100)
    top = 18 + 22 * (text.count("<br>") + 1) + 22 * rows + 8 + (20 if subplot_titles else 0)
    fig.update_layout(
        title={
            "text": text,
            "x": 0.0,
            "xanchor": "left",
            # 10 px from the top edge (pad.t is not applied); plotly lifts each extra line of a wrapped title by
            # half a line, taken back here
            "y": 1.0 - (10 + 11 * text.count("<br>")) / (height + max(0, top - 60)),
            "yref": "container",
            "yanchor": "top",
            "pad": {"l": 8},
            "font": {"size": 16},
        },
        font={"family": FONT, "size": 12},
        height=height + max(0, top - 60),
        margin={"l": 70, "r": 30, "t": max(60, top), "b": 60},
        legend=legend,
        hoverlabel={"font": {"family": FONT}},
    )
    if x_title is not None:
        fig.update_xaxes(title_text=x_title)
    if y_title is not None:
        fig.update_yaxes(title_text=y_title)
    fit_subplot_titles(fig)
    label_colour_bars(fig)
    note_empty_panels(fig)
    return fig


def legend_rows(fig: go.Figure, width_px: float) -> int:
    """Rows a horizontal legend of ``fig`` takes at ``width_px``: its entries (named traces shown in the legend,
    one per legend group) at ~7 px a character plus the symbol, wrapped as plotly wraps them."""
    widths, groups = [], set()
    for tr in fig.data:
        if tr.showlegend is False or not tr.name or (tr.legendgroup and tr.legendgroup in groups):
            continue
        if tr.showlegend is None and len(fig.data) == 1:  # plotly shows no legend for a single trace
            continue
        groups.add(tr.legendgroup)
        widths.append(45 + 7 * len(str(tr.name)))
    rows, used = (1, 0) if widths else (0, 0)
    for w in widths:
        if used and used + w > width_px:
            rows, used = rows + 1, 0
        used += w
    return rows


EMPTY_PANEL_NOTE = "every value is 0 here"
# A note inside a panel (empty, or a run the view does not apply to): centred, grey, named so that layout code
# tells it from subplot titles.
NOTE_STYLE = {
    "showarrow": False,
    "xanchor": "center",
    "yanchor": "middle",
    "font": {"size": 12, "color": "#555"},
    "name": "note",
}


def mark_repeat_start(fig: go.Figure, x: float | None) -> go.Figure:
    """A dashed vertical line at ``x`` (None: nothing) labelled where a copy task's second half begins, so a
    per-token view shows which positions are predictable from the first half."""
    if x is not None:
        fig.add_vline(
            x=x,
            line={"dash": "dash", "color": "#555", "width": 1.5},
            annotation={"text": "second half (copy) →", "font": {"size": 11, "color": "#555"}},
            annotation_position="top right",
        )
    return fig


def note_empty_panels(fig: go.Figure, text: str = EMPTY_PANEL_NOTE) -> None:
    """A note inside each panel whose bars are all 0 (or missing): an empty panel says that it is empty, instead
    of looking like a drawing that failed. Only panels of bar traces (a line at 0 is drawn and seen)."""
    panels: dict[tuple[str, str], list] = {}
    for tr in fig.data:
        if getattr(tr, "xaxis", None) is None and tr.type not in ("bar", "scatter", "box", "heatmap"):
            continue
        panels.setdefault((tr.xaxis or "x", tr.yaxis or "y"), []).append(tr)
    for (x, y), traces in panels.items():
        if not all(tr.type == "bar" for tr in traces):
            continue
        values = []
        for tr in traces:
            v = tr.x if tr.orientation == "h" else tr.y
            try:
                values.append(np.asarray(v if v is not None else [], dtype=np.float64).ravel())
            except (TypeError, ValueError):
                values.append(np.ones(1))
        allv = np.concatenate(values) if values else np.zeros(0)
        if np.any(np.nan_to_num(allv) != 0):
            continue
        fig.add_annotation(
            text=text,
            xref=f"{x} domain",
            yref=f"{y} domain",
            x=0.5,
            y=0.8,
            **NOTE_STYLE,
        )


# ----------------------------------------------------------------------------------------- text that fits
def wrap_to_px(text: str, px: float, size: float = SUBPLOT_TITLE_SIZE) -> str:
    """``text`` broken into lines (plotly's ``<br>``) of at most ``px`` pixels at font ``size``
    (``CHAR_PX * size`` per character); existing breaks kept."""
    import textwrap

    width = max(8, int(px / (CHAR_PX * size)))
    lines = []
    # " — run label" stays on one line (the run's name, and code that strips it from a title, read it whole)
    for part in str(text).replace(" — ", "\u00a0—\u00a0").split("<br>"):
        lines += textwrap.wrap(part, width, break_long_words=False) or [part]
    return "<br>".join(lines).replace("\u00a0", " ")


def subplot_spacing(rows: int, cols: int, height: int, title_lines: int = 1, width: int = FIGURE_WIDTH) -> dict:
    """``horizontal_spacing`` / ``vertical_spacing`` for ``make_subplots`` computed from what sits between panels:
    y tick labels and a y title (80 px) between columns; x tick labels, an x title and the next row's subplot
    title (``title_lines`` lines) between rows."""
    plot_w = max(width - 100, 200)
    plot_h = max(height - 120, 100)
    out = {}
    if cols > 1:
        out["horizontal_spacing"] = min(0.3, 80 / plot_w)
    if rows > 1:
        out["vertical_spacing"] = min(0.3, (48 + 18 * title_lines + 8) / plot_h)
    return out


def _is_subplot_title(ann: dict) -> bool:
    return (
        ann.get("xref") == "paper"
        and ann.get("yref") == "paper"
        and ann.get("yanchor") == "bottom"
        and ann.get("showarrow") is False
        and ann.get("name") is None
    )


def fit_subplot_titles(fig: Any, width: int | None = None) -> None:
    """Subplot titles wrapped to their panel's width (a figure ``width`` px wide, default its own or
    ``FIGURE_WIDTH``), at one font size, lifted clear of the top tick label; the top margin grows for a wrapped
    title of the top row. Works on a ``go.Figure`` or a figure dict, in place."""
    is_dict = isinstance(fig, dict)
    layout = fig.setdefault("layout", {}) if is_dict else fig.layout.to_plotly_json()
    anns = layout.get("annotations") or []
    width = width or layout.get("width") or FIGURE_WIDTH
    margin = layout.get("margin") or {}
    plot_w = width - margin.get("l", 70) - margin.get("r", 30)
    domains = [tuple(v.get("domain", (0.0, 1.0))) for k, v in layout.items() if k.startswith("xaxis")]
    domains = domains or [(0.0, 1.0)]
    for key, axis in list(layout.items()):  # x titles as wide as their panel (side by side: half as wide)
        text = ((axis or {}).get("title") or {}).get("text") if key.startswith("xaxis") else None
        if text and len(domains) > 1:
            d0, d1 = axis.get("domain", (0.0, 1.0))
            wrapped = wrap_to_px(text, (d1 - d0) * plot_w - 8, 14)
            if wrapped != text:
                if is_dict:
                    axis["title"] = {**axis["title"], "text": wrapped}
                else:
                    fig.layout[key].title.text = wrapped
    extra_top = 0
    for ann in anns:
        if not _is_subplot_title(ann) or ann.get("text") is None:
            continue
        x = float(ann.get("x", 0.5))
        d0, d1 = min(domains, key=lambda d: abs((d[0] + d[1]) / 2 - x))
        text = wrap_to_px(ann["text"], (d1 - d0) * plot_w - 8)
        ann["text"] = text
        ann["font"] = {**(ann.get("font") or {}), "size": SUBPLOT_TITLE_SIZE}
        ann["yshift"] = max(ann.get("yshift") or 0, 6)
        if float(ann.get("y", 0)) >= 0.99:
            extra_top = max(extra_top, 17 * text.count("<br>"))
    if is_dict:
        if extra_top:
            layout["margin"] = {**margin, "t": margin.get("t", 60) + extra_top}
        return
    fig.update_layout(annotations=anns)
    if extra_top:
        fig.update_layout(margin={"t": (fig.layout.margin.t or 60) + extra_top})


# ----------------------------------------------------------------------------------------- colour bars
def colour_ticks(lo: float, hi: float, at_least: int = MIN_COLOUR_TICKS) -> dict:
    """Explicit tick values putting at least ``at_least`` (at most ~10) round numbers between lo and hi: the
    multiples of the largest step of 1, 2, 2.5 or 5 x 10^k that gives that many (a short colour bar keeps its
    labels apart). Values rounded, so a tick at an end (3 x 0.2) is the end itself and is drawn."""
    lo, hi = (float(lo), float(hi)) if lo <= hi else (float(hi), float(lo))
    span = hi - lo
    if not np.isfinite(span) or span <= 0:
        return {}
    magnitude = 10.0 ** np.floor(np.log10(span))
    for step in (magnitude * m for m in (5, 2.5, 2, 1, 0.5, 0.25, 0.2, 0.1, 0.05, 0.025, 0.02, 0.01)):
        ticks = np.round(np.arange(np.floor(lo / step), np.ceil(hi / step) + 1) * step, 12)
        ticks = ticks[(ticks >= lo - 1e-12 * span) & (ticks <= hi + 1e-12 * span)]
        if ticks.size >= at_least:
            return {"tickmode": "array", "tickvals": [float(t) for t in ticks]}
    return {}


def _colour_range(tr: dict) -> tuple[float, float] | None:
    """The colour range of a trace dict: zmin/zmax (heatmaps) or marker cmin/cmax, else the data's range."""
    from analysis.compare.shared_scales import finite_range

    if tr.get("type") in ("heatmap", "contour", "histogram2d"):
        lo, hi, values = tr.get("zmin"), tr.get("zmax"), tr.get("z")
    else:
        marker = tr.get("marker") or {}
        lo, hi, values = marker.get("cmin"), marker.get("cmax"), marker.get("color")
    if lo is None or hi is None:  # plotly ignores a lone zmin or zmax: the data's range is drawn
        return finite_range(values)
    return float(lo), float(hi)


def label_colour_bars(fig: Any) -> None:
    """Every colour bar gets at least ``MIN_COLOUR_TICKS`` labelled ticks over its colour range, and its title at
    its side (clear of the end tick labels). On a ``go.Figure`` or a list of trace dicts, in place."""
    traces = fig if isinstance(fig, list) else None
    for k, tr in enumerate(traces if traces is not None else fig.data):
        spec = tr if traces is not None else tr.to_plotly_json()
        kind = spec.get("type")
        heat = kind in ("heatmap", "contour", "histogram2d")
        marker = spec.get("marker") or {}
        if not heat and not marker.get("showscale"):
            continue
        if spec.get("showscale") is False or spec.get("coloraxis"):
            continue
        rng = _colour_range(spec)
        if rng is None:
            continue
        bar = dict((spec.get("colorbar") if heat else marker.get("colorbar")) or {})
        bar.update(colour_ticks(*rng))
        title = dict(bar.get("title") or {})
        if title.get("text"):
            title["side"] = "right"
            bar["title"] = title
        if traces is not None:
            if heat:
                tr["colorbar"] = bar
            else:
                tr["marker"] = {**marker, "colorbar": bar}
        elif heat:
            fig.data[k].colorbar = bar
        else:
            fig.data[k].marker.colorbar = bar


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
    if key in ("customdata", "tickvals"):  # printed as they are; a float32 tick at a range end falls outside it
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
    if (
        axis.get("tickmode") != "array" or axis.get("type") == "category"
    ):  # each category its own label (a box per head)
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


def accuracy_with_interval(x: Any, df: Any, name: str, what: str, trials: str, digits: int = 2) -> go.Figure:
    """A share against ``x`` with its 95% Wilson band and the chance line (a legend entry, not a note: a note on the
    line sat over the data and the ticks): ``df`` has accuracy, ci_low, ci_high, chance, correct and ``trials``
    columns, and chance_low / chance_high (``null_reference.with_chance_band``) drawn as the band a chance guesser
    reaches with the same trials; ``what`` names x in the hover. Recall by distance and MQAR by length draw it."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=np.r_[x, x[::-1]], y=np.r_[df["ci_high"], df["ci_low"][::-1]], fill="toself",
                             fillcolor="rgba(31,119,180,0.15)", line={"width": 0}, name="95% interval (Wilson)",
                             hoverinfo="skip"))  # fmt: skip
    fig.add_trace(
        go.Scatter(
            x=x, y=df["accuracy"], mode="lines+markers", name=name, line={"color": RUN_COLORS[0]},
            customdata=np.stack([df["correct"], df[trials]], axis=-1),
            hovertemplate=f"{what} %{{x}}<br>accuracy %{{y:.{digits}f}} (%{{customdata[0]}} of %{{customdata[1]}})"
            "<extra></extra>",
        )
    )  # fmt: skip
    n = int(np.min(df[trials]))
    fig.add_trace(go.Scatter(x=np.r_[x, x[::-1]], y=np.r_[df["chance_high"], df["chance_low"][::-1]], fill="toself",
                             fillcolor="rgba(68,68,68,0.12)", line={"width": 0},
                             name=f"chance guesses of {n} {trials} (95%)", hoverinfo="skip"))  # fmt: skip
    chance = float(df["chance"].iloc[0])
    fig.add_trace(go.Scatter(x=[float(np.min(x)), float(np.max(x))], y=[chance, chance], mode="lines",
                             name=f"chance {chance:.3f} (1 / values)", line={"dash": "dash", "color": "#444"},
                             hoverinfo="skip"))  # fmt: skip
    return fig
