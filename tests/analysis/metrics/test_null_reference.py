"""Null references (analysis.metrics.null_reference) against closed forms and independent simulations."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.metrics import attention as at
from analysis.metrics import null_reference as nr
from k3core.training.load_stats import moe_load_stats


def _uniform_causal_map(tokens: int) -> np.ndarray:
    """[batch 1, head 1, query, key] softmax of equal logits under the causal mask: row i is 1/(i+1) on 0..i."""
    logits = np.where(np.tril(np.ones((tokens, tokens))) > 0, 0.0, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True))[None, None]


@pytest.mark.parametrize("tokens", [1, 2, 7, 512])
def test_uniform_sink_mass_and_received_match_a_uniform_softmax(tokens):
    attn = _uniform_causal_map(tokens)
    received = at.mean_received(attn.sum(-2))[0, 0]  # the recorder's received sum, as the tables read it
    assert received[0] == pytest.approx(nr.uniform_first_token_mass(tokens), rel=1e-12)
    np.testing.assert_allclose(received, nr.uniform_received(tokens), rtol=1e-12)
    entropy = -(attn * np.log(np.where(attn > 0, attn, 1.0))).sum(-1)[0, 0]
    norm = at.causal_normalised_entropy(entropy)
    np.testing.assert_allclose(norm[1:], nr.uniform_entropy_norm(np.arange(1, tokens)), rtol=1e-12)
    if tokens == 512:  # the "about 0.015" for k3-full is what uniform attention gives
        assert 0.012 < nr.uniform_first_token_mass(tokens) < 0.015


def test_the_routing_floor_matches_a_multinomial_simulation_and_the_closed_forms():
    """k = 1: balanced routing is a multinomial of T tokens over E equal cells; simulated here with numpy's own
    multinomial (another generator, another seed) and compared with the floor's MaxVio and CV."""
    tokens, experts = 512, 16
    floor = nr.balanced_routing_floor(tokens, 1, experts, draws=2000, seed=1)
    rng = np.random.default_rng(12345)
    counts = rng.multinomial(tokens, np.full(experts, 1 / experts), size=4000)
    stats = [moe_load_stats(c) for c in counts]
    max_vio = np.array([s["max_vio"] for s in stats])
    cv = np.array([s["cv"] for s in stats])
    assert floor.max_vio_mean == pytest.approx(max_vio.mean(), rel=0.03)
    assert floor.max_vio_hi == pytest.approx(np.percentile(max_vio, 97.5), rel=0.08)
    assert floor.cv_mean == pytest.approx(cv.mean(), rel=0.03)
    assert floor.max_vio_lo > 0.1  # a perfectly balanced router reads MaxVio > 0 on 512 tokens by sampling alone
    # closed forms: E[CV^2] = (1 - p) / (T p), share sd = sqrt(p (1 - p) / T) / k
    assert np.sqrt(np.mean(cv**2)) == pytest.approx(floor.cv_rms_closed_form, rel=0.02)
    shares = counts / tokens
    assert shares.std() == pytest.approx(floor.share_sd_closed_form, rel=0.03)
    assert floor.share_lo < 1 / experts < floor.share_hi


def test_top_k_floor_picks_k_distinct_experts_and_matches_its_closed_forms():
    tokens, k, experts = 300, 4, 32
    counts = nr.balanced_counts(tokens, k, experts, draws=1500, seed=3)
    assert (counts.sum(1) == tokens * k).all() and (counts <= tokens).all()
    floor = nr.balanced_routing_floor(tokens, k, experts, draws=1500, seed=3)
    p = k / experts
    cv = counts.std(1) / counts.mean(1)
    assert np.sqrt(np.mean(cv**2)) == pytest.approx(np.sqrt((1 - p) / (tokens * p)), rel=0.03)
    assert floor.cv_rms_closed_form == pytest.approx(np.sqrt((1 - p) / (tokens * p)))
    assert (counts / (tokens * k)).std() == pytest.approx(floor.share_sd_closed_form, rel=0.03)
    assert floor.max_vio_within(floor.max_vio_mean) and not floor.max_vio_within(2 * floor.max_vio_hi)
    # more tokens, a lower floor (sampling noise shrinks as 1/sqrt(T))
    assert nr.balanced_routing_floor(4 * tokens, k, experts).max_vio_mean < floor.max_vio_mean


def test_independence_chance_and_words():
    p = np.array([0.5, 0.25, 0.25])
    expected = nr.independent_coactivation(p)
    assert expected[0, 1] == pytest.approx(0.125) and expected.shape == (3, 3)
    # independent draws of two experts' choices co-occur at p_i p_j
    rng = np.random.default_rng(0)
    chosen = rng.random((200_000, 3)) < p
    assert (chosen[:, 0] & chosen[:, 1]).mean() == pytest.approx(expected[0, 1], rel=0.02)
    assert nr.chance_recall(64) == pytest.approx(1 / 64)
    assert nr.relative_to(0.0140, 0.0133) == "at" and nr.relative_to(0.4, 0.0133) == "above"
    assert nr.relative_to(0.001, 0.0133) == "below"
    with pytest.raises(ValueError):
        nr.uniform_first_token_mass(0)


@pytest.mark.parametrize(("candidates", "trials"), [(64, 16), (2, 100), (10, 40)])
def test_chance_interval_holds_95_percent_of_simulated_chance_guessers(candidates, trials):
    lo, hi = nr.chance_interval(candidates, trials)
    rng = np.random.default_rng(candidates * trials)
    accuracy = rng.binomial(trials, 1 / candidates, size=200_000) / trials
    inside = ((accuracy >= lo) & (accuracy <= hi)).mean()
    assert inside >= 0.95 and lo <= 1 / candidates <= hi
    # the tightest such interval from the quantiles: one step in from either end holds less than 97.5% per side
    assert (accuracy < lo).mean() <= 0.025 and (accuracy > hi).mean() <= 0.025
