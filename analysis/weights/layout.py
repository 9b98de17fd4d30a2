"""A checkpoint's layout from its tensor names and header shapes alone: which decoder layer a tensor is in,
each layer's mixer (KDA / MLA) and FFN (dense / MoE), parameters by depth and kind, and which tensors the
weight summary reads."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from k3core.loading.names import counts_as_parameter, layer_of
from k3core.modeling.config import K3Config

EXPERT_RE = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
COMPONENTS = (  # what ``tensor_kind`` answers, in reading order
    "embedding",
    "KDA attention",
    "MLA attention",
    "dense FFN",
    "MoE router",
    "MoE routed experts",
    "MoE shared experts",
    "MoE latent projections",
    "residual (AttnRes / scale-bias)",
    "norms",
    "LM head",
)
# The coarser kinds of parameters by depth (``params_by_depth``): components grouped.
KINDS = ("KDA", "MLA", "dense FFN", "routed experts", "shared experts", "norms/other", "embedding / LM head")
KIND_OF_COMPONENT = {
    "embedding": "embedding / LM head",
    "LM head": "embedding / LM head",
    "KDA attention": "KDA",
    "MLA attention": "MLA",
    "dense FFN": "dense FFN",
    "MoE router": "routed experts",
    "MoE routed experts": "routed experts",
    "MoE latent projections": "routed experts",
    "MoE shared experts": "shared experts",
    "residual (AttnRes / scale-bias)": "norms/other",
    "norms": "norms/other",
}
NORMS = {  # label -> tensor suffix inside a decoder layer
    "input": "input_layernorm.weight",
    "post_attention": "post_attention_layernorm.weight",
    "kda_o_norm": "self_attn.o_norm.weight",
    "latent_expert_norm": "block_sparse_moe.routed_expert_norm.weight",
}


def numel(meta: Any) -> int:
    """Element count of a tensor meta: its ``numel``, else the product of its ``shape``."""
    n = getattr(meta, "numel", None)
    return int(n) if n is not None else math.prod(meta.shape)  # Python ints: 250K names in a second, no overflow


def num_layers_of(names: Iterable[str], config: K3Config | None = None) -> int:
    """Decoder layer count: the config's, else one more than the largest ``model.layers.i`` index."""
    if config is not None:
        return int(config.num_hidden_layers)
    idx = [i for i, _ in map(layer_of, names) if i is not None]
    return max(idx) + 1 if idx else 0


def layer_structure(names: Iterable[str], config: K3Config | None = None) -> pd.DataFrame:
    """Per decoder layer: mixer ("kda" if it has ``self_attn.A_log`` / ``dt_bias``, "mla" otherwise) and
    ffn ("moe" if it has a router ``block_sparse_moe.gate.weight``, else "dense"). Without any
    ``self_attn`` tensor in a layer the config decides."""
    names = list(names)
    n = num_layers_of(names, config)
    kda, mla, moe = set(), set(), set()
    for name in names:
        i, rest = layer_of(name)
        if i is None:
            continue
        if rest in ("self_attn.A_log", "self_attn.dt_bias"):
            kda.add(i)
        elif rest.startswith("self_attn."):
            mla.add(i)
        if rest == "block_sparse_moe.gate.weight":
            moe.add(i)
    rows = []
    for i in range(n):
        if i in kda:
            mixer = "kda"
        elif i in mla or config is None:
            mixer = "mla"
        else:
            mixer = "mla" if config.is_mla_layer(i) else "kda"
        rows.append({"layer": i, "mixer": mixer, "ffn": "moe" if i in moe else "dense"})
    return pd.DataFrame(rows, columns=["layer", "mixer", "ffn"])


def tensor_kind(name: str, mixer: str | None = None) -> str:
    """Which component of the model a (canonical) tensor belongs to (one of ``COMPONENTS``; the one classifier
    behind ``k3lab inspect``'s parameter counts and the parameters by depth), from its name and its layer's
    mixer ("kda" / "mla"; None outside the decoder layers):

    - "embedding" / "LM head": ``model.embed_tokens``, ``lm_head``;
    - "KDA attention" / "MLA attention": ``self_attn.*`` of a KDA / MLA layer;
    - "dense FFN": ``mlp.*`` (and transformers' dense ``block_sparse_moe.{gate,up,down}_proj``);
    - "MoE router" (``block_sparse_moe.gate.*``: weights and selection bias), "MoE routed experts"
      (``block_sparse_moe.experts.*``), "MoE shared experts", "MoE latent projections" (the rest of the MoE
      block: latent down/up projections and norm);
    - "residual (AttnRes / scale-bias)": AttnRes pseudo-queries and key norms, scale/bias residuals, the
      output mix; "norms": every other tensor (layer norms, the final norm).
    """
    rest = layer_of(name)[1]
    if rest.startswith("block_sparse_moe.experts."):  # first: nearly every tensor of a big MoE checkpoint
        return "MoE routed experts"
    if rest.startswith("model.embed_tokens"):
        return "embedding"
    if rest.startswith("lm_head"):
        return "LM head"
    if "_res_" in rest or rest.startswith("model.output_attn_res"):
        return "residual (AttnRes / scale-bias)"
    if rest.startswith("self_attn."):
        return "MLA attention" if mixer == "mla" else "KDA attention"
    if rest.startswith("mlp.") or rest in _DENSE_UNDER_MOE:
        return "dense FFN"
    if rest.startswith("block_sparse_moe.shared_experts."):
        return "MoE shared experts"
    if rest.startswith("block_sparse_moe.gate."):
        return "MoE router"
    if rest.startswith("block_sparse_moe."):
        return "MoE latent projections"
    return "norms"


_DENSE_UNDER_MOE = frozenset(f"block_sparse_moe.{p}_proj.weight" for p in ("gate", "up", "down"))


def params_by_depth(shapes: Mapping[str, Any], structure: pd.DataFrame) -> pd.DataFrame:
    """Parameters (elements, from header shapes) per depth and kind: ``analysis.metrics.allocation.params_by_kind`` (the
    definition and its rule) counted from what a checkpoint stores, so it answers without a config too. Columns:
    layer (-1 = embedding, n = output: LM head, final norm, output mix), depth ("embedding", "L0".., "output"),
    kind, params. Only (depth, kind) pairs with parameters appear."""
    mixers = dict(zip(structure["layer"], structure["mixer"]))
    n = len(structure)
    totals: dict[tuple[int, str], int] = {}
    for name, meta in shapes.items():
        if not counts_as_parameter(name):  # the router selection bias: a buffer (k3core PARAMETER_RULE)
            continue
        i = layer_of(name)[0]
        if i is None:
            i = -1 if name.startswith("model.embed_tokens") else n
        kind = KIND_OF_COMPONENT[tensor_kind(name, mixers.get(i))]
        totals[(i, kind)] = totals.get((i, kind), 0) + numel(meta)
    rows = [
        {"layer": i, "depth": depth_label(i, n), "kind": kind, "params": p}
        for (i, kind), p in sorted(totals.items(), key=lambda kv: (kv[0][0], KINDS.index(kv[0][1])))
    ]
    df = pd.DataFrame(rows, columns=["layer", "depth", "kind", "params"])
    df.attrs["keys"] = ["layer", "depth", "kind"]
    return df


def depth_label(i: int, n: int) -> str:
    """ "embedding" (i = -1), "L<i>" or "output" (i = n) of a model with n decoder layers."""
    return "embedding" if i < 0 else ("output" if i >= n else f"L{i}")


def small_tensor_names(names: Iterable[str], structure: pd.DataFrame) -> list[str]:
    """The tensors a weight summary reads: KDA A_log / dt_bias, the norms of ``NORMS``, AttnRes
    pseudo-queries, scale/bias residuals, router biases and router weights. Nothing else."""
    wanted_rest = {
        "self_attn.A_log",
        "self_attn.dt_bias",
        "self_attention_res_proj.weight",
        "mlp_res_proj.weight",
        "self_attention_res_scale",
        "self_attention_res_bias",
        "mlp_res_scale",
        "mlp_res_bias",
        "block_sparse_moe.gate.e_score_correction_bias",
        "block_sparse_moe.gate.weight",
        *NORMS.values(),
    }
    out = []
    for name in names:
        i, rest = layer_of(name)
        if (i is not None and rest in wanted_rest) or name == "model.output_attn_res_proj.weight":
            out.append(name)
    return out


def expert_tensor_names(names: Iterable[str]) -> list[str]:
    """Every routed expert matrix (``model.layers.i.block_sparse_moe.experts.E.w{1,2,3}.weight``)."""
    return [n for n in names if (lambda p: p[0] is not None and EXPERT_RE.match(p[1]))(layer_of(n))]
