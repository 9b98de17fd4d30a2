"""A run in the library (``Entry``) and its row file: the JSON copy of its index row that each run folder carries
(``runs/<id>/.k3lab-entry.json``, or ``paths/<id>.json`` for a folder on the server), so that the index can be
rebuilt from the folders (``app.library.store``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3core.loading.folder import CONFIG_NAME
from k3core.utils.files import parse_json, read_bytes_limited

SOURCES = ("upload", "path", "preset")
ENTRY_FILE = ".k3lab-entry.json"  # a stored run's row, inside its folder (what rebuilding the index reads)
_MAX_ENTRY_BYTES = 1 << 20
_ID_RE = re.compile(r"[0-9a-f]{12}\Z")
#: states of a row: ready; checking:<pid> (an upload being checked by that process); unchecked (the process
#: died before its check finished: the page says so and offers the check again)
STATES = ("ready", "unchecked")


@dataclass(frozen=True)
class Entry:
    """One run in the library."""

    id: str
    name: str
    source: str  # "upload", "path" or "preset"
    path: Path  # the run folder
    fingerprint: str
    summary: dict[str, Any]
    size_bytes: int
    added_at: str
    state: str = "ready"

    @property
    def unchecked(self) -> bool:
        """True when the check of this upload did not finish (the server stopped during it)."""
        return self.state == "unchecked"

    @property
    def available(self) -> bool:
        """False when the folder has gone (a path entry on an unmounted disk, a folder removed by hand)."""
        return (self.path / CONFIG_NAME).is_file()

    @property
    def stored(self) -> bool:
        """True when the library owns the files (uploads and presets); path entries are only referenced."""
        return self.source != "path"


def row_of(entry: Entry, location: str, state: str | None = None) -> dict[str, Any]:
    """The row file of an entry: its index row, with the folder's location (``runs/<id>`` or the absolute path of a
    folder on the server) and the state it is saved in (default: its own)."""
    return {
        "format": "k3lab-library-entry/1",
        "id": entry.id,
        "name": entry.name,
        "source": entry.source,
        "location": location,
        "fingerprint": entry.fingerprint,
        "summary": entry.summary,
        "size_bytes": entry.size_bytes,
        "added_at": entry.added_at,
        "state": state or entry.state,
    }


def row_problem(run_id: str, source: str, location: str) -> str | None:
    """Why a row (of the index or a row file) is not one of this library's runs, or None. Rows are data, never
    paths to follow: an id is one run id (12 hex digits, one path component); a stored run's location is exactly
    ``runs/<id>`` (inside the home); a folder on the server is an absolute, normalised path (opened only where the
    allowed roots confine it, ``app.library.roots``)."""
    if not _ID_RE.match(run_id):
        return f"its id {run_id[:40]!r} is not a run id"
    if source == "path":
        if not location.startswith("/") or os.path.normpath(location) != location or "\0" in location:
            return f"its folder {location[:80]!r} is not an absolute, normalised path"
    elif location != f"runs/{run_id}":
        return f"its location {location[:80]!r} is not its own folder runs/{run_id}"
    return None


def read_row(file: Path) -> dict[str, Any] | None:
    """A row file's row, or None when it is missing or not one (the folder is then described instead)."""
    try:
        row = parse_json(read_bytes_limited(file, _MAX_ENTRY_BYTES), file.name)
    except (OSError, ValueError):
        return None
    keys = ("id", "name", "source", "location", "fingerprint", "summary", "size_bytes", "added_at")
    if not isinstance(row, dict) or row.get("format") != "k3lab-library-entry/1" or any(k not in row for k in keys):
        return None
    if row["source"] not in SOURCES or not isinstance(row["summary"], dict) or not _ID_RE.match(str(row["id"])):
        return None
    if not isinstance(row["size_bytes"], int) or not all(isinstance(row[k], str) for k in keys if k not in (
            "summary", "size_bytes")):  # fmt: skip
        return None
    if row["source"] == "path" and row_problem(row["id"], "path", row["location"]) is not None:
        return None  # a stored run's location is its folder's (the caller sets it); a path row's must be one
    return row
