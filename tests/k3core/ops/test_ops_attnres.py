"""k3core.ops.attnres: the depth softmax mix against its formula written out in float64 loops."""

from __future__ import annotations

import torch

from k3core.ops.attnres import attnres_mix


def explicit_mix(query, norm_weight, sources, eps):
    """p_i = softmax_i(sum_d w_d * nw_d * v_id / sqrt(mean_d v_id^2 + eps)); out = sum_i p_i v_i (float64 loops)."""
    w = (query.double() * norm_weight.double()).tolist()
    logits = []
    for v in sources:
        v = v.double()
        rms = torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        logits.append(sum(w[d] * (v[..., d] / rms[..., 0]) for d in range(len(w))))
    logits = torch.stack(logits)
    p = torch.exp(logits - logits.max(0).values)
    p = p / p.sum(0)
    return sum(p[i].unsqueeze(-1) * sources[i].double() for i in range(len(sources))), p


def test_attnres_zero_query_is_the_uniform_average():
    sources = torch.randn(5, 2, 3, 16) * torch.arange(1, 6).view(5, 1, 1, 1)
    mixed, p = attnres_mix(torch.zeros(16), sources, torch.rand(16) + 0.5, return_weights=True)
    torch.testing.assert_close(mixed, sources.mean(0))
    torch.testing.assert_close(p, torch.full((5, 2, 3), 0.2))


def test_attnres_mix_matches_the_formula():
    gen = torch.Generator().manual_seed(3)
    sources = torch.randn(4, 2, 3, 8, generator=gen) * 3
    query, norm_w = torch.randn(8, generator=gen), torch.rand(8, generator=gen) + 0.5
    mixed, p = attnres_mix(query, sources, norm_w, eps=1e-5, return_weights=True)
    ref, ref_p = explicit_mix(query, norm_w, list(sources), 1e-5)
    torch.testing.assert_close(mixed.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(p.double(), ref_p, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(p, torch.full_like(p, 0.25))  # the query matters
    # The softmax ignores the scale of each source (keys are RMS-normalised; up to eps) but mixes the raw sources.
    scaled = sources * torch.tensor([1.0, 10.0, 0.1, 3.0]).view(4, 1, 1, 1)
    mixed_scaled, p_scaled = attnres_mix(query, scaled, norm_w, eps=1e-12, return_weights=True)
    _, p_tiny_eps = attnres_mix(query, sources, norm_w, eps=1e-12, return_weights=True)
    torch.testing.assert_close(p_scaled, p_tiny_eps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed_scaled, (p_scaled.unsqueeze(-1) * scaled).sum(0))


def test_attnres_mix_bf16_sources_keep_their_dtype_with_fp32_weights():
    sources = torch.randn(3, 2, 8).bfloat16()
    mixed, p = attnres_mix(torch.randn(8), sources, torch.ones(8), return_weights=True)
    assert mixed.dtype == torch.bfloat16 and p.dtype == torch.float32
    torch.testing.assert_close(p.sum(0), torch.ones(2))
