"""Hidden-state diagnostics (analysis.metrics.hidden_states) against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.metrics import hidden_states as hs
from k3core.interp.trace import Trace


def test_identical_tokens_collapse_completely():
    x = np.tile(np.array([[1.0, -2.0, 3.0, 0.5]]), (7, 1))
    assert hs.rank_collapse_ratio(x) == 0.0
    assert hs.token_uniformity(x) == pytest.approx(1.0)
    assert hs.effective_rank(x) == 0.0  # centred: nothing left


def test_rank_collapse_hand_cases():
    # zero-mean tokens: nothing to remove, r = 1
    assert hs.rank_collapse_ratio(np.array([[1.0, 0.0], [-1.0, 0.0]])) == pytest.approx(1.0)
    # X = [[1, 1], [1, -1]]: mean (1, 0), residual [[0, 1], [0, -1]]: r = sqrt(2) / 2
    assert hs.rank_collapse_ratio(np.array([[1.0, 1.0], [1.0, -1.0]])) == pytest.approx(math.sqrt(2) / 2)
    assert hs.rank_collapse_ratio(np.zeros((3, 2))) == 0.0


def test_orthogonal_tokens_effective_rank():
    n = 5
    eye = np.eye(n) * 3.0
    assert hs.effective_rank(eye, center=False) == pytest.approx(n)
    # centring n orthonormal tokens leaves n - 1 equal singular values
    assert hs.effective_rank(eye) == pytest.approx(n - 1)
    # a random orthogonal basis (not axis aligned) too
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(n, n)))
    assert hs.effective_rank(q, center=False) == pytest.approx(n)
    assert hs.token_uniformity(eye) == pytest.approx(0.0)
    assert hs.effective_rank(np.outer([1.0, 2, 3], [1.0, -1]), center=False) == pytest.approx(1.0)


def test_linear_cka_identity_and_invariances():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 8))
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    assert hs.linear_cka(x, x) == pytest.approx(1.0)
    assert hs.linear_cka(x, x @ q) == pytest.approx(1.0)  # orthogonal transform
    assert hs.linear_cka(x, 5.0 * x) == pytest.approx(1.0)  # isotropic scaling
    assert hs.linear_cka(x, x + 3.0) == pytest.approx(1.0)  # centring removes a shift
    y = rng.normal(size=(40, 8))
    assert hs.linear_cka(x, y) < 0.5
    assert math.isnan(hs.linear_cka(np.ones((4, 2)), x[:4]))


def test_linear_cka_hand_case():
    # one feature each: CKA is the squared Pearson correlation
    x = np.array([[1.0], [2.0], [3.0], [4.0]])
    y = np.array([[1.0], [3.0], [2.0], [4.0]])
    r = np.corrcoef(x[:, 0], y[:, 0])[0, 1]
    assert hs.linear_cka(x, y) == pytest.approx(r**2)


def test_block_influence():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 4))
    assert hs.block_influence(x, x) == pytest.approx(0.0)
    assert hs.block_influence(x, 2 * x) == pytest.approx(0.0)
    assert hs.block_influence(x, -x) == pytest.approx(2.0)
    y = np.array([[1.0, 0.0], [0.0, 1.0]])
    z = np.array([[0.0, 1.0], [0.0, 1.0]])  # cosines 0 and 1
    assert hs.block_influence(y, z) == pytest.approx(0.5)


def test_layer_redundancy_table_uses_consecutive_depths():
    rng = np.random.default_rng(3)
    h0 = rng.normal(size=(1, 5, 4))
    hidden = np.stack([h0, h0, -h0])  # layer 0 does nothing, layer 1 flips the sign
    tr = Trace(meta={"layer_types": ["KDA", "MLA"]})
    tr.add("hidden", hidden, ("depth", "batch", "token", "hidden"))
    df = hs.layer_redundancy_table(tr)
    np.testing.assert_allclose(df["block_influence"], [0.0, 2.0], atol=1e-12)
    np.testing.assert_allclose(df["cka"], [1.0, 1.0])
    assert list(df["layer_type"]) == ["KDA", "MLA"]


def test_tied_activations_are_picked_in_position_order():
    """One token read at several positions has one embedding: equal |h| at depth 0. The picks among ties are the
    first positions (token, then channel), whatever order a partition algorithm leaves them in; NaN is never
    picked."""
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, size=(64, 48))
    row = x[3].copy()
    for t in (3, 17, 40, 41, 60):  # the same token five times
        x[t] = row
    c = int(np.argmax(np.abs(row)))
    x[3, c] = x[17, c] = x[40, c] = x[41, c] = x[60, c] = 5.0  # tied for first, above everything else
    x[50, 0] = np.nan
    for k in (1, 2, 3, 5):
        top = hs.top_activations(x, k=k)
        assert [(t, ch) for t, ch, _ in top] == [(t, c) for t in (3, 17, 40, 41, 60)][:k]
    top = hs.top_activations(x, k=7)  # the five ties, then the two next largest entries
    assert [v for _, _, v in top[:5]] == [5.0] * 5 and all(abs(v) < 5.0 for _, _, v in top[5:])
    everything = hs.top_activations(x, k=x.size - 1)  # all but the NaN
    assert len(everything) == x.size - 1 and all(np.isfinite(v) for _, _, v in everything)


def test_planted_massive_activation_is_found():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 32))
    x[5, 7] = -1000.0
    x[9, 2] = 400.0
    top = hs.top_activations(x, k=2)
    assert top[0] == (5, 7, -1000.0)
    assert top[1][:2] == (9, 2)
    assert hs.max_median_ratio(x) == pytest.approx(1000.0 / np.median(np.abs(x)))
    tr = Trace()
    tr.add("hidden", np.stack([rng.normal(size=(1, 16, 32)), x[None]]), ("depth", "batch", "token", "hidden"))
    df = hs.massive_activation_table(tr, k=3)
    top_final = df[(df["depth"] == 1) & (df["rank"] == 0)].iloc[0]
    assert (top_final["token"], top_final["channel"], top_final["value"]) == (5, 7, -1000.0)
    assert top_final["depth_label"] == "final"
    assert top_final["max_median_ratio"] > 100


def test_effective_rank_uncentred():
    assert hs.effective_rank(np.outer([1.0, 2.0, 3.0], [1.0, 0.0, 1.0]), center=False) == pytest.approx(1.0)
    assert hs.effective_rank(np.eye(5), center=False) == pytest.approx(5.0)
    assert hs.effective_rank(np.zeros((3, 3)), center=False) == 0.0
