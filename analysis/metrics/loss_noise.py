"""How much of a loss difference A - B is noise: of the text evaluated (a confidence interval), and of the seed.

Per-token losses of neighbouring tokens are correlated, so the unit of sampling is a window, not a token
(the batch-means method): each sequence's scored tokens are cut, in order, into ``n = max(T // W, 1)`` windows
of about ``W`` tokens (``np.array_split``), and each window contributes the mean of its scored tokens.

- Paired (A and B scored the same tokens: two runs on one text, a run and its edited copy):
  ``d_t = nll_A,t - nll_B,t``; ``delta = mean_t d_t`` over every scored token (equal to the headline delta);
  ``SE = std(m, ddof=1) / sqrt(n)`` over the ``n`` window means ``m_i`` of ``d``;
  95% CI ``delta +- t_{0.975, n-1} * SE``.
- Unpaired (different tokens: one run on two texts): ``delta = mean(nll_A) - mean(nll_B)``,
  ``SE = sqrt(s_A^2 / n_A + s_B^2 / n_B)`` over each side's window means, Welch-Satterthwaite degrees of freedom.

The interval covers only the choice of text. Two separately trained runs also differ by their seed: the
sample checkpoints (two seeds each of k3-full and plain-residual) put that at ``SEED_NOISE_BPB`` bits/byte
(sample_checkpoints/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analysis.runs.context import AnalysisContext
from k3core.interp.trace import names

DEFAULT_WINDOW = 32  # tokens per window: a few sentences of bytes; 256 tokens give 8 windows
# Short texts get shorter windows, down to MIN_WINDOW_TOKENS, so that a CI has MIN_WINDOWS windows where it can
MIN_WINDOWS = 8
MIN_WINDOW_TOKENS = 4
# The sample runs' seed-to-seed spread of validation bits/byte, the larger of k3-full's and plain-residual's two-seed
# ranges (sample_checkpoints/README.md, checks.json): differences under this are within the seed's noise.
SEED_NOISE_BPB = 0.017
_LN2 = math.log(2)

# Student's t, two-sided 95% (the 0.975 quantile), for 1..30 degrees of freedom (standard tables).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: float) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (non-integer df rounded down, which widens
    the interval): the table up to 30, above it the Cornish-Fisher series in z = 1.959964 to 1/df^3 (error < 1e-4)."""
    if not df >= 1:
        return math.nan
    if df < 31:
        return _T975[int(df) - 1]
    z, v = 1.959963985, float(df)
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
    )


def window_means(nll: np.ndarray, window: int = DEFAULT_WINDOW) -> np.ndarray:
    """Mean of the scored (finite) losses in each window of about ``window`` tokens, per sequence ([batch, token]
    or [token]); windows without a scored token are dropped."""
    x = np.atleast_2d(np.asarray(nll, dtype=np.float64))
    out = []
    for row in x:
        scored = row[np.isfinite(row)]
        if scored.size:
            out.extend(part.mean() for part in np.array_split(scored, max(scored.size // window, 1)))
    return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True)
class LossNoise:
    """A - B of the mean next-token loss (nats) with its 95% CI half-width over ``n_windows`` windows."""

    delta: float
    half_width: float
    n_windows: int
    window: int
    paired: bool

    @property
    def within_noise(self) -> bool:
        """The 95% CI contains 0 (or could not be computed): the text evaluated cannot tell A from B."""
        return not math.isfinite(self.half_width) or abs(self.delta) <= self.half_width

    def in_bits(self) -> tuple[float, float]:
        """(delta, half-width) in bits per token (= bits per byte for a byte vocabulary)."""
        return self.delta / _LN2, self.half_width / _LN2


def loss_difference(nll_a: np.ndarray, nll_b: np.ndarray, paired: bool, window: int = DEFAULT_WINDOW) -> LossNoise:
    """A - B of the mean loss with its 95% CI (module docstring: paired window means and a t interval, or Welch's
    for unpaired). Paired needs the same shape and the same scored tokens. Fewer than two windows: half-width NaN."""
    a = np.atleast_2d(np.asarray(nll_a, dtype=np.float64))
    b = np.atleast_2d(np.asarray(nll_b, dtype=np.float64))
    if paired:
        if a.shape != b.shape or not np.array_equal(np.isfinite(a), np.isfinite(b)):
            raise ValueError("paired losses need the same scored tokens in A and B")
        d = a - b
        m = window_means(d, window)
        delta = float(np.nanmean(d)) if np.isfinite(d).any() else math.nan
        n = m.size
        half = t975(n - 1) * float(m.std(ddof=1)) / math.sqrt(n) if n >= 2 else math.nan
        return LossNoise(delta, half, n, window, True)
    ma, mb = window_means(a, window), window_means(b, window)
    fa, fb = a[np.isfinite(a)], b[np.isfinite(b)]
    delta = float(fa.mean() - fb.mean()) if fa.size and fb.size else math.nan
    n = int(min(ma.size, mb.size))
    if n < 2:
        return LossNoise(delta, math.nan, n, window, False)
    va, vb = ma.var(ddof=1) / ma.size, mb.var(ddof=1) / mb.size
    se = math.sqrt(va + vb)
    denom = va**2 / (ma.size - 1) + vb**2 / (mb.size - 1)
    df = (va + vb) ** 2 / denom if denom > 0 else float(ma.size + mb.size - 2)
    return LossNoise(delta, t975(df) * se, int(ma.size + mb.size), window, False)


def choose_window(scored_tokens: int) -> int:
    """``DEFAULT_WINDOW`` tokens, shorter for a text of fewer than ``MIN_WINDOWS`` such windows (at least
    ``MIN_WINDOW_TOKENS``: shorter windows would hide the correlation of neighbouring tokens' losses)."""
    return min(DEFAULT_WINDOW, max(scored_tokens // MIN_WINDOWS, MIN_WINDOW_TOKENS))


def headline_noise(a: AnalysisContext, b: AnalysisContext, window: int | None = None) -> LossNoise | None:
    """``loss_difference`` of two traced contexts' per-token losses, paired when both scored the same tokens,
    over windows of ``window`` tokens (default ``choose_window`` of the shorter run's scored tokens per
    sequence); None when either trace has no per-token loss."""
    na, nb = a.trace.get(names.TOKEN_NLL), b.trace.get(names.TOKEN_NLL)
    if na is None or nb is None:
        return None
    if window is None:
        scored = [int(np.isfinite(np.atleast_2d(np.asarray(x, dtype=np.float64))).sum(axis=-1).min()) for x in (na, nb)]
        window = choose_window(min(scored))
    ta, tb = a.trace.get(names.TOKENS), b.trace.get(names.TOKENS)
    same_text = ta is not None and tb is not None and np.shape(ta) == np.shape(tb) and np.array_equal(ta, tb)
    paired = same_text and np.array_equal(np.isfinite(na), np.isfinite(nb))
    return loss_difference(na, nb, paired=paired, window=window)


def noise_statement(noise: LossNoise, byte_vocab: bool, separate_training: bool) -> str:
    """One sentence for researchers: "A - B = x ± y bits/byte (95% CI, n windows of W tokens, paired)" and whether
    that is within noise; with ``separate_training`` (two trained checkpoints) also the seed noise."""
    unit = "bits/byte" if byte_vocab else "bits/token"
    d, h = noise.in_bits()
    how = "paired: both scored the same tokens" if noise.paired else "unpaired: different tokens"
    if not math.isfinite(h):
        text = f"A - B = {d:+.4f} {unit}; too few tokens for a confidence interval ({noise.n_windows} window(s))."
    else:
        text = (
            f"A - B = {d:+.4f} ± {h:.4f} {unit} (95% CI, {noise.n_windows} windows of ~{noise.window} tokens, {how}): "
            + ("within the noise of the text evaluated." if noise.within_noise else "outside the noise of this text.")
        )
    if separate_training:
        text += (
            f" The interval covers the text only: separately trained runs also differ by their seed, about "
            f"{SEED_NOISE_BPB} bits/byte for the sample runs (two seeds of each of two configs)"
        )
        # the seed noise is in bits/byte: a difference in bits/token of another vocabulary is not compared with it
        text += f"; this difference is {'within' if abs(d) < SEED_NOISE_BPB else 'beyond'} that." if byte_vocab else "."
    return text
