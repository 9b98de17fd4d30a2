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

Over every position of a long text: the recorder keeps ``hidden`` for a window only, plus per position bin the
moments ``n``, ``s = sum h``, ``G = sum h h^T``, ``U = sum h / ||h||`` and, between consecutive depths,
``C = sum h_l h_(l+1)^T`` and ``sum cos`` (``hidden_bins.*``). Rank collapse, effective rank, token uniformity,
cosine and CKA follow from them exactly (``*_from_moments``); the tables use them whenever the window is shorter
than the text (massive activations stay on the window: a median is not a moment).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.metrics.entropy import entropy
from analysis.metrics.tidy import tidy
from analysis.runs.missing_data import MissingTraceData
from k3core.interp.trace import Trace, names

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
    return float(np.exp(entropy(p)))


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
    """The ``k`` largest ``|x|`` entries of X [token, hidden] as (token, channel, signed value), largest first; equal
    ``|x|`` in (token, channel) order, so ties pick the same entries on every machine (one token read twice has the
    same embedding: at depth 0 ties are the rule). NaN entries are never picked.

    O(size): the k-th largest value is unique whatever the tie order (``np.partition``); every entry above it is in,
    and of those equal to it the first ones. (``np.argpartition`` alone picks among ties by its selection algorithm,
    whose SIMD paths differ between CPUs.)"""
    x = _as_2d(x)
    flat = np.abs(x).ravel()
    flat = np.where(np.isnan(flat), -np.inf, flat)
    k = min(k, flat.size)
    if k == 0:
        return []
    kth = np.partition(flat, flat.size - k)[flat.size - k]
    above = np.flatnonzero(flat > kth)
    idx = np.concatenate([above, np.flatnonzero(flat == kth)[: k - above.size]])
    idx = idx[np.lexsort((idx, -flat[idx]))]  # largest first, then by position
    tokens, channels = np.unravel_index(idx, x.shape)
    return [(int(t), int(c), float(x[t, c])) for t, c in zip(tokens, channels)]


def max_median_ratio(x: np.ndarray) -> float:
    """``max |x| / median |x|`` (Sun et al. 2024 flag activations ~1000x the median)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    med = np.median(a)
    return float(a.max() / med) if med > 0 else float("inf")


def rank_collapse_from_moments(n: float, s: np.ndarray, gram: np.ndarray) -> float:
    """``r = sqrt(tr G - ||s||^2 / n) / sqrt(tr G)``: ``||X - 1 mu^T||_F^2 = tr G - n ||mu||^2`` with ``mu = s / n``."""
    return rank_collapse_from_trace(n, s, float(np.trace(gram)))


def rank_collapse_from_trace(n: float, s: np.ndarray, total: float) -> float:
    """``rank_collapse_from_moments`` from ``tr G = sum_t ||h_t||^2`` alone (``hidden_bins.sq_sum`` of a sketched
    trace): exact whatever the width."""
    total = float(total)
    if total <= 0:
        return 0.0
    return float(np.sqrt(max(total - float(s @ s) / n, 0.0) / total))


def effective_rank_from_moments(n: float, s: np.ndarray, gram: np.ndarray) -> float:
    """Centred effective rank from moments: the singular values of ``X - 1 mu^T`` are the square roots of the
    eigenvalues of ``G - s s^T / n`` (clipped at 0), then ``exp(H(sigma / sum sigma))`` as ``effective_rank``."""
    centred = gram - np.outer(s, s) / n
    sigma = np.sqrt(np.clip(np.linalg.eigvalsh((centred + centred.T) / 2), 0.0, None))
    total = sigma.sum()
    if total <= _EPS * max(1.0, float(np.sqrt(abs(np.trace(gram))))):
        return 0.0
    p = sigma[sigma > 0] / total
    return float(np.exp(entropy(p)))


def token_uniformity_from_moments(n: float, unit_sum: np.ndarray) -> float:
    """Mean pairwise cosine of distinct tokens, ``(||U||^2 - n) / (n (n - 1))`` with ``U = sum_t h_t / ||h_t||``
    (the all-pairs sum of unit dot products minus the n diagonal ones); NaN for n < 2."""
    if n < 2:
        return float("nan")
    return float((unit_sum @ unit_sum - n) / (n * (n - 1)))


def linear_cka_from_moments(
    n: float, s_x: np.ndarray, g_x: np.ndarray, s_y: np.ndarray, g_y: np.ndarray, cross: np.ndarray
) -> float:
    """``linear_cka`` from moments: centred ``X^T X = G_x - s_x s_x^T / n``, likewise Y, and centred
    ``X^T Y = C - s_x s_y^T / n``; ``CKA = ||X^T Y||_F^2 / (||X^T X||_F ||Y^T Y||_F)``; NaN when constant."""
    cxx, cyy = g_x - np.outer(s_x, s_x) / n, g_y - np.outer(s_y, s_y) / n
    cxy = cross - np.outer(s_x, s_y) / n
    den = np.linalg.norm(cxx) * np.linalg.norm(cyy)
    if den <= _EPS:
        return float("nan")
    return float(np.linalg.norm(cxy) ** 2 / den)


def sketch_frobenius_sq(b: np.ndarray) -> float:
    """Unbiased ``||A||_F^2`` from a Gaussian sketch ``B = R^T A R`` (R [D, k], entries N(0, 1/k)): an off-diagonal
    entry has ``E[B_ij^2] = ||A||_F^2 / k^2`` (i != j), so ``||A||_F^2 ~ k / (k - 1) * sum_(i != j) B_ij^2``. (The
    plain ``||B||_F^2`` is biased up by ``(tr A)^2 / k`` through the diagonal.)"""
    k = b.shape[-1]
    return float((np.sum(b * b) - np.sum(np.diagonal(b) ** 2)) * k / (k - 1))


def linear_cka_from_sketch(
    n: float, s_x: np.ndarray, g_x: np.ndarray, s_y: np.ndarray, g_y: np.ndarray, cross: np.ndarray
) -> float:
    """``linear_cka_from_moments`` from sketched moments (``R^T s``, ``R^T G R``, ``R^T C R``): the three Frobenius
    norms of the centred matrices estimated with ``sketch_frobenius_sq``; NaN when constant."""
    cxx, cyy = g_x - np.outer(s_x, s_x) / n, g_y - np.outer(s_y, s_y) / n
    cxy = cross - np.outer(s_x, s_y) / n
    den = np.sqrt(max(sketch_frobenius_sq(cxx), 0.0) * max(sketch_frobenius_sq(cyy), 0.0))
    if den <= _EPS:
        return float("nan")
    return float(max(sketch_frobenius_sq(cxy), 0.0) / den)


def _has_moments(trace: Trace) -> bool:
    return names.hidden_bins("gram") in trace or names.hidden_bins("sketch_gram") in trace


def _moment_arrays(trace: Trace) -> dict[str, np.ndarray]:
    """The moments (``hidden_bins.*``, float64) with the second moments under one set of keys: ``gram``,
    ``cross_gram`` and ``gram_sum`` (the sums in the Gram's basis) are the exact ones, or, in a sketched trace
    (``k3core.interp.hidden_moments``: wider states), the random projection's ``R^T G R``, ``R^T C R`` and ``R^T s``,
    with the exact ``tr G`` as ``sq_sum``; exact traces have no ``sq_sum``."""
    kinds = ("count", "sum", "unit_sum", "gram", "cross_gram", "cos_sum", "sq_sum")
    m = {k: np.asarray(trace[names.hidden_bins(k)], dtype=np.float64) for k in kinds if names.hidden_bins(k) in trace}
    if "gram" not in m:
        for kind, key in (("sketch_gram", "gram"), ("sketch_cross_gram", "cross_gram"), ("sketch_sum", "gram_sum")):
            if names.hidden_bins(kind) in trace:
                m[key] = np.asarray(trace[names.hidden_bins(kind)], dtype=np.float64)
    else:
        m.pop("sq_sum", None)
    m.setdefault("gram_sum", m["sum"])
    return m


def _moments(trace: Trace) -> dict[str, np.ndarray] | None:
    """The whole-text moments (``_moment_arrays``) when the hidden window is shorter than the text, else None
    (the whole text is in ``hidden``; older traces have no moments)."""
    if not _has_moments(trace) or names.HIDDEN not in trace:
        return None
    count = np.asarray(trace[names.hidden_bins("count")], dtype=np.float64)
    if trace[names.HIDDEN].shape[2] >= count.sum():
        return None
    return _moment_arrays(trace)


def hidden_covered_positions(trace: Trace) -> int:
    """How many positions the hidden-state tables describe: the whole text with moments, else the window."""
    m = _moments(trace)
    return int(m["count"].sum()) if m is not None else int(_hidden(trace).shape[2])


def _rank_row(
    n: float, s: np.ndarray, gram: np.ndarray, unit_sum: np.ndarray, gram_sum: np.ndarray, sq_sum: float | None
) -> dict[str, float]:
    """One sequence's rank statistics from its moments; ``gram_sum`` the sums in the Gram's basis, ``sq_sum`` the
    exact ``tr G`` of a sketched Gram (None: ``gram`` is exact)."""
    return {
        "ratio": rank_collapse_from_moments(n, s, gram) if sq_sum is None else rank_collapse_from_trace(n, s, sq_sum),
        "effective_rank": effective_rank_from_moments(n, gram_sum, gram),
        "token_cosine": token_uniformity_from_moments(n, unit_sum),
    }


def _sequence_rows(n: float, m: dict[str, np.ndarray], pick: tuple, over_bins: bool = False) -> list[dict[str, float]]:
    """``_rank_row`` of each sequence of ``m[kind][pick]`` ([batch, bin, ...] summed over bins when ``over_bins``)."""

    def part(kind: str) -> np.ndarray | None:
        if kind not in m:
            return None
        x = m[kind][pick]
        return x.sum(1) if over_bins else x

    s, g, u, gs, sq = (part(k) for k in ("sum", "gram", "unit_sum", "gram_sum", "sq_sum"))
    return [_rank_row(n, s[q], g[q], u[q], gs[q], None if sq is None else sq[q]) for q in range(s.shape[0])]


def rank_collapse_by_position_table(trace: Trace) -> pd.DataFrame:
    """Rank collapse per depth and position bin over the whole text (from ``hidden_bins.*``; mean over batch).

    Columns: depth, depth_label, bin, start, stop (positions [start, stop)), ratio, effective_rank, token_cosine.
    """
    if not _has_moments(trace):
        raise MissingTraceData("no hidden-state moments in this trace (hidden_bins.*): record with 'hidden'")
    m = _moment_arrays(trace)
    edges = np.asarray(trace[names.POSITION_BINS])
    labels = depth_labels(m["sum"].shape[0])
    rows = []
    for d in range(m["sum"].shape[0]):
        for b, n in enumerate(m["count"]):
            per_seq = _sequence_rows(n, m, (d, slice(None), b))
            row = {k: float(np.mean([r[k] for r in per_seq])) for k in per_seq[0]}
            rows.append({"depth": d, "depth_label": labels[d], "bin": b, "start": int(edges[b]),
                         "stop": int(edges[b + 1]), **row})  # fmt: skip
    return tidy(pd.DataFrame(rows), keys=["depth", "bin"], value="ratio")


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
    token uniformity, each averaged over the batch, over every position (from the moments when the hidden window
    is shorter than the text). Columns: depth, depth_label, ratio, effective_rank, token_cosine."""
    m = _moments(trace)
    if m is not None:
        n, D = m["count"].sum(), m["sum"].shape[0]
        labels = depth_labels(D)
        rows = []
        for d in range(D):
            per_seq = _sequence_rows(n, m, (d,), over_bins=True)  # [batch, ...] over bins
            rows.append({"depth": d, "depth_label": labels[d],
                         **{k: float(np.mean([r[k] for r in per_seq])) for k in per_seq[0]}})  # fmt: skip
        return tidy(pd.DataFrame(rows), keys=["depth"], value="ratio")
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

    Columns: layer, layer_type, cosine, block_influence, cka. Over every position (moments) when the hidden window
    is shorter than the text.
    """
    types = trace.meta.get("layer_types") or []
    m = _moments(trace)
    if m is not None and "cross_gram" in m:
        n = m["count"].sum()
        s_, g_, c_, cos_ = (m[k].sum(2) for k in ("gram_sum", "gram", "cross_gram", "cos_sum"))  # over bins
        cka_of = linear_cka_from_moments if "sq_sum" not in m else linear_cka_from_sketch
        rows = []
        for layer in range(c_.shape[0]):
            cos = float(np.mean(cos_[layer] / n))
            cka = np.mean([cka_of(n, s_[layer, q], g_[layer, q], s_[layer + 1, q], g_[layer + 1, q],
                                                   c_[layer, q]) for q in range(c_.shape[1])])  # fmt: skip
            rows.append({"layer": layer, "layer_type": types[layer] if layer < len(types) else "?",
                         "cosine": cos, "block_influence": 1.0 - cos, "cka": float(cka)})  # fmt: skip
        return tidy(pd.DataFrame(rows), keys=["layer"], value="block_influence")
    h = _hidden(trace)
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
