"""Files: atomic writes (a reader, or a crash, sees the old file or the new one, never half of one), the one
rule for the folders commands write (``check_output_folder``), and bounded reads of files users supply (a size
limit, JSON parsed into the caller's own error type, and an optional check of every opened descriptor that a
server installs with ``checked_opens``)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and return the path.

    The bytes go to a fresh temporary file beside ``path`` (same folder, so the same filesystem),
    are flushed and fsynced, and the file is renamed over ``path`` (``os.replace``, atomic on POSIX
    and Windows). On any error the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """``atomic_write_bytes(path, text.encode(encoding))``."""
    return atomic_write_bytes(path, text.encode(encoding))


def fsync_dir(path: str | Path) -> None:
    """Flush a folder's entries (a rename inside it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------- output folders
class OutputFolderError(ValueError):
    """A folder a command was asked to write into that it must not write into (nothing was written)."""


def home_folders() -> set[Path]:
    """Home folders no command writes into: the user's ($HOME and the account's own), /root, and /home and
    /Users themselves (each /home/NAME and /Users/NAME is refused by ``check_output_folder`` too)."""
    homes = {Path("/root"), Path("/home"), Path("/Users"), Path(os.path.expanduser("~"))}
    try:
        import pwd

        homes.add(Path(pwd.getpwuid(os.getuid()).pw_dir))
    except (ImportError, KeyError, OSError):
        pass
    return {Path(os.path.realpath(h)) for h in homes}


def _is_home(resolved: Path) -> bool:
    return resolved in home_folders() or resolved.parent in (Path("/home"), Path("/Users"))


def check_output_folder(out: str | Path, own: tuple[str, ...], kind: str, option: str = "--out") -> Path:
    """``out`` as a Path when a command that writes a ``kind`` may write there, else OutputFolderError naming it.

    The one rule for every folder a command writes (train runs, reports, trace, weights, experiment and survey
    folders, exports, offload folders, the runs library): never the file system's root or a home folder (after
    links are resolved); a folder that does not exist yet or is empty; or a folder that already holds one of
    ``own`` (names of the files this kind of output writes: its own earlier output, which the command continues
    or replaces). Anything else in the folder is the user's, and the folder is refused before anything is
    written. ``own=()``: only a new or empty folder."""
    path = Path(out)
    resolved = Path(os.path.realpath(path))
    choose = f"choose a new folder for {option}"
    if resolved == Path(resolved.anchor):
        raise OutputFolderError(f"{path}: will not write a {kind} into the root of the file system; {choose}")
    if _is_home(resolved):
        raise OutputFolderError(f"{path}: will not write a {kind} into a home folder ({resolved}); {choose}")
    if not path.exists():
        if path.is_symlink():
            raise OutputFolderError(f"{path}: is a link to nothing; {choose}")
        return path
    if not path.is_dir():
        raise OutputFolderError(f"{path}: exists and is not a folder; {choose}")
    if any(path.joinpath(name).exists() for name in own):
        return path
    with os.scandir(path) as entries:
        found = [entry.name for _, entry in zip(range(4), entries)]
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        why = (
            f"holds files that are not a {kind}'s"
            if own
            else f"is not an empty folder (a {kind} is never written over)"
        )
        raise OutputFolderError(f"{path}: {why} ({shown}); nothing was written there; {choose}, or an empty one")
    return path


# ---------------------------------------------------------------------------------- reading
# What a server (the app) may add to every open of a checkpoint file: a check of the opened descriptor
# (regular file, one link, inside the allowed folders) that raises the caller's error to refuse it. None:
# plain opens, as on a user's own machine.
FileCheck = Callable[[int, Path], None]  # (fd, path as given) -> None, or raises
_FILE_CHECK: ContextVar[FileCheck | None] = ContextVar("k3lab_file_check", default=None)


@contextmanager
def checked_opens(check: FileCheck) -> Iterator[None]:
    """Within this block (this thread / context), every ``open_for_reading`` resolves the path, opens it with
    O_NOFOLLOW and hands the descriptor to ``check`` before anything is read from it."""
    token = _FILE_CHECK.set(check)
    try:
        yield
    finally:
        _FILE_CHECK.reset(token)


def open_for_reading(path: str | Path, follow_link: bool = True) -> int:
    """A read-only descriptor of ``path`` (the caller closes it). Under ``checked_opens`` the resolved path is
    opened without following a last link and the descriptor itself is checked (no check-then-open race).
    ``follow_link=False``: a ``path`` that is itself a symbolic link is refused everywhere (OSError ELOOP), its
    folder's links still followed."""
    check = _FILE_CHECK.get()
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    if check is None:
        return os.open(path, flags if follow_link else flags | nofollow)
    real = os.path.realpath(path) if follow_link else os.path.join(os.path.realpath(Path(path).parent), Path(path).name)
    fd = os.open(real, flags | nofollow)
    try:
        check(fd, Path(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes_limited(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of a file through one descriptor; ValueError when it holds more than ``max_bytes``."""
    fd = open_for_reading(path)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise ValueError(f"{Path(path).name} is {size:,} bytes, over the limit of {max_bytes:,} for this file")
        data = fh.read(size + 1)  # the size it has, not the limit: no buffer of max_bytes for a small file
        if len(data) > size:  # it grew, or its size is not known (st_size 0): read on, to the limit
            data += fh.read(max_bytes + 1 - len(data))
    if len(data) > max_bytes:
        raise ValueError(f"{Path(path).name} is over the limit of {max_bytes:,} bytes for this file")
    return data


MAX_JSON_INT_DIGITS = 20  # no count, width or id in a checkpoint's JSON needs more (2**63 has 19 digits)


class _Refused(ValueError):
    pass


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise _Refused(f"a number of {len(text.lstrip('-')):,} digits ({text[:12]}...) is out of range")
    return int(text)


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:24]} is out of range")
    return value


def _json_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON value")


def parse_json(data: bytes | str, where: str, error: type[Exception] = ValueError, check_ints: bool = True) -> Any:
    """JSON from a file a user supplied, every failure raised as ``error`` naming ``where``: invalid JSON,
    nesting too deep for the parser, integers over MAX_JSON_INT_DIGITS digits, NaN / Infinity, floats that
    overflow (1e999). ``check_ints=False`` leaves integers to Python's own limit (4,300 digits) for files of
    millions of integers that the caller range-checks itself (a per-integer hook costs 3x the parse)."""
    int_hook = _json_int if check_ints else None
    try:
        return json.loads(data, parse_int=int_hook, parse_float=_json_float, parse_constant=_json_constant)
    except _Refused as exc:
        raise error(f"{where}: {exc}") from None
    except RecursionError:
        raise error(f"{where}: nested too deeply to be a checkpoint file") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{where} is not valid JSON ({exc})") from None
