"""The residual stream between layers: plain, scale/bias, and AttnRes (attention over depth, block or full).

``DepthStream`` holds the depth sources so far (immutable; ``Source`` says what each holds, as data);
``read_input`` and ``add_output`` are how a sub-layer reads and adds to it; ``depth_mix`` is the AttnRes mix of
one site (its depth weights and output are hook points).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import nn

from ...ops.attnres import attnres_combine, attnres_mix
from ..config import ATTNRES_MODES, K3Config
from ..hooks import AttnResSite, HookContext, HookNames, HookPoint, point
from .norm import RMSNorm

_DEPTH = ("source", "batch", "token", "hidden")
_WEIGHTS = ("batch", "token", "source")
_BTD = ("batch", "token", "hidden")

# The hook points of the residual stream (k3core.modeling.hooks). The depth state is offered on request.
STREAM = HookPoint(
    "stream", _DEPTH, "depth state entering the layer: plain/scale_bias [h]; AttnRes its sources (info: sources)",
    on_request=True,
)  # fmt: skip
FINAL_STREAM = HookPoint("final_stream", _DEPTH, "depth state before the output", per_layer=False, on_request=True)
ATTN_RES_WEIGHTS = HookPoint("attn_res.weights", _WEIGHTS, "AttnRes depth weights at the attention input site")
ATTN_RES_MIX = HookPoint("attn_res.mix", _BTD, "its mixed output (= resid_in)")
MLP_RES_WEIGHTS = HookPoint("mlp_res.weights", _WEIGHTS, "AttnRes depth weights at the FFN input site")
MLP_RES_MIX = HookPoint("mlp_res.mix", _BTD, "its mixed output (= ffn_in)")
OUTPUT_RES_WEIGHTS = HookPoint("output_res.weights", _WEIGHTS, "the final depth mix's weights", per_layer=False)
OUTPUT_RES_MIX = HookPoint("output_res.mix", _BTD, "its mixed output (= final_resid)", per_layer=False)
#: (weights, mix) points of each AttnRes site side ("attn", "mlp" of a layer; "output": the model's)
SITE_POINTS = {
    "attn": (ATTN_RES_WEIGHTS, ATTN_RES_MIX),
    "mlp": (MLP_RES_WEIGHTS, MLP_RES_MIX),
    HookNames.OUTPUT_SITE: (OUTPUT_RES_WEIGHTS, OUTPUT_RES_MIX),
}


def scale_bias_init(config: K3Config, layer_idx: int) -> float:
    """Initial residual scale: 1.0 at the first layer falling linearly to 0.9 at the last."""
    depth = layer_idx / max(config.num_hidden_layers - 1, 1)
    return 1.0 - 0.1 * depth


class Source(NamedTuple):
    """What one depth source holds, as data (its label for people: ``k3core.interp.catalogue.source_label``):
    ``kind`` "embedding", "block" (block AttnRes: block ``index`` from 1, ``partial`` while the block is open) or
    the output of sub-layer "attn" / "ffn" of layer ``index`` (full AttnRes)."""

    kind: str
    index: int = 0
    partial: bool = False


EMBEDDING = Source("embedding")


@dataclass(frozen=True)
class DepthStream:
    """What flows from layer to layer (immutable: adding a sub-layer's output makes a new one).

    - plain / scale_bias: one source h (``last``); read h; add h + f (scale_bias: h + scale * f + bias).
    - block_attnres: completed block sums (``bank``, starting with the embedding) + the running partial sum P of
      the current block (``last``); read = the site's softmax mix over bank + [P] (layer 0's attention reads
      P = x directly); each block's first attention output starts a new P.
    - full_attnres: the embedding and every sub-layer output; read = the site's mix over all of them.
    """

    bank: tuple[torch.Tensor, ...]
    bank_names: tuple[Source, ...]
    last: torch.Tensor | None  # additive: h; block: partial P (None when a block has just been closed); full: newest
    last_name: Source | None

    @classmethod
    def start(cls, x: torch.Tensor) -> DepthStream:
        """The stream entering layer 0: the embedding."""
        return cls((), (), x, EMBEDDING)

    def sources(self) -> tuple[list[torch.Tensor], list[Source]]:
        if self.last is None:
            return list(self.bank), list(self.bank_names)
        return [*self.bank, self.last], [*self.bank_names, self.last_name]


def offer_stream(hooks: HookContext | None, name: str, stream: DepthStream) -> DepthStream:
    """The depth state as one hook point [source, batch, token, hidden] (built only when asked for); a write
    replaces every source."""
    if hooks is None or not hooks.wants(name):
        return stream
    sources, names = stream.sources()
    stacked = torch.stack([s.to(sources[-1].device) for s in sources])
    new = point(hooks, name, stacked, sources=names)
    if new is stacked:
        return stream
    bank = tuple(new[j].to(s.device) for j, s in enumerate(stream.bank))
    return replace(stream, bank=bank, last=new[-1].to(sources[-1].device))


def read_input(
    config: K3Config, layer: nn.Module, side: str, stream: DepthStream, hooks: HookContext | None
) -> torch.Tensor:
    """The input of a decoder layer's sub-layer ("attn" or "mlp"): the stream itself, or its AttnRes depth mix
    at that site (the model's output: ``K3Model.read_out``)."""
    if config.residual not in ATTNRES_MODES:
        return stream.last
    if side == "attn":
        if not stream.bank:  # the first layer reads the embedding itself
            return stream.last
        proj, norm = layer.self_attention_res_proj, layer.self_attention_res_norm
    else:
        proj, norm = layer.mlp_res_proj, layer.mlp_res_norm
    sources, names = stream.sources()
    return depth_mix(hooks, HookNames.attnres_site(layer.layer_idx, side), proj, norm, sources, names)


def add_output(config: K3Config, layer: nn.Module, side: str, stream: DepthStream, out: torch.Tensor) -> DepthStream:
    """The stream with a sub-layer's output ("attn" or "mlp" of decoder layer ``layer``) added."""
    i, mode = layer.layer_idx, config.residual
    if mode == "plain":
        return replace(stream, last=stream.last.to(out.device) + out)
    if mode == "scale_bias":
        scale, bias = (
            (layer.self_attention_res_scale, layer.self_attention_res_bias)
            if side == "attn"
            else (layer.mlp_res_scale, layer.mlp_res_bias)
        )
        return replace(stream, last=stream.last.to(out.device) + out * scale + bias)
    if mode == "full_attnres":
        kind = "attn" if side == "attn" else "ffn"
        return DepthStream((*stream.bank, stream.last), (*stream.bank_names, stream.last_name), out, Source(kind, i))
    block = config.attn_res_block_size
    bank, names, last, name = stream.bank, stream.bank_names, stream.last, stream.last_name
    if side == "attn" and i % block == 0:  # a new block starts
        bank, names = (*bank, last), (*names, name)
        last, name = None, Source("block", i // block + 1, partial=True)
    last = out if last is None else last.to(out.device) + out
    if side == "mlp" and ((i + 1) % block == 0 or i + 1 == config.num_hidden_layers):
        name = name._replace(partial=False)
    return DepthStream(bank, names, last, name)


def depth_mix(
    hooks: HookContext | None,
    site: str,
    proj: nn.Linear,
    norm: RMSNorm,
    sources: list[torch.Tensor],
    names: list[Source],
) -> torch.Tensor:
    """AttnRes mix of ``sources`` at ``site``; its depth weights and output are hook points."""
    # Layers may sit on different devices (device="auto"): the mix runs where its pseudo-query is.
    dev = proj.weight.device
    stacked = torch.stack([s.to(dev) for s in sources])
    if hooks is None:
        return attnres_mix(proj.weight[0], stacked, norm.weight, norm.eps)
    where = AttnResSite.parse(site)
    at = where.layer
    weights_point, mix_point = SITE_POINTS[where.sublayer]
    mixed, p = attnres_mix(proj.weight[0], stacked, norm.weight, norm.eps, return_weights=True)
    weights = p.permute(1, 2, 0)
    new = point(hooks, weights_point.at(at), weights, sources=names, site=site)
    if new is not weights:
        mixed = attnres_combine(new.permute(2, 0, 1), stacked)
    return point(hooks, mix_point.at(at), mixed, site=site)
