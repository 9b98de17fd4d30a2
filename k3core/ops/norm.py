"""RMSNorm, the functional form (``k3core.layers.norm.RMSNorm`` is the module; AttnRes normalises its keys with it)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm(x; w, eps) = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
