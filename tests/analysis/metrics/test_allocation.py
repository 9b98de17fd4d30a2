"""Layer allocation from a config (analysis.metrics.allocation): per-layer params equal the model's; FLOPs, cache by
hand."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from analysis.metrics import allocation as al
from analysis.weights.layout import layer_structure, params_by_depth
from k3core.loading.folder import CheckpointFiles
from k3core.loading.names import counts_as_parameter
from k3core.loading.pretrained import build_meta_model, published_shapes
from k3core.modeling.cache import K3Cache
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import PRESETS, from_preset
from tests.conftest import nano_model, random_ids

VARIANTS = [
    ("k3-nano", {}),
    ("k3-mini", {}),
    ("k3-nano", dict(residual="scale_bias", num_experts=0)),
    ("k3-nano", dict(residual="plain", kda_gate="softplus")),
    (
        "k3-nano",
        dict(
            residual="full_attnres",
            routed_expert_hidden_size=None,
            kda_output_gate="low_rank",
            q_lora_rank=None,
            mla_output_gate=False,
            latent_moe_use_norm=False,
            layer_width_multipliers=[1.0, 0.5, 2.0, 1.5],
        ),
    ),
    ("k3-nano", dict(tie_word_embeddings=True, num_shared_experts=0, first_k_dense_replace=0)),
    ("kimi-linear-48b", {}),
]


@pytest.mark.parametrize("preset,overrides", VARIANTS)
def test_parameter_counts_match_the_model_per_layer_and_in_total(preset, overrides):
    cfg = from_preset(preset, **overrides)
    small = cfg.hidden_size <= 512  # build the small ones for real, the published sizes on the meta device
    model = K3ForCausalLM.from_config(cfg, device="cpu" if small else "meta")
    alloc = al.layer_allocation(cfg)
    layers = alloc[alloc["part"].str.startswith("L")]
    assert list(layers["params"]) == [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert alloc["params"].sum() == model.num_parameters()
    assert alloc["active_params"].sum() == model.num_parameters(active=True)


SAMPLES = sorted(p for p in (Path(__file__).resolve().parents[3] / "sample_checkpoints").glob("*/config.json"))


def _stored_by_kind(shapes: dict, cfg) -> pd.DataFrame:
    return params_by_depth(shapes, layer_structure(shapes, cfg)).reset_index(drop=True)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameters_by_kind_from_the_config_equal_the_stored_shapes_of_every_preset(preset):
    """The one definition (params_by_kind) and the count from a checkpoint's shapes (params_by_depth) agree on
    every (layer, kind)."""
    cfg = from_preset(preset)
    shapes = {
        k: SimpleNamespace(shape=s) for k, s in published_shapes(build_meta_model(K3ForCausalLM, cfg, None)).items()
    }
    pd.testing.assert_frame_equal(_stored_by_kind(shapes, cfg), al.params_by_kind(cfg))


@pytest.mark.parametrize("preset,overrides", VARIANTS[2:6])  # the layouts no preset has
def test_parameters_by_kind_equal_the_stored_shapes_of_each_layout(preset, overrides):
    cfg = from_preset(preset, **overrides)
    shapes = {
        k: SimpleNamespace(shape=s) for k, s in published_shapes(build_meta_model(K3ForCausalLM, cfg, None)).items()
    }
    pd.testing.assert_frame_equal(_stored_by_kind(shapes, cfg), al.params_by_kind(cfg))


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.parent.name)
def test_parameters_by_kind_equal_the_headers_of_every_sample(sample):
    files = CheckpointFiles.open(sample.parent)
    assert len(SAMPLES) >= 4  # the glob found the shipped samples
    by_kind = al.params_by_kind(files.config)
    pd.testing.assert_frame_equal(_stored_by_kind(files.tensors, files.config), by_kind)
    # k3core PARAMETER_RULE: the router-bias buffers are stored, not counted; the allocation table sums the same
    stored = [(name, t.numel) for name, t in files.tensors.items()]
    assert any(not counts_as_parameter(name) for name, _ in stored) == bool(files.config.num_experts)
    assert by_kind["params"].sum() == sum(n for name, n in stored if counts_as_parameter(name))
    assert by_kind["params"].sum() == al.layer_allocation(files.config)["params"].sum()


def test_parameter_counts_match_kimi_k3_on_meta():
    cfg = from_preset("kimi-k3")
    model = K3ForCausalLM.from_config(cfg, device="meta")
    alloc = al.layer_allocation(cfg)
    assert alloc["params"].sum() == model.num_parameters()
    assert alloc["active_params"].sum() == model.num_parameters(active=True)
    assert abs(alloc["params"].sum() / 2.78e12 - 1) < 0.03
    assert list(alloc["ffn_kind"][1:-1]) == ["dense FFN"] + ["LatentMoE"] * 92


def test_allocation_columns_for_k3_nano_by_hand():
    cfg = from_preset("k3-nano")  # D 64, KDA H 2 d 16 conv 4, dense FFN 128 in layer 0
    alloc = al.layer_allocation(cfg, seq_len=1000).set_index("part")
    # KDA matmuls: q,k,v,o 4*64*32 + convs 3*32*4 + f_a 64*16 + f_b 16*32 + b 64*2 + gate 64*32; FFN 3*64*128
    kda_mm = 4 * 64 * 32 + 3 * 32 * 4 + 64 * 16 + 16 * 32 + 64 * 2 + 64 * 32
    assert alloc.loc["L0", "matmul_flops"] == 2 * (kda_mm + 3 * 64 * 128)
    assert alloc.loc["L0", "mixing_flops"] == 7 * 2 * 16**2
    # MLA (layer 3): 2 H (d_qk + d_v) (T + 1) / 2 = 2 * 2 * (24 + 16) * 500.5
    assert alloc.loc["L3", "mixing_flops"] == pytest.approx(2 * 2 * 40 * 500.5)
    assert list(alloc.loc[["L0", "L1", "L2", "L3"], "layer_type"]) == ["KDA", "KDA", "KDA", "MLA"]
    assert list(alloc.loc[["L0", "L1"], "ffn_kind"]) == ["dense FFN", "LatentMoE"]
    # cache: KDA 4*2*16*16 + 3*3*2*16*2 ; MLA (16 + 8) * 1000 * 2
    assert alloc.loc["L0", "cache_bytes"] == 4 * 2 * 16 * 16 + 3 * 3 * 2 * 16 * 2
    assert alloc.loc["L3", "cache_bytes"] == 24 * 1000 * 2
    assert alloc.loc["embedding", "flops"] == 0
    assert alloc.loc["output", "matmul_flops"] == 2 * 64 * 256


def test_decode_mode_counts_all_keys():
    cfg = from_preset("k3-nano")
    assert al.sequence_mixing_flops(cfg, 3, 100, mode="decode") == 2 * 2 * 40 * 100
    with pytest.raises(ValueError, match="mode"):
        al.sequence_mixing_flops(cfg, 3, 100, mode="train")


def test_depth_mix_sources_follow_the_block_layout():
    cfg = from_preset("k3-nano")  # 4 layers, block size 2
    assert al.depth_mix_sources(cfg) == {
        "0.mlp": 2,
        "1.attn": 2,
        "1.mlp": 2,
        "2.attn": 2,
        "2.mlp": 3,
        "3.attn": 3,
        "3.mlp": 3,
        "output": 3,
    }
    assert al.depth_mix_sources(from_preset("kimi-k3"))["output"] == 9
    full = al.depth_mix_sources(cfg.replace(residual="full_attnres"))
    assert full["1.attn"] == 3 and full["1.mlp"] == 4 and full["output"] == 9
    assert al.depth_mix_sources(cfg.replace(residual="plain")) == {}


def test_cache_bytes_match_a_real_decode_cache():
    model = nano_model(kda_chunk_size=16)
    cfg = model.config
    cache = K3Cache.for_config(cfg)
    T = 37
    with torch.no_grad():
        model(random_ids(T, B=1), cache=cache)
    expected = sum(al.layer_cache_bytes(cfg, i, T, dtype_bytes=4) for i in range(cfg.num_hidden_layers))
    assert cache.nbytes() == expected


def test_cache_bytes_by_length_kda_flat_mla_linear():
    cfg = from_preset("kimi-k3")
    table = al.cache_bytes_by_length(cfg)
    assert table["seq_len"].min() == 1024 and table["seq_len"].max() == 2**20
    kda = table[table["layer_type"] == "KDA"].set_index("seq_len")["bytes_per_layer"]
    mla = table[table["layer_type"] == "MLA"].set_index("seq_len")["bytes_per_layer"]
    assert kda.nunique() == 1 and kda.iloc[0] == 4 * 96 * 128 * 128 + 3 * 3 * 96 * 128 * 2
    assert mla[2**20] == (512 + 64) * 2**20 * 2
    assert mla[2048] == 2 * mla[1024]
    tot = table[table["layer_type"] == "total"].set_index("seq_len")["bytes"]
    assert tot[2**20] == 69 * kda.iloc[0] + 24 * mla[2**20]
    with pytest.raises(ValueError):
        al.cache_bytes_by_length(cfg, [])
