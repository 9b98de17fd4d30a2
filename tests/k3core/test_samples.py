"""The shipped sample checkpoints: they load, fit in 8 MB, learned something, and their recorded
validation loss reproduces from the weights on the windows named in their metrics.json."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k3core.modeling.config import K3Config
from k3core.modeling.model import K3ForCausalLM
from k3core.training import TrainConfig, evaluate_bits_per_byte, load_corpus, load_metrics, parse_overrides

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_checkpoints"
RECIPE = json.loads((SAMPLES / "recipe.json").read_text())
NAMES = [run["name"] for run in RECIPE["runs"]]
MAX_BYTES = 8_000_000


@pytest.fixture(scope="module")
def val_bytes() -> np.ndarray:
    m = load_metrics(SAMPLES / NAMES[0])
    return load_corpus(TrainConfig(**m["train_config"])).val


def test_the_recipe_names_the_four_comparisons():
    assert {"k3-full", "plain-residual", "scale-bias", "plain-moe"} <= set(NAMES)
    for name in NAMES:
        assert (SAMPLES / name / "config.json").is_file(), f"sample {name} is missing; see sample_checkpoints/README"


@pytest.mark.parametrize("name", NAMES)
def test_sample_loads_fits_and_reproduces(name, val_bytes):
    folder = SAMPLES / name
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert size <= MAX_BYTES, f"{name}: {size:,} bytes of weights"
    model = K3ForCausalLM.from_pretrained(folder)
    m = load_metrics(folder)
    assert m["status"] == "finished"
    assert model.num_parameters() == m["params"]["total"]
    assert next(model.parameters()).dtype == torch.float32

    # the model is exactly the recipe's base config with this run's --set changes
    run = next(r for r in RECIPE["runs"] if r["name"] == name)
    base = K3Config.load(ROOT / RECIPE["base_config"]).to_dict()
    assert model.config.to_dict() == K3Config.from_dict({**base, **parse_overrides(run["set"])}).to_dict()

    # validation data unchanged, and the recorded loss reproduces on the recorded windows
    assert hashlib.sha256(np.ascontiguousarray(val_bytes).tobytes()).hexdigest() == m["data"]["val_sha256"]
    ev = m["eval"]
    loss, bpb = evaluate_bits_per_byte(model, val_bytes, ev["window_starts"], ev["seq_len"], ev["batch_size"])
    assert loss == pytest.approx(m["final"]["val_loss"], rel=0.01)
    # learned something real: far below the byte-unigram baseline (about 4.82 bits/byte)
    assert bpb < m["data"]["unigram_baseline_bpb"] - 2.0
    assert (folder / "README.md").is_file()


def test_samples_share_data_budget_and_schedule():
    configs = {}
    for name in NAMES:
        m = load_metrics(SAMPLES / name)
        tc = {k: v for k, v in m["train_config"].items() if k not in ("out_dir", "overrides")}
        configs[name] = (tc, m["final"]["tokens_seen"], m["eval"]["window_starts"])
    first = configs[NAMES[0]]
    for name, value in configs.items():
        assert value == first, f"{name} was trained differently from {NAMES[0]}"


def test_plain_moe_matches_the_active_budget():
    full = load_metrics(SAMPLES / "k3-full")["params"]["active"]
    plain = load_metrics(SAMPLES / "plain-moe")["params"]["active"]
    assert abs(plain - full) / full < 0.005


def test_readme_table_is_current():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import train_samples
    finally:
        sys.path.pop(0)
    readme = (SAMPLES / "README.md").read_text()
    assert train_samples.readme_table(train_samples.load_recipe()) in readme
    assert train_samples.campaign_table(train_samples.load_recipe()) in readme
    for run in RECIPE["runs"]:
        assert train_samples.command(RECIPE, run) in readme
