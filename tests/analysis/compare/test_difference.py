"""Differences A - B of two tidy tables and their figures (analysis.compare.difference), on hand cases."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.compare.difference import difference_figure, difference_table, reduce_keys
from analysis.views.view import NotApplicable


def test_difference_table_hand_case_and_refusals():
    a = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "v": [1.0, 2.0, 3.0, 4.0], "const": 7})
    b = pd.DataFrame({"layer": [1, 1, 0, 0], "head": [1, 0, 1, 0], "v": [0.5, 0.5, 0.5, 0.5], "const": 7})
    diff = difference_table(a, b, ["layer", "head"], ["v"])
    np.testing.assert_allclose(diff.sort_values(["layer", "head"])["v_diff"], [0.5, 1.5, 2.5, 3.5])
    assert "const_diff" not in diff
    with pytest.raises(NotApplicable, match="rows"):
        difference_table(a, a.iloc[:2], ["layer", "head"], ["v"])
    with pytest.raises(NotApplicable, match="do not match"):
        difference_table(a, a.assign(layer=[5, 5, 6, 6]), ["layer", "head"], ["v"])
    with pytest.raises(NotApplicable, match="uniquely"):
        difference_table(a, a, ["layer"], ["v"])


def test_one_value_over_two_keys_is_a_symmetric_heatmap():
    a = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "v": [1.0, 2.0, 3.0, 4.0]})
    b = a.assign(v=[1.0, 1.0, 1.0, 0.5])
    fig = difference_figure(difference_table(a, b, ["layer", "head"], ["v"]), "t", x="head")
    hm = fig.data[0]
    np.testing.assert_allclose(hm.z, [[0.0, 1.0], [2.0, 3.5]])
    assert (hm.zmin, hm.zmid, hm.zmax) == (-3.5, 0.0, 3.5)
    assert list(hm.y) == ["layer 0", "layer 1"] and list(hm.x) == ["0", "1"]


def test_several_values_or_one_key_are_bars_per_value():
    a = pd.DataFrame({"layer": [0, 1], "p": [10.0, 20.0], "q": [1.0, 1.0]})
    b = a.assign(p=[12.0, 15.0], q=[0.5, 2.0])
    fig = difference_figure(difference_table(a, b, ["layer"], ["p", "q"]), "t")
    assert [t.type for t in fig.data] == ["bar", "bar"]
    np.testing.assert_allclose(fig.data[0].y, [-2.0, 5.0])
    np.testing.assert_allclose(fig.data[1].y, [0.5, -1.0])
    assert fig.layout.yaxis.range[0] == pytest.approx(-fig.layout.yaxis.range[1])  # centred at 0


def test_reduce_keys_averages_over_heads():
    df = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "v": [1.0, 3.0, 5.0, 9.0]})
    out = reduce_keys(df, ["layer", "head"], ["v"], ["head"])
    assert list(out["v"]) == [2.0, 7.0] and out.attrs["keys"] == ["layer"]
    with pytest.raises(NotApplicable, match="no key"):
        reduce_keys(df, ["head"], ["v"], ["head"])
