"""Null references: what a statistic reads when nothing was learned, so a figure can show chance beside the value.

- Uniform causal attention (query i spreads 1/(i+1) over keys 0..i): normalised entropy 1 at every query; first-token
  mass s_0 = (1/T) sum_{i<T} 1/(i+1) = H_T / T (H_T the T-th harmonic number); attention received by key j, mean
  over the T - j queries that see it, (H_T - H_j) / (T - j).
- Perfectly balanced routing at the view's token count: each of T tokens picks k of E experts uniformly at random
  without replacement, so each count c_e ~ Binomial(T, k/E) with the total T k fixed. Closed forms: the share
  c_e / (T k) has mean 1/E and standard deviation sqrt(p (1 - p) / T) / k with p = k / E; E[CV^2] = (1 - p) / (T p)
  (the population variance of exchangeable counts with a fixed sum is Var c_e). MaxVio has no simple closed form: it
  is simulated (``balanced_routing_floor``, seeded), and CV is simulated alongside for its interval.
- Independence of two experts' choices: the share of tokens choosing both is p_i p_j (p_i the diagonal share).
- Chance recall: a guess uniform over V candidates is right with probability 1/V; an observed accuracy of n trials
  carries its Wilson interval (``analysis.metrics.intervals.wilson_interval``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

#: a value within this relative distance of a reference level is said, in words, to sit at that level
AT_REFERENCE = 0.25


def harmonic(n: int | np.ndarray) -> np.ndarray:
    """H_n = sum_{m=1..n} 1/m (H_0 = 0), elementwise."""
    n = np.asarray(n, dtype=np.int64)
    top = int(n.max(initial=0))
    cumulative = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, top + 1, dtype=np.float64))])
    return cumulative[n]


def uniform_first_token_mass(tokens: int) -> float:
    """First-token mass of uniform causal attention over ``tokens`` queries: H_T / T."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    return float(harmonic(tokens) / tokens)


def uniform_received(tokens: int, keys: np.ndarray | None = None) -> np.ndarray:
    """Attention received by key j under uniform causal attention, mean over the queries i >= j that see it:
    (H_T - H_j) / (T - j), for ``keys`` (default 0..T-1)."""
    j = np.arange(tokens) if keys is None else np.asarray(keys, dtype=np.int64)
    if j.size and (j.min() < 0 or j.max() >= tokens):
        raise ValueError(f"keys must lie in 0..{tokens - 1}")
    return (harmonic(tokens) - harmonic(j)) / (tokens - j)


def uniform_entropy_norm(queries: np.ndarray) -> np.ndarray:
    """Normalised entropy H_i / log(i + 1) of uniform causal attention: 1 at every query i >= 1 (NaN at 0)."""
    q = np.asarray(queries)
    return np.where(q >= 1, 1.0, np.nan)


def independent_coactivation(diagonal_share: np.ndarray) -> np.ndarray:
    """Share of tokens choosing both i and j if the two choices were independent: p_i p_j (the matrix of the
    outer product of the diagonal shares)."""
    p = np.asarray(diagonal_share, dtype=np.float64)
    return np.outer(p, p)


@dataclass(frozen=True)
class RoutingFloor:
    """MaxVio, CV and per-expert load share under perfectly balanced routing of ``tokens`` tokens, k of E experts:
    simulated means and 95% intervals (2.5th-97.5th percentile) over ``draws`` seeded draws, and the closed forms."""

    tokens: int
    k: int
    experts: int
    draws: int
    max_vio_mean: float
    max_vio_lo: float
    max_vio_hi: float
    cv_mean: float
    cv_lo: float
    cv_hi: float
    cv_rms_closed_form: float  # sqrt((1 - p) / (T p)), p = k / E
    share_lo: float  # 95% interval of one expert's share c_e / (T k)
    share_hi: float
    share_sd_closed_form: float  # sqrt(p (1 - p) / T) / k

    def max_vio_within(self, value: float) -> bool:
        """Whether a measured MaxVio lies within what balanced routing gives by sampling alone."""
        return bool(value <= self.max_vio_hi)

    def cv_within(self, value: float) -> bool:
        return bool(value <= self.cv_hi)


#: above this many (token, expert) cells per draw, the counts are drawn from a multinomial instead (see below)
EXACT_CELLS = 1_000_000


def balanced_counts(tokens: int, k: int, experts: int, draws: int, seed: int = 0) -> np.ndarray:
    """[draws, experts] load counts of perfectly balanced routing: each token picks k distinct experts uniformly.

    Up to EXACT_CELLS tokens x experts, drawn exactly (a uniform k-subset per token). Beyond, the T k assignments
    are drawn as a multinomial over E equal cells and their spread around T k / E scaled by
    sqrt((1 - k/E) / (1 - 1/E)), the ratio of the exact to the multinomial variance (counts rounded; a 100K-token
    text of a 384-expert model in milliseconds)."""
    rng = np.random.default_rng(seed)
    if tokens * experts > EXACT_CELLS:
        multi = rng.multinomial(tokens * k, np.full(experts, 1.0 / experts), size=draws).astype(np.float64)
        mean = tokens * k / experts
        scale = np.sqrt((1 - k / experts) / (1 - 1 / experts)) if experts > 1 else 0.0
        return np.clip(np.rint(mean + (multi - mean) * scale), 0, tokens).astype(np.int64)
    counts = np.zeros((draws, experts), dtype=np.int64)
    block = max(1, 2_000_000 // max(tokens * experts, 1))
    for start in range(0, draws, block):
        n = min(block, draws - start)
        # k distinct experts per token: the k smallest of E uniform keys (a uniform random k-subset)
        picks = np.argpartition(rng.random((n, tokens, experts)), k - 1, axis=-1)[..., :k] if k < experts else None
        if picks is None:
            counts[start : start + n] = tokens
            continue
        flat = picks.reshape(n, -1) + experts * np.arange(n)[:, None]
        counts[start : start + n] = np.bincount(flat.ravel(), minlength=n * experts).reshape(n, experts)
    return counts


@lru_cache(maxsize=64)
def balanced_routing_floor(tokens: int, k: int, experts: int, draws: int = 400, seed: int = 0) -> RoutingFloor:
    """The sampling floor of the balance statistics at ``tokens`` tokens (module docstring), simulated."""
    from k3core.training.load_stats import moe_load_stats

    if tokens < 1 or not 1 <= k <= experts:
        raise ValueError(f"need tokens >= 1 and 1 <= k <= experts, got {tokens}, {k}, {experts}")
    counts = balanced_counts(tokens, k, experts, draws, seed)
    stats = [moe_load_stats(c.astype(np.float64)) for c in counts]
    max_vio = np.array([s["max_vio"] for s in stats])
    cv = np.array([s["cv"] for s in stats])
    shares = (counts / (tokens * k)).ravel()
    p = k / experts
    return RoutingFloor(
        tokens=tokens,
        k=k,
        experts=experts,
        draws=draws,
        max_vio_mean=float(max_vio.mean()),
        max_vio_lo=float(np.percentile(max_vio, 2.5)),
        max_vio_hi=float(np.percentile(max_vio, 97.5)),
        cv_mean=float(cv.mean()),
        cv_lo=float(np.percentile(cv, 2.5)),
        cv_hi=float(np.percentile(cv, 97.5)),
        cv_rms_closed_form=float(np.sqrt((1 - p) / (tokens * p))) if p < 1 else 0.0,
        share_lo=float(np.percentile(shares, 2.5)),
        share_hi=float(np.percentile(shares, 97.5)),
        share_sd_closed_form=float(np.sqrt(p * (1 - p) / tokens) / k),
    )


def chance_recall(candidates: int) -> float:
    """Accuracy of a guess uniform over ``candidates`` answers: 1 / V."""
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1, got {candidates}")
    return 1.0 / candidates


def chance_interval(candidates: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """The accuracies a chance guesser (right with probability 1/V) reaches in ``trials`` tries, central ``level``
    interval: the binomial quantiles of Binomial(n, 1/V), divided by n (exact, from the pmf)."""
    p, n = chance_recall(candidates), int(trials)
    if n < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if p == 1:
        return 1.0, 1.0
    m = np.arange(n + 1)
    log_choose = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in m])
    log_pmf = log_choose + np.log(p) * m + np.log1p(-p) * (n - m)  # the binomial pmf, in logs
    cdf = np.cumsum(np.exp(log_pmf))
    tail = (1 - level) / 2
    lo = int(np.searchsorted(cdf, tail))
    hi = int(np.searchsorted(cdf, 1 - tail))
    return lo / n, min(hi, n) / n


def with_chance_band(df: Any, trials: str, level: float = 0.95) -> Any:
    """``df`` (columns accuracy, chance and ``trials``) with each row's chance interval (``chance_interval`` at
    V = 1 / chance and that row's trial count) as chance_low / chance_high, and at_chance = accuracy <= chance_high:
    the rows a guesser would reach as often as not."""
    bands = [chance_interval(round(1 / float(c)), int(n), level) for c, n in zip(df["chance"], df[trials], strict=True)]
    low = [b[0] for b in bands]
    high = [b[1] for b in bands]
    return df.assign(chance_low=low, chance_high=high, at_chance=df["accuracy"].to_numpy() <= np.array(high))


def relative_to(value: float, reference: float, tolerance: float = AT_REFERENCE) -> str:
    """ "at" when ``value`` is within ``tolerance`` (relative) of ``reference``, else "above" or "below"."""
    if abs(value - reference) <= tolerance * abs(reference):
        return "at"
    return "above" if value > reference else "below"
