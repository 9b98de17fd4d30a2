"""analysis.density / analysis.importance / analysis.figures.density: hand-computed cases and a real k3-nano."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from analysis import density as dn
from analysis import importance as im
from analysis.figures import density as fd
from analysis.views import AnalysisContext, NotApplicable
from k3core.config import K3Config
from k3core.model import K3Cache, K3ForCausalLM
from k3core.trace import Trace, record


def _nano(seed: int = 0, **overrides) -> K3ForCausalLM:
    overrides.setdefault("kda_chunk_size", 16)
    torch.manual_seed(seed)
    return K3ForCausalLM.from_config(K3Config.from_preset("k3-nano", **overrides)).eval()


def _ids(T: int = 40, B: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def nano_run():
    model = _nano()
    ids = _ids()
    with record(model, what="all", max_batch=2) as trace:
        model(ids, labels=ids)
    return model, ids, trace


# ----------------------------------------------------------------------------- allocation


VARIANTS = [
    ("k3-nano", {}),
    ("k3-mini", {}),
    ("k3-nano", dict(residual="scale_bias", num_experts=0)),
    ("k3-nano", dict(residual="plain", kda_gate="softplus")),
    (
        "k3-nano",
        dict(
            residual="full_attnres",
            routed_expert_hidden_size=None,
            kda_output_gate="low_rank",
            q_lora_rank=None,
            mla_output_gate=False,
            latent_moe_use_norm=False,
            layer_width_multipliers=[1.0, 0.5, 2.0, 1.5],
        ),
    ),
    ("k3-nano", dict(tie_word_embeddings=True, num_shared_experts=0, first_k_dense_replace=0)),
    ("kimi-linear-48b", {}),
]


@pytest.mark.parametrize("preset,overrides", VARIANTS)
def test_parameter_counts_match_the_model_per_layer_and_in_total(preset, overrides):
    cfg = K3Config.from_preset(preset, **overrides)
    small = cfg.hidden_size <= 512  # build the small ones for real, the published sizes on the meta device
    model = K3ForCausalLM.from_config(cfg, device="cpu" if small else "meta")
    alloc = dn.layer_allocation(cfg)
    layers = alloc[alloc["part"].str.startswith("L")]
    assert list(layers["params"]) == [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert alloc["params"].sum() == model.num_parameters()
    assert alloc["active_params"].sum() == model.num_parameters(active=True)


def test_parameter_counts_match_kimi_k3_on_meta():
    cfg = K3Config.from_preset("kimi-k3")
    model = K3ForCausalLM.from_config(cfg, device="meta")
    alloc = dn.layer_allocation(cfg)
    assert alloc["params"].sum() == model.num_parameters()
    assert alloc["active_params"].sum() == model.num_parameters(active=True)
    assert abs(alloc["params"].sum() / 2.78e12 - 1) < 0.03
    assert list(alloc["ffn_kind"][1:-1]) == ["dense FFN"] + ["LatentMoE"] * 92


def test_allocation_columns_for_k3_nano_by_hand():
    cfg = K3Config.from_preset("k3-nano")  # D 64, KDA H 2 d 16 conv 4, dense FFN 128 in layer 0
    alloc = dn.layer_allocation(cfg, seq_len=1000).set_index("part")
    # KDA matmuls: q,k,v,o 4*64*32 + convs 3*32*4 + f_a 64*16 + f_b 16*32 + b 64*2 + gate 64*32; FFN 3*64*128
    kda_mm = 4 * 64 * 32 + 3 * 32 * 4 + 64 * 16 + 16 * 32 + 64 * 2 + 64 * 32
    assert alloc.loc["L0", "matmul_flops"] == 2 * (kda_mm + 3 * 64 * 128)
    assert alloc.loc["L0", "mixing_flops"] == 7 * 2 * 16**2
    # MLA (layer 3): 2 H (d_qk + d_v) (T + 1) / 2 = 2 * 2 * (24 + 16) * 500.5
    assert alloc.loc["L3", "mixing_flops"] == pytest.approx(2 * 2 * 40 * 500.5)
    assert list(alloc.loc[["L0", "L1", "L2", "L3"], "layer_type"]) == ["KDA", "KDA", "KDA", "MLA"]
    assert list(alloc.loc[["L0", "L1"], "ffn_kind"]) == ["dense FFN", "LatentMoE"]
    # cache: KDA 4*2*16*16 + 3*3*2*16*2 ; MLA (16 + 8) * 1000 * 2
    assert alloc.loc["L0", "cache_bytes"] == 4 * 2 * 16 * 16 + 3 * 3 * 2 * 16 * 2
    assert alloc.loc["L3", "cache_bytes"] == 24 * 1000 * 2
    assert alloc.loc["embedding", "flops"] == 0
    assert alloc.loc["output", "matmul_flops"] == 2 * 64 * 256


def test_decode_mode_counts_all_keys():
    cfg = K3Config.from_preset("k3-nano")
    assert dn.sequence_mixing_flops(cfg, 3, 100, mode="decode") == 2 * 2 * 40 * 100
    with pytest.raises(ValueError, match="mode"):
        dn.sequence_mixing_flops(cfg, 3, 100, mode="train")


def test_depth_mix_sources_follow_the_block_layout():
    cfg = K3Config.from_preset("k3-nano")  # 4 layers, block size 2
    assert dn.depth_mix_sources(cfg) == {
        "0.mlp": 2,
        "1.attn": 2,
        "1.mlp": 2,
        "2.attn": 2,
        "2.mlp": 3,
        "3.attn": 3,
        "3.mlp": 3,
        "output": 3,
    }
    assert dn.depth_mix_sources(K3Config.from_preset("kimi-k3"))["output"] == 9
    full = dn.depth_mix_sources(cfg.replace(residual="full_attnres"))
    assert full["1.attn"] == 3 and full["1.mlp"] == 4 and full["output"] == 9
    assert dn.depth_mix_sources(cfg.replace(residual="plain")) == {}


def test_cache_bytes_match_a_real_decode_cache():
    model = _nano()
    cfg = model.config
    cache = K3Cache.for_config(cfg)
    T = 37
    with torch.no_grad():
        model(_ids(T, B=1), cache=cache)
    expected = sum(dn.layer_cache_bytes(cfg, i, T, dtype_bytes=4) for i in range(cfg.num_hidden_layers))
    assert cache.nbytes() == expected


def test_cache_bytes_by_length_kda_flat_mla_linear():
    cfg = K3Config.from_preset("kimi-k3")
    table = dn.cache_bytes_by_length(cfg)
    assert table["seq_len"].min() == 1024 and table["seq_len"].max() == 2**20
    kda = table[table["layer_type"] == "KDA"].set_index("seq_len")["bytes_per_layer"]
    mla = table[table["layer_type"] == "MLA"].set_index("seq_len")["bytes_per_layer"]
    assert kda.nunique() == 1 and kda.iloc[0] == 4 * 96 * 128 * 128 + 3 * 3 * 96 * 128 * 2
    assert mla[2**20] == (512 + 64) * 2**20 * 2
    assert mla[2048] == 2 * mla[1024]
    tot = table[table["layer_type"] == "total"].set_index("seq_len")["bytes"]
    assert tot[2**20] == 69 * kda.iloc[0] + 24 * mla[2**20]
    with pytest.raises(ValueError):
        dn.cache_bytes_by_length(cfg, [])


# ----------------------------------------------------------------------------- KDA memory metrics


def test_memory_horizon():
    assert dn.memory_horizon(np.log(0.5)) == pytest.approx(2.0)
    assert dn.memory_horizon(np.log(0.9)) == pytest.approx(10.0)
    assert dn.memory_horizon(0.0) == math.inf
    assert dn.memory_horizon(-1e-40) > 1e30  # alpha rounds to 1: huge, not a division error
    with pytest.raises(ValueError):
        dn.memory_horizon(0.1)


def test_horizon_quantiles_are_order_statistics_and_survive_infinity():
    g = np.log([0.5, 0.9, 1.0])
    lo, mid, hi = dn.horizon_quantiles(g, (0.0, 0.5, 1.0))
    assert lo == pytest.approx(2.0) and mid == pytest.approx(10.0) and hi == math.inf


def test_near_lower_bound_fraction():
    g = np.array([-4.9, -4.6, -4.4, -1.0, -0.1])  # 0.9 * -5 = -4.5: two entries below
    assert dn.near_lower_bound_fraction(g, -5.0) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        dn.near_lower_bound_fraction(g, 1.0)


def test_effective_rank():
    assert dn.effective_rank(np.outer([1.0, 2.0, 3.0], [1.0, 0.0, 1.0])) == pytest.approx(1.0)
    assert dn.effective_rank(np.eye(5)) == pytest.approx(5.0)
    assert dn.effective_rank(np.zeros((3, 3))) == 0.0


def _kda_trace(g: np.ndarray, beta: np.ndarray, lower_bound: float = -5.0, gate: str = "lower_bound") -> Trace:
    t = Trace(meta={"config": {"kda_gate": gate, "kda_gate_lower_bound": lower_bound}})
    t.add("kda.0.g", g, ("batch", "token", "head", "channel"))
    t.add("kda.0.beta", beta, ("batch", "token", "head"))
    return t


def test_kda_decay_stats_on_a_hand_trace():
    # one layer, 2 heads x 2 channels, 2 tokens; head 0 always alpha 0.5, head 1 g = -4.8 (near the bound)
    g = np.zeros((1, 2, 2, 2))
    g[:, :, 0, :] = np.log(0.5)
    g[:, :, 1, :] = -4.8
    t = _kda_trace(g, np.full((1, 2, 2), 0.25))
    stats = dn.kda_decay_stats(t).set_index("head")
    assert stats.loc[0, "horizon_median"] == pytest.approx(2.0)
    assert stats.loc[0, "alpha_mean"] == pytest.approx(0.5)
    assert stats.loc[0, "frac_near_lb"] == 0.0 and stats.loc[1, "frac_near_lb"] == 1.0
    chan = dn.kda_channel_decay(t)
    assert np.allclose(chan[chan["head"] == 0]["horizon"], 2.0)
    beta = dn.kda_beta_stats(t)
    assert np.allclose(beta["mean"], 0.25) and np.allclose(beta["std"], 0.0)
    softplus = dn.kda_decay_stats(_kda_trace(g, np.full((1, 2, 2), 0.25), gate="softplus"))
    assert softplus["frac_near_lb"].isna().all()  # no lower bound in the softplus form


def test_kda_metrics_on_a_real_trace(nano_run):
    model, ids, trace = nano_run
    decay = dn.kda_decay_stats(trace)
    assert sorted(decay["layer"].unique()) == [0, 1, 2] and len(decay) == 3 * 2
    assert (decay["horizon_median"] >= 1).all()
    norms = dn.kda_state_norms(trace)
    assert sorted(norms["token"].unique()) == [16, 32, 40]  # chunk ends of a 40-token prefix, chunk 16
    assert (norms["state_norm"] > 0).all()
    rank = dn.kda_state_rank(trace)
    assert ((rank["effective_rank"] >= 1) & (rank["effective_rank"] <= 16)).all()
    summary = dn.kda_layer_summary(trace)
    assert list(summary["layer"]) == [0, 1, 2]


# ----------------------------------------------------------------------------- importance


def test_ablation_of_a_silent_sublayer_is_zero_and_of_a_live_one_matches_a_manual_ablation():
    model = _nano(seed=1)
    ids = _ids(24)
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()  # this sub-layer's output is exactly zero
    imp = im.ablation_importance(model, ids).set_index(["layer", "sublayer"])
    assert imp.loc[(2, "attn"), "importance"] == 0.0
    base = imp.loc[(0, "ffn"), "base_loss"]
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.zero_()  # the dense FFN of layer 0, removed by hand
        manual = float(model(ids, labels=ids).loss)
    assert imp.loc[(0, "ffn"), "ablated_loss"] == pytest.approx(manual, abs=1e-6)
    assert imp.loc[(0, "ffn"), "importance"] == pytest.approx(manual - base, abs=1e-6)
    assert not model.training


def test_gradient_x_activation_zero_for_a_silent_sublayer_and_first_order_close_to_ablation():
    model = _nano(seed=2)
    ids = _ids(24)
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[1].self_attn.o_proj.weight.mul_(0.05)  # small output: the first-order estimate is good
    gxa = im.gradient_x_activation_importance(model, ids).set_index(["layer", "sublayer"])
    abl = im.ablation_importance(model, ids).set_index(["layer", "sublayer"])
    assert gxa.loc[(2, "attn"), "importance"] == 0.0 and gxa.loc[(2, "attn"), "gxa_abs"] == 0.0
    est, exact = gxa.loc[(1, "attn"), "taylor_ablation"], abl.loc[(1, "attn"), "importance"]
    assert exact != 0 and est == pytest.approx(exact, rel=0.2)


def test_importance_rejects_bad_input():
    model = _nano()
    with pytest.raises(ValueError, match="integer"):
        im.ablation_importance(model, torch.zeros(1, 5))
    with pytest.raises(ValueError, match="2 tokens"):
        im.ablation_importance(model, torch.zeros(1, 1, dtype=torch.long))


# ----------------------------------------------------------------------------- views


def _check_view(view, ctx):
    fig, df = view.build(ctx)
    assert fig.layout.title.text, view.key
    assert len(fig.data) > 0 and len(df) > 0, view.key
    return fig, df


def test_every_density_view_builds_on_a_real_k3_nano_trace(nano_run):
    model, ids, trace = nano_run
    ctx = AnalysisContext(trace=trace, config=model.config, model=model, input_ids=ids, options={"seq_len": 8192})
    keys = [v.key for v in fd.VIEWS]
    assert len(keys) == len(set(keys))
    for view in fd.VIEWS:
        fig, df = _check_view(view, ctx)
        if view.key == "density_allocated_vs_measured":
            assert view.needs_model
            assert {"ablation_attn", "ablation_ffn", "gxa_attn", "gxa_ffn", "horizon_median"} <= set(df.columns)
            # both estimates share a scale and sign: gxa columns hold the first-order ablation estimate -gxa
            # (the FFN outputs of a fresh model are small, so the first-order estimate is close)
            assert np.allclose(df["gxa_ffn"], df["ablation_ffn"], rtol=0.3, atol=5e-5)
            assert list(df["layer"]) == [0, 1, 2, 3]
        if view.key == "density_cache_vs_length":
            assert 8192 in set(df["seq_len"])


def test_density_views_without_model_or_kda_are_not_applicable(nano_run):
    model, ids, trace = nano_run
    ctx = AnalysisContext(trace=trace, config=model.config)
    view = {v.key: v for v in fd.VIEWS}
    with pytest.raises(NotApplicable):
        view["density_allocated_vs_measured"].build(ctx)
    # an all-MLA model has no KDA memory to show, but still an allocation
    mla = _nano(full_attn_layers=[1, 2, 3, 4])
    tokens = _ids(12)
    with record(mla, what={"kda", "mla", "moe"}) as trace2:
        mla(tokens)
    ctx2 = AnalysisContext(trace=trace2, config=mla.config)
    for key in ("kda_decay", "kda_beta", "kda_state_norm"):
        with pytest.raises(NotApplicable):
            view[key].build(ctx2)
    _check_view(view["density_allocation"], ctx2)


def test_kda_views_pool_heads_per_layer_when_there_are_many(nano_run, monkeypatch):
    model, ids, trace = nano_run
    monkeypatch.setattr(fd, "MAX_HEAD_BOXES", 1)
    monkeypatch.setattr(fd, "MAX_HEAD_LINES", 1)
    ctx = AnalysisContext(trace=trace, config=model.config)
    view = {v.key: v for v in fd.VIEWS}
    _, decay = _check_view(view["kda_decay"], ctx)
    _, beta = _check_view(view["kda_beta"], ctx)
    fig, _ = _check_view(view["kda_state_norm"], ctx)
    assert list(decay["layer"]) == [0, 1, 2] and list(beta["layer"]) == [0, 1, 2]
    assert len(fig.data) == 3  # one mean line per KDA layer
    pooled = dn.kda_beta_stats(trace, by="layer").set_index("layer")
    assert pooled.loc[1, "mean"] == pytest.approx(float(trace["kda.1.beta"].mean()), rel=1e-6)
    with pytest.raises(ValueError):
        dn.kda_beta_stats(trace, by="token")
