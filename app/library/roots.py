"""Which server folders the app may open by path.

Opening a checkpoint by path reads the server's disk, so a path is accepted only inside a configured root:
the runs library home and the folders given with ``k3lab app --root DIR`` (default: the folder the app was
started in; see ``app.server.settings.configured_roots``). Paths are resolved (symlinks followed, ``..``
collapsed) *before* the check, so a link inside a root that points outside it is refused like the outside
path itself. No Streamlit here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from k3core.loading.tensor_info import CheckpointError


class PathRefused(ValueError):
    """A path the app will not open; the message says why and how to allow it."""


def _inside(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def _refusal(shown: str, roots: Sequence[Path]) -> PathRefused:
    listed = ", ".join(str(r) for r in roots) or "(none)"
    return PathRefused(
        f"{shown} is outside the folders this app may open ({listed}). Start the app with "
        f"`k3lab app --root DIR` to allow another folder."
    )


def confine(path: str | Path, roots: Sequence[str | Path], base: str | Path | None = None) -> Path:
    """The resolved path when it lies inside one of ``roots`` (after resolving both); else PathRefused.

    A relative path is taken relative to ``base`` (default: the current folder). The root check comes
    before the existence check, so a refusal never tells whether an outside path exists.
    """
    raw = str(path).strip()
    if not raw:
        raise PathRefused("No folder given: type the path of a checkpoint folder on the server.")
    if "\x00" in raw:
        raise PathRefused("The path contains a NUL character.")
    resolved_roots = [Path(r).expanduser().resolve() for r in roots]
    candidate = Path(raw).expanduser()
    if not candidate.is_absolute():
        candidate = Path(base or os.getcwd()) / candidate
    try:
        resolved = candidate.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise PathRefused(f"{raw}: cannot resolve the path ({exc.__class__.__name__})") from exc
    if not _inside(resolved, resolved_roots):
        raise _refusal(raw, resolved_roots)
    if not resolved.exists():
        raise PathRefused(f"{raw}: no such file or folder")
    return resolved


def confine_folder(path: str | Path, roots: Sequence[str | Path], base: str | Path | None = None) -> Path:
    """confine() for a checkpoint folder: also every entry directly inside it must resolve inside a root.

    The loader reads the folder's files (config.json, weights, index), so a file that is a symlink to,
    say, /etc/shadow would leak it even though the folder itself is allowed.
    """
    folder = confine(path, roots, base)
    if not folder.is_dir():
        raise PathRefused(f"{path}: not a folder (a checkpoint is a folder with config.json and its weights)")
    resolved_roots = [Path(r).expanduser().resolve() for r in roots]
    for entry in sorted(folder.iterdir()):
        try:
            target = entry.resolve()
            info = target.stat()
        except (OSError, RuntimeError) as exc:
            raise PathRefused(f"{path}: {entry.name} cannot be resolved ({exc.__class__.__name__})") from exc
        if not _inside(target, resolved_roots):
            raise PathRefused(
                f"{path}: {entry.name} is a link to a file outside the folders this app may open; "
                f"copy the file into the folder or start the app with `k3lab app --root DIR`."
            )
        if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
            raise PathRefused(f"{path}: {entry.name} {_HARD_LINKS.format(n=info.st_nlink)}")
    return folder


_HARD_LINKS = (
    "has {n} hard links, and one of them may lie outside the folders this app may open; copy the file "
    "(a copy has one link)"
)


def descriptor_refusal(fd: int, roots: Sequence[Path]) -> str | None:
    """Why an opened file may not be read by the app, from the descriptor itself (no check-then-open race):
    not a regular file, more than one hard link, or (where /proc shows it) a file outside ``roots``."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_nlink > 1:
        return _HARD_LINKS.format(n=info.st_nlink)
    proc = Path(f"/proc/self/fd/{fd}")
    if proc.is_symlink():
        where = Path(os.readlink(proc))
        if not _inside(where, roots):
            return "lies outside the folders this app may open"
    return None


def descriptor_check(roots: Callable[[], Sequence[Path]]) -> Callable[[int, Path], None]:
    """A ``k3core.utils.files.checked_opens`` check that refuses, as a CheckpointError, what descriptor_refusal names;
    ``roots()`` is asked at each open (the folders may change between server starts, not within a check)."""

    def check(fd: int, path: Path) -> None:
        reason = descriptor_refusal(fd, [Path(r).resolve() for r in roots()])
        if reason is not None:
            raise CheckpointError(f"{path.name}: {reason}")

    return check
