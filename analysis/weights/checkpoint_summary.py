"""What a checkpoint holds, from its headers alone (or a model's shapes): what ``k3lab inspect`` prints and the
Overview page shows.

The key config fields, parameter counts (total and active per token, by component), the layer
map (per layer: KDA/MLA, dense FFN/MoE, width multiplier, parameters, AttnRes block boundaries) and
headline numbers: the final training numbers from metrics.json when present, and with ``--text`` /
``--sample`` those of a quick trace (analysis.metrics.headline.headline_numbers). A checkpoint folder is read
through ``k3core.loading.folder.CheckpointFiles``: config.json and the safetensors headers only
(parameter counts from shapes, bytes by dtype, skipped multimodal tensors, names and shapes checked
against the config), so a 5 TB checkpoint answers in seconds; only ``--text`` / ``--sample`` load
weights. RUN may also be a preset name (``k3lab inspect kimi-k3``): its shapes are built on the meta
device, so any size works, without weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from analysis.weights.layout import COMPONENTS, layer_structure, num_layers_of, params_by_depth, tensor_kind
from k3core.loading.folder import CheckpointFiles
from k3core.loading.names import counts_as_parameter, layer_of
from k3core.modeling.config import K3Config

if TYPE_CHECKING:  # k3core.modeling.model imports torch: loaded only where a model is built
    from k3core.modeling.model import K3ForCausalLM


def config_summary(cfg: K3Config) -> dict[str, Any]:
    """The config fields a reader needs first (the full dict is cfg.to_dict())."""
    out: dict[str, Any] = {
        "name": cfg.name,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        # one layer numbering in the app and its files: 0-based, as the code and the layer map (the HF config's
        # full_attn_layers list is 1-based; it is converted here, never shown raw)
        "mla_layers": [i for i in range(cfg.num_hidden_layers) if cfg.is_mla_layer(i)],
        "kda": f"{cfg.kda_num_heads} heads x {cfg.kda_head_dim}, gate {cfg.kda_gate}"
        + (f" (lower bound {cfg.kda_gate_lower_bound})" if cfg.kda_gate == "lower_bound" else "")
        + f", output gate {cfg.kda_output_gate}, chunk {cfg.kda_chunk_size}",
        "mla": f"{cfg.num_attention_heads} heads, q_lora {cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, "
        f"qk {cfg.qk_nope_head_dim}+{cfg.qk_rope_head_dim} (NoPE), v {cfg.v_head_dim}, "
        f"output gate {cfg.mla_output_gate}",
        "ffn": f"{cfg.hidden_act}, dense width {cfg.intermediate_size}",
        "residual": cfg.residual
        + (f" (block size {cfg.attn_res_block_size})" if cfg.residual == "block_attnres" else ""),
    }
    if cfg.num_experts:
        latent = f", latent {cfg.routed_expert_hidden_size}" if cfg.routed_expert_hidden_size else " (not latent)"
        out["moe"] = (
            f"{cfg.num_experts} experts, top-{cfg.num_experts_per_token}, {cfg.num_shared_experts} shared, "
            f"width {cfg.moe_intermediate_size}{latent}, first {cfg.first_k_dense_replace} layer(s) dense, "
            f"balancing {cfg.balancing}"
        )
    else:
        out["moe"] = "none (dense FFN everywhere)"
    if cfg.layer_width_multipliers is not None:
        out["layer_width_multipliers"] = list(cfg.layer_width_multipliers)
    return out


def component_of(name: str, cfg: K3Config) -> str:
    """Which component a parameter (by its state-dict name) belongs to: ``analysis.weights.layout.tensor_kind``
    with the layer's mixer from the config."""
    i = layer_of(name)[0]
    return tensor_kind(name, None if i is None else ("mla" if cfg.is_mla_layer(i) else "kda"))


def parameter_breakdown(model: K3ForCausalLM) -> dict[str, dict[str, int]]:
    """{component: {"total": n, "active": n}} of the model's parameters (buffers such as the router's selection
    bias are not parameters); routed experts count k of E per token as active."""
    seen: set[int] = set()
    sizes = []
    for name, p in model.named_parameters():
        if id(p) not in seen:  # tied weights count once
            seen.add(id(p))
            sizes.append((name, p.numel()))
    return _breakdown(sizes, model.config)


def header_breakdown(files: CheckpointFiles, cfg: K3Config) -> dict[str, dict[str, int]]:
    """``parameter_breakdown`` from the safetensors headers alone (shapes; no tensor is read; k3core PARAMETER_RULE:
    the router-bias buffers are stored, not counted)."""
    return _breakdown(((name, t.numel) for name, t in files.tensors.items() if counts_as_parameter(name)), cfg)


def _breakdown(sizes: Iterable[tuple[str, int]], cfg: K3Config) -> dict[str, dict[str, int]]:
    out = {c: {"total": 0, "active": 0} for c in COMPONENTS}
    share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
    for name, n in sizes:
        comp = component_of(name, cfg)
        out[comp]["total"] += n
        out[comp]["active"] += round(n * share) if comp == "MoE routed experts" else n
    return {k: v for k, v in out.items() if v["total"]}


def bytes_by_dtype(files: CheckpointFiles) -> dict[str, int]:
    """Declared bytes per storage format (``MXFP4``, ``BF16``, ``F32``, ...), largest first."""
    return files.bytes_by_format()


def params_by_layer(files: CheckpointFiles) -> dict[int, int]:
    """Parameters per decoder layer, from header shapes: ``analysis.weights.layout.params_by_depth`` over its kinds
    (k3core PARAMETER_RULE: no router-bias buffers)."""
    table = params_by_depth(files.tensors, layer_structure(files.tensors, files.config))
    layers = table[(table["layer"] >= 0) & (table["layer"] < num_layers_of(files.tensors, files.config))]
    return {int(i): int(n) for i, n in layers.groupby("layer")["params"].sum().items()}


def header_check(files: CheckpointFiles, cfg: K3Config) -> dict[str, Any]:
    """How the headers compare with the config: tensor names missing / unexpected, shapes that differ."""
    from k3core.loading.pretrained import build_meta_model, published_shapes, stored_shape_ok
    from k3core.modeling.model import K3ForCausalLM

    expected = published_shapes(build_meta_model(K3ForCausalLM, cfg, None))
    missing = sorted(set(expected) - set(files.tensors))
    unexpected = sorted(set(files.tensors) - set(expected))
    shapes = sorted(
        k for k in set(expected) & set(files.tensors) if not stored_shape_ok(k, files.tensors[k].shape, expected[k])
    )
    return {"matches_config": not (missing or unexpected or shapes), "missing": missing, "unexpected": unexpected,
            "mis_shaped": shapes}  # fmt: skip


def checkpoint_summary(files: CheckpointFiles) -> dict[str, Any]:
    """Everything ``k3lab inspect`` says about a checkpoint folder without reading a tensor."""
    cfg = files.config
    return {
        "files": len(files.files),
        "tensors": len(files.tensors),
        "bytes_total": files.bytes_total,
        "bytes_by_dtype": bytes_by_dtype(files),
        "skipped_tensors": list(files.skipped),
        "params_by_layer": params_by_layer(files),
        "check": header_check(files, cfg),
        "bytes_read": files.bytes_read,
    }


def layer_map(cfg: K3Config) -> list[dict[str, Any]]:
    """Per layer: index, mixer (KDA/MLA), FFN (dense FFN / MoE / LatentMoE), FFN width, width multiplier and
    the AttnRes block (block_attnres: a new block starts every attn_res_block_size layers)."""
    rows = []
    for i in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(i)
        ffn = ("LatentMoE" if cfg.is_latent_moe else "MoE") if moe else "dense FFN"
        width = cfg.scaled_width(cfg.moe_intermediate_size if moe else cfg.intermediate_size, i)
        row = {
            "layer": i,
            "mixer": "MLA" if cfg.is_mla_layer(i) else "KDA",
            "ffn": ffn,
            "ffn_width": width,
            "width_mult": cfg.width_multiplier(i),
            "attnres_block": None,
            "block_start": False,
        }
        if cfg.residual == "block_attnres":
            row["attnres_block"] = i // cfg.attn_res_block_size + 1
            row["block_start"] = i % cfg.attn_res_block_size == 0
        rows.append(row)
    return rows
