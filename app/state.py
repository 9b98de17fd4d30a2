"""The app's inputs and its cached loaders.

Everything expensive is cached, keyed by everything that changes the result:

- models: ``st.cache_resource`` keyed by (checkpoint fingerprint, device, dtype). The fingerprint is
  ``k3core.checkpoint.checkpoint_fingerprint`` (SHA-256 of config.json and the weights), itself cached
  per (folder, file names, sizes, mtimes) so an unchanged folder is hashed once.
- token ids: ``st.cache_data`` keyed by (text source, max tokens, sha256 of the text, vocab size).
- traces: ``st.cache_data`` keyed by (fingerprint, device, dtype, sha256 of the token ids and targets,
  trace items); recorded with ``analysis.runs.trace_run``.
- figures: ``st.cache_data`` keyed by (view key, trace key, label, options, metrics digest).

User mistakes raise ``InputError`` (text) or ``CheckpointError`` (checkpoint); the pages show their
message with ``st.error`` and keep running. This module never draws anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import streamlit as st
import torch

from k3core.checkpoint import CheckpointError, checkpoint_fingerprint, load_pretrained
from k3core.runtime import configure_threads

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLES_DIR = REPO_ROOT / "sample_checkpoints"
RUNS_ENV = "K3LAB_RUNS"

MAX_TOKENS_DEFAULT = 512
MAX_TOKENS_CAP = 8192  # hard upper bound of the max-tokens input (CPU-friendly)
MAX_ATTN_LEN = 1024  # MLA attention matrices are recorded for at most this many positions (quadratic)
SEQ_LENS = tuple(1024 * 2**i for i in range(11))  # 1K .. 1M for the density cache view
SEQ_LEN_DEFAULT = 131072

# Built-in texts come from analysis.runs.sample_input, the same the report and `k3lab inspect` use.
TEXT_SHAKESPEARE = "Shakespeare (held-out play)"
TEXT_MQAR = "MQAR sequence"
TEXT_REPEAT = "Repeated passage (copy task)"
TEXT_PASTE = "Paste text"
TEXT_UPLOAD = "Upload a .txt file"
TEXT_SOURCES = (TEXT_SHAKESPEARE, TEXT_MQAR, TEXT_REPEAT, TEXT_PASTE, TEXT_UPLOAD)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# One forward at a time through the shared (cached) models: the trace recorder is process-global
# and two sessions must not record into each other's traces.
MODEL_LOCK = threading.RLock()


class InputError(ValueError):
    """Something the user chose or typed cannot be used (the message says what and how to fix it)."""


# ----------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class RunRef:
    """A checkpoint folder the user can pick."""

    label: str
    path: str
    origin: str  # "preloaded" (K3LAB_RUNS), "sample" (sample_checkpoints/) or "uploaded"


def is_checkpoint_dir(path: str | Path) -> bool:
    """A folder with a config.json (the loader reports everything else that may be wrong)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def discover_runs(
    env_value: str | None, samples_dir: str | Path | None, uploaded: Iterable[RunRef] = ()
) -> tuple[list[RunRef], list[str]]:
    """Runs in picker order: K3LAB_RUNS entries, then sample_checkpoints/* folders, then uploads.

    A K3LAB_RUNS entry is a checkpoint folder, or a folder of checkpoint folders (each becomes a run).
    Duplicate folders are listed once (first origin wins); labels are the folder names, made unique
    with a " (2)", " (3)" suffix. Returns (runs, problems) where problems names K3LAB_RUNS entries that
    are not checkpoint folders.
    """
    found: list[tuple[Path, str]] = []
    problems: list[str] = []
    for entry in (env_value or "").split(os.pathsep):
        entry = entry.strip()
        if not entry:
            continue
        path = Path(entry).expanduser()
        children = sorted(p for p in path.iterdir() if is_checkpoint_dir(p)) if path.is_dir() else []
        if is_checkpoint_dir(path):
            found.append((path.resolve(), "preloaded"))
        elif children:  # a folder of runs
            found.extend((child.resolve(), "preloaded") for child in children)
        else:
            problems.append(f"{entry}: not a checkpoint folder (no config.json)")
    if samples_dir is not None and Path(samples_dir).is_dir():
        for path in sorted(Path(samples_dir).iterdir()):
            if is_checkpoint_dir(path):
                found.append((path.resolve(), "sample"))
    for run in uploaded:
        found.append((Path(run.path).resolve(), "uploaded"))

    runs: list[RunRef] = []
    seen_paths: set[Path] = set()
    labels: set[str] = set()
    uploaded_labels = {str(Path(r.path).resolve()): r.label for r in uploaded}
    for path, origin in found:
        if path in seen_paths:
            continue
        seen_paths.add(path)
        base = uploaded_labels.get(str(path), path.name) if origin == "uploaded" else path.name
        label, n = base, 2
        while label in labels:
            label, n = f"{base} ({n})", n + 1
        labels.add(label)
        runs.append(RunRef(label=label, path=str(path), origin=origin))
    return runs, problems


def _folder_stamp(path: Path) -> tuple:
    """(name, size, mtime) of every file in a checkpoint folder: changes whenever the content may have."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


@st.cache_data(show_spinner=False, max_entries=64)
def _fingerprint(path: str, stamp: tuple) -> str:
    return checkpoint_fingerprint(path)


def run_fingerprint(path: str | Path) -> str:
    """checkpoint_fingerprint of a folder, recomputed only when a file's size or mtime changes."""
    path = Path(path)
    try:
        return _fingerprint(str(path), _folder_stamp(path))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({exc})") from exc


@st.cache_resource(show_spinner="Loading the checkpoint...", max_entries=6)
def _cached_run(fingerprint: str, device: str, dtype: str, _path: str):
    """analysis.runs.Run for a checkpoint folder: model (eval, on device, in dtype), metrics, model card."""
    from analysis.runs import Run, model_card, read_card_text, read_metrics

    model = load_pretrained(_path, device=device, dtype=DTYPES[dtype])
    configure_threads(model)
    metrics, note = read_metrics(_path)
    card = model_card(model, metrics, read_card_text(_path))
    if note:
        card["notes"].append(note)
    return Run(model=model, config=model.config, metrics=metrics, card=card, path=Path(_path), fingerprint=fingerprint)


def check_device(device: str, dtype: str) -> None:
    """Raise InputError for a device or dtype this machine cannot use."""
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    if device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {device!r}; choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("CUDA was chosen but no CUDA device is available; choose cpu")


def load_run(run: RunRef, device: str = "cpu", dtype: str = "float32"):
    """The run as an analysis.runs.Run (model shared across sessions). Raises CheckpointError / InputError."""
    check_device(device, dtype)
    return _cached_run(run_fingerprint(run.path), device, dtype, run.path)


def load_model(run: RunRef, device: str = "cpu", dtype: str = "float32"):
    """The run's K3ForCausalLM (eval mode). Raises CheckpointError / InputError."""
    return load_run(run, device, dtype).model


def run_metrics(run: RunRef) -> dict | None:
    """The run's metrics.json (training history), or None when absent or unreadable."""

    path = Path(run.path) / "metrics.json"
    if not path.is_file():
        return None
    stat = path.stat()
    return _read_metrics(run.path, (stat.st_size, stat.st_mtime_ns))


@st.cache_data(show_spinner=False, max_entries=64)
def _read_metrics(path: str, stamp: tuple) -> dict | None:
    from analysis.runs import read_metrics

    return read_metrics(path)[0]


def run_card(run: RunRef) -> str | None:
    """The run's model card text (README.md), or None."""
    from analysis.runs import read_card_text

    return read_card_text(run.path, max_chars=20000)


def metrics_digest(metrics: dict | None) -> str:
    """sha256 of a metrics dict (canonical JSON), '' for None."""
    if not metrics:
        return ""
    return hashlib.sha256(json.dumps(metrics, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------- text
@dataclass(frozen=True)
class TextChoice:
    """What the user picked to read: a built-in sample, or their own text (pasted or uploaded)."""

    source: str  # one of TEXT_SOURCES
    max_tokens: int = MAX_TOKENS_DEFAULT
    text: str | None = None  # pasted / uploaded text
    name: str = ""  # uploaded file name

    def key(self) -> tuple:
        """What changes the tokens: source, max tokens and a digest of the text."""
        digest = hashlib.sha256(self.text.encode("utf-8", "surrogatepass")).hexdigest() if self.text else ""
        return (self.source, int(self.max_tokens), digest)


@dataclass(frozen=True)
class Tokens:
    """The token ids the model reads, and where they came from."""

    ids: np.ndarray  # int64 [1, T]
    targets: np.ndarray | None  # aligned next-token targets (-100: no loss), None: next-token labels
    source: str  # description for captions
    text: str | None  # None for synthetic sequences (MQAR)
    total: int  # tokens before truncation
    digest: str = ""  # sha256 of ids and targets: the cache key of the input

    @property
    def n(self) -> int:
        return int(self.ids.shape[1])

    @property
    def truncated(self) -> bool:
        return self.total > self.n

    @property
    def user_text(self) -> bool:
        return self.source.startswith((TEXT_PASTE, TEXT_UPLOAD))


def token_digest(ids: np.ndarray, targets: np.ndarray | None = None) -> str:
    """sha256 over the int64 ids (and targets) with their shapes."""
    h = hashlib.sha256()
    for arr in (ids, targets):
        if arr is not None:
            arr = np.ascontiguousarray(arr, dtype=np.int64)
            h.update(str(arr.shape).encode() + arr.tobytes())
        h.update(b"|")
    return h.hexdigest()


def check_max_tokens(max_tokens: Any) -> int:
    """2 <= max_tokens <= MAX_TOKENS_CAP, as an int."""
    try:
        n = int(max_tokens)
    except (TypeError, ValueError) as exc:
        raise InputError(f"max tokens must be a whole number, got {max_tokens!r}") from exc
    if n != max_tokens or not 2 <= n <= MAX_TOKENS_CAP:
        raise InputError(f"max tokens must be between 2 and {MAX_TOKENS_CAP}, got {max_tokens!r}")
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
    if choice.source not in TEXT_SOURCES:
        raise InputError(f"unknown text source {choice.source!r}; choose one of {TEXT_SOURCES}")


def decode_upload(data: bytes, name: str = "upload") -> str:
    """An uploaded text file as str. Raises InputError for binary / non-UTF-8 files."""
    if b"\x00" in data[:65536]:
        raise InputError(f"{name}: this looks like a binary file (NUL bytes), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


@st.cache_data(show_spinner=False, max_entries=32)
def _cached_tokens(key: tuple, vocab_size: int, _choice: TextChoice, _config) -> Tokens:
    from analysis.runs import sample_input, text_input

    choice = _choice
    try:
        if choice.source == TEXT_SHAKESPEARE:
            sample = sample_input("shakespeare", _config, choice.max_tokens)
        elif choice.source == TEXT_MQAR:
            sample = sample_input("mqar", _config, choice.max_tokens)
        elif choice.source == TEXT_REPEAT:
            sample = sample_input("repeat", _config, choice.max_tokens)
        else:
            # Never encode more than needed: a UTF-8 character is at most 4 bytes.
            sample = text_input(
                choice.text[: 4 * choice.max_tokens], _config, choice.max_tokens, name=choice.name or choice.source
            )
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    ids = sample.input_ids.cpu().numpy().astype(np.int64)
    targets = None if sample.targets is None else sample.targets.cpu().numpy().astype(np.int64)
    total = len(choice.text.encode("utf-8", "replace")) if choice.text is not None else int(ids.shape[1])
    source = choice.source if choice.text is None else f"{choice.source}{': ' + choice.name if choice.name else ''}"
    if sample.description and choice.text is None:
        source = sample.description
    return Tokens(
        ids=ids,
        targets=targets,
        source=source,
        text=sample.text,
        total=max(total, int(ids.shape[1])),
        digest=token_digest(ids, targets),
    )


def make_tokens(choice: TextChoice, config) -> Tokens:
    """Token ids for a text choice and a model config (analysis.runs sample_input / text_input). Cached."""
    check_text(choice)
    return _cached_tokens(choice.key(), int(config.vocab_size), choice, config)


# ----------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Inputs:
    """Everything the sidebar chose; pages read it with ``current_inputs()``."""

    runs: tuple[RunRef, ...]
    run: RunRef | None
    text: TextChoice
    text_error: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    seq_len: int = SEQ_LEN_DEFAULT
    record_attn: bool = True
    problems: tuple[str, ...] = ()

    def options(self) -> dict[str, Any]:
        return {"seq_len": int(self.seq_len)}


def current_inputs() -> Inputs | None:
    return st.session_state.get("k3lab_inputs")


# ----------------------------------------------------------------------------------------- traces
def trace_items(record_attn: bool) -> tuple[str, ...]:
    """What the recorder captures: everything, attention matrices only when asked."""
    from k3core.trace import WHAT_ALL, WHAT_DEFAULT

    return tuple(sorted(WHAT_ALL if record_attn else WHAT_DEFAULT))


@st.cache_data(show_spinner="Running the model on the text...", max_entries=12)
def _cached_trace(
    fingerprint: str, device: str, dtype: str, digest: str, what: tuple[str, ...], _path: str, _tokens: Tokens
):
    from analysis.runs import trace_run

    run = _cached_run(fingerprint, device, dtype, _path)
    ids = torch.as_tensor(_tokens.ids, dtype=torch.long)
    targets = None if _tokens.targets is None else torch.as_tensor(_tokens.targets, dtype=torch.long)
    with MODEL_LOCK:
        ctx = trace_run(run, ids, what=list(what), targets=targets, max_attn_len=MAX_ATTN_LEN)
    return ctx.trace


def trace_loss(trace) -> float | None:
    """The loss trace_run stored in the trace header."""
    loss = (trace.meta.get("run") or {}).get("loss")
    return float(loss) if loss is not None else None


@dataclass
class Loaded:
    """A run ready for analysis: model, trace, context and the key its figures are cached under."""

    run: RunRef
    model: Any
    ctx: Any  # analysis.views.AnalysisContext
    key: tuple
    tokens: Tokens
    fingerprint: str = ""
    notes: list[str] = field(default_factory=list)


def load(
    run: RunRef,
    choice: TextChoice,
    device: str = "cpu",
    dtype: str = "float32",
    record_attn: bool = True,
    options: dict[str, Any] | None = None,
    label: str | None = None,
) -> Loaded:
    """Model + recorded trace + AnalysisContext for a run on a text choice (all cached).

    Raises CheckpointError (bad checkpoint) or InputError (bad text / device / options).
    """
    from analysis.views import AnalysisContext

    options = dict(options or {})
    check_options(options)
    fp = run_fingerprint(run.path)
    loaded_run = load_run(run, device, dtype)
    model = loaded_run.model
    tokens = make_tokens(choice, model.config)
    what = trace_items(record_attn)
    trace = _cached_trace(fp, device, dtype, tokens.digest, what, run.path, tokens)
    notes = []
    loss = trace_loss(trace)
    if loss is not None and not np.isfinite(loss):
        notes.append(f"The forward pass gave a non-finite loss ({loss}); try float32.")
    label = label or run.label
    ctx = AnalysisContext(
        trace=trace,
        config=model.config,
        model=model,
        input_ids=torch.as_tensor(tokens.ids, dtype=torch.long),
        metrics=loaded_run.metrics,
        label=label,
        options=options,
    )
    key = (fp, device, dtype, tokens.digest, what, label, options_key(options), metrics_digest(loaded_run.metrics))
    return Loaded(run=run, model=model, ctx=ctx, key=key, tokens=tokens, fingerprint=fp, notes=notes)


KNOWN_OPTIONS = {"seq_len": int, "overlay_metrics": dict}


def check_options(options: dict[str, Any]) -> None:
    """Raise InputError for an option no view understands or a value of the wrong kind."""
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise InputError(f"unknown option(s) {unknown}; known: {sorted(KNOWN_OPTIONS)}")
    seq_len = options.get("seq_len")
    if seq_len is not None and (not isinstance(seq_len, int) or not SEQ_LENS[0] <= seq_len <= SEQ_LENS[-1]):
        raise InputError(f"seq_len must be a whole number of tokens in {SEQ_LENS[0]}..{SEQ_LENS[-1]}, got {seq_len!r}")


def options_key(options: dict[str, Any]) -> tuple:
    """A hashable, order-independent form of the view options."""
    return tuple(sorted((str(k), repr(v)) for k, v in options.items()))


@st.cache_data(show_spinner=False, max_entries=512)
def _cached_view(view_key: str, key: tuple, _build, _ctx):
    return _build(_ctx)


@st.cache_data(show_spinner="Running the model again for this figure (ablations, gradients)...", max_entries=128)
def _cached_model_view(view_key: str, key: tuple, _build, _ctx):
    with MODEL_LOCK:
        return _build(_ctx)


def build_view(view, loaded: Loaded):
    """(figure, table) of a View for a loaded run, cached per (view, run key). Raises NotApplicable."""
    if view.needs_model:
        return _cached_model_view(view.key, loaded.key, view.build, loaded.ctx)
    return _cached_view(view.key, loaded.key, view.build, loaded.ctx)


# ----------------------------------------------------------------------------------------- uploads
UPLOAD_NAMES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "metrics.json",
    "README.md",
    "pytorch_model.bin",
    "model.bin",
    "model.pt",
    "pytorch_model.pt",
)
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def save_upload(files: Iterable[tuple[str, bytes]], name: str = "", root: str | Path | None = None) -> RunRef:
    """Write uploaded checkpoint files into a fresh temporary folder and return it as a run.

    Accepts config.json, model.safetensors (or shards + index), optional metrics.json / README.md, and
    pickle weights (.bin/.pt, which the loader reads only with torch.load(weights_only=True)). Raises
    InputError for an unknown file name, a duplicate, or a missing config.json. The checkpoint itself is
    validated when it is loaded (CheckpointError).
    """
    files = list(files)
    if not files:
        raise InputError("No files uploaded: choose config.json and model.safetensors.")
    names = [Path(n).name for n, _ in files]
    bad = [n for n in names if n not in UPLOAD_NAMES and not _SHARD_RE.match(n)]
    if bad:
        raise InputError(
            f"unexpected file(s) {bad}: a checkpoint is config.json + model.safetensors (or shards "
            f"model-00001-of-0000N.safetensors + model.safetensors.index.json), optionally metrics.json "
            f"and README.md"
        )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InputError(f"file(s) uploaded twice: {dupes}")
    if "config.json" not in names:
        raise InputError(
            "config.json is missing among the uploaded files (a checkpoint is config.json + model.safetensors)"
        )
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip()).strip("-.") or "uploaded"
    folder = Path(tempfile.mkdtemp(prefix=f"k3lab-upload-{label}-", dir=root))
    for fname, data in zip(names, (d for _, d in files)):
        (folder / fname).write_bytes(data)
    return RunRef(label=label, path=str(folder), origin="uploaded")


def remove_upload(run: RunRef) -> None:
    """Delete an uploaded run's temporary folder (only folders this app created)."""
    path = Path(run.path)
    if run.origin == "uploaded" and path.name.startswith("k3lab-upload-") and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------- summaries
@st.cache_data(show_spinner=False, max_entries=64)
def _cached_headline(key: tuple, _ctx) -> dict[str, Any]:
    from analysis.compare import headline_numbers

    return headline_numbers(_ctx)


def headline(loaded: Loaded) -> dict[str, Any]:
    """analysis.compare.headline_numbers of a loaded run, cached per run key."""
    return _cached_headline(loaded.key, loaded.ctx)


def cached_build(view, *loadeds: Loaded):
    """The same View, its build served from the figure cache for these loaded runs' contexts.

    Lets analysis.compare build side-by-side and difference figures without recomputing a view."""
    import dataclasses

    by_ctx = {id(loaded.ctx): loaded for loaded in loadeds}

    def build(ctx):
        loaded = by_ctx.get(id(ctx))
        return build_view(view, loaded) if loaded is not None else view.build(ctx)

    return dataclasses.replace(view, build=build)


@st.cache_data(show_spinner=False, max_entries=256)
def _cached_pair(kind: str, view_key: str, key_a: tuple, key_b: tuple, _view, _a: Loaded, _b: Loaded):
    from analysis import compare

    fn = compare.side_by_side if kind == "side" else compare.difference_view
    return fn(cached_build(_view, _a, _b), _a.ctx, _b.ctx)


def compare_view(kind: str, view, a: Loaded, b: Loaded):
    """analysis.compare.side_by_side (kind "side") or difference_view (kind "diff"), cached. May raise
    NotApplicable."""
    if kind not in ("side", "diff"):
        raise InputError(f"unknown comparison {kind!r}")
    return _cached_pair(kind, view.key, a.key, b.key, view, a, b)  # model runs lock inside build_view
