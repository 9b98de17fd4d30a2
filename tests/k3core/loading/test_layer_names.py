"""``model.layers.i`` names are parsed once (k3core.loading.names.layer_of): the weights path, the rank plan and
streamed execution read layers through it, and no other module parses them (the check finds a second parser)."""

from __future__ import annotations

import re
from pathlib import Path

from k3core.distributed.rank_plan import layer_bytes
from k3core.loading.names import layer_of
from k3core.loading.streamed_run import streamed_module_of
from tests.repo.scan import matching_lines

ROOT = Path(__file__).resolve().parents[3]
HOME = "k3core/loading/names.py"
# a regex over layer names (model\.layers\.(\d+) ...), or the prefix cut off by hand
_PARSER = re.compile(r"""layers\\\\?\.\(?\\\\?d|startswith\(\s*["']model\.layers\.["']|["']model\.layers\.["']\s*\)""")


def layer_name_parsers(root: Path) -> list[str]:
    return matching_lines(root, ("k3core", "analysis", "app", "k3lab"), _PARSER)


def test_layer_names_are_parsed_once():
    assert {hit.split(":")[0] for hit in layer_name_parsers(ROOT)} == {HOME}


def test_the_layer_name_check_finds_a_second_parser(tmp_path):
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "x.py").write_text(
        "import re\nRE = re.compile(r'^model\\.layers\\.(\\d+)\\.')\nok = name.startswith('model.embed')\n"
        "if name.startswith('model.layers.'):\n    pass\n"
    )
    assert layer_name_parsers(tmp_path) == ["analysis/x.py:2", "analysis/x.py:4"]


def test_layer_of_and_its_callers():
    assert layer_of("model.layers.12.self_attn.q_proj.weight") == (12, "self_attn.q_proj.weight")
    assert layer_of("model.layers.x.mlp") == (None, "model.layers.x.mlp")
    assert layer_of("model.layers.3") == (None, "model.layers.3")  # no name inside the layer
    assert layer_of("lm_head.weight") == (None, "lm_head.weight")
    assert streamed_module_of("model.layers.3.block_sparse_moe.gate.weight") == "model.layers.3.block_sparse_moe"
    assert streamed_module_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp"
    assert streamed_module_of("model.layers.3.input_layernorm.weight") is None
    assert streamed_module_of("model.embed_tokens.weight") == "model.embed_tokens"
    sizes = {"model.embed_tokens.weight": 5, "model.layers.0.mlp.w": 2, "model.layers.1.self_attn.w": 3, "lm_head.w": 7}
    assert layer_bytes(sizes, 2) == ([2, 3], 5, 7)
