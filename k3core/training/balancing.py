"""Auxiliary-loss-free balancing: the selection-bias update after each optimiser step.

    sign      b_j += u * sign(mean(load) - load_j)                               (DeepSeek-V3)
    quantile  alpha_t = (k+1)-th largest s_t + b;  b_j <- lerp(b_j, q_j - mean(q), 1/2),
              q_j = quantile_t(alpha_t - s_tj, k/E)                               (K3)

The statistics come from the last training forward of each LatentMoE (``last_load``, ``last_scores``).
"""

from __future__ import annotations

import torch

from ..modeling.layers.moe import LatentMoE


@torch.no_grad()
def update_bias(moe: LatentMoE) -> None:
    """One selection-bias update of one MoE layer, by its config's ``balancing`` rule."""
    config = moe.config
    bias = moe.gate.e_score_correction_bias
    if config.balancing == "sign" and moe.last_load is not None:
        load = moe.last_load.float()
        bias += config.bias_update_rate * torch.sign(load.mean() - load)
    elif config.balancing == "quantile" and moe.last_scores is not None:
        s = moe.last_scores
        k, E = config.num_experts_per_token, config.num_experts
        if k < E:
            alpha = (s + bias).topk(k + 1, dim=-1).values[:, -1:]
            target = torch.quantile(alpha - s, k / E, dim=0)
            target -= target.mean()
            bias.lerp_(target, 0.5)  # halfway each step: damps batch-to-batch noise
        moe.last_scores = None


@torch.no_grad()
def update_router_biases(model: torch.nn.Module) -> None:
    """``update_bias`` on every MoE layer of a K3ForCausalLM."""
    for moe in model.moe_layers():
        update_bias(moe)
