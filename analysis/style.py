"""One look for every k3lab figure: template, colour scales that read in print, layer-type colours."""

from __future__ import annotations

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
