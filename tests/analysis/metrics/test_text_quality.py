"""Real-word share (analysis.metrics.text_quality): hand-counted cases, and the references it is read against on
the Shakespeare vocabulary: held-out text scores high, random bytes about 0."""

from __future__ import annotations

import math

import numpy as np

from analysis.metrics import text_quality as tq
from k3core.data import load_shakespeare


def test_words_are_letter_runs_of_three_or_more_lowercased_with_inner_apostrophes():
    assert tq.words("O'er the HILLS, a fox-trot; 'tis 42 go") == ["o'er", "the", "hills", "fox", "trot", "tis"]
    assert tq.words("a an to", min_letters=1) == ["a", "an", "to"]
    vocab = tq.vocabulary(["The hills are green.", "A fox"])
    assert vocab == {"the", "hills", "are", "green", "a", "fox"}
    assert tq.real_word_share("the hills blorp the", vocab) == (0.75, 4)
    share, n = tq.real_word_share("a 1 ?", vocab)
    assert math.isnan(share) and n == 0


def test_held_out_text_scores_high_and_random_bytes_about_zero():
    corpus = load_shakespeare()
    vocab = tq.vocabulary([bytes(corpus.train).decode("utf-8", "replace")])
    val = bytes(corpus.val).decode("utf-8", "replace")
    held_out = [tq.real_word_share(val[s : s + 2000], vocab)[0] for s in range(0, 200_000, 40_000)]
    assert min(held_out) > 0.9
    noise = np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes().decode("utf-8", "replace")
    share, n = tq.real_word_share(noise, vocab)
    assert n < 40 and share < 0.2  # random bytes rarely spell three letters, and then seldom a word
