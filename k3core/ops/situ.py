"""FFN activations: SiTU (K3) and SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU(g, u) = beta*tanh(g/beta) * sigmoid(g) * linear_beta*tanh(u/linear_beta), in fp32.

    Both branches are soft-clamped (the gate to about +-beta, the linear branch to +-linear_beta).
    """
    g, u = gate.float(), up.float()
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
        return out.to(gate.dtype)
    # No autograd: the same products in place on two fresh buffers (half the passes over memory,
    # no temporaries; the MoE experts' activation was a third of their time). Equal to the line above
    # up to the rounding of folding beta * linear_beta into one factor (tests/k3core/ops/test_ops_situ.py).
    out = torch.div(g, beta).tanh_().mul_(torch.sigmoid(g))
    out.mul_(torch.div(u, linear_beta).tanh_()).mul_(beta * linear_beta)
    return out.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU(g, u) = SiLU(g) * u."""
    return F.silu(gate) * up
