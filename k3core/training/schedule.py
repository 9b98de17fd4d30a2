"""The learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

from .config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for the step after ``step`` completed steps (``s``), with ``W = warmup_steps``,
    ``N = steps`` and ``lr_min = lr * min_lr_ratio``::

        lr(s) = lr * (s + 1) / W                                             s < W
        lr(s) = lr_min + (lr - lr_min) * (1 + cos(pi * p)) / 2,  p = clamp((s - W) / max(1, N - W), 0, 1)
    """
    warm = cfg.warmup_steps
    if step < warm:
        return cfg.lr * (step + 1) / warm
    lr_min = cfg.lr * cfg.min_lr_ratio
    progress = min(1.0, max(0.0, (step - warm) / max(1, cfg.steps - warm)))
    return lr_min + (cfg.lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))
