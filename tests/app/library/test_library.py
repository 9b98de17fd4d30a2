"""app.library.store: runs added by upload, zip, path or preset persist in the home folder's SQLite index."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
import zipfile
from contextlib import closing

import pytest
import torch

from analysis.weights.checkpoint_summary import config_summary
from app.library.entries import ENTRY_FILE
from app.library.run_folders import LibraryError, human_count, summary_text
from app.library.store import RunsLibrary
from app.library.upload_checks import accepted_name, clean_name
from app.server.settings import DEFAULT_MAX_UPLOAD_MB, HOME_ENV, MAX_UPLOAD_ENV, home_dir, max_upload_mb
from k3core.modeling.model import K3ForCausalLM
from tests.conftest import nano_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A real k3-nano checkpoint folder and its model."""
    folder = tmp_path_factory.mktemp("ckpt") / "nano"
    model = nano_model(seed=3)
    model.save_pretrained(folder)
    (folder / "metrics.json").write_text(json.dumps({"history": [{"step": 0, "loss": 5.0}]}))
    return folder, model


def _stored(model) -> int:
    """Numbers in the checkpoint's tensors (parameters and persistent buffers, as the headers count them)."""
    return sum(t.numel() for t in model.state_dict().values())


def _files(folder):
    return [(p.name, p.read_bytes()) for p in sorted(folder.iterdir())]


@pytest.fixture
def lib(tmp_path):
    return RunsLibrary(tmp_path / "home")


def test_home_and_upload_limit_come_from_the_environment(tmp_path):
    assert home_dir({HOME_ENV: str(tmp_path / "h")}) == tmp_path / "h"
    assert home_dir({}).name == ".k3lab"
    assert max_upload_mb({}) == DEFAULT_MAX_UPLOAD_MB == 4096
    assert max_upload_mb({MAX_UPLOAD_ENV: "300"}) == 300
    assert max_upload_mb({MAX_UPLOAD_ENV: "lots"}) == DEFAULT_MAX_UPLOAD_MB
    lib = RunsLibrary.from_env({HOME_ENV: str(tmp_path / "h"), MAX_UPLOAD_ENV: "7"})
    assert lib.home == (tmp_path / "h").resolve() and lib.max_upload_bytes == 7 * 1024**2


def test_upload_is_stored_indexed_and_survives_a_restart(lib, ckpt):
    folder, model = ckpt
    entry, skipped = lib.add_files(_files(folder), "my run!")
    assert skipped == []
    assert (entry.name, entry.source, entry.available, entry.stored) == ("my-run", "upload", True, True)
    assert entry.path.parent == lib.home / "runs"
    assert sorted(p.name for p in entry.path.iterdir()) == sorted([ENTRY_FILE, *(p.name for p in folder.iterdir())])
    assert entry.size_bytes == sum(p.stat().st_size for p in folder.iterdir())
    assert entry.summary["parameters"] == _stored(model)
    assert entry.summary == {**config_summary(model.config), "parameters": _stored(model), "dtypes": ["F32"]}
    assert (
        summary_text(entry.summary)
        == f"4 layers · width 64 · vocab 256 · 8 experts · {human_count(_stored(model))} params"
    )

    again = RunsLibrary(lib.home)  # a server restart: a new process opens the same home
    assert [(e.id, e.name, e.fingerprint) for e in again.entries()] == [(entry.id, "my-run", entry.fingerprint)]
    with sqlite3.connect(lib.home / "library.sqlite") as con:
        cols = [r[1] for r in con.execute("PRAGMA table_info(runs)")]
    assert cols == [
        "id", "name", "source", "location", "fingerprint", "config_summary", "size_bytes", "added_at", "state"
    ]  # fmt: skip
    loaded = K3ForCausalLM.from_pretrained(again.entries()[0].path)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_row_indexed_before_config_summary_still_shows(lib, ckpt):
    """Rows written when the library built its own summary (keys layers / experts / model_type) read as they did."""
    folder, model = ckpt
    entry = lib.add_path(folder)
    old = {"model_type": "k3", "layers": 4, "hidden_size": 64, "vocab_size": 256, "experts": 8,
           "parameters": _stored(model), "dtypes": ["F32"]}  # fmt: skip
    with closing(sqlite3.connect(lib.home / "library.sqlite")) as con, con:
        con.execute("UPDATE runs SET config_summary = ? WHERE id = ?", (json.dumps(old), entry.id))
    shown = RunsLibrary(lib.home).get(entry.id)
    assert shown.summary == old and shown.available
    assert summary_text(shown.summary) == summary_text(entry.summary)  # the same caption as a new row's
    assert (
        summary_text({**old, "experts": 0}) == f"4 layers · width 64 · vocab 256 · {human_count(_stored(model))} params"
    )


def test_names_are_made_unique_and_rename_checks_conflicts(lib, ckpt):
    folder, _ = ckpt
    a, _ = lib.add_files(_files(folder), "mine")
    b, _ = lib.add_files(_files(folder), "mine")
    assert (a.name, b.name) == ("mine", "mine-2")
    assert a.fingerprint == b.fingerprint  # same bytes, same config
    with pytest.raises(LibraryError, match="'mine' is already in the library"):
        lib.rename(b.id, "mine")
    renamed = lib.rename(b.id, "  other name ")
    assert renamed.name == "other-name" and RunsLibrary(lib.home).get(b.id).name == "other-name"
    with pytest.raises(LibraryError, match="at least one letter"):
        lib.rename(a.id, "!!!")


def test_delete_removes_the_files_and_the_row(lib, ckpt):
    folder, _ = ckpt
    entry, _ = lib.add_files(_files(folder), "gone")
    lib.delete(entry.id)
    assert not entry.path.exists() and lib.entries() == []
    with pytest.raises(LibraryError, match="no longer in the library"):
        lib.delete(entry.id)


def test_missing_weights_say_why_and_mention_the_upload_limit(lib, ckpt):
    folder, _ = ckpt
    with pytest.raises(LibraryError, match=r"no weights among the files \(config.json\).*4,096 MB per file"):
        lib.add_files([("config.json", (folder / "config.json").read_bytes())], "w")
    with pytest.raises(LibraryError, match="config.json is missing"):
        lib.add_files([("model.safetensors", (folder / "model.safetensors").read_bytes())], "w")
    assert lib.entries() == [] and not list(lib.tmp_dir.iterdir()) and not list(lib.runs_dir.iterdir())


def test_missing_shards_are_named(lib, ckpt, tmp_path):
    folder, model = ckpt
    sharded = model.save_pretrained(tmp_path / "sharded", max_shard_bytes=200_000)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2
    files = [f for f in _files(sharded) if f[0] != shards[-1]]
    with pytest.raises(LibraryError, match=rf"missing: \['{shards[-1]}'\].*upload limit"):
        lib.add_files(files, "s")
    entry, _ = lib.add_files(_files(sharded), "s")
    assert entry.summary["parameters"] == _stored(model)


def test_oversized_file_is_refused_with_the_limit(tmp_path, ckpt):
    folder, _ = ckpt
    lib = RunsLibrary(tmp_path / "home", max_upload_bytes=1024**2)
    big = b"#" * (1024**2 + 1)
    for data in (big, io.BytesIO(big)):
        with pytest.raises(LibraryError, match=r"README.md is over the upload limit of 1 MB per file.*--max-upload-mb"):
            lib.add_files([*_files(folder), ("README.md", data)], "big")
    assert not list(lib.tmp_dir.iterdir())


def test_unknown_files_are_refused_or_skipped(lib, ckpt):
    folder, _ = ckpt
    with pytest.raises(LibraryError, match=r"unexpected file\(s\) \['evil.py'\]"):
        lib.add_files([*_files(folder), ("evil.py", b"print(1)")])
    entry, skipped = lib.add_files([*_files(folder), ("sub/evil.py", b"x")], skip_unknown=True)
    assert skipped == ["evil.py"] and not (entry.path / "evil.py").exists()
    with pytest.raises(LibraryError, match="uploaded twice"):
        lib.add_files([*_files(folder), ("other/config.json", b"{}")])
    with pytest.raises(LibraryError, match="No files"):
        lib.add_files([])


def test_folder_upload_names_keep_only_the_base_name(lib, ckpt):
    folder, _ = ckpt
    entry, _ = lib.add_files([(f"nano/{n}", d) for n, d in _files(folder)])
    assert entry.name == "nano"  # named after the uploaded folder
    assert sorted(p.name for p in entry.path.iterdir()) == sorted([ENTRY_FILE, *(p.name for p in folder.iterdir())])
    assert lib.add_files([(f"nano/{n}", d) for n, d in _files(folder)], "given")[0].name == "given"
    assert all(p.parent == entry.path for p in entry.path.rglob("*"))


def test_zip_of_a_run_folder_is_added(lib, ckpt):
    folder, model = ckpt
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in folder.iterdir():
            zf.write(p, f"nano/{p.name}")
        zf.writestr("nano/.gitattributes", "*.safetensors filter=lfs")
    entry, skipped = lib.add_files([("nano.zip", io.BytesIO(buf.getvalue()))])
    assert entry.name == "nano" and skipped == ["nano/.gitattributes"]
    assert entry.summary["parameters"] == _stored(model)
    with pytest.raises(LibraryError, match="not both"):
        lib.add_files([("nano.zip", buf.getvalue()), ("config.json", b"{}")])


def test_zip_slip_is_refused_and_leaves_nothing(lib, ckpt, tmp_path):
    folder, _ = ckpt
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for p in folder.iterdir():
            zf.write(p, p.name)
        zf.writestr("../../escaped.json", "{}")
    with pytest.raises(LibraryError, match=r"^evil: the zip entry '\.\./\.\./escaped\.json' points outside"):
        lib.add_zip(buf.getvalue(), "evil")
    assert not list(tmp_path.rglob("escaped.json"))
    assert lib.entries() == [] and not list(lib.tmp_dir.iterdir()) and not list(lib.runs_dir.iterdir())


def test_corrupt_checkpoint_is_refused_by_name_not_by_path(lib, ckpt):
    folder, _ = ckpt
    with pytest.raises(LibraryError) as err:
        lib.add_files(
            [("config.json", (folder / "config.json").read_bytes()), ("model.safetensors", b"garbage!")], "bad"
        )
    assert str(err.value).startswith("bad")
    assert str(lib.home) not in str(err.value) and "tmp" not in str(err.value)


def test_path_entries_reference_the_folder_and_delete_leaves_it(lib, ckpt):
    folder, model = ckpt
    entry = lib.add_path(folder)
    assert (entry.name, entry.source, entry.path, entry.stored) == ("nano", "path", folder.resolve(), False)
    assert entry.summary["parameters"] == _stored(model)
    assert lib.add_path(folder).id == entry.id  # the same folder is one entry
    assert not list(lib.runs_dir.iterdir())  # nothing copied
    lib.delete(entry.id)
    assert (folder / "model.safetensors").is_file()


def test_preset_is_seeded_and_large_presets_are_refused(lib, tmp_path):
    torch.manual_seed(123)
    before = torch.rand(3)
    entry = lib.add_preset("k3-nano", seed=5)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), before)  # the global RNG stream is not disturbed
    assert (entry.name, entry.source) == ("k3-nano-random", "preset")
    weights = K3ForCausalLM.from_pretrained(entry.path).state_dict()
    torch.manual_seed(5)
    expected = K3ForCausalLM.from_config("k3-nano").state_dict()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert "seed 5" in (entry.path / "README.md").read_text()
    with pytest.raises(LibraryError, match=r"k3-small has 264.76M parameters .* too large"):
        RunsLibrary(tmp_path / "h2", max_preset_params=10**6).add_preset("k3-small")
    with pytest.raises(LibraryError, match="unknown preset"):
        lib.add_preset("k3-huge")


def test_cleanup_removes_leftovers_of_dead_processes_only(tmp_path):
    lib = RunsLibrary(tmp_path / "home")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (lib.tmp_dir / f"{dead.pid}-abc").mkdir()
    (lib.tmp_dir / f"{dead.pid}-abc" / "model.safetensors").write_bytes(b"half")
    (lib.tmp_dir / f"{os.getpid()}-live").mkdir()  # this process is adding a run right now
    (lib.trash_dir / "0123456789ab-dead").mkdir()  # a delete that a crash interrupted
    unknown = lib.runs_dir / "0123456789ab"  # a run folder no row or row file describes: kept, never deleted
    unknown.mkdir()
    (unknown / "notes.txt").write_text("mine")
    old = time.time() - 3600
    os.utime(unknown, (old, old))
    again = RunsLibrary(lib.home)  # opening the library cleans up
    assert not (lib.tmp_dir / f"{dead.pid}-abc").exists() and not (lib.trash_dir / "0123456789ab-dead").exists()
    assert (lib.tmp_dir / f"{os.getpid()}-live").exists() and (unknown / "notes.txt").read_text() == "mine"
    assert any("0123456789ab" in m and "kept" in m for m in again.recovered)


def test_redact_names_runs_not_server_paths(lib, ckpt):
    folder, _ = ckpt
    entry, _ = lib.add_files(_files(folder), "mine")
    msg = f"{entry.path}/model.safetensors: truncated; staging {lib.tmp_dir}/123-abc/x failed"
    out = lib.redact(msg)
    assert out == "mine/model.safetensors: truncated; staging (runs library) failed"


def test_two_threads_add_at_once(tmp_path, ckpt):
    folder, _ = ckpt
    lib = RunsLibrary(tmp_path / "home")
    errors = []

    def add():
        try:
            RunsLibrary(lib.home).add_files(_files(folder), "same")
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=add) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(e.name for e in lib.entries()) == ["same", "same-2"]


def test_names(ckpt):
    assert accepted_name("model-00001-of-00003.safetensors") and accepted_name("tiktoken.model")
    assert not accepted_name("evil.py") and not accepted_name("config.json.bak")
    assert clean_name(" a b/../c ", "d") == "a-b-..-c" and clean_name("///", "d") == "d"
