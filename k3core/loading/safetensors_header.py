"""Safetensors headers read and checked before any data: a file is 8 bytes of header length, a JSON table of
{dtype, shape, data_offsets} per tensor, then the bytes.

``read_safetensors_header`` validates the table against safetensors' own bounds (header size, dimensions, bytes
exactly shape x dtype, data inside the file) so a corrupt or hostile file fails with a CheckpointError naming it;
``read_span`` reads one byte range and ``is_hole`` spots the holes of sparse files (read as zeros, not read).
``k3core.loading.folder`` builds a checkpoint's table of tensors from these headers.
"""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path

import torch

from ..utils.files import open_for_reading, parse_json
from .tensor_info import CheckpointError

MAX_HEADER_BYTES = 100 * 1024**2  # safetensors' own limit: a header over 100 MB is corrupt or hostile
MAX_DIMS = 8  # safetensors' own bounds on a tensor's shape: at most 8 dimensions, each below 2**63
MAX_DIM = 2**63 - 1
# Bits per element of every safetensors dtype: the header's byte range must be exactly shape x this.
DTYPE_BITS: dict[str, int] = {
    **{t: 8 for t in ("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0")},
    **{t: 16 for t in ("U16", "I16", "F16", "BF16")},
    **{t: 32 for t in ("U32", "I32", "F32")},
    **{t: 64 for t in ("U64", "I64", "F64")},
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


def read_safetensors_header(file: Path) -> tuple[dict, int]:
    """The parsed JSON header of a safetensors file and the absolute offset where its data starts.

    Checks that the header is an object of {dtype, shape, data_offsets} entries whose data fits in
    the file; raises CheckpointError naming the file otherwise."""
    with os.fdopen(open_for_reading(file), "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{file.name}: not a safetensors file (only {size} bytes)")
        head = fh.read(8)
        n = int.from_bytes(head, "little")
        if n <= 0 or n > size - 8 or n > MAX_HEADER_BYTES:
            if head[:2] == b"PK" or head[:1] == b"\x80":
                raise CheckpointError(
                    f"{file.name}: this is a pickle/zip (torch.save) file, not safetensors; "
                    f"k3lab never unpickles untrusted files"
                )
            raise CheckpointError(
                f"{file.name}: not a safetensors file (header length {n} does not fit in {size} bytes)"
            )
        header_bytes = fh.read(n)
    header = parse_json(header_bytes, f"{file.name}: corrupt safetensors header", CheckpointError, check_ints=False)
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{file.name}: corrupt safetensors header (a JSON {type(header).__name__}, "
            f"expected an object of tensor entries)"
        )
    data_start = 8 + n
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        ok = (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        )
        if not ok:
            raise CheckpointError(
                f"{file.name}: corrupt safetensors header: entry {key[:200]!r} is not "
                f"{{dtype, shape, data_offsets}} ({str(entry)[:120]})"
            )
        _check_extent(file.name, key, dtype, shape, offsets)
        end = max(end, offsets[1])
    if data_start + end > size:
        raise CheckpointError(
            f"{file.name}: truncated: the header describes {data_start + end} bytes but the file has {size}"
        )
    return header, data_start


def is_hole(fd: int, begin: int, end: int) -> bool:
    """Whether bytes [begin, end) of an open file are a hole of a sparse file (they read as zeros): no data
    starts before ``end`` (``SEEK_DATA``). False where the filesystem cannot tell."""
    if end <= begin or not hasattr(os, "SEEK_DATA"):
        return False
    try:
        return os.lseek(fd, begin, os.SEEK_DATA) >= end
    except OSError as exc:
        return exc.errno == errno.ENXIO  # no data at all after begin


def read_span(file: Path, begin: int, end: int, what: str) -> torch.Tensor:
    """Bytes [begin, end) of ``file`` as a uint8 tensor (one read; a hole of a sparse file is not read, it is
    zeros); CheckpointError naming ``what`` if the file is shorter."""
    with open(file, "rb", buffering=0) as fh:
        if end <= file.stat().st_size and is_hole(fh.fileno(), begin, end):
            return torch.zeros(end - begin, dtype=torch.uint8)
        buf = torch.empty(end - begin, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        fh.seek(begin)
        done = 0
        while done < len(view):
            n = fh.readinto(view[done:])
            if not n:
                raise CheckpointError(
                    f"{file.name}: truncated while reading {what!r} (bytes {begin}-{end} of {file.stat().st_size})"
                )
            done += n
    return buf


def _check_extent(where: str, key: str, dtype: str, shape: list[int], offsets: list[int]) -> None:
    """The entry's shape is one safetensors allows (at most MAX_DIMS dimensions, each below 2**63) and its
    bytes are exactly shape x dtype. Checked before anything multiplies shapes: a header of long shapes or
    huge numbers would otherwise cost time quadratic in its size."""
    name = repr(key[:200])
    if dtype not in DTYPE_BITS:
        raise CheckpointError(f"{where}: tensor {name} has an unknown dtype {dtype[:40]!r}")
    if len(shape) > MAX_DIMS or any(d > MAX_DIM for d in shape):
        raise CheckpointError(
            f"{where}: corrupt safetensors header: tensor {name} has a shape of {len(shape)} dimension(s) out of "
            f"range (at most {MAX_DIMS}, each below 2**63)"
        )
    nbytes, bits = offsets[1] - offsets[0], math.prod(shape) * DTYPE_BITS[dtype]
    if bits != 8 * nbytes:
        raise CheckpointError(
            f"{where}: corrupt safetensors data: tensor {name} has {nbytes:,} bytes for shape {shape} of {dtype} "
            f"({bits // 8 if bits % 8 == 0 else bits / 8:,} expected)"
        )
