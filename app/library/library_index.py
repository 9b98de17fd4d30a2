"""The runs library's index: one SQLite file (``library.sqlite``, stdlib ``sqlite3``), one short connection per
operation (``connect``), so several app sessions and server restarts share it. A damaged or unreadable index is moved
aside (``library.sqlite.damaged-<UTC time>``) when the library opens (``open_index``) and rebuilt from the run
folders' row files by ``app.library.store``; the index is a cache of those rows, never the authority on what to
delete. Its rows are data, never paths to follow: every read checks a row's id and location (``read_entries``,
``app.library.entries.row_problem``); a bad row is set aside (out of the index, into ``SET_ASIDE``) with a message."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.library.entries import SOURCES, Entry, row_problem
from app.library.run_folders import LibraryError

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    source TEXT NOT NULL CHECK (source IN ('upload', 'path', 'preset')),
    location TEXT NOT NULL,          -- runs/<id> (relative to the home) or an absolute folder (source 'path')
    fingerprint TEXT NOT NULL,
    config_summary TEXT NOT NULL,    -- JSON
    size_bytes INTEGER NOT NULL,
    added_at TEXT NOT NULL,          -- ISO 8601, UTC
    state TEXT NOT NULL DEFAULT 'ready'  -- ready | checking:<pid> | unchecked
)
"""
COLUMNS = "id, name, source, location, fingerprint, config_summary, size_bytes, added_at, state"
SET_ASIDE = "library.rows-set-aside.jsonl"  # index rows that were not runs of this library, one JSON a line


class BadRow(LibraryError):
    """An index row whose id or location is not one of this library's runs (``row_problem``)."""


@contextmanager
def connect(db_path: Path) -> Iterator[sqlite3.Connection]:
    """One connection per operation, committed on success (a busy database is waited for, not failed).

    A damaged or unreadable index is a LibraryError (the pages say so and keep running)."""
    try:
        with closing(sqlite3.connect(db_path, timeout=30)) as con:
            with con:
                yield con
    except sqlite3.Error as exc:
        raise LibraryError(
            f"the runs library's index (library.sqlite) cannot be read or written ({exc}); restart the app: "
            f"at start a damaged index is moved aside and rebuilt from the run folders, and no run is deleted"
        ) from exc


def index_problem(db_path: Path) -> str | None:
    """Why the index file cannot serve as it is ('damaged: ...'), or None (a missing one is simply created).

    A busy or locked index is another process at work, not damage: that is raised, never moved aside."""
    if not db_path.exists() and not db_path.is_symlink():
        return None
    if db_path.is_symlink() or not db_path.is_file():
        return "not a regular file"
    try:
        with closing(sqlite3.connect(db_path, timeout=30)) as con:
            verdict = con.execute("PRAGMA quick_check").fetchone()
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "runs" in tables:
                con.execute("SELECT * FROM runs").fetchall()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise LibraryError(f"the runs library's index is busy in another process ({exc}); try again") from exc
        return f"unreadable ({exc})"
    except sqlite3.DatabaseError as exc:
        return f"damaged ({exc})"
    if verdict is None or verdict[0] != "ok":
        return f"damaged (integrity check: {verdict[0] if verdict else 'no answer'})"
    return None


def open_index(home: Path, db_path: Path) -> str | None:
    """Open the index, moving a damaged or unreadable one aside first (it is rebuilt by the library's _reconcile);
    returns, in words, what was repaired (None when nothing was)."""
    problem = index_problem(db_path)
    recovered = None
    if problem is not None:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        aside = home / f"library.sqlite.damaged-{stamp}-{secrets.token_hex(3)}"
        try:
            os.replace(db_path, aside)
            for suffix in ("-journal", "-wal", "-shm"):
                side = db_path.with_name(db_path.name + suffix)
                if side.exists():
                    os.replace(side, aside.with_name(aside.name + suffix))
        except OSError as exc:
            raise LibraryError(
                f"the runs library's index (library.sqlite) is {problem} and cannot be moved aside "
                f"({exc.strerror}); the runs' files are untouched. Make the library folder writable and restart "
                f"the app: the index is then rebuilt from the run folders"
            ) from exc
        recovered = (
            f"The runs library's index was {problem}. It was moved aside (as {aside.name}) and rebuilt from the "
            f"run folders; no run was deleted."
        )
    with connect(db_path) as con:
        con.execute(SCHEMA)
        if "state" not in {r[1] for r in con.execute("PRAGMA table_info(runs)")}:  # an index of an older k3lab
            con.execute("ALTER TABLE runs ADD COLUMN state TEXT NOT NULL DEFAULT 'ready'")
    return recovered


def read_entries(home: Path, db_path: Path, where: str = "", params: tuple = ()) -> tuple[list[Entry], list[str]]:
    """(the index rows ``where`` selects as Entries, oldest first; a message per bad row, each set aside)."""
    with connect(db_path) as con:
        rows = con.execute(f"SELECT {COLUMNS} FROM runs {where} ORDER BY added_at, name", params).fetchall()
    entries, set_aside = [], []
    for row in rows:
        try:
            entries.append(entry_of_row(home, row))
        except BadRow as exc:
            set_aside.append(set_row_aside(home, db_path, row, str(exc)))
    return entries, set_aside


def set_row_aside(home: Path, db_path: Path, row: tuple, why: str) -> str:
    """Move a bad row out of the index into ``home/SET_ASIDE`` (appended, as data); the message that says so."""
    record = dict(zip(COLUMNS.split(", "), (str(v) for v in row)))
    with open(home / SET_ASIDE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({**record, "why": why}) + "\n")
    with connect(db_path) as con:
        con.execute("DELETE FROM runs WHERE id = ? AND location = ?", (record["id"], record["location"]))
    return f"{why}; the row was set aside (into {SET_ASIDE}) and nothing it names was opened or changed"


def entry_of_row(home: Path, row: tuple) -> Entry:
    """An index row as an Entry; a damaged summary or size shows as unknown rather than breaking the list. BadRow
    when its id or location is not one of this library's runs (``row_problem``)."""
    run_id, name, source, location, fingerprint, summary, size, added, state = (str(v) for v in row)
    problem = row_problem(run_id, source, location)
    if problem is not None:
        raise BadRow(f"A row of the runs library's index ({name[:60]!r}) is not a run of this library: {problem}")
    path = Path(location) if source == "path" else home / location
    try:
        parsed = json.loads(summary)
    except (ValueError, RecursionError):
        parsed = {}
    if not isinstance(parsed, dict):
        parsed = {}
    size_bytes = int(size) if size.isdigit() and len(size) < 20 else 0
    source = source if source in SOURCES else "upload"
    return Entry(run_id, name, source, path, fingerprint, parsed, size_bytes, added, state)


def insert_row(con: sqlite3.Connection, row: dict[str, Any]) -> str:
    """Insert a row (the keys of a row file) under a free name (name, name-2, ...); returns the id of the row.

    One transaction from the checks to the insert: a folder on the server already indexed (by another
    session or process, even at the same moment) returns its existing row's id instead, and so does an id
    already indexed (a rebuild in another process read the run folder's row file first)."""
    con.execute("BEGIN IMMEDIATE")  # hold the write lock from reading the names to the insert
    if con.execute("SELECT 1 FROM runs WHERE id = ?", (row["id"],)).fetchone() is not None:
        return row["id"]
    if row["source"] == "path":
        found = con.execute("SELECT id FROM runs WHERE source = 'path' AND location = ?", (row["location"],)).fetchone()
        if found is not None:
            return found[0]
    taken = {r[0] for r in con.execute("SELECT name FROM runs")}
    final, n = row["name"], 2
    while final in taken:
        final, n = f"{row['name']}-{n}", n + 1
    con.execute(
        f"INSERT INTO runs ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (row["id"], final, row["source"], row["location"], row["fingerprint"], json.dumps(row["summary"]),
         int(row["size_bytes"]), row["added_at"], row.get("state", "ready")),
    )  # fmt: skip
    return row["id"]
