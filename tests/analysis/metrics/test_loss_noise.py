"""Noise floor of a loss difference (analysis.metrics.loss_noise): hand computations, planted effects, real traces."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from analysis.metrics import headline as hl
from analysis.metrics import loss_noise as ln
from analysis.runs.loading import run_from_model, trace_run
from k3core.interp.trace import names
from tests.conftest import nano_model


def test_paired_ci_matches_a_hand_computation():
    a = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, np.nan]])  # the last token is not scored
    b = np.zeros_like(a)
    b[0, -1] = np.nan
    r = ln.loss_difference(a, b, paired=True, window=2)
    # windows of d: [1, 2], [3, 4], [5, 6] -> means 1.5, 3.5, 5.5; std (ddof 1) = 2; t_{0.975, 2} = 4.303
    assert r.n_windows == 3 and r.paired
    assert r.delta == pytest.approx(3.5)
    assert r.half_width == pytest.approx(4.303 * 2.0 / math.sqrt(3))
    assert r.within_noise  # 3.5 < 4.97: the CI contains 0
    assert r.in_bits() == pytest.approx((3.5 / math.log(2), r.half_width / math.log(2)))


def test_unpaired_ci_matches_a_hand_computation():
    a = np.array([1.0, 3.0, 5.0, 7.0])  # window means 2, 6: var 8
    b = np.array([0.0, 0.0, 1.0, 1.0, 2.0, 2.0])  # window means 0, 1, 2: var 1
    r = ln.loss_difference(a, b, paired=False, window=2)
    va, vb = 8 / 2, 1 / 3
    df = (va + vb) ** 2 / (va**2 / 1 + vb**2 / 2)  # Welch: 1.17 -> 1 (rounded down)
    assert r.delta == pytest.approx(4.0 - 1.0) and not r.paired
    assert r.half_width == pytest.approx(ln.t975(df) * math.sqrt(va + vb))
    assert ln.t975(df) == pytest.approx(12.706)


def test_identical_runs_are_within_noise_and_a_planted_difference_is_not():
    rng = np.random.default_rng(0)
    a = rng.gamma(2.0, 1.0, size=(2, 256))  # per-token losses of about 2 nats, spread 1.4
    same = ln.loss_difference(a, a.copy(), paired=True)
    assert same.delta == 0.0 and same.within_noise
    # B: a different model of the same text whose per-token losses differ by noise only
    noisy = ln.loss_difference(a, a + rng.normal(0.0, 0.3, a.shape), paired=True)
    assert noisy.n_windows == 16 and noisy.within_noise
    planted = ln.loss_difference(a, a + 0.05 + rng.normal(0.0, 0.1, a.shape), paired=True)
    assert planted.delta == pytest.approx(-0.05, abs=0.01) and planted.half_width < 0.02 and not planted.within_noise
    # pairing is what resolves it: the same shift on independent texts is lost in the texts' spread (~0.18)
    other = rng.gamma(2.0, 1.0, size=(2, 256)) + 0.05
    assert ln.loss_difference(a, other, paired=False).within_noise


def test_too_few_tokens_and_mismatched_pairs():
    r = ln.loss_difference(np.array([1.0, 2.0]), np.array([0.5, 1.0]), paired=True, window=32)
    assert r.n_windows == 1 and math.isnan(r.half_width) and r.within_noise
    assert "too few tokens" in ln.noise_statement(r, byte_vocab=True, separate_training=False)
    with pytest.raises(ValueError, match="same scored tokens"):
        ln.loss_difference(np.ones(4), np.ones(5), paired=True)


def test_t975_series_continues_the_table():
    assert ln.t975(31) == pytest.approx(2.040, abs=1e-3)  # table value of t_{0.975, 31}
    assert ln.t975(30.5) == ln.t975(30) == 2.042
    assert ln.t975(120) == pytest.approx(1.980, abs=1e-3)
    assert ln.t975(1e9) == pytest.approx(1.95996, abs=1e-5)
    assert math.isnan(ln.t975(0))


def test_statement_says_the_interval_the_flag_and_the_seed_noise():
    r = ln.LossNoise(delta=0.01 * math.log(2), half_width=0.02 * math.log(2), n_windows=8, window=32, paired=True)
    text = ln.noise_statement(r, byte_vocab=True, separate_training=True)
    assert "A - B = +0.0100 ± 0.0200 bits/byte (95% CI, 8 windows of ~32 tokens, paired" in text
    assert "within the noise" in text and f"{ln.SEED_NOISE_BPB} bits/byte" in text and "is within that" in text
    big = ln.LossNoise(delta=0.2 * math.log(2), half_width=0.01, n_windows=8, window=32, paired=True)
    text = ln.noise_statement(big, byte_vocab=False, separate_training=False)
    assert "bits/token" in text and "outside the noise" in text and "seed" not in text
    # a token vocabulary's bits/token are not compared with the bits/byte seed noise
    text = ln.noise_statement(big, byte_vocab=False, separate_training=True)
    assert f"{ln.SEED_NOISE_BPB} bits/byte" in text and "that." not in text


def _ctx(seed: int, ids: torch.Tensor, label: str):
    torch.manual_seed(seed)
    model = nano_model(seed=None, kda_chunk_size=16)
    return trace_run(run_from_model(model), ids, label=label)


def test_headline_noise_of_real_traces_and_the_table_columns():
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(0))
    a, b = _ctx(0, ids, "A"), _ctx(1, ids, "B")
    noise = ln.headline_noise(a, b)
    assert ln.choose_window(95) == 11 and ln.choose_window(10_000) == 32 and ln.choose_window(3) == 4
    assert noise.paired and noise.window == 11 and noise.n_windows == 8  # 95 scored tokens: 8 windows of ~12
    ha, hb = hl.headline_numbers(a), hl.headline_numbers(b)
    assert noise.delta == pytest.approx(ha["loss"] - hb["loss"], abs=1e-6)  # fp32 means  # the headline delta itself
    d = np.asarray(a.trace[names.TOKEN_NLL], np.float64) - np.asarray(b.trace[names.TOKEN_NLL], np.float64)
    m = [part.mean() for part in np.array_split(d[np.isfinite(d)], 8)]
    assert noise.half_width == pytest.approx(2.365 * np.std(m, ddof=1) / math.sqrt(8))  # t_{0.975, 7}
    table = hl.headline_table(ha, hb, noise=noise).set_index("metric")
    assert table.loc["bits_per_byte", "ci95"] == pytest.approx(noise.half_width / math.log(2))
    assert table.loc["loss", "ci95"] == pytest.approx(noise.half_width)
    assert table.loc["loss", "within_noise"] == noise.within_noise
    assert math.isnan(table.loc["sink_rate", "ci95"]) and table.loc["sink_rate", "within_noise"] is None
    assert "ci95" not in hl.headline_table(ha, hb).columns  # the report's table is unchanged
    other = _ctx(0, torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(1)), "A'")
    assert not ln.headline_noise(a, other).paired  # one run on two texts
