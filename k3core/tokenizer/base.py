"""The tokenizer protocol every tokenizer implements (:class:`Tokenizer`) and its one error type."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from .readable import readable_bytes, readable_text


class TokenizerError(ValueError):
    """A tokenizer is missing, unreadable or does not fit the model (the message names the folder or file)."""


def content_digest(*parts: bytes) -> str:
    """16 hex digits of sha256 over the parts, each prefixed by its length (so ``(a, bc)`` != ``(ab, c)``):
    identifies a tokenizer's files' contents for cache keys."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:16]


def _id_list(ids: Any) -> list[int]:
    """Token ids from a list, a numpy array or a torch tensor (any shape, flattened) as Python ints."""
    if hasattr(ids, "reshape") and hasattr(ids, "tolist"):
        ids = ids.reshape(-1).tolist()
    elif isinstance(ids, int):
        ids = [ids]
    return [int(i) for i in ids]


class Tokenizer(ABC):
    """Text <-> token ids, plus a readable string per token.

    ``vocab_size`` is one more than the largest id the tokenizer can produce or decode; ``special_tokens``
    maps the name of each added / special token to its id; ``kind`` is ``"bytes"``, ``"tokenizers"`` or
    ``"tiktoken"``; ``name`` says where it came from, for captions; ``digest`` identifies its files' contents
    (cache keys: two runs with the same vocabulary size may still tokenize differently).
    """

    kind: str = ""
    name: str = ""
    vocab_size: int = 0
    digest: str = ""
    special_tokens: dict[str, int]

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token names in the text become their ids; no BOS/EOS added)."""

    @abstractmethod
    def _decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def _piece(self, token_id: int) -> bytes | str:
        """The token's raw bytes (byte-level tokenizers) or its string (special tokens, word vocabularies)."""

    def decode(self, ids: Iterable[int] | Any) -> str:
        """Text of ``ids`` (list, numpy array or torch tensor); invalid UTF-8 becomes U+FFFD.

        Raises ValueError for an id outside ``[0, vocab_size)`` (e.g. ``-100`` padding)."""
        values = _id_list(ids)
        bad = [i for i in values if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"{type(self).__name__}.decode: ids must be in [0, {self.vocab_size}), got e.g. {bad[0]}")
        return self._decode(values)

    def token_strings(self, ids: Iterable[int] | Any) -> list[str]:
        """One readable string per id (``k3core.tokenizer.readable``); an id outside the vocabulary is ``<id N>``."""
        out = []
        for i in _id_list(ids):
            if not 0 <= i < self.vocab_size:
                out.append(f"<id {i}>")
                continue
            piece = self._piece(i)
            out.append(readable_bytes(piece) if isinstance(piece, bytes) else readable_text(piece))
        return out

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (trace meta, model cards)."""
        return {"kind": self.kind, "name": self.name, "vocab_size": int(self.vocab_size), "digest": self.digest}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"
