"""How much each KDA layer's memory holds, measured from a trace (``kda.*`` arrays).

- decay alpha = exp(g) per token, head and key channel; the memory as a half-life ``ln 2 / (-g)`` tokens
  (``half_life``: the one definition of KDA memory, also used for the resting decay of ``analysis.weights``;
  inf when alpha = 1); beside it the reference's memory horizon ``1 / (1 - alpha)`` tokens (``memory_horizon``:
  the mean lifetime of a write, docs/K3_REFERENCE.md), about 1.44 half-lives for slow decays; per channel the
  geometric-mean decay ``alpha_eff = exp(mean_t g)``, its half-life and its horizon;
- the share of decays near the gate's lower bound (``g < 0.9 * lower_bound``);
- the delta-rule write strength beta;
- the state S: its Frobenius norm ``||S||_F`` at chunk ends over time, and the effective rank
  ``exp(H(sigma / sum sigma))`` of the final state (uncentred: S is a map, not a sample set); these are
  also the KDA counterparts of the attention degradation diagnostics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

from analysis.metrics.hidden_states import effective_rank
from analysis.metrics.tidy import tidy
from k3core.interp.trace import Trace, names

LN2 = math.log(2.0)
NEAR_LOWER_BOUND = 0.9  # "near the lower bound": g < 0.9 * lower_bound


def half_life(g: np.ndarray) -> np.ndarray:
    """Tokens until a channel's memory halves: alpha^n = 1/2 with alpha = exp(g), so n = ln 2 / (-g).

    g = 0 (alpha = 1, no forgetting) gives inf; g > 0 is not a decay and raises.
    """
    g = np.asarray(g, dtype=np.float64)
    if np.any(g > 0):
        raise ValueError("log decay g must be <= 0 (alpha = exp(g) <= 1)")
    with np.errstate(divide="ignore"):
        return np.where(g < 0, LN2 / np.where(g < 0, -g, 1.0), np.inf)


def memory_horizon(g: np.ndarray) -> np.ndarray:
    """The reference's memory horizon 1 / (1 - alpha) tokens with alpha = exp(g): the expected lifetime
    sum_n alpha^n of a write (n = 0, 1, ...), computed as -1 / expm1(g) so slow decays keep their digits.

    g = 0 (alpha = 1, no forgetting) gives inf; g > 0 is not a decay and raises. For small -g it is about
    1 / (-g) = half_life / ln 2.
    """
    g = np.asarray(g, dtype=np.float64)
    if np.any(g > 0):
        raise ValueError("log decay g must be <= 0 (alpha = exp(g) <= 1)")
    with np.errstate(divide="ignore"):
        return np.where(g < 0, -1.0 / np.expm1(np.where(g < 0, g, -1.0)), np.inf)


def half_life_quantiles(g: np.ndarray, qs: Iterable[float]) -> np.ndarray:
    """Quantiles of the half-life ln 2 / (-g) over all entries of g.

    The half-life is increasing in g, so its q-quantile is the half-life of g's q-quantile; taking g's
    quantile as an order statistic ("inverted_cdf") keeps this exact and copes with infinite half-lives.
    """
    g = np.asarray(g, dtype=np.float64).ravel()
    if g.size == 0:
        raise ValueError("no decay values")
    return half_life(np.minimum(np.quantile(g, list(qs), method="inverted_cdf"), 0.0))


def _kda_layers(trace: Trace) -> list[int]:
    return [i for i in trace.layer_indices("kda") if names.kda_g(i) in trace]


def _kda_gate_form(trace: Trace) -> tuple[str, float]:
    cfg = trace.config
    return cfg.get("kda_gate", "lower_bound"), float(cfg.get("kda_gate_lower_bound", -5.0))


def kda_channel_decay(trace: Trace) -> pd.DataFrame:
    """Per KDA layer, head and key channel: mean log decay over tokens and batch, and what it implies.

    alpha_eff = exp(mean_t g) (a run of n tokens decays by exp(n mean g), so this is the per-token
    geometric-mean decay); half_life = ln 2 / (-mean_t g) tokens and horizon = 1 / (1 - alpha_eff) tokens (both inf
    when alpha_eff = 1). Columns: layer, head, channel, g_mean, alpha, half_life, horizon.
    """
    frames = []
    for i in _kda_layers(trace):
        g = np.asarray(trace[names.kda_g(i)], dtype=np.float64)  # [B, T, H, d]
        g_mean = g.reshape(-1, g.shape[-2], g.shape[-1]).mean(0)  # [H, d]
        H, d = g_mean.shape
        frames.append(
            pd.DataFrame(
                dict(
                    layer=i,
                    head=np.repeat(np.arange(H), d),
                    channel=np.tile(np.arange(d), H),
                    g_mean=g_mean.ravel(),
                    alpha=np.exp(g_mean).ravel(),
                    half_life=half_life(np.minimum(g_mean, 0)).ravel(),
                    horizon=memory_horizon(np.minimum(g_mean, 0)).ravel(),
                )
            )
        )
    return (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["layer", "head", "channel", "g_mean", "alpha", "half_life", "horizon"])
    )


def near_lower_bound_fraction(g: np.ndarray, lower_bound: float, near: float = NEAR_LOWER_BOUND) -> float:
    """Share of decay entries with g < near * lower_bound (lower_bound < 0; near = 0.9: within 10% of it)."""
    if lower_bound >= 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    g = np.asarray(g)
    return float((g < near * lower_bound).mean()) if g.size else float("nan")


def kda_decay_stats(trace: Trace, near: float = NEAR_LOWER_BOUND) -> pd.DataFrame:
    """Per KDA layer and head: decay summary over tokens and channels.

    Columns: layer, head, g_mean, alpha_mean (mean of exp(g)), half_life_median / half_life_p10 / half_life_p90
    (quantiles of ln 2 / (-g) over every token and channel; inf when g = 0), frac_near_lb
    (share of g < near * lower_bound; NaN for the softplus gate form, which has no lower bound).
    """
    form, lb = _kda_gate_form(trace)
    rows = []
    for i in _kda_layers(trace):
        g = np.asarray(trace[names.kda_g(i)], dtype=np.float64)
        for h in range(g.shape[2]):
            gh = g[:, :, h, :].ravel()
            p10, p50, p90 = half_life_quantiles(gh, (0.1, 0.5, 0.9))
            rows.append(
                dict(
                    layer=i,
                    head=h,
                    g_mean=gh.mean(),
                    alpha_mean=np.exp(gh).mean(),
                    half_life_median=p50,
                    half_life_p10=p10,
                    half_life_p90=p90,
                    frac_near_lb=near_lower_bound_fraction(gh, lb, near) if form == "lower_bound" else np.nan,
                )
            )
    return pd.DataFrame(
        rows,
        columns=[
            "layer",
            "head",
            "g_mean",
            "alpha_mean",
            "half_life_median",
            "half_life_p10",
            "half_life_p90",
            "frac_near_lb",
        ],
    )


def kda_beta_stats(trace: Trace, by: str = "head") -> pd.DataFrame:
    """Write strength beta over tokens per KDA layer and head (``by="head"``) or per layer with all heads
    pooled (``by="layer"``): mean, std, p10, median, p90, min, max."""
    if by not in ("head", "layer"):
        raise ValueError(f"by must be 'head' or 'layer', got {by!r}")
    rows = []
    for i in _kda_layers(trace):
        beta = np.asarray(trace[names.kda_beta(i)], dtype=np.float64)  # [B, T, H]
        groups = [(h, beta[..., h].ravel()) for h in range(beta.shape[-1])] if by == "head" else [(None, beta.ravel())]
        for h, b in groups:
            row = dict(layer=i, head=h) if by == "head" else dict(layer=i)
            row.update(
                mean=b.mean(),
                std=b.std(),
                p10=np.quantile(b, 0.1),
                median=np.median(b),
                p90=np.quantile(b, 0.9),
                min=b.min(),
                max=b.max(),
            )
            rows.append(row)
    cols = ["layer", "head"] if by == "head" else ["layer"]
    return pd.DataFrame(rows, columns=cols + ["mean", "std", "p10", "median", "p90", "min", "max"])


def kda_state_norms(trace: Trace) -> pd.DataFrame:
    """Frobenius norm ||S||_F of each KDA head's state at chunk ends, mean over the recorded batch (empty
    without ``kda.i.state_norm`` arrays).

    Columns: layer, head, step, token (the position the state has absorbed; 1, 2, ... when the trace has
    no ``kda.i.state_steps``), state_norm.
    """
    frames = []
    for i in trace.layer_indices("kda"):
        if names.kda_state_norm(i) not in trace:
            continue
        norms = np.asarray(trace[names.kda_state_norm(i)], dtype=np.float64).mean(0)  # [step, H]
        S, H = norms.shape
        steps = trace.get(names.kda_state_steps(i))
        tokens = np.asarray(steps) if steps is not None else np.arange(1, S + 1)
        frames.append(
            pd.DataFrame(
                dict(
                    layer=i,
                    head=np.tile(np.arange(H), S),
                    step=np.repeat(np.arange(S), H),
                    token=np.repeat(tokens, H),
                    state_norm=norms.ravel(),
                )
            )
        )
    columns = ["layer", "head", "step", "token", "state_norm"]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    return tidy(table, keys=["layer", "head", "step"], value="state_norm")


def kda_state_rank(trace: Trace) -> pd.DataFrame:
    """Per KDA layer and head, mean over the batch: effective rank exp(H(sigma / sum sigma)) of the final
    state S (d x d, uncentred) and its Frobenius norm (empty without ``kda.i.final_state`` arrays).

    Columns: layer, head, effective_rank, head_dim (d, the largest possible rank), frobenius.
    """
    rows = []
    for i in trace.layer_indices("kda"):
        if names.kda_final_state(i) not in trace:
            continue
        S = np.asarray(trace[names.kda_final_state(i)], dtype=np.float64)  # [B, H, d, d]
        for h in range(S.shape[1]):
            rows.append(
                dict(
                    layer=i,
                    head=h,
                    effective_rank=float(np.mean([effective_rank(m, center=False) for m in S[:, h]])),
                    head_dim=int(min(S.shape[-2], S.shape[-1])),
                    frobenius=float(np.linalg.norm(S[:, h], axis=(-2, -1)).mean()),
                )
            )
    table = pd.DataFrame(rows, columns=["layer", "head", "effective_rank", "head_dim", "frobenius"])
    return tidy(table, keys=["layer", "head"], value="effective_rank")


def kda_layer_summary(trace: Trace) -> pd.DataFrame:
    """One row per KDA layer: median half-life over heads' medians, mean near-bound share, mean beta,
    mean final-state effective rank (the measured side of the allocated-vs-measured table)."""
    decay, beta, rank = kda_decay_stats(trace), kda_beta_stats(trace), kda_state_rank(trace)
    if decay.empty:
        return pd.DataFrame(columns=["layer", "half_life_median", "frac_near_lb", "beta_mean", "state_rank"])
    out = decay.groupby("layer").agg(
        half_life_median=("half_life_median", "median"), frac_near_lb=("frac_near_lb", "mean")
    )
    out["beta_mean"] = beta.groupby("layer")["mean"].mean()
    out["state_rank"] = rank.groupby("layer")["effective_rank"].mean() if not rank.empty else np.nan
    return out.reset_index()
