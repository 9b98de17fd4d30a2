"""Attention over depth (AttnRes), the functional core.

    mix(v_0..v_n; w, norm_w) = sum_i p_i v_i,   p = softmax_i( <w, norm_w * RMSNorm(v_i)> )

The softmax runs over the source axis in fp32 with no 1/sqrt(D) factor; the raw sources are
mixed, not their normalised keys. A zero pseudo-query w gives the uniform average.
"""

from __future__ import annotations

import torch

from .norm import inverse_rms


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

    The normalised keys are never formed: <w, norm_w * v / rms(v)> = (v . (w * norm_w)) / rms(v), one
    matrix-vector product and one norm per source (1 / rms(v) is RMSNorm's ``k3core.ops.norm.inverse_rms``),
    and the mix is summed in place (measured: benchmarks/README.md, "Timings behind the code").
    """
    mixed, p = _DepthMix.apply(sources.float(), query.float() * norm_weight.float(), eps)
    mixed = mixed.to(sources.dtype)
    return (mixed, p) if return_weights else mixed


class _DepthMix(torch.autograd.Function):
    """(mixed, p) of fp32 sources v [N, ..., D] and w = query * norm_weight [D], with a hand-written backward.

    Forward: d_i = v_i . w, r_i = 1 / rms(v_i), p = softmax_i(d_i r_i), mixed = sum_i p_i v_i.
    Backward, from g (of mixed) and g_p (of p, where the weights are read):
        gp_i = g . v_i + g_p_i,   gl_i = p_i (gp_i - sum_j p_j gp_j)          (softmax)
        dv_i = p_i g + gl_i r_i w - gl_i d_i r_i^3 v_i / D                   (d r_i / d v_i = -r_i^3 v_i / D)
        dw   = sum_i gl_i r_i v_i
    Three passes over the sources instead of autograd's chain, which keeps every intermediate (measured:
    benchmarks/README.md, "Timings behind the code"); tests/k3core/ops/test_ops_attnres.py checks it against
    autograd of the formula in fp64."""

    @staticmethod
    def forward(ctx, src32: torch.Tensor, w: torch.Tensor, eps: float):
        dots = src32 @ w  # [N, ...]
        r = inverse_rms(src32, eps).squeeze(-1)
        p = torch.softmax(dots * r, dim=0)
        ctx.save_for_backward(src32, w, dots, r, p)
        return _weighted_sum(p, src32), p

    @staticmethod
    def backward(ctx, g_mixed: torch.Tensor | None, g_p: torch.Tensor | None):
        src32, w, dots, r, p = ctx.saved_tensors
        gp = torch.zeros_like(p) if g_mixed is None else (src32 * g_mixed).sum(-1)
        if g_p is not None:
            gp = gp + g_p
        a = p * (gp - (p * gp).sum(0, keepdim=True)) * r  # gl_i r_i
        g_src = g_w = None
        if ctx.needs_input_grad[0]:
            g_src = src32 * (-(a * dots * r * r) / src32.shape[-1]).unsqueeze(-1)
            if g_mixed is not None:
                g_src.addcmul_(g_mixed.unsqueeze(0).expand_as(src32), p.unsqueeze(-1))
            g_src.addcmul_(a.unsqueeze(-1), w)
        if ctx.needs_input_grad[1]:
            g_w = a.reshape(-1) @ src32.reshape(-1, src32.shape[-1])
        return g_src, g_w, None


def attnres_combine(weights: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """sum_i p_i v_i with given depth weights p: [N, ...] and sources [N, ..., D] (the second half of
    ``attnres_mix``, for weights edited between the softmax and the mix). Returns the dtype of sources."""
    return _weighted_sum(weights.float(), sources.float()).to(sources.dtype)


def _weighted_sum(p: torch.Tensor, src32: torch.Tensor) -> torch.Tensor:
    """sum_i p_i v_i in fp32. Without autograd (and inside ``_DepthMix``) one fused multiply-add per source into
    one buffer (no [N, ..., D] temporary); with it, the broadcast product and sum (its backward measured faster)."""
    if torch.is_grad_enabled() and (p.requires_grad or src32.requires_grad):
        return (p.unsqueeze(-1) * src32).sum(0)
    mixed = src32[0] * p[0].unsqueeze(-1)
    for i in range(1, src32.shape[0]):
        mixed.addcmul_(src32[i], p[i].unsqueeze(-1))
    return mixed
