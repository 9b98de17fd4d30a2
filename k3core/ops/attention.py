"""Softmax attention in O(T) memory for any q/k and v head dims (MLA: nope + rope != v), with its naive reference.

    out[t] = sum_s softmax_s(q_t . k_s * scale over the keys t may see) v_s      (zero where t sees no key)

Which keys a query sees: causal by default (query t, at absolute position ``past + t``, sees keys 0..past + t),
or an explicit boolean ``mask`` [..., T, S] (True = visible; broadcast over batch and heads), or the causal rows
of each query block as changed by ``mask_rows(start, stop, rows)`` (a written key mask: never more than
[block, S] of it at once).

Why this exists: PyTorch's fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``) and the CUDA
flash kernel need one head dim for q, k and v; MLA's v is narrower than its q/k (32 vs 48 in the samples,
128 vs 192 in Kimi Linear / K3), so SDPA falls back to its math path, which materialises [B, H, T, S] scores
and probabilities (quadratic memory, 63% of the sample's forward at T=4096). Zero-padding the narrower side
changes nothing: zero columns of v give zero output columns (sliced off); zero columns of q and k add 0 to
q . k. Then:

- causal with no past (prefill, training): one fused SDPA call with ``is_causal`` (O(T) memory);
- everything else (cached decoding with a past, a mask, ``mask_rows``): query blocks of ``block`` rows, each an
  SDPA call with its [block, S] boolean mask, so at most block x S mask and (if a backend still falls back
  to math) score entries exist at once: O(T) memory for a fixed block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

QUERY_BLOCK = 1024  # rows per masked SDPA call: block x S bytes of mask per call (64 MB at S = 64K)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    past: int = 0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The naive form (materialises [..., T, S], in fp32): q [B, H, T, dqk], k [B, H, S, dqk], v [B, H, S, dv]."""
    T, S = q.shape[-2], k.shape[-2]
    visible = _causal(T, S, past, q.device) if mask is None else mask.to(torch.bool)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    seen = visible.any(-1, keepdim=True)
    probs = torch.where(seen, scores, torch.zeros_like(scores)).softmax(-1) * seen
    return (probs @ v.float()).to(v.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    past: int = 0,
    mask: torch.Tensor | None = None,
    block: int = QUERY_BLOCK,
    mask_rows: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """attention_reference in O(T) memory on fused SDPA kernels; same shapes in and out, v's head dim out.

    ``mask_rows(start, stop, rows)``: for each query block [start, stop), the visible keys of those queries
    ([..., stop - start, S] bool; given the causal rows [stop - start, S]); exactly ``attention`` with the
    [T, S] mask those rows stack to, never holding it."""
    T, S = q.shape[-2], k.shape[-2]
    if mask is not None and mask_rows is not None:
        raise ValueError("give mask or mask_rows, not both")
    if mask is None and past + T != S:
        raise ValueError(f"causal attention needs past + T == S keys, got past={past}, T={T}, S={S}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    dv = v.shape[-1]
    q, k, v = _common_head_dim(q, k, v)
    if mask_rows is not None:
        out = torch.cat(
            [
                _masked_block(
                    q, k, v, scale, past, mask_rows(i, stop, _causal(stop - i, S, past + i, q.device)), i, stop
                )
                for i, stop in ((i, min(i + block, T)) for i in range(0, T, block))
            ],
            -2,
        )
    elif mask is None and past == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif mask is None and T == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)  # one new token sees every key
    else:
        out = torch.cat(
            [_masked_block(q, k, v, scale, past, _rows(mask, i, min(i + block, T)), i, min(i + block, T))
             for i in range(0, T, block)], -2
        )  # fmt: skip
    return out[..., :dv] if out.shape[-1] != dv else out


def _rows(mask, start, stop):
    """The rows of queries start..stop-1 of a [..., T, S] mask (one row broadcasts), or None."""
    if mask is None:
        return None
    return mask[..., start:stop, :] if mask.shape[-2] != 1 else mask


def _masked_block(q, k, v, scale, past, rows, start, stop):
    """Queries start..stop-1 against the keys they may see: ``rows`` [..., stop - start, S] (None: causal, where
    only keys 0..past + stop - 1 exist for them)."""
    if rows is None:
        end = past + stop
        visible = _causal(stop - start, end, past + start, q.device)
        return F.scaled_dot_product_attention(
            q[..., start:stop, :], k[..., :end, :], v[..., :end, :], attn_mask=visible, scale=scale
        )
    rows = rows.to(torch.bool)
    seen = rows.any(-1, keepdim=True)
    safe = rows | ~seen  # a row that sees no key attends everywhere, then is zeroed (not NaN)
    out = F.scaled_dot_product_attention(q[..., start:stop, :], k, v, attn_mask=safe, scale=scale)
    return out if bool(seen.all()) else out.masked_fill(~seen, 0.0)


def _causal(T: int, S: int, past: int, device) -> torch.Tensor:
    """[T, S] bool: query t (absolute position past + t) sees keys 0..past + t."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=past)


def _common_head_dim(q, k, v):
    """Zero-pad q/k or v on the last dim to one head dim (exact: see the module docstring)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:
        v = F.pad(v, (0, dqk - dv))
    elif dqk < dv:
        q, k = F.pad(q, (0, dv - dqk)), F.pad(k, (0, dv - dqk))
    return q, k, v
