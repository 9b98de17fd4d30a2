"""k3core.loading.folder: headers first, one tensor at a time, one name table."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3core.loading.folder import CheckpointFiles, folder_fingerprint
from k3core.loading.names import canonical_name, keep_fp32
from k3core.loading.safetensors_header import read_safetensors_header
from k3core.loading.tensor_info import DTYPES, CheckpointError, stored_dtype_name
from k3core.modeling.presets import from_preset


@pytest.fixture
def folder(tmp_path):
    cfg = from_preset("k3-nano")
    (tmp_path / "config.json").write_text(cfg.to_json())
    return tmp_path


def test_name_table_variants():
    assert canonical_name("language_model.model.layers.3.self_attn.A_log") == "model.layers.3.self_attn.A_log"
    assert canonical_name("vision_tower.blocks.0.attn.qkv.weight") is None
    assert canonical_name("mm_projector.linear_1.weight") is None
    # transformers writes the dense layer's MLP under block_sparse_moe
    assert canonical_name("model.layers.0.block_sparse_moe.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    # ... but the router of a routed layer is untouched
    assert (
        canonical_name("model.layers.1.block_sparse_moe.gate.weight") == "model.layers.1.block_sparse_moe.gate.weight"
    )
    assert (
        canonical_name("model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight")
        == "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight"
    )


def test_keep_fp32_rule():
    for name in (
        "model.layers.0.self_attn.A_log",
        "model.layers.0.self_attn.dt_bias",
        "model.layers.0.self_attn.q_conv1d.weight",
        "model.layers.0.self_attn.o_norm.weight",
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
    ):
        assert keep_fp32(name), name
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "lm_head.weight",
    ):
        assert not keep_fp32(name), name


def test_open_sharded_prefixed_multimodal_reads_only_asked_bytes(folder):
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.randn(4, 5).to(torch.bfloat16)
    vision = torch.zeros(1000)
    save_file({"language_model.model.norm.weight": a, "vision_tower.w": vision}, str(folder / "s1.safetensors"))
    save_file({"language_model.lm_head.weight": b}, str(folder / "s2.safetensors"))
    index = {
        "weight_map": {
            "language_model.model.norm.weight": "s1.safetensors",
            "vision_tower.w": "s1.safetensors",
            "language_model.lm_head.weight": "s2.safetensors",
        }
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = CheckpointFiles.open(folder)
    assert set(ck.tensors) == {"model.norm.weight", "lm_head.weight"}
    assert ck.skipped == ["vision_tower.w"]
    assert ck.tensors["lm_head.weight"].dtype == "BF16" and ck.tensors["lm_head.weight"].shape == (4, 5)
    assert ck.num_parameters == 6 + 20
    assert ck.bytes_total == 6 * 4 + 20 * 2
    assert ck.bytes_read == 0
    assert torch.equal(ck.read("model.norm.weight"), a)
    assert ck.bytes_read == 24
    assert torch.equal(ck.read("lm_head.weight"), b)
    assert ck.bytes_read == 24 + 40
    with pytest.raises(CheckpointError, match="no tensor"):
        ck.read("model.missing")


def test_truncated_and_hostile_headers(folder):
    save_file({"x": torch.ones(100)}, str(folder / "model.safetensors"))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointFiles.open(folder)
    (folder / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        CheckpointFiles.open(folder)
    bad = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}).encode()
    (folder / "model.safetensors").write_bytes(len(bad).to_bytes(8, "little") + bad + b"\0" * 8)
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        CheckpointFiles.open(folder)


def test_index_cannot_point_outside_the_folder(folder):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="plain file names"):
        CheckpointFiles.open(folder)


def test_sparse_file_header_only(folder):
    """A 64 GB declared tensor in a file hole: open and fingerprint read only the header."""
    n = 16 * 1024**3  # float32 elements -> 64 GiB
    header = json.dumps({"big": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    file = folder / "model.safetensors"
    with open(file, "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header)
        fh.truncate(8 + len(header) + 4 * n)
    assert os.stat(file).st_blocks * 512 < 1024**2  # really sparse
    start = time.perf_counter()
    ck = CheckpointFiles.open(folder)
    fp = folder_fingerprint(folder)
    assert time.perf_counter() - start < 5
    assert ck.bytes_total == 4 * n and ck.bytes_read == 0 and len(fp) == 64
    hdr, data_start = read_safetensors_header(file)
    assert data_start == 8 + len(header) and hdr["big"]["shape"] == [n]


def test_fingerprint_covers_pickle_weights(folder):
    sd1 = {"model.norm.weight": torch.ones(4)}
    sd2 = {"model.norm.weight": torch.full((4,), 2.0)}
    other = folder / "other"
    other.mkdir()
    (other / "config.json").write_text((folder / "config.json").read_text())
    torch.save(sd1, folder / "pytorch_model.bin")
    torch.save(sd2, other / "pytorch_model.bin")
    # same config, same size, same modification time: only the bytes differ
    assert (folder / "pytorch_model.bin").stat().st_size == (other / "pytorch_model.bin").stat().st_size
    for f in (folder / "pytorch_model.bin", other / "pytorch_model.bin"):
        os.utime(f, ns=(10**18, 10**18))
    a = CheckpointFiles.open(folder)
    assert folder_fingerprint(folder) != folder_fingerprint(other)
    assert torch.equal(a.read("model.norm.weight"), sd1["model.norm.weight"])
    # a pickle holding arbitrary objects is refused without running it
    torch.save({"x": ValueError("not a tensor")}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only"):
        CheckpointFiles.open(folder)


def test_fingerprint_changes_with_weights_not_with_reopen(folder):
    save_file({"x": torch.ones(3)}, str(folder / "model.safetensors"))
    fp1 = folder_fingerprint(folder)
    assert folder_fingerprint(folder) == fp1
    save_file({"x": torch.ones(4)}, str(folder / "model.safetensors"))
    assert folder_fingerprint(folder) != fp1


def test_stored_dtype_names_are_the_inverse_of_dtypes(tmp_path):
    """Every torch dtype a safetensors file can hold is named as its header names it, by the checkpoint reader
    and by the weights path's loaded-model source (one table, DTYPES, and its inverse)."""
    from analysis.weights.source import StateDictSource

    tensors = {name.lower(): torch.zeros(2, dtype=dtype) for name, dtype in DTYPES.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    header, _ = read_safetensors_header(tmp_path / "model.safetensors")
    source = StateDictSource(tensors)
    for name, dtype in DTYPES.items():
        assert stored_dtype_name(dtype) == name == header[name.lower()]["dtype"]
        assert source.tensors[name.lower()].dtype == name
    assert stored_dtype_name(torch.complex64) == "torch.complex64"  # not storable: said as torch says it


def test_no_second_table_of_torch_dtype_names():
    """A string "torch.bfloat16" in the code is a hand-written table of dtype names beside DTYPES."""
    root = Path(__file__).resolve().parents[3]
    found = [f"{p.relative_to(root)}:{n}" for folder in ("k3core", "analysis", "app", "k3lab")
             for p in sorted((root / folder).rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"""["']torch\.(?:b?float\d*|int\d+|uint8|bool|float8_\w+)["']""", line)]  # fmt: skip
    assert found == []
