"""KDA's implicit attention (``k3core.ops.kda.implicit_attention``): A @ v is the layer's own core output (the
chunked and the recurrent path), A equals a brute-force fp64 recurrence fed one basis value vector at a time, and
the window map / mass before the window are the matching parts of the whole A."""

from __future__ import annotations

import pytest
import torch

from k3core.modeling.hooks import hooks
from k3core.ops.kda import implicit_attention, kda_chunk, kda_recurrent
from k3core.ops.kda.implicit_attention import kda_attention_blocks, kda_attention_reference, kda_attention_window
from tests.conftest import nano_model, random_ids


def _inputs(dtype=torch.float32, B=2, T=100, H=3, K=16, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    g = -torch.rand(B, T, H, K, generator=gen, dtype=dtype) * 0.3
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, r(B, T, H, V), g, beta


def _whole(q, k, g, beta, chunk_size):
    B, T, H = beta.shape
    A = torch.zeros(B, H, T, T, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    for t0, t1, rows in kda_attention_blocks(q, k, g, beta, chunk_size=chunk_size):
        A[:, :, t0:t1, :t1] = rows
    return A


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("group_tokens", [1024, 32])  # chunk maps made for all chunks at once, or a few at a time
def test_attention_times_values_is_the_kda_output_fp32(chunk_size, group_tokens, monkeypatch):
    monkeypatch.setattr(implicit_attention, "_GROUP_TOKENS", group_tokens)
    q, k, v, g, beta = _inputs()  # T = 100: not a multiple of the chunk; 3 heads, 2 sequences
    A = _whole(q, k, g, beta, chunk_size)
    assert A.dtype == torch.float32
    o_attn = torch.einsum("bhts,bshv->bthv", A, v)
    o_chunk, _ = kda_chunk(q, k, v, g, beta, chunk_size=chunk_size, backend="torch")
    o_rec, _ = kda_recurrent(q, k, v, g, beta)
    assert _rel(o_attn, o_chunk) < 1e-5
    assert _rel(o_attn, o_rec) < 1e-5
    assert torch.equal(A, A.tril())  # causal: nothing from a later key


def test_attention_matches_brute_force_recurrence_one_basis_value_at_a_time():
    q, k, _, g, beta = _inputs(torch.float64, B=1, T=64, H=2, K=8, seed=3)
    A = _whole(q, k, g, beta, chunk_size=16)
    assert A.dtype == torch.float64
    brute = torch.zeros_like(A)
    for s in range(64):  # the recurrence with the value e_s: a 1-channel value that is 1 at token s only
        v = torch.zeros(1, 64, 2, 1, dtype=torch.float64)
        v[:, s] = 1.0
        o, _ = kda_recurrent(q, k, v, g, beta)
        brute[:, :, :, s] = o[..., 0].transpose(1, 2)
    assert (A - brute).abs().max().item() < 1e-12
    assert (kda_attention_reference(q, k, g, beta) - brute).abs().max().item() < 1e-12
    assert A.abs().max() > 0.05  # not trivially zero


def test_grouped_value_heads_repeat_their_query_key_head():
    q, k, v, g, beta = _inputs(torch.float64, T=40, H=2, seed=5)
    g = torch.cat([g, g * 0.5], 2)  # 4 value heads over 2 query/key heads
    beta = torch.cat([beta, beta.flip(1)], 2)
    v = torch.cat([v, v], 2)
    A = _whole(q, k, g, beta, chunk_size=8)
    o, _ = kda_recurrent(q, k, v, g, beta)
    assert _rel(torch.einsum("bhts,bshv->bthv", A, v), o) < 1e-12


def test_window_map_and_mass_before_are_parts_of_the_whole_rows():
    q, k, _, g, beta = _inputs(torch.float64, T=90, seed=1)
    A = kda_attention_reference(q, k, g, beta)
    attn, before = kda_attention_window(q, k, g, beta, (37, 80), chunk_size=16)
    assert attn.shape == (2, 3, 43, 43)
    assert (attn - A[:, :, 37:80, 37:80]).abs().max() < 1e-12
    assert (before - A[:, :, 37:80, :37].sum(-1)).abs().max() < 1e-12
    first, none_before = kda_attention_window(q, k, g, beta, (0, 20))
    assert (first - A[:, :, :20, :20]).abs().max() < 1e-12 and not none_before.any()
    with pytest.raises(ValueError, match="holds no query"):
        kda_attention_window(q, k, g, beta, (95, 120))


def test_attention_reproduces_a_kda_layer_core_output():
    """On a real layer: the core output seen at blocks.0.kda.o (before the output norm and gate) from the q, k, v,
    g, beta the same forward passed through its hook points; T = 45 is not a multiple of the chunk."""
    model = nano_model()
    seen = {}
    keep = lambda key: lambda v, n, info: seen.__setitem__(key, v.detach())  # noqa: E731
    table = {f"blocks.0.kda.{p}": keep(p) for p in ("q", "k", "v", "g", "beta", "o")}
    with hooks(read=table), torch.no_grad():
        model(random_ids(45))
    C = model.config.kda_chunk_size
    A = _whole(seen["q"], seen["k"], seen["g"], seen["beta"], chunk_size=C)
    o_attn = torch.einsum("bhts,bshv->bthv", A, seen["v"].float())
    assert _rel(o_attn, seen["o"]) < 1e-5
