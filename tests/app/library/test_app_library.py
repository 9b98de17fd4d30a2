"""The Runs library page under streamlit.testing's AppTest, on real k3-nano checkpoints: uploads (good and bad)
persist across sessions, folders open by path only inside the allowed roots, presets are created, and a run too
big for the device's memory gets a message instead of a load."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from app import page_registry
from app.library import home as library_home
from app.library import memory_fit, run_list, run_messages
from app.library.store import RunsLibrary
from app.server.settings import HOME_ENV, ROOTS_ENV
from k3core.modeling.model import K3ForCausalLM

APP = Path(__file__).resolve().parents[3] / "app" / "main.py"
TIMEOUT = 180


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("libruns")
    folders = {}
    for name, seed in (("good", 0), ("other", 1)):
        torch.manual_seed(seed)
        folders[name] = K3ForCausalLM.from_config("k3-nano").save_pretrained(root / f"nano-{name}")
    corrupt = root / "corrupt"
    corrupt.mkdir()
    shutil.copy(folders["good"] / "config.json", corrupt / "config.json")
    (corrupt / "model.safetensors").write_bytes(b"definitely not safetensors")
    folders["corrupt"] = corrupt
    return folders


@pytest.fixture
def env(monkeypatch, tmp_path, runs):
    """Only the 'good' run preloaded, no samples, a fresh library home, the runs' folder as the only root."""
    home = tmp_path / "home"
    monkeypatch.setenv(HOME_ENV, str(home))
    monkeypatch.setenv(ROOTS_ENV, str(runs["good"].parent))
    monkeypatch.setenv(run_list.RUNS_ENV, str(runs["good"]))
    empty = tmp_path / "no-samples"
    empty.mkdir()
    monkeypatch.setattr(run_list, "SAMPLES_DIR", empty)
    return home


def _library_page(max_tokens: int = 16) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = max_tokens
    at.run()
    return at.switch_page("page_scripts/runs_library.py").run()


def _errors(at: AppTest) -> list[str]:
    """The error boxes' text as shown (the app escapes messages for Markdown: drop the escapes)."""
    return [re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", e.value) for e in at.error]


def _upload(at: AppTest, folder: Path, names=("config.json", "model.safetensors"), weights_from: Path | None = None):
    uploader = at.get("file_uploader")[0]
    for name in names:
        src = (weights_from or folder) if name != "config.json" else folder
        uploader.upload(name, (src / name).read_bytes())


def test_upload_persists_and_a_bad_one_leaves_nothing(env, runs):
    at = _library_page()
    assert not at.exception
    _upload(at, runs["other"], weights_from=runs["corrupt"])
    at.button(key="k3lab_upload_add").click().run()
    assert not at.exception
    errors = _errors(at)
    assert any("cannot be used" in e and "not a safetensors file" in e for e in errors), errors
    assert not any(str(env) in e for e in errors)  # no server paths of the library in the message
    assert RunsLibrary(env).entries() == []

    _upload(at, runs["other"])
    at.text_input(key="k3lab_upload_name").input("mine")
    at.button(key="k3lab_upload_add").click().run()
    assert not at.exception and _errors(at) == []
    assert at.session_state["k3lab_run"] == "mine"  # selected in the sidebar
    assert any("Added **mine**" in s.value for s in at.success)
    [entry] = RunsLibrary(env).entries()
    assert (entry.name, entry.source, entry.state) == ("mine", "upload", "ready")  # its check finished

    # A new session (a browser reload) and a new library object (a server restart) still list it.
    library_home._library.clear()
    again = _library_page()
    assert not again.exception
    assert "mine · uploaded" in again.selectbox(key="k3lab_run").options
    assert any("**mine**" in m.value for m in again.markdown)
    again.switch_page("page_scripts/overview.py").run()
    again.selectbox(key="k3lab_run").select("mine").run()
    assert not again.exception and _errors(again) == []
    assert [s.value for s in again.subheader][0] == "mine"


def test_a_damaged_index_shows_every_run_and_says_what_was_repaired(env, runs):
    lib = RunsLibrary(env)
    kept, _ = lib.add_files([(p.name, p.read_bytes()) for p in sorted(runs["other"].iterdir())], "kept")
    halfway, _ = lib.add_files([(p.name, p.read_bytes()) for p in sorted(runs["other"].iterdir())], "halfway")
    lib._set_state(halfway.id, "unchecked")  # as a kill -9 during its check leaves it
    lib.db_path.write_bytes(b"\x00garbage, not sqlite" * 50)
    library_home._library.clear()
    at = _library_page()
    assert not at.exception and _errors(at) == []
    assert any("moved aside" in i.value and "no run was deleted" in i.value for i in at.info)
    assert {e.name for e in library_home.library().entries()} == {"kept", "halfway"}
    assert any("did not finish" in w.value for w in at.warning)
    at.button(key=f"k3lab_lib_check_{halfway.id}").click().run()
    assert not at.exception and _errors(at) == []
    assert RunsLibrary(env).get(halfway.id).state == "ready" and (kept.path / "model.safetensors").is_file()


def test_missing_weights_point_at_the_upload_limit(env, runs):
    at = _library_page()
    _upload(at, runs["other"], names=("config.json",))
    at.button(key="k3lab_upload_add").click().run()
    [error] = _errors(at)
    assert "no weights among the files (config.json)" in error and "200 MB per file" in error


def test_open_by_path_inside_the_roots_only(env, runs, tmp_path):
    at = _library_page()
    at.text_input(key="k3lab_open_path").input(str(runs["other"]))
    at.button(key="k3lab_open_check").click().run()
    assert not at.exception and _errors(at) == []
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Parameters"] == "211.57K" and metrics["Memory in float32"] == "826.5 KiB"
    plan = at.dataframe[0].value
    assert list(plan["device"])[0] == "cpu" and list(plan["memory"])[0] == "826.5 KiB"
    assert list(plan["decoder layers"])[0] == "0-3"
    ranks = at.dataframe[1].value  # the multi-GPU plan: 826 KiB fits one GPU, all layers on rank 0
    assert list(ranks["layers"]) == ["0-3"] and "embedding" in list(ranks["holds"])[0]
    at.button(key="k3lab_open_add").click().run()
    assert at.session_state["k3lab_run"] == "nano-other"
    [entry] = RunsLibrary(env).entries()
    assert (entry.source, entry.path) == ("path", runs["other"].resolve())
    assert "nano-other · folder" in at.selectbox(key="k3lab_run").options

    # Started again with other roots: the entry stays in the library but is not offered any more.
    library_home._library.clear()
    other_root = tmp_path / "other-root"
    other_root.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ROOTS_ENV, str(other_root))
        again = _library_page()
        assert "nano-other · folder" not in again.selectbox(key="k3lab_run").options
        assert any("Not offered in the run picker" in w.value and "outside" in w.value for w in again.warning)
    assert library_home.path_refusal(entry) is None  # back with the original roots

    outside = tmp_path / "outside"
    shutil.copytree(runs["other"], outside)
    (runs["good"].parent / "sneaky").symlink_to(outside, target_is_directory=True)
    try:
        for path in (outside, runs["good"].parent / "sneaky", runs["good"].parent / ".." / outside.name):
            at.text_input(key="k3lab_open_path").input(str(path))
            at.button(key="k3lab_open_check").click().run()
            assert any("outside the folders this app may open" in e for e in _errors(at)), path
    finally:
        (runs["good"].parent / "sneaky").unlink()


def test_preset_rename_and_delete(env):
    at = _library_page()
    at.selectbox(key="k3lab_preset").select("k3-nano")
    at.number_input(key="k3lab_preset_seed").set_value(7)
    at.button(key="k3lab_preset_create").click().run()
    assert not at.exception and _errors(at) == []
    [entry] = RunsLibrary(env).entries()
    assert (entry.name, entry.source) == ("k3-nano-random", "preset")
    assert at.session_state["k3lab_run"] == "k3-nano-random"

    at.text_input(key=f"k3lab_lib_name_{entry.id}").input("fresh")
    at.button(key=f"k3lab_lib_rename_{entry.id}").click().run()
    assert [e.name for e in RunsLibrary(env).entries()] == ["fresh"]
    assert "fresh · preset" in at.selectbox(key="k3lab_run").options
    at.button(key=f"k3lab_lib_delete_{entry.id}").click().run()
    assert RunsLibrary(env).entries() == [] and not entry.path.exists()
    assert "fresh · preset" not in at.selectbox(key="k3lab_run").options
    # the page says what it deleted, and the Run box shows a run that is there (with a note on why)
    assert any("Deleted **fresh**" in m.value for m in at.success), [m.value for m in at.success]
    box = at.selectbox(key="k3lab_run")
    assert box.value in box.options and box.value != "fresh"
    assert any("**fresh** is no longer in the runs library" in i.value for i in at.sidebar.info)


def test_a_run_too_big_for_memory_gets_a_message_not_a_load(env, runs, monkeypatch):
    monkeypatch.setattr(memory_fit, "available_memory", lambda device: 100_000)  # 100 KB free
    ref = run_list.RunRef("nano-good", str(runs["good"]), "preloaded")
    problem = memory_fit.fit_problem(ref, "cpu", "float32")
    assert problem.startswith("**nano-good** needs 826.5 KiB in float32 but cpu has 97.7 KiB free")
    assert "in bfloat16" in memory_fit.fit_problem(ref, "cpu", "bfloat16")
    monkeypatch.setattr(memory_fit, "available_memory", lambda device: 10**12)
    assert memory_fit.fit_problem(ref, "cpu", "float32") is None


def test_messages_name_the_run_not_the_folder(env, runs):
    lib = library_home.library()
    entry, _ = lib.add_files([(p.name, p.read_bytes()) for p in runs["other"].iterdir()], "named")
    ref = run_list.ref_of(entry)
    text = run_messages.message(f"{entry.path}: truncated; {entry.path.name}/model.safetensors bad", ref)
    assert text == "named: truncated; named/model.safetensors bad"
    assert os.fspath(env) not in text


def test_loading_reports_progress_in_bytes(runs):
    from analysis.runs.loading import load_run

    calls = []
    run = load_run(runs["good"], progress=lambda done, total: calls.append((done, total)))
    total = sum(t.numel() * t.element_size() for t in run.model.state_dict().values())
    assert calls and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)  # never goes back


def test_overview_of_a_run_too_big_for_memory_says_so_and_loads_nothing(env, runs, monkeypatch):
    monkeypatch.setattr(memory_fit, "available_memory", lambda device: 100_000)  # 100 KB free: nano needs 826 KB
    loads = []
    monkeypatch.setattr("analysis.runs.loading.load_run", lambda *a, **k: loads.append(a))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 16
    at.run()
    assert not at.exception
    [error] = _errors(at)
    assert error.startswith("**nano-good** needs 826.5 KiB in float32 but cpu has 97.7 KiB free")
    assert page_registry.page("weights").mention in error
    assert loads == []  # the page stopped before loading
