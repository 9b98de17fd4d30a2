"""RMSNorm module (the math lives in ``k3core.ops.norm.rms_norm``)."""

from __future__ import annotations

import torch
from torch import nn

from ...ops.norm import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm(x; w, eps) = w * x / sqrt(mean(x^2) + eps), in fp32, cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
