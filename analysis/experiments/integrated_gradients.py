"""Integrated gradients on the embeddings of the input tokens, our own integral (``integrated_gradients``): the
``ig_frozen_routing`` method of ``analysis.experiments.attribution.token_attribution``, with every MoE layer's top-k
expert set held at the one the input chose, on an adaptive Gauss-Legendre path; and ``routing_changes``, how often
the top-k sets change along plain IG's straight path (each change a jump plain IG cannot integrate).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from analysis.experiments.attribution_inputs import AttributionError
from k3core.modeling.hooks import HookNames, hooks
from k3core.modeling.model import EMBED


def _moe_points(config: Any, name: str) -> list[str]:
    return [HookNames.block(i, f"moe.{name}") for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def _embedded_path(
    model: nn.Module, ids: torch.Tensor, n: int, baseline_token: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, e'): the embedding of x + y [L, D], and of the baseline (input positions 0..n-1 replaced by the baseline
    token; the target tokens keep theirs, so they get no attribution)."""
    base_ids = ids.clone()
    base_ids[:n] = baseline_token
    with torch.no_grad():
        embed = model.model.embed_tokens
        return embed(ids.unsqueeze(0))[0].float(), embed(base_ids.unsqueeze(0))[0].float()


def _input_routing(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every MoE layer's chosen experts [1, L, k] on the input (a causal model: a prefix routes as the whole)."""
    chosen: dict[str, torch.Tensor] = {}
    names = _moe_points(model.config, "experts")
    with torch.no_grad(), hooks(read={p: (lambda v, name, info: chosen.__setitem__(name, v.clone())) for p in names}):
        model(ids.unsqueeze(0))
    return chosen


def _frozen_selection(chosen: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write hooks on moe.selection that make top-k pick the recorded experts at every position, batch expanded
    (1 on the recorded set, 0 elsewhere: the gate weights are still read from the scores of that set)."""

    def hook_for(experts: torch.Tensor) -> Any:
        def hook(value: torch.Tensor, name: str, info: dict) -> torch.Tensor:
            picks = experts.to(value.device).expand(value.shape[0], -1, -1)
            return torch.zeros_like(value).scatter(-1, picks, 1.0)

        return hook

    return {name.replace("moe.experts", "moe.selection"): hook_for(e) for name, e in chosen.items()}


#: Gauss-Legendre nodes per panel of the adaptive IG path
PANEL_NODES = 4


def integrated_gradients(
    model: nn.Module,
    input_ids: torch.Tensor,
    target_ids: torch.Tensor,
    baseline_token: int = 0,
    n_steps: int = 64,
    freeze_routing: bool = True,
    max_steps: int | None = None,
    rtol: float = 1e-4,
) -> tuple[torch.Tensor, list[float], int]:
    """(attr [m, n], g(x) - g(baseline) per target, path points used) of IG on the embeddings of the input tokens:

        attr[j, i] = sum_d (e_i - e'_i)_d * sum_k w_k d g_j / d e_i (e' + a_k (e - e'))

    for g_j = log p(y_j | x, y_<j) of one forward over x + y, with every MoE layer's top-k experts held at the ones x
    chose when ``freeze_routing`` (then g is smooth). The nodes (a_k, w_k): Gauss-Legendre, PANEL_NODES per panel of
    [0, 1], starting from n_steps / PANEL_NODES equal panels. Each panel [a, b] checks itself (its attributions must
    sum to g(b) - g(a): the path of a trained model has narrow steep stretches, where an embedding passes near the
    origin of an RMSNorm); the worst panels are halved until sum_panels |that miss| <= rtol |g(x) - g(baseline)|
    or ``max_steps`` points (default 16 n_steps) are spent. The reported delta then says what is left."""
    import numpy as np

    if n_steps < 1:
        raise AttributionError(f"n_steps must be at least 1, got {n_steps}")
    max_steps = 16 * n_steps if max_steps is None else max_steps
    device = next(model.parameters()).device
    ids = torch.cat([input_ids, target_ids]).to(device)
    n, m = input_ids.numel(), target_ids.numel()
    e, e_base = _embedded_path(model, ids, n, baseline_token)
    nodes, weights = np.polynomial.legendre.leggauss(PANEL_NODES)
    write = _frozen_selection(_input_routing(model, ids)) if freeze_routing else {}
    targets = target_ids.to(device)
    dtype = model.model.embed_tokens.weight.dtype

    def g(alphas: list[float], grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(points [S, L, D], target log-probabilities [S, m]) at path points e' + a (e - e')."""
        a = torch.tensor(alphas, dtype=torch.float32, device=device).view(-1, 1, 1)
        point = (e_base + a * (e - e_base)).requires_grad_(grad)
        with hooks(write={**write, EMBED.at(): lambda v, name, info: point.to(dtype)}):
            logits = model(ids.unsqueeze(0).expand(point.shape[0], -1)).logits.float()
        logp = torch.log_softmax(logits[:, n - 1 : n - 1 + m], -1)
        return point, logp.gather(2, targets.expand(point.shape[0], -1).unsqueeze(-1))[..., 0]

    ends: dict[float, torch.Tensor] = {}

    def value_at(alphas: list[float]) -> None:
        todo = sorted({a for a in alphas if a not in ends})
        with torch.no_grad():
            for start in range(0, len(todo), 16):
                _, out = g(todo[start : start + 16])
                ends.update(zip(todo[start : start + 16], out))

    def panel_attributions(panels: list[tuple[float, float]]) -> list[torch.Tensor]:
        """Each panel's attributions [m, L] (16 points per forward: bounded memory)."""
        out = []
        for start in range(0, len(panels), 16 // PANEL_NODES):
            group = panels[start : start + 16 // PANEL_NODES]
            alphas = [lo + (hi - lo) * (x + 1) / 2 for lo, hi in group for x in nodes]
            w = torch.tensor([(hi - lo) * wk / 2 for lo, hi in group for wk in weights], device=device)
            point, logp = g(alphas, grad=True)
            grads = torch.stack(
                [torch.autograd.grad((logp[:, j] * w).sum(), point, retain_graph=j + 1 < m)[0] for j in range(m)]
            )  # [m, S, L, D]: the weighted gradient at each node
            per_node = (grads * (e - e_base)).sum(-1).detach()  # [m, S, L]
            out += list(per_node.view(m, len(group), PANEL_NODES, -1).sum(2).unbind(1))
        return out

    count = max(1, round(n_steps / PANEL_NODES))
    panels = [(k / count, (k + 1) / count) for k in range(count)]
    attrs = dict(zip(panels, panel_attributions(panels)))
    used = PANEL_NODES * count
    value_at([0.0, 1.0] + [a for p in panels for a in p])
    difference = (ends[1.0] - ends[0.0]).abs().clamp_min(1e-12)
    while True:
        miss = {p: (attrs[p].sum(-1) - (ends[p[1]] - ends[p[0]])).abs() / difference for p in attrs}
        if float(sum(miss.values()).max()) <= rtol or used + 2 * PANEL_NODES > max_steps:
            break
        worst = sorted(miss, key=lambda p: float(miss[p].max()), reverse=True)
        worst = worst[: max(1, min(8 // PANEL_NODES, (max_steps - used) // (2 * PANEL_NODES)))]  # 16 new points
        halves = [h for lo, hi in worst for h in ((lo, (lo + hi) / 2), ((lo + hi) / 2, hi))]
        for p in worst:
            del attrs[p]
        attrs.update(zip(halves, panel_attributions(halves)))
        used += PANEL_NODES * len(halves)
        value_at([a for p in halves for a in p])
    matrix = torch.stack(list(attrs.values())).sum(0)[:, :n].cpu()
    return matrix, (ends[1.0] - ends[0.0]).tolist(), used


@torch.no_grad()
def routing_changes(
    model: nn.Module, input_ids: torch.Tensor, target_ids: torch.Tensor, baseline_token: int = 0, n_steps: int = 64
) -> int:
    """How many (MoE layer, position) top-k expert sets differ between neighbouring points of the straight path
    e' + a (e - e'), a = 0, 1/n_steps, ..., 1 (each is a jump plain IG cannot integrate); 0 on a dense model."""
    names = _moe_points(model.config, "experts")
    if not names:
        return 0
    device = next(model.parameters()).device
    ids = torch.cat([input_ids, target_ids]).to(device)
    e, e_base = _embedded_path(model, ids, input_ids.numel(), baseline_token)
    dtype = model.model.embed_tokens.weight.dtype
    previous: dict[str, torch.Tensor] = {}
    changes = 0
    alphas = torch.linspace(0, 1, n_steps + 1, device=device)
    for start in range(0, n_steps + 1, 16):
        a = alphas[start : start + 16].view(-1, 1, 1)
        point = e_base + a * (e - e_base)
        chosen: dict[str, torch.Tensor] = {}
        read = {p: (lambda v, name, info, into=chosen: into.__setitem__(name, v.sort(-1).values)) for p in names}
        with hooks(read=read, write={EMBED.at(): lambda v, name, info, at=point: at.to(dtype)}):
            model(ids.unsqueeze(0).expand(point.shape[0], -1))
        for name, sets in chosen.items():
            if name in previous:
                sets = torch.cat([previous[name], sets])
            changes += int((sets[1:] != sets[:-1]).any(-1).sum())
            previous[name] = sets[-1:]
    return changes
