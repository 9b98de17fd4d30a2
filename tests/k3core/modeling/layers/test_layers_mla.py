"""k3core.modeling.layers.mla: MLA (NoPE) against explicit causal softmax attention (Section 3 of K3_REFERENCE.md)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import nano_model


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
