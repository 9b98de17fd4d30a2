"""Differences between configurations read against their seed-to-seed spread: which differences between runs of
different configs exceed what retraining the same config with another seed changes.

The input is tidy: one row per run and metric, columns ``run, config, seed, metric, value``.

- ``seed_spread``: per (metric, config) trained with two or more seeds, ``spread = max - min`` over its seeds.
- ``seed_noise``: per metric, the largest ``spread`` over the configs that have one: the noise a difference
  between two configs must exceed. With two seeds per config this is a rough estimate (the range of two draws
  is about 1.13 standard deviations of one on average), so it is a floor to clear, not a confidence interval.
- ``config_differences``: per metric and config other than the reference, the mean over its seeds minus the
  reference's mean, beside ``seed_noise``; ``beyond`` when ``|delta| > noise`` (None where no config of that metric
  has two seeds, or a value is missing).
"""

from __future__ import annotations

import math

import pandas as pd

COLUMNS = ("run", "config", "seed", "metric", "value")


def _check(table: pd.DataFrame) -> pd.DataFrame:
    missing = [c for c in COLUMNS if c not in table]
    if missing:
        raise ValueError(f"a runs table needs the columns {list(COLUMNS)}; missing {missing}")
    if table.duplicated(["run", "metric"]).any():
        raise ValueError("a runs table has one row per (run, metric)")
    return table.dropna(subset=["value"])


def seed_spread(table: pd.DataFrame) -> pd.DataFrame:
    """Per (metric, config) with at least two seeds: ``spread = max - min`` of ``value`` over the seeds.
    Columns: metric, config, n_seeds, spread."""
    table = _check(table)
    grouped = table.groupby(["metric", "config"], sort=False)["value"]
    out = grouped.agg(n_seeds="count", spread=lambda v: float(v.max() - v.min())).reset_index()
    return out[out["n_seeds"] >= 2].reset_index(drop=True)


def seed_noise(table: pd.DataFrame) -> dict[str, float]:
    """Per metric: the largest ``seed_spread`` over the configs trained with two or more seeds."""
    spread = seed_spread(table)
    return {str(m): float(s) for m, s in spread.groupby("metric", sort=False)["spread"].max().items()}


def config_differences(table: pd.DataFrame, reference: str) -> pd.DataFrame:
    """Per metric and config != ``reference``: mean over its seeds (``value``), the reference's (``reference_value``),
    ``delta = value - reference_value``, ``noise`` (``seed_noise``, NaN where unmeasured) and ``beyond``
    (``|delta| > noise``; None where either is missing). Configs and metrics keep their order in ``table``."""
    table = _check(table)
    if reference not in set(table["config"]):
        raise ValueError(f"no runs of the reference config {reference!r} in the table")
    noise = seed_noise(table)
    means = table.groupby(["metric", "config"], sort=False)["value"].mean()
    rows = []
    for metric in dict.fromkeys(table["metric"]):
        ref = means.get((metric, reference), math.nan)
        for config in dict.fromkeys(table["config"]):
            if config == reference or (metric, config) not in means:
                continue
            value = float(means[(metric, config)])
            delta = value - ref
            floor = noise.get(str(metric), math.nan)
            known = math.isfinite(delta) and math.isfinite(floor)
            rows.append(
                dict(
                    metric=metric,
                    config=config,
                    value=value,
                    reference_value=float(ref),
                    delta=delta,
                    noise=floor,
                    beyond=bool(abs(delta) > floor) if known else None,
                )
            )
    return pd.DataFrame(rows, columns=["metric", "config", "value", "reference_value", "delta", "noise", "beyond"])
