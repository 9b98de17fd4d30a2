"""Density and KDA memory views (analysis.figures.density, analysis.figures.kda_memory) on a real k3-nano trace."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.figures import density as fd
from analysis.figures import kda_memory as fk
from analysis.figures.style import screen_figure
from analysis.metrics import kda_memory as km
from analysis.runs.context import AnalysisContext
from analysis.views.view import NotApplicable
from k3core.interp.recorder import record
from k3core.interp.trace import Trace, names
from k3core.modeling.presets import from_preset
from tests.conftest import nano_model, random_ids, traced_nano


@pytest.fixture(scope="module")
def nano_run():
    return traced_nano()


def _check_view(view, ctx):
    fig, df = view.build(ctx)
    assert fig.layout.title.text, view.key
    assert len(fig.data) > 0 and len(df) > 0, view.key
    return fig, df


def test_every_density_view_builds_on_a_real_k3_nano_trace(nano_run):
    model, ids, trace = nano_run
    ctx = AnalysisContext(trace=trace, config=model.config, model=model, input_ids=ids, options={"seq_len": 8192})
    keys = [v.key for v in fd.VIEWS + fk.VIEWS]
    assert len(keys) == len(set(keys))
    for view in fd.VIEWS + fk.VIEWS:
        fig, df = _check_view(view, ctx)
        if view.key == "density_allocated_vs_measured":
            assert view.needs_model
            assert {"ablation_attn", "ablation_ffn", "gxa_attn", "gxa_ffn", "half_life_median"} <= set(df.columns)
            # both estimates share a scale and sign: gxa columns hold the first-order ablation estimate -gxa
            # (the FFN outputs of a fresh model are small, so the first-order estimate is close)
            assert np.allclose(df["gxa_ffn"], df["ablation_ffn"], rtol=0.3, atol=5e-5)
            assert list(df["layer"]) == [0, 1, 2, 3]
            # the ablation lines carry their noise floor as error bars, the first-order lines none
            assert (df[["ablation_noise_attn", "ablation_noise_ffn"]] >= 0).all().all()
            bars = {t.name: t.error_y.array for t in fig.data if t.name and t.name.startswith(("ablation", "grad"))}
            np.testing.assert_array_equal(bars["ablation, FFN"], df["ablation_noise_ffn"].to_numpy())
            assert bars["grad x act (1st order), FFN"] is None
        if view.key == "density_cache_vs_length":
            assert 8192 in set(df["seq_len"])


def test_density_views_without_model_or_kda_are_not_applicable(nano_run):
    model, ids, trace = nano_run
    ctx = AnalysisContext(trace=trace, config=model.config)
    view = {v.key: v for v in fd.VIEWS + fk.VIEWS}
    with pytest.raises(NotApplicable):
        view["density_allocated_vs_measured"].build(ctx)
    # an all-MLA model has no KDA memory to show, but still an allocation
    mla = nano_model(kda_chunk_size=16, full_attn_layers=[1, 2, 3, 4])
    tokens = random_ids(12)
    with record(mla, what={"kda", "mla", "moe"}) as trace2:
        mla(tokens)
    ctx2 = AnalysisContext(trace=trace2, config=mla.config)
    for key in ("kda_decay", "kda_beta", "kda_state_norm"):
        with pytest.raises(NotApplicable):
            view[key].build(ctx2)
    _check_view(view["density_allocation"], ctx2)


def test_kda_views_pool_heads_per_layer_when_there_are_many(nano_run, monkeypatch):
    model, ids, trace = nano_run
    monkeypatch.setattr(fk, "MAX_HEAD_BOXES", 1)
    monkeypatch.setattr(fk, "MAX_HEAD_LINES", 1)
    ctx = AnalysisContext(trace=trace, config=model.config)
    view = {v.key: v for v in fd.VIEWS + fk.VIEWS}
    _, decay = _check_view(view["kda_decay"], ctx)
    _, beta = _check_view(view["kda_beta"], ctx)
    fig, _ = _check_view(view["kda_state_norm"], ctx)
    assert list(decay["layer"]) == [0, 1, 2] and list(beta["layer"]) == [0, 1, 2]
    assert len(fig.data) == 3  # one mean line per KDA layer
    pooled = km.kda_beta_stats(trace, by="layer").set_index("layer")
    assert pooled.loc[1, "mean"] == pytest.approx(float(trace["blocks.1.kda.beta"].mean()), rel=1e-6)
    with pytest.raises(ValueError):
        km.kda_beta_stats(trace, by="token")


def test_density_views_show_hand_computed_numbers():
    cfg = from_preset("k3-nano")
    ctx = AnalysisContext(trace=Trace(), config=cfg, label="hand", options={"seq_len": 1000})
    fig, table = fd.build_allocation(ctx)
    # decode cache per sequence, by hand: a KDA layer holds its fp32 state 4 H d^2 plus bf16 conv tails
    # (K - 1) 3 H d 2; an MLA layer (kv_lora + rope) T 2 bytes
    H, d, K = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    kda = 4 * H * d * d + (K - 1) * 3 * H * d * 2
    mla = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 1000 * 2
    cache = {}
    for tr in fig.data:
        if tr.yaxis == "y3":
            cache.update(zip(tr.x, tr.y))
    assert cache == {i: (mla if t == "MLA" else kda) for i, t in enumerate(cfg.layer_types())}
    # no bars on a log axis (a bar's length there depends on where the axis starts): FLOPs and cache are markers
    for tr in fig.data:
        axis = fig.layout[f"yaxis{tr.yaxis[1:]}" if tr.yaxis != "y" else "yaxis"]
        assert not (axis.type == "log" and tr.type == "bar"), (tr.name, tr.yaxis)
    assert {tr.type for tr in fig.data if tr.yaxis in ("y2", "y3")} == {"scatter"}
    # KDA decay: g = log 0.5 everywhere gives a half-life of ln 2 / (-log 0.5) = 1 token in every channel
    g = np.full((1, 4, 2, 3), np.log(0.5))
    tr = Trace(meta={"config": {"kda_gate": "lower_bound", "kda_gate_lower_bound": -5.0}})
    tr.add(names.kda_g(0), g, ("batch", "token", "head", "channel"))
    tr.add(names.kda_beta(0), np.full((1, 4, 2), 0.25), ("batch", "token", "head"))
    ctx = AnalysisContext(trace=tr, config=cfg, label="hand")
    fig, _ = fk.build_kda_decay(ctx)
    box = fig.data[0]
    np.testing.assert_allclose(box.median, [1.0, 1.0])
    np.testing.assert_allclose(fig.data[1].y, [0.0, 0.0])  # log 0.5 > 0.9 x (-5): nowhere near the bound
    fig, _ = fk.build_kda_beta(ctx)
    np.testing.assert_allclose(fig.data[0].median, [0.25, 0.25])


def test_state_norm_ticks_and_hovers_name_the_last_token_the_state_has_read(nano_run):
    """A chunk end at x = 16 is the state after tokens 0..15: its tick and hover name token 15, not token 16."""
    from k3core.tokenizer import ByteTokenizer

    model, ids, trace = nano_run
    if model.config.vocab_size != ByteTokenizer.vocab_size:
        pytest.skip("needs a byte-level vocabulary to label tokens")
    ctx = AnalysisContext(trace=trace, config=model.config, input_ids=ids, tokenizer=ByteTokenizer())
    fig, table = {v.key: v for v in fd.VIEWS + fk.VIEWS}["kda_state_norm"].build(ctx)
    axis = fig.layout.xaxis
    assert list(axis.tickvals) == sorted(set(table["token"]))
    assert list(axis.ticktext) == ctx.position_labels([v - 1 for v in axis.tickvals])
    line = fig.data[0]
    assert list(line.text) == ctx.position_labels([x - 1 for x in line.x])


def test_box_plots_label_every_head(nano_run):
    """Every box has its own tick label (plotly's category ticks dropped every other head)."""
    model, ids, trace = nano_run
    ctx = AnalysisContext(trace=trace, config=model.config)
    for build in (fk.build_kda_decay, fk.build_kda_beta):
        fig, _ = build(ctx)
        box = next(t for t in fig.data if t.type == "box")
        axis = fig.layout.xaxis
        assert axis.tickmode == "array" and list(axis.ticktext) == list(box.x) == list(axis.tickvals)
        shown = screen_figure(fig, max_ticks=2).layout.xaxis  # the screen copy thins token ticks, never these
        assert list(shown.ticktext) == list(box.x)
        assert len(box.x) == len(set(box.x)) > 1
