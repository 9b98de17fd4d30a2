"""Effects of an edit, per token: the baseline and the edited forward side by side.

    loss_change_t  = nll_edited(t) - nll_base(t),   nll(t) = -log p(x_{t+1} | x_<=t)
    prediction changes at a position: the top-k of both runs with their probabilities

``run_experiment`` runs both forwards (and, on request, records both traces for the Compare views).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F

from k3core.interp.edit_kinds import Edit
from k3core.interp.interventions import intervene
from k3core.interp.recorder import record
from k3core.interp.trace import Trace


def token_losses(logits: torch.Tensor, ids: torch.Tensor, batch: int = 0) -> torch.Tensor:
    """nll(t) = -log p(x_{t+1} | x_<=t) for t = 0..T-2, [T - 1]."""
    return F.cross_entropy(logits[batch, :-1].float(), ids[batch, 1:], reduction="none")


def per_token_effects(
    base_logits: torch.Tensor,
    edited_logits: torch.Tensor,
    ids: torch.Tensor,
    token_label: Callable[[int], str] = str,
    batch: int = 0,
) -> pd.DataFrame:
    """One row per position t < T-1: position, token, next_token, base_loss, edited_loss, loss_change,
    base_top1, edited_top1 (labels), top1_changed."""
    base, edited = token_losses(base_logits, ids, batch), token_losses(edited_logits, ids, batch)
    b1, e1 = base_logits[batch, :-1].argmax(-1), edited_logits[batch, :-1].argmax(-1)
    rows = []
    for t in range(ids.shape[1] - 1):
        rows.append(
            dict(
                position=t,
                token=token_label(int(ids[batch, t])),
                next_token=token_label(int(ids[batch, t + 1])),
                base_loss=float(base[t]),
                edited_loss=float(edited[t]),
                loss_change=float(edited[t] - base[t]),
                base_top1=token_label(int(b1[t])),
                edited_top1=token_label(int(e1[t])),
                top1_changed=bool(b1[t] != e1[t]),
            )
        )
    return pd.DataFrame(rows)


def prediction_changes(
    base_logits: torch.Tensor,
    edited_logits: torch.Tensor,
    positions: Iterable[int],
    k: int = 5,
    token_label: Callable[[int], str] = str,
    batch: int = 0,
) -> pd.DataFrame:
    """Top-k of both runs at each position: position, rank, base_token, base_prob, edited_token, edited_prob,
    and the edited probability of the baseline's token (edited_prob_of_base)."""
    rows = []
    for t in positions:
        pb = torch.softmax(base_logits[batch, t].float(), -1)
        pe = torch.softmax(edited_logits[batch, t].float(), -1)
        tb, te = pb.topk(k), pe.topk(k)
        for r in range(k):
            rows.append(
                dict(
                    position=t,
                    rank=r,
                    base_token=token_label(int(tb.indices[r])),
                    base_prob=float(tb.values[r]),
                    edited_token=token_label(int(te.indices[r])),
                    edited_prob=float(te.values[r]),
                    edited_prob_of_base=float(pe[tb.indices[r]]),
                )
            )
    return pd.DataFrame(rows)


@dataclass
class Experiment:
    edits: list[Edit]
    base_logits: torch.Tensor
    edited_logits: torch.Tensor
    base_trace: Trace | None = None
    edited_trace: Trace | None = None

    def effects(self, ids: torch.Tensor, token_label: Callable[[int], str] = str) -> pd.DataFrame:
        return per_token_effects(self.base_logits, self.edited_logits, ids, token_label)

    def summary(self, ids: torch.Tensor) -> dict[str, Any]:
        base, edited = token_losses(self.base_logits, ids), token_losses(self.edited_logits, ids)
        return dict(
            edits=[e.to_dict() for e in self.edits],
            base_loss=float(base.mean()),
            edited_loss=float(edited.mean()),
            loss_change=float((edited - base).mean()),
            positions_changed_top1=int(
                (self.base_logits[0, :-1].argmax(-1) != self.edited_logits[0, :-1].argmax(-1)).sum()
            ),
        )


@torch.no_grad()
def forward_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits of ``ids`` [batch, T, V] (eval mode, no edits), on the CPU; ``ids`` go to the model's
    device."""
    was_training = model.training
    model.eval()
    try:
        return model(ids.to(next(model.parameters()).device)).logits.cpu()
    finally:
        model.train(was_training)


@torch.no_grad()
def run_experiment(
    model: torch.nn.Module,
    ids: torch.Tensor,
    edits: list[Edit],
    traces: bool = False,
    what: Any = None,
    max_tokens: int = 1024,
) -> Experiment:
    """The baseline and the edited forward of ``ids`` (and both traces when ``traces``)."""
    was_training = model.training
    model.eval()
    try:
        if traces:
            with record(model, what=what, max_tokens=max_tokens) as base_trace:
                base = model(ids, labels=ids).logits
            with intervene(model, edits), record(model, what=what, max_tokens=max_tokens) as edited_trace:
                edited = model(ids, labels=ids).logits
            return Experiment(list(edits), base, edited, base_trace, edited_trace)
        base = model(ids).logits
        with intervene(model, edits):
            edited = model(ids).logits
        return Experiment(list(edits), base, edited)
    finally:
        model.train(was_training)
