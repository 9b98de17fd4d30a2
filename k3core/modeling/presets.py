"""Named K3Config presets: the sizes k3lab trains and tests (k3-nano, k3-mini, k3-small), the published
architectures (kimi-linear-48b, kimi-k3) and k3-large (the K3 architecture scaled to one GPU).

``from_preset("k3-nano", residual="plain")`` builds one, with field overrides; ``PRESETS`` maps each name
to its builder.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, K3Config


def _every_fourth(n_layers: int, last_two: bool = False) -> list[int]:
    layers = list(range(4, n_layers + 1, 4))
    if last_two and n_layers not in layers:
        layers.append(n_layers)
    return layers


def _nano() -> K3Config:
    return K3Config(name="k3-nano")


def _mini() -> K3Config:
    # Trainable on a 2-core CPU: 8 layers, MLA every 4th, Block AttnRes over blocks of 2 layers.
    return K3Config(
        name="k3-mini",
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=8,
        full_attn_layers=[4, 8],
        kda_num_heads=4,
        kda_head_dim=32,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=384,
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=1,
        moe_intermediate_size=64,
        routed_expert_hidden_size=64,
        first_k_dense_replace=1,
        residual="block_attnres",
        attn_res_block_size=2,
    )


def _small() -> K3Config:
    return K3Config(
        name="k3-small",
        vocab_size=32768,
        hidden_size=768,
        num_hidden_layers=12,
        full_attn_layers=[4, 8, 12],
        kda_num_heads=6,
        kda_head_dim=128,
        num_attention_heads=6,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=128,
        intermediate_size=3072,
        num_experts=32,
        num_experts_per_token=4,
        num_shared_experts=1,
        moe_intermediate_size=384,
        routed_expert_hidden_size=384,
        first_k_dense_replace=1,
        residual="block_attnres",
        attn_res_block_size=3,
    )


def _kimi_linear_48b() -> K3Config:
    return K3Config(
        name="kimi-linear-48b",
        vocab_size=163840,
        hidden_size=2304,
        num_hidden_layers=27,
        full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
        kda_num_heads=32,
        kda_head_dim=128,
        kda_gate="softplus",
        kda_output_gate="low_rank",
        num_attention_heads=32,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_output_gate=False,
        hidden_act="swiglu",
        intermediate_size=9216,
        num_experts=256,
        num_experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=1024,
        routed_expert_hidden_size=None,
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        residual="plain",
    )


def _kimi_k3() -> K3Config:
    return K3Config(
        name="kimi-k3",
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=93,
        full_attn_layers=_every_fourth(93, last_two=True),
        kda_num_heads=96,
        kda_head_dim=128,
        kda_gate="lower_bound",
        kda_gate_lower_bound=-5.0,
        kda_output_gate="full",
        num_attention_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_output_gate=True,
        hidden_act="situ",
        intermediate_size=33792,
        num_experts=896,
        num_experts_per_token=16,
        num_shared_experts=2,
        moe_intermediate_size=3072,
        routed_expert_hidden_size=3584,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        residual="block_attnres",
        attn_res_block_size=12,
    )


def _k3_large() -> K3Config:
    # The K3 architecture (every mechanism, same head dims and ratios) scaled to about 60B parameters,
    # which is about 120 GB in bf16 and so fits one 141 GB GPU with room for activations.
    return _kimi_k3().replace(
        name="k3-large",
        hidden_size=4096,
        num_hidden_layers=32,
        full_attn_layers=_every_fourth(32),
        kda_num_heads=32,
        num_attention_heads=32,
        q_lora_rank=1024,
        intermediate_size=16384,
        num_experts=128,
        num_experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=2048,
        routed_expert_hidden_size=2048,
        attn_res_block_size=8,
    )


PRESETS = {
    "k3-nano": _nano,
    "k3-mini": _mini,
    "k3-small": _small,
    "kimi-linear-48b": _kimi_linear_48b,
    "k3-large": _k3_large,
    "kimi-k3": _kimi_k3,
}


def from_preset(name: str, **overrides: Any) -> K3Config:
    """The preset ``name`` with ``overrides`` applied to its fields (validated). Raises ConfigError."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]().replace(**overrides) if overrides else PRESETS[name]()
