"""LatentMoE diagnostics: expert load and balance, routing weights, co-activation, reuse, latent PCA.

From the trace arrays ``moe.i.load`` [expert] (assignments over the whole batch), ``moe.i.experts`` /
``moe.i.weights`` [batch, token, rank] (chosen experts sorted by weight, rank 0 = top-1),
``moe.i.latent`` [batch, token, latent] (z = W_down x) and ``moe.i.bias`` [expert] (e_bias).

Load of one layer, c = assignments per expert, p = c / sum(c), E experts:

    MaxVio  = max_e c / mean(c) - 1          (0 when perfectly balanced)
    CV      = std(c) / mean(c)                (population std)
    entropy = -sum p log p / log E            (1 when balanced; 0 log 0 = 0)
    dead    = #{e : c_e = 0};   min/mean = min_e c / mean(c)
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from k3core.interp.trace import Trace, names
from k3core.training.load_stats import moe_load_stats

from .entropy import normalised_entropy


def moe_layers(trace: Trace) -> list[int]:
    """MoE layers with routing data in the trace (0-based, depth order)."""
    return [i for i in trace.layer_indices("moe") if names.moe_load(i) in trace or names.moe_experts(i) in trace]


def num_experts_of(trace: Trace, layer: int) -> int:
    """E for a MoE layer: the length of its load vector, else the trace's config."""
    if names.moe_load(layer) in trace:
        return int(np.asarray(trace[names.moe_load(layer)]).shape[0])
    n = trace.config.get("num_experts")
    if not n:
        raise ValueError("cannot tell the number of experts: no moe.*.load array and no config")
    return int(n)


def load_counts(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """c[e] = number of (token, rank) assignments to expert e."""
    experts = np.asarray(experts)
    if experts.size and (experts.min() < 0 or experts.max() >= num_experts):
        raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
    return np.bincount(experts.ravel().astype(np.int64), minlength=num_experts)


def load_imbalance(counts: np.ndarray) -> dict[str, float]:
    """Balance metrics of one layer's load c (module docstring): max_vio and cv
    (``k3core.training.load_stats.moe_load_stats``, the one definition training logs too), entropy, dead, min_over_mean,
    plus total (sum c) and experts (E)."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError("counts must be a non-empty 1-D array")
    if np.any(c < 0):
        raise ValueError("counts must be non-negative")
    total, mean = c.sum(), c.mean()
    stats = moe_load_stats(c)
    if total == 0:
        return dict(**stats, entropy=np.nan, dead=int(c.size), min_over_mean=np.nan, total=0.0, experts=int(c.size))
    return dict(
        **stats,
        entropy=float(normalised_entropy(c / total)),
        dead=int((c == 0).sum()),
        min_over_mean=float(c.min() / mean),
        total=float(total),
        experts=int(c.size),
    )


def expert_load(trace: Trace) -> pd.DataFrame:
    """Load heatmap data: per MoE layer and expert, count c[l, e] and share c / sum_e c (whole batch).

    Columns: layer, expert, count, share.
    """
    frames = []
    for i in moe_layers(trace):
        if names.moe_load(i) in trace:
            c = np.asarray(trace[names.moe_load(i)], dtype=np.int64)
        else:
            c = load_counts(trace[names.moe_experts(i)], num_experts_of(trace, i))
        total = c.sum()
        frames.append(
            pd.DataFrame(
                dict(layer=i, expert=np.arange(c.size), count=c, share=c / total if total else np.zeros(c.size))
            )
        )
    return (
        pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["layer", "expert", "count", "share"])
    )


def top_k_of(trace: Trace, layer: int) -> int:
    """k, the experts each token chooses in a MoE layer: the rank axis of ``moe.i.experts``, else the config."""
    if names.moe_experts(layer) in trace:
        return int(np.asarray(trace[names.moe_experts(layer)]).shape[-1])
    return int(trace.config.get("num_experts_per_token") or 1)


FLOOR_COLUMNS = ["tokens", "max_vio_floor", "max_vio_floor_hi", "cv_floor", "cv_floor_hi", "within_floor"]


def imbalance_table(trace: Trace) -> pd.DataFrame:
    """Per MoE layer: max_vio, cv, entropy, dead, min_over_mean, total, experts (see ``load_imbalance``), and their
    sampling floor at the layer's token count (``analysis.metrics.null_reference.balanced_routing_floor``): the mean
    and 97.5th percentile of MaxVio and CV under perfectly balanced routing, and whether both measured values lie
    within it (``within_floor``)."""
    from .null_reference import balanced_routing_floor

    load = expert_load(trace)
    rows = []
    for layer, g in load.groupby("layer"):
        stats = load_imbalance(g.sort_values("expert")["count"].to_numpy())
        k = top_k_of(trace, int(layer))
        tokens = int(round(stats["total"] / k))
        floor = balanced_routing_floor(tokens, k, stats["experts"]) if tokens >= 1 else None
        rows.append(
            dict(
                layer=int(layer),
                **stats,
                tokens=tokens,
                max_vio_floor=floor.max_vio_mean if floor else np.nan,
                max_vio_floor_hi=floor.max_vio_hi if floor else np.nan,
                cv_floor=floor.cv_mean if floor else np.nan,
                cv_floor_hi=floor.cv_hi if floor else np.nan,
                within_floor=bool(floor and floor.max_vio_within(stats["max_vio"]) and floor.cv_within(stats["cv"])),
            )
        )
    columns = ["layer", "max_vio", "cv", "entropy", "dead", "min_over_mean", "total", "experts", *FLOOR_COLUMNS]
    return pd.DataFrame(rows, columns=columns)


def weight_by_rank(trace: Trace) -> pd.DataFrame:
    """Mean routing weight of the r-th chosen expert (rank 1 = largest weight), per MoE layer.

    Columns: layer, rank (1..k), mean_weight, std_weight.
    """
    frames = []
    for i in moe_layers(trace):
        w = trace.get(names.moe_weights(i))
        if w is None:
            continue
        w = np.asarray(w, dtype=np.float64).reshape(-1, np.asarray(w).shape[-1])
        frames.append(
            pd.DataFrame(dict(layer=i, rank=np.arange(1, w.shape[1] + 1), mean_weight=w.mean(0), std_weight=w.std(0)))
        )
    return (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["layer", "rank", "mean_weight", "std_weight"])
    )


def coactivation(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """C[i, j] = number of tokens whose chosen set contains both i and j (i != j); C[i, i] = tokens choosing i.

    ``experts`` [..., k] with the chosen ids of each token in the last axis (C = M^T M with M the
    token x expert 0/1 incidence matrix).
    """
    experts = np.asarray(experts)
    if experts.ndim < 1:
        raise ValueError("experts must have a rank axis")
    flat = experts.reshape(-1, experts.shape[-1]).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
    m = np.zeros((flat.shape[0], num_experts), dtype=np.int64)
    np.put_along_axis(m, flat, 1, axis=1)
    return m.T @ m


def next_token_reuse(experts: np.ndarray) -> float:
    """Share of token t's chosen experts also chosen for token t + 1, mean over consecutive pairs
    within each sequence: mean_t |S_t ∩ S_{t+1}| / k. ``experts`` [batch, token, k]. NaN with < 2 tokens."""
    e = np.asarray(experts)
    if e.ndim != 3:
        raise ValueError(f"experts must be [batch, token, k], got shape {e.shape}")
    B, T, k = e.shape
    if T < 2:
        return float("nan")
    same = (e[:, :-1, :, None] == e[:, 1:, None, :]).any(-1)  # [B, T-1, k]: expert of t chosen again at t+1
    return float(same.sum(-1).mean() / k)


def reuse_table(trace: Trace) -> pd.DataFrame:
    """Per MoE layer: next-token reuse and the chance level k / E (independent uniform choices).

    Columns: layer, reuse, chance, k, experts.
    """
    rows = []
    for i in moe_layers(trace):
        e = trace.get(names.moe_experts(i))
        if e is None:
            continue
        k, E = np.asarray(e).shape[-1], num_experts_of(trace, i)
        rows.append(dict(layer=i, reuse=next_token_reuse(e), chance=k / E, k=k, experts=E))
    return pd.DataFrame(rows, columns=["layer", "reuse", "chance", "k", "experts"])


def coactivation_table(trace: Trace, layers: list[int] | None = None) -> pd.DataFrame:
    """Tidy co-activation counts for the given MoE layers (default: all), diagonal included.

    Columns: layer, expert_i, expert_j, count, rate (count / tokens), independent (p_i p_j, the rate of both under
    independent choices: ``analysis.metrics.null_reference.independent_coactivation``), lift (rate / independent).
    """
    from .null_reference import independent_coactivation

    frames = []
    for i in moe_layers(trace) if layers is None else layers:
        e = trace.get(names.moe_experts(i))
        if e is None:
            continue
        E = num_experts_of(trace, i)
        C = coactivation(e, E)
        n_tok = int(np.prod(np.asarray(e).shape[:-1]))
        independent = independent_coactivation(np.diag(C) / max(n_tok, 1))
        with np.errstate(divide="ignore", invalid="ignore"):
            lift = (C / max(n_tok, 1)) / independent
        frames.append(
            pd.DataFrame(
                dict(
                    layer=i,
                    expert_i=np.repeat(np.arange(E), E),
                    expert_j=np.tile(np.arange(E), E),
                    count=C.ravel(),
                    rate=C.ravel() / max(n_tok, 1),
                    independent=independent.ravel(),
                    lift=lift.ravel(),
                )
            )
        )
    return (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["layer", "expert_i", "expert_j", "count", "rate", "independent", "lift"])
    )


def pca_2d(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PCA by SVD of the centred rows of x [N, F]: (coords [N, 2], explained variance ratio [2]).

    Ratio_i = s_i^2 / sum s^2; missing components (N or F < 2) are zero-filled.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty [N, F] array, got shape {x.shape}")
    xc = x - x.mean(0, keepdims=True)
    u, s, _ = np.linalg.svd(xc, full_matrices=False)
    total = (s**2).sum()
    coords = np.zeros((x.shape[0], 2))
    ratio = np.zeros(2)
    r = min(2, s.size)
    coords[:, :r] = u[:, :r] * s[:r]
    if total > 0:
        ratio[:r] = s[:r] ** 2 / total
    return coords, ratio


def latent_pca(trace: Trace, layer: int) -> tuple[pd.DataFrame, np.ndarray]:
    """2-D PCA of the routed-expert inputs z (``moe.<layer>.latent``) with each token's top-1 expert.

    Returns (DataFrame: layer, batch, token, token_id, pc1, pc2, top1_expert, top1_weight; explained ratio [2]).
    """
    z = trace.get(names.moe_latent(layer))
    if z is None:
        raise KeyError(f"trace has no moe.{layer}.latent (record with 'latent')")
    z = np.asarray(z)
    B, T, F = z.shape
    coords, ratio = pca_2d(z.reshape(-1, F))
    experts = trace.get(names.moe_experts(layer))
    weights = trace.get(names.moe_weights(layer))
    tokens = trace.get(names.TOKENS)
    df = pd.DataFrame(
        dict(
            layer=layer,
            batch=np.repeat(np.arange(B), T),
            token=np.tile(np.arange(T), B),
            token_id=np.asarray(tokens)[:B, :T].ravel() if tokens is not None else -1,
            pc1=coords[:, 0],
            pc2=coords[:, 1],
            top1_expert=np.asarray(experts)[..., 0].ravel() if experts is not None else -1,
            top1_weight=np.asarray(weights)[..., 0].ravel() if weights is not None else np.nan,
        )
    )
    return df, ratio


def bias_load_correlation(bias: pd.DataFrame, load: pd.DataFrame) -> pd.DataFrame:
    """Per MoE layer, the Pearson r between the selection bias e_bias (``analysis.weights`` router_bias table:
    layer, expert, bias) and the traced load c (``expert_load``: layer, expert, count); NaN when either is
    constant or their expert counts differ. Columns: layer, load_corr."""
    rows = []
    for layer, g in bias.groupby("layer"):
        b = g.sort_values("expert")["bias"].to_numpy(dtype=np.float64)
        c = load[load["layer"] == layer].sort_values("expert")["count"].to_numpy(dtype=np.float64)
        r = float(np.corrcoef(b, c)[0, 1]) if c.size == b.size and b.std() > 0 and c.std() > 0 else np.nan
        rows.append({"layer": int(layer), "load_corr": r})
    return pd.DataFrame(rows, columns=["layer", "load_corr"])
