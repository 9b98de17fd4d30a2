"""Measured sub-layer importance: how much the LM loss depends on each attention and FFN output.

Two estimates, one row per (layer, sublayer) with sublayer in {"attn", "ffn"}:

- **ablation** (exact): ``importance = L(sub-layer output := 0) - L`` with L the mean next-token loss
  on the given tokens; one extra forward per sub-layer (2 L in all). A forward hook on
  ``layer.self_attn`` / ``layer.ffn`` replaces the output with zeros. Its noise floor: the 95% CI half-width of
  that paired difference over window means of the per-token losses (``analysis.metrics.loss_noise.loss_difference``,
  windows of ``choose_window`` tokens): how much of it the choice of text could explain. ``significant`` when
  ``|importance| > noise``.
- **gradient x activation** (Captum ``LayerGradientXActivation``, one forward + one backward):
  per sub-layer output a [batch, token, hidden] and the summed next-token loss S = sum_t nll_t,
  ``gxa = mean_{batch, token} sum_hidden (dS/da) * a``. Since the mean loss is S / N, ``-gxa`` is the
  first-order Taylor estimate of the ablation importance (removing a changes the mean loss by about
  -sum (dL/da) a = -gxa). ``gxa_abs`` uses |(dS/da) * a| (magnitude, sign-free).

Everything runs in eval mode under the caller's device; the model's training flag is restored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import pandas as pd
import torch
from torch import nn

from analysis.metrics.loss_noise import choose_window, loss_difference

SUBLAYERS = ("attn", "ffn")


def sublayer_modules(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(layer, "attn" | "ffn", module) for every decoder layer: ``layer.self_attn`` and ``layer.ffn``."""
    try:
        layers = model.model.layers
    except AttributeError as exc:
        raise TypeError("expected a K3ForCausalLM (model.model.layers)") from exc
    out = []
    for i, layer in enumerate(layers):
        out.append((i, "attn", layer.self_attn))
        out.append((i, "ffn", layer.ffn))
    return out


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def zeroed_output(module: nn.Module) -> Iterator[None]:
    """Inside the block, ``module``'s forward output is replaced by zeros of the same shape."""
    handle = module.register_forward_hook(lambda _mod, _inp, out: torch.zeros_like(out))
    try:
        yield
    finally:
        handle.remove()


def _check_ids(input_ids: torch.Tensor) -> None:
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype not in (torch.long, torch.int)
    ):
        raise ValueError("input_ids must be an integer tensor [batch, tokens]")
    if input_ids.shape[1] < 2:
        raise ValueError("need at least 2 tokens per sequence for a next-token loss")


@torch.no_grad()
def lm_loss(model: nn.Module, input_ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) of the model on input_ids (labels = input_ids, shifted)."""
    return float(model(input_ids, labels=input_ids).loss)


@torch.no_grad()
def token_nll(model: nn.Module, input_ids: torch.Tensor) -> np.ndarray:
    """Next-token cross-entropy (nats) at every position, ``-log p(x_{t+1} | x_<=t)``: [batch, tokens - 1],
    float64, computed from fp32 logits."""
    out = model(input_ids)
    logits = (out.logits if hasattr(out, "logits") else out)[:, :-1].float()
    nll = nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")
    return nll.double().cpu().numpy()


Progress = Callable[[int, int, str], None]  # (done, total, what is running next)


def ablation_importance(model: nn.Module, input_ids: torch.Tensor, progress: Progress | None = None) -> pd.DataFrame:
    """Increase in mean LM loss when one sub-layer's output is zeroed: L(ablated) - L(base), with its noise floor.

    Columns: layer, sublayer, method ("ablation"), base_loss, ablated_loss, importance, noise (95% CI half-width
    of the paired per-token difference, module docstring; NaN under two windows), significant
    (``|importance| > noise``). ``progress`` is called before each of the 2 L + 1 forward passes.
    """
    _check_ids(input_ids)
    rows = []
    subs = sublayer_modules(model)
    with _eval_mode(model):
        if progress:
            progress(0, len(subs) + 1, "base loss")
        base = token_nll(model, input_ids)
        window = choose_window(base.shape[-1])
        for k, (i, name, module) in enumerate(subs):
            if progress:
                progress(k + 1, len(subs) + 1, f"layer {i} {name} zeroed")
            with zeroed_output(module):
                ablated = token_nll(model, input_ids)
            diff = loss_difference(ablated, base, paired=True, window=window)
            rows.append(
                dict(
                    layer=i,
                    sublayer=name,
                    method="ablation",
                    base_loss=float(base.mean()),
                    ablated_loss=float(ablated.mean()),
                    importance=diff.delta,
                    noise=diff.half_width,
                    significant=bool(abs(diff.delta) > diff.half_width),
                )
            )
    return pd.DataFrame(rows)


def layers_above_noise(importance: pd.DataFrame) -> list[int]:
    """The layers with at least one sub-layer whose ablation raises the loss by more than its noise floor:
    ``importance > noise`` on an ``ablation`` row (``ablation_importance``), in layer order."""
    rows = importance[(importance["method"] == "ablation") & (importance["importance"] > importance["noise"])]
    return sorted({int(layer) for layer in rows["layer"]})


def gradient_x_activation_importance(model: nn.Module, input_ids: torch.Tensor) -> pd.DataFrame:
    """Captum LayerGradientXActivation on every sub-layer output against the summed LM loss.

    gxa = mean over batch and tokens of sum over hidden of (dS/da) * a, S = sum of next-token NLL per
    sequence (the forward function returns S per sequence, shape [batch]: Captum takes one gradient
    per output element, so a 0-d scalar loss is reshaped rather than passed as is).
    Columns: layer, sublayer, method ("gxa"), importance (= gxa), gxa_abs, taylor_ablation (= -gxa).
    """
    from captum.attr import LayerGradientXActivation

    _check_ids(input_ids)
    subs = sublayer_modules(model)

    def summed_nll(ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids).logits[:, :-1].float()
        nll = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        return nll.view(ids.shape[0], -1).sum(-1)  # [batch]

    with _eval_mode(model):
        lgxa = LayerGradientXActivation(summed_nll, [m for _, _, m in subs])
        attributions = lgxa.attribute(input_ids)
    rows = []
    for (i, name, _), attr in zip(subs, attributions):
        attr = attr.detach().float()
        rows.append(
            dict(
                layer=i,
                sublayer=name,
                method="gxa",
                importance=float(attr.sum(-1).mean()),
                gxa_abs=float(attr.abs().sum(-1).mean()),
                taylor_ablation=-float(attr.sum(-1).mean()),
            )
        )
    return pd.DataFrame(rows)


def sublayer_importance(model: nn.Module, input_ids: torch.Tensor, progress: Progress | None = None) -> pd.DataFrame:
    """Both estimates stacked (tidy): layer, sublayer, method in {"ablation", "gxa"}, importance, ...

    For the gxa rows ``importance`` is the first-order ablation estimate -gxa, so both methods share
    a scale (nats of mean loss) and a sign (positive: the sub-layer helps).
    """
    abl = ablation_importance(model, input_ids, progress)
    if progress:
        progress(1, 1, "gradient x activation (one forward and backward)")
    gxa = gradient_x_activation_importance(model, input_ids)
    gxa = gxa.assign(gxa=gxa["importance"], importance=gxa["taylor_ablation"])
    return pd.concat([abl, gxa], ignore_index=True)
