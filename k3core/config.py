"""K3Config: one validated dataclass describing a K3-style model, with named presets.

Every mechanism is a switch, so that two runs can differ in exactly one of them:

- which layers are MLA (``full_attn_layers``, 1-based as in Hugging Face configs); the rest are KDA
- KDA decay-gate form (``kda_gate``: "lower_bound" as in K3, "softplus" as in Kimi Linear)
- KDA output gate (``kda_output_gate``: "full" rank or "low_rank")
- MLA output gate (``mla_output_gate``)
- residual mode (``residual``: "block_attnres", "full_attnres", "scale_bias", "plain")
- FFN activation (``hidden_act``: "situ" or "swiglu")
- MoE (``num_experts`` = 0 disables it; ``routed_expert_hidden_size`` = None is plain, non-latent MoE)
- balancing (``balancing``: "sign", "quantile", "aux_loss", "none")
- density tiers (``layer_width_multipliers``: one factor per layer on that layer's FFN/expert widths)

``K3Config.from_hf_dict`` reads the ``config.json`` of Kimi K3 (``text_config`` inside a
``kimi_k3`` wrapper) and of Kimi Linear, with their real field names.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KDA_GATES = ("lower_bound", "softplus")
KDA_OUTPUT_GATES = ("full", "low_rank")
RESIDUAL_MODES = ("block_attnres", "full_attnres", "scale_bias", "plain")
ACTIVATIONS = ("situ", "swiglu")
BALANCING = ("sign", "quantile", "aux_loss", "none")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent."""


@dataclass
class K3Config:
    # ---- trunk
    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 4
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 1_048_576
    # MLA layers, 1-based (HF convention); every other layer is KDA
    full_attn_layers: list[int] = field(default_factory=lambda: [4])

    # ---- KDA
    kda_num_heads: int = 2
    kda_head_dim: int = 16
    kda_conv_size: int = 4
    kda_gate: str = "lower_bound"
    kda_gate_lower_bound: float = -5.0
    kda_output_gate: str = "full"
    kda_chunk_size: int = 64

    # ---- gated MLA (NoPE)
    num_attention_heads: int = 2
    q_lora_rank: int | None = 24
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    mla_output_gate: bool = True
    mla_norm_eps: float = 1e-6

    # ---- FFN
    hidden_act: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    intermediate_size: int = 128  # dense FFN width (first_k_dense_replace layers, or all when no MoE)

    # ---- MoE
    num_experts: int = 8  # 0: dense FFN in every layer
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    moe_intermediate_size: int = 32
    routed_expert_hidden_size: int | None = 32  # LatentMoE latent width; None: plain MoE
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    balancing: str = "sign"
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 1e-2

    # ---- residual
    residual: str = "block_attnres"
    attn_res_block_size: int = 2

    # ---- density tiers: per-layer multiplier on FFN / expert widths (None: all 1)
    layer_width_multipliers: list[float] | None = None

    name: str = "custom"

    def __post_init__(self) -> None:
        _check_field_types(self)
        self.full_attn_layers = sorted(self.full_attn_layers)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        choices = {
            "kda_gate": KDA_GATES,
            "kda_output_gate": KDA_OUTPUT_GATES,
            "residual": RESIDUAL_MODES,
            "hidden_act": ACTIVATIONS,
            "balancing": BALANCING,
        }
        for key, allowed in choices.items():
            value = getattr(self, key)
            need(value in allowed, f"{key}={value!r} is not one of {allowed}")
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "kda_num_heads",
            "kda_head_dim",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "intermediate_size",
            "kda_conv_size",
            "kda_chunk_size",
        ):
            need(int(getattr(self, key)) > 0, f"{key} must be a positive integer, got {getattr(self, key)!r}")
        need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim must be >= 0")
        need(
            self.q_lora_rank is None or self.q_lora_rank > 0,
            f"q_lora_rank must be positive or None, got {self.q_lora_rank!r}",
        )
        for key in ("rms_norm_eps", "mla_norm_eps", "situ_beta", "situ_linear_beta", "routed_scaling_factor"):
            need(
                math.isfinite(getattr(self, key)) and getattr(self, key) > 0,
                f"{key} must be a finite positive number, got {getattr(self, key)!r}",
            )
        for key in ("initializer_range", "bias_update_rate", "aux_loss_coef"):
            need(
                math.isfinite(getattr(self, key)) and getattr(self, key) >= 0,
                f"{key} must be a finite number >= 0, got {getattr(self, key)!r}",
            )
        n = self.num_hidden_layers
        bad = [i for i in self.full_attn_layers if not 1 <= i <= n]
        need(not bad, f"full_attn_layers {bad} outside 1..{n} (the list is 1-based)")
        need(len(set(self.full_attn_layers)) == len(self.full_attn_layers), "full_attn_layers has duplicates")
        need(
            math.isfinite(self.kda_gate_lower_bound) and self.kda_gate_lower_bound < 0,
            f"kda_gate_lower_bound must be a finite negative number, got {self.kda_gate_lower_bound!r}",
        )
        if self.num_experts:
            need(self.num_experts >= 1, "num_experts must be >= 0")
            need(
                1 <= self.num_experts_per_token <= self.num_experts,
                f"num_experts_per_token={self.num_experts_per_token} must be in 1..num_experts",
            )
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
            need(self.num_shared_experts >= 0, "num_shared_experts must be >= 0")
            if self.routed_expert_hidden_size is not None:
                need(self.routed_expert_hidden_size > 0, "routed_expert_hidden_size must be positive or None")
            need(0 <= self.first_k_dense_replace <= n, "first_k_dense_replace must be within 0..num_hidden_layers")
        need(self.attn_res_block_size >= 1, "attn_res_block_size must be >= 1")
        if self.layer_width_multipliers is not None:
            need(
                len(self.layer_width_multipliers) == n,
                f"layer_width_multipliers has {len(self.layer_width_multipliers)} entries, expected {n}",
            )
            need(
                all(math.isfinite(m) and m > 0 for m in self.layer_width_multipliers),
                "layer_width_multipliers must be finite and positive",
            )

    # ------------------------------------------------------------------ layer map
    def is_mla_layer(self, layer_idx: int) -> bool:
        """layer_idx is 0-based; full_attn_layers is 1-based."""
        return (layer_idx + 1) in self.full_attn_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.num_experts > 0 and layer_idx >= self.first_k_dense_replace

    def layer_types(self) -> list[str]:
        return ["MLA" if self.is_mla_layer(i) else "KDA" for i in range(self.num_hidden_layers)]

    def width_multiplier(self, layer_idx: int) -> float:
        return 1.0 if self.layer_width_multipliers is None else float(self.layer_width_multipliers[layer_idx])

    def scaled_width(self, width: int, layer_idx: int) -> int:
        """A width after the layer's density-tier multiplier, rounded to a multiple of 8 (at least 8)."""
        m = self.width_multiplier(layer_idx)
        if m == 1.0:
            return width
        return max(8, int(round(width * m / 8)) * 8)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_latent_moe(self) -> bool:
        return self.num_experts > 0 and self.routed_expert_hidden_size is not None

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> K3Config:
        """Build from our own dict or from a Hugging Face Kimi K3 / Kimi Linear config.json dict."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        hf_markers = ("text_config", "linear_attn_config")
        if data.get("model_type") in ("kimi_k3", "kimi_linear") or any(m in data for m in hf_markers):
            return cls.from_hf_dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config fields: {unknown}")
        try:
            return cls(**data)
        except TypeError as exc:  # pragma: no cover - dataclass signature errors
            raise ConfigError(str(exc)) from exc

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> K3Config:
        """Read a Hugging Face ``config.json`` of Kimi K3 or Kimi Linear (their real field names)."""
        try:
            return cls._from_hf_dict(data)
        except KeyError as exc:
            raise ConfigError(f"Hugging Face config is missing the field {exc}") from exc
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"Hugging Face config has an invalid value: {exc}") from exc

    @classmethod
    def _from_hf_dict(cls, data: dict[str, Any]) -> K3Config:
        text = data.get("text_config", data)
        if not isinstance(text, dict):
            raise ConfigError(f"text_config must be a JSON object, got {type(text).__name__}")
        lac = text.get("linear_attn_config") or {}
        n_layers = int(text["num_hidden_layers"])
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
            name=str(data.get("_name_or_path") or text.get("model_type", "hf")),
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
        return cls(**kw)

    def hf_incompatibility(self) -> str | None:
        """Why this config has no transformers ``kimi_linear`` form, or None when it has one."""
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
        if self.num_experts:
            wants["routed_expert_hidden_size"] = None
        for key, want in wants.items():
            if getattr(self, key) != want:
                return f"{key}={getattr(self, key)!r} (transformers' Kimi Linear has {want!r})"
        return None

    def to_hf_dict(self) -> dict[str, Any]:
        """This config as a transformers ``KimiLinearConfig`` config.json (field names of the published
        Kimi Linear repo), plus a ``k3lab`` entry for the fields Hugging Face has no place for.
        Raises ConfigError when the architecture is not Kimi Linear (see :meth:`hf_incompatibility`)."""
        reason = self.hf_incompatibility()
        if reason is not None:
            raise ConfigError(f"config {self.name!r} is not a Kimi Linear architecture: {reason}")
        n = self.num_hidden_layers
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": n,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": self.initializer_range,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "num_experts": self.num_experts or self.num_experts_per_token,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid",
            "num_expert_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace if self.num_experts else n,
            "linear_attn_config": {
                "full_attn_layers": list(self.full_attn_layers),
                "kda_layers": [i for i in range(1, n + 1) if i not in self.full_attn_layers],
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.kda_conv_size,
            },
            "k3lab": {
                k: getattr(self, k)
                for k in sorted(HF_ABSENT_FIELDS | (set() if self.num_experts else DENSE_INERT_FIELDS))
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> K3Config:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def replace(self, **changes: Any) -> K3Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> K3Config:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]().replace(**overrides) if overrides else PRESETS[name]()


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


def _type_ok(value: Any, annotation: str) -> bool:
    """Does ``value`` fit a field annotation such as "int", "float", "int | None" or "list[float] | None"?"""
    for alt in (a.strip() for a in annotation.split("|")):
        if alt == "None" and value is None:
            return True
        if alt == "bool" and isinstance(value, bool):
            return True
        if alt == "str" and isinstance(value, str):
            return True
        if alt == "int" and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return True
        if alt == "float" and isinstance(value, numbers.Real) and not isinstance(value, bool):
            return True
        if alt.startswith("list[") and isinstance(value, (list, tuple)):
            inner = alt[len("list[") : -1]
            if all(_type_ok(v, inner) for v in value):
                return True
    return False


def _check_field_types(config: K3Config) -> None:
    """Raise ConfigError naming the first field whose value does not match its declared type."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not _type_ok(value, str(f.type)):
            raise ConfigError(f"{f.name} must be of type {f.type}, got {value!r} ({type(value).__name__})")


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
