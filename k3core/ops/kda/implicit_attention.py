"""KDA's implicit attention: the signed weights A[t, s] with ``o_t = sum_{s <= t} A[t, s] v_s`` exactly.

For fixed q, k, g and beta the KDA output is linear in the values (layouts and math: ``k3core.ops.kda``). Unrolling
``S_t = M_t S_{t-1} + beta_t k_t v_t^T`` with ``M_r = (I - beta_r k_r k_r^T) Diag(exp g_r)`` (decay first, then the
delta-rule update, as :func:`k3core.ops.kda.kda_step`) and ``o_t = S_t^T (scale q_t)``::

    A[t, s] = scale * beta_s * q_t^T M_t M_{t-1} ... M_{s+1} k_s        (s <= t; the product is I when s = t)

In chunk form (chunks of C tokens, the quantities of :func:`k3core.ops.kda.kda_chunk`: A_qk, T_inv, Gamma,
Gamma_to_end of each chunk, ``T_beta = T_inv Diag(beta)``, ``W = T_beta (Gamma * K)``), a chunk maps its entering
state S_0 and its own values V to

    O = R S_0 + A_in V,              R = scale (Gamma * Q - A_qk W),   A_in = scale A_qk T_beta   (C x K, C x C)
    S_C = P S_0 + E V,               P = Diag(Gamma_C) - K_dec^T W,    E = K_dec^T T_beta          (K x K, K x C)

Feeding one-hot values (one value channel per key) makes the state a K x (keys so far) matrix X whose column s is
"what key s left in the state"; the attention rows of chunk n's queries are then ``[R_n X, A_in_n]`` and the carry
is ``X <- [P_n X, E_n]``. :func:`kda_attention_blocks` streams these rows one query chunk at a time: memory
O(K T + C T) per head (the carry and one row block; never T x T), work about ``T^2 K (1/2 + K / (2 C))``
multiply-adds per head (R X and P X over every earlier key). :func:`kda_attention_window` runs the same stream on a
query window's own tokens only (a key before the window cannot reach it without passing through the window's
transitions, so the window's map needs nothing from before it) and adds each query's signed mass before the window
from one single-value KDA pass (v = 1 before the window, 0 inside it). fp32, or fp64 when any input is fp64.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from .intra_chunk import decay, intra_chunk
from .naive import compute_dtype, expand_heads

__all__ = ["kda_attention_blocks", "kda_attention_window", "kda_attention_reference"]

_GROUP_TOKENS = 1024  # tokens whose chunk maps are made at once


def _chunk_maps(q, k, g, beta, scale, C):
    """Per chunk (time-major [N, Z, ...], Z = B * HV): R [C, K], A_in [C, C], P [K, K], E [K, C]."""
    Z, T, K = q.shape
    N = max(1, math.ceil(T / C))
    pad = N * C - T

    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(Z, N, C, *x.shape[2:]).transpose(0, 1).reshape(N * Z, C, *x.shape[2:])

    qc, kc, bc = chunks(q), chunks(k), chunks(beta.unsqueeze(-1)).squeeze(-1)
    A_qk, t_inv, gamma, gamma_to_end = intra_chunk(qc, kc, decay(chunks(g)), bc)
    t_beta = t_inv * bc.unsqueeze(-2)
    W = torch.bmm(t_beta, kc * gamma)
    R = (qc * gamma - torch.bmm(A_qk, W)) * scale
    A_in = torch.bmm(A_qk, t_beta) * scale
    k_dec_t = (kc * gamma_to_end).transpose(-1, -2)  # [NZ, K, C]
    P = torch.diag_embed(gamma[:, -1]) - torch.bmm(k_dec_t, W)
    E = torch.bmm(k_dec_t, t_beta)
    return tuple(x.view(N, Z, *x.shape[1:]) for x in (R, A_in, P, E))


def _flat(q, k, g, beta):
    """[B, T, H(V), K] inputs -> [B * HV, T, K] in the compute dtype (q/k heads repeated for grouped values)."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    if k.shape != q.shape or g.shape != (B, T, HV, K) or beta.shape != (B, T, HV) or HV % H:
        raise ValueError(
            f"q, k [B, T, H, K], g [B, T, HV, K], beta [B, T, HV] expected, got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(g.shape)}, {tuple(beta.shape)}"
        )
    dt = compute_dtype(q, k, g, beta)

    def heads(x: torch.Tensor, rep: int) -> torch.Tensor:
        x = expand_heads(x.to(dt), rep, 2)
        return x.transpose(1, 2).reshape(B * HV, T, *x.shape[3:])

    return heads(q, HV // H), heads(k, HV // H), heads(g, 1), heads(beta, 1), (B, HV)


@torch.no_grad()
def kda_attention_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The implicit attention rows of every query, one query chunk at a time (module docstring).

    q, k: [B, T, H, K] (L2-normalised, as the layer feeds them); g: [B, T, HV, K]; beta: [B, T, HV]; scale
    defaults to K**-0.5. Yields ``(t0, t1, rows)``: rows [B, HV, t1 - t0, t1] = A[t, s] for queries
    t0 <= t < t1 and keys s < t1 (0 for s > t), in fp32 (fp64 for fp64 inputs).
    """
    C = chunk_size
    if C < 1 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two, got {C}")
    T, K = q.shape[1], q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    qf, kf, gf, bf, (B, HV) = _flat(q, k, g, beta)
    if T == 0:
        return
    Z, N = qf.shape[0], math.ceil(T / C)
    group = max(1, _GROUP_TOKENS // C)  # chunk maps made for this many chunks at a time (O(group C^2) each)
    carry = qf.new_zeros(Z, K, T + C)  # column s: what key s left in the state (one-hot values)
    for n in range(N):
        if n % group == 0:
            span = slice(n * C, min(T, (n + group) * C))
            R, A_in, P, E = _chunk_maps(qf[:, span], kf[:, span], gf[:, span], bf[:, span], scale, C)
        m = n % group
        t0, t1 = n * C, min(T, (n + 1) * C)
        rows = qf.new_empty(Z, C, t1)
        torch.bmm(R[m], carry[:, :, :t0], out=rows[:, :, :t0])
        rows[:, :, t0:] = A_in[m][:, :, : t1 - t0]
        yield t0, t1, rows[:, : t1 - t0].view(B, HV, t1 - t0, t1)
        if t1 < T:
            carry[:, :, :t0] = torch.bmm(P[m], carry[:, :, :t0])
            carry[:, :, t0 : t0 + C] = E[m]


@torch.no_grad()
def kda_attention_window(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    window: tuple[int, int],
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The implicit attention map of the query window [start, stop) over keys in the same window, and each query's
    signed mass before the window.

    Returns ``(map [B, HV, n, n], before [B, HV, n])``, n = stop - start: ``map[.., i, j] = A[start + i, start + j]``
    and ``before[.., i] = sum_{s < start} A[start + i, s]`` (so a row of the map plus its ``before`` is the whole
    row sum). Memory is window-sized: the map comes from the window's own tokens; ``before`` from one KDA pass with a
    single value channel.
    """
    from .chunk import kda_chunk

    T = q.shape[1]
    start, stop = max(0, int(window[0])), min(T, int(window[1]))
    if stop <= start:
        raise ValueError(f"attention window {tuple(window)} holds no query of a {T}-token text")
    part = [x[:, start:stop] for x in (q, k, g, beta)]
    B, HV, n = q.shape[0], g.shape[2], stop - start
    dt = compute_dtype(q, k, g, beta)
    attn = torch.zeros(B, HV, n, n, dtype=dt, device=q.device)
    for t0, t1, rows in kda_attention_blocks(*part, scale=scale, chunk_size=chunk_size):
        attn[:, :, t0:t1, :t1] = rows
    if start == 0:
        return attn, attn.new_zeros(B, HV, n)
    ones = torch.zeros(B, stop, HV, 1, dtype=dt, device=q.device)
    ones[:, :start] = 1.0
    o, _ = kda_chunk(q[:, :stop].to(dt), k[:, :stop].to(dt), ones, g[:, :stop].to(dt), beta[:, :stop].to(dt),
                     scale=scale, chunk_size=chunk_size, backend="torch")  # fmt: skip
    return attn, o[:, start:, :, 0].transpose(1, 2)


@torch.no_grad()
def kda_attention_reference(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """The whole A [B, HV, T, T] by brute force in fp64: the recurrence run with one basis value vector per key
    (value channel s is 1 at token s, else 0), for tests only (T x T memory)."""
    from .naive import kda_recurrent

    B, T, _, _ = q.shape
    HV = g.shape[2]
    basis = torch.eye(T, dtype=torch.float64).view(1, T, 1, T).expand(B, T, HV, T)
    o, _ = kda_recurrent(q.double(), k.double(), basis.contiguous(), g.double(), beta.double(), scale=scale)
    return o.permute(0, 2, 1, 3)  # [B, HV, query, key]
