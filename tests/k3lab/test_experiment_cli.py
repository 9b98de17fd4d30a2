"""k3lab experiment / patch / attribute on a saved k3-nano: exit codes, JSON written, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from analysis.experiments import attribution
from k3lab.cli import main
from k3lab.experiment import METHOD_CHOICES

from ..conftest import nano_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("nano")
    nano_model().save_pretrained(path)
    return path


def test_experiment_writes_effects_that_match_a_forward(run_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    code = main(["experiment", str(run_dir), "--edit", "moe.ban layer=2 experts=0,1", "--edit",
                 '{"kind": "value", "point": "mixer_out", "op": "zero", "layers": [0]}', "--text",
                 "Friends, Romans, countrymen", "--out", str(out), "--no-static", "--lens"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    data = json.loads((out / "experiment.json").read_text())
    assert [e["kind"] for e in data["edits"]] == ["moe", "value"] and data["tokens"] == 27
    ids = torch.tensor([list(b"Friends, Romans, countrymen")])
    from analysis.experiments.effects import token_losses

    model = nano_model()
    with torch.no_grad():
        base = token_losses(model(ids).logits, ids)
    assert [round(r["base_loss"], 5) for r in data["effects"]] == [round(float(v), 5) for v in base]
    assert (out / "figures" / "loss_change.html").is_file() and (out / "figures" / "lens_edited.csv").is_file()
    assert "mean loss" in capsys.readouterr().out


def test_experiment_errors_are_clear(run_dir, tmp_path, capsys):
    code = main(["experiment", str(run_dir), "--edit", "moe.ban layer=0 experts=1", "--text", "abc", "--out",
                 str(tmp_path)])  # fmt: skip
    assert code == 2 and "layer 0 has no MoE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["experiment", "--help"])
    assert "moe.ban layer=2 experts=1,5" in capsys.readouterr().out


def test_patch_and_attribute(run_dir, tmp_path, capsys):
    code = main(["patch", str(run_dir), "--clean", "the cat sat", "--corrupted", "the dog sat", "--correct", "a",
                 "--wrong", "o", "--out", str(tmp_path / "p"), "--no-static"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "p" / "patching.json").read_text())
    last = [r for r in data["table"] if r["layer"] == 3 and r["site"] == "resid"][0]
    assert abs(last["fraction_restored"] - 1) < 1e-6
    code = main(["patch", str(run_dir), "--clean", "the cat", "--corrupted", "the do", "--correct", "a", "--wrong",
                 "o", "--out", str(tmp_path / "q")])  # fmt: skip
    assert code == 2 and "same length" in capsys.readouterr().err
    code = main(["attribute", str(run_dir), "--prompt", "ab", "--target", "c", "--method", "all", "--layers",
                 "--steps", "8", "--out", str(tmp_path / "a"), "--no-static"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "a" / "attribution.json").read_text())
    assert set(data["methods"]) == set(attribution.METHODS) == set(METHOD_CHOICES)
    assert len(data["methods"]["shapley"]["matrix"][0]) == 2 and "delta" in data["layers"]
    assert data["methods"]["shapley"]["seed"] == 0 and data["methods"]["shapley"]["n_samples"] == 8
    assert data["methods"]["integrated_gradients"]["routing_changes"] >= 0
    out = capsys.readouterr().out
    assert "raise --steps" not in out and "ig_frozen_routing delta per output token" in out
