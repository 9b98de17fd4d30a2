"""Residual-path tensors by depth: AttnRes pseudo-query norms, scale/bias residual statistics and the
RMSNorm gains (small pure functions on numpy arrays keyed by canonical tensor name)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from .layout import NORMS


def vector_norm(x: np.ndarray) -> float:
    """Euclidean norm sqrt(sum x^2) over every entry, in float64."""
    return float(np.sqrt(np.sum(np.square(np.asarray(x, dtype=np.float64)))))


def query_norm_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """AttnRes pseudo-query norm ||w|| per site. Columns: layer (num_layers for the output mix), site
    ("attn" | "mlp" | "output"), depth (plot label), query_norm. Empty for runs without AttnRes.
    (With Block AttnRes the first layer's attention-site query is never used: its bank is empty.)"""
    rows = []
    for i in range(num_layers):
        for site, key in (("attn", "self_attention_res_proj"), ("mlp", "mlp_res_proj")):
            w = values.get(f"model.layers.{i}.{key}.weight")
            if w is not None:
                rows.append({"layer": i, "site": site, "depth": f"L{i} {site}", "query_norm": vector_norm(w)})
    w = values.get("model.output_attn_res_proj.weight")
    if w is not None:
        rows.append({"layer": num_layers, "site": "output", "depth": "output", "query_norm": vector_norm(w)})
    df = pd.DataFrame(rows, columns=["layer", "site", "depth", "query_norm"])
    df.attrs["keys"] = ["layer", "site", "depth"]
    return df


def scale_bias_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """Scale/bias residual (h = h + scale * f(h) + bias) per layer and site: scale and bias mean and
    population std over channels. Columns: layer, site, scale_mean, scale_std, bias_mean, bias_std."""
    rows = []
    for i in range(num_layers):
        for site, key in (("attn", "self_attention_res"), ("mlp", "mlp_res")):
            scale = values.get(f"model.layers.{i}.{key}_scale")
            bias = values.get(f"model.layers.{i}.{key}_bias")
            if scale is None or bias is None:
                continue
            scale, bias = np.asarray(scale, np.float64), np.asarray(bias, np.float64)
            rows.append(
                {
                    "layer": i,
                    "site": site,
                    "scale_mean": float(scale.mean()),
                    "scale_std": float(scale.std()),
                    "bias_mean": float(bias.mean()),
                    "bias_std": float(bias.std()),
                }
            )
    df = pd.DataFrame(rows, columns=["layer", "site", "scale_mean", "scale_std", "bias_mean", "bias_std"])
    df.attrs["keys"] = ["layer", "site"]
    return df


def norm_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """RMSNorm weights by depth: mean and max of each norm's weight vector. Columns: layer, norm
    ("input", "post_attention", "kda_o_norm", "latent_expert_norm"), mean, max."""
    rows = []
    for i in range(num_layers):
        for label, suffix in NORMS.items():
            w = values.get(f"model.layers.{i}.{suffix}")
            if w is not None:
                w = np.asarray(w, np.float64)
                rows.append({"layer": i, "norm": label, "mean": float(w.mean()), "max": float(w.max())})
    df = pd.DataFrame(rows, columns=["layer", "norm", "mean", "max"])
    df.attrs["keys"] = ["layer", "norm"]
    return df
