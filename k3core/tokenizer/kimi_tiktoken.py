"""Kimi's tokenizer: ``tiktoken`` over a ``tiktoken.model`` rank file, Kimi's split pattern and the special
tokens of ``tokenizer_config.json`` (:class:`TiktokenTokenizer`)."""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from ..utils.files import parse_json, read_bytes_limited
from .base import Tokenizer, TokenizerError, content_digest

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
MAX_RANKS_BYTES = 64 * 1024**2  # Kimi's tiktoken.model: 2.6 MB
MAX_CONFIG_BYTES = 16 * 1024**2  # tokenizer_config.json
MAX_SPECIAL_TOKENS = 64 * 1024  # when no model vocabulary bounds them


def read_tiktoken_ranks(path: str | Path, max_ranks: int | None = None) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken file: one ``base64(token bytes) rank`` line per token.

    Checks what tiktoken needs and would otherwise crash on: ranks ``0..n-1`` each used once, no token twice,
    every single byte present (BPE starts from bytes); with ``max_ranks`` (the model's vocabulary), no more
    lines than that, counted before any is parsed. Raises TokenizerError naming the file and line."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    try:
        data = read_bytes_limited(path, MAX_RANKS_BYTES)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path.name}: unreadable ({exc})") from exc
    if max_ranks is not None and data.count(b"\n") > max_ranks:
        raise TokenizerError(f"{path.name}: more ranks than the model's {max_ranks:,} token ids")
    lines = data.splitlines()
    for lineno, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise TokenizerError(f"{path.name}, line {lineno}: expected 'base64-token rank', got {line[:80]!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError) as exc:
            raise TokenizerError(f"{path.name}, line {lineno}: expected 'base64-token rank' ({exc})") from exc
        if token in ranks:
            raise TokenizerError(f"{path.name}, line {lineno}: token {token!r} appears twice")
        ranks[token] = rank
    if not ranks:
        raise TokenizerError(f"{path.name}: no ranks (expected one 'base64-token rank' line per token)")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path.name}: ranks must be 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{path.name}: {len(missing)} single bytes have no rank (e.g. 0x{missing[0]:02X}); byte-level BPE "
            "needs all 256"
        )
    return ranks


def _special_tokens_from_config(
    config: dict, n_ranks: int, where: str, vocab_size: int | None = None
) -> dict[str, int]:
    """Kimi's special tokens: ids ``n_ranks .. n_ranks + 255`` (more if ``added_tokens_decoder`` names higher
    ids), named by ``added_tokens_decoder`` or ``<|reserved_token_{id}|>``.

    Every id is checked against the model's ``vocab_size`` (when given; else at most MAX_SPECIAL_TOKENS)
    before any token is made: one id of 10**6 would otherwise build a million special tokens."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{where}: added_tokens_decoder must be an object of id -> token")
    named: dict[int, str] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        try:
            idx = int(key) if len(key) <= 20 else None
        except ValueError:
            idx = None
        if idx is None:
            raise TokenizerError(f"{where}: added_tokens_decoder key {key[:40]!r} is not a token id")
        if not isinstance(content, str) or not content:
            raise TokenizerError(f"{where}: added_tokens_decoder[{key}] has no 'content' string")
        if idx < n_ranks:
            raise TokenizerError(
                f"{where}: special token {content!r} has id {idx}, inside the {n_ranks:,} BPE ranks of tiktoken.model"
            )
        named[idx] = content
    top = max(named) + 1 if named else 0
    count = max(KIMI_NUM_RESERVED_SPECIAL_TOKENS, top - n_ranks)
    if vocab_size is not None and n_ranks + count > vocab_size:
        raise TokenizerError(
            f"{where}: the tokenizer ({n_ranks:,} BPE ranks + {count:,} special ids) has ids up to "
            f"{n_ranks + count - 1:,} but the model's vocab_size is {vocab_size:,}: it is not this model's tokenizer"
        )
    if count > MAX_SPECIAL_TOKENS:
        raise TokenizerError(f"{where}: {count:,} special token ids; at most {MAX_SPECIAL_TOKENS:,}")
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
    def from_folder(cls, folder: str | Path, vocab_size: int | None = None) -> TiktokenTokenizer:
        """Read ``tiktoken.model`` and ``tokenizer_config.json`` from a checkpoint folder (Kimi's layout).

        With ``vocab_size`` (the model's), a tokenizer with more ids is refused before it is built."""
        folder = Path(folder)
        model_file, config_file = folder / "tiktoken.model", folder / "tokenizer_config.json"
        if not config_file.is_file():
            raise TokenizerError(
                f"{folder.name}: has tiktoken.model but no tokenizer_config.json (needed for the special tokens; "
                "copy it from the checkpoint's repository)"
            )
        try:
            raw_config = read_bytes_limited(config_file, MAX_CONFIG_BYTES)
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{config_file.name}: unreadable ({exc})") from exc
        config = parse_json(raw_config, f"{config_file.name}: unreadable", TokenizerError)
        if not isinstance(config, dict):
            raise TokenizerError(f"{config_file.name}: expected a JSON object")
        ranks = read_tiktoken_ranks(model_file, vocab_size)
        specials = _special_tokens_from_config(config, len(ranks), config_file.name, vocab_size)
        model_bytes = read_bytes_limited(model_file, MAX_RANKS_BYTES)
        digest = content_digest(model_bytes, json.dumps(specials, sort_keys=True).encode())
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
