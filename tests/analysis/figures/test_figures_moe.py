"""LatentMoE views (analysis.figures.moe): numbers against hand-computed routing, then a real k3-nano trace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.figures import moe as fm
from analysis.metrics import moe as mo
from analysis.runs.context import AnalysisContext
from analysis.views.catalogue import section_views
from analysis.views.view import NotApplicable
from analysis.weights import summary_of_model
from k3core.interp.trace import Trace, names
from k3core.modeling.presets import from_preset
from tests.conftest import traced_nano

VIEW = {v.key: v for v in fm.VIEWS}
CONFIG = from_preset("k3-nano")


@pytest.fixture(scope="module")
def nano_run():
    model, _, trace = traced_nano(T=32)
    return model, trace


def _hand_ctx() -> AnalysisContext:
    """One MoE layer (1), 4 experts, top-2, 3 tokens: {0, 1}, {0, 2}, {0, 1}; weights 0.75 / 0.25."""
    experts = np.array([[[0, 1], [0, 2], [0, 1]]])
    weights = np.tile([0.75, 0.25], (1, 3, 1))
    t = Trace(meta={"config": {"num_experts": 4}})
    t.add(names.moe_experts(1), experts, ("batch", "token", "rank"))
    t.add(names.moe_weights(1), weights, ("batch", "token", "rank"))
    t.add(names.moe_load(1), mo.load_counts(experts, 4), ("expert",))  # [3, 2, 1, 0]
    t.add(names.moe_bias(1), np.array([0.1, -0.1, 0.2, 0.0]), ("expert",))
    return AnalysisContext(trace=t, config=CONFIG, label="hand")


def test_load_heatmap_and_imbalance_show_the_hand_numbers():
    ctx = _hand_ctx()
    fig, _ = VIEW["moe_load_heatmap"].build(ctx)
    np.testing.assert_allclose(fig.data[0].z, [[3 / 6, 2 / 6, 1 / 6, 0.0]])  # 6 assignments
    fig, _ = VIEW["moe_imbalance"].build(ctx)
    bars = {t.name.split(" =")[0].split(" (")[0]: list(t.y) for t in fig.data}
    mean = 6 / 4
    assert bars["MaxVio"] == [pytest.approx(3 / mean - 1)]  # 1.0
    assert bars["CV"] == [pytest.approx(np.std([3, 2, 1, 0]) / mean)]
    assert bars["dead experts"] == [1]


def test_weight_by_rank_reuse_and_coactivation_show_the_hand_numbers():
    ctx = _hand_ctx()
    fig, _ = VIEW["moe_weight_by_rank"].build(ctx)
    assert list(fig.data[0].x) == [1, 2] and list(fig.data[0].y) == [0.75, 0.25]
    fig, _ = VIEW["moe_reuse"].build(ctx)
    # pairs (t, t+1): {0,1}->{0,2} shares 1 of 2, {0,2}->{0,1} shares 1 of 2: reuse 0.5; chance k/E = 2/4
    assert list(fig.data[0].y) == [pytest.approx(0.5)] and list(fig.data[1].y) == [pytest.approx(0.5)]
    fig, _ = VIEW["moe_coactivation"].build(ctx)
    z = np.asarray(fig.data[0].z, dtype=float)
    assert z[0, 1] == pytest.approx(2 / 3) and z[0, 2] == pytest.approx(1 / 3) and z[1, 2] == 0.0
    assert np.isnan(z[0, 0])  # diagonal blank


def test_router_bias_view_reads_the_weights_and_correlates_the_traced_load(nano_run):
    model, trace = nano_run
    layer = 1  # a MoE layer of k3-nano
    gate = model.model.layers[layer].block_sparse_moe.gate
    bias = torch.linspace(-0.2, 0.2, gate.e_score_correction_bias.numel())
    with torch.no_grad():
        saved = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.copy_(bias)
    try:
        summary = summary_of_model(model)
    finally:
        with torch.no_grad():
            gate.e_score_correction_bias.copy_(saved)
    view = next(v for v in section_views("moe") if v.key == "moe_bias")
    _, table = view.build(AnalysisContext(trace=trace, config=model.config, weights=summary))
    row = table.set_index("layer").loc[layer]
    assert row["std"] == pytest.approx(float(bias.double().std(unbiased=False)))
    load = mo.expert_load(trace)
    c = load[load["layer"] == layer].sort_values("expert")["count"].to_numpy(dtype=float)
    assert row["load_corr"] == pytest.approx(np.corrcoef(bias.double().numpy(), c)[0, 1])
    _, weights_only = view.build(AnalysisContext(trace=None, config=model.config, weights=summary))
    assert "load_corr" not in weights_only  # no trace: the bias alone


def test_every_moe_view_builds_on_a_real_k3_nano_trace(nano_run):
    model, trace = nano_run
    ctx = AnalysisContext(trace=trace, config=model.config, model=model)
    views = section_views("moe")  # the trace views and the router bias, drawn from the weights
    keys = [v.key for v in views]
    assert len(keys) == len(set(keys)) and "moe_bias" in keys
    for view in views:
        fig, df = view.build(ctx)
        assert fig.layout.title.text and len(fig.data) > 0 and len(df) > 0, view.key
        if view.key in ("moe_coactivation", "moe_latent_pca"):
            assert fig.layout.updatemenus and len(fig.layout.updatemenus[0].buttons) == 3  # one per MoE layer
    # the heatmap's numbers are the trace's load counts over their sum
    fig, _ = VIEW["moe_load_heatmap"].build(ctx)
    load = np.asarray(trace[names.moe_load(3)], dtype=float)
    row = list(fig.data[0].y).index("L3")
    np.testing.assert_allclose(np.asarray(fig.data[0].z)[row], load / load.sum())
    one = AnalysisContext(trace=trace, config=model.config, options={"layer": 3})
    fig, _ = VIEW["moe_coactivation"].build(one)
    assert len(fig.data) == 1 and "layer 3" in fig.layout.title.text
    with pytest.raises(NotApplicable):
        VIEW["moe_coactivation"].build(AnalysisContext(trace=trace, config=model.config, options={"layer": 0}))
    # latent PCA: one trace per top-1 expert; its hover names the expert, its points carry position, id and weight
    fig, table = VIEW["moe_latent_pca"].build(AnalysisContext(trace=trace, config=model.config, options={"layer": 3}))
    assert {t.name for t in fig.data} == {str(e) for e in table["top1_expert"].unique()}
    for t in fig.data:
        rows = table[table["top1_expert"] == int(t.name)]
        assert f"top-1 expert {t.name} (weight %{{customdata[2]:.3f}})" in t.hovertemplate
        np.testing.assert_array_equal(np.asarray(t.customdata)[:, :2], rows[["token", "token_id"]].to_numpy())
        np.testing.assert_allclose(np.asarray(t.customdata)[:, 2], rows["top1_weight"], rtol=1e-6)


def test_moe_views_not_applicable_without_moe_and_plain_moe_pca_works():
    model, _, trace = traced_nano(T=12, num_experts=0)
    ctx = AnalysisContext(trace=trace, config=model.config)
    for view in fm.VIEWS:
        with pytest.raises(NotApplicable):
            view.build(ctx)
    model, _, trace = traced_nano(T=12, routed_expert_hidden_size=None)  # plain MoE: z = x
    fig, _ = VIEW["moe_latent_pca"].build(AnalysisContext(trace=trace, config=model.config))
    assert "plain MoE" in fig.layout.title.text
