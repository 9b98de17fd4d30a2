"""Fixtures of the app's AppTest tests: k3-nano checkpoint folders, and the app pointed at given folders only."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from app.library import run_list
from app.server.settings import HOME_ENV
from k3core.modeling.model import K3ForCausalLM
from tests.app.apptest_helpers import METRICS, save_nano


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two good k3-nano runs (seeds 0 and 1, with metrics), one with a corrupt weights file, one with a NaN weight."""
    root = tmp_path_factory.mktemp("runs")
    good = save_nano(root / "nano-a", 0, METRICS)
    other = save_nano(root / "nano-b", 1, METRICS)
    corrupt = root / "corrupt"
    corrupt.mkdir()
    shutil.copy(good / "config.json", corrupt / "config.json")
    (corrupt / "model.safetensors").write_bytes(b"definitely not safetensors")
    torch.manual_seed(2)
    model = K3ForCausalLM.from_config("k3-nano")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    nan = model.save_pretrained(root / "nan-weights")
    return {"good": good, "other": other, "corrupt": corrupt, "nan": Path(nan)}


@pytest.fixture
def app_env(monkeypatch, tmp_path):
    """Point the app at given checkpoint folders only (no shipped samples)."""

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "k3lab-home"))  # the runs library of this test only

    def use(*folders: Path) -> None:
        monkeypatch.setenv(run_list.RUNS_ENV, os.pathsep.join(str(f) for f in folders))
        empty = tmp_path / "no-samples"
        empty.mkdir(exist_ok=True)
        monkeypatch.setattr(run_list, "SAMPLES_DIR", empty)

    return use
