"""The published Kimi K3 checkpoint's layout (benchmarks/k3_replica.py: compressed-tensors MXFP4 experts, BF16 and F32
tensors, language_model. prefix, vision tensors, index, quantization_config inside text_config), every tensor of
its 2.78T parameters declared, as file holes: what `k3lab inspect`, `k3lab weights` and the placement plan say."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.k3_replica import EXPERT_RE, VISION, k3_config_json, model_shapes, write_replica
from k3core.loading.folder import CheckpointFiles
from k3core.loading.names import counts_as_parameter
from k3core.modeling.model import K3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
EXPERT_BYTES = 17_547_264  # the six stored tensors of one routed expert


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    config_json = k3_config_json()
    replica = write_replica(tmp_path_factory.mktemp("k3") / "Kimi-K3", config_json, model_shapes(config_json))
    return replica


def _cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "k3lab.cli", *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def truncated(tmp_path_factory):
    """The same layout, 3 layers deep (the dense layer, two MoE layers)."""
    config_json = k3_config_json(num_layers=3)
    return write_replica(tmp_path_factory.mktemp("k3") / "Kimi-K3-3", config_json, model_shapes(config_json))


def test_published_layout_headers(truncated):
    shapes, stored = truncated.shapes, truncated.stored
    n_expert_weights = sum(1 for n in shapes if EXPERT_RE.match(n))
    assert n_expert_weights == 2 * 896 * 3
    assert len(stored) == len(shapes) + n_expert_weights + len(VISION)  # packed + scale per expert weight
    files = CheckpointFiles.open(truncated.folder)
    assert files.config.name == "kimi_k3"
    assert files.quantization["format"] == "mxfp4-pack-quantized"
    biases = 2 * 896  # the router selection biases: stored elements, not parameters (checkpoint_files.PARAMETER_RULE)
    assert files.num_parameters == truncated.params + biases
    assert files.skipped == sorted(VISION)
    by_format = files.bytes_by_format()
    assert list(by_format) == ["MXFP4", "BF16", "F32"]
    assert by_format["MXFP4"] == 2 * 896 * EXPERT_BYTES == truncated.stored_bytes(".experts.")
    bf16 = sum(math.prod(s) * 2 for n, (d, s) in stored.items() if d == "BF16" and n not in VISION)
    f32 = sum(math.prod(s) * 4 for n, (d, s) in stored.items() if d == "F32")
    assert (by_format["BF16"], by_format["F32"]) == (bf16, f32)
    assert files.bytes_total == sum(by_format.values())
    expert = files.tensors["model.layers.2.block_sparse_moe.experts.895.w2.weight"]
    assert (expert.dtype, expert.shape, expert.nbytes) == ("MXFP4", (3584, 3072), 3584 * 1536 + 3584 * 96)
    # the placement plan counts what the model computes with, and says what is stored
    plan = K3ForCausalLM.plan_placement(truncated.folder, device="cpu", dtype=None)
    assert plan.stored_parameters == truncated.params + biases
    assert plan.stored_bytes_by_format == by_format
    assert plan.total_bytes == 4 * (truncated.params + biases) - 4 * 32 * 3  # fp32; A_log's padding is not loaded
    assert "MXFP4" in plan.describe()


@pytest.mark.slow
def test_published_layout_inspect_and_weights(published, tmp_path):
    shapes = published.shapes
    doc = json.loads(_cli("inspect", str(published.folder), "--json"))
    assert doc["config"]["name"] == "kimi_k3"
    total = sum(v["total"] for v in doc["parameters"].values())
    assert total == published.params
    check = doc["checkpoint"]["check"]
    assert check["matches_config"], {k: v[:3] for k, v in check.items() if isinstance(v, list)}
    by_layer = {int(k): v for k, v in doc["checkpoint"]["params_by_layer"].items()}
    want = {
        i: sum(math.prod(s) for n, s in shapes.items() if n.startswith(f"model.layers.{i}.") and counts_as_parameter(n))
        for i in range(93)
    }
    assert by_layer == want
    assert 29.9e9 < want[1] < 30.4e9  # an MoE layer: about 30B, not 16.4B of packed bytes
    by_format = doc["checkpoint"]["bytes_by_dtype"]
    assert list(by_format) == ["MXFP4", "BF16", "F32"]
    assert by_format["MXFP4"] == 92 * 896 * EXPERT_BYTES == published.stored_bytes(".experts.")
    assert sum(by_format.values()) == pytest.approx(1.56e12, rel=0.005)

    out = tmp_path / "weights"
    _cli("weights", str(published.folder), "--out", str(out), "--no-static")
    weights = json.loads((out / "weights.json").read_text())
    assert weights["total_params"] == published.params
    assert [entry["params"] for entry in weights["layers"]] == [want[i] for i in range(93)]
    assert weights["bytes_read"] < 1e-3 * weights["bytes_total"]
