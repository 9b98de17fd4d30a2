"""LatentMoE expert dispatch: grouped (sorted by expert, each expert once) vs the per-expert masked loop.

Times ``StackedExperts`` alone on N latent vectors, k experts per token (random routing, random
renormalised weights), k3-small expert shapes (latent L = 384, expert width m = 384), fp32, CPU.
The grouped_mm column uses torch's grouped GEMM (on CPU torch runs it through a fallback; on CUDA
it is the kernel that ``dispatch="grouped"`` picks automatically for bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.modeling.layers.moe import StackedExperts
from k3core.modeling.presets import from_preset

from .common import Row, inference, side_by_side


def make_dispatch_problem(N: int, E: int, k: int, L: int = 384, m: int = 384, seed: int = 0):
    """(experts module, z [N, L], expert ids [N, k], weights [N, k]) with random weights and routing."""
    gen = torch.Generator().manual_seed(seed)
    cfg = from_preset("k3-small", num_experts=E, num_experts_per_token=k)
    ex = StackedExperts(cfg, E, L, m)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    z = torch.randn(N, L, generator=gen)
    experts = torch.rand(N, E, generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(N, k, generator=gen)
    return ex, z, experts, weights / weights.sum(-1, keepdim=True)


def run(quick: bool = False) -> list[Row]:
    N, k, repeat = (1024, 4, 3) if quick else (4096, 4, 5)
    rows = []
    for E in (16, 64):
        ex, z, experts, weights = make_dispatch_problem(N, E, k)
        fns = {
            "grouped": inference(lambda ex=ex, z=z, e=experts, w=weights: ex(z, e, w, backend="sorted_loop")),
            "masked": inference(lambda ex=ex, z=z, e=experts, w=weights: ex.forward_masked_loop(z, e, w)),
        }
        has_mm = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
        if has_mm:
            fns["grouped_mm"] = inference(lambda ex=ex, z=z, e=experts, w=weights: ex(z, e, w, backend="grouped_mm"))
        t = side_by_side(fns, repeat=repeat)
        rows.append(
            Row(
                "MoE dispatch tokens/s",
                f"N={N} E={E} k={k} L=m=384",
                N / t["grouped"],
                "grouped (sorted)",
                N / t["masked"],
                "masked loop",
                "tok/s",
                t["masked"] / t["grouped"],
                note=f"best of {repeat}",
            )
        )
        if has_mm:
            rows.append(
                Row(
                    "MoE dispatch tokens/s",
                    f"N={N} E={E} k={k} L=m=384",
                    N / t["grouped_mm"],
                    "grouped_mm (CPU fallback)",
                    N / t["masked"],
                    "masked loop",
                    "tok/s",
                    t["masked"] / t["grouped_mm"],
                    note="torch grouped GEMM; CUDA picks it for bf16",
                )
            )
    return rows
