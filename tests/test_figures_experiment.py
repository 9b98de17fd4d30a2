"""The Experiment page's figures drawn right: depth order, numeric key positions."""

from __future__ import annotations

import pandas as pd

from analysis import attribution as attr
from analysis.figures.experiment import layer_attribution_figure, mla_attention_figure

from .conftest import nano_model, random_ids


def test_layer_attribution_bars_stand_in_depth_order():
    model = nano_model()
    result = attr.layer_attribution(model, random_ids(6, 1, 1)[0], random_ids(1, 1, 2)[0], n_steps=4)
    fig = layer_attribution_figure(result)
    order = list(fig.layout.xaxis.categoryarray)
    layers = [int(c.split()[0][1:]) for c in order]
    assert layers == sorted(layers) and set(order) == {x for trace in fig.data for x in trace.x}
    assert fig.layout.xaxis.categoryorder == "array"


def test_mla_attention_keys_are_numbers_in_position_order():
    rows = pd.DataFrame({"key": ["0", "105", "112", "12", "2"], "prob": [0.1, 0.2, 0.3, 0.25, 0.15]})
    fig = mla_attention_figure(rows, 112, "MLA layer 3, head 0")
    assert list(fig.data[0].x) == [0, 2, 12, 105, 112]
    assert list(fig.data[0].y) == [0.1, 0.15, 0.25, 0.2, 0.3]
    assert fig.layout.xaxis.type == "linear"


def test_the_config_table_numbers_layers_from_zero_like_the_layer_map():
    from analysis.checkpoint_summary import config_summary
    from k3core.presets import from_preset

    cfg = from_preset("k3-nano")
    summary = config_summary(cfg)
    assert summary["mla_layers"] == [i for i, t in enumerate(cfg.layer_types()) if t == "MLA"]
    assert not any("1-based" in key for key in summary)
