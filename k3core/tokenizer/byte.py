"""The UTF-8 byte tokenizer: ids 0..255 are the bytes themselves (the sample checkpoints use it)."""

from __future__ import annotations

from .base import Tokenizer


class ByteTokenizer(Tokenizer):
    """UTF-8 byte-level tokenizer: every string maps to its UTF-8 bytes (ids ``0..255``)."""

    kind = "bytes"
    name = "UTF-8 bytes"
    vocab_size: int = 256
    digest = "utf-8-bytes"

    def __init__(self) -> None:
        self.special_tokens = {}

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as a list of ints in ``[0, 256)``."""
        return list(text.encode("utf-8"))

    def _decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def _piece(self, token_id: int) -> bytes:
        return bytes([token_id])

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"
