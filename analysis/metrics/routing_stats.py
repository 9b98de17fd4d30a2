"""Routing statistics of a MoE layer over many tokens, one formula each (see DIAGNOSTICS.md, "Surveys").

Notation, per token t of one MoE layer: sigmoid scores ``s_t`` [E], selection ``a_t = s_t + b`` (b the
selection bias), chosen experts ``S_t`` (the top k of ``a_t``), routing weights ``w_te`` (e in S_t).
MaxVio and CV are ``k3core.training.load_stats.moe_load_stats``; co-activation is ``analysis.metrics.moe.coactivation``.
"""

from __future__ import annotations

import math

import numpy as np

TOKEN_CLASSES = ("lower", "upper", "digit", "space", "punct", "other")
_CLASS = {name: i for i, name in enumerate(TOKEN_CLASSES)}


def kth_largest(values: np.ndarray, k: int) -> np.ndarray:
    """The k-th largest entry of each row (k = 1: the maximum) of ``values`` [..., E]."""
    values = np.asarray(values)
    E = values.shape[-1]
    if not 1 <= k <= E:
        raise ValueError(f"k must lie in 1..{E}, got {k}")
    return np.partition(values, E - k, axis=-1)[..., E - k]


def selection_margin(selection: np.ndarray, k: int) -> np.ndarray:
    """Margin between the last selected and the first unselected expert, ``a_(k) - a_(k+1)`` (order statistics of
    the selection ``a_t``, largest first) [...]; small margins are tokens whose routing a small bias change flips."""
    return kth_largest(selection, k) - kth_largest(selection, k + 1)


def cutoff_gaps(selection: np.ndarray, scores: np.ndarray, k: int) -> np.ndarray:
    """Quantile balancing's statistic (K3; ``k3core.training.balancing``): the cut-off ``alpha_t = a_(k+1)``
    (the (k+1)-th largest selection) minus each expert's score, ``alpha_t - s_te`` [..., E]; the bias update
    solves for the k/E quantile of each expert's gaps."""
    return kth_largest(selection, k + 1)[..., None] - np.asarray(scores)


def chosen_mask(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Boolean [..., E]: True where expert e is among the token's chosen ``experts`` [..., k]."""
    experts = np.asarray(experts, dtype=np.int64)
    mask = np.zeros((*experts.shape[:-1], num_experts), dtype=bool)
    np.put_along_axis(mask, experts, True, axis=-1)
    return mask


def byte_classes() -> np.ndarray:
    """Token class of each byte 0..255 (TOKEN_CLASSES): ASCII lower / upper letters, digits, whitespace,
    punctuation; everything else (controls, non-ASCII UTF-8 bytes) "other"."""
    out = np.full(256, _CLASS["other"], dtype=np.int64)
    for b in range(128):
        c = chr(b)
        if c.islower():
            out[b] = _CLASS["lower"]
        elif c.isupper():
            out[b] = _CLASS["upper"]
        elif c.isdigit():
            out[b] = _CLASS["digit"]
        elif c.isspace():
            out[b] = _CLASS["space"]
        elif 33 <= b < 127:
            out[b] = _CLASS["punct"]
    return out


def string_class(piece: str) -> int:
    """Token class of a token string (BPE): whitespace only -> space; else, without its leading whitespace, all
    letters starting upper-case -> upper, all letters -> lower, all digits -> digit, all punctuation -> punct,
    anything else (mixed) -> other."""
    if piece and piece.isspace():
        return _CLASS["space"]
    word = piece.lstrip()
    if not word:
        return _CLASS["other"]
    if word.isalpha():
        return _CLASS["upper"] if word[0].isupper() else _CLASS["lower"]
    if word.isdigit():
        return _CLASS["digit"]
    if all(not ch.isalnum() and not ch.isspace() for ch in word):
        return _CLASS["punct"]
    return _CLASS["other"]


def lift(counts: np.ndarray, corpus_counts: np.ndarray) -> np.ndarray:
    """Lift of each category c for each expert: ``P(c | e) / P(c) = (n_ec / n_e) / (N_c / N)`` [E, C]
    (> 1: the expert sees c more often than the corpus has it); NaN where n_e = 0 or N_c = 0."""
    n = np.asarray(counts, dtype=np.float64)
    corpus = np.asarray(corpus_counts, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_given = n / n.sum(-1, keepdims=True)
        p = corpus / corpus.sum()
        out = p_given / p
    return np.where(np.isfinite(out), out, np.nan)


def specialisation(counts: np.ndarray, corpus_counts: np.ndarray) -> np.ndarray:
    """Specialisation score of each expert, in bits: the KL divergence of the token classes it is routed from the
    corpus's, ``S_e = sum_c P(c | e) log2(P(c | e) / P(c))`` [E] (0: routed like the corpus; large: one class).
    NaN for an expert no token reached."""
    n = np.asarray(counts, dtype=np.float64)
    corpus = np.asarray(corpus_counts, dtype=np.float64)
    totals = n.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_given = n / totals
        p = corpus / corpus.sum()
        terms = np.where(p_given > 0, p_given * np.log2(p_given / p), 0.0)
    out = terms.sum(-1)
    return np.where(totals[..., 0] > 0, out, math.nan)


def reap_saliency(gate_norm_sum: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """REAP saliency (Lasby et al. 2025) of each expert: the mean over the tokens routed to it of its routing
    weight times its output norm, ``R_e = (1 / n_e) sum_{t : e in S_t} w_te ||f_e(z_t)||_2`` [E]; NaN if n_e = 0."""
    n = np.asarray(tokens, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, np.asarray(gate_norm_sum, dtype=np.float64) / n, math.nan)
