"""Trace folders: the traces of a run plus its run card, the files that travel to a laptop without the weights.

Layout of a trace folder DIR (``k3lab trace RUN --text FILE --out DIR``, one process or under torchrun)::

    run_card.json      what was run, on what, where and how (format CARD_FORMAT, below)
    config.json        the model's config (K3Config's own JSON), so tools that list checkpoints list it too
    trace-0.npz ...    one k3core.interp.trace.Trace per text (``Trace.save``; no pickles)
    tokenizer files    copied from the checkpoint when it had them (readable token strings without it)
    metrics.json       the checkpoint's training history and README.md its model card, when it had them

The run card holds: ``config`` (K3Config.to_dict), ``texts`` (per text: its trace file, name, token ids, their
readable strings, loss, the trace file's SHA-256), ``tokenizer`` (its description, or None), ``edits`` (None
when the model was run as it is), and ``made`` (host, device, dtype, world size, k3lab version, source
fingerprint of the code, the checkpoint's fingerprint and folder name, UTC time, command line).

A folder is written whole or not at all: everything goes into a staging folder beside DIR, which is renamed to
DIR as the last step (a rename within one filesystem is atomic), so a reader, or a crash, never sees half a
trace folder. DIR must not exist, or be an empty folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..modeling.config import K3Config
from ..utils.files import check_output_folder, fsync_dir, open_for_reading, parse_json, read_bytes_limited
from .trace import Trace, TraceLayout
from .trace_checks import check_card, check_layout, check_trace
from .trace_npz import NpzLimits, TraceError, check_ratio, zip_totals

CARD_NAME = "run_card.json"
CARD_FORMAT = "k3lab-trace-dir/1"
TRACE_PATTERN = "trace-{}.npz"
MAX_CARD_BYTES = 64 * 1024**2
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tiktoken.model",
    "tokenizer.model",
    "metrics.json",
    "README.md",
)
_CHUNK = 1 << 20


def is_trace_dir(path: str | Path) -> bool:
    """A folder with a run card (``read_trace_dir`` checks the rest)."""
    path = Path(path)
    return path.is_dir() and (path / CARD_NAME).is_file()


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return _sha256(fh)


def _sha256(fh) -> str:
    """SHA-256 of an open file from its start; the file is left at its start again (read next from the same
    descriptor: what was hashed is what is read)."""
    h = hashlib.sha256()
    fh.seek(0)
    while block := fh.read(_CHUNK):
        h.update(block)
    fh.seek(0)
    return h.hexdigest()


def _open_trace_file(folder: Path, name: str):
    """A trace file of a folder as an open binary file, through the checked open every other file goes through
    (``k3core.utils.files.open_for_reading``: under a server no link out, a regular file of one link). A trace file
    that is a symbolic link is refused everywhere, in the app and on the command line alike (one rule: a trace
    folder holds its traces). Every refusal is a TraceError naming ``folder/name`` once."""
    where = f"{folder.name}/{name}"
    try:
        fd = open_for_reading(folder / name, follow_link=False)
    except FileNotFoundError as exc:
        raise TraceError(f"{where}: the trace file is missing") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TraceError(
                f"{where}: is a symbolic link; a trace folder's trace files must be the files themselves "
                "(copy the file into the folder)"
            ) from exc
        raise TraceError(f"{where}: cannot open the trace file ({exc.strerror})") from exc
    except TraceError:
        raise
    except ValueError as exc:  # the server's descriptor check (its own error type, its message led by the name)
        raise TraceError(f"{where}: {str(exc).removeprefix(f'{name}: ')}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TraceError(f"{where}: not a regular file")
    return os.fdopen(fd, "rb")


def _staging_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    return staging


def check_out_dir(out: str | Path) -> Path:
    """``out`` as a Path, or OutputFolderError (a ValueError): a trace folder is never written over, so only a
    new or empty folder (and never the root or a home folder: ``check_output_folder``)."""
    return check_output_folder(out, (), "trace folder")


def write_trace_dir(
    out: str | Path,
    traces: list[Trace],
    card: dict[str, Any],
    config_json: str,
    copy_from: str | Path | None = None,
) -> Path:
    """Write a trace folder atomically (see the module docstring) and return its path.

    ``card`` is the run card without the trace files' names and digests (they are filled in per text: ``card
    ["texts"][i]`` describes ``traces[i]``); ``config_json`` is config.json's text; ``copy_from`` is the
    checkpoint folder whose tokenizer files and metrics.json are copied. Raises ValueError when ``out`` holds
    something, OSError when it cannot be written; on any error nothing is left at ``out``."""
    out = check_out_dir(out)
    texts = card.get("texts") or []
    if len(texts) != len(traces) or not traces:
        raise ValueError(f"the run card describes {len(texts)} text(s) but {len(traces)} trace(s) were given")
    staging = _staging_dir(out)
    try:
        card = {**card, "format": CARD_FORMAT, "texts": [dict(t) for t in texts]}
        for i, (trace, text) in enumerate(zip(traces, card["texts"])):
            name = TRACE_PATTERN.format(i)
            trace.save(staging / name)
            text["file"] = name
            text["sha256"] = file_sha256(staging / name)
        (staging / "config.json").write_text(config_json, encoding="utf-8")
        if copy_from is not None:
            for name in COPIED_FILES:
                if (Path(copy_from) / name).is_file():
                    shutil.copyfile(Path(copy_from) / name, staging / name)
        (staging / CARD_NAME).write_text(json.dumps(card, indent=1, default=str), encoding="utf-8")
        if out.exists():
            out.rmdir()  # an empty folder the user made: replaced by the complete one
        os.rename(staging, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


@dataclass
class TraceDir:
    """A trace folder read back: its run card (checked, ``k3core.interp.trace_checks``), its config and where its traces
    are (loaded on demand with ``trace``, each checked against the card)."""

    path: Path
    card: dict[str, Any]
    config: K3Config | None = None
    limits: NpzLimits = NpzLimits()

    @property
    def texts(self) -> list[dict[str, Any]]:
        return self.card["texts"]

    def _entry(self, index: int) -> tuple[dict[str, Any], str]:
        if not 0 <= index < len(self.texts):
            raise TraceError(f"{self.path.name}: no text {index} (the folder has {len(self.texts)})")
        entry = self.texts[index]
        name = str(entry.get("file", ""))
        if Path(name).name != name or not name:
            raise TraceError(f"{self.path.name}: the trace file of text {index} ({entry.get('file')!r}) is missing")
        return entry, name

    def _checked_layout(self, fh, entry: dict[str, Any], where: str) -> TraceLayout:
        layout = Trace.layout(fh, self.limits, where)
        if self.config is not None:
            check_layout(layout.axes, layout.shapes, self.config, len(entry["tokens"]), where)
        return layout

    def inflated_bytes(self, index: int = 0) -> int:
        """The bytes reading text ``index``'s trace allocates, from its file's zip directory and headers, after every
        check of names, axes and shapes against the card (``check_layout``): nothing inflated. What a server admits
        against its job memory before it calls ``trace(index, max_bytes=...)``. Raises TraceError."""
        entry, name = self._entry(index)
        with _open_trace_file(self.path, name) as fh:
            return self._checked_layout(fh, entry, f"{self.path.name}/{name}").nbytes

    def trace(self, index: int = 0, verify: bool = True, max_bytes: int | None = None) -> Trace:
        """The trace of text ``index``; ``verify`` checks its SHA-256 against the card (hashed and read from one
        descriptor). Its layout is checked against the card before any array is inflated; ``max_bytes`` (what a
        server admitted, ``inflated_bytes``) caps what it may inflate to. Raises TraceError naming the file and what
        is wrong."""
        entry, name = self._entry(index)
        where = f"{self.path.name}/{name}"
        limits = self.limits
        if max_bytes is not None:
            limits = replace(limits, max_bytes=min(limits.max_bytes, int(max_bytes)))
        with _open_trace_file(self.path, name) as fh:
            if verify and entry.get("sha256") and _sha256(fh) != entry["sha256"]:
                raise TraceError(f"{where} does not match its run card (changed or truncated)")
            self._checked_layout(fh, entry, where)
            trace = Trace.load(fh, limits, where)
        if self.config is not None:
            check_trace(trace, self.config, entry["tokens"], where)
        return trace

    def check_all(self) -> None:
        """Read every trace (within the limits) and check it against the card: what an upload's check does."""
        for i in range(len(self.texts)):
            self.trace(i)


def read_trace_dir(path: str | Path, limits: NpzLimits | None = None) -> TraceDir:
    """The run card of a trace folder, checked (format, texts with their files and tokens, config; the traces'
    sizes from their zip directories against the limits, one file and the whole folder). Raises TraceError."""
    path = Path(path)
    limits = limits or NpzLimits()
    card_file = path / CARD_NAME
    if not card_file.is_file():
        raise TraceError(f"{path.name}: not a trace folder (no {CARD_NAME})")
    try:
        card = parse_json(  # integers are range-checked by check_card (a per-integer hook costs 3x the parse)
            read_bytes_limited(card_file, MAX_CARD_BYTES),
            f"{path.name}/{CARD_NAME}",
            error=TraceError,
            check_ints=False,
        )
    except OSError as exc:
        raise TraceError(f"{path.name}: cannot read {CARD_NAME} ({exc})") from exc
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT:
        found = card.get("format") if isinstance(card, dict) else type(card).__name__
        raise TraceError(f"{path.name}: {CARD_NAME} is not a k3lab run card (format {found!r}, want {CARD_FORMAT})")
    texts = card.get("texts")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, dict) for t in texts):
        raise TraceError(f"{path.name}: {CARD_NAME} lists no traced texts")
    if not isinstance(card.get("config"), dict):
        raise TraceError(f"{path.name}: {CARD_NAME} has no config")
    config = check_card(card, f"{path.name}/{CARD_NAME}")
    stored = inflated = 0
    for name in dict.fromkeys(t["file"] for t in texts):
        try:
            with _open_trace_file(path, name) as fh:
                file_stored, file_inflated = zip_totals(fh, f"{path.name}/{name}")
        except TraceError:
            continue  # unreadable or missing: said when its text is opened (the other texts stay usable)
        check_ratio(file_stored, file_inflated, limits, f"{path.name}/{name}")
        stored, inflated = stored + file_stored, inflated + file_inflated
    folder_limits = NpzLimits(len(texts) * limits.max_bytes, limits.max_ratio, limits.ratio_floor)
    check_ratio(stored, inflated, folder_limits, f"{path.name} (all trace files)")
    return TraceDir(path=path, card=card, config=config, limits=limits)


def trace_dir_fingerprint(path: str | Path) -> str:
    """SHA-256 of the run card (which holds every trace file's digest): one key per trace folder's content."""
    return hashlib.sha256(read_bytes_limited(Path(path, CARD_NAME), MAX_CARD_BYTES)).hexdigest()
