"""Tokenizers: a checkpoint folder's own tokenizer, or UTF-8 bytes.

``load_tokenizer(folder, vocab_size)`` picks, in this order:

1. ``tokenizer.json`` in the folder -> :class:`HFTokenizer` (the ``tokenizers`` library);
2. ``tiktoken.model`` + ``tokenizer_config.json`` (Kimi's layout) -> :class:`TiktokenTokenizer`: ``tiktoken``
   with that file's ranks (one ``base64-token rank`` line each), Kimi's split pattern (:data:`KIMI_PAT_STR`)
   and special tokens at ids ``n_ranks .. n_ranks + 255`` named by ``added_tokens_decoder``
   (unnamed slots are ``<|reserved_token_{id}|>``, as in Kimi's ``tokenization_kimi.py``);
3. no tokenizer file and ``vocab_size == 256`` -> :class:`ByteTokenizer` (the sample checkpoints);
4. anything else -> :class:`TokenizerError` naming the folder and the files looked for.

A tokenizer whose ids do not fit the model (``tokenizer.vocab_size > vocab_size``) is refused.

Every tokenizer has ``encode(text) -> list[int]`` (no BOS/EOS added: ``decode(encode(text)) == text`` for the
byte-level tokenizers), ``decode(ids) -> str`` and ``token_strings(ids) -> list[str]``: one readable string per
token for figure axes and hovers, with whitespace made visible (``' '`` -> ``␣``, ``'\\n'`` -> ``↵``,
``'\\t'`` -> ``⇥``), control characters escaped (``\\x00``) and bytes that are not whole UTF-8 characters shown
as ``<0xE2>``. Special tokens are shown by their name (``<|im_end|>``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "KIMI_NUM_RESERVED_SPECIAL_TOKENS",
    "KIMI_PAT_STR",
    "TOKENIZER_FILES",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "read_tiktoken_ranks",
    "readable_bytes",
    "readable_text",
    "token_axis_labels",
]

#: The files ``load_tokenizer`` looks for, in order of preference.
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json")

#: Kimi's pre-tokenizer split (``pat_str`` of ``tokenization_kimi.py``, Kimi K2 / Kimi Linear): runs of Han
#: characters first, then cl100k-like words with Han excluded from the letter classes (``&&[^\p{Han}]``),
#: numbers in groups of at most three digits, punctuation runs, newlines and other whitespace.
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

#: Special-token slots Kimi reserves right after the BPE ranks (163,584 ranks + 256 = 163,840 ids).
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256

# tiktoken's Rust core recurses over long runs of one character class; Kimi's own tokenizer cuts texts into
# pieces of at most 400,000 characters with at most 25,000 consecutive whitespace / non-whitespace characters.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})


class TokenizerError(ValueError):
    """A tokenizer is missing, unreadable or does not fit the model (the message names the folder or file)."""


# ----------------------------------------------------------------------------- readable strings
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


def _digest(*parts: bytes) -> str:
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


# ----------------------------------------------------------------------------- the protocol
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
        """One readable string per id (see the module docstring); an id outside the vocabulary is ``<id N>``."""
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


# ----------------------------------------------------------------------------- UTF-8 bytes
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


# ----------------------------------------------------------------------------- tokenizer.json
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
            text = path.read_text(encoding="utf-8")
            spec = json.loads(text)
            tokenizer = _Tokenizer.from_str(text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"{path}: unreadable tokenizer.json ({exc})") from exc
        except Exception as exc:  # tokenizers raises plain Exception for a JSON it cannot build a tokenizer from
            raise TokenizerError(f"{path}: not a tokenizers tokenizer.json ({exc})") from exc
        decoder = spec.get("decoder") if isinstance(spec, dict) else None
        return cls(tokenizer, name=path.name, decoder_spec=decoder, digest=_digest(text.encode("utf-8")))

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


# ----------------------------------------------------------------------------- tiktoken.model (Kimi)
def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken file: one ``base64(token bytes) rank`` line per token.

    Checks what tiktoken needs and would otherwise crash on: ranks ``0..n-1`` each used once, no token twice,
    every single byte present (BPE starts from bytes). Raises TokenizerError naming the file and line."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise TokenizerError(f"{path}: unreadable ({exc})") from exc
    for lineno, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise TokenizerError(f"{path}, line {lineno}: expected 'base64-token rank', got {line[:80]!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError) as exc:
            raise TokenizerError(f"{path}, line {lineno}: expected 'base64-token rank' ({exc})") from exc
        if token in ranks:
            raise TokenizerError(f"{path}, line {lineno}: token {token!r} appears twice")
        ranks[token] = rank
    if not ranks:
        raise TokenizerError(f"{path}: no ranks (expected one 'base64-token rank' line per token)")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{path}: {len(missing)} single bytes have no rank (e.g. 0x{missing[0]:02X}); byte-level BPE needs all 256"
        )
    return ranks


def _special_tokens_from_config(config: dict, n_ranks: int, where: Path) -> dict[str, int]:
    """Kimi's special tokens: ids ``n_ranks .. n_ranks + 255`` (more if ``added_tokens_decoder`` names higher
    ids), named by ``added_tokens_decoder`` or ``<|reserved_token_{id}|>``."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{where}: added_tokens_decoder must be an object of id -> token")
    named: dict[int, str] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        try:
            idx = int(key)
        except ValueError as exc:
            raise TokenizerError(f"{where}: added_tokens_decoder key {key!r} is not a token id") from exc
        if not isinstance(content, str) or not content:
            raise TokenizerError(f"{where}: added_tokens_decoder[{key}] has no 'content' string")
        if idx < n_ranks:
            raise TokenizerError(
                f"{where}: special token {content!r} has id {idx}, inside the {n_ranks:,} BPE ranks of tiktoken.model"
            )
        named[idx] = content
    top = max(named) + 1 if named else 0
    count = max(KIMI_NUM_RESERVED_SPECIAL_TOKENS, top - n_ranks)
    specials: dict[str, int] = {}
    for idx in range(n_ranks, n_ranks + count):
        content = named.get(idx, f"<|reserved_token_{idx}|>")
        if content in specials:
            raise TokenizerError(f"{where}: special token {content!r} is given two ids ({specials[content]}, {idx})")
        specials[content] = idx
    return specials


def _tiktoken_pieces(text: str) -> list[str]:
    """Cut ``text`` where tiktoken could overflow: every ``_TIKTOKEN_MAX_CHARS`` characters and inside runs of
    more than ``_TIKTOKEN_MAX_RUN`` whitespace (or non-whitespace) characters. Short texts stay whole."""
    if len(text) <= _TIKTOKEN_MAX_RUN:
        return [text]
    pieces: list[str] = []
    for start in range(0, len(text), _TIKTOKEN_MAX_CHARS):
        block = text[start : start + _TIKTOKEN_MAX_CHARS]
        cut, run, last_space = 0, 0, None
        for i, ch in enumerate(block):
            space = ch.isspace()
            run = run + 1 if space == last_space else 1
            last_space = space
            if run > _TIKTOKEN_MAX_RUN:
                pieces.append(block[cut:i])
                cut, run = i, 1
        pieces.append(block[cut:])
    return pieces


class TiktokenTokenizer(Tokenizer):
    """Kimi's tokenizer: ``tiktoken`` over ``tiktoken.model`` ranks with :data:`KIMI_PAT_STR` and the special
    tokens of ``tokenizer_config.json``."""

    kind = "tiktoken"

    def __init__(
        self, ranks: dict[bytes, int], special_tokens: dict[str, int], name: str = "tiktoken.model", digest: str = ""
    ) -> None:
        import tiktoken

        self.digest = digest
        self._enc = tiktoken.Encoding(
            name=name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=special_tokens
        )
        self.special_tokens = dict(special_tokens)
        self._special_names = {i: s for s, i in special_tokens.items()}
        self.vocab_size = max([len(ranks) - 1, *special_tokens.values()]) + 1
        self.name = f"{name} ({len(ranks):,} BPE ranks + {len(special_tokens)} special ids)"

    @classmethod
    def from_folder(cls, folder: str | Path) -> TiktokenTokenizer:
        """Read ``tiktoken.model`` and ``tokenizer_config.json`` from a checkpoint folder (Kimi's layout)."""
        folder = Path(folder)
        model_file, config_file = folder / "tiktoken.model", folder / "tokenizer_config.json"
        if not config_file.is_file():
            raise TokenizerError(
                f"{folder}: has tiktoken.model but no tokenizer_config.json (needed for the special tokens; "
                "copy it from the checkpoint's repository)"
            )
        ranks = read_tiktoken_ranks(model_file)
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"{config_file}: unreadable ({exc})") from exc
        if not isinstance(config, dict):
            raise TokenizerError(f"{config_file}: expected a JSON object")
        specials = _special_tokens_from_config(config, len(ranks), config_file)
        digest = _digest(model_file.read_bytes(), json.dumps(specials, sort_keys=True).encode())
        return cls(ranks, specials, name=model_file.name, digest=digest)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _tiktoken_pieces(text):
            ids.extend(self._enc.encode(piece, allowed_special="all"))
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids, errors="replace")

    def _piece(self, token_id: int) -> bytes | str:
        if token_id in self._special_names:
            return self._special_names[token_id]
        return self._enc.decode_single_token_bytes(token_id)


# ----------------------------------------------------------------------------- choosing one
def load_tokenizer(folder: str | Path, vocab_size: int) -> Tokenizer:
    """The tokenizer of a checkpoint folder for a model with ``vocab_size`` ids (see the module docstring).

    Raises TokenizerError when the folder has no usable tokenizer or the tokenizer has more ids than the model.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"{folder}: not a folder (looked for tokenizer.json or tiktoken.model in it)")
    if (folder / "tokenizer.json").is_file():
        tok: Tokenizer = HFTokenizer.from_file(folder / "tokenizer.json")
    elif (folder / "tiktoken.model").is_file():
        tok = TiktokenTokenizer.from_folder(folder)
    elif int(vocab_size) == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    else:
        raise TokenizerError(
            f"{folder}: no tokenizer for a model with {int(vocab_size):,} token ids (looked for tokenizer.json, "
            f"or tiktoken.model + tokenizer_config.json; the built-in byte tokenizer fits only vocab_size 256). "
            "Copy the checkpoint's tokenizer files into the folder."
        )
    if tok.vocab_size > int(vocab_size):
        raise TokenizerError(
            f"{folder}: the tokenizer ({tok.name}) has ids up to {tok.vocab_size - 1:,} but the model's "
            f"vocab_size is {int(vocab_size):,}: it is not this model's tokenizer"
        )
    return tok
