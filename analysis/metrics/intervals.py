"""Confidence intervals of a share: the Wilson score interval of x successes in n trials (one definition).

Used for an expert's load share (surveys), recall accuracy by distance and MQAR accuracy by length."""

from __future__ import annotations

import numpy as np


def wilson_interval(successes: np.ndarray, trials: np.ndarray | int, z: float = 1.96) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval of a binomial share p = x / n (z = 1.96: 95%):

        centre = (p + z^2 / 2n) / (1 + z^2 / n),  half = z sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2 / n)

    Returns (low, high), clipped to [0, 1]; NaN where n = 0. Scalars in give 0-d arrays out."""
    x = np.asarray(successes, dtype=np.float64)
    n = np.broadcast_to(np.asarray(trials, dtype=np.float64), x.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = x / n
        denom = 1 + z * z / n
        centre = (p + z * z / (2 * n)) / denom
        half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low, high = np.clip(centre - half, 0, 1), np.clip(centre + half, 0, 1)
    bad = n == 0
    return np.where(bad, np.nan, low), np.where(bad, np.nan, high)
