"""Inside one KDA chunk: the scores and the UT inverse that do not depend on the incoming state, and their backward.

:func:`intra_chunk` computes, for Z chunks of C tokens at once, A_qk, A_kk, T_inv = (I + Diag(beta) A_kk)^{-1} and
the decay products (the forward of :func:`k3core.ops.kda.chunk.kda_chunk`); :func:`intra_chunk_grad` is the
backward of the dyadic scores for the hand-written chunk backward (``chunk._KDAChunkFn``). Both tile the strictly
lower triangle dyadically (:func:`dyadic_index`) and split each decay at a reference row, so no factor exceeds 1.
"""

from __future__ import annotations

import functools

import torch

# exp() of arguments below about -87 gives fp32 subnormals or 0, which takes a slow path on CPU
# (10-40x slower).  The chunked path clamps per-step log-decays here first (only reachable with
# an unbounded gate such as Kimi Linear's): exp(-60) ~ 9e-27 instead of something smaller, far
# below fp32 resolution for any O(1) quantity it multiplies.
EXP_FLOOR = -60.0


def decay(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for a log-decay x <= 0, with x clamped at EXP_FLOOR (error < exp(-60))."""
    return torch.exp(x.clamp_min(EXP_FLOOR))


@functools.cache
def dyadic_index(C: int) -> tuple[int, ...]:
    """Flat gather map that assembles the C x C matrix A_qk from its dyadic blocks.

    The strictly lower triangle of a C x C matrix (C a power of two) is tiled exactly once by
    the blocks "right half x left half" of every dyadic interval: for block size s in
    1, 2, ..., C/2 and parent p in range(C // (2s)), rows p*2s + s + i by columns p*2s + j
    (0 <= i, j < s).  Entry (r, j), r > j, belongs to level s = 2**floor(log2(r ^ j)).

    :func:`intra_chunk` stores the values as ``[0, diag (C), level 1, level 2, ...]`` with level
    s a flattened [P, s, s] block tensor.  The returned map (length C*C, row-major) gathers the
    matrix from that vector; index 0 is the zero slot (upper triangle).
    """
    offsets = {}
    pos = 1 + C
    s = 1
    while s < C:
        offsets[s] = pos
        pos += (C // (2 * s)) * s * s
        s *= 2
    index = []
    for r in range(C):
        for j in range(C):
            if j > r:
                index.append(0)
            elif j == r:
                index.append(1 + r)
            else:
                s = 1 << ((r ^ j).bit_length() - 1)
                p, i, jj = r // (2 * s), r % s, j % s
                index.append(offsets[s] + (p * s + i) * s + jj)
    return tuple(index)


@functools.lru_cache(maxsize=16)
def _dyadic_index_tensor(C: int, device: torch.device) -> torch.Tensor:
    # A normal tensor even when first asked for under inference_mode (autograd saves it later).
    with torch.inference_mode(False):
        return torch.tensor(dyadic_index(C), device=device)


def intra_chunk(
    q: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, with_kk: bool = False
) -> tuple[torch.Tensor, ...]:
    """Everything inside a chunk that does not depend on the incoming state.

    Args:
        q, k: [Z, C, K] queries and keys of Z chunks of C tokens.
        alpha: [Z, C, K] per-step decays exp(g) in (0, 1].
        beta: [Z, C] write strengths.

    With G_r = g_1 + ... + g_r (within the chunk) returns ``(A_qk, T_inv, Gamma, Gamma_to_end)``::

        A_qk[r, j] = sum_c q[r, c] k[j, c] exp(G[r, c] - G[j, c])   for j <= r, else 0
        A_kk[r, j] = sum_c k[r, c] k[j, c] exp(G[r, c] - G[j, c])   for j <  r, else 0
        T_inv = (I + Diag(beta) A_kk)^{-1}    (unit lower triangular; A_kk itself is not formed)
        Gamma[r] = exp(G[r]),   Gamma_to_end[j] = exp(G[C] - G[j])

    Overflow: the naive factorisation exp(G_r) * exp(-G_j) overflows (exp(-G_j) reaches e^320
    at g = -5).  Instead exp(G_r - G_j), j < r, is split at a reference index m, j <= m < r,
    as exp(G_r - G_m) * exp(G_m - G_j): two factors <= 1.  The dyadic tiling of the lower
    triangle (see :func:`dyadic_index`) provides such an m for every block "right half x left
    half" of a dyadic interval (the last row of its left half), so each level s = 1, 2, ..., C/2
    is one batched matmul of decayed rows by decayed columns (~C^2 K / 2 multiply-adds per chunk
    over all levels).  The factors are prefix / suffix products of alpha built bottom-up over
    the same tree: one exp per token and channel, each factor a product of at most
    log2(C) + 1 terms, so it stays accurate to a few ulps however large the cumulative decay.

    The inverse follows the same tree: inv([[A, 0], [B, D]]) = [[A^-1, 0], [-D^-1 B A^-1, D^-1]],
    where at level s the block B is exactly that level's block of Diag(beta) A_kk.

    ``with_kk`` also returns A_kk itself (fifth, [Z, C, C], strictly lower), which the hand-written
    backward (:class:`_KDAChunkFn`) needs for d beta; the other outputs are bit-identical either way.
    """
    Z, C, K = alpha.shape
    # Without autograd the running products can be updated in place (saves a copy per level).
    inplace = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, alpha, beta)))
    pre = alpha.clone() if inplace else alpha  # at level s: inclusive prefix products in s-blocks
    suf = torch.ones_like(alpha)  # at level s: exclusive suffix products within s-blocks
    q_vals = [alpha.new_zeros(Z, 1), (q * k).sum(-1)]
    k_vals = [alpha.new_zeros(Z, 1 + C)] if with_kk else None
    inv = alpha.new_ones(Z, C, 1, 1)  # inverses of the 1 x 1 diagonal blocks
    s = 1
    while s < C:
        P = C // (2 * s)
        pre_b = pre.view(Z, P, 2, s, K)
        suf_b = suf.view(Z, P, 2, s, K)
        q_b = q.view(Z, P, 2, s, K)
        k_b = k.view(Z, P, 2, s, K)
        # rows r of the right half decayed back to m: exp(G_r - G_m) = pre_b[:, :, 1]
        row_decay = pre_b[:, :, 1]
        # keys j of the left half decayed forward to m: exp(G_m - G_j) = suf_b[:, :, 0]
        cols_t = (k_b[:, :, 0] * suf_b[:, :, 0]).transpose(-1, -2)  # [Z, P, K, s]
        blk_q = torch.matmul(q_b[:, :, 1] * row_decay, cols_t)  # [Z, P, s, s]
        blk_k = torch.matmul(k_b[:, :, 1] * row_decay, cols_t)
        q_vals.append(blk_q.reshape(Z, P * s * s))
        if with_kk:
            k_vals.append(blk_k.reshape(Z, P * s * s))
        # Inverse of the 2s x 2s diagonal blocks of I + Diag(beta) A_kk from the s x s ones.
        off = beta.view(Z, P, 2, s, 1)[:, :, 1] * blk_k
        inv_b = inv.view(Z, P, 2, s, s)
        a_inv, d_inv = inv_b[:, :, 0], inv_b[:, :, 1]
        x = torch.matmul(torch.matmul(d_inv, off), a_inv).neg_()
        inv = torch.cat([torch.cat([a_inv, torch.zeros_like(a_inv)], dim=-1), torch.cat([x, d_inv], dim=-1)], dim=-2)
        # Move to blocks of size 2s: the left half's suffix products take in the right half's
        # total, the right half's prefix products the left half's total.
        left_total, right_total = pre_b[:, :, 0, -1:], pre_b[:, :, 1, -1:]
        if inplace:
            suf_b[:, :, 0] *= right_total
            pre_b[:, :, 1] *= left_total
        else:
            suf = torch.stack([suf_b[:, :, 0] * right_total, suf_b[:, :, 1]], dim=2).view(Z, C, K)
            pre = torch.stack([pre_b[:, :, 0], pre_b[:, :, 1] * left_total], dim=2).view(Z, C, K)
        s *= 2
    index = _dyadic_index_tensor(C, alpha.device)
    A_qk = torch.cat(q_vals, dim=-1).index_select(-1, index).view(Z, C, C)
    if with_kk:
        A_kk = torch.cat(k_vals, dim=-1).index_select(-1, index).view(Z, C, C)
        return A_qk, inv.view(Z, C, C), pre, suf, A_kk
    return A_qk, inv.view(Z, C, C), pre, suf


@functools.lru_cache(maxsize=16)
def _dyadic_levels_index(C: int, device: torch.device) -> torch.Tensor:
    """Flat gather map from a row-major C x C matrix to its strictly lower dyadic blocks, level by level.

    The inverse of :func:`dyadic_index` on the strictly lower triangle: level s = 1, 2, ..., C/2 as a
    contiguous [P, s, s] block tensor (P = C / 2s; rows p*2s + s + i, columns p*2s + j), concatenated.
    """
    index = []
    s = 1
    while s < C:
        for p in range(C // (2 * s)):
            for i in range(s):
                for j in range(s):
                    index.append((p * 2 * s + s + i) * C + p * 2 * s + j)
        s *= 2
    with torch.inference_mode(False):
        return torch.tensor(index, device=device)


def _block_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for [..., m, s] x [..., s, n]; for s <= 2 as broadcast products (a batched matmul of
    thousands of 2 x 1 or 4 x 2 matrices is slower than one elementwise pass)."""
    if a.shape[-1] <= 2:
        return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)
    return torch.matmul(a, b)


def intra_chunk_grad(
    q: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor, dA_qk: torch.Tensor, dA_kk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the strictly lower parts of A_qk and A_kk (:func:`intra_chunk`) w.r.t. their factors.

    With ``E[r, j, c] = exp(G_r[c] - G_j[c])`` returns ``(dq_row, dk_row, dk_col, dg_A)``, the first three for fixed G::

        dq_row[r] = sum_{j<r} dA_qk[r, j] E[r, j] k_j,   dk_row[r] = sum_{j<r} dA_kk[r, j] E[r, j] k_j
        dk_col[j] = sum_{r>j} (dA_qk[r, j] q_r + dA_kk[r, j] k_r) E[r, j]

    and ``dg_A``, these scores' part of the gradient w.r.t. the per-step log-decays g_t.  A pair
    (r, j) with term x_rj = dA[r, j] sum_c a_r E k_j (a = q or k) depends on g_t exactly for
    j < t <= r, so within a level's block (rows R, columns L) dg_t, t in R, gets the reverse cumulative
    sum over r >= t of the row terms and dg_t, t in L, the exclusive cumulative sum over j < t of the
    column terms.  (Summing dG_r = q dq_row + k dk_row - k dk_col in reverse instead cancels terms
    of pairs beyond t: fp32 errors of ~C ulps relative, measured 3.5e-5 at C = 64.)  Same dyadic
    tiling and split decays as the forward (no positive exponent); both scores' blocks are gathered
    once, level by level.
    """
    Z, C, K = alpha.shape
    pre, suf = alpha.clone(), torch.ones_like(alpha)
    dq_row, dk_row, dk_col = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(k)
    dg_A = torch.zeros_like(q)
    qk = torch.stack([q, k], dim=1)  # [Z, 2, C, K]
    # torch.gather, not index_select: along the last dim it measured 2.4x faster here (0.97 vs 2.30 ms at Z = 128)
    index = _dyadic_levels_index(C, q.device)
    blocks = torch.stack([dA_qk, dA_kk], dim=1).view(Z, 2, C * C)
    blocks = blocks.gather(-1, index.expand(Z, 2, index.numel()))
    pos = 0
    s = 1
    while s < C:
        P = C // (2 * s)
        g_b = blocks[..., pos : pos + P * s * s].view(Z, 2, P, s, s)  # [score, block, row i, column j]
        pos += P * s * s
        pre_b, suf_b = pre.view(Z, P, 2, s, K), suf.view(Z, P, 2, s, K)
        row_decay = pre_b[:, :, 1]
        col_decay = suf_b[:, :, 0]
        cols = (k.view(Z, P, 2, s, K)[:, :, 0] * col_decay).unsqueeze(1)  # [Z, 1, P, s, K]
        rows = _block_matmul(g_b, cols) * row_decay.unsqueeze(1)  # [Z, 2, P, s, K]
        dq_row.view(Z, P, 2, s, K)[:, :, 1] += rows[:, 0]
        dk_row.view(Z, P, 2, s, K)[:, :, 1] += rows[:, 1]
        qk_right = qk.view(Z, 2, P, 2, s, K)[:, :, :, 1]
        r_side = qk_right * row_decay.unsqueeze(1)  # [Z, 2, P, s, K]
        col = _block_matmul(g_b.transpose(-1, -2), r_side).sum(1) * col_decay
        dk_col.view(Z, P, 2, s, K)[:, :, 0] += col
        dg_b = dg_A.view(Z, P, 2, s, K)
        dg_b[:, :, 1] += (qk_right * rows).sum(1).flip(-2).cumsum(-2).flip(-2)
        if s > 1:
            dg_b[:, :, 0, 1:] += (k.view(Z, P, 2, s, K)[:, :, 0, :-1] * col[:, :, :-1]).cumsum(-2)
        left_total, right_total = pre_b[:, :, 0, -1:], pre_b[:, :, 1, -1:]
        suf_b[:, :, 0] *= right_total
        pre_b[:, :, 1] *= left_total
        s *= 2
    return dq_row, dk_row, dk_col, dg_A
