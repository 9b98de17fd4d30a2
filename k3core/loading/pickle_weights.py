"""Pickle weight files (``pytorch_model.bin`` and friends), read only when safe: a torch.save zip whose entries
are stored uncompressed (``check_pickle_zip``), loaded with ``torch.load(weights_only=True)`` into a plain dict
of tensors (``read_pickle_weights_only``). k3lab never unpickles arbitrary objects.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import BinaryIO

import torch

from ..utils.files import open_for_reading
from .tensor_info import CheckpointError


def check_pickle_zip(file: Path, fh: BinaryIO) -> None:
    """A torch.save zip (open as ``fh``) that torch.load can read without inflating anything: every entry stored
    uncompressed and inside the file (a deflated entry could unpack to any size: a 200 KB file to a 200 MB
    tensor). Leaves ``fh`` at its start."""
    size = os.fstat(fh.fileno()).st_size
    if not zipfile.is_zipfile(fh):
        raise CheckpointError(
            f"{file.name}: refusing to load this pickle file: not a torch.save zip archive (older pickle formats "
            f"are not read); convert it to safetensors"
        )
    try:
        with zipfile.ZipFile(fh) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{file.name}: damaged torch.save zip archive ({exc})") from exc
    fh.seek(0)
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise CheckpointError(
                f"{file.name}: refusing to load this pickle file: the zip entry {info.filename[:120]!r} is "
                f"compressed (torch.save never compresses, and a compressed entry can unpack to far more than the "
                f"file holds); convert it to safetensors"
            )
        total += info.file_size
    if total > size:
        raise CheckpointError(f"{file.name}: its zip entries declare {total:,} bytes, more than the file's {size:,}")


def read_pickle_weights_only(file: Path) -> dict[str, torch.Tensor]:
    try:
        with os.fdopen(open_for_reading(file), "rb") as fh:
            check_pickle_zip(file, fh)
            obj = torch.load(fh, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure means we refuse the file
        raise CheckpointError(
            f"{file.name}: refusing to load this pickle file: torch.load(weights_only=True) "
            f"rejected it ({type(exc).__name__}); convert it to safetensors"
        ) from exc
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise CheckpointError(f"{file.name}: the pickle file does not hold a plain dict of tensors")
    return obj
