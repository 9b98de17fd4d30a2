"""What an added run may hold and the checks before the library keeps it: the file names a checkpoint or trace folder
may carry (``accepted_name``), run names (``clean_name``), the upload limit per file (``write_limited``), weights
present (``check_weights_present``) and tokenizer files that load and fit the model (``check_tokenizer``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import BinaryIO

from app.library.run_folders import FolderInfo, LibraryError, run_message
from k3core.interp.trace_folder import CARD_NAME, is_trace_dir, read_trace_dir
from k3core.interp.trace_npz import TraceError
from k3core.loading.folder import (
    CONFIG_NAME,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    PICKLE_NAMES,
    TOKENIZER_FILES,
    WEIGHTS_NAME,
)
from k3core.utils.files import parse_json, read_bytes_limited

EXTRA_NAMES = ("metrics.json", "README.md", "generation_config.json", "special_tokens_map.json", *TOKENIZER_FILES)
SHARD_RE = re.compile(r"^model-\d+-of-\d+\.safetensors$")
TRACE_FILE_RE = re.compile(r"^trace-\d+\.npz$")  # a trace folder's traces (k3core.interp.trace_folder)
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")
_CHUNK = 1 << 20


def accepted_name(name: str) -> bool:
    """A file name that belongs in a checkpoint folder (config, weights, shards, index, tokenizer, card)."""
    return (
        name in (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, *PICKLE_NAMES, *EXTRA_NAMES, CARD_NAME)
        or bool(SHARD_RE.match(name))
        or bool(TRACE_FILE_RE.match(name))
    )


def clean_name(name: str, default: str) -> str:
    """A run name of letters, digits, '.', '_' and '-' (at most 64 characters)."""
    return _NAME_RE.sub("-", name.strip()).strip("-.")[:64] or default


def write_limited(target: Path, data: bytes | BinaryIO, shown: str, max_upload_bytes: int) -> None:
    """Copy bytes or a file object to target in blocks, refusing files over the upload limit."""
    written = 0
    with open(target, "xb") as out:
        if isinstance(data, (bytes, bytearray, memoryview)):
            written = len(data)
            if written <= max_upload_bytes:
                out.write(data)
        else:
            if hasattr(data, "seek"):
                data.seek(0)
            while (block := data.read(_CHUNK)) and written <= max_upload_bytes:
                written += len(block)
                out.write(block)
    if written > max_upload_bytes:
        raise LibraryError(
            f"{shown} is over the upload limit of {max_upload_bytes // 1024**2:,} MB per file; start the "
            f"app with `k3lab app --max-upload-mb N`, or open the folder by path."
        )


def limit_hint(max_upload_bytes: int) -> str:
    """What to do about a file over the upload limit (the browser refuses it before it reaches the app)."""
    mb = max_upload_bytes // 1024**2
    return (
        f"A file over the upload limit ({mb:,} MB per file) is refused by the browser before it reaches the app: "
        f"start the app with `k3lab app --max-upload-mb N`, or open the folder by path."
    )


def check_weights_present(folder: Path, name: str, max_upload_bytes: int) -> None:
    """A staged run folder is a trace folder whose traces all check, or a checkpoint with config.json and its weights
    (model.safetensors, a pickle, or every shard its index lists); LibraryError naming what is missing."""
    if is_trace_dir(folder):  # a trace folder: traces and a run card, no weights (k3core.interp.trace_folder)
        try:
            read_trace_dir(folder).check_all()  # every trace read within the limits, checked against the card
        except TraceError as exc:
            raise LibraryError(run_message(str(exc), folder, name)) from exc
        return
    names = sorted(p.name for p in folder.iterdir())
    if CONFIG_NAME not in names:
        raise LibraryError(
            f"{name}: config.json is missing (a checkpoint is a folder with config.json and model.safetensors)"
        )
    if INDEX_NAME in names:
        try:
            index = parse_json(read_bytes_limited(folder / INDEX_NAME, MAX_INDEX_BYTES), INDEX_NAME)
            wanted = {str(w) for w in index["weight_map"].values()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LibraryError(f"{name}: {INDEX_NAME} is not a valid shard index ({str(exc)[:200]})") from exc
        missing = sorted(w for w in wanted if w not in names)
        if missing:
            raise LibraryError(
                f"{name}: shard file(s) listed in the index are missing: {missing[:8]}. " + limit_hint(max_upload_bytes)
            )
    elif not any(n in (WEIGHTS_NAME, *PICKLE_NAMES) or SHARD_RE.match(n) for n in names):
        raise LibraryError(
            f"{name}: no weights among the files ({', '.join(names)}); a checkpoint needs model.safetensors "
            f"(or shards with {INDEX_NAME}). " + limit_hint(max_upload_bytes)
        )


def check_tokenizer(folder: Path, name: str, info: FolderInfo) -> None:
    """Tokenizer files that come with an upload must load and fit the model (checked before it is kept)."""
    from k3core.tokenizer import TOKENIZER_FILES, TokenizerError, load_tokenizer

    if not any((folder / f).is_file() for f in TOKENIZER_FILES) or info.files is None or info.files.config is None:
        return
    try:
        load_tokenizer(folder, info.files.config.vocab_size)
    except TokenizerError as exc:
        raise LibraryError(run_message(str(exc), folder, name)) from exc
