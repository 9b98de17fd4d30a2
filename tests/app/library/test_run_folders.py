"""app.library.run_folders: a checkpoint folder described from its headers."""

from __future__ import annotations

import pytest

from analysis.runs.loading import load_run
from app.library.run_folders import LibraryError, content_fingerprint, describe_folder, human_count, summary_text
from k3core.loading.folder import CheckpointFiles, folder_fingerprint
from tests.conftest import nano_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "nano"
    model = nano_model(seed=3)
    model.save_pretrained(folder)
    return folder, model


def test_describe_counts_from_headers(ckpt):
    folder, model = ckpt
    stored = sum(t.numel() for t in model.state_dict().values())  # parameters and persistent buffers
    info = describe_folder(folder)
    assert info.num_parameters == stored
    assert info.weight_bytes == 4 * stored and info.dtypes == {"F32": info.weight_bytes}
    assert info.size_bytes == sum(p.stat().st_size for p in folder.iterdir())
    assert info.summary["num_hidden_layers"] == model.config.num_hidden_layers and info.files.bytes_read == 0
    assert info.summary["parameters"] == stored and info.summary["dtypes"] == ["F32"]
    assert summary_text(info.summary).startswith(f"{model.config.num_hidden_layers} layers · width 64")


def test_one_fingerprint_per_thing_fingerprinted(ckpt):
    """A folder on the server is keyed by k3core's folder_fingerprint (what the loader and the app's caches use);
    the same folder's bytes by content_fingerprint (uploads); no second checkpoint fingerprint function."""
    folder, _ = ckpt
    info = describe_folder(folder)
    assert info.fingerprint == folder_fingerprint(folder) == load_run(folder).fingerprint
    assert content_fingerprint(folder) != info.fingerprint
    assert not hasattr(CheckpointFiles, "fingerprint")


def test_errors_name_the_run_not_the_folder(tmp_path):
    folder = tmp_path / "secret-server-folder"
    folder.mkdir()
    with pytest.raises(LibraryError) as err:
        describe_folder(folder, label="my-run")
    assert str(err.value).startswith("my-run") and "secret-server-folder" not in str(err.value)


def test_content_fingerprint_follows_bytes_not_times(tmp_path):
    (tmp_path / "a").write_bytes(b"12")
    first = content_fingerprint(tmp_path)
    (tmp_path / "a").write_bytes(b"12")
    assert content_fingerprint(tmp_path) == first
    (tmp_path / "a").write_bytes(b"13")
    assert content_fingerprint(tmp_path) != first


def test_human_count():
    assert human_count(None) == "?" and human_count(211550) == "211.55K"
