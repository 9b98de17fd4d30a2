"""Tidy tables: marking which columns index a diagnostics table and which is its value."""

from __future__ import annotations

import pandas as pd


def tidy(df: pd.DataFrame, keys: list[str], value: str | None = None) -> pd.DataFrame:
    """Mark the key (index-like) columns and the main value column (``df.attrs["keys"]``, ``df.attrs["value"]``),
    so that exports and comparisons know how the table is indexed."""
    df.attrs["keys"] = list(keys)
    if value is not None:
        df.attrs["value"] = value
    return df
