"""Training and validation batches of byte windows: the single implementation training uses.

A window starting at ``s`` is ``x = data[s : s + T]`` with next-byte targets ``y = data[s + 1 : s + T + 1]``.
Targets use ``IGNORE_INDEX = -100`` (PyTorch's ``cross_entropy`` default) for positions with no loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

IGNORE_INDEX = -100


def _as_byte_array(data: np.ndarray | bytes) -> np.ndarray:
    if isinstance(data, (bytes, bytearray)):
        return np.frombuffer(data, dtype=np.uint8)
    arr = np.asarray(data)
    if arr.ndim != 1:
        raise ValueError(f"data must be 1-D, got shape {arr.shape}")
    return arr


def windows(
    data: np.ndarray | bytes, starts: Sequence[int] | np.ndarray, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows starting at ``starts``: ``x[j] = data[s_j : s_j + T]``, ``y[j] = data[s_j + 1 : s_j + T + 1]``.

    Both are ``int64`` of shape ``[len(starts), seq_len]``; every window must lie inside ``data``.
    """
    arr = _as_byte_array(data)
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    if starts.size and (starts.min() < 0 or starts.max() + seq_len + 1 > len(arr)):
        raise ValueError(f"a window of {seq_len + 1} bytes starting at {starts.max()} does not fit {len(arr)} bytes")
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(arr[idx].astype(np.int64))
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def random_batches(
    data: np.ndarray | bytes,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One random training batch: :func:`windows` at ``batch_size`` random starts.

    Start offsets are uniform over ``[0, len(data) - seq_len - 1]`` (drawn with ``generator``, so
    the batch is reproducible). Needs ``len(data) >= seq_len + 1``.
    """
    arr = _as_byte_array(data)
    if batch_size < 1 or seq_len < 1:
        raise ValueError("batch_size and seq_len must be >= 1")
    if len(arr) < seq_len + 1:
        raise ValueError(f"data has {len(arr)} tokens, need at least seq_len + 1 = {seq_len + 1}")
    high = len(arr) - seq_len  # exclusive upper bound for the start offset
    starts = torch.randint(0, high, (batch_size,), generator=generator).numpy()
    return windows(arr, starts, seq_len)


def eval_window_starts(n_bytes: int, seq_len: int, n_windows: int) -> list[int]:
    """Start offsets of ``n_windows`` non-overlapping validation windows spread evenly over ``n_bytes``.

    With ``W = (n_bytes - 1) // seq_len`` full windows and ``n = min(n_windows, W)``, window ``j``
    starts at ``(j * W // n) * seq_len``. E.g. 1001 bytes, seq_len 100, 4 windows: W = 10, starts
    0, 200, 500, 700. Raises ``ValueError`` when not even one window fits.
    """
    total = (n_bytes - 1) // seq_len
    if total < 1:
        raise ValueError(f"validation split ({n_bytes} bytes) is shorter than one window of {seq_len + 1}")
    n = min(n_windows, total)
    return [int(j * total // n) * seq_len for j in range(n)]
