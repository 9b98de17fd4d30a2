"""The runs library: checkpoints the user added, kept on disk under a k3lab home folder.

Layout of the home folder (``K3LAB_HOME``, ``k3lab app --home DIR``; default ``~/.k3lab``)::

    library.sqlite     the index: one row per run (name, source, fingerprint, config summary, size, added_at, state)
    runs/<id>/         the files of an uploaded run or a random-init preset, and ``.k3lab-entry.json``: its row
    paths/<id>.json    the row of a folder on the server (that folder is only referenced, never written)
    tmp/<pid>-<rand>/  staging while a run is being added (moved into runs/ when complete, else removed)
    trash/<id>/        a run being deleted (the library marked it; removed at the next start if a crash left it)

The index is a cache of the rows the run folders carry, never the authority on what to delete: a damaged,
missing or unreadable index is moved aside (``library.sqlite.damaged-<UTC time>``) and rebuilt from ``runs/``
and ``paths/`` when the library is opened, and a run folder without a row is indexed again (from its row file,
or described from its files), never deleted. Cleanup removes only what the library itself marked: staging
folders of dead processes, ``trash/`` and folders whose row file says ``deleted``. ``recovered`` lists, in
words, what opening the library repaired (the library page shows it).

A run comes from one of three sources: ``upload`` (files or a zip, copied into ``runs/``), ``path`` (a folder
on the server, confined to the allowed roots by ``app.library.roots``; only indexed, never copied: it may be 100 GB)
or ``preset`` (a freshly initialised model of a named configuration, saved into ``runs/``). The index lives
in SQLite (stdlib ``sqlite3``), one short connection per operation, so several app sessions and server
restarts share it.

Every user-facing failure is a ``LibraryError`` whose message names runs and files, never the library's
own folders (``redact`` turns any such path that slips through into the run's name). No Streamlit here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

from analysis.output.format import format_bytes
from app.library.run_folders import FolderInfo, LibraryError, content_fingerprint, describe_folder, human_count
from app.library.safe_zip import ZipRefused, extract_run_zip
from app.server.settings import DEFAULT_MAX_UPLOAD_MB, home_dir, max_upload_mb
from k3core.checkpoints.folder import (
    CONFIG_NAME,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    PICKLE_NAMES,
    TOKENIZER_FILES,
    WEIGHTS_NAME,
)
from k3core.interp.trace_folder import CARD_NAME, is_trace_dir, read_trace_dir
from k3core.interp.trace_npz import TraceError
from k3core.utils.files import atomic_write_text, parse_json, read_bytes_limited

MAX_PRESET_PARAMS = 1_000_000_000  # a fresh preset is written in fp32: 4 GB at this size
SOURCES = ("upload", "path", "preset")
EXTRA_NAMES = ("metrics.json", "README.md", "generation_config.json", "special_tokens_map.json", *TOKENIZER_FILES)
SHARD_RE = re.compile(r"^model-\d+-of-\d+\.safetensors$")
TRACE_FILE_RE = re.compile(r"^trace-\d+\.npz$")  # a trace folder's traces (k3core.interp.trace_folder)
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")
_CHUNK = 1 << 20
ENTRY_FILE = ".k3lab-entry.json"  # a stored run's row, inside its folder (what rebuilding the index reads)
_MAX_ENTRY_BYTES = 1 << 20
_ID_RE = re.compile(r"^[0-9a-f]{12}$")
#: states of a row: ready; checking:<pid> (an upload being checked by that process); unchecked (the process
#: died before its check finished: the page says so and offers the check again)
STATES = ("ready", "unchecked")

_SCHEMA = """
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
_COLUMNS = "id, name, source, location, fingerprint, config_summary, size_bytes, added_at, state"


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


# ------------------------------------------------------------------------------------- entries
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


def _state(checking: bool) -> str:
    return f"checking:{os.getpid()}" if checking else "ready"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunsLibrary:
    """The runs library in one home folder. Safe to use from several threads and processes at once."""

    def __init__(
        self,
        home: str | Path,
        *,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_MB * 1024**2,
        max_preset_params: int = MAX_PRESET_PARAMS,
    ) -> None:
        self.home = Path(home).expanduser().resolve()
        self.runs_dir = self.home / "runs"
        self.paths_dir = self.home / "paths"
        self.tmp_dir = self.home / "tmp"
        self.trash_dir = self.home / "trash"
        self.db_path = self.home / "library.sqlite"
        self.max_upload_bytes = int(max_upload_bytes)
        self.max_preset_params = int(max_preset_params)
        self.recovered: list[str] = []  # what opening the library repaired, in words (shown on the library page)
        try:
            for folder in (self.runs_dir, self.paths_dir, self.tmp_dir, self.trash_dir):
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LibraryError(f"cannot open the runs library in {self.home} ({exc})") from exc
        self._open_index()
        self.cleanup()
        self._reconcile()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RunsLibrary:
        """The library at home_dir(env) with the upload limit max_upload_mb(env)."""
        return cls(home_dir(env), max_upload_bytes=max_upload_mb(env) * 1024**2)

    # ---------------------------------------------------------------------------- database
    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """One connection per operation, committed on success (a busy database is waited for, not failed).

        A damaged or unreadable index is a LibraryError (the pages say so and keep running)."""
        try:
            with closing(sqlite3.connect(self.db_path, timeout=30)) as con:
                with con:
                    yield con
        except sqlite3.Error as exc:
            raise LibraryError(
                f"the runs library's index (library.sqlite) cannot be read or written ({exc}); restart the app: "
                f"at start a damaged index is moved aside and rebuilt from the run folders, and no run is deleted"
            ) from exc

    def _index_problem(self) -> str | None:
        """Why the index file cannot serve as it is ('damaged: ...'), or None (a missing one is simply created).

        A busy or locked index is another process at work, not damage: that is raised, never moved aside."""
        if not self.db_path.exists() and not self.db_path.is_symlink():
            return None
        if self.db_path.is_symlink() or not self.db_path.is_file():
            return "not a regular file"
        try:
            with closing(sqlite3.connect(self.db_path, timeout=30)) as con:
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

    def _open_index(self) -> None:
        """Open the index, moving a damaged or unreadable one aside first (it is rebuilt by _reconcile)."""
        problem = self._index_problem()
        if problem is not None:
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
            aside = self.home / f"library.sqlite.damaged-{stamp}-{secrets.token_hex(3)}"
            try:
                os.replace(self.db_path, aside)
                for suffix in ("-journal", "-wal", "-shm"):
                    side = self.db_path.with_name(self.db_path.name + suffix)
                    if side.exists():
                        os.replace(side, aside.with_name(aside.name + suffix))
            except OSError as exc:
                raise LibraryError(
                    f"the runs library's index (library.sqlite) is {problem} and cannot be moved aside "
                    f"({exc.strerror}); the runs' files are untouched. Make the library folder writable and restart "
                    f"the app: the index is then rebuilt from the run folders"
                ) from exc
            self.recovered.append(
                f"The runs library's index was {problem}. It was moved aside (as {aside.name}) and rebuilt from the "
                f"run folders; no run was deleted."
            )
        with self._db() as con:
            con.execute(_SCHEMA)
            if "state" not in {r[1] for r in con.execute("PRAGMA table_info(runs)")}:  # an index of an older k3lab
                con.execute("ALTER TABLE runs ADD COLUMN state TEXT NOT NULL DEFAULT 'ready'")

    def _entry(self, row: tuple) -> Entry:
        """An index row as an Entry; a damaged summary or size shows as unknown rather than breaking the list."""
        run_id, name, source, location, fingerprint, summary, size, added, state = (str(v) for v in row)
        path = Path(location) if source == "path" else self.home / location
        try:
            parsed = json.loads(summary)
        except (ValueError, RecursionError):
            parsed = {}
        if not isinstance(parsed, dict):
            parsed = {}
        size_bytes = int(size) if size.isdigit() and len(size) < 20 else 0
        source = source if source in SOURCES else "upload"
        return Entry(run_id, name, source, path, fingerprint, parsed, size_bytes, added, state)

    def entries(self) -> list[Entry]:
        """Every run in the library, oldest first."""
        with self._db() as con:
            rows = con.execute(f"SELECT {_COLUMNS} FROM runs ORDER BY added_at, name").fetchall()
        return [self._entry(r) for r in rows]

    def get(self, run_id: str) -> Entry:
        with self._db() as con:
            row = con.execute(f"SELECT {_COLUMNS} FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise LibraryError("this run is no longer in the library (deleted in another window?)")
        return self._entry(row)

    def _insert(self, con: sqlite3.Connection, row: dict[str, Any]) -> str:
        """Insert a row (the keys of a row file) under a free name (name, name-2, ...); returns the id of the row.

        One transaction from the checks to the insert: a folder on the server already indexed (by another
        session or process, even at the same moment) returns its existing row's id instead, and so does an id
        already indexed (a rebuild in another process read the run folder's row file first)."""
        con.execute("BEGIN IMMEDIATE")  # hold the write lock from reading the names to the insert
        if con.execute("SELECT 1 FROM runs WHERE id = ?", (row["id"],)).fetchone() is not None:
            return row["id"]
        if row["source"] == "path":
            found = con.execute(
                "SELECT id FROM runs WHERE source = 'path' AND location = ?", (row["location"],)
            ).fetchone()
            if found is not None:
                return found[0]
        taken = {r[0] for r in con.execute("SELECT name FROM runs")}
        final, n = row["name"], 2
        while final in taken:
            final, n = f"{row['name']}-{n}", n + 1
        con.execute(
            f"INSERT INTO runs ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (row["id"], final, row["source"], row["location"], row["fingerprint"], json.dumps(row["summary"]),
             int(row["size_bytes"]), row["added_at"], row.get("state", "ready")),
        )  # fmt: skip
        return row["id"]

    # ---------------------------------------------------------------------------- row files
    def _row_file(self, entry_id: str, source: str) -> Path:
        return self.paths_dir / f"{entry_id}.json" if source == "path" else self.runs_dir / entry_id / ENTRY_FILE

    @staticmethod
    def _row_of(entry: Entry, location: str, state: str | None = None) -> dict[str, Any]:
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

    def _location(self, entry: Entry) -> str:
        return str(entry.path) if entry.source == "path" else f"runs/{entry.id}"

    def _save_row(self, entry: Entry, state: str | None = None) -> None:
        """Write the row file of an entry (atomically: a crash leaves the old row file or the new one)."""
        file = self._row_file(entry.id, entry.source)
        if file.parent.is_dir():
            atomic_write_text(file, json.dumps(self._row_of(entry, self._location(entry), state)))

    @staticmethod
    def _read_row(file: Path) -> dict[str, Any] | None:
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
        return row

    def _reconcile(self) -> None:
        """Make the index agree with the run folders, losing nothing: a folder without a row is indexed again
        (from its row file, else described from its files), a row file marked deleted finishes its delete, an
        upload whose check never finished is marked unchecked, and rows of an older k3lab get their row files."""
        with self._db() as con:
            rows = {r[0]: self._entry(r) for r in con.execute(f"SELECT {_COLUMNS} FROM runs")}
        stored = {e.path.name: e for e in rows.values() if e.stored}
        restored: list[str] = []
        for folder in sorted(self.runs_dir.iterdir()):
            if not folder.is_dir() or folder.is_symlink():
                continue
            row = self._read_row(folder / ENTRY_FILE)
            if row is not None and row.get("state") == "deleted":  # the library marked it: finish the delete
                with self._db() as con:
                    con.execute("DELETE FROM runs WHERE id = ?", (folder.name,))
                self._remove_stored(folder)
                continue
            entry = stored.get(folder.name)
            if entry is None:
                name = self._restore_stored(folder, row)
                if name is not None:
                    restored.append(name)
            elif row is None:
                self._save_row(entry)  # indexed before row files existed
            if (entry := entry or self._get_or_none(folder.name)) is not None:
                self._settle_check(entry)
        for file in sorted(self.paths_dir.glob("*.json")):
            row = self._read_row(file)
            if row is not None and row["source"] == "path" and row["id"] not in rows and file.stem == row["id"]:
                with self._db() as con:
                    run_id = self._insert(con, row)
                restored.append(self.get(run_id).name)
        for entry in rows.values():
            if entry.source == "path" and not self._row_file(entry.id, "path").exists():
                self._save_row(entry)
        if restored:
            self.recovered.append(
                f"{len(restored)} run(s) missing from the index were found in their folders and listed again: "
                + ", ".join(restored[:20])
                + (" ..." if len(restored) > 20 else "")
            )

    def _get_or_none(self, run_id: str) -> Entry | None:
        try:
            return self.get(run_id)
        except LibraryError:
            return None

    def _restore_stored(self, folder: Path, row: dict[str, Any] | None) -> str | None:
        """Index a run folder that has no row; returns its name, or None when it cannot be (it is left alone)."""
        if row is None or row["id"] != folder.name or row["source"] == "path":
            try:
                info = describe_folder(folder, label=folder.name)
            except Exception as exc:  # noqa: BLE001 - a folder that cannot be described is kept, and said so
                self.recovered.append(
                    f"A run folder without an index row ({folder.name}) could not be read ({str(exc)[:200]}); its "
                    f"files are kept where they are."
                )
                return None
            added = datetime.fromtimestamp(folder.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
            row = {"id": folder.name, "name": f"recovered-{folder.name}", "source": "upload",
                   "fingerprint": info.fingerprint, "summary": info.summary, "size_bytes": info.size_bytes,
                   "added_at": added, "state": "unchecked"}  # fmt: skip
        row = {**row, "location": f"runs/{folder.name}"}
        with self._db() as con:
            self._insert(con, row)
        entry = self.get(folder.name)
        self._save_row(entry)
        return entry.name

    def _settle_check(self, entry: Entry) -> None:
        """An upload left 'checking' by a process that is gone is marked unchecked (index and row file)."""
        if not entry.state.startswith("checking:"):
            return
        pid = entry.state.partition(":")[2]
        if pid.isdigit() and _pid_alive(int(pid)):
            return
        self._set_state(entry.id, "unchecked")

    def _set_state(self, run_id: str, state: str) -> Entry:
        with self._db() as con:
            con.execute("UPDATE runs SET state = ? WHERE id = ?", (state, run_id))
        entry = self.get(run_id)
        self._save_row(entry)
        return entry

    def mark_checked(self, run_id: str) -> Entry:
        """The upload's check (loading every tensor) passed: the run is ready."""
        return self._set_state(run_id, "ready")

    def mark_checking(self, run_id: str) -> Entry:
        """This process is checking the run now (a crash during the check leaves it marked unchecked)."""
        return self._set_state(run_id, f"checking:{os.getpid()}")

    # ---------------------------------------------------------------------------- adding
    @contextmanager
    def _staging(self) -> Iterator[Path]:
        """A fresh folder under tmp/, removed unless the caller moved it away."""
        folder = self.tmp_dir / f"{os.getpid()}-{secrets.token_hex(6)}"
        try:
            folder.mkdir(parents=True)  # tmp/ may have been removed while the app runs
        except OSError as exc:
            raise LibraryError(f"cannot write to the runs library ({exc.strerror})") from exc
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _commit(self, staging: Path, name: str, source: str, state: str = "ready") -> Entry:
        """Check a staged run folder, write its row file, move it into runs/<id> and index it."""
        self._check_weights_present(staging, name)
        info = describe_folder(staging, label=name)
        info = dataclasses.replace(info, fingerprint=content_fingerprint(staging))  # stored: hash the bytes once
        self._check_tokenizer(staging, name, info)
        run_id = secrets.token_hex(6)
        target = self.runs_dir / run_id
        added = datetime.now(timezone.utc).isoformat(timespec="seconds")
        row = {"format": "k3lab-library-entry/1", "id": run_id, "name": name, "source": source,
               "location": f"runs/{run_id}", "fingerprint": info.fingerprint, "summary": info.summary,
               "size_bytes": info.size_bytes, "added_at": added, "state": state}  # fmt: skip
        try:
            atomic_write_text(staging / ENTRY_FILE, json.dumps(row))  # the folder carries its row from the start
            self.runs_dir.mkdir(parents=True, exist_ok=True)
            os.replace(staging, target)
        except OSError as exc:
            raise LibraryError(f"{name}: cannot write to the runs library ({exc.strerror})") from exc
        try:
            with self._db() as con:
                self._insert(con, row)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        entry = self.get(run_id)
        if entry.name != name:
            self._save_row(entry)  # the name was taken: name-2
        return entry

    @staticmethod
    def _check_tokenizer(folder: Path, name: str, info: FolderInfo) -> None:
        """Tokenizer files that come with an upload must load and fit the model (checked before it is kept)."""
        from k3core.tokenizer import TOKENIZER_FILES, TokenizerError, load_tokenizer

        if not any((folder / f).is_file() for f in TOKENIZER_FILES) or info.files is None or info.files.config is None:
            return
        try:
            load_tokenizer(folder, info.files.config.vocab_size)
        except TokenizerError as exc:
            raise LibraryError(f"{name}: {exc}") from exc

    def _limit_hint(self) -> str:
        mb = self.max_upload_bytes // 1024**2
        return (
            f"A file over the upload limit ({mb:,} MB per file) is refused by the browser before it reaches the app: "
            f"start the app with `k3lab app --max-upload-mb N`, or open the folder by path."
        )

    def _check_weights_present(self, folder: Path, name: str) -> None:
        if is_trace_dir(folder):  # a trace folder: traces and a run card, no weights (k3core.interp.trace_folder)
            try:
                read_trace_dir(folder).check_all()  # every trace read within the limits, checked against the card
            except TraceError as exc:
                raise LibraryError(f"{name}: {exc}") from exc
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
                    f"{name}: shard file(s) listed in the index are missing: {missing[:8]}. " + self._limit_hint()
                )
        elif not any(n in (WEIGHTS_NAME, *PICKLE_NAMES) or SHARD_RE.match(n) for n in names):
            raise LibraryError(
                f"{name}: no weights among the files ({', '.join(names)}); a checkpoint needs model.safetensors "
                f"(or shards with {INDEX_NAME}). " + self._limit_hint()
            )

    def add_files(
        self,
        files: Iterable[tuple[str, bytes | BinaryIO]],
        name: str = "",
        skip_unknown: bool = False,
        checking: bool = False,
    ) -> tuple[Entry, list[str]]:
        """Copy uploaded checkpoint files into the library. Returns (entry, skipped file names).

        ``checking``: the caller checks the run further (loads every tensor) and then calls ``mark_checked``
        or ``delete``; until then the row says so, and a crash during the check leaves the run marked unchecked.

        File names are reduced to their base name (a folder upload sends 'myrun/config.json'); unknown
        names are refused, or skipped with ``skip_unknown`` (a whole-folder upload with extra files). A
        single .zip goes through add_zip."""
        files = list(files)
        if not files:
            raise LibraryError("No files uploaded: choose config.json and model.safetensors (or a zip of the folder).")
        zips = [f for f in files if f[0].lower().endswith(".zip")]
        if zips:
            if len(files) > 1:
                raise LibraryError("Upload either one zip of the run folder or the files themselves, not both.")
            return self.add_zip(files[0][1], name or Path(files[0][0]).stem, checking=checking)
        paths = [Path(n.replace("\\", "/")) for n, _ in files]
        names = [p.name for p in paths]
        tops = {p.parts[0] for p in paths if len(p.parts) > 1}
        folder = tops.pop() if len(tops) == 1 and all(len(p.parts) > 1 for p in paths) else ""
        unknown = sorted({n for n in names if not accepted_name(n)})
        if unknown and not skip_unknown:
            raise LibraryError(
                f"unexpected file(s) {unknown}: a checkpoint is config.json + model.safetensors (or shards "
                f"model-00001-of-0000N.safetensors + {INDEX_NAME}), optionally metrics.json, README.md and "
                f"tokenizer files; or upload a zip of the folder"
            )
        dupes = sorted({n for n in names if names.count(n) > 1 and accepted_name(n)})
        if dupes:
            raise LibraryError(f"file(s) uploaded twice: {dupes}")
        label = clean_name(name, clean_name(folder, "uploaded"))  # a folder upload is named after its folder
        with self._staging() as staging:
            for fname, data in zip(names, (d for _, d in files)):
                if accepted_name(fname):
                    self._write(staging / fname, data, fname)
            return self._commit(staging, label, "upload", _state(checking)), unknown

    def _write(self, target: Path, data: bytes | BinaryIO, shown: str) -> None:
        """Copy bytes or a file object to target in blocks, refusing files over the upload limit."""
        written = 0
        with open(target, "xb") as out:
            if isinstance(data, (bytes, bytearray, memoryview)):
                written = len(data)
                if written <= self.max_upload_bytes:
                    out.write(data)
            else:
                if hasattr(data, "seek"):
                    data.seek(0)
                while (block := data.read(_CHUNK)) and written <= self.max_upload_bytes:
                    written += len(block)
                    out.write(block)
        if written > self.max_upload_bytes:
            raise LibraryError(
                f"{shown} is over the upload limit of {self.max_upload_bytes // 1024**2:,} MB per file; start the "
                f"app with `k3lab app --max-upload-mb N`, or open the folder by path."
            )

    def add_zip(
        self, source: str | Path | BinaryIO | bytes, name: str = "", checking: bool = False
    ) -> tuple[Entry, list[str]]:
        """Safely unpack a zip of one run folder into the library. Returns (entry, skipped entries)."""
        import io

        if isinstance(source, (bytes, bytearray)):
            source = io.BytesIO(source)
        label = clean_name(name, "uploaded")
        with self._staging() as staging:
            try:
                result = extract_run_zip(
                    source, staging, max_total_bytes=2 * self.max_upload_bytes, accept=accepted_name
                )
            except ZipRefused as exc:
                raise LibraryError(f"{label}: {exc}") from exc
            return self._commit(staging, label, "upload", _state(checking)), result.skipped

    def add_path(self, folder: str | Path, name: str = "") -> Entry:
        """Index a checkpoint folder on the server (already confined by app.library.roots); its files stay where they
        are.

        The same folder added twice is the same entry."""
        folder = Path(folder).resolve()
        with self._db() as con:
            row = con.execute(
                f"SELECT {_COLUMNS} FROM runs WHERE source = 'path' AND location = ?", (str(folder),)
            ).fetchone()
        if row is not None:
            return self._entry(row)
        label = clean_name(name, clean_name(folder.name, "checkpoint"))
        info = describe_folder(folder, label=label)
        added = datetime.now(timezone.utc).isoformat(timespec="seconds")
        row = {"id": secrets.token_hex(6), "name": label, "source": "path", "location": str(folder),
               "fingerprint": info.fingerprint, "summary": info.summary, "size_bytes": info.size_bytes,
               "added_at": added}  # fmt: skip
        with self._db() as con:  # checks again inside the insert's transaction: one entry per folder
            run_id = self._insert(con, row)
        entry = self.get(run_id)
        self._save_row(entry)  # paths/<id>.json: the index can be rebuilt without it
        return entry

    def add_preset(self, preset: str, name: str = "", seed: int = 0) -> Entry:
        """A freshly initialised model of a named configuration (seeded), saved into the library."""
        import torch

        from k3core.model import K3ForCausalLM
        from k3core.presets import PRESETS

        if preset not in PRESETS:
            raise LibraryError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        n = K3ForCausalLM.from_config(preset, device="meta").num_parameters()
        if n > self.max_preset_params:
            raise LibraryError(
                f"{preset} has {human_count(n)} parameters ({format_bytes(4 * n)} in float32): too large to create "
                f"here (limit {human_count(self.max_preset_params)}); use `k3lab inspect` for its shapes, or open a "
                f"saved checkpoint by path"
            )
        label = clean_name(name, f"{preset}-random")
        with self._staging() as staging:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = K3ForCausalLM.from_config(preset)
            model.save_pretrained(staging)
            (staging / "README.md").write_text(
                f"# {label}\n\nA fresh random initialisation of the `{preset}` preset (seed {seed}); untrained.\n"
            )
            return self._commit(staging, label, "preset")

    # ---------------------------------------------------------------------------- changing
    def rename(self, run_id: str, new_name: str) -> Entry:
        """Give a run a new name (letters, digits, '.', '_', '-'); LibraryError when the name is taken."""
        entry = self.get(run_id)
        name = clean_name(new_name, "")
        if not name:
            raise LibraryError("A run name needs at least one letter or digit.")
        with self._db() as con:
            try:
                con.execute("UPDATE runs SET name = ? WHERE id = ?", (name, run_id))
            except sqlite3.IntegrityError as exc:
                raise LibraryError(f"a run named {name!r} is already in the library; choose another name") from exc
        if entry.source != "path":
            readme = entry.path / "README.md"
            if readme.is_file() and readme.read_text(errors="replace").startswith(f"# {entry.name}\n"):
                readme.write_text(readme.read_text(errors="replace").replace(f"# {entry.name}\n", f"# {name}\n", 1))
        renamed = self.get(run_id)
        self._save_row(renamed)
        return renamed

    def delete(self, run_id: str) -> Entry:
        """Remove a run from the library; an upload's or preset's files are deleted, a path's folder is left alone.

        The row file is marked deleted first, so a crash at any step ends, at the next start, with the run
        either still listed whole or gone whole (never a folder of half its files listed or left behind)."""
        entry = self.get(run_id)
        if entry.stored and entry.path.is_dir():
            self._save_row(entry, state="deleted")
        with self._db() as con:
            con.execute("DELETE FROM runs WHERE id = ?", (run_id,))
        if entry.stored:
            self._remove_stored(entry.path)
        else:
            self._row_file(entry.id, "path").unlink(missing_ok=True)
        return entry

    def _remove_stored(self, path: Path) -> None:
        """Move a real folder directly under runs/ into trash/ (one rename), then remove it; never follow a link
        out of the library. A crash during the removal leaves it in trash/, which the next start empties."""
        if path.parent != self.runs_dir or not path.is_dir() or path.is_symlink():
            return
        trashed = self.trash_dir / f"{path.name}-{secrets.token_hex(4)}"
        try:
            self.trash_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, trashed)
        except OSError:
            trashed = path  # the rename failed (a read-only disk): remove it in place
        shutil.rmtree(trashed, ignore_errors=True)

    def cleanup(self) -> list[str]:
        """Remove what the library itself marked as disposable: staging folders of processes that are gone and
        trash/. Run folders are never removed here (a folder without a row is indexed again, see _reconcile)."""
        removed = []
        for leftover in self.tmp_dir.iterdir():
            pid = leftover.name.split("-", 1)[0]
            if pid.isdigit() and _pid_alive(int(pid)):
                continue  # a run being added right now, by this or another process
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
            removed.append(f"tmp/{leftover.name}")
        for leftover in self.trash_dir.iterdir():
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
            removed.append(f"trash/{leftover.name}")
        return removed

    # ---------------------------------------------------------------------------- messages
    def redact(self, text: str, names: Mapping[str | Path, str] | None = None) -> str:
        """A message with the library's folders replaced by run names (and any other home path by 'the library')."""
        stored = [e for e in self.entries() if e.stored]
        mapping = {str(e.path): e.name for e in stored}
        mapping.update({e.path.name: e.name for e in stored})  # the loader names a folder by its id
        mapping.update({str(Path(k)): v for k, v in (names or {}).items()})
        for path in sorted(mapping, key=len, reverse=True):
            text = text.replace(path, mapping[path])
        return re.sub(re.escape(str(self.home)) + r"[^\s'\":,;)]*", "(runs library)", text)
