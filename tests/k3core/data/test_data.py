"""Tests for k3core.data: corpora, baselines, batching and MQAR."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from k3core.data import (
    DEFAULT_VAL_PLAYS,
    IGNORE_INDEX,
    Corpus,
    clean_play_markdown,
    eval_window_starts,
    list_shakespeare_plays,
    load_shakespeare,
    load_text_path,
    make_mqar,
    make_mqar_packed,
    mix_mqar,
    mqar_accuracy,
    random_batches,
    segment_queries,
    unigram_bits_per_byte,
    unigram_cross_entropy_bits,
    windows,
)
from tests.conftest import nano_model
from tests.repo.scan import CODE_FOLDERS, matching_lines

# --------------------------------------------------------------------------------------------
# Shakespeare corpus
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shakespeare() -> Corpus:
    return load_shakespeare()


def test_list_shakespeare_plays():
    plays = list_shakespeare_plays()
    assert len(plays) == 38
    assert plays == list_shakespeare_plays()
    assert all(p.suffix == ".md" and p.is_file() for p in plays)
    rel = [f"{p.parent.name}/{p.name}" for p in plays]
    assert rel == sorted(rel)


def test_shakespeare_split_by_play(shakespeare):
    c = shakespeare
    assert c.train.dtype == np.uint8 and c.val.dtype == np.uint8
    assert c.train.ndim == 1 and c.val.ndim == 1
    assert len(c.train) > 1_000_000 and len(c.val) > 50_000
    assert set(c.val_names) == set(DEFAULT_VAL_PLAYS)
    assert not set(c.train_names) & set(c.val_names)
    assert len(c.train_names) + len(c.val_names) == 38
    # cleaned text is pure ASCII and has no NUL (so MQAR's tokens never collide with it)
    assert int(c.train.max()) < 128 and int(c.val.max()) < 128
    assert int(c.train.min()) > 0 and int(c.val.min()) > 0
    text = bytes(c.val).decode("ascii")
    assert "**" not in text and "##" not in text and "\\" not in text
    assert "\nFLAVIUS:\nHence! home, you idle creatures get you home:" in text  # Julius Caesar 1.1


def test_shakespeare_deterministic_and_configurable(shakespeare):
    again = load_shakespeare()
    assert np.array_equal(again.train, shakespeare.train)
    assert np.array_equal(again.val, shakespeare.val)
    assert again.val_names == shakespeare.val_names

    c = load_shakespeare(val_plays=["hamlet", "tragedies/macbeth"])
    assert c.val_names == ["hamlet", "macbeth"]
    assert "hamlet" not in c.train_names and "twelfth-night" in c.train_names
    assert len(c.train) + len(c.val) == len(shakespeare.train) + len(shakespeare.val)
    with pytest.raises(ValueError, match="unknown play"):
        load_shakespeare(val_plays=["not-a-play"])
    with pytest.raises(ValueError):
        load_shakespeare(val_plays=[])


def test_clean_play_markdown():
    md = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A heath.\n\n_Thunder. Enter Witches_\n\n"
        "**First Witch**  \nWhen shall we\u2014three\u2014meet again  \n\\--in rain? &amp; c.\n\n\n\n"
        "__\\[Aside]_  \n"
    )
    out = clean_play_markdown(md)
    assert out == (
        "A Play\n\nACT I\n\nSCENE I. A heath.\n\nThunder. Enter Witches\n\n"
        "First Witch:\nWhen shall we--three--meet again\n--in rain? & c.\n\n[Aside]\n"
    )


# --------------------------------------------------------------------------------------------
# Local text paths
# --------------------------------------------------------------------------------------------


def test_load_text_path_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha text\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# beta\n", encoding="utf-8")
    (tmp_path / "sub" / "c.txt").write_text("gamma ☕\n", encoding="utf-8")
    (tmp_path / "ignored.bin").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    c = load_text_path(tmp_path, val_fraction=0.3)
    assert c.train_names == ["a.txt", "b.md"]
    assert c.val_names == ["sub/c.txt"]
    assert bytes(c.train) == b"alpha text\n\n# beta\n"
    assert bytes(c.val).decode("utf-8") == "gamma ☕\n"
    assert c.train.dtype == np.uint8


def test_load_text_path_single_file(tmp_path):
    f = tmp_path / "doc.txt"
    data = ("To be, or not to be.\n" * 50).encode()
    f.write_bytes(data)
    c = load_text_path(f, val_fraction=0.1)
    assert len(c.train) + len(c.val) == len(data)
    assert len(c.val) == round(0.1 * len(data))
    assert bytes(c.train) + bytes(c.val) == data
    assert c.train_names == c.val_names == ["doc.txt"]
    # a folder with a single file is split the same way
    c2 = load_text_path(tmp_path, val_fraction=0.1)
    assert np.array_equal(c2.train, c.train) and np.array_equal(c2.val, c.val)


def test_load_text_path_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_text_path(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="no \\*.txt"):
        load_text_path(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_text_path(empty)
    with pytest.raises(ValueError, match="empty"):
        load_text_path(tmp_path)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"abc\xff\xfe\x80def")
    with pytest.raises(ValueError, match="UTF-8"):
        load_text_path(binary)
    with pytest.raises(ValueError, match="UTF-8"):
        load_text_path(tmp_path)
    with pytest.raises(ValueError, match="val_fraction"):
        load_text_path(tmp_path, val_fraction=0.0)


# --------------------------------------------------------------------------------------------
# Unigram baselines
# --------------------------------------------------------------------------------------------


def test_unigram_bits_hand_computed():
    # "aab": p(a) = 2/3, p(b) = 1/3 -> H = log2(3) - 2/3
    expected = -(2 / 3) * math.log2(2 / 3) - (1 / 3) * math.log2(1 / 3)
    assert unigram_bits_per_byte(np.frombuffer(b"aab", dtype=np.uint8)) == pytest.approx(expected)
    assert unigram_bits_per_byte(b"aab") == pytest.approx(math.log2(3) - 2 / 3)
    assert unigram_bits_per_byte(b"aaaa") == pytest.approx(0.0)
    assert unigram_bits_per_byte(np.arange(256, dtype=np.uint8)) == pytest.approx(8.0)
    # add-one smoothing: q(a) = 3/259, q(b) = 2/259 when fit on "aab"
    ce = unigram_cross_entropy_bits(b"aab", b"ab")
    assert ce == pytest.approx(-(math.log2(3 / 259) + math.log2(2 / 259)) / 2)


def test_unigram_bits_on_shakespeare(shakespeare):
    h = unigram_bits_per_byte(shakespeare.val)
    ce = unigram_cross_entropy_bits(shakespeare.train, shakespeare.val)
    assert 0.0 < h < 8.0 and 0.0 < ce < 8.0
    assert ce >= h - 1e-9  # cross-entropy under another distribution is never below the entropy
    assert 4.0 < ce < 5.5


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


def test_random_batches_shapes_and_shift():
    data = np.random.default_rng(1).integers(0, 256, size=1000).astype(np.uint8)
    g = torch.Generator().manual_seed(0)
    x, y = random_batches(data, batch_size=4, seq_len=16, generator=g)
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    windows = np.lib.stride_tricks.sliding_window_view(data, 17)
    for row_x, row_y in zip(x, y):
        # each row is a real window of the data, with y the same window shifted by one
        hits = np.nonzero((windows[:, :16] == row_x.numpy()).all(axis=1))[0]
        assert len(hits) == 1
        assert np.array_equal(windows[hits[0], 1:], row_y.numpy())
    x2, y2 = random_batches(data, 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # the very last byte can be a target
    tiny = np.array([1, 2, 3], dtype=np.uint8)
    x, y = random_batches(tiny, 5, 2, torch.Generator().manual_seed(1))
    assert torch.equal(x, torch.tensor([[1, 2]] * 5)) and torch.equal(y, torch.tensor([[2, 3]] * 5))
    with pytest.raises(ValueError):
        random_batches(tiny, 1, 3, torch.Generator())


def test_windows_by_hand():
    data = np.arange(20, dtype=np.uint8)
    x, y = windows(data, [0, 7, 15], 4)
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [[0, 1, 2, 3], [7, 8, 9, 10], [15, 16, 17, 18]]
    assert y.tolist() == [[1, 2, 3, 4], [8, 9, 10, 11], [16, 17, 18, 19]]
    assert windows(b"abcde", [0], 4)[1].tolist() == [[98, 99, 100, 101]]  # bytes work too; the last byte is a target
    with pytest.raises(ValueError, match="does not fit"):
        windows(data, [16], 4)  # needs data[16:21], only 20 bytes


def test_eval_window_starts_by_hand():
    # 1001 bytes, seq_len 100 -> W = 10 full windows; 4 of them at (j * 10 // 4) * 100 = 0, 2, 5, 7 (x100)
    assert eval_window_starts(1001, 100, 4) == [0, 200, 500, 700]
    # more asked than there are: every window once, tiling the split
    assert eval_window_starts(1001, 100, 50) == [i * 100 for i in range(10)]
    assert eval_window_starts(1000, 100, 50) == [i * 100 for i in range(9)]  # 1000 bytes: the 10th lacks a target
    with pytest.raises(ValueError, match="shorter than one window"):
        eval_window_starts(100, 100, 1)


# --------------------------------------------------------------------------------------------
# MQAR
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["random", "contiguous"])
def test_mqar_structure(placement):
    g = torch.Generator().manual_seed(123)
    N, T, D = 64, 64, 8
    b = make_mqar(N, T, D, generator=g, query_placement=placement)
    assert b.inputs.shape == b.targets.shape == (N, T)
    assert b.inputs.dtype == b.targets.dtype == torch.int64
    assert b.keys.shape == b.values.shape == (N, D)
    # default token ranges: keys 128..191, values 192..255, filler 0
    assert int(b.keys.min()) >= 128 and int(b.keys.max()) < 192
    assert int(b.values.min()) >= 192 and int(b.values.max()) < 256
    assert torch.equal(b.inputs[:, 0 : 2 * D : 2], b.keys)
    assert torch.equal(b.inputs[:, 1 : 2 * D : 2], b.values)
    n_answers = 0
    for i in range(N):
        keys = b.keys[i].tolist()
        assert len(set(keys)) == D  # keys unique per example
        seq, tgt = b.inputs[i].tolist(), b.targets[i].tolist()
        answer_pos = [t for t in range(T) if tgt[t] != IGNORE_INDEX]
        assert answer_pos == b.query_positions[i].tolist()
        assert len(answer_pos) == D
        for t in range(T):
            if t not in answer_pos:
                assert tgt[t] == IGNORE_INDEX
                if t >= 2 * D:
                    assert seq[t] == 0  # filler
        for t in answer_pos:
            key = seq[t]
            # the pair (key, value) appears earlier in the sequence, and the target is that value
            j = next(j for j in range(0, t - 1) if seq[j] == key and j % 2 == 0 and j < 2 * D)
            assert j + 1 < t
            assert tgt[t] == seq[j + 1]
            n_answers += 1
        # every key is queried once
        assert sorted(seq[t] for t in answer_pos) == sorted(keys)
    assert n_answers == N * D
    if placement == "contiguous":
        assert torch.equal(b.query_positions, (torch.arange(D) + 2 * D).expand(N, D))


def test_mqar_deterministic_and_validation():
    a = make_mqar(4, 32, 4, generator=torch.Generator().manual_seed(7))
    b = make_mqar(4, 32, 4, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    small = make_mqar(3, 20, 4, vocab_size=16, num_queries=2, generator=torch.Generator().manual_seed(0))
    assert int(small.inputs.max()) < 16 and int(small.answer_mask.sum()) == 6
    with pytest.raises(ValueError):
        make_mqar(2, 10, 8)  # too short
    with pytest.raises(ValueError):
        make_mqar(2, 64, 4, key_range=(100, 200), value_range=(150, 256))  # overlap
    with pytest.raises(ValueError):
        make_mqar(2, 256, 100)  # more pairs than keys


def test_mqar_dense_rows_ask_every_key_again_and_answers_stay_recall():
    """num_queries > pairs: each key asked floor(Q/D) or ceil(Q/D) times, at distinct positions after the
    context, each target the value bound to its key; the answers never appear in the input after the context."""
    D, Q, T = 8, 60, 128
    b = make_mqar(32, T, D, num_queries=Q, generator=torch.Generator().manual_seed(3))
    assert b.query_positions.shape == (32, Q) and int(b.answer_mask.sum()) == 32 * Q
    for i in range(32):
        pos = b.query_positions[i]
        assert len(set(pos.tolist())) == Q and int(pos.min()) >= 2 * D
        counts = torch.bincount(b.query_keys[i] - 128, minlength=64)[b.keys[i] - 128]
        assert int(counts.min()) == Q // D and int(counts.max()) == -(-Q // D) and int(counts.sum()) == Q
        bound = dict(zip(b.keys[i].tolist(), b.values[i].tolist(), strict=True))
        assert [bound[k] for k in b.inputs[i, pos].tolist()] == b.targets[i, pos].tolist()
        assert not bool((b.inputs[i, 2 * D :] >= 192).any())  # no value is ever written after the context
    # the repeats are shuffled: a key's second query is not always after every key's first
    first_rounds = [b.query_keys[i, :D].unique().numel() for i in range(32)]
    assert min(first_rounds) < D
    # Q <= D draws exactly what it drew before (validation sets are unchanged)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(
        make_mqar(4, 64, 8, generator=g1).inputs, make_mqar(4, 64, 8, num_queries=8, generator=g2).inputs
    )
    with pytest.raises(ValueError, match="too short"):
        make_mqar(2, 40, 8, num_queries=30)


def _segment_answers_are_bound_in_their_segment(inputs, targets, span):
    """Every answer is the value bound to its query key earlier in the same segment of ``span`` tokens."""
    answers = 0
    for row_x, row_y in zip(inputs.tolist(), targets.tolist(), strict=True):
        for start in range(0, len(row_x), span):
            seg_x, seg_y = row_x[start : start + span], row_y[start : start + span]
            bound = {}
            for t, (tok, tgt) in enumerate(zip(seg_x, seg_y, strict=True)):
                if tgt != IGNORE_INDEX:
                    assert bound[tok] == tgt, f"segment at {start}, position {t}"
                    answers += 1
                elif 128 <= tok < 192 and t + 1 < len(seg_x) and seg_x[t + 1] >= 192:
                    bound[tok] = seg_x[t + 1]  # a context pair k v
    return answers


def test_packed_mqar_rows_are_independent_short_examples():
    """span < T: ceil(T / span) examples end to end, each answer bound in its own segment, the answer count
    Q * span / T per segment (density kept); a tail too short for an example is unscored filler."""
    g = torch.Generator().manual_seed(0)
    x, y = make_mqar_packed(6, 256, 64, 4, num_queries=64, generator=g)
    assert x.shape == y.shape == (6, 256)
    assert _segment_answers_are_bound_in_their_segment(x, y, 64) == 6 * 64
    assert int((y != IGNORE_INDEX).sum(dim=1).min()) == 64
    for start in (0, 64, 128, 192):  # each segment opens with its own 4 context pairs
        seg = x[:, start : start + 8]
        assert bool(((seg[:, 0::2] >= 128) & (seg[:, 0::2] < 192)).all()) and bool((seg[:, 1::2] >= 192).all())
    # uneven: segments of 100, 100 and 56 tokens with 25, 25 and 14 queries
    x, y = make_mqar_packed(3, 256, 100, 5, num_queries=64, generator=g)
    assert _segment_answers_are_bound_in_their_segment(x, y, 100) == 3 * 64
    assert segment_queries(64, 256, 56) == 14
    # an 8-token tail cannot hold 2 x 5 pairs + its query: filler, nothing scored
    x, y = make_mqar_packed(2, 108, 100, 5, num_queries=8, generator=g)
    assert bool((x[:, 100:] == 0).all()) and bool((y[:, 100:] == IGNORE_INDEX).all())
    # span >= T is plain make_mqar, draw for draw
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    packed = make_mqar_packed(3, 128, 128, 8, num_queries=32, generator=g1)
    plain = make_mqar(3, 128, 8, num_queries=32, generator=g2)
    assert torch.equal(packed[0], plain.inputs) and torch.equal(packed[1], plain.targets)
    with pytest.raises(ValueError, match="span"):
        make_mqar_packed(1, 64, 0, 4)


def test_mix_mqar_packs_its_rows_when_given_a_span(shakespeare):
    g = torch.Generator().manual_seed(1)
    x, y = random_batches(shakespeare.train, 8, 128, g)
    x2, y2, k = mix_mqar(x, y, 0.5, num_kv_pairs=4, generator=g, span=32, num_queries=32)
    assert k == 4 and torch.equal(x2[:4], x[:4])
    assert _segment_answers_are_bound_in_their_segment(x2[4:], y2[4:], 32) == 4 * 32


def test_mqar_accuracy():
    g = torch.Generator().manual_seed(0)
    b = make_mqar(16, 48, 6, generator=g)
    V = 256
    perfect = torch.zeros(16, 48, V)
    mask = b.answer_mask
    perfect[mask] = torch.nn.functional.one_hot(b.targets[mask], V).float() * 10.0
    assert mqar_accuracy(perfect, b) == 1.0
    assert mqar_accuracy(perfect, b.targets) == 1.0
    wrong = torch.zeros(16, 48, V)
    wrong[mask] = torch.nn.functional.one_hot((b.targets[mask] + 1) % V, V).float() * 10.0
    assert mqar_accuracy(wrong, b) == 0.0
    # half of the answers right
    half = perfect.clone()
    pos = mask.nonzero()
    flip = pos[::2]
    half[flip[:, 0], flip[:, 1]] = wrong[flip[:, 0], flip[:, 1]]
    assert mqar_accuracy(half, b) == pytest.approx(len(pos[1::2]) / len(pos))


def test_mix_mqar(shakespeare):
    g = torch.Generator().manual_seed(0)
    x, y = random_batches(shakespeare.train, 8, 64, g)
    x2, y2, k = mix_mqar(x, y, 0.25, num_kv_pairs=4, generator=g)
    assert k == 2
    assert torch.equal(x2[:6], x[:6]) and torch.equal(y2[:6], y[:6])
    assert int(x2[6:].max()) >= 128  # MQAR keys/values live in the high byte range
    assert int((y2[6:] != IGNORE_INDEX).sum()) == 2 * 4
    assert int((y2[:6] == IGNORE_INDEX).sum()) == 0
    x3, y3, k0 = mix_mqar(x, y, 0.0, num_kv_pairs=4, generator=g)
    assert k0 == 0 and torch.equal(x3, x) and torch.equal(y3, y)
    # stochastic rounding: expected share matches the fraction
    ks = [mix_mqar(x, y, 0.1, 4, generator=g)[2] for _ in range(400)]
    assert set(ks) <= {0, 1} and 0.6 < np.mean(ks) < 1.0

    # ignored targets carry no loss: uniform logits give exactly ln 256 over the answers and text targets
    loss = torch.nn.functional.cross_entropy(torch.zeros(8 * 64, 256), y2.reshape(-1))
    assert loss.item() == pytest.approx(math.log(256), rel=1e-5)


ROOT = Path(__file__).resolve().parents[3]
# -100 written where a target is marked or tested as "no loss": a second spelling of IGNORE_INDEX
_IGNORE_LITERAL = re.compile(
    r"(?:[!=]=|value=|ignore_index=|full(?:_like)?\([^()]*(?:\([^()]*\))?[^()]*,)\s*-100\b(?!\.)"
)


def ignore_literals(root: Path) -> list[str]:
    """file:line of every -100 used as the ignored-target marker under the code folders."""
    return matching_lines(root, CODE_FOLDERS, _IGNORE_LITERAL)


def test_ignored_targets_are_spelled_ignore_index_everywhere():
    assert ignore_literals(ROOT) == []


def test_the_ignore_check_finds_a_bare_minus_100(tmp_path):
    (tmp_path / "k3core").mkdir()
    probe = ["t = F.pad(y, (0, 1), value=" + "-100)", "m = t != " + "-100", "b = torch.full((2, 1), " + "-100)",
             "ok = [-100, 3]", "bias = -100.0"]  # fmt: skip
    (tmp_path / "k3core" / "x.py").write_text("\n".join(probe) + "\n")
    assert ignore_literals(tmp_path) == ["k3core/x.py:1", "k3core/x.py:2", "k3core/x.py:3"]


def test_the_model_loss_skips_ignore_index_targets():
    """The mean loss with some targets set to IGNORE_INDEX is the mean of the per-token losses of the others."""
    model = nano_model()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    targets = torch.roll(ids, -1, dims=1)
    full = model(ids, targets=targets)
    per_token = torch.nn.functional.cross_entropy(
        full.logits.float().flatten(0, 1), targets.flatten(), reduction="none"
    )
    keep = torch.ones_like(targets, dtype=torch.bool)
    keep[0, :5] = False
    keep[1, -1] = False
    masked = model(ids, targets=targets.masked_fill(~keep, IGNORE_INDEX))
    torch.testing.assert_close(masked.loss, per_token[keep.flatten()].mean(), rtol=1e-5, atol=1e-6)
