"""Choosing a checkpoint folder's tokenizer (:func:`load_tokenizer`; the order is in the package docstring)."""

from __future__ import annotations

from pathlib import Path

from .base import Tokenizer, TokenizerError
from .byte import ByteTokenizer
from .hf import HFTokenizer
from .kimi_tiktoken import TiktokenTokenizer

#: The files ``load_tokenizer`` looks for, in order of preference.
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json")


def load_tokenizer(folder: str | Path, vocab_size: int) -> Tokenizer:
    """The tokenizer of a checkpoint folder for a model with ``vocab_size`` ids (the order is in the package docstring).

    Raises TokenizerError when the folder has no usable tokenizer or the tokenizer has more ids than the model.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"{folder.name}: not a folder (looked for tokenizer.json or tiktoken.model in it)")
    if (folder / "tokenizer.json").is_file():
        tok: Tokenizer = HFTokenizer.from_file(folder / "tokenizer.json")
    elif (folder / "tiktoken.model").is_file():
        tok = TiktokenTokenizer.from_folder(folder, int(vocab_size))
    elif int(vocab_size) == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    else:
        raise TokenizerError(
            f"{folder.name}: no tokenizer for a model with {int(vocab_size):,} token ids (looked for tokenizer.json, "
            f"or tiktoken.model + tokenizer_config.json; the built-in byte tokenizer fits only vocab_size 256). "
            "Copy the checkpoint's tokenizer files into the folder."
        )
    if tok.vocab_size > int(vocab_size):
        raise TokenizerError(
            f"{folder.name}: the tokenizer ({tok.name}) has ids up to {tok.vocab_size - 1:,} but the model's "
            f"vocab_size is {int(vocab_size):,}: it is not this model's tokenizer"
        )
    return tok
