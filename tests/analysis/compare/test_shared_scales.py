"""Shared axis ranges and colour scales (analysis.compare.shared_scales) on hand-made figure dicts."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import pytest

from analysis.compare.shared_scales import plotly_array, share_colour_scales, shared_axis_ranges


def test_log_axis_range_is_in_log10_units_and_covers_both():
    fig = {
        "data": [
            {"type": "bar", "x": [0, 1], "y": [1e3, 1e5], "yaxis": "y"},
            {"type": "bar", "x": [0, 1], "y": [2e2, 4e6], "xaxis": "x2", "yaxis": "y2"},
        ],
        "layout": {"yaxis": {"type": "log"}, "yaxis2": {"type": "log"}, "xaxis2": {}},
    }
    shared_axis_ranges(fig, [("yaxis", "yaxis2"), ("xaxis", "xaxis2")])
    lo, hi = fig["layout"]["yaxis"]["range"]
    span = math.log10(4e6) - math.log10(2e2)
    assert lo == pytest.approx(math.log10(2e2) - 0.05 * span) and hi == pytest.approx(math.log10(4e6) + 0.05 * span)
    assert fig["layout"]["yaxis2"]["range"] == [lo, hi]
    assert fig["layout"]["xaxis"]["range"] == fig["layout"]["xaxis2"]["range"]


def test_linear_bars_start_at_zero_and_a_chosen_range_stays():
    fig = {
        "data": [
            {"type": "bar", "x": ["a", "b"], "y": [2.0, 4.0]},
            {"type": "scatter", "x": [0, 1], "y": [0.2, 0.9], "xaxis": "x2", "yaxis": "y2"},
        ],
        "layout": {"yaxis2": {"range": [0, 1]}},
    }
    shared_axis_ranges(fig, [])
    assert fig["layout"]["yaxis"]["range"] == [0.0, pytest.approx(4.0 + 0.05 * 4.0)]
    assert fig["layout"]["yaxis2"]["range"] == [0, 1]  # the data lie inside the view's 0..1


def test_categories_are_the_union_in_order_and_reversed_axes_stay_reversed():
    fig = {
        "data": [
            {"type": "heatmap", "z": [[1, 2]], "x": ["H0", "H1"], "y": ["L0"]},
            {"type": "heatmap", "z": [[1], [2]], "x": ["H0"], "y": ["L0", "L3"], "xaxis": "x2", "yaxis": "y2"},
        ],
        "layout": {"yaxis": {"autorange": "reversed"}, "yaxis2": {"autorange": "reversed"}},
    }
    shared_axis_ranges(fig, [("xaxis", "xaxis2"), ("yaxis", "yaxis2")])
    assert fig["layout"]["yaxis"]["categoryarray"] == ["L0", "L3"]
    assert fig["layout"]["yaxis"]["range"] == [1.5, -0.5]  # two categories, top to bottom
    assert fig["layout"]["xaxis2"]["categoryarray"] == ["H0", "H1"]


def test_numeric_heatmap_cells_are_covered_to_their_edges():
    fig = {"data": [{"type": "heatmap", "z": [[1, 2, 3]], "x": [0, 1, 2]}], "layout": {}}
    shared_axis_ranges(fig, [])
    assert fig["layout"]["xaxis"]["range"] == [-0.5, 2.5]  # exactly the cell edges: no blank band


def test_bar_slots_are_covered_to_their_edges_on_both_runs_axes():
    """Bars at 1..7 (run A) and 1..5 (run B) on matched x axes: plotly draws each bar centred on its
    position, one slot wide, so the shared range is 0.5..7.5, not the centres' 1..7 padded by 5%."""
    fig = {
        "data": [
            {"type": "bar", "x": [1, 2, 3, 4, 5, 6, 7], "y": [3, 1, 2, 2, 1, 4, 2]},
            {"type": "bar", "x": [1, 2, 3, 4, 5], "y": [1, 1, 1, 5, 1], "xaxis": "x2", "yaxis": "y2"},
        ],
        "layout": {},
    }
    shared_axis_ranges(fig, [("xaxis", "xaxis2"), ("yaxis", "yaxis2")])
    assert fig["layout"]["xaxis"]["range"] == [0.5, 7.5] == fig["layout"]["xaxis2"]["range"]
    lo, hi = fig["layout"]["yaxis"]["range"]
    assert lo == 0.0 and hi == 5 + 0.05 * 5  # values from the zero base, padded 5%


def test_paired_heatmaps_share_one_colour_range_and_one_bar():
    a = {"type": "heatmap", "z": [[0.0, 1.0]]}
    b = {"type": "heatmap", "z": [[-2.0, 0.5]]}
    share_colour_scales([a], [b])
    assert (a["zmin"], a["zmax"]) == (b["zmin"], b["zmax"]) == (-2.0, 1.0)
    assert a["showscale"] is False and "showscale" not in b


def test_plotly_array_reads_base64_typed_arrays():
    fig = go.Figure(go.Heatmap(z=np.arange(6.0).reshape(2, 3)))
    z = fig.to_plotly_json()["data"][0]["z"]
    np.testing.assert_array_equal(plotly_array(z), np.arange(6.0).reshape(2, 3))
