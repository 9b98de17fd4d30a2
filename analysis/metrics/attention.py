"""MLA attention diagnostics: pure functions of a recorded trace (see DIAGNOSTICS.md).

MLA attention ``A`` is ``trace["mla.i.attn"]`` with axes [batch, head, query, key]; it is causal and
starts at position 0, so query row ``i`` sees the ``i + 1`` keys ``0..i``. Every per-sequence metric is
computed for each recorded sequence and averaged over the batch; layer indices are 0-based.

- Causal attention entropy (Zhai et al. 2023, "entropy collapse"): per row
  ``H_i = -sum_j A_ij log A_ij`` and normalised ``H_i / log(i + 1)`` (1 = uniform over the visible
  keys, 0 = one key). Row 0 has a single key, so its entropy is 0 and its normalisation ``log 1 = 0``
  is undefined: row 0 is skipped (NaN) and layer/head means run over rows ``1..T-1``.
- Attention sink (Gu et al. 2024): the mean attention key ``j`` receives from the queries that can
  see it, ``s_j = (1 / (T - j)) sum_{i >= j} A_ij`` (query 0 counts for key 0); the sink mass is
  ``s_0`` and the sink rate is the share of (layer, head) with ``s_0 > 0.3``. With very few tokens
  ``s_0`` is large by construction (with T = 2, s_0 >= 1/2): ``MIN_SINK_TOKENS`` says when it means
  something.
- Gated MLA: the mean output gate per head.

Traces recorded since issue 24 carry these per position for the whole text (``mla.i.entropy``, ``mla.i.sink``,
``mla.i.received``: computed by the recorder from q and k in query blocks, ``k3core.interp.attention_stats``); the full
map ``mla.i.attn`` is then only a window. Older traces have only the map: the same statistics are computed from it
(``attention_statistics``), so every table reads either.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.metrics.entropy import entropy
from analysis.metrics.tidy import tidy
from analysis.runs.missing_data import MissingTraceData
from k3core.interp.trace import Trace, names

SINK_THRESHOLD = 0.3
MIN_SINK_TOKENS = 16  # below this many keys the first-token mass is large by construction


def _check_attention(attn: np.ndarray) -> np.ndarray:
    attn = np.asarray(attn, dtype=np.float64)
    if attn.ndim < 2 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attention must be [..., query, key] with query == key, got shape {attn.shape}")
    return attn


def causal_row_entropy(attn: np.ndarray) -> np.ndarray:
    """Entropy of each attention row in nats, ``H_i = -sum_j A_ij log A_ij`` (0 log 0 = 0); [..., query]."""
    return entropy(_check_attention(attn), axis=-1)


def attention_received(attn: np.ndarray) -> np.ndarray:
    """Mean attention each key receives from the queries that can see it: ``s_j = sum_{i>=j} A_ij / (T - j)``.

    Input [..., query, key] (causal, square); output [..., key]. ``s_0`` is the first-token sink mass.
    """
    attn = _check_attention(attn)
    T = attn.shape[-1]
    lower = np.tril(np.ones((T, T), dtype=bool))
    column_sums = np.where(lower, attn, 0.0).sum(-2)
    return column_sums / (T - np.arange(T, dtype=np.float64))


def sink_rate(first_token_mass: np.ndarray, threshold: float = SINK_THRESHOLD) -> float:
    """Share of (layer, head) whose first-token mass exceeds ``threshold`` (Gu et al. 2024: 0.3)."""
    mass = np.asarray(first_token_mass, dtype=np.float64).ravel()
    if mass.size == 0:
        return float("nan")
    return float((mass > threshold).mean())


def _mla_attn_names(trace: Trace) -> list[tuple[int, str]]:
    return [(i, names.mla_attn(i)) for i in trace.layer_indices("mla") if names.mla_attn(i) in trace]


def statistic_layers(trace: Trace) -> list[int]:
    """MLA layers with attention statistics: the blocked whole-text arrays, or (older traces) a map from 0."""
    return [
        i for i in trace.layer_indices("mla") if names.mla_stat(i, "entropy") in trace or names.mla_attn(i) in trace
    ]


def attention_statistics(trace: Trace, layer: int) -> dict[str, np.ndarray]:
    """Per query and key of MLA layer ``layer``, each [batch, head, token] (float64):

    ``entropy`` H_i (nats), ``sink`` A_i0, ``received`` sum_{i >= j} A_ij; from the recorder's blocked arrays,
    or computed from the map ``mla.i.attn`` of an older trace (causal, starting at position 0).
    """
    if names.mla_stat(layer, "entropy") in trace:
        return {kind: np.asarray(trace[names.mla_stat(layer, kind)], dtype=np.float64)
                for kind in ("entropy", "sink", "received")}  # fmt: skip
    attn = _check_attention(trace[names.mla_attn(layer)])
    T = attn.shape[-1]
    return {
        "entropy": causal_row_entropy(attn),
        "sink": attn[..., 0],
        "received": np.where(np.tril(np.ones((T, T), dtype=bool)), attn, 0.0).sum(-2),
    }


def causal_normalised_entropy(entropy: np.ndarray) -> np.ndarray:
    """Row entropies normalised by their causal maximum, ``H_i / log(i + 1)`` over the last axis (query position i
    from 0: i + 1 visible keys); 1 means uniform over the keys ``0..i``, 0 all mass on one key. Position 0 (one key)
    is NaN. The one normalisation of causal rows, for traces' recorded entropies and a map's rows
    (``causal_row_entropy``) alike."""
    n_keys = np.arange(1, entropy.shape[-1] + 1, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.asarray(entropy, dtype=np.float64) / np.log(n_keys)
    out[..., 0] = np.nan
    return out


def mean_received(received_sum: np.ndarray) -> np.ndarray:
    """``s_j = sum_{i >= j} A_ij / (T - j)``: a key's summed attention over the T - j queries that see it."""
    T = received_sum.shape[-1]
    return np.asarray(received_sum, dtype=np.float64) / (T - np.arange(T, dtype=np.float64))


def has_attention(trace: Trace) -> bool:
    """Whether the trace holds MLA attention statistics (recorded with "mla", or older: "attn_probs")."""
    return bool(statistic_layers(trace))


def _require_attention(trace: Trace) -> list[int]:
    found = statistic_layers(trace)
    if not found:
        types = trace.meta.get("layer_types") or []
        if types and "MLA" not in types:
            why = "the model has no MLA layer"
        else:
            why = (
                "attention statistics were not recorded: record with 'mla' (the default) or, for the maps, record "
                "the MLA attention probabilities too (trace_run(..., what='all'))"
            )
        raise MissingTraceData(f"no MLA attention statistics in this trace: {why}")
    return found


def attention_tokens(trace: Trace) -> int:
    """The number of key positions the attention statistics cover (0 without them)."""
    found = statistic_layers(trace)
    return int(attention_statistics(trace, found[0])["entropy"].shape[-1]) if found else 0


def attention_entropy_table(trace: Trace) -> pd.DataFrame:
    """Per MLA layer and head: mean row entropy (nats) and mean causal-normalised entropy (rows 1..T-1).

    Columns: layer, head, entropy, entropy_norm, queries (rows averaged).
    """
    rows = []
    for layer in _require_attention(trace):
        full = attention_statistics(trace, layer)["entropy"]  # [batch, head, query]
        ent, norm = full[..., 1:], causal_normalised_entropy(full)[..., 1:]
        for h in range(full.shape[1]):
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "entropy": float(ent[:, h].mean()) if ent.shape[-1] else float("nan"),
                    "entropy_norm": float(np.nanmean(norm[:, h])) if norm.shape[-1] else float("nan"),
                    "queries": int(norm.shape[-1]),
                }
            )
    return tidy(pd.DataFrame(rows), keys=["layer", "head"], value="entropy_norm")


def entropy_by_position_table(trace: Trace) -> pd.DataFrame:
    """Normalised entropy per MLA layer, head and query position (mean over batch; row 0 skipped).

    Columns: layer, head, query, entropy_norm.
    """
    frames = []
    for layer in _require_attention(trace):
        norm = causal_normalised_entropy(attention_statistics(trace, layer)["entropy"]).mean(0)  # [head, query]
        H, T = norm.shape
        frames.append(
            pd.DataFrame(
                {
                    "layer": layer,
                    "head": np.repeat(np.arange(H), T - 1),
                    "query": np.tile(np.arange(1, T), H),
                    "entropy_norm": norm[:, 1:].ravel(),
                }
            )
        )
    return tidy(pd.concat(frames, ignore_index=True), keys=["layer", "head", "query"], value="entropy_norm")


def attention_sink_table(trace: Trace, threshold: float = SINK_THRESHOLD) -> pd.DataFrame:
    """Per MLA layer and head: first-token sink mass ``s_0`` and whether it exceeds ``threshold``.

    Columns: layer, head, first_token_mass, is_sink.
    """
    rows = []
    for layer in _require_attention(trace):
        received = mean_received(attention_statistics(trace, layer)["received"]).mean(0)  # [head, key]
        for h in range(received.shape[0]):
            mass = float(received[h, 0])
            rows.append({"layer": layer, "head": h, "first_token_mass": mass, "is_sink": mass > threshold})
    return tidy(pd.DataFrame(rows), keys=["layer", "head"], value="first_token_mass")


def attention_received_table(trace: Trace, max_keys: int = 32) -> pd.DataFrame:
    """Mean attention received per MLA layer, head and key position (first ``max_keys`` keys).

    Columns: layer, head, key, received; ``df.attrs["total_keys"]`` is the number of keys recorded.
    """
    frames = []
    for layer in _require_attention(trace):
        received = mean_received(attention_statistics(trace, layer)["received"]).mean(0)[:, :max_keys]
        H, K = received.shape
        frames.append(
            pd.DataFrame(
                {
                    "layer": layer,
                    "head": np.repeat(np.arange(H), K),
                    "key": np.tile(np.arange(K), H),
                    "received": received.ravel(),
                }
            )
        )
    table = tidy(pd.concat(frames, ignore_index=True), keys=["layer", "head", "key"], value="received")
    table.attrs["total_keys"] = attention_tokens(trace)
    return table


def mla_gate_table(trace: Trace) -> pd.DataFrame:
    """Mean output-gate value per MLA layer and head (``mla.i.gate``, gated MLA). Columns: layer, head, gate_mean."""
    rows = []
    for layer in trace.layer_indices("mla"):
        gate = trace.get(names.mla_gate(layer))
        if gate is None:
            continue
        means = np.asarray(gate, dtype=np.float64).mean(axis=(0, 1))
        rows += [{"layer": layer, "head": h, "gate_mean": float(m)} for h, m in enumerate(means)]
    if not rows:
        raise MissingTraceData("no MLA output gates in this trace (mla.i.gate): no gated MLA layer was recorded")
    return tidy(pd.DataFrame(rows), keys=["layer", "head"], value="gate_mean")
