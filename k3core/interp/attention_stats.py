"""Attention statistics over every position, from q and k in query blocks (never a T x T matrix).

The recorder (``k3core.interp.layer_reads``) calls ``blocked_attention_stats`` on an MLA layer's q and k; it does not
use the layer's own attention (which may be a fused kernel that never forms probabilities). For query ``i`` and the
keys ``j`` it sees (causal ``j <= i``, or a written key mask), with scores ``s_ij = q_i . k_j * scale``:

    p_ij          = w_ij / z_i,  w_ij = exp(s'_ij),  s'_ij = s_ij - max_j s_ij,  z_i = sum_j w_ij
    entropy_i     = -sum_j p_ij log p_ij = log z_i - sum_j w_ij s'_ij / z_i  (nats; 0 for a query seeing no key)
    sink_i        = p_i0                                                    (attention on the first token)
    received_j    = sum_i p_ij                                              (column sum: attention key j receives)

computed per (sequence, head) over blocks of ``block`` queries: one [block, keys] score slab (and its weights) at a
time, so memory is O(block x T) while the work stays O(T^2) like the attention itself. A query window
(``window=(start, stop)``) also returns that diagonal block of the probability map, ``p_ij`` for
``start <= i, j < stop`` (rows normalised over all visible keys, so they sum to 1 only when ``start == 0``).
``attention_probabilities`` is the fp32 reference: the whole [T, S] probability matrix, which the tests compare the
blocked statistics against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DEFAULT_BLOCK = 256  # [256, T] fp32 slabs: 64 MB each at 64K tokens; 128 was 20% slower
_HIDDEN = torch.finfo(torch.float32).min  # a hidden key's score: finite, so 0 x score stays 0 (not NaN)


def position_bins(T: int, first: int = 16) -> list[int]:
    """Edges of the position bins of a T-token text: 0, 16, 32, 64, ... (``first`` doubling, below T), then T.

    Bin ``b`` holds positions ``edges[b] <= t < edges[b + 1]``; doubling widths suit a log-position axis.
    """
    if T < 1:
        raise ValueError(f"a text has at least one token, got T={T}")
    edges, edge = [0], first
    while edge < T:
        edges.append(edge)
        edge *= 2
    return [*edges, int(T)]


@torch.no_grad()
def blocked_attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    visible: torch.Tensor | Callable[[int, int], torch.Tensor] | None = None,
    block: int = DEFAULT_BLOCK,
    window: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Entropy, sink mass and received attention of every query/key (formulas in the module docstring), fp32.

    q, k: [B, H, T, d] (same T: prefill); visible: None (causal), a bool mask [T, T] / broadcastable to
    [B, H, T, T] (True = seen), or ``visible(start, stop)`` giving the rows of queries [start, stop) of such a
    mask (a key mask held per query block). Returns {"entropy": [B, H, T], "sink": [B, H, T], "received":
    [B, H, T]} and, with ``window``, "map": [B, H, stop - start, stop - start].
    """
    B, H, T, _ = q.shape
    if k.shape[:3] != (B, H, T):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, head and length")
    entropy = torch.zeros(B, H, T, dtype=torch.float32)
    sink = torch.zeros(B, H, T, dtype=torch.float32)
    received = torch.zeros(B, H, T, dtype=torch.float64)
    out: dict[str, torch.Tensor] = {}
    if isinstance(visible, torch.Tensor):
        mask = visible
        visible = lambda start, stop: mask[..., start:stop, :]  # noqa: E731
    if window is not None:
        w0, w1 = max(0, int(window[0])), min(T, int(window[1]))
        attn_map = torch.zeros(B, H, max(0, w1 - w0), max(0, w1 - w0), dtype=torch.float32)
    lower = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
    for b in range(B):
        for h in range(H):
            qh, kh = q[b, h].float(), k[b, h].float()
            for start in range(0, T, block):
                stop = min(T, start + block)
                n = stop - start
                scores = (qh[start:stop] @ kh[:stop].T).mul_(scale)  # [n, stop]
                if visible is None:  # causal: only the diagonal block has hidden keys
                    scores[:, start:stop].masked_fill_(~lower[:n, :n], _HIDDEN)
                    empty = None
                else:
                    seen = visible(start, stop).to(torch.bool).expand(B, H, n, T)[b, h, :, :stop].to(scores.device)
                    scores.masked_fill_(~seen, _HIDDEN)
                    empty = ~seen.any(-1)  # queries that see no key: all statistics 0
                # shifted by the row maximum, so log z and the weighted mean of the shifted scores are both
                # O(log T): H = log z - sum_j w_j s'_j / z without the cancellation of lse - sum p s
                scores -= scores.amax(-1, keepdim=True)
                weights = torch.exp(scores)  # a hidden key: exp(-3e38 - max) = 0
                if empty is not None:
                    weights[empty] = 0.0
                z = weights.sum(-1).clamp_min_(1e-30)
                sink[b, h, start:stop] = (weights[:, 0] / z).cpu()
                received[b, h, :stop] += ((1.0 / z)[None, :] @ weights)[0].double().cpu()
                if window is not None and start < w1 and stop > w0:
                    r0, r1 = max(start, w0), min(stop, w1)
                    rows = slice(r0 - start, r1 - start)
                    attn_map[b, h, r0 - w0 : r1 - w0, : r1 - w0] = (weights[rows, w0:r1] / z[rows, None]).cpu()
                ent = z.log() - weights.mul_(scores).sum(-1) / z  # 0 x (-3e38) = 0 for hidden keys
                if empty is not None:
                    ent[empty] = 0.0
                entropy[b, h, start:stop] = ent.clamp_min_(0.0).cpu()
    out.update(entropy=entropy, sink=sink, received=received.float())
    if window is not None:
        out["map"] = attn_map
    return out


def attention_probabilities(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) over the visible keys, in fp32: q [..., T, d], k [..., S, d], visible [T, S]
    (True = seen). A query that sees no key gets all zeros."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return probs.nan_to_num(0.0)
