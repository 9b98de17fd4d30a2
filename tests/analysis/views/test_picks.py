"""Layer and head picks of per-layer / per-head views (analysis.views.picks, View.picks) on a real k3-nano trace: a pick
shows exactly that layer's / head's values from the trace, a bad pick names the valid ones, no pick changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.compare.two_runs import side_by_side
from analysis.figures import degradation as fig_dg
from analysis.metrics import attention as at
from analysis.metrics import attnres as ar
from analysis.metrics import kda_memory as km
from analysis.metrics import moe as mo
from analysis.runs.context import AnalysisContext
from analysis.runs.loading import run_from_model, trace_run
from analysis.views import picks as pk
from analysis.views import view as view_mod
from analysis.views.catalogue import all_views
from k3core.interp.trace import names
from tests.conftest import nano_model

from ..figures import test_figures_degradation

VIEWS = {v.key: v for v in all_views()}


ctx = test_figures_degradation.nano_ctx  # the fixture: a real k3-nano trace with everything recorded


def _build(key: str, ctx: AnalysisContext, **pick):
    return VIEWS[key].build(ctx.with_options(**pick))


def _last(choices: view_mod.PickChoices, axis: str) -> int:
    return choices.values(axis)[-1]


def _data(fig) -> list:
    """The figure's data traces: without the null-reference lines drawn beside them (issue 39), e.g. "uniform causal
    attention (null reference)"."""
    return [t for t in fig.data if "null reference" not in (t.name or "")]


def _same_table(built, expected) -> None:
    """The view's table is the analysis function's table, plus the null-reference columns issue 39 exports beside
    it (e.g. uniform_entropy_norm, uniform_mass)."""
    added = set(built.columns) - set(expected.columns)
    assert all("uniform" in c for c in added), added
    __import__("pandas").testing.assert_frame_equal(built[list(expected.columns)], expected)


def test_views_declare_picks_with_choices_from_the_trace(ctx):
    picked = {k for k, v in VIEWS.items() if v.picks is not None}
    assert {"kda_state_norm", "degradation_entropy_position", "moe_coactivation", "moe_latent_pca"} <= picked
    for key in picked:
        choices = VIEWS[key].picks.choices(ctx)
        assert choices.layers, key
        kind = {"KDA": "kda", "MLA": "mla", "MoE": "moe", "AttnRes": "attnres"}[choices.mechanism]
        assert set(choices.layers) <= set(ctx.trace.layer_indices(kind)), key
        assert bool(choices.heads) == (view_mod.HEAD in VIEWS[key].picks.axes), key
    mla = pk.mla_choices(ctx)
    assert mla.heads == tuple(range(ctx.trace[names.mla_attn(mla.layers[0])].shape[1]))


def test_kda_state_norm_pick_is_that_layer_and_head(ctx):
    choices = pk.kda_state_choices(ctx)
    layer, head = _last(choices, "layer"), _last(choices, "head")
    fig, table = _build("kda_state_norm", ctx, layer=layer, head=head)
    expected = np.asarray(ctx.trace[names.kda_state_norm(layer)], dtype=np.float64).mean(0)[:, head]
    assert len(fig.data) == 1
    np.testing.assert_allclose(np.asarray(fig.data[0].y, dtype=np.float64), expected, rtol=1e-12)
    assert set(table["layer"]) == {layer} and set(table["head"]) == {head}
    assert f"KDA layer {layer}, head {head}" in fig.layout.title.text
    # layer only: one line per head of that layer
    fig, table = _build("kda_state_norm", ctx, layer=layer)
    assert len(fig.data) == len(choices.heads) and set(table["layer"]) == {layer}


def test_kda_beta_and_decay_picks(ctx):
    choices = pk.kda_choices(ctx)
    layer, head = choices.layers[0], _last(choices, "head")
    fig, table = _build("kda_beta", ctx, layer=layer, head=head)
    beta = np.asarray(ctx.trace[names.kda_beta(layer)], dtype=np.float64)[..., head].ravel()
    assert len(table) == 1
    np.testing.assert_allclose(fig.data[0].median, [np.median(beta)])
    np.testing.assert_allclose(fig.data[0].upperfence, [beta.max()])
    fig, table = _build("kda_decay", ctx, head=head)  # head h of every KDA layer
    assert list(table["layer"]) == list(choices.layers) and set(table["head"]) == {head}
    g = np.asarray(ctx.trace[names.kda_g(layer)], dtype=np.float64)[..., head, :]
    g_mean = g.reshape(-1, g.shape[-1]).mean(0)
    np.testing.assert_allclose(table.loc[table["layer"] == layer, "g_mean"], [g_mean.mean()], rtol=1e-9)


def test_entropy_by_position_pick_is_that_heads_row_entropy(ctx):
    choices = pk.mla_choices(ctx)
    layer, head = _last(choices, "layer"), _last(choices, "head")
    fig, table = _build("degradation_entropy_position", ctx, layer=layer, head=head)
    expected = at.causal_normalised_entropy(at.causal_row_entropy(ctx.trace[names.mla_attn(layer)])).mean(0)[head, 1:]
    (line,) = _data(fig)
    assert line.name == f"MLA layer {layer} head {head}"
    np.testing.assert_allclose(np.asarray(line.y, dtype=np.float64), expected, rtol=1e-6)
    assert [t.name for t in fig.data if t not in _data(fig)] == ["uniform causal attention (null reference)"]
    fig, _ = _build("degradation_entropy_position", ctx, head=head)  # head h in every MLA layer
    assert [t.name for t in _data(fig)] == [f"MLA layer {i} head {head}" for i in choices.layers]


def test_sink_views_pick_that_layer_and_head(ctx):
    choices = pk.mla_choices(ctx)
    layer, head = _last(choices, "layer"), _last(choices, "head")
    received = at.attention_received(ctx.trace[names.mla_attn(layer)]).mean(0)
    fig, table = _build("degradation_sink", ctx, layer=layer, head=head)
    np.testing.assert_allclose(fig.data[0].y, [received[head, 0]], rtol=1e-6)
    fig, table = _build("degradation_sink_profile", ctx, layer=layer)
    # the first row is uniform attention's reference (issue 39), then the picked layer's heads
    assert list(fig.data[0].y) == [fig_dg.UNIFORM_ROW, *(f"L{layer} H{h}" for h in choices.heads)]
    z = np.asarray(fig.data[0].z)
    np.testing.assert_allclose(z[1 + head], received[head, : table["key"].max() + 1], rtol=1e-6)


def test_moe_and_attnres_layer_picks(ctx):
    layer = _last(pk.moe_choices(ctx), "layer")
    fig, table = _build("moe_load_heatmap", ctx, layer=layer)
    experts = np.asarray(ctx.trace[names.moe_experts(layer)]).ravel()
    counts = np.bincount(experts, minlength=mo.num_experts_of(ctx.trace, layer))
    assert list(fig.data[0].y) == [f"L{layer}"]
    np.testing.assert_allclose(np.asarray(fig.data[0].z)[0], counts / counts.sum())
    fig, table = _build("moe_coactivation", ctx, layer=layer)
    assert set(table["layer"]) == {layer} and len(fig.data) == 1
    fig, table = _build("moe_weight_by_rank", ctx, layer=layer)
    weights = np.asarray(ctx.trace[names.moe_weights(layer)], dtype=np.float64)
    np.testing.assert_allclose(fig.data[0].y, weights.reshape(-1, weights.shape[-1]).mean(0))

    sites = ar.sites(ctx.trace)
    layer = int(sites[-2].split(".")[0])  # a late layer's sites
    fig, table = _build("attnres_depth_weights", ctx, layer=layer)
    mine = [s for s in sites if s.split(".")[0] == str(layer)]
    assert sorted(table["site"].unique()) == sorted(mine)
    for row, site in enumerate(mine):
        assert fig.data[0].y[row] == f"L{site.replace('.', ' ')}"
        p = np.asarray(ctx.trace[names.attnres(site)], dtype=np.float64)
        n = p.shape[-1]
        np.testing.assert_allclose(np.asarray(fig.data[0].z)[row][:n], p.reshape(-1, n).mean(0), rtol=1e-9)


@pytest.mark.parametrize(
    ("pick", "message"),
    [
        ({"layer": 10_000}, "is not one of this run's"),
        ({"layer": "three"}, "must be a whole number"),
        ({"head": 999}, "MLA heads"),
        ({"layer": 1.5}, "must be a whole number"),
    ],
)
def test_bad_picks_name_the_valid_choices(ctx, pick, message):
    with pytest.raises(pk.PickError, match=message) as err:
        _build("degradation_entropy_position", ctx, **pick)
    valid = pk.mla_choices(ctx)
    listed = valid.heads if "head" in pick else valid.layers
    assert ", ".join(map(str, listed)) in str(err.value)


def test_a_layer_without_the_mechanism_is_refused(ctx):
    kda_only = sorted(set(pk.kda_choices(ctx).layers) - set(pk.mla_choices(ctx).layers))
    assert kda_only
    with pytest.raises(pk.PickError, match=f"layer {kda_only[0]} is not one of this run's MLA layers"):
        _build("degradation_sink", ctx, layer=kda_only[0])


def test_no_pick_shows_what_the_view_always_showed(ctx):
    """Without a pick the tables are the analysis functions' full tables (every layer and head)."""
    _same_table(_build("kda_state_norm", ctx)[1], km.kda_state_norms(ctx.trace))
    _same_table(_build("degradation_entropy_position", ctx)[1], at.entropy_by_position_table(ctx.trace))
    _same_table(_build("degradation_sink", ctx)[1], at.attention_sink_table(ctx.trace))
    _same_table(_build("attnres_depth_weights", ctx)[1], ar.depth_weights(ctx.trace))
    fig, _ = _build("degradation_entropy_position", ctx)
    assert [t.name for t in _data(fig)] == [f"MLA layer {i}" for i in pk.mla_choices(ctx).layers]
    for key in ("kda_state_norm", "degradation_sink", "moe_load_heatmap"):
        explicit = _build(key, ctx, layer=None, head=None)
        assert explicit[0].to_json() == _build(key, ctx)[0].to_json()


def test_compare_uses_one_pick_for_both_runs(ctx):
    other = trace_run(
        run_from_model(nano_model(seed=None, kda_chunk_size=16)),
        torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1)),
        what="all",
        label="other",
    )
    layer, head = _last(pk.mla_choices(ctx), "layer"), 0
    view = VIEWS["degradation_entropy_position"]
    a, b = ctx.with_options(layer=layer, head=head), other.with_options(layer=layer, head=head)
    fig, table = side_by_side(view, a, b)
    for run, c in (("nano", ctx), ("other", other)):
        rows = table[table["run"] == run]
        assert set(rows["layer"]) == {layer} and set(rows["head"]) == {head}
        expected = at.causal_normalised_entropy(at.causal_row_entropy(c.trace[names.mla_attn(layer)])).mean(0)[head, 1:]
        np.testing.assert_allclose(rows["entropy_norm"], expected, rtol=1e-6)
    assert len(_data(fig)) == 2  # one line per run, each beside its run's uniform reference
    assert fig.layout.title.text.startswith(f"Entropy by query position, MLA layer {layer}, head {head}: nano vs other")


def test_pick_text_round_trips():
    for layer, head in ((3, 1), (3, None), (None, 2), (12, 0)):
        text = pk.pick_text(layer, head)
        assert pk.parse_pick(text) == {k: v for k, v in (("layer", layer), ("head", head)) if v is not None}
    for bad in ("", "L", "3", "L3X", "H-1", "layer3"):
        with pytest.raises(ValueError, match="is not a pick"):
            pk.parse_pick(bad)


def test_compare_a_pick_only_one_run_has_says_so_in_the_other_half(ctx):
    """Run B has its MLA layer elsewhere: the pick of A's MLA layer draws A's half and B's half names B's layers."""
    from app.state.pickers import merged, only_in

    model = nano_model(seed=None, kda_chunk_size=16, full_attn_layers=[2])
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    other = trace_run(run_from_model(model), ids, what="all", label="other")
    layer = pk.mla_choices(ctx).layers[0]
    assert pk.mla_choices(other).layers == (1,) != (layer,)
    view = VIEWS["degradation_sink"]
    fig, table = side_by_side(view, ctx.with_options(layer=layer), other.with_options(layer=layer))
    assert set(table["run"]) == {"nano"} and set(table["layer"]) == {layer}
    notes = " ".join(a.text for a in fig.layout.annotations)
    assert f"layer {layer} is not one of this run's MLA layers: 1" in notes.replace("<br>", " ")
    each = [pk.mla_choices(ctx), pk.mla_choices(other)]
    assert merged(each).layers == (1, layer)
    assert only_in({"layer": layer}, each, ["nano", "other"]) == f"other has no layer {layer}"
    assert only_in({"layer": layer, "head": 0}, each, ["nano", "other"]) == f"other has no layer {layer}"
