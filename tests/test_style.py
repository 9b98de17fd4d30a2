"""The shared figure style (analysis.style): the legend never sits on subplot titles."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.style import apply_style


def test_legend_moves_right_of_the_plots_when_subplot_titles_take_the_top_row():
    plain = apply_style(go.Figure(go.Scatter(x=[0, 1], y=[1, 2], name="a")), "t")
    assert plain.layout.legend.orientation == "h" and plain.layout.legend.y > 1
    panels = make_subplots(rows=1, cols=2, subplot_titles=("left", "right"))
    panels.add_trace(go.Scatter(x=[0], y=[1], name="a"), row=1, col=1)
    panels = apply_style(panels, "t", "x", "y")
    assert panels.layout.legend.orientation == "v" and panels.layout.legend.x > 1
    assert panels.layout.title.text == "t" and panels.layout.xaxis.title.text == "x"
