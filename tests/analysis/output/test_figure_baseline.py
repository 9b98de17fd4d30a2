"""Figures, reports and traces are byte-identical to the recorded baseline on the five samples
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


def test_the_five_samples_draw_what_the_baseline_recorded(recorded):
    assert sorted(recorded["samples"]) == baseline.sample_names() and len(recorded["samples"]) == 5
    assert recorded["tokens"] == baseline.TOKENS
    diffs = baseline.differences(recorded, baseline.compute())
    assert diffs == [], (
        "differs from tests/data/figure_baseline.json (scripts/record_figure_baseline.py):\n" + "\n".join(diffs)
    )


def test_the_comparison_names_what_differs(recorded):
    changed = copy.deepcopy(recorded)
    full = changed["samples"]["k3-full"]
    view = next(k for k, v in full["views"].items() if not v.startswith("n/a"))
    full["views"][view] = "0" * 64
    first, second = sorted(full["trace"])[:2]
    full["trace"]["renamed.item"] = full["trace"].pop(first)  # a key renamed, its values kept
    full["trace"][second] = "1" * 64
    del changed["report"]["headline.json"]
    assert sorted(baseline.differences(recorded, changed)) == sorted(
        [
            f"k3-full: view {view}: differs",
            f"k3-full: trace array {first} renamed to renamed.item (same values)",
            f"k3-full: trace array {second}: differs",
            "k3-full report: headline.json: missing",
        ]
    )
