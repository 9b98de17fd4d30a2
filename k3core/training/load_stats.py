"""MoE load balance (MaxVio, CV) of one layer's expert load: the one definition training and analysis report."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def moe_load_stats(load: torch.Tensor | np.ndarray | Sequence[float]) -> dict[str, float]:
    """Imbalance of one MoE layer's expert load ``c`` (assignments per expert):

        MaxVio = max_e c_e / mean(c) - 1        0 when perfectly balanced
        CV     = std(c) / mean(c)               population std (divide by E, not E - 1)

    Returns ``{"max_vio": ..., "cv": ...}``; both are NaN when no token was routed (mean 0) or ``c``
    is empty. E.g. ``c = [2, 2, 4, 0]``: mean 2, MaxVio = 4/2 - 1 = 1, CV = sqrt(2)/2.
    """
    if isinstance(load, torch.Tensor):
        load = load.detach().to("cpu", torch.float64).numpy()
    c = np.asarray(load, dtype=np.float64).reshape(-1)
    mean = float(c.mean()) if c.size else 0.0
    if mean == 0.0:
        return {"max_vio": float("nan"), "cv": float("nan")}
    return {"max_vio": float(c.max()) / mean - 1.0, "cv": float(c.std()) / mean}
