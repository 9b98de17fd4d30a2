"""k3core.utils.files: atomic writes leave the old file or the new one, never a part, and no temporary files."""

from __future__ import annotations

import os

import pytest

from k3core.utils import files


def test_atomic_write_replaces_the_whole_file(tmp_path):
    path = tmp_path / "metrics.json"
    assert files.atomic_write_bytes(path, b"first version, long") == path
    assert path.read_bytes() == b"first version, long"
    files.atomic_write_text(path, "2nd: \u00e9")  # shorter, non-ASCII: no tail of the old bytes left
    assert path.read_bytes() == b"2nd: \xc3\xa9"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"good weights")

    def full_disk(src, dst):
        raise OSError("No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        files.atomic_write_bytes(path, b"x" * 1000)
    assert path.read_bytes() == b"good weights"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_missing_folder_is_an_error_not_a_silent_success(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.atomic_write_text(tmp_path / "nope" / "a.txt", "x")
