"""Degradation views (analysis.figures.degradation) on a real k3-nano trace."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from analysis.figures import degradation as fig_dg
from analysis.metrics import attention as at
from analysis.metrics import hidden_states as hs
from analysis.metrics.headline import degradation_summary, headline_numbers
from analysis.runs.context import AnalysisContext
from analysis.runs.loading import run_from_model, trace_run
from analysis.views.view import NotApplicable
from k3core.interp.trace import Trace, names
from k3core.modeling.presets import from_preset
from tests.conftest import nano_model


@pytest.fixture(scope="module")
def nano_ctx() -> AnalysisContext:
    torch.manual_seed(0)
    model = nano_model(seed=None, kda_chunk_size=16)
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
    ent = at.attention_entropy_table(tr)
    assert set(ent["layer"]) == {i for i in range(4) if nano_ctx.config.is_mla_layer(i)}
    assert ((ent["entropy_norm"] >= 0) & (ent["entropy_norm"] <= 1 + 1e-9)).all()
    # rows sum to 1, so the received means weighted by their audiences (T - j) add up to T
    attn = tr[names.mla_attn(int(ent["layer"].iloc[0]))]
    T = attn.shape[-1]
    received = at.attention_received(attn)
    np.testing.assert_allclose((received * (T - np.arange(T))).sum(-1), T, rtol=1e-5)
    rc = hs.rank_collapse_table(tr)
    assert len(rc) == nano_ctx.config.num_hidden_layers + 1
    assert ((rc["ratio"] >= 0) & (rc["ratio"] <= 1 + 1e-9)).all()
    summary = degradation_summary(tr)
    assert all(np.isfinite(v) for v in summary.values()), summary
    assert 0.0 <= summary["sink_rate"] <= 1.0


def test_entropy_views_come_from_the_blocked_statistics_without_maps(nano_ctx):
    """Since issue 24 the entropy and sink views read the recorder's blocked statistics (q, k in query blocks), so
    they draw without the maps ("attn_probs"), with the values the maps give; without "mla" they say why."""
    model = nano_ctx.model
    ctx = trace_run(run_from_model(model), nano_ctx.input_ids, what=None, label="no-probs")
    assert not any(n.endswith(".mla.attn") for n in ctx.trace.arrays)
    _, table = fig_dg.build_entropy_heatmap(ctx)
    _, from_maps = fig_dg.build_entropy_heatmap(nano_ctx)
    np.testing.assert_allclose(table["entropy_norm"], from_maps["entropy_norm"], rtol=1e-5, atol=1e-6)
    bare = trace_run(run_from_model(model), nano_ctx.input_ids, what=("hidden", "kda"), label="no-mla")
    with pytest.raises(NotApplicable, match="not recorded"):
        fig_dg.build_entropy_heatmap(bare)
    fig, _ = fig_dg.build_rank_collapse(ctx)  # hidden states are recorded by default
    assert len(fig.data) == 3


def test_sink_view_warns_when_too_few_tokens_and_headline_has_no_rate(nano_ctx):
    model = nano_ctx.model
    short = trace_run(run_from_model(model), nano_ctx.input_ids[:, :2], what="all", label="two")
    fig, df = fig_dg.build_sink_mass(short)
    # s_0 = (1 + A_10) / 2 >= 0.5 > 0.3 for every head: a "100% sink" that the figure must not present as a finding
    assert (df["first_token_mass"] >= 0.5).all() and df.attrs["too_few_tokens"]
    assert any("only 2 tokens" in (a.text or "") for a in fig.layout.annotations)
    assert "sink rate" not in fig.layout.title.text
    assert math.isnan(headline_numbers(short)["sink_rate"])
    assert not math.isnan(headline_numbers(nano_ctx)["sink_rate"])


def test_views_name_the_run_and_the_keys_shown(nano_ctx):
    for view in fig_dg.VIEWS:
        fig, _ = view.build(nano_ctx)
        assert fig.layout.title.text.endswith("— nano"), view.key
    fig, df = fig_dg.build_sink_profile(nano_ctx)
    assert "first 32 of 48 keys" in fig.layout.title.text and df["key"].max() == 31


def test_attention_views_show_hand_computed_numbers():
    T = 20
    uniform = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]  # row i: 1/(i+1) on keys 0..i
    sink = np.zeros((T, T))
    sink[:, 0] = 1.0  # every query on token 0
    tr = Trace(meta={"layer_types": ["KDA", "MLA"], "what": ["attn_probs"]})
    tr.add(names.mla_attn(1), np.stack([uniform, sink])[None], ("batch", "head", "query", "key"))
    ctx = AnalysisContext(trace=tr, config=from_preset("k3-nano"), label="hand")
    fig, _ = fig_dg.build_entropy_heatmap(ctx)
    np.testing.assert_allclose(np.asarray(fig.data[0].z, dtype=float), [[1.0, 0.0]], atol=1e-12)
    fig, _ = fig_dg.build_sink_mass(ctx)
    # uniform head: s_0 = (1/T) sum_i 1/(i+1) = H_T / T; sink head: 1
    np.testing.assert_allclose(fig.data[0].y, [sum(1 / k for k in range(1, T + 1)) / T, 1.0])
    assert "sink rate 50%" in fig.layout.title.text
    fig, _ = fig_dg.build_sink_profile(ctx)
    z = np.asarray(fig.data[0].z, dtype=float)
    assert fig.data[0].y[0] == fig_dg.UNIFORM_ROW  # the first row: uniform causal attention, the null reference
    np.testing.assert_allclose(z[0], z[1], rtol=1e-12)  # the uniform head reads exactly its reference
    assert z[2, 0] == 1.0 and z[2, 1] == 0.0  # the sink head: key 0 gets everything, key 1 nothing
    assert z[1, T - 1] == pytest.approx(1 / T)  # the last key is seen only by the last query, with 1/T
    fig, _ = fig_dg.build_entropy_by_position(ctx)  # mean of a uniform head (1) and a sink head (0)
    assert "mean 0.500: below the uniform level 1" in fig.layout.title.text.replace("<br>", " ")
    assert fig.data[0].name.startswith("uniform causal attention") and set(fig.data[0].y) == {1.0}
    fig, table = fig_dg.build_sink_mass(ctx)
    title = fig.layout.title.text.replace("<br>", " ")
    assert list(table["vs_uniform"]) == ["at", "above"] and "1 of 2 heads at the uniform-attention level" in title
    np.testing.assert_allclose(table["uniform_mass"], sum(1 / k for k in range(1, T + 1)) / T)


def test_hidden_state_views_show_hand_computed_numbers():
    h = np.zeros((2, 1, 3, 2))  # depth 2 (one layer + final), one sequence, 3 tokens, width 2
    h[0, 0] = [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]  # identical tokens: ratio 0, token cosine 1
    h[1, 0] = [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]
    tr = Trace(meta={"layer_types": ["KDA"]})
    tr.add(names.HIDDEN, h, ("depth", "batch", "token", "hidden"))
    ctx = AnalysisContext(trace=tr, config=from_preset("k3-nano"), label="hand")
    fig, _ = fig_dg.build_rank_collapse(ctx)
    assert list(fig.data[0].y)[0] == 0.0 and list(fig.data[2].y)[0] == pytest.approx(1.0)
    # final: cosines (1,2) = 0, (1,3) = -1, (2,3) = 0: mean over the 3 pairs -1/3
    assert list(fig.data[2].y)[1] == pytest.approx(-1 / 3)
    fig, _ = fig_dg.build_layer_redundancy(ctx)
    # per-token cosines between input and output: 1, 0, -1 -> mean 0 -> Block Influence 1
    assert list(fig.data[0].y) == [pytest.approx(1.0)]


def test_redundancy_axes_share_zero_ratio_has_its_own_axis_and_uniform_entropy_is_said(nano_ctx):
    fig, df = fig_dg.build_layer_redundancy(nano_ctx)
    y1, y2 = fig.layout.yaxis.range, fig.layout.yaxis2.range
    assert -y1[0] / (y1[1] - y1[0]) == pytest.approx(-y2[0] / (y2[1] - y2[0]))  # 0 at one height on both axes
    assert y1[1] >= df["block_influence"].max()
    fig, _ = fig_dg.build_massive_activations(nano_ctx)
    ratio = next(t for t in fig.data if t.name.startswith("max / median"))
    assert ratio.yaxis == "y2" and all(t.yaxis in (None, "y") for t in fig.data if t is not ratio)
    fig, df = fig_dg.build_entropy_heatmap(nano_ctx)
    said = any("near uniform" in (a.text or "") for a in fig.layout.annotations)
    assert said == (df["entropy_norm"].min() >= fig_dg.NEAR_UNIFORM)
    assert said  # the untrained nano's heads are near uniform: the branch below runs
    # round colour-bar ticks over NEAR_UNIFORM..1, both ends labelled: at least the four every colour bar has, and
    # not plotly's own one per 0.01 (they stacked on a short bar)
    ticks = list(fig.data[0].colorbar.tickvals)
    assert 4 <= len(ticks) <= 6 and ticks[0] == pytest.approx(fig_dg.NEAR_UNIFORM) and ticks[-1] == pytest.approx(1)
