"""K3Config: one validated dataclass describing a K3-style model.

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

The named presets live in ``k3core.modeling.presets``; the Hugging Face ``config.json`` mapping (Kimi K3, Kimi
Linear) in ``k3core.modeling.hf_config``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KDA_GATES = ("lower_bound", "softplus")
KDA_OUTPUT_GATES = ("full", "low_rank")
ATTNRES_MODES = ("block_attnres", "full_attnres")  # the residual modes that mix over depth (AttnRes)
RESIDUAL_MODES = (*ATTNRES_MODES, "scale_bias", "plain")
ACTIVATIONS = ("situ", "swiglu")
BALANCING = ("sign", "quantile", "aux_loss", "none")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent."""


# Upper limits on the sizes a config may ask for: generous (Kimi K3: 93 layers, 896 experts, width 7,168,
# vocab 163,840, FFN 33,792), stated in the README, so that a hostile config.json of a few bytes is refused
# before a model, a placement plan or a layer table is sized by it.
LIMITS: dict[str, int] = {
    "num_hidden_layers": 256,
    "num_experts": 2048,
    "vocab_size": 4 * 1024**2,
    "hidden_size": 64 * 1024,
    "intermediate_size": 256 * 1024,
    "moe_intermediate_size": 256 * 1024,
    "routed_expert_hidden_size": 64 * 1024,
    "kda_num_heads": 1024,
    "num_attention_heads": 1024,
    "kda_head_dim": 4096,
    "qk_nope_head_dim": 4096,
    "qk_rope_head_dim": 4096,
    "v_head_dim": 4096,
    "q_lora_rank": 64 * 1024,
    "kv_lora_rank": 64 * 1024,
    "kda_conv_size": 64,
    "kda_chunk_size": 64 * 1024,
    "num_experts_per_token": 2048,
    "num_shared_experts": 64,
    "attn_res_block_size": 256,
    "max_position_embeddings": 2**40,
}
MAX_EXPERT_SLOTS = 256 * 1024  # layers x routed experts (Kimi K3: 83,328): names and views per expert
MAX_NAME_CHARS = 256


def check_limit(key: str, value: object) -> None:
    """ConfigError when ``value`` is an int over LIMITS[key]: checked before the value sizes anything."""
    limit = LIMITS[key]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > limit:
        shown = f"{value:,}" if value < 10**30 else f"a number of {len(str(value))} digits"
        raise ConfigError(f"{key}={shown} is over k3lab's limit of {limit:,}")


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
        for key in ("full_attn_layers", "layer_width_multipliers"):  # before anything walks the lists
            value = getattr(self, key)
            if isinstance(value, (list, tuple)) and len(value) > LIMITS["num_hidden_layers"]:
                raise ConfigError(f"{key} has {len(value):,} entries; at most {LIMITS['num_hidden_layers']} layers")
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
            need(value in allowed, f"{key}={str(value)[:40]!r} is not one of {allowed}")
        for key in LIMITS:
            check_limit(key, getattr(self, key))
        need(len(self.name) <= MAX_NAME_CHARS, f"name has {len(self.name):,} characters; at most {MAX_NAME_CHARS}")
        need(
            self.num_hidden_layers * self.num_experts <= MAX_EXPERT_SLOTS,
            f"{self.num_hidden_layers} layers x {self.num_experts} experts is over k3lab's limit of "
            f"{MAX_EXPERT_SLOTS:,} expert slots",
        )
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
    def uses_attnres(self) -> bool:
        """Whether the residual stream is an AttnRes mix over depth (block or full), not an additive one."""
        return self.residual in ATTNRES_MODES

    @property
    def is_latent_moe(self) -> bool:
        return self.num_experts > 0 and self.routed_expert_hidden_size is not None

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> K3Config:
        """Build from k3lab's own config dict (a Hugging Face one is read by
        ``k3core.modeling.hf_config.config_from_hf``)."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            hint = (
                " (a Hugging Face config.json? read it with k3core.modeling.hf_config.config_from_hf)"
                if {"model_type", "text_config", "linear_attn_config"} & set(unknown)
                else ""
            )
            raise ConfigError(f"unknown config fields: {unknown}{hint}")
        try:
            return cls(**data)
        except TypeError as exc:  # pragma: no cover - dataclass signature errors
            raise ConfigError(str(exc)) from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> K3Config:
        """Read a config saved by :meth:`save` (k3lab's own format)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def replace(self, **changes: Any) -> K3Config:
        return dataclasses.replace(self, **changes)


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
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "..."
            raise ConfigError(f"{f.name} must be of type {f.type}, got {shown} ({type(value).__name__})")
