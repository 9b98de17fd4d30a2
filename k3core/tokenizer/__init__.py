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

Modules: ``base`` (the :class:`Tokenizer` protocol, :class:`TokenizerError`), ``readable`` (readable token
strings), ``byte`` (:class:`ByteTokenizer`), ``hf`` (:class:`HFTokenizer`), ``kimi_tiktoken``
(:class:`TiktokenTokenizer`), ``load`` (:func:`load_tokenizer`).
"""

from .base import Tokenizer, TokenizerError
from .byte import ByteTokenizer
from .hf import HFTokenizer
from .kimi_tiktoken import KIMI_NUM_RESERVED_SPECIAL_TOKENS, KIMI_PAT_STR, TiktokenTokenizer, read_tiktoken_ranks
from .load import TOKENIZER_FILES, load_tokenizer
from .readable import readable_bytes, readable_text, token_axis_labels

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
