"""RMSNorm, the functional form (``k3core.modeling.layers.norm.RMSNorm`` is the module; AttnRes scales its keys with
:func:`inverse_rms`)."""

from __future__ import annotations

import torch


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, kept as a size-1 dim: one fused norm reduction, no x^2
    temporary (the pow-then-mean form wrote and read a second tensor of x's size)."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1] + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm(x; w, eps) = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back."""
    x32 = x.float()
    y = x32 * inverse_rms(x32, eps)
    if weight is not None:
        grad = torch.is_grad_enabled() and (y.requires_grad or weight.requires_grad)
        y = y * weight.float() if grad else y.mul_(weight.float())
    return y.to(x.dtype)
