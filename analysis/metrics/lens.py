"""Logit lens and AttnRes lens: what the model would predict if its depth stopped early.

AttnRes lens (block / full AttnRes runs): at each block boundary (block AttnRes: the embedding, then
after every completed block; full AttnRes: after every layer) the model's own output depth mix,
restricted to the sources that exist so far, then the final RMSNorm and the LM head:

    logits_d = W_head RMSNorm( sum_{i in sources_d} p_i v_i ),  p = softmax_i(<w_out, norm(v_i)>)

Plain logit lens (plain / scale-bias runs): logits_d = W_head RMSNorm(h_d) for the hidden state h_d
entering layer d, and the final one. In both, the last depth is exactly the model's own logits.

Per depth and position the table gives the top-k tokens and probabilities, the rank of the actual next
token (0 = top) and KL(p_final || p_d) in nats.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch

from k3core.interp.catalogue import source_label
from k3core.modeling.hooks import active, hooks
from k3core.modeling.layers.residual import FINAL_STREAM, STREAM


def boundary_layers(config: object) -> list[int]:
    """Layers whose entering depth state is a lens depth (then the final state)."""
    if config.residual == "block_attnres":
        size = config.attn_res_block_size
        return [i for i in range(config.num_hidden_layers) if i % size == 0]
    return list(range(config.num_hidden_layers))


@torch.no_grad()
def lens_logits(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """(depth labels, logits [depth, batch, token, vocab]) of the lens on one forward.

    Each depth's sources go through the model's own output path (``K3Model.read_out``, then the LM head) inside the
    caller's hook context: edits of the output site's depth weights, final_resid, final_norm or the logits act on
    every depth as on the model, so the last depth is the (edited) model's logits."""
    config = model.config
    inner = model.model
    layers = boundary_layers(config)
    names = [STREAM.at(i) for i in layers] + [FINAL_STREAM.at()]
    states: dict[str, tuple[torch.Tensor, list[str]]] = {}

    def keep(value: torch.Tensor, name: str, info: dict) -> None:
        states[name] = (value, list(info["sources"]))

    was_training = model.training
    model.eval()
    try:
        with hooks(read=dict.fromkeys(names, keep)):
            model(ids)
        edits = active()  # the caller's edits (intervene), None without any
        attnres = config.uses_attnres
        labels, out = [], []
        for layer, name in zip([*layers, None], names):
            stacked, sources = states[name]
            h = inner.read_out(list(stacked), sources, edits)
            if attnres:
                label = f"{source_label(sources[-1])} ({len(sources)} sources)"
            else:
                done = config.num_hidden_layers if layer is None else layer  # layers already applied
                label = "embedding" if done == 0 else f"after layer {done - 1}" + (" (final)" if layer is None else "")
            out.append(model.head(h).logits)
            labels.append(label)
    finally:
        model.train(was_training)
    return labels, torch.stack(out)


def lens_table(
    labels: list[str],
    logits: torch.Tensor,
    ids: torch.Tensor,
    top_k: int = 5,
    token_label: Callable[[int], str] = str,
    batch: int = 0,
) -> pd.DataFrame:
    """One row per (depth, position): depth, label, position, top-k tokens / probabilities, the next
    token's rank (-1 at the last position) and KL(final || depth)."""
    logp = torch.log_softmax(logits[:, batch].float(), -1)  # [depth, T, V]
    final = logp[-1]
    kl = (final.exp() * (final - logp)).sum(-1)  # [depth, T]
    top = logp.topk(top_k, dim=-1)
    T = ids.shape[1]
    rows = []
    for d, label in enumerate(labels):
        for t in range(T):
            if t + 1 < T:
                nxt = int(ids[batch, t + 1])
                rank = int((logp[d, t] > logp[d, t, nxt]).sum())
            else:
                nxt, rank = -1, -1
            rows.append(
                dict(
                    depth=d,
                    label=label,
                    position=t,
                    top_tokens=[token_label(int(i)) for i in top.indices[d, t]],
                    top_ids=[int(i) for i in top.indices[d, t]],
                    top_probs=[float(p) for p in top.values[d, t].exp()],
                    next_token=nxt,
                    next_rank=rank,
                    kl_to_final=float(kl[d, t]),
                )
            )
    return pd.DataFrame(rows)
