"""Error messages shown to the user: server folders replaced by run names, never the folder a run lives in."""

from __future__ import annotations

from pathlib import Path

from app.library.home import library
from app.library.run_folders import LibraryError
from app.library.run_list import RunRef


def message(exc: BaseException | str, ref: RunRef | None = None) -> str:
    """An error's text with server folders replaced by run names (the run's own, the library's)."""
    text = str(exc)
    names = {}
    if ref is not None:
        names[ref.path] = ref.label
        names[str(Path(ref.path).resolve())] = ref.label
    try:
        return library().redact(text, names)
    except LibraryError:
        for path, name in names.items():
            text = text.replace(path, name)
        return text
