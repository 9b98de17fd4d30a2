"""Attention degradation diagnostics: pure functions of a recorded trace (see DIAGNOSTICS.md).

Conventions (T = tokens, D = hidden width, H = heads; layer indices are 0-based):

- MLA attention ``A`` is ``trace["mla.i.attn"]`` with axes [batch, head, query, key]; it is causal and
  starts at position 0, so query row ``i`` sees the ``i + 1`` keys ``0..i``.
- Hidden states are ``trace["hidden"]`` with axes [depth, batch, token, hidden]; depth ``l`` is the
  state entering layer ``l`` and the last depth is the final state (before the final RMSNorm). So
  layer ``l`` maps depth ``l`` (its input) to depth ``l + 1`` (its output). With AttnRes residuals the
  state entering layer ``l`` is that layer's attention-side depth mix, so two consecutive states differ by
  the layer's output *and* by the change of mix weights; with plain / scale-bias residuals they differ by
  exactly the layer's (scaled) outputs.
- Every per-sequence metric is computed for each recorded sequence and averaged over the batch.

Metrics and their sources:

- Causal attention entropy (Zhai et al. 2023, "entropy collapse"): per row
  ``H_i = -sum_j A_ij log A_ij`` and normalised ``H_i / log(i + 1)`` (1 = uniform over the visible
  keys, 0 = one key). Row 0 has a single key, so its entropy is 0 and its normalisation ``log 1 = 0``
  is undefined: row 0 is skipped (NaN) and layer/head means run over rows ``1..T-1``.
- Attention sink (Gu et al. 2024): the mean attention key ``j`` receives from the queries that can
  see it, ``s_j = (1 / (T - j)) sum_{i >= j} A_ij`` (query 0 counts for key 0); the sink mass is
  ``s_0`` and the sink rate is the share of (layer, head) with ``s_0 > 0.3``.
- Rank collapse (Dong et al. 2021): ``r = ||X - 1 mean_t(X)^T||_F / ||X||_F`` and the effective rank
  (Roy & Vetterli 2007) ``exp(H(sigma / sum sigma))`` of the centred states.
- Token uniformity: mean pairwise cosine similarity between distinct tokens.
- Layer redundancy: per-token cosine between a layer's input and output, Block Influence
  ``BI = 1 - cos`` (ShortGPT, Men et al. 2024), and linear CKA between them (Kornblith et al. 2019).
- Massive activations (Sun et al. 2024): the largest ``|h|`` per depth, where they sit
  (token, channel), and the ratio ``max |h| / median |h|``.
- KDA layers have no attention matrix: their counterparts are the state Frobenius norm and the
  effective rank of the final state ``S`` (per head, uncentred: ``S`` is a map, not a sample set).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from k3core.trace import Trace, names

SINK_THRESHOLD = 0.3
_EPS = 1e-12


class MissingTraceData(LookupError):
    """The trace lacks the arrays a metric needs (the message names them and how to record them)."""


# ----------------------------------------------------------------------------- attention (MLA)
def _check_attention(attn: np.ndarray) -> np.ndarray:
    attn = np.asarray(attn, dtype=np.float64)
    if attn.ndim < 2 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attention must be [..., query, key] with query == key, got shape {attn.shape}")
    return attn


def causal_row_entropy(attn: np.ndarray) -> np.ndarray:
    """Entropy of each attention row in nats, ``H_i = -sum_j A_ij log A_ij`` (0 log 0 = 0); [..., query]."""
    attn = _check_attention(attn)
    safe = np.where(attn > 0, attn, 1.0)
    return -(attn * np.log(safe)).sum(-1)


def causal_normalised_entropy(attn: np.ndarray) -> np.ndarray:
    """Row entropy normalised by its causal maximum, ``H_i / log(i + 1)``; row 0 (one key) is NaN.

    1 means uniform attention over the visible keys ``0..i``, 0 means all mass on one key.
    """
    ent = causal_row_entropy(attn)
    n_keys = np.arange(1, ent.shape[-1] + 1, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = ent / np.log(n_keys)
    out[..., 0] = np.nan
    return out


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


def has_attention(trace: Trace) -> bool:
    """Whether the trace holds MLA attention probabilities (recorded with what including "attn_probs")."""
    return bool(_mla_attn_names(trace))


def _require_attention(trace: Trace) -> list[tuple[int, str]]:
    found = _mla_attn_names(trace)
    if not found:
        raise MissingTraceData(
            "no MLA attention probabilities in this trace (mla.i.attn); the model has no "
            "MLA layer or the trace was recorded without 'attn_probs' (use what='all')"
        )
    return found


def attention_entropy_table(trace: Trace) -> pd.DataFrame:
    """Per MLA layer and head: mean row entropy (nats) and mean causal-normalised entropy (rows 1..T-1).

    Columns: layer, head, entropy, entropy_norm, queries (rows averaged).
    """
    rows = []
    for layer, name in _require_attention(trace):
        attn = trace[name]  # [batch, head, query, key]
        ent = causal_row_entropy(attn)[..., 1:]
        norm = causal_normalised_entropy(attn)[..., 1:]
        for h in range(attn.shape[1]):
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "entropy": float(ent[:, h].mean()) if ent.shape[-1] else float("nan"),
                    "entropy_norm": float(np.nanmean(norm[:, h])) if norm.shape[-1] else float("nan"),
                    "queries": int(norm.shape[-1]),
                }
            )
    return _tidy(pd.DataFrame(rows), keys=["layer", "head"], value="entropy_norm")


def entropy_by_position_table(trace: Trace) -> pd.DataFrame:
    """Normalised entropy per MLA layer, head and query position (mean over batch; row 0 skipped).

    Columns: layer, head, query, entropy_norm.
    """
    frames = []
    for layer, name in _require_attention(trace):
        norm = causal_normalised_entropy(trace[name]).mean(0)  # [head, query]
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
    return _tidy(pd.concat(frames, ignore_index=True), keys=["layer", "head", "query"], value="entropy_norm")


def attention_sink_table(trace: Trace, threshold: float = SINK_THRESHOLD) -> pd.DataFrame:
    """Per MLA layer and head: first-token sink mass ``s_0`` and whether it exceeds ``threshold``.

    Columns: layer, head, first_token_mass, is_sink.
    """
    rows = []
    for layer, name in _require_attention(trace):
        received = attention_received(trace[name]).mean(0)  # [head, key]
        for h in range(received.shape[0]):
            mass = float(received[h, 0])
            rows.append({"layer": layer, "head": h, "first_token_mass": mass, "is_sink": mass > threshold})
    return _tidy(pd.DataFrame(rows), keys=["layer", "head"], value="first_token_mass")


def attention_received_table(trace: Trace, max_keys: int = 32) -> pd.DataFrame:
    """Mean attention received per MLA layer, head and key position (first ``max_keys`` keys).

    Columns: layer, head, key, received.
    """
    frames = []
    for layer, name in _require_attention(trace):
        received = attention_received(trace[name]).mean(0)[:, :max_keys]  # [head, key]
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
    return _tidy(pd.concat(frames, ignore_index=True), keys=["layer", "head", "key"], value="received")


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
    return _tidy(pd.DataFrame(rows), keys=["layer", "head"], value="gate_mean")


# ----------------------------------------------------------------------------- hidden states
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
    return float(np.exp(-(p * np.log(p)).sum()))


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
    """The ``k`` largest ``|x|`` entries of X [token, hidden] as (token, channel, signed value), largest first."""
    x = _as_2d(x)
    flat = np.abs(x).ravel()
    k = min(k, flat.size)
    idx = np.argpartition(-flat, k - 1)[:k]
    idx = idx[np.argsort(-flat[idx], kind="stable")]
    tokens, channels = np.unravel_index(idx, x.shape)
    return [(int(t), int(c), float(x[t, c])) for t, c in zip(tokens, channels)]


def max_median_ratio(x: np.ndarray) -> float:
    """``max |x| / median |x|`` (Sun et al. 2024 flag activations ~1000x the median)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    med = np.median(a)
    return float(a.max() / med) if med > 0 else float("inf")


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
    token uniformity, each averaged over the batch. Columns: depth, depth_label, ratio, effective_rank,
    token_cosine."""
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
    return _tidy(pd.DataFrame(rows), keys=["depth"], value="ratio")


def layer_redundancy_table(trace: Trace) -> pd.DataFrame:
    """Per layer l (input = depth l, output = depth l + 1): mean token cosine, Block Influence and linear CKA.

    Columns: layer, layer_type, cosine, block_influence, cka.
    """
    h = _hidden(trace)
    types = trace.meta.get("layer_types") or []
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
    return _tidy(pd.DataFrame(rows), keys=["layer"], value="block_influence")


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
    return _tidy(pd.DataFrame(rows), keys=["depth", "rank"], value="abs_value")


# ----------------------------------------------------------------------------- KDA state counterparts
def kda_state_table(trace: Trace) -> pd.DataFrame:
    """Per KDA layer and head: final-state Frobenius norm ``||S||_F`` and effective rank of ``S`` (uncentred,
    mean over batch). Columns: layer, head, state_norm, state_effective_rank, state_dim."""
    rows = []
    for layer in trace.layer_indices("kda"):
        s = trace.get(names.kda_final_state(layer))
        if s is None:
            continue
        s = np.asarray(s, dtype=np.float64)  # [batch, head, key, value]
        for h in range(s.shape[1]):
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "state_norm": float(np.mean([np.linalg.norm(m) for m in s[:, h]])),
                    "state_effective_rank": float(np.mean([effective_rank(m, center=False) for m in s[:, h]])),
                    "state_dim": int(min(s.shape[2], s.shape[3])),
                }
            )
    if not rows:
        raise MissingTraceData("no KDA final states in this trace (kda.i.final_state); record with 'kda'")
    return _tidy(pd.DataFrame(rows), keys=["layer", "head"], value="state_effective_rank")


def kda_state_norm_table(trace: Trace) -> pd.DataFrame:
    """KDA state Frobenius norm over time (at chunk ends) per layer and head, mean over batch.

    Columns: layer, head, step, position, state_norm.
    """
    frames = []
    for layer in trace.layer_indices("kda"):
        norms = trace.get(names.kda_state_norm(layer))
        if norms is None:
            continue
        norms = np.asarray(norms, dtype=np.float64).mean(0)  # [step, head]
        steps = trace.get(names.kda_state_steps(layer))
        pos = np.asarray(steps) if steps is not None else np.arange(1, norms.shape[0] + 1)
        S, H = norms.shape
        frames.append(
            pd.DataFrame(
                {
                    "layer": layer,
                    "head": np.tile(np.arange(H), S),
                    "step": np.repeat(np.arange(S), H),
                    "position": np.repeat(pos, H),
                    "state_norm": norms.ravel(),
                }
            )
        )
    if not frames:
        raise MissingTraceData("no KDA state norms in this trace (kda.i.state_norm); record with 'kda'")
    return _tidy(pd.concat(frames, ignore_index=True), keys=["layer", "head", "step"], value="state_norm")


def _tidy(df: pd.DataFrame, keys: list[str], value: str | None = None) -> pd.DataFrame:
    """Mark the key (index-like) columns and the main value column, so that comparisons can align two runs'
    tables (``df.attrs["keys"]``, ``df.attrs["value"]``)."""
    df.attrs["keys"] = list(keys)
    if value is not None:
        df.attrs["value"] = value
    return df
