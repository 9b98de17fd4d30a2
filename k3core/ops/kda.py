"""Kimi Delta Attention (KDA) token mixer: recurrent reference, single decode step, chunked form.

Layouts follow flash-linear-attention's ``naive_recurrent_kda``::

    q, k  : [B, T, H, K]     (already L2-normalised per head)
    v     : [B, T, HV, V]    (HV == H for K3; HV may be a multiple of H, "grouped values")
    g     : [B, T, HV, K]    log of the per-channel decay alpha = exp(g), g <= 0
    beta  : [B, T, HV]       write strength in (0, 1)
    state : [B, HV, K, V]    keys x values, fp32

Per head, with D_t = Diag(exp(g_t)) and s = scale (default K**-0.5)::

    S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (s q_t)

i.e. decay the state per key channel, read the prediction ``(D_t S_{t-1})^T k_t``, write
``beta_t k_t (v_t - prediction)^T`` (the delta rule), then read with the scaled query.

Three entry points:

* :func:`kda_step`: one decoding step (the single definition of the recurrence).
* :func:`kda_recurrent`: loops :func:`kda_step` over time; the reference.
* :func:`kda_chunk`: the chunked (WY / UT-transform) algorithm in pure PyTorch, or fla's Triton
  kernel on CUDA when it is installed.

All arithmetic is done in fp32 (fp64 if any input is fp64); outputs are cast to ``v.dtype`` and
final states are returned in the compute dtype.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["kda_step", "kda_recurrent", "kda_chunk"]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 if any given tensor is fp64, else fp32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _check_shapes(q, k, v, g, beta, initial_state) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"value heads ({HV}) must be a multiple of query/key heads ({H})")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        raise ValueError(f"initial_state must be [B, HV, K, V] = {(B, HV, K, V)}, got {tuple(initial_state.shape)}")
    return B, T, H, K, HV, V


def _expand_heads(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """Repeat q/k heads so they line up with the value heads (no-op when HV == H)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


# --------------------------------------------------------------------------------------------
# recurrent form
# --------------------------------------------------------------------------------------------


def _step_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA step on already-prepared compute-dtype tensors.

    q (pre-scaled), k, alpha = exp(g): [..., K]; v: [..., V]; beta: [...]; state: [..., K, V].

        S' = Diag(alpha) S
        S_new = S' + beta k (v - S'^T k)^T          ( = (I - beta k k^T) S' + beta k v^T )
        o = S_new^T q
    """
    decayed = state * alpha.unsqueeze(-1)
    pred = torch.matmul(k.unsqueeze(-2), decayed).squeeze(-2)  # S'^T k : [..., V]
    write = (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - pred).unsqueeze(-2)
    new_state = decayed + write
    o = torch.matmul(q.unsqueeze(-2), new_state).squeeze(-2)
    return o, new_state


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of KDA.

    Args:
        q, k: [B, H, K] (L2-normalised); v: [B, HV, V]; g: [B, HV, K] log-decay (<= 0);
        beta: [B, HV]; state: [B, HV, K, V] (None means zeros); scale defaults to K**-0.5.

    Math per head: ``S_t = (I - beta k k^T) Diag(exp(g)) S_{t-1} + beta k v^T``,
    ``o = S_t^T (scale q)``.

    Returns:
        ``(o, new_state)``: o [B, HV, V] in ``v.dtype``; new_state [B, HV, K, V] in fp32
        (fp64 if any input is fp64).
    """
    B, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if scale is None:
        scale = K**-0.5
    dt = _compute_dtype(q, k, v, g, beta, state)
    groups = HV // H
    qf = _expand_heads(q.to(dt), groups, 1) * scale
    kf = _expand_heads(k.to(dt), groups, 1)
    if state is None:
        state = torch.zeros(B, HV, K, V, dtype=dt, device=v.device)
    o, new_state = _step_core(qf, kf, v.to(dt), g.to(dt).exp(), beta.to(dt), state.to(dt))
    return o.to(v.dtype), new_state


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (the reference implementation).

    Args:
        q, k: [B, T, H, K] (L2-normalised); v: [B, T, HV, V]; g: [B, T, HV, K] log-decay (<= 0);
        beta: [B, T, HV]; scale defaults to K**-0.5; initial_state: [B, HV, K, V] or None (zeros).

    For t = 1..T, per head (see :func:`kda_step`)::

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
        o_t = S_t^T (scale q_t)

    The loop runs over T only; each step is vectorised over batch and heads.

    Returns:
        ``(o, final_state)``: o [B, T, HV, V] in ``v.dtype``; final_state [B, HV, K, V] in fp32
        (fp64 for fp64 inputs), or None unless ``output_final_state``.
    """
    B, T, H, K, HV, V = _check_shapes(q, k, v, g, beta, initial_state)
    if scale is None:
        scale = K**-0.5
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    groups = HV // H
    qf = _expand_heads(q.to(dt), groups, 2) * scale
    kf = _expand_heads(k.to(dt), groups, 2)
    vf, betaf = v.to(dt), beta.to(dt)
    alpha = g.to(dt).exp()  # all decays at once; exp(g) <= 1

    if initial_state is None:
        state = torch.zeros(B, HV, K, V, dtype=dt, device=v.device)
    else:
        state = initial_state.to(dt)
    outs = []
    for t in range(T):
        o_t, state = _step_core(qf[:, t], kf[:, t], vf[:, t], alpha[:, t], betaf[:, t], state)
        outs.append(o_t)
    if T > 0:
        o = torch.stack(outs, dim=1)
    else:
        o = vf.new_zeros(B, 0, HV, V)
    return o.to(v.dtype), (state if output_final_state else None)


# --------------------------------------------------------------------------------------------
# chunked form
# --------------------------------------------------------------------------------------------


@functools.cache
def _dyadic_layout(C: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where each entry of a strictly lower C x C matrix lives in the dyadic block list.

    The strictly lower triangle of a C x C matrix (C a power of two) is tiled exactly once by
    the blocks "right half x left half" of every dyadic interval: for block size s in
    C/2, C/4, ..., 1 and parent p in range(C // (2s)), rows p*2s + s + i and columns p*2s + j
    (0 <= i, j < s).  Entry (r, j), r > j, belongs to the level s = 2**floor(log2(r ^ j)).

    Returns two flat index maps of length C*C into ``[0, diag (C), level blocks...]``:
    the first for the strictly lower matrix (diagonal -> 0), the second including the diagonal.
    Slot 0 is a zero.
    """
    offsets = {}
    pos = 1 + C  # slot 0 = zero, slots 1..C = diagonal
    s = C // 2
    while s >= 1:
        offsets[s] = pos
        pos += (C // (2 * s)) * s * s
        s //= 2
    strict, incl = [], []
    for r in range(C):
        for j in range(C):
            if j > r:
                strict.append(0)
                incl.append(0)
            elif j == r:
                strict.append(0)
                incl.append(1 + r)
            else:
                s = 1 << ((r ^ j).bit_length() - 1)
                p, i, jj = r // (2 * s), r % s, j % s
                idx = offsets[s] + p * s * s + i * s + jj
                strict.append(idx)
                incl.append(idx)
    return tuple(strict), tuple(incl)


def _suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """Exclusive reverse cumulative sum along dim -2: out[j] = x[j+1] + ... + x[-1] (0 at the end).

    Summed directly from the end (no "total minus prefix" cancellation), so when the result is
    small it is accurate even if the whole sum is large.
    """
    rev = x.flip(-2).cumsum(-2).flip(-2)
    return torch.cat([rev[..., 1:, :], torch.zeros_like(rev[..., :1, :])], dim=-2)


def _intra_chunk_scores(qs: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted q.k and k.k scores inside each chunk, without any exp of a positive number.

    qs, k: [..., C, K]; g: [..., C, K] per-step log-decays (<= 0) of each chunk.  With
    G_r = g_1 + ... + g_r, returns ``(Aqk, Akk)``, both [..., C, C]::

        Aqk[r, j] = sum_c qs[r, c] k[j, c] exp(G[r, c] - G[j, c])   for j <= r, else 0
        Akk[r, j] = sum_c  k[r, c] k[j, c] exp(G[r, c] - G[j, c])   for j <  r, else 0

    exp(G_r - G_j) is split at a reference index m with j <= m < r:
    exp(G_r - G_j) = exp(G_r - G_m) * exp(G_m - G_j), both factors <= 1.  Using the dyadic
    tiling of the lower triangle (see :func:`_dyadic_layout`), every block "right half x left
    half" has such an m (the last row of its left half), so each block is one batched matmul of
    safely-decayed rows by safely-decayed columns.  Cost ~ C^2 K / 2 multiply-adds per chunk.

    The two exponents are summed locally from g (a prefix sum over the right half, a suffix sum
    over the left half) rather than as differences of chunk-wide prefix sums, which would lose
    precision to cancellation once the cumulative decay is large (hundreds, at g = -5 per step).
    """
    C = g.shape[-2]
    lead = g.shape[:-2]
    q_vals, k_vals = [(qs * k).sum(-1)], [torch.zeros_like(k[..., 0])]
    s = C // 2
    while s >= 1:
        P = C // (2 * s)
        gb = g.unflatten(-2, (P, 2, s))  # [..., P, 2, s, K]
        qb = qs.unflatten(-2, (P, 2, s))
        kb = k.unflatten(-2, (P, 2, s))
        col = kb[..., 0, :, :] * torch.exp(_suffix_sum(gb[..., 0, :, :]))  # exp(G_m - G_j) k_j
        row_decay = torch.exp(gb[..., 1, :, :].cumsum(-2))  # exp(G_r - G_m)
        rows = torch.cat([qb[..., 1, :, :] * row_decay, kb[..., 1, :, :] * row_decay], dim=-2)  # [..., P, 2s, K]
        blk = torch.matmul(rows, col.transpose(-1, -2))  # [..., P, 2s, s]
        q_vals.append(blk[..., :s, :].reshape(*lead, P * s * s))
        k_vals.append(blk[..., s:, :].reshape(*lead, P * s * s))
        s //= 2
    zero = g.new_zeros(*lead, 1)
    q_vals = torch.cat([zero, *q_vals], dim=-1)
    k_vals = torch.cat([zero, *k_vals], dim=-1)
    strict, incl = _dyadic_layout(C)
    strict_idx = torch.tensor(strict, device=g.device)
    incl_idx = torch.tensor(incl, device=g.device)
    Aqk = q_vals.index_select(-1, incl_idx).unflatten(-1, (C, C))
    Akk = k_vals.index_select(-1, strict_idx).unflatten(-1, (C, C))
    return Aqk, Akk


def _kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size):
    """Pure-PyTorch chunked KDA (see :func:`kda_chunk` for the math)."""
    B, T, H, K, HV, V = _check_shapes(q, k, v, g, beta, initial_state)
    C = chunk_size
    if C < 1 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two, got {C}")
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    groups = HV // H
    N = max(1, math.ceil(T / C))
    pad = N * C - T
    BH = B * HV

    def prep(x: torch.Tensor, expand: bool) -> torch.Tensor:
        # [B, T, h, D] -> [B*HV, N, C, D] in the compute dtype; padded tokens are zeros, which
        # (k = 0, beta = 0, g = 0) leave the state untouched.
        x = x.to(dt)
        if expand:
            x = _expand_heads(x, groups, 2)
        x = x.transpose(1, 2)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.reshape(BH, N, C, x.shape[-1])

    qs = prep(q, True) * scale
    kc = prep(k, True)
    vc = prep(v, False)
    gc = prep(g, False)
    bc = prep(beta.unsqueeze(-1), False)  # [BH, N, C, 1]

    G = gc.cumsum(-2)  # within-chunk cumulative log-decay G_r, <= 0 and non-increasing
    G_to_end = _suffix_sum(gc)  # G_C - G_r, <= 0

    # Intra-chunk scores (masked and overflow-free, see _intra_chunk_scores).
    Aqk, Akk = _intra_chunk_scores(qs, kc, gc)

    # UT transform: (I + diag(beta) Akk) [U | W] = diag(beta) [V | exp(G) * K].
    rhs = torch.cat([bc * vc, bc * (torch.exp(G) * kc)], dim=-1)
    sol = torch.linalg.solve_triangular(bc * Akk, rhs, upper=False, unitriangular=True)
    U, W = sol.split([V, K], dim=-1)

    # Chunk transition S_next = (Diag(gamma) - Kd^T W) S + Kd^T U.
    k_dec = kc * torch.exp(G_to_end)  # keys decayed to the end of the chunk
    k_dec_t = k_dec.transpose(-1, -2)
    trans = torch.diag_embed(torch.exp(G[..., -1, :])) - torch.matmul(k_dec_t, W)  # [BH, N, K, K]
    inject = torch.matmul(k_dec_t, U)  # [BH, N, K, V]

    if initial_state is None:
        state = torch.zeros(BH, K, V, dtype=dt, device=v.device)
    else:
        state = initial_state.to(dt).reshape(BH, K, V)
    states = []
    for n in range(N):
        states.append(state)
        state = torch.baddbmm(inject[:, n], trans[:, n], state)
    S_in = torch.stack(states, dim=1)  # state entering each chunk: [BH, N, K, V]

    # Outputs: inter-chunk part from the entering state, intra-chunk part through Aqk.
    delta = U - torch.matmul(W, S_in)  # beta * (v - prediction) per token
    o = torch.matmul(qs * torch.exp(G), S_in) + torch.matmul(Aqk, delta)  # [BH, N, C, V]

    o = o.reshape(B, HV, N * C, V)[:, :, :T].transpose(1, 2).to(v.dtype)
    final = state.reshape(B, HV, K, V) if output_final_state else None
    return o, final


@functools.lru_cache(maxsize=1)
def _fla_chunk_kda():
    """fla's Triton ``chunk_kda`` if it imports (needs triton + CUDA), else None."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # ImportError, or triton failing at import time
        return None
    return chunk_kda


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA: same inputs, outputs and math as :func:`kda_recurrent`, but parallel in time.

    Split time into chunks of C tokens (the tail is zero-padded internally).  Within a chunk let
    ``G_r = g_1 + ... + g_r`` (cumulative log-decay, per key channel), ``Gamma_r = exp(G_r)`` and
    ``S_0`` the state entering the chunk.  Writing ``d_r = beta_r (v_r - (D_r S_{r-1})^T k_r)``
    the recurrence unrolls to::

        S_r = Diag(Gamma_r) S_0 + sum_{j<=r} Diag(Gamma_r / Gamma_j) k_j d_j^T
        d_r + beta_r sum_{j<r} A_kk[r, j] d_j = beta_r v_r - beta_r S_0^T (Gamma_r * k_r)

    with ``A_kk[r, j] = k_r^T Diag(exp(G_r - G_j)) k_j``.  So with the unit lower-triangular
    ``M = I + Diag(beta) A_kk`` (the UT transform / WY representation)::

        U = M^{-1} Diag(beta) V,   W = M^{-1} Diag(beta) (Gamma * K),   D = U - W S_0
        O = (Gamma * Q s) S_0 + A_qk D,     A_qk[r, j] = s q_r^T Diag(exp(G_r - G_j)) k_j, j <= r
        S_C = (Diag(Gamma_C) - K_dec^T W) S_0 + K_dec^T U,   K_dec[j] = exp(G_C - G_j) * k_j

    Everything except the last line is computed for all chunks at once (batched matmuls and one
    batched triangular solve); a loop over chunks then carries the state with one
    ``baddbmm`` per chunk, and the outputs are formed afterwards from the stored states.
    Every exponent is <= 0 (``exp(G_r - G_j)`` is split at an intermediate index, see
    :func:`_intra_chunk_scores`), so arbitrarily strong decay (e.g. g = -5 on every step)
    cannot overflow.  Differentiable through autograd.

    Args:
        q, k: [B, T, H, K] (L2-normalised); v: [B, T, HV, V]; g: [B, T, HV, K] log-decay (<= 0);
        beta: [B, T, HV]; scale defaults to K**-0.5; initial_state: [B, HV, K, V] or None.
        chunk_size: C, a power of two (torch backend only; fla always uses 64).
        backend: "auto" (fla's Triton ``chunk_kda`` for CUDA tensors when it imports, else
            torch), "torch" (always the pure-PyTorch path) or "fla" (require fla).

    Returns:
        ``(o, final_state)`` as :func:`kda_recurrent`.
    """
    if backend not in ("auto", "torch", "fla"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'fla', got {backend!r}")
    K = q.shape[-1]
    if scale is None:
        scale = K**-0.5
    use_fla = False
    if backend == "fla":
        if _fla_chunk_kda() is None:
            raise RuntimeError("backend='fla' requested but fla.ops.kda.chunk_kda could not be imported")
        use_fla = True
    elif backend == "auto":
        use_fla = q.is_cuda and _fla_chunk_kda() is not None
    if use_fla:
        return _fla_chunk_kda()(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=False,
        )
    return _kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
