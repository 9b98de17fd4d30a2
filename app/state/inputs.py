"""What the user chose: the app's input types, their limits and their checks (no widgets, no models).

The sidebar (``app.state.sidebar``) draws the widgets and returns an ``Inputs``; the URL (``app.state.links``)
carries the same choices; ``app.render.caching`` turns them into a loaded run. User mistakes raise
``InputError``; pages show its message with ``st.error`` and keep running.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import streamlit as st
import torch

from analysis.runs.loading import DTYPES
from k3core.utils import input_limits
from k3core.utils.input_limits import shown

if TYPE_CHECKING:
    from app.library.run_list import RunRef

MAX_TOKENS_DEFAULT = 512
MAX_TOKENS_CAP = 8192  # hard upper bound of the max-tokens input (CPU-friendly)
MAX_TEXT_CHARS = input_limits.MAX_TEXT_CHARS  # the Generate prompt (k3core.utils.input_limits)
# a pasted or uploaded sidebar text: only its first max-tokens tokens are read and its token count comes from its
# first MB (analysis.runs.texts.count_tokens), so it may be longer than a typed prompt, but not unbounded
MAX_SIDEBAR_TEXT_CHARS = 64 * input_limits.MAX_TEXT_CHARS
LONG_INPUT_TOKENS = 2048  # above this the page estimates the cost and asks before running the model
MAX_ATTN_LEN = 1024  # MLA and KDA attention maps are recorded for at most this many positions (quadratic)
#: the sidebar checkbox that records the attention maps and KDA's implicit attention (its cost is in its help)
ATTENTION_CHECKBOX = "Record attention maps and KDA implicit attention (slower: up to 7x a forward)"
SEQ_LENS = tuple(1024 * 2**i for i in range(11))  # 1K .. 1M for the density cache view
SEQ_LEN_DEFAULT = 131072

# Built-in texts come from analysis.runs.texts.sample_input, the same the report and `k3lab inspect` use.
TEXT_SHAKESPEARE = "Shakespeare (held-out play)"
TEXT_MQAR = "MQAR sequence"
TEXT_REPEAT = "Repeated passage (copy task)"
TEXT_PASTE = "Paste text"
TEXT_UPLOAD = "Upload a .txt file"
TEXT_SOURCES = (TEXT_SHAKESPEARE, TEXT_MQAR, TEXT_REPEAT, TEXT_PASTE, TEXT_UPLOAD)
TEXT_RECORDED = (
    "Recorded text (trace folder)"  # not offered: a trace folder's own picker (app.state.sidebar.text_choice)
)
SAMPLE_OF_SOURCE = {TEXT_SHAKESPEARE: "shakespeare", TEXT_MQAR: "mqar", TEXT_REPEAT: "repeat"}
SHORT_SOURCE = {
    TEXT_SHAKESPEARE: "Shakespeare",
    TEXT_MQAR: "MQAR",
    TEXT_REPEAT: "repeat",
    TEXT_PASTE: "pasted text",
}

# edits / patching / attribution / lens_value: the Experiment views' inputs (analysis.figures.experiment)
KNOWN_OPTIONS = {
    "seq_len": int,
    "overlay_metrics": dict,
    "edits": list,
    "patching": dict,
    "attribution": dict,
    "lens_value": str,
}


class InputError(ValueError):
    """Something the user chose or typed cannot be used (the message says what and how to fix it)."""


@dataclass(frozen=True)
class TextChoice:
    """What the user picked to read in the sidebar: a built-in sample, or their own text (pasted or uploaded).
    ``app.render.caching.make_tokens`` turns it into the run's ``analysis.runs.texts.Input``."""

    source: str  # one of TEXT_SOURCES, or TEXT_RECORDED
    max_tokens: int = MAX_TOKENS_DEFAULT
    text: str | None = None  # pasted / uploaded text (recorded: the text as traced, for a checkpoint to read)
    name: str = ""  # uploaded file name (recorded: the traced text's name)
    recorded: int | None = None  # TEXT_RECORDED: the number of the trace folder's text

    def key(self) -> tuple:
        """What changes the tokens: source, max tokens, a digest of the text and the recorded text's number."""
        digest = hashlib.sha256(self.text.encode("utf-8", "surrogatepass")).hexdigest() if self.text else ""
        return (self.source, int(self.max_tokens), digest, self.recorded)

    @property
    def short(self) -> str:
        """A short name: 'Shakespeare', 'MQAR', 'notes.txt', 'pasted text', 'text 1 (b.txt)'."""
        if self.source == TEXT_RECORDED:
            return f"text {self.recorded}" + (f" ({self.name})" if self.name else "")
        if self.source == TEXT_UPLOAD and self.name:
            return self.name
        return SHORT_SOURCE.get(self.source, self.source)


@dataclass(frozen=True)
class Inputs:
    """Everything the sidebar chose (runs, text, device, options): the start of every page, read with
    ``current_inputs()``; ``app.render.page_scaffold.load_or_stop`` turns it into a ``Loaded`` run."""

    runs: tuple[RunRef, ...]
    run: RunRef | None
    text: TextChoice
    text_error: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    seq_len: int = SEQ_LEN_DEFAULT
    record_attn: bool = True
    problems: tuple[str, ...] = ()
    max_memory: str = (
        ""  # a memory budget ("8GB"): run from the checkpoint files within it (k3core.loading.streamed_run)
    )

    def options(self) -> dict[str, Any]:
        return {"seq_len": int(self.seq_len)}


def current_inputs() -> Inputs | None:
    return st.session_state.get("k3lab_inputs")


def check_max_tokens(max_tokens: Any) -> int:
    """2 <= max_tokens <= MAX_TOKENS_CAP, as an int."""
    try:
        n = int(max_tokens)
    except (TypeError, ValueError) as exc:
        raise InputError(f"max tokens must be a whole number, got {shown(max_tokens)}") from exc
    if n != max_tokens or not 2 <= n <= MAX_TOKENS_CAP:
        raise InputError(f"max tokens must be between 2 and {MAX_TOKENS_CAP}, got {shown(max_tokens)}")
    return n


def check_text(choice: TextChoice) -> None:
    """Raise InputError for an empty text or a bad max tokens (no model needed)."""
    check_max_tokens(choice.max_tokens)
    if choice.source in (TEXT_PASTE, TEXT_UPLOAD) and (choice.text is None or not choice.text.strip()):
        where = (
            "the uploaded file is empty"
            if choice.source == TEXT_UPLOAD and choice.text is not None
            else "no text file uploaded yet"
            if choice.source == TEXT_UPLOAD
            else "the text box is empty"
        )
        raise InputError(
            f"The text is empty ({where}): paste or upload some text, or pick a built-in sample "
            f"(Shakespeare, MQAR) in the sidebar."
        )
    if choice.text is not None and len(choice.text) > MAX_SIDEBAR_TEXT_CHARS:
        raise InputError(
            f"The text is {len(choice.text):,} characters, over the limit of {MAX_SIDEBAR_TEXT_CHARS:,}: use a "
            f"shorter text "
            f"(only the first {choice.max_tokens:,} tokens are read)"
        )
    if choice.source == TEXT_RECORDED and not (choice.text or "").strip():
        raise InputError(
            f"recorded text {choice.recorded} of the trace folder has no readable text (a synthetic sample's ids): "
            "a checkpoint cannot read it; pick a text for it in the sidebar"
        )
    if choice.source not in (*TEXT_SOURCES, TEXT_RECORDED):
        raise InputError(f"unknown text source {shown(choice.source)}; choose one of {TEXT_SOURCES}")


def decode_upload(data: bytes, name: str = "upload") -> str:
    """An uploaded text file as str. Raises InputError for binary / non-UTF-8 files."""
    if b"\x00" in data[:65536]:
        raise InputError(f"{name}: this looks like a binary file (NUL bytes), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def device_choices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def dtype_choices(device: str) -> list[str]:
    return ["float32", "bfloat16", "float16"] if device == "cuda" else ["float32", "bfloat16"]


def check_max_memory(text: str) -> str:
    """A memory budget as typed ("" = none, "8GB", "6GiB", "512MB"); InputError when it cannot be read."""
    from k3core.utils.units import parse_bytes

    text = (text or "").strip()
    if not text:
        return ""
    try:
        parse_bytes(text, what="the memory budget")
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    return text


def check_device(device: str, dtype: str) -> None:
    """Raise InputError for a device or dtype this machine cannot use."""
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {shown(dtype)}; choose one of {sorted(DTYPES)}")
    if device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {shown(device)}; choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("CUDA was chosen but no CUDA device is available; choose cpu")


def check_options(options: dict[str, Any]) -> None:
    """Raise InputError for an option no view understands or a value of the wrong kind."""
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise InputError(f"unknown option(s) {unknown}; known: {sorted(KNOWN_OPTIONS)}")
    seq_len = options.get("seq_len")
    if seq_len is not None and (not isinstance(seq_len, int) or not SEQ_LENS[0] <= seq_len <= SEQ_LENS[-1]):
        raise InputError(
            f"seq_len must be a whole number of tokens in {SEQ_LENS[0]}..{SEQ_LENS[-1]}, got {shown(seq_len)}"
        )


def options_key(options: dict[str, Any]) -> tuple:
    """A hashable, order-independent form of the view options."""
    return tuple(sorted((str(k), repr(v)) for k, v in options.items()))
