"""k3core.ops.situ (SiTU, SwiGLU) and the gated MLP that uses them (k3core.modeling.layers.ffn)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3core.ops.situ import situ, swiglu
from tests.conftest import nano_model


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


def test_situ_without_autograd_equals_the_differentiable_form():
    """The in-place (no-grad) path and the autograd path: same values to fp32 rounding, inputs untouched."""
    g, u = torch.randn(4096) * 8, torch.randn(4096) * 60
    g0, u0 = g.clone(), u.clone()
    with torch.no_grad():
        fast = situ(g, u)
    assert torch.equal(g, g0) and torch.equal(u, u0)
    slow = situ(g.clone().requires_grad_(), u.clone().requires_grad_())
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-6, atol=1e-6)
