"""FFN activations: SiTU (K3) and SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU(g, u) = beta*tanh(g/beta) * sigmoid(g) * linear_beta*tanh(u/linear_beta), in fp32.

    Both branches are soft-clamped (the gate to about +-beta, the linear branch to +-linear_beta).
    """
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU(g, u) = SiLU(g) * u."""
    return F.silu(gate) * up
