"""Sizes written by people: "6GB", "80GiB", "512MiB", "1.5TB", "6e9" -> bytes (the one parser every option uses).

Decimal units are powers of 1000 (GB = 10^9), binary units powers of 1024 (GiB = 2^30), as accelerate's
``max_memory`` reads them; the trailing B may be left out ("80G", "80Gi").
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:([KMGT])(i?)B?|(B))?", re.IGNORECASE)


def parse_bytes(value: int | float | str, bare: int = 1, what: str = "a size", zero_ok: bool = False) -> int:
    """Bytes of ``value``: a positive number (zero too with ``zero_ok``) times ``bare`` (the unit of a bare number:
    1 for bytes, 2**30 for GiB), or a text with a unit. Raises ValueError naming ``what``."""
    if isinstance(value, bool):
        raise ValueError(f"cannot read {what} {value!r} (examples: 6GB, 80GiB, 512MiB)")
    if isinstance(value, (int, float)):
        number, scale = float(value), bare
    else:
        m = _SIZE.fullmatch(str(value).strip())
        if not m:
            raise ValueError(f"cannot read {what} {value!r} (examples: 6GB, 80GiB, 512MiB)")
        number, prefix, binary = float(m.group(1)), m.group(2), m.group(3)
        if prefix:
            scale = (1024 if binary else 1000) ** ("KMGT".index(prefix.upper()) + 1)
        else:
            scale = 1 if m.group(4) else bare
    if not (number >= 0 if zero_ok else number > 0) or number * scale >= 2**63:
        least = "at least 0" if zero_ok else "positive"
        raise ValueError(f"{what} must be {least} and below 8 EiB, got {value!r}")
    return int(number * scale)
