"""Attention degradation diagnostics: each metric against a hand-computed case, then a real k3-nano trace."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from analysis import degradation as dg
from analysis.figures import degradation as fig_dg
from analysis.headline import degradation_summary
from analysis.runs import run_from_model, trace_run
from analysis.views import AnalysisContext, NotApplicable
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.trace import Trace


def uniform_causal(T: int) -> np.ndarray:
    """Row i attends uniformly to keys 0..i."""
    return np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]


def first_token(T: int) -> np.ndarray:
    a = np.zeros((T, T))
    a[:, 0] = 1.0
    return a


def attn_trace(per_head: list[np.ndarray], layer: int = 3) -> Trace:
    tr = Trace()
    tr.add(f"mla.{layer}.attn", np.stack(per_head)[None], ("batch", "head", "query", "key"))
    return tr


# ----------------------------------------------------------------------------- entropy
def test_uniform_causal_attention_has_normalised_entropy_one():
    norm = dg.causal_normalised_entropy(uniform_causal(6))
    assert math.isnan(norm[0])  # one key: undefined, skipped
    np.testing.assert_allclose(norm[1:], 1.0, atol=1e-12)
    np.testing.assert_allclose(dg.causal_row_entropy(uniform_causal(4)), np.log([1, 2, 3, 4]), atol=1e-12)


def test_one_hot_attention_has_entropy_zero_and_table_skips_row_zero():
    tr = attn_trace([uniform_causal(5), first_token(5)])
    df = dg.attention_entropy_table(tr)
    assert list(df["layer"]) == [3, 3] and list(df["head"]) == [0, 1]
    np.testing.assert_allclose(df["entropy_norm"], [1.0, 0.0], atol=1e-12)
    # mean raw entropy over rows 1..4 of the uniform head: (log 2 + log 3 + log 4 + log 5) / 4
    assert df["entropy"].iloc[0] == pytest.approx(np.log([2, 3, 4, 5]).mean())
    assert (df["queries"] == 4).all()


def test_hand_computed_row_entropy():
    a = np.array([[1.0, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]])
    expected = -(0.25 * np.log(0.25) * 2 + 0.5 * np.log(0.5)) / np.log(3)
    assert dg.causal_normalised_entropy(a)[2] == pytest.approx(expected)


# ----------------------------------------------------------------------------- sink
def test_all_attention_on_first_token_is_a_full_sink():
    tr = attn_trace([first_token(8), first_token(8)])
    sink = dg.attention_sink_table(tr)
    np.testing.assert_allclose(sink["first_token_mass"], 1.0)
    assert sink["is_sink"].all()
    assert dg.sink_rate(sink["first_token_mass"].to_numpy()) == 1.0


def test_attention_received_hand_case():
    a = np.array([[1.0, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]])
    # key 0 seen by queries 0,1,2: (1 + 0.5 + 0.2)/3; key 1 by 1,2: (0.5 + 0.3)/2; key 2 by 2: 0.5
    np.testing.assert_allclose(dg.attention_received(a), [1.7 / 3, 0.4, 0.5])
    # uniform causal: key 0 gets the mean of 1/(i+1)
    T = 10
    assert dg.attention_received(uniform_causal(T))[0] == pytest.approx(np.mean(1 / np.arange(1, T + 1)))


def test_sink_rate_threshold_is_strict():
    assert dg.sink_rate(np.array([0.3, 0.31, 0.1, 0.9])) == 0.5
    assert math.isnan(dg.sink_rate(np.array([])))


def test_attention_needs_square_matrix():
    with pytest.raises(ValueError, match="query == key"):
        dg.causal_row_entropy(np.ones((3, 4)))


# ----------------------------------------------------------------------------- rank collapse
def test_identical_tokens_collapse_completely():
    x = np.tile(np.array([[1.0, -2.0, 3.0, 0.5]]), (7, 1))
    assert dg.rank_collapse_ratio(x) == 0.0
    assert dg.token_uniformity(x) == pytest.approx(1.0)
    assert dg.effective_rank(x) == 0.0  # centred: nothing left


def test_rank_collapse_hand_cases():
    # zero-mean tokens: nothing to remove, r = 1
    assert dg.rank_collapse_ratio(np.array([[1.0, 0.0], [-1.0, 0.0]])) == pytest.approx(1.0)
    # X = [[1, 1], [1, -1]]: mean (1, 0), residual [[0, 1], [0, -1]]: r = sqrt(2) / 2
    assert dg.rank_collapse_ratio(np.array([[1.0, 1.0], [1.0, -1.0]])) == pytest.approx(math.sqrt(2) / 2)
    assert dg.rank_collapse_ratio(np.zeros((3, 2))) == 0.0


def test_orthogonal_tokens_effective_rank():
    n = 5
    eye = np.eye(n) * 3.0
    assert dg.effective_rank(eye, center=False) == pytest.approx(n)
    # centring n orthonormal tokens leaves n - 1 equal singular values
    assert dg.effective_rank(eye) == pytest.approx(n - 1)
    # a random orthogonal basis (not axis aligned) too
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(n, n)))
    assert dg.effective_rank(q, center=False) == pytest.approx(n)
    assert dg.token_uniformity(eye) == pytest.approx(0.0)
    assert dg.effective_rank(np.outer([1.0, 2, 3], [1.0, -1]), center=False) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- redundancy
def test_linear_cka_identity_and_invariances():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 8))
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    assert dg.linear_cka(x, x) == pytest.approx(1.0)
    assert dg.linear_cka(x, x @ q) == pytest.approx(1.0)  # orthogonal transform
    assert dg.linear_cka(x, 5.0 * x) == pytest.approx(1.0)  # isotropic scaling
    assert dg.linear_cka(x, x + 3.0) == pytest.approx(1.0)  # centring removes a shift
    y = rng.normal(size=(40, 8))
    assert dg.linear_cka(x, y) < 0.5
    assert math.isnan(dg.linear_cka(np.ones((4, 2)), x[:4]))


def test_linear_cka_hand_case():
    # one feature each: CKA is the squared Pearson correlation
    x = np.array([[1.0], [2.0], [3.0], [4.0]])
    y = np.array([[1.0], [3.0], [2.0], [4.0]])
    r = np.corrcoef(x[:, 0], y[:, 0])[0, 1]
    assert dg.linear_cka(x, y) == pytest.approx(r**2)


def test_block_influence():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 4))
    assert dg.block_influence(x, x) == pytest.approx(0.0)
    assert dg.block_influence(x, 2 * x) == pytest.approx(0.0)
    assert dg.block_influence(x, -x) == pytest.approx(2.0)
    y = np.array([[1.0, 0.0], [0.0, 1.0]])
    z = np.array([[0.0, 1.0], [0.0, 1.0]])  # cosines 0 and 1
    assert dg.block_influence(y, z) == pytest.approx(0.5)


def test_layer_redundancy_table_uses_consecutive_depths():
    rng = np.random.default_rng(3)
    h0 = rng.normal(size=(1, 5, 4))
    hidden = np.stack([h0, h0, -h0])  # layer 0 does nothing, layer 1 flips the sign
    tr = Trace(meta={"layer_types": ["KDA", "MLA"]})
    tr.add("hidden", hidden, ("depth", "batch", "token", "hidden"))
    df = dg.layer_redundancy_table(tr)
    np.testing.assert_allclose(df["block_influence"], [0.0, 2.0], atol=1e-12)
    np.testing.assert_allclose(df["cka"], [1.0, 1.0])
    assert list(df["layer_type"]) == ["KDA", "MLA"]


# ----------------------------------------------------------------------------- massive activations
def test_planted_massive_activation_is_found():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 32))
    x[5, 7] = -1000.0
    x[9, 2] = 400.0
    top = dg.top_activations(x, k=2)
    assert top[0] == (5, 7, -1000.0)
    assert top[1][:2] == (9, 2)
    assert dg.max_median_ratio(x) == pytest.approx(1000.0 / np.median(np.abs(x)))
    tr = Trace()
    tr.add("hidden", np.stack([rng.normal(size=(1, 16, 32)), x[None]]), ("depth", "batch", "token", "hidden"))
    df = dg.massive_activation_table(tr, k=3)
    top_final = df[(df["depth"] == 1) & (df["rank"] == 0)].iloc[0]
    assert (top_final["token"], top_final["channel"], top_final["value"]) == (5, 7, -1000.0)
    assert top_final["depth_label"] == "final"
    assert top_final["max_median_ratio"] > 100


# ----------------------------------------------------------------------------- KDA state
def test_kda_state_table_effective_rank():
    d = 4
    states = np.stack([np.eye(d), np.outer(np.arange(1.0, d + 1), np.ones(d))])[None]  # [1, 2, d, d]
    tr = Trace()
    tr.add("kda.0.final_state", states, ("batch", "head", "key", "value"))
    df = dg.kda_state_table(tr)
    np.testing.assert_allclose(df["state_effective_rank"], [d, 1.0])
    np.testing.assert_allclose(df["state_norm"], [2.0, np.sqrt(d * (1 + 4 + 9 + 16))])


def test_missing_data_is_reported():
    with pytest.raises(dg.MissingTraceData, match="attn_probs"):
        dg.attention_entropy_table(Trace())
    with pytest.raises(dg.MissingTraceData, match="hidden"):
        dg.rank_collapse_table(Trace())


# ----------------------------------------------------------------------------- real k3-nano trace
@pytest.fixture(scope="module")
def nano_ctx() -> AnalysisContext:
    torch.manual_seed(0)
    model = K3ForCausalLM.from_config(K3Config.from_preset("k3-nano", kda_chunk_size=16)).eval()
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    return trace_run(run_from_model(model), ids, what="all", label="nano")


def test_every_degradation_view_builds_on_a_real_trace(nano_ctx):
    for view in fig_dg.VIEWS:
        fig, df = view.build(nano_ctx)
        assert len(fig.data) > 0, view.key
        assert len(df) > 0, view.key
        assert df.attrs.get("keys"), view.key


def test_real_trace_metrics_are_in_range(nano_ctx):
    tr = nano_ctx.trace
    ent = dg.attention_entropy_table(tr)
    assert set(ent["layer"]) == {i for i in range(4) if nano_ctx.config.is_mla_layer(i)}
    assert ((ent["entropy_norm"] >= 0) & (ent["entropy_norm"] <= 1 + 1e-9)).all()
    # rows sum to 1, so the received means weighted by their audiences (T - j) add up to T
    attn = tr[f"mla.{int(ent['layer'].iloc[0])}.attn"]
    T = attn.shape[-1]
    received = dg.attention_received(attn)
    np.testing.assert_allclose((received * (T - np.arange(T))).sum(-1), T, rtol=1e-5)
    rc = dg.rank_collapse_table(tr)
    assert len(rc) == nano_ctx.config.num_hidden_layers + 1
    assert ((rc["ratio"] >= 0) & (rc["ratio"] <= 1 + 1e-9)).all()
    summary = degradation_summary(tr)
    assert all(np.isfinite(v) for v in summary.values()), summary
    assert 0.0 <= summary["sink_rate"] <= 1.0


def test_entropy_views_need_attention_probabilities(nano_ctx):
    model = nano_ctx.model
    ctx = trace_run(run_from_model(model), nano_ctx.input_ids, what=None, label="no-probs")
    with pytest.raises(NotApplicable, match="attn_probs"):
        fig_dg.build_entropy_heatmap(ctx)
    fig, _ = fig_dg.build_rank_collapse(ctx)  # hidden states are recorded by default
    assert len(fig.data) == 3
