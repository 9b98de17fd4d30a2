"""FFN activations: SiTU (K3) and SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements per pass of the no-autograd SiTU: 1 MB of fp32 per temporary, about one core's L2 cache, so its
# chain of in-place passes reads memory once per block instead of once per pass.
_BLOCK = 1 << 18


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU(g, u) = beta*tanh(g/beta) * sigmoid(g) * linear_beta*tanh(u/linear_beta), in fp32.

    Both branches are soft-clamped (the gate to about +-beta, the linear branch to +-linear_beta).
    """
    g, u = gate.float(), up.float()
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
        return out.to(gate.dtype)
    # No autograd: the same products in place, block by block (tests/k3core/ops/test_ops_situ.py), with
    # tanh from expm1, which torch computes faster on the CPU than tanh; no temporaries of the whole size
    # (measured: benchmarks/README.md, "Timings behind the code").
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    g_flat, u_flat, out_flat = g.reshape(-1), u.reshape(-1), out.view(-1)
    for i in range(0, out_flat.numel(), _BLOCK):
        g_i, u_i, o_i = g_flat[i : i + _BLOCK], u_flat[i : i + _BLOCK], out_flat[i : i + _BLOCK]
        _tanh_half_(torch.mul(g_i, 2.0 / beta, out=o_i)).mul_(torch.sigmoid(g_i))
        o_i.mul_(_tanh_half_(torch.mul(u_i, 2.0 / linear_beta))).mul_(beta * linear_beta)
    return out.to(gate.dtype)


def _tanh_half_(x: torch.Tensor) -> torch.Tensor:
    """tanh(x / 2) in place: e / (e + 2) with e = expm1(x), x clamped to [-20, 20] (tanh(10) is 1 in fp32).

    No cancellation on either side of 0 (expm1 is exact near 0; for x < 0 the denominator lies in (1, 2)):
    within 2e-7 relative of tanh over the whole line (measured against fp64)."""
    x.clamp_(-20.0, 20.0).expm1_()
    return x.div_(x + 2.0)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU(g, u) = SiLU(g) * u."""
    return F.silu(gate) * up
