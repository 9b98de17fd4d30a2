"""Attention over depth (AttnRes), the functional core.

    mix(v_0..v_n; w, norm_w) = sum_i p_i v_i,   p = softmax_i( <w, norm_w * RMSNorm(v_i)> )

The softmax runs over the source axis in fp32 with no 1/sqrt(D) factor; the raw sources are
mixed, not their normalised keys. A zero pseudo-query w gives the uniform average.
"""

from __future__ import annotations

import torch

from .norm import rms_norm


def attnres_mix(
    query: torch.Tensor,
    sources: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = 1e-5,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted mix of depth sources.

    query: [D] pseudo-query; sources: [N, ..., D] stacked on the first axis; norm_weight: [D].
    Returns the mix [..., D] (dtype of sources) and, when ``return_weights``, p: [N, ...] (fp32).
    """
    src32 = sources.float()
    keys = rms_norm(src32, None, eps)
    logits = keys @ (query.float() * norm_weight.float())  # [N, ...]
    p = torch.softmax(logits, dim=0)
    mixed = (p.unsqueeze(-1) * src32).sum(0).to(sources.dtype)
    return (mixed, p) if return_weights else mixed


def attnres_combine(weights: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """sum_i p_i v_i with given depth weights p: [N, ...] and sources [N, ..., D] (the second half of
    ``attnres_mix``, for weights edited between the softmax and the mix). Returns the dtype of sources."""
    return (weights.float().unsqueeze(-1) * sources.float()).sum(0).to(sources.dtype)
