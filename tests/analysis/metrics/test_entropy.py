"""Entropy is defined once (analysis.metrics.entropy: entropy, normalised_entropy) and causal rows are normalised
once (analysis.metrics.attention.causal_normalised_entropy): the training history's depth-mix entropy is the same
number as the trace's (0 for one source, never NaN), and no other module writes the formula (the check finds one)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from analysis.metrics import attention as at
from analysis.metrics.entropy import entropy, normalised_entropy
from analysis.metrics.history import attnres_history_table
from tests.repo.scan import matching_lines

ROOT = Path(__file__).resolve().parents[3]
# p * log p (an entropy), or a division by a log other than log 2 (bits): a normalised entropy written again
_FORMULA = re.compile(r"\*\s*(?:np|math|torch)\.log\(|/\s*(?:np|math|torch)\.log\((?!2\))")
HOMES = {"analysis/metrics/entropy.py", "analysis/metrics/attention.py"}  # entropy; the causal normalisation


def entropy_formulas(root: Path) -> list[str]:
    """file:line of every entropy or normalisation formula under analysis/ and app/."""
    return matching_lines(root, ("analysis", "app"), _FORMULA)


def test_entropy_and_its_normalisations_are_written_once():
    hits = [hit.split(":")[0] for hit in entropy_formulas(ROOT)]
    assert set(hits) == HOMES
    assert hits.count("analysis/metrics/attention.py") == 1  # causal_normalised_entropy, nothing else there
    assert not hasattr(at, "normalised_entropy")  # one name per concept: no second "normalised_entropy"


def test_the_entropy_check_finds_a_second_definition(tmp_path):
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "x.py").write_text("bits = loss / math.log(2)\nh = -(p * np.log(p)).sum()\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "y.py").write_text("norm = h / np.log(n)\n")
    assert entropy_formulas(tmp_path) == ["analysis/x.py:2", "app/y.py:1"]


def test_history_mix_entropy_is_the_normalised_entropy_and_zero_for_one_source():
    sites = {
        "0.attn": {"mean_weights": [1.0], "sources": ["embedding"]},
        "1.attn": {"mean_weights": [0.2, 0.8], "sources": ["embedding", "block 0"]},
    }
    record = {"step": 10, "sites": sites}
    table = attnres_history_table({"history": {"attnres": [record]}})
    mix = table[table.metric == "mix_entropy"].set_index("site").value
    assert mix["0.attn"] == 0.0  # was NaN: one source has no spread, as analysis.metrics.attnres says
    assert mix["1.attn"] == pytest.approx(float(normalised_entropy(np.array([0.2, 0.8]))), abs=0)


def test_causal_normalisation_of_a_map_and_of_recorded_entropies_agree():
    rng = np.random.default_rng(0)
    attn = np.tril(rng.random((5, 5)))
    attn /= attn.sum(-1, keepdims=True)
    rows = at.causal_row_entropy(attn)
    assert np.array_equal(rows, entropy(attn, -1))
    norm = at.causal_normalised_entropy(rows)
    assert np.isnan(norm[0]) and np.allclose(norm[1:], rows[1:] / np.log(np.arange(2, 6)))
