"""Trace overhead: a forward inside ``record(model)`` (default items) vs a plain forward, k3-mini."""

from __future__ import annotations

import torch

from k3core.interp.recorder import record
from k3core.modeling.model import K3ForCausalLM

from .common import Row, side_by_side


def time_trace(preset: str = "k3-mini", T: int = 512, batch: int = 1, repeat: int = 7, seed: int = 0) -> dict:
    """Best seconds of a plain forward and of a recorded one (record(model), default ``what``)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM.from_config(preset).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, T), generator=torch.Generator().manual_seed(seed))

    def plain():
        with torch.inference_mode():
            model(ids)

    def recorded():
        with torch.inference_mode(), record(model):
            model(ids)

    return side_by_side({"plain": plain, "recorded": recorded}, repeat=repeat)


def run(quick: bool = False) -> list[Row]:
    T, repeat = 512, (5 if quick else 9)
    t = time_trace(T=T, repeat=repeat)
    ratio = t["recorded"] / t["plain"]
    return [
        Row(
            "trace overhead",
            f"k3-mini T={T} B=1",
            t["recorded"],
            "record(model)",
            t["plain"],
            "plain forward",
            "s",
            ratio,
            target="<= 1.5",
            ok=ratio <= 1.5,
            note=f"best of {repeat}; default trace items",
        )
    ]
