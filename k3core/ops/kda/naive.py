"""KDA's recurrent form: :func:`kda_step` (one decoding step, the single definition of the
recurrence) and :func:`kda_recurrent` (loops it over time; the reference every fast path is tested
against), plus the input checks and dtype rules the chunked form (``k3core.ops.kda.chunk``) shares.

Layouts, math and dtype rules: ``k3core.ops.kda``.
"""

from __future__ import annotations

import torch

__all__ = ["kda_step", "kda_recurrent"]

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 if any given tensor is fp64, else fp32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def check_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int]:
    """The sizes (B, T, H, K, HV, V) of a KDA call, after checking every input's shape against them."""
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


def expand_heads(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
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
    dt = compute_dtype(q, k, v, g, beta, state)
    groups = HV // H
    qf = expand_heads(q.to(dt), groups, 1) * scale
    kf = expand_heads(k.to(dt), groups, 1)
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
    B, T, H, K, HV, V = check_shapes(q, k, v, g, beta, initial_state)
    if scale is None:
        scale = K**-0.5
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    groups = HV // H
    qf = expand_heads(q.to(dt), groups, 2) * scale
    kf = expand_heads(k.to(dt), groups, 2)
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
