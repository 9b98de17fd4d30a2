"""The names of stored tensors: one table of the variants published checkpoints use, and two rules on names.

``canonical_name`` maps a stored name to k3core's state-dict name through ``NAME_TABLE`` (or None for a tensor
that is not part of the text model); ``keep_fp32`` says which tensors stay fp32 whatever the load dtype;
``counts_as_parameter`` applies ``PARAMETER_RULE``, the one parameter-count rule.
"""

from __future__ import annotations

import functools
import re

LAYER_PREFIX = "model.layers."


def layer_of(name: str) -> tuple[int | None, str]:
    """(decoder layer index, name inside the layer) of ``model.layers.i.<rest>``; (None, name) for any other name.
    The one parser of layer names (weights path, rank plan, streamed execution)."""
    # str methods, not a regex: this runs for every tensor name (250k for Kimi K3), several times
    if not name.startswith(LAYER_PREFIX):
        return None, name
    idx, _, rest = name[len(LAYER_PREFIX) :].partition(".")
    return (int(idx), rest) if idx.isdigit() and rest else (None, name)


# ---------------------------------------------------------------------------------- name table
# Each rule is (kind, pattern, replacement) applied in order to a stored tensor name:
#   strip: remove a prefix;  skip: the tensor is not part of the text model;  rename: regex substitution.
NAME_TABLE: tuple[tuple[str, str, str], ...] = (
    ("strip", "language_model.", ""),  # Kimi K3 repo: the text model of a multimodal checkpoint
    ("skip", "vision_tower.", ""),
    ("skip", "vision_model.", ""),
    ("skip", "mm_projector.", ""),
    ("skip", "multi_modal_projector.", ""),
    ("skip", "audio_tower.", ""),
    # transformers-saved Kimi Linear: the dense layer's MLP under block_sparse_moe (a routed layer's
    # router is block_sparse_moe.gate.weight, never gate_proj, so this cannot catch an MoE tensor)
    ("rename", r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate|up|down)_proj\.weight$", r"\1mlp.\2_proj.weight"),
)

# Tensors the published checkpoints store in fp32 and the reference computes in fp32: they stay fp32
# whatever dtype the model is loaded in (rounding the router bias to bf16 changes which experts win).
KEEP_FP32_PATTERNS: tuple[str, ...] = (
    r"\.self_attn\.A_log$",
    r"\.self_attn\.dt_bias$",
    r"\.self_attn\.[qkv]_conv1d\.weight$",
    r"\.self_attn\.o_norm\.weight$",
    r"\.gate\.e_score_correction_bias$",
)
_KEEP_FP32 = re.compile("|".join(KEEP_FP32_PATTERNS))

# The parameter-count rule, one for the model, the model card, the Weights page and ``inspect``: parameters are
# the tensors training learns by gradient (``nn.Parameter``). The router selection bias is a buffer that load
# balancing sets (it steers which experts are chosen, never their weights): stored in the checkpoint, not counted.
NOT_PARAMETER_PATTERNS: tuple[str, ...] = (r"\.gate\.e_score_correction_bias$",)
_NOT_PARAMETER = re.compile("|".join(NOT_PARAMETER_PATTERNS))
PARAMETER_RULE = (
    "Learned weights (nn.Parameter) of the text model, tied weights once; the router selection bias "
    "(e_score_correction_bias, a load-balancing buffer) is stored but not counted."
)


def counts_as_parameter(name: str) -> bool:
    """Whether a checkpoint tensor counts as parameters under ``PARAMETER_RULE`` (router selection bias: no)."""
    return _NOT_PARAMETER.search(name) is None


def canonical_name(raw: str) -> str | None:
    """k3core's state-dict name for a stored tensor name, or None when it is not part of the text model."""
    name = raw
    for kind, pattern, replacement in NAME_TABLE:
        if kind == "strip" and name.startswith(pattern):
            name = name[len(pattern) :]
        elif kind == "skip" and name.startswith(pattern):
            return None
        elif kind == "rename":
            name = _compiled(pattern).sub(replacement, name)
    return name


@functools.cache
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def keep_fp32(name: str) -> bool:
    """Whether the tensor ``name`` (canonical) is kept in fp32 whatever dtype the model is loaded in."""
    return _KEEP_FP32.search(name) is not None
