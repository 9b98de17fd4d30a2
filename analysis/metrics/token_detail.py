"""Per-token inspection: everything the model did at one position, read from a trace and the logits.

For position t (batch row 0): its loss -log p(x_{t+1} | x_<=t), the top-k next-token predictions, the
experts it went to in every MoE layer with their routing weights, its AttnRes depth weights at every
site, the MLA attention from it as the query (per layer and head, over keys 0..t), and its KDA gates
(beta, output-gate mean and mean log decay g per head). Record the trace with ``what="all"`` to have
every part (the MLA attention needs "attn_probs").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from k3core.interp.trace import Trace, names


class TokenDetailError(ValueError):
    """A position outside the recorded tokens."""


@dataclass
class TokenDetail:
    summary: dict
    top_k: pd.DataFrame  # rank, token_id, token, prob
    experts: pd.DataFrame  # layer, rank, expert, weight
    depth: pd.DataFrame  # site, source_index, source, weight
    mla: pd.DataFrame  # layer, head, key, key_token, prob
    kda: pd.DataFrame  # layer, head, beta, gate, g_mean


def token_detail(
    trace: Trace,
    logits: torch.Tensor,
    position: int,
    top_k: int = 5,
    token_label: Callable[[int], str] = str,
) -> TokenDetail:
    """Everything at ``position`` (see the module docstring)."""
    tokens = trace[names.TOKENS][0]
    T = tokens.shape[0]
    if not 0 <= position < T:
        raise TokenDetailError(f"position {position} is outside the recorded tokens 0..{T - 1}")
    t = position
    probs = torch.softmax(logits[0, t].float(), -1)
    top = probs.topk(top_k)
    nll = trace.get(names.TOKEN_NLL)
    loss = float(nll[0, t]) if nll is not None and np.isfinite(nll[0, t]) else None
    summary = dict(
        position=t,
        token_id=int(tokens[t]),
        token=token_label(int(tokens[t])),
        next_token=token_label(int(tokens[t + 1])) if t + 1 < T else None,
        loss=loss,
    )
    top_rows = [
        dict(rank=r, token_id=int(i), token=token_label(int(i)), prob=float(p))
        for r, (i, p) in enumerate(zip(top.indices, top.values))
    ]
    experts = [
        dict(layer=i, rank=r, expert=int(e), weight=float(w))
        for i in trace.layer_indices("moe")
        if names.moe_experts(i) in trace
        for r, (e, w) in enumerate(zip(trace[names.moe_experts(i)][0, t], trace[names.moe_weights(i)][0, t]))
    ]
    depth = []
    sources = trace.meta.get(names.ATTNRES_SOURCES_META, {})
    for site, source_names in sources.items():
        weights = trace[names.attnres(site)][0, t]
        depth += [
            dict(site=site, source_index=j, source=s, weight=float(w))
            for j, (s, w) in enumerate(zip(source_names, weights))
        ]
    mla = []
    for i in trace.layer_indices("mla"):
        if names.mla_attn(i) not in trace:
            continue
        attn = trace[names.mla_attn(i)][0]  # [head, query, key]
        if t >= attn.shape[1]:
            continue
        mla += [
            dict(layer=i, head=h, key=k, key_token=token_label(int(tokens[k])), prob=float(attn[h, t, k]))
            for h in range(attn.shape[0])
            for k in range(t + 1)
        ]
    kda = []
    for i in trace.layer_indices("kda"):
        if names.kda_beta(i) not in trace:
            continue
        beta, gate, g = trace[names.kda_beta(i)][0, t], trace[names.kda_gate(i)][0, t], trace[names.kda_g(i)][0, t]
        kda += [
            dict(layer=i, head=h, beta=float(beta[h]), gate=float(gate[h]), g_mean=float(g[h].mean()))
            for h in range(beta.shape[0])
        ]
    return TokenDetail(
        summary,
        pd.DataFrame(top_rows),
        pd.DataFrame(experts, columns=["layer", "rank", "expert", "weight"]),
        pd.DataFrame(depth, columns=["site", "source_index", "source", "weight"]),
        pd.DataFrame(mla, columns=["layer", "head", "key", "key_token", "prob"]),
        pd.DataFrame(kda, columns=["layer", "head", "beta", "gate", "g_mean"]),
    )
