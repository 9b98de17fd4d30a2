"""Attention statistics over every position, from q and k in query blocks (never a T x T matrix).

The recorder (``k3core.trace``) calls ``blocked_attention_stats`` on an MLA layer's q and k; it does not use the
layer's own attention (which may be a fused kernel that never forms probabilities). For query ``i`` and the keys
``j`` it sees (causal ``j <= i``, or a written key mask), with scores ``s_ij = q_i . k_j * scale``:

    p_ij          = exp(s_ij - lse_i),   lse_i = log sum_j exp(s_ij)
    entropy_i     = -sum_j p_ij log p_ij,  log p_ij = s_ij - lse_i          (nats; 0 for a query seeing no key)
    sink_i        = p_i0                                                    (attention on the first token)
    received_j    = sum_i p_ij                                              (column sum: attention key j receives)

computed per (sequence, head) over blocks of ``block`` queries: one [block, keys] score slab at a time, so memory
is O(block x T) while the work stays O(T^2) like the attention itself. A query window (``window=(start, stop)``)
also returns that diagonal block of the probability map, ``p_ij`` for ``start <= i, j < stop`` (rows normalised
over all visible keys, so they sum to 1 only when ``start == 0``).
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK = 128


def position_bins(T: int) -> list[int]:
    """Edges of the position bins of a T-token text: 0, 16, 32, 64, ... (powers of two below T), then T.

    Bin ``b`` holds positions ``edges[b] <= t < edges[b + 1]``; doubling widths suit a log-position axis.
    """
    if T < 1:
        raise ValueError(f"a text has at least one token, got T={T}")
    edges, edge = [0], 16
    while edge < T:
        edges.append(edge)
        edge *= 2
    return [*edges, int(T)]


def _visible_slab(visible: torch.Tensor | None, b: int, h: int, start: int, stop: int, device) -> torch.Tensor:
    """[stop - start, stop] bool: which keys 0..stop-1 queries start..stop-1 see (causal without a mask);
    ``visible`` is None or already broadcast to [B, H, T, T] (a view, no copy)."""
    if visible is None:
        queries = torch.arange(start, stop, device=device)[:, None]
        return torch.arange(stop, device=device)[None, :] <= queries
    return visible[b, h, start:stop, :stop].to(device)


@torch.no_grad()
def blocked_attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    window: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Entropy, sink mass and received attention of every query/key (formulas in the module docstring), fp32.

    q, k: [B, H, T, d] (same T: prefill); visible: None (causal) or a bool mask [T, T] / broadcastable to
    [B, H, T, T] (True = seen). Returns {"entropy": [B, H, T], "sink": [B, H, T], "received": [B, H, T]} and,
    with ``window``, "map": [B, H, stop - start, stop - start].
    """
    B, H, T, _ = q.shape
    if k.shape[:3] != (B, H, T):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, head and length")
    entropy = torch.zeros(B, H, T, dtype=torch.float32)
    sink = torch.zeros(B, H, T, dtype=torch.float32)
    received = torch.zeros(B, H, T, dtype=torch.float64)
    out: dict[str, torch.Tensor] = {}
    if visible is not None:
        visible = visible.to(torch.bool).expand(B, H, T, T)
    if window is not None:
        w0, w1 = max(0, int(window[0])), min(T, int(window[1]))
        attn_map = torch.zeros(B, H, max(0, w1 - w0), max(0, w1 - w0), dtype=torch.float32)
    for b in range(B):
        for h in range(H):
            qh, kh = q[b, h].float(), k[b, h].float()
            for start in range(0, T, block):
                stop = min(T, start + block)
                scores = (qh[start:stop] @ kh[:stop].T) * scale  # [n, stop]
                seen = _visible_slab(visible, b, h, start, stop, scores.device)
                scores = scores.masked_fill(~seen, float("-inf"))
                lse = torch.logsumexp(scores, dim=-1)  # -inf for a query that sees no key
                # log p per entry, not lse - sum p s: that difference of two large numbers loses fp32 digits
                log_probs = (scores - lse[:, None]).masked_fill_(~seen, 0.0)
                probs = torch.exp(log_probs).masked_fill_(~seen, 0.0)
                entropy[b, h, start:stop] = -(probs * log_probs).sum(-1).cpu()
                sink[b, h, start:stop] = probs[:, 0].cpu()
                received[b, h, :stop] += probs.sum(0).double().cpu()
                if window is not None and start < w1 and stop > w0:
                    r0, r1 = max(start, w0), min(stop, w1)
                    attn_map[b, h, r0 - w0 : r1 - w0, : r1 - w0] = probs[r0 - start : r1 - start, w0:r1].cpu()
    out.update(entropy=entropy, sink=sink, received=received.float())
    if window is not None:
        out["map"] = attn_map
    return out
