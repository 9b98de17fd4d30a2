"""Figures, reports and traces are byte-identical to the recorded baseline on the shipped samples, one per config
(tests/data/figure_baseline.json, written by scripts/record_figure_baseline.py): every trace array, the figure JSON
and table of every trace or weights view, and every file of k3-full's report. A failure names each view, report file
or trace array that differs; a deliberate change is recorded again with the script."""

from __future__ import annotations

import copy
import json

import pytest

from scripts import record_figure_baseline as baseline


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(baseline.BASELINE.read_text(encoding="utf-8"))


def test_the_samples_draw_what_the_baseline_recorded(recorded):
    names = baseline.sample_names()
    assert sorted(recorded["samples"]) == names and {"k3-full", "k3-mxfp4", "untrained"} <= set(names)
    assert "k3-full-s1" not in names
    assert recorded["tokens"] == baseline.TOKENS
    diffs = baseline.differences(recorded, baseline.compute())
    assert diffs == [], (
        "differs from tests/data/figure_baseline.json (scripts/record_figure_baseline.py):\n" + "\n".join(diffs)
    )


def test_the_comparison_names_what_differs(recorded):
    changed = copy.deepcopy(recorded)
    full = changed["samples"]["k3-full"]
    view = next(k for k, v in full["views"].items() if isinstance(v, dict) and v["l1"] > 0)
    full["views"][view]["proj"][0] += 2e-4 * full["views"][view]["l1"]  # values moved by 2 RTOL
    first, second = sorted(full["trace"])[:2]
    full["trace"]["renamed.item"] = full["trace"].pop(first)  # a key renamed, its values kept
    full["trace"][second] = {**full["trace"][second], "skeleton": "1" * 64}  # another dtype or shape
    del changed["report"]["headline.json"]
    assert sorted(baseline.differences(recorded, changed)) == sorted(
        [
            f"k3-full: view {view}: differs",
            f"k3-full: trace array {first} renamed to renamed.item (same values)",
            f"k3-full: trace array {second}: differs",
            "k3-full report: headline.json: missing",
        ]
    )


def test_a_figure_matches_across_float_rounding_but_not_across_a_change():
    """The fingerprint of a real figure's JSON: values moved by float32 rounding (1e-7 relative, as another CPU's
    kernels move them) still match; the same figure with values scaled by 1e-3, one label changed or one value
    more in a trace does not."""
    import numpy as np
    import plotly.graph_objects as go

    rng = np.random.default_rng(0)
    z = rng.standard_normal((12, 40))

    def fp(values, title="entropy"):
        fig = go.Figure(go.Heatmap(z=values), layout=dict(title=title))
        return baseline.text_fingerprint(fig.to_json().encode())

    reference = fp(z)
    assert baseline.same(reference, fp(z * (1 + 1e-7 * rng.standard_normal(z.shape))))
    assert not baseline.same(reference, fp(z * (1 + 1e-3)))
    assert not baseline.same(reference, fp(z, title="entropy (bits)"))
    assert not baseline.same(reference, fp(np.vstack([z, z[:1]])))
    text = b"layer,loss\n0,2.4512345\n1,2.5\n"
    assert baseline.same(
        baseline.text_fingerprint(text), baseline.text_fingerprint(text.replace(b"2.4512345", b"2.4512346"))
    )
    assert not baseline.same(baseline.text_fingerprint(text), baseline.text_fingerprint(text.replace(b"2.45", b"2.55")))
