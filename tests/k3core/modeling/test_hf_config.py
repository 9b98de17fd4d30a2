"""Hugging Face config.json (Kimi K3, Kimi Linear) read into a K3Config with their real field names."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.k3_replica import kimi_k3_hf_dict
from k3core.modeling.config import ConfigError, K3Config
from k3core.modeling.hf_config import config_from_hf, config_to_hf, is_hf_config
from k3core.modeling.presets import from_preset


def kimi_linear_hf_dict() -> dict:
    """A Kimi Linear 48B-A3B config.json (flat, no text_config)."""
    full = [4, 8, 12, 16, 20, 24, 27]
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 163840,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 27,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "moe_intermediate_size": 1024,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "linear_attn_config": {
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, 28) if i not in full],
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
    }


def _differences(a: K3Config, b: K3Config, ignore: set[str]) -> dict:
    return {
        f.name: (getattr(a, f.name), getattr(b, f.name))
        for f in dataclasses.fields(K3Config)
        if f.name not in ignore and getattr(a, f.name) != getattr(b, f.name)
    }


def test_hf_kimi_k3_config_matches_the_preset():
    cfg = config_from_hf(kimi_k3_hf_dict())
    assert _differences(cfg, from_preset("kimi-k3"), ignore={"name"}) == {}


def test_hf_kimi_k3_config_without_hidden_act_or_full_layer_list():
    data = kimi_k3_hf_dict()
    text = data["text_config"]
    del text["hidden_act"]  # only the SiTU parameters say which activation it is
    del text["linear_attn_config"]["full_attn_layers"]  # derived from kda_layers
    cfg = config_from_hf(data)
    assert cfg.hidden_act == "situ" and cfg.situ_beta == 4.0 and cfg.situ_linear_beta == 25.0
    assert cfg.full_attn_layers == from_preset("kimi-k3").full_attn_layers


def test_hf_kimi_linear_config_matches_the_preset():
    cfg = config_from_hf(kimi_linear_hf_dict())
    preset = from_preset("kimi-linear-48b")
    # Fields that have no effect for this model (plain residual, SwiGLU, softplus gate, plain MoE).
    inert = {
        "name",
        "attn_res_block_size",
        "latent_moe_use_norm",
        "situ_beta",
        "situ_linear_beta",
        "kda_gate_lower_bound",
    }
    assert _differences(cfg, preset, ignore=inert) == {}
    assert cfg.kda_gate == "softplus" and cfg.kda_output_gate == "low_rank" and not cfg.mla_output_gate
    assert cfg.residual == "plain" and cfg.hidden_act == "swiglu" and cfg.routed_expert_hidden_size is None


def test_hf_config_errors_are_config_errors():
    data = kimi_linear_hf_dict()
    del data["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        config_from_hf(data)
    data = kimi_k3_hf_dict()
    data["text_config"]["num_hidden_layers"] = "many"
    with pytest.raises(ConfigError):
        config_from_hf(data)


def test_is_hf_config_tells_the_two_formats_apart():
    assert is_hf_config(kimi_k3_hf_dict()) and is_hf_config(kimi_linear_hf_dict())
    assert is_hf_config(config_to_hf(from_preset("kimi-linear-48b")))
    assert not is_hf_config(from_preset("kimi-linear-48b").to_dict())
    assert not is_hf_config([1, 2])
