"""app.library.store recovery: a damaged, missing or unreadable index never costs a run (it is rebuilt from the run
folders), deletes and upload checks interrupted by kill -9 end whole, and only what the library marked is removed."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import tracemalloc
from contextlib import closing

import pytest

from app.library.entries import ENTRY_FILE
from app.library.run_folders import LibraryError
from app.library.store import RunsLibrary
from tests.conftest import nano_model

MAX_SECONDS, MAX_EXTRA_BYTES = 2.0, 200 * 1024**2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "nano"
    nano_model(seed=4).save_pretrained(folder)
    return folder


def _files(folder):
    return [(p.name, p.read_bytes()) for p in sorted(folder.iterdir())]


def _listing(lib):
    return sorted((e.id, e.name, e.source, e.fingerprint, e.size_bytes, e.added_at) for e in lib.entries())


def _snapshot(lib):
    """Every stored file's bytes by relative path (what a user would lose)."""
    return {str(p.relative_to(lib.runs_dir)): p.read_bytes() for p in sorted(lib.runs_dir.rglob("*")) if p.is_file()}


@pytest.fixture
def library(tmp_path, ckpt):
    """A library with two uploads and a folder on the server, all older than any 'young folder' grace period."""
    lib = RunsLibrary(tmp_path / "home")
    lib.add_files(_files(ckpt), "first")
    lib.add_files(_files(ckpt), "second")
    lib.add_path(ckpt, "on-server")
    old = time.time() - 3600
    for folder in lib.runs_dir.iterdir():
        os.utime(folder, (old, old))
    return lib


def _reopen_measured(home):
    """RunsLibrary(home) with its wall time and peak traced memory."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        lib = RunsLibrary(home)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < MAX_SECONDS and peak < MAX_EXTRA_BYTES, (seconds, peak)
    return lib


def _zero_bytes(db):
    db.write_bytes(b"")


def _missing(db):
    db.unlink()


def _garbage(db):
    db.write_bytes(b"this is not a database, it was overwritten" * 100)


def _a_folder(db):
    db.unlink()
    db.mkdir()


def _truncated(db):
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2 + 7])


@pytest.mark.parametrize("damage", [_zero_bytes, _missing, _garbage, _a_folder, _truncated])
def test_a_damaged_index_is_rebuilt_and_every_run_stays_listed(library, damage):
    before, files = _listing(library), _snapshot(library)
    damage(library.db_path)
    again = _reopen_measured(library.home)
    assert _listing(again) == before
    assert _snapshot(again) == files  # not one byte of a run lost
    assert all(e.available for e in again.entries())
    if damage in (_garbage, _a_folder):  # kept for a look, never deleted
        aside = [p.name for p in again.home.iterdir() if p.name.startswith("library.sqlite.damaged-")]
        assert len(aside) == 1 and any("moved aside" in m and aside[0] in m for m in again.recovered)
    assert _listing(RunsLibrary(library.home)) == before  # and a second start agrees


def test_the_runtime_message_for_a_broken_index_names_a_step_that_loses_nothing(library):
    before = _listing(library)
    _garbage(library.db_path)
    with pytest.raises(LibraryError) as err:
        library.entries()
    message = str(err.value)
    assert "restart the app" in message and "no run is deleted" in message and "move it away" not in message
    assert _listing(RunsLibrary(library.home)) == before  # following the message keeps every run


def test_a_run_folder_without_row_or_row_file_is_listed_again_not_deleted(library):
    first = next(e for e in library.entries() if e.name == "first")
    (first.path / ENTRY_FILE).unlink()  # a folder written by an older k3lab
    with closing(sqlite3.connect(library.db_path)) as con, con:
        con.execute("DELETE FROM runs WHERE id = ?", (first.id,))
    again = RunsLibrary(library.home)
    back = again.get(first.id)
    assert (back.name, back.fingerprint != "", back.unchecked) == (f"recovered-{first.id}", True, True)
    assert (first.path / "model.safetensors").is_file() and any("listed again" in m for m in again.recovered)


def test_rows_of_an_older_index_get_row_files(library):
    for entry in library.entries():
        library._row_file(entry.id, entry.source).unlink()
    with closing(sqlite3.connect(library.db_path)) as con, con:
        con.execute("UPDATE runs SET state = 'ready'")
    before = _listing(library)
    RunsLibrary(library.home)  # writes the row files of rows that have none
    library.db_path.unlink()
    assert _listing(RunsLibrary(library.home)) == before


def test_renames_survive_a_rebuild(library):
    first = next(e for e in library.entries() if e.name == "first")
    library.rename(first.id, "renamed")
    library.db_path.write_bytes(b"")
    assert RunsLibrary(library.home).get(first.id).name == "renamed"


def _interrupted_delete(library, entry, stage):
    """The state kill -9 leaves at each step of delete: marked, row gone, moved to trash."""
    library._save_row(entry, state="deleted")
    if stage == "marked":
        return
    with closing(sqlite3.connect(library.db_path)) as con, con:
        con.execute("DELETE FROM runs WHERE id = ?", (entry.id,))
    (entry.path / "model.safetensors").unlink()  # rmtree got part of the way
    if stage == "moved":
        os.replace(entry.path, library.trash_dir / f"{entry.id}-1234")


@pytest.mark.parametrize("stage", ["marked", "row-gone", "moved"])
def test_a_delete_killed_half_way_ends_whole_at_the_next_start(library, stage):
    second = next(e for e in library.entries() if e.name == "second")
    _interrupted_delete(library, second, stage)
    again = RunsLibrary(library.home)
    assert second.id not in {e.id for e in again.entries()}
    assert not second.path.exists() and list(again.trash_dir.iterdir()) == []
    assert sorted(e.name for e in again.entries()) == ["first", "on-server"]


def test_a_delete_is_complete_and_leaves_no_folder(library):
    first = next(e for e in library.entries() if e.name == "first")
    library.delete(first.id)
    assert not first.path.exists() and list(library.trash_dir.iterdir()) == []
    on_server = next(e for e in library.entries() if e.name == "on-server")
    library.delete(on_server.id)
    library.db_path.unlink()
    assert [e.name for e in RunsLibrary(library.home).entries()] == ["second"]  # deleted rows stay deleted


def test_an_upload_killed_during_its_check_is_marked_unchecked(tmp_path, ckpt):
    home = tmp_path / "home"
    script = (
        "import os, sys; from pathlib import Path; from app.library.store import RunsLibrary; "
        f"lib = RunsLibrary({str(home)!r}); "
        f"files = [(p.name, p.read_bytes()) for p in sorted(Path({str(ckpt)!r}).iterdir())]; "
        "entry, _ = lib.add_files(files, 'halfway', checking=True); print(entry.id, flush=True); "
        "os.kill(os.getpid(), 9)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    run_id = done.stdout.split()[0]
    lib = RunsLibrary(home)
    entry = lib.get(run_id)
    assert entry.unchecked and entry.available
    assert lib.mark_checked(run_id).state == "ready" and not RunsLibrary(home).get(run_id).unchecked
    assert json.loads((entry.path / ENTRY_FILE).read_text())["state"] == "ready"


def test_a_check_in_progress_in_a_live_process_is_left_alone(tmp_path, ckpt):
    lib = RunsLibrary(tmp_path / "home")
    entry, _ = lib.add_files(_files(ckpt), "checking", checking=True)
    assert RunsLibrary(lib.home).get(entry.id).state == f"checking:{os.getpid()}"  # this process is alive
