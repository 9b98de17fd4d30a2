"""K3Config: validation, the layer map, its own dict / JSON form; it imports neither presets nor HF config code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3core.modeling.config import ATTNRES_MODES, RESIDUAL_MODES, ConfigError, K3Config
from k3core.modeling.hf_config import config_to_hf
from k3core.modeling.presets import from_preset
from tests.repo.scan import CODE_FOLDERS, matching_lines


def test_scaled_width_rounds_to_multiples_of_8():
    cfg = from_preset("k3-nano", layer_width_multipliers=[1.0, 0.5, 2.0, 0.01])
    assert [cfg.scaled_width(128, i) for i in range(4)] == [128, 64, 256, 8]


# ----------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("residual", "dense", "residual"),
        ("kda_gate", "exp", "kda_gate"),
        ("kda_output_gate", "none", "kda_output_gate"),
        ("hidden_act", "gelu", "hidden_act"),
        ("balancing", "random", "balancing"),
        ("hidden_size", 0, "hidden_size"),
        ("hidden_size", 64.5, "hidden_size"),
        ("hidden_size", "64", "hidden_size"),
        ("tie_word_embeddings", "yes", "tie_word_embeddings"),
        ("num_experts", None, "num_experts"),
        ("num_experts", -1, "num_experts"),
        ("num_experts_per_token", 9, "num_experts_per_token"),
        ("full_attn_layers", [0], "1-based"),
        ("full_attn_layers", [5], "outside"),
        ("full_attn_layers", [2, 2], "duplicates"),
        ("full_attn_layers", "4", "full_attn_layers"),
        ("kda_gate_lower_bound", 1.0, "kda_gate_lower_bound"),
        ("q_lora_rank", -3, "q_lora_rank"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps"),
        ("rms_norm_eps", 0.0, "rms_norm_eps"),
        ("attn_res_block_size", 0, "attn_res_block_size"),
        ("layer_width_multipliers", [1.0, 1.0], "layer_width_multipliers"),
        ("layer_width_multipliers", [1.0, 0.0, 1.0, 1.0], "layer_width_multipliers"),
        ("first_k_dense_replace", 9, "first_k_dense_replace"),
    ],
)
def test_bad_values_raise_config_error_naming_the_field(field, value, words):
    with pytest.raises(ConfigError, match=words):
        from_preset("k3-nano", **{field: value})


def test_from_dict_rejects_unknown_fields_and_non_objects():
    data = K3Config().to_dict()
    data["hidden_sise"] = 64
    with pytest.raises(ConfigError, match="hidden_sise"):
        K3Config.from_dict(data)
    with pytest.raises(ConfigError, match="JSON object"):
        K3Config.from_dict([1, 2])


def test_dict_and_file_round_trip(tmp_path):
    cfg = from_preset("k3-mini", layer_width_multipliers=[1.0] * 4 + [0.5] * 4, q_lora_rank=None)
    assert K3Config.from_dict(json.loads(cfg.to_json())) == cfg
    cfg.save(tmp_path / "c.json")
    assert K3Config.load(tmp_path / "c.json") == cfg


def test_from_dict_points_a_hugging_face_config_to_its_reader():
    with pytest.raises(ConfigError, match="config_from_hf"):
        K3Config.from_dict(config_to_hf(from_preset("kimi-linear-48b")))


def test_config_module_imports_neither_presets_nor_hf_config():
    """One job per module and no import circle: config.py stands alone."""
    code = (
        "import json, sys, k3core.modeling.config; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('k3core'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["k3core", "k3core.modeling", "k3core.modeling.config"]


ROOT = Path(__file__).resolve().parents[3]
# a tuple literal naming both AttnRes modes, in either order: a second definition of "which modes are AttnRes"
_ATTNRES_TUPLE = re.compile(r"""\(\s*["'](block|full)_attnres["']\s*,\s*["'](block|full)_attnres["']\s*,?\s*\)""")


def attnres_tuples(root: Path) -> list[str]:
    """Every file:line under the code folders that spells the AttnRes residual modes as a tuple literal."""
    return matching_lines(root, CODE_FOLDERS, _ATTNRES_TUPLE)


def test_the_attnres_modes_are_defined_once():
    """``config.uses_attnres`` / ``ATTNRES_MODES`` is the one answer to "does this residual mix over depth"."""
    assert [hit.split(":")[0] for hit in attnres_tuples(ROOT)] == ["k3core/modeling/config.py"]
    assert set(ATTNRES_MODES) < set(RESIDUAL_MODES)
    for mode in RESIDUAL_MODES:
        assert from_preset("k3-nano", residual=mode).uses_attnres == mode.endswith("_attnres")


def test_the_attnres_check_finds_a_second_definition(tmp_path):
    (tmp_path / "analysis").mkdir()
    second = "('full_attnres', " + "'block_attnres')"  # split so that this file holds no such tuple itself
    (tmp_path / "analysis" / "x.py").write_text(f"a = 1\nif cfg.residual in {second}:\n")
    assert attnres_tuples(tmp_path) == ["analysis/x.py:2"]
