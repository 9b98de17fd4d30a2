"""k3core.modeling.layers.kda: the KDA decay gates and the whole layer against Section 2 of K3_REFERENCE.md token by
token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import nano_model


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
