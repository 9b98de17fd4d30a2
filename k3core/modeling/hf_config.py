"""The Hugging Face ``config.json`` of Kimi K3 and Kimi Linear, both ways, with their real field names.

- ``config_from_hf(data)`` reads Kimi K3's (``text_config`` inside a ``kimi_k3`` wrapper) and Kimi Linear's
  (``linear_attn_config``; also the one transformers' ``KimiLinearConfig`` writes) into a K3Config;
- ``config_to_hf(config)`` writes a Kimi-Linear-type K3Config as transformers' ``kimi_linear`` config.json,
  plus a ``k3lab`` entry for the fields Hugging Face has no place for, so a save round-trips exactly;
- ``hf_incompatibility(config)`` says why a config has no such form (None when it has one);
- ``is_hf_config(data)`` tells a Hugging Face config.json from k3lab's own.
"""

from __future__ import annotations

import itertools
from typing import Any

from .config import MAX_NAME_CHARS, ConfigError, K3Config, check_limit

HF_MODEL_TYPES = ("kimi_k3", "kimi_linear")
HF_MARKERS = ("text_config", "linear_attn_config")


# Fields with no place in a Hugging Face Kimi Linear config.json (training knobs, inert switches):
# k3lab's own save_pretrained keeps them under a "k3lab" entry.
HF_ABSENT_FIELDS = frozenset(
    {
        "name",
        "kda_chunk_size",
        "balancing",
        "bias_update_rate",
        "aux_loss_coef",
        "situ_beta",
        "situ_linear_beta",
        "latent_moe_use_norm",
        "kda_gate_lower_bound",
        "attn_res_block_size",
    }
)

# MoE fields that mean nothing in a model without experts (kept so a save round-trips exactly).
DENSE_INERT_FIELDS = frozenset(
    {
        "num_experts_per_token",
        "first_k_dense_replace",
        "num_shared_experts",
        "moe_intermediate_size",
        "routed_expert_hidden_size",
        "routed_scaling_factor",
        "latent_moe_use_norm",
    }
)


def is_hf_config(data: Any) -> bool:
    """Is ``data`` a Hugging Face Kimi K3 / Kimi Linear config.json (rather than k3lab's own)?"""
    return isinstance(data, dict) and (data.get("model_type") in HF_MODEL_TYPES or any(m in data for m in HF_MARKERS))


def config_from_hf(data: dict[str, Any]) -> K3Config:
    """Read a Hugging Face ``config.json`` of Kimi K3 or Kimi Linear (their real field names). Raises ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
    try:
        return _from_hf(data)
    except KeyError as exc:
        raise ConfigError(f"Hugging Face config is missing the field {exc}") from exc
    except (TypeError, ValueError, OverflowError, AttributeError) as exc:  # a value of the wrong JSON type
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"Hugging Face config has an invalid value: {str(exc)[:200]}") from exc


def _from_hf(data: dict[str, Any]) -> K3Config:
    text = data.get("text_config", data)
    if not isinstance(text, dict):
        raise ConfigError(f"text_config must be a JSON object, got {type(text).__name__}")
    lac = text.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigError(f"linear_attn_config must be a JSON object, got {type(lac).__name__}")
    n_layers = int(text["num_hidden_layers"])
    check_limit("num_hidden_layers", n_layers)  # before any per-layer list is built from it
    full = _hf_full_attn_layers(text, lac, n_layers)
    # Kimi K3 text configs may omit hidden_act and only carry the SiTU parameters.
    act = text.get("hidden_act", "situ" if "activation_situ_beta" in text else "silu")
    if act not in ("situ", "silu", "swish", "swiglu"):
        raise ConfigError(f"hidden_act {act!r} is not supported (SiTU or SiLU/SwiGLU)")
    _hf_refuse_unsupported(text)
    lower_bound = lac.get("gate_lower_bound")
    latent = text.get("routed_expert_hidden_size")
    num_experts = int(text.get("num_experts") or text.get("n_routed_experts") or text.get("num_local_experts") or 0)
    # transformers' KimiLinearConfig makes the first layer dense unless told otherwise.
    dense_default = 1 if data.get("model_type") == "kimi_linear" else 0
    first_dense = _hf_first_dense(text, n_layers, int(text.get("first_k_dense_replace", dense_default)))
    if first_dense >= n_layers:
        num_experts = 0  # every layer dense: transformers still writes (unused) expert counts
    max_pos = text.get("max_position_embeddings", text.get("model_max_length", 1_048_576))
    kw = dict(
        name=str(data.get("_name_or_path") or data.get("model_type") or text.get("model_type", "hf"))[:MAX_NAME_CHARS],
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_hidden_layers=n_layers,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", data.get("tie_word_embeddings", False))),
        initializer_range=float(text.get("initializer_range", 0.02)),
        max_position_embeddings=int(max_pos),
        full_attn_layers=list(full),
        kda_num_heads=int(lac.get("num_heads", text.get("linear_num_heads", text.get("num_attention_heads")))),
        kda_head_dim=int(lac.get("head_dim", text.get("linear_head_dim", 128))),
        kda_conv_size=int(lac.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4))),
        kda_gate="lower_bound" if lower_bound is not None else "softplus",
        kda_gate_lower_bound=float(lower_bound) if lower_bound is not None else -5.0,
        kda_output_gate="full" if lac.get("use_full_rank_gate", False) else "low_rank",
        num_attention_heads=int(text["num_attention_heads"]),
        q_lora_rank=text.get("q_lora_rank"),
        kv_lora_rank=int(text.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(text.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(text.get("qk_rope_head_dim", 64)),
        v_head_dim=int(text.get("v_head_dim", 128)),
        mla_output_gate=bool(text.get("mla_use_output_gate", False)),
        hidden_act="situ" if act == "situ" else "swiglu",
        situ_beta=float(text.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(text.get("activation_situ_linear_beta", 25.0)),
        intermediate_size=int(text.get("intermediate_size", 4 * int(text["hidden_size"]))),
        num_experts=num_experts,
        num_experts_per_token=int(text.get("num_experts_per_token") or text.get("num_experts_per_tok") or 1),
        num_shared_experts=int(text.get("num_shared_experts") or text.get("n_shared_experts") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 1),
        routed_expert_hidden_size=int(latent) if latent else None,
        latent_moe_use_norm=bool(text.get("latent_moe_use_norm", latent is not None)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=first_dense,
        balancing="sign",
        residual="block_attnres" if text.get("attn_res_block_size") else "plain",
        attn_res_block_size=int(text.get("attn_res_block_size") or 12),
    )
    # Fields a Hugging Face config has no place for, kept by k3lab's own save_pretrained.
    extra = data.get("k3lab")
    if isinstance(extra, dict):
        keep = HF_ABSENT_FIELDS | (DENSE_INERT_FIELDS if not num_experts else frozenset())
        kw.update({k: v for k, v in extra.items() if k in keep})
    return K3Config(**kw)


def hf_incompatibility(config: K3Config) -> str | None:
    """Why ``config`` has no transformers ``kimi_linear`` form, or None when it has one."""
    wants = {
        "kda_gate": "softplus",
        "kda_output_gate": "low_rank",
        "mla_output_gate": False,
        "residual": "plain",
        "hidden_act": "swiglu",
        "layer_width_multipliers": None,
        "tie_word_embeddings": False,
        "mla_norm_eps": 1e-6,
    }
    if config.num_experts:
        wants["routed_expert_hidden_size"] = None
    for key, want in wants.items():
        if getattr(config, key) != want:
            return f"{key}={getattr(config, key)!r} (transformers' Kimi Linear has {want!r})"
    return None


def config_to_hf(config: K3Config) -> dict[str, Any]:
    """``config`` as a transformers ``KimiLinearConfig`` config.json (field names of the published
    Kimi Linear repo), plus a ``k3lab`` entry for the fields Hugging Face has no place for.
    Raises ConfigError when the architecture is not Kimi Linear (see :func:`hf_incompatibility`)."""
    reason = hf_incompatibility(config)
    if reason is not None:
        raise ConfigError(f"config {config.name!r} is not a Kimi Linear architecture: {reason}")
    n = config.num_hidden_layers
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": False,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": True,
        "num_experts": config.num_experts or config.num_experts_per_token,
        "num_experts_per_token": config.num_experts_per_token,
        "num_shared_experts": config.num_shared_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": config.routed_scaling_factor,
        "first_k_dense_replace": config.first_k_dense_replace if config.num_experts else n,
        "linear_attn_config": {
            "full_attn_layers": list(config.full_attn_layers),
            "kda_layers": [i for i in range(1, n + 1) if i not in config.full_attn_layers],
            "num_heads": config.kda_num_heads,
            "head_dim": config.kda_head_dim,
            "short_conv_kernel_size": config.kda_conv_size,
        },
        "k3lab": {
            k: getattr(config, k)
            for k in sorted(HF_ABSENT_FIELDS | (set() if config.num_experts else DENSE_INERT_FIELDS))
        },
    }


def _hf_full_attn_layers(text: dict[str, Any], lac: dict[str, Any], n_layers: int) -> list[int]:
    """1-based MLA layers, in transformers' order of precedence: ``layer_types``, then the
    ``linear_attn_config`` lists, then its default (every 4th layer after the first, 0-based i % 4 == 0)."""
    types = text.get("layer_types")
    if types is not None:
        if (
            not isinstance(types, list)
            or len(types) != n_layers
            or not set(types) <= {"full_attention", "linear_attention"}
        ):
            raise ConfigError(
                f"layer_types must list 'full_attention' / 'linear_attention' for each of the "
                f"{n_layers} layers, got {str(types)[:120]}"
            )
        return [i + 1 for i, t in enumerate(types) if t == "full_attention"]
    if lac.get("full_attn_layers") is not None:
        return list(lac["full_attn_layers"])
    if lac.get("kda_layers") is not None:
        kda = set(lac["kda_layers"])
        return [i for i in range(1, n_layers + 1) if i not in kda]
    return [i + 1 for i in range(n_layers) if i and i % 4 == 0]


def _hf_first_dense(text: dict[str, Any], n_layers: int, default: int) -> int:
    """first_k_dense_replace, from ``mlp_layer_types`` (["dense"] * k + ["sparse"] * rest) when given."""
    types = text.get("mlp_layer_types")
    if types is None:
        return default
    k = sum(1 for _ in itertools.takewhile(lambda t: t == "dense", types)) if isinstance(types, list) else 0
    if not isinstance(types, list) or len(types) != n_layers or types[k:] != ["sparse"] * (n_layers - k):
        raise ConfigError(
            f"mlp_layer_types must be dense layers first, then sparse ones (one per layer); got {str(types)[:120]}"
        )
    return k


def _hf_refuse_unsupported(text: dict[str, Any]) -> None:
    """Options of Hugging Face configs that change the math in ways k3lab does not implement."""
    if text.get("moe_renormalize", text.get("norm_topk_prob", True)) is False:
        raise ConfigError(
            "moe_renormalize / norm_topk_prob = false is not supported (routing weights are "
            "always renormalised over the chosen experts)"
        )
    groups = int(text.get("num_expert_group") or text.get("n_group") or 1)
    if groups > 1 and int(text.get("topk_group") or groups) < groups:
        raise ConfigError(
            f"grouped expert routing (num_expert_group={groups}, topk_group={text.get('topk_group')}) is not supported"
        )
    if text.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(
            f"moe_router_activation_func {text['moe_router_activation_func']!r} is not supported (sigmoid only)"
        )
    if text.get("attention_bias"):
        raise ConfigError("attention_bias = true is not supported (MLA projections have no bias)")
    kv_heads = text.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != int(text["num_attention_heads"]):
        raise ConfigError(
            f"num_key_value_heads={kv_heads} differs from num_attention_heads="
            f"{text['num_attention_heads']} (MLA has one key/value head per query head)"
        )
