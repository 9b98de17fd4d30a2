"""Entropy of a distribution: the one definition behind the AttnRes depth mix, the MoE load and attention rows."""

from __future__ import annotations

import numpy as np


def entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """H = -sum p log p over ``axis``, in nats (0 log 0 = 0). p must be non-negative."""
    p = np.asarray(p, dtype=np.float64)
    if np.any(p < 0):
        raise ValueError("probabilities must be non-negative")
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return -plogp.sum(axis=axis)


def normalised_entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """entropy(p) / log n over ``axis`` (n = its length): 1 for uniform, 0 for one-hot; 0 where n = 1."""
    p = np.asarray(p, dtype=np.float64)
    n = p.shape[axis]
    if n < 1:
        raise ValueError("empty distribution")
    h = entropy(p, axis)
    if n == 1:
        return np.zeros_like(h)
    return h / np.log(n)
