"""A ``tokenizer.json`` read by the ``tokenizers`` library (:class:`HFTokenizer`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..utils.files import parse_json, read_bytes_limited
from .base import Tokenizer, TokenizerError, content_digest

MAX_TOKENIZER_BYTES = 256 * 1024**2  # tokenizer.json (a 256K-token vocabulary: about 35 MB)

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-character table that byte-level BPE vocabularies are written in.

    Bytes that are printable Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves; the other
    68 bytes, in increasing order, become the characters U+0100, U+0101, ... (so ``' '`` is ``Ġ``, ``'\\n'`` ``Ċ``).
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


def _decoder_types(spec: Any) -> set[str]:
    """Every ``type`` named in a tokenizer.json ``decoder`` entry (nested ``Sequence`` decoders included)."""
    if isinstance(spec, dict):
        found = {spec["type"]} if isinstance(spec.get("type"), str) else set()
        for value in spec.values():
            found |= _decoder_types(value)
        return found
    if isinstance(spec, list):
        return set().union(*(_decoder_types(v) for v in spec)) if spec else set()
    return set()


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` read by the ``tokenizers`` library (BPE, WordPiece, Unigram, WordLevel)."""

    kind = "tokenizers"

    def __init__(
        self, tokenizer: Any, name: str = "tokenizer.json", decoder_spec: Any = None, digest: str = ""
    ) -> None:
        self._tok = tokenizer
        self.digest = digest
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._added = {int(i): t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.special_tokens = {content: i for i, content in self._added.items()}
        types = _decoder_types(decoder_spec)
        self._byte_level = "ByteLevel" in types
        self._metaspace = "Metaspace" in types or "Replace" in types
        self._byte_decoder = _gpt2_byte_decoder() if self._byte_level else {}
        model = type(tokenizer.model).__name__
        self.name = f"{name} ({model}, {self.vocab_size:,} ids)"

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        """Load ``tokenizer.json``; TokenizerError naming the file if it is not a tokenizers file."""
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        try:
            text = read_bytes_limited(path, MAX_TOKENIZER_BYTES).decode("utf-8")
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{path.name}: unreadable tokenizer.json ({str(exc)[:200]})") from exc
        spec = parse_json(text, f"{path.name}: unreadable tokenizer.json", TokenizerError)
        try:
            tokenizer = _Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises plain Exception for a JSON it cannot build a tokenizer from
            raise TokenizerError(f"{path.name}: not a tokenizers tokenizer.json ({str(exc)[:200]})") from exc
        decoder = spec.get("decoder") if isinstance(spec, dict) else None
        return cls(tokenizer, name=path.name, decoder_spec=decoder, digest=content_digest(text.encode("utf-8")))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def _piece(self, token_id: int) -> bytes | str:
        if token_id in self._added:
            return self._added[token_id]
        piece = self._tok.id_to_token(token_id)
        if piece is None:  # a hole in the id range
            return f"<id {token_id}>"
        byte = _BYTE_FALLBACK.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if self._byte_level:
            try:
                return bytes(self._byte_decoder[c] for c in piece)
            except KeyError:  # not written in the byte alphabet
                return piece
        if self._metaspace:
            return piece.replace("▁", " ")
        return piece
