"""KDA resting decay: the decay gate with zero input, per head and channel, and its half-life in tokens
(``analysis.metrics.kda_memory.half_life``, the one definition of KDA memory)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
import torch

from analysis.metrics.kda_memory import half_life
from k3core.modeling.config import K3Config
from k3core.ops.kda.gate import kda_decay_gate


def live_a_log(a_log: np.ndarray, num_heads: int) -> np.ndarray:
    """A_log as one value per live head. Accepts [H], Kimi Linear's [1, 1, H, 1] and the real K3
    checkpoint's zero padding (128 entries, the first H live); fewer than H entries is an error."""
    flat = np.asarray(a_log, dtype=np.float64).reshape(-1)
    if flat.size < num_heads:
        raise ValueError(f"A_log has {flat.size} entries, fewer than the {num_heads} KDA heads")
    return flat[:num_heads]


def resting_decay(
    a_log: np.ndarray, dt_bias: np.ndarray, num_heads: int, gate: str = "lower_bound", lower_bound: float = -5.0
) -> np.ndarray:
    """The KDA decay gate (``k3core.ops.kda.gate.kda_decay_gate``, in float64) with zero input, per head and
    channel, [H, d] float64:

        lower-bound gate (K3):         g0 = lb * sigmoid(exp(A_log[h]) * dt_bias[h, c])
        softplus gate (Kimi Linear):   g0 = -exp(A_log[h]) * softplus(dt_bias[h, c])

    A_log has one value per head (broadcast over that head's d channels, padding after the live heads
    ignored); dt_bias has H * d values. g0 = log alpha0 <= 0 is the log decay per token at rest."""
    a = torch.from_numpy(live_a_log(a_log, num_heads))[:, None]
    dt = torch.from_numpy(np.asarray(dt_bias, dtype=np.float64).reshape(num_heads, -1))
    return kda_decay_gate(dt, a, gate, float(lower_bound)).numpy()


def spread(x: np.ndarray) -> dict[str, float]:
    """Median and 10th / 90th percentiles over all entries (numpy's linear interpolation; with infinite
    entries the nearest rank, since interpolating between inf and inf is undefined)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    method = "linear" if np.isfinite(x).all() else "nearest"
    p10, med, p90 = np.percentile(x, [10, 50, 90], method=method)
    return {"median": float(med), "p10": float(p10), "p90": float(p90)}


def kda_tables(
    values: Mapping[str, np.ndarray],
    structure: pd.DataFrame,
    config: K3Config | None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per layer, per layer x head) resting-decay tables of the KDA layers.

    Layer columns: layer, heads, g0_mean, half_life_median, half_life_p10, half_life_p90 (over all the
    layer's H*d channels). Head columns: layer, head, A_log, g0_mean, half_life_median/p10/p90 (over the
    head's d channels). The head count is the config's (``kda_num_heads``), else dt_bias size / o_norm size.
    Without a config the gate form is unknown and the tables are empty."""
    layer_rows, head_rows = [], []
    if config is not None:
        for i in structure.loc[structure["mixer"] == "kda", "layer"]:
            a = values.get(f"model.layers.{i}.self_attn.A_log")
            dt = values.get(f"model.layers.{i}.self_attn.dt_bias")
            if a is None or dt is None:
                continue
            heads = int(config.kda_num_heads)
            g0 = resting_decay(a, dt, heads, config.kda_gate, config.kda_gate_lower_bound)
            hl = half_life(g0)
            s = spread(hl)
            layer_rows.append(
                {
                    "layer": int(i),
                    "heads": heads,
                    "g0_mean": float(g0.mean()),
                    "half_life_median": s["median"],
                    "half_life_p10": s["p10"],
                    "half_life_p90": s["p90"],
                }
            )
            a_live = live_a_log(a, heads)
            for h in range(heads):
                sh = spread(hl[h])
                head_rows.append(
                    {
                        "layer": int(i),
                        "head": h,
                        "A_log": float(a_live[h]),
                        "g0_mean": float(g0[h].mean()),
                        "half_life_median": sh["median"],
                        "half_life_p10": sh["p10"],
                        "half_life_p90": sh["p90"],
                    }
                )
    layers = pd.DataFrame(
        layer_rows, columns=["layer", "heads", "g0_mean", "half_life_median", "half_life_p10", "half_life_p90"]
    )
    heads = pd.DataFrame(
        head_rows, columns=["layer", "head", "A_log", "g0_mean", "half_life_median", "half_life_p10", "half_life_p90"]
    )
    layers.attrs["keys"] = ["layer"]
    heads.attrs["keys"] = ["layer", "head"]
    return layers, heads
