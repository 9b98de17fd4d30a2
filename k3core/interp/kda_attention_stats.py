"""Attention statistics of KDA heads over every position, from the layer's implicit attention (never T x T).

KDA's output is ``o_t = sum_{s <= t} A[t, s] v_s`` with signed weights A (``k3core.ops.kda.implicit_attention``).
The statistics are those of MLA's heads (``k3core.interp.attention_stats``) on the magnitudes normalised per query,
with the sign and the scale reported beside them:

    z_t            = sum_s |A[t, s]|,      p_ts = |A[t, s]| / z_t         (a query whose row is all zero: p = 0)
    entropy_t      = -sum_s p_ts log p_ts                                 (nats; log(t + 1) for uniform attention)
    sink_t         = p_t0                                                 (mass on the first token)
    received_s     = sum_t p_ts                                           (column sum)
    negative_t     = sum_{s: A[t, s] < 0} p_ts                            (the share of |A| that is negative)
    row_sum_t      = sum_s A[t, s]                                        (signed: 1 would be a convex mix)
    half_dist_t    = the smallest d with sum_{t - d <= s <= t} p_ts >= 1/2   (distance holding half the mass)
    distance[b, e] = sum_{t in position bin b} sum_{s: t - s in distance bin e} p_ts   (summed over the bin's queries)

Distance bins (``distance_bins``): 0, 1, 2-3, 4-7, ... (doubling). The rows come one query chunk at a time
(``kda_attention_blocks``): memory O(K T + C T) per head (the one-hot carry and one row block), work about
``T^2 K (1/2 + K / (2 C))`` multiply-adds per head plus O(T^2) for the statistics; see docs/DIAGNOSTICS.md.
"""

from __future__ import annotations

import torch

from ..ops.kda.implicit_attention import kda_attention_blocks
from .attention_stats import position_bins

KDA_STATS = ("entropy", "sink", "received", "negative", "row_sum", "half_distance")


def distance_bins(T: int) -> list[int]:
    """Edges of the distance bins of a T-token text: 0, 1, 2, 4, 8, ... (powers of two below T), then T
    (``position_bins`` doubling from 1). Bin ``e`` holds distances ``edges[e] <= t - s < edges[e + 1]``."""
    return position_bins(T, first=1)


def _row_stats(rows: torch.Tensor, t0: int, edges: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-query statistics of one block of rows [n, t1] (queries t0 .. t0 + n - 1), a few [n, t1] temporaries:
    the negative share as (sum |A| - sum A) / (2 sum |A|), the suffix masses from one prefix sum."""
    n, t1 = rows.shape
    row_sum = rows.sum(-1)
    p = rows.abs()
    z = p.sum(-1)
    p /= z.clamp_min(1e-30).unsqueeze(-1)
    entropy = -torch.special.xlogy(p, p).sum(-1)
    received = p.sum(-2)
    prefix = p.cumsum(-1)  # prefix[s] = sum_{s' <= s} p; the mass at distance < e is total - prefix[t - e]
    total = prefix[:, -1:]
    t = torch.arange(t0, t0 + n, device=rows.device)
    cols = t[:, None] - edges[None, :]  # [n, E + 1]
    at = prefix.gather(-1, cols.clamp(0, t1 - 1))
    below = torch.where(cols >= 0, total - at, total)
    below[:, 0] = 0.0  # distance < 0: nothing
    # keys s <= t with sum_{s' >= s} p >= 1/2: s = 0, and s >= 1 with prefix[s - 1] <= total - 1/2
    held = 1 + (prefix[:, :-1] <= total - 0.5).sum(-1)
    return {
        "entropy": entropy,
        "sink": p[:, 0],
        "negative": torch.where(z > 0, (z - row_sum) / (2 * z.clamp_min(1e-30)), 0.0),
        "row_sum": row_sum,
        "half_distance": torch.where(z > 0, t - (held - 1), 0).to(p.dtype),
        "received": received,
        "by_distance": below[:, 1:] - below[:, :-1],  # [n, E]
    }


@torch.no_grad()
def kda_attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    position_edges: list[int],
    scale: float | None = None,
    chunk_size: int = 64,
) -> dict[str, torch.Tensor]:
    """The statistics of the module docstring for every query and head, fp32 on the CPU.

    q, k: [B, T, H, K]; g: [B, T, HV, K]; beta: [B, T, HV] (the layer's own, as its hook points show them);
    position_edges: the position bins' edges (``attention_stats.position_bins(T)``). Returns
    {"entropy"|"sink"|"negative"|"row_sum"|"half_distance": [B, HV, T], "received": [B, HV, T],
    "distance": [B, HV, position bin, distance bin] (mass summed over each position bin's queries),
    "distance_edges": [E + 1]}.
    """
    B, T, HV = beta.shape
    dev = q.device
    edges = torch.tensor(distance_bins(T), device=dev)
    out = {name: torch.zeros(B, HV, T) for name in KDA_STATS if name != "received"}
    received = torch.zeros(B, HV, T, dtype=torch.float64, device=dev)
    pos = torch.tensor(position_edges)
    bin_of = torch.bucketize(torch.arange(T), pos[1:-1], right=True).to(dev)  # position bin of each query
    distance = torch.zeros(B, HV, len(position_edges) - 1, len(edges) - 1, dtype=torch.float64, device=dev)
    H = q.shape[2]
    for b in range(B):
        for h in range(HV):  # one head at a time: its carry and one row block are the working memory
            head = slice(h * H // HV, h * H // HV + 1)
            qkgb = (
                q[b : b + 1, :, head],
                k[b : b + 1, :, head],
                g[b : b + 1, :, h : h + 1],
                beta[b : b + 1, :, h : h + 1],
            )
            for t0, t1, rows in kda_attention_blocks(*qkgb, scale=scale, chunk_size=chunk_size):
                stats = _row_stats(rows[0, 0], t0, edges)
                for name in out:
                    out[name][b, h, t0:t1] = stats[name].float().cpu()
                received[b, h, :t1] += stats["received"].double()
                distance[b, h].index_add_(0, bin_of[t0:t1], stats["by_distance"].double())
    out["received"] = received.float().cpu()
    out["distance"] = distance.float().cpu()
    out["distance_edges"] = edges.cpu()
    return out
