"""The shared figure style (analysis.figures.style): the legend never sits on subplot titles; the screen copy of a
figure (lighter payload for the browser) keeps its numbers and look."""

from __future__ import annotations

import base64

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from analysis.figures.style import apply_style


def test_legend_moves_right_of_the_plots_when_subplot_titles_take_the_top_row():
    plain = apply_style(go.Figure(go.Scatter(x=[0, 1], y=[1, 2], name="a")), "t")
    assert plain.layout.legend.orientation == "h" and plain.layout.legend.y > 1
    panels = make_subplots(rows=1, cols=2, subplot_titles=("left", "right"))
    panels.add_trace(go.Scatter(x=[0], y=[1], name="a"), row=1, col=1)
    panels = apply_style(panels, "t", "x", "y")
    assert panels.layout.legend.orientation == "v" and panels.layout.legend.x > 1
    assert panels.layout.title.text == "t" and panels.layout.xaxis.title.text == "x"


def test_round_significant_matches_hand_values():
    from analysis.figures.style import round_significant

    got = round_significant(np.array([123456.7, 0.000123456, -98765.4321, 1.0, 0.0, np.inf, np.nan]), 5)
    np.testing.assert_array_equal(got[:6], [123460.0, 0.00012346, -98765.0, 1.0, 0.0, np.inf])
    assert np.isnan(got[6])


def test_screen_floats_keep_whole_numbers_exact_and_round_the_rest_column_by_column():
    from analysis.figures.style import screen_floats

    positions = np.array([0.0, 131071.0, 163839.0])  # token positions / ids beyond 5 digits stay exact
    assert screen_floats(positions, 5).dtype == np.float32
    np.testing.assert_array_equal(screen_floats(positions, 5), positions)
    table = np.array([[131071.0, 0.123456789], [7.0, 2.718281828]])
    out = screen_floats(table, 5)
    np.testing.assert_array_equal(out[:, 0], [131071.0, 7.0])
    np.testing.assert_allclose(out[:, 1], [0.12346, 2.7183], rtol=1e-7)


def _values(value) -> np.ndarray:
    """An array from a figure property: a numpy array, or plotly's typed-array dict ({"dtype", "bdata", "shape"})."""
    if isinstance(value, dict):
        flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        return flat.reshape([int(n) for n in str(value.get("shape", flat.size)).split(",")])
    return np.asarray(value)


def test_screen_figure_is_a_lighter_copy_with_the_same_numbers_and_look():
    from analysis.figures.style import SCREEN_MAX_TICKS, screen_figure

    rng = np.random.default_rng(0)
    y = rng.normal(size=400)
    custom = np.stack([np.arange(400.0), rng.random(400)], axis=1)
    # the template named: importing streamlit makes its own template plotly's default
    scatter = go.Scatter(x=np.arange(400), y=y, customdata=custom, hovertemplate="%{customdata[1]:.3f}")
    fig = go.Figure(scatter, layout={"template": "plotly_white"})
    fig.add_trace(go.Heatmap(z=rng.random((4, 5))))
    apply_style(fig, "t", "x", "y")
    fig.update_xaxes(
        tickmode="array", tickvals=list(range(0, 400, 10)), ticktext=[f"{i}:tok" for i in range(0, 400, 10)]
    )
    original = fig.to_json()

    screen = screen_figure(fig)
    assert fig.to_json() == original  # the exported figure is untouched
    assert len(screen.to_json()) < 0.75 * len(original)  # float32 y and z, a trimmed template, fewer ticks
    assert _values(screen.data[0].y).dtype == np.float32
    np.testing.assert_allclose(np.asarray(screen.data[0].y, dtype=float), y, rtol=1e-4)
    assert _values(screen.data[0].customdata).dtype == np.float64  # hover prints it as is: untouched
    np.testing.assert_array_equal(_values(screen.data[0].customdata), custom)
    np.testing.assert_allclose(np.asarray(screen.data[1].z, dtype=float), np.asarray(fig.data[1].z), rtol=1e-4)
    # the same look: the template's layout and the defaults of the figure's own trace types
    template = screen.layout.template
    assert set(template.data.to_plotly_json()) == {"scatter", "heatmap"}
    assert template.layout.plot_bgcolor == "white" and template.layout.xaxis.automargin is True
    assert template.layout.scene.to_plotly_json() == {} and template.layout.polar.to_plotly_json() == {}
    assert screen.layout.title.text == "t" and screen.layout.height == fig.layout.height
    # 40 explicit token ticks: every 3rd on screen, the first kept, each with its own label
    vals, texts = list(screen.layout.xaxis.tickvals), list(screen.layout.xaxis.ticktext)
    assert len(vals) <= SCREEN_MAX_TICKS and vals[:2] == [0, 30] and texts[:2] == ["0:tok", "30:tok"]
    assert len(fig.layout.xaxis.tickvals) == 40


def test_log_axes_label_minor_ticks_by_their_value():
    """plotly's default writes a small "5" for 0.5 on a log axis' minor ticks: the k3lab template asks for 0.5."""
    from analysis.figures.style import apply_style

    assert pio.templates.default == "k3lab", pio.templates.default  # not streamlit's, whatever was imported first

    fig = apply_style(go.Figure(go.Scatter(x=[1, 2], y=[0.3, 3])), "log", "x", "y")
    fig.update_yaxes(type="log")
    assert fig.layout.template.layout.yaxis.minorloglabels == "complete"
    assert fig.layout.template.layout.xaxis.minorloglabels == "complete"
