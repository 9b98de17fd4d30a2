"""k3core.modeling.layers.moe: LatentMoE dispatch (the grouped dispatch equals the per-expert masked loop), routing
weights, and the balancing rules (aux loss, sign and quantile bias updates) against their formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3core.interp import recorder as trace_mod
from k3core.modeling.layers.ffn import activation
from k3core.modeling.layers.moe import LatentMoE, expert_counts, grouped_mm_available
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset
from k3core.training.balancing import update_router_biases
from tests.conftest import nano_model


def make_moe(k: int = 2, E: int = 8, seed: int = 0, **overrides) -> LatentMoE:
    """The first LatentMoE of a k3-nano with k of E experts, weights re-drawn large enough to matter."""
    cfg = from_preset("k3-nano", num_experts=E, num_experts_per_token=k, **overrides)
    torch.manual_seed(seed)
    moe = K3ForCausalLM.from_config(cfg).moe_layers()[0]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return moe


def hidden(N: int = 37, D: int = 64, seed: int = 5) -> torch.Tensor:
    return torch.randn(1, N, D, generator=torch.Generator().manual_seed(seed))


def grads(moe: LatentMoE, x: torch.Tensor, dispatch: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and the gradients (input and every parameter) of a fixed random projection of it."""
    moe.zero_grad()
    x = x.clone().requires_grad_()
    y = moe(x, dispatch=dispatch)
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    (y * r).sum().backward()
    named = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    named["x"] = x.grad.clone()
    return y.detach(), named


@pytest.mark.parametrize("k", [1, 2, 8])
def test_grouped_dispatch_equals_masked_loop_with_gradients(k):
    moe = make_moe(k=k)
    with torch.no_grad():
        moe.gate.e_score_correction_bias[3] = -100.0  # expert 3 never selected (unless k = E)
    x = hidden()
    _, experts, _ = moe.route(x[0])
    load = torch.bincount(experts.flatten(), minlength=8)
    assert (load[3] == 0) == (k < 8)
    if k == 8:
        assert (load == x.shape[1]).all()
    y_g, g_g = grads(moe, x, "grouped")
    y_m, g_m = grads(moe, x, "masked")
    y_s, g_s = grads(moe, x, "sorted_loop")
    assert y_m.abs().max() > 0.1
    torch.testing.assert_close(y_g, y_m, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y_s, y_m, atol=1e-6, rtol=1e-5)
    assert set(g_g) == set(g_m) and "experts.w1" in g_g and "gate.weight" in g_g
    for name in g_m:
        torch.testing.assert_close(g_g[name], g_m[name], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(g_s[name], g_m[name], atol=1e-5, rtol=1e-5, msg=name)
    if k < 8:  # the unused expert gets a zero gradient
        assert g_g["experts.w1"][3].abs().max() == 0


def test_stacked_experts_by_hand():
    moe = make_moe(k=2)
    ex = moe.experts
    z = torch.randn(3, ex.w1.shape[2], generator=torch.Generator().manual_seed(1))
    experts = torch.tensor([[0, 2], [2, 1], [6, 0]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]])

    def expert(e, v):  # W2 act(W1 v, W3 v)
        return F.linear(activation(moe.config, F.linear(v, ex.w1[e]), F.linear(v, ex.w3[e])), ex.w2[e])

    want = torch.stack([sum(w * expert(int(e), z[i]) for e, w in zip(experts[i], weights[i])) for i in range(3)])
    with torch.no_grad():
        torch.testing.assert_close(ex(z, experts, weights), want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ex.forward_masked_loop(z, experts, weights), want, atol=1e-6, rtol=1e-5)
        empty = ex(z[:0], experts[:0], weights[:0])
    assert empty.shape == (0, z.shape[1])


@pytest.mark.skipif(not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"), reason="no grouped GEMM")
def test_grouped_mm_backend_forward_equals_masked_loop():
    # torch implements grouped_mm's forward on CPU (fp32) too, so the GPU path's math is checked here.
    moe = make_moe(k=2)
    with torch.no_grad():
        moe.gate.e_score_correction_bias[5] = -100.0
        x = hidden()
        torch.testing.assert_close(moe(x, dispatch="grouped_mm"), moe(x, dispatch="masked"), atol=1e-6, rtol=1e-5)
    assert not grouped_mm_available(x)  # "auto" only picks it for bf16 on CUDA


def test_routing_weights_are_renormalised_and_scaled():
    moe = make_moe(k=2, routed_scaling_factor=2.446)
    x = hidden(N=11)[0]
    with torch.no_grad():
        scores, experts, weights = moe.route(x)
    s = torch.sigmoid(x @ moe.gate.weight.T)
    torch.testing.assert_close(scores, s)
    top = s.topk(2, dim=-1)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True) * 2.446)
    assert torch.equal(experts, top.indices)
    torch.testing.assert_close(weights.sum(-1), torch.full((11,), 2.446))
    assert (weights[:, 0] >= weights[:, 1]).all()  # sorted by weight


def test_selection_bias_changes_selection_not_the_weight_formula():
    moe = make_moe(k=2)
    x = hidden(N=11)[0]
    with torch.no_grad():
        s = torch.sigmoid(x @ moe.gate.weight.T)
        worst = int(s.mean(0).argmin())
        moe.gate.e_score_correction_bias[worst] = 10.0
        _, experts, weights = moe.route(x)
    assert (experts == worst).any(-1).all()  # the biased expert is now chosen for every token
    chosen_s = s.gather(1, experts)
    torch.testing.assert_close(weights, chosen_s / chosen_s.sum(-1, keepdim=True))  # unbiased scores only


def test_bad_dispatch_names_are_rejected():
    moe = make_moe(k=2)
    with pytest.raises(ValueError, match="dispatch"):
        moe(hidden(), dispatch="fast")
    with pytest.raises(ValueError, match="backend"):
        moe.experts(torch.zeros(2, 32), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2), backend="x")


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
        scores = torch.from_numpy(tr[f"blocks.{i}.moe.scores"]).reshape(-1, E).double()
        f = torch.from_numpy(tr[f"blocks.{i}.moe.experts.load"]).double() / (scores.shape[0] * k)
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
    update_router_biases(model)
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
    s = moe.last_scores.numpy().astype(np.float64)
    k, E = model.config.num_experts_per_token, model.config.num_experts
    # alpha_t = (k+1)-th largest of s + b; b_j = quantile_t(alpha_t - s_tj, k/E); b -= mean(b)
    alpha = np.sort(s + before, axis=1)[:, -(k + 1)][:, None]
    target = np.quantile(alpha - s, k / E, axis=0)
    target -= target.mean()
    update_router_biases(model)
    after = moe.gate.e_score_correction_bias.numpy()
    np.testing.assert_allclose(after, before + 0.5 * (target - before), rtol=1e-5, atol=1e-6)
    delta = after - before
    assert delta[0] < 0 and delta[0] == delta.min()


def test_quantile_rule_lowers_the_bias_of_an_expert_with_high_scores():
    model = nano_model(balancing="quantile")
    moe = model.moe_layers()[0]
    scores = torch.rand(64, 8) * 0.5
    scores[:, 0] = 0.9  # expert 0 scores highest for every token
    moe.last_scores = scores
    update_router_biases(model)
    bias = moe.gate.e_score_correction_bias
    assert bias[0] < 0 and bias[0] == bias.min()
    assert bias.sum().abs() < 1e-6  # b -= mean(b)


def test_expert_counts_is_bincount_with_a_fixed_shape():
    g = torch.Generator().manual_seed(0)
    for n, num_experts in ((0, 4), (7, 3), (500, 16)):
        ids = torch.randint(0, num_experts, (n,), generator=g)
        counts = expert_counts(ids, num_experts)
        assert counts.dtype == torch.int64 and torch.equal(counts, torch.bincount(ids, minlength=num_experts))
    assert torch.equal(expert_counts(torch.tensor([2, 2]), 5), torch.tensor([0, 0, 2, 0, 0]))
