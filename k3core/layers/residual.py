"""The residual stream between layers: plain, scale/bias, and AttnRes (attention over depth, block or full).

``ResidualStream`` holds the depth sources so far and says how a sub-layer reads and adds to them;
``depth_mix`` is the AttnRes mix of one site (its depth weights and output are hook points).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ATTNRES_MODES, K3Config
from ..interp.hooks import HookContext, HookNames, HookPoint, point
from ..ops.attnres import attnres_combine, attnres_mix
from .norm import RMSNorm

_DEPTH = ("source", "batch", "token", "hidden")
_WEIGHTS = ("batch", "token", "source")
_BTD = ("batch", "token", "hidden")

# The hook points of the residual stream (k3core.interp.hooks). The depth state is offered on request.
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


class ResidualStream:
    """What flows from layer to layer: the depth sources so far, and how a sub-layer reads and adds to them.

    - plain / scale_bias: one source h; read h; write h + f (scale_bias: h + scale * f + bias).
    - block_attnres: completed block sums (the bank, starting with the embedding) + the running partial
      sum P of the current block; read = the site's softmax mix over bank + [P] (layer 0's attention reads
      P = x directly); each block's first attention output starts a new P.
    - full_attnres: the embedding and every sub-layer output; read = the site's mix over all of them.
    """

    def __init__(self, config: K3Config, x: torch.Tensor):
        self.mode = config.residual
        self.block_size = config.attn_res_block_size
        self.num_layers = config.num_hidden_layers
        self.bank: list[torch.Tensor] = []  # block: completed blocks; full: every source but the last
        self.bank_names: list[str] = []
        self.last: torch.Tensor | None = x  # additive: h; block: partial P; full: the newest source
        self.last_name = "embedding"

    @property
    def attnres(self) -> bool:
        return self.mode in ATTNRES_MODES

    def sources(self) -> tuple[list[torch.Tensor], list[str]]:
        if self.last is None:
            return list(self.bank), list(self.bank_names)
        return self.bank + [self.last], self.bank_names + [self.last_name]

    def offer(self, hooks: HookContext, name: str) -> None:
        """The depth state as one hook point [source, batch, token, hidden] (built only when asked for)."""
        if not hooks.wants(name):
            return
        sources, names = self.sources()
        stacked = torch.stack([s.to(sources[-1].device) for s in sources])
        new = point(hooks, name, stacked, sources=names)
        if new is not stacked:
            self.bank = [new[j].to(s.device) for j, s in enumerate(self.bank)]
            self.last = new[-1].to(sources[-1].device)

    def read(self, layer: nn.Module, side: str, hooks: HookContext | None) -> torch.Tensor:
        """The input of a sub-layer ("attn" or "mlp" of a decoder layer; the model's output: ``K3Model.read_out``)."""
        if not self.attnres:
            return self.last
        if side == "attn":
            if not self.bank:  # the first layer reads the embedding itself
                return self.last
            site = HookNames.attnres_site(layer.layer_idx, "attn")
            proj, norm = layer.self_attention_res_proj, layer.self_attention_res_norm
        else:
            site = HookNames.attnres_site(layer.layer_idx, "mlp")
            proj, norm = layer.mlp_res_proj, layer.mlp_res_norm
        sources, names = self.sources()
        return depth_mix(hooks, site, proj, norm, sources, names)

    def write(self, layer: nn.Module, side: str, out: torch.Tensor) -> None:
        """Add a sub-layer's output ("attn" or "mlp") to the stream."""
        i = layer.layer_idx
        if self.mode == "plain":
            self.last = self.last.to(out.device) + out
        elif self.mode == "scale_bias":
            scale, bias = (
                (layer.self_attention_res_scale, layer.self_attention_res_bias)
                if side == "attn"
                else (layer.mlp_res_scale, layer.mlp_res_bias)
            )
            self.last = self.last.to(out.device) + out * scale + bias
        elif self.mode == "full_attnres":
            self.bank.append(self.last)
            self.bank_names.append(self.last_name)
            self.last, self.last_name = out, f"L{i}.{'attn' if side == 'attn' else 'ffn'}"
        else:
            if side == "attn" and i % self.block_size == 0:  # a new block starts
                self.bank.append(self.last)
                self.bank_names.append(self.last_name)
                self.last, self.last_name = None, f"block {i // self.block_size + 1} (partial)"
            self.last = out if self.last is None else self.last.to(out.device) + out
            if side == "mlp" and ((i + 1) % self.block_size == 0 or i + 1 == self.num_layers):
                self.last_name = self.last_name.replace(" (partial)", "")


def depth_mix(
    hooks: HookContext | None,
    site: str,
    proj: nn.Linear,
    norm: RMSNorm,
    sources: list[torch.Tensor],
    names: list[str],
) -> torch.Tensor:
    """AttnRes mix of ``sources`` at ``site``; its depth weights and output are hook points."""
    # Layers may sit on different devices (device="auto"): the mix runs where its pseudo-query is.
    dev = proj.weight.device
    stacked = torch.stack([s.to(dev) for s in sources])
    if hooks is None:
        return attnres_mix(proj.weight[0], stacked, norm.weight, norm.eps)
    layer, _, side = site.rpartition(".")
    at = int(layer) if layer else None
    weights_point, mix_point = SITE_POINTS[side]
    mixed, p = attnres_mix(proj.weight[0], stacked, norm.weight, norm.eps, return_weights=True)
    weights = p.permute(1, 2, 0)
    new = point(hooks, weights_point.at(at), weights, sources=names, site=site)
    if new is not weights:
        mixed = attnres_combine(new.permute(2, 0, 1), stacked)
    return point(hooks, mix_point.at(at), mixed, site=site)
