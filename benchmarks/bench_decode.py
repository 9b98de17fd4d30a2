"""Generation: cached decoding (k3core.generation.decode, K3Cache) vs recomputing the whole forward per new token."""

from __future__ import annotations

import torch

from k3core.generation.decode import generate, next_token
from k3core.modeling.model import K3ForCausalLM

from .common import Row, side_by_side


def generate_uncached(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding without a cache: a full forward over the whole sequence for every new token."""
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.cat([ids, next_token(model(ids).logits[:, -1]).unsqueeze(1)], dim=1)
    return ids


def run(quick: bool = False) -> list[Row]:
    prompt_len, n, repeat = (128, 16, 2) if quick else (512, 32, 3)
    torch.manual_seed(0)
    model = K3ForCausalLM.from_config("k3-mini").eval()
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        same = torch.equal(generate(model, ids, n), generate_uncached(model, ids, n))
    t = side_by_side(
        {"cached": lambda: generate(model, ids, n), "uncached": lambda: generate_uncached(model, ids, n)}, repeat=repeat
    )
    return [
        Row(
            "greedy decode tokens/s",
            f"k3-mini prompt={prompt_len} new={n}",
            n / t["cached"],
            "K3Cache",
            n / t["uncached"],
            "full re-forward",
            "tok/s",
            t["uncached"] / t["cached"],
            note=f"same tokens: {same}; includes the prefill",
        )
    ]
