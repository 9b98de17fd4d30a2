"""Validation numbers a run records and anyone can reproduce from its checkpoint and metrics.json:
bits per byte on fixed windows of the validation split, and MQAR accuracy on a fixed-seed set."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ..data import IGNORE_INDEX, make_mqar, mqar_accuracy, windows
from .config import TrainError

MQAR_EVAL_SEED = 1234
LN2 = math.log(2.0)


@torch.no_grad()
def evaluate_bits_per_byte(
    model: nn.Module,
    data: np.ndarray,
    starts: Sequence[int],
    seq_len: int,
    batch_size: int = 16,
) -> tuple[float, float]:
    """Mean next-byte loss over the windows ``data[s : s + seq_len + 1]``: (nats/byte, bits/byte).

    ``loss = sum of token NLLs / number of tokens`` over all windows; ``bits = loss / ln 2``.
    """
    if len(starts) == 0:
        raise TrainError("no validation windows")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for b in range(0, len(starts), batch_size):
            x, y = windows(data, starts[b : b + batch_size], seq_len)
            x, y = x.to(device), y.to(device)
            out = model(x, targets=y)
            total += float(out.loss) * y.numel()
            count += y.numel()
    finally:
        model.train(was_training)
    loss = total / count
    return loss, loss / LN2


@torch.no_grad()
def evaluate_mqar(
    model: nn.Module,
    examples: int,
    seq_len: int,
    num_kv_pairs: int,
    batch_size: int = 16,
    seed: int = MQAR_EVAL_SEED,
) -> float:
    """MQAR accuracy (argmax at answer positions) on ``examples`` sequences from a fixed seed."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    batch = make_mqar(examples, seq_len, num_kv_pairs, vocab_size=model.config.vocab_size, generator=gen)
    correct, total = 0.0, 0
    try:
        for b in range(0, examples, batch_size):
            x = batch.inputs[b : b + batch_size].to(device)
            t = batch.targets[b : b + batch_size]
            logits = model(x).logits.cpu()
            n = int((t != IGNORE_INDEX).sum())
            correct += mqar_accuracy(logits, t) * n
            total += n
    finally:
        model.train(was_training)
    return correct / max(total, 1)
