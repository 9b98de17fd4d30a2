"""``k3lab inspect`` on a checkpoint folder answers from config.json and the safetensors headers alone.

The big case is a checkpoint shaped exactly like Kimi-Linear-48B (every tensor declared, about 98 GB in
bf16 shards of about 5 GB) written as sparse files: headers only, the data regions left as file holes.
"""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch

from k3core.loading.names import keep_fp32
from k3core.loading.pretrained import build_meta_model
from k3core.modeling.config import K3Config
from k3core.modeling.hf_config import config_to_hf
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset
from k3lab import inspect as insp

SHARD_BYTES = 5 * 10**9


def write_sparse(folder, tensors: dict[str, tuple[str, tuple[int, ...]]], shard_bytes: int = SHARD_BYTES) -> int:
    """Safetensors shards + index whose data regions are holes (declared size, almost no disk). Returns bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    width = {"BF16": 2, "F32": 4, "U8": 1}
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        n = math.prod(shape) * width[dtype]
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = (dtype, shape, n)
        size += n
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, (dtype, shape, n) in shard.items():
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / file, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + offset)  # a hole: declared size, no data blocks
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def kimi_linear_tensors(cfg: K3Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the model as the published repo stores it: bf16, the keep-fp32 ones F32, A_log [1, 1, H, 1]."""
    out = {}
    for name, t in build_meta_model(K3ForCausalLM, cfg, torch.bfloat16).state_dict().items():
        shape = tuple(t.shape)
        if name.endswith("self_attn.A_log"):
            shape = (1, 1, shape[0], 1)
        out[name] = ("F32" if keep_fp32(name) else "BF16", shape)
    return out


@pytest.fixture(scope="module")
def sparse_48b(tmp_path_factory):
    cfg = from_preset("kimi-linear-48b")
    folder = tmp_path_factory.mktemp("kimi-linear-48b")
    tensors = kimi_linear_tensors(cfg)
    tensors["vision_tower.patch_embed.weight"] = ("BF16", (1152, 3, 14, 14))  # multimodal: skipped, listed
    declared = write_sparse(folder, tensors)
    (folder / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    return cfg, folder, declared, tensors


def _run(capsys, *argv) -> tuple[int, str]:
    code = insp.main([str(a) for a in argv])
    return code, capsys.readouterr().out


def test_sparse_files_take_no_disk(sparse_48b):
    _, folder, declared, _ = sparse_48b
    used = sum(os.stat(f).st_blocks * 512 for f in folder.iterdir())
    assert declared > 90 * 10**9 and used < 50 * 10**6  # ~98 GB declared, a few MB of headers on disk


def test_inspect_answers_from_headers(sparse_48b, capsys):
    cfg, folder, declared, tensors = sparse_48b
    code, out = _run(capsys, folder, "--json")
    assert code == 0
    payload = json.loads(out)
    ckpt = payload["checkpoint"]
    assert ckpt["bytes_read"] == 0  # not one tensor byte
    assert ckpt["check"]["matches_config"] is True
    assert ckpt["skipped_tensors"] == ["vision_tower.patch_embed.weight"]
    text_model = {k: v for k, v in tensors.items() if not k.startswith("vision_tower.")}
    assert ckpt["bytes_total"] == declared - 1152 * 3 * 14 * 14 * 2
    assert ckpt["tensors"] == len(text_model) and ckpt["files"] > 15  # about 5 GB shards
    # bytes by dtype: F32 only for the keep-fp32 tensors
    f32 = sum(math.prod(s) * 4 for d, s in text_model.values() if d == "F32")
    assert ckpt["bytes_by_dtype"]["F32"] == f32 and set(ckpt["bytes_by_dtype"]) == {"BF16", "F32"}
    # parameter counts from shapes = the model's own count: one rule (k3core PARAMETER_RULE), the router-bias
    # buffers stored in the checkpoint are not parameters
    meta = K3ForCausalLM.from_config(cfg, device="meta")
    total = sum(v["total"] for v in payload["parameters"].values())
    assert total == meta.num_parameters()
    active = sum(v["active"] for v in payload["parameters"].values())
    assert active == pytest.approx(meta.num_parameters(active=True), rel=1e-6)
    assert sum(ckpt["params_by_layer"].values()) == total - 2 * cfg.vocab_size * cfg.hidden_size - cfg.hidden_size


def test_inspect_text_report(sparse_48b, capsys):
    _, folder, _, _ = sparse_48b
    code, out = _run(capsys, folder)
    assert code == 0
    assert "checkpoint files (headers only)" in out and "skipped (not the text model): 1" in out
    assert "every tensor the config needs is there" in out and "BF16" in out and "F32" in out
    assert "layout: kkkMkkkMkkkMkkkMkkkMkkkMkkM" in out


def test_inspect_reports_mismatches_without_failing(tmp_path, capsys):
    cfg = from_preset("k3-nano")
    tensors = kimi_linear_tensors(cfg)
    del tensors["model.layers.2.self_attn.dt_bias"]
    tensors["model.layers.1.block_sparse_moe.experts.0.w1_scales"] = ("U8", (4, 2))  # quantised leftovers
    write_sparse(tmp_path, tensors)
    (tmp_path / "config.json").write_text(cfg.to_json())
    code, out = _run(capsys, tmp_path)
    assert code == 0
    assert "missing: 1: model.layers.2.self_attn.dt_bias" in out
    assert "unexpected: 1: model.layers.1.block_sparse_moe.experts.0.w1_scales" in out and "U8" in out


def test_inspect_bad_folder_is_a_clear_error(tmp_path, capsys):
    code = insp.main([str(tmp_path / "nowhere")])
    assert code == 2 and "no such checkpoint" in capsys.readouterr().err


def test_breakdowns_of_a_model_and_of_its_headers_agree(tmp_path):
    """One per-component count for a model and for its headers (k3core PARAMETER_RULE: the stored router-bias
    buffers are not counted)."""
    from analysis.weights.checkpoint_summary import header_breakdown, parameter_breakdown
    from k3core.loading.folder import CheckpointFiles
    from k3core.loading.names import counts_as_parameter

    torch.manual_seed(0)
    model = K3ForCausalLM.from_config("k3-nano")
    model.save_pretrained(tmp_path / "nano")
    files = CheckpointFiles.open(tmp_path / "nano")
    assert not all(map(counts_as_parameter, files.tensors))  # the buffers are there, in the headers
    assert header_breakdown(files, model.config) == parameter_breakdown(model)
