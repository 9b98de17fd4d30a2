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


def test_attnres_mix_gradients_equal_autograd_of_the_formula():
    """The mix's hand-written backward (sources, pseudo-query, norm weight; through both the mix and the
    returned weights) against autograd of the formula written out in fp64."""
    gen = torch.Generator().manual_seed(5)
    sources = (torch.randn(4, 2, 3, 16, generator=gen) * 2).requires_grad_()
    query = torch.randn(16, generator=gen).requires_grad_()
    norm_w = (torch.rand(16, generator=gen) + 0.5).requires_grad_()
    g_mix, g_p = torch.randn(2, 3, 16, generator=gen), torch.randn(4, 2, 3, generator=gen)
    mixed, p = attnres_mix(query, sources, norm_w, eps=1e-5, return_weights=True)
    got = torch.autograd.grad((mixed * g_mix).sum() + (p * g_p).sum(), (sources, query, norm_w))

    leaves = [t.detach().double().requires_grad_() for t in (sources, query, norm_w)]
    v, q, nw = leaves
    logits = (v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * (q * nw)).sum(-1)
    ref_p = torch.softmax(logits, 0)
    ref_mix = (ref_p.unsqueeze(-1) * v).sum(0)
    want = torch.autograd.grad(
        (ref_mix * g_mix.double()).sum() + (ref_p * g_p.double()).sum(), leaves, retain_graph=True
    )
    for name, a, b in zip(("sources", "query", "norm_weight"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=name)
    # only the mix used (the model's path without hooks): the weights' gradient is absent
    grads = torch.autograd.grad((attnres_mix(query, sources, norm_w) * g_mix).sum(), (sources, query))
    want = torch.autograd.grad((ref_mix * g_mix.double()).sum(), leaves[:2])
    for a, b in zip(grads, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
