"""Bounded reading of a trace's .npz file: every member checked from the zip directory and its .npy header before
a byte is inflated, so a small file cannot make the reader allocate or inflate more than the limits allow.

Checks, in order (each refusal a ``TraceError`` naming the file and the member):

* the zip directory: only ``.npy`` members, stored or deflated, at most ``MAX_MEMBERS``;
* the sizes the directory declares: the inflated total at most ``limits.max_bytes`` (``MAX_TRACE_BYTES``, 4 GiB
  by default), and over ``RATIO_FLOOR_BYTES`` at most ``limits.max_ratio`` (``MAX_INFLATE_RATIO``) times the
  stored bytes (recorded activations compress by 1-5x; a zip bomb by 1,000x);
* each member's .npy header (versions 1 and 2): a plain numeric or boolean dtype (no objects, no pickles) and
  a declared shape x itemsize equal to the bytes the member declares, before the array is allocated;
* inflating: into the allocated array in blocks, never past the declared size (``zipfile`` stops there and
  checks the CRC at the end).

``zip_totals`` gives (stored, inflated) from the directory alone: what a whole trace folder's ratio check reads.
``npz_layout`` gives each member's shape and dtype from the directory and the .npy headers (a member's first bytes
inflated, never its array): what a reader checks, and a server admits against its memory budget, before inflating.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np


class TraceError(ValueError):
    """A trace file or trace folder is missing, corrupt, over a limit or not a k3lab trace."""


MAX_TRACE_BYTES = 4 * 1024**3  # one trace file, inflated (README: "Limits")
MAX_INFLATE_RATIO = 50  # inflated / stored bytes, for a file or a folder inflating past RATIO_FLOOR_BYTES
RATIO_FLOOR_BYTES = 64 * 1024**2  # below this, any ratio (a small trace of zeros compresses well and costs nothing)
MAX_MEMBERS = 100_000
MAX_NPY_HEADER = 1 << 16
_BLOCK = 1 << 22
_DTYPE_KINDS = "biufc"  # bool, ints, unsigned, floats, complex


@dataclass(frozen=True)
class NpzLimits:
    """What one .npz may inflate to (bytes) and at what ratio over its stored bytes."""

    max_bytes: int = MAX_TRACE_BYTES
    max_ratio: float = MAX_INFLATE_RATIO
    ratio_floor: int = RATIO_FLOOR_BYTES


def check_ratio(stored: int, inflated: int, limits: NpzLimits, where: str) -> None:
    """TraceError when ``inflated`` bytes are over the limit, or over the ratio limit past its floor."""
    if inflated > limits.max_bytes:
        raise TraceError(
            f"{where}: the arrays inflate to {inflated:,} bytes, over the limit of {limits.max_bytes:,} bytes"
        )
    if inflated > limits.ratio_floor and inflated > limits.max_ratio * max(stored, 1):
        raise TraceError(
            f"{where}: {stored:,} stored bytes would inflate to {inflated:,} ({inflated / max(stored, 1):,.0f}x; "
            f"the limit is {limits.max_ratio:g}x): not a trace k3lab wrote"
        )


def _members(zf: zipfile.ZipFile, where: str) -> list[zipfile.ZipInfo]:
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise TraceError(f"{where}: {len(infos):,} members, over the limit of {MAX_MEMBERS:,}")
    seen = set()
    for info in infos:
        if not info.filename.endswith(".npy") or info.filename in seen:
            raise TraceError(f"{where}: member {info.filename[:80]!r} is not one array of a trace")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise TraceError(f"{where}: member {info.filename[:80]!r} uses an unsupported compression")
        seen.add(info.filename)
    return infos


def zip_totals(fh: BinaryIO, where: str) -> tuple[int, int]:
    """(stored, inflated) bytes of an .npz's members, from its zip directory only (nothing inflated)."""
    try:
        with zipfile.ZipFile(fh) as zf:
            infos = _members(zf, where)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise TraceError(f"{where}: not a readable k3lab trace ({type(exc).__name__}: {exc})") from exc
    return sum(i.compress_size for i in infos), sum(i.file_size for i in infos)


def _header(member: BinaryIO, info: zipfile.ZipInfo, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """The .npy header of a member: (shape, fortran order, dtype), checked against the member's declared size."""
    name = f"{where}: member {info.filename[:80]!r}"
    try:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(member, max_header_size=MAX_NPY_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(member, max_header_size=MAX_NPY_HEADER)
        else:
            raise TraceError(f"{name}: .npy format version {version} is not supported")
    except TraceError:
        raise
    except (ValueError, TypeError, SyntaxError) as exc:
        raise TraceError(f"{name}: not a .npy array ({str(exc)[:200]})") from exc
    if dtype.hasobject or dtype.kind not in _DTYPE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise TraceError(f"{name}: dtype {dtype.str!r} is not a plain numeric array (objects are refused)")
    if not all(isinstance(n, int) and n >= 0 for n in shape) or len(shape) > 32:
        raise TraceError(f"{name}: bad shape {shape!r}")
    declared = math.prod(shape) * dtype.itemsize  # Python ints: no overflow for any declared shape
    holds = info.file_size - member.tell()
    if declared != holds:
        raise TraceError(
            f"{name}: its header declares shape {tuple(shape)} of {dtype.name} ({declared:,} bytes) but the member "
            f"holds {holds:,} bytes"
        )
    return tuple(shape), bool(fortran), dtype


@dataclass(frozen=True)
class NpzLayout:
    """An .npz's arrays as its zip directory and .npy headers declare them, nothing inflated: member name (without
    '.npy') -> (shape, dtype); ``nbytes``: the bytes its members inflate to (what reading it allocates)."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]
    nbytes: int


def npz_layout(fh: BinaryIO, where: str, limits: NpzLimits | None = None) -> NpzLayout:
    """The layout of an .npz (``NpzLayout``), its directory checked against ``limits`` and each member's .npy header
    checked as ``read_npz`` checks it; TraceError naming ``where``. ``fh`` is left at its start."""
    limits = limits or NpzLimits()
    shapes, dtypes = {}, {}
    try:
        with zipfile.ZipFile(fh) as zf:
            infos = _members(zf, where)
            nbytes = sum(i.file_size for i in infos)
            check_ratio(sum(i.compress_size for i in infos), nbytes, limits, where)
            for info in infos:
                with zf.open(info) as member:
                    shape, _, dtype = _header(member, info, where)
                name = info.filename[: -len(".npy")]
                shapes[name], dtypes[name] = shape, dtype
    except TraceError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error) as exc:
        raise TraceError(f"{where}: not a readable k3lab trace ({type(exc).__name__}: {exc})") from exc
    finally:
        fh.seek(0)
    return NpzLayout(shapes, dtypes, nbytes)


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> np.ndarray:
    with zf.open(info) as member:
        shape, fortran, dtype = _header(member, info, where)
        array = np.empty(shape, dtype=dtype, order="F" if fortran else "C")
        flat = memoryview(array.reshape(-1, order="A")).cast("B") if array.size else memoryview(b"")
        done = 0
        while done < len(flat):
            block = member.read(min(_BLOCK, len(flat) - done))
            if not block:
                raise TraceError(f"{where}: member {info.filename[:80]!r} is truncated")
            flat[done : done + len(block)] = block
            done += len(block)
        member.read(1)  # reaching the end makes zipfile check the CRC
    return array


def read_npz(
    fh: BinaryIO, where: str, limits: NpzLimits | None = None, only: Collection[str] | None = None
) -> dict[str, np.ndarray]:
    """Every array of an .npz (member name without '.npy' -> array), or those named in ``only``, read within
    ``limits`` (checked on the whole directory); TraceError names ``where`` for anything refused or unreadable."""
    limits = limits or NpzLimits()
    try:
        with zipfile.ZipFile(fh) as zf:
            infos = _members(zf, where)
            check_ratio(sum(i.compress_size for i in infos), sum(i.file_size for i in infos), limits, where)
            wanted = [i for i in infos if only is None or i.filename[: -len(".npy")] in only]
            return {info.filename[: -len(".npy")]: _read_member(zf, info, where) for info in wanted}
    except TraceError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error) as exc:
        raise TraceError(f"{where}: not a readable k3lab trace ({type(exc).__name__}: {exc})") from exc
