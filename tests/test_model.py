"""The K3 model: every switch combination trains, and each mechanism matches its formula (K3_REFERENCE.md)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3core import trace as trace_mod
from k3core.config import K3Config
from k3core.model import K3ForCausalLM, scale_bias_init
from k3core.ops.attnres import attnres_mix
from k3core.ops.situ import situ, swiglu

from .conftest import nano_config, nano_model, randomize_attnres_queries

# ------------------------------------------------------------------------------------ switch combinations

# (residual mode, block size): Block AttnRes with several block sizes, including one larger than the model.
RESIDUALS = [
    ("block_attnres", 1),
    ("block_attnres", 2),
    ("block_attnres", 3),
    ("block_attnres", 5),
    ("full_attnres", 2),
    ("scale_bias", 2),
    ("plain", 2),
]
MOES = {"latent": {}, "plain": {"routed_expert_hidden_size": None}, "none": {"num_experts": 0}}
BALANCING = ["sign", "quantile", "aux_loss", "none"]
# Two-valued switches, covered pairwise (with each other and with the three factors above).
BINARY = {
    "kda_gate": ["lower_bound", "softplus"],
    "kda_output_gate": ["full", "low_rank"],
    "mla_output_gate": [True, False],
    "hidden_act": ["situ", "swiglu"],
    "q_lora_rank": [24, None],
    "layer_width_multipliers": [None, [1.0, 0.5, 2.0, 0.75]],
}


def covering_rows() -> list[tuple[int, ...]]:
    """Value indices for every factor: the full product of residual x MoE x balancing (84 rows), each row
    completed greedily with the two-valued switches that cover the most not-yet-covered pairs. The result
    covers every pair of values of every two factors (checked in test_switch_rows_cover_every_pair)."""
    sizes = [len(RESIDUALS), len(MOES), len(BALANCING)] + [len(v) for v in BINARY.values()]
    uncovered = {
        ((i, a), (j, b))
        for i, j in itertools.combinations(range(len(sizes)), 2)
        for a in range(sizes[i])
        for b in range(sizes[j])
    }
    rows = []
    for head in itertools.product(*(range(n) for n in sizes[:3])):

        def gain(tail, head=head, uncovered=uncovered):
            row = head + tail
            return sum(((i, row[i]), (j, row[j])) in uncovered for i, j in itertools.combinations(range(len(row)), 2))

        best = max(itertools.product(*(range(n) for n in sizes[3:])), key=gain)
        row = head + best
        uncovered -= {((i, row[i]), (j, row[j])) for i, j in itertools.combinations(range(len(row)), 2)}
        rows.append(row)
    assert not uncovered, uncovered
    return rows


def row_config(row: tuple[int, ...]) -> K3Config:
    residual, block = RESIDUALS[row[0]]
    kwargs = dict(residual=residual, attn_res_block_size=block, balancing=BALANCING[row[2]])
    kwargs.update(list(MOES.values())[row[1]])
    for (name, values), idx in zip(BINARY.items(), row[3:]):
        kwargs[name] = values[idx]
    return nano_config(**kwargs)


def test_switch_rows_cover_every_pair():
    rows = covering_rows()
    assert len(rows) == len(RESIDUALS) * len(MOES) * len(BALANCING)
    assert len(set(rows)) == len(rows)
    assert len({r[:3] for r in rows}) == len(rows)  # full product of the first three factors
    for i, j in itertools.combinations(range(len(rows[0])), 2):
        assert len({(r[i], r[j]) for r in rows}) == len({r[i] for r in rows}) * len({r[j] for r in rows})


def test_every_switch_combination_trains():
    """Forward + backward with finite loss and grads; aux loss exactly when asked for; bias update runs."""
    ids = torch.randint(0, 256, (2, 5))
    for row in covering_rows():
        cfg = row_config(row)
        torch.manual_seed(0)
        model = K3ForCausalLM.from_config(cfg).train()
        out = model(ids, labels=ids)
        label = f"{cfg.residual}/{cfg.attn_res_block_size} experts={cfg.num_experts} " + str(row)
        assert out.logits.shape == (2, 5, 256), label
        assert torch.isfinite(out.loss), label
        wants_aux = cfg.balancing == "aux_loss" and cfg.num_experts > 0
        assert (out.aux_loss is not None) == wants_aux, label
        loss = out.loss + (cfg.aux_loss_coef * out.aux_loss if wants_aux else 0.0)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert all(torch.isfinite(g).all() for g in grads.values()), label
        assert grads["model.embed_tokens.weight"].abs().sum() > 0, label
        assert grads["lm_head.weight"].abs().sum() > 0, label
        model.update_router_biases()
        for moe in model.moe_layers():
            assert torch.isfinite(moe.gate.e_score_correction_bias).all(), label


def test_switches_change_the_modules():
    lr = nano_model(kda_output_gate="low_rank", mla_output_gate=False, q_lora_rank=None, residual="scale_bias")
    attn0, attn3 = lr.model.layers[0].self_attn, lr.model.layers[3].self_attn
    assert hasattr(attn0, "g_a_proj") and hasattr(attn0, "g_b_proj") and not hasattr(attn0, "g_proj")
    assert not hasattr(attn3, "g_proj") and hasattr(attn3, "q_proj") and not hasattr(attn3, "q_a_proj")
    assert not hasattr(lr.model, "output_attn_res_proj")
    plain_moe = nano_model(routed_expert_hidden_size=None).model.layers[1].ffn
    assert not hasattr(plain_moe, "routed_expert_down_proj") and plain_moe.experts.w1.shape[-1] == 64
    dense = nano_model(num_experts=0)
    assert all(not layer.is_moe and hasattr(layer, "mlp") for layer in dense.model.layers)
    tiers = nano_model(layer_width_multipliers=[1.0, 0.5, 2.0, 1.0])
    assert tiers.model.layers[1].ffn.experts.w1.shape[1] == 16  # 32 * 0.5
    assert tiers.model.layers[2].ffn.experts.w1.shape[1] == 64  # 32 * 2


# ------------------------------------------------------------------------------------ balancing


def _train_forward(model: K3ForCausalLM, ids: torch.Tensor) -> None:
    model.train()
    with torch.no_grad():
        model(ids)


def test_aux_loss_is_the_switch_formula_in_training_mode_only():
    model = nano_model(balancing="aux_loss")
    ids = torch.randint(0, 256, (2, 6))
    model.train()
    with trace_mod.record(model, what="moe", max_tokens=6, max_batch=2) as tr:
        out = model(ids, labels=ids)
    E, k = model.config.num_experts, model.config.num_experts_per_token
    expected = []
    for i in tr.layer_indices("moe"):
        scores = torch.from_numpy(tr[f"moe.{i}.scores"]).reshape(-1, E).double()
        f = torch.from_numpy(tr[f"moe.{i}.load"]).double() / (scores.shape[0] * k)
        P = (scores / scores.sum(-1, keepdim=True)).mean(0)
        expected.append(E * (f * P).sum())
    assert out.aux_loss.requires_grad
    assert out.aux_loss.item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-5)
    model.eval()
    assert model(ids, labels=ids).aux_loss is None
    assert nano_model(balancing="sign").train()(ids, labels=ids).aux_loss is None


def test_sign_rule_moves_the_overloaded_expert_down():
    model = nano_model(balancing="sign")
    moe = model.moe_layers()[0]
    moe.gate.e_score_correction_bias[0] = 1.0  # scores are in (0, 1): expert 0 wins every token
    before = moe.gate.e_score_correction_bias.clone()
    _train_forward(model, torch.randint(0, 256, (2, 8)))
    load = moe.last_load.float()
    assert load[0] == 16 and load[0] > load.mean()
    model.update_router_biases()
    delta = moe.gate.e_score_correction_bias - before
    u = model.config.bias_update_rate
    assert torch.allclose(delta, u * torch.sign(load.mean() - load))
    assert delta[0] == pytest.approx(-u, rel=1e-4)
    assert (delta[load < load.mean()] > 0).all()


def test_quantile_rule_matches_its_formula_and_moves_the_overloaded_expert_down():
    model = nano_model(balancing="quantile")
    moe = model.moe_layers()[0]
    moe.gate.e_score_correction_bias[0] = 1.0
    before = moe.gate.e_score_correction_bias.clone().numpy().astype(np.float64)
    _train_forward(model, torch.randint(0, 256, (2, 8)))
    s = moe._last_scores.numpy().astype(np.float64)
    k, E = model.config.num_experts_per_token, model.config.num_experts
    # alpha_t = (k+1)-th largest of s + b; b_j = quantile_t(alpha_t - s_tj, k/E); b -= mean(b)
    alpha = np.sort(s + before, axis=1)[:, -(k + 1)][:, None]
    target = np.quantile(alpha - s, k / E, axis=0)
    target -= target.mean()
    model.update_router_biases()
    after = moe.gate.e_score_correction_bias.numpy()
    np.testing.assert_allclose(after, before + 0.5 * (target - before), rtol=1e-5, atol=1e-6)
    delta = after - before
    assert delta[0] < 0 and delta[0] == delta.min()


def test_quantile_rule_lowers_the_bias_of_an_expert_with_high_scores():
    model = nano_model(balancing="quantile")
    moe = model.moe_layers()[0]
    scores = torch.rand(64, 8) * 0.5
    scores[:, 0] = 0.9  # expert 0 scores highest for every token
    moe._last_scores = scores
    model.update_router_biases()
    bias = moe.gate.e_score_correction_bias
    assert bias[0] < 0 and bias[0] == bias.min()
    assert bias.sum().abs() < 1e-6  # b -= mean(b)


# ------------------------------------------------------------------------------------ AttnRes


def explicit_mix(query, norm_weight, sources, eps):
    """p_i = softmax_i(sum_d w_d * nw_d * v_id / sqrt(mean_d v_id^2 + eps)); out = sum_i p_i v_i (float64 loops)."""
    w = (query.double() * norm_weight.double()).tolist()
    logits = []
    for v in sources:
        v = v.double()
        rms = torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        logits.append(sum(w[d] * (v[..., d] / rms[..., 0]) for d in range(len(w))))
    logits = torch.stack(logits)
    p = torch.exp(logits - logits.max(0).values)
    p = p / p.sum(0)
    return sum(p[i].unsqueeze(-1) * sources[i].double() for i in range(len(sources))), p


def test_attnres_zero_query_is_the_uniform_average():
    sources = torch.randn(5, 2, 3, 16) * torch.arange(1, 6).view(5, 1, 1, 1)
    mixed, p = attnres_mix(torch.zeros(16), sources, torch.rand(16) + 0.5, return_weights=True)
    torch.testing.assert_close(mixed, sources.mean(0))
    torch.testing.assert_close(p, torch.full((5, 2, 3), 0.2))


def test_attnres_mix_matches_the_formula():
    gen = torch.Generator().manual_seed(3)
    sources = torch.randn(4, 2, 3, 8, generator=gen) * 3
    query, norm_w = torch.randn(8, generator=gen), torch.rand(8, generator=gen) + 0.5
    mixed, p = attnres_mix(query, sources, norm_w, eps=1e-5, return_weights=True)
    ref, ref_p = explicit_mix(query, norm_w, list(sources), 1e-5)
    torch.testing.assert_close(mixed.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(p.double(), ref_p, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(p, torch.full_like(p, 0.25))  # the query matters
    # The softmax ignores the scale of each source (keys are RMS-normalised; up to eps) but mixes the raw sources.
    scaled = sources * torch.tensor([1.0, 10.0, 0.1, 3.0]).view(4, 1, 1, 1)
    mixed_scaled, p_scaled = attnres_mix(query, scaled, norm_w, eps=1e-12, return_weights=True)
    _, p_tiny_eps = attnres_mix(query, sources, norm_w, eps=1e-12, return_weights=True)
    torch.testing.assert_close(p_scaled, p_tiny_eps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed_scaled, (p_scaled.unsqueeze(-1) * scaled).sum(0))


def test_attnres_mix_bf16_sources_keep_their_dtype_with_fp32_weights():
    sources = torch.randn(3, 2, 8).bfloat16()
    mixed, p = attnres_mix(torch.randn(8), sources, torch.ones(8), return_weights=True)
    assert mixed.dtype == torch.bfloat16 and p.dtype == torch.float32
    torch.testing.assert_close(p.sum(0), torch.ones(2))


@pytest.mark.parametrize("residual", ["block_attnres", "full_attnres"])
def test_fresh_model_depth_weights_are_uniform(residual):
    model = nano_model(residual=residual)
    with torch.no_grad(), trace_mod.record(model, what="attnres") as tr:
        model(torch.randint(0, 256, (1, 5)))
    names = [n for n in tr.names("attnres.") if not n.endswith("_query_norm")]
    assert len(names) >= 2 * model.config.num_hidden_layers - 1
    for name in names:
        n = tr[name].shape[-1]
        np.testing.assert_allclose(tr[name], 1.0 / n, rtol=1e-6, err_msg=name)


def _reference_hidden(model: K3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """K3_REFERENCE.md section 6, written out literally: the final hidden state (after the final RMSNorm)."""
    m, cfg = model.model, model.config
    x = m.embed_tokens(ids)

    def mix(proj, norm, sources):
        return explicit_mix(proj.weight[0], norm.weight, sources, norm.eps)[0].float()

    if cfg.residual == "block_attnres":
        bank, P = [], x
        for i, layer in enumerate(m.layers):
            h = mix(layer.self_attention_res_proj, layer.self_attention_res_norm, bank + [P]) if bank else P
            if i % cfg.attn_res_block_size == 0:
                bank.append(P)
                P = torch.zeros_like(x)
            P = P + layer.attention(h)
            h = mix(layer.mlp_res_proj, layer.mlp_res_norm, bank + [P])
            P = P + layer.feed_forward(h)
        final = mix(m.output_attn_res_proj, m.output_attn_res_norm, bank + [P])
    elif cfg.residual == "full_attnres":
        outs = [x]
        for layer in m.layers:
            outs.append(layer.attention(mix(layer.self_attention_res_proj, layer.self_attention_res_norm, outs)))
            outs.append(layer.feed_forward(mix(layer.mlp_res_proj, layer.mlp_res_norm, outs)))
        final = mix(m.output_attn_res_proj, m.output_attn_res_norm, outs)
    elif cfg.residual == "scale_bias":
        h = x
        for layer in m.layers:
            h = h + layer.self_attention_res_scale * layer.attention(h) + layer.self_attention_res_bias
            h = h + layer.mlp_res_scale * layer.feed_forward(h) + layer.mlp_res_bias
        final = h
    else:
        h = x
        for layer in m.layers:
            h = h + layer.attention(h)
            h = h + layer.feed_forward(h)
        final = h
    return m.norm(final)


@pytest.mark.parametrize(
    "residual, block",
    [
        ("block_attnres", 1),
        ("block_attnres", 2),
        ("block_attnres", 3),
        ("full_attnres", 2),
        ("scale_bias", 2),
        ("plain", 2),
    ],
)
def test_residual_modes_match_the_reference_loops(residual, block):
    model = nano_model(
        residual=residual,
        attn_res_block_size=block,
        num_hidden_layers=5,
        full_attn_layers=[4],
        layer_width_multipliers=None,
    )
    randomize_attnres_queries(model)
    if residual == "scale_bias":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "_res_scale" in name or "_res_bias" in name:
                    p.add_(torch.randn_like(p) * 0.3)
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model.model(ids), _reference_hidden(model, ids), rtol=1e-4, atol=1e-4)


def test_scale_bias_initialisation():
    model = nano_model(residual="scale_bias")
    layers = model.model.layers
    assert torch.all(layers[0].self_attention_res_scale == 1.0) and torch.all(layers[0].mlp_res_bias == 0.0)
    assert layers[-1].mlp_res_scale[0].item() == pytest.approx(0.9)
    assert scale_bias_init(model.config, 1) == pytest.approx(1.0 - 0.1 / 3)


def test_93_layer_block_12_bank_bookkeeping():
    """K3's layout (93 layers, Block AttnRes over 12) at a tiny width: the output mix sees 9 sources."""
    full = list(range(4, 93, 4)) + [93]
    cfg = K3Config(
        num_hidden_layers=93,
        hidden_size=8,
        vocab_size=16,
        full_attn_layers=full,
        attn_res_block_size=12,
        kda_num_heads=1,
        kda_head_dim=4,
        kda_chunk_size=2,
        num_attention_heads=1,
        q_lora_rank=None,
        kv_lora_rank=4,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=4,
        num_experts=0,
        intermediate_size=8,
    )
    model = K3ForCausalLM.from_config(cfg).eval()
    with torch.no_grad(), trace_mod.record(model, what="attnres") as tr:
        model(torch.randint(0, 16, (1, 2)))
    sources = tr.meta["attnres_sources"]
    assert sources["output"] == ["embedding"] + [f"block {b}" for b in range(1, 9)]
    assert tr["attnres.output"].shape[-1] == 9
    assert "0.attn" not in sources  # the first attention input is the embedding itself
    for i in range(1, 93):
        assert len(sources[f"{i}.attn"]) == (i + 11) // 12 + 1, i
    for i in range(93):
        assert len(sources[f"{i}.mlp"]) == i // 12 + 2, i


def test_attnres_pseudo_queries_receive_gradients():
    model = nano_model().train()
    ids = torch.randint(0, 256, (2, 6))
    model(ids, labels=ids).loss.backward()
    grads = [model.model.layers[1].self_attention_res_proj.weight.grad, model.model.output_attn_res_proj.weight.grad]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


# ------------------------------------------------------------------------------------ SiTU / FFN


def test_situ_matches_the_closed_form():
    beta, lin = 4.0, 25.0
    values = [-200.0, -30.0, -5.0, -1.0, -0.1, 0.0, 0.3, 2.0, 7.0, 40.0, 500.0]
    g = torch.tensor(values).repeat_interleave(len(values))
    u = torch.tensor(values).repeat(len(values))
    out = situ(g, u, beta, lin)
    for gi, ui, oi in zip(g.tolist(), u.tolist(), out.tolist()):
        ref = beta * math.tanh(gi / beta) / (1 + math.exp(-gi)) * lin * math.tanh(ui / lin)
        assert oi == pytest.approx(ref, rel=1e-5, abs=1e-6), (gi, ui)
    # Both branches are soft-clamped: the output is bounded by beta * linear_beta whatever the inputs.
    assert out.abs().max() <= beta * lin
    big = situ(torch.tensor([500.0]), torch.tensor([1e4]), beta, lin)
    assert big.item() == pytest.approx(beta * lin, rel=1e-4)
    # A gate-only clamp would give about beta * u here; SiTU clamps the linear branch too.
    mid = situ(torch.tensor([10.0]), torch.tensor([100.0]), beta, lin).item()
    assert mid == pytest.approx(4 * math.tanh(2.5) / (1 + math.exp(-10)) * 25 * math.tanh(4.0), rel=1e-5)


def test_situ_computes_in_fp32_and_returns_the_input_dtype():
    g, u = torch.randn(64) * 10, torch.randn(64) * 50
    out = situ(g.bfloat16(), u.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), situ(g.bfloat16().float(), u.bfloat16().float()), rtol=1e-2, atol=1e-2)


def test_swiglu_and_gated_mlp():
    g, u = torch.randn(10), torch.randn(10)
    torch.testing.assert_close(swiglu(g, u), g * torch.sigmoid(g) * u)
    for act in ("situ", "swiglu"):
        mlp = nano_model(hidden_act=act).model.layers[0].mlp
        x = torch.randn(2, 3, 64)
        gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
        inner = situ(gate, up) if act == "situ" else F.silu(gate) * up
        torch.testing.assert_close(mlp(x), inner @ mlp.down_proj.weight.T, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ KDA


def _kda_z(layer, x):
    z = x @ layer.f_a_proj.weight.T @ layer.f_b_proj.weight.T + layer.dt_bias
    return z.view(*x.shape[:2], layer.num_heads, layer.head_dim)


def test_kda_lower_bound_gate_formula():
    layer = nano_model(kda_gate="lower_bound").model.layers[0].self_attn
    x = torch.randn(2, 6, 64) * 3
    with torch.no_grad():
        # Moderate gate parameters: at init (A up to 16, dt_bias about -5) g underflows to -0.0 in fp32.
        layer.A_log.copy_(torch.tensor([0.0, 0.7]))
        layer.dt_bias.normal_()
        g = layer.decay(x)
        A = layer.A_log.exp().view(1, 1, -1, 1)
        expected = -5.0 * torch.sigmoid(A * _kda_z(layer, x))
    torch.testing.assert_close(g, expected)
    assert g.shape == (2, 6, 2, 16) and g.dtype == torch.float32
    assert (g > -5.0).all() and (g < 0).all()


def test_kda_softplus_gate_formula():
    layer = nano_model(kda_gate="softplus").model.layers[0].self_attn
    x = torch.randn(2, 6, 64) * 3
    with torch.no_grad():
        g = layer.decay(x)
        expected = -layer.A_log.exp().view(1, 1, -1, 1) * F.softplus(_kda_z(layer, x))
        extreme = layer.decay(x * 1e4)
    torch.testing.assert_close(g, expected)
    assert (g <= 0).all() and (extreme <= 0).all() and torch.isfinite(extreme).all()


def _kda_reference(layer, x):
    """Section 2 of K3_REFERENCE.md written out token by token (float64)."""
    B, T, _ = x.shape
    H, d = layer.num_heads, layer.head_dim
    x = x.double()

    def conv_silu(proj, conv):
        y = x @ proj.weight.double().T  # [B, T, C]
        w = conv.weight.double()[:, 0, :]  # [C, K]
        K = w.shape[1]
        out = torch.zeros_like(y)
        for t in range(T):
            for j in range(K):  # tap j sees the input K-1-j steps back
                s = t - (K - 1 - j)
                if s >= 0:
                    out[:, t] += w[:, j] * y[:, s]
        return F.silu(out).view(B, T, H, d)

    q, k, v = (
        conv_silu(p, c)
        for p, c in ((layer.q_proj, layer.q_conv1d), (layer.k_proj, layer.k_conv1d), (layer.v_proj, layer.v_conv1d))
    )
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(x @ layer.b_proj.weight.double().T)
    g = layer.decay(x.float()).double()
    S = torch.zeros(B, H, d, d, dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    o = torch.zeros(B, T, H, d, dtype=torch.float64)
    for t in range(T):
        for b in range(B):
            for h in range(H):
                kk, bb = k[b, t, h], beta[b, t, h]
                S[b, h] = (eye - bb * torch.outer(kk, kk)) @ torch.diag(g[b, t, h].exp()) @ S[b, h] + bb * torch.outer(
                    kk, v[b, t, h]
                )
                o[b, t, h] = S[b, h].T @ (q[b, t, h] * d**-0.5)
    w_norm = layer.o_norm.weight.double()
    o = w_norm * o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps)
    if hasattr(layer, "g_proj"):
        gate_in = x @ layer.g_proj.weight.double().T
    else:
        gate_in = x @ layer.g_a_proj.weight.double().T @ layer.g_b_proj.weight.double().T
    o = o * torch.sigmoid(gate_in.view(B, T, H, d))
    return o.reshape(B, T, H * d) @ layer.o_proj.weight.double().T


@pytest.mark.parametrize("gate, out_gate", [("lower_bound", "full"), ("softplus", "low_rank")])
def test_kda_layer_matches_the_token_by_token_recurrence(gate, out_gate):
    layer = nano_model(kda_gate=gate, kda_output_gate=out_gate).model.layers[0].self_attn
    x = torch.randn(2, 11, 64)  # longer than one chunk of 8
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), _kda_reference(layer, x), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------ MLA


def _mla_reference(attn, x):
    """Section 3: explicit causal softmax attention, no positions anywhere, per head."""
    B, T, _ = x.shape
    H, nope, rope, vdim = attn.num_heads, attn.nope, attn.rope, attn.vdim
    if hasattr(attn, "q_a_proj"):
        qa = x @ attn.q_a_proj.weight.T
        qa = attn.q_a_layernorm.weight * qa / torch.sqrt(qa.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = qa @ attn.q_b_proj.weight.T
    else:
        q = x @ attn.q_proj.weight.T
    q = q.view(B, T, H, nope + rope)
    lat = x @ attn.kv_a_proj_with_mqa.weight.T
    c, k_r = lat[..., : attn.kv_lora], lat[..., attn.kv_lora :]
    c = attn.kv_a_layernorm.weight * c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
    kv = (c @ attn.kv_b_proj.weight.T).view(B, T, H, nope + vdim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    out = torch.zeros(B, T, H, vdim)
    for b in range(B):
        for h in range(H):
            K = torch.cat([k_nope[b, :, h], k_r[b]], dim=-1)  # [T, nope + rope]
            scores = q[b, :, h] @ K.T / math.sqrt(nope + rope)
            scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            out[b, :, h] = scores.softmax(-1) @ v[b, :, h]
    if hasattr(attn, "g_proj"):
        out = out * torch.sigmoid(x @ attn.g_proj.weight.T).view(B, T, H, vdim)
    return out.reshape(B, T, H * vdim) @ attn.o_proj.weight.T


@pytest.mark.parametrize("q_lora, gated", [(24, True), (None, False)])
def test_mla_nope_equals_explicit_softmax_attention(q_lora, gated):
    attn = nano_model(q_lora_rank=q_lora, mla_output_gate=gated).model.layers[3].self_attn
    assert attn.scale == pytest.approx((16 + 8) ** -0.5)
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), _mla_reference(attn, x), rtol=1e-4, atol=1e-5)


def test_mla_has_no_positional_information():
    """NoPE: the last query's output depends on the set of earlier tokens, not on their order."""
    attn = nano_model().model.layers[3].self_attn
    x = torch.randn(1, 6, 64)
    perm = torch.tensor([3, 0, 4, 1, 2, 5])
    with torch.no_grad():
        torch.testing.assert_close(attn(x)[0, -1], attn(x[:, perm])[0, -1], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ model level


@pytest.mark.parametrize("residual", ["block_attnres", "scale_bias"])
def test_bf16_forward_on_cpu(residual):
    model = nano_model(residual=residual).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16
    assert torch.isfinite(out.loss) and abs(out.loss.item() - math.log(256)) < 1.0


def test_labels_and_targets_agree_and_ignore_minus_100():
    model = nano_model()
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        by_labels = model(ids, labels=ids)
        targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        by_targets = model(ids, targets=targets)
        nll = F.cross_entropy(by_labels.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(by_labels.loss, by_targets.loss)
    torch.testing.assert_close(by_labels.loss, nll)
    assert model(ids).loss is None


@pytest.mark.parametrize(
    "ids, labels, words",
    [
        (torch.tensor([[1, 256]]), None, "0..255"),
        (torch.tensor([[-1, 3]]), None, "0..255"),
        (torch.tensor([1, 2, 3]), None, "batch, tokens"),
        (torch.tensor([[1.0, 2.0]]), None, "integer"),
        (torch.zeros(2, 0, dtype=torch.long), None, "no tokens"),
        (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2]]), "shape"),
        (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 300]]), "labels"),
    ],
)
def test_bad_inputs_raise_value_error(ids, labels, words):
    model = nano_model()
    with pytest.raises(ValueError, match=words):
        model(ids, labels=labels)


def test_parameter_counts():
    model = nano_model()
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == total
    per_expert = 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    inactive = n_moe * (cfg.num_experts - cfg.num_experts_per_token) * per_expert
    assert model.num_parameters(active=True) == total - inactive
    tied = nano_model(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.num_parameters() == total - 256 * 64


@pytest.mark.parametrize("residual", ["block_attnres", "scale_bias"])
def test_meta_build_then_to_empty_and_reset_gives_a_fresh_model(residual):
    """device="meta" skips initialisation; to_empty() + reset_parameters() initialises every tensor."""
    reference = nano_model(residual=residual)
    model = K3ForCausalLM.from_config(nano_config(residual=residual), device="meta")
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        for b in model.buffers():
            b.fill_(float("nan"))
    model.reset_parameters()
    for (name, p), ref in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.isfinite(p).all(), name
        if "norm" in name or "res_proj" in name or "_res_" in name or "e_score" in name:
            assert torch.equal(p, ref), name  # deterministic initial values
        elif p.numel() >= 256:  # random init: same spread as a fresh model
            assert abs(p.float().std().item() - ref.float().std().item()) <= 0.2 * ref.float().std().item(), name
    ids = torch.randint(0, 256, (1, 4))
    assert torch.isfinite(model.eval()(ids, labels=ids).loss)


def test_decoder_layer_accessors():
    model = nano_model()
    layers = model.model.layers
    assert [layer.is_mla for layer in layers] == [False, False, False, True]
    assert layers[0].ffn is layers[0].mlp and layers[1].ffn is layers[1].block_sparse_moe
    h = torch.randn(1, 4, 64)
    with torch.no_grad():
        torch.testing.assert_close(layers[1].attention(h), layers[1].self_attn(layers[1].input_layernorm(h)))
        torch.testing.assert_close(layers[1].feed_forward(h), layers[1].ffn(layers[1].post_attention_layernorm(h)))
