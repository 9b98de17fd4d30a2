"""Library rows are data, not paths (app.library.library_index.read_entries, app.library.entries.row_problem): a row
whose id or location leads out of its run folder is set aside with a message and never followed; a row file's
temporary left by a killed write is cleaned at start; upload refusals name the upload, never the library's folders."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest

from app.library.entries import ENTRY_FILE
from app.library.library_index import SET_ASIDE
from app.library.run_folders import LibraryError
from app.library.store import RunsLibrary

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "sample_checkpoints" / "plain-residual"


def _insert(home: Path, run_id: str, name: str, source: str, location: str) -> None:
    with closing(sqlite3.connect(home / "library.sqlite")) as con, con:
        con.execute(
            "INSERT INTO runs (id, name, source, location, fingerprint, config_summary, size_bytes, added_at, state) "
            "VALUES (?, ?, ?, ?, 'f', '{}', 1, '2026-01-01T00:00:00+00:00', 'ready')",
            (run_id, name, source, location),
        )


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "run_id, source, location, why",
    [
        ("../../victim2", "upload", "../victim2", "is not a run id"),
        ("0123456789ab", "upload", "../victim2", "is not its own folder runs/0123456789ab"),
        ("0123456789ab", "preset", "runs/../../victim2", "is not its own folder"),
        ("0123456789ab\n", "upload", "runs/0123456789ab\n", "is not a run id"),
        ("0123456789ab", "path", "../victim2", "is not an absolute, normalised path"),
        ("0123456789ab", "path", "/tmp/../victim2", "is not an absolute, normalised path"),
    ],
)
def test_a_row_that_leads_out_of_its_folder_is_set_aside_never_followed(tmp_path, run_id, source, location, why):
    home = tmp_path / "home"
    lib = RunsLibrary(home)
    good, _ = lib.add_files([(p.name, p.read_bytes()) for p in SAMPLE.iterdir()], name="good")
    victim = tmp_path / "victim2"
    victim.mkdir()
    (victim / "README.md").write_text("# victim\n\nthe user's own notes\n")
    (victim / "config.json").write_text("{}")
    _insert(home, run_id, "victim", source, location)
    before = _tree(victim)
    start = time.perf_counter()
    for act in (lambda: lib.rename(run_id, "renamed"), lambda: lib.delete(run_id), lambda: lib.get(run_id)):
        with pytest.raises(LibraryError, match="this run is no longer in the library|is not a run of this library"):
            act()
    assert [e.name for e in lib.entries()] == ["good"]
    assert any(why in note and "'victim'" in note and "set aside" in note for note in lib.recovered), lib.recovered
    assert time.perf_counter() - start < 2.0
    assert _tree(victim) == before  # nothing written, renamed or deleted there
    aside = [json.loads(line) for line in (home / SET_ASIDE).read_text().splitlines()]
    assert [(r["id"], r["location"]) for r in aside] == [(run_id, location)]
    reopened = RunsLibrary(home)  # the row stays out; the good run is untouched
    assert [e.name for e in reopened.entries()] == ["good"] and reopened.get(good.id).available
    assert _tree(victim) == before


def test_a_path_row_file_with_a_relative_folder_is_not_restored(tmp_path):
    home = tmp_path / "home"
    RunsLibrary(home)
    row = {"format": "k3lab-library-entry/1", "id": "0123456789ab", "name": "x", "source": "path",
           "location": "../victim2", "fingerprint": "f", "summary": {}, "size_bytes": 1,
           "added_at": "2026-01-01T00:00:00+00:00", "state": "ready"}  # fmt: skip
    (home / "paths" / "0123456789ab.json").write_text(json.dumps(row))
    assert RunsLibrary(home).entries() == []


def test_a_killed_row_write_leaves_no_temporary_behind(tmp_path):
    home = tmp_path / "home"
    lib = RunsLibrary(home)
    entry, _ = lib.add_files([(p.name, p.read_bytes()) for p in SAMPLE.iterdir()], name="run")
    path_entry = lib.add_path(SAMPLE)
    stale = entry.path / f".{ENTRY_FILE}.k9x2_abc.tmp"  # what atomic_write_text leaves when killed mid-write
    stale_path_row = home / "paths" / f".{path_entry.id}.json.k9x2_abc.tmp"
    live = entry.path / f".{ENTRY_FILE}.live_one.tmp"  # a write happening now, in another process
    users = entry.path / "notes.tmp"
    for file in (stale, stale_path_row, live, users):
        file.write_text('{"half": ')
    an_hour_ago = time.time() - 3600
    for file in (stale, stale_path_row, users):
        os.utime(file, (an_hour_ago, an_hour_ago))
    reopened = RunsLibrary(home)
    assert not stale.exists() and not stale_path_row.exists()
    assert live.exists() and users.exists()
    assert reopened.get(entry.id).name == "run" and (entry.path / ENTRY_FILE).is_file()


def test_an_upload_refusal_names_the_upload_not_the_staging_folder(tmp_path):
    from analysis.runs.loading import load_run
    from analysis.runs.trace_writer import read_inputs, write_run_traces

    run = load_run(SAMPLE)
    traced = tmp_path / "traced"
    write_run_traces(run, read_inputs(run, None, "shakespeare", 16), traced)
    files = [(p.name, p.read_bytes()) for p in traced.iterdir()]
    files = [(n, d[: len(d) // 2] if n == "trace-0.npz" else d) for n, d in files]
    lib = RunsLibrary(tmp_path / "home")
    for name, shown in (("mytrace", "mytrace/trace-0.npz"), ("", "uploaded/trace-0.npz")):
        with pytest.raises(LibraryError) as caught:
            lib.add_files(files, name=name)
        message = str(caught.value)
        assert message.startswith(shown), message
        assert not re.search(r"\d+-[0-9a-f]{12}", message) and str(lib.home) not in message, message
    with pytest.raises(LibraryError) as caught:
        lib.add_files([(p.name, p.read_bytes()) for p in SAMPLE.iterdir()] + [("tokenizer.json", b"{no")], name="t")
    assert str(caught.value).startswith("t: tokenizer.json") and "tmp" not in str(caught.value)
    assert list(lib.tmp_dir.iterdir()) == [] and list(lib.runs_dir.iterdir()) == []
