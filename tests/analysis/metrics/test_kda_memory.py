"""KDA memory measured from a trace (analysis.metrics.kda_memory): hand cases and a real k3-nano trace."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.metrics import kda_memory as km
from k3core.interp.trace import Trace, names
from tests.conftest import traced_nano


@pytest.fixture(scope="module")
def nano_run():
    return traced_nano()


def test_half_life():
    assert km.half_life(np.log(0.5)) == pytest.approx(1.0)  # alpha = 1/2: halves every token
    assert km.half_life(np.log(0.5) / 10) == pytest.approx(10.0)
    assert km.half_life(0.0) == math.inf
    assert km.half_life(-1e-40) > 1e30  # alpha rounds to 1: huge, not a division error
    with pytest.raises(ValueError):
        km.half_life(0.1)


def test_half_life_quantiles_are_order_statistics_and_survive_infinity():
    g = np.log(0.5) / np.array([2.0, 10.0, np.inf])
    lo, mid, hi = km.half_life_quantiles(g, (0.0, 0.5, 1.0))
    assert lo == pytest.approx(2.0) and mid == pytest.approx(10.0) and hi == math.inf


def test_near_lower_bound_fraction():
    g = np.array([-4.9, -4.6, -4.4, -1.0, -0.1])  # 0.9 * -5 = -4.5: two entries below
    assert km.near_lower_bound_fraction(g, -5.0) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        km.near_lower_bound_fraction(g, 1.0)


def _kda_trace(g: np.ndarray, beta: np.ndarray, lower_bound: float = -5.0, gate: str = "lower_bound") -> Trace:
    t = Trace(meta={"config": {"kda_gate": gate, "kda_gate_lower_bound": lower_bound}})
    t.add("blocks.0.kda.g", g, ("batch", "token", "head", "channel"))
    t.add("blocks.0.kda.beta", beta, ("batch", "token", "head"))
    return t


def test_kda_decay_stats_on_a_hand_trace():
    # one layer, 2 heads x 2 channels, 2 tokens; head 0 always alpha 0.5, head 1 g = -4.8 (near the bound)
    g = np.zeros((1, 2, 2, 2))
    g[:, :, 0, :] = np.log(0.5)
    g[:, :, 1, :] = -4.8
    t = _kda_trace(g, np.full((1, 2, 2), 0.25))
    stats = km.kda_decay_stats(t).set_index("head")
    assert stats.loc[0, "half_life_median"] == pytest.approx(1.0)
    assert stats.loc[0, "alpha_mean"] == pytest.approx(0.5)
    assert stats.loc[0, "frac_near_lb"] == 0.0 and stats.loc[1, "frac_near_lb"] == 1.0
    chan = km.kda_channel_decay(t)
    assert np.allclose(chan[chan["head"] == 0]["half_life"], 1.0)
    assert np.allclose(chan[chan["head"] == 0]["horizon"], 2.0)  # 1 / (1 - 0.5)
    assert np.allclose(chan[chan["head"] == 1]["horizon"], 1 / (1 - np.exp(-4.8)))
    beta = km.kda_beta_stats(t)
    assert np.allclose(beta["mean"], 0.25) and np.allclose(beta["std"], 0.0)
    softplus = km.kda_decay_stats(_kda_trace(g, np.full((1, 2, 2), 0.25), gate="softplus"))
    assert softplus["frac_near_lb"].isna().all()  # no lower bound in the softplus form


def test_kda_metrics_on_a_real_trace(nano_run):
    model, ids, trace = nano_run
    decay = km.kda_decay_stats(trace)
    assert sorted(decay["layer"].unique()) == [0, 1, 2] and len(decay) == 3 * 2
    assert (decay["half_life_median"] > 0).all()
    norms = km.kda_state_norms(trace)
    assert sorted(norms["token"].unique()) == [16, 32, 40]  # chunk ends of a 40-token prefix, chunk 16
    assert (norms["state_norm"] > 0).all()
    rank = km.kda_state_rank(trace)
    assert ((rank["effective_rank"] >= 1) & (rank["effective_rank"] <= 16)).all()
    summary = km.kda_layer_summary(trace)
    assert list(summary["layer"]) == [0, 1, 2]


def test_kda_state_rank_hand_case():
    d = 4
    states = np.stack([np.eye(d), np.outer(np.arange(1.0, d + 1), np.ones(d))])[None]  # [1, 2, d, d]
    tr = Trace()
    tr.add(names.kda_final_state(0), states, ("batch", "head", "key", "value"))
    df = km.kda_state_rank(tr)
    np.testing.assert_allclose(df["effective_rank"], [d, 1.0])  # identity: d equal singular values; outer: rank 1
    np.testing.assert_allclose(df["frobenius"], [2.0, np.sqrt(d * (1 + 4 + 9 + 16))])
    assert km.kda_state_rank(Trace()).empty and km.kda_state_norms(Trace()).empty


def test_memory_horizon_is_the_mean_lifetime_of_a_write():
    """1 / (1 - alpha) = sum_n alpha^n, checked against the partial sum; slow decays keep their digits (expm1)."""
    g = np.array([-2.0, -0.1, -1e-9, 0.0])
    horizon = km.memory_horizon(g)
    alpha = np.exp(g[:2])
    assert np.allclose(horizon[:2], (alpha[:, None] ** np.arange(2000)).sum(1), rtol=1e-9)
    assert horizon[2] == pytest.approx(1e9, rel=1e-8)  # 1 / (1 - exp(g)) in float64 is off by up to 1e-7 relative here
    assert np.isinf(horizon[3])
    with pytest.raises(ValueError, match="g must be <= 0"):
        km.memory_horizon(np.array([0.1]))
