"""Config differences against the seed spread (analysis.compare.seeds), on hand-made tables with known answers."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.compare import seeds as sd


def _table(rows):
    return pd.DataFrame(rows, columns=list(sd.COLUMNS))


RUNS = _table(
    [
        ("full-s0", "full", 0, "bpb", 2.00),
        ("full-s1", "full", 1, "bpb", 2.04),
        ("plain-s0", "plain", 0, "bpb", 2.10),
        ("plain-s1", "plain", 1, "bpb", 2.08),
        ("moe-s0", "moe", 0, "bpb", 2.05),
        ("full-s0", "full", 0, "sinks", 0.5),
        ("full-s1", "full", 1, "sinks", 0.5),
        ("moe-s0", "moe", 0, "sinks", 0.9),
        ("full-s0", "full", 0, "recall", 0.7),
        ("moe-s0", "moe", 0, "recall", float("nan")),
    ]
)


def test_spread_is_the_range_over_seeds_and_noise_its_largest_over_configs():
    spread = sd.seed_spread(RUNS).set_index(["metric", "config"])
    assert spread.loc[("bpb", "full"), "spread"] == pytest.approx(0.04)
    assert spread.loc[("bpb", "plain"), "spread"] == pytest.approx(0.02)
    assert spread.loc[("sinks", "full"), "spread"] == 0.0 and spread.loc[("bpb", "full"), "n_seeds"] == 2
    assert ("bpb", "moe") not in spread.index  # one seed: no spread
    assert sd.seed_noise(RUNS) == pytest.approx({"bpb": 0.04, "sinks": 0.0})


def test_differences_use_seed_means_and_say_beyond_only_where_noise_is_measured():
    diff = sd.config_differences(RUNS, "full").set_index(["metric", "config"])
    plain = diff.loc[("bpb", "plain")]
    assert plain["value"] == pytest.approx(2.09) and plain["reference_value"] == pytest.approx(2.02)
    assert plain["delta"] == pytest.approx(0.07) and plain["noise"] == pytest.approx(0.04) and plain["beyond"]
    assert not diff.loc[("bpb", "moe"), "beyond"]  # 0.03 < 0.04
    assert diff.loc[("sinks", "moe"), "beyond"]  # any difference beyond a spread of exactly 0
    assert ("recall", "moe") not in diff.index  # its value is missing
    assert list(diff.reset_index()["config"][:2]) == ["plain", "moe"]


def test_no_measured_noise_gives_no_verdict_and_bad_tables_are_refused():
    one_seed = RUNS[RUNS["seed"] == 0]
    diff = sd.config_differences(one_seed, "full")
    assert diff["beyond"].isna().all() and diff["noise"].map(math.isnan).all()
    with pytest.raises(ValueError, match="reference config 'nope'"):
        sd.config_differences(RUNS, "nope")
    with pytest.raises(ValueError, match="missing \\['seed'\\]"):
        sd.seed_spread(RUNS.drop(columns="seed"))
    with pytest.raises(ValueError, match="one row per"):
        sd.seed_spread(pd.concat([RUNS, RUNS.iloc[:1]]))
