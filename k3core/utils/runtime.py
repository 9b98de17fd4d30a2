"""Process-level runtime settings shared by the CLI, the report and the app."""

from __future__ import annotations

import os

import torch

SMALL_MODEL_PARAMETERS = 20_000_000


def configure_threads(model: torch.nn.Module | None = None, env: str = "K3LAB_THREADS") -> int:
    """Pick torch's intra-op thread count for this process and return it.

    ``$K3LAB_THREADS`` wins when set. Otherwise a small model (< 20M parameters) on the CPU runs on
    one thread: its ops are too small to gain from more, and when other processes hold the cores,
    OpenMP's spin-waiting made a 1.5M-parameter forward 90x slower with two threads than with one
    (9.3 s vs 0.1 s, measured on a busy 2-core machine). Larger models keep torch's default.
    """
    requested = os.environ.get(env)
    if requested:
        torch.set_num_threads(max(1, int(requested)))
    elif model is not None:
        params = sum(p.numel() for p in model.parameters())
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        if on_cpu and params < SMALL_MODEL_PARAMETERS:
            torch.set_num_threads(1)
    return torch.get_num_threads()
