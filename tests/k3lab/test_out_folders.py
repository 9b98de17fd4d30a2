"""Writes only where the user said: every command that writes a folder refuses one holding the user's files, the
root of the file system and a home folder, within 2 s, with a message naming the folder, and changes nothing there
(``k3core.utils.files.check_output_folder``, the one rule)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from k3core.utils.files import OutputFolderError, check_output_folder
from k3lab.cli import entry

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = str(ROOT / "sample_checkpoints" / "k3-full")

# case -> (command, argv with {out} for the folder it writes)
COMMANDS = {
    "train": ("train", ["k3-nano", "--steps", "1", "--out", "{out}"]),
    "train --resume": ("train", ["--resume", "{out}"]),
    "report": ("report", [SAMPLE, "--out", "{out}"]),
    "report --text-index all": ("report", [SAMPLE, "--text-index", "all", "--out", "{out}"]),
    "long": ("long", [SAMPLE, "--out", "{out}"]),
    "trace": ("trace", [SAMPLE, "--out", "{out}"]),
    "weights": ("weights", [SAMPLE, "--out", "{out}"]),
    "experiment": ("experiment", [SAMPLE, "--edit", "value.zero point=mixer_out layers=1", "--out", "{out}"]),
    "patch": ("patch", [SAMPLE, "--clean", "ab", "--corrupted", "ac", "--out", "{out}"]),
    "attribute": ("attribute", [SAMPLE, "--prompt", "ab", "--target", "c", "--out", "{out}"]),
    "survey": ("survey", [SAMPLE, "--sample", "shakespeare", "--out", "{out}"]),
    "generate --offload-folder": ("generate", [SAMPLE, "--device", "auto", "--offload-folder", "{out}"]),
    "app --home": ("app", ["--home", "{out}"]),
}


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    return {p.name: (p.read_bytes() if p.is_file() else None) for p in sorted(folder.iterdir())}


def _refused(command: str, out: Path, capsys) -> str:
    name, argv = COMMANDS[command]
    main = entry(name)
    start = time.perf_counter()
    code = main([a.replace("{out}", str(out)) for a in argv])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code != 0, err
    assert elapsed < 2.0, f"{command}: refused after {elapsed:.2f} s"
    return err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_of_the_users_files_is_refused_and_left_as_it_was(command, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "README.md").write_text("my notes\n")
    (out / "data").mkdir()
    before = _snapshot(out)
    err = _refused(command, out, capsys)
    assert str(out) in err and "README.md" in err and "choose a new folder" in err, err
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_home_folder_is_refused(command, tmp_path, monkeypatch, capsys):
    # Each command's --out goes through the rule (the root of the file system is refused by the same rule: see
    # test_the_rule; no command is pointed at / here, so that a regression cannot write there).
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for out in (home, tmp_path / "link-to-home"):
        if out != home:
            out.symlink_to(home)
        err = _refused(command, out, capsys)
        assert str(out) in err and "home folder" in err, err
    assert list(home.iterdir()) == []  # not even a folder made in it


def test_the_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    (tmp_path / "to-root").symlink_to("/")
    for where in ("/", tmp_path / "to-root", "/root", "/home/someone", "/home", "/Users/someone", tmp_path / "me"):
        with pytest.raises(OutputFolderError, match="root of the file system|home folder"):
            check_output_folder(where, ("report.html",), "report")
    assert check_output_folder(tmp_path / "new" / "deeper", (), "report") == tmp_path / "new" / "deeper"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_output_folder(empty, (), "trace folder") == empty
    mine = tmp_path / "mine"
    mine.mkdir()
    for i in range(6):
        (mine / f"f{i}").write_text("x")
    with pytest.raises(OutputFolderError, match=r"not a report.s \(.*, \.\.\.\)"):
        check_output_folder(mine, ("report.html",), "report")
    (mine / "report.html").write_text("an earlier report")
    assert check_output_folder(mine, ("report.html",), "report") == mine  # its own output: replaced
    with pytest.raises(OutputFolderError, match="not an empty folder .a trace folder is never written over"):
        check_output_folder(mine, (), "trace folder")  # own=(): never written over
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputFolderError, match="not a folder"):
        check_output_folder(tmp_path / "file", (), "report")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputFolderError, match="link to nothing"):
        check_output_folder(tmp_path / "dangling", (), "report")


def test_a_train_run_continues_in_its_own_folder(tmp_path, capsys):
    from k3lab import train

    out = tmp_path / "run"
    argv = ["k3-nano", "--steps", "2", "--stop-at", "1", "--eval-every", "0", "--sample-tokens", "4"]
    assert train.main([*argv, "--eval-windows", "1", "--no-progress", "--out", str(out)]) == 0
    assert train.main(["--resume", str(out), "--no-progress"]) == 0
    assert "finished" in capsys.readouterr().out
    assert train.main(["k3-nano", "--out", str(out)]) == 2  # a new run into a finished one: the run's own message
    assert "already holds a run" in capsys.readouterr().err
    assert os.path.isfile(out / "model.safetensors")
