"""A checkpoint folder described from its headers: size, parameters, dtypes, a config summary.

What the runs library stores for each run and what the *Open a folder* form shows before anything is
loaded. No tensor data is read (pickle files excepted), so this answers for a 100 GB folder in seconds.
Failures are ``LibraryError`` messages that name the run, not the server folder. No Streamlit here.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.output.format import format_count
from analysis.weights.checkpoint_summary import config_summary
from k3core.interp.trace_folder import is_trace_dir, read_trace_dir, trace_dir_fingerprint
from k3core.interp.trace_npz import TraceError
from k3core.loading.folder import CheckpointFiles, folder_fingerprint
from k3core.loading.tensor_info import CheckpointError
from k3core.modeling.config import K3Config

_CHUNK = 1 << 20


class LibraryError(ValueError):
    """Something about a run the user added or chose; the message says what and how to fix it."""


def human_count(n: int | None) -> str:
    """analysis.output.format.format_count, '?' when unknown: 211550 -> '211.55K'."""
    return "?" if n is None else format_count(n)


@dataclass(frozen=True)
class FolderInfo:
    """What a checkpoint folder holds, from its headers: no tensor data is read (except pickle files)."""

    size_bytes: int  # every file in the folder
    weight_bytes: int  # the text model's tensors
    num_parameters: int
    dtypes: dict[str, int]  # bytes per stored dtype
    skipped: list[str]  # stored tensors that are not part of the text model (vision tower, ...)
    summary: dict[str, Any]
    fingerprint: str
    files: CheckpointFiles | None  # the config and the tensor table, read from the headers (None: a trace folder)


def folder_stamp(path: Path) -> tuple:
    """(name, size, mtime) of every file in a checkpoint folder (or of one file): changes whenever the content
    may have, so it keys the app's caches of a folder (fingerprint, placement plan). Raises CheckpointError
    when there is nothing at ``path``."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def folder_size(folder: Path) -> int:
    """Bytes of the regular files directly in ``folder`` (links followed, as the loader would)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def describe_folder(folder: str | Path, label: str | None = None) -> FolderInfo:
    """Size, parameter count, dtypes and a config summary of a checkpoint folder. Raises LibraryError."""
    folder = Path(folder)
    if is_trace_dir(folder):
        return describe_trace_folder(folder, label)
    try:
        files = CheckpointFiles.open(folder)
        fingerprint = folder_fingerprint(folder)
    except CheckpointError as exc:
        raise LibraryError(run_message(str(exc), folder, label)) from exc
    except OSError as exc:
        raise LibraryError(f"{label or folder.name}: cannot read the checkpoint ({exc.strerror})") from exc
    cfg = files.config
    dtypes: dict[str, int] = {}
    for info in files.tensors.values():
        dtypes[info.dtype] = dtypes.get(info.dtype, 0) + info.nbytes
    summary = {**config_summary(cfg), "parameters": files.num_parameters, "dtypes": sorted(dtypes)}
    return FolderInfo(
        size_bytes=folder_size(folder),
        weight_bytes=files.bytes_total,
        num_parameters=files.num_parameters,
        dtypes=dtypes,
        skipped=list(files.skipped),
        summary=summary,
        fingerprint=fingerprint,
        files=files,
    )


def describe_trace_folder(folder: Path, label: str | None = None) -> FolderInfo:
    """A trace folder (``k3core.interp.trace_folder``: traces and a run card, no weights) as the library describes a
    run."""
    try:
        card = read_trace_dir(folder).card
        cfg = K3Config.from_dict(card["config"])
        fingerprint = trace_dir_fingerprint(folder)
    except (TraceError, ValueError, TypeError) as exc:
        raise LibraryError(run_message(str(exc), folder, label)) from exc
    except OSError as exc:
        raise LibraryError(f"{label or folder.name}: cannot read the trace folder ({exc.strerror})") from exc
    parameters = card.get("parameters") if isinstance(card.get("parameters"), int) else 0
    summary = {**config_summary(cfg), "parameters": parameters, "dtypes": [], "trace": len(card["texts"])}
    return FolderInfo(folder_size(folder), 0, parameters, {}, [], summary, fingerprint, None)


def summary_text(summary: Mapping[str, Any]) -> str:
    """'4 layers · width 64 · vocab 256 · 8 experts · 211.6K params' from a stored summary: the fields of
    ``analysis.weights.checkpoint_summary.config_summary`` with the folder's parameter count (``describe_folder``).
    Rows indexed before that summary was the library's (keys ``layers`` and ``experts``) read the same."""

    def number(*keys: str) -> int | None:  # the index is a file on disk: anything else in it shows as "?"
        value = next((summary[k] for k in keys if k in summary), None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    layers, width, vocab = number("num_hidden_layers", "layers"), number("hidden_size"), number("vocab_size")
    parts = [f"{layers if layers is not None else '?'} layers", f"width {width if width is not None else '?'}"]
    parts.append(f"vocab {vocab:,}" if vocab else "vocab ?")
    experts = number("experts") or _experts_of(summary.get("moe"))
    if experts:
        parts.append(f"{experts} experts")
    parts.append(f"{human_count(number('parameters'))} params")
    if number("trace"):
        parts.append(f"trace of {number('trace')} text(s), no weights")
    return " · ".join(parts)


def _experts_of(moe: Any) -> int | None:
    """The expert count leading config_summary's "moe" field ('8 experts, top-2, ...'); None for dense."""
    match = re.match(r"(\d{1,9}) experts,", moe) if isinstance(moe, str) else None
    return int(match.group(1)) if match else None


def run_message(message: str, folder: Path, label: str | None) -> str:
    """A message about a run folder (it names the folder, by path or by name, or a file in it) that says the run's
    name instead, and first: never the library's own folders (a staging folder's pid-and-random name)."""
    if not label:
        return message
    for shown in (str(folder), folder.name):
        message = message.replace(shown, label) if shown else message
    return message if message.startswith((f"{label}:", f"{label}/")) else f"{label}: {message}"


def content_fingerprint(folder: Path) -> str:
    """SHA-256 over every file's name and bytes, in name order: equal for equal uploads, whatever the mtimes."""
    h = hashlib.sha256()
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(file.name.encode() + b"\0" + str(file.stat().st_size).encode() + b"\0")
        with open(file, "rb") as fh:
            while block := fh.read(_CHUNK):
                h.update(block)
    return h.hexdigest()
