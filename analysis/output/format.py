"""Numbers as people read them: the one formatter behind the app, the report and ``k3lab inspect``."""

from __future__ import annotations

import math
import numbers
from typing import Any

MISSING = "n/a"


def format_number(value: Any, digits: int = 4) -> str:
    """A compact display of one number.

    None and NaN -> "n/a"; +-inf -> "∞" / "-∞"; bool -> "True" / "False"; integers with thousands
    separators ("12,345"); other reals with ``digits`` significant digits (``f"{v:.{digits}g}"``:
    2.51234 -> "2.512", 0.000123 -> "0.000123", 123456.7 -> "1.235e+05"). Anything else: ``str``.
    """
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        v = float(value)
        if math.isnan(v):
            return MISSING
        if math.isinf(v):
            return "∞" if v > 0 else "-∞"
        return f"{v:.{digits}g}"
    return str(value)


def format_count(n: float) -> str:
    """A large count with a unit suffix, 3 significant figures: 1234 -> "1.23K", 2.5e9 -> "2.50B", 999 -> "999"."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def format_tokens(n: int) -> str:
    """A token count in binary units when exact: 1024 -> "1K", 1048576 -> "1M", 1000 -> "1000"."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}K"
    return str(n)


def format_bytes(n: float) -> str:
    """A byte count in binary units, one decimal: 512 -> "512 B", 1536 -> "1.5 KiB", 98.25e9 -> "91.5 GiB"
    (the one byte formatter; inf and nan as they are)."""
    if not math.isfinite(n):
        return str(n)
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"
