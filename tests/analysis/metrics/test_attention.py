"""MLA attention diagnostics (analysis.metrics.attention) against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.metrics import attention as at
from analysis.metrics import hidden_states as hs
from analysis.runs.missing_data import MissingTraceData
from k3core.interp.trace import Trace


def uniform_causal(T: int) -> np.ndarray:
    """Row i attends uniformly to keys 0..i."""
    return np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]


def first_token(T: int) -> np.ndarray:
    a = np.zeros((T, T))
    a[:, 0] = 1.0
    return a


def attn_trace(per_head: list[np.ndarray], layer: int = 3) -> Trace:
    tr = Trace()
    tr.add(f"blocks.{layer}.mla.attn", np.stack(per_head)[None], ("batch", "head", "query", "key"))
    return tr


def test_uniform_causal_attention_has_normalised_entropy_one():
    norm = at.causal_normalised_entropy(at.causal_row_entropy(uniform_causal(6)))
    assert math.isnan(norm[0])  # one key: undefined, skipped
    np.testing.assert_allclose(norm[1:], 1.0, atol=1e-12)
    np.testing.assert_allclose(at.causal_row_entropy(uniform_causal(4)), np.log([1, 2, 3, 4]), atol=1e-12)


def test_one_hot_attention_has_entropy_zero_and_table_skips_row_zero():
    tr = attn_trace([uniform_causal(5), first_token(5)])
    df = at.attention_entropy_table(tr)
    assert list(df["layer"]) == [3, 3] and list(df["head"]) == [0, 1]
    np.testing.assert_allclose(df["entropy_norm"], [1.0, 0.0], atol=1e-12)
    # mean raw entropy over rows 1..4 of the uniform head: (log 2 + log 3 + log 4 + log 5) / 4
    assert df["entropy"].iloc[0] == pytest.approx(np.log([2, 3, 4, 5]).mean())
    assert (df["queries"] == 4).all()


def test_hand_computed_row_entropy():
    a = np.array([[1.0, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]])
    expected = -(0.25 * np.log(0.25) * 2 + 0.5 * np.log(0.5)) / np.log(3)
    assert at.causal_normalised_entropy(at.causal_row_entropy(a))[2] == pytest.approx(expected)


def test_all_attention_on_first_token_is_a_full_sink():
    tr = attn_trace([first_token(8), first_token(8)])
    sink = at.attention_sink_table(tr)
    np.testing.assert_allclose(sink["first_token_mass"], 1.0)
    assert sink["is_sink"].all()
    assert at.sink_rate(sink["first_token_mass"].to_numpy()) == 1.0


def test_attention_received_hand_case():
    a = np.array([[1.0, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]])
    # key 0 seen by queries 0,1,2: (1 + 0.5 + 0.2)/3; key 1 by 1,2: (0.5 + 0.3)/2; key 2 by 2: 0.5
    np.testing.assert_allclose(at.attention_received(a), [1.7 / 3, 0.4, 0.5])
    # uniform causal: key 0 gets the mean of 1/(i+1)
    T = 10
    assert at.attention_received(uniform_causal(T))[0] == pytest.approx(np.mean(1 / np.arange(1, T + 1)))


def test_sink_rate_threshold_is_strict():
    assert at.sink_rate(np.array([0.3, 0.31, 0.1, 0.9])) == 0.5
    assert math.isnan(at.sink_rate(np.array([])))


def test_attention_needs_square_matrix():
    with pytest.raises(ValueError, match="query == key"):
        at.causal_row_entropy(np.ones((3, 4)))


def test_missing_data_is_reported():
    with pytest.raises(MissingTraceData, match="not recorded"):
        at.attention_entropy_table(Trace())
    with pytest.raises(MissingTraceData, match="hidden"):
        hs.rank_collapse_table(Trace())
