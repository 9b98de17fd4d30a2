"""How much of a generated text is real words: the share of its words that occur in a reference vocabulary (the
training text's words), so "mostly real words" is a number with references beside it.

A word is a run of ASCII letters with inner apostrophes (``o'er``), lowercased, of at least ``MIN_WORD_LETTERS``
letters: random letters make mostly real one- and two-letter words ("a", "o", "an", "to"), so counting those would
score an untrained model's random bytes about 0.56 on the Shakespeare vocabulary; from three letters on they score
about 0, held-out Shakespeare 0.95-0.99, and the first shipped samples ("Shakespeare-shaped nonsense") 0.68-0.75.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
MIN_WORD_LETTERS = 3


def words(text: str, min_letters: int = MIN_WORD_LETTERS) -> list[str]:
    """The words of ``text`` in order (``WORD``, at least ``min_letters`` letters), lowercased."""
    return [w.lower() for w in WORD.findall(text) if sum(c.isalpha() for c in w) >= min_letters]


def vocabulary(texts: Iterable[str]) -> frozenset[str]:
    """Every word (``words``, any length) of the reference texts."""
    return frozenset(w for text in texts for w in words(text, min_letters=1))


def real_word_share(text: str, vocab: frozenset[str]) -> tuple[float, int]:
    """(share, n): of the ``n`` words of ``text`` (``words``), the share found in ``vocab``, each occurrence counted:
    ``|{w in words(text): w in vocab}| / n`` (NaN when the text has no word)."""
    found = words(text)
    if not found:
        return float("nan"), 0
    return sum(w in vocab for w in found) / len(found), len(found)
