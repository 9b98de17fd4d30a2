"""The papers' figures that run the model (docs/DIAGNOSTICS.md, "The papers' figures"):

- MQAR accuracy against sequence length (Kimi Linear report, arXiv 2510.26692, Figure 4): ``mqar_by_length`` makes
  Zoology's multi-query associative recall (``k3core.data.mqar.make_mqar``: ``pairs`` key-value pairs, then every key
  queried once at random places in the rest of the sequence) at each length, scores the argmax at every query, and
  gives the accuracy over all queries with its 95% Wilson interval and chance (1 / number of values).
- Block AttnRes read causally (arXiv 2606.13168): ``attnres_source_effects`` gives, per AttnRes site and depth source,
  the mean routing weight and the loss change when that source is removed from the mix (``AttnResEdit`` mode "mask":
  weight 0, the others renormalised), with its 95% noise floor (paired window means,
  ``analysis.metrics.loss_noise.loss_difference``). A source whose weight is 0 everywhere has effect exactly 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pandas as pd
import torch

from analysis.metrics.importance import token_nll
from analysis.metrics.intervals import wilson_interval
from analysis.metrics.loss_noise import choose_window, loss_difference
from analysis.metrics.tidy import tidy
from k3core.data.batches import IGNORE_INDEX
from k3core.data.mqar import make_mqar, mqar_chance
from k3core.interp.edit_kinds import AttnResEdit
from k3core.interp.interventions import intervene
from k3core.interp.recorder import record
from k3core.interp.trace import names

MQAR_LENGTHS = (256, 512, 1024, 2048)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def mqar_by_length(
    model: torch.nn.Module,
    lengths: Iterable[int] = MQAR_LENGTHS,
    examples: int = 8,
    pairs: int = 16,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> pd.DataFrame:
    """MQAR accuracy per sequence length (module docstring), one forward of ``examples`` sequences per length;
    ``progress(done, total)`` after each. Columns: length, accuracy, correct, queries, ci_low, ci_high, chance."""
    vocab = int(model.config.vocab_size)
    device = next(iter(model.parameters()), torch.zeros(())).device
    rows = []
    todo = sorted({int(t) for t in lengths})
    for done, T in enumerate(todo, 1):
        batch = make_mqar(examples, T, pairs, vocab, generator=torch.Generator().manual_seed(seed + T))
        pred = _logits(model, batch.inputs.to(device)).argmax(-1).cpu()
        mask = batch.targets != IGNORE_INDEX
        correct, n = int((pred[mask] == batch.targets[mask]).sum()), int(mask.sum())
        low, high = wilson_interval(np.asarray(correct), n)
        rows.append(
            dict(
                length=T,
                accuracy=correct / n,
                correct=correct,
                queries=n,
                ci_low=float(low),
                ci_high=float(high),
                chance=mqar_chance(vocab),
            )
        )
        if progress is not None:
            progress(done, len(todo))
    return tidy(pd.DataFrame(rows), keys=["length"], value="accuracy")


@torch.no_grad()
def attnres_source_effects(
    model: torch.nn.Module,
    ids: torch.Tensor,
    sites: Iterable[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> pd.DataFrame:
    """Per AttnRes site and source: mean routing weight and the loss change when the source is removed (module
    docstring): one recorded forward, then one forward per (site, source); ``progress(done, total)`` after each.
    Columns: site, source, name, weight, effect, noise (95% half-width), significant."""
    if not model.config.uses_attnres:
        raise ValueError(f"no AttnRes sites: the model's residual is {model.config.residual!r}")
    with record(model, what={"attnres"}, max_batch=ids.shape[0]) as trace:
        base = token_nll(model, ids)
    labels = trace.meta.get(names.ATTNRES_SOURCES_META, {})
    chosen = list(labels) if sites is None else [str(s) for s in sites]
    window = choose_window(base.size)
    total = 1 + sum(len(labels[site]) for site in chosen)
    if progress is not None:
        progress(1, total)
    rows: list[dict[str, Any]] = []
    for site in chosen:
        weights = np.asarray(trace[names.attnres(site)], dtype=np.float64)  # [batch, token, source]
        for s, name in enumerate(labels[site]):
            with intervene(model, [AttnResEdit(site=site, mode="mask", sources=[s])]):
                edited = token_nll(model, ids)
            diff = loss_difference(edited, base, paired=True, window=window)
            rows.append(
                dict(
                    site=site,
                    source=s,
                    name=name,
                    weight=float(weights[..., s].mean()),
                    effect=diff.delta,
                    noise=diff.half_width,
                    significant=abs(diff.delta) > diff.half_width,
                )
            )
            if progress is not None:
                progress(len(rows) + 1, total)
    return tidy(pd.DataFrame(rows), keys=["site", "source"], value="effect")
