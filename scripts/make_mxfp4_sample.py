"""Write sample_checkpoints/k3-mxfp4: the trained ``k3-full`` sample stored the way the published Kimi K3 is.

    python scripts/make_mxfp4_sample.py [--out sample_checkpoints/k3-mxfp4]

- config.json: a ``kimi_k3`` wrapper with the language model in ``text_config`` and compressed-tensors'
  ``quantization_config`` (``mxfp4-pack-quantized``, group 32, uint8 scales) inside it;
- routed experts compressed by compressed-tensors' own MXFP4 compressor (``weight_packed`` + ``weight_scale``,
  the six tensors of an expert back to back), everything else BF16 except the F32 tensors (keep-fp32 rule),
  all under ``language_model.``, plus one vision tensor that is not part of the text model.

MXFP4 groups 32 inputs, so the expert width 40 is padded to 64 with zero units first (zero gate and up rows,
zero down columns: SiTU(0, 0) = 0, so the padded model computes exactly what ``k3-full`` computes); the
shared expert, whose width follows, is padded the same way. Needs compressed-tensors (the test extra).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3core.loading.names import keep_fp32  # noqa: E402
from k3core.modeling.config import K3Config  # noqa: E402
from k3core.modeling.model import K3ForCausalLM  # noqa: E402

WIDTH = 64  # expert width after padding: a multiple of MXFP4's group of 32
EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
MXFP4_ARGS = dict(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8)


def text_config(cfg: K3Config) -> dict:
    """The Hugging Face Kimi K3 ``text_config`` of a K3Config (the fields k3core.modeling.hf_config reads)."""
    full = list(cfg.full_attn_layers)
    return {
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "max_position_embeddings": cfg.max_position_embeddings,
        "linear_attn_config": {
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, cfg.num_hidden_layers + 1) if i not in full],
            "num_heads": cfg.kda_num_heads,
            "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.kda_conv_size,
            "gate_lower_bound": cfg.kda_gate_lower_bound,
            "use_full_rank_gate": cfg.kda_output_gate == "full",
        },
        "num_attention_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": cfg.mla_output_gate,
        "hidden_act": cfg.hidden_act,
        "activation_situ_beta": cfg.situ_beta,
        "activation_situ_linear_beta": cfg.situ_linear_beta,
        "intermediate_size": cfg.intermediate_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_expert_hidden_size": cfg.routed_expert_hidden_size,
        "latent_moe_use_norm": cfg.latent_moe_use_norm,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "attn_res_block_size": cfg.attn_res_block_size,
    }


def quantization_config() -> dict:
    from compressed_tensors.quantization import QuantizationArgs

    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": QuantizationArgs(**MXFP4_ARGS).model_dump(mode="json"),
                "input_activations": None,
                "output_activations": None,
                "format": "mxfp4-pack-quantized",
            }
        },
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.*", "lm_head", "re:vision.*"],
    }


def padded(model: K3ForCausalLM) -> dict[str, torch.Tensor]:
    """The published state dict with the expert (and shared expert) width padded to WIDTH by zero units."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    m = model.config.moe_intermediate_size
    n_shared = model.config.num_shared_experts
    for name in list(state):
        t = state[name]
        match = EXPERT.match(name)
        if match:
            w = match.group(3)
            state[name] = torch.nn.functional.pad(t, (0, WIDTH - m) if w == "w2" else (0, 0, 0, WIDTH - m))
        elif ".shared_experts." in name:
            pad = n_shared * (WIDTH - m)
            state[name] = torch.nn.functional.pad(t, (0, pad) if "down_proj" in name else (0, 0, 0, pad))
    return state


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own MXFP4 quantisation of one matrix: (packed U8, scale U8)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**MXFP4_ARGS)
    groups = weight.reshape(weight.shape[0], -1, 32)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    parts = MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale}, QuantizationScheme(
        targets=["Linear"], weights=args))  # fmt: skip
    return parts["weight_packed"].contiguous(), parts["weight_scale"].contiguous()


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file with the tensors in the given order (safetensors' own writer sorts them), each
    offset aligned to 8 bytes by ordering (every size here is a multiple of 8 but the F32 vectors, which go first)."""
    header, blobs, offset = {"__metadata__": {"format": "pt", "producer": "k3lab make_mxfp4_sample"}}, [], 0
    dtypes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}
    for name, t in tensors:
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + b"".join(blobs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default=str(ROOT / "sample_checkpoints" / "k3-full"))
    p.add_argument("--out", default=str(ROOT / "sample_checkpoints" / "k3-mxfp4"))
    args = p.parse_args()
    source = K3ForCausalLM.from_pretrained(args.source)
    cfg = K3Config.from_dict({**source.config.to_dict(), "moe_intermediate_size": WIDTH, "name": "k3-mxfp4"})
    state = padded(source)
    f32, rest = [], []
    experts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        match = EXPERT.match(name)
        if match:
            experts.setdefault((int(match.group(1)), int(match.group(2))), {})[match.group(3)] = t
        elif keep_fp32(name):
            f32.append(("language_model." + name, t.float()))
        else:
            rest.append(("language_model." + name, t.to(torch.bfloat16)))
    ordered = f32 + rest
    for (layer, e), weights in sorted(experts.items()):
        for w in ("w1", "w2", "w3"):
            packed, scale = mxfp4(weights[w].float())
            base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
            ordered += [(base + ".weight_packed", packed), (base + ".weight_scale", scale)]
    ordered.append(("vision_tower.patch_embed.proj.weight", torch.zeros(8, 3, 2, 2, dtype=torch.bfloat16)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", ordered)
    text = {**text_config(cfg), "quantization_config": quantization_config()}
    config = {
        "_name_or_path": "k3-mxfp4",
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"hidden_size": 8},
        "k3lab": {k: cfg.to_dict()[k] for k in ("kda_chunk_size", "balancing", "bias_update_rate", "aux_loss_coef")},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out} ({(out / 'model.safetensors').stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
