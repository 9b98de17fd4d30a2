"""The shipped sample checkpoints (sample_checkpoints/README.md), recomputed from their weights.

Every sample loads as the recipe's config, fits its folder limit, and its numbers reproduce from the weights
(``scripts/check_samples.measure``): the recorded validation bits/byte and MQAR accuracy, and every number of the
README's tables (``sample_checkpoints/checks.json``, which the tables are printed from). ``k3-full`` meets the
campaign's targets; every trained sample's card reads mostly real words; the untrained sample is the app's untrained
twin of ``k3-full``; and ``k3-full``'s first 50 steps rerun bit for bit from its recorded command.
"""

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
from k3core.training import TrainConfig, load_corpus, load_metrics, parse_overrides, rerun_start

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_checkpoints"
RECIPE = json.loads((SAMPLES / "recipe.json").read_text())
NAMES = [run["name"] for run in RECIPE["runs"]]
UNTRAINED = "untrained"
#: the issue's limit on one run folder (weights, config, metrics.json, model card)
MAX_FOLDER_BYTES = 16_000_000
#: how closely a recomputed number must match the recorded one. Bits/byte and entropies are sums of float32
#: products whose rounding moves with the CPU's kernels (about 1e-6 relative), far inside these; MQAR accuracy
#: may flip one of its 512 answers where two logits tie within that rounding.
BPB_REL = 1e-4
ENTROPY_ABS = 1e-4
MQAR_ABS = 1 / 512 + 1e-9

sys.path.insert(0, str(ROOT / "scripts"))
try:
    import check_samples
    import train_samples
finally:
    sys.path.pop(0)


@pytest.fixture(scope="module")
def measured():
    """``check_samples.measure`` of a shipped sample, computed once per module."""
    cache: dict[str, dict] = {}

    def measure(name: str) -> dict:
        if name not in cache:
            cache[name] = check_samples.measure(SAMPLES / name)
        return cache[name]

    return measure


@pytest.fixture(scope="module")
def checks() -> dict[str, dict]:
    """The README's numbers, per sample (``check_samples.py ... --compare --json sample_checkpoints/checks.json``)."""
    return {Path(c["run"]).name: c for c in json.loads((SAMPLES / train_samples.CHECKS_FILE).read_text())}


def test_every_campaign_run_ships_under_its_samples_name():
    assert {
        "k3-full",
        "k3-full-s1",
        "plain-residual",
        "plain-residual-s1",
        "scale-bias",
        "plain-moe",
        UNTRAINED,
    } == set(NAMES)
    units = {u["name"]: u for u in RECIPE["campaign"]["runs"]}
    for run in RECIPE["runs"]:
        unit = units[run["unit"]]
        assert unit["status"] == "done" and unit["folder"] == f"sample_checkpoints/{run['name']}"
        assert train_samples.ship_name(unit) == run["name"]
        assert (SAMPLES / run["name"] / "config.json").is_file(), f"{run['name']} is missing; see its README"


@pytest.mark.parametrize("name", NAMES)
def test_sample_loads_fits_and_reproduces_its_numbers(name, measured, checks):
    folder = SAMPLES / name
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size <= MAX_FOLDER_BYTES, f"{name}: {size:,} bytes"
    model = K3ForCausalLM.from_pretrained(folder)
    m = load_metrics(folder)
    assert m["status"] == "finished" and m["run_name"] == name
    assert model.num_parameters() == m["params"]["total"]
    assert next(model.parameters()).dtype == torch.float32

    # the model is exactly the recipe's base config with this run's --set changes
    run = next(r for r in RECIPE["runs"] if r["name"] == name)
    base = K3Config.load(ROOT / RECIPE["base_config"]).to_dict()
    assert model.config.to_dict() == K3Config.from_dict({**base, **parse_overrides(run["set"])}).to_dict()

    # the validation plays are the recorded ones, and the recorded numbers reproduce from the weights
    val = load_corpus(TrainConfig.from_dict(m["train_config"])).val
    assert hashlib.sha256(np.ascontiguousarray(val).tobytes()).hexdigest() == m["data"]["val_sha256"]
    found = measured(name)
    assert found["val_bpb"] == pytest.approx(m["final"]["val_bpb"], rel=BPB_REL)
    assert found["mqar_accuracy"] == pytest.approx(m["final"]["mqar_accuracy"], abs=MQAR_ABS)

    # ... and so do the README's (checks.json)
    readme = checks[name]
    assert found["val_bpb"] == pytest.approx(readme["val_bpb"], rel=BPB_REL)
    assert found["mqar_accuracy"] == pytest.approx(readme["mqar_accuracy"], abs=MQAR_ABS)
    assert found["min_head_entropy"] == pytest.approx(readme["min_head_entropy"], abs=ENTROPY_ABS)
    assert found["min_head_entropy_at"] == readme["min_head_entropy_at"]
    assert found["layers_above_noise_list"] == readme["layers_above_noise_list"]
    assert (found["real_word_share"], found["sample_words"]) == (readme["real_word_share"], readme["sample_words"])
    assert (folder / "README.md").is_file()

    unigram = m["data"]["unigram_baseline_bpb"]  # about 4.82 bits/byte on the validation plays
    if name == UNTRAINED:  # worse than guessing bytes by their frequency; MQAR at chance
        assert found["val_bpb"] > unigram and found["mqar_interval"][0] <= found["mqar_chance"]
    else:  # learned real structure, and its card's sample is mostly real words
        assert found["val_bpb"] < unigram - 2.5
        assert check_samples.meets(found["real_word_share"], RECIPE["campaign"]["targets"]["every run real_word_share"])


def test_k3_full_meets_every_target(measured):
    found = measured("k3-full")
    rows = check_samples.target_rows(found, RECIPE["campaign"]["targets"])
    assert {key for key, *_ in rows} == {
        "val_bpb",
        "mqar_accuracy",
        "layers_above_noise",
        "min_head_entropy",
        "real_word_share",
    }
    assert [(key, value, target) for key, value, target, met in rows if not met] == []
    assert found["check_tokens"] == check_samples.CHECK_TOKENS
    assert set(found["layers_above_noise_list"]) <= set(range(found["num_layers"]))
    lo, hi = found["mqar_interval"]
    assert lo <= found["mqar_accuracy"] <= hi
    assert "target val_bpb <= 2.05: " in check_samples.report(found, RECIPE["campaign"]["targets"])


def test_samples_share_data_budget_and_schedule():
    """Every trained sample is one command with its own --set changes and seed; the untrained one is k3-full's
    command with --steps 0."""

    def schedule(name):
        m = load_metrics(SAMPLES / name)
        return {k: v for k, v in m["train_config"].items() if k not in ("out_dir", "overrides", "seed")}, m

    reference, full = schedule("k3-full")
    for name in NAMES:
        tc, m = schedule(name)
        if name == UNTRAINED:
            assert {k for k in tc if tc[k] != reference[k]} == {"steps"} and tc["steps"] == 0
            assert m["seed"] == full["seed"]
            continue
        assert tc == reference, f"{name} was trained differently from k3-full"
        assert m["final"]["tokens_seen"] == full["final"]["tokens_seen"]
        assert m["eval"] == full["eval"]
    assert {load_metrics(SAMPLES / n)["seed"] for n in ("k3-full-s1", "plain-residual-s1")} == {1}


def test_the_untrained_sample_is_k3_fulls_untrained_twin():
    """The app's untrained-twin toggle builds exactly the shipped untrained weights from k3-full's config and seed."""
    from analysis.runs.loading import load_run
    from analysis.runs.twin import untrained_twin

    twin = untrained_twin(load_run(SAMPLES / "k3-full")).model.state_dict()
    shipped = load_run(SAMPLES / UNTRAINED).model.state_dict()
    assert twin.keys() == shipped.keys()
    assert [k for k in twin if not torch.equal(twin[k], shipped[k])] == []


def test_plain_moe_matches_the_active_budget():
    full = load_metrics(SAMPLES / "k3-full")["params"]["active"]
    plain = load_metrics(SAMPLES / "plain-moe")["params"]["active"]
    assert abs(plain - full) / full < 0.005


def test_readme_tables_are_current(checks):
    readme = (SAMPLES / "README.md").read_text()
    assert train_samples.readme_table(RECIPE) in readme
    assert train_samples.campaign_table(RECIPE) in readme
    for run in RECIPE["runs"]:
        assert train_samples.command(RECIPE, run) in readme
    assert set(checks) == set(NAMES)
    assert train_samples.checks_tables() in readme


def test_the_seed_noise_the_app_states_is_the_samples_measured_spread(checks):
    """``SEED_NOISE_BPB`` (the Compare page's and the report's seed noise) is the larger two-seed range of validation
    bits/byte over the configs shipped with two seeds, as the README's comparison reads it."""
    from analysis.compare.seeds import seed_noise
    from analysis.metrics.loss_noise import SEED_NOISE_BPB

    noise = seed_noise(check_samples.runs_table(list(checks.values())))["val_bpb"]
    assert SEED_NOISE_BPB == round(noise, 3)


def test_k3_full_reruns_its_first_50_steps_bit_for_bit(tmp_path):
    assert rerun_start(SAMPLES / "k3-full", tmp_path / "rerun", steps=50) == []
