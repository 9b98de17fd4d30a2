"""KDA implicit attention beside MLA attention: pure functions of a recorded trace (docs/DIAGNOSTICS.md, "KDA implicit
attention").

KDA heads' statistics are the recorder's ``blocks.i.kda.attn.*`` arrays (``k3core.interp.kda_attention_stats``: on
|A| normalised per query, with the negative share and the signed row sum); MLA heads' are
``analysis.metrics.attention.attention_statistics``. Both are read the same way here, so one table holds every head
with its layer kind. The null reference of each statistic is uniform causal attention (query t spreads 1 / (t + 1)
over its t + 1 keys): normalised entropy 1, mean attention received by key j ``(1 / (T - j)) sum_{t >= j} 1 / (t + 1)``
(first-token mass ``H_T / T``, H_T the harmonic number), half-mass distance about t / 2.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.metrics import attention as at
from analysis.metrics.tidy import tidy
from analysis.runs.missing_data import MissingTraceData
from k3core.interp.trace import Trace, names


def kda_statistic_layers(trace: Trace) -> list[int]:
    """KDA layers with implicit-attention statistics (recorded with "kda_attn")."""
    return [i for i in trace.layer_indices("kda") if names.kda_attn_stat(i, "entropy") in trace]


def kda_map_layers(trace: Trace) -> list[int]:
    """KDA layers with a window map (recorded with "attn_probs")."""
    return [i for i in trace.layer_indices("kda") if names.kda_attn(i) in trace]


def kda_statistics(trace: Trace, layer: int) -> dict[str, np.ndarray]:
    """The recorded per-position statistics of KDA layer ``layer`` (float64), as ``attention_statistics``'s for MLA:
    entropy, sink, received [batch, head, token], plus negative, row_sum, half_distance; distance [batch, head,
    position bin, distance bin] and distance_edges."""
    kinds = ("entropy", "sink", "received", "negative", "row_sum", "half_distance", "distance", "distance_edges")
    return {kind: np.asarray(trace[names.kda_attn_stat(layer, kind)], dtype=np.float64) for kind in kinds}


def uniform_received(T: int) -> np.ndarray:
    """Mean attention key j receives under uniform causal attention: ``(1 / (T - j)) sum_{t=j}^{T-1} 1 / (t + 1)``."""
    inv = 1.0 / np.arange(1, T + 1, dtype=np.float64)
    tail = np.cumsum(inv[::-1])[::-1]  # sum_{t >= j} 1 / (t + 1)
    return tail / (T - np.arange(T, dtype=np.float64))


def _kind_statistics(trace: Trace) -> list[tuple[str, int, dict[str, np.ndarray]]]:
    out = [("MLA", i, at.attention_statistics(trace, i)) for i in at.statistic_layers(trace)]
    out += [("KDA", i, kda_statistics(trace, i)) for i in kda_statistic_layers(trace)]
    if not any(kind == "KDA" for kind, _, _ in out):
        raise MissingTraceData(
            "no KDA implicit-attention statistics in this trace: record with 'kda_attn' (in what='all'; in the app, "
            "'Record attention maps and KDA implicit attention')"
        )
    return sorted(out, key=lambda x: x[1])


def head_statistics_table(trace: Trace) -> pd.DataFrame:
    """Per layer and head of both kinds: mean causal-normalised entropy (queries 1..T-1), first-token mass s_0
    (mean attention received by key 0), and for KDA heads the mean negative share, row sum and half-mass distance
    (NaN for MLA). Columns: kind, layer, head, entropy_norm, first_token_mass, is_sink, negative, row_sum,
    half_distance; ``attrs["tokens"]``, ``attrs["null_first_token_mass"]`` (uniform causal attention)."""
    rows, T = [], 0
    for kind, layer, stats in _kind_statistics(trace):
        norm = at.causal_normalised_entropy(stats["entropy"])[..., 1:]
        sink = at.mean_received(stats["received"])[..., 0]
        T = stats["entropy"].shape[-1]
        for h in range(stats["entropy"].shape[1]):
            extra = {
                c: float(stats[c][:, h].mean()) if kind == "KDA" else np.nan
                for c in ("negative", "row_sum", "half_distance")
            }
            mass = float(sink[:, h].mean())
            rows.append(
                {
                    "kind": kind,
                    "layer": layer,
                    "head": h,
                    "entropy_norm": float(np.nanmean(norm[:, h])) if norm.shape[-1] else np.nan,
                    "first_token_mass": mass,
                    "is_sink": mass > at.SINK_THRESHOLD,
                    **extra,
                }
            )
    table = tidy(pd.DataFrame(rows), keys=["layer", "head"], value="entropy_norm")
    table.attrs.update(tokens=T, null_first_token_mass=float(uniform_received(T)[0]) if T else np.nan)
    return table


def received_by_kind_table(trace: Trace, max_keys: int = 32) -> pd.DataFrame:
    """Mean attention received per key position (first ``max_keys``), mean over heads and batch, per layer of both
    kinds, with the uniform causal reference. Columns: kind, layer, key, received, uniform."""
    frames = []
    for kind, layer, stats in _kind_statistics(trace):
        received = at.mean_received(stats["received"]).mean((0, 1))[:max_keys]
        null = uniform_received(stats["received"].shape[-1])[:max_keys]
        frames.append(
            pd.DataFrame(
                {"kind": kind, "layer": layer, "key": np.arange(len(received)), "received": received, "uniform": null}
            )
        )
    return tidy(pd.concat(frames, ignore_index=True), keys=["layer", "key"], value="received")


def distance_profile_table(trace: Trace) -> pd.DataFrame:
    """KDA's |A| share by distance bin for each position bin (mean over heads, batch and the bin's queries).
    Columns: layer, position (bin start), distance (bin start), share."""
    edges_pos = np.asarray(trace[names.POSITION_BINS])
    frames = []
    for kind, layer, stats in _kind_statistics(trace):
        if kind != "KDA":
            continue
        counts = np.diff(edges_pos).astype(np.float64)
        share = stats["distance"].mean((0, 1)) / counts[:, None]  # [position bin, distance bin]
        dist = stats["distance_edges"][:-1]
        P, D = share.shape
        frames.append(
            pd.DataFrame(
                {
                    "layer": layer,
                    "position": np.repeat(edges_pos[:-1], D),
                    "distance": np.tile(dist, P),
                    "share": share.ravel(),
                }
            )
        )
    return tidy(pd.concat(frames, ignore_index=True), keys=["layer", "position", "distance"], value="share")


def reach_table(trace: Trace, heads: pd.DataFrame) -> pd.DataFrame:
    """Per KDA layer and head: the reach (mean half-mass distance over queries, and the median) beside the resting
    half-life read from the weights (``heads``: ``analysis.weights.decay.kda_tables``' per-head table).
    Columns: layer, head, reach_mean, reach_median, half_life_median."""
    rows = []
    for layer in kda_statistic_layers(trace):
        half = kda_statistics(trace, layer)["half_distance"]
        for h in range(half.shape[1]):
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "reach_mean": float(half[:, h].mean()),
                    "reach_median": float(np.median(half[:, h])),
                }
            )
    if not rows:
        raise MissingTraceData("no KDA implicit-attention statistics in this trace: record with 'kda_attn'")
    table = pd.DataFrame(rows).merge(heads[["layer", "head", "half_life_median"]], on=["layer", "head"], how="left")
    return tidy(table, keys=["layer", "head"], value="reach_mean")


def kda_map(trace: Trace, layer: int, head: int | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The window map of KDA layer ``layer`` (mean over batch; one head, or the mean over heads), its mass before the
    window per query, and the window [start, stop)."""
    if names.kda_attn(layer) not in trace:
        raise MissingTraceData(f"no KDA attention map of layer {layer}: record with 'attn_probs'")
    attn = np.asarray(trace[names.kda_attn(layer)], dtype=np.float64).mean(0)
    before = np.asarray(trace[names.kda_attn_stat(layer, "before")], dtype=np.float64).mean(0)
    pick = slice(None) if head is None else slice(head, head + 1)
    window = list(trace.meta.get("attn_window", [0, attn.shape[-1]]))
    return attn[pick].mean(0), before[pick].mean(0), window
