"""Hidden-state diagnostics over depth: rank collapse, token uniformity, layer redundancy, massive activations.

Hidden states are ``trace["hidden"]`` with axes [depth, batch, token, hidden]; depth ``l`` is the
state entering layer ``l`` and the last depth is the final state (before the final RMSNorm). So
layer ``l`` maps depth ``l`` (its input) to depth ``l + 1`` (its output). With AttnRes residuals the
state entering layer ``l`` is that layer's attention-side depth mix, so two consecutive states differ by
the layer's output *and* by the change of mix weights; with plain / scale-bias residuals they differ by
exactly the layer's (scaled) outputs. Per-sequence metrics are averaged over the batch.

- Rank collapse (Dong et al. 2021): ``r = ||X - 1 mean_t(X)^T||_F / ||X||_F`` and the effective rank
  (Roy & Vetterli 2007) ``exp(H(sigma / sum sigma))`` of the centred states.
- Token uniformity: mean pairwise cosine similarity between distinct tokens.
- Layer redundancy: per-token cosine between a layer's input and output, Block Influence
  ``BI = 1 - cos`` (ShortGPT, Men et al. 2024), and linear CKA between them (Kornblith et al. 2019).
- Massive activations (Sun et al. 2024): the largest ``|h|`` per depth, where they sit
  (token, channel), and the ratio ``max |h| / median |h|``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.tidy import tidy
from analysis.trace_errors import MissingTraceData
from k3core.trace import Trace, names

_EPS = 1e-12


def _as_2d(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a [token, hidden] matrix, got shape {x.shape}")
    return x


def rank_collapse_ratio(x: np.ndarray) -> float:
    """Dong et al. 2021: ``r = ||X - 1 mean_t(X)^T||_F / ||X||_F`` for X [token, hidden] (0: identical tokens)."""
    x = _as_2d(x)
    total = np.linalg.norm(x)
    if total == 0:
        return 0.0
    return float(np.linalg.norm(x - x.mean(0, keepdims=True)) / total)


def effective_rank(x: np.ndarray, center: bool = True) -> float:
    """Roy & Vetterli 2007: ``exp(H(p))`` with ``p = sigma / sum sigma`` the normalised singular values.

    ``center=True`` first removes the mean over rows (tokens). A zero matrix has effective rank 0.
    """
    x = _as_2d(x)
    if center:
        x = x - x.mean(0, keepdims=True)
    sigma = np.linalg.svd(x, compute_uv=False)
    total = sigma.sum()
    if total <= _EPS * max(1.0, np.abs(x).max(initial=0.0)):
        return 0.0
    p = sigma[sigma > 0] / total
    return float(np.exp(-(p * np.log(p)).sum()))


def token_uniformity(x: np.ndarray) -> float:
    """Mean pairwise cosine similarity between distinct tokens (diagonal excluded) of X [token, hidden]."""
    x = _as_2d(x)
    T = x.shape[0]
    if T < 2:
        return float("nan")
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), _EPS)
    sims = unit @ unit.T
    return float((sims.sum() - np.trace(sims)) / (T * (T - 1)))


def token_cosine(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-token cosine between two states of the same tokens, [token]."""
    x, y = _as_2d(x), _as_2d(y)
    if x.shape != y.shape:
        raise ValueError(f"states must have the same shape, got {x.shape} and {y.shape}")
    num = (x * y).sum(1)
    den = np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), _EPS)
    return num / den


def block_influence(x_in: np.ndarray, x_out: np.ndarray) -> float:
    """ShortGPT Block Influence: ``BI = 1 - mean_t cos(x_in_t, x_out_t)`` (0: the layer changes nothing)."""
    return float(1.0 - token_cosine(x_in, x_out).mean())


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA (Kornblith et al. 2019), HSIC form with column-centred X, Y (tokens are the samples):

    ``CKA = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)``; 1 for identical (up to rotation and isotropic
    scale) representations. Returns NaN when either representation is constant.
    """
    x, y = _as_2d(x), _as_2d(y)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs the same tokens in both: {x.shape[0]} vs {y.shape[0]} rows")
    x = x - x.mean(0, keepdims=True)
    y = y - y.mean(0, keepdims=True)
    den = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    if den <= _EPS:
        return float("nan")
    return float(np.linalg.norm(y.T @ x) ** 2 / den)


def top_activations(x: np.ndarray, k: int = 5) -> list[tuple[int, int, float]]:
    """The ``k`` largest ``|x|`` entries of X [token, hidden] as (token, channel, signed value), largest first."""
    x = _as_2d(x)
    flat = np.abs(x).ravel()
    k = min(k, flat.size)
    idx = np.argpartition(-flat, k - 1)[:k]
    idx = idx[np.argsort(-flat[idx], kind="stable")]
    tokens, channels = np.unravel_index(idx, x.shape)
    return [(int(t), int(c), float(x[t, c])) for t, c in zip(tokens, channels)]


def max_median_ratio(x: np.ndarray) -> float:
    """``max |x| / median |x|`` (Sun et al. 2024 flag activations ~1000x the median)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    med = np.median(a)
    return float(a.max() / med) if med > 0 else float("inf")


def _hidden(trace: Trace) -> np.ndarray:
    h = trace.get(names.HIDDEN)
    if h is None:
        raise MissingTraceData("no hidden states in this trace ('hidden'); record with what including 'hidden'")
    return np.asarray(h, dtype=np.float64)  # [depth, batch, token, hidden]


def depth_labels(n_depth: int) -> list[str]:
    """Names of the depth axis: 'L0 in', 'L1 in', ..., 'final'."""
    return [f"L{d} in" for d in range(n_depth - 1)] + ["final"]


def rank_collapse_table(trace: Trace) -> pd.DataFrame:
    """Per depth (state entering each layer, then final): rank-collapse ratio, effective rank (centred) and
    token uniformity, each averaged over the batch. Columns: depth, depth_label, ratio, effective_rank,
    token_cosine."""
    h = _hidden(trace)
    labels = depth_labels(h.shape[0])
    rows = []
    for d in range(h.shape[0]):
        seqs = h[d]
        rows.append(
            {
                "depth": d,
                "depth_label": labels[d],
                "ratio": float(np.mean([rank_collapse_ratio(s) for s in seqs])),
                "effective_rank": float(np.mean([effective_rank(s) for s in seqs])),
                "token_cosine": float(np.mean([token_uniformity(s) for s in seqs])),
            }
        )
    return tidy(pd.DataFrame(rows), keys=["depth"], value="ratio")


def layer_redundancy_table(trace: Trace) -> pd.DataFrame:
    """Per layer l (input = depth l, output = depth l + 1): mean token cosine, Block Influence and linear CKA.

    Columns: layer, layer_type, cosine, block_influence, cka.
    """
    h = _hidden(trace)
    types = trace.meta.get("layer_types") or []
    rows = []
    for layer in range(h.shape[0] - 1):
        cos = np.mean([token_cosine(a, b).mean() for a, b in zip(h[layer], h[layer + 1])])
        cka = np.mean([linear_cka(a, b) for a, b in zip(h[layer], h[layer + 1])])
        rows.append(
            {
                "layer": layer,
                "layer_type": types[layer] if layer < len(types) else "?",
                "cosine": float(cos),
                "block_influence": float(1.0 - cos),
                "cka": float(cka),
            }
        )
    return tidy(pd.DataFrame(rows), keys=["layer"], value="block_influence")


def massive_activation_table(trace: Trace, k: int = 5) -> pd.DataFrame:
    """Per depth the ``k`` largest ``|h|`` (first recorded sequence) with their (token, channel), plus the
    depth's max/median ratio. Columns: depth, depth_label, rank, token, channel, value, abs_value,
    median_abs, max_median_ratio."""
    h = _hidden(trace)
    labels = depth_labels(h.shape[0])
    rows = []
    for d in range(h.shape[0]):
        x = h[d, 0]
        med = float(np.median(np.abs(x)))
        ratio = max_median_ratio(x)
        for rank, (t, c, v) in enumerate(top_activations(x, k)):
            rows.append(
                {
                    "depth": d,
                    "depth_label": labels[d],
                    "rank": rank,
                    "token": t,
                    "channel": c,
                    "value": v,
                    "abs_value": abs(v),
                    "median_abs": med,
                    "max_median_ratio": ratio,
                }
            )
    return tidy(pd.DataFrame(rows), keys=["depth", "rank"], value="abs_value")
