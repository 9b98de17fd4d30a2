"""The inputs attribution accepts: ``AttributionError`` and the checks of token ids (``check_ids``), shared by token
attribution (``analysis.experiments.attribution``), the frozen-routing integral
(``analysis.experiments.integrated_gradients``) and layer attribution (``analysis.experiments.layer_attribution``)."""

from __future__ import annotations

import torch


class AttributionError(ValueError):
    """Inputs or options attribution cannot use."""


def check_ids(input_ids: torch.Tensor, target_ids: torch.Tensor, vocab: int, baseline_token: int) -> None:
    """Refuse input or target ids that are not a non-empty 1-d tensor of token ids of the vocabulary, or a baseline
    token outside it (AttributionError)."""
    for name, ids in (("input", input_ids), ("target", target_ids)):
        if ids.dim() != 1 or ids.numel() == 0:
            raise AttributionError(f"{name} ids must be a non-empty 1-d tensor, got shape {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise AttributionError(f"{name} ids must lie in 0..{vocab - 1}")
    if not 0 <= baseline_token < vocab:
        raise AttributionError(f"baseline token must lie in 0..{vocab - 1}, got {baseline_token}")
