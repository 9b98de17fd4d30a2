"""Gated feed-forward network: out = W_down act(W_gate x, W_up x), act = SiTU (K3) or SwiGLU."""

from __future__ import annotations

import torch
from torch import nn

from ...ops.situ import situ, swiglu
from ..config import K3Config


def activation(config: K3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if config.hidden_act == "situ":
        return situ(gate, up, config.situ_beta, config.situ_linear_beta)
    return swiglu(gate, up)


class GatedMLP(nn.Module):
    """Dense FFN and shared experts (keys ``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, config: K3Config, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(self.config, self.gate_proj(x), self.up_proj(x)))
