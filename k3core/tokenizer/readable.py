"""Tokens as readable strings, for figure axes and hovers: whitespace made visible (``' '`` -> ``␣``,
``'\\n'`` -> ``↵``, ``'\\t'`` -> ``⇥``, ``'\\r'`` -> ``␍``), invisible characters escaped (``\\x00``) and bytes
that are not whole UTF-8 characters shown as ``<0xE2>``."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})


def readable_text(text: str) -> str:
    """``text`` with whitespace made visible (␣ ↵ ⇥ ␍), invisible characters escaped (``\\x00``, ``\\u200b``)
    and undecodable bytes (surrogate-escaped, U+DC80..U+DCFF) shown as ``<0xHH>``."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif 0xDC80 <= code <= 0xDCFF:
            out.append(f"<0x{code - 0xDC00:02X}>")
        elif unicodedata.category(ch) in _INVISIBLE_CATEGORIES:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def readable_bytes(data: bytes) -> str:
    """A token's bytes as readable text: whole UTF-8 characters as themselves, other bytes as ``<0xHH>``."""
    return readable_text(bytes(data).decode("utf-8", errors="surrogateescape"))


def token_axis_labels(strings: Sequence[str], start: int = 0) -> list[str]:
    """Unique category labels for a token axis: ``"{position}:{string}"`` (``"12:␣the"``), positions from
    ``start``. Plotly merges equal categories, so repeated tokens need their position to stay apart."""
    return [f"{start + i}:{s}" for i, s in enumerate(strings)]
