"""Unpack a zip of one checkpoint folder without trusting the archive.

Refused with a ``ZipRefused`` whose message says what was wrong: absolute names, drive letters, ``..``
or backslashes in a name (zip-slip), symlinks and other special files, encrypted entries, nested
archives, sub-folders below the run folder, more than one top-level folder, duplicate names, too many
entries, a total unpacked size over the limit, a compression ratio that only a zip bomb has (per entry and
over the whole archive, before anything is written), and entries
that unpack to more bytes than their header declares (checked while writing, not only from the header).
Hidden files and macOS resource forks (``__MACOSX/``, ``.DS_Store``, ``.gitattributes``, ``.cache/``) and
names the caller does not accept are skipped and listed. No Streamlit here.
"""

from __future__ import annotations

import re
import shutil
import stat
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from analysis.output.format import format_bytes

MAX_ENTRIES = 2000
MAX_RATIO = 200.0  # uncompressed / compressed; weights compress ~1.1x, text ~5-10x
RATIO_MIN_BYTES = 1 << 20  # small files may compress well without being bombs
ARCHIVE_SUFFIXES = (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".7z", ".rar", ".zst")
_DRIVE = re.compile(r"^[A-Za-z]:")
_CHUNK = 1 << 20


class ZipRefused(ValueError):
    """A zip the app will not unpack; the message says why."""


@dataclass
class Extracted:
    """What extract_run_zip wrote (file names in the destination folder) and what it skipped."""

    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    total_bytes: int = 0


def _check_name(name: str) -> PurePosixPath:
    """The entry name as a relative POSIX path; ZipRefused for anything that could escape the folder."""
    if not name or "\x00" in name or any(ord(c) < 32 for c in name):
        raise ZipRefused(f"the zip has an entry with an invalid name ({name!r})")
    if "\\" in name:
        raise ZipRefused(f"the zip entry {name!r} uses backslashes in its name; zip the folder again with a zip tool")
    if name.startswith("/") or _DRIVE.match(name):
        raise ZipRefused(f"the zip entry {name!r} has an absolute path; a run zip holds relative names only")
    parts = PurePosixPath(name).parts
    if any(part == ".." for part in parts):
        raise ZipRefused(f"the zip entry {name!r} points outside the folder ('..'); refused")
    return PurePosixPath(*[p for p in parts if p != "."])


def _is_junk(path: PurePosixPath) -> bool:
    return any(part.startswith(".") or part == "__MACOSX" for part in path.parts)


def extract_run_zip(
    source: str | Path | BinaryIO,
    dest: str | Path,
    *,
    max_total_bytes: int,
    accept: Callable[[str], bool] = lambda name: True,
    max_entries: int = MAX_ENTRIES,
    max_ratio: float = MAX_RATIO,
) -> Extracted:
    """Unpack a zip of one run folder into the empty folder ``dest``. Returns what was written.

    The files may sit at the top of the archive or inside one folder (``myrun/config.json``); that folder
    level is dropped. ``accept(name)`` decides which file names are kept; the others are skipped.
    On ZipRefused, files already written to ``dest`` are removed.
    """
    dest = Path(dest)
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise ZipRefused(f"not a readable zip archive ({exc})") from exc
    with archive:
        infos = archive.infolist()
        if len(infos) > max_entries:
            raise ZipRefused(f"the zip has {len(infos):,} entries; a run folder has at most {max_entries:,}")
        result = Extracted()
        members: list[tuple[zipfile.ZipInfo, PurePosixPath]] = []
        for info in infos:
            path = _check_name(info.filename)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise ZipRefused(f"the zip entry {info.filename!r} is a symbolic link; links are not accepted")
            if info.is_dir() or stat.S_ISDIR(mode):
                continue
            if stat.S_IFMT(mode) and not stat.S_ISREG(mode):
                raise ZipRefused(f"the zip entry {info.filename!r} is not a regular file")
            if info.flag_bits & 0x1:
                raise ZipRefused(f"the zip entry {info.filename!r} is encrypted; upload an unencrypted zip")
            if not path.parts or _is_junk(path):
                result.skipped.append(info.filename)
                continue
            if path.name.lower().endswith(ARCHIVE_SUFFIXES):
                raise ZipRefused(
                    f"the zip contains another archive ({info.filename}); nested archives are not unpacked - "
                    f"zip the run folder itself"
                )
            members.append((info, path))
        if not members:
            raise ZipRefused("the zip holds no files")

        tops = {p.parts[0] for _, p in members}
        if all(len(p.parts) > 1 for _, p in members) and len(tops) == 1:
            members = [(info, PurePosixPath(*p.parts[1:])) for info, p in members]
        deep = sorted(str(p) for _, p in members if len(p.parts) > 1)
        if deep:
            raise ZipRefused(
                "the zip must hold one run folder (config.json and the weights at the top, or inside one folder); "
                f"it has files in sub-folders: {deep[:5]}{' ...' if len(deep) > 5 else ''}"
            )
        kept: list[tuple[zipfile.ZipInfo, str]] = []
        for info, p in members:
            if accept(p.name):
                kept.append((info, p.name))
            else:
                result.skipped.append(info.filename)
        names = [name for _, name in kept]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ZipRefused(f"the zip holds the same file name twice: {dupes}")
        if not kept:
            raise ZipRefused(f"the zip holds no checkpoint files (found: {sorted(str(p) for _, p in members)[:8]})")

        declared = sum(info.file_size for info, _ in kept)
        if declared > max_total_bytes:
            raise ZipRefused(
                f"the zip would unpack to {format_bytes(declared)}, over the limit of {format_bytes(max_total_bytes)}; "
                f"open a folder this large by path instead"
            )
        # The whole archive too: many entries each under RATIO_MIN_BYTES (40 x 1 MiB of zeros in 48 KB) would
        # pass one by one. Compressed sizes are the archive's own claims, so they must fit in the archive.
        compressed = sum(info.compress_size for info in infos)
        archive_bytes = archive.fp.seek(0, 2) if archive.fp is not None else compressed
        if compressed > archive_bytes:
            raise ZipRefused("the zip's entries claim more compressed bytes than the archive holds; refused")
        if declared > RATIO_MIN_BYTES and declared > max_ratio * max(compressed, 1):
            raise ZipRefused(
                f"the zip would unpack to {declared / max(compressed, 1):,.0f}x its compressed size "
                f"({format_bytes(declared)} from {format_bytes(compressed)}; a zip bomb pattern); refused"
            )
        for info, name in kept:
            if info.file_size > RATIO_MIN_BYTES and info.file_size > max_ratio * max(info.compress_size, 1):
                raise ZipRefused(
                    f"{name} would unpack {info.file_size / max(info.compress_size, 1):,.0f}x its compressed size "
                    f"(a zip bomb pattern); refused"
                )
        dest.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(dest).free
        if declared > free:
            raise ZipRefused(
                f"not enough disk space to unpack the zip ({format_bytes(declared)} needed, {format_bytes(free)} free)"
            )
        try:
            for info, name in kept:
                result.total_bytes += _write_member(archive, info, dest / name, max_total_bytes - result.total_bytes)
                result.files.append(name)
        except BaseException:
            for name in result.files:
                (dest / name).unlink(missing_ok=True)
            raise
    return result


def _write_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, budget: int) -> int:
    """Copy one entry, stopping as soon as it exceeds its declared size or the remaining budget."""
    written = 0
    with open(target, "xb") as out:  # "x": never overwrite; dest is a fresh folder
        try:
            with archive.open(info) as src:
                while block := src.read(_CHUNK):
                    written += len(block)
                    if written > info.file_size:
                        raise ZipRefused(f"{info.filename} unpacks to more bytes than its header declares; refused")
                    if written > budget:
                        raise ZipRefused("the zip unpacks to more than the size limit; refused")
                    out.write(block)
        except BaseException as exc:
            out.close()
            target.unlink(missing_ok=True)
            if isinstance(exc, (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile)):
                raise ZipRefused(f"{info.filename}: the zip is damaged ({exc})") from exc
            if isinstance(exc, NotImplementedError):  # e.g. an unsupported compression method
                raise ZipRefused(f"{info.filename}: {exc}") from exc
            raise
    return written
