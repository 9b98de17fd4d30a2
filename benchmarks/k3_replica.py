"""A sparse replica of the published Kimi K3 checkpoint, as its files are laid out (docs/K3_REFERENCE.md):
compressed-tensors MXFP4 routed experts (``weight_packed`` U8 [out, in/2] + ``weight_scale`` U8 [out, in/32],
the six tensors of an expert back to back), everything else BF16 but the F32 tensors, ``language_model.``
prefix, vision tensors, an index, and a config.json with ``quantization_config`` inside ``text_config``.

Every tensor is declared with its published shape; only the planted ones get real bytes, the rest are file holes (a
1.56 TB replica takes a few MB of disk). Used by benchmarks/bench_k3_stream.py and by the tests (benchmarks import
no test code). An independent numpy MXFP4 codec (``mxfp4_encode`` / ``mxfp4_decode``) lets tests plant experts and
compute what k3lab must report without k3lab's own decoder.
"""

from __future__ import annotations

import gc
import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

F32_RULE = re.compile(
    r"\.self_attn\.(A_log|dt_bias|[qkv]_conv1d\.weight|o_norm\.weight)$|\.gate\.e_score_correction_bias$"
)
EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
A_LOG_PAD = 128
SHARD_BYTES = 16_300_000_000  # 96 shards for the full model, as published
VISION = {
    "vision_tower.patch_embed.proj.weight": (1152, 3, 14, 14),
    "vision_tower.blocks.0.attn.qkv.weight": (3456, 1152),
    "mm_projector.proj.0.weight": (7168, 4608),
    "mm_projector.proj.2.weight": (7168, 7168),
}
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantization_config() -> dict:
    """The published ``quantization_config`` (inside ``text_config``)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "torch.uint8",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.*", "lm_head", "re:vision.*"],
    }


def mxfp4_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The issue's rule in numpy, float64: low nibble = column 2k, high = 2k+1, bit 3 sign, 2^(s - 127)."""
    low, high = packed & 15, packed >> 4
    nib = np.stack([low, high], -1).reshape(packed.shape[0], -1)
    values = FP4[nib & 7] * np.where(nib & 8, -1.0, 1.0)
    return values * np.exp2(np.repeat(scale.astype(np.float64) - 127, 32, axis=1))


def random_mxfp4(rng: np.random.Generator, out: int, inp: int, center: int = 120) -> tuple[np.ndarray, np.ndarray]:
    """Random packed bytes and scale exponents around 2^(center - 127)."""
    packed = rng.integers(0, 256, (out, inp // 2), dtype=np.uint8)
    scale = rng.integers(center - 3, center + 3, (out, inp // 32), dtype=np.uint8)
    return packed, scale


def _bytes(value: np.ndarray, dtype: str) -> bytes:
    if dtype == "F32":
        return np.ascontiguousarray(value, dtype=np.float32).tobytes()
    if dtype == "U8":
        return np.ascontiguousarray(value, dtype=np.uint8).tobytes()
    t = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().tobytes()


SIZES = {"F32": 4, "BF16": 2, "U8": 1}


@contextmanager
def no_gc():
    """Python's cyclic collector paused while a replica's headers are built: a full-depth K3 header is ~10^6 small
    dicts and lists, none in a cycle, and the collector rescanning them as they pile up made writing the replica
    2-3x slower (measured). Reference counting still frees everything; the collector resumes at the end."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class Replica:
    folder: Path
    shapes: dict[str, tuple]  # canonical logical shapes (what the model computes with)
    stored: dict[str, tuple[str, tuple]]  # stored name -> (dtype, shape)
    planted: dict[str, np.ndarray] = field(default_factory=dict)
    experts: dict[tuple[int, int], dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)

    @property
    def params(self) -> int:
        """Parameters under k3lab's rule (``checkpoint_files.PARAMETER_RULE``: the router selection bias is not one)."""
        from k3core.loading.names import counts_as_parameter

        return sum(math.prod(s) for n, s in self.shapes.items() if counts_as_parameter(n))

    def stored_bytes(self, pattern: str = "") -> int:
        return sum(math.prod(s) * SIZES[d] for n, (d, s) in self.stored.items() if pattern in n)


def stored_entries(shapes: dict[str, tuple]) -> list[tuple[str, str, tuple]]:
    """(stored name, dtype, shape) in file order: per layer its dense tensors, then each expert's six parts
    back to back (w1 packed, w1 scale, w2 packed, w2 scale, w3 packed, w3 scale)."""
    entries: list[tuple[str, str, tuple]] = []
    experts: dict[tuple[int, int], dict[str, tuple]] = {}
    order: list = []
    for name, shape in shapes.items():
        m = EXPERT_RE.match(name)
        if m:
            key = (int(m.group(1)), int(m.group(2)))
            if key not in experts:
                experts[key] = {}
                order.append(key)
            experts[key][m.group(3)] = shape
            continue
        order.append(name)
    for item in order:
        if isinstance(item, str):
            entries.append((item, "F32" if F32_RULE.search(item) else "BF16", shapes[item]))
            continue
        layer, e = item
        for w in ("w1", "w2", "w3"):
            out, inp = experts[item][w]
            base = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
            entries.append((base + ".weight_packed", "U8", (out, inp // 2)))
            entries.append((base + ".weight_scale", "U8", (out, inp // 32)))
    return entries


@no_gc()
def write_replica(
    folder: Path,
    config_json: dict,
    shapes: dict[str, tuple],
    planted: dict[str, np.ndarray] | None = None,
    experts: dict[tuple[int, int], dict[str, tuple[np.ndarray, np.ndarray]]] | None = None,
    shard_bytes: int = SHARD_BYTES,
    vision: dict[str, tuple] | None = None,
    prefix: str = "language_model.",
) -> Replica:
    """Write the sparse replica (see the module docstring). ``planted``: canonical name -> values (BF16/F32);
    ``experts``: (layer, expert) -> {"w1": (packed, scale), ...} planted MXFP4 parts."""
    planted = planted or {}
    experts = experts or {}
    vision = VISION if vision is None else vision
    folder.mkdir(parents=True, exist_ok=True)
    entries = [(prefix + n, d, s) for n, d, s in stored_entries(shapes)]
    entries += [(n, "BF16", s) for n, s in vision.items()]
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[2]) * SIZES[entry[1]]
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    weight_map, stored, total = {}, {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset, places = 0, []
        # F32 first: every later offset stays 4-byte aligned (all sizes here are even)
        for raw, dtype, shape in sorted(shard, key=lambda e: e[1] != "F32"):
            nbytes = math.prod(shape) * SIZES[dtype]
            header[raw] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            places.append((raw, offset, dtype, shape))
            offset += nbytes
            weight_map[raw] = fname
            stored[raw[len(prefix) :] if raw.startswith(prefix) else raw] = (dtype, shape)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        start = 8 + len(blob)
        with open(folder / fname, "wb") as fh:
            fh.write(len(blob).to_bytes(8, "little") + blob)
            for raw, begin, dtype, _ in places:
                name = raw[len(prefix) :] if raw.startswith(prefix) else raw
                value = planted.get(name)
                m = re.match(
                    r"^(model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123]))\.weight_(\w+)$", name
                )
                if m and (int(m.group(2)), int(m.group(3))) in experts:
                    packed, scale = experts[(int(m.group(2)), int(m.group(3)))][m.group(4)]
                    value = packed if m.group(5) == "packed" else scale
                if value is not None:
                    fh.seek(start + begin)
                    fh.write(_bytes(value, dtype))
            fh.truncate(start + offset)
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config_json, indent=1))
    return Replica(folder, dict(shapes), stored, dict(planted), dict(experts))


def kimi_k3_hf_dict() -> dict:
    """A Kimi K3 config.json (multimodal wrapper, text_config inside) with the published values."""
    full = list(range(4, 93, 4)) + [93]
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "vision_config": {"hidden_size": 1152},
        "text_config": {
            "model_type": "kimi_k3_text",
            "vocab_size": 163840,
            "hidden_size": 7168,
            "num_hidden_layers": 93,
            "num_attention_heads": 96,
            "num_key_value_heads": 96,
            "intermediate_size": 33792,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1048576,
            "tie_word_embeddings": False,
            "hidden_act": "situ",
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "linear_attn_config": {
                "full_attn_layers": full,
                "kda_layers": [i for i in range(1, 94) if i not in full],
                "num_heads": 96,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
                "gate_lower_bound": -5.0,
                "use_full_rank_gate": True,
            },
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "num_experts": 896,
            "num_experts_per_token": 16,
            "num_shared_experts": 2,
            "moe_intermediate_size": 3072,
            "routed_expert_hidden_size": 3584,
            "latent_moe_use_norm": True,
            "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid",
            "routed_scaling_factor": 1.0,
            "first_k_dense_replace": 1,
            "attn_res_block_size": 12,
        },
    }


def k3_config_json(num_layers: int | None = None) -> dict:
    """The published config.json (``kimi_k3_hf_dict``) with ``quantization_config`` inside
    ``text_config``; ``num_layers`` truncates the depth (MLA layers kept where they fall)."""

    data = kimi_k3_hf_dict()
    text = data["text_config"]
    text["quantization_config"] = quantization_config()
    if num_layers is not None:
        lac = text["linear_attn_config"]
        lac["full_attn_layers"] = [i for i in lac["full_attn_layers"] if i <= num_layers]
        lac["kda_layers"] = [i for i in lac["kda_layers"] if i <= num_layers]
        text["num_hidden_layers"] = num_layers
    return data


def model_shapes(config_json: dict) -> dict[str, tuple]:
    """Canonical tensor names and logical shapes of the model a config.json describes, as published
    (A_log padded to 128 entries)."""
    from k3core.loading.pretrained import build_meta_model, published_shapes
    from k3core.modeling.hf_config import config_from_hf
    from k3core.modeling.model import K3ForCausalLM

    shapes = published_shapes(build_meta_model(K3ForCausalLM, config_from_hf(config_json), None))
    for name in list(shapes):
        if name.endswith("self_attn.A_log"):
            shapes[name] = (A_LOG_PAD,)
    return shapes


def forward_plants(
    config_json: dict,
    shapes: dict[str, tuple],
    token_ids: list[int],
    seed: int = 0,
    pool: int = 24,
    planted_experts: int = 4,
) -> tuple[dict[str, np.ndarray], dict[tuple[int, int], dict[str, tuple[np.ndarray, np.ndarray]]]]:
    """Values that make a forward over ``token_ids`` do real work while the rest stays holes: embedding rows
    of those tokens, every norm weight, the KDA gate parameters, and per MoE layer a router whose rows and
    selection bias favour a pool of ``pool`` experts (tokens then choose different top-k subsets of it),
    ``planted_experts`` of which get random MXFP4 values."""
    rng = np.random.default_rng(seed)
    text = config_json.get("text_config", config_json)
    D, E = text["hidden_size"], text["num_experts"]
    planted: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, int], dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    embed = np.zeros((max(token_ids) + 1, D), np.float32)
    embed[token_ids] = rng.normal(0, 1, (len(token_ids), D))
    planted["model.embed_tokens.weight"] = embed  # rows beyond the last planted token stay holes
    for name, shape in shapes.items():
        if name.endswith(("norm.weight", "layernorm.weight")):
            planted[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        elif name.endswith("self_attn.A_log"):
            a = np.zeros(shape, np.float32)
            a[: text["linear_attn_config"]["num_heads"]] = rng.uniform(
                -1.5, 1.5, text["linear_attn_config"]["num_heads"]
            )
            planted[name] = a
        elif name.endswith("self_attn.dt_bias"):
            planted[name] = rng.normal(-2, 1, shape).astype(np.float32)
        elif name.endswith("block_sparse_moe.gate.weight"):
            layer = int(name.split(".")[2])
            chosen = rng.choice(E, pool, replace=False)
            rows = np.zeros(shape, np.float32)
            rows[chosen] = rng.normal(0, 0.05, (pool, D))
            planted[name] = rows
            bias = np.zeros(E, np.float32)
            bias[chosen] = 1.0
            planted[name.replace("gate.weight", "gate.e_score_correction_bias")] = bias
            for e in chosen[:planted_experts]:
                parts = {}
                for w in ("w1", "w2", "w3"):
                    out, inp = shapes[f"model.layers.{layer}.block_sparse_moe.experts.{int(e)}.{w}.weight"]
                    parts[w] = random_mxfp4(rng, out, inp)
                experts[(layer, int(e))] = parts
    return planted, experts
