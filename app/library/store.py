"""The runs library: checkpoints the user added, kept on disk under a k3lab home folder.

Layout of the home folder (``K3LAB_HOME``, ``k3lab app --home DIR``; default ``~/.k3lab``)::

    library.sqlite     the index: one row per run (name, source, fingerprint, config summary, size, added_at, state)
    runs/<id>/         the files of an uploaded run or a random-init preset, and ``.k3lab-entry.json``: its row
    paths/<id>.json    the row of a folder on the server (that folder is only referenced, never written)
    tmp/<pid>-<rand>/  staging while a run is being added (moved into runs/ when complete, else removed)
    trash/<id>/        a run being deleted (the library marked it; removed at the next start if a crash left it)
    library.rows-set-aside.jsonl   index rows that were not runs of this library (an id or location leading out
                       of its run folder): set aside on the read that found them, never followed

The index is a cache of the rows the run folders carry, never the authority on what to delete: a damaged,
missing or unreadable index is moved aside (``library.sqlite.damaged-<UTC time>``) and rebuilt from ``runs/``
and ``paths/`` when the library is opened, and a run folder without a row is indexed again (from its row file,
or described from its files), never deleted. Cleanup removes only what the library itself marked: staging
folders of dead processes, ``trash/``, folders whose row file says ``deleted`` and row files' temporaries
(``.<row file>.*.tmp``) a killed write left. ``recovered`` lists, in words, what opening the library repaired
(the library page shows it).

A run comes from one of three sources: ``upload`` (files or a zip, copied into ``runs/``), ``path`` (a folder
on the server, confined to the allowed roots by ``app.library.roots``; only indexed, never copied: it may be 100 GB)
or ``preset`` (a freshly initialised model of a named configuration, saved into ``runs/``). The index lives
in SQLite (``app.library.library_index``: one short connection per operation, so several app sessions and server
restarts share it); a run's row and its row file are ``app.library.entries``; the checks an added run passes before
it is kept, ``app.library.upload_checks``.

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
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

from analysis.output.format import format_bytes
from app.library.entries import ENTRY_FILE, Entry, read_row, row_of
from app.library.library_index import COLUMNS, connect, entry_of_row, insert_row, open_index, read_entries
from app.library.run_folders import LibraryError, content_fingerprint, describe_folder, human_count
from app.library.safe_zip import ZipRefused, extract_run_zip
from app.library.upload_checks import (
    accepted_name,
    check_tokenizer,
    check_weights_present,
    clean_name,
    write_limited,
)
from app.server.settings import DEFAULT_MAX_UPLOAD_MB, home_dir, max_upload_mb
from k3core.loading.folder import INDEX_NAME
from k3core.utils.files import OutputFolderError, atomic_write_text, check_output_folder

STALE_TMP_SECONDS = 60  # a row file's temporary lives for milliseconds; one this old was left by a killed write
MAX_PRESET_PARAMS = 1_000_000_000  # a fresh preset is written in fp32: 4 GB at this size


def _state(checking: bool) -> str:
    return f"checking:{os.getpid()}" if checking else "ready"


def check_library_home(home: str | Path) -> Path:
    """``home`` when the runs library may live there (``check_output_folder``: a new or empty folder, or a library
    home already: it holds library.sqlite or runs/); LibraryError naming it otherwise."""
    try:
        return check_output_folder(home, ("library.sqlite", "runs"), "runs library", option="--home")
    except OutputFolderError as exc:
        raise LibraryError(str(exc)) from None


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
        self.home = check_library_home(Path(home).expanduser()).resolve()
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
        recovered = open_index(self.home, self.db_path)
        if recovered is not None:
            self.recovered.append(recovered)
        self.cleanup()
        self._reconcile()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RunsLibrary:
        """The library at home_dir(env) with the upload limit max_upload_mb(env)."""
        return cls(home_dir(env), max_upload_bytes=max_upload_mb(env) * 1024**2)

    # ---------------------------------------------------------------------------- the index
    def entries(self) -> list[Entry]:
        """Every run in the library, oldest first (a bad row is set aside, and ``recovered`` says so)."""
        entries, set_aside = read_entries(self.home, self.db_path)
        self.recovered += set_aside
        return entries

    def get(self, run_id: str) -> Entry:
        entries, set_aside = read_entries(self.home, self.db_path, "WHERE id = ?", (run_id,))
        self.recovered += set_aside
        if set_aside:
            raise LibraryError(set_aside[0])
        if not entries:
            raise LibraryError("this run is no longer in the library (deleted in another window?)")
        return entries[0]

    # ---------------------------------------------------------------------------- row files
    def _row_file(self, entry_id: str, source: str) -> Path:
        return self.paths_dir / f"{entry_id}.json" if source == "path" else self.runs_dir / entry_id / ENTRY_FILE

    def _location(self, entry: Entry) -> str:
        return str(entry.path) if entry.source == "path" else f"runs/{entry.id}"

    def _save_row(self, entry: Entry, state: str | None = None) -> None:
        """Write the row file of an entry (atomically: a crash leaves the old row file or the new one)."""
        file = self._row_file(entry.id, entry.source)
        if file.parent.is_dir():
            atomic_write_text(file, json.dumps(row_of(entry, self._location(entry), state)))

    def _reconcile(self) -> None:
        """Make the index agree with the run folders, losing nothing: a folder without a row is indexed again
        (from its row file, else described from its files), a row file marked deleted finishes its delete, an
        upload whose check never finished is marked unchecked, and rows of an older k3lab get their row files."""
        rows = {e.id: e for e in self.entries()}
        stored = {e.path.name: e for e in rows.values() if e.stored}
        restored: list[str] = []
        for folder in sorted(self.runs_dir.iterdir()):
            if not folder.is_dir() or folder.is_symlink():
                continue
            row = read_row(folder / ENTRY_FILE)
            if row is not None and row.get("state") == "deleted":  # the library marked it: finish the delete
                with connect(self.db_path) as con:
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
            row = read_row(file)
            if row is not None and row["source"] == "path" and row["id"] not in rows and file.stem == row["id"]:
                with connect(self.db_path) as con:
                    run_id = insert_row(con, row)
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
        with connect(self.db_path) as con:
            insert_row(con, row)
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
        with connect(self.db_path) as con:
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
        check_weights_present(staging, name, self.max_upload_bytes)
        info = describe_folder(staging, label=name)
        info = dataclasses.replace(info, fingerprint=content_fingerprint(staging))  # stored: hash the bytes once
        check_tokenizer(staging, name, info)
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
            with connect(self.db_path) as con:
                insert_row(con, row)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        entry = self.get(run_id)
        if entry.name != name:
            self._save_row(entry)  # the name was taken: name-2
        return entry

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
                    write_limited(staging / fname, data, fname, self.max_upload_bytes)
            return self._commit(staging, label, "upload", _state(checking)), unknown

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
        with connect(self.db_path) as con:
            row = con.execute(
                f"SELECT {COLUMNS} FROM runs WHERE source = 'path' AND location = ?", (str(folder),)
            ).fetchone()
        if row is not None:
            return entry_of_row(self.home, row)
        label = clean_name(name, clean_name(folder.name, "checkpoint"))
        info = describe_folder(folder, label=label)
        added = datetime.now(timezone.utc).isoformat(timespec="seconds")
        row = {"id": secrets.token_hex(6), "name": label, "source": "path", "location": str(folder),
               "fingerprint": info.fingerprint, "summary": info.summary, "size_bytes": info.size_bytes,
               "added_at": added}  # fmt: skip
        with connect(self.db_path) as con:  # checks again inside the insert's transaction: one entry per folder
            run_id = insert_row(con, row)
        entry = self.get(run_id)
        self._save_row(entry)  # paths/<id>.json: the index can be rebuilt without it
        return entry

    def add_preset(self, preset: str, name: str = "", seed: int = 0) -> Entry:
        """A freshly initialised model of a named configuration (seeded), saved into the library."""
        import torch

        from k3core.modeling.model import K3ForCausalLM
        from k3core.modeling.presets import PRESETS

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
        with connect(self.db_path) as con:
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
        with connect(self.db_path) as con:
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
        """Remove what the library itself marked as disposable: staging folders of processes that are gone,
        trash/ and row files' temporaries older than STALE_TMP_SECONDS. Run folders are never removed here (a
        folder without a row is indexed again, see _reconcile)."""
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
        # row files' temporaries (atomic_write_text's ".<name>.*.tmp") a killed write left; not a live write's
        old = time.time() - STALE_TMP_SECONDS
        for leftover in [*self.runs_dir.glob(f"*/.{ENTRY_FILE}.*.tmp"), *self.paths_dir.glob(".*.json.*.tmp")]:
            if leftover.is_file() and not leftover.is_symlink() and leftover.stat().st_mtime < old:
                leftover.unlink(missing_ok=True)
                removed.append(f"{leftover.parent.name}/{leftover.name}")
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
