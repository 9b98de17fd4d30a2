"""Routing tensors by layer and expert: router selection biases and their spread, router weight row norms,
routed expert weight norms (small pure functions on numpy arrays keyed by canonical tensor name)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pandas as pd

from k3core.loading.names import layer_of

from .layout import EXPERT_RE


def _layer_expert_table(values: Mapping[str, np.ndarray], num_layers: int, tensor: str, column: str) -> pd.DataFrame:
    """One value per MoE layer and expert from the vector stored as ``model.layers.{i}.{tensor}``.
    Columns: layer, expert, ``column``; keys layer, expert."""
    frames = []
    for i in range(num_layers):
        v = values.get(f"model.layers.{i}.{tensor}")
        if v is not None:
            v = np.asarray(v, np.float64).reshape(-1)
            frames.append(pd.DataFrame({"layer": i, "expert": np.arange(v.size), column: v}))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["layer", "expert", column])
    df.attrs["keys"] = ["layer", "expert"]
    return df


def router_bias_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """Router selection bias e_bias per MoE layer and expert (it shifts which experts are chosen,
    top_k(s + e_bias), not their weights). Columns: layer, expert, bias."""
    return _layer_expert_table(values, num_layers, "block_sparse_moe.gate.e_score_correction_bias", "bias")


def bias_stats(bias: np.ndarray) -> dict[str, float]:
    """mean, population std, min and max of one layer's selection biases."""
    b = np.asarray(bias, np.float64).reshape(-1)
    return {"mean": float(b.mean()), "std": float(b.std()), "min": float(b.min()), "max": float(b.max())}


def router_bias_spread(bias: pd.DataFrame) -> pd.DataFrame:
    """Per MoE layer: e_bias mean, std (population), min, max (``bias_stats``)."""
    rows = [
        {"layer": int(layer), **bias_stats(g.sort_values("expert")["bias"].to_numpy())}
        for layer, g in bias.groupby("layer", sort=True)
    ]
    df = pd.DataFrame(rows, columns=["layer", "mean", "std", "min", "max"])
    df.attrs["keys"] = ["layer"]
    return df


def row_norms(matrix: np.ndarray) -> np.ndarray:
    """Euclidean norm of each row: for the router weight W [E, D], ||W_e|| per expert e."""
    m = np.asarray(matrix, np.float64)
    return np.sqrt(np.square(m).sum(axis=1))


def router_norm_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """Router weight row norm ||W_router[e]|| per MoE layer and expert. Columns: layer, expert, weight_norm.
    (``values`` holds the row norms already: the reader reduces each router matrix as it reads it.)"""
    return _layer_expert_table(values, num_layers, "block_sparse_moe.gate.weight", "weight_norm")


def expert_norm_table(sums: Mapping[str, float], num_layers: int) -> pd.DataFrame:
    """Per MoE layer and routed expert: Frobenius norms of w1 (gate), w3 (up), w2 (down) and of the three
    together, sqrt(|w1|^2 + |w2|^2 + |w3|^2). ``sums`` maps each expert matrix's name to its sum of squares.
    Columns: layer, expert, w1_norm, w2_norm, w3_norm, norm."""
    acc: dict[tuple[int, int], dict[str, float]] = {}
    for name, sq in sums.items():
        i, rest = layer_of(name)
        m = EXPERT_RE.match(rest) if i is not None else None
        if m:
            acc.setdefault((i, int(m.group(1))), {})[m.group(2)] = float(sq)
    rows = []
    for (i, e), parts in sorted(acc.items()):
        row = {"layer": i, "expert": e}
        for w in ("w1", "w2", "w3"):
            row[f"{w}_norm"] = math.sqrt(parts[w]) if w in parts else float("nan")
        row["norm"] = math.sqrt(sum(parts.values()))
        rows.append(row)
    df = pd.DataFrame(rows, columns=["layer", "expert", "w1_norm", "w2_norm", "w3_norm", "norm"])
    df.attrs["keys"] = ["layer", "expert"]
    return df
