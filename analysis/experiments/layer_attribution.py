"""Layer attribution (``layer_attribution``): Captum ``IntegratedGradients`` on one multiplier per element of
every sub-layer output (the KDA / MLA mixer outputs, dense FFN outputs, routed-expert and shared-expert
outputs, hook points of ``k3core.modeling.hooks``), from all multipliers 0 (every sub-layer output removed) to 1
(the model as it is), for f = sum_j log p(y_j | x, y_<j). Each output's attribution, summed over its
elements, says how much of f flows through it; grouped by mixer type (KDA vs MLA) and FFN kind (dense,
routed, shared). Completeness again: the sum over everything = f(model) - f(no sub-layers) + delta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn

from analysis.experiments.attribution_inputs import check_ids
from k3core.modeling.hooks import HookNames, hooks


def layer_points(config: Any) -> list[tuple[int, str, str, str]]:
    """(layer, group, kind, hook point) of every sub-layer output: group "mixer" (kind KDA / MLA) or
    "ffn" (kind dense / routed / shared)."""
    out = []
    for i in range(config.num_hidden_layers):
        mixer = "MLA" if config.is_mla_layer(i) else "KDA"
        out.append((i, "mixer", mixer, HookNames.block(i, "mixer_out")))
        if config.is_moe_layer(i):
            out.append((i, "ffn", "routed", HookNames.block(i, "moe.routed_out")))
            if config.num_shared_experts:
                out.append((i, "ffn", "shared", HookNames.block(i, "moe.shared_out")))
        else:
            out.append((i, "ffn", "dense", HookNames.block(i, "ffn_out")))
    return out


@dataclass
class LayerAttribution:
    table: pd.DataFrame  # layer, group, kind, point, attribution
    by_kind: pd.DataFrame  # group, kind, attribution
    f_model: float  # f with every output as it is
    f_baseline: float  # f with every sub-layer output removed
    delta: float  # Captum's convergence delta
    baseline: str = "every sub-layer output multiplied by 0 (the multipliers' baseline)"


def layer_attribution(
    model: nn.Module, input_ids: torch.Tensor, target_ids: torch.Tensor, n_steps: int = 64
) -> LayerAttribution:
    """Integrated gradients over multipliers of every sub-layer output (see the module docstring)."""
    from captum.attr import IntegratedGradients

    input_ids, target_ids = input_ids.reshape(-1).cpu(), target_ids.reshape(-1).cpu()
    check_ids(input_ids, target_ids, model.config.vocab_size, 0)
    config = model.config
    entries = layer_points(config)
    ids = torch.cat([input_ids, target_ids]).unsqueeze(0)
    n, m = input_ids.numel(), target_ids.numel()
    shapes: dict[str, tuple[int, ...]] = {}
    with (
        torch.no_grad(),
        hooks(read={p: (lambda v, name, info: shapes.__setitem__(name, v.shape)) for *_, p in entries}),
    ):
        model(ids)

    def f(*multipliers: torch.Tensor) -> torch.Tensor:
        batch = multipliers[0].shape[0]
        write = {
            point: (lambda v, name, info, k=k: v * multipliers[k].to(v.dtype)) for k, (*_, point) in enumerate(entries)
        }
        with hooks(write=write):
            logits = model(ids.expand(batch, -1)).logits.float()
        logp = torch.log_softmax(logits[:, n - 1 : n - 1 + m], -1)
        return logp.gather(2, target_ids.to(logp.device).expand(batch, -1).unsqueeze(-1))[..., 0].sum(-1)

    device = next(model.parameters()).device
    ones = tuple(torch.ones(shapes[p][1:], device=device).unsqueeze(0) for *_, p in entries)
    zeros = tuple(torch.zeros_like(t) for t in ones)
    was_training = model.training
    model.eval()
    try:
        ig = IntegratedGradients(f)
        attrs, delta = ig.attribute(ones, baselines=zeros, n_steps=n_steps, return_convergence_delta=True)
        with torch.no_grad():
            f_model, f_base = float(f(*ones)), float(f(*zeros))
    finally:
        model.train(was_training)
    rows = [
        dict(layer=i, group=group, kind=kind, point=point, attribution=float(a.sum()))
        for (i, group, kind, point), a in zip(entries, attrs)
    ]
    table = pd.DataFrame(rows)
    by_kind = table.groupby(["group", "kind"], as_index=False)["attribution"].sum()
    return LayerAttribution(table, by_kind, f_model, f_base, float(delta.reshape(-1)[0]))
