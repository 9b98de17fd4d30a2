"""Tidy tables shared by the diagnostics: which columns index a table, and the error for missing trace data."""

from __future__ import annotations

import pandas as pd


class MissingTraceData(LookupError):
    """The trace lacks the arrays a metric needs (the message names them and how to record them)."""


def tidy(df: pd.DataFrame, keys: list[str], value: str | None = None) -> pd.DataFrame:
    """Mark the key (index-like) columns and the main value column (``df.attrs["keys"]``, ``df.attrs["value"]``),
    so that exports and comparisons know how the table is indexed."""
    df.attrs["keys"] = list(keys)
    if value is not None:
        df.attrs["value"] = value
    return df
