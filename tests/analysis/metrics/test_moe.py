"""analysis.metrics.moe: hand-computed routing cases and a real k3-nano trace."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.metrics import moe as mo
from k3core.interp.trace import Trace
from tests.conftest import traced_nano


@pytest.fixture(scope="module")
def nano_run():
    model, _, trace = traced_nano(T=32)
    return model, trace


# ----------------------------------------------------------------------------- metrics by hand


def test_balanced_load_has_zero_maxvio_and_unit_entropy():
    m = mo.load_imbalance(np.full(8, 5))
    assert m["max_vio"] == 0.0 and m["cv"] == 0.0 and m["entropy"] == pytest.approx(1.0)
    assert m["dead"] == 0 and m["min_over_mean"] == 1.0 and m["total"] == 40 and m["experts"] == 8


def test_skewed_load_by_hand():
    m = mo.load_imbalance(np.array([6, 2, 0, 0]))  # mean 2
    assert m["max_vio"] == pytest.approx(2.0)  # 6 / 2 - 1
    assert m["cv"] == pytest.approx(np.sqrt((16 + 0 + 4 + 4) / 4) / 2)  # population std / mean
    p = np.array([0.75, 0.25])
    assert m["entropy"] == pytest.approx(-(p * np.log(p)).sum() / np.log(4))
    assert m["dead"] == 2 and m["min_over_mean"] == 0.0
    collapsed = mo.load_imbalance(np.array([4, 0, 0, 0]))
    assert collapsed["entropy"] == 0.0 and collapsed["max_vio"] == pytest.approx(3.0)
    with pytest.raises(ValueError):
        mo.load_imbalance(np.array([1, -1]))


def _routing_trace(experts: np.ndarray, weights: np.ndarray, E: int) -> Trace:
    t = Trace(meta={"config": {"num_experts": E}})
    t.add("blocks.1.moe.experts", experts, ("batch", "token", "rank"))
    t.add("blocks.1.moe.weights", weights, ("batch", "token", "rank"))
    t.add("blocks.1.moe.experts.load", mo.load_counts(experts, E), ("expert",))
    t.add("blocks.1.moe.selection_bias", np.linspace(-1, 1, E), ("expert",))
    return t


def test_one_hot_routing_gives_the_known_heatmap():
    # 4 tokens, top-1 of 4 experts: experts 0, 0, 0, 2
    experts = np.array([[[0], [0], [0], [2]]])
    t = _routing_trace(experts, np.ones((1, 4, 1)), E=4)
    load = mo.expert_load(t)
    assert list(load["count"]) == [3, 0, 1, 0]
    assert list(load["share"]) == pytest.approx([0.75, 0.0, 0.25, 0.0])
    row = mo.imbalance_table(t).iloc[0]
    assert row["layer"] == 1 and row["dead"] == 2 and row["max_vio"] == pytest.approx(2.0)


def test_weight_by_rank_by_hand():
    experts = np.array([[[0, 1], [2, 3]]])
    weights = np.array([[[0.7, 0.3], [0.5, 0.5]]])
    table = mo.weight_by_rank(_routing_trace(experts, weights, E=4))
    assert list(table["rank"]) == [1, 2] and list(table["mean_weight"]) == pytest.approx([0.6, 0.4])


def test_coactivation_counts_by_hand():
    experts = np.array([[0, 1], [0, 1], [1, 2]])  # three tokens, k = 2
    C = mo.coactivation(experts, 3)
    assert C.tolist() == [[2, 2, 0], [2, 3, 1], [0, 1, 1]]
    assert (C == C.T).all()
    with pytest.raises(ValueError):
        mo.coactivation(np.array([[0, 5]]), 3)


def test_next_token_reuse_by_hand():
    same = np.array([[[0, 1], [1, 0], [0, 1]]])  # identical sets, order ignored
    assert mo.next_token_reuse(same) == 1.0
    disjoint = np.array([[[0, 1], [2, 3], [0, 1]]])
    assert mo.next_token_reuse(disjoint) == 0.0
    half = np.array([[[0, 1], [1, 2]], [[3, 4], [3, 4]]])  # seq 0: 1 of 2 kept; seq 1: 2 of 2
    assert mo.next_token_reuse(half) == pytest.approx(0.75)
    assert np.isnan(mo.next_token_reuse(np.zeros((1, 1, 2), dtype=int)))


def test_pca_of_points_on_a_line_is_all_on_pc1():
    t = np.linspace(-3, 3, 20)
    x = np.stack([t, 2 * t, -t, 0 * t + 5], axis=1)  # a line in 4-D
    coords, ratio = mo.pca_2d(x)
    assert ratio[0] == pytest.approx(1.0) and ratio[1] == pytest.approx(0.0, abs=1e-12)
    assert np.abs(coords[:, 0]) == pytest.approx(np.abs(t) * np.sqrt(6))  # distance along the line
    assert np.allclose(coords[:, 1], 0.0, atol=1e-9)


def test_pca_of_an_anisotropic_cloud_orders_components():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 3)) * np.array([5.0, 1.0, 0.1])
    _, ratio = mo.pca_2d(x)
    assert ratio[0] > 0.9 and ratio[0] > ratio[1] > 0


# ----------------------------------------------------------------------------- real trace


def test_moe_metrics_on_a_real_trace(nano_run):
    model, trace = nano_run
    cfg = model.config
    assert mo.moe_layers(trace) == [1, 2, 3]  # first_k_dense_replace = 1
    load = mo.expert_load(trace)
    # the load counts every token of the batch: 2 sequences x 32 tokens x k
    assert (load.groupby("layer")["count"].sum() == 2 * 32 * cfg.num_experts_per_token).all()
    # whole-batch load agrees with the recorded per-token choices (max_batch = 2: all tokens recorded)
    for i in (1, 2, 3):
        assert (
            mo.load_counts(trace[f"blocks.{i}.moe.experts"], cfg.num_experts) == trace[f"blocks.{i}.moe.experts.load"]
        ).all()
    ranks = mo.weight_by_rank(trace)
    assert np.allclose(ranks.groupby("layer")["mean_weight"].sum(), cfg.routed_scaling_factor)
    assert (ranks.groupby("layer")["mean_weight"].diff().dropna() <= 0).all()  # sorted by weight
    C = mo.coactivation(trace["blocks.1.moe.experts"], cfg.num_experts)
    assert np.trace(C) == 2 * 32 * cfg.num_experts_per_token
    reuse = mo.reuse_table(trace)
    assert ((reuse["reuse"] >= 0) & (reuse["reuse"] <= 1)).all() and (reuse["chance"] == 2 / 8).all()
    df, ratio = mo.latent_pca(trace, 2)
    assert len(df) == 2 * 32 and 0 < ratio[1] <= ratio[0] <= 1
    assert (df["top1_expert"] == trace["blocks.2.moe.experts"][..., 0].ravel()).all()
    bias = pd.DataFrame({"layer": 1, "expert": range(cfg.num_experts), "bias": np.arange(cfg.num_experts, dtype=float)})
    load = mo.expert_load(trace)
    corr = mo.bias_load_correlation(bias, load)
    c = load[load["layer"] == 1]["count"].to_numpy(dtype=float)
    assert corr["load_corr"].iloc[0] == pytest.approx(np.corrcoef(np.arange(cfg.num_experts, dtype=float), c)[0, 1])
    assert np.isnan(mo.bias_load_correlation(bias.assign(bias=0.0), load)["load_corr"].iloc[0])  # constant bias


def test_imbalance_says_whether_a_layer_sits_within_the_balanced_routing_floor():
    """A router picking uniformly at random (balanced in expectation) reads MaxVio > 0 yet lies within the floor;
    one sending half of all tokens to expert 0 does not. The co-activation table carries p_i p_j beside each rate."""
    rng = np.random.default_rng(7)
    E, k, T = 8, 2, 512
    balanced = np.argsort(rng.random((1, T, E)), axis=-1)[..., :k]
    row = mo.imbalance_table(_routing_trace(balanced, np.ones((1, T, k)), E)).iloc[0]
    assert row["max_vio"] > 0 and row["tokens"] == T and bool(row["within_floor"])
    assert 0 < row["max_vio_floor"] < row["max_vio_floor_hi"]
    skewed = balanced.copy()
    skewed[0, : T // 2, 0] = 0
    skewed[0, : T // 2, 1] = np.where(skewed[0, : T // 2, 1] == 0, 1, skewed[0, : T // 2, 1])
    assert not bool(mo.imbalance_table(_routing_trace(skewed, np.ones((1, T, k)), E)).iloc[0]["within_floor"])
    co = mo.coactivation_table(_routing_trace(balanced, np.ones((1, T, k)), E))
    diag = co[co.expert_i == co.expert_j].set_index("expert_i")["rate"]
    pair = co[(co.expert_i == 0) & (co.expert_j == 1)].iloc[0]
    assert pair["independent"] == pytest.approx(diag[0] * diag[1])
    assert pair["lift"] == pytest.approx(pair["rate"] / pair["independent"])
