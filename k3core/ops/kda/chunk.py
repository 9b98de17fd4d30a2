"""KDA's chunked form: :func:`kda_chunk` (the WY / UT-transform algorithm in pure PyTorch, or fla's
Triton kernel on CUDA when it is installed) and :func:`kda_chunk_end_states` (the state at every chunk
end, an independent reference for the states ``kda_chunk(output_chunk_states=True)`` returns).

Same inputs, outputs and math as :func:`k3core.ops.kda.naive.kda_recurrent`; layouts and dtype
rules: ``k3core.ops.kda``.
"""

from __future__ import annotations

import functools
import math

import torch

from .intra_chunk import EXP_FLOOR, decay, intra_chunk, intra_chunk_grad
from .naive import check_shapes, compute_dtype, expand_heads

__all__ = ["kda_chunk", "kda_chunk_end_states"]


# Chunks are processed in groups of about this many floats per [group, C, K] temporary.
_GROUP_ELEMENTS = 1 << 18


def _to_chunks(x: torch.Tensor, dt: torch.dtype, C: int) -> torch.Tensor:
    """[B, T, h, ...] -> new time-major buffer [N, B, h, C, ...] in dtype dt (N = ceil(T / C)).

    The tail of the last chunk is zero-filled.
    """
    B, T, h = x.shape[:3]
    rest = x.shape[3:]
    N = max(1, math.ceil(T / C))
    out = x.new_empty(N, B, h, C, *rest, dtype=dt)
    dims = (1, 0, 3, 2, *range(4, 4 + len(rest)))
    out_bt = out.permute(dims)  # [B, N, C, h, ...] view
    full = T // C
    if full:
        out_bt[:, :full].copy_(x[:, : full * C].reshape(B, full, C, h, *rest))
    if full < N:
        out_bt[:, full, : T - full * C].copy_(x[:, full * C :])
        out_bt[:, full, T - full * C :].zero_()
    return out


def _chunk_loop(qc, kc, vc, gc, bc, state, scale, C, output_chunk_states, real_chunks, save=False):
    """The chunked forward on time-major chunks [N, BH, C, D] (see :func:`_kda_chunk_torch`).

    ``real_chunks``: chunks holding at least one real token (N is 1 even when T == 0).
    Returns ``(o [N * BH, C, V], final state, chunk-end states, saved)``; with ``save`` ``saved`` is
    ``(A_qk, T_inv, A_kk, Gamma, Gamma_to_end, D, S_in)`` over all chunks (S_in [N, BH, K, V]: the
    state entering each chunk) for :class:`_KDAChunkFn`'s backward, else None.
    """
    N, BH, _, K = qc.shape
    V = vc.shape[-1]
    saved, s_in = [], []
    # Stream over groups of consecutive chunks (all sequences and heads at once), sized so that a
    # group's temporaries stay cache-sized (about _GROUP_ELEMENTS floats per [group, C, K] tensor):
    # per-chunk work batched over the group, then the state loop, then the group's outputs.
    group = max(1, _GROUP_ELEMENTS // (BH * C * max(K, V)))
    outs, ends = [], []
    for n0 in range(0, N, group):
        n1 = min(N, n0 + group)
        q_z, k_z = qc[n0:n1].view(-1, C, K), kc[n0:n1].view(-1, C, K)
        b_z = bc[n0:n1].view(-1, C)
        # Intra-chunk scores and UT transform; Gamma = exp(G), Gamma_to_end = exp(G_C - G).
        A_qk, t_inv, gamma, gamma_to_end, *A_kk = intra_chunk(
            q_z, k_z, decay(gc[n0:n1].view(-1, C, K)), b_z, with_kk=save
        )
        # T_beta = (I + Diag(beta) A_kk)^{-1} Diag(beta);  U = T_beta V,  W = T_beta (Gamma * K).
        t_beta = t_inv * b_z.unsqueeze(-2)
        U = torch.bmm(t_beta, vc[n0:n1].view(-1, C, V)).view(n1 - n0, BH, C, V)
        # [W ; Gamma * Q]: one matmul with the entering state gives both W S and (Gamma * Q) S.
        WQ = torch.cat([torch.bmm(t_beta, k_z * gamma), q_z * gamma], dim=-2).view(n1 - n0, BH, 2 * C, K)
        k_dec = (k_z * gamma_to_end).view(n1 - n0, BH, C, K)  # keys decayed to the chunk end
        gamma_end = gamma[:, -1, :].view(n1 - n0, BH, K, 1)  # decay over the whole chunk

        # State passing, one chunk at a time:  D = U - W S  (= beta (v - prediction) per token),
        # S_next = Diag(gamma_end) S + K_dec^T D; the inter-chunk output part (Gamma * Q) S on the way.
        inter, deltas = [], []
        for i in range(n1 - n0):
            if save:
                s_in.append(state)
            WQS = torch.bmm(WQ[i], state)  # [BH, 2C, V]
            delta = U[i] - WQS[:, :C]
            inter.append(WQS[:, C:])
            deltas.append(delta)
            state = torch.baddbmm(state * gamma_end[i], k_dec[i].transpose(-1, -2), delta)
            if output_chunk_states and n0 + i < real_chunks:
                ends.append(state)
        D = torch.stack(deltas).view(-1, C, V)
        if save:
            saved.append((A_qk, t_inv, A_kk[0], gamma, gamma_to_end, D))

        # Outputs: O = scale * ((Gamma * Q) S_in + A_qk D).
        outs.append(torch.baddbmm(torch.stack(inter).view(-1, C, V), A_qk, D, beta=scale, alpha=scale))

    o = torch.cat(outs) if len(outs) > 1 else outs[0]  # [N * BH, C, V]
    if save:
        parts = [torch.cat(x) if len(saved) > 1 else x[0] for x in zip(*saved)]
        return o, state, ends, (*parts, torch.stack(s_in))
    return o, state, ends, None


class _KDAChunkFn(torch.autograd.Function):
    """Chunked KDA with a hand-written chunked backward, on time-major chunks [N, BH, C, D].

    Forward: :func:`_chunk_loop` (the same ops as the autograd path, so outputs are bit-identical),
    keeping A_qk, A_kk, T_inv, Gamma, Gamma_to_end, D and the state entering each chunk.  Backward
    (notation of :func:`kda_chunk`), with dO' = s dO and dS' the gradient of the state leaving a chunk:

        dD = A_qk^T dO' + K_dec dS',    dS_in = (Gamma Q)^T dO' + Diag(Gamma_C) dS' - W^T dD

    is the only sequential part (two matmuls per chunk, in reverse); everything else is batched over
    all chunks: d(Gamma Q) = dO' S_in^T, dW = -dD S_in^T, dK_dec = D dS'^T, then through
    U = T Diag(beta) V, W = T Diag(beta) (Gamma K), T = M^{-1} (dM = -T^T dT T^T, strictly lower),
    M = I + Diag(beta) A_kk, A_qk / A_kk (:func:`intra_chunk_grad`, which also gives the scores' part of dg),
    and finally the decay products' part of dg (cumulative sums within a chunk; zero where the exp floor clamps g).
    """

    @staticmethod
    def forward(ctx, qc, kc, vc, gc, bc, state0, scale, C):
        N = qc.shape[0]
        o, state, _, saved = _chunk_loop(qc, kc, vc, gc, bc, state0, scale, C, False, N, save=True)
        ctx.save_for_backward(qc, kc, vc, gc, bc, *saved)
        ctx.scale = scale
        return o, state

    @staticmethod
    def backward(ctx, d_o, d_final):
        qc, kc, vc, gc, bc, A_qk, t_inv, A_kk, gamma, gamma_to_end, D, s_in = ctx.saved_tensors
        N, BH, C, K = qc.shape
        V = vc.shape[-1]
        Z = N * BH
        q, k, v, b = qc.reshape(Z, C, K), kc.reshape(Z, C, K), vc.reshape(Z, C, V), bc.reshape(Z, C)
        dO = d_o.reshape(Z, C, V) * ctx.scale
        gq, gk = q * gamma, k * gamma
        k_dec = k * gamma_to_end
        t_beta = t_inv * b.unsqueeze(-2)
        W = torch.bmm(t_beta, gk)
        gamma_end = gamma[:, -1, :].view(N, BH, K, 1)

        # Sequential part: the state gradient, chunk by chunk in reverse.
        P = torch.bmm(A_qk.transpose(-1, -2), dO).view(N, BH, C, V)
        R = torch.bmm(gq.transpose(-1, -2), dO).view(N, BH, K, V)
        k_dec_n, W_n = k_dec.view(N, BH, C, K), W.view(N, BH, C, K)
        dS = torch.zeros_like(s_in[0]) if d_final is None else d_final.to(s_in.dtype)
        dDs, dSs = [None] * N, [None] * N
        for i in range(N - 1, -1, -1):
            dSs[i] = dS
            dD_i = torch.baddbmm(P[i], k_dec_n[i], dS)
            dS = torch.baddbmm(R[i] + gamma_end[i] * dS, W_n[i].transpose(-1, -2), dD_i, alpha=-1)
            dDs[i] = dD_i
        dD = torch.stack(dDs).view(Z, C, V)
        dS_out = torch.stack(dSs).view(Z, K, V)
        S = s_in.view(Z, K, V)

        # Batched over all chunks.
        dA_qk = torch.bmm(dO, D.transpose(-1, -2)).tril_()
        dgq = torch.bmm(dO, S.transpose(-1, -2))  # d(Gamma Q)
        dW = torch.bmm(dD, S.transpose(-1, -2)).neg_()
        dk_dec = torch.bmm(D, dS_out.transpose(-1, -2))
        dgamma_end = (S * dS_out).sum(-1)  # [Z, K]
        # U = T (beta V), W = T (beta Gamma K):  with Y = [V, Gamma K] and dX = T^T [dD, dW],
        # d(beta Y) = dX and T^T dT = dX (beta Y)^T, so dM = -T^T dT T^T = -dX (beta Y)^T T^T.
        Y = torch.cat([v, gk], dim=-1)
        bY = Y * b.unsqueeze(-1)
        dX = torch.bmm(t_inv.transpose(-1, -2), torch.cat([dD, dW], dim=-1))
        dY = dX * b.unsqueeze(-1)
        dv, dgk = dY[..., :V], dY[..., V:]
        db = (Y * dX).sum(-1)
        dM = torch.bmm(torch.bmm(dX, bY.transpose(-1, -2)), t_inv.transpose(-1, -2)).neg_().tril_(-1)
        db += (dM * A_kk).sum(-1)
        dA_kk = dM * b.unsqueeze(-1)

        dq_row, dk_row, dk_col, dg_A = intra_chunk_grad(q, k, decay(gc.reshape(Z, C, K)), dA_qk, dA_kk)
        diag = dA_qk.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)  # A_qk[r, r] = q_r . k_r
        dq = dgq * gamma + dq_row + diag * k
        dk = dgk * gamma + dk_dec * gamma_to_end + dk_row + dk_col + diag * q
        # Gradient w.r.t. g_t (every factor is exp of a difference of G's, G_r = g_1 + ... + g_r):
        # Gamma_r depends on g_t for t <= r (reverse cumulative sum), Gamma_C on every g_t,
        # Gamma_to_end[j] = exp(G_C - G_j) for j < t (exclusive cumulative sum; no cancelling terms).
        dg = (gq * dgq + gk * dgk).flip(1).cumsum(1).flip(1) + dg_A
        dg += (gamma[:, -1] * dgamma_end).unsqueeze(1)
        dg[:, 1:] += (k_dec * dk_dec)[:, :-1].cumsum(1)
        dg *= gc.reshape(Z, C, K) >= EXP_FLOOR
        dstate0 = dS if ctx.needs_input_grad[5] else None
        return (
            dq.view(N, BH, C, K),
            dk.view(N, BH, C, K),
            dv.view(N, BH, C, V),
            dg.view(N, BH, C, K),
            db.view(N, BH, C),
            dstate0,
            None,
            None,
        )


def _kda_chunk_torch(
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    chunk_size,
    output_chunk_states=False,
    hand_backward=True,
):
    """Pure-PyTorch chunked KDA (see :func:`kda_chunk` for the math, ``output_chunk_states`` and ``hand_backward``)."""
    B, T, H, K, HV, V = check_shapes(q, k, v, g, beta, initial_state)
    C = chunk_size
    if C < 1 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two, got {C}")
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    N = max(1, math.ceil(T / C))
    BH = B * HV

    # Time-major chunked copies [N, B*HV, C, D]: chunk n of every sequence and head side by side,
    # so that a range of n is one contiguous block.  Padded tokens (k = 0, beta = 0, g = 0) leave
    # the state as it is.
    qc = expand_heads(_to_chunks(q, dt, C), HV // H, 2).view(N, BH, C, K)
    kc = expand_heads(_to_chunks(k, dt, C), HV // H, 2).view(N, BH, C, K)
    vc = _to_chunks(v, dt, C).view(N, BH, C, V)
    gc = _to_chunks(g, dt, C).view(N, BH, C, K)
    bc = _to_chunks(beta, dt, C).view(N, BH, C)

    if initial_state is None:
        state = vc.new_zeros(BH, K, V)
    else:
        state = initial_state.to(dt).reshape(BH, K, V)

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)
    )
    if needs_grad and hand_backward and not output_chunk_states:
        # Hand-written chunked backward (about 2x the forward instead of autograd's ~4x over
        # hundreds of small kernels); the forward inside is the same _chunk_loop.
        o, state = _KDAChunkFn.apply(qc, kc, vc, gc, bc, state, scale, C)
        ends = []
    else:
        o, state, ends, _ = _chunk_loop(qc, kc, vc, gc, bc, state, scale, C, output_chunk_states, math.ceil(T / C))
    o = o.view(N, B, HV, C, V).permute(1, 0, 3, 2, 4).reshape(B, N * C, HV, V)[:, :T]
    o = o.to(v.dtype).contiguous()
    final = state.view(B, HV, K, V) if output_final_state else None
    if output_chunk_states:
        states = torch.stack(ends, 1).view(B, HV, len(ends), K, V).transpose(1, 2) if ends else o.new_zeros(
            B, 0, HV, K, V, dtype=dt
        )  # fmt: skip
        return o, final, states
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
    chunk_size: int = 32,
    backend: str = "auto",
    output_chunk_states: bool = False,
    hand_backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Chunked KDA: same inputs, outputs and math as :func:`kda_recurrent`, but parallel in time.

    Split time into chunks of C tokens (the tail is zero-padded internally).  Within a chunk let
    ``G_r = g_1 + ... + g_r`` (cumulative log-decay, per key channel), ``Gamma_r = exp(G_r)`` and
    ``S_0`` the state entering the chunk.  Writing ``d_r = beta_r (v_r - (D_r S_{r-1})^T k_r)``
    the recurrence unrolls to::

        S_r = Diag(Gamma_r) S_0 + sum_{j<=r} Diag(Gamma_r / Gamma_j) k_j d_j^T
        d_r + beta_r sum_{j<r} A_kk[r, j] d_j = beta_r v_r - beta_r S_0^T (Gamma_r * k_r)

    with ``A_kk[r, j] = k_r^T Diag(exp(G_r - G_j)) k_j``.  So with the unit lower-triangular
    ``M = I + Diag(beta) A_kk`` (the UT transform / WY representation)::

        U = M^{-1} Diag(beta) V,   W = M^{-1} Diag(beta) (Gamma * K)       (per chunk, no state)
        D = U - W S_0                                                     (the rows d_r)
        S_C = Diag(Gamma_C) S_0 + K_dec^T D,   K_dec[j] = exp(G_C - G_j) * k_j
        O = s ((Gamma * Q) S_0 + A_qk D),     A_qk[r, j] = q_r^T Diag(exp(G_r - G_j)) k_j, j <= r

    U, W, K_dec and A_qk do not depend on the state: they are computed with batched matmuls for
    a group of consecutive chunks at once (all sequences and heads; groups sized to stay in
    cache), M^{-1} by a batched dyadic block inversion.  A loop over the group's chunks then
    carries the state with two matmuls per chunk (``[W; Gamma Q] S_0`` and the state update),
    and the group's outputs follow in one batched matmul.  No exponent is ever positive:
    ``exp(G_r - G_j)`` is split at an intermediate index and built from products of per-step
    decays (see :func:`intra_chunk`), so arbitrarily strong decay (g = -5 on every step, or far
    below) cannot overflow.  Differentiable (gradients match :func:`kda_recurrent`): on the torch
    path with a hand-written chunked backward (:class:`_KDAChunkFn`), through autograd when
    ``output_chunk_states`` is asked for.

    Args:
        q, k: [B, T, H, K] (L2-normalised); v: [B, T, HV, V]; g: [B, T, HV, K] log-decay (<= 0);
        beta: [B, T, HV]; scale defaults to K**-0.5; initial_state: [B, HV, K, V] or None.
        chunk_size: C, a power of two (torch backend only; fla always uses 64).  The default 32
            measured about 10% faster than 64 on a 2-core CPU (benchmarks/bench_kda.py).
        backend: "auto" (fla's Triton ``chunk_kda`` for non-fp64 CUDA tensors when it imports,
            else torch), "torch" (always the pure-PyTorch path) or "fla" (require fla).
        output_chunk_states: also return the state at the end of each chunk n = 0 .. ceil(T / C) - 1,
            S after tokens [0, min((n + 1) C, T)), as [B, N, HV, K, V]: on the torch path the state loop's
            own states (compute dtype), on the fla path :func:`kda_chunk_end_states` after the kernel (fp32),
            so recording on a GPU keeps the fast kernel.
        hand_backward: on the torch path, differentiate with the hand-written chunked backward
            (:class:`_KDAChunkFn`, the default); False runs autograd over the same forward ops (the
            reference the tests and ``benchmarks/bench_kda_ratio.py`` compare it with).

    Returns:
        ``(o, final_state)`` as :func:`kda_recurrent`; ``(o, final_state, chunk_states)`` with
        ``output_chunk_states``.
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
        # fp64 stays on the torch path (reference precision; the Triton kernels target 16/32-bit)
        use_fla = q.is_cuda and v.dtype != torch.float64 and _fla_chunk_kda() is not None
    if use_fla:
        o, final = _fla_chunk_kda()(
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
        if output_chunk_states:
            return o, final, kda_chunk_end_states(q, k, v, g, beta, initial_state, chunk_size)[0]
        return o, final
    return _kda_chunk_torch(
        q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, output_chunk_states, hand_backward
    )


def kda_chunk_end_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 32,
) -> tuple[torch.Tensor, list[int]]:
    """The state S at every chunk end, [B, N, HV, K, V] fp32, and the token position of each (one
    batched :func:`kda_chunk` call): an independent reference for the states ``kda_chunk`` returns with
    ``output_chunk_states`` (tests/k3core/ops/test_kda_chunk_state.py), and those states on the fla path.

    Within a chunk the state map is affine: S_end = A_n S_start + B_n (A_n: K x K). Running every chunk
    independently (chunks as batch) with values [v | 0] and initial state [0 | I] gives [B_n | A_n] as
    the final state, since value columns evolve independently. Then S_n = A_n S_{n-1} + B_n is one small
    matmul per chunk. (Zero padding of the last chunk, k = beta = g = 0, is the identity.)
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def as_chunks(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(B * N, C, *x.shape[2:])

    v_aug = torch.cat([v.float(), v.new_zeros(B, T, HV, K, dtype=torch.float32)], dim=-1)
    eye = torch.eye(K, device=q.device).expand(B * N, HV, K, K)
    start = torch.cat([eye.new_zeros(B * N, HV, K, V), eye], dim=-1)
    _, end = kda_chunk(
        as_chunks(q),
        as_chunks(k),
        as_chunks(v_aug),
        as_chunks(g),
        as_chunks(beta),
        initial_state=start,
        output_final_state=True,
        chunk_size=C,
    )
    end = end.float().view(B, N, HV, K, V + K)
    inject, trans = end[..., :V], end[..., V:]
    state = q.new_zeros(B, HV, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    states = []
    for n in range(N):
        state = torch.matmul(trans[:, n], state) + inject[:, n]
        states.append(state)
    return torch.stack(states, 1), [min((n + 1) * C, T) for n in range(N)]
