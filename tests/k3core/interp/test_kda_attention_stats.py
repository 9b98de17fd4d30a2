"""KDA implicit-attention statistics per position (``k3core.interp.kda_attention_stats``), streamed in row blocks,
against the same formulas applied to the whole fp64 A of the brute-force reference."""

from __future__ import annotations

import torch

from k3core.interp.attention_stats import position_bins
from k3core.interp.kda_attention_stats import distance_bins, kda_attention_stats
from k3core.ops.kda.implicit_attention import kda_attention_reference


def _inputs(B=2, T=75, H=3, K=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    g = -torch.rand(B, T, H, K, generator=gen, dtype=dtype) * 0.2
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, g, beta


def test_distance_bins_double_from_one():
    assert distance_bins(1) == [0, 1]
    assert distance_bins(20) == [0, 1, 2, 4, 8, 16, 20]


def test_streamed_statistics_equal_the_formulas_on_the_whole_matrix():
    q, k, g, beta = _inputs()
    T = q.shape[1]
    A = kda_attention_reference(q, k, g, beta)  # [B, H, T, T] fp64
    got = kda_attention_stats(q, k, g, beta, position_bins(T), chunk_size=16)
    mag = A.abs()
    p = mag / mag.sum(-1, keepdim=True)
    ent = -(torch.where(p > 0, p * p.clamp_min(1e-300).log(), 0.0)).sum(-1)
    t = torch.arange(T)
    dist = t[:, None] - t[None, :]
    expect = {
        "entropy": ent,
        "sink": p[..., 0],
        "received": p.sum(-2),
        "negative": torch.where(A < 0, p, 0.0).sum(-1),
        "row_sum": A.sum(-1),
    }
    for name, want in expect.items():
        assert torch.allclose(got[name].double(), want, atol=1e-5), name
    # half-mass distance: the smallest d with the mass within distance d >= 1/2
    within = torch.stack([torch.where((dist >= 0) & (dist <= d), p, 0.0).sum(-1) for d in range(T)], -1)
    half = (within < 0.5).sum(-1)
    assert torch.equal(got["half_distance"].long(), half)
    # distance profile summed over each position bin's queries
    edges, pos = distance_bins(T), position_bins(T)
    for b in range(len(pos) - 1):
        for e in range(len(edges) - 1):
            sel = (dist >= edges[e]) & (dist < edges[e + 1])
            want = torch.where(sel, p, 0.0).sum(-1)[..., pos[b] : pos[b + 1]].sum(-1)
            assert torch.allclose(got["distance"][..., b, e].double(), want, atol=1e-5)
    assert torch.allclose(got["distance"].sum((-1, -2)).double(), torch.full((2, 3), float(T), dtype=torch.float64))
    assert (got["negative"] > 0).any() and (got["negative"] <= 1 + 1e-6).all()


def test_a_head_that_keeps_only_the_current_token():
    """A head whose decay g -> -inf (alpha = 0) wipes the
    state every step, so A[t, s] = scale beta_t (q_t . k_t) on the diagonal only: entropy 0, half distance 0, all
    mass at distance 0, first-token mass 1 only at t = 0."""
    q, k, g, beta = _inputs(B=1, T=40, H=2, seed=1)
    g = torch.full_like(g, -80.0)
    got = kda_attention_stats(q, k, g, beta, position_bins(40), chunk_size=8)
    assert got["entropy"].abs().max() < 1e-6
    assert not got["half_distance"].any()
    assert torch.allclose(got["distance"][..., 0].sum(-1), torch.full((1, 2), 40.0))
    assert torch.allclose(got["sink"][..., 0], torch.ones(1, 2)) and got["sink"][..., 1:].abs().max() < 1e-6


def test_recorded_items_are_the_layer_own_implicit_attention():
    """record(what={"kda_attn", "attn_probs"}) on a real model: the window map, its mass before and the statistics
    equal the reference A of the q, k, g, beta that the same forward showed at its hook points; the window's rows
    plus their mass before are the whole rows' sums."""
    from k3core.interp.recorder import record
    from k3core.interp.trace import names
    from k3core.interp.trace_size import record_bytes
    from k3core.modeling.hooks import hooks
    from tests.conftest import nano_model, random_ids

    model, ids = nano_model(), random_ids(70)
    seen = {}
    keep = lambda key: lambda v, n, info: seen.__setitem__(key, v.detach())  # noqa: E731
    with hooks(read={f"blocks.0.kda.{p}": keep(p) for p in ("q", "k", "g", "beta")}), torch.no_grad():
        with record(model, what={"kda_attn", "attn_probs"}, max_batch=2, attn_window=(10, 50)) as trace:
            model(ids)
    A = kda_attention_reference(seen["q"], seen["k"], seen["g"], seen["beta"])
    assert trace.meta["attn_window"] == [10, 50] and trace.axes[names.kda_attn(0)] == ("batch", "head", "query", "key")
    assert torch.allclose(torch.from_numpy(trace[names.kda_attn(0)]).double(), A[:, :, 10:50, 10:50], atol=1e-5)
    before = torch.from_numpy(trace[names.kda_attn_stat(0, "before")]).double()
    assert torch.allclose(before, A[:, :, 10:50, :10].sum(-1), atol=1e-5)
    row_sum = torch.from_numpy(trace[names.kda_attn_stat(0, "row_sum")]).double()
    assert torch.allclose(row_sum, A.sum(-1), atol=1e-5)
    mag = A.abs()
    assert torch.allclose(
        torch.from_numpy(trace[names.kda_attn_stat(0, "sink")]).double(), mag[..., 0] / mag.sum(-1), atol=1e-5
    )
    kda_layers = [i for i in range(model.config.num_hidden_layers) if not model.config.is_mla_layer(i)]
    assert trace.layer_indices("kda") == kda_layers
    # the size estimate counts these items: within 3% of what the trace holds
    held = sum(a.nbytes for n, a in trace.arrays.items() if ".kda.attn" in n)
    est = record_bytes(model.config, 70, what={"kda_attn", "attn_probs"}, max_batch=2, max_attn_len=40).by_item
    assert abs(est["kda_attn"] - held) <= 0.03 * held
